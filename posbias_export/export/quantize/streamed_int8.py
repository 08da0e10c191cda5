"""--quantize int8 without the float file: ONNX Runtime's own graph, its own rounding, one weight at a time.

The whole-model path (quantize.py) hands `quantize_dynamic` the float file, which it loads whole
and copies (11-17.5 GB for 0.5-1B models). The graph it writes (DynamicQuantizeLinear shared by
the MatMuls of one activation, MatMulInteger, Cast, the scales' Mul; the table's
DequantizeLinear) does not depend on the weights' values, only on which nodes are quantized and
the channel count of each weight. So `quantize_dynamic` runs on a skeleton: each weight it
quantizes replaced by a stand-in of one row (a MatMul's [1, N] keeps its N channels, the
embedding's [1, K] its width), every other large weight a graph input of its type and shape.
Each stand-in's quantized tensors are then replaced by the real weight's, rounded by the
routine `quantize_dynamic` calls per tensor (`quantize_data`) on slabs read from the source:
  MatMul, per channel: each of the N columns of W^T (a row of nn.Linear's W) on its own;
  MatMul, per tensor (--quant-per-tensor), and the embedding: the range over all slabs first,
  then each slab with that range (`rmin_override` / `rmax_override`: the same scale and zero
  point the whole tensor gives), as the elementwise rounding it is.
The file equals the whole-model path's (tests/test_quantize_streamed.py compares them).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ...errors import ExportCheckError
from . import whole
from .schemes import Int8
from ..streamed import is_pending_tensor
from .graph_names import used_names
from .slabs import Weights

# What quantize_dynamic passes its per-tensor routine (onnx_quantizer.py): weights int8,
# symmetric (is_weight_symmetric), the scheme's reduce_range; the embedding read by Gather is
# quantized as an activation: uint8, asymmetric, full range. No minimum real range.
WEIGHT_TYPE, TABLE_TYPE = TensorProto.INT8, TensorProto.UINT8
QUANTIZED_SUFFIX, SCALE_SUFFIX, ZERO_POINT_SUFFIX = "_quantized", "_scale", "_zero_point"  # its names


def quantize_int8_streamed(proto: onnx.ModelProto, weights: Weights, spec: Int8, names: list[str],
                           head: tuple[str, ...]) -> onnx.ModelProto:
    """Int8.quantize's result for the named nodes of a graph of placeholders (fold_weight_shaping
    done, nodes named); `head` is quantized as every layer (int8 has no head option)."""
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    rounding = {}  # weight name -> the op that reads it (the first picked, as the quantizer meets them)
    for node in graph.node:
        if node.name in names:
            rounding.setdefault(node.input[1] if node.op_type == "MatMul" else node.input[0], node.op_type)
    skeleton, held_back = _skeleton(proto, rounding)
    folder = weights.spill.parent
    path = folder / "skeleton.onnx"
    onnx.save_model(skeleton, str(path))
    try:
        quantized = whole.quantize_path(str(path), spec, names, head)
    finally:
        path.unlink(missing_ok=True)
    _restore(quantized, held_back, proto)
    by_name = {t.name: t for t in quantized.graph.initializer}
    for weight, op_type in rounding.items():
        source = inits[weight]
        made = _table(weights, source) if op_type == "Gather" else _matmul_weight(weights, source, spec)
        for tensor in made:  # the values spilled beside the output, streamed in by `save`
            _replace(by_name, weights.keep(tensor), rows_differ=tensor.name.endswith(QUANTIZED_SUFFIX))
    return quantized


def _skeleton(proto: onnx.ModelProto, rounding: dict[str, str]) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """A copy of the graph that quantize_dynamic can load in a few MB: the quantized weights one
    row each, the other placeholders graph inputs (returned, to be put back). Shape inference
    cannot type a MatMul with a one-row stand-in: its output gets its type (no shape) as value_info,
    the exporter's shapes are dropped."""
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(proto)
    graph = skeleton.graph
    kept, held_back = [], []
    for tensor in graph.initializer:
        if tensor.name in rounding:  # [rows, width] -> [1, width]: channels and table width kept
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
            kept.append(numpy_helper.from_array(np.ones((1, tensor.dims[-1]), dtype), tensor.name))
        elif is_pending_tensor(tensor):
            held_back.append(tensor)
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        else:
            kept.append(tensor)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    types = {t.name: t.data_type for t in kept}
    del graph.value_info[:]
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in rounding:
            graph.value_info.append(onnx.helper.make_tensor_value_info(node.output[0], types[node.input[1]], None))
    return skeleton, held_back


