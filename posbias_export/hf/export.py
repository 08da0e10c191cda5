"""Export an imported model: export/pipeline.py's passes with a spec of the ecosystem's names:
input_ids, attention_mask [batch, sequence] -> logits (causal LMs) or last_hidden_state (the
T5 encoder); with kv_cache, past_key.N / past_value.N in and present_key.N / present_value.N
out, as our own cached decoders (so `generate` and bench-decode run these files). The T5
decoder's file also takes encoder_hidden_states and encoder_attention_mask."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..export.files import check_outputs
from ..export.naming import NAMINGS, POSBIAS, Naming
from ..export.pipeline import ExportReport, ExportRequest, run_passes
from ..export.options import ExportOptions, options_from
from ..export.roles import leading_inputs, role
from ..export.signature import ExportSpec, Signature, cached_signature, lm_signature
from ..nn import file_sha256
from .folder import folder_files
from .imported import ImportedModel
from .models import load_model


@dataclass
class ImportedSpec(ExportSpec):
    """A causal LM or the T5 encoder from a folder: our lm signature with an attention mask.
    shipped: a file for a folder that travels (--out-dir): its metadata names the source folder
    but not where it lay on this machine."""

    model: ImportedModel | None = None
    shipped: bool = False

    @classmethod
    def of(cls, model: ImportedModel, options: ExportOptions, naming: Naming = POSBIAS,
           shipped: bool = False) -> "ImportedSpec":
        kv_cache = options.kv_cache
        if kv_cache and not model.causal:
            raise ValueError(f"a KV cache is for causal decoders; {model.model_type}'s encoder has none (drop --kv-cache, "
                             "or export the decoder of an encoder-decoder folder with --part decoder)")
        note = model.export_note()
        common = dict(notes=[note] if note else [], model=model, shipped=shipped, last_logits=options.last_logits)
        if model.arch == "decoder":  # the T5 decoder file always carries its cache
            part = dataclasses.replace(naming, cache_part="decoder") if naming.name != POSBIAS.name else naming
            # the clients feed a seq2seq decoder no mask of its own (transformers.js gives it the encoder's)
            return Seq2SeqDecoderSpec(f"{model.model_type} {model.arch}", model.bias_name, True, naming=part,
                                 with_mask=naming.name == POSBIAS.name, **common)
        return cls(f"{model.model_type} {model.arch}", model.bias_name, kv_cache, naming=naming, **common)

    @property
    def attention_mask(self) -> bool:
        return True

    def calibration_tokenizer(self) -> str | None:
        path = self.model.source_dir / "tokenizer.json"
        return str(path) if path.is_file() else None

    @property
    def role(self) -> str:
        """What the file takes and gives (export/roles.py): the architecture's role, with a cache."""
        m = self.model
        if m.role == "causal-lm" and self.kv_cache:
            return "causal-lm-with-past"
        return m.role

    def signature(self, model, trace_len, dtype, settings, batch=2) -> Signature:
        m = self.model
        return lm_signature(model, settings, m.vocab_size, (m.num_kv_heads, m.head_dim, m.num_layers), trace_len, dtype,
                            True, self.kv_cache, output=role(self.role).outputs[0], batch=batch,
                            last_logits=self.last_logits, names=leading_inputs(self.role, m.extra_inputs))

    def contract_fields(self) -> dict:
        from ..export.contract import IMPORTED

        m = self.model
        weights = sorted(p for p in m.source_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
        where = {"model_name": m.source_dir.name} if self.shipped else {"model_dir": str(m.source_dir)}
        return {"source": IMPORTED, "model_type": m.model_type, **where,
                "weights_sha256": ",".join(f"{p.name}:{file_sha256(p)}" for p in weights),
                "arch": m.arch, "bias": m.bias_name, "vocab_size": m.vocab_size}

    def check_inplace(self, request) -> None:
        if self.model.arch != "lm":
            raise ValueError(f"target ort (an in-place KV cache) is built for causal LMs (BLOOM, MPT, Falcon) so far; "
                             f"a {self.model.model_type} {self.model.arch} file uses the portable target")
        super().check_inplace(request)

    def predicts_tokens(self) -> bool:
        """A T5 encoder's features lead to predictions through its decoder (export_model refuses
        an encoder alone, whose features have none)."""
        return self.model.arch in ("lm", "decoder", "encoder")


class CachedSeq2SeqDecoder(torch.nn.Module):
    """Flat tensors in and out for an encoder-decoder's decoder file (a `part="decoder"` class: T5's,
    UMT5's), as KVCacheLM with the encoder's output."""

    def __init__(self, decoder, settings):
        super().__init__()
        self.decoder, self.settings = decoder, settings

    def forward(self, input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask, *past_flat):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        logits, presents = self.decoder.step(input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                        past, settings=self.settings)
        return (logits, *[t for kv in presents for t in kv])


class CachedSeq2SeqDecoderMerged(torch.nn.Module):
    """An encoder-decoder's decoder as the clients call it, in Optimum's merged layout: no mask of its own
    (decoder tokens are never padded while generating: every key is attended, as transformers'
    own generate does), use_cache_branch, and per layer the self-attention cache then the
    cross-attention one (t5_decoder.T5Decoder.step_cross_cached)."""

    def __init__(self, decoder, settings):
        super().__init__()
        self.decoder, self.settings = decoder, settings

    def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask, use_cache_branch, *past_flat):
        layers = len(past_flat) // 4
        past = [(past_flat[4 * i], past_flat[4 * i + 1]) for i in range(layers)]
        past_cross = [(past_flat[4 * i + 2], past_flat[4 * i + 3]) for i in range(layers)]
        logits, presents, cross = self.decoder.step_cross_cached(input_ids, encoder_hidden_states, encoder_attention_mask,
                                                                 use_cache_branch, past, past_cross, self.settings)
        return (logits, *[t for own, kv in zip(presents, cross) for t in (*own, *kv)])


