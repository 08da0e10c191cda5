"""Index arithmetic out of If branches, so ONNX Runtime computes it on the host.

ONNX Runtime's CUDA provider (1.31.1, measured on an H200: benchmarks/gpu_cure.md) runs the shape
arithmetic of an If branch on the GPU and copies each result back to the host for the op that
reads it there (a Slice's bounds, a Loop's trip count, a Pad's pads). With asynchronous launches
those reads see stale values: our blocked files gave wrong blocks (max error 1-5) and Sandwich a
Range of 10^18 bytes, order-dependently. The same arithmetic outside any If (the blocked Loop with
every If dropped) ran right in every order: there ONNX Runtime computes it on the host from the
inputs' shapes. This pass gives every If the same: each node of a branch that computes a value an
op reads on the host (the HOST_INPUTS slots) from shapes and constants alone, and everything such
a value is made of, moves in front of the If (renamed apart), recursively. Loop bodies stay as
they are: they depend on the iteration, and ran right. What moves is integers and tiny tensors
computed from shapes, so a branch not taken costs microseconds.

A blocked attention function calls helper functions (PadQueries, SlimBlockBounds...) whose
nodes the pass must see, so `hoist_functions` first inlines those helpers into each
posbias.BlockedAttention<Family> body (ONNX Runtime inlines them anyway); the body and the
family's own functions (posbias.Alibi, posbias.KerpleLog...) stay functions of the file.
"""
from __future__ import annotations

import itertools

import onnx
import onnx.inliner

from ..runners import runtimes_common
from .graph_order import outside_reads, subgraphs

__all__ = ["HOST_INPUTS", "hoist_functions", "hoist_nodes"]

# The inputs ONNX Runtime's CUDA kernels read on the host, by op: the runners' table, which decides
# their launches from the same reads (runtimes/common/host_reads.py)
HOST_INPUTS = runtimes_common("host_reads").HOST_INPUTS
SHAPE_SOURCES = ("Shape", "Size", "Constant")


def _rename_uses(nodes, old: str, new: str) -> None:
    """Every use of `old` (in subgraphs too) reads `new`."""
    for node in nodes:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for graph in subgraphs(node):
            _rename_uses(graph.node, old, new)
            for out in graph.output:
                if out.name == old:
                    raise ValueError(f"a subgraph returns {old!r}, which the hoist moved")


def _lifted(branch: onnx.GraphProto, shape: set[str]) -> list[onnx.NodeProto]:
    """The branch nodes to move in front of its If, in order, removed from the branch."""
    nodes = list(branch.node)
    defined = {o for n in nodes for o in n.output}
    returned = {o.name for o in branch.output}
    derived: dict[str, onnx.NodeProto] = {}  # shape-derived values computable before the If -> producer
    for node in nodes:
        if any(True for _ in subgraphs(node)) or set(node.output) & returned:
            continue
        inputs = [i for i in node.input if i]
        available = all(i not in defined or i in derived for i in inputs)
        from_shapes = node.op_type in SHAPE_SOURCES or (inputs and all(i in shape or i in derived for i in inputs))
        if available and from_shapes:
            derived.update((o, node) for o in node.output)
    seeds = [node.input[i] for node in nodes for i in HOST_INPUTS.get(node.op_type, ()) if i < len(node.input)]
    for node in nodes:  # what nested Ifs and Loops read from here (a Loop's body: as it would from the graph)
        for graph in subgraphs(node):
            seeds += outside_reads(graph)
    wanted, stack = set(), [name for name in seeds if name in derived]
    while stack:  # what host reads need, and what that is made of
        name = stack.pop()
        producer = derived[name]
        if id(producer) in wanted:
            continue
        wanted.add(id(producer))
        stack += [i for i in producer.input if i in derived]
    moved = [n for n in nodes if id(n) in wanted]
    del branch.node[:]
    branch.node.extend(n for n in nodes if id(n) not in wanted)
    return moved


