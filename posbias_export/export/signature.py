"""What differs between the models one export pipeline serves, as one object per kind of model
(Optimum's per-model OnnxConfig): the module a trace runs with its attention settings bound,
example inputs, input and output names with their dynamic axes, the metadata the file records
and the notes its report carries. pipeline.py runs the same passes for every spec; hf/export.py
supplies specs for imported models.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..nn import AttentionSettings, ModelConfig
from .naming import POSBIAS, Naming
from .targets import TARGETS, target

INPUT_NAMES = {"lm": ["input_ids"], "block": ["hidden_states"], "attention": ["query", "key", "value"]}
OUTPUT_NAMES = {"lm": ["logits"], "block": ["output"], "attention": ["output"]}


@dataclass
class Signature:
    module: nn.Module
    args: tuple
    dynamic_shapes: tuple
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, tuple[int, ...]]  # name -> axes that must come out symbolic


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
        logits, presents = self.lm.step(input_ids, attention_mask, past, settings=self.settings)
        return (logits, *[t for kv in presents for t in kv])


def cache_names(layers: int) -> tuple[list[str], list[str]]:
    """past_key.N / past_value.N in, present_key.N / present_value.N out, layer by layer."""
    past = [f"past_{kind}.{i}" for i in range(layers) for kind in ("key", "value")]
    return past, [n.replace("past_", "present_") for n in past]


def cached_signature(module: nn.Module, leading: tuple, leading_shapes: tuple,
                     leading_names: list[str], leading_axes: dict, heads: int, head_dim: int, layers: int,
                     batch: int, past_len: int, dtype: torch.dtype, gen: torch.Generator, past_dim,
                     last_logits: bool = False) -> Signature:
    """A cached decoder's signature: `module` takes the leading inputs, then one (key, value)
    pair per layer, flat (KVCacheLM); its first output is the logits ([B, 1, V] with last_logits)."""
    b = leading_shapes[0][0]
    past = [torch.randn(batch, heads, past_len, head_dim, generator=gen).to(dtype) for _ in range(2 * layers)]
    past_names, present_names = cache_names(layers)
    return Signature(
        module, (*leading, *past), (*leading_shapes, tuple({0: b, 2: past_dim} for _ in past)),
        [*leading_names, *past_names], ["logits", *present_names],
        {**leading_axes, "logits": (0,) if last_logits else (0, 1), **{n: (0, 2) for n in past_names + present_names}},
    )


def lm_signature(model: nn.Module, settings: AttentionSettings, vocab_size: int, cache_shape: tuple[int, int, int],
                 trace_len: int, dtype: torch.dtype, with_mask: bool, kv_cache: bool, output: str = "logits",
                 batch: int = 2, last_logits: bool = False, names: list[str] | None = None) -> Signature:
    """input_ids [B, L] (+ attention_mask) -> `output` [B, L, ...]; with kv_cache the cached
    decoder: input_ids [B, L], attention_mask [B, P + L] and the past pairs ([heads, head_dim,
    layers] = cache_shape) in, logits and the present pairs out. names: the leading inputs' (a
    role's: export/roles.py)."""
    gen = torch.Generator().manual_seed(0)
    b, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    if kv_cache:
        # Distinct example sizes for past and new tokens, so no axis gets unified with another.
        past_len = trace_len // 2 + 1
        ids = torch.randint(0, vocab_size, (batch, trace_len), generator=gen)
        mask = torch.ones(batch, past_len + trace_len, dtype=torch.int64)
        past_dim, total = torch.export.Dim("past"), torch.export.Dim("total")
        names = names or ["input_ids", "attention_mask"]
        return cached_signature(KVCacheLM(model, settings), (ids, mask), ({0: b, 1: seq}, {0: b, 1: total}),
                                names, {n: (0, 1) for n in names},
                                *cache_shape, batch, past_len, dtype, gen, past_dim, last_logits)
    ids = torch.randint(0, vocab_size, (batch, trace_len), generator=gen)
    args = (ids, torch.ones(batch, trace_len, dtype=torch.int64)) if with_mask else (ids,)
    names = names or ["input_ids"] + (["attention_mask"] if with_mask else [])
    args += tuple(torch.zeros_like(ids) for _ in names[len(args):])  # token_type_ids: one segment
    return Signature(WithSettings(model, settings), args, tuple({0: b, 1: seq} for _ in args), names, [output],
                     {n: (0, 1) for n in names + [output]})


