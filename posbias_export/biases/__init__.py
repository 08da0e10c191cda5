"""Bias families: every module of this package that defines an AttentionBias subclass with a
`name` adds a family. The registry, the CLI's choices and flags, ModelConfig's validation,
the ONNX function list and the tests all read it from here; adding a family is adding a file.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from .base import (
    FAMILIES,
    FLOAT32_LOWEST,
    MASK_PENALTY,
    SCORE_FLOOR,
    AttentionBias,
    BiasParams,
    floor_scores,
    mask_value,
    query_key_positions,
    relative_distance,
)

_SHARED = {"base", "onnx_domain", "readme_blocks"}  # modules that hold no family (readme_blocks: run by hand)
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _SHARED and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

from .alibi import alibi_slopes  # noqa: E402  (public helpers of particular families)
from .t5 import t5_relative_bucket  # noqa: E402

BIASES: tuple[str, ...] = tuple(sorted(FAMILIES, key=lambda name: (FAMILIES[name].rank, name)))
DEFAULT_BIAS = BIASES[0]  # the first by rank: ALiBi
NO_BIAS = "none"  # the family that adds nothing: position schemes (RoPE, absolute tables) build on it


def bias_class(name: str) -> type[AttentionBias]:
    if name not in FAMILIES:
        raise ValueError(f"unknown bias {name!r}; choose one of: {', '.join(BIASES)}")
    return FAMILIES[name]


def make_params(name: str, values: dict | None = None) -> BiasParams:
    """The family's hyper-parameter dataclass from a dict (strings from the command line are
    converted); an unknown key or a bad value is a ValueError naming the family."""
    cls = bias_class(name).Params
    fields = {f.name: f for f in dataclasses.fields(cls)}
    converted = {}
    for key, value in (values or {}).items():
        if key not in fields:
            takes = ", ".join(fields) or "no hyper-parameters"
            raise ValueError(f"bias {name!r} has no hyper-parameter {key!r}; it takes: {takes}")
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise ValueError(f"bias {name!r}: {key} must be an integer, got {value!r}") from None
        converted[key] = value
    try:
        return cls(**converted)
    except ValueError as err:
        raise ValueError(f"bias {name!r}: {err}") from None


def hyper_parameter_fields() -> list[tuple[str, dataclasses.Field]]:
    """(family, field) for every hyper-parameter of every family, in registry order."""
    return [(name, f) for name in BIASES for f in dataclasses.fields(FAMILIES[name].Params)]


def create_bias(name: str, num_heads: int, causal: bool = True, seed: int = 0, **params) -> AttentionBias:
    """Build a bias module by name. Keyword arguments are the family's hyper-parameters
    (see `make_params`); `seed` initialises learned families."""
    return bias_class(name)(num_heads, causal=causal, params=make_params(name, params), seed=seed)


FAMILY_TABLE_HEADER = ("| `--bias` | adds to each score | learned | hyper-parameters (default) | paper |\n"
                       "|---|---|---|---|---|\n")


def family_row(name: str) -> str:
    """One family's row of README's table, from what its class declares."""
    cls = FAMILIES[name]
    params = ", ".join(f"`{f.name}` ({f.default})" for f in dataclasses.fields(cls.Params)) or "-"
    return f"| `{name}` | {cls.summary} | {'yes' if cls.learned else 'no'} | {params} | {cls.paper or '-'} |"


def family_table() -> str:
    """The registered families as a markdown table (README's: python -m posbias_export.biases.readme_blocks writes it,
    tests/test_docs.py checks it family by family)."""
    return FAMILY_TABLE_HEADER + "".join(family_row(name) + "\n" for name in BIASES)


__all__ = [
    "BIASES",
    "DEFAULT_BIAS",
    "NO_BIAS",
    "FLOAT32_LOWEST",
    "MASK_PENALTY",
    "SCORE_FLOOR",
    "AttentionBias",
    "BiasParams",
    "alibi_slopes",
    "bias_class",
    "family_row",
    "create_bias",
    "family_table",
    "floor_scores",
    "hyper_parameter_fields",
    "make_params",
    "mask_value",
    "query_key_positions",
    "relative_distance",
    "t5_relative_bucket",
]
