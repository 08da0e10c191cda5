"""Each bias module against an independent float64 implementation of its paper's formula."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posbias_export as pbe
from posbias_export.biases import alibi, kerple, sandwich, window

SHAPES = [(1, 1), (1, 17), (17, 17), (5, 40), (40, 40), (1, 1024), (300, 1024)]  # (q_len, k_len)
shape_ids = [f"q{q}-k{k}" for q, k in SHAPES]


def test_registry_names():
    assert pbe.BIASES == ("alibi", "kerple_power", "kerple_log", "sandwich", "t5", "window", "none")


def test_unknown_bias_lists_choices():
    with pytest.raises(ValueError, match="choose one of: alibi, kerple_power"):
        pbe.create_bias("alibix", num_heads=4)


def test_unknown_option_is_value_error():
    with pytest.raises(ValueError, match="sandwich"):
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
    got = pbe.create_bias("alibi", num_heads)(q_len, k_len).double().numpy()
    ref = alibi.reference_bias(num_heads, q_len, k_len)
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
    r1, r2 = mod.r1().double().detach().numpy(), mod.r2().double().detach().numpy()
    ref = (kerple.reference_power if variant == "kerple_power" else kerple.reference_log)(r1, r2, q_len, k_len)
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
    got = pbe.create_bias("sandwich", 8, sin_dim=sin_dim)(q_len, k_len).double().numpy()
    ref = sandwich.reference_bias(8, q_len, k_len, sin_dim)  # via sum_k cos((i-j) w_k)
    # float32 angles t*w_k carry abs error ~ t * 2^-24 each; summed over sum_k w_k (< 8)
    # frequencies, twice (sin and cos tables), times lambda_max = 1: ~1e-6 per position.
    atol = 1e-6 * k_len * 8 * 2 + 1e-5
    np.testing.assert_allclose(got, ref, rtol=0, atol=atol)


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


# --- Window ----------------------------------------------------------------------------------
@pytest.mark.parametrize("q_len,k_len", SHAPES, ids=shape_ids)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_window_vs_reference(causal, q_len, k_len):
    got = pbe.create_bias("window", 4, causal=causal, window=7)(q_len, k_len).double().numpy()
    assert got.shape == (1, q_len, k_len)
    np.testing.assert_array_equal(got, window.reference_bias(q_len, k_len, 7, causal))


def test_window_counts_the_query_itself():
    b = pbe.create_bias("window", 1, window=3)(1, 10)[0, 0]
    assert (b == 0).nonzero().flatten().tolist() == [7, 8, 9]


def test_none_is_zero():
    assert torch.count_nonzero(pbe.create_bias("none", 4)(5, 9)) == 0


@pytest.mark.parametrize("name", ["alibi", "kerple_power", "kerple_log", "sandwich", "t5", "window", "none"])
def test_batched_positions_match_per_row(name):
    """from_positions with [B, L] positions (padding) equals the unbatched bias per row."""
    mod = pbe.create_bias(name, 4)
    q = torch.stack([torch.arange(3, 8), torch.arange(0, 5)])  # [2, 5]
    k = torch.stack([torch.arange(0, 8), torch.arange(-3, 5)])  # [2, 8]
    batched = mod.from_positions(q, k)
    for row in range(2):
        torch.testing.assert_close(batched[row], mod.from_positions(q[row], k[row]))
