"""The folders are the layers (docs/layout.md): a module imports only from its own layer and
those below it, and the runners under runtimes/ import neither torch nor this package. Read
from the source with ast, so a lazy import inside a function counts too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "posbias_export"
# bottom up; a room may import its own layer and every layer before it
LAYERS = [{"errors", "environment", "lazy", "plots", "runners", "limits"}, {"biases"}, {"nn"}, {"export"}, {"parity"}, {"study", "hf"}, {"peers"},
          {"bench", "clients", "validation", "serve"},
          {"gpu", "evidence"}, {"commands"}, {"cli", "__main__", "__init__"}]
RANK = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}


def _room(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imported_rooms(path: Path) -> set[str]:
    """The rooms of posbias_export a module imports, absolute or relative."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = path.relative_to(PACKAGE).parent.parts
    rooms = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb from the module's package
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                parts = [*base, *(node.module.split(".") if node.module else [])]
                if parts:
                    rooms.add(parts[0])
                else:  # "from . import x" at the top: x are rooms
                    rooms |= {alias.name for alias in node.names}
            elif node.module and node.module.split(".")[0] == "posbias_export":
                parts = node.module.split(".")[1:]
                rooms |= {parts[0]} if parts else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            rooms |= {a.name.split(".")[1] for a in node.names if a.name.startswith("posbias_export.")}
    return rooms


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_no_upward_import(path):
    room = _room(path)
    assert room in RANK, f"{room} is in no layer: add it to docs/layout.md and LAYERS"
    upward = sorted(r for r in _imported_rooms(path) if r in RANK and RANK[r] > RANK[room])
    assert not upward, f"{path.relative_to(ROOT)} ({room}) imports from higher layers: {upward}"


def test_runners_import_neither_torch_nor_the_package():
    for path in (ROOT / "runtimes").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        assert not names & {"torch", "posbias_export"}, f"{path.relative_to(ROOT)} imports {names & {'torch', 'posbias_export'}}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules a module imports (lazily too): `from .x import y` names x, or x.y
    where y is a module itself."""
    me = _module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            subs = {f"{target}.{a.name}" for a in node.names} & modules
            found |= subs if len(subs) == len(node.names) else {target} | subs
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & modules
    return found & modules - {_module_name(path)}


def test_no_import_cycle():
    """No two modules of the package import each other, directly or around a circle (a lazy
    import inside a function counts: it only hides the circle)."""
    paths = {_module_name(p): p for p in MODULES}
    graph = {name: _imported_modules(path, set(paths)) for name, path in paths.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name, trail):
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