def _restore(quantized: onnx.ModelProto, held_back: list[onnx.TensorProto], original: onnx.ModelProto) -> None:
    """The held-back placeholders initializers again (those still read), and the exporter's value
    types for the values the quantized graph still has (the skeleton's are partial)."""
    graph = quantized.graph
    names = {t.name for t in held_back}
    inputs = [i for i in graph.input if i.name not in names]
    del graph.input[:]
    graph.input.extend(inputs)
    used = used_names(graph)
    graph.initializer.extend(t for t in held_back if t.name in used)
    produced = {o for node in graph.node for o in node.output}
    del graph.value_info[:]
    graph.value_info.extend(v for v in original.graph.value_info if v.name in produced)


def _replace(by_name: dict[str, onnx.TensorProto], tensor: onnx.TensorProto, rows_differ: bool) -> None:
    """The skeleton's tensor of this name replaced by the real one: the same type and dims (but
    for the rows of a quantized weight: the stand-in had one)."""
    stand_in = by_name.get(tensor.name)
    skip = 1 if rows_differ else 0
    if stand_in is None or stand_in.data_type != tensor.data_type or len(stand_in.dims) != len(tensor.dims) or \
            list(stand_in.dims[skip:]) != list(tensor.dims[skip:]):
        raise ExportCheckError(f"ONNX Runtime's int8 quantizer wrote {tensor.name} unlike this export expects "
                               "(an onnxruntime this version does not know): export with a pinned onnxruntime")
    stand_in.CopyFrom(tensor)


def _matmul_weight(weights: Weights, tensor: onnx.TensorProto, spec: Int8) -> list[onnx.TensorProto]:
    """A MatMul weight [K, N] as quantize_dynamic writes it: int8 values [K, N], scales and zero
    points per output channel ([N]) or per tensor ([])."""
    from onnxruntime.quantization.quant_utils import quantize_data

    k, n = tensor.dims
    values = np.empty((k, n), np.int8)
    if spec.per_channel:  # quantize_weight_per_channel_impl: channel i is column i, flattened
        scales, zero_points, at = [], [], 0
        for slab in weights.column_slabs(tensor):  # [K, c]
            for column in slab.T:
                zero_point, scale, q = quantize_data(column.flatten(), WEIGHT_TYPE, True, reduce_range=spec.REDUCE_RANGE)
                values[:, at] = q
                scales.append(scale)
                zero_points.append(zero_point)
                at += 1
        shape, scale, zero_point = [n], np.hstack(scales), np.hstack(zero_points)
    else:  # quantize_initializer_impl: the tensor flattened, one range
        rmin, rmax = _range(weights.column_slabs(tensor))
        at = 0
        for slab in weights.column_slabs(tensor):
            zero_point, scale, q = quantize_data(slab.flatten(), WEIGHT_TYPE, True, reduce_range=spec.REDUCE_RANGE,
                                                 rmin_override=rmin, rmax_override=rmax)
            values[:, at:at + slab.shape[1]] = q.reshape(slab.shape)
            at += slab.shape[1]
        shape = []
    return _tensors(tensor, values, WEIGHT_TYPE, shape, scale, zero_point)


def _table(weights: Weights, tensor: onnx.TensorProto) -> list[onnx.TensorProto]:
    """The embedding [V, K] as quantize_dynamic writes it: uint8 values, one scale and zero point."""
    from onnxruntime.quantization.quant_utils import quantize_data

    rmin, rmax = _range(weights.row_slabs(tensor))
    values, at = np.empty(tuple(tensor.dims), np.uint8), 0
    for slab in weights.row_slabs(tensor):
        zero_point, scale, q = quantize_data(slab.flatten(), TABLE_TYPE, False, reduce_range=False,
                                             rmin_override=rmin, rmax_override=rmax)
        values[at:at + slab.shape[0]] = q.reshape(slab.shape)
        at += slab.shape[0]
    return _tensors(tensor, values, TABLE_TYPE, [], scale, zero_point)


def _range(slabs) -> tuple[np.ndarray, np.ndarray]:
    """The minimum and maximum of a tensor given in slabs: the whole's `data.min()`, `data.max()`."""
    lows, highs = zip(*((slab.min(), slab.max()) for slab in slabs))
    return min(lows), max(highs)


def _tensors(tensor: onnx.TensorProto, values: np.ndarray, kind: int, shape: list[int], scale, zero_point):
    """The three initializers under the quantizer's names, made as it makes them."""
    return [numpy_helper.from_array(values, tensor.name + QUANTIZED_SUFFIX),
            onnx.helper.make_tensor(tensor.name + SCALE_SUFFIX, tensor.data_type, shape,
                                    np.asarray(scale).reshape(-1).tolist()),
            onnx.helper.make_tensor(tensor.name + ZERO_POINT_SUFFIX, kind, shape,
                                    np.asarray(zero_point).reshape(-1).tolist())]
