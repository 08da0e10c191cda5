"""Export an imported model: the same passes as export/pipeline.py (trace with dynamic axes,
attach the posbias functions, inline on request, symbolic-axis and domain checks, re-trace at
another length, full checker on the written file), with the ecosystem's names:
input_ids, attention_mask [batch, sequence] -> logits (causal LMs) or last_hidden_state (the
T5 encoder); with kv_cache, past_key.N / past_value.N in and present_key.N / present_value.N
out, as our own cached decoders (so `generate` and bench-decode run these files)."""
from __future__ import annotations

import copy
import dataclasses
import os
import time

import onnx
import torch

from ..export import checks, functions
from ..export.files import ensure_writable, save_checked
from ..export.metadata import FORMAT_VERSION, write_metadata
from ..export.pipeline import OPSETS, ExportReport, attention_form, generated_functions, report_dims, run_exporter
from ..export.signature import Signature, signature
from ..nn import DEFAULT_BLOCK, AttentionSettings, file_sha256
from .layers import ImportedModel
from .models import load_model


def hf_signature(model: ImportedModel, trace_len: int, settings: AttentionSettings, kv_cache: bool) -> Signature:
    """Our lm signature with an attention mask (the model carries vocab, heads and layers);
    the encoder's output renamed."""
    sig = signature(model, model, "lm", trace_len, torch.float32, settings, attention_mask=True, kv_cache=kv_cache)
    if model.output_name == "logits":
        return sig
    axes = {(model.output_name if k == "logits" else k): v for k, v in sig.dynamic_axes.items()}
    return dataclasses.replace(sig, output_names=[model.output_name], dynamic_axes=axes)


class CachedT5Decoder(torch.nn.Module):
    """Flat tensors in and out for the T5 decoder file (see hf/t5_decoder.py)."""

    def __init__(self, decoder, settings: AttentionSettings):
        super().__init__()
        self.decoder, self.settings = decoder, settings

    def forward(self, input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask, *past_flat):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        logits, presents = self.decoder(input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                        past, settings=self.settings)
        return (logits, *[t for kv in presents for t in kv])


