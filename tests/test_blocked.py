"""The query-blocked attention form: PyTorch blocked == plain (float64), the exported Loop on
ONNX Runtime and the reference evaluator against a float64 reference computed in blocks, and
the export options that choose the form. Long inputs (4096, 16384 slow) at the issue's shape."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from onnx.reference import ReferenceEvaluator

import posbias_export as pbe
import tiers
from posbias_export.export import functions
from posbias_export.biases import bias_class
from posbias_export.nn import DEFAULT_BLOCK, block_plan
from posbias_export.nn.plans import TABLE_ROW_BUDGET
from posbias_export.nn.blocked import keep_mask
from posbias_export.export import FileContract
from posbias_export.nn.attention import AttentionSettings, attention_heads, layer_bias
from posbias_export.parity import FLOAT32, compare, torch_outputs
from conftest import SMALL, lm_inputs, ort_session

BENCH_SHAPE = dict(num_heads=8, dim=512)  # the H=8, d=64


def _qkv(batch, heads, q_len, k_len, head_dim, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, head_dim, generator=g, dtype=dtype)
    k, v = (torch.randn(batch, heads, k_len, head_dim, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("block", [1, 7, 64])
@pytest.mark.parametrize("bias", pbe.BIASES)
def test_torch_blocked_equals_plain_float64(bias, block, causal):
    """Same math, other order: equal to float64 rounding, with q_len < k_len and left padding."""
    cfg = pbe.ModelConfig(bias=bias, causal=causal, **SMALL)
    module = layer_bias(cfg).double()
    q, k, v = _qkv(2, cfg.num_heads, 37, 50, cfg.head_dim)
    key_mask = torch.ones(2, 50, dtype=torch.int64)
    key_mask[1, :9] = 0  # the second row is left-padded
    k_pos = (key_mask.cumsum(-1) - 1).clamp_min(0)  # [B, Lk]
    q_pos = k_pos[:, -37:]  # [B, Lq]
    plain = attention_heads(q, k, v, q_pos, k_pos, key_mask, module, causal, AttentionSettings(form="plain"))
    blocked = attention_heads(q, k, v, q_pos, k_pos, key_mask, module, causal, AttentionSettings(form="blocked", block=block))
    torch.testing.assert_close(blocked, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("block", [1, 7, 64])
@pytest.mark.parametrize("bias", pbe.BIASES)
def test_distance_table_blocks_equal_plain_float64(bias, block, causal, padded):
    """1-D positions (the indices): relative families slice each block's bias from one table of
    per-distance values (DistanceTablePositions), causal mask folded in; a key mask (as the
    transformers layers pass with index positions) adds the padding penalty. Equal to the plain
    form to float64 rounding, with q_len < k_len and partial last blocks."""
    cfg = pbe.ModelConfig(bias=bias, causal=causal, **SMALL)
    module = layer_bias(cfg).double()
    q, k, v = _qkv(2, cfg.num_heads, 37, 50, cfg.head_dim)
    q_pos, k_pos = torch.arange(13, 50), torch.arange(50)
    key_mask = None
    if padded:
        key_mask = torch.ones(2, 50, dtype=torch.int64)
        key_mask[1, :9] = 0  # the second row is left-padded
    plain = attention_heads(q, k, v, q_pos, k_pos, key_mask, module, causal, AttentionSettings(form="plain"))
    blocked = attention_heads(q, k, v, q_pos, k_pos, key_mask, module, causal, AttentionSettings(form="blocked", block=block))
    torch.testing.assert_close(blocked, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bias", ["kerple_power", "t5", "sandwich", "window"])
def test_distance_table_is_evaluated_once_outside_the_loop(tmp_path, as_built, bias):
    """The ...ByDistance body calls the family's function once, before the Loop, and folds the
    causal mask into that table; each Loop body only slices and adds the slice once to the
    scores (BlockAttendMasked), the padding penalty only in the Loop taken when some key is
    padding; the per-pair body is kept for the one-block branch (decode steps). A family whose
    bias is constant from some distance on (T5) calls it once more, before the Loop too, for
    those constants (FarKeys), builds a table of the keys near a block only (NearVectorPositions),
    and each block slices it for its near keys (NearFarScores)."""
    far = pbe.create_bias(bias, 8).far_distance is not None
    _, path = _export_core(tmp_path, bias, 16)
    model = onnx.load(str(path))
    name = "BlockedAttention" + bias_class(bias).function_name + "ByDistance"
    body = next(f for f in model.functions if f.name == name)
    branches = {g.name: g for n in body.node if n.op_type == "If" for a in n.attribute for g in [a.g]}
    blocks = branches["query_blocks"]
    outer_ops = [n.op_type for n in blocks.node]
    assert outer_ops.count(bias_class(bias).function_name) == 1 + far and "MaskFutureInTable" in outer_ops
    assert ("FarKeys" in outer_ops) == ("NearVectorPositions" in outer_ops) == far
    padding_if = next(n for n in blocks.node if n.op_type == "If")
    loops = {a.g.name: next(b.g for b in a.g.node[0].attribute) for a in padding_if.attribute}
    for branch, loop_body in loops.items():
        ops = [n.op_type for n in loop_body.node]
        if far:
            assert "NearFarScores" in ops and "AttendScores" in ops and "SliceByDistance" not in ops, branch
        else:
            assert "SliceByDistance" in ops and "BlockAttendMasked" in ops, branch
        assert bias_class(bias).function_name not in ops and "BlockAttend" not in ops, branch
        assert ("AddPaddingPenalty" in ops) == (branch == "blocks_padded"), branch
    direct_ops = [n.op_type for n in branches["one_block"].node]
    assert bias_class(bias).function_name in direct_ops
    # a window's decode step reads only the keys within its reach
    assert ("DirectWindowKeys" in direct_ops) == (bias == "window")


def test_alibi_key_row_rides_in_the_matmul(tmp_path, as_built):
    """ALiBi's ...ByDistance body: before the Loop one mask-only table (MaskTable, no ALiBi
    values: they would be an [H, Bq, W] Add per block); in each Loop the block's key row and
    BlockAttendFolded, which appends it to the keys; the padding penalty only in the padded
    Loop. float16 models keep the per-block BlockAttend (a row inside a float16 MatMul would
    lose the scores' precision)."""
    _, path = _export_core(tmp_path, "alibi", 16)
    body = next(f for f in onnx.load(str(path)).functions if f.name == "BlockedAttentionAlibiByDistance")
    branches = {a.g.name: a.g for n in body.node if n.op_type == "If" for a in n.attribute}
    outer_ops = [n.op_type for n in branches["query_blocks"].node]
    assert "MaskTable" in outer_ops and not {"Alibi", "AlibiKeyRow", "MaskFutureInTable"} & set(outer_ops)
    padding_if = next(n for n in branches["query_blocks"].node if n.op_type == "If")
    for branch in padding_if.attribute:
        ops = [n.op_type for n in branch.g.node[0].attribute[0].g.node]
        assert {"SliceByDistance", "AlibiKeyRow", "BlockAttendFolded"} <= set(ops), branch.g.name
        assert not {"BlockAttendMasked", "BlockAttend", "Alibi"} & set(ops), branch.g.name
        assert ("AddPaddingPenalty" in ops) == (branch.g.name == "blocks_padded")
    half = pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), arch="attention")
    pbe.export_onnx(half, tmp_path / "half.onnx", block=16, dtype="float16", check_growth=False)
    names = {f.name for f in onnx.load(str(tmp_path / "half.onnx")).functions}
    assert "BlockedAttentionAlibi" in names and "BlockedAttentionAlibiByDistance" not in names


