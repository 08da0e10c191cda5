"""No positional bias (NoPE, or positions carried by RoPE / absolute embeddings).

Formula: bias(i, j) = 0. Hyper-parameters: none. Learned: no.
"""
from __future__ import annotations

import numpy as np
import torch
from onnxscript import FLOAT, INT64, script
from onnxscript import opset18 as op

from .base import AttentionBias, relative_distance
from .onnx_domain import posbias


@script(posbias, default_opset=op)
def NoBias(q_pos: INT64, k_pos: INT64) -> FLOAT:
    """Zeros, [..., Lq] x [..., Lk] -> [..., 1, Lq, Lk].

    PyTorch: torch.zeros(*q_pos.shape, k_pos.shape[-1]).unsqueeze(-3)
    """
    rel = op.Sub(op.Unsqueeze(q_pos, [-1]), op.Unsqueeze(k_pos, [-2]))  # [..., Lq, Lk]
    zeros = op.Mul(op.Cast(rel, to=1), op.Constant(value_float=0.0))
    return op.Unsqueeze(zeros, [-3])  # [..., 1, Lq, Lk]


@script(posbias, default_opset=op)
def NoBiasKeyRow(q_pos_b: INT64, k_pos_b: INT64) -> FLOAT:
    """Zeros as one row for the blocked form, [..., Bq] x [..., W] -> [..., 1, 1, W]: the
    scores need no [Bq, W] bias at all (exact, so bidirectional exports use it too).

    PyTorch: torch.zeros(*k_pos_b.shape[:-1], 1, 1, k_pos_b.shape[-1])
    """
    zeros = op.Mul(op.Cast(k_pos_b, to=1), op.Constant(value_float=0.0))  # [..., W]
    return op.Unsqueeze(zeros, [-2, -3])  # [..., 1, 1, W]


class NoPositionalBias(AttentionBias):
    name = "none"
    test_tier = "extended"  # the grid tests run its cells under -m slow: it takes the baseline every family's path is built on
    summary = "nothing (NoPE)"
    rank = 1000  # last: the baseline every other family is compared with
    function = NoBias
    function_name = "NoBias"
    head_independent = True
    mask_only = True  # a FlexAttention baseline: the block mask alone
    relative = True
    key_row_function = NoBiasKeyRow
    key_row_exact = True

    def from_positions(self, q_pos, k_pos):
        rel = relative_distance(q_pos, k_pos)  # [..., Lq, Lk]
        return torch.zeros_like(rel, dtype=torch.float32).unsqueeze(-3)  # [..., 1, Lq, Lk]

    def reference(self, q_pos, k_pos):
        return np.zeros((1, len(q_pos), len(k_pos)))
