"""Bias-augmented attention: the settings that choose its form, the plain and blocked forms,
the attention layer and the attention-only model the benchmarks export.

Keys sit at positions 0..Lk-1 and queries are the last Lq of them, so q_len < k_len (a KV
cache) is the same code path. How attention is computed is an explicit, frozen value
(`AttentionSettings`) passed to every forward: the same weights can be run plain in eager
PyTorch, blocked in float64 as a reference, or traced into posbias.* function nodes, and
nothing is ever set on a module to switch between them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..biases import AttentionBias, create_bias, floor_scores, mask_value, query_key_positions
from ..limits import check_index
from .plans import DEFAULT_BLOCK, block_plan
from .blocked import blocked_attention, keep_mask
from .config import ModelConfig
from .positions import RotaryEmbedding, logn_scale

ATTENTION_FORMS = ("blocked", "plain")
ATTENTION_IMPLS = ("explicit", "sdpa")
CACHE_FORMS = ("concat", "inplace")


@dataclass(frozen=True)
class AttentionSettings:
    """How attention is computed; every combination computes the same math.

    form: "plain" builds the whole [.., H, Lq, Lk] bias; "blocked" one query block of `block`
      rows at a time (causal only; memory linear in L).
    impl: "explicit" (matmul, softmax, matmul) or "sdpa" (F.scaled_dot_product_attention,
      which the opset-23 exporter turns into the ONNX Attention op).
    functions: this forward is traced for ONNX export: emit posbias.* nodes whose bodies are
      attached as model-local functions afterwards, instead of tracing the bias (an eager call
      with it returns placeholders).
    fused: the blocked form's GPU-shaped body (export/targets/__init__.py): each block ends in one fused
      attention op, rows budgeted for ONNX Runtime CUDA; the PyTorch twin cuts the same blocks.
    cache: how a cached step's keys reach attention in an exported file: "concat" (past + new,
      a new present each step) or "inplace" (export/targets/inplace_body.py: ONNX Runtime's
      GroupQueryAttention writes the new rows into a buffer past and present may share). The same
      math: an eager call computes it by concatenation either way.
    """

    form: str = "plain"
    block: int = DEFAULT_BLOCK
    impl: str = "explicit"
    functions: bool = False
    fused: bool = False
    cache: str = "concat"

    def __post_init__(self):
        if self.form not in ATTENTION_FORMS:
            raise ValueError(f"attention form must be one of {', '.join(ATTENTION_FORMS)}, got {self.form!r}")
        if self.cache not in CACHE_FORMS:
            raise ValueError(f"cache form must be one of {', '.join(CACHE_FORMS)}, got {self.cache!r}")
        if self.impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention impl must be one of {', '.join(ATTENTION_IMPLS)}, got {self.impl!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be a positive integer, got {self.block!r}")
        check_index(self.block, "block")  # the exported graph's index math is int32-safe up to 2^30


EAGER = AttentionSettings()  # what a plain model(x) call uses


def layer_bias(cfg: ModelConfig, layer: int = 0) -> AttentionBias:
    """The bias module of one layer; learned families get the layer index as init seed."""
    return create_bias(cfg.bias, cfg.num_heads, causal=cfg.causal, seed=layer, **cfg.bias_params)


def attention_heads(q, k, v, q_pos, k_pos, key_mask, bias: AttentionBias, causal: bool,
                    settings: AttentionSettings = EAGER) -> torch.Tensor:
    """Bias-augmented attention on split heads: q [B, H, Lq, hd], k/v [B, H, Lk, hd] (queries are
    the last Lq key positions), q_pos [..., Lq], k_pos [..., Lk], key_mask [B, Lk] or None."""
    Lq, Lk = q.shape[2], k.shape[2]
    if settings.form == "blocked":  # causal or not: the bias knows (bias.causal == causal)
        plan = block_plan(bias, settings.fused, q.dtype, indices=q_pos.dim() == 1)
        return blocked_attention(q, k, v, q_pos, k_pos, keep_mask(key_mask, Lk, q.device), bias, settings.block, plan,
                                 settings.functions)
    q_idx, k_idx = query_key_positions(Lq, Lk, device=q.device)  # [Lq], [Lk]
    allowed = (k_idx.unsqueeze(0) <= q_idx.unsqueeze(1)) if causal else None  # [Lq, Lk]
    if key_mask is not None:
        keep = keep_mask(key_mask, Lk)  # [B, 1, 1, Lk]
        allowed = keep if allowed is None else keep & allowed  # [B, 1, Lq, Lk]
    scores_bias = bias.compute(q_pos, k_pos, settings.functions)  # [H|1, Lq, Lk] or [B, H|1, Lq, Lk], float32
    return attend(q, k, v, scores_bias, allowed, settings.impl)  # [B, H, Lq, hd]


def inplace_attention(q, k, v, past, key_mask, bias: AttentionBias, from_mask: bool = True):
    """Traced for an in-place file: ONE posbias.CachedAttention<Family> node (its body:
    export/targets/inplace_body.py) taking q [B, H, S, hd], the new rows k, v [B, Hkv, S, hd], the past
    buffers and the mask [B, T] -> (out [B, H, S, hd], (present_key, present_value) [B, Hkv, T,
    hd]; an in-place buffer's capacity at run time). from_mask: positions cumsum(mask) - 1, else
    the key indices (the function's name says which)."""
    if key_mask is None:
        raise ValueError("an in-place cache takes its lengths from the attention mask; this call has none")
    tensors, _ = bias.function_inputs()
    tensors = [t.float() if t.is_floating_point() else t for t in tensors]
    B, kv_heads, _, hd = k.shape
    total = key_mask.shape[1]
    name = f"CachedAttention{bias.function_name}{'' if from_mask else 'Indices'}"  # inplace_body.function_name
    out, present_key, present_value = torch.onnx.ops.symbolic_multi_out(
        f"posbias::{name}", [q, k, v, past[0], past[1], key_mask, *tensors], {},
        dtypes=[q.dtype] * 3, shapes=[q.shape, (B, kv_heads, total, hd), (B, kv_heads, total, hd)], version=1)
    return out, (present_key, present_value)


def attend(q, k, v, bias, allowed, impl: str = "explicit") -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias, masked) v. Scores, bias and softmax in float32 whatever
    the model dtype (slope * distance overflows fp16 near 131k tokens); float64 stays float64
    (the reference)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    low = mask_value(torch.float32)
    if impl == "sdpa":
        mask = bias if allowed is None else torch.where(allowed, bias, low)  # [H|1, Lq, Lk]
        # clamp at the narrower dtype's lowest: fp16's for fp16 models; for a float64 reference
        # over a float32 bias, float32's (float64's lowest does not fit a float32 tensor)
        floor = max(mask_value(q.dtype), mask_value(mask.dtype))
        mask = mask.clamp_min(floor).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q * scale) @ k.transpose(-1, -2)  # [B, H, Lq, Lk]
    scores = scores.to(torch.promote_types(q.dtype, torch.float32)) + bias
    if allowed is not None:
        scores = torch.where(allowed, scores, low)
    probs = torch.softmax(floor_scores(scores), dim=-1).to(v.dtype)  # [B, H, Lq, Lk], no subnormal (float32)
    return probs @ v  # [B, H, Lq, hd]


class BiasedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.bias = layer_bias(cfg, layer)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_base, cfg.rope_scaling, cfg.rope_factor) if cfg.use_rope else None

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                settings: AttentionSettings = EAGER) -> torch.Tensor:
        """x [B, Lq, D] (queries: the LAST Lq positions of the keys), context [B, Lk, D] or None,
        key_mask [B, Lk] (1 = token, 0 = padding) or None -> out [B, Lq, D]. With a mask,
        positions come from cumsum(mask) - 1, so left padding does not shift anyone's distances."""
        return self.attend(x, context, key_mask, None, settings)[0]

    def step(self, x: torch.Tensor, key_mask: torch.Tensor | None, past: tuple[torch.Tensor, torch.Tensor],
             settings: AttentionSettings = EAGER) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The cache path: past (k, v) [B, H, P, hd] each, keys already rotated; x holds only the
        Lq new tokens (keys: past + new, Lk = P + Lq), key_mask [B, P + Lq] or None ->
        (out [B, Lq, D], present (k, v) [B, H, P + Lq, hd])."""
        return self.attend(x, None, key_mask, past, settings)

    def attend(self, x, context, key_mask, past, settings) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Both paths: (out [B, Lq, D], (k, v) the keys and values attended, past included)."""
        H, hd = self.cfg.num_heads, self.cfg.head_dim
        kv_in = x if context is None else context
        B, Lq, D = x.shape
        w_q, w_k, w_v = self.qkv.weight.chunk(3, dim=0)  # [D, D] each
        q = F.linear(x, w_q).view(B, Lq, H, hd).transpose(1, 2)  # [B, H, Lq, hd]
        k = F.linear(kv_in, w_k).view(B, -1, H, hd).transpose(1, 2)  # [B, H, Lnew, hd]
        v = F.linear(kv_in, w_v).view(B, -1, H, hd).transpose(1, 2)  # [B, H, Lnew, hd]
        # with a cache, the keys are the mask's (an in-place buffer's length is its capacity, not P)
        Lk = k.shape[2] if past is None else (key_mask.shape[1] if key_mask is not None else past[0].shape[2] + Lq)
        q_idx, k_idx = query_key_positions(Lq, Lk, device=x.device)  # [Lq], [Lk]
        if key_mask is None:
            q_pos, k_pos = q_idx, k_idx
        else:
            k_pos = (key_mask.to(torch.int64).cumsum(-1) - 1).clamp_min(0)  # [B, Lk]
            q_pos = k_pos[:, Lk - Lq:]  # [B, Lq]
        if self.cfg.logn_train_len:
            q = q * logn_scale(q_pos, self.cfg.logn_train_len).unsqueeze(-1).unsqueeze(-3).to(q.dtype)  # [.., 1, Lq, 1]
        if self.rope is not None:
            q = self.rope(q, q_pos)
            k = self.rope(k, q_pos if past is not None else k_pos)  # new keys sit at the query positions
        if past is not None and settings.cache == "inplace" and settings.functions:
            y, present = inplace_attention(q, k, v, past, key_mask, self.bias)  # [B, H, Lq, hd], buffers
            return self.out(y.transpose(1, 2).reshape(B, Lq, D)), present
        if past is not None:
            k = torch.cat([past[0].to(k.dtype), k], dim=2)  # [B, H, P + Lq, hd]
            v = torch.cat([past[1].to(v.dtype), v], dim=2)
        y = attention_heads(q, k, v, q_pos, k_pos, key_mask, self.bias, self.cfg.causal, settings)  # [B, H, Lq, hd]
        out = self.out(y.transpose(1, 2).reshape(B, Lq, D))  # [B, Lq, D]
        return out, (k, v)


class AttentionCore(nn.Module):
    """Bias-augmented attention alone, no projections: (query, key, value) [B, H, L, hd] ->
    [B, H, L, hd], keys at 0..L-1. What the attention benchmark exports and times."""

    arch = "attention"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.bias = layer_bias(cfg)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: AttentionSettings = EAGER):
        q_pos, k_pos = query_key_positions(q.shape[2], k.shape[2], device=q.device)  # [Lq], [Lk]
        return attention_heads(q, k, v, q_pos, k_pos, None, self.bias, self.cfg.causal, settings)
