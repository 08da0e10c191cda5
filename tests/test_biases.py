"""Each bias module against an independent float64 implementation of its paper's formula."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posbias_export as pbe
from posbias_export.biases import FLOAT32_LOWEST, bias_class
from posbias_export.biases.onnx_domain import DOMAIN

SHAPES = [(1, 1), (1, 17), (17, 17), (5, 40), (40, 40), (1, 1024), (300, 1024)]  # (q_len, k_len)
shape_ids = [f"q{q}-k{k}" for q, k in SHAPES]


def positions(q_len, k_len):
    """The convention: keys at 0..Lk-1, queries the last Lq of them."""
    return np.arange(k_len - q_len, k_len), np.arange(k_len)


SHIPPED = ("alibi", "kerple_power", "kerple_log", "sandwich", "t5", "window", "none")


def test_registry_names():
    """The shipped families are registered in rank order; another family (a copied file) joins
    by its own rank without displacing them, and ALiBi stays the default."""
    assert [n for n in pbe.BIASES if n in SHIPPED] == list(SHIPPED)
    ranks = [(bias_class(n).rank, n) for n in pbe.BIASES]
    assert ranks == sorted(ranks) and len(set(pbe.BIASES)) == len(pbe.BIASES)
    assert pbe.BIASES[0] == "alibi"


def test_unknown_bias_lists_choices():
    with pytest.raises(ValueError, match="choose one of: " + ", ".join(pbe.BIASES) + "$"):
        pbe.create_bias("alibix", num_heads=4)


def test_unknown_option_is_value_error():
    with pytest.raises(ValueError, match="bias 'sandwich' has no hyper-parameter 'window'; it takes: sin_dim"):
        pbe.create_bias("sandwich", num_heads=4, window=3)


# --- ALiBi -------------------------------------------------------------------------------
@pytest.mark.parametrize("num_heads", range(1, 65))
def test_alibi_slopes_match_paper(num_heads):
    """Paper: geometric 2^(-8h/n); non-powers of two interleave from the 2n series."""
    got = pbe.alibi_slopes(num_heads).double().numpy()
    p = 2 ** math.floor(math.log2(num_heads))
    expected = [2 ** (-8 * h / p) for h in range(1, p + 1)]
    expected += [2 ** (-8 * h / (2 * p)) for h in range(1, 2 * p, 2)][: num_heads - p]
    np.testing.assert_allclose(got, expected, rtol=1e-7)  # float32 storage of exact powers of 2^(1/n)


@pytest.mark.parametrize("num_heads", range(1, 65))
def test_alibi_slopes_match_bloom(num_heads):
    """Peer library: Hugging Face BLOOM's build_alibi_tensor gives slope_h * position."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    mask = torch.ones(1, 3)
    bloom = build_alibi_tensor(mask, num_heads, torch.float32).view(num_heads, 3)  # slope * [0, 1, 2]
    np.testing.assert_allclose(bloom[:, 1].numpy(), pbe.alibi_slopes(num_heads).numpy(), rtol=1e-6)


@pytest.mark.parametrize("q_len,k_len", SHAPES, ids=shape_ids)
@pytest.mark.parametrize("num_heads", [1, 6, 8, 12])
def test_alibi_bias_vs_fp64(num_heads, q_len, k_len):
    bias = pbe.create_bias("alibi", num_heads)
    got = bias(q_len, k_len).double().numpy()
    ref = bias.reference(*positions(q_len, k_len))
    # float32 slope times an exact integer distance: relative error <= 2^-24 twice
    np.testing.assert_allclose(got, ref, rtol=2.5e-7, atol=0)


def test_alibi_shape_and_queries_are_last_positions():
    b = pbe.create_bias("alibi", 4)(3, 10)
    assert b.shape == (4, 3, 10)
    assert torch.all(b[:, -1, -1] == 0) and torch.all(b[:, 0, 7] == 0)  # query 0 sits at key 7


# --- KERPLE --------------------------------------------------------------------------------
@pytest.mark.parametrize("q_len,k_len", SHAPES, ids=shape_ids)
@pytest.mark.parametrize("variant", ["kerple_power", "kerple_log"])
def test_kerple_vs_fp64(variant, q_len, k_len):
    mod = pbe.create_bias(variant, 6, seed=3)
    got = mod(q_len, k_len).detach().double().numpy()
    ref = mod.reference(*positions(q_len, k_len))
    # float32 pow/log: a few ulps relative, judged on the largest magnitude present
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(ref).max()))


raw = st.floats(allow_nan=False, allow_infinity=False, width=32)  # every finite float32