def test_one_head_tables_get_the_whole_budget():
    """A table with one head (ALiBi's mask, a head-independent family) may take H times the
    rows of a per-head table: 256 rows at 16384 where KERPLE's [H, Bq, M] table gets 128."""
    alibi, window, kerple = (block_plan(bias_class(n)(8)) for n in ("alibi", "window", "kerple_log"))
    assert (alibi.table_heads, window.table_heads, kerple.table_heads) == (1, 1, 8)
    assert alibi.row_budget == window.row_budget == 8 * kerple.row_budget
    assert alibi.rows(256, 16384) == 256
    assert kerple.rows(256, 16384) == 128


def test_bidirectional_tables_keep_the_causal_rows():
    """A bidirectional table is 2 Lk wide (keys on both sides of each query): it gets twice the
    entries, so the same rows as a causal one (128 at 16384) instead of half."""
    causal, bidirectional = (block_plan(bias_class("kerple_log")(8, causal=c)) for c in (True, False))
    assert bidirectional.row_budget == 2 * causal.row_budget
    assert bidirectional.rows(256, 16384) == 128
    assert bidirectional.rows(256, 8192) == 256


def _export_core(tmp_path, bias, block, shape=SMALL, causal=True, **kwargs):
    cfg = pbe.ModelConfig(bias=bias, causal=causal, **shape)
    core = pbe.build_model(cfg, arch="attention")
    path = tmp_path / f"{bias}_core_{block}.onnx"
    pbe.export_onnx(core, path, block=block, check_growth=False, **kwargs)
    return core, path


