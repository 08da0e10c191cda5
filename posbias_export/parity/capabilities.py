"""What each runtime of runtimes.py cannot run, and why: one table. validate's default runtimes
leave these out for such a file, saying why (a runtime named with --runtimes still runs, and its
error is its row); the tests choose their runtimes from it; docs/validating.md shows it (checked
against this table by tests/test_docs.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

OPENVINO = ("openvino", "openvino-bf16")


def _has_op(proto, op_type: str, domain: str) -> bool:
    nodes = [*proto.graph.node, *(n for f in proto.functions for n in f.node)]
    return any(n.op_type == op_type and n.domain == domain for n in nodes)


def _partial_quantized_block(proto) -> bool:
    """A GatherBlockQuantized table whose quantized axis is not a whole number of blocks (ONNX
    Runtime pads the last block; OpenVINO 2025's frontend refuses the node)."""
    from onnx import helper

    shapes = {i.name: i.dims for i in proto.graph.initializer}
    for n in (n for n in proto.graph.node if n.op_type == "GatherBlockQuantized"):
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        dims = shapes.get(n.input[0])
        if dims and dims[attrs.get("quantize_axis", 1)] % attrs.get("block_size", 128):
            return True
    return False


# a file's feature -> how to tell it from the file (a parity.reference.ModelFile)
FEATURES: dict[str, Callable] = {
    "quantized weights": lambda file: bool(file.scheme),
    "in-place cache": lambda file: file.inplace_cache,
    "com.microsoft.GroupQueryAttention": lambda file: _has_op(file.proto, "GroupQueryAttention", "com.microsoft"),
    "an int4 table wider than a whole number of blocks": lambda file: _partial_quantized_block(file.proto),
}


@dataclass(frozen=True)
class Gap:
    feature: str  # a key of FEATURES
    runtimes: tuple[str, ...]
    reason: str  # measured: benchmarks/order_parity.md, slim_table_parity.md, tests/test_inplace_cache.py


GAPS = (
    Gap("quantized weights", ("reference",), "the ONNX reference evaluator implements no quantized op "
        "(GatherBlockQuantized, int8 DequantizeLinear at opset 18)"),
    Gap("com.microsoft.GroupQueryAttention", OPENVINO, "OpenVINO has no com.microsoft.GroupQueryAttention"),
    Gap("an int4 table wider than a whole number of blocks", OPENVINO, "OpenVINO's GatherBlockQuantized needs the "
        "quantized width to be a multiple of the block (--quant-block dividing the hidden size avoids it)"),
)

# a runtime a file of this feature adds to the defaults, after the one it is a variant of
ADDED = {"in-place cache": ("ort-cpu", "ort-cpu-shared")}  # its cache bound to one buffer, as genai runs it


def cannot_run(runtime: str, files) -> str | None:
    """Why `runtime` cannot run one of these files (ModelFile), or None."""
    for gap in GAPS:
        if runtime in gap.runtimes and any(FEATURES[gap.feature](f) for f in files):
            return f"{gap.reason} (a file with {gap.feature})"
    return None


def runnable(chosen: tuple[str, ...], files) -> tuple[tuple[str, ...], dict[str, str]]:
    """Of the chosen runtimes, those that can run these files, and why each other cannot; with
    the runtimes a feature of theirs adds."""
    out, skipped = [], {}
    for name in chosen:
        reason = cannot_run(name, files)
        if reason:
            skipped[name] = reason
        else:
            out.append(name)
    for feature, (after, added) in ADDED.items():
        if after in out and added not in out and any(FEATURES[feature](f) for f in files):
            out.insert(out.index(after) + 1, added)
    return tuple(out), skipped


def table_markdown() -> str:
    """The table as docs/validating.md shows it."""
    lines = ["| a file with | does not run on | because |", "|---|---|---|"]
    lines += [f"| {g.feature} | {', '.join(f'`{r}`' for r in g.runtimes)} | {g.reason} |" for g in GAPS]
    return "\n".join(lines)
