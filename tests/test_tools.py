"""tools/: the scripts that belong to no command (GPU lease steps, one-off measurements whose
results live in benchmarks/). Each still imports against today's package and answers --help."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import posbias_export as pbe

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "tools").glob("*.py"))


def test_benchmarks_holds_results_only():
    scripts = [p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh", ".js", ".mjs")]
    assert not scripts, f"scripts in benchmarks/: {scripts} (commands' scripts go to posbias_export/bench/, others to tools/)"


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_tool_imports(path):
    spec = importlib.util.spec_from_file_location(f"tools_{path.stem}", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # its imports of the package resolve


@pytest.mark.parametrize("path", [p for p in SCRIPTS if "argparse" in p.read_text()], ids=lambda p: p.name)
def test_tool_help(path):
    proc = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-1000:]


def test_gpu_lease_script_parses_and_reads_families_from_the_registry():
    text = (ROOT / "tools" / "gpu_lease.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_lease.sh")]).returncode == 0
    assert "p.BIASES" in text and " ".join(pbe.BIASES) not in text
