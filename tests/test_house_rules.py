"""House rules that hold after the issue that set them closes (docs/layout.md): no function
longer than 60 lines in the package or the runners, and no decision on a model-type string
outside hf/architectures/ (an architecture's role and registry decide; a new architecture then
needs no edit elsewhere). Read from the source with ast: a nested class counts in its function."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60
SOURCES = sorted(p for folder in ("posbias_export", "runtimes") for p in (ROOT / folder).rglob("*.py")
                 if "node_modules" not in p.parts)


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_no_function_longer_than_sixty_lines(path):
    long = [f"{f.name} ({f.end_lineno - f.lineno + 1} lines, line {f.lineno})"
            for f in _functions(ast.parse(path.read_text(encoding="utf-8")))
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(ROOT)}: split {', '.join(long)}"


def _model_type_compares(tree: ast.AST, model_types: set[str]) -> list[tuple[int, list[str]]]:
    """(line, the model types) of each comparison with a model-type string or a tuple of them."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            hits = [v.value for v in values if isinstance(v, ast.Constant) and v.value in model_types]
            if hits:
                found.append((node.lineno, hits))
    return found


def test_no_model_type_string_decides_outside_the_architectures():
    from posbias_export.hf.models import SUPPORTED

    model_types = set(SUPPORTED)
    outside = [p for p in SOURCES if "architectures" not in p.relative_to(ROOT).parts]
    found = {str(p.relative_to(ROOT)): hits for p in outside
             if (hits := _model_type_compares(ast.parse(p.read_text(encoding="utf-8")), model_types))}
    assert not found, f"model-type compares outside hf/architectures/ (use the role or the registry): {found}"


def test_the_rules_see_what_they_forbid():
    """Each check finds the case it exists for (so a passing run is not an empty search)."""
    tree = ast.parse("def f(kind):\n    if kind in ('t5', 'umt5'):\n        return 1\n    return kind == 'bloom'\n")
    assert [hits for _, hits in _model_type_compares(tree, {"t5", "umt5", "bloom"})] == [["t5", "umt5"], ["bloom"]]
    long = ast.parse("def g():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert [f.end_lineno - f.lineno + 1 for f in _functions(long)] == [MAX_FUNCTION_LINES + 1]