def _reference(core, q, k, v, block):
    """float64 reference computed in blocks (the plain float64 form would not fit at 16k),
    and PyTorch float32 on the same inputs for the error budget."""
    settings = AttentionSettings(form="blocked", block=block)
    ref64 = torch_outputs(core, (q, k, v), torch.float64, settings)
    torch32 = torch_outputs(core, (q, k, v), torch.float32, settings)
    return ref64, torch32


@pytest.mark.parametrize("bias", tiers.families())
def test_exported_loop_matches_reference_across_block_boundaries(tmp_path, bias):
    """Block 16: lengths 1, 16 (one full block), 17 and 300 (a partial last block)."""
    core, path = _export_core(tmp_path, bias, 16)
    session = ort_session(path)
    for length in (1, 16, 17, 300):
        q, k, v = _qkv(2, SMALL["num_heads"], length, length, SMALL["dim"] // SMALL["num_heads"], seed=length,
                       dtype=torch.float32)
        got = session.run(None, {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()})[0]
        parity = compare(got, *_reference(core, q, k, v, 16), FLOAT32)
        assert parity.passed, f"L={length}: {parity}"


@pytest.mark.parametrize("bias", ["alibi", "kerple_log", "t5", "window"])
def test_reference_evaluator_runs_the_loop_as_functions_and_inlined(tmp_path, bias):
    """The ONNX reference evaluator (no ORT code) agrees: the Loop, its body's function calls
    and the inlined flat graph are standard ONNX."""
    core, path = _export_core(tmp_path, bias, 8)
    q, k, v = _qkv(1, SMALL["num_heads"], 21, 21, SMALL["dim"] // SMALL["num_heads"], seed=3, dtype=torch.float32)
    feeds = {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()}
    ref64, torch32 = _reference(core, q, k, v, 8)
    model = onnx.load(path)
    for form in (model, functions.inline(model)):
        got = ReferenceEvaluator(form).run(None, feeds)[0]
        parity = compare(got, ref64, torch32, FLOAT32)
        assert parity.passed, str(parity)


def test_causal_lm_export_defaults_to_blocked(exports):
    model = onnx.load(exports.cli("alibi", "lm", True))
    contract = FileContract.of(model)
    assert contract.attention == "blocked" and contract.attention_block == DEFAULT_BLOCK
    names = {f.name for f in model.functions}
    # positions are the indices: the table path, with ALiBi's key row folded into the MatMul; the
    # body's helpers are inlined into it (export/hoist.py), the family's own function stays named
    assert {"BlockedAttentionAlibiByDistance", "AlibiKeyRow"} <= names
    assert "Alibi" not in names  # the key-row shortcut replaces the full bias function under the causal mask
    blocked_fn = next(f for f in model.functions if f.name == "BlockedAttentionAlibiByDistance")
    # an If picks the Loop over blocks, or (queries fit one block: decode) the same math direct
    assert blocked_fn.node[-1].op_type == "If"
    assert {"Loop", "AlibiKeyRow", "MatMul", "Softmax"} <= {n.op_type for n in functions.all_nodes(blocked_fn.node)}
    # the bias lives inside the loop, built per block: no whole-length bias node in the graph
    assert not any(n.op_type == "Alibi" for n in model.graph.node)


def test_bidirectional_defaults_to_blocked_and_plain_on_request(exports):
    assert FileContract.of_path(exports.cli("alibi", "lm", False)).attention == "blocked"
    for path in (exports.cli("alibi", "lm", False, ("--attention", "plain")),
                 exports.cli("alibi", "lm", True, ("--attention", "plain"))):
        model = onnx.load(path)
        assert FileContract.of(model).attention == "plain"
        assert not any(f.name.startswith("BlockedAttention") for f in model.functions)


@pytest.mark.parametrize("kwargs, message", [
    (dict(attention="blocked", opset=23), "opset 23"),
    (dict(attention="fast"), "attention form must be one of"),
    (dict(block=0), "block must be a positive integer"),
], ids=["blocked-opset23", "unknown-form", "block-0"])
def test_bad_attention_options(tmp_path, kwargs, message):
    model = pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL))
    with pytest.raises(ValueError, match=message):
        pbe.export_onnx(model, tmp_path / "x.onnx", **kwargs)
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("bias", tiers.families())
def test_bidirectional_blocked_export_matches_plain_float64(tmp_path, bias):
    """--bidirectional --attention blocked: every query block sees every key (a symmetric
    window only its reach), no causal mask. Judged against the PLAIN float64 form (an
    independent computation), on ORT and the reference evaluator, across block boundaries."""
    core, path = _export_core(tmp_path, bias, 16, causal=False, attention="blocked")
    model = onnx.load(path)
    assert FileContract.of(model).attention == "blocked"
    assert any(f.name.startswith("BlockedAttention") for f in model.functions)
    session = ort_session(path)
    plain = AttentionSettings(form="plain")
    for length in (1, 17, 300):
        q, k, v = _qkv(2, SMALL["num_heads"], length, length, SMALL["dim"] // SMALL["num_heads"], seed=length,
                       dtype=torch.float32)
        ref64 = torch_outputs(core, (q, k, v), torch.float64, plain)
        torch32 = torch_outputs(core, (q, k, v), torch.float32, plain)
        feeds = {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()}
        got = session.run(None, feeds)[0]
        assert compare(got, ref64, torch32, FLOAT32).passed, f"L={length}: {compare(got, ref64, torch32, FLOAT32)}"
        if length == 17:
            evaluated = ReferenceEvaluator(model).run(None, feeds)[0]
            assert compare(evaluated, ref64, torch32, FLOAT32).passed


