"""ONNX Script pieces of the GPU-shaped body's slim distance-table path (a relative family whose
positions are the key indices: KERPLE, T5, Sandwich, window blocks, ...).

The family's function runs once per call on a per-head vector of distances (T values per head).
Each query block then gathers ITS OWN bias from that vector, written once in the [H|1, Bq, W]
layout the fused op reads:

    no [H, Bq, M] table, no [Bq, M] int64 index (at 16384 tokens: 1.34 GB + 0.67 GB that every
    block sliced again), and the block's memory is its own bias alone.

A block's bias is Toeplitz (its value depends on key - query), so it is gathered 8 keys at a time
from SlimWindows' rows of 8 consecutive vector values: an int32 index of Bq x W/8, not Bq x W
(an eighth of the index memory; on ORT CPU 1.9x faster at 16384 tokens. ONNX Runtime CUDA's
Gather time did not move, 4.9 ms at 16384 tokens on an H200: its kernel spends it on index
arithmetic per value. An index-free form, Expand and two Slices, measured slower still:
benchmarks/gpu_slim_forms.md).

The blocks run last first (SlimBlock), so the Loop's first block is its widest: every later
block's bias fits in memory the first one freed. In block order, each block's bias was wider than
any freed before it, and ONNX Runtime's arena held all of them at once (11 GB at 32768 tokens).

Every block's keys start and end on a multiple of KEY_ALIGN (the keys are padded once to a
multiple of it: fused kernels read a bias row in 8-element vectors; the one-block branch of every
GPU body pads its keys the same way, AlignDirectKeys). Each block's bounds are a few integer ops
in the Loop body from its iteration number and the per-call scalars (SlimBlock): a table computed
before the Loop and read there made ONNX Runtime CUDA copy each row back to the host, which
asynchronous launches read stale.
"""
from __future__ import annotations

from onnxscript import BOOL, FLOAT, INT32, INT64, script
from onnxscript import opset18 as op

from ...biases.onnx_domain import posbias

KEY_ALIGN = 8  # keys per aligned group; the literal 8s below are this value (ONNX Script takes literals)


@script(posbias, default_opset=op)
def AlignKeys(k: FLOAT, v: FLOAT, keep: BOOL):
    """Keys, values and the keep mask padded once to a multiple of 8 keys (zeros; the padding keys
    are marked not kept): k8, v8 [B, H, Lk8, d], keep8 [B|1, 1, 1, Lk8].

    PyTorch: pad = -Lk % 8; F.pad(k, (0, 0, 0, pad)), F.pad(v, ...), F.pad(keep, (0, pad), value=False)
    """
    k_len = op.Shape(k, start=2, end=3)  # [1]
    pad = op.Sub(op.Mul(op.Div(op.Add(k_len, [7]), [8]), [8]), k_len)  # [1]
    zero = op.Constant(value_ints=[0])
    pads = op.Concat(zero, pad, axis=0)  # [2]
    dropped = op.Cast(op.ConstantOfShape(op.Concat(op.Shape(keep, end=-1), pad, axis=0)), to=9)  # [B|1, 1, 1, pad] False
    return op.Pad(k, pads, None, [2]), op.Pad(v, pads, None, [2]), op.Concat(keep, dropped, axis=-1)


@script(posbias, default_opset=op)
def AlignDirectKeys(k: FLOAT, v: FLOAT, k_pos: INT64, keep: BOOL):
    """The one-block branch's keys padded to a multiple of 8 like AlignKeys, with their positions
    (the last one repeated: a valid position for any family, its bias masked anyway) and indices:
    k8, v8 [B, H, Lk8, d], k_pos8 [..., Lk8], keep8 [B|1, 1, 1, Lk8], k_idx8 [Lk8]. The padding keys
    are not kept, and come after every query (their indices are >= Lk).

    PyTorch: AlignKeys(k, v, keep), k_pos[..., arange(Lk8).clamp(max=Lk - 1)], arange(Lk8)
    """
    k8, v8, keep8 = AlignKeys(k, v, keep)
    k_len8 = op.Shape(k8, start=2, end=3)  # [1]
    k_idx8 = op.Range(op.Constant(value_int=0), op.Squeeze(k_len8), op.Constant(value_int=1))  # [Lk8]
    last = op.Sub(op.Shape(k, start=2, end=3), op.Constant(value_ints=[1]))  # [1] Lk - 1
    # the last position repeated by a Gather, not an edge Pad: ONNX Runtime CUDA has no int64 Pad, and
    # its CPU one would read the positions back from the GPU inside this If branch (host_reads.py)
    k_pos8 = op.Gather(k_pos, op.Min(k_idx8, last), axis=-1)  # [..., Lk8]
    return k8, v8, k_pos8, keep8, k_idx8


@script(posbias, default_opset=op)
def SlimVectorPositions(k: FLOAT, block: INT64, lookahead: INT64):
    """The positions of the per-distance vector every block gathers from: vector[t] =
    g(Bq - 1 + Lk - t), t = 0..T-1, as the family's function of row [Bq - 1] and cols [T] with
    cols[t] = t - Lk. T = Bq - 1 + Lk + min(Lk, Bq + lookahead) + 8 covers every (query, key)
    pair of every block, the aligned keys past a block's end included.

    PyTorch: [Bq - 1], arange(Bq - 1 + Lk + min(Lk, Bq + lookahead) + 8) - Lk
    """
    k_len = op.Squeeze(op.Shape(k, start=2, end=3))  # scalar Lk
    one = op.Constant(value_int=1)
    last = op.Sub(block, one)  # scalar Bq - 1
    width = op.Add(op.Add(k_len, op.Min(k_len, op.Add(block, lookahead))), op.Constant(value_int=8))  # scalar
    cols = op.Sub(op.Range(op.Constant(value_int=0), op.Add(last, width), one), k_len)  # [T]
    return op.Reshape(last, [1]), cols


