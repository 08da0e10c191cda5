"""No positional bias (NoPE, or positions carried by RoPE / absolute embeddings)."""
from __future__ import annotations

import torch

from .base import AttentionBias, relative_distance


class NoPositionalBias(AttentionBias):
    name = "none"
    output_heads_is_one = True

    def onnx_function(self):
        return NoBias

    def from_positions(self, q_pos, k_pos):
        rel = relative_distance(q_pos, k_pos)  # [..., Lq, Lk]
        return torch.zeros_like(rel, dtype=torch.float32).unsqueeze(-3)  # [..., 1, Lq, Lk]


from onnxscript import FLOAT, INT64, script  # noqa: E402
from onnxscript import opset18 as op  # noqa: E402

from .onnx_domain import posbias  # noqa: E402


@script(posbias, default_opset=op)
def NoBias(q_pos: INT64, k_pos: INT64) -> FLOAT:
    """Zeros, [..., Lq] x [..., Lk] -> [..., 1, Lq, Lk].

    PyTorch: torch.zeros(*q_pos.shape, k_pos.shape[-1]).unsqueeze(-3)
    """
    rel = op.Sub(op.Unsqueeze(q_pos, [-1]), op.Unsqueeze(k_pos, [-2]))  # [..., Lq, Lk]
    zeros = op.Mul(op.Cast(rel, to=1), op.Constant(value_float=0.0))
    return op.Unsqueeze(zeros, [-3])  # [..., 1, Lq, Lk]
