"""Whether ONNX Runtime CUDA runs a file right with its default asynchronous launches, read from
the file's graph (never from a label).

ONNX Runtime CUDA (1.31.1, measured on an H200: benchmarks/gpu_cure.md) gave our blocked files
wrong blocks (max error 1-5) and Sandwich a Range of 10^18 bytes with asynchronous launches,
order-dependently. Its verbose log says where: inside a subgraph (an If branch, a Loop body), a
value an op reads on the host (a Slice's bounds, a Range's limits, a Loop's trip count) was
computed on the GPU and copied back (MemcpyToHost), and that read can see a stale value.

Which values those are follows from how ONNX Runtime places nodes, which this module replays on
the graph (onnxruntime/core/framework/fallback_cpu_capability.cc, GetCpuPreferredNodes): every
node goes to the CUDA provider, then, graph by graph, a node moves to the CPU when it consumes a
host value (a Shape's or Size's output, or a node already moved) and every input it has is such
a value, the graph's own input (a Loop body's iteration number lives on the host), or a small
constant of THIS graph: never a value of an enclosing graph, never a float16 one, never one the
CUDA kernel reads on the host anyway. Constant subexpressions are folded first, as ONNX Runtime
folds them before placing. A host read of a value left on the GPU is a device-to-host copy: in a
subgraph, the risk.

The portable blocked body is fenced apart (unfused_loops): it still raced without any copy back.

    python runtimes/common/host_reads.py model.onnx    # prints the risky reads, exit 1 if there are any
"""
from __future__ import annotations

import heapq
import sys

# The inputs ONNX Runtime's CUDA kernels read on the host, by op (their kernels' CPU inputs); the
# export's hoist (posbias_export/export/hoist.py) moves the If branches' arithmetic behind them.
HOST_INPUTS = {
    "Slice": (1, 2, 3, 4), "Range": (0, 1, 2), "Reshape": (1,), "Pad": (1, 2, 3), "Expand": (1,),
    "ConstantOfShape": (0,), "Tile": (1,), "Unsqueeze": (1,), "Squeeze": (1,), "Split": (1,), "TopK": (1,),
    "Resize": (1, 2, 3), "Loop": (0, 1), "If": (0,), "OneHot": (1,), "CumSum": (1,), "Trilu": (1,),
    "ReduceMin": (1,), "ReduceMax": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceProd": (1,),
    "GroupQueryAttention": (6,),
}
HOST_OUTPUTS = {"Shape": (0,), "Size": (0,)}  # CUDA kernels that write their output on the host
# Ops whose CUDA kernels lack an element type of their first input: the node runs on the CPU and
# reads every input there (ONNX Runtime's CUDA Pad: float, double, float16 only; its log showed the
# int64 positions Pad of the window branch copied to the host).
CUDA_TYPES = {"Pad": (1, 10, 11)}
SMALL_CONSTANT = 100  # elements: ONNX Runtime's kSmallInitializerThreshold
SMALL_BYTES = 4096  # an initializer read with its values (graph_only): every small constant's, names included
HALF = (10, 16)  # float16, bfloat16: ONNX Runtime never moves a node with such an input to the CPU


def _subgraphs(node):
    for attr in node.attribute:
        yield from ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)


def _constants(graph, outer: dict[str, str]) -> dict[str, bool]:
    """The constants `graph` sees (initializers and Constant nodes, its own and its enclosing
    graphs', which ONNX Runtime looks up too, and what it folds from them) -> whether each is small."""
    import numpy as np
    from onnx import numpy_helper

    small = {name: True for name, w in outer.items() if w == "const"}  # scalars and index vectors
    small.update((t.name, int(np.prod(t.dims)) <= SMALL_CONSTANT) for t in graph.initializer)
    for node in graph.node:
        if node.op_type == "Constant":
            tensor = next((a.t for a in node.attribute if a.name == "value"), None)
            small[node.output[0]] = tensor is None or numpy_helper.to_array(tensor).size <= SMALL_CONSTANT
        elif (node.op_type not in HOST_OUTPUTS and not any(True for _ in _subgraphs(node))
              and node.input and all(not i or i in small for i in _data_inputs(node))):
            small.update((o, all(small[i] for i in _data_inputs(node) if i)) for o in node.output)
    return small


