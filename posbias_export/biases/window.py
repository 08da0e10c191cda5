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
