"""Bias-augmented attention, a transformer block and a tiny byte-level decoder LM.

One dataclass config; dimensions unpacked once; shapes commented. Keys sit at positions
0..Lk-1 and queries are the last Lq of them, so q_len < k_len is the same code path.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .biases import BIASES, AttentionBias, create_bias, mask_value, query_key_positions
from .blocked import ATTENTION_FORMS, DEFAULT_BLOCK, blocked_attention, keep_mask
from .positions import POSITIONS, ROPE_SCALINGS, RotaryEmbedding, logn_scale, sinusoidal_embedding

ARCHS = ("lm", "block", "attention")
ATTN_IMPLS = ("explicit", "sdpa")


@dataclass
class ModelConfig:
    bias: str = "alibi"
    num_heads: int = 4
    dim: int = 128
    num_layers: int = 2
    causal: bool = True
    vocab_size: int = 256  # byte-level
    mlp_ratio: int = 4
    rope: bool | None = None  # None: on for "window" (Su's super-baseline), off otherwise
    rope_base: float = 10000.0
    window: int = 64  # keys a query sees, itself included
    sandwich_dim: int = 128
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    position: str = "none"  # absolute encoding added to the embeddings: none, sinusoidal, learned
    max_positions: int = 1024  # learned table size
    rope_scaling: str = "none"  # none, linear (position interpolation), ntk (base scaling)
    rope_factor: float = 1.0
    logn_train_len: int = 0  # > 0: scale queries by max(1, log_{L_train}(n))

    def __post_init__(self):
        if self.bias not in BIASES:
            raise ValueError(f"unknown bias {self.bias!r}; choose one of: {', '.join(BIASES)}")
        for name in ("num_heads", "dim", "num_layers", "vocab_size", "mlp_ratio", "window",
                     "sandwich_dim", "t5_num_buckets", "t5_max_distance", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if self.use_rope and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got dim/num_heads = {self.head_dim}")
        if not (self.rope_base > 1.0):
            raise ValueError(f"rope_base must be > 1, got {self.rope_base}")
        if self.position not in POSITIONS:
            raise ValueError(f"position must be one of {', '.join(POSITIONS)}, got {self.position!r}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, got {self.rope_scaling!r}")
        if not (self.rope_factor >= 1.0):
            raise ValueError(f"rope_factor must be >= 1, got {self.rope_factor}")
        if self.logn_train_len < 0 or self.logn_train_len == 1:
            raise ValueError(f"logn_train_len must be 0 (off) or >= 2, got {self.logn_train_len}")
        if self.position == "sinusoidal" and self.dim % 2:
            raise ValueError(f"sinusoidal positions need an even dim, got {self.dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def use_rope(self) -> bool:
        return self.bias == "window" if self.rope is None else bool(self.rope)

    def bias_params(self) -> dict:
        return {
            "sandwich": {"sin_dim": self.sandwich_dim},
            "t5": {"num_buckets": self.t5_num_buckets, "max_distance": self.t5_max_distance},
            "window": {"window": self.window},
        }.get(self.bias, {})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**data)


class BiasedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.bias = layer_bias(cfg, layer)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_base, cfg.rope_scaling, cfg.rope_factor) if cfg.use_rope else None
        self.impl = "explicit"  # "sdpa": F.scaled_dot_product_attention (opset 23 -> ONNX Attention)
        self.form = "plain"  # "blocked": query blocks, memory linear in L (causal only; export's default)
        self.block = DEFAULT_BLOCK

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x [B, Lq, D] (queries: the LAST Lq positions of the keys), context [B, Lk, D] or None,
        key_mask [B, Lk] (1 = token, 0 = padding) or None. With a mask, positions come from
        cumsum(mask) - 1, so left padding does not shift anyone's distances.

        past: (k, v) [B, H, P, hd] each, keys already rotated: x then holds only the Lq new
        tokens, the keys are past + new (Lk = P + Lq), and the return value is
        (out [B, Lq, D], (k, v) [B, H, P + Lq, hd]) instead of out alone.
        """
        H, hd = self.cfg.num_heads, self.cfg.head_dim
        kv_in = x if context is None else context
        B, Lq, D = x.shape
        w_q, w_k, w_v = self.qkv.weight.chunk(3, dim=0)  # [D, D] each
        q = F.linear(x, w_q).view(B, Lq, H, hd).transpose(1, 2)  # [B, H, Lq, hd]
        k = F.linear(kv_in, w_k).view(B, -1, H, hd).transpose(1, 2)  # [B, H, Lnew, hd]
        v = F.linear(kv_in, w_v).view(B, -1, H, hd).transpose(1, 2)  # [B, H, Lnew, hd]
        Lk = k.shape[2] if past is None else past[0].shape[2] + Lq
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
        if past is not None:
            k = torch.cat([past[0].to(k.dtype), k], dim=2)  # [B, H, P + Lq, hd]
            v = torch.cat([past[1].to(v.dtype), v], dim=2)
        y = attention_heads(q, k, v, q_pos, k_pos, key_mask, self.bias, self.cfg.causal, self.form, self.block,
                            self.impl)  # [B, H, Lq, hd]
        out = self.out(y.transpose(1, 2).reshape(B, Lq, D))  # [B, Lq, D]
        return out if past is None else (out, (k, v))


