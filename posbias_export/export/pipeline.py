"""torch -> ONNX with dynamic batch and sequence axes, as a list of named passes over one
export state:

    prepare -> functions -> trace -> inline -> check -> growth -> names -> metadata -> quantize -> save

`PASSES` is that list; `run_passes` runs it. What differs between models (names, axes, example
inputs, what a file records) is the request's spec (signature.py): our own models and the
imported Hugging Face ones (hf/export.py) run the same passes. A pass either fills its part of
the state or raises (ValueError: bad request; OSError: unwritable output; ExportCheckError: the
exporter produced something we refuse to ship). Nothing is written until every check passed.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from ..biases import FAMILIES, AttentionBias
from ..errors import cause_line
from ..nn import AttentionSettings, block_plan, non_finite_tensor
from ..runners import runtimes_common
from . import checks, functions, streamed
from .files import SavedModel, ensure_writable, save_checked
from .hoist import hoist_functions
from .targets.inplace_body import function_proto as inplace_function_proto
from .contract import FileContract, with_fields, write_contract
from .metadata import drop_machine_paths
from .naming import POSBIAS, rename
from .options import ExportOptions, options_from
from .signature import ExportSpec, ModelSpec, Signature
from .targets import attention_settings, target, target_opset

DTYPES = {"float32": torch.float32, "float16": torch.float16}
ORT_OPS = (("com.microsoft", "GroupQueryAttention"),)  # the in-place cache's step (export/targets/inplace_body.py)


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
    """Everything an export was asked for, validated: where, the model's spec, the options, and
    what they resolve to (the opset, the attention settings)."""

    path: Path
    spec: ExportSpec
    options: ExportOptions
    opset: int
    settings: AttentionSettings

    @property
    def dtype(self) -> str:
        return self.options.dtype

    @property
    def trace_len(self) -> int:
        return self.options.trace_len

    @property
    def target(self) -> str:
        return self.options.target

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.options.dtype]

    @classmethod
    def create(cls, path, spec: ExportSpec, options: ExportOptions) -> "ExportRequest":
        opset = target_opset(options.target, options.opset)
        settings = attention_settings(opset, options.attention, options.target, options.block)
        request = cls(ensure_writable(path), spec, options, opset, settings)
        spec.check(request)
        return request


@dataclass
class ExportState:
    """What the passes share: the request and the model in, the checked proto and the saved file out."""

    request: ExportRequest
    model: torch.nn.Module
    start: float = field(default_factory=time.perf_counter)
    prepared: torch.nn.Module | None = None
    fakes: dict = field(default_factory=dict)  # id(fake parameter) -> the reader of its values
    weights: list[streamed.WeightRef] = field(default_factory=list)  # what the saved file's placeholders hold
    generated: list[onnx.FunctionProto] = field(default_factory=list)
    proto: onnx.ModelProto | None = None
    sig: Signature | None = None
    done: list[str] = field(default_factory=list)
    initializer_bytes: int = 0
    saved: SavedModel | None = None
    contract: FileContract | None = None  # what the file says it is (written by `metadata`, kept true after)
    resources: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # what lives until the last pass


# --- the passes, in order --------------------------------------------------------------------
def prepare(state: ExportState) -> None:
    """A copy to trace, in the export dtype and eval mode, its large weights fake tensors whose
    values are streamed into the file by `save` (streamed.py); the caller's model is never touched."""
    bad = non_finite_tensor(state.model)  # tensors in memory; streamed ones are checked as they are written
    if bad:
        raise ValueError(f"the model's tensor {bad!r} holds NaN or infinity; refusing to export it")
    state.prepared, state.fakes = streamed.skeleton(state.model, state.request.torch_dtype)
    if state.request.spec.last_logits:
        if not hasattr(state.prepared, "last_logits_only"):
            raise ValueError(f"a {type(state.model).__name__} cannot return the last position's logits only")
        state.prepared.last_logits_only = True


def generated_functions(model: torch.nn.Module, settings: AttentionSettings, dtype: torch.dtype, opset: int,
                        target_name: str = "portable") -> list[onnx.FunctionProto]:
    """Function bodies made per export, callees first: those of biases outside the registry
    (an imported model's own bias, e.g. Falcon's) and, for the blocked form, the
    posbias.BlockedAttention<Family> bodies its layers emit (block size baked in): one per
    plan, for positions that are the key indices and for positions from a padding mask."""
    build_body = target(target_name).body
    protos = {}
    for bias in model.modules():
        if not isinstance(bias, AttentionBias):
            continue
        if type(bias).name not in FAMILIES:
            for proto in reversed(type(bias).function_protos()):  # the key row first: the bias calls it
                protos[proto.name] = proto
        if settings.cache == "inplace":  # the model's cache heads and position convention (hf/imported.py)
            proto = inplace_function_proto(bias, opset, getattr(model, "num_kv_heads", None),
                                           getattr(model, "positions_from_mask", True), dtype == torch.float16)
            protos[proto.name] = proto
        if settings.form != "blocked":
            continue
        for indices in (False, True):  # the layers' nodes say which one they call
            plan = block_plan(bias, settings.fused, dtype, indices)
            proto = build_body(bias, plan, settings.block, dtype, opset)
            protos[proto.name] = proto
    return list(protos.values())


