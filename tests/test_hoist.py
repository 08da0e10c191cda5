"""export/hoist.py: If branches' host-read index arithmetic moved out, the math unchanged, and
runtimes/common/host_reads.py: which subgraph reads ONNX Runtime CUDA can see stale
(benchmarks/gpu_cure.md measured both on an H200)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from posbias_export.export.hoist import hoist_functions, hoist_nodes

ROOT = Path(__file__).resolve().parents[1]
OLD_FILE = ROOT / "posbias_export" / "gpu" / "data" / "alibi_attention_0f33d6a.onnx"  # exported before the hoist


def _host_reads():
    spec = importlib.util.spec_from_file_location("host_reads", ROOT / "runtimes" / "common" / "host_reads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _branchy_model(shape_in_branch: bool) -> onnx.ModelProto:
    """x [n] -> If(n > 2): x[start:] with start = n - 2 computed in the branch (from the outer n, or
    from the branch's own Shape), else x."""
    start = [helper.make_node("Shape", ["x"], ["n_b"]), helper.make_node("Sub", ["n_b", "two"], ["start"])] \
        if shape_in_branch else [helper.make_node("Sub", ["n", "two"], ["start"])]
    then = helper.make_graph([*start, helper.make_node("Slice", ["x", "start", "n"], ["y_then"])], "then", [],
                             [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, ["m"])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["y_else"])], "else", [],
                              [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, ["m"])])
    nodes = [helper.make_node("Constant", [], ["two"], value=helper.make_tensor("two", TensorProto.INT64, [1], [2])),
             helper.make_node("Shape", ["x"], ["n"]),
             helper.make_node("Greater", ["n", "two"], ["long1"]),
             helper.make_node("Squeeze", ["long1"], ["long"]),
             helper.make_node("If", ["long"], ["y"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_a_branch_computing_a_host_read_from_an_outer_value_is_risky_and_from_its_own_shape_is_not():
    reads = _host_reads()
    risky = reads.risky_host_reads(_branchy_model(shape_in_branch=False))
    assert len(risky) == 1 and "If:then" in risky[0] and "Slice input 1 (start)" in risky[0]
    assert reads.risky_host_reads(_branchy_model(shape_in_branch=True)) == []


def test_hoisting_moves_the_branch_arithmetic_out_and_keeps_the_outputs():
    model = _branchy_model(shape_in_branch=False)
    hoisted = onnx.ModelProto()
    hoisted.CopyFrom(model)
    nodes = hoist_nodes(list(hoisted.graph.node), set())
    del hoisted.graph.node[:]
    hoisted.graph.node.extend(nodes)
    onnx.checker.check_model(hoisted)
    if_node = next(n for n in hoisted.graph.node if n.op_type == "If")
    then = next(a.g for a in if_node.attribute if a.name == "then_branch")
    assert [n.op_type for n in then.node] == ["Slice"]  # the Sub moved in front of the If
    assert _host_reads().risky_host_reads(hoisted) == []
    for n in (1, 2, 5):
        x = np.arange(n, dtype=np.float32)
        np.testing.assert_array_equal(_run(hoisted, {"x": x}), _run(model, {"x": x}))


def _loop_model(start_from: str) -> onnx.ModelProto:
    """x [n] -> Loop over n-1 steps, each taking x[i:i+2] summed, the window's start computed from
    the iteration plus a zero: the enclosing graph's ("outer"), none ("iteration"), or one the body
    computes from its own Shape ("shape")."""
    zero = {"outer": [helper.make_node("Add", ["it", "zero"], ["start0"])],
            "iteration": [helper.make_node("Identity", ["it"], ["start0"])],
            "shape": [helper.make_node("Shape", ["x"], ["n_here"]), helper.make_node("Sub", ["n_here", "n_here"], ["zero_1d"]),
                      helper.make_node("Squeeze", ["zero_1d"], ["zero_here"]),
                      helper.make_node("Add", ["it", "zero_here"], ["start0"])]}[start_from]
    body = helper.make_graph(
        [*zero,
         helper.make_node("Unsqueeze", ["start0", "axis"], ["start"]),
         helper.make_node("Add", ["start", "two"], ["stop"]),
         helper.make_node("Slice", ["x", "start", "stop"], ["window"]),
         helper.make_node("ReduceSum", ["window"], ["out"], keepdims=1),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [helper.make_tensor_value_info("it", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    consts = [("two", [1], [2]), ("axis", [1], [0]), ("one", [], [1])]
    nodes = [helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, dims, vals))
             for name, dims, vals in consts]
    nodes += [helper.make_node("Shape", ["x"], ["n1"]), helper.make_node("Squeeze", ["n1"], ["n"]),
              helper.make_node("Sub", ["n", "one"], ["steps"]), helper.make_node("Sub", ["n", "n"], ["zero"]),
              helper.make_node("Constant", [], ["go"], value=helper.make_tensor("go", TensorProto.BOOL, [], [True])),
              helper.make_node("Loop", ["steps", "go"], ["y"], body=body)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("start_from, risky", [("outer", True), ("iteration", True), ("shape", False)])
def test_a_loop_body_computes_on_the_host_only_what_starts_from_its_own_shape(start_from, risky):
    """ONNX Runtime moves a node to the CPU only when it consumes a host value of its own graph
    (a Shape's output): arithmetic from an enclosing graph's value, or from the iteration number
    alone, stays on the GPU and is copied back for the Slice (host_reads.py replays this; the
    blocked Loop's bounds read so gave wrong blocks on the H200, benchmarks/gpu_cure.md)."""
    reads = _host_reads()
    found = reads.risky_host_reads(_loop_model(start_from))
    assert bool(found) == risky, found
    assert all("Loop:body: Slice input" in r for r in found)
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(_run(_loop_model(start_from), {"x": x}).ravel(), x[:-1] + x[1:])


def test_the_file_exported_before_the_cure_is_risky_and_hoisting_it_keeps_its_outputs():
    """The committed 0f33d6a file (wrong on the H200 after 1024 tokens, benchmarks/gpu_cure.md)
    is flagged (its Loop body reads its block's bounds on the host); hoisted, ONNX Runtime CPU
    gives the same bits at lengths of one block, several and an odd one, and the same file twice
    is hoisted to the same bytes (names are numbered per function)."""
    reads = _host_reads()
    assert any("Loop:" in r for r in reads.risky_host_reads(onnx.load(OLD_FILE)))
    old = onnx.load(OLD_FILE)
    hoisted = hoist_functions(onnx.load(OLD_FILE))
    onnx.checker.check_model(hoisted, full_check=True)
    assert hoisted.SerializeToString() == hoist_functions(onnx.load(OLD_FILE)).SerializeToString()
    rng = np.random.default_rng(0)
    for n in (1, 17, 300, 1000):
        feeds = {name: rng.standard_normal((1, 8, n, 64)).astype(np.float32) for name in ("query", "key", "value")}
        np.testing.assert_array_equal(_run(hoisted, feeds), _run(old, feeds))


@pytest.mark.parametrize("keep", [[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]])
def test_has_padding_counts_padding_keys_from_a_shape(keep):
    """HasPadding reads how many keys are padding from NonZero's output shape (a host value in
    ONNX Runtime CUDA), and agrees with not keep.all()."""
    from posbias_export.export.targets.blocked_script import HasPadding

    proto = HasPadding.to_model_proto()
    mask = np.array(keep, dtype=bool).reshape(1, 1, 1, -1)
    assert bool(_run(proto, {proto.graph.input[0].name: mask})) == (not mask.all())


@pytest.mark.parametrize("bias, target", [("kerple_log", "cuda-ort"), ("alibi", "cuda-ort"), ("alibi", "portable"),
                                          ("t5", "portable"), ("sandwich", "portable")])
def test_exported_subgraphs_read_nothing_stale_on_the_host(tmp_path, bias, target):
    """Every export is cured: no If branch and no Loop body is left reading on the host a value
    ONNX Runtime CUDA computes on the GPU (If branches: hoisted; Loop bodies: the per-call scalars
    read from their own Shape, block_scaffold.LOOP_SCALARS), except Sandwich's, whose Range length
    comes from the positions' values (data, not shapes; the runners keep host-synchronous launches
    for it)."""
    import posbias_export as pbe

    model = pbe.build_model(pbe.ModelConfig(bias=bias, num_heads=4, dim=64, num_layers=1, vocab_size=64))
    path = tmp_path / "lm.onnx"
    pbe.export_onnx(model, path, check_growth=False, target=target, attention_mask=True)
    risky = _host_reads().risky_host_reads(onnx.load(path))
    if bias == "sandwich":
        assert risky and all("Range input 1 (rows" in r for r in risky), risky  # Sandwich's distance table
    else:
        assert risky == [], risky


def test_the_replayed_placement_predicts_the_copies_onnx_runtime_cuda_logged():
    """host_reads.py replays ONNX Runtime CUDA's placement on the graph: for the committed 0f33d6a
    file, the values it says a subgraph reads back from the GPU are, scope by scope, the
    MemcpyToHost copies ONNX Runtime's own verbose log listed on the H200 (benchmarks/gpu_cure.json)."""
    import json
    import re

    logged = next(p for p in json.loads((ROOT / "benchmarks" / "gpu_cure.json").read_text())["placement"]
                  if p["file"] == OLD_FILE.name)["memcpy_lines"]
    # the two inliners name a function's values apart differently: ONNX Runtime _inlfunc_<Function>_<name>,
    # onnx's <name>__<call>; the names inside each function are the same
    to_host = sorted(re.search(r"MemcpyToHost before _inlfunc_[A-Za-z]+_(\S+)", line).group(1)
                     for line in logged if "Add MemcpyToHost" in line)
    predicted = sorted({r.rsplit("(", 1)[1].rstrip(")") for r in _host_reads().risky_host_reads(onnx.load(OLD_FILE))})
    assert to_host and [name.rsplit("__", 1)[0] for name in predicted] == to_host, (predicted, to_host)


def test_the_portable_file_that_raced_without_a_copy_back_is_fenced(tmp_path):
    """The committed portable ALiBi attention file (commit 77e0afd; wrong blocks in 1 of 9 fresh
    processes on the H200 with asynchronous launches, benchmarks/gpu_cure_loops.md) reads nothing
    back from the GPU in any subgraph, yet the runners keep host-synchronous launches for it: its
    blocked Loop attends without a fused op. The GPU-target body is not fenced."""
    import posbias_export as pbe

    reads = _host_reads()
    repro = onnx.load(ROOT / "posbias_export" / "gpu" / "data" / "alibi_attention_portable_77e0afd.onnx")
    assert reads.risky_host_reads(repro) == []
    assert len(reads.unfused_loops(repro)) == 2  # the padded and unpadded Loops
    assert reads.needs_host_sync(str(ROOT / "posbias_export" / "gpu" / "data" / "alibi_attention_portable_77e0afd.onnx"))
    core = pbe.build_model(pbe.ModelConfig(bias="alibi", num_heads=4, dim=64), arch="attention")
    out = tmp_path / "gpu.onnx"
    pbe.export_onnx(core, out, check_growth=False, target="cuda-ort")
    assert reads.unfused_loops(onnx.load(out)) == [] and not reads.needs_host_sync(str(out))
