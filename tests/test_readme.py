"""The README's commands and the docs' examples are the ones that are run."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci/run").read_text()
    test_cmd = next(line for line in ci.splitlines() if "pytest" in line and not line.startswith("#"))
    assert test_cmd in readme


def test_python_api_example_runs(tmp_path, monkeypatch):
    page = (ROOT / "docs" / "python-api.md").read_text()
    block = re.search(r"# Python API\n\n```python\n(.*?)```", page, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/python-api.md", "exec"), {})
    assert (tmp_path / "model.onnx").stat().st_size > 0
    assert (tmp_path / "model.safetensors").stat().st_size > 0


def test_onnxscript_function_example_runs(tmp_path):
    """Run as a file: onnxscript reads a @script function's source with inspect."""
    page = (ROOT / "docs" / "onnx-functions.md").read_text()
    block = re.search(r"## Calling a posbias function from your own ONNX Script model\n\n```python\n(.*?)```", page, re.S).group(1)
    (tmp_path / "example.py").write_text(block)
    proc = subprocess.run([sys.executable, str(tmp_path / "example.py")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "(1, 8, 5, 5)" in proc.stdout
