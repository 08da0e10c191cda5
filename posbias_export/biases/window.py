"""Local window attention: Su's "super-baseline" (RoPE + attend only to nearby keys).

Source: Su Jianlin, "Transformer Upgrade Road 7: length extrapolation and local attention"
(kexue.fm, 2023): with RoPE and a window no larger than the training length, every query
sees only distances it saw in training, so extrapolation is a non-issue.

Convention: the window COUNTS THE QUERY ITSELF. Causal: query i sees keys j with
0 <= i - j < w (itself and the w - 1 keys before it). Bidirectional: |i - j| < w.
Formula: bias(i, j) = 0 inside the window, the float32 lowest finite value outside
(never -inf, so a row can never become NaN). RoPE is applied by the attention layer.
Hyper-parameters: window (w, default 64). Learned: no.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from onnxscript import FLOAT, INT64, script
from onnxscript import opset18 as op

from .base import FLOAT32_LOWEST, AttentionBias, BiasParams, hyper_parameter, relative_distance
from .onnx_domain import posbias


@dataclass(frozen=True)
class WindowParams(BiasParams):
    window: int = hyper_parameter(64, "keys a query sees, itself included", alias="--window", legacy_key="window")


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
    bias = op.Where(inside, op.Constant(value_float=0.0), op.Constant(value_float=FLOAT32_LOWEST))  # [..., Lq, Lk]
    return op.Unsqueeze(bias, [-3])  # [..., 1, Lq, Lk]


class WindowBias(AttentionBias):
    name = "window"
    summary = "RoPE on q and k, and `0` if `0 <= i - j < w` else masked (`w` counts the query; bidirectional `abs(i - j) < w`)"
    paper = "Su, \"super-baseline\" (kexue.fm, 2023)"
    rank = 60
    Params = WindowParams
    function = Window
    relative = True
    head_independent = True
    mask_only = True  # a FlexAttention baseline: the block mask alone
    uses_rope = True  # Su's super-baseline: RoPE inside the window

    def __init__(self, num_heads: int, causal: bool = True, params: WindowParams | None = None, seed: int = 0):
        super().__init__(num_heads, causal, params, seed)
        self.window = self.params.window

    @property
    def lookback(self) -> int:
        return self.window - 1  # the window counts the query itself

    @classmethod
    def params_for_training(cls, train_len: int) -> dict:
        return {"window": train_len}  # the super-baseline: a window no longer than training

    def function_inputs(self):
        return [], {"window": self.window, "causal": int(self.causal)}

    def from_positions(self, q_pos, k_pos):
        rel = relative_distance(q_pos, k_pos)  # i - j, [..., Lq, Lk]
        inside = rel.abs() < self.window
        if self.causal:
            inside = inside & (rel >= 0)
        zero = torch.zeros((), dtype=torch.float32, device=rel.device)
        low = torch.full((), FLOAT32_LOWEST, dtype=torch.float32, device=rel.device)
        return torch.where(inside, zero, low).unsqueeze(-3)  # [..., 1, Lq, Lk]

    def reference(self, q_pos, k_pos):
        """[1, Lq, Lk]: 0 inside the window, the float32 lowest value outside."""
        rel = np.asarray(q_pos)[:, None] - np.asarray(k_pos)[None, :]
        inside = (rel >= 0) & (rel < self.window) if self.causal else np.abs(rel) < self.window
        return np.where(inside, 0.0, FLOAT32_LOWEST)[None]
