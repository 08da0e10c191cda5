"""Whether ONNX Runtime CUDA runs a file right with its default asynchronous launches, read from
the file's graph (never from a label).

ONNX Runtime CUDA (1.31.1, measured on an H200: benchmarks/gpu_cure.md) places index arithmetic
inside a subgraph (an If branch, a Loop body) on the GPU when it starts from a value of an
enclosing graph, and copies the result back for the op that reads it on the host (a Slice's
bounds, a Loop's trip count, a Pad's pads, an If's condition). With asynchronous launches that
read can see a stale value: wrong blocks (max error 1-5) or a Range of 10^18 bytes. Arithmetic
that starts from the subgraph's own Shape nodes, constants and inputs (a Loop's iteration
number) runs on the host and is safe. export/hoist.py moves every If branch's risky arithmetic
out (failures went from most blocked cells to a few); the blocked Loop bodies still read per-block
bounds so (wrong, rarely: 3 of 32 validate jobs), so those files keep host-synchronous launches.

    python runtimes/common/host_reads.py model.onnx    # prints the risky reads, exit 1 if there are any
"""
from __future__ import annotations

import sys

# The inputs ONNX Runtime's CUDA kernels read on the host, by op (their kernels' CPU inputs); the
# export's hoist (posbias_export/export/hoist.py) moves the arithmetic behind exactly these.
HOST_INPUTS = {
    "Slice": (1, 2, 3, 4), "Range": (0, 1, 2), "Reshape": (1,), "Pad": (1, 2, 3), "Expand": (1,),
    "ConstantOfShape": (0,), "Tile": (1,), "Unsqueeze": (1,), "Squeeze": (1,), "Split": (1,), "TopK": (1,),
    "Resize": (1, 2, 3), "Loop": (0, 1), "If": (0,), "OneHot": (1,), "CumSum": (1,), "Trilu": (1,),
    "ReduceMin": (1,), "ReduceMax": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceProd": (1,),
    "GroupQueryAttention": (5, 6),
}


def _subgraphs(node):
    for attr in node.attribute:
        yield from ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)


def _branch_reads(nodes, constants: set[str], where: str) -> list[str]:
    """Host reads inside the subgraphs (If branches, Loop bodies) among `nodes` whose arithmetic
    starts from a value of an enclosing graph."""
    found = []
    for node in nodes:
        for graph in _subgraphs(node):
            inner = constants | {i.name for i in graph.input}  # a Loop's iteration number lives on the host
            here = f"{where}/{node.op_type}:{graph.name}"  # which op owns the subgraph: If or Loop
            found += _risky_in_branch(graph.node, inner, here)
            found += _branch_reads(graph.node, constants | {o for n in graph.node if n.op_type == "Constant"
                                                             for o in n.output}, here)
    return found


def _host_read_names(nodes) -> list[tuple[str, int, str]]:
    """(op, slot, name) of every host read in `nodes` and in the If branches nested in them (what
    a nested branch reads from outside itself is read from here); Loop bodies are left out."""
    reads = []
    for node in nodes:
        reads += [(node.op_type, slot, node.input[slot]) for slot in HOST_INPUTS.get(node.op_type, ())
                  if slot < len(node.input) and node.input[slot]]
        if node.op_type == "If":
            for graph in _subgraphs(node):
                inner = {o for n in graph.node for o in n.output}
                reads += [r for r in _host_read_names(graph.node) if r[2] not in inner]
    return reads


def _risky_in_branch(nodes, constants: set[str], where: str) -> list[str]:
    defined = {o: n for n in nodes for o in n.output}
    constants = constants | {o for n in nodes if n.op_type == "Constant" for o in n.output}
    risky = []
    for op_type, slot, read in _host_read_names(nodes):
        if read in defined:
            stack, seen = [read], set()
            while stack:
                name = stack.pop()
                if not name or name in seen or name in constants:
                    continue
                seen.add(name)
                producer = defined.get(name)
                if producer is None:  # an enclosing graph's value feeds branch arithmetic read on the host
                    risky.append(f"{where}: {op_type} input {slot} ({read}) from {name}")
                    break
                if producer.op_type not in ("Shape", "Size"):
                    stack += list(producer.input)
    return risky


def risky_host_reads(model) -> list[str]:
    """Every subgraph host read of `model` (a ModelProto) that ONNX Runtime CUDA can read stale."""
    if model.functions:  # read what ONNX Runtime runs: the model-local functions inlined
        import onnx.inliner

        model = onnx.inliner.inline_local_functions(model)
    constants = {i.name for i in model.graph.initializer}
    return _branch_reads(model.graph.node, constants | {o for n in model.graph.node if n.op_type == "Constant"
                                                        for o in n.output}, "graph")


def needs_host_sync(model_path: str) -> bool:
    """True when the file has a risky host read (or cannot be read: then the cure stays on, as it
    was for every file with control flow before)."""
    try:
        import onnx

        model = onnx.load(model_path, load_external_data=False)
    except Exception:  # noqa: BLE001 - the session's own load reports a bad file
        return True
    return bool(risky_host_reads(model))


def main(argv=None) -> int:
    import onnx

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: host_reads.py model.onnx", file=sys.stderr)
        return 2
    found = risky_host_reads(onnx.load(args[0], load_external_data=False))
    print("\n".join(found) or "no subgraph reads on the host what it computed from an enclosing graph: safe with asynchronous launches")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
