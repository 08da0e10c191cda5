"""The GPU-shaped export targets (--target cuda / cuda-ort), checked where CI runs (ONNX Runtime
CPU and the ONNX reference evaluator): same math as the PLAIN float64 form (an independent
computation) across block boundaries, the graph shape the GPU needs (one fused attention op per
block, its bias gathered from a per-distance vector, no tensor near 2^31 elements),
and the options. The CUDA measurements are in benchmarks/gpu_*.md (posbias_export/gpu/attention.py)."""
from __future__ import annotations

import onnx
import pytest
import torch
from onnx.reference import ReferenceEvaluator

import posbias_export as pbe
import tiers
from posbias_export.export import FileContract, functions
from posbias_export.nn.attention import AttentionSettings
from posbias_export.biases import bias_class
from posbias_export.nn import block_plan
from posbias_export.parity import FLOAT32, compare, torch_outputs
from conftest import SMALL, ort_session

FUSED_OP = {"cuda": ("", "Attention"), "cuda-ort": ("com.microsoft", "MultiHeadAttention")}


def _qkv(length, seed, batch=2):
    g = torch.Generator().manual_seed(seed)
    head_dim = SMALL["dim"] // SMALL["num_heads"]
    return [torch.randn(batch, SMALL["num_heads"], length, head_dim, generator=g) for _ in range(3)]


def _export(tmp_path, bias, target, block=16, causal=True, **kwargs):
    core = pbe.build_model(pbe.ModelConfig(bias=bias, causal=causal, **SMALL), arch="attention")
    path = tmp_path / f"{bias}_{target}.onnx"
    pbe.export_onnx(core, path, block=block, check_growth=False, target=target, **kwargs)
    return core, path


# cuda-ort keeps the bidirectional cells by default; cuda's run with -m slow
GPU_CASES = [(b, t, c) for b in pbe.BIASES for t in ("cuda", "cuda-ort") for c in (True, False)]
GPU_IDS = [f"{b}-{t}-{'causal' if c else 'bidirectional'}" for b, t, c in GPU_CASES]


@pytest.mark.parametrize("bias,target,causal", tiers.cases(
    GPU_CASES, GPU_IDS, slow={f"{b}-cuda-bidirectional" for b in pbe.BIASES}))
def test_gpu_target_matches_plain_float64(tmp_path, bias, target, causal):
    """Block 16: L=1 and 16 take the one-block branch, 17 and 300 the Loop (partial last block)."""
    core, path = _export(tmp_path, bias, target, causal=causal)
    session = ort_session(path)
    plain = AttentionSettings(form="plain")
    for length in (1, 16, 17, 300):
        q, k, v = _qkv(length, seed=length)
        ref64 = torch_outputs(core, (q, k, v), torch.float64, plain)
        torch32 = torch_outputs(core, (q, k, v), torch.float32, plain)
        got = session.run(None, {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()})[0]
        parity = compare(got, ref64, torch32, FLOAT32)
        assert parity.passed, f"L={length}: {parity}"


@pytest.mark.parametrize("bias", ["alibi", "kerple_log", "sandwich", "window"])
def test_reference_evaluator_runs_the_standard_gpu_target(tmp_path, bias):
    """--target cuda is standard ONNX (opset 23 Attention): the reference evaluator runs it,
    as local functions and inlined, through the Loop."""
    core, path = _export(tmp_path, bias, "cuda", block=8)
    model = onnx.load(path)
    assert model.opset_import[0].version == 23 or any(i.domain == "" and i.version == 23 for i in model.opset_import)
    q, k, v = _qkv(21, seed=3, batch=1)
    feeds = {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()}
    plain = AttentionSettings(form="plain")
    ref64, torch32 = (torch_outputs(core, (q, k, v), dt, plain) for dt in (torch.float64, torch.float32))
    for form in (model, functions.inline(model)):
        parity = compare(ReferenceEvaluator(form).run(None, feeds)[0], ref64, torch32, FLOAT32)
        assert parity.passed, str(parity)


