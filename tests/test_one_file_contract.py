"""The extension contract: a bias family is one file.

Copies the project, adds `biases/alibi_copy.py` (biases/alibi.py with the class and the name
renamed, nothing else touched), and checks in subprocesses that the new family exports (plain
and blocked, functions kept and inlined), validates, is offered by `--help`, and that the test
suite collects and passes its cases.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

ROOT = Path(__file__).resolve().parents[1]
NEW = "alibi_copy"
FAST_CASES = "test_biases.py or test_functions.py"  # the registry-driven unit tests: seconds, not minutes


def _copy_project(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "node_modules", "*.onnx", "*.data")
    for name in ("posbias_export", "runtimes", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    node_modules = ROOT / "runtimes" / "node" / "node_modules"
    if node_modules.exists():  # the node runner needs its installed package, not a copy
        (dest / "runtimes" / "node" / "node_modules").symlink_to(node_modules)
    source = (ROOT / "posbias_export" / "biases" / "alibi.py").read_text()
    renamed = source.replace('name = "alibi"', f'name = "{NEW}"')
    renamed = re.sub(r"\bclass AlibiBias\b", "class AlibiCopyBias", renamed)
    assert renamed.count(NEW) == 1 and "AlibiCopyBias" in renamed, "alibi.py no longer has the expected shape"
    (dest / "posbias_export" / "biases" / f"{NEW}.py").write_text(renamed)


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("contract")
    _copy_project(dest)
    return dest


def test_new_family_is_registered_from_the_copy(project):
    out = _run(["-c", "import posbias_export as p, posbias_export.biases as b; print(p.__file__); print(*p.BIASES)"], project)
    assert out.returncode == 0, out.stderr
    package_file, names = out.stdout.splitlines()
    assert Path(package_file).is_relative_to(project), "the copy was not the package imported"
    assert NEW in names.split() and "alibi" in names.split()


def test_help_offers_the_new_family(project):
    out = _run(["-m", "posbias_export", "--help"], project)
    assert out.returncode == 0, out.stderr
    assert NEW in out.stdout


FORMS = [("plain", False), ("plain", True), ("blocked", False), ("blocked", True)]


@pytest.fixture(scope="module")
def exported(project) -> dict:
    """Export every form through the CLI, then validate each, in ONE process (torch imports once)."""
    paths = {case: project / f"{NEW}_{case[0]}_{'inline' if case[1] else 'functions'}.onnx" for case in FORMS}
    commands = []
    for (form, inline), path in paths.items():
        commands.append(["--bias", NEW, "--attention", form, "--out", str(path), "--heads", "4", "--dim", "64",
                         "--layers", "1"] + (["--inline-functions"] if inline else []))
        commands.append(["validate", str(path), "--runtimes", "ort-cpu,reference", "--lengths", "1,40"])
    driver = ("import sys; from posbias_export.cli import main\n"
              f"for argv in {commands!r}:\n"
              "    code = main(argv)\n"
              "    print('EXIT', code, *argv, flush=True)\n"
              "    if code: sys.exit(code)\n")
    out = _run(["-c", driver], project)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return {"paths": paths, "stdout": out.stdout}


@pytest.mark.parametrize("form,inline", FORMS)
def test_new_family_exports_and_validates(exported, form, inline):
    model = onnx.load(exported["paths"][form, inline])
    local = {f.name for f in model.functions}
    if inline:
        assert not local and all(n.domain != "posbias" for n in model.graph.node)
    else:
        # the copy's own function names (causal blocked takes the key-row shortcut), none of alibi's
        assert ("AlibiCopyKeyRow" if form == "blocked" else "AlibiCopy") in local, local
        assert not {"Alibi", "AlibiKeyRow"} & local
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["posbias.bias"] == NEW and meta["posbias.attention"] == form
    assert exported["stdout"].count("EXIT 0 validate") == len(FORMS) and "FAIL" not in exported["stdout"]


@pytest.mark.slow  # collects the whole suite in a subprocess: ~40 s
def test_suite_collects_and_passes_the_new_family(project):
    collect = _run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-k", NEW, "tests"], project)
    assert collect.returncode == 0, collect.stdout[-2000:] + collect.stderr[-2000:]
    collected = [line for line in collect.stdout.splitlines() if "::" in line]
    files = {line.split("::")[0] for line in collected}
    # every registry-driven test module picks the family up
    for module in ("test_biases.py", "test_functions.py", "test_export.py", "test_blocked.py", "test_runtimes.py",
                   "test_parity_ort.py", "test_model.py"):
        assert f"tests/{module}" in files, f"{module} collected no {NEW} case"
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", NEW, "tests/test_biases.py",
                "tests/test_functions.py"], project, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    assert re.search(r"\d+ passed", run.stdout) and "failed" not in run.stdout
