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
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .base import AttentionBias, relative_distance


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


class AlibiBias(AttentionBias):
    name = "alibi"

    def onnx_function(self):
        return Alibi

    def function_inputs(self):
        return [self.slopes], {}

    def __init__(self, num_heads: int, causal: bool = True):
        super().__init__(num_heads, causal)
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)  # [H]

    def from_positions(self, q_pos, k_pos):
        distance = relative_distance(q_pos, k_pos).abs().to(torch.float32)  # [..., Lq, Lk]
        return -self.slopes.view(-1, 1, 1) * distance.unsqueeze(-3)  # [..., H, Lq, Lk]


def reference_bias(num_heads: int, q_len: int, k_len: int) -> np.ndarray:
    """float64 oracle straight from the paper: -m_h * |i - j|, [H, Lq, Lk]."""
    n = num_heads
    p = 1 << (n.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * h / p) for h in range(1, p + 1)]
    slopes += [2.0 ** (-8.0 * h / (2 * p)) for h in range(1, 2 * p + 1, 2)][: n - p]
    i = np.arange(k_len - q_len, k_len, dtype=np.float64)[:, None]
    j = np.arange(k_len, dtype=np.float64)[None, :]
    return -np.asarray(slopes)[:, None, None] * np.abs(i - j)[None]


from onnxscript import FLOAT, INT64, script  # noqa: E402
from onnxscript import opset18 as op  # noqa: E402

from .onnx_domain import RelativeDistance, posbias  # noqa: E402


@script(posbias, default_opset=op)
def Alibi(q_pos: INT64, k_pos: INT64, slopes: FLOAT) -> FLOAT:
    """ALiBi bias: -slope_h * |i - j|, [..., Lq] x [..., Lk] x [H] -> [..., H, Lq, Lk].

    PyTorch: -slopes.view(-1, 1, 1) * (q_pos[..., :, None] - k_pos[..., None, :]).abs().float().unsqueeze(-3)
    """
    distance = op.Unsqueeze(op.Abs(RelativeDistance(q_pos, k_pos)), [-3])  # [..., 1, Lq, Lk]
    per_head = op.Reshape(slopes, [-1, 1, 1])  # [H, 1, 1]
    return op.Mul(op.Neg(per_head), distance)  # [..., H, Lq, Lk]