def _ops(model):
    return {(n.domain, n.op_type) for n in functions.all_nodes(
        [n for f in model.functions for n in f.node] + list(model.graph.node))}


@pytest.mark.parametrize("target", ["cuda", "cuda-ort"])
def test_gpu_target_graph_shape(tmp_path, as_built, target):
    """Each block ends in the fused op with the bias as its mask; each block gathers its bias from
    the family's function on a vector (test_slim_table.py); the portable per-block MatMul/Softmax is gone;
    the metadata says which target it is (the reference reads it)."""
    _, path = _export(tmp_path, "kerple_log", target)
    model = onnx.load(path)
    body = next(f for f in model.functions if f.name.startswith("BlockedAttention") and f.name.endswith("ByDistance"))
    ops = _ops(onnx.helper.make_model(onnx.helper.make_graph(list(body.node), "b", [], []), functions=model.functions))
    assert FUSED_OP[target] in ops
    assert ("posbias", "GatherBlockBias") in ops and ("posbias", "SlimVectorPositions") in ops
    assert ("posbias", "BlockAttend") not in ops and ("posbias", "BlockAttendMasked") not in ops
    assert FileContract.of(model).target == target
    if target == "cuda-ort":
        assert any(i.domain == "com.microsoft" for i in model.opset_import)


def test_gpu_rows_keep_every_block_under_the_int32_index_limit():
    """ONNX Runtime CUDA indexes with int32: a block's [H=8, rows, keys] mask (and the table)
    must stay below 2^31 elements at any length; rows shrink as keys grow."""
    plan = block_plan(bias_class("kerple_log")(8), fused=True)
    assert plan.rows(4096, 16384) == 4096
    assert plan.rows(4096, 32768) == 2048
    for length in (1024, 16384, 32768, 65536, 1 << 20):
        rows = plan.rows(4096, length)
        assert 8 * rows * (2 * length) < 2 ** 31


def test_gpu_target_lm_with_padding_and_kv_cache(tmp_path):
    """An LM with an attention_mask (positions from the mask: the per-block bias path) and a
    KV-cache decoder (prefill then single steps): equal to the float64 plain model."""
    from posbias_export.parity import run_matrix

    cfg = pbe.ModelConfig(bias="t5", **SMALL)
    model = pbe.build_model(cfg)
    path = tmp_path / "lm.onnx"
    pbe.export_onnx(model, path, target="cuda-ort", block=8, attention_mask=True, check_growth=False)
    matrix = run_matrix(path, ("ort-cpu",), (1, 17, 40), batch=3)
    assert matrix.ok, [(c.case, c.verdict, c.parity) for c in matrix.cells]
    kv = tmp_path / "kv.onnx"
    pbe.export_onnx(model, kv, target="cuda", block=8, kv_cache=True, check_growth=False)
    matrix = run_matrix(kv, ("ort-cpu", "reference"), (1, 17, 40), batch=2)
    assert matrix.ok, [(c.runtime, c.case, c.verdict, c.parity) for c in matrix.cells]


@pytest.mark.parametrize("kwargs, message", [
    (dict(target="gpu"), "target must be one of"),
    (dict(target="cuda", opset=18), "needs opset 23"),
    (dict(target="cuda-ort", attention="plain"), "is a blocked form"),
])
def test_bad_target_options(tmp_path, kwargs, message):
    model = pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), arch="attention")
    with pytest.raises(ValueError, match=message):
        pbe.export_onnx(model, tmp_path / "x.onnx", **kwargs)
    assert not (tmp_path / "x.onnx").exists()


def test_cli_target_flag(tmp_path, capsys):
    from posbias_export.cli import main

    assert main(["--bias", "alibi", "--target", "cuda", "--out", str(tmp_path / "m.onnx")]) == 0
    assert "opset 23" in capsys.readouterr().out
    assert main(["--bias", "alibi", "--target", "cuda", "--opset", "18", "--out", str(tmp_path / "n.onnx")]) == 2
    assert not (tmp_path / "n.onnx").exists()


