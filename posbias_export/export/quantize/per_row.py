"""int8's activations quantized per row instead of per call, in standard ops.

ONNX Runtime's quantize_dynamic writes DynamicQuantizeLinear before each group of MatMulIntegers:
ONE uint8 scale and zero point from the range of its whole input. The rows of a batch and the
tokens of a prompt run at once share them, so a row's numbers depend on what else the call holds
(a server's batch, a prompt split into blocks: docs/quantized.md). Here each DynamicQuantizeLinear
becomes the same arithmetic over each row (the last axis): the row's range widened to hold 0, scale
= range / 255, zero point = round(-min / scale) clipped to [0, 255], q = round(x / scale) + zero
point clipped (rounding half to even, as the operator's). A one-row call (a decode step) is
quantized exactly as before.

MatMulInteger takes the activations' zero point as a scalar only (ONNX Runtime 1.32: "input1 zero
point must be a scalar"), so each consumer gets the rows' zero points after the product instead:
(q - z_row) (W - w_zp) = q (W - w_zp) - z_row * colsum(W - w_zp). The column sums are computed in
the graph from the weights (an initializer-only branch, folded once when a session is made); the
scales' Mul takes the row scales [..., M, 1] where it took a scalar. Weights and the nodes that
touch them are unchanged, so the streamed quantizer's stand-ins are replaced by name as before.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPERATOR = "DynamicQuantizeLinear"


def activations_per_row(proto: onnx.ModelProto) -> int:
    """Every DynamicQuantizeLinear of the main graph rewritten per row, in place -> how many."""
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 18)
    graph = proto.graph
    found = [n for n in graph.node if n.op_type == OPERATOR]
    if not found:
        return 0
    constants = _constants(graph)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    after: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> nodes to insert right after it
    for node in found:
        quantized, scale, zero = node.output
        row_scale, row_zero = f"{quantized}_row_scale", f"{quantized}_row_zero"
        after.setdefault(id(node), []).extend(_row_quantizer(node.input[0], quantized, row_scale, row_zero, opset))
        users = consumers.get(quantized, []) + consumers.get(scale, []) + consumers.get(zero, [])
        for user in {id(u): u for u in users}.values():  # a MatMulInteger takes two of the outputs
            if user.op_type == "MatMulInteger" and user.input[0] == quantized:
                after.setdefault(id(user), []).extend(_zero_point_after(user, row_zero, constants))
            elif user.op_type == "Mul":
                user.input[:] = [row_scale if name == scale else name for name in user.input]
            elif user.op_type != "MatMulInteger":
                raise ValueError(f"{OPERATOR} {node.name!r} feeds a {user.op_type}: not a graph quantize_dynamic writes")
    nodes = []
    for node in graph.node:
        if node.op_type != OPERATOR:
            nodes.append(node)
        nodes.extend(after.get(id(node), []))
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(constants.values())
    return len(found)


def _constants(graph: onnx.GraphProto) -> dict[str, TensorProto]:
    """The few constants the rewrite shares (added to the graph once)."""
    values = {"per_row_last_axis": np.array([-1], np.int64), "per_row_first_axis": np.array([0], np.int64),
              "per_row_zero": np.array(0.0, np.float32), "per_row_one": np.array(1.0, np.float32),
              "per_row_levels": np.array(255.0, np.float32)}
    taken = {t.name for t in graph.initializer}
    if taken & set(values):
        raise ValueError("the graph is already quantized per row")
    return {name: numpy_helper.from_array(value, name) for name, value in values.items()}


def _reduce(op: str, x: str, out: str, opset: int) -> onnx.NodeProto:
    if opset >= 18:
        return helper.make_node(op, [x, "per_row_last_axis"], [out], keepdims=1)
    return helper.make_node(op, [x], [out], axes=[-1], keepdims=1)


def _row_quantizer(x: str, quantized: str, scale: str, zero: str, opset: int) -> list[onnx.NodeProto]:
    """x [..., K] float -> quantized [..., K] uint8, scale and zero [..., 1] float (the zero point's
    value, an integer in [0, 255]), DynamicQuantizeLinear's formulas over each row."""
    p = f"{quantized}_row"
    span = helper.make_node("Sub", [f"{p}_high", f"{p}_low"], [f"{p}_span"])
    return [
        _reduce("ReduceMax", x, f"{p}_max", opset),
        _reduce("ReduceMin", x, f"{p}_min", opset),
        helper.make_node("Max", [f"{p}_max", "per_row_zero"], [f"{p}_high"]),  # the range holds 0
        helper.make_node("Min", [f"{p}_min", "per_row_zero"], [f"{p}_low"]),
        span,
        helper.make_node("Div", [f"{p}_span", "per_row_levels"], [f"{p}_raw_scale"]),
        # a row of zeros: any scale quantizes it to the zero point; 1 keeps the divisions finite
        helper.make_node("Equal", [f"{p}_raw_scale", "per_row_zero"], [f"{p}_flat"]),
        helper.make_node("Where", [f"{p}_flat", "per_row_one", f"{p}_raw_scale"], [scale]),
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


def _zero_point_after(matmul: onnx.NodeProto, row_zero: str, constants: dict) -> list[onnx.NodeProto]:
    """The MatMulInteger without its activations' zero point, and that zero point's share taken
    from its output: out - z_row * colsum(W - w_zp)."""
    weight = matmul.input[1]
    weight_zero = matmul.input[3] if len(matmul.input) > 3 and matmul.input[3] else None
    product, out = f"{matmul.output[0]}_without_zero", matmul.output[0]
    p = f"{matmul.output[0]}_zero_share"
    matmul.input[2] = ""
    matmul.output[0] = product
    nodes = [helper.make_node("Cast", [weight], [f"{p}_weight"], to=TensorProto.INT32)]
    centred = f"{p}_weight"
    if weight_zero is not None:
        nodes += [helper.make_node("Cast", [weight_zero], [f"{p}_weight_zero"], to=TensorProto.INT32),
                  helper.make_node("Sub", [f"{p}_weight", f"{p}_weight_zero"], [f"{p}_centred"])]
        centred = f"{p}_centred"
    return nodes + [
        helper.make_node("ReduceSum", [centred, "per_row_first_axis"], [f"{p}_colsum"], keepdims=0),  # [N]
        helper.make_node("Cast", [row_zero], [f"{p}_row_zero"], to=TensorProto.INT32),
        helper.make_node("Mul", [f"{p}_row_zero", f"{p}_colsum"], [f"{p}_share"]),  # [..., M, N]
        helper.make_node("Sub", [product, f"{p}_share"], [out]),
    ]
