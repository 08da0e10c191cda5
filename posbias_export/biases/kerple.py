"""KERPLE: kernelized relative positional embeddings (power and logarithmic variants).

Paper: Chi, Fan, Ramadge, Rudnicky. "KERPLE: Kernelized Relative Positional Embedding for
Length Extrapolation", NeurIPS 2022 (arXiv:2205.09921).

Two families from one paper, sharing their reparametrization (hence one file):
  power: bias(i, j) = -r1 * |i - j|^r2          with r1 > 0, 0 < r2 <= 2
  log:   bias(i, j) = -r1 * log(1 + r2 * |i - j|) with r1, r2 > 0
Learnable per head. The constraints hold for ANY raw parameter value by reparametrization:
  r1 = softplus(raw_r1)            (clamped at EPS so underflow cannot give 0)
  r2 = 2 * sigmoid(raw_r2)         (power; clamped to [EPS, 2])
  r2 = softplus(raw_r2)            (log;  clamped at EPS)
Checkpoints store the natural values r1 and r2 (what the paper reports), never the raw ones;
loading validates them, so a checkpoint with r2 > 2 for the power variant is rejected.
Hyper-parameters: none. Learned: yes (r1, r2 per head).
"""
from __future__ import annotations

import numpy as np
import torch
from onnxscript import FLOAT, INT64, script
from onnxscript import opset18 as op
from torch import nn
from torch.nn import functional as F

from .base import AttentionBias, relative_distance
from .onnx_domain import RelativeDistance, posbias

EPS = 1e-6


@script(posbias, default_opset=op)
def KerplePower(q_pos: INT64, k_pos: INT64, r1: FLOAT, r2: FLOAT) -> FLOAT:
    """KERPLE power: -r1_h * |i - j|^r2_h, [..., Lq] x [..., Lk] x [H] x [H] -> [..., H, Lq, Lk].
    r1, r2 are the constrained (natural) values, as KerplePowerBias.r1() / .r2() give them.

    PyTorch: -r1.view(-1, 1, 1) * torch.pow(distance.unsqueeze(-3), r2.view(-1, 1, 1))
    """
    distance = op.Unsqueeze(op.Abs(RelativeDistance(q_pos, k_pos)), [-3])  # [..., 1, Lq, Lk]
    r1_h = op.Reshape(r1, [-1, 1, 1])  # [H, 1, 1]
    r2_h = op.Reshape(r2, [-1, 1, 1])  # [H, 1, 1]
    return op.Mul(op.Neg(r1_h), op.Pow(distance, r2_h))  # [..., H, Lq, Lk]


@script(posbias, default_opset=op)
def KerpleLog(q_pos: INT64, k_pos: INT64, r1: FLOAT, r2: FLOAT) -> FLOAT:
    """KERPLE log: -r1_h * log(1 + r2_h |i - j|), [..., Lq] x [..., Lk] x [H] x [H] -> [..., H, Lq, Lk].

    PyTorch: -r1.view(-1, 1, 1) * torch.log1p(r2.view(-1, 1, 1) * distance.unsqueeze(-3))
    """
    distance = op.Unsqueeze(op.Abs(RelativeDistance(q_pos, k_pos)), [-3])  # [..., 1, Lq, Lk]
    r1_h = op.Reshape(r1, [-1, 1, 1])  # [H, 1, 1]
    r2_h = op.Reshape(r2, [-1, 1, 1])  # [H, 1, 1]
    one = op.Constant(value_float=1.0)
    # 1 + r2 d >= 1: Log never sees 0. (ONNX has no log1p; for d >= 1 and r2 of O(1) the
    # argument is >= 1 + r2 and plain Log loses nothing that matters in float32.)
    return op.Mul(op.Neg(r1_h), op.Log(op.Add(one, op.Mul(r2_h, distance))))  # [..., H, Lq, Lk]


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    # softplus^-1(y) = y + log(1 - exp(-y)), stable for small and large y
    return y + torch.log(-torch.expm1(-y))


def _distance64(q_pos, k_pos) -> np.ndarray:
    return np.abs(np.asarray(q_pos, np.float64)[:, None] - np.asarray(k_pos, np.float64)[None, :])  # [Lq, Lk]