def merged_cache_names(layers: int) -> tuple[list[str], list[str]]:
    """Per layer: past_key.N, past_value.N, past_cross_key.N, past_cross_value.N (Optimum's
    order: the decoder's cache, then the encoder's); the presents likewise."""
    past = [f"past_{part}{kind}.{i}" for i in range(layers) for part in ("", "cross_") for kind in ("key", "value")]
    return past, [n.replace("past_", "present_") for n in past]


@dataclass
class Seq2SeqDecoderSpec(ImportedSpec):
    """The cached decoder part of an encoder-decoder (hf/architectures/t5_decoder.py): input_ids, attention_mask,
    encoder_hidden_states, encoder_attention_mask and the past pairs in; logits and the present
    pairs out. with_mask off: the clients' merged file (CachedSeq2SeqDecoderMerged)."""

    with_mask: bool = True

    @property
    def attention_mask(self) -> bool:
        return self.with_mask

    @property
    def role(self) -> str:
        return "seq2seq-decoder-with-past" if self.with_mask else "seq2seq-decoder-merged"

    def signature(self, model, trace_len, dtype, settings, batch=2) -> Signature:
        m, gen = self.model, torch.Generator().manual_seed(0)
        past_len, enc_len = trace_len // 2 + 1, trace_len + 3  # distinct sizes: no axis unified with another
        b, seq, total = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("total")
        past_dim, enc_seq = torch.export.Dim("past"), torch.export.Dim("encoder_seq")
        ids = torch.randint(0, m.vocab_size, (batch, trace_len), generator=gen)
        mask = torch.ones(batch, past_len + trace_len, dtype=torch.int64)
        states = torch.randn(batch, enc_len, m.config.d_model, generator=gen).to(dtype)  # the encoder file's output dtype
        enc_mask = torch.ones(batch, enc_len, dtype=torch.int64)
        if not self.with_mask:
            return self.merged_signature(model, (ids, states, enc_mask), (b, seq, enc_seq, past_dim), settings, dtype,
                                         gen, past_len)
        names = leading_inputs(self.role)
        module, leading, shapes = CachedSeq2SeqDecoder(model, settings), (ids, mask, states, enc_mask), (
            {0: b, 1: seq}, {0: b, 1: total}, {0: b, 1: enc_seq}, {0: b, 1: enc_seq})
        return cached_signature(module, leading, shapes, names, {n: (0, 1) for n in names}, m.num_kv_heads, m.head_dim,
                                m.num_layers, batch, past_len, dtype, gen, past_dim)

    def merged_signature(self, model, leading_args, dims, settings, dtype, gen, past_len) -> Signature:
        """The clients' file (CachedSeq2SeqDecoderMerged): traced on the cached branch's shapes (the
        cross cache as long as the encoder's states; torch.cond traces both branches)."""
        m = self.model
        (ids, states, enc_mask), (b, seq, enc_seq, past_dim) = leading_args, dims
        cross_dim = torch.export.Dim("encoder_past")
        batch, enc_len = ids.shape[0], states.shape[1]
        past = [torch.randn(batch, m.num_kv_heads, length, m.head_dim, generator=gen).to(dtype)
                for _ in range(m.num_layers) for length in (past_len, past_len, enc_len, enc_len)]
        past_names, present_names = merged_cache_names(m.num_layers)
        leading = leading_inputs(self.role)
        cache_shapes = tuple({0: b, 2: cross_dim if "cross" in n else past_dim} for n in past_names)
        return Signature(
            CachedSeq2SeqDecoderMerged(model, settings), (ids, states, enc_mask, torch.tensor([True]), *past),
            ({0: b, 1: seq}, {0: b, 1: enc_seq}, {0: b, 1: enc_seq}, {}, cache_shapes),
            [*leading, *past_names], ["logits", *present_names],
            {**{n: (0, 1) for n in leading[:3]}, "logits": (0, 1), **{n: (0, 2) for n in past_names + present_names}},
        )


