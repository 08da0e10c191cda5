"""Position encodings that are not attention biases.

- RoPE (Su et al., "RoFormer", 2021): rotate (x_k, x_{k+d/2}) (the half-split layout of
  GPT-NeoX/LLaMA) by t * theta_k, theta_k = base^(-2k/d). Scaling for longer contexts:
  "linear" position interpolation (Chen et al. 2023): t -> t / s; "ntk"-aware base scaling
  (bloc97, 2023): base -> base * s^(d / (d - 2)), which stretches low frequencies and keeps
  high ones.
- Sinusoidal absolute (Vaswani et al. 2017): PE[t, 2i] = sin(t / 10000^(2i/d)),
  PE[t, 2i+1] = cos(...), added to the token embeddings; computed on the fly.
- Learned absolute (GPT-2 style): a [max_positions, d] table; beyond it a model has no
  embedding, so it is resized (linear interpolation or copying) or refused.
- log-n attention scaling (Su, 2021): q at 1-based position n scaled by max(1, log(n) / log(L_train)).
"""
from __future__ import annotations

import math

import torch
from torch import nn


ROPE_SCALINGS = ("none", "linear", "ntk")
POSITIONS = ("none", "sinusoidal", "learned")
RESIZE_METHODS = ("interpolate", "copy")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0, scaling: str = "none", factor: float = 1.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        if scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling must be one of {ROPE_SCALINGS}, got {scaling!r}")
        if scaling == "ntk":
            base = base * factor ** (head_dim / (head_dim - 2)) if head_dim > 2 else base * factor
        k = torch.arange(head_dim // 2, dtype=torch.float64)
        inv_freq = base ** (-2.0 * k / head_dim)
        if scaling == "linear":
            inv_freq = inv_freq / factor  # t / s * theta == t * (theta / s)
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)  # [d/2]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, L, d], positions [L] or [B, L] -> rotated x, same shape and dtype."""
        angle = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [..., L, d/2]
        if angle.dim() == 3:
            angle = angle.unsqueeze(1)  # [B, 1, L, d/2]: batched positions broadcast over heads
        cos, sin = torch.cos(angle), torch.sin(angle)
        x1, x2 = x.float().chunk(2, dim=-1)  # [B, H, L, d/2] each
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [B, H, L, d]
        return rotated.to(x.dtype)


def sinusoidal_embedding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """[..., L] int positions -> [..., L, dim] float32, interleaved sin/cos (Vaswani et al.)."""
    i = torch.arange(dim // 2, device=positions.device, dtype=torch.float32)
    freq = torch.exp(i * (-2.0 * math.log(10000.0) / dim))  # [dim/2]
    angle = positions.to(torch.float32).unsqueeze(-1) * freq  # [..., L, dim/2]
    return torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1).flatten(-2)  # [..., L, dim]


def logn_scale(q_pos: torch.Tensor, train_len: int) -> torch.Tensor:
    """max(1, log(n) / log(L_train)) for 1-based position n; [..., Lq] -> [..., Lq] float32."""
    n = (q_pos + 1).to(torch.float32)
    return (torch.log(n) / math.log(train_len)).clamp_min(1.0)


@torch.no_grad()
def resize_learned_table(table: torch.Tensor, new_len: int, method: str) -> torch.Tensor:
    """[old, d] -> [new_len, d]: linear interpolation over positions, or copying the table
    periodically (row t takes row t mod old)."""
    if method not in RESIZE_METHODS:
        raise ValueError(f"resize method must be one of {RESIZE_METHODS}, got {method!r}")
    old = table.shape[0]
    if method == "copy":
        return table[torch.arange(new_len) % old].clone()
    grid = table.T.unsqueeze(0).float()  # [1, d, old]
    return torch.nn.functional.interpolate(grid, size=new_len, mode="linear", align_corners=True)[0].T.to(table.dtype)