class _KerpleBase(AttentionBias):
    """The shared reparametrization and checkpoint format; not a family itself (no name)."""

    learned = True
    relative = True
    r2_max: float | None = None

    def __init__(self, num_heads: int, causal: bool = True, params=None, seed: int = 0):
        super().__init__(num_heads, causal, params, seed)
        gen = torch.Generator().manual_seed(seed)
        # Natural-value init spread over heads, like the paper's uniform init.
        r1 = 0.1 + 1.9 * torch.rand(num_heads, generator=gen)
        r2 = 0.1 + 0.9 * torch.rand(num_heads, generator=gen)
        self.raw_r1 = nn.Parameter(torch.zeros(num_heads))
        self.raw_r2 = nn.Parameter(torch.zeros(num_heads))
        self.set_natural(r1, r2)
        self.register_state_dict_post_hook(_natural_state_dict_hook)
        self.register_load_state_dict_pre_hook(_natural_load_pre_hook)

    def function_inputs(self):
        return [self.r1(), self.r2()], {}  # natural values: the function needs no reparametrization

    def natural64(self) -> tuple[np.ndarray, np.ndarray]:
        """(r1, r2) [H] as float64, for the oracle."""
        return self.r1().detach().double().numpy(), self.r2().detach().double().numpy()

    # --- constrained values ---------------------------------------------------------------
    def r1(self) -> torch.Tensor:
        return F.softplus(self.raw_r1).clamp_min(EPS)  # [H]

    def r2(self) -> torch.Tensor:
        raise NotImplementedError

    def _raw_r2_from(self, r2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def check_natural(self, r1: torch.Tensor, r2: torch.Tensor) -> None:
        r1 = torch.as_tensor(r1, dtype=torch.float64)
        r2 = torch.as_tensor(r2, dtype=torch.float64)
        for label, value in (("r1", r1), ("r2", r2)):
            if value.shape != (self.num_heads,):
                raise ValueError(
                    f"{self.name} {label} must have shape [{self.num_heads}], got {list(value.shape)}"
                )
            if not torch.isfinite(value).all() or (value <= 0).any():
                raise ValueError(f"{self.name} requires {label} > 0, got {value.tolist()}")
        if self.r2_max is not None and (r2 > self.r2_max).any():
            raise ValueError(f"{self.name} requires 0 < r2 <= {self.r2_max:g}, got {r2.tolist()}")

    @torch.no_grad()
    def set_natural(self, r1, r2) -> None:
        self.check_natural(r1, r2)
        r1 = torch.as_tensor(r1, dtype=torch.float64).clamp_min(EPS)
        r2 = torch.as_tensor(r2, dtype=torch.float64).clamp_min(EPS)
        self.raw_r1.copy_(_inverse_softplus(r1).to(self.raw_r1.dtype))
        self.raw_r2.copy_(self._raw_r2_from(r2).to(self.raw_r2.dtype))


def _natural_state_dict_hook(module, state_dict, prefix, local_metadata):
    raw1, raw2 = state_dict.pop(prefix + "raw_r1"), state_dict.pop(prefix + "raw_r2")
    state_dict[prefix + "r1"] = module.r1().detach().to(raw1.dtype)
    state_dict[prefix + "r2"] = module.r2().detach().to(raw2.dtype)


def _natural_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    if prefix + "r1" not in state_dict or prefix + "r2" not in state_dict:
        return  # the normal missing-key error is reported by load_state_dict
    r1, r2 = state_dict.pop(prefix + "r1"), state_dict.pop(prefix + "r2")
    module.check_natural(r1, r2)  # raises ValueError with the offending values
    state_dict[prefix + "raw_r1"] = _inverse_softplus(r1.double().clamp_min(EPS)).to(module.raw_r1.dtype)
    state_dict[prefix + "raw_r2"] = module._raw_r2_from(r2.double().clamp_min(EPS)).to(module.raw_r2.dtype)


class KerplePowerBias(_KerpleBase):
    name = "kerple_power"
    test_tier = "extended"  # the grid tests run its cells under -m slow: it takes kerple_log's per-distance table path
    summary = "`-r1 * abs(i - j)^r2`, learned per head, `r1 > 0`, `0 < r2 <= 2`"
    paper = "Chi et al., *KERPLE*, NeurIPS 2022"
    rank = 20
    function = KerplePower
    r2_max = 2.0

    def r2(self) -> torch.Tensor:
        return (2.0 * torch.sigmoid(self.raw_r2)).clamp(EPS, 2.0)  # [H]

    def _raw_r2_from(self, r2):
        half = (r2 / 2.0).clamp(EPS, 1.0 - 1e-12)
        return torch.log(half) - torch.log1p(-half)  # logit

    def from_positions(self, q_pos, k_pos):
        distance = relative_distance(q_pos, k_pos).abs().to(torch.float32).unsqueeze(-3)  # [..., 1, Lq, Lk]
        r1, r2 = self.r1().view(-1, 1, 1), self.r2().view(-1, 1, 1)  # [H, 1, 1]
        return -r1 * torch.pow(distance, r2)  # [..., H, Lq, Lk]; 0^r2 = 0 since r2 > 0

    def reference(self, q_pos, k_pos):
        """float64: -r1 |i-j|^r2, [H, Lq, Lk]."""
        r1, r2 = self.natural64()
        return -r1[:, None, None] * _distance64(q_pos, k_pos)[None] ** r2[:, None, None]


class KerpleLogBias(_KerpleBase):
    name = "kerple_log"
    summary = "`-r1 * log(1 + r2 * abs(i - j))`, learned per head, `r1, r2 > 0`"
    paper = "Chi et al., *KERPLE*, NeurIPS 2022"
    rank = 30
    function = KerpleLog

    def r2(self) -> torch.Tensor:
        return F.softplus(self.raw_r2).clamp_min(EPS)  # [H]

    def _raw_r2_from(self, r2):
        return _inverse_softplus(r2)

    def from_positions(self, q_pos, k_pos):
        distance = relative_distance(q_pos, k_pos).abs().to(torch.float32).unsqueeze(-3)  # [..., 1, Lq, Lk]
        r1, r2 = self.r1().view(-1, 1, 1), self.r2().view(-1, 1, 1)  # [H, 1, 1]
        # 1 + r2*|i-j| >= 1, so log never sees 0
        return -r1 * torch.log1p(r2 * distance)  # [..., H, Lq, Lk]

    def reference(self, q_pos, k_pos):
        """float64: -r1 log(1 + r2 |i-j|), [H, Lq, Lk]."""
        r1, r2 = self.natural64()
        return -r1[:, None, None] * np.log1p(r2[:, None, None] * _distance64(q_pos, k_pos)[None])
