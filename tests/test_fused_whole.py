"""The GPU targets' fused whole-sequence path (BlockPlan.whole): ALiBi as query/key features and
`none` as a plain causal call, with no bias tensor and no Loop, checked on ONNX Runtime CPU
(which implements com.microsoft.MultiHeadAttention and ONNX Attention) against float64.

The features must be exact where the issue's measurements say they can be (the float16 high and
low parts of slope * position), as accurate as the bias-tensor design at 4096 tokens, and each
check must fail when the split is broken: one feature instead of two parts, or the features
placed after q. Padded batches and decode steps stay on the blocked path; a whole path that
ignored padding fails the padded test."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnxscript import BOOL, FLOAT, INT64, script
from onnxscript import opset18 as op

import posbias_export as pbe
from posbias_export.biases.alibi import alibi_slopes
from posbias_export.biases.onnx_domain import posbias
from posbias_export.export.targets.gpu_script import HalfParts, SlopeParts
from posbias_export.nn import block_plan, plans
from posbias_export.nn.attention import AttentionSettings
from posbias_export.parity import FLOAT16, FLOAT32, compare, torch_outputs
from conftest import ort_session

HEADS, HEAD_DIM = 8, 64


# --- the feature split -------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [8, 12])
def test_float16_parts_hold_slope_times_position(heads):
    """hi and lo are float16 values; hi + lo is m*j exactly for power-of-two head counts (the
    slopes are powers of two) and to 2^-22 of its size otherwise, up to 16384 tokens."""
    pos = np.arange(16384, dtype=np.int64)
    slopes = alibi_slopes(heads).numpy()
    hi, lo = HalfParts(*SlopeParts(pos, slopes))
    hi16, lo16 = hi.astype(np.float16), lo.astype(np.float16)
    assert np.array_equal(hi16.astype(np.float32), hi)  # hi is float16 already
    exact = np.float64(2.0) ** (-8.0 * np.arange(1, heads + 1) / heads) if heads == 8 else slopes.astype(np.float64)
    want = exact[:, None] * pos  # [H, L]
    got = hi16.astype(np.float64) + lo16.astype(np.float64)
    if heads == 8:
        assert np.array_equal(got, want)
    else:
        assert np.abs(got - want).max() <= 2.0 ** -22 * want.max()
    # one float16 feature is what fails: 1-2 units off at 4096 tokens
    assert np.abs(want.astype(np.float16).astype(np.float64) - want)[:, :4096].max() >= 0.5


def test_float32_high_part_products_are_exact():
    """SlopeParts' high part keeps 8 significant bits, so hi * j is exact in float32 below 2^16."""
    pos = np.arange(0, 65536, 7, dtype=np.int64)
    slopes = alibi_slopes(12).numpy()
    a, b = SlopeParts(pos, slopes)
    hi = a[:, 1] / np.float32(7)  # [H] the high part of each slope
    assert np.array_equal(a.astype(np.float64), hi.astype(np.float64)[:, None] * pos)
    assert np.abs(a.astype(np.float64) + b - slopes.astype(np.float64)[:, None] * pos).max() < 2e-6


# --- the plan ----------------------------------------------------------------------------------
def test_plan_chooses_the_whole_path_per_family():
    whole = {name: block_plan(pbe.create_bias(name, 4), fused=True).whole for name in pbe.BIASES}
    assert whole.pop("alibi") == "features" and whole.pop("none") == "plain"
    assert set(whole.values()) == {None}  # float32: a window, a table, a learned bias take the blocked path
    assert block_plan(pbe.create_bias("window", 4), fused=True, dtype=torch.float16).whole == "window"
    assert block_plan(pbe.create_bias("window", 4, causal=False), fused=True, dtype=torch.float16).whole is None
    assert block_plan(pbe.create_bias("alibi", 4, causal=False), fused=True).whole is None  # -m|i-j| is not rank 2
    assert block_plan(pbe.create_bias("alibi", 4), fused=False).whole is None  # portable: no fused op


