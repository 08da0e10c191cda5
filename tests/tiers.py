"""Test tiers as data at the parametrize site: which cells the default run keeps (CI, about 13
minutes on 2 cores) and which run under `-m slow` only.

- A family whose class says `test_tier = "extended"` (kerple_power, sandwich, none: their paths
  through the exporters are another family's, and their formulas are checked against the papers
  in test_biases.py) has its cells in the grid tests (those parametrized with `families()`) marked
  slow.
- Other cells are named slow by id where they are parametrized (`cases(..., slow={ids})`); an id
  that no case has any more is an error at collection, so a rename cannot silently move a cell
  between the tiers.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

import posbias_export as pbe
from posbias_export.biases import bias_class

SLOW = pytest.mark.slow


class TierError(ValueError):
    """A tier names a case that does not exist."""


def extended(value) -> bool:
    """A registered family whose cells run under -m slow in the grid tests."""
    return isinstance(value, str) and value in pbe.BIASES and bias_class(value).test_tier == "extended"


def families(names: Iterable[str] | None = None) -> list:
    """The families (every registered one by default) as parameters, the extended tier marked slow."""
    return [pytest.param(n, id=n, marks=SLOW) if extended(n) else pytest.param(n, id=n)
            for n in (pbe.BIASES if names is None else names)]


def cases(values: Sequence, ids: Sequence[str], slow: Iterable[str] = (), grid: bool = True) -> list:
    """pytest.param per value with its id, marked slow when its id is in `slow` or (grid) a value
    names an extended family. Raises TierError for an id in `slow` that no case has."""
    slow = set(slow)
    if len(ids) != len(values) or len(set(ids)) != len(ids):
        raise TierError("cases need one distinct id per value")
    missing = sorted(slow - set(ids))
    if missing:
        raise TierError(f"the slow tier names {missing}, which no case has (ids: {', '.join(ids)})")
    out = []
    for value, case_id in zip(values, ids):
        parts = value if isinstance(value, tuple) else (value,)
        is_slow = case_id in slow or (grid and any(extended(v) for v in parts))
        out.append(pytest.param(*parts, id=case_id, marks=SLOW if is_slow else ()))
    return out