def layer_bias(cfg: ModelConfig, layer: int = 0) -> AttentionBias:
    """The bias module of one layer (learned families get a per-layer init seed)."""
    return create_bias(cfg.bias, cfg.num_heads, causal=cfg.causal, **cfg.bias_params(),
                       **({"seed": layer} if cfg.bias in ("kerple_power", "kerple_log", "t5") else {}))


def attention_heads(q, k, v, q_pos, k_pos, key_mask, bias: AttentionBias, causal: bool, form: str = "plain",
                    block: int = DEFAULT_BLOCK, impl: str = "explicit") -> torch.Tensor:
    """Bias-augmented attention on split heads: q [B, H, Lq, hd], k/v [B, H, Lk, hd] (queries are
    the last Lq key positions), q_pos [..., Lq], k_pos [..., Lk], key_mask [B, Lk] or None.
    form "plain" builds the whole [.., H, Lq, Lk] bias; "blocked" one query block at a time."""
    if form not in ATTENTION_FORMS:
        raise ValueError(f"attention form must be one of {', '.join(ATTENTION_FORMS)}, got {form!r}")
    Lq, Lk = q.shape[2], k.shape[2]
    if form == "blocked":
        if not causal:
            raise ValueError("the blocked attention form is for causal models; use the plain form")
        return blocked_attention(q, k, v, q_pos, k_pos, keep_mask(key_mask, Lk, q.device), bias, block)
    q_idx, k_idx = query_key_positions(Lq, Lk, device=q.device)  # [Lq], [Lk]
    allowed = (k_idx.unsqueeze(0) <= q_idx.unsqueeze(1)) if causal else None  # [Lq, Lk]
    if key_mask is not None:
        keep = keep_mask(key_mask, Lk)  # [B, 1, 1, Lk]
        allowed = keep if allowed is None else keep & allowed  # [B, 1, Lq, Lk]
    scores_bias = bias.compute(q_pos, k_pos)  # [H or 1, Lq, Lk] or [B, H or 1, Lq, Lk], float32
    return attend(q, k, v, scores_bias, allowed, impl)  # [B, H, Lq, hd]


