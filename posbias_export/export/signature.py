"""What one trace needs: the module with its attention settings bound, example inputs, the
dynamic shapes and the input/output names, per arch (lm, block, attention, KV-cache lm)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..nn import AttentionSettings, ModelConfig

INPUT_NAMES = {"lm": ["input_ids"], "block": ["hidden_states"], "attention": ["query", "key", "value"]}
OUTPUT_NAMES = {"lm": ["logits"], "block": ["output"], "attention": ["output"]}


class WithSettings(nn.Module):
    """model(*args, settings=settings): the attention settings fixed for one trace."""

    def __init__(self, model: nn.Module, settings: AttentionSettings):
        super().__init__()
        self.model, self.settings = model, settings

    def forward(self, first, second=None, third=None):  # explicit, not *args: torch.export matches dynamic_shapes to it
        args = (first, second, third)
        used = len(args) - next(i for i, a in enumerate(reversed(args)) if a is not None)  # drop trailing Nones
        return self.model(*args[:used], settings=self.settings)


class KVCacheLM(nn.Module):
    """The export signature of a cached decoder: flat tensors in and out.
    (input_ids [B, L], attention_mask [B, P+L], past_key.0, past_value.0, ...) ->
    (logits [B, L, V], present_key.0, present_value.0, ...), past/present [B, H, P(+L), hd]."""

    def __init__(self, lm: nn.Module, settings: AttentionSettings):
        super().__init__()
        self.lm, self.settings = lm, settings

    def forward(self, input_ids, attention_mask, *past_flat):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        logits, presents = self.lm(input_ids, attention_mask, past, settings=self.settings)
        return (logits, *[t for kv in presents for t in kv])


@dataclass
class Signature:
    module: nn.Module
    args: tuple
    dynamic_shapes: tuple
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, tuple[int, ...]]  # name -> axes that must come out symbolic


def signature(model: nn.Module, cfg: ModelConfig, arch: str, trace_len: int, dtype: torch.dtype,
              settings: AttentionSettings, attention_mask: bool = False, kv_cache: bool = False,
              batch: int = 2) -> Signature:
    gen = torch.Generator().manual_seed(0)
    b, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    if kv_cache:
        # Distinct example sizes for past and new tokens, so no axis gets unified with another.
        past_len = trace_len // 2 + 1
        ids = torch.randint(0, cfg.vocab_size, (batch, trace_len), generator=gen)
        mask = torch.ones(batch, past_len + trace_len, dtype=torch.int64)
        past = [torch.randn(batch, cfg.num_heads, past_len, cfg.head_dim, generator=gen).to(dtype)
                for _ in range(2 * cfg.num_layers)]
        past_dim, total = torch.export.Dim("past"), torch.export.Dim("total")
        layers = range(cfg.num_layers)
        past_names = [f"past_{kind}.{i}" for i in layers for kind in ("key", "value")]
        present_names = [f"present_{kind}.{i}" for i in layers for kind in ("key", "value")]
        return Signature(
            KVCacheLM(model, settings), (ids, mask, *past),
            ({0: b, 1: seq}, {0: b, 1: total}, tuple({0: b, 2: past_dim} for _ in past)),
            ["input_ids", "attention_mask", *past_names], ["logits", *present_names],
            {"input_ids": (0, 1), "attention_mask": (0, 1), "logits": (0, 1),
             **{n: (0, 2) for n in past_names + present_names}},
        )
    module = WithSettings(model, settings)
    if arch == "attention":
        shape = (batch, cfg.num_heads, trace_len, cfg.head_dim)
        args = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
        names = INPUT_NAMES[arch]
        return Signature(module, args, tuple({0: b, 2: seq} for _ in args), names, OUTPUT_NAMES[arch],
                         {**{n: (0, 2) for n in names}, "output": (0, 2)})
    mask = torch.ones(batch, trace_len, dtype=torch.int64) if attention_mask else None
    if arch == "lm":
        first = torch.randint(0, cfg.vocab_size, (batch, trace_len), generator=gen)
        args = (first, mask) if attention_mask else (first,)
    else:
        first = torch.randn(batch, trace_len, cfg.dim, generator=gen).to(dtype)
        args = (first, None, mask) if attention_mask else (first,)
    names = INPUT_NAMES[arch] + (["attention_mask"] if attention_mask else [])
    return Signature(module, args, tuple(None if a is None else {0: b, 1: seq} for a in args), names,
                     OUTPUT_NAMES[arch], {n: (0, 1) for n in names + OUTPUT_NAMES[arch]})
