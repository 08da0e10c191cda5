"""The posbias ONNX functions as model-local FunctionProtos: attach them to an exported model
(callees first: the reference evaluator needs that order), or inline them to a flat graph."""
from __future__ import annotations

import onnx
import onnx.inliner

from .biases.alibi import Alibi
from .biases.kerple import KerpleLog, KerplePower
from .biases.none import NoBias
from .biases.onnx_domain import DOMAIN, VERSION, RelativeDistance
from .biases.sandwich import Sandwich
from .biases.t5 import T5
from .biases.window import Window
from .blocked_script import BLOCK_FUNCTIONS

__all__ = ["Alibi", "KerpleLog", "KerplePower", "NoBias", "RelativeDistance", "Sandwich", "T5", "Window",
           "all_nodes", "attach", "function_protos", "inline"]

# Callees before callers.
ALL_FUNCTIONS = (RelativeDistance, Alibi, KerplePower, KerpleLog, Sandwich, T5, Window, NoBias, *BLOCK_FUNCTIONS)
BY_NAME = {f.name: f for f in ALL_FUNCTIONS}


def all_nodes(nodes):
    """Every node, those inside subgraph attributes (a Loop body) included."""
    for node in nodes:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attr.g.node)


def function_protos(names: set[str], opset: int, generated=()) -> list[onnx.FunctionProto]:
    """FunctionProtos for `names` and everything they call, callees first, importing the
    model's standard opset version (their ops mean the same from opset 18 on). `generated`
    are protos built per export (the blocked attention), placed after their callees."""
    made = {proto.name: proto for proto in generated}
    needed: set[str] = set()

    def visit(name: str) -> None:
        if name in needed:
            return
        if name not in BY_NAME and name not in made:
            raise ValueError(f"unknown posbias function {name!r}")
        needed.add(name)
        proto = made[name] if name in made else BY_NAME[name].to_function_proto()
        for node in all_nodes(proto.node):
            if node.domain == DOMAIN:
                visit(node.op_type)

    for name in names:
        visit(name)
    protos = [fn.to_function_proto() for fn in ALL_FUNCTIONS if fn.name in needed]
    protos += [proto for name, proto in made.items() if name in needed]
    for proto in protos:
        for imp in proto.opset_import:
            if imp.domain in ("", "ai.onnx"):
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
    return sorted(used)


def inline(model: onnx.ModelProto) -> onnx.ModelProto:
    """Flat graph of standard ops: every local function expanded, the posbias import dropped."""
    flat = onnx.inliner.inline_local_functions(model)
    keep = [i for i in flat.opset_import if i.domain != DOMAIN]
    del flat.opset_import[:]
    flat.opset_import.extend(keep)
    return flat
