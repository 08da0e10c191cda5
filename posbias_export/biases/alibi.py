"""ALiBi: Attention with Linear Biases.

Paper: Press, Smith, Lewis. "Train Short, Test Long: Attention with Linear Biases Enables
Input Length Extrapolation", ICLR 2022 (arXiv:2108.12409).

Formula: score(i, j) = q_i . k_j / sqrt(d) - m_h * |i - j|
  m_h = 2^(-8 h / n) for head h = 1..n when n is a power of two (a geometric series).
  Otherwise, with p the largest power of two below n: the p slopes of p heads, then every
  other slope of 2p heads (odd positions 1, 3, 5, ...) until n slopes are reached (the
  paper's interleave; BLOOM and x-transformers do the same).
Causal models only ever see j <= i, where |i - j| = i - j; the symmetric (bidirectional)
variant uses |i - j| on both sides.
Hyper-parameters: none. Learned: no.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from onnxscript import FLOAT, INT64, script
from onnxscript import opset18 as op

from .base import AttentionBias, relative_distance
from .onnx_domain import RelativeDistance, posbias


def _geometric_slopes(n: int) -> list[float]:
    # 2^(-8/n), 2^(-16/n), ..., 2^(-8): start == ratio
    return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Per-head ALiBi slopes, float32 Tensor [H]."""
    if int(num_heads) < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    n = int(num_heads)
    p = 2 ** int(math.floor(math.log2(n)))
    slopes = _geometric_slopes(p)
    if p < n:
        slopes += _geometric_slopes(2 * p)[0::2][: n - p]
    return torch.tensor(slopes, dtype=torch.float32)


@script(posbias, default_opset=op)
def Alibi(q_pos: INT64, k_pos: INT64, slopes: FLOAT) -> FLOAT:
    """ALiBi bias: -slope_h * |i - j|, [..., Lq] x [..., Lk] x [H] -> [..., H, Lq, Lk].

    PyTorch: -slopes.view(-1, 1, 1) * (q_pos[..., :, None] - k_pos[..., None, :]).abs().float().unsqueeze(-3)
    """
    distance = op.Unsqueeze(op.Abs(RelativeDistance(q_pos, k_pos)), [-3])  # [..., 1, Lq, Lk]
    per_head = op.Reshape(slopes, [-1, 1, 1])  # [H, 1, 1]
    return op.Mul(op.Neg(per_head), distance)  # [..., H, Lq, Lk]


@script(posbias, default_opset=op)
def AlibiKeyRow(q_pos_b: INT64, k_pos_b: INT64, slopes: FLOAT) -> FLOAT:
    """Causal ALiBi for one query block as ONE row per head: slope_h * (j - p0), p0 the position
    of the block's middle row. Under a causal mask -m(i - j) = m(j - p0) - m(i - p0), and
    softmax ignores the per-row constant m(i - p0), so the H*Bq*W bias becomes H*W values.
    p0 inside the block (not 0) keeps the values small where they matter, near the diagonal:
    |m(i - p0)| <= m*Bq/2, so float32 rounding of the scores stays a few 1e-6 (measured) instead
    of growing with L.

    [..., Bq] x [..., W] x [H] -> [..., H, 1, W]
    PyTorch: slopes.view(-1, 1, 1) * (k_pos_b[..., None, :] - q_pos_b[..., Bq//2, None, None]).float().unsqueeze(-3)
    """
    middle = op.Div(op.Shape(q_pos_b, start=-1), [2])  # [1]
    p0 = op.Slice(q_pos_b, middle, op.Add(middle, [1]), [-1])  # [..., 1]
    rel = op.Cast(op.Sub(op.Unsqueeze(k_pos_b, [-2]), op.Unsqueeze(p0, [-1])), to=1)  # [..., 1, W]
    return op.Mul(op.Reshape(slopes, [-1, 1, 1]), op.Unsqueeze(rel, [-3]))  # [..., H, 1, W]


class AlibiBias(AttentionBias):
    name = "alibi"
    summary = "`-m_h * abs(i - j)`, `m_h = 2^(-8h/H)` (for H not a power of two the paper's interleave, as BLOOM)"
    paper = "Press et al., *Train Short, Test Long*, ICLR 2022"
    rank = 10
    function = Alibi
    relative = True
    key_row_function = AlibiKeyRow
    key_row_mirrors = True  # -m|i - j|: m(j - p0) before the query, -m(j - p0) after it (up to row constants)
    slope_features = True  # causal: -m(i - j) = (m j) - (m i), one dot product of features

    def __init__(self, num_heads: int, causal: bool = True, params=None, seed: int = 0):
        super().__init__(num_heads, causal, params, seed)
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)  # [H]

    def function_inputs(self):
        return [self.slopes], {}

    def score_mod(self, device=None):
        """FlexAttention: score - m_h |i - j| (causal: m_h (j - i), equal where the mask keeps j <= i)."""
        slopes = self.slopes.to(device=device, dtype=torch.float32).reshape(-1)  # [H]
        if self.causal:
            return lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)
        return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (kv_idx - q_idx).abs()

    def from_positions(self, q_pos, k_pos):
        distance = relative_distance(q_pos, k_pos).abs().to(torch.float32)  # [..., Lq, Lk]
        return -self.slopes.view(-1, 1, 1) * distance.unsqueeze(-3)  # [..., H, Lq, Lk]

    def reference(self, q_pos, k_pos):
        """float64 straight from the paper: -m_h * |i - j|, slopes recomputed here, [H, Lq, Lk]."""
        n = self.num_heads
        p = 1 << (n.bit_length() - 1)
        slopes = [2.0 ** (-8.0 * h / p) for h in range(1, p + 1)]
        slopes += [2.0 ** (-8.0 * h / (2 * p)) for h in range(1, 2 * p + 1, 2)][: n - p]
        distance = np.abs(np.asarray(q_pos, np.float64)[:, None] - np.asarray(k_pos, np.float64)[None, :])
        return -np.asarray(slopes)[:, None, None] * distance[None]