def export_model(model_dir: str | os.PathLike, path: str | os.PathLike, options: ExportOptions | None = None, *,
                 names: str = "posbias", shipped: bool = False, **option_fields) -> ExportReport:
    """Export the model in a local Hugging Face folder (BLOOM, MPT, Falcon with alibi, the T5
    encoder; part="decoder": the cached T5 decoder) to `path` and check it. `options`: an
    ExportOptions (export/options.py) or its fields as keywords: dtype (float32, float16),
    target (portable, cuda, cuda-ort: export/targets/__init__.py), opset (None: the target's), kv_cache,
    logits="last" (with kv_cache: the last position's logits only, [B, 1, V]), quantize (a
    schemes.Scheme: causal LMs, a T5's encoder or decoder). The weights are streamed from the
    folder into the file (never held whole). Raises ValueError for a bad folder or request,
    OSError for an unwritable path, ExportCheckError for a failed check; nothing is written
    then. names="huggingface": the clients' names (export/naming.py); shipped: the metadata
    keeps the folder's name, not its path."""
    options = options_from(options, option_fields)
    check_outputs([path, f"{path}.data"], folder_files(model_dir))  # never write over what the folder holds
    model = load_model(model_dir, options.part, lazy=True)  # weights streamed into the file as it is written
    if names not in NAMINGS:
        raise ValueError(f"names must be one of {', '.join(NAMINGS)}, got {names!r}")
    if options.quantize is not None:  # int4's block and head: those asked for, else the architecture's
        options = dataclasses.replace(options, quantize=options.quantize.resolved(model.default_quant_block,
                                                                                  model.default_quant_head))
    spec = ImportedSpec.of(model, options, NAMINGS[names], shipped)
    return run_passes(ExportRequest.create(path, spec, options), model)