def test_bidirectional_blocked_lm_with_left_padding(tmp_path):
    """A T5-style bidirectional LM in the blocked form with an attention_mask: equal to the
    plain float64 model on every real token."""
    model = pbe.build_model(pbe.ModelConfig(bias="t5", causal=False, **SMALL))
    ids = lm_inputs(2, 41, seed=5)
    mask = torch.ones(2, 41, dtype=torch.int64)
    mask[0, :7] = 0
    plain = AttentionSettings(form="plain")
    ref64 = torch_outputs(model, (ids, mask), torch.float64, plain)
    torch32 = torch_outputs(model, (ids, mask), torch.float32, plain)
    pbe.export_onnx(model, tmp_path / "m.onnx", attention="blocked", block=8, attention_mask=True, check_growth=False)
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    real = mask.numpy().astype(bool)
    got = ort_session(tmp_path / "m.onnx").run(None, feeds)[0]
    parity = compare(got[real], ref64[real], torch32[real], FLOAT32)
    assert parity.passed, str(parity)
    # OpenVINO (inlined file): it runs int64 index arithmetic in int32, which once wrapped the
    # "all keys" reach (2^40) and failed every bidirectional blocked file
    openvino = pytest.importorskip("openvino")
    pbe.export_onnx(model, tmp_path / "flat.onnx", attention="blocked", block=8, attention_mask=True,
                    inline_functions=True, check_growth=False)
    compiled = openvino.Core().compile_model(str(tmp_path / "flat.onnx"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    got = compiled(feeds)[0]
    parity = compare(got[real], ref64[real], torch32[real], FLOAT32)
    assert parity.passed, str(parity)


def test_lm_blocked_and_plain_exports_with_left_padding(tmp_path):
    """Whole LM with an attention_mask (batched positions) and block 5: each form within the
    parity budget of the float64 model run in the same form, and the two forms agree on every
    real token. (Fully padded query rows see no key; each form returns its own arbitrary
    average there, which nothing downstream reads.)"""
    model = pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL))
    ids = lm_inputs(2, 23, seed=4)
    mask = torch.ones(2, 23, dtype=torch.int64)
    mask[0, :6] = 0
    outputs = {}
    for form in ("blocked", "plain"):
        settings = AttentionSettings(form=form, block=5)
        ref64 = torch_outputs(model, (ids, mask), torch.float64, settings)
        torch32 = torch_outputs(model, (ids, mask), torch.float32, settings)
        path = tmp_path / f"{form}.onnx"
        pbe.export_onnx(model, path, attention=form, block=5, attention_mask=True, check_growth=False)
        got = ort_session(path).run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
        parity = compare(got, ref64, torch32, FLOAT32)
        assert parity.passed, f"{form}: {parity}"
        outputs[form] = got
    real = mask.numpy().astype(bool)
    np.testing.assert_allclose(outputs["blocked"][real], outputs["plain"][real], rtol=1e-4, atol=2e-5)


