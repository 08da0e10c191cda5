"""The posbias ONNX functions as model-local FunctionProtos: attach them to an exported model
(callees first: the reference evaluator needs that order), or inline them to a flat graph.

The library is read from the bias registry (each family brings its own functions) plus the
shared RelativeDistance and the pieces of the blocked form.
"""
from __future__ import annotations

import copy
import functools

import onnx
import onnx.inliner

from ..biases import BIASES, bias_class
from ..biases.onnx_domain import DOMAIN, STANDARD_DOMAINS, VERSION, RelativeDistance
from .graph_order import subgraphs
from .targets.blocked_script import BLOCK_FUNCTIONS
from .targets.gpu_script import GPU_FUNCTIONS
from .targets.gpu_table_script import SLIM_TABLE_FUNCTIONS

__all__ = ["all_nodes", "attach", "function_protos", "inline", "library"]


@functools.lru_cache(maxsize=None)
def _library() -> tuple[onnx.FunctionProto, ...]:
    protos = [RelativeDistance.to_function_proto()]
    for name in BIASES:
        protos += bias_class(name).function_protos()
    protos += [fn.to_function_proto() for fn in BLOCK_FUNCTIONS + GPU_FUNCTIONS + SLIM_TABLE_FUNCTIONS]
    names = [p.name for p in protos]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise ValueError(f"two posbias functions share a name: {', '.join(clashes)}")
    return tuple(protos)


def library() -> dict[str, onnx.FunctionProto]:
    """Every posbias function by name, callees before callers (fresh copies)."""
    return {p.name: copy.deepcopy(p) for p in _library()}


def all_nodes(nodes):
    """Every node, those inside subgraph attributes (a Loop body) included."""
    for node in nodes:
        yield node
        for graph in subgraphs(node):
            yield from all_nodes(graph.node)


def function_protos(names: set[str], opset: int, generated=()) -> list[onnx.FunctionProto]:
    """FunctionProtos for `names` and everything they call, callees first, importing the
    model's standard opset version (their ops mean the same from opset 18 on). `generated`
    are protos built per export (the blocked attention), placed after their callees."""
    known = library()
    made = {proto.name: proto for proto in generated}
    needed: set[str] = set()

    def visit(name: str) -> None:
        if name in needed:
            return
        if name not in known and name not in made:
            raise ValueError(f"unknown posbias function {name!r}")
        needed.add(name)
        for node in all_nodes((made.get(name) or known[name]).node):
            if node.domain == DOMAIN:
                visit(node.op_type)

    for name in names:
        visit(name)
    protos = [proto for name, proto in known.items() if name in needed]
    protos += [proto for name, proto in made.items() if name in needed]
    for proto in protos:
        for imp in proto.opset_import:
            if imp.domain in STANDARD_DOMAINS:
                imp.version = opset
    return protos


def attach(model: onnx.ModelProto, opset: int, generated=()) -> list[str]:
    """Append the FunctionProtos for every posbias node in the graph; returns their names."""
    used = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    if not used:
        return []
    existing = {(f.domain, f.name) for f in model.functions}
    for proto in function_protos(used, opset, generated):
        if (proto.domain, proto.name) not in existing:
            model.functions.append(proto)
    if not any(i.domain == DOMAIN for i in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, VERSION))
    # a runtime's own domain a function calls (the cuda-ort target's MultiHeadAttention) is
    # imported by the model too: ONNX Runtime resolves a function's domains against the model's
    have = {i.domain for i in model.opset_import}
    for proto in model.functions:
        for imp in proto.opset_import:
            if imp.domain not in have:
                model.opset_import.append(onnx.helper.make_opsetid(imp.domain, imp.version))
                have.add(imp.domain)
    return sorted(used)


def inline(model: onnx.ModelProto) -> onnx.ModelProto:
    """Flat graph of standard ops: every local function expanded, the posbias import dropped."""
    flat = onnx.inliner.inline_local_functions(model)
    keep = [i for i in flat.opset_import if i.domain != DOMAIN]
    del flat.opset_import[:]
    flat.opset_import.extend(keep)
    return flat
