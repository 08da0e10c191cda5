"""Export targets, and the one function that turns (opset, form, target) into the attention
settings a trace runs with.

portable: runs everywhere; the blocked body multiplies, masks and softmaxes each block with
  separate standard ops (blocked_graph.py).
cuda: GPU-shaped blocked body, each block one ONNX Attention op (opset 23; gpu_graph.py).
cuda-ort: the same with ONNX Runtime's com.microsoft.MultiHeadAttention (ONNX Runtime only).
ort: a --kv-cache file whose cache is written in place (inplace_graph.py: GroupQueryAttention;
  ONNX Runtime only); the portable blocked body elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..nn import DEFAULT_BLOCK, AttentionSettings
from ..nn.plans import GPU_DEFAULT_BLOCK

OPSETS = (18, 23)
SDPA_OPSET = 23  # the exporter turns F.scaled_dot_product_attention into the ONNX Attention op from here on


@dataclass(frozen=True)
class Target:
    name: str
    fused_op: str | None  # None: the portable body; "onnx": ONNX Attention-23; "ort": com.microsoft.MultiHeadAttention
    min_opset: int
    default_block: int
    help: str
    inplace_cache: bool = False  # KV-cache files write the new rows into a buffer (inplace_graph.py)

    @property
    def default_opset(self) -> int:
        return max(18, self.min_opset)


TARGETS = {t.name: t for t in (
    Target("portable", None, 18, DEFAULT_BLOCK, "runs everywhere (default)"),
    Target("cuda", "onnx", 23, GPU_DEFAULT_BLOCK, "GPU-shaped blocks, each one ONNX Attention op (opset 23, large "
           "blocks, no tensor past 2^31 elements) for ONNX Runtime CUDA"),
    Target("cuda-ort", "ort", 18, GPU_DEFAULT_BLOCK, "the same with com.microsoft.MultiHeadAttention (ONNX Runtime "
           "only, CPU or CUDA)"),
    Target("ort", None, 18, DEFAULT_BLOCK, "with --kv-cache: the cache written in place, past and present may share "
           "one buffer (com.microsoft.GroupQueryAttention with the family's bias; ONNX Runtime only, float32)",
           inplace_cache=True),
)}


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
