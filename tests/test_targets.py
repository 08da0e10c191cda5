"""A target is one module plus one row (docs/adding-a-target.md): the worked example, added in
memory, exports, says what it is in the file's contract, and validates against float64."""
from __future__ import annotations

import sys
import types

import pytest

import posbias_export as pbe
from posbias_export.export import FileContract, targets


@pytest.fixture
def portable_wide(monkeypatch):
    """The doc's targets/portable_wide.py, and its name in MODULES."""
    from posbias_export.export.targets.blocked_body import function_proto

    module = types.ModuleType(f"{targets.__name__}.portable_wide")
    module.TARGET = targets.Target("portable-wide", "the portable body in 1024-row blocks", body=function_proto,
                                   default_block=1024, quantized=True)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(targets, "MODULES", (*targets.MODULES, "portable_wide"))
    monkeypatch.setattr(targets, "TARGETS", targets._registry())
    return module.TARGET


def test_a_new_target_is_one_module_and_one_row(tmp_path, portable_wide):
    from posbias_export.parity import run_matrix

    model = pbe.build_model(pbe.ModelConfig(bias="kerple_log", num_heads=4, dim=64, num_layers=1))
    path = tmp_path / "wide.onnx"
    pbe.export_onnx(model, path, check_growth=False, target="portable-wide")
    contract = FileContract.of_path(path)
    assert (contract.target, contract.attention, contract.attention_block) == ("portable-wide", "blocked", 1024)
    matrix = run_matrix(path, ("ort-cpu", "reference"), (1, 17, 40), batch=2)
    assert matrix.ok, [(c.runtime, c.case, c.verdict) for c in matrix.cells]


def test_two_modules_may_not_claim_one_name(monkeypatch, portable_wide):
    from posbias_export.export.targets.blocked_body import function_proto

    clash = types.ModuleType(f"{targets.__name__}.clash")
    clash.TARGET = targets.Target("portable-wide", "a copy that kept the name", body=function_proto)
    monkeypatch.setitem(sys.modules, clash.__name__, clash)
    monkeypatch.setattr(targets, "MODULES", (*targets.MODULES, "clash"))
    with pytest.raises(ValueError, match="two target modules claim the name 'portable-wide'"):
        targets._registry()
