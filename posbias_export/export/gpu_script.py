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


# shared with the portable body (blocked_script.py): PadQueries, DirectQueries, DistanceVectorPositions,
# ExpandDistanceVector
GPU_FUNCTIONS = (GpuBlockKeys, MaskedBias, ReplacePadding)
