"""--quantize without the float file: each weight quantized as the export goes, one at a time.
`quantize_streamed` is the entry point of both schemes (int8: streamed_int8.py); int4 is here.

The whole-model path (quantize.py) writes the float model, then ONNX Runtime's
MatMulNBitsQuantizer loads all of it and quantizes node by node: its peak is the float weights
several times over (8.9 GB for BLOOM-560m's 0.52 GB int4 file). Here the graph keeps its weights
as placeholders (streamed.py). For each node that quantizer would touch, its weight is read a
slab at a time (nn.Linear's W^T: a piece of W's rows is a slab of columns) and each slab is
rounded by the quantizer's own per-tensor routine (`qbits_block_quant`, ONNX Runtime's C++
kernel, for MatMul; `quantize_ndarray` for the embedding's Gather): columns, and the embedding's
rows, are quantized independently, so the slabs stacked are the whole tensor's result. The node
is replaced by the MatMulNBits / GatherBlockQuantized node the quantizer writes, and the
quantized tensors are spilled to a file beside the output as placeholders in turn, streamed into
the model's data by `save`. The peak is one slab and one weight's quantized form. The file holds
the whole-model quantizer's nodes and tensors (tests/test_quantize_streamed.py compares them).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ...errors import ExportCheckError
from . import whole
from .schemes import Int4, Int8, Scheme
from .graph_names import drop_unused
from .slabs import Weights
from .tied import share_tied_table, tied_heads


def _node_quantizer(spec: Int4, bits: int):
    """The per-node quantizer MatMulNBitsQuantizer builds from Int4.quantize's arguments."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer
    from onnxruntime.quantization.quant_utils import QuantFormat

    return DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=spec.block, is_symmetric=spec.symmetric, accuracy_level=spec.accuracy_level or None,
        quant_format=QuantFormat.QOperator, op_types_to_quantize=("MatMul", "Gather"),
        quant_axes=(("MatMul", 0), ("Gather", 1)), bits=bits))


def _matmul_nbits(node: onnx.NodeProto, slabs, k: int, n: int, name: str, spec: Int4, bits: int):
    """DefaultWeightOnlyQuantizer.quantize_matmul's MatMulNBits node and tensors for a weight
    [K, N] given as slabs of columns, its rounding (qbits_block_quant, ONNX Runtime's C++ kernel)
    run slab by slab: each column is quantized on its own, so the slabs' results stacked are the
    whole's."""
    quantizer = _node_quantizer(spec, bits)
    parts = [quantizer.qbits_block_quant(np.ascontiguousarray(slab)) for slab in slabs]
    packed, scales, zero_points = (np.concatenate([p[i] for p in parts], axis=0) for i in range(3))
    tensors = [numpy_helper.from_array(packed, f"{name}_Q{bits}"), numpy_helper.from_array(scales, f"{name}_scales")]
    if not spec.symmetric:
        tensors.append(numpy_helper.from_array(zero_points, f"{name}_zero_points"))
    attrs = {"K": k, "N": n, "bits": bits, "block_size": spec.block}
    if spec.accuracy_level:  # the quantizer leaves 0 out: the attribute is optional
        attrs["accuracy_level"] = spec.accuracy_level
    quantized = onnx.helper.make_node("MatMulNBits", [node.input[0], *(t.name for t in tensors)], [node.output[0]],
                                      name=f"{node.name}_Q{bits}" if node.name else "", domain="com.microsoft", **attrs)
    return [quantized], tensors


