"""The extension contract: a bias family is one file.

Copies the project and adds two families, each a shipped file with the class and the name
renamed: `alibi_copy` (biases/alibi.py: key-row shortcuts, the folded and two-sided bodies) and
`window_copy` (biases/window.py: a hyper-parameter, with its own flag and no legacy key, since
those are claims on shared names). In subprocesses: both register, show in `--help`, export
(plain and blocked, functions kept and inlined), validate, and (slow) the registry-driven tests
of the whole suite collect and pass their cases. A copy that keeps a shipped family's flag or
legacy key is refused at registration with one line naming both families.
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
BIASES = ROOT / "posbias_export" / "biases"
NEW, WITH_PARAMS = "alibi_copy", "window_copy"


def _renamed(source: str, cls: str, name: str, new_cls: str, new_name: str, keep_summary: bool = False) -> str:
    """The file with its class, family name and summary renamed (what docs/adding-a-family.md
    asks of a copy; keep_summary: the copy a newcomer forgot to describe)."""
    out = source.replace(f'name = "{name}"', f'name = "{new_name}"')
    out = re.sub(rf"\bclass {cls}\b", f"class {new_cls}", out)
    if not keep_summary:
        out = out.replace('    summary = "', f'    summary = "({new_name}, a copy of {name}) ', 1)
    assert out.count(f'"{new_name}"') == 1 and f"class {new_cls}" in out, f"{name}.py no longer has the expected shape"
    return out


def _window_copy(keep_flag: bool = False, keep_legacy: bool = False) -> str:
    copy = _renamed((BIASES / "window.py").read_text(), "WindowBias", "window", "WindowCopyBias", WITH_PARAMS)
    if not keep_flag:
        copy = copy.replace('alias="--window"', 'alias="--window-copy"')
    if not keep_legacy:
        copy = copy.replace(', legacy_key="window"', "")
    return copy


def _copy_project(dest: Path, families: dict[str, str]) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "node_modules", "*.onnx", "*.data")
    for name in ("posbias_export", "runtimes", "tests", "tools", "docs", "benchmarks"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "models", dest / "models")
    node_modules = ROOT / "runtimes" / "node" / "node_modules"
    if node_modules.exists():  # the node runner needs its installed package, not a copy
        (dest / "runtimes" / "node" / "node_modules").symlink_to(node_modules)
    for module, text in families.items():
        (dest / "posbias_export" / "biases" / f"{module}.py").write_text(text)
    return dest


def _regenerate_docs(project: Path) -> None:
    """The newcomer's one step besides the file: README's family table from the registry."""
    out = _run(["-m", "posbias_export.biases.readme_blocks"], project)
    check = _run(["-m", "posbias_export.biases.readme_blocks", "--check"], project)  # up to date now (a second run writes nothing)
    assert out.returncode == 0 and check.returncode == 0 and "up to date" in check.stdout, out.stdout + out.stderr


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    alibi = _renamed((BIASES / "alibi.py").read_text(), "AlibiBias", "alibi", "AlibiCopyBias", NEW)
    project = _copy_project(tmp_path_factory.mktemp("contract"), {NEW: alibi, WITH_PARAMS: _window_copy()})
    _regenerate_docs(project)
    return project


def test_new_families_are_registered_from_the_copy(project):
    out = _run(["-c", "import posbias_export as p; print(p.__file__); print(*p.BIASES)"], project)
    assert out.returncode == 0, out.stderr
    package_file, names = out.stdout.splitlines()
    assert Path(package_file).is_relative_to(project), "the copy was not the package imported"
    assert {NEW, WITH_PARAMS, "alibi", "window"} <= set(names.split())


def test_help_offers_the_new_families(project):
    out = _run(["-m", "posbias_export", "--help"], project)
    assert out.returncode == 0, out.stderr
    assert NEW in out.stdout and WITH_PARAMS in out.stdout and "--window-copy" in out.stdout


@pytest.mark.parametrize("kept, claim", [("flag", "flag '--window'"), ("legacy", "legacy config key 'window'")])
def test_a_copy_that_keeps_a_shared_claim_is_refused_with_one_line(tmp_path, kept, claim):
    """Renaming only the class and the name of window.py keeps --window (argparse would crash
    on the duplicate) and the legacy key (old window checkpoints would feed the copy)."""
    copy = _window_copy(keep_flag=kept == "flag", keep_legacy=True)
    project = _copy_project(tmp_path, {WITH_PARAMS: copy})
    for argv in (["-m", "posbias_export", "--help"], ["-m", "posbias_export", "--bias", "alibi", "--out", "m.onnx"]):
        out = _run(argv, project)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr
        assert "'window'" in lines[0] and f"'{WITH_PARAMS}'" in lines[0] and claim in lines[0], lines[0]
        assert not (project / "m.onnx").exists()


def test_a_copy_that_keeps_the_summary_is_refused_with_one_line(tmp_path):
    """A copy that ships the original's summary (README would describe two families alike) is
    refused at registration, naming both."""
    copy = _renamed((BIASES / "alibi.py").read_text(), "AlibiBias", "alibi", "AlibiCopyBias", NEW, keep_summary=True)
    project = _copy_project(tmp_path, {NEW: copy})
    out = _run(["-m", "posbias_export", "--help"], project)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "'alibi'" in lines[0] and f"'{NEW}'" in lines[0] and "summary" in lines[0], lines[0]


def test_the_regenerated_readme_documents_the_copies(project):
    """After python -m posbias_export.biases.readme_blocks the docs checks pass for the new families (the contract's slow
    run also runs them under --family)."""
    out = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "tests/test_docs.py"], project)
    assert out.returncode == 0, out.stdout[-3000:]


FORMS = [("plain", False), ("plain", True), ("blocked", False), ("blocked", True)]
CASES = [(NEW, form, inline, ()) for form, inline in FORMS] + [
    (WITH_PARAMS, "blocked", False, ("--window-copy", "8")), (WITH_PARAMS, "blocked", True, ("--bias-param", "window=8"))]


@pytest.fixture(scope="module")
def exported(project):
    """case -> (its file, the output of its export and validate through the CLI), made on first use,
    each case in one process (the default run exports only its own case, not all six)."""
    made = {}

    def get(case):
        if case not in made:
            name, form, inline, extra = case
            path = project / f"{name}_{form}_{'inline' if inline else 'functions'}.onnx"
            commands = [["--bias", name, "--attention", form, "--out", str(path), "--heads", "4", "--dim", "64",
                         "--layers", "1", *extra] + (["--inline-functions"] if inline else []),
                        ["validate", str(path), "--runtimes", "ort-cpu,reference", "--lengths", "1,40",
                         "--skip-order-check"]]
            driver = ("import sys; from posbias_export.cli import main\n"
                      f"for argv in {commands!r}:\n"
                      "    code = main(argv)\n"
                      "    print('EXIT', code, *argv, flush=True)\n"
                      "    if code: sys.exit(code)\n")
            out = _run(["-c", driver], project)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            made[case] = (path, out.stdout)
        return made[case]

    return get


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{'inline' if c[2] else 'functions'}" for c in CASES])
def test_new_family_exports_and_validates(exported, case):
    name, form, inline, _ = case
    path, stdout = exported(case)
    model = onnx.load(path)
    local = {f.name for f in model.functions}
    if inline:
        assert not local and all(n.domain != "posbias" for n in model.graph.node)
    elif name == NEW:
        # the copy's own function names (causal blocked folds its key row), none of alibi's
        assert ("AlibiCopyKeyRow" if form == "blocked" else "AlibiCopy") in local, local
        assert not {"Alibi", "AlibiKeyRow"} & local
    else:
        assert "WindowCopy" in local and "Window" not in local, local
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["posbias.bias"] == name and meta["posbias.attention"] == form
    if name == WITH_PARAMS:
        assert meta["posbias.bias_params"] == '{"window": 8}'
    assert stdout.count("EXIT 0 validate") == 1 and "FAIL" not in stdout


def registry_driven_modules(collected: list[str], shipped: set[str]) -> dict[str, set[str]]:
    """Test module -> the families its cells name, for every module with a cell for each shipped
    family (a module parametrized by the registry, whatever its author listed)."""
    seen: dict[str, set[str]] = {}
    for line in collected:
        if "[" in line:
            module, ids = line.split("::")[0], line[line.index("[") + 1:].rstrip("]")
            seen.setdefault(module, set()).update(ids.split("-"))
    return {module: names for module, names in seen.items() if shipped <= names}


@pytest.mark.slow  # the registry-driven cases of the whole suite for both copies: ~10 min
def test_suite_collects_and_passes_the_new_families(project):
    """The registry-driven modules are found by collecting the copy's whole suite (no list to
    keep); each collects cases of both new families, and `pytest --family` runs their default
    cells (the slow ones are the same code at longer lengths)."""
    import posbias_export as pbe

    collect = _run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "", "tests"], project)
    assert collect.returncode == 0, collect.stdout[-2000:] + collect.stderr[-2000:]
    modules = registry_driven_modules([line for line in collect.stdout.splitlines() if "::" in line],
                                      set(pbe.BIASES))
    assert len(modules) >= 10, sorted(modules)
    for module, names in modules.items():
        assert {NEW, WITH_PARAMS} <= names, f"{module} collected no case of {({NEW, WITH_PARAMS} - names)}"
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-m", "not slow", "--family", NEW, "--family",
                WITH_PARAMS, "tests"], project, timeout=3000)
    assert run.returncode == 0, run.stdout[-3000:]
    assert re.search(r"\d+ passed", run.stdout) and "failed" not in run.stdout
