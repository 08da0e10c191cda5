"""Sandwich: the inner product of sinusoidal position embeddings as an attention bias.

Paper: Chi, Fan, Rudnicky, Ramadge. "Dissecting Transformer Length Extrapolation via the Lens
of Receptive Field Analysis", ACL 2023 (arXiv:2212.10356).

Formula: bias_h(i, j) = lambda_h * (<p_i, p_j> - d'/2)
  p_t = [sin(t w_1), cos(t w_1), ..., sin(t w_K), cos(t w_K)], w_k = 10000^(-2(k-1)/d'), K = d'/2
  <p_i, p_j> = sum_k cos((i - j) w_k), largest (= d'/2) at i = j and decaying with distance.
Subtracting d'/2 is a constant shift (softmax ignores it) that makes the bias 0 on the
diagonal and <= 0 elsewhere. lambda_h = H / (8 h) for head h = 1..H: the per-head
compression of the authors' released code, ALiBi-like, so heads see different ranges.
Computed once per distance (a Toeplitz matrix) and gathered: memory [N] + [Lq, Lk], not [Lq, Lk, K].
Hyper-parameters: sin_dim (d', default 128). Learned: no.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from onnxscript import FLOAT, INT64, script
from onnxscript import opset18 as op

from .base import AttentionBias, BiasParams, hyper_parameter, relative_distance
from .onnx_domain import posbias


@dataclass(frozen=True)
class SandwichParams(BiasParams):
    # features [positions, sin_dim / 2] at every length: 8192 is 32x the largest head size in use
    sin_dim: int = hyper_parameter(128, "sinusoid dimension d'", minimum=2, maximum=8192, even=True,
                                   alias="--sandwich-dim", legacy_key="sandwich_dim")


def sandwich_frequencies(sin_dim: int) -> torch.Tensor:
    """w_k = 10000^(-2k/d') for k = 0..d'/2-1, float32 [d'/2]."""
    k = torch.arange(sin_dim // 2, dtype=torch.float64)
    return (10000.0 ** (-2.0 * k / sin_dim)).to(torch.float32)


def sandwich_head_scales(num_heads: int) -> torch.Tensor:
    """lambda_h = H / (8 h), float32 [H]."""
    h = torch.arange(1, num_heads + 1, dtype=torch.float64)
    return (num_heads / (8.0 * h)).to(torch.float32)


SPLIT = 64  # distance = lo + a*SPLIT + b: sinusoids of the coarse and fine parts only


@script(posbias, default_opset=op)
def Sandwich(q_pos: INT64, k_pos: INT64, frequencies: FLOAT, head_scales: FLOAT) -> FLOAT:
    """Sandwich: lambda_h (<p_i, p_j> - d'/2), [..., Lq] x [..., Lk] x [d'/2] x [H] -> [..., H, Lq, Lk].

    <p_i, p_j> = sum_k cos((i - j) w_k) depends on the distance alone: evaluated once per
    distance in [lo, hi] (lo = min i - max j, hi = max i - min j) and gathered, so a decode
    step costs ~N*d' multiply-adds, not (Lq + Lk) * d' sines and cosines. A distance
    lo + a*S + b (S = SPLIT) splits its angle in two: cos(x + y) = cos x cos y - sin x sin y
    makes the table one MatMul of [cos, -sin](coarse) by [cos, sin](fine)^T, with sinusoids
    of N/S + S angles only. Integer offsets before the Cast keep small distances exact.

    PyTorch: SandwichBias.from_positions (the same steps)
    """
    lo = op.Sub(op.ReduceMin(q_pos, keepdims=0), op.ReduceMax(k_pos, keepdims=0))  # scalar
    count = op.Sub(op.Sub(op.ReduceMax(q_pos, keepdims=0), op.ReduceMin(k_pos, keepdims=0)), op.Sub(lo, 1))  # N distances
    split = op.Constant(value_int=SPLIT)
    one = op.Constant(value_int=1)
    zero = op.Constant(value_int=0)
    rows = op.Div(op.Sub(op.Add(count, split), one), split)  # ceil(N / S)
    coarse = op.Add(op.Mul(op.Range(zero, rows, one), split), lo)  # [N/S]: lo + a*S
    fine = op.Range(zero, split, one)  # [S]
    angle_c = op.Mul(op.Unsqueeze(op.Cast(coarse, to=1), [-1]), frequencies)  # [N/S, K]
    angle_f = op.Mul(op.Unsqueeze(op.Cast(fine, to=1), [-1]), frequencies)  # [S, K]
    p_c = op.Concat(op.Cos(angle_c), op.Neg(op.Sin(angle_c)), axis=-1)  # [N/S, 2K]
    p_f = op.Concat(op.Cos(angle_f), op.Sin(angle_f), axis=-1)  # [S, 2K]
    half = op.Cast(op.Shape(frequencies), to=1)  # [1]: d'/2
    inner = op.Sub(op.Reshape(op.MatMul(p_c, op.Transpose(p_f)), [-1]), half)  # [N/S * S]: <p_i, p_j> - d'/2 at distance lo + index
    index = op.Sub(op.Unsqueeze(op.Sub(q_pos, lo), [-1]), op.Unsqueeze(k_pos, [-2]))  # [..., Lq, Lk]: i - j - lo
    per_pair = op.Gather(inner, index)  # [..., Lq, Lk]
    return op.Mul(op.Reshape(head_scales, [-1, 1, 1]), op.Unsqueeze(per_pair, [-3]))  # [..., H, Lq, Lk]


class SandwichBias(AttentionBias):
    name = "sandwich"
    test_tier = "extended"  # the grid tests run its cells under -m slow: it takes kerple_log's per-distance table path
    summary = "`lambda_h * (<p_i, p_j> - d'/2)`, `p` sinusoidal of width `d'`, `lambda_h = H / (8h)`"
    paper = "Chi et al., *Dissecting Transformer Length Extrapolation via the Lens of Receptive Field Analysis*, ACL 2023"
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

    def distance_inner(self, lo: int, count: int) -> torch.Tensor:
        """<p_i, p_j> - d'/2 for the distances lo .. lo + count - 1 (and a few past them), as
        the ONNX function: coarse (lo + a*S) and fine (b) sinusoids, one MatMul. [>= count]"""
        device = self.frequencies.device
        rows = -(-count // SPLIT)
        coarse = torch.arange(rows, device=device) * SPLIT + lo  # [N/S]
        fine = torch.arange(SPLIT, device=device)  # [S]
        angle_c = coarse.to(torch.float32).unsqueeze(-1) * self.frequencies  # [N/S, K]
        angle_f = fine.to(torch.float32).unsqueeze(-1) * self.frequencies  # [S, K]
        p_c = torch.cat([torch.cos(angle_c), -torch.sin(angle_c)], dim=-1)  # [N/S, 2K]
        p_f = torch.cat([torch.cos(angle_f), torch.sin(angle_f)], dim=-1)  # [S, 2K]
        return (p_c @ p_f.T).reshape(-1) - self.sin_dim / 2  # [N/S * S]

    def from_positions(self, q_pos, k_pos):
        if q_pos.numel() == 0 or k_pos.numel() == 0:
            shape = relative_distance(q_pos, k_pos).shape  # [..., Lq, Lk]
            return torch.zeros(*shape[:-2], self.num_heads, *shape[-2:], device=q_pos.device)
        lo = int(q_pos.min() - k_pos.max())
        inner = self.distance_inner(lo, int(q_pos.max() - k_pos.min()) - lo + 1)  # [>= N]
        index = relative_distance(q_pos - lo, k_pos)  # [..., Lq, Lk]: i - j - lo
        return self.head_scales.view(-1, 1, 1) * inner[index].unsqueeze(-3)  # [..., H, Lq, Lk]

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