def make_functions(state: ExportState) -> None:
    r = state.request
    state.generated = generated_functions(state.prepared, r.settings, r.torch_dtype, r.opset, r.target)


def run_exporter(sig: Signature, opset: int, fakes: dict | None = None) -> tuple[onnx.ModelProto, list]:
    """One dynamo export of a signature (module, example inputs, dynamic shapes, names); the
    module's fake parameters (`fakes`: id -> reader) become placeholders. Returns the proto and
    the weight references its placeholders index."""
    # The exporter prints progress, warnings and (on failure) whole graphs of its own, through
    # stdout and torch's loggers; the report carries what matters, the error its cause.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.disable(logging.CRITICAL)
        try:
            program = torch.onnx.export(
                sig.module, sig.args, dynamo=True, dynamic_shapes=sig.dynamic_shapes, opset_version=opset,
                input_names=sig.input_names, output_names=sig.output_names, verbose=False, optimize=False,
            )
            # onnxscript's optimizer, as the exporter runs it, kept off the fake weights
            refs = streamed.placeholders(program.model, sig.module, fakes or {})
        except ValueError:
            raise
        except Exception as err:  # the exporter's errors are pages long: keep the line naming the cause
            raise checks.ExportCheckError(f"torch.onnx.export failed: {cause_line(err)}") from err
        finally:
            logging.disable(logging.NOTSET)
    return program.model_proto, refs


def traced(state: ExportState, trace_len: int) -> tuple[onnx.ModelProto, Signature, list]:
    """One dynamo export at `trace_len` with the spec's dynamic axes, functions attached."""
    r = state.request
    sig = r.spec.signature(state.prepared, trace_len, r.torch_dtype, r.settings)
    proto, refs = run_exporter(sig, r.opset, state.fakes)
    functions.attach(proto, r.opset, state.generated)  # the bodies of the posbias.* nodes the trace emitted
    # index arithmetic out of If branches: ONNX Runtime CUDA computes it on the host (hoist.py)
    return hoist_functions(proto), sig, refs


def trace(state: ExportState) -> None:
    state.proto, state.sig, state.weights = traced(state, state.request.trace_len)


def inline(state: ExportState) -> None:
    if state.request.options.inline_functions:
        state.proto = functions.inline(state.proto)


def check_exported(state: ExportState) -> None:
    checks.check_symbolic_axes(state.proto, state.sig.dynamic_axes)
    inplace = state.request.settings.cache == "inplace" and state.request.spec.kv_cache
    checks.check_domains(state.proto, ORT_OPS if inplace else ())
    state.done += ["symbolic batch/seq axes", domains_line(state.proto)]


def domains_line(proto: onnx.ModelProto) -> str:
    """What the file holds, by domain, read from its graph (a later pass that adds contrib ops,
    the quantizers, rewrites the line from the final graph)."""
    nodes = [*proto.graph.node, *(n for f in proto.functions for n in f.node)]
    contrib = sorted({n.op_type for n in nodes if n.domain == "com.microsoft"})
    if not proto.functions and not contrib:
        return "standard domain only"
    return "standard ops" + (" + posbias local functions" if proto.functions else "") + \
        (f" + com.microsoft.{', '.join(contrib)} (ONNX Runtime only)" if contrib else "")


def with_domains_line(done: list[str], proto: onnx.ModelProto) -> list[str]:
    return [domains_line(proto) if d.startswith("standard ") else d for d in done]


def check_trace_growth(state: ExportState) -> None:
    """Re-trace at another length: an initializer whose shape changes was sized by the trace."""
    r = state.request
    if not r.options.check_growth:
        return
    other_len = 2 * r.trace_len + 1
    other, _, _ = traced(state, other_len)
    checks.check_no_trace_length_growth(state.proto, other, r.trace_len, other_len)
    state.done.append(f"no initializer grows with trace length ({r.trace_len} vs {other_len})")


def apply_names(state: ExportState) -> None:
    """The spec's naming (Hugging Face's, for the clients people serve with): inputs, outputs,
    symbolic axes; after the checks, which speak our names."""
    naming = state.request.spec.naming
    if naming.name != POSBIAS.name:
        rename(state.proto, naming)
        state.done.append(f"{naming.name} input/output names")