def hoist_nodes(nodes: list[onnx.NodeProto], shape: set[str] | None = None, fresh=None) -> list[onnx.NodeProto]:
    """`nodes` (one scope, in order) with every If's host-read index arithmetic moved in front of
    it; `shape`: names of the enclosing scopes known to come from shapes and constants; `fresh`:
    the counter that names moved values apart (one per function: the same export, the same names)."""
    shape = set(shape or ())
    fresh = itertools.count() if fresh is None else fresh
    out: list[onnx.NodeProto] = []
    for node in nodes:
        if node.op_type == "If":
            for branch in subgraphs(node):
                inner = hoist_nodes(list(branch.node), shape, fresh)  # nested Ifs lift into the branch first
                del branch.node[:]
                branch.node.extend(inner)
                moved = _lifted(branch, shape)
                for node_moved in moved:
                    for k, name in enumerate(node_moved.output):  # renamed apart: both branches may define a name
                        renamed = f"{name}_host{next(fresh)}"
                        _rename_uses([*moved, *branch.node], name, renamed)
                        node_moved.output[k] = renamed
                        shape.add(renamed)
                out.extend(moved)
        elif not any(True for _ in subgraphs(node)):
            inputs = [i for i in node.input if i]
            if node.op_type in SHAPE_SOURCES or (inputs and all(i in shape for i in inputs)):
                shape.update(node.output)
        out.append(node)
    return out


def hoist_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each posbias.BlockedAttention<Family> function that holds an If: its helpers inlined, its
    If branches' host-read index arithmetic moved in front of them. Other functions and the
    graph are left as they are; helpers nothing calls any more are dropped."""
    targets = [f for f in model.functions if f.name.startswith("BlockedAttention")
               and any(n.op_type == "If" for n in f.node)]
    if not targets:
        return model
    keep = {(f.domain, f.name) for f in targets}
    helpers = [(f.domain, f.name) for f in model.functions if f.name in _blocked_helpers()]
    holder = onnx.ModelProto(ir_version=model.ir_version)  # the functions alone: no graph, no weights copied
    holder.opset_import.extend(model.opset_import)
    holder.functions.extend(model.functions)
    inlined = onnx.inliner.inline_selected_functions(holder, helpers)  # the families' functions stay calls
    bodies = {(f.domain, f.name): f for f in inlined.functions}
    for f in model.functions:
        if (f.domain, f.name) in keep:
            body = hoist_nodes(list(bodies[f.domain, f.name].node))
            del f.node[:]
            f.node.extend(body)
            known = {o.domain for o in f.opset_import}
            f.opset_import.extend(o for o in bodies[f.domain, f.name].opset_import if o.domain not in known)
    return _drop_uncalled(model)


def _blocked_helpers() -> set[str]:
    """The pieces the blocked bodies are made of (PadQueries, SlimBlockBounds...): inlined so their
    index arithmetic can move; a family's own functions (posbias.Alibi, KerpleLog...) stay named."""
    from .targets.blocked_script import BLOCK_FUNCTIONS
    from .targets.gpu_script import GPU_FUNCTIONS
    from .targets.gpu_table_script import SLIM_TABLE_FUNCTIONS

    return {fn.name for fn in BLOCK_FUNCTIONS + GPU_FUNCTIONS + SLIM_TABLE_FUNCTIONS}


def _drop_uncalled(model: onnx.ModelProto) -> onnx.ModelProto:
    from .functions import all_nodes

    called: set[tuple[str, str]] = set()
    by_id = {(f.domain, f.name): f for f in model.functions}
    todo = [(n.domain, n.op_type) for n in all_nodes(model.graph.node) if (n.domain, n.op_type) in by_id]
    while todo:
        key = todo.pop()
        if key in called:
            continue
        called.add(key)
        todo += [(n.domain, n.op_type) for n in all_nodes(by_id[key].node) if (n.domain, n.op_type) in by_id]
    kept = [f for f in model.functions if (f.domain, f.name) in called]
    del model.functions[:]
    model.functions.extend(kept)
    return model
