"""ONNX Script pieces of the GPU-shaped blocked attention (export target cuda / cuda-ort).

The portable body (blocked_script.py) multiplies, masks and softmaxes each block with separate
ops; here a block ends in ONE fused attention op (ONNX Attention-23, or ONNX Runtime's
com.microsoft.MultiHeadAttention) that takes the block's bias as its float mask. Keys therefore
stay [B, H, Lk, d] (no transposed copy), and the mask is built in float32 then handed over in the
model dtype (gpu_graph.py adds the Cast). Only standard opset-18 ops in these pieces.
"""
from __future__ import annotations

from onnxscript import BOOL, FLOAT, INT64, script
from onnxscript import opset18 as op

from ..biases import MASK_PENALTY
from ..biases.onnx_domain import posbias


@script(posbias, default_opset=op)
def GpuBlockPrepare(q: FLOAT, k: FLOAT, q_pos: INT64, max_block: INT64):
    """Scale and pad the queries once: q_pad [B, H, n*Bq, d] (scaled by 1/sqrt(d), so the fused
    op runs with scale 1), q_pos_pad [..., n*Bq], block Bq = min(max_block, Lq), n_blocks,
    offset = Lk - Lq. As BlockPrepare, without the transposed keys.

    PyTorch: Bq = min(max_block, Lq); n = ceil(Lq / Bq); q_pad = F.pad(q / sqrt(d), (0, 0, 0, n*Bq - Lq))
    """
    q_len = op.Shape(q, start=2, end=3)  # [1]
    k_len = op.Shape(k, start=2, end=3)  # [1]
    head_dim = op.CastLike(op.Shape(q, start=3, end=4), q)  # [1]
    block = op.Min(op.Reshape(max_block, [1]), q_len)  # [1]
    n_blocks = op.Div(op.Sub(op.Add(q_len, block), [1]), block)  # [1], ceil division
    pad = op.Sub(op.Mul(n_blocks, block), q_len)  # [1]
    zero = op.Constant(value_ints=[0])
    q_pad = op.Pad(op.Div(q, op.Sqrt(head_dim)), op.Concat(zero, pad, axis=0), None, [2])  # [B, H, n*Bq, d]
    q_pos_pad = op.Pad(q_pos, op.Concat(zero, pad, axis=0), None, [-1], mode="edge")  # [..., n*Bq]
    offset = op.Sub(k_len, q_len)  # [1]
    return q_pad, q_pos_pad, op.Squeeze(block), op.Squeeze(n_blocks), op.Squeeze(offset)


@script(posbias, default_opset=op)
def GpuBlockKeys(it: INT64, k: FLOAT, v: FLOAT, k_pos: INT64, keep: BOOL, block: INT64, offset: INT64,
                 lookback: INT64, lookahead: INT64):
    """The keys query block `it` can see, [lo, end) as in BlockKeys, untransposed:
    k_b, v_b [B, H, W, d], k_pos_b [..., W], k_idx [W], keep_b [B|1, 1, 1, W].

    PyTorch: keys = slice(lo, end); k[:, :, keys], v[:, :, keys], k_pos[..., keys], arange(lo, end), keep[..., keys]
    """
    k_len = op.Shape(k, start=2, end=3)  # [1]
    first = op.Reshape(op.Add(op.Mul(it, block), offset), [1])  # [1] key index of the first query
    end = op.Min(op.Add(op.Add(first, op.Reshape(block, [1])), op.Reshape(lookahead, [1])), k_len)  # [1]
    lo = op.Max(op.Sub(first, op.Reshape(lookback, [1])), op.Constant(value_ints=[0]))  # [1]
    k_idx = op.Range(op.Squeeze(lo), op.Squeeze(end), op.Constant(value_int=1))  # [W]
    return (op.Slice(k, lo, end, [2]), op.Slice(v, lo, end, [2]), op.Slice(k_pos, lo, end, [-1]), k_idx,
            op.Slice(keep, lo, end, [-1]))


@script(posbias, default_opset=op)
def GpuDirectPrepare(q: FLOAT, k: FLOAT):
    """All queries as one block: q scaled by 1/sqrt(d) [B, H, Lq, d], q_idx [Lq, 1], k_idx [Lk].

    PyTorch: q / sqrt(d), arange(Lk - Lq, Lk)[:, None], arange(Lk)
    """
    q_len = op.Squeeze(op.Shape(q, start=2, end=3))  # scalar
    k_len = op.Squeeze(op.Shape(k, start=2, end=3))  # scalar
    head_dim = op.CastLike(op.Shape(q, start=3, end=4), q)  # [1]
    one = op.Constant(value_int=1)
    q_idx = op.Unsqueeze(op.Range(op.Sub(k_len, q_len), k_len, one), [1])  # [Lq, 1]
    k_idx = op.Range(op.Constant(value_int=0), k_len, one)  # [Lk]
    return op.Div(q, op.Sqrt(head_dim)), q_idx, k_idx


@script(posbias, default_opset=op)
def MaskedBias(bias: FLOAT, q_idx: INT64, k_idx: INT64, keep: BOOL) -> FLOAT:
    """A bias with the causal and padding masks added (0 or MASK_PENALTY, see BlockAttend):
    bias [.., H|1, Bq, W], q_idx [Bq, 1] (or one index past every key: no causal mask),
    k_idx [W], keep [B|1, 1, 1, W] -> [B|1, H|1, Bq, W] float32.

    PyTorch: bias + where((k_idx <= q_idx) & keep, 0, -1e30)
    """
    allowed = op.And(op.LessOrEqual(k_idx, q_idx), keep)  # [B|1, 1, Bq, W]
    return op.Add(bias, op.Where(allowed, op.Constant(value_float=0.0), op.Constant(value_float=MASK_PENALTY)))


@script(posbias, default_opset=op)
def ReplacePadding(bias: FLOAT, keep_b: BOOL, floor: FLOAT) -> FLOAT:
    """Padding keys get `floor` (the mask value of the bias's dtype) instead of their bias:
    bias [H|1, Bq, W], keep_b [B|1, 1, 1, W] -> [B|1, H|1, Bq, W]. A fully padded row stays
    uniform, as with the added penalty.

    PyTorch: where(keep_b, bias, floor)
    """
    return op.Where(keep_b, bias, floor)


# the distance vector's pieces (DistanceVectorPositions, ExpandDistanceVector) are shared: blocked_script.py
GPU_FUNCTIONS = (GpuBlockPrepare, GpuBlockKeys, GpuDirectPrepare, MaskedBias, ReplacePadding)
