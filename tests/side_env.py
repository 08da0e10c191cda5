"""The side environment Optimum and sentence-transformers' ONNX backend run in (they pin an older
transformers than ours): posbias_export/clients/optimum_env.sh makes it once at $OPTIMUM_VENV
(default .optimum-venv in the repository, git-ignored). Tests make it when it is missing, so CI
runs these clients on every push; where it cannot be made (no registry) a run outside CI skips
with the installer's last line, and CI fails."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIDE_ENV = Path(os.environ.get("OPTIMUM_VENV", ROOT / ".optimum-venv"))
SCRIPT = ROOT / "posbias_export" / "clients" / "optimum_env.sh"
CHECK = "import sentence_transformers, optimum.onnxruntime"


def side_python() -> Path:
    """The side environment's python, made if missing."""
    python = SIDE_ENV / "bin" / "python"
    if python.is_file() and subprocess.run([str(python), "-c", CHECK], capture_output=True).returncode == 0:
        return python
    made = subprocess.run(["bash", str(SCRIPT), "make"], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "OPTIMUM_VENV": str(SIDE_ENV)})
    ok = made.returncode == 0 and subprocess.run([str(python), "-c", CHECK], capture_output=True).returncode == 0
    if not ok:
        why = (made.stderr.strip().splitlines() or [f"exit {made.returncode}"])[-1][:300]
        if os.environ.get("CI"):
            pytest.fail(f"the Optimum side environment could not be made: {why}")
        pytest.skip(f"the Optimum side environment could not be made here: {why}")
    return python
