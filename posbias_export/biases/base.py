"""Shared pieces of every bias family: the position convention and the mask value."""
from __future__ import annotations

import torch
from torch import nn


def query_key_positions(q_len, k_len, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys sit at 0..k_len-1; queries are the LAST q_len of them (prefill and decode share one path)."""
    k_pos = torch.arange(k_len, device=device)  # [Lk]
    q_pos = torch.arange(k_len - q_len, k_len, device=device)  # [Lq]
    return q_pos, k_pos


def relative_distance(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """i - j for every (query, key) pair: [..., Lq] x [..., Lk] -> [..., Lq, Lk] int64."""
    return q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)


def mask_value(dtype: torch.dtype = torch.float32) -> float:
    """The dtype's lowest finite value: a fully masked row stays finite (uniform), never NaN."""
    return torch.finfo(dtype).min


class AttentionBias(nn.Module):
    """An additive, pre-softmax attention bias. Pure: nothing is cached in forward.

    forward(q_len, k_len) -> float32 Tensor [H or 1, q_len, k_len]
    from_positions(q_pos [..., Lq], k_pos [..., Lk]) -> [..., H or 1, Lq, Lk]
    """

    name: str = ""
    # Export sets this: one posbias.* node (with its FunctionProto) instead of the traced body.
    emit_function: bool = False

    def __init__(self, num_heads: int, causal: bool = True):
        super().__init__()
        if int(num_heads) < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        self.num_heads = int(num_heads)
        self.causal = bool(causal)

    def forward(self, q_len, k_len, device=None) -> torch.Tensor:
        q_pos, k_pos = query_key_positions(q_len, k_len, device=device or self._device())
        return self.from_positions(q_pos, k_pos)

    def from_positions(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """from_positions, or during ONNX export (emit_function set) a single posbias.* node."""
        if self.emit_function and torch.onnx.is_in_onnx_export():
            tensors, attrs = self.function_inputs()
            # float32 whatever the model dtype: the bias is computed and added in float32
            tensors = [t.float() if t.is_floating_point() else t for t in tensors]
            shape = [*q_pos.shape[:-1], self.output_heads, q_pos.shape[-1], k_pos.shape[-1]]
            return torch.onnx.ops.symbolic(
                f"posbias::{self.onnx_function().name}", [q_pos, k_pos, *tensors], attrs,
                dtype=torch.float32, shape=shape, version=1,
            )
        return self.from_positions(q_pos, k_pos)

    # --- the ONNX Script twin ------------------------------------------------------------
    output_heads_is_one: bool = False

    @property
    def output_heads(self) -> int:
        return 1 if self.output_heads_is_one else self.num_heads

    def onnx_function(self):
        """The @onnxscript.script function in domain posbias computing this bias."""
        raise NotImplementedError

    def function_inputs(self) -> tuple[list[torch.Tensor], dict]:
        """Tensors after (q_pos, k_pos), and attributes, for onnx_function()."""
        return [], {}

    def hyper_parameters(self) -> dict:
        """Fixed (non-learned) settings, recorded in exported models' metadata."""
        return {}

    def _device(self):
        for t in list(self.parameters()) + list(self.buffers()):
            return t.device
        return None
