"""torch -> ONNX with dynamic batch and sequence axes, post-export checks, metadata, atomic save."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from . import blocked, checks, functions
from .biases import AttentionBias
from .model import AttentionCore, BiasedAttention, KVCacheLM, ModelConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16}
OPSETS = (18, 23)
EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # protobuf's hard limit is 2 GB
METADATA_PREFIX = "posbias."
INPUT_NAMES = {"lm": ["input_ids"], "block": ["hidden_states"], "attention": ["query", "key", "value"]}
OUTPUT_NAMES = {"lm": ["logits"], "block": ["output"], "attention": ["output"]}


@dataclass
class ExportReport:
    path: str
    arch: str
    bias: str
    opset: int
    dtype: str
    trace_len: int
    inputs: dict[str, list]
    outputs: dict[str, list]
    op_types: list[str]
    initializer_bytes: int
    file_bytes: int
    seconds: float
    checks: list[str] = field(default_factory=list)

    def summary(self) -> str:
        shape = ", ".join(f"{k} {v}" for k, v in self.inputs.items())
        return (
            f"wrote {self.path} ({self.file_bytes / 1e6:.2f} MB): {self.arch} with {self.bias} bias, "
            f"opset {self.opset}, {self.dtype}, inputs {shape}; checks passed: {', '.join(self.checks)}"
        )


def ensure_writable(path: str | os.PathLike) -> Path:
    """Fail before the (slow) export if the output cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise OSError(f"cannot write {path}: it is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OSError(f"cannot write {path}: directory {parent} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise OSError(f"cannot write {path}: the existing file is read-only")
    try:  # the only reliable test (root ignores permission bits; read-only mounts do not)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}.probe-"):
            pass
    except OSError as err:
        raise OSError(f"cannot write {path}: directory {parent} is not writable ({err.strerror})") from None
    return path


@dataclass
class Signature:
    """What one trace needs: the module, example args, dynamic shapes and the I/O names."""

    module: torch.nn.Module
    args: tuple
    dynamic_shapes: tuple
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, tuple[int, ...]]  # name -> axes that must come out symbolic


def signature(model: torch.nn.Module, cfg: ModelConfig, arch: str, trace_len: int, dtype: torch.dtype,
              attention_mask: bool = False, kv_cache: bool = False, batch: int = 2) -> Signature:
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
            KVCacheLM(model), (ids, mask, *past),
            ({0: b, 1: seq}, {0: b, 1: total}, tuple({0: b, 2: past_dim} for _ in past)),
            ["input_ids", "attention_mask", *past_names], ["logits", *present_names],
            {"input_ids": (0, 1), "attention_mask": (0, 1), "logits": (0, 1),
             **{n: (0, 2) for n in past_names + present_names}},
        )
    if arch == "attention":
        if attention_mask:
            raise ValueError("the attention arch takes no attention_mask")
        shape = (batch, cfg.num_heads, trace_len, cfg.head_dim)
        args = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
        names = INPUT_NAMES[arch]
        return Signature(model, args, tuple({0: b, 2: seq} for _ in args), names, OUTPUT_NAMES[arch],
                         {**{n: (0, 2) for n in names}, "output": (0, 2)})
    mask = torch.ones(batch, trace_len, dtype=torch.int64) if attention_mask else None
    if arch == "lm":
        first = torch.randint(0, cfg.vocab_size, (batch, trace_len), generator=gen)
        args = (first, mask) if attention_mask else (first,)
    else:
        first = torch.randn(batch, trace_len, cfg.dim, generator=gen).to(dtype)
        args = (first, None, mask) if attention_mask else (first,)
    names = INPUT_NAMES[arch] + (["attention_mask"] if attention_mask else [])
    return Signature(model, args, tuple(None if a is None else {0: b, 1: seq} for a in args), names,
                     OUTPUT_NAMES[arch], {n: (0, 1) for n in names + OUTPUT_NAMES[arch]})


