"""validate's accuracy-level check (parity/accuracy_level.py, issue 48): an int4 file whose
MatMulNBits compute at level 4 is also run at level 0, judged by the same policy, with the share
of next tokens the two disagree on; a level-0 file gets no such row; the copy never outlives
the run."""
from __future__ import annotations

import onnx
import pytest
from conftest import SMALL

from posbias_export.cli import main as cli_main
from posbias_export.parity.accuracy_level import LEVEL0_ROW, level0_copy, level4_nodes


def _int4(tmp_path, *extra) -> str:
    path = tmp_path / "q4.onnx"
    assert cli_main(["--bias", "alibi", "--quantize", "int4", "--out", str(path), "--skip-growth-check",
                     "--heads", str(SMALL["num_heads"]), "--dim", str(SMALL["dim"]),
                     "--layers", str(SMALL["num_layers"]), *extra]) == 0
    return path


def test_a_level4_file_is_also_judged_at_level0(tmp_path):
    from posbias_export.validation import validate

    path = _int4(tmp_path)
    assert level4_nodes(path) > 0
    result = validate([path], ("ort-cpu",), (17, 64), batch=2, order=False)
    cells = [c for c in result.matrices[0].cells if c.runtime == LEVEL0_ROW]
    assert [c.case for c in cells] == ["L=17 B=2", "L=64 B=2"] and all(c.verdict == "pass" for c in cells)
    for cell in cells:
        assert 0.0 <= cell.parity["next_token_differs_from_level4"] <= 1.0 and "kl_mean" in cell.parity
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q4.onnx"]  # the copy is gone


def test_a_level0_file_gets_no_second_row(tmp_path):
    from posbias_export.validation import validate

    path = _int4(tmp_path, "--quant-accuracy-level", "0")
    assert level4_nodes(path) == 0
    result = validate([path], ("ort-cpu",), (17,), batch=2, order=False)
    assert LEVEL0_ROW not in {c.runtime for c in result.matrices[0].cells}


def test_the_copy_changes_only_the_accuracy_level_and_is_removed(tmp_path):
    path = _int4(tmp_path)
    original = onnx.load(str(path))
    with level0_copy(path) as copy:
        assert copy.parent == path.parent and copy.name.startswith(".q4.onnx.")
        changed = onnx.load(str(copy))
        assert level4_nodes(copy) == 0
        for a, b in zip(original.graph.node, changed.graph.node):
            if a.op_type == "MatMulNBits":
                b = onnx.NodeProto.FromString(b.SerializeToString())
                for attr in b.attribute:
                    if attr.name == "accuracy_level":
                        attr.i = 4
            assert a == b
        assert original.graph.initializer == changed.graph.initializer
    assert not copy.exists()


def test_a_folder_without_room_for_the_copy_is_a_not_run_row(tmp_path, monkeypatch):
    import tempfile

    from posbias_export.parity import accuracy_level

    path = _int4(tmp_path)

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    runs = accuracy_level.level0_runs(("ort-cpu",), path, [], 60.0, False)
    assert len(runs) == 1 and runs[0].name == LEVEL0_ROW
    assert runs[0].problem == "not run: no copy beside the file (Permission denied)"