@dataclass
class ExportSpec:
    """Base of the per-model export specs. arch and bias label the report; `check` refuses what
    this model cannot be exported as; `signature` makes one trace; `contract_fields` says what the
    file records about the model (FileContract fields; the pipeline adds how it was exported)."""

    arch: str
    bias: str
    kv_cache: bool = False
    notes: list[str] = field(default_factory=list)
    naming: Naming = POSBIAS  # the names the file is written with (naming.py)
    last_logits: bool = False  # a cached decoder's logits for the last position only, [B, 1, V]

    def check(self, request) -> None:
        """Raise ValueError for a request this model cannot honour."""
        if self.last_logits and not self.kv_cache:
            raise ValueError("logits='last' is for generation files (a KV cache); a file for scoring keeps every "
                             "position's logits")
        if request.options.quantize is not None:
            if not self.predicts_tokens():
                raise ValueError(f"quantize is for files judged by their next-token predictions (language models, "
                                 f"a T5's encoder and decoder); this is a {self.arch!r} export")
            if request.dtype != "float32":
                raise ValueError("quantize starts from float32 weights (the quantizers write their own scales); "
                                 "drop --dtype float16")
            if not target(request.target).quantized:
                takes = " and ".join(name for name, t in TARGETS.items() if t.quantized)
                raise ValueError(f"quantize is for the {takes} targets (ONNX Runtime's CPU kernels for "
                                 "quantized MatMul); the GPU targets keep float weights")
        if request.settings.cache == "inplace":
            self.check_inplace(request)
        elif request.options.kv_dtype != "float":
            raise ValueError(f"kv_dtype {request.options.kv_dtype} is for a cache written in place: it needs kv_cache "
                             "and target ort (--kv-cache --target ort)")

    def check_inplace(self, request) -> None:
        """--target ort writes a KV cache in place: a cached decoder (float32, or float16 with
        float16's lowest on padded keys: GroupQueryAttention's CPU kernel takes both)."""
        if not self.kv_cache:
            raise ValueError("target ort writes a KV cache in place: it needs kv_cache (--kv-cache)")
        if request.options.inline_functions:
            raise ValueError("target ort keeps its cached attention a function around GroupQueryAttention; drop "
                             "--inline-functions")

    def calibration_tokenizer(self) -> str | None:
        """The tokenizer.json an int8 cache is calibrated through (None: the text's bytes)."""
        return None

    def predicts_tokens(self) -> bool:
        """Whether the file's outputs lead to next-token predictions (what the quantized policy,
        parity/quantized.py, judges)."""
        return "lm" in self.arch

    def signature(self, model: nn.Module, trace_len: int, dtype: torch.dtype, settings: AttentionSettings,
                  batch: int = 2) -> Signature:
        raise NotImplementedError

    def contract_fields(self) -> dict:
        raise NotImplementedError

    @property
    def attention_mask(self) -> bool:
        return self.kv_cache


@dataclass
class ModelSpec(ExportSpec):
    """Our own models (build_model): lm, block or attention, with an optional attention mask and
    KV cache."""

    cfg: ModelConfig | None = None
    with_mask: bool = False
    extra: dict = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module, options, metadata: dict | None) -> "ModelSpec":
        """The spec of one of our models under an ExportOptions (its kv_cache, attention_mask and
        logits shape the file); ValueError for what the model cannot be exported as."""
        kv_cache, attention_mask = options.kv_cache, options.attention_mask
        cfg = getattr(model, "cfg", None)
        if not isinstance(cfg, ModelConfig):
            hint = (" (a transformers model: save it with save_pretrained and export the folder with "
                    "posbias_export.hf.export_model or --model DIR)" if type(model).__module__.startswith("transformers")
                    else "")
            raise ValueError(f"export_onnx needs a model from posbias_export.build_model (with a .cfg), "
                             f"got {type(model).__name__}{hint}")
        arch = getattr(model, "arch", "lm")
        if kv_cache and arch != "lm":
            raise ValueError("kv_cache needs the lm arch")
        if kv_cache and not cfg.causal:  # a cache replays past keys for new queries: causal decoding only
            raise ValueError("a KV cache is for causal decoding; a bidirectional model has none (drop kv_cache or bidirectional)")
        if arch == "attention" and attention_mask:
            raise ValueError("the attention arch takes no attention_mask")
        return cls(arch, cfg.bias, bool(kv_cache), last_logits=options.last_logits, cfg=cfg, with_mask=bool(attention_mask),
                   extra={k: str(v) for k, v in (metadata or {}).items()})

    @property
    def attention_mask(self) -> bool:
        return self.with_mask or self.kv_cache

    def signature(self, model, trace_len, dtype, settings, batch=2) -> Signature:
        cfg = self.cfg
        if self.arch == "lm":
            return lm_signature(model, settings, cfg.vocab_size, (cfg.num_heads, cfg.head_dim, cfg.num_layers),
                                trace_len, dtype, self.with_mask, self.kv_cache, batch=batch,
                                last_logits=self.last_logits)
        gen = torch.Generator().manual_seed(0)
        b, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
        module = WithSettings(model, settings)
        if self.arch == "attention":
            shape = (batch, cfg.num_heads, trace_len, cfg.head_dim)
            args = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
            names = INPUT_NAMES[self.arch]
            return Signature(module, args, tuple({0: b, 2: seq} for _ in args), names, OUTPUT_NAMES[self.arch],
                             {**{n: (0, 2) for n in names}, "output": (0, 2)})
        first = torch.randn(batch, trace_len, cfg.dim, generator=gen).to(dtype)
        mask = torch.ones(batch, trace_len, dtype=torch.int64)
        args = (first, None, mask) if self.with_mask else (first,)
        names = INPUT_NAMES[self.arch] + (["attention_mask"] if self.with_mask else [])
        return Signature(module, args, tuple(None if a is None else {0: b, 1: seq} for a in args), names,
                         OUTPUT_NAMES[self.arch], {n: (0, 1) for n in names + OUTPUT_NAMES[self.arch]})

    def contract_fields(self) -> dict:
        """The model (its config whole), a learned table's size, and the caller's own keys
        (where the weights came from: FileContract's fields; anything else kept as given)."""
        from .contract import split_fields

        return {"config": self.cfg.to_dict(), "bias": self.cfg.bias, "bias_params": dict(self.cfg.bias_params),
                "arch": self.arch, "max_positions": self.cfg.max_positions if self.cfg.position == "learned" else None,
                **split_fields(self.extra)}
