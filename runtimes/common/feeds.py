"""Check inputs against what the model declares, BEFORE the runtime sees them: runtimes'
own messages for a wrong name, rank or dtype are often cryptic or, worse, a silent cast."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .tensor_io import RunnerError


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype
    dims: tuple  # int for a fixed axis, str (symbol) or None for a dynamic one
    id_limit: int | None = None  # token ids: every value must lie in [0, id_limit)


TOKEN_INPUT = "input_ids"


def with_token_limit(specs: list[InputSpec], limit: int | None) -> list[InputSpec]:
    """The token input bounded by the rows of the model's table (graph_facts.token_limit: an
    Embedding lookup with an id outside it is an error in PyTorch, but runtimes silently wrap -1
    to the last row or return garbage)."""
    return [replace(s, id_limit=limit) if s.name == TOKEN_INPUT and limit else s for s in specs]


def check_feeds(feeds: dict[str, np.ndarray], specs: list[InputSpec]) -> None:
    expected = {s.name for s in specs}
    missing = [s.name for s in specs if s.name not in feeds]
    unexpected = sorted(set(feeds) - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        raise RunnerError(f"input names do not match the model ({'; '.join(parts)}); it expects {sorted(expected)}")
    symbols: dict[str, tuple[str, int]] = {}
    for spec in specs:
        array = feeds[spec.name]
        if array.dtype != spec.dtype:
            raise RunnerError(f"input {spec.name!r}: expected dtype {spec.dtype}, got {array.dtype}")
        if array.ndim != len(spec.dims):
            raise RunnerError(f"input {spec.name!r}: expected rank {len(spec.dims)} {list(spec.dims)}, got shape {list(array.shape)}")
        for axis, (want, got) in enumerate(zip(spec.dims, array.shape)):
            if isinstance(want, int) and want >= 0 and want != got:
                raise RunnerError(f"input {spec.name!r}: axis {axis} must be {want}, got {got} (shape {list(array.shape)})")
            if isinstance(want, str) and want:
                seen = symbols.setdefault(want, (spec.name, got))
                if seen[1] != got:
                    raise RunnerError(f"inputs {seen[0]!r} and {spec.name!r} disagree on axis {want!r}: {seen[1]} vs {got}")
        if array.size == 0 and not _empty_cache(spec, array):
            raise RunnerError(f"input {spec.name!r} is empty (shape {list(array.shape)})")
        if spec.id_limit is not None:
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= spec.id_limit:
                bad = low if low < 0 else high
                raise RunnerError(f"input {spec.name!r}: token id {bad} is outside the vocabulary [0, {spec.id_limit})")


def _empty_cache(spec: InputSpec, array: np.ndarray) -> bool:
    """A cache input of a cached decoder may hold no step yet (a prefill): its past axis (named
    past, past_sequence_length, ...; a merged seq2seq decoder's cross cache:
    encoder_sequence_length_out, Optimum's name) is the one of length 0."""
    from .cache import is_past_axis

    empty_axes = [axis for axis, size in enumerate(array.shape) if size == 0]
    return bool(empty_axes) and all(is_past_axis(spec.dims[a]) for a in empty_axes)


ONNX_TYPE_TO_NUMPY = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
    "tensor(int8)": np.int8,  # an int8 KV cache (--kv-dtype int8)
}
