"""--quantize int4 without the float file: each weight quantized as the export goes, one at a time.

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

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import ExportCheckError
from ..nn.lazy_weights import pieces
from . import quantize as whole
from .schemes import Int4
from .streamed import PENDING, WeightRef, is_pending_tensor, pending_index

SPILL_MIN_BYTES = 1024  # smaller tensors stay in the model proto (what onnx.save_model's threshold keeps inline)
READ_BYTES = 64 << 20  # a spilled tensor is streamed out this many bytes at a time
SLAB_ELEMENTS = 1 << 22  # weights handed to ONNX Runtime's rounding per call (16 MB of float32)


@dataclass(frozen=True)
class SpilledRef:
    """What a placeholder holds when its bytes were computed here: a span of the spill file."""

    path: Path
    offset: int
    nbytes: int

    def chunks(self):
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            left = self.nbytes
            while left:
                piece = f.read(min(left, READ_BYTES))
                if not piece:
                    raise OSError(f"{self.path} ended {left} bytes early")
                left -= len(piece)
                yield np.frombuffer(piece, np.uint8)


class Weights:
    """The graph's constant tensors by name: placeholders read through their references (refs,
    appended to as tensors are spilled), the others as they are. One spill file per export."""

    def __init__(self, refs: list, spill: Path):
        self.refs, self.spill, self.end = refs, spill, 0
        spill.touch()

    def read(self, tensor: onnx.TensorProto) -> np.ndarray:
        if not is_pending_tensor(tensor):
            return numpy_helper.to_array(tensor)
        ref = self.refs[pending_index(tensor)]
        out = np.empty(tuple(tensor.dims), onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        if isinstance(ref, WeightRef) and ref.perm == (1, 0):  # W^T: the source's rows fill columns
            at = 0
            for piece in pieces(ref.reader):  # WeightRef.chunks would hold the whole source per slab
                rows = ref.checked(piece)
                out[:, at:at + rows.shape[0]] = rows.T
                at += rows.shape[0]
            return out
        flat, at = out.reshape(-1).view(np.uint8), 0  # filled piece by piece: the tensor is held once
        for piece in ref.chunks():  # a WeightRef's: slabs along the first axis, in the file's dtype
            raw = piece.reshape(-1).view(np.uint8)
            flat[at:at + raw.size] = raw
            at += raw.size
        if at != flat.size:
            raise OSError(f"weight {tensor.name}: {at} bytes read of {flat.size}")
        return out

    def column_slabs(self, tensor: onnx.TensorProto):
        """A MatMul weight [K, N] as [K, c] slabs, left to right. A source weight read transposed
        (nn.Linear's W^T) is never whole in memory: each piece of its rows is a slab of columns."""
        ref = self.refs[pending_index(tensor)] if is_pending_tensor(tensor) else None
        if isinstance(ref, WeightRef) and ref.perm == (1, 0):
            for piece in pieces(ref.reader):
                yield ref.checked(piece).T
            return
        values = self.read(tensor)
        step = max(1, SLAB_ELEMENTS // max(1, values.shape[0]))
        for start in range(0, values.shape[1], step):
            yield values[:, start:start + step]

    def row_slabs(self, tensor: onnx.TensorProto):
        """A 2-D weight as slabs of an even number of rows, top to bottom (int4 packs two values
        a byte: each slab then packs into whole bytes); a source weight piece by piece."""
        ref = self.refs[pending_index(tensor)] if is_pending_tensor(tensor) else None
        if isinstance(ref, WeightRef) and not ref.perm:
            parts = (ref.checked(piece) for piece in pieces(ref.reader))
        else:
            values = self.read(tensor)
            step = max(2, SLAB_ELEMENTS // max(1, values.shape[1]))
            parts = (values[start:start + step] for start in range(0, values.shape[0], step))
        carried = None
        for part in parts:
            part = part if carried is None else np.concatenate([carried, part])
            keep = part.shape[0] // 2 * 2
            carried = part[keep:] if keep < part.shape[0] else None
            if keep:
                yield part[:keep]
        if carried is not None:  # an odd last row: its bytes end the packed data, as the whole's do
            yield carried

    def transposed(self, tensor: onnx.TensorProto, perm: tuple[int, ...], name: str) -> onnx.TensorProto | None:
        """A placeholder of a source weight's transpose (the writer permutes as it reads, as
        streamed.fold_weight_transposes does); None when `tensor` is not a source weight."""
        ref = self.refs[pending_index(tensor)] if is_pending_tensor(tensor) else None
        if not isinstance(ref, WeightRef):
            return None
        composed = tuple(ref.perm[p] for p in perm) if ref.perm else perm
        self.refs.append(WeightRef(ref.reader, ref.dtype, composed))
        return _placeholder(name, tensor.data_type, self.refs[-1].shape, len(self.refs) - 1, self.refs[-1].nbytes)

    def keep(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        """`tensor` (with its values) as the graph will hold it: inline if small, else its bytes
        appended to the spill file and the tensor a placeholder of them."""
        if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.ByteSize() <= SPILL_MIN_BYTES:
            return tensor
        # raw_data as the quantizer wrote it (int4: two per byte); a typed field's values as bytes
        raw = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
        offset = -(-self.end // 4096) * 4096
        with open(self.spill, "r+b") as f:
            f.seek(offset)
            f.write(raw)
        self.end = offset + len(raw)
        self.refs.append(SpilledRef(self.spill, offset, len(raw)))
        return _placeholder(tensor.name, tensor.data_type, tensor.dims, len(self.refs) - 1, len(raw))


def _placeholder(name: str, data_type: int, dims, index: int, nbytes: int) -> onnx.TensorProto:
    """A pending tensor (streamed.py): its offset the index of its reference."""
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims), data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", PENDING), ("offset", str(index)), ("length", str(nbytes))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def drop_unused(graph: onnx.GraphProto) -> None:
    used = whole._used_names(graph)
    for t in [t for t in graph.initializer if t.name not in used]:
        graph.initializer.remove(t)


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


def quantize_streamed(proto: onnx.ModelProto, refs: list, spec: Int4, spill: Path) -> onnx.ModelProto:
    """Int4.quantize's result on a graph of placeholders (streamed.py), computed weight by weight;
    `refs` gains the spilled tensors' references (the file at `spill` must live until `save`)."""
    weights = Weights(refs, spill)
    whole.fold_weight_shaping(proto, weights.read, weights.keep, weights.transposed)
    whole.name_nodes(proto)
    picked = whole.weight_nodes(proto)
    if not picked:
        raise ExportCheckError("the model has no weight MatMul or embedding Gather to quantize")
    names, head = [n.name for n in picked], whole.head_nodes(proto, picked)
    spec = spec.resolved()
    body = {n for n in names if spec.head == "int4" or n not in head}
    eight = {n for n in names if n in head} if spec.head == "int8" else set()
    with whole._quiet():
        _opsets_as_the_quantizer_sets_them(proto)
        _quantize_nodes(proto, weights, spec, 4, body)
        if eight:  # the head in a second pass, as Int4.quantize runs it
            _quantize_nodes(proto, weights, spec, 8, eight)
    return whole._functions_at_model_opset(proto)