# --- parity and sabotage -----------------------------------------------------------------------
def _inputs(core, length, dtype, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads, head_dim = core.cfg.num_heads, core.cfg.head_dim
    # float16-representable values in either dtype, so both files see the same numbers
    return [torch.randn(batch, heads, length, head_dim, generator=g).half().to(dtype) for _ in range(3)]


@pytest.fixture(scope="module")
def alibi_core():
    return pbe.build_model(pbe.ModelConfig(bias="alibi", num_heads=HEADS, dim=HEADS * HEAD_DIM), arch="attention")


@pytest.fixture(scope="module")
def narrow_alibi_core():
    """8 heads (slopes 2^-1 .. 2^-8, as the issue measured) with small heads: the features' error
    does not depend on the head size, the run time does."""
    return pbe.build_model(pbe.ModelConfig(bias="alibi", num_heads=HEADS, dim=HEADS * 16), arch="attention")


def _export(core, path, dtype, whole=True, monkeypatch=None):
    if not whole:
        monkeypatch.setattr(plans, "_whole_path", lambda bias, dtype: None)
    pbe.export_onnx(core, path, dtype=dtype, check_growth=False, target="cuda-ort")
    return path


def _judge(core, length, dtype):
    """A function judging a file on one input (the references computed once for every file)."""
    q, k, v = _inputs(core, length, torch.float16 if dtype == "float16" else torch.float32)
    plain = AttentionSettings(form="plain")
    ref64 = torch_outputs(core, (q, k, v), torch.float64, plain)
    same = torch_outputs(core, (q, k, v), getattr(torch, dtype), plain)
    feeds = {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()}
    return lambda path: compare(ort_session(path).run(None, feeds)[0], ref64, same,
                                FLOAT16 if dtype == "float16" else FLOAT32)


def _sabotaged(monkeypatch, replacement):
    """Exports from here on carry one posbias helper function with another body (a sabotaged
    feature layout); the export inlines it into the blocked body as it does the real one."""
    from posbias_export.export import functions

    real = functions.library
    proto = replacement.to_function_proto()
    monkeypatch.setattr(functions, "library", lambda: {**real(), proto.name: proto})


@script(posbias, default_opset=op)
def SlopeFeatures(q_hi: FLOAT, q_lo: FLOAT, k_hi: FLOAT, k_lo: FLOAT):
    """Sabotage: ONE feature per side (m j and -m i whole, float16-rounded in a float16 file)."""
    q_one = op.Unsqueeze(op.ConstantOfShape(op.Shape(q_hi), value=[1.0]), [-1])
    k_one = op.Unsqueeze(op.ConstantOfShape(op.Shape(k_hi), value=[1.0]), [-1])
    zero_q, zero_k = op.Mul(q_one, op.Constant(value_float=0.0)), op.Mul(k_one, op.Constant(value_float=0.0))
    q_feat = op.Concat(q_one, op.Unsqueeze(op.Neg(op.Add(q_hi, q_lo)), [-1]), zero_q, zero_q, axis=-1)
    k_feat = op.Concat(op.Unsqueeze(op.Add(k_hi, k_lo), [-1]), k_one, zero_k, zero_k, axis=-1)
    return q_feat, k_feat


@script(posbias, default_opset=op)
def PrependFeatures(x: FLOAT, feat: FLOAT, width: INT64) -> FLOAT:
    """Sabotage: the features AFTER x (large terms added once q.k has accumulated)."""
    n = op.Shape(feat, start=-1)
    typed = op.CastLike(op.Expand(feat, op.Concat(op.Shape(x, end=-1), n, axis=0)), x)
    pads = op.Concat(op.Constant(value_ints=[0]), op.Sub(op.Reshape(width, [1]), n), axis=0)
    return op.Concat(x, op.Pad(typed, pads, None, [-1]), axis=-1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_features_match_the_bias_tensor_design_at_4096(tmp_path, monkeypatch, alibi_core, dtype):
    """ALiBi's features pass the parity policy at 4096 and are no worse than the blocked bias
    tensor design (exported with the whole path off) on the same float16-valued inputs."""
    judge = _judge(alibi_core, 4096, dtype)
    features = judge(_export(alibi_core, tmp_path / "f.onnx", dtype))
    tensor = judge(_export(alibi_core, tmp_path / "t.onnx", dtype, False, monkeypatch))
    assert features.passed and tensor.passed, (features, tensor)
    assert features.max_abs <= 1.5 * tensor.max_abs + 1e-7, (features, tensor)


@pytest.mark.parametrize("dtype, sabotage, length", [("float16", SlopeFeatures, 4096),
                                                      ("float32", PrependFeatures, 2048)],
                         ids=["one-feature", "features-after-q"])
def test_a_broken_feature_split_fails(tmp_path, monkeypatch, narrow_alibi_core, dtype, sabotage, length):
    core = narrow_alibi_core
    path, judge = _export(core, tmp_path / "f.onnx", dtype), _judge(core, length, dtype)
    assert judge(path).passed
    _sabotaged(monkeypatch, sabotage)
    broken = judge(_export(core, tmp_path / "broken.onnx", dtype))
    assert not broken.passed, broken


@script(posbias, default_opset=op)
def WholeSequence(q: FLOAT, k: FLOAT, keep: BOOL) -> BOOL:
    """Sabotage: the whole path for every input with as many queries as keys, padded or not."""
    return op.Squeeze(op.Equal(op.Shape(q, start=2, end=3), op.Shape(k, start=2, end=3)))


@pytest.mark.parametrize("bias", ["alibi", "none"])
def test_padded_batches_stay_on_the_blocked_path(tmp_path, monkeypatch, bias):
    """An LM file with attention_mask: an unpadded batch takes the whole path, a left-padded one
    the blocked path; both match float64, and a whole path that ignored padding fails."""
    from posbias_export.parity.reference import generated_inputs, reference_model, torch_args
    from posbias_export.export import attention_settings_of, read_contract

    path = tmp_path / "lm.onnx"
    model = pbe.build_model(pbe.ModelConfig(bias=bias, num_heads=4, dim=64, num_layers=1, vocab_size=64))
    pbe.export_onnx(model, path, check_growth=False, target="cuda-ort", attention_mask=True)
    contract = read_contract(onnx.load(path))
    reference, settings = reference_model(contract), attention_settings_of(contract)
    unpadded = generated_inputs(contract, 40, 3, seed=1)
    mask = np.ones_like(unpadded["attention_mask"])
    mask[1, :5], mask[2, :11] = 0, 0  # left padding
    padded = {**unpadded, "attention_mask": mask}

    def verdict(file, feeds):
        got = ort_session(file).run(None, feeds)[0]
        args = torch_args(contract, feeds)
        keep = feeds["attention_mask"].astype(bool)  # padded positions' logits are not compared
        ref = torch_outputs(reference, args, torch.float64, settings)
        same = torch_outputs(reference, args, torch.float32, settings)
        return compare(got[keep], ref[keep], same[keep], FLOAT32)

    assert verdict(path, unpadded).passed and verdict(path, padded).passed
    _sabotaged(monkeypatch, WholeSequence)
    broken = tmp_path / "broken.onnx"
    pbe.export_onnx(model, broken, check_growth=False, target="cuda-ort", attention_mask=True)
    assert verdict(broken, unpadded).passed  # the sabotage changes nothing where there is no padding
    assert not verdict(broken, padded).passed


def _set_window(path, out, delta):
    """The file with GroupQueryAttention's local_window_size moved by `delta` (sabotage)."""
    model = onnx.load(path)

    def walk(graph_nodes):
        for node in graph_nodes:
            if node.op_type == "GroupQueryAttention":
                next(a for a in node.attribute if a.name == "local_window_size").i += delta
                return True
            if any(walk(a.g.node) for a in node.attribute if a.type == onnx.AttributeProto.GRAPH):
                return True
        return False

    assert any(walk(f.node) for f in model.functions), "no GroupQueryAttention in the file"
    onnx.save(model, out)
    return out


def test_float16_window_uses_the_local_window_op(tmp_path):
    """--target cuda-ort, float16, window 16: GroupQueryAttention's local window over the whole
    sequence matches float64 at 1, 17 and 300 tokens; one key more or less fails."""
    core = pbe.build_model(pbe.ModelConfig(bias="window", num_heads=4, dim=128, bias_params={"window": 16}),
                           arch="attention")
    path = tmp_path / "w.onnx"
    pbe.export_onnx(core, path, dtype="float16", check_growth=False, target="cuda-ort")
    plain = AttentionSettings(form="plain")

    def passes(file, length):
        g = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(2, 4, length, 32, generator=g).half() for _ in range(3))
        got = ort_session(file).run(None, {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()})[0]
        ref = torch_outputs(core, (q, k, v), torch.float64, plain)
        return compare(got, ref, torch_outputs(core, (q, k, v), torch.float16, plain), FLOAT16).passed

    assert all(passes(path, n) for n in (1, 17, 300))
    assert not passes(_set_window(path, tmp_path / "wider.onnx", +1), 300)
    assert not passes(_set_window(path, tmp_path / "narrower.onnx", -1), 300)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("target", ["cuda", "cuda-ort"])
def test_no_bias_is_one_plain_fused_call(tmp_path, target, causal):
    """none: the fused op's own causal mask (or none) over the whole sequence, on both GPU targets."""
    core = pbe.build_model(pbe.ModelConfig(bias="none", causal=causal, num_heads=4, dim=128), arch="attention")
    path = tmp_path / "none.onnx"
    pbe.export_onnx(core, path, check_growth=False, target=target)
    session, plain = ort_session(path), AttentionSettings(form="plain")
    for length in (1, 17, 300):
        g = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(2, 4, length, 32, generator=g) for _ in range(3))
        got = session.run(None, {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()})[0]
        parity = compare(got, torch_outputs(core, (q, k, v), torch.float64, plain),
                         torch_outputs(core, (q, k, v), torch.float32, plain), FLOAT32)
        assert parity.passed, f"L={length}: {parity}"