@settings(max_examples=200, deadline=None)
@given(a=raw, b=raw, variant=st.sampled_from(["kerple_power", "kerple_log"]))
def test_kerple_constraints_hold_for_any_raw_values(a, b, variant):
    mod = pbe.create_bias(variant, 2)
    with torch.no_grad():
        mod.raw_r1.fill_(a)
        mod.raw_r2.fill_(b)
    r1, r2 = mod.r1(), mod.r2()
    assert torch.all(r1 > 0) and torch.all(torch.isfinite(r1))
    assert torch.all(r2 > 0) and torch.all(torch.isfinite(r2))
    if variant == "kerple_power":
        assert torch.all(r2 <= 2)
    bias = mod(3, 50)  # may reach -inf for r1 near float32 max; never NaN, never positive
    assert not torch.isnan(bias).any() and torch.all(bias <= 0)


@pytest.mark.parametrize("variant", ["kerple_power", "kerple_log"])
def test_kerple_state_dict_holds_natural_values_and_round_trips(variant):
    mod = pbe.create_bias(variant, 3, seed=1)
    state = mod.state_dict()
    assert set(state) == {"r1", "r2"}
    torch.testing.assert_close(state["r1"], mod.r1().detach())
    other = pbe.create_bias(variant, 3, seed=9)
    other.load_state_dict(state)
    torch.testing.assert_close(other.r1(), mod.r1(), rtol=1e-6, atol=0)
    torch.testing.assert_close(other.r2(), mod.r2(), rtol=1e-6, atol=0)


def test_kerple_power_rejects_r2_above_two():
    mod = pbe.create_bias("kerple_power", 2)
    with pytest.raises(ValueError, match="r2 <= 2"):
        mod.load_state_dict({"r1": torch.tensor([1.0, 1.0]), "r2": torch.tensor([1.0, 2.5])})
    with pytest.raises(ValueError, match="r1 > 0"):
        mod.load_state_dict({"r1": torch.tensor([0.0, 1.0]), "r2": torch.tensor([1.0, 1.0])})


# --- Sandwich ------------------------------------------------------------------------------
@pytest.mark.parametrize("q_len,k_len", SHAPES, ids=shape_ids)
@pytest.mark.parametrize("sin_dim", [16, 128])
def test_sandwich_vs_fp64(sin_dim, q_len, k_len):
    bias = pbe.create_bias("sandwich", 8, sin_dim=sin_dim)
    got = bias(q_len, k_len).double().numpy()
    ref = bias.reference(*positions(q_len, k_len))  # via sum_k cos((i-j) w_k)
    # float32 angles t*w_k carry abs error ~ t * 2^-24 each; summed over sum_k w_k (< 8)
    # frequencies, twice (sin and cos tables), times lambda_max = 1: ~1e-6 per position.
    atol = 1e-6 * k_len * 8 * 2 + 1e-5
    np.testing.assert_allclose(got, ref, rtol=0, atol=atol)


def test_sandwich_error_follows_the_distance_not_the_position():
    """The bias is evaluated per distance (integer offsets before any float32 rounding), so far
    from position 0 its values are those of the same distances near 0, bit for bit, and near
    the diagonal stay within float32 rounding of a d'-term dot product worth at most d'/2 = 64
    (~1e-4; 2e-5 measured). The product of position tables made 9e-3 there at position 50000.
    Far off the diagonal the angle's float32 rounding bounds it: 2^-24 (d + SPLIT) sum_k w_k
    per table, twice."""
    from posbias_export.biases.sandwich import SPLIT

    bias = pbe.create_bias("sandwich", 8)
    errors = []
    for base in (0, 50000):
        q_pos, k_pos = np.arange(base + 1000, base + 1040), np.arange(base, base + 1040)
        got = bias.from_positions(torch.from_numpy(q_pos), torch.from_numpy(k_pos)).double().numpy()
        errors.append(np.abs(got - bias.reference(q_pos, k_pos)))  # [H, 40, 1040]
    np.testing.assert_array_equal(errors[0], errors[1])
    distance = np.abs(np.arange(1000, 1040)[:, None] - np.arange(1040)[None, :])  # [40, 1040]
    assert errors[1][:, distance < 64].max() < 1e-4
    frequencies = bias.frequencies.double().numpy()
    assert (errors[1] <= 2 * 2.0 ** -24 * (distance + SPLIT) * frequencies.sum() + 1e-4).all()


def test_sandwich_is_zero_on_diagonal_and_negative_elsewhere():
    b = pbe.create_bias("sandwich", 4)(32, 32)
    assert torch.allclose(torch.diagonal(b, dim1=-2, dim2=-1), torch.zeros(4, 32), atol=1e-5)
    assert torch.all(b <= 1e-5)


