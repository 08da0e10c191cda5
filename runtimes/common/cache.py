"""Where a cached decoder keeps its KV cache, read from its input and output names: ours
(past_key.N / past_value.N in, present_key.N / present_value.N out) or Hugging Face's
(past_key_values.N.key in, present.N.key out; a seq2seq decoder's past_key_values.N.decoder.key).
Every runner that feeds a cache asks here, so a file in either naming runs everywhere."""
from __future__ import annotations

import re
from dataclasses import dataclass

_PAST = re.compile(r"^(?:past_(?P<k1>key|value)\.(?P<l1>\d+)|past_key_values\.(?P<l2>\d+)(?:\.decoder)?\.(?P<k2>key|value))$")
_PRESENT = re.compile(r"^(?:present_(?P<k1>key|value)\.(?P<l1>\d+)|present\.(?P<l2>\d+)(?:\.decoder)?\.(?P<k2>key|value))$")


def _by_layer(names, pattern) -> dict[tuple[int, str], str]:
    found = {}
    for name in names:
        match = pattern.match(name)
        if match:
            layer = int(match["l1"] if match["l1"] is not None else match["l2"])
            found[layer, match["k1"] or match["k2"]] = name
    return found


@dataclass(frozen=True)
class CacheLayout:
    past: tuple[str, ...]  # input names: key 0, value 0, key 1, value 1, ...
    present: tuple[str, ...]  # output names in the same order

    @property
    def layers(self) -> int:
        return len(self.past) // 2

    def present_to_past(self) -> dict[str, str]:
        return dict(zip(self.present, self.past))


_CROSS_PAST = re.compile(r"^(?:past_cross_(?P<k1>key|value)\.(?P<l1>\d+)|past_key_values\.(?P<l2>\d+)\.encoder\.(?P<k2>key|value))$")
_CROSS_PRESENT = re.compile(
    r"^(?:present_cross_(?P<k1>key|value)\.(?P<l1>\d+)|present\.(?P<l2>\d+)\.encoder\.(?P<k2>key|value))$")


def is_cache_input(name: str) -> bool:
    """A past key or value input (self or cross attention), in either naming."""
    return bool(_PAST.match(name) or _CROSS_PAST.match(name))


def is_cache_output(name: str) -> bool:
    """A present key or value output (self or cross attention), in either naming."""
    return bool(_PRESENT.match(name) or _CROSS_PRESENT.match(name))


def is_cross_cache(name: str) -> bool:
    """A seq2seq decoder's cross-attention cache (it grows per encoder token, not per step)."""
    return bool(_CROSS_PAST.match(name) or _CROSS_PRESENT.match(name))


def past_entry(name: str) -> tuple[int, str] | None:
    """(layer, "key" | "value") of a self-attention past input, else None."""
    match = _PAST.match(name)
    if not match:
        return None
    return int(match["l1"] if match["l1"] is not None else match["l2"]), match["k1"] or match["k2"]


def is_past_axis(dim_name) -> bool:
    """The axis a cache input grows along, as files name it (past, past_sequence_length, ...; a
    merged seq2seq decoder's cross cache: Optimum's encoder_sequence_length_out): empty at a prefill."""
    return isinstance(dim_name, str) and ("past" in dim_name or dim_name == "encoder_sequence_length_out")


def cross_cache_layout(input_names, output_names) -> CacheLayout | None:
    """A seq2seq decoder's cross-attention cache (Optimum's merged layout: past_key_values.N.
    encoder.key in, present.N.encoder.key out, chosen by use_cache_branch), or None."""
    return _layout(input_names, output_names, _CROSS_PAST, _CROSS_PRESENT)


def cache_layout(input_names, output_names) -> CacheLayout | None:
    """The cache's names layer by layer, or None when the model has no cache inputs. A cache
    with a missing layer or half, or inputs without their outputs, is a ValueError."""
    return _layout(input_names, output_names, _PAST, _PRESENT)


def _layout(input_names, output_names, past_pattern, present_pattern) -> CacheLayout | None:
    past, present = _by_layer(input_names, past_pattern), _by_layer(output_names, present_pattern)
    if not past:
        return None
    layers = 1 + max(layer for layer, _ in past)
    order = [(layer, kind) for layer in range(layers) for kind in ("key", "value")]
    missing = [f"{kind} {layer}" for layer, kind in order if (layer, kind) not in past]
    if missing:
        raise ValueError(f"the model's cache inputs lack the past {missing[0]}")
    absent = [f"{kind} {layer}" for layer, kind in order if (layer, kind) not in present]
    if absent:
        raise ValueError(f"the model's cache outputs lack the present {absent[0]}")
    return CacheLayout(tuple(past[key] for key in order), tuple(present[key] for key in order))
