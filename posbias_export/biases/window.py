"""Local window attention: Su's "super-baseline" (RoPE + attend only to nearby keys).

Source: Su Jianlin, "Transformer Upgrade Road 7: length extrapolation and local attention"
(kexue.fm, 2023): with RoPE and a window no larger than the training length, every query
sees only distances it saw in training, so extrapolation is a non-issue.

Convention: the window COUNTS THE QUERY ITSELF. Causal: query i sees keys j with
0 <= i - j < w (itself and the w - 1 keys before it). Bidirectional: |i - j| < w.
Formula: bias(i, j) = 0 inside the window, the float32 lowest finite value outside
(never -inf, so a row can never become NaN). RoPE is applied by the attention layer.
"""
from __future__ import annotations

import numpy as np
import torch

from .base import AttentionBias, mask_value, relative_distance


class WindowBias(AttentionBias):
    name = "window"
    output_heads_is_one = True

    def onnx_function(self):
        return Window

    def function_inputs(self):
        return [], {"window": self.window, "causal": int(self.causal)}

    def __init__(self, num_heads: int, causal: bool = True, window: int = 64):
        super().__init__(num_heads, causal)
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = int(window)

    def hyper_parameters(self) -> dict:
        return {"window": self.window}

    def from_positions(self, q_pos, k_pos):
        rel = relative_distance(q_pos, k_pos)  # i - j, [..., Lq, Lk]
        inside = rel.abs() < self.window
        if self.causal:
            inside = inside & (rel >= 0)
        zero = torch.zeros((), dtype=torch.float32, device=rel.device)
        low = torch.full((), mask_value(torch.float32), dtype=torch.float32, device=rel.device)
        return torch.where(inside, zero, low).unsqueeze(-3)  # [..., 1, Lq, Lk]


def reference_bias(q_len: int, k_len: int, window: int, causal: bool) -> np.ndarray:
    """float64 oracle, [1, Lq, Lk]: 0 inside the window, the float32 lowest value outside."""
    rel = np.arange(k_len - q_len, k_len)[:, None] - np.arange(k_len)[None]
    inside = (rel >= 0) & (rel < window) if causal else np.abs(rel) < window
    return np.where(inside, 0.0, float(np.finfo(np.float32).min))[None]


from onnxscript import FLOAT, INT64, script  # noqa: E402
from onnxscript import opset18 as op  # noqa: E402

from .onnx_domain import posbias  # noqa: E402


@script(posbias, default_opset=op)
def Window(q_pos: INT64, k_pos: INT64, window: int, causal: int) -> FLOAT:
    """Local window: 0 where the key is inside the window (which counts the query itself),
    float32 lowest elsewhere, [..., Lq] x [..., Lk] -> [..., 1, Lq, Lk]. Attributes: window,
    causal (1: 0 <= i - j < window; 0: |i - j| < window).

    PyTorch: inside = ((i - j).abs() < w) & ((i - j) >= 0 or not causal); where(inside, 0, lowest)
    """
    w = op.Constant(value_int=window)
    is_causal = op.Constant(value_int=causal)
    rel = op.Sub(op.Unsqueeze(q_pos, [-1]), op.Unsqueeze(k_pos, [-2]))  # i - j, [..., Lq, Lk]
    zero = op.Constant(value_int=0)
    ahead_ok = op.Or(op.GreaterOrEqual(rel, zero), op.Equal(is_causal, zero))  # [..., Lq, Lk]
    inside = op.And(op.Less(op.Abs(rel), w), ahead_ok)
    low = op.Constant(value_float=-3.4028234663852886e38)  # float32 lowest finite, never -inf
    bias = op.Where(inside, op.Constant(value_float=0.0), low)  # [..., Lq, Lk]
    return op.Unsqueeze(bias, [-3])  # [..., 1, Lq, Lk]
