"""Weight-only quantization of a saved float LM file through ONNX Runtime's own quantizers (the
scheme classes, schemes.py, make the call).

What is quantized: the linear layers' weights (top-level MatMul nodes whose right input is a
2-D initializer) and the token embedding (the Gather reading `input_ids`). Attention, the
positional bias, norms and the softmax stay in float: they live in model-local functions or
Loop/If bodies, or read no weight initializer, and are never in the list handed to the
quantizer. A tied LM head (MatMul on Transpose(embedding)) gets the transposed table as its
own initializer first, so the head, half the bytes at BLOOM-560m, is quantized too; then the
embedding reads its rows from the quantized head (tied.py): the table is stored once.

The export never writes the float file: it quantizes weight by weight (streamed.py,
with this module's fold and node choice). `quantize_file` is the whole-file path those files are
tested equal to, and `quantize_path` is what the int8 stream runs on its skeleton.
"""
from __future__ import annotations

import contextlib
import errno
import logging
from pathlib import Path

import onnx

from ...errors import ExportCheckError
from .graph_names import drop_unused
from .tied import share_tied_table, tied_heads
from .schemes import Scheme

WEIGHT_SHAPING = {"Transpose", "Split", "Reshape", "Squeeze", "Unsqueeze", "Slice", "Concat", "Cast"}


def fold_weight_shaping(proto: onnx.ModelProto, read=None, keep=None, transposed=None) -> int:
    """Make every weight an initializer the quantizer can see: evaluate the Split / Transpose /
    Reshape ... nodes whose inputs are all constants (a fused qkv weight split three ways, a
    tied head's Transpose(embedding)) and drop what no node reads any more. (onnxscript's
    folder skips multi-output nodes such as Split.) Returns the number of nodes folded.
    A graph of placeholders (streamed.py) passes how a constant is read (`read`), how an
    output is held (`keep`), and `transposed(tensor, perm, name)`: a Transpose made without
    reading its input, or None to evaluate it."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    read, keep = read or numpy_helper.to_array, keep or (lambda tensor: tensor)
    graph = proto.graph
    consts = {t.name: t for t in graph.initializer}
    kept, folded = [], 0
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            consts[node.output[0]] = onnx.helper.get_attribute_value(node.attribute[0]) \
                if node.attribute[0].name == "value" else None
            kept.append(node)
            continue
        inputs = [i for i in node.input if i]
        if not (node.op_type in WEIGHT_SHAPING and node.domain in ("", "ai.onnx") and inputs and all(
                consts.get(i) is not None for i in inputs)):
            kept.append(node)
            continue
        made = None
        if transposed is not None and node.op_type == "Transpose":
            source = consts[node.input[0]]
            perm = next((tuple(a.ints) for a in node.attribute if a.name == "perm"), tuple(reversed(range(len(source.dims)))))
            made = transposed(source, perm, node.output[0])
            made = None if made is None else [made]
        if made is None:
            single = onnx.helper.make_model(
                onnx.helper.make_graph([node], "fold", [], [onnx.helper.make_tensor_value_info(o, 0, None)
                                                              for o in node.output]),
                opset_imports=[op for op in proto.opset_import if op.domain in ("", "ai.onnx")])
            values = ReferenceEvaluator(single).run(None, {i: read(consts[i]) for i in inputs})
            made = [keep(numpy_helper.from_array(value, name)) for name, value in zip(node.output, values)]
        for tensor in made:
            graph.initializer.append(tensor)
            consts[tensor.name] = tensor
        folded += 1
    del graph.node[:]
    graph.node.extend(kept)
    drop_unused(graph)
    return folded


def weight_nodes(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes the quantizer may touch: top-level MatMul with a 2-D weight initializer (both
    sides at least 16: a linear layer, not a small constant), and the Gather of the token
    embedding (its indices are `input_ids`)."""
    inits = {t.name: t for t in proto.graph.initializer}
    picked = []
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "MatMul" and node.input[1] in inits:
            dims = inits[node.input[1]].dims
            if len(dims) == 2 and min(dims) >= 16:
                picked.append(node)
        elif node.op_type == "Gather" and node.input[0] in inits and node.input[1] == "input_ids":
            if len(inits[node.input[0]].dims) == 2:
                picked.append(node)
    return picked


def name_nodes(proto: onnx.ModelProto) -> None:
    """Give every unnamed top-level node a unique name (the quantizers select nodes by name)."""
    taken = {n.name for n in proto.graph.node}
    for i, node in enumerate(proto.graph.node):
        if not node.name:
            name = f"{node.op_type}_q{i}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)


def prepared_float(path: Path) -> onnx.ModelProto:
    """A saved float file with every weight an initializer and every node named."""
    proto = onnx.load(str(path))
    fold_weight_shaping(proto)
    name_nodes(proto)
    return proto


