"""ONNX Script pieces of the GPU-shaped blocked attention (export target cuda / cuda-ort).

The portable body (blocked_script.py) multiplies, masks and softmaxes each block with separate
ops; here a block ends in ONE fused attention op (ONNX Attention-23, or ONNX Runtime's
com.microsoft.MultiHeadAttention) that takes the block's bias as its float mask. Keys therefore
stay [B, H, Lk, d] (no transposed copy), and the mask is built in float32 then handed over in the
model dtype (gpu_body.py adds the Cast). Only standard opset-18 ops in these pieces.
"""
from __future__ import annotations

from onnxscript import BOOL, FLOAT, INT64, script
from onnxscript import opset18 as op

from ...biases import MASK_PENALTY
from ...biases.onnx_domain import posbias
from .blocked_script import HasPadding


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


@script(posbias, default_opset=op)
def WholeSequence(q: FLOAT, k: FLOAT, keep: BOOL) -> BOOL:
    """True when one fused call over the whole sequence serves the input: as many queries as
    keys (no cache: the op's causal mask then needs no alignment) and no padding key.

    PyTorch: q.shape[2] == k.shape[2] and keep.all()
    """
    same = op.Equal(op.Shape(q, start=2, end=3), op.Shape(k, start=2, end=3))  # [1]
    return op.And(op.Squeeze(same), op.Not(HasPadding(keep)))


@script(posbias, default_opset=op)
def SlopeParts(pos: INT64, slopes: FLOAT):
    """slope_h * pos as two float32 parts a + b, a exact: slopes [H] split by Veltkamp's trick
    (the high part keeps 8 significant bits, so hi * pos is exact for positions below 2^16;
    the low part carries the rest, its product 2^8 times smaller). pos [..., L] -> a, b [..., H, L].

    PyTorch: hi = bfloat16-like(slopes); (hi[:, None] * pos[..., None, :], (slopes - hi)[:, None] * pos[..., None, :])
    """
    split = op.Mul(slopes, op.Constant(value_float=65537.0))  # 2^16 + 1
    hi = op.Reshape(op.Sub(split, op.Sub(split, slopes)), [-1, 1])  # [H, 1]
    lo = op.Sub(op.Reshape(slopes, [-1, 1]), hi)  # [H, 1], exact
    at = op.Unsqueeze(op.Cast(pos, to=1), [-2])  # [..., 1, L]
    return op.Mul(hi, at), op.Mul(lo, at)


@script(posbias, default_opset=op)
def HalfParts(a: FLOAT, b: FLOAT):
    """a + b as a float16-representable high part and the remainder (float16 holds slope * j
    only to 1-2 units at 4096 tokens; high + low hold it to 2^-22 of its size, and exactly for
    power-of-two slopes). [...] x [...] -> [...], [...] (float32 values, float16-exact).

    PyTorch: hi = (a + b).half().float(); hi, ((a - hi) + b)
    """
    hi = op.Cast(op.Cast(op.Add(a, b), to=10), to=1)
    return hi, op.Add(op.Sub(a, hi), b)


@script(posbias, default_opset=op)
def SlopeFeatures(q_hi: FLOAT, q_lo: FLOAT, k_hi: FLOAT, k_lo: FLOAT):
    """The causal bias -m (i - j) = m j - m i as a dot product of 4 features: queries
    [1, -m i (hi), 1, -m i (lo)], keys [m j (hi), 1, m j (lo), 1], each [..., H, L, 4]. Pairs
    interleave so that in a kernel summing in order the two large high terms cancel first (near
    the diagonal) before the low ones and then q.k are added: grouped [hi, lo, 1, 1] loses
    ~2e-4 at 4096 tokens for heads whose slopes are not powers of two, features after q.k 1e-4
    (measured on ONNX Runtime CPU).

    PyTorch: stack([1, -q_hi, 1, -q_lo], -1), stack([k_hi, 1, k_lo, 1], -1)
    """
    q_one = op.Unsqueeze(op.ConstantOfShape(op.Shape(q_hi), value=[1.0]), [-1])  # [..., H, Lq, 1]
    k_one = op.Unsqueeze(op.ConstantOfShape(op.Shape(k_hi), value=[1.0]), [-1])
    q_feat = op.Concat(q_one, op.Unsqueeze(op.Neg(q_hi), [-1]), q_one, op.Unsqueeze(op.Neg(q_lo), [-1]), axis=-1)
    k_feat = op.Concat(op.Unsqueeze(k_hi, [-1]), k_one, op.Unsqueeze(k_lo, [-1]), k_one, axis=-1)
    return q_feat, k_feat


@script(posbias, default_opset=op)
def PrependFeatures(x: FLOAT, feat: FLOAT, width: INT64) -> FLOAT:
    """[features, zeros, x]: feat [.., H, L, n] broadcast to x [B, H, L, d], in x's dtype, padded
    with zeros to `width` columns, then x -> [B, H, L, width + d].

    PyTorch: cat([pad(feat.expand(B, H, L, n).to(x.dtype), (0, width - n)), x], -1)
    """
    n = op.Shape(feat, start=-1)  # [1]
    typed = op.CastLike(op.Expand(feat, op.Concat(op.Shape(x, end=-1), n, axis=0)), x)  # [B, H, L, n]
    pads = op.Concat(op.Constant(value_ints=[0]), op.Sub(op.Reshape(width, [1]), n), axis=0)  # [0, width - n]
    return op.Concat(op.Pad(typed, pads, None, [-1]), x, axis=-1)


@script(posbias, default_opset=op)
def PadValues(v: FLOAT, width: INT64) -> FLOAT:
    """v [B, H, L, d] with `width` zero columns after it (fused kernels want the values as wide
    as the queries): -> [B, H, L, d + width].

    PyTorch: pad(v, (0, width))
    """
    return op.Pad(v, op.Concat(op.Constant(value_ints=[0]), op.Reshape(width, [1]), axis=0), None, [-1])


@script(posbias, default_opset=op)
def DropPadding(out: FLOAT, v: FLOAT) -> FLOAT:
    """The first d columns of the fused op's output [B, H, L, d + width] (v [B, H, L, d]).

    PyTorch: out[..., :v.shape[-1]]
    """
    return op.Slice(out, op.Constant(value_ints=[0]), op.Shape(v, start=3, end=4), op.Constant(value_ints=[3]))


# shared with the portable body (blocked_script.py): PadQueries, DirectQueries, HasPadding, MaskFutureInTable;
# the slim table path's pieces: gpu_table_script.py
GPU_FUNCTIONS = (GpuBlockKeys, MaskedBias, ReplacePadding, WholeSequence, SlopeParts, HalfParts, SlopeFeatures,
                 PrependFeatures, PadValues, DropPadding)
