"""Export targets: what a user names with --target, one module of this folder each, with its
body builder and ONNX Script pieces beside it:

    portable.py   runs everywhere: the blocked body multiplies, masks and softmaxes each block
                  with separate standard ops (blocked_body.py, blocked_script.py)
    cuda.py       GPU-shaped blocks, each one ONNX Attention op (opset 23; gpu_body.py, gpu_script.py,
                  gpu_table_script.py)
    cuda_ort.py   the same with ONNX Runtime's com.microsoft.MultiHeadAttention (ONNX Runtime only)
    ort.py        a --kv-cache file whose cache is written in place (inplace_body.py: GroupQueryAttention;
                  ONNX Runtime only); the portable blocked body elsewhere

A Target carries its behaviour: the posbias.BlockedAttention<Family> body it builds, whether it
takes quantized weights, whether it is shaped for a GPU, the notes its export report adds. Adding
one is a module defining TARGET and its name in MODULES (docs/adding-a-target.md). The functions
below turn (opset, form, target) into the attention settings a trace runs with.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

from ...nn import DEFAULT_BLOCK, AttentionSettings

OPSETS = (18, 23)
SDPA_OPSET = 23  # the exporter turns F.scaled_dot_product_attention into the ONNX Attention op from here on


def no_notes(request, proto) -> list[str]:
    return []


@dataclass(frozen=True)
class Target:
    name: str
    help: str
    body: Callable  # (bias, plan, block, dtype, opset) -> the posbias.BlockedAttention<Family> FunctionProto
    fused_op: str | None = None  # None: per-block standard ops; "onnx": ONNX Attention-23; "ort": MultiHeadAttention
    min_opset: int = 18
    default_block: int = DEFAULT_BLOCK
    inplace_cache: bool = False  # KV-cache files write the new rows into a buffer (inplace_body.py)
    quantized: bool = False  # takes --quantize (ONNX Runtime's CPU kernels for quantized MatMul)
    gpu: bool = False  # shaped for ONNX Runtime CUDA (a shipped folder's genai config says so)
    notes: Callable = no_notes  # (ExportRequest, final proto) -> what the export report adds

    @property
    def default_opset(self) -> int:
        return max(18, self.min_opset)


MODULES = ("portable", "cuda", "cuda_ort", "ort")  # a new target: its module here, one row


def _registry() -> dict[str, Target]:
    found: dict[str, Target] = {}
    for module in MODULES:
        made = import_module(f".{module}", __name__).TARGET
        if made.name in found:
            raise ValueError(f"two target modules claim the name {made.name!r}")
        found[made.name] = made
    return found


TARGETS = _registry()


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {name!r}")
    return TARGETS[name]


def target_opset(name: str, opset: int | None) -> int:
    """The target's default opset unless one is asked for; ONNX Attention needs 23."""
    tgt = target(name)
    if opset is None:
        return tgt.default_opset
    if opset not in OPSETS:
        raise ValueError(f"opset must be one of {OPSETS}, got {opset!r}")
    if opset < tgt.min_opset:
        raise ValueError(f"target {name} uses the ONNX Attention op: it needs opset {tgt.min_opset}")
    return opset


def attention_form(opset: int, requested: str | None, target_name: str = "portable") -> str:
    """blocked (memory linear in L) for opset-18 exports unless the plain form is asked for;
    opset 23 uses the ONNX Attention op, which needs the plain form. The GPU targets are
    blocked bodies (with a fused attention op per block)."""
    if target(target_name).fused_op is not None:
        if requested == "plain":
            raise ValueError(f"target {target_name} is a blocked form; drop attention='plain' (or use target portable)")
        return "blocked"
    if requested is None:
        return "blocked" if opset < SDPA_OPSET else "plain"
    if requested == "blocked" and opset >= SDPA_OPSET:
        raise ValueError("opset 23 exports use the ONNX Attention op (the plain form); use opset 18 for blocked")
    return requested


def attention_settings(opset: int, form: str | None, target_name: str = "portable", block: int | None = None,
                       functions: bool = True) -> AttentionSettings:
    """How attention runs in a trace of (opset, form, target), and in the reference run of a
    file exported so (functions=False): the ONE place that decides the form, the block and
    whether SDPA (the ONNX Attention op) is used."""
    form = attention_form(opset, form, target_name)
    tgt = target(target_name)
    return AttentionSettings(form=form, block=tgt.default_block if block is None else block, functions=functions,
                             impl="sdpa" if opset >= SDPA_OPSET and form == "plain" else "explicit",
                             fused=tgt.fused_op is not None, cache="inplace" if tgt.inplace_cache else "concat")