def _data_inputs(node):
    """A node's inputs as ONNX Runtime runs it: CastLike is expanded to a Cast of its first input
    (the second gives only the type)."""
    return node.input[:1] if node.op_type == "CastLike" else node.input


def _elem_types(graph) -> dict[str, int]:
    infos = [*graph.input, *graph.output, *graph.value_info]
    return {v.name: v.type.tensor_type.elem_type for v in infos if v.type.HasField("tensor_type")}


def place(graph, loop_body: bool = False, outer: dict[str, str] | None = None) -> dict[str, str]:
    """Where ONNX Runtime CUDA leaves each value of `graph` (one scope): 'cpu', 'gpu', 'const'
    (folded or initializer), or 'input'. Values of enclosing graphs are not in it."""
    constants = _constants(graph, outer or {})
    inputs = [i.name for i in graph.input]
    where = {name: "const" for name in constants}
    for k, name in enumerate(inputs):  # a Loop body's iteration number and condition live on the host
        where[name] = "cpu" if loop_body and k < 2 else "input"
    nodes = [n for n in graph.node if not (n.output and all(o in constants for o in n.output))]
    types = _elem_types(graph)
    consumers: dict[str, list[int]] = {}
    for k, node in enumerate(nodes):
        for name in _data_inputs(node):
            consumers.setdefault(name, []).append(k)
    host: set[str] = set()
    queue: list[int] = []
    on_cpu = {k for k, node in enumerate(nodes) if not _has_cuda_kernel(node, types)}
    for k, node in enumerate(nodes):
        outs = node.output if k in on_cpu else [node.output[slot] for slot in HOST_OUTPUTS.get(node.op_type, ())]
        host.update(outs)
        queue += [c for name in outs for c in consumers.get(name, [])]
    heapq.heapify(queue)  # ONNX Runtime visits candidates in topological order
    seen = set(on_cpu)
    while queue:
        k = heapq.heappop(queue)
        if k in seen:
            continue
        seen.add(k)
        node = nodes[k]
        if any(True for _ in _subgraphs(node)) or not _movable(node, constants, set(inputs), host, types):
            continue
        on_cpu.add(k)
        host.update(node.output)
        for name in node.output:
            for c in consumers.get(name, []):
                heapq.heappush(queue, c)
    for k, node in enumerate(nodes):
        for slot, name in enumerate(node.output):
            where[name] = "cpu" if k in on_cpu or slot in HOST_OUTPUTS.get(node.op_type, ()) else "gpu"
    return where


def _has_cuda_kernel(node, types) -> bool:
    wanted = CUDA_TYPES.get(node.op_type)
    return wanted is None or not node.input or types.get(node.input[0], wanted[0]) in wanted


def _movable(node, constants, inputs, host, types) -> bool:
    for slot, name in enumerate(_data_inputs(node)):
        if types.get(name) in HALF:
            return False
        if constants.get(name) or name in inputs:
            continue
        if not name or name not in host or slot in HOST_INPUTS.get(node.op_type, ()):
            return False
    return True


def device_to_host_reads(graph, outer: dict[str, str] | None = None, where_: str = "graph",
                         loop_body: bool = False) -> list[tuple[str, str]]:
    """(scope, what) for every value of `graph` and its subgraphs that an op reads on the host
    while ONNX Runtime CUDA left it on the GPU: a device-to-host copy in that scope."""
    outer = outer or {}
    here = place(graph, loop_body, outer)
    seen = {**outer, **here}
    moved = {o for o, w in here.items() if w == "cpu"}
    found = []
    for node in graph.node:
        on_cpu = bool(node.output) and all(o in moved for o in node.output) and node.op_type not in HOST_OUTPUTS
        slots = range(len(_data_inputs(node))) if on_cpu else HOST_INPUTS.get(node.op_type, ())
        for slot in slots:
            name = node.input[slot] if slot < len(node.input) else ""
            if name and seen.get(name) == "gpu":
                found.append((where_, f"{node.op_type} input {slot} ({name})"))
        for sub in _subgraphs(node):
            found += device_to_host_reads(sub, seen, f"{where_}/{node.op_type}:{sub.name}", node.op_type == "Loop")
    return found


