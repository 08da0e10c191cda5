"""int8's activations quantized per row instead of per call, in standard ops.

ONNX Runtime's quantize_dynamic writes DynamicQuantizeLinear before each group of MatMulIntegers:
ONE uint8 scale and zero point from the range of its whole input. The rows of a batch and the
tokens of a prompt run at once share them, so a row's numbers depend on what else the call holds
(a server's batch, a prompt split into blocks: docs/quantized.md). Here each DynamicQuantizeLinear
becomes the same formulas over each row (the last axis): the row's range widened to hold 0, scale =
range / 255, zero point = round(-min / scale) clipped to [0, 255], q = round(x / scale) + zero point
clipped (rounding half to even, as the operator's). A one-row call (a decode step) is quantized
exactly as before at every input but the head's (below).

MatMulInteger takes the activations' zero point as a scalar only (ONNX Runtime 1.32: "input1 zero
point must be a scalar"), so each consumer takes the rows' zero points out after the product:
(q - z_row) (W - w_zp) = q (W - w_zp) - z_row * colsum(W - w_zp), the column sums a MatMulInteger
of a row of ones by the weight (initializer-only: ONNX Runtime folds it to [1, N] when a session is
made). The scales' Mul takes the row scales [..., M, 1] where it took a scalar.

The head's input (a normed state, about zero) is quantized symmetrically instead: scale = max|x| /
127, zero point 128 for every row, so no [M, vocab] correction is computed at a prompt's every
position (bloom-560m's 512-token prefill with every position's logits: peak 2.26 GB with it, 1.71
without, as the per-call graph's 1.73). Symmetric everywhere cost the trained checkpoints up to
1.5% of perplexity (the feed-forward's second input is one-sided after its activation); the zero
point per row keeps them within 0.34% (benchmarks/quantized.md). Weights and the nodes that read
them are unchanged, so the streamed quantizer's stand-ins are replaced by name as before.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPERATOR = "DynamicQuantizeLinear"
CONSTANTS = {"per_row_last_axis": np.array([-1], np.int64), "per_row_one_row": np.array([1], np.int64),
             "per_row_zero": np.array(0.0, np.float32), "per_row_one": np.array(1.0, np.float32),
             "per_row_levels": np.array(255.0, np.float32), "per_row_half_levels": np.array(127.0, np.float32),
             "per_row_low": np.array(-128.0, np.float32), "per_row_offset": np.array(128.0, np.float32),
             "per_row_zero_point": np.array(128, np.uint8), "per_row_no_zero_point": np.array(0, np.uint8)}


def activations_per_row(proto: onnx.ModelProto, symmetric: tuple[str, ...] = ()) -> int:
    """Every DynamicQuantizeLinear of the main graph rewritten per row, in place -> how many.
    symmetric: the nodes (the head's) whose input is quantized about zero, without a zero point."""
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 18)
    graph = proto.graph
    found = [n for n in graph.node if n.op_type == OPERATOR]
    if not found:
        return 0
    if {t.name for t in graph.initializer} & set(CONSTANTS):
        raise ValueError("the graph is already quantized per row")
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    placed: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> the nodes standing in its place
    for node in found:
        quantized, scale, zero = node.output
        readers = [*users.get(quantized, []), *users.get(scale, []), *users.get(zero, [])]
        if any(r.op_type not in ("MatMulInteger", "Mul") for r in readers):
            raise ValueError(f"{OPERATOR} {node.name!r} feeds another op than quantize_dynamic's MatMulInteger and Mul")
        # quantize_dynamic names a MatMul's MatMulInteger after it: <name>_quant
        about_zero = all(r.name.removesuffix("_quant") in symmetric for r in users.get(quantized, []))
        row_scale, row_zero = f"{quantized}_row_scale", f"{quantized}_row_zero"
        rows = _symmetric if about_zero else _asymmetric
        placed[id(node)] = rows(node.input[0], quantized, row_scale, row_zero, opset)
        for user in users.get(scale, []):  # the scales' Mul
            user.input[:] = [row_scale if name == scale else name for name in user.input]
        for user in users.get(quantized, []):
            if about_zero:
                user.input[2] = "per_row_zero_point"
            else:
                placed[id(user)] = [user, *_zero_point_after(user, row_zero)]
    nodes = [n for node in graph.node for n in placed.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in CONSTANTS.items())
    return len(found)


def _row_max(x: str, out: str, opset: int, op: str = "ReduceMax") -> onnx.NodeProto:
    if opset >= 18:
        return helper.make_node(op, [x, "per_row_last_axis"], [out], keepdims=1)
    return helper.make_node(op, [x], [out], axes=[-1], keepdims=1)


def _scale_of(raw: str, scale: str) -> list[onnx.NodeProto]:
    """A row of zeros: any scale quantizes it to its zero point; 1 keeps the divisions finite."""
    return [helper.make_node("Equal", [raw, "per_row_zero"], [f"{scale}_flat"]),
            helper.make_node("Where", [f"{scale}_flat", "per_row_one", raw], [scale])]