def export_contract(request: ExportRequest) -> FileContract:
    """What the file records (FileContract): the spec's model, then how it was exported."""
    spec, settings = request.spec, request.settings
    return FileContract(
        **spec.contract_fields(), dtype=request.dtype, opset=request.opset, trace_len=request.trace_len,
        attention_mask=spec.attention_mask, kv_cache=spec.kv_cache,
        functions="inlined" if request.options.inline_functions else "local", attention=settings.form,
        attention_block=settings.block if settings.form == "blocked" else None, target=request.target,
        names=spec.naming.name, logits="last" if spec.last_logits else "all")


def add_metadata(state: ExportState) -> None:
    state.contract = export_contract(state.request)
    write_contract(state.proto, state.contract)
    drop_machine_paths(state.proto)  # torch's stack traces: absolute paths of this machine
    state.proto.producer_name = "posbias_export"


def quantize_weights(state: ExportState) -> None:
    """--quantize, the scheme recorded in the metadata: weight by weight on the graph of
    placeholders, no float file (quantize/streamed.py: ONNX Runtime's rounding and nodes; int8
    runs its quantizer on a skeleton, quantize/streamed_int8.py). The quantized tensors are
    spilled beside the output until `save` streams them in."""
    spec = state.request.options.quantize
    if spec is None:
        return
    from ..runners import atomic
    from .quantize.streamed import quantize_streamed

    spill = Path(state.resources.enter_context(atomic().temporary_folder(state.request.path))) / "quantized.bin"
    state.proto = quantize_streamed(state.proto, state.weights, spec, spill)
    recorded(state, spec)


def recorded(state: ExportState, spec) -> None:
    """The quantized graph's metadata, producer and summary lines."""
    from .quantize import whole as quantize

    count = quantize.quantized_node_count(state.proto)
    opset = next(op.version for op in state.proto.opset_import if op.domain in ("", "ai.onnx"))  # int4: 21
    state.contract = with_fields(state.contract, opset=opset, **spec.contract_fields(count))
    write_contract(state.proto, state.contract)
    state.proto.producer_name = "posbias_export"
    state.done = with_domains_line(state.done, state.proto)  # the quantizer's contrib ops: ONNX Runtime only
    state.done.append(f"{spec.name} weights ({count} nodes by ONNX Runtime's quantizer)")


def cache_dtype(state: ExportState) -> None:
    """--kv-dtype: the in-place cache made float16 (kv_float16.py) or int8 (int8_cache)."""
    kind = state.request.options.kv_dtype
    if kind == "int8":
        int8_cache(state)
    elif kind == "float16":
        from .quantize import kv_float16

        layers = kv_float16.to_float16_cache(state.proto)
        state.contract = with_fields(state.contract, kv_dtype="float16")
        write_contract(state.proto, state.contract)
        state.done.append(f"float16 KV cache ({layers} layers)")


def int8_cache(state: ExportState) -> None:
    """--kv-dtype int8: a copy of the file as it stands (float or quantized weights) written to a
    temporary, its cache calibrated there on ONNX Runtime, then the graph's cache made int8
    (kv_int8.py); a streamed file's weights stay placeholders, streamed again by `save`."""
    from ..runners import atomic
    from .quantize import kv_int8

    probe = onnx.ModelProto()
    probe.CopyFrom(state.proto)  # saving moves tensors out of the proto it is given
    with atomic().temporary_folder(state.request.path) as tmp:
        float_path = Path(tmp) / "float_cache.onnx"
        save_checked(probe, float_path, checks.check_loads_in_ort, state.weights)
        absmax = kv_int8.calibrate(str(float_path), state.request.spec.calibration_tokenizer())
    del probe
    layers = kv_int8.to_int8_cache(state.proto, absmax)
    state.contract = with_fields(state.contract, kv_dtype="int8", kv_calibration=kv_int8.CALIBRATION_NOTE)
    write_contract(state.proto, state.contract)
    state.done = with_domains_line(state.done, state.proto)
    state.done.append(f"int8 KV cache ({layers} layers, scales calibrated on {kv_int8.CALIBRATION_TOKENS} tokens)")


def save(state: ExportState) -> None:
    state.initializer_bytes = checks.initializer_bytes(state.proto)  # before saving: external data empties the proto
    quantized = state.request.options.quantize is not None or state.request.options.kv_dtype != "float"
    # quantized: contrib ops the checker's shape inference does not know; ONNX Runtime must load it
    check = checks.check_loads_in_ort if quantized else checks.check_full_and_loads
    state.saved = save_checked(state.proto, state.request.path, check, state.weights,
                               external=state.request.options.external_data)
    session = quantized or state.saved.model_bytes + state.saved.data_bytes <= checks.SESSION_CHECK_MAX_BYTES
    state.done.append(("onnx.checker" if quantized else "onnx.checker full check")
                      + (" + ONNX Runtime default session" if session else ""))


