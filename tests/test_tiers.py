"""The test tiers are data (tests/tiers.py) and `pytest --family NAME` selects a family's cells."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import posbias_export as pbe
import tiers

ROOT = Path(__file__).resolve().parents[1]


def test_a_tier_naming_a_case_that_does_not_exist_fails():
    """A renamed case cannot silently move between the default and the slow run."""
    assert [p.id for p in tiers.cases(["a", "b"], ["a", "b"], slow={"b"})] == ["a", "b"]
    with pytest.raises(tiers.TierError, match="no case has"):
        tiers.cases(["a", "b"], ["a", "b"], slow={"c"})


def test_extended_families_are_slow_in_the_grid():
    marked = {p.id: bool(p.marks) for p in tiers.families()}
    assert set(marked) == set(pbe.BIASES)
    assert {n for n, slow in marked.items() if slow} == {n for n in pbe.BIASES if tiers.extended(n)}
    assert not tiers.extended("alibi")  # the default family always runs by default


def _collect(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n0", "-p", "no:cacheprovider",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 5), proc.stdout[-2000:] + proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_family_option_selects_every_cell_of_one_family():
    """--family sandwich (an extended family): its cells of the default and the slow tier, nothing else."""
    got = _collect("--family", "sandwich", "tests/test_biases.py", "tests/test_parity_ort.py")
    assert got and all("sandwich" in line for line in got)
    assert "tests/test_biases.py::test_family_declarations[sandwich]" in got
    assert any(line.startswith("tests/test_parity_ort.py::test_ort_cpu_lm_causal[") for line in got)  # slow tier
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n0", "--family", "sandwhich"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "choose from" in proc.stderr


class _Item:
    def __init__(self, nodeid):
        self.nodeid, self.marks = nodeid, []

    def add_marker(self, mark):
        self.marks.append(mark)


def test_measured_slow_tests_are_marked_and_a_renamed_one_fails(tmp_path):
    """slow_by_time.txt: a named test is marked slow, the others are not; a name no test of a file
    collected whole has is an error, and a file of which one test was asked for is not judged."""
    listed = tmp_path / "slow.txt"
    listed.write_text("# measured\n  12.5 tests/test_a.py::test_long[x y]\n")
    assert tiers.measured_slow(listed) == {"tests/test_a.py::test_long[x y]": 12.5}
    items = [_Item("tests/test_a.py::test_long[x y]"), _Item("tests/test_a.py::test_short")]
    tiers.mark_measured(items, tiers.measured_slow(listed))
    assert [m.name for m in items[0].marks] == ["slow"] and items[1].marks == []
    renamed = [_Item("tests/test_a.py::test_longer[x y]")]
    with pytest.raises(tiers.TierError, match="test_long"):
        tiers.mark_measured(renamed, tiers.measured_slow(listed))
    tiers.mark_measured(renamed, tiers.measured_slow(listed), args=["tests/test_a.py::test_longer"])
    assert renamed[0].marks == []
    # the project's own file names only tests that exist (collection of the whole suite checks it too)
    assert all("::" in node and node.startswith("tests/test_") for node in tiers.measured_slow())
