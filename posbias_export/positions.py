"""Rotary position embedding (RoPE), applied to queries and keys inside attention.

Paper: Su et al. "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021).
Rotate each pair (x_{2k}, x_{2k+1})... here in the half-split layout (x_k, x_{k+d/2}) used by
GPT-NeoX/LLaMA, by angle t * theta_k with theta_k = base^(-2k/d).
"""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        k = torch.arange(head_dim // 2, dtype=torch.float64)
        self.register_buffer("inv_freq", (base ** (-2.0 * k / head_dim)).to(torch.float32), persistent=False)  # [d/2]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, L, d], positions [L] or [B, L] -> rotated x, same shape and dtype."""
        angle = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [..., L, d/2]
        if angle.dim() == 3:
            angle = angle.unsqueeze(1)  # [B, 1, L, d/2]: batched positions broadcast over heads
        cos, sin = torch.cos(angle), torch.sin(angle)
        x1, x2 = x.float().chunk(2, dim=-1)  # [B, H, L, d/2] each
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [B, H, L, d]
        return rotated.to(x.dtype)
