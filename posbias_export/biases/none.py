"""No positional bias (NoPE, or positions carried by RoPE / absolute embeddings)."""
from __future__ import annotations

import torch

from .base import AttentionBias, relative_distance


class NoBias(AttentionBias):
    name = "none"

    def from_positions(self, q_pos, k_pos):
        rel = relative_distance(q_pos, k_pos)  # [..., Lq, Lk]
        return torch.zeros_like(rel, dtype=torch.float32).unsqueeze(-3)  # [..., 1, Lq, Lk]
