"""T5 relative position buckets: a learned scalar per (bucket, head).

Paper: Raffel et al. "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer", JMLR 2020 (arXiv:1910.10683), section 2.1.

Formula, with relative_position = j - i (key minus query) and n = num_buckets:
  bidirectional: half the buckets for j > i (offset n/2), the other half for j <= i; n <- n/2
  causal: only j <= i is distinguished; r = max(i - j, 0)
  r < n/2                    -> bucket r (exact)
  r >= n/2                   -> n/2 + floor(log(r / (n/2)) / log(max_distance / (n/2)) * (n - n/2)),
                                capped at n - 1 (logarithmic bins up to max_distance)
  bias_h(i, j) = embedding[bucket(j - i), h]
The bucket function matches Hugging Face transformers' T5Attention._relative_position_bucket
bit for bit (checkpoints depend on it), including its float32 log arithmetic. Every distance
>= max_distance falls in the last bucket, so the module precomputes one bucket per offset in
[-max_distance, max_distance] (a table that does not grow with sequence length) and clamps.
Hyper-parameters: num_buckets (32), max_distance (128). Learned: yes (the [n, H] table).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from onnxscript import FLOAT, INT64, script
from onnxscript import opset18 as op
from torch import nn

from .base import AttentionBias, BiasParams, hyper_parameter, relative_distance
from .onnx_domain import posbias


@dataclass(frozen=True)
class T5Params(BiasParams):
    # the table is [num_buckets, heads]: 65536 buckets are 2048x T5's 32
    num_buckets: int = hyper_parameter(32, "number of buckets", minimum=4, maximum=1 << 16, alias="--t5-buckets",
                                       legacy_key="t5_num_buckets")
    max_distance: int = hyper_parameter(128, "distance of the last bucket", alias="--t5-max-distance",
                                        legacy_key="t5_max_distance")

    def check(self) -> None:
        if self.max_distance <= self.num_buckets // 2:
            raise ValueError(f"t5 needs max_distance > num_buckets/2, got {self.num_buckets}, {self.max_distance}")


def t5_relative_bucket(
    relative_position: torch.Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """Bucket index (int64) for each relative position j - i."""
    relative_position = torch.as_tensor(relative_position).to(torch.int64)
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.int64) * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp_min(0)
    max_exact = num_buckets // 2
    # Clamp before log: exact distances never use the log branch, and log(0) is -inf.
    far = distance.clamp_min(max_exact).to(torch.float32)
    log_bins = (
        torch.log(far / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.int64)
    far_bucket = (max_exact + log_bins).clamp_max(num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, far_bucket)


def reference_bucket(offset: np.ndarray, bidirectional: bool, num_buckets: int, max_distance: int) -> np.ndarray:
    """The paper's bucket of j - i, in numpy with exact integer thresholds: distance r lands in
    log bin b when r >= (n/2) * (max_distance / (n/2)) ** (b / (n - n/2)), found by counting
    the thresholds it reaches (no floor of a rounded logarithm)."""
    offset = np.asarray(offset, np.int64)
    n = num_buckets // 2 if bidirectional else num_buckets
    base = np.where(offset > 0, n, 0) if bidirectional else np.zeros_like(offset)
    distance = np.abs(offset) if bidirectional else np.maximum(-offset, 0)
    exact = n // 2
    bins = n - exact
    thresholds = exact * (max_distance / exact) ** (np.arange(1, bins) / bins)  # float64 [bins - 1]
    log_bin = (distance[..., None] >= thresholds).sum(-1)
    return base + np.where(distance < exact, distance, np.minimum(exact + log_bin, n - 1))


@script(posbias, default_opset=op)
def T5(q_pos: INT64, k_pos: INT64, bucket_of_offset: INT64, weight: FLOAT, max_distance: int) -> FLOAT:
    """T5 bias: weight[bucket(j - i), h], via the per-offset bucket table,
    [..., Lq] x [..., Lk] x [2M+1] x [n, H] -> [..., H, Lq, Lk] (M = max_distance attribute).

    PyTorch: buckets = bucket_of_offset[(j - i).clamp(-M, M) + M]; weight[buckets].movedim(-1, -3)
    """
    m = op.Constant(value_int=max_distance)
    offset = op.Sub(op.Unsqueeze(k_pos, [-2]), op.Unsqueeze(q_pos, [-1]))  # j - i, [..., Lq, Lk]
    index = op.Add(op.Clip(offset, op.Neg(m), m), m)  # [..., Lq, Lk] in [0, 2M]
    buckets = op.Gather(bucket_of_offset, index, axis=0)  # [..., Lq, Lk]
    values = op.Gather(weight, buckets, axis=0)  # [..., Lq, Lk, H]
    # head axis from last to third-from-last, for 1-D and batched positions alike
    return op.Einsum(values, equation="...qkh->...hqk")  # [..., H, Lq, Lk]


class T5Bias(AttentionBias):
    name = "t5"
    summary = "a learned scalar per (bucket of `j - i`, head), log-spaced buckets, Hugging Face's bucket function"
    paper = "Raffel et al., *T5*, JMLR 2020"
    rank = 50
    Params = T5Params
    function = T5
    relative = True
    learned = True
    symmetric = False  # bidirectional: j > i and j < i use different buckets

    def __init__(self, num_heads: int, causal: bool = True, params: T5Params | None = None, seed: int = 0):
        super().__init__(num_heads, causal, params, seed)
        self.num_buckets, self.max_distance = self.params.num_buckets, self.params.max_distance
        self.relative_attention_bias = nn.Embedding(self.num_buckets, num_heads)  # [n, H]
        nn.init.normal_(self.relative_attention_bias.weight, std=0.5, generator=torch.Generator().manual_seed(seed))
        offsets = torch.arange(-self.max_distance, self.max_distance + 1)  # j - i, clamped range
        table = t5_relative_bucket(offsets, not causal, self.num_buckets, self.max_distance)
        self.register_buffer("bucket_of_offset", table, persistent=False)  # [2*max_distance + 1]

    def function_inputs(self):
        return [self.bucket_of_offset, self.relative_attention_bias.weight], {"max_distance": self.max_distance}

    @property
    def far_distance(self) -> int:
        """Every distance from max_distance on is the last bucket of its side."""
        return self.max_distance

    def from_positions(self, q_pos, k_pos):
        offset = (-relative_distance(q_pos, k_pos)).clamp(-self.max_distance, self.max_distance)  # j - i, [..., Lq, Lk]
        buckets = self.bucket_of_offset[offset + self.max_distance]  # [..., Lq, Lk]
        values = self.relative_attention_bias(buckets).to(torch.float32)  # [..., Lq, Lk, H]
        return values.movedim(-1, -3)  # [..., H, Lq, Lk]

    def reference(self, q_pos, k_pos):
        """float64 table lookup at the paper's bucket of every (i, j), no clamped table: [H, Lq, Lk]."""
        offset = np.asarray(k_pos)[None, :] - np.asarray(q_pos)[:, None]  # j - i, [Lq, Lk]
        buckets = reference_bucket(offset, not self.causal, self.num_buckets, self.max_distance)
        weight = self.relative_attention_bias.weight.detach().double().numpy()  # [n, H]
        return np.moveaxis(weight[buckets], -1, 0)  # [H, Lq, Lk]
