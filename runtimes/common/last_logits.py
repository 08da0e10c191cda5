"""A decoder's graph that computes the logits of each row's last position only.

A server samples from the last position's logits and nothing else, yet a decoder file's head (the
[hidden, vocabulary] matmul) runs over every position of a step: for a 512-token prompt in
bloom-560m that is 512 x 1024 x 250880 multiply-adds, nearly half the prefill's work, whose
result is thrown away. `last_position_graph` slices the head's input to its last position, so
`logits` is [batch, 1, vocabulary]: the same numbers for that position, a step's other outputs
(the cache) untouched. The edit is made on the graph only (graph_only.py: no weight is read); the
session finds the tensors in the file or beside it (see `session_source`).
"""
from __future__ import annotations

from pathlib import Path

from .graph_only import load_graph_only

KEEP_INLINE_BYTES = 4096  # small constants stay in the graph: shape inference reads their values
HEADS = ("MatMul", "MatMulNBits", "Gemm")
PASS_THROUGH = ("Cast", "Identity")  # ops a head's result may go through on its way to `logits`
END = 2**62  # Slice's "to the end"


def head_node(graph, logits: str):
    """The matmul whose result becomes `logits` (through casts only), or None."""
    producer = {out: node for node in graph.node for out in node.output}
    node = producer.get(logits)
    while node is not None and node.op_type in PASS_THROUGH:
        node = producer.get(node.input[0])
    return node if node is not None and node.op_type in HEADS else None


def last_position_graph(model_path: str):
    """The file's ModelProto (graph only) with the head's input sliced to the last position, or
    None when the graph has no recognisable head (the caller keeps the file as it is)."""
    import onnx
    from onnx import helper

    # a file that holds its weights (a float16 or quantized decoder under 2 GB) is not parsed whole:
    # the edited graph names each weight where it lies in the file, and the session reads it there
    proto = load_graph_only(model_path, KEEP_INLINE_BYTES, refer_in_place=True)
    graph = proto.graph
    logits = graph.output[0].name
    head = head_node(graph, logits)
    if head is None:
        return None
    hidden = head.input[0]
    sliced = f"{hidden}__last_position"
    consts = {f"{sliced}_{name}": value for name, value in (("starts", -1), ("ends", END), ("axes", 1))}
    graph.initializer.extend(helper.make_tensor(name, onnx.TensorProto.INT64, [1], [value])
                             for name, value in consts.items())
    index = list(graph.node).index(head)
    graph.node.insert(index, helper.make_node("Slice", [hidden, *consts], [sliced], name=f"{sliced}_slice"))
    head.input[0] = sliced
    position = graph.output[0].type.tensor_type.shape.dim[1]
    position.Clear()
    position.dim_value = 1
    return proto


def session_source(model_path: str, ort_options):
    """What to hand InferenceSession for the last-position graph: the edited model's bytes, with
    `ort_options` told where its external tensors lie (the file's folder). None: use the file
    (no head found, or no onnx package to edit it with)."""
    try:
        proto = last_position_graph(model_path)
    except ImportError:
        return None
    if proto is None:
        return None
    ort_options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(Path(model_path).resolve().parent))
    return proto.SerializeToString()
