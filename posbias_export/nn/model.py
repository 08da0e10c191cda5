"""A transformer block and a tiny byte-level decoder LM around BiasedAttention.

One dataclass config (config.py); dimensions unpacked once; shapes commented. Every forward
takes the AttentionSettings (attention.py) to use, EAGER by default.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from ..limits import check_fits, check_index
from .attention import EAGER, AttentionCore, AttentionSettings, BiasedAttention
from .config import ARCHS, ModelConfig
from .positions import resize_learned_table, sinusoidal_embedding


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: hidden [B, Lq, D] (+ context [B, Lk, D]) -> [B, Lq, D]."""

    arch = "block"

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.ln_attn = nn.LayerNorm(cfg.dim)
        self.attn = BiasedAttention(cfg, layer)
        self.ln_mlp = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                settings: AttentionSettings = EAGER) -> torch.Tensor:
        """x [B, Lq, D] (+ context [B, Lk, D], key_mask [B, Lk]) -> [B, Lq, D]."""
        h = self.ln_attn(x)
        return self.feed_forward(x + self.attn(h, None if context is None else self.ln_attn(context), key_mask, settings))

    def step(self, x: torch.Tensor, key_mask: torch.Tensor | None, past: tuple[torch.Tensor, torch.Tensor],
             settings: AttentionSettings = EAGER) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The cache path: x [B, Lq, D] new tokens, past (k, v) [B, H, P, hd] -> (out, present)."""
        attn, present = self.attn.step(self.ln_attn(x), key_mask, past, settings)
        return self.feed_forward(x + attn), present

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln_mlp(x))


class DecoderLM(nn.Module):
    """Byte-level LM: input_ids [B, L] int64 -> logits [B, L, vocab]."""

    last_logits_only = False  # set on an export copy: logits [B, 1, V] of the last position (--logits last)

    arch = "lm"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embed = nn.Embedding(cfg.max_positions, cfg.dim) if cfg.position == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                settings: AttentionSettings = EAGER) -> torch.Tensor:
        """input_ids [B, L]; attention_mask [B, L] (1 = token, 0 = padding), optional -> logits
        [B, L, V] ([B, 1, V] on an export copy with last_logits_only)."""
        x = self.embedded(input_ids, attention_mask, None)
        for block in self.blocks:
            x = block(x, None, attention_mask, settings)
        return self.logits(x)

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, past: list,
             settings: AttentionSettings = EAGER) -> tuple[torch.Tensor, list]:
        """The cache path: input_ids [B, L] new tokens, attention_mask [B, P + L] or None, past
        one (k, v) [B, H, P, hd] pair per layer (P may be 0) -> (logits [B, L, V], presents)."""
        x = self.embedded(input_ids, attention_mask, past)
        presents = []
        for block, layer_past in zip(self.blocks, past):
            x, present = block.step(x, attention_mask, layer_past, settings)
            presents.append(present)
        return self.logits(x), presents

    def embedded(self, input_ids, attention_mask, past) -> torch.Tensor:
        x = self.embed(input_ids)  # [B, L, D]
        if self.cfg.position != "none":
            x = x + self.absolute_positions(input_ids, attention_mask, past).to(x.dtype)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.last_logits_only:  # generation reads the last position only: [B, 1, D], no [B, L, V] tensor
            x = x[:, -1:]
        return self.head(self.ln_f(x))  # [B, L, V]

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

    def resize_positions(self, new_len: int, method: str = "interpolate", ignore_size_limits: bool = False) -> "DecoderLM":
        """Give a learned-position model a table of `new_len` rows (interpolated or copied)."""
        if self.pos_embed is None:
            raise ValueError("only a model with learned positions has a table to resize")
        check_index(new_len, "the position table's rows")
        check_fits(3.0 * new_len * self.cfg.dim * 4, f"a position table of {new_len} rows",  # old, new, interpolation
                   ignore_size_limits)
        table = resize_learned_table(self.pos_embed.weight.data, new_len, method)
        self.pos_embed = nn.Embedding.from_pretrained(table, freeze=False)
        # a new config for this model: the old one may be shared (the caller's, another model's)
        old, new = self.cfg, dataclasses.replace(self.cfg, max_positions=new_len)
        for module in self.modules():
            if getattr(module, "cfg", None) is old:
                module.cfg = new
        return self

    def empty_past(self, batch: int, dtype: torch.dtype = torch.float32) -> list:
        shape = (batch, self.cfg.num_heads, 0, self.cfg.head_dim)
        return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in self.blocks]


MODELS = {cls.arch: cls for cls in (DecoderLM, Block, AttentionCore)}


def build_model(cfg: ModelConfig, seed: int = 0, arch: str = "lm") -> nn.Module:
    """A freshly initialised model in eval mode; the same seed gives the same weights."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of: {', '.join(ARCHS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MODELS[arch](cfg)
    return model.eval()