def risky_host_reads(model) -> list[str]:
    """Every host read inside a subgraph of `model` (a ModelProto) of a value ONNX Runtime CUDA
    computes on the GPU: the reads it can see stale. The model-local functions are inlined first,
    as ONNX Runtime runs them."""
    import onnx.inliner

    model = _light(model)
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    model = _typed(model)  # the element types: which kernels CUDA has
    return [f"{scope}: {what}" for scope, what in device_to_host_reads(model.graph) if scope != "graph"]


FUSED_ATTENTION = ("Attention", "MultiHeadAttention", "GroupQueryAttention")


def unfused_loops(model) -> list[str]:
    """The Loop bodies of `model` that attend without a fused attention op: the portable blocked
    body (MatMul, Softmax, MatMul per block). ONNX Runtime CUDA 1.31.1 still gave wrong blocks for
    ALiBi's with asynchronous launches though none of its subgraphs copies anything back to the
    host any more (H200, 2026-11-28: 1 of 9 fresh processes of the attention file, and the ALiBi
    LM and cache files in validate; benchmarks/gpu_cure_loops.md). Not understood, so fenced: such
    a file keeps host-synchronous launches. The GPU-shaped bodies (one fused op per block) ran
    right in every case (90 fresh processes, every validate job)."""
    import onnx.inliner

    model = _light(model)
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    found = []

    def walk(nodes, where):
        for node in nodes:
            for sub in _subgraphs(node):
                here = f"{where}/{node.op_type}:{sub.name}"
                if node.op_type == "Loop" and not any(n.op_type in FUSED_ATTENTION for n in sub.node):
                    found.append(here)
                walk(sub.node, here)

    walk(model.graph.node, "graph")
    return found


def _light(model):
    """`model` without its weights' bytes (a published model's weights would not fit the 2 GB
    protobuf limit that shape inference and the inliner work under): each initializer of more than
    SMALL_CONSTANT elements keeps its name, type and dims only."""
    import numpy as np
    import onnx
    from onnx import helper

    def bare(t):
        if int(np.prod(t.dims)) <= SMALL_CONSTANT:
            return t
        return onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims)

    graph = helper.make_graph(model.graph.node, model.graph.name, model.graph.input, model.graph.output,
                              [bare(t) for t in model.graph.initializer])
    light = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    light.functions.extend(model.functions)
    return light


def _typed(model):
    """`model` with its values' element types inferred (unknown where inference fails: every op is
    then taken to have its CUDA kernel)."""
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001
        return model


def needs_host_sync(model_path: str) -> bool:
    """True when the file has a risky host read or an unfused blocked Loop (or cannot be read:
    then the switch stays on, as it was for every file with control flow before)."""
    try:
        model = _graph(model_path)  # the weights' bytes not read
    except Exception:  # noqa: BLE001 - the session's own load reports a bad file
        return True
    return bool(risky_host_reads(model) or unfused_loops(model))


def _graph(model_path: str):
    """The file's graph with small constants' values, without its weights' bytes."""
    if __package__:
        from .graph_only import load_graph_only
    else:  # run as a script, or loaded by its path (tests): graph_only.py is beside it
        import importlib.util
        from pathlib import Path

        spec = importlib.util.spec_from_file_location("graph_only", Path(__file__).with_name("graph_only.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        load_graph_only = module.load_graph_only
    return load_graph_only(model_path, SMALL_BYTES)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: host_reads.py model.onnx", file=sys.stderr)
        return 2
    model = _graph(args[0])
    found = risky_host_reads(model) + [f"{loop}: attends without a fused op (the portable blocked body)"
                                       for loop in unfused_loops(model)]
    print("\n".join(found) or "no subgraph reads on the host a value ONNX Runtime CUDA computes on the GPU, and every "
          "blocked Loop ends in a fused attention op: safe with asynchronous launches")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
