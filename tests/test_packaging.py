"""A plain (not editable) install serves: the runners and `generate` ship inside the package."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def test_pyproject_lists_every_package_folder():
    """The package list is explicit (runtimes/ is mapped into the package): a new folder must join it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    ours = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "posbias_export").rglob("__init__.py")}
    runners = {"posbias_export.runtimes." + ".".join(p.relative_to(ROOT / "runtimes").parts)
               for p in (ROOT / "runtimes").iterdir() if p.is_dir() and p.name not in ("__pycache__",)}
    assert ours | runners | {"posbias_export.runtimes"} == listed
    assert config["package-dir"] == {"posbias_export.runtimes": "runtimes"}


@pytest.mark.slow
def test_wheel_installs_and_serves_from_another_folder(tmp_path):
    """Build the wheel, install it without the source tree on the path, then export, validate and
    generate from an unrelated folder (dependencies come from this environment)."""
    wheels, site, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "-w", str(wheels), str(ROOT)], check=True, timeout=600)
    wheel = next(wheels.glob("posbias_export-*.whl"))
    subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=600)
    clients = site / "posbias_export" / "clients"  # bench-clients runs installed: its side scripts are package data
    assert all((clients / f).is_file() for f in ("optimum_env.sh", "optimum_client.py", "js/generate.mjs",
                                                 "js/web.mjs", "js/package.json"))
    # the installed copy must win over the editable one this environment may have
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "posbias_export", *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)

    where = cli("--help")
    assert where.returncode == 0
    probe = subprocess.run([sys.executable, "-c", "import posbias_export.parity as p; print(p.RUNTIMES_DIR)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert Path(probe.stdout.strip()).is_relative_to(site), probe.stdout + probe.stderr
    assert cli("--bias", "alibi", "--kv-cache", "--out", "kv.onnx").returncode == 0
    assert cli("--bias", "alibi", "--out", "model.onnx").returncode == 0
    validated = cli("validate", "model.onnx", "--runtimes", "ort-cpu,reference", "--lengths", "1,40")
    assert validated.returncode == 0, validated.stdout + validated.stderr
    generated = cli("generate", "kv.onnx", "--prompt", "To be", "--max-new-tokens", "8")
    assert generated.returncode == 0 and generated.stdout.startswith("To be"), generated.stderr