def head_nodes(proto: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> tuple[str, ...]:
    """The weight MatMul that makes the first output (the logits), reached back through the
    nodes between them (a reshape, a cast); none for a file whose first output has no such
    MatMul (an encoder's features)."""
    if proto.graph.output[0].name != "logits":  # an encoder's features: no head
        return ()
    weights = {n.output[0]: n for n in nodes if n.op_type == "MatMul"}
    producer = {o: n for n in proto.graph.node for o in n.output}
    frontier, seen = [proto.graph.output[0].name], set()
    while frontier:
        name = frontier.pop()
        if name in weights:
            return (weights[name].name,)
        node = producer.get(name)
        if node is None or name in seen or node.op_type == "MatMul":
            continue
        seen.add(name)
        frontier += [i for i in node.input if i]
    return ()


def quantize_file(float_path: Path, spec: Scheme) -> onnx.ModelProto:
    """The quantized model of a saved float file (its weights folded into initializers first,
    written beside it, then handed to the quantizer by path)."""
    tied = tied_heads(onnx.load(str(float_path), load_external_data=False))
    proto = prepared_float(float_path)
    picked = weight_nodes(proto)
    names, head = [n.name for n in picked], head_nodes(proto, picked)
    prepared = float_path.with_name("prepared.onnx")
    onnx.save_model(proto, prepared, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="prepared.onnx.data", size_threshold=1024)
    del proto
    quantized = quantize_path(str(prepared), spec, names, head)
    share_tied_table(quantized, tied)
    return quantized


def quantize_path(path: str, spec: Scheme, nodes: list[str], head: tuple[str, ...] = ()) -> onnx.ModelProto:
    """ONNX Runtime's quantizer of the scheme applied to the model file at `path` (its tensors
    in external data), at the named `nodes`. The quantizers' own temporaries (quantize_dynamic
    copies the model into the system temp folder) go beside `path` instead: inside our locked
    temporary folder, gone with it, swept after a kill -9, never left in /tmp."""
    with _quiet(), _temporaries_in(Path(path).parent):
        return _quantize(path, spec, nodes, head)


@contextlib.contextmanager
def _temporaries_in(folder: Path):
    import tempfile

    previous = tempfile.tempdir
    tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = previous


@contextlib.contextmanager
def _quiet():
    """The quantizers log a line per node (INFO) and advise pre-processing (root WARNING) that
    does not apply to weight-only quantization; our summary says what was quantized."""
    import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401  (its loggers exist from here on)
    import onnxruntime.quantization.quantize  # noqa: F401

    root, previous = logging.getLogger(), logging.getLogger().level
    root.setLevel(logging.ERROR)
    quiet = [logging.getLogger(n) for n in logging.root.manager.loggerDict if n.startswith("onnxruntime")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(previous)
        for q, level in zip(quiet, levels):
            q.setLevel(level)


def _quantize(path: str, spec: Scheme, names: list[str], head: tuple[str, ...] = ()) -> onnx.ModelProto:
    from google.protobuf.message import DecodeError

    if not names:
        raise ExportCheckError("the model has no weight MatMul or embedding Gather to quantize")
    try:
        return _functions_at_model_opset(spec.quantize(path, names, head))
    except DecodeError:
        # ONNX Runtime's quantizer writes a shape-inferred copy and reads it back; on a full disk
        # the copy is cut short silently and the read fails with a protobuf error
        import shutil

        folder = Path(path).parent
        free = shutil.disk_usage(folder).free / 2**20
        raise OSError(errno.ENOSPC, f"the {spec.name} quantizer could not read back its own copy of the model "
                                    f"({free:.1f} MiB free beside the output): the disk is full or the copy was "
                                    "cut short") from None


def _functions_at_model_opset(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The 4-bit quantizer raises the model's default-domain opset to 21 (int4 tensors need
    it); ONNX requires a local function to import the same version as the model. Our
    functions' ops (Shape, Reshape, Where, Softmax, Loop ...) mean the same at 18 and 21:
    21 only adds types; the quantized file's parity is measured, not assumed (validate)."""
    version = next(op.version for op in proto.opset_import if op.domain in ("", "ai.onnx"))
    for function in proto.functions:
        for op in function.opset_import:
            if op.domain in ("", "ai.onnx"):
                op.version = version
    return proto


def quantized_node_count(proto: onnx.ModelProto) -> int:
    """Nodes of the quantized formats in the graph (MatMulNBits, GatherBlockQuantized,
    MatMulInteger, and the DequantizeLinear after a quantized Gather)."""
    kinds = {"MatMulNBits", "GatherBlockQuantized", "MatMulInteger"}
    return sum(n.op_type in kinds for n in proto.graph.node) + sum(
        n.op_type == "DequantizeLinear" and n.input[0].endswith("_quantized") for n in proto.graph.node)
