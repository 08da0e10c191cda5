"""Test tiers as data at the parametrize site: which cells the default run keeps (CI, about 22
minutes of pytest on 2 cores) and which run under `-m slow` only.

- A family whose class says `test_tier = "extended"` (kerple_power, sandwich, none: their paths
  through the exporters are another family's, and their formulas are checked against the papers
  in test_biases.py) has its cells in the grid tests (those parametrized with `families()`) marked
  slow.
- Other cells are named slow by id where they are parametrized (`cases(..., slow={ids})`); an id
  that no case has any more is an error at collection, so a rename cannot silently move a cell
  between the tiers.
- The architecture tests take their tier from the variant's role (tests/role_matrix.py).
- Tests measured long are named with their seconds in slow_by_time.txt (`mark_measured`, below).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

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


# Tests measured long in the default run (`pytest --durations=0`, two workers on a 2-core machine),
# named in slow_by_time.txt as "seconds node-id": marked slow at collection so the default run
# stays near 15 minutes. Each behaviour they cover keeps a faster case in the default run (a
# smaller parameter, a sibling test) or is named in the file's comment as covered by -m slow only.
MEASURED = Path(__file__).with_name("slow_by_time.txt")


def measured_slow(path: Path = MEASURED) -> dict[str, float]:
    """node id -> the seconds it took, from the file (comments and blank lines skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            seconds, node = line.split(maxsplit=1)
            out[node] = float(seconds)
    return out


def mark_measured(items, listed: dict[str, float], args=()) -> None:
    """Mark slow each item the file names. Raises TierError for a named id whose file was collected
    whole (no `args` names a test in it) but which no item has: a renamed test would otherwise move
    silently into the default run."""
    collected = {item.nodeid for item in items}
    picked = {Path(arg.split("::")[0]).name for arg in args if "::" in arg}  # files of which some tests were asked for
    files = {f for f in (node.split("::")[0] for node in collected) if Path(f).name not in picked}
    missing = sorted(node for node in listed if node.split("::")[0] in files and node not in collected)
    if missing:
        raise TierError(f"{MEASURED.name} names tests that do not exist: {', '.join(missing[:5])}")
    for item in items:
        if item.nodeid in listed:
            item.add_marker(SLOW)