def _asymmetric(x: str, quantized: str, scale: str, zero: str, opset: int) -> list[onnx.NodeProto]:
    """x [..., K] float -> quantized [..., K] uint8, scale and zero [..., 1] float (the zero point's
    value, an integer in [0, 255]): DynamicQuantizeLinear's formulas over each row."""
    p = f"{quantized}_row"
    return [
        _row_max(x, f"{p}_max", opset), _row_max(x, f"{p}_min", opset, "ReduceMin"),
        helper.make_node("Max", [f"{p}_max", "per_row_zero"], [f"{p}_high"]),  # the range holds 0
        helper.make_node("Min", [f"{p}_min", "per_row_zero"], [f"{p}_low"]),
        helper.make_node("Sub", [f"{p}_high", f"{p}_low"], [f"{p}_span"]),
        helper.make_node("Div", [f"{p}_span", "per_row_levels"], [f"{p}_raw_scale"]),
        *_scale_of(f"{p}_raw_scale", scale),
        helper.make_node("Div", [f"{p}_low", scale], [f"{p}_low_steps"]),
        helper.make_node("Neg", [f"{p}_low_steps"], [f"{p}_neg_low_steps"]),
        helper.make_node("Round", [f"{p}_neg_low_steps"], [f"{p}_zero_rounded"]),
        helper.make_node("Clip", [f"{p}_zero_rounded", "per_row_zero", "per_row_levels"], [zero]),
        helper.make_node("Div", [x, scale], [f"{p}_steps"]),
        helper.make_node("Round", [f"{p}_steps"], [f"{p}_rounded"]),
        helper.make_node("Add", [f"{p}_rounded", zero], [f"{p}_shifted"]),
        helper.make_node("Clip", [f"{p}_shifted", "per_row_zero", "per_row_levels"], [f"{p}_clipped"]),
        helper.make_node("Cast", [f"{p}_clipped"], [quantized], to=TensorProto.UINT8),
    ]


def _symmetric(x: str, quantized: str, scale: str, zero: str, opset: int) -> list[onnx.NodeProto]:
    """x [..., K] float -> quantized [..., K] uint8 about 128 and scale [..., 1] (max|x| / 127)."""
    p = f"{quantized}_row"
    return [
        helper.make_node("Abs", [x], [f"{p}_abs"]),
        _row_max(f"{p}_abs", f"{p}_largest", opset),
        helper.make_node("Div", [f"{p}_largest", "per_row_half_levels"], [f"{p}_raw_scale"]),
        *_scale_of(f"{p}_raw_scale", scale),
        helper.make_node("Div", [x, scale], [f"{p}_steps"]),
        helper.make_node("Round", [f"{p}_steps"], [f"{p}_rounded"]),
        helper.make_node("Clip", [f"{p}_rounded", "per_row_low", "per_row_half_levels"], [f"{p}_clipped"]),
        helper.make_node("Add", [f"{p}_clipped", "per_row_offset"], [f"{p}_shifted"]),
        helper.make_node("Cast", [f"{p}_shifted"], [quantized], to=TensorProto.UINT8),
    ]


def _zero_point_after(matmul: onnx.NodeProto, row_zero: str) -> list[onnx.NodeProto]:
    """The MatMulInteger without its activations' zero point, and that zero point's share taken
    from its output: out - z_row * colsum(W - w_zp). The column sums: a MatMulInteger of a row of
    ones [1, K] (K read from the weight's shape: the streamed quantizer's stand-ins have one row) by
    the same weight and zero point, folded when a session is made with no copy of the weight (a Cast
    of each weight to int32 instead peaked a bloom-560m session at 6.5 GB, not 1.7)."""
    weight = matmul.input[1]
    weight_zero = matmul.input[3] if len(matmul.input) > 3 else ""
    product, out = f"{matmul.output[0]}_without_zero", matmul.output[0]
    p = f"{matmul.output[0]}_zero_share"
    # a zero point of 0, not an empty input: OpenVINO's CPU plugin refuses an empty optional input
    # ("NullNode ... with dynamic rank"); the same product
    matmul.input[2] = "per_row_no_zero_point"
    matmul.output[0] = product
    ones = helper.make_tensor("value", TensorProto.UINT8, [1], [1])
    return [
        helper.make_node("Shape", [weight], [f"{p}_weight_rows"], end=1),  # [K]
        helper.make_node("Concat", ["per_row_one_row", f"{p}_weight_rows"], [f"{p}_ones_shape"], axis=0),
        helper.make_node("ConstantOfShape", [f"{p}_ones_shape"], [f"{p}_ones"], value=ones),  # [1, K]
        helper.make_node("MatMulInteger", [f"{p}_ones", weight, "per_row_no_zero_point", *([weight_zero] if weight_zero else [])],
                         [f"{p}_colsum"]),  # [1, N]
        helper.make_node("Cast", [row_zero], [f"{p}_row_zero"], to=TensorProto.INT32),
        helper.make_node("Mul", [f"{p}_row_zero", f"{p}_colsum"], [f"{p}_share"]),  # [..., M, N]
        helper.make_node("Sub", [product, f"{p}_share"], [out]),
    ]