def t5_decoder_signature(model, trace_len: int, settings: AttentionSettings, batch: int = 2) -> Signature:
    gen = torch.Generator().manual_seed(0)
    past_len, enc_len = trace_len // 2 + 1, trace_len + 3  # distinct sizes: no axis unified with another
    b, seq, total = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("total")
    past_dim, enc_seq = torch.export.Dim("past"), torch.export.Dim("encoder_seq")
    ids = torch.randint(0, model.vocab_size, (batch, trace_len), generator=gen)
    mask = torch.ones(batch, past_len + trace_len, dtype=torch.int64)
    states = torch.randn(batch, enc_len, model.config.d_model, generator=gen)
    enc_mask = torch.ones(batch, enc_len, dtype=torch.int64)
    past = [torch.randn(batch, model.num_heads, past_len, model.head_dim, generator=gen)
            for _ in range(2 * model.num_layers)]
    past_names = [f"past_{kind}.{i}" for i in range(model.num_layers) for kind in ("key", "value")]
    present_names = [n.replace("past_", "present_") for n in past_names]
    return Signature(
        CachedT5Decoder(model, settings), (ids, mask, states, enc_mask, *past),
        ({0: b, 1: seq}, {0: b, 1: total}, {0: b, 1: enc_seq}, {0: b, 1: enc_seq},
         tuple({0: b, 2: past_dim} for _ in past)),
        ["input_ids", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", *past_names],
        ["logits", *present_names],
        {"input_ids": (0, 1), "attention_mask": (0, 1), "encoder_hidden_states": (0, 1),
         "encoder_attention_mask": (0, 1), "logits": (0, 1), **{n: (0, 2) for n in past_names + present_names}},
    )


def hf_metadata(model: ImportedModel, opset: int, trace_len: int, settings: AttentionSettings, kv_cache: bool,
                inline_functions: bool) -> dict[str, str]:
    weights = sorted(p for p in model.source_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    meta = {
        "source": "huggingface",
        "model_type": model.model_type,
        "model_dir": str(model.source_dir),
        "weights_sha256": ",".join(f"{p.name}:{file_sha256(p)}" for p in weights),
        "arch": model.arch,
        "bias": model.bias_name,
        "vocab_size": str(model.vocab_size),
        "dtype": "float32",
        "opset": str(opset),
        "trace_len": str(trace_len),
        "attention_mask": "1",
        "kv_cache": str(int(kv_cache)),
        "functions": "inlined" if inline_functions else "local",
        "attention": settings.form,
        "format_version": FORMAT_VERSION,
    }
    if settings.form == "blocked":
        meta["attention_block"] = str(settings.block)
    return meta


def export_model(
    model_dir: str | os.PathLike,
    path: str | os.PathLike,
    opset: int = 18,
    trace_len: int = 16,
    *,
    kv_cache: bool = False,
    inline_functions: bool = False,
    attention: str | None = None,
    block: int = DEFAULT_BLOCK,
    check_growth: bool = True,
    part: str = "encoder",
) -> ExportReport:
    """Export the model in a local Hugging Face folder (BLOOM, MPT, Falcon with alibi, the T5
    encoder; part="decoder": the cached T5 decoder) to `path` in float32 and check it. Raises ValueError for a bad folder or request,
    OSError for an unwritable path, ExportCheckError for a failed check; nothing is written then."""
    start = time.perf_counter()
    if opset not in OPSETS:
        raise ValueError(f"opset must be one of {OPSETS}, got {opset!r}")
    if isinstance(trace_len, bool) or not isinstance(trace_len, int) or trace_len < 2:
        raise ValueError(f"trace_len must be an integer >= 2 (1 would specialize the axis), got {trace_len!r}")
    path = ensure_writable(path)
    model = load_model(model_dir, part)
    if kv_cache and not model.causal:
        raise ValueError(f"a KV cache is for causal decoders; {model.model_type}'s encoder has none (drop --kv-cache, "
                         "or export the decoder of an encoder-decoder folder with --part decoder)")
    kv_cache = kv_cache or model.arch == "decoder"  # the T5 decoder file always carries its cache
    settings = AttentionSettings(form=attention_form(model, opset, attention), block=block,
                                 impl="sdpa" if opset >= 23 else "explicit", functions=True)
    prepared = copy.deepcopy(model).eval()
    generated = generated_functions(prepared, settings, torch.float32, opset)

    def traced(length):
        if model.arch == "decoder":
            sig = t5_decoder_signature(prepared, length, settings)
        else:
            sig = hf_signature(prepared, length, settings, kv_cache)
        proto = run_exporter(sig, opset)
        functions.attach(proto, opset, generated)
        return (functions.inline(proto) if inline_functions else proto), sig

    proto, sig = traced(trace_len)
    checks.check_symbolic_axes(proto, sig.dynamic_axes)
    checks.check_domains(proto)
    done = ["symbolic batch/seq axes", "standard domain only" if inline_functions else "standard ops + posbias local functions"]
    if check_growth:
        other_len = 2 * trace_len + 1
        checks.check_no_trace_length_growth(proto, traced(other_len)[0], trace_len, other_len)
        done.append(f"no initializer grows with trace length ({trace_len} vs {other_len})")
    write_metadata(proto, hf_metadata(model, opset, trace_len, settings, kv_cache, inline_functions))
    proto.producer_name = "posbias_export"
    initializer_bytes = checks.initializer_bytes(proto)
    saved = save_checked(proto, path, checks.check_full)
    done.append("onnx.checker full check")
    notes = []
    if proto.functions:
        notes.append("OpenVINO cannot load model-local functions: give it a file exported with --inline-functions")
    if model.model_type == "mpt":
        notes.append(f"positions come from the input: this file runs past max_seq_len ({model.config.max_seq_len}), "
                     "where transformers' MPT stops")
    return ExportReport(
        path=str(path), arch=f"{model.model_type} {model.arch}", bias=model.bias_name, opset=opset, dtype="float32",
        trace_len=trace_len, inputs=report_dims(proto.graph.input), outputs=report_dims(proto.graph.output),
        op_types=sorted({n.op_type for n in proto.graph.node}), initializer_bytes=initializer_bytes,
        file_bytes=saved.model_bytes, seconds=time.perf_counter() - start, checks=done,
        data_path=str(saved.data_path) if saved.data_path else None, data_bytes=saved.data_bytes, notes=notes,
    )
