"""Nodes put back in an order where every value is made before it is read, subgraphs counted.

ONNX Runtime's quantizers sort a graph by each node's listed inputs only. An If or Loop whose branch
reads a value of the graph around it (an inlined blocked attention's branches do) lists no such
input, so the sort can move that value's producer after the If, and onnx.checker then refuses the
file ("Nodes in a graph must be topologically sorted"). This sort counts a subgraph's outside reads
as its node's inputs and otherwise keeps the nodes' order.
"""
from __future__ import annotations

import heapq

import onnx


def subgraphs(node: onnx.NodeProto):
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def outside_reads(graph: onnx.GraphProto) -> set[str]:
    """The names `graph` (its nested subgraphs too) reads from the scopes around it."""
    inner = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    reads = {i for n in graph.node for i in n.input if i}
    for node in graph.node:
        for sub in subgraphs(node):
            reads |= outside_reads(sub)
    return reads - inner


def _reads(node: onnx.NodeProto) -> set[str]:
    names = {i for i in node.input if i}
    for sub in subgraphs(node):
        names |= outside_reads(sub)
    return names


def sort_graph(graph: onnx.GraphProto) -> None:
    """Reorder `graph`'s nodes (and each subgraph's) so every read follows its producer; stable:
    a node moves only behind what it reads. A name no node of the graph makes (an input, an
    initializer, the outer scope's) is there from the start."""
    nodes = list(graph.node)
    producer = {out: index for index, node in enumerate(nodes) for out in node.output if out}
    waits_on = [{producer[name] for name in _reads(node) if name in producer} - {index} for index, node in enumerate(nodes)]
    readers: dict[int, list[int]] = {}
    for index, before in enumerate(waits_on):
        for other in before:
            readers.setdefault(other, []).append(index)
    ready = [index for index, before in enumerate(waits_on) if not before]
    heapq.heapify(ready)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for reader in readers.get(index, []):
            waits_on[reader].discard(index)
            if not waits_on[reader]:
                heapq.heappush(ready, reader)
    if len(order) != len(nodes):
        raise ValueError("the graph has a cycle: its nodes cannot be ordered")
    del graph.node[:]
    graph.node.extend(nodes[index] for index in order)
    for node in graph.node:
        for sub in subgraphs(node):
            sort_graph(sub)