def attend(q, k, v, bias, allowed, impl: str = "explicit") -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias, masked) v. Scores, bias and softmax in float32 whatever
    the model dtype (slope * distance overflows fp16 near 131k tokens); float64 stays float64
    (the reference)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    low = mask_value(torch.float32)
    if impl == "sdpa":
        mask = bias if allowed is None else torch.where(allowed, bias, low)  # [H|1, Lq, Lk]
        mask = mask.clamp_min(mask_value(q.dtype)).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q * scale) @ k.transpose(-1, -2)  # [B, H, Lq, Lk]
    scores = scores.to(torch.promote_types(q.dtype, torch.float32)) + bias
    if allowed is not None:
        scores = torch.where(allowed, scores, low)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [B, H, Lq, Lk]
    return probs @ v  # [B, H, Lq, hd]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: hidden [B, Lq, D] (+ context [B, Lk, D]) -> [B, Lq, D]."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.ln_attn = nn.LayerNorm(cfg.dim)
        self.attn = BiasedAttention(cfg, layer)
        self.ln_mlp = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Returns out [B, Lq, D], or (out, present (k, v)) when `past` is given."""
        h = self.ln_attn(x)
        attn = self.attn(h, None if context is None else self.ln_attn(context), key_mask, past)
        attn, present = attn if past is not None else (attn, None)
        x = x + attn
        x = x + self.mlp(self.ln_mlp(x))
        return x if past is None else (x, present)


class DecoderLM(nn.Module):
    """Byte-level LM: input_ids [B, L] int64 -> logits [B, L, vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embed = nn.Embedding(cfg.max_positions, cfg.dim) if cfg.position == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, past: list | None = None):
        """input_ids [B, L]; attention_mask [B, P + L] (1 = token, 0 = padding), optional;
        past: one (k, v) [B, H, P, hd] pair per layer (P may be 0), or None.
        Returns logits [B, L, V], or (logits, presents) when `past` is given."""
        x = self.embed(input_ids)  # [B, L, D]
        if self.cfg.position != "none":
            x = x + self.absolute_positions(input_ids, attention_mask, past).to(x.dtype)
        presents = []
        for index, block in enumerate(self.blocks):
            if past is None:
                x = block(x, None, attention_mask)
            else:
                x, present = block(x, None, attention_mask, past[index])
                presents.append(present)
        logits = self.head(self.ln_f(x))  # [B, L, V]
        return logits if past is None else (logits, presents)

    def absolute_positions(self, input_ids, attention_mask, past) -> torch.Tensor:
        """Position embeddings of the new tokens, [L, D] or [B, L, D]."""
        L = input_ids.shape[1]
        if attention_mask is not None:
            pos = (attention_mask.to(torch.int64).cumsum(-1) - 1).clamp_min(0)[:, -L:]  # [B, L]
        else:
            start = 0 if past is None else past[0][0].shape[2]
            pos = torch.arange(start, start + L, device=input_ids.device)  # [L]
        if self.pos_embed is not None:
            return self.pos_embed(pos)  # beyond the table: IndexError here, a Gather error in ONNX
        return sinusoidal_embedding(pos, self.cfg.dim)

    def empty_past(self, batch: int, dtype: torch.dtype = torch.float32) -> list:
        shape = (batch, self.cfg.num_heads, 0, self.cfg.head_dim)
        return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in self.blocks]


class KVCacheLM(nn.Module):
    """The export signature of a cached decoder: flat tensors in and out.
    (input_ids [B, L], attention_mask [B, P+L], past_key.0, past_value.0, ...) ->
    (logits [B, L, V], present_key.0, present_value.0, ...), past/present [B, H, P(+L), hd]."""

    def __init__(self, lm: DecoderLM):
        super().__init__()
        self.lm, self.cfg, self.arch = lm, lm.cfg, "lm"

    def forward(self, input_ids, attention_mask, *past_flat):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        logits, presents = self.lm(input_ids, attention_mask, past)
        return (logits, *[t for kv in presents for t in kv])


class AttentionCore(nn.Module):
    """Bias-augmented attention alone, no projections: (query, key, value) [B, H, L, hd] ->
    [B, H, L, hd], keys at 0..L-1. What the attention benchmark exports and times."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.bias = layer_bias(cfg)
        self.impl, self.form, self.block = "explicit", "plain", DEFAULT_BLOCK

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q_pos, k_pos = query_key_positions(q.shape[2], k.shape[2], device=q.device)  # [Lq], [Lk]
        return attention_heads(q, k, v, q_pos, k_pos, None, self.bias, self.cfg.causal, self.form, self.block, self.impl)


def resize_positions(model: DecoderLM, new_len: int, method: str = "interpolate") -> DecoderLM:
    """Give a learned-position model a table of `new_len` rows (interpolated or copied)."""
    from .positions import resize_learned_table

    if model.pos_embed is None:
        raise ValueError("only a model with learned positions has a table to resize")
    table = resize_learned_table(model.pos_embed.weight.data, new_len, method)
    model.pos_embed = nn.Embedding.from_pretrained(table, freeze=False)
    model.cfg.max_positions = new_len
    return model


def build_model(cfg: ModelConfig, seed: int = 0, arch: str = "lm") -> nn.Module:
    """A freshly initialised model in eval mode; the same seed gives the same weights."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of: {', '.join(ARCHS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = {"lm": DecoderLM, "block": Block, "attention": AttentionCore}[arch](cfg)
    model.arch = arch
    return model.eval()
