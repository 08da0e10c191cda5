"""Sandwich: the inner product of sinusoidal position embeddings as an attention bias.

Paper: Chi, Fan, Rudnicky, Ramadge. "Dissecting Transformer Length Extrapolation via the Lens
of Receptive Field Analysis", ACL 2023 (arXiv:2212.10356).

Formula: bias_h(i, j) = lambda_h * (<p_i, p_j> - d'/2)
  p_t = [sin(t w_1), cos(t w_1), ..., sin(t w_K), cos(t w_K)], w_k = 10000^(-2(k-1)/d'), K = d'/2
  <p_i, p_j> = sum_k cos((i - j) w_k), largest (= d'/2) at i = j and decaying with distance.
Subtracting d'/2 is a constant shift (softmax ignores it) that makes the bias 0 on the
diagonal and <= 0 elsewhere. lambda_h = H / (8 h) for head h = 1..H: the per-head
compression of the authors' released code, ALiBi-like, so heads see different ranges.
Computed as a matrix product of position tables, so memory stays [Lq, Lk], not [Lq, Lk, K].
Hyper-parameters: sin_dim (d', default 128). Learned: no.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from onnxscript import FLOAT, INT64, script
from onnxscript import opset18 as op

from .base import AttentionBias, BiasParams, hyper_parameter
from .onnx_domain import posbias


@dataclass(frozen=True)
class SandwichParams(BiasParams):
    sin_dim: int = hyper_parameter(128, "sinusoid dimension d'", minimum=2, even=True, alias="--sandwich-dim",
                                   legacy_key="sandwich_dim")


def sandwich_frequencies(sin_dim: int) -> torch.Tensor:
    """w_k = 10000^(-2k/d') for k = 0..d'/2-1, float32 [d'/2]."""
    k = torch.arange(sin_dim // 2, dtype=torch.float64)
    return (10000.0 ** (-2.0 * k / sin_dim)).to(torch.float32)


def sandwich_head_scales(num_heads: int) -> torch.Tensor:
    """lambda_h = H / (8 h), float32 [H]."""
    h = torch.arange(1, num_heads + 1, dtype=torch.float64)
    return (num_heads / (8.0 * h)).to(torch.float32)


@script(posbias, default_opset=op)
def Sandwich(q_pos: INT64, k_pos: INT64, frequencies: FLOAT, head_scales: FLOAT) -> FLOAT:
    """Sandwich: lambda_h (<p_i, p_j> - d'/2), [..., Lq] x [..., Lk] x [d'/2] x [H] -> [..., H, Lq, Lk].

    One sinusoid table for the query and key positions together, and a rank-3 MatMul (an Einsum
    with an ellipsis was the slowest op of a decode step on ONNX Runtime).

    PyTorch: p = cat(sin(pos * w), cos(pos * w)); lambda.view(-1, 1, 1) * (p_q @ p_k.mT - d'/2).unsqueeze(-3)
    """
    q_len = op.Shape(q_pos, start=-1)  # [1]
    pos = op.Concat(q_pos, k_pos, axis=-1)  # [..., Lq + Lk], one table for both
    angle = op.Mul(op.Unsqueeze(op.Cast(pos, to=1), [-1]), frequencies)  # [..., L, K]
    sin_t = op.Sin(angle)  # [..., L, K]
    cos_t = op.Cos(angle)  # [..., L, K]
    # 1-D and batched positions alike as [B', L, 2K] (B' = 1 or B): a rank-3 MatMul, 9x faster on
    # ONNX Runtime than the Einsum "...qd,...kd->...qk" for a decode step (0.04 vs 0.39 ms, 4096 keys)
    flat = op.Concat([-1], op.Shape(pos, start=-1), op.Mul(op.Shape(frequencies), [2]), axis=0)  # [3]: B', L, 2K
    table = op.Reshape(op.Concat(sin_t, cos_t, axis=-1), flat)  # [B', L, 2K]
    p_q = op.Slice(table, [0], q_len, [1])  # [B', Lq, 2K]
    p_k = op.Slice(table, q_len, [9223372036854775807], [1])  # [B', Lk, 2K]
    half = op.Cast(op.Shape(frequencies), to=1)  # [1]: d'/2
    inner = op.Sub(op.MatMul(p_q, op.Transpose(p_k, perm=[0, 2, 1])), half)  # [B', Lq, Lk]
    inner_shape = op.Concat(op.Shape(q_pos), op.Shape(k_pos, start=-1), axis=0)  # [..., Lq, Lk]
    return op.Mul(op.Reshape(head_scales, [-1, 1, 1]), op.Unsqueeze(op.Reshape(inner, inner_shape), [-3]))  # [..., H, Lq, Lk]


class SandwichBias(AttentionBias):
    name = "sandwich"
    rank = 40
    Params = SandwichParams
    function = Sandwich
    relative = True

    def __init__(self, num_heads: int, causal: bool = True, params: SandwichParams | None = None, seed: int = 0):
        super().__init__(num_heads, causal, params, seed)
        self.sin_dim = self.params.sin_dim
        self.register_buffer("frequencies", sandwich_frequencies(self.sin_dim), persistent=False)  # [K]
        self.register_buffer("head_scales", sandwich_head_scales(num_heads), persistent=False)  # [H]

    def function_inputs(self):
        return [self.frequencies, self.head_scales], {}

    def position_table(self, pos: torch.Tensor) -> torch.Tensor:
        """Sinusoidal embeddings [..., L] -> [..., L, d'] (sin block then cos block)."""
        angle = pos.to(torch.float32).unsqueeze(-1) * self.frequencies  # [..., L, K]
        return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)  # [..., L, 2K]

    def from_positions(self, q_pos, k_pos):
        p_q = self.position_table(q_pos)  # [..., Lq, d']
        p_k = self.position_table(k_pos)  # [..., Lk, d']
        inner = p_q @ p_k.transpose(-1, -2) - self.sin_dim / 2  # [..., Lq, Lk]
        return self.head_scales.view(-1, 1, 1) * inner.unsqueeze(-3)  # [..., H, Lq, Lk]

    def reference(self, q_pos, k_pos):
        """float64 via the identity <p_i, p_j> = sum_k cos((i - j) w_k): [H, Lq, Lk]."""
        d = self.sin_dim
        w = 10000.0 ** (-2.0 * np.arange(d // 2, dtype=np.float64) / d)
        rel = np.asarray(q_pos, np.float64)[:, None] - np.asarray(k_pos, np.float64)[None, :]
        inner = np.zeros_like(rel)
        for wk in w:  # loop over frequencies keeps memory at [Lq, Lk]
            inner += np.cos(rel * wk)
        scales = self.num_heads / (8.0 * np.arange(1, self.num_heads + 1, dtype=np.float64))
        return scales[:, None, None] * (inner - d / 2)[None]
