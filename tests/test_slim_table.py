"""The GPU-shaped body's slim distance-table path (gpu_table_script.py): every block gathers its
own bias from the per-distance vector's 8-wide windows with an int32 index, over keys aligned to
multiples of 8, the widest block first.

The index arithmetic is checked exactly (each gathered entry is the distance of its own query
and key), the aligned keys always cover the keys a block must see, and an export whose alignment
keys are not masked for a bidirectional family fails parity (the padding check is load-bearing).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import posbias_export as pbe
from posbias_export.export import functions
from posbias_export.export.targets.block_scaffold import UNBOUNDED
from posbias_export.export.targets.gpu_table_script import (KEY_ALIGN, AlignKeys, GatherBlockBias, SlimBlock,
                                                            SlimVectorPositions, SlimWindows)
from posbias_export.nn.attention import AttentionSettings
from posbias_export.parity import FLOAT32, compare, torch_outputs
from conftest import SMALL, ort_session


def _i64(x):
    return np.array(x, np.int64)


# (Lq, Lk, block, lookback, lookahead): prefill, decode offsets, causal windows, bidirectional
CASES = [(37, 37, 16, UNBOUNDED, 0), (300, 300, 64, UNBOUNDED, 0), (20, 45, 8, UNBOUNDED, 0),
         (100, 100, 16, 9, 0), (61, 61, 16, 30, 30), (50, 50, 16, UNBOUNDED, UNBOUNDED), (9, 9, 4, UNBOUNDED, UNBOUNDED)]


@pytest.mark.parametrize("q_len, k_len, block, lookback, lookahead", CASES)
def test_each_block_gathers_the_distance_of_its_own_query_and_key(q_len, k_len, block, lookback, lookahead):
    """Run the functions eagerly: for every block, the bias gathered from the windows of the
    vector's positions holds distance (query index) - (key index), the keys start and end on
    multiples of 8 inside the padded keys, they cover every key the block's queries may see, and
    the blocks come last first (a causal Loop's widest block first)."""
    n_blocks = -(-q_len // block)
    offset = k_len - q_len
    k = np.zeros((1, 1, k_len, 2), np.float32)
    k[0, 0, :, 0] = np.arange(1, k_len + 1)  # key j holds j + 1 (the alignment keys hold 0)
    keep = np.ones((1, 1, 1, k_len), bool)
    row, cols = SlimVectorPositions(k, _i64(block), _i64(lookahead))
    k8, v8, keep8 = AlignKeys(k, k, keep)
    assert k8.shape[2] % KEY_ALIGN == 0 and k8.shape[2] - k_len < KEY_ALIGN
    assert keep8[..., :k_len].all() and not keep8[..., k_len:].any()
    windows = SlimWindows(cols[None].astype(np.float32))  # [1, T - 7, 8]: exact (small integers)
    assert windows.shape == (1, cols.shape[0] - 7, KEY_ALIGN)
    q_pad = np.zeros((1, 1, n_blocks * block, 2), np.float32)
    q_pad[0, 0, :, 0] = np.arange(n_blocks * block)  # row r holds r
    for it in range(n_blocks):
        q_b, k_b, _, keep_b, idx = SlimBlock(_i64(it), k, q_pad, k8, v8, keep8, _i64(block), _i64(n_blocks),
                                             _i64(offset), _i64(lookback), _i64(lookahead))
        q0 = block * (n_blocks - 1 - it)  # the last block first
        np.testing.assert_array_equal(q_b[0, 0, :, 0], np.arange(q0, q0 + block))
        assert idx.dtype == np.int32 and q_b.shape[2] == block
        lo = int(k_b[0, 0, 0, 0]) - 1  # the first key it took (key 0 of a block starting at 0 holds 1)
        end = lo + k_b.shape[2]
        np.testing.assert_array_equal(k_b[0, 0, :, 0], k8[0, 0, lo:end, 0])
        assert lo % KEY_ALIGN == 0 and end % KEY_ALIGN == 0 and end <= k8.shape[2]
        first = offset + q0  # key index of the block's first query
        needed_lo = max(0, first - lookback)
        needed_end = min(k_len, first + block + lookahead)
        assert lo <= needed_lo and needed_end <= end
        assert 0 <= idx.min() and idx.max() < windows.shape[1] and idx.shape == (block, (end - lo) // KEY_ALIGN)
        distance = row[0] - GatherBlockBias(windows, idx)[0]  # [Bq, W] what the family's function was evaluated at
        expected = (first + np.arange(block))[:, None] - (lo + np.arange(end - lo))[None, :]
        np.testing.assert_array_equal(distance, expected)


def _export(tmp_path, bias, causal):
    core = pbe.build_model(pbe.ModelConfig(bias=bias, causal=causal, **SMALL), arch="attention")
    path = tmp_path / f"{bias}.onnx"
    pbe.export_onnx(core, path, block=16, check_growth=False, target="cuda-ort")
    return core, path


def _body(model):
    return next(f for f in model.functions if f.name.startswith("BlockedAttention") and f.name.endswith("ByDistance"))


def test_no_table_and_no_int64_index_in_the_gpu_body(tmp_path, as_built):
    """The slim path's only Gather over the bias takes the int32 index SlimBlock builds (over the
    windows); nothing expands a [H, Bq, M] table; the one-block branch aligns its keys too."""
    _, path = _export(tmp_path, "kerple_log", True)
    model = onnx.load(path)
    called = {n.op_type for n in functions.all_nodes(list(_body(model).node))}
    assert {"SlimBlock", "SlimWindows", "GatherBlockBias", "AlignKeys", "AlignDirectKeys"} <= called
    assert not {"ExpandDistanceVector", "DistanceVectorPositions", "SliceByDistance"} & called
    gather = next(f for f in model.functions if f.name == "GatherBlockBias")
    assert [n.op_type for n in gather.node if n.op_type != "Constant"] == ["Gather", "Reshape"]


def _lengths_parity(core, session, lengths):
    plain = AttentionSettings(form="plain")
    results = {}
    for length in lengths:
        g = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(1, SMALL["num_heads"], length, SMALL["dim"] // SMALL["num_heads"], generator=g)
                   for _ in range(3))
        ref64, torch32 = (torch_outputs(core, (q, k, v), dt, plain) for dt in (torch.float64, torch.float32))
        got = session.run(None, {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()})[0]
        results[length] = compare(got, ref64, torch32, FLOAT32)
    return results


def test_unmasked_alignment_keys_fail_a_bidirectional_family(tmp_path, as_built):
    """Sabotage: choose the Loop by the caller's keep instead of the aligned keep8, so a
    bidirectional family's zero alignment keys count as real keys: parity must fail at a length
    that is not a multiple of 8 (and still pass at one that is: only alignment keys differ)."""
    core, path = _export(tmp_path, "t5", False)
    model = onnx.load(path)
    sabotaged = 0
    for node in functions.all_nodes(list(_body(model).node)):
        if node.op_type == "HasPadding" and list(node.input) == ["keep8"]:
            node.input[0] = "keep"
            sabotaged += 1
    assert sabotaged == 1
    broken = tmp_path / "broken.onnx"
    onnx.save(model, broken)
    good = _lengths_parity(core, ort_session(path), (45, 48))
    bad = _lengths_parity(core, ort_session(broken), (45, 48))
    assert good[45].passed and good[48].passed, good
    assert bad[48].passed and not bad[45].passed, bad


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("bias", ["kerple_log", "t5"])
def test_queries_after_a_cache_take_the_blocks_with_an_offset(tmp_path, bias, causal):
    """21 queries that are the last of 45 keys (a chunked prefill after a cache): blocks of 8
    rows start at key 24, none aligned to 8; equal to the plain float64 form."""
    core = pbe.build_model(pbe.ModelConfig(bias=bias, causal=causal, **SMALL), arch="attention")
    path = tmp_path / f"{bias}.onnx"
    pbe.export_onnx(core, path, block=8, check_growth=False, target="cuda-ort")
    g = torch.Generator().manual_seed(0)
    head_dim = SMALL["dim"] // SMALL["num_heads"]
    q = torch.randn(1, SMALL["num_heads"], 21, head_dim, generator=g)
    k, v = (torch.randn(1, SMALL["num_heads"], 45, head_dim, generator=g) for _ in range(2))
    plain = AttentionSettings(form="plain")
    ref64, torch32 = (torch_outputs(core, (q, k, v), dt, plain) for dt in (torch.float64, torch.float32))
    got = ort_session(path).run(None, {"query": q.numpy(), "key": k.numpy(), "value": v.numpy()})[0]
    parity = compare(got, ref64, torch32, FLOAT32)
    assert parity.passed, str(parity)
