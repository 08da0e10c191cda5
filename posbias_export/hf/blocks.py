"""The pieces the imported architectures build their layers from: head reshapes, self-attention
through our biased attention (plain or blocked, with a KV cache), the softmax scale folded into
the queries, ALiBi slopes as transformers computes them, and T5's RMSNorm."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..biases import AttentionBias, query_key_positions
from ..nn.attention import EAGER, AttentionSettings, attention_heads, inplace_attention
from ..nn.lazy_weights import parameter_device


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, L, H * d] -> [B, H, L, d]."""
    B, L, _ = x.shape
    return x.view(B, L, heads, -1).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """[B, H, L, d] -> [B, L, H * d]."""
    B, H, L, d = y.shape
    return y.transpose(1, 2).reshape(B, L, H * d)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, L, d] -> [B, heads, L, d]: key/value head g serves query heads g * r .. g * r + r - 1
    (r = heads / Hkv), the grouping of Falcon's fused QKV layouts."""
    B, Hkv, L, d = x.shape
    if Hkv == heads:
        return x
    return x[:, :, None].expand(B, Hkv, heads // Hkv, L, d).reshape(B, heads, L, d)


def self_attention(q, k, v, attention_mask, past, bias: AttentionBias, settings: AttentionSettings = EAGER,
                   positions_from_mask: bool = False):
    """q [B, H, Lq, d], the new k/v [B, Hkv, Lq, d] (Hkv divides H: multi-query and grouped
    layouts keep their own key/value heads in the cache); past (k, v) [B, Hkv, P, d] or None;
    attention_mask [B, P + Lq] (1 = token, 0 = padding) or None.
    Positions are 0..Lk-1, or cumsum(mask) - 1 where the original model counts them so
    (Falcon: its rounded bias is not shift-invariant). Softmax scale 1/sqrt(d): callers fold
    a model's own scale into q. Returns y [B, H, Lq, d] and the present (k, v) [B, H, P+Lq, d]."""
    if past is not None and settings.cache == "inplace" and settings.functions:  # --target ort: written in place
        return inplace_attention(q, k, v, past, attention_mask, bias, positions_from_mask)
    if past is not None:
        k = torch.cat([past[0].to(k.dtype), k], dim=2)  # [B, H, P + Lq, d]
        v = torch.cat([past[1].to(v.dtype), v], dim=2)
    Lq, Lk = q.shape[2], k.shape[2]
    if positions_from_mask and attention_mask is not None:
        k_pos = (attention_mask.to(torch.int64).cumsum(-1) - 1).clamp_min(0)  # [B, Lk]
        q_pos = k_pos[:, Lk - Lq:]  # [B, Lq]
    else:
        q_pos, k_pos = query_key_positions(Lq, Lk, device=q.device)  # [Lq], [Lk]
    heads = q.shape[1]
    y = attention_heads(q, repeat_kv(k, heads), repeat_kv(v, heads), q_pos, k_pos, attention_mask, bias, bias.causal,
                        settings)  # [B, H, Lq, d]
    return y, (k, v)  # the cache keeps Hkv heads


def scale_queries(q: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Fold a model's softmax scale into q: our attention multiplies by 1/sqrt(d) (exact when
    the two agree; T5's scale 1 with d = 64 multiplies by 8 and back, also exact)."""
    factor = softmax_scale * math.sqrt(q.shape[-1])
    return q if factor == 1.0 else q * factor


def bloom_style_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes as BLOOM and Falcon compute them, float32 [H]: base^k with base = 2^(-8/p)
    in float32 for the p = 2^floor(log2 H) first heads, odd powers of 2^(-4/p) for the rest.
    The values are the paper's; computing them as transformers does keeps the last bit."""
    p = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(p) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + p, dtype=torch.int32))
    if p != num_heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * p) - 3))), dtype=torch.float32)
        rest = min(p, num_heads - p)
        slopes = torch.cat([slopes, torch.pow(extra, torch.arange(1, 1 + 2 * rest, 2, dtype=torch.int32))])
    return slopes


class RMSNorm(nn.Module):
    """T5's LayerNorm: no mean, no bias; variance in float32. [..., D] -> [..., D]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=parameter_device()))  # meta from a folder: a lying dim allocates nothing
        self.eps = eps

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(self.weight.dtype)
