"""torch -> ONNX with dynamic batch and sequence axes, as a list of named passes:

    validate_request -> prepare -> trace -> attach_functions -> (inline) -> check_exported
    -> check_trace_growth -> add_metadata -> save_checked (onnx.checker full check on the written file) -> report

Each pass is a function below; export_onnx() runs them in that order. A pass either returns
what the next needs or raises (ValueError: bad request; OSError: unwritable output;
ExportCheckError: the exporter produced something we refuse to ship). Nothing is written
until every check passed.
"""
from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from ..biases import FAMILIES, AttentionBias
from ..nn import DEFAULT_BLOCK, AttentionSettings, ModelConfig, non_finite_tensor
from ..nn.blocked import GPU_DEFAULT_BLOCK, TARGETS
from ..errors import first_line
from . import checks, functions
from .blocked_graph import function_proto as blocked_function_proto
from .gpu_graph import gpu_function_proto
from .files import SavedModel, ensure_writable, save_checked
from .metadata import export_metadata, write_metadata
from .signature import Signature, signature

DTYPES = {"float32": torch.float32, "float16": torch.float16}
OPSETS = (18, 23)


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
    data_path: str | None = None  # external tensor data beside the model (over ~2 GB)
    data_bytes: int = 0
    notes: list[str] = field(default_factory=list)  # what a user of the file should know

    def summary(self) -> str:
        shape = ", ".join(f"{k} {v}" for k, v in self.inputs.items())
        data = f" + {self.data_path} ({self.data_bytes / 1e6:.1f} MB of tensors: keep the two together)" if self.data_path else ""
        lines = [
            f"wrote {self.path} ({self.file_bytes / 1e6:.2f} MB){data}: {self.arch} with {self.bias} bias, "
            f"opset {self.opset}, {self.dtype}, inputs {shape}; checks passed: {', '.join(self.checks)}"
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


@dataclass(frozen=True)
class ExportRequest:
    """Everything export_onnx was asked for, validated."""

    path: Path
    cfg: ModelConfig
    arch: str
    opset: int
    dtype: str
    trace_len: int
    settings: AttentionSettings
    attention_mask: bool
    kv_cache: bool
    inline_functions: bool
    check_growth: bool
    metadata: dict

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def attention_form(cfg, opset: int, requested: str | None, target: str = "portable") -> str:
    """blocked (memory linear in L, causal or bidirectional) for opset-18 exports unless the
    plain form is asked for; opset 23 uses the ONNX Attention op, which needs the plain form.
    The GPU targets are blocked bodies (with a fused attention op per block)."""
    if target != "portable":
        if requested == "plain":
            raise ValueError(f"target {target} is a blocked form; drop attention='plain' (or use target portable)")
        return "blocked"
    if requested is None:
        return "blocked" if opset < 23 else "plain"
    if requested == "blocked" and opset >= 23:
        raise ValueError("opset 23 exports use the ONNX Attention op (the plain form); use opset 18 for blocked")
    return requested


# --- the passes, in order --------------------------------------------------------------------
def target_opset(target: str, opset: int | None) -> int:
    """18 unless asked; the cuda target's ONNX Attention op needs 23."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if opset is None:
        return 23 if target == "cuda" else 18
    if target == "cuda" and opset < 23:
        raise ValueError("target cuda uses the ONNX Attention op: it needs opset 23")
    return opset


def validate_request(model: torch.nn.Module, path, opset, dtype, trace_len, *, attention, block, attention_mask,
                     kv_cache, inline_functions, check_growth, metadata, target="portable") -> ExportRequest:
    opset = target_opset(target, opset)
    if block is None:
        block = DEFAULT_BLOCK if target == "portable" else GPU_DEFAULT_BLOCK
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if opset not in OPSETS:
        raise ValueError(f"opset must be one of {OPSETS}, got {opset!r}")
    if isinstance(trace_len, bool) or not isinstance(trace_len, int) or trace_len < 2:
        raise ValueError(f"trace_len must be an integer >= 2 (1 would specialize the axis), got {trace_len!r}")
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        hint = (" (a transformers model: save it with save_pretrained and export the folder with "
                "posbias_export.hf.export_model or --model DIR)" if type(model).__module__.startswith("transformers") else "")
        raise ValueError(f"export_onnx needs a model from posbias_export.build_model (with a .cfg), "
                         f"got {type(model).__name__}{hint}")
    arch = getattr(model, "arch", "lm")
    bad = non_finite_tensor(model)
    if bad:
        raise ValueError(f"the model's tensor {bad!r} holds NaN or infinity; refusing to export it")
    if kv_cache and arch != "lm":
        raise ValueError("kv_cache needs the lm arch")
    if kv_cache and not cfg.causal:  # a cache replays past keys for new queries: causal decoding only
        raise ValueError("a KV cache is for causal decoding; a bidirectional model has none (drop kv_cache or bidirectional)")
    if arch == "attention" and attention_mask:
        raise ValueError("the attention arch takes no attention_mask")
    # Opset 23 has the ONNX Attention op, which the exporter emits for SDPA.
    form = attention_form(cfg, opset, attention, target)
    settings = AttentionSettings(form=form, block=block, functions=True, target=target,
                                 impl="sdpa" if opset >= 23 and form == "plain" else "explicit")
    return ExportRequest(ensure_writable(path), cfg, arch, opset, dtype, trace_len, settings, bool(attention_mask),
                         bool(kv_cache), bool(inline_functions), bool(check_growth), dict(metadata or {}))


def prepare(model: torch.nn.Module, request: ExportRequest) -> torch.nn.Module:
    """A copy in the export dtype, in eval mode; the caller's model is never touched."""
    return copy.deepcopy(model).eval().to(request.torch_dtype)


def generated_functions(model: torch.nn.Module, settings: AttentionSettings, dtype: torch.dtype,
                        opset: int) -> list[onnx.FunctionProto]:
    """Function bodies made per export, callees first: those of biases outside the registry
    (an imported model's own bias, e.g. Falcon's) and, for the blocked form, the
    posbias.BlockedAttention<Family> bodies its layers emit (block size baked in)."""
    protos = {}
    for bias in model.modules():
        if not isinstance(bias, AttentionBias):
            continue
        if type(bias).name not in FAMILIES:
            for proto in reversed(type(bias).function_protos()):  # the key row first: the bias calls it
                protos[proto.name] = proto
        if settings.form == "blocked":  # both bodies; the layers' nodes say which one they call
            for by_distance in (False, True):
                if settings.target == "portable":
                    proto = blocked_function_proto(bias, settings.block, dtype, opset, by_distance)
                else:
                    proto = gpu_function_proto(bias, settings.block, dtype, opset, by_distance,
                                               "onnx" if settings.target == "cuda" else "ort")
                protos[proto.name] = proto
    return list(protos.values())


def blocked_functions(model: torch.nn.Module, request: ExportRequest) -> list[onnx.FunctionProto]:
    return generated_functions(model, request.settings, request.torch_dtype, request.opset)


def run_exporter(sig: Signature, opset: int) -> onnx.ModelProto:
    """One dynamo export of a signature (module, example inputs, dynamic shapes, names)."""
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
            raise checks.ExportCheckError(f"torch.onnx.export failed: {first_line(err)}") from err
    return program.model_proto


def trace(model: torch.nn.Module, request: ExportRequest, trace_len: int) -> tuple[onnx.ModelProto, Signature]:
    """One dynamo export with the signature's dynamic axes."""
    sig = signature(model, request.cfg, request.arch, trace_len, request.torch_dtype, request.settings,
                    request.attention_mask, request.kv_cache)
    return run_exporter(sig, request.opset), sig


def attach_functions(proto: onnx.ModelProto, request: ExportRequest, generated: list[onnx.FunctionProto]) -> None:
    """The bodies of the posbias.* nodes the trace emitted, as model-local functions."""
    functions.attach(proto, request.opset, generated)


def check_exported(proto: onnx.ModelProto, sig: Signature, request: ExportRequest) -> list[str]:
    checks.check_symbolic_axes(proto, sig.dynamic_axes)
    checks.check_domains(proto)
    done = ["symbolic batch/seq axes",
            "standard domain only" if request.inline_functions else "standard ops + posbias local functions"]
    if request.settings.target == "cuda-ort":
        done[-1] += " + com.microsoft.MultiHeadAttention (ONNX Runtime only)"
    return done


def check_trace_growth(proto: onnx.ModelProto, model: torch.nn.Module, request: ExportRequest,
                 generated: list[onnx.FunctionProto]) -> list[str]:
    """Re-trace at another length: an initializer whose shape changes was sized by the trace."""
    if not request.check_growth:
        return []
    other_len = 2 * request.trace_len + 1
    other, _ = trace(model, request, other_len)
    attach_functions(other, request, generated)
    checks.check_no_trace_length_growth(proto, other, request.trace_len, other_len)
    return [f"no initializer grows with trace length ({request.trace_len} vs {other_len})"]


def add_metadata(proto: onnx.ModelProto, request: ExportRequest) -> None:
    write_metadata(proto, export_metadata(request.cfg, request.arch, request.dtype, request.opset, request.trace_len,
                                          request.settings, request.attention_mask, request.kv_cache,
                                          request.inline_functions, request.metadata))
    proto.producer_name = "posbias_export"


def report_dims(values) -> dict[str, list]:
    """name -> shape of graph inputs or outputs (symbolic axes by name)."""
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}