def _gather_block_quantized(node: onnx.NodeProto, slabs, shape: tuple[int, ...], name: str, spec: Int4):
    """DefaultWeightOnlyQuantizer.quantize_gather's GatherBlockQuantized node and tensors (4 bits,
    blocks along axis 1) for a table given as slabs of rows, its rounding (quantize_ndarray) run
    slab by slab: each row is quantized on its own."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    parts = [DefaultWeightOnlyQuantizer.quantize_ndarray(slab, 1, spec.block, spec.symmetric) for slab in slabs]
    data = np.concatenate([p[0] for p in parts])
    scales = np.concatenate([p[1] for p in parts], axis=0)
    kind = onnx.TensorProto.INT4 if spec.symmetric else onnx.TensorProto.UINT4
    tensors = [onnx.helper.make_tensor(f"{name}_Q4", kind, shape, data.tobytes(), True),
               numpy_helper.from_array(scales, f"{name}_scales")]
    if not spec.symmetric:
        zero_points = np.concatenate([p[2] for p in parts])
        tensors.append(onnx.helper.make_tensor(f"{name}_zero_points", kind, scales.shape, zero_points.tobytes(), True))
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    inputs = [tensors[0].name, node.input[1], *(t.name for t in tensors[1:])]
    quantized = onnx.helper.make_node("GatherBlockQuantized", inputs, [node.output[0]],
                                      name=f"{node.name}_Q4" if node.name else "", domain="com.microsoft",
                                      gather_axis=axis, quantize_axis=1, block_size=spec.block)
    return [quantized], tensors


def _quantize_nodes(proto: onnx.ModelProto, weights: Weights, spec: Int4, bits: int, names: set[str]) -> None:
    """One MatMulNBitsQuantizer pass over the top-level nodes named, a weight at a time: the
    weight read, quantized, its tensors kept (spilled), the node replaced."""
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    new_nodes = []
    for node in graph.node:
        if node.name not in names:
            new_nodes.append(node)
            continue
        weight = inits[node.input[1] if node.op_type == "MatMul" else node.input[0]]
        shape = tuple(weight.dims)
        if node.op_type == "MatMul":
            replaced, tensors = _matmul_nbits(node, weights.column_slabs(weight), *shape, weight.name, spec, bits)
        else:
            replaced, tensors = _gather_block_quantized(node, weights.row_slabs(weight), shape, weight.name, spec)
        for tensor in tensors:
            kept = weights.keep(tensor)
            graph.initializer.append(kept)
            inits[kept.name] = kept
        new_nodes.extend(replaced)
    del graph.node[:]
    graph.node.extend(new_nodes)
    drop_unused(graph)


def _opsets_as_the_quantizer_sets_them(proto: onnx.ModelProto) -> None:
    """MatMulNBitsQuantizer.process: com.microsoft imported, the default domain raised to 21 and
    the IR to 10 (int4 tensors need both) when Gather is among the op types, as ours is."""
    domains = {op.domain: op for op in proto.opset_import}
    if "com.microsoft" in domains:
        domains["com.microsoft"].version = 1
    else:
        proto.opset_import.add(domain="com.microsoft", version=1)
    for op in proto.opset_import:
        if op.domain in ("", "ai.onnx") and op.version < 21:
            op.version = 21
    proto.ir_version = max(proto.ir_version, 10)


def quantize_streamed(proto: onnx.ModelProto, refs: list, spec: Scheme, spill: Path) -> onnx.ModelProto:
    """The scheme's whole-model quantizer's result on a graph of placeholders (streamed.py),
    computed weight by weight; `refs` gains the spilled tensors' references (the file at `spill`
    must live until `save`; its folder also holds int8's skeleton while it is quantized)."""
    from .streamed_int8 import quantize_int8_streamed

    weights = Weights(refs, spill)
    tied = tied_heads(proto)  # before the fold turns Transpose(table) into the head's own weight
    whole.fold_weight_shaping(proto, weights.read, weights.keep, weights.transposed)
    whole.name_nodes(proto)
    picked = whole.weight_nodes(proto)
    if not picked:
        raise ExportCheckError("the model has no weight MatMul or embedding Gather to quantize")
    head = whole.head_nodes(proto, picked)
    if isinstance(spec, Int8):
        quantized = quantize_int8_streamed(proto, weights, spec, [n.name for n in picked], head)
    else:
        quantized = _quantize_int4(proto, weights, spec, [n.name for n in picked], head)
    share_tied_table(quantized, tied, aliases=True)  # the writer stores an alias's bytes once
    return quantized


def _quantize_int4(proto: onnx.ModelProto, weights: Weights, spec: Int4, names: list[str],
                   head: tuple[str, ...]) -> onnx.ModelProto:
    """Int4.quantize's passes: the body in 4 bits, the head as `spec.head` says."""
    spec = spec.resolved()
    body = {n for n in names if spec.head == "int4" or n not in head}
    eight = {n for n in names if n in head} if spec.head == "int8" else set()
    with whole._quiet():
        _opsets_as_the_quantizer_sets_them(proto)
        _quantize_nodes(proto, weights, spec, 4, body)
        if eight:  # the head in a second pass, as Int4.quantize runs it
            _quantize_nodes(proto, weights, spec, 8, eight)
    return whole._functions_at_model_opset(proto)
