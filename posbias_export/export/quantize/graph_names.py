"""Which values a graph still reads, and its initializers that nothing reads dropped: what every
quantizer pass does after it replaces nodes (its own module, below the passes that use it)."""
from __future__ import annotations

import onnx

from ..graph_order import subgraphs


def used_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name a node of `graph` or of its subgraphs reads, and the graph's outputs."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
        for sub in subgraphs(node):
            used |= used_names(sub)
    return used


def drop_unused(graph: onnx.GraphProto) -> None:
    """Remove the initializers no node (nor subgraph) reads and no output names."""
    used = used_names(graph)
    for tensor in [t for t in graph.initializer if t.name not in used]:
        graph.initializer.remove(tensor)