def report(proto: onnx.ModelProto, request: ExportRequest, initializer_bytes: int, saved: SavedModel, seconds: float,
           done: list[str]) -> ExportReport:
    dims = report_dims
    notes = []
    if proto.functions:
        notes.append("OpenVINO cannot load model-local functions: give it a file exported with --inline-functions "
                     "(ONNX Runtime, onnxruntime-node and the reference evaluator load this one as it is)")
    return ExportReport(
        path=str(request.path), arch=request.arch, bias=request.cfg.bias, opset=request.opset, dtype=request.dtype,
        trace_len=request.trace_len, inputs=dims(proto.graph.input), outputs=dims(proto.graph.output),
        op_types=sorted({n.op_type for n in proto.graph.node}), initializer_bytes=initializer_bytes,
        file_bytes=saved.model_bytes, seconds=seconds, checks=done,
        data_path=str(saved.data_path) if saved.data_path else None, data_bytes=saved.data_bytes, notes=notes,
    )


def export_onnx(
    model: torch.nn.Module,
    path: str | os.PathLike,
    opset: int | None = None,
    dtype: str = "float32",
    trace_len: int = 16,
    *,
    check_growth: bool = True,
    attention_mask: bool = False,
    kv_cache: bool = False,
    inline_functions: bool = False,
    attention: str | None = None,
    block: int | None = None,
    metadata: dict | None = None,
    target: str = "portable",
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
    target: "portable" (every runtime), "cuda" (GPU-shaped blocked body ending each block in
    the ONNX Attention op, opset 23) or "cuda-ort" (the same with ONNX Runtime's
    com.microsoft.MultiHeadAttention: ONNX Runtime only). opset: 18, or 23 for target cuda.
    Raises ValueError for bad arguments, OSError for an unwritable path, and
    checks.ExportCheckError when the exported model fails a post-export check. On any failure
    no file is written and an existing file at `path` is left untouched.
    """
    start = time.perf_counter()
    request = validate_request(model, path, opset, dtype, trace_len, attention=attention, block=block,
                               attention_mask=attention_mask, kv_cache=kv_cache, inline_functions=inline_functions,
                               check_growth=check_growth, metadata=metadata, target=target)
    prepared = prepare(model, request)
    generated = blocked_functions(prepared, request)
    proto, sig = trace(prepared, request, request.trace_len)
    attach_functions(proto, request, generated)
    if request.inline_functions:
        proto = functions.inline(proto)
    done = check_exported(proto, sig, request)
    done += check_trace_growth(proto, prepared, request, generated)
    add_metadata(proto, request)
    initializer_bytes = checks.initializer_bytes(proto)  # before saving: external data empties the proto
    saved = save_checked(proto, request.path, checks.check_full)
    done.append("onnx.checker full check")
    return report(proto, request, initializer_bytes, saved, time.perf_counter() - start, done)