def attention_form(cfg: ModelConfig, opset: int, requested: str | None) -> str:
    """blocked for causal opset-18 exports unless the plain form is asked for."""
    if requested is None:
        return "blocked" if cfg.causal and opset < 23 else "plain"
    if requested not in blocked.ATTENTION_FORMS:
        raise ValueError(f"attention must be one of {', '.join(blocked.ATTENTION_FORMS)}, got {requested!r}")
    if requested == "blocked" and not cfg.causal:
        raise ValueError("the blocked attention form needs a causal model (bidirectional exports are plain)")
    if requested == "blocked" and opset >= 23:
        raise ValueError("opset 23 exports use the ONNX Attention op (the plain form); use opset 18 for blocked")
    return requested


def _prepare(model: torch.nn.Module, dtype: torch.dtype, opset: int, form: str, block: int) -> torch.nn.Module:
    model = copy.deepcopy(model).eval().to(dtype)
    for module in model.modules():
        if isinstance(module, (BiasedAttention, AttentionCore)):
            # Opset 23 has the ONNX Attention op, which the exporter emits for SDPA.
            module.impl = "sdpa" if opset >= 23 else "explicit"
            module.form, module.block = form, block
        if isinstance(module, AttentionBias):
            module.emit_function = True  # one posbias.* node per layer, body attached after
    return model


def generated_functions(model: torch.nn.Module, dtype: torch.dtype, opset: int) -> list[onnx.FunctionProto]:
    """The blocked-attention functions this model's layers emit (built per export: block size baked in)."""
    protos = {}
    for module in model.modules():
        if isinstance(module, (BiasedAttention, AttentionCore)) and module.form == "blocked":
            proto = blocked.function_proto(module.bias, module.block, dtype, opset)
            protos[proto.name] = proto
    return list(protos.values())


def trace_to_onnx(sig: Signature, opset: int, generated: list[onnx.FunctionProto] = ()) -> onnx.ModelProto:
    """One dynamo export with the signature's dynamic axes; returns the ModelProto."""
    # The exporter prints progress and warnings of its own; the report carries what matters.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        try:
            program = torch.onnx.export(
                sig.module, sig.args, dynamo=True, dynamic_shapes=sig.dynamic_shapes, opset_version=opset,
                input_names=sig.input_names, output_names=sig.output_names, verbose=False,
            )
        except Exception as err:  # the exporter's errors are long; keep the first line
            first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
            raise checks.ExportCheckError(f"torch.onnx.export failed: {first}") from err
    proto = program.model_proto
    functions.attach(proto, opset, generated)
    return proto


