"""Check inputs against what the model declares, BEFORE the runtime sees them: runtimes'
own messages for a wrong name, rank or dtype are often cryptic or, worse, a silent cast."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tensor_io import RunnerError


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype
    dims: tuple  # int for a fixed axis, str (symbol) or None for a dynamic one


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
        if array.size == 0:
            raise RunnerError(f"input {spec.name!r} is empty (shape {list(array.shape)})")


ONNX_TYPE_TO_NUMPY = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
}