def _long_parity(tmp_path, bias, length):
    core, path = _export_core(tmp_path, bias, DEFAULT_BLOCK, BENCH_SHAPE)
    q, k, v = _qkv(1, 8, length, length, 64, seed=length, dtype=torch.float32)
    got = ort_session(path).run(None, {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()})[0]
    parity = compare(got, *_reference(core, q, k, v, DEFAULT_BLOCK), FLOAT32)
    assert parity.passed, str(parity)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("bias", tiers.families())
def test_ort_blocked_at_4096_bench_shape(tmp_path, bias):
    """H=8, d=64 at 4096 (256x the trace length) vs the float64 blocked reference."""
    _long_parity(tmp_path, bias, 4096)


@pytest.mark.slow
@pytest.mark.parametrize("bias", pbe.BIASES)
def test_ort_blocked_at_16384_bench_shape(tmp_path, bias):
    """Every bias at L=16384 on this machine: the plain form would hold 8.6 GB of scores."""
    _long_parity(tmp_path, bias, 16384)


def test_keep_mask_shapes():
    assert keep_mask(None, 7).shape == (1, 1, 1, 7)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert keep_mask(mask, 3).tolist() == [[[[False, True, True]]], [[[True, True, True]]]]



def test_distance_table_rows_follow_the_budget():
    """Rows per block on the table path: budget // table width (causal: Lk; bidirectional: 2 Lk;
    a symmetric window: Lk + its reach), at least 1, at most the block."""
    def rows(lookahead, length):
        plan = dataclasses.replace(block_plan(bias_class("kerple_log")(8)), lookahead=lookahead, row_budget=TABLE_ROW_BUDGET)
        return plan.rows(256, length)
    assert [rows(0, n) for n in (1024, 8192, 16384, 32768)] == [256, 256, 128, 64]
    assert [rows(None, n) for n in (8192, 16384)] == [128, 64]
    assert rows(100, 16384) == (1 << 21) // 16484
    assert rows(None, 1 << 23) == 1