def _gpu_attention():
    """posbias_export/gpu/attention.py (the GPU benchmark a lease runs; its no-GPU refusal is
    tested in test_tools.py)."""
    from posbias_export.gpu import attention

    return attention


def test_gpu_bench_targets_are_ratios_of_the_measured_cells(tmp_path):
    """The targets table divides the right cells: synthetic rows with known times."""
    g = _gpu_attention()

    def row(bias, config, length, ms, gb=1.0, dtype="float16"):
        return {"bias": bias, "dtype": dtype, "config": config, "length": length, "times": [ms / 1e3] * 3,
                "gpu_bytes": gb * 1e9}

    rows = [row("alibi", "flex", 16384, 1.0), row("alibi", "ort-cuda", 4096, 1.0),
            row("alibi", "ort-cuda-ort", 4096, 0.5), row("alibi", "ort-cuda", 16384, 9.0),
            row("alibi", "ort-cuda-ort", 16384, 1.25), row("none", "torch-sdpa", 16384, 1.0),
            row("none", "ort-cuda-ort", 16384, 2.0), row("t5", "flex", 16384, 2.0),
            row("t5", "ort-cuda-ort", 16384, 7.0), row("alibi", "ort-cuda-ort", 32768, 8.0, gb=3.0),
            row("t5", "ort-cuda", 32768, 8.0, gb=5.0),
            row("alibi", "ort-cuda-ort", 1024, 0.3), row("alibi", "ort-plain", 1024, 0.2)]
    checks = {c["target"]: c for c in g.targets({"rows": rows})}
    assert checks["alibi fp16 L=16384: export / compiled Flex <= 1.5x"]["measured"] == pytest.approx(1.25)  # the faster target
    assert checks["alibi fp16 L=16384: export / compiled Flex <= 1.5x"]["met"]
    assert not checks["none fp16 L=16384: export / fused SDPA <= 1.5x"]["met"]  # 2x
    assert not checks["t5 fp16 L=16384: export / compiled Flex (same table) <= 3x"]["met"]  # 3.5x
    assert checks["alibi fp16 L=32768: GPU memory <= 4 GB"]["met"]
    assert not checks["t5 fp16 L=32768: GPU memory <= 4 GB"]["met"]
    assert checks["alibi float16 L=1024: export / plain form <= 1.2x"]["measured"] == pytest.approx(1.5)
    assert checks["alibi float32 L=1024: export / plain form <= 1.2x"]["measured"] is None
    md, _ = g.write({"rows": rows, "heads": 8, "head_dim": 64, "lengths": [1024, 4096, 16384, 32768]}, tmp_path,
                    {"description": "synthetic"})
    text = md.read_text()
    assert "| alibi | 4096 | 1.00 / 1.00 GB | 0.50 / 1.00 GB |" in text
    assert "| alibi float32 L=1024: export / plain form <= 1.2x | not measured | 1.2x | not measured | - |" in text


def test_gpu_bench_targets_without_a_gpu_read_not_measured():
    g = _gpu_attention()

    checks = g.target_rows([], ["alibi", "none", "kerple_log"])
    assert checks and all(c["measured"] is None and not c["met"] for c in checks)
    assert all(row.endswith("| not measured | - |") for row in g.targets_markdown(checks)[4:])


def test_flex_cell_that_materialised_its_scores_is_not_a_time():
    """A Flex cell whose memory reaches the scores' size ran eagerly (the recompile limit spent)."""
    g = _gpu_attention()

    scores = 8 * 16384 * 16384 * 2  # H=8, float16
    assert g.ran_eagerly({"gpu_bytes": scores * 1.6}, 8, 16384, "float16")  # eager Flex: ~13 bytes per score
    assert not g.ran_eagerly({"gpu_bytes": 40e6}, 8, 16384, "float16")  # compiled: O(L d)
