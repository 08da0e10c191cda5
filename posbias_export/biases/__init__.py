"""Bias families: one module per family, and a factory keyed by name."""
from __future__ import annotations

from .alibi import AlibiBias, alibi_slopes
from .base import AttentionBias, mask_value, query_key_positions, relative_distance
from .kerple import KerpleLogBias, KerplePowerBias
from .none import NoPositionalBias
from .sandwich import SandwichBias
from .t5 import T5Bias, t5_relative_bucket
from .window import WindowBias

_FAMILIES = {
    cls.name: cls
    for cls in (AlibiBias, KerplePowerBias, KerpleLogBias, SandwichBias, T5Bias, WindowBias, NoPositionalBias)
}
BIASES: tuple[str, ...] = tuple(_FAMILIES)


def bias_class(name: str) -> type[AttentionBias]:
    if name not in _FAMILIES:
        raise ValueError(f"unknown bias {name!r}; choose one of: {', '.join(BIASES)}")
    return _FAMILIES[name]


def create_bias(name: str, num_heads: int, causal: bool = True, **params) -> AttentionBias:
    """Build a bias module by name. Extra keyword arguments are the family's hyper-parameters
    (sandwich: sin_dim; t5: num_buckets, max_distance; window: window; kerple/t5: seed)."""
    cls = bias_class(name)
    try:
        return cls(num_heads, causal=causal, **params)
    except TypeError as err:  # an option this family does not take
        raise ValueError(f"bias {name!r}: {err}") from None


__all__ = [
    "BIASES",
    "AttentionBias",
    "bias_class",
    "create_bias",
    "alibi_slopes",
    "t5_relative_bucket",
    "mask_value",
    "query_key_positions",
    "relative_distance",
]