@pytest.mark.parametrize("causal", [True, False])
def test_distance_table_rows_are_capped_by_the_budget(tmp_path, monkeypatch, as_built, causal):
    """Long inputs: the table path takes budget // width query rows per block (memory), here
    2000 // 300 = 6 (bidirectional: twice the budget over twice the width, 4000 // 600 = 6)
    instead of 16, in the ONNX Loop and its PyTorch twin alike; the output is the same math."""
    import posbias_export.nn.plans as plans

    monkeypatch.setattr(plans, "TABLE_ROW_BUDGET", 2000)  # the ONNX body and the twin read it through the plan
    core, path = _export_core(tmp_path, "kerple_log", 16, causal=causal)
    body = next(f for f in onnx.load(str(path)).functions if f.name == "BlockedAttentionKerpleLogByDistance")
    budget = [n for n in body.node if n.op_type == "If"][0]
    assert "row_budget" in str(budget)
    q, k, v = _qkv(2, SMALL["num_heads"], 300, 300, SMALL["dim"] // SMALL["num_heads"], seed=3, dtype=torch.float32)
    got = ort_session(path).run(None, {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()})[0]
    parity = compare(got, *_reference(core, q, k, v, 16), FLOAT32)
    assert parity.passed, str(parity)


NEAR_FAR = dict(bias_params={"max_distance": 20, "num_buckets": 16})  # T5's constant from 20 on: far keys in short inputs


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_near_far_blocks_match_float64(tmp_path, causal):
    """T5's bias is one constant per side from max_distance on (AttentionBias.far_distance): each
    block adds it inside the MatMul for the keys that far from all its queries and slices a table
    of the near keys for the rest (NearFarScores). Blocks of 8 rows, max_distance 20: lengths
    where the far keys are none (1, 8, 9), on one side (29), and on both sides of most blocks (60,
    bidirectional), on ONNX Runtime and the reference evaluator (the function form and inlined),
    judged against the float64 model by the float32 policy."""
    core, path = _export_core(tmp_path, "t5", 8, shape={**SMALL, **NEAR_FAR}, causal=causal)
    assert block_plan(core.bias, indices=True).far == 20
    session, model = ort_session(path), onnx.load(path)
    for length in (1, 8, 9, 29, 60):
        q, k, v = _qkv(2, SMALL["num_heads"], length, length, SMALL["dim"] // SMALL["num_heads"], seed=length,
                       dtype=torch.float32)
        feeds = {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()}
        ref64, torch32 = _reference(core, q, k, v, 8)
        runs = {"ort": session.run(None, feeds)[0]}
        if length in (9, 60):
            runs.update(reference=ReferenceEvaluator(model).run(None, feeds)[0],
                        inlined=ReferenceEvaluator(functions.inline(model)).run(None, feeds)[0])
        for name, got in runs.items():
            parity = compare(got, ref64, torch32, FLOAT32)
            assert parity.passed, f"{name} L={length}: {parity}"


def test_near_far_t5_encoder_with_padding_equals_transformers(tmp_path):
    """The near-far body with a key mask (transformers' T5 layers pass index positions and a
    padding mask: the padded Loop adds the penalty to the joined scores): a tiny T5 encoder
    (max_distance 20) exported in blocks of 8 rows, validated on left-padded batches of 40 and 61
    tokens against transformers and our float64 model."""
    from hf_folders import save_tiny_model
    from posbias_export.hf.export import export_model
    from posbias_export.validation import validate

    pytest.importorskip("transformers")
    folder = save_tiny_model("t5", tmp_path / "t5")
    path = tmp_path / "t5.onnx"
    export_model(folder, path, block=8, check_growth=False)
    result = validate([path], ["ort-cpu"], (40, 61), batch=3, model_dir=folder, order=False)
    assert result.ok, [(c.runtime, c.case, c.verdict) for c in result.matrices[0].cells if not c.ok]
    assert "transformers" in {c.runtime for c in result.matrices[0].cells}