@script(posbias, default_opset=op)
def SlimBlock(it: INT64, k: FLOAT, q_pad: FLOAT, k8: FLOAT, v8: FLOAT, keep8: BOOL, block: INT64, n_blocks: INT64,
              offset: INT64, lookback: INT64, lookahead: INT64):
    """Query block n - 1 - it (the last block first: see the module docstring; the Loop's outputs
    are put back in order after it) and its aligned keys: q_b [B, H, Bq, d], k_b, v_b [B, H, W, d],
    keep_b [B|1, 1, 1, W], and idx [Bq, W/8] int32, the window (SlimWindows) of each query and
    each 8 keys: idx[r, c] = Bq - 1 - r + shift + 8c. The block's first padded query row q0, its
    aligned keys [lo, end) (lo rounded down, end up, to a multiple of 8; the extra keys are masked
    by distance or marked padding; W = end - lo) and `shift`, the vector index of (row Bq - 1,
    key lo), are computed here from the iteration number and the scalars, which the body reads
    from its own Shape (block_scaffold.LOOP_SCALARS): ONNX Runtime CUDA then keeps this arithmetic
    on the host.

    PyTorch: q0 = (n - 1 - it) * Bq; first = q0 + offset; lo = max(first - lookback, 0) // 8 * 8;
             end = ceil8(min(first + Bq + lookahead, Lk)); shift = lo - first + Lk;
             q_pad[:, :, q0:q0 + Bq], k8[:, :, lo:end], ..., ((Bq - 1 - arange(Bq))[:, None] + shift + arange(0, end - lo, 8)).int()
    """
    k_len = op.Shape(k, start=2, end=3)  # [1] Lk
    one = op.Constant(value_int=1)
    eight = op.Constant(value_ints=[8])
    q0 = op.Reshape(op.Mul(op.Sub(op.Sub(n_blocks, one), it), block), [1])  # [1]
    first = op.Add(q0, op.Reshape(offset, [1]))  # [1] key index of the block's first query
    end_key = op.Min(op.Add(op.Add(first, op.Reshape(block, [1])), op.Reshape(lookahead, [1])), k_len)  # [1]
    lo_key = op.Max(op.Sub(first, op.Reshape(lookback, [1])), op.Constant(value_ints=[0]))  # [1]
    lo = op.Mul(op.Div(lo_key, eight), eight)  # [1]
    end = op.Mul(op.Div(op.Add(end_key, op.Constant(value_ints=[7])), eight), eight)  # [1]
    shift = op.Cast(op.Squeeze(op.Add(op.Sub(lo, first), k_len)), to=6)  # scalar int32
    q_b = op.Slice(q_pad, q0, op.Add(q0, op.Reshape(block, [1])), [2])  # [B, H, Bq, d]
    width = op.Cast(op.Squeeze(op.Sub(end, lo)), to=6)  # scalar int32 W
    last = op.Cast(op.Sub(block, one), to=6)  # scalar int32 Bq - 1
    one32 = op.Cast(one, to=6)
    rows = op.Range(last, op.Cast(op.Constant(value_int=-1), to=6), op.Neg(one32))  # [Bq] int32: Bq-1 .. 0
    cols = op.Range(shift, op.Add(shift, width), op.Cast(op.Constant(value_int=8), to=6))  # [W/8] int32
    idx = op.Add(op.Unsqueeze(rows, [1]), cols)  # [Bq, W/8] int32
    return (q_b, op.Slice(k8, lo, end, [2]), op.Slice(v8, lo, end, [2]), op.Slice(keep8, lo, end, [-1]), idx)


@script(posbias, default_opset=op)
def SlimWindows(vector: FLOAT) -> FLOAT:
    """Every run of 8 consecutive vector values, once per call: vector [H|1, T] -> windows
    [H|1, T - 7, 8], windows[h, m, j] = vector[h, m + j] (8 x the vector: 8 H T values, small).

    PyTorch: vector.unfold(1, 8, 1)
    """
    starts = op.Range(op.Constant(value_int=0), op.Sub(op.Squeeze(op.Shape(vector, start=1, end=2)),
                                                        op.Constant(value_int=7)), op.Constant(value_int=1))  # [T - 7]
    idx = op.Add(op.Unsqueeze(starts, [1]), op.Constant(value_ints=[0, 1, 2, 3, 4, 5, 6, 7]))  # [T - 7, 8]
    return op.Gather(vector, idx, axis=1)


@script(posbias, default_opset=op)
def GatherBlockBias(windows: FLOAT, idx: INT32) -> FLOAT:
    """One block's bias from the typed windows, 8 keys per index: windows [H|1, T - 7, 8],
    idx [Bq, W/8] int32 -> [H|1, Bq, W/8, 8] -> [H|1, Bq, W], written once.

    PyTorch: windows[:, idx].flatten(-2)
    """
    return op.Reshape(op.Gather(windows, idx, axis=1), op.Constant(value_ints=[0, 0, -1]))


SLIM_TABLE_FUNCTIONS = (AlignKeys, AlignDirectKeys, SlimVectorPositions, SlimBlock, SlimWindows,
                        GatherBlockBias)