# --- T5 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidir", "causal"])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 64), (64, 256), (8, 20)])
def test_t5_buckets_equal_transformers(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-5000, 5001)
    ours = pbe.t5_relative_bucket(rel, bidirectional, num_buckets, max_distance)
    theirs = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("q_len,k_len", SHAPES, ids=shape_ids)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_t5_bias_is_embedding_of_transformers_bucket(causal, q_len, k_len):
    from transformers.models.t5.modeling_t5 import T5Attention

    mod = pbe.create_bias("t5", 4, causal=causal)
    i = torch.arange(k_len - q_len, k_len)[:, None]
    j = torch.arange(k_len)[None]
    buckets = T5Attention._relative_position_bucket(j - i, not causal, 32, 128)  # j - i, as T5
    ref = mod.relative_attention_bias.weight.detach()[buckets].permute(2, 0, 1)  # [H, Lq, Lk]
    assert torch.equal(mod(q_len, k_len).detach(), ref)
    # the oracle (exact integer bucket thresholds in numpy) agrees with transformers too
    np.testing.assert_array_equal(mod.reference(*positions(q_len, k_len)), ref.double().numpy())


# --- Window ----------------------------------------------------------------------------------
@pytest.mark.parametrize("q_len,k_len", SHAPES, ids=shape_ids)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_window_vs_reference(causal, q_len, k_len):
    bias = pbe.create_bias("window", 4, causal=causal, window=7)
    got = bias(q_len, k_len).double().numpy()
    assert got.shape == (1, q_len, k_len)
    np.testing.assert_array_equal(got, bias.reference(*positions(q_len, k_len)))


def test_window_counts_the_query_itself():
    b = pbe.create_bias("window", 1, window=3)(1, 10)[0, 0]
    assert (b == 0).nonzero().flatten().tolist() == [7, 8, 9]


def test_none_is_zero():
    assert torch.count_nonzero(pbe.create_bias("none", 4)(5, 9)) == 0


@pytest.mark.parametrize("name", pbe.BIASES)
def test_batched_positions_match_per_row(name):
    """from_positions with [B, L] positions (padding) equals the unbatched bias per row."""
    mod = pbe.create_bias(name, 4)
    q = torch.stack([torch.arange(3, 8), torch.arange(0, 5)])  # [2, 5]
    k = torch.stack([torch.arange(0, 8), torch.arange(-3, 5)])  # [2, 8]
    batched = mod.from_positions(q, k)
    for row in range(2):
        torch.testing.assert_close(batched[row], mod.from_positions(q[row], k[row]))


# --- every registered family: its declarations hold --------------------------------------------
def _finite_scale(ref: np.ndarray) -> float:
    """The largest magnitude that is a bias value, not a mask (masks use the float32 lowest)."""
    values = np.abs(ref[np.abs(ref) < 1e30])
    return max(1.0, float(values.max()) if values.size else 1.0)


@pytest.mark.parametrize("q_len,k_len", [(1, 1), (1, 17), (17, 17), (5, 40), (40, 40)], ids=lambda s: str(s))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", pbe.BIASES)
def test_family_matches_its_float64_oracle(name, causal, q_len, k_len):
    """from_positions (float32) against the family's reference (float64, the paper's formula).
    Short distances (<= 40): float32 evaluation errs by a few ulps of the largest value present
    (Sandwich: a sum of d'/2 cosines of angles up to 40, ~3e-4 absolute of values up to 64)."""
    bias = pbe.create_bias(name, 6, causal=causal, seed=2)
    got = bias(q_len, k_len).detach().double().numpy()
    ref = bias.reference(*positions(q_len, k_len))
    assert got.shape == ref.shape == (bias.output_heads, q_len, k_len)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * _finite_scale(ref))