def export_onnx(
    model: torch.nn.Module,
    path: str | os.PathLike,
    opset: int = 18,
    dtype: str = "float32",
    trace_len: int = 16,
    *,
    check_growth: bool = True,
    attention_mask: bool = False,
    kv_cache: bool = False,
    inline_functions: bool = False,
    attention: str | None = None,
    block: int = blocked.DEFAULT_BLOCK,
    metadata: dict | None = None,
) -> ExportReport:
    """Export `model` (from build_model) to `path` and check the result; returns a report.

    The bias of every layer is one `posbias.*` node whose body is a model-local function;
    inline_functions=True expands them into a flat graph of standard ops instead.
    kv_cache=True exports a cached decoder (inputs input_ids, attention_mask, past_key.N,
    past_value.N; outputs logits, present_key.N, present_value.N); one file serves prefill
    (past length 0) and decode (one new token).
    attention_mask=True adds an `attention_mask` [B, L] input (1 = token, 0 = padding).
    attention: "blocked" (the default for causal opset-18 exports: a Loop over query blocks of
    `block` rows, memory linear in L) or "plain" (the whole [H, L, L] bias and scores at once).
    Raises ValueError for bad arguments, OSError for an unwritable path, and
    checks.ExportCheckError when the exported model fails a post-export check. On any failure
    no file is written and an existing file at `path` is left untouched.
    """
    start = time.perf_counter()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if opset not in OPSETS:
        raise ValueError(f"opset must be one of {OPSETS}, got {opset!r}")
    if isinstance(trace_len, bool) or not isinstance(trace_len, int) or trace_len < 2:
        raise ValueError(f"trace_len must be an integer >= 2 (1 would specialize the axis), got {trace_len!r}")
    cfg: ModelConfig = model.cfg
    arch = getattr(model, "arch", "lm")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive integer, got {block!r}")
    form = attention_form(cfg, opset, attention)
    path = ensure_writable(path)

    if kv_cache and arch != "lm":
        raise ValueError("kv_cache needs the lm arch")
    prepared = _prepare(model, DTYPES[dtype], opset, form, block)
    generated = generated_functions(prepared, DTYPES[dtype], opset)
    sig = signature(prepared, cfg, arch, trace_len, DTYPES[dtype], attention_mask, kv_cache)
    proto = trace_to_onnx(sig, opset, generated)

    if inline_functions:
        proto = functions.inline(proto)
    checks.check_symbolic_axes(proto, sig.dynamic_axes)
    done = ["symbolic batch/seq axes"]
    checks.check_domains(proto)
    done.append("standard domain only" if inline_functions else "standard ops + posbias local functions")
    if check_growth:
        other_len = 2 * trace_len + 1
        other = trace_to_onnx(signature(prepared, cfg, arch, other_len, DTYPES[dtype], attention_mask, kv_cache), opset,
                              generated)
        checks.check_no_trace_length_growth(proto, other, trace_len, other_len)
        done.append(f"no initializer grows with trace length ({trace_len} vs {other_len})")

    meta = {
        "config": json.dumps(cfg.to_dict(), sort_keys=True),
        "arch": arch,
        "dtype": dtype,
        "opset": str(opset),
        "trace_len": str(trace_len),
        "attention_mask": str(int(attention_mask or kv_cache)),
        "kv_cache": str(int(kv_cache)),
        "functions": "inlined" if inline_functions else "local",
        "attention": form,
        "format_version": "1",
    }
    if form == "blocked":
        meta["attention_block"] = str(block)
    if cfg.position == "learned":
        meta["max_positions"] = str(cfg.max_positions)  # runners refuse longer inputs with a clear error
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    onnx.helper.set_model_props(proto, {METADATA_PREFIX + k: v for k, v in meta.items()})
    proto.producer_name = "posbias_export"
    checks.check_full(proto)
    done.append("onnx.checker full check")

    file_bytes = save_atomic(proto, path)
    value_dims = lambda values: {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}
    return ExportReport(
        path=str(path), arch=arch, bias=cfg.bias, opset=opset, dtype=dtype, trace_len=trace_len,
        inputs=value_dims(proto.graph.input), outputs=value_dims(proto.graph.output),
        op_types=sorted({n.op_type for n in proto.graph.node}),
        initializer_bytes=checks.initializer_bytes(proto), file_bytes=file_bytes,
        seconds=time.perf_counter() - start, checks=done,
    )


def save_atomic(proto: onnx.ModelProto, path: Path) -> int:
    """Write to a temporary file in the same directory, then rename: a failure leaves no partial
    file and never clobbers an existing one. Models over ~2 GB get external data beside them."""
    path = Path(path)
    external = proto.ByteSize() > EXTERNAL_DATA_THRESHOLD
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        tmp_model = Path(tmp) / path.name
        if external:
            data_name = path.name + ".data"
            onnx.save_model(proto, tmp_model, save_as_external_data=True, all_tensors_to_one_file=True, location=data_name)
            os.replace(Path(tmp) / data_name, path.parent / data_name)
        else:
            onnx.save_model(proto, tmp_model)
        size = tmp_model.stat().st_size
        os.replace(tmp_model, path)
    return size


def read_metadata(model: onnx.ModelProto) -> dict[str, str]:
    """Our metadata_props, without the prefix."""
    return {p.key[len(METADATA_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(METADATA_PREFIX)}
