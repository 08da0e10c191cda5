"""The posbias ONNX Script functions, three ways (onnxscript eager, FunctionProto in a model,
inlined) against the PyTorch modules and float64 references; the exported models' function
and inlined forms on ORT, the reference evaluator and OpenVINO; the ONNX Script-authored block."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

import posbias_export as pbe
import tiers
from posbias_export.export import checks, functions
from posbias_export.biases import bias_class
from posbias_export.parity import run_matrix
from script_block import script_block_model
from posbias_export.parity import compare
from conftest import SMALL, ort_session

SHAPES = [(1, 1), (17, 17), (1024, 1024), (5, 40), (1, 300)]  # (q_len, k_len)


def single_node_model(bias) -> onnx.ModelProto:
    """q_pos, k_pos -> posbias.<Family>(q_pos, k_pos, params) -> bias, with its functions."""
    tensors, attrs = bias.function_inputs()
    inits = [numpy_helper.from_array(t.detach().float().numpy() if t.is_floating_point() else t.numpy(), f"p{i}")
             for i, t in enumerate(tensors)]
    node = helper.make_node(bias.function_name, ["q_pos", "k_pos", *[t.name for t in inits]], ["bias"], domain="posbias", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("q_pos", onnx.TensorProto.INT64, ["Lq"]),
                                            helper.make_tensor_value_info("k_pos", onnx.TensorProto.INT64, ["Lk"])],
                              [helper.make_tensor_value_info("bias", onnx.TensorProto.FLOAT, ["heads", "Lq", "Lk"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("posbias", 1)],
                              ir_version=10, functions=functions.function_protos({bias.function_name}, 18))
    onnx.checker.check_model(model, full_check=True)
    return model


def three_ways(bias, q_pos, k_pos) -> dict[str, np.ndarray]:
    tensors, attrs = bias.function_inputs()
    params = [t.detach().float().numpy() if t.is_floating_point() else t.numpy() for t in tensors]
    model = single_node_model(bias)
    flat = functions.inline(model)
    assert not flat.functions and all(n.domain in ("", "ai.onnx") for n in flat.graph.node)
    feeds = {"q_pos": q_pos, "k_pos": k_pos}
    return {
        "eager": np.asarray(bias.function(q_pos, k_pos, *params, **attrs)),
        "function": ort_session_bytes(model).run(None, feeds)[0],
        "inlined": ort_session_bytes(flat).run(None, feeds)[0],
    }


def ort_session_bytes(model):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("q_len,k_len", SHAPES, ids=[f"q{q}-k{k}" for q, k in SHAPES])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", pbe.BIASES)
def test_function_three_ways(name, causal, q_len, k_len):
    bias = pbe.create_bias(name, 6, causal=causal)
    q_pos, k_pos = np.arange(k_len - q_len, k_len, dtype=np.int64), np.arange(k_len, dtype=np.int64)
    torch32 = bias(q_len, k_len).detach().double().numpy()
    ref64 = bias.reference(q_pos, k_pos)
    for way, got in three_ways(bias, q_pos, k_pos).items():
        assert got.shape == torch32.shape, way
        parity = compare(got, ref64, torch32)
        assert parity.passed, f"{way}: {parity}"


@pytest.mark.parametrize("name", pbe.BIASES)
def test_function_with_batched_positions(name):
    """Positions [B, L] (padding masks) give [B, H, Lq, Lk], equal to the torch module."""
    bias = pbe.create_bias(name, 4)
    q = np.stack([np.arange(3, 8), np.arange(0, 5)]).astype(np.int64)
    k = np.stack([np.arange(0, 8), np.arange(-3, 5)]).astype(np.int64)
    expected = bias.from_positions(torch.from_numpy(q), torch.from_numpy(k)).detach().numpy()
    tensors, attrs = bias.function_inputs()
    params = [t.detach().float().numpy() if t.is_floating_point() else t.numpy() for t in tensors]
    got = np.asarray(bias.function(q, k, *params, **attrs))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("arch", ["lm", "block"])
@pytest.mark.parametrize("name", tiers.families())
def test_default_export_has_functions_inline_export_has_none(exports, name, arch):
    """Causal exports are blocked: exactly one posbias.BlockedAttention<Family> node per layer
    (its Loop calls the family's function per block); the inlined file has no function at all."""
    model = onnx.load(str(exports.cli(name, arch)))
    nodes = [n for n in model.graph.node if n.domain == "posbias"]
    layers = SMALL["num_layers"] if arch == "lm" else 1
    cls = bias_class(name)
    # README's naming: BlockedAttention + the family's function + "ByDistance" where the body runs
    # on the key indices (no padding mask here) of a relative family (a function of i - j)
    expected = "BlockedAttention" + cls.function_name + ("ByDistance" if cls.relative else "")
    assert [n.op_type for n in nodes] == [expected] * layers
    local = {f.name for f in model.functions}
    assert {n.op_type for n in nodes} <= local and all(f.domain == "posbias" for f in model.functions)
    checks.check_domains(model)  # posbias only as local functions
    onnx.checker.check_model(model, full_check=True)
    flat = onnx.load(str(exports.cli(name, arch, extra=("--inline-functions",))))
    assert not flat.functions and {i.domain for i in flat.opset_import} <= {"", "ai.onnx"}
    assert all(n.domain in ("", "ai.onnx") for n in flat.graph.node)
    onnx.checker.check_model(flat, full_check=True)


# the inlined form on every runtime: alibi by default, every family with -m slow
FORMS = [(b, f) for b in pbe.BIASES for f in ("functions", "inlined")]


@pytest.mark.parametrize("name,form", tiers.cases(
    FORMS, [f"{b}-{f}" for b, f in FORMS], slow={f"{b}-inlined" for b in pbe.BIASES if b != "alibi"}))
def test_runtimes_run_both_forms(exports, name, form):
    extra = () if form == "functions" else ("--inline-functions",)
    matrix = run_matrix(exports.cli(name, "lm", True, extra), ("ort-cpu", "reference", "openvino"), (1, 17, 300), batch=2,
                        order=False)  # the order protocol: test_runtimes, test_order_protocol
    assert matrix.ok, [(c.runtime, c.case, c.verdict) for c in matrix.cells if not c.ok]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", pbe.BIASES)
def test_script_block_matches_exported_block_and_pytorch(exports, name, causal):
    block = pbe.build_model(pbe.ModelConfig(bias=name, causal=causal, **SMALL), seed=0, arch="block")
    scripted = script_block_model(block)
    onnx.checker.check_model(scripted, full_check=True)
    exported = ort_session(exports.cli(name, "block", causal))
    for length in (1, 17, 257):
        x = torch.randn(2, length, SMALL["dim"], generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            torch32 = block(x).double().numpy()
            ref64 = block.double()(x.double()).numpy()
            block.float()
        script_out = ort_session_bytes(scripted).run(None, {"hidden_states": x.numpy()})[0]
        flat_out = ort_session_bytes(script_block_model(block, inline=True)).run(None, {"hidden_states": x.numpy()})[0]
        export_out = exported.run(None, {"hidden_states": x.numpy()})[0]
        for label, got in (("script", script_out), ("script-inlined", flat_out), ("export", export_out)):
            parity = compare(got, ref64, torch32)
            assert parity.passed, f"{label} L={length}: {parity}"
        np.testing.assert_allclose(script_out, export_out, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("name", tiers.families())
def test_plain_export_shares_fixed_bias_nodes(exports, name):
    """In the plain form a learned bias is one posbias node per layer (its own tensors), a
    fixed one a single node the exporter's common-subexpression pass shares."""
    model = onnx.load(str(exports.cli(name, "lm", causal=False, extra=("--attention", "plain"))))
    nodes = [n.op_type for n in model.graph.node if n.domain == "posbias"]
    expected = SMALL["num_layers"] if bias_class(name).learned else 1
    assert nodes == [bias_class(name).function_name] * expected