@pytest.mark.parametrize("name", pbe.BIASES)
def test_family_declarations(name):
    """What a family says about itself is true of its oracle, over a span past every
    hyper-parameter's default (AttentionBias.reach): symmetry, relative (positions shifted by
    twice the reach leave it unchanged), look-back, head axis, learned tensors, and a
    FunctionProto per ONNX function named after the family."""
    cls = bias_class(name)
    span = np.arange(cls.reach() + 1)  # past every hyper-parameter's default distance
    bias = pbe.create_bias(name, 4, causal=False)
    square = bias.reference(span, span)  # [H|1, N, N]
    assert np.array_equal(square, square.transpose(0, 2, 1)) == cls.symmetric
    assert square.shape[0] == (1 if cls.head_independent else 4)
    causal = pbe.create_bias(name, 4, causal=True)
    seen = causal.reference(span, span) > FLOAT32_LOWEST / 2  # [H|1, N, N]
    distance = span[:, None] - span[None, :]
    if cls.relative:  # the blocked form's per-distance table relies on bias(i, j) = g(i - j)
        shift = 2 * cls.reach()
        for module in (bias, causal):
            assert np.array_equal(module.reference(span + shift, span + shift), module.reference(span, span))
    if causal.lookback is None:
        assert seen.all()
    else:
        assert np.array_equal(seen[0], (distance >= 0) & (distance <= causal.lookback))
    assert bool(list(causal.parameters())) == cls.learned
    again = pbe.create_bias(name, 4, causal=True, seed=1)
    differs = not np.array_equal(causal.reference(np.arange(9), np.arange(9)), again.reference(np.arange(9), np.arange(9)))
    assert differs == cls.learned  # learned families take the layer's seed; fixed ones ignore it
    protos = cls.function_protos()
    assert protos[0].name == cls.function_name and protos[0].domain == DOMAIN
    assert [p.name for p in protos[1:]] == ([cls.key_row_name()] if cls.key_row_function else [])
    if bias.far_distance is not None:  # one value per head and side from that distance on (the near-far body)
        far, wide = bias.far_distance, np.arange(4 * bias.far_distance)
        grid = bias.reference(wide, wide)  # [H, N, N], bidirectional: both sides
        gap = wide[:, None] - wide[None, :]  # i - j
        for side, at in ((gap >= far, (far, 0)), (gap <= -far, (0, far))):
            constant = bias.reference(np.array([at[0]]), np.array([at[1]]))[:, 0, 0]  # [H]
            assert np.array_equal(grid[:, side], np.broadcast_to(constant[:, None], grid[:, side].shape))


@pytest.mark.parametrize("name", pbe.BIASES)
def test_float16_module_returns_the_float32_bias(name):
    """The dtype rule (AttentionBias._apply): a family cast with its model to float16 keeps its
    own tensors float32 and returns the same float32 bias; a family that computes in its
    module's dtype fails here, before any export."""
    ref = pbe.create_bias(name, 6, seed=2)
    half = pbe.create_bias(name, 6, seed=2).half()
    assert all(t.dtype == torch.float32 for t in [*half.parameters(), *half.buffers()] if t.is_floating_point())
    for q_len, k_len in ((1, 1), (17, 17), (1, 300)):
        got = half(q_len, k_len)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref(q_len, k_len), rtol=0, atol=0)
    q = torch.stack([torch.arange(3, 8), torch.arange(0, 5)])  # [2, 5]: padded rows' positions
    k = torch.stack([torch.arange(0, 8), torch.arange(-3, 5)])  # [2, 8]
    assert half.from_positions(q, k).dtype == torch.float32
    assert all(t.dtype == torch.float64 for t in half.double().parameters())  # float64 (references) still applies


@pytest.mark.parametrize("name", [n for n in pbe.BIASES if bias_class(n).key_row_function is not None])
def test_key_row_shortcut_equals_the_bias_up_to_a_row_constant(name):
    """The blocked form's shortcut: under the causal mask, bias - key_row is constant per query row."""
    bias = pbe.create_bias(name, 6)
    tensors, _ = bias.function_inputs()
    q_pos, k_pos = np.arange(40, 56), np.arange(0, 56)  # a block of 16 queries and the keys it sees
    row = np.asarray(bias.key_row_function(q_pos, k_pos, *[t.detach().numpy() for t in tensors]))  # [H, 1, W]
    ref = bias.reference(q_pos, k_pos)  # [H, Bq, W]
    diff = np.where(k_pos[None, :] <= q_pos[:, None], ref - row, np.nan)  # only where the causal mask keeps
    spread = np.nanmax(diff, axis=-1) - np.nanmin(diff, axis=-1)  # [H, Bq]
    assert spread.max() < 1e-4 * _finite_scale(ref)


@pytest.mark.parametrize("name", pbe.BIASES)
def test_hyper_parameters_validate(name):
    """Every declared integer hyper-parameter is carried by the module, changes the bias it
    computes (over distances past every default: 0..400), and rejects 0 and a non-integer."""
    cls = bias_class(name)
    q_pos, k_pos = np.arange(400, 401), np.arange(0, 401)
    default = pbe.create_bias(name, 2).reference(q_pos, k_pos)
    for field in dataclasses.fields(cls.Params):
        value = field.default + 2  # keeps an even field even
        changed = pbe.create_bias(name, 2, **{field.name: value})
        assert getattr(changed.params, field.name) == value
        assert changed.reference(q_pos, k_pos).shape == default.shape
        assert not np.array_equal(changed.reference(q_pos, k_pos), default), f"{field.name}={value} changed nothing"
    for field in dataclasses.fields(cls.Params):
        with pytest.raises(ValueError, match=field.name):
            pbe.create_bias(name, 2, **{field.name: 0})
        with pytest.raises(ValueError, match=field.name):
            pbe.create_bias(name, 2, **{field.name: 2.5})