Pass = tuple[str, Callable[[ExportState], None]]
PASSES: tuple[Pass, ...] = (
    ("prepare", prepare),
    ("functions", make_functions),
    ("trace", trace),
    ("inline", inline),
    ("check", check_exported),
    ("growth", check_trace_growth),
    ("names", apply_names),
    ("metadata", add_metadata),
    ("quantize", quantize_weights),
    ("kv_dtype", cache_dtype),
    ("save", save),
)


def report_dims(values) -> dict[str, list]:
    """name -> shape of graph inputs or outputs (symbolic axes by name)."""
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}


def cache_bytes_per_token(proto: onnx.ModelProto) -> int:
    """What one more token adds to a cached decoder's KV cache, over every past input
    [B, heads, P, d] (heads as the file holds them: fewer for multi-query / grouped models)."""
    cache = runtimes_common("cache")
    total = 0
    for value in proto.graph.input:
        t = value.type.tensor_type
        dims = t.shape.dim
        # a seq2seq cross cache grows per encoder token, not per step
        self_cache = cache.is_cache_input(value.name) and not cache.is_cross_cache(value.name)
        if self_cache and len(dims) == 4 and dims[1].HasField("dim_value") and dims[3].HasField("dim_value"):
            total += dims[1].dim_value * dims[3].dim_value * onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
    return total


def report(state: ExportState) -> ExportReport:
    r, proto, saved = state.request, state.proto, state.saved
    notes = []
    per_token = cache_bytes_per_token(proto)
    if per_token:
        notes.append(f"KV cache: {per_token} bytes per token and sequence ({per_token / 1024:.1f} KiB; "
                     f"{per_token * 4096 / 2**20:.1f} MiB at 4096 tokens)")
    notes += target(r.target).notes(r, proto)  # what its target says about serving it
    if proto.functions and not (r.settings.cache == "inplace" and r.spec.kv_cache):
        notes.append("OpenVINO cannot load model-local functions: give it a file exported with --inline-functions "
                     "(ONNX Runtime, onnxruntime-node and the reference evaluator load this one as it is)")
    return ExportReport(
        path=str(r.path), arch=r.spec.arch, bias=r.spec.bias,
        opset=next((op.version for op in proto.opset_import if op.domain in ("", "ai.onnx")), r.opset),
        dtype=(r.dtype if r.options.quantize is None else f"{r.dtype} activations, {r.options.quantize.name} weights")
        + (f", {r.options.kv_dtype} KV cache" if r.options.kv_dtype != "float" else ""),
        trace_len=r.trace_len, inputs=report_dims(proto.graph.input), outputs=report_dims(proto.graph.output),
        op_types=sorted({n.op_type for n in proto.graph.node}), initializer_bytes=state.initializer_bytes,
        file_bytes=saved.model_bytes, seconds=time.perf_counter() - state.start, checks=state.done,
        data_path=str(saved.data_path) if saved.data_path else None, data_bytes=saved.data_bytes,
        notes=notes + r.spec.notes,
    )


def run_passes(request: ExportRequest, model: torch.nn.Module, passes: tuple[Pass, ...] = PASSES) -> ExportReport:
    state = ExportState(request, model)
    with state.resources:
        for _, run in passes:
            run(state)
    return report(state)


def export_onnx(model: torch.nn.Module, path: str | os.PathLike, options: ExportOptions | None = None, *,
                metadata: dict | None = None, **option_fields) -> ExportReport:
    """Export `model` (from build_model) to `path` and check the result; returns a report.
    `options`: an ExportOptions (export/options.py), or its fields as keywords, e.g.
    export_onnx(model, "m.onnx", kv_cache=True, logits="last").

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
    logits="last" (with kv_cache): logits [B, 1, V] of the last position only, what generation
    reads; no [B, L, V] tensor at a long prompt.
    quantize: a schemes.Scheme (lm files): int8 / int4 weights through ONNX Runtime's
    quantizers, checked by loading the file in ONNX Runtime. `metadata`: the caller's own keys.
    Raises ValueError for bad arguments, OSError for an unwritable path, and
    checks.ExportCheckError when the exported model fails a post-export check. On any failure
    no file is written and an existing file at `path` is left untouched.
    """
    options = options_from(options, option_fields)
    spec = ModelSpec.of(model, options, metadata)
    return run_passes(ExportRequest.create(path, spec, options), model)
