"""The quantizers' node sort, mended: an If's branch reading a value of the graph around it counts
as the If reading it (export/graph_order.py), so int8 files exported with --inline-functions pass
onnx.checker (ONNX Runtime's quantize_dynamic had moved such a producer after its If)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from posbias_export.export.graph_order import sort_graph


def branch_reading(outer: str, out: str) -> onnx.GraphProto:
    return helper.make_graph([helper.make_node("Identity", [outer], [out])], f"reads_{outer}", [],
                             [helper.make_tensor_value_info(out, TensorProto.FLOAT, [None])])


def if_after_its_outside_read_moved() -> onnx.ModelProto:
    """x -> doubled (made AFTER the If, as the quantizer's sort left it) -> the If's branches read
    doubled without listing it -> y; plus a node that reads y."""
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["picked"], then_branch=branch_reading("doubled", "a"),
                         else_branch=branch_reading("x", "b")),
        helper.make_node("Add", ["picked", "x"], ["y"]),
        helper.make_node("Add", ["x", "x"], ["doubled"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
                              [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_branchs_outside_read_moves_before_its_if():
    model = if_after_its_outside_read_moved()
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(model, full_check=True)
    before = [n.op_type for n in model.graph.node]
    sort_graph(model.graph)
    onnx.checker.check_model(model, full_check=True)
    order = [n.output[0] for n in model.graph.node]
    assert order.index("doubled") < order.index("picked")
    assert sorted(n.op_type for n in model.graph.node) == sorted(before)  # nothing added or lost
    assert order[:2] == ["total", "positive"]  # stable: what was in order stays where it was
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([1.0, 2.0, -0.5], np.float32)
    assert np.array_equal(session.run(None, {"x": x})[0], 2 * x + x)  # the then branch: doubled + x
    assert np.array_equal(session.run(None, {"x": -x})[0], -2 * x)  # the else branch: x + x


def test_a_cycle_is_refused():
    nodes = [helper.make_node("Neg", ["b"], ["a"]), helper.make_node("Neg", ["a"], ["b"])]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1])])
    with pytest.raises(ValueError, match="cycle"):
        sort_graph(graph)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_inlined_export_passes_the_checker(tmp_path, scheme):
    """--quantize with --inline-functions (OpenVINO's form): the export's own checks pass."""
    out = tmp_path / "model.onnx"
    done = subprocess.run([sys.executable, "-m", "posbias_export", "--bias", "alibi", "--quantize", scheme,
                           "--inline-functions", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    assert not model.functions
