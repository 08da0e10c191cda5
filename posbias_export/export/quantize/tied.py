"""A tied table stored once in a quantized file: the embedding reads the head's quantized weight.

A tied LM head (BLOOM, MPT, Falcon: logits = h @ E^T) is quantized as its own
copy of the table, because ONNX Runtime's quantizers see two nodes: the head's MatMul on
Transpose(E), folded into an initializer, and the embedding's Gather on E. That is the largest
tensor twice (257M parameters at BLOOM-560m). Here, after quantization, the embedding's node and
tensors are dropped and the token rows are read out of the head's quantized tensors instead,
with standard ops (Gather, bit unpacking, Cast, Sub, Mul), rows only: one token's row at a decode
step. The embedding then holds the head's values exactly (int4, default head: the same values
GatherBlockQuantized held before, as both round blocks of a row the same way; int8 scheme: the
head's 7-bit per-row rounding instead of one scale for the whole table).

The head's tensors are what the kernels expect and are not touched: MatMulNBits' B [N, blocks,
bytes] (two 4-bit values a byte, low nibble first), scales [N, blocks], zero points [N, ceil(
blocks / 2)] at 4 bits (two blocks a byte) or [N, blocks] at 8; MatMulInteger's B [K, N] int8 with
a scale and zero point per column. (GatherBlockQuantized cannot read MatMulNBits' tensors in
place: it wants scales of the data's rank, MatMulNBits refuses any but [N, blocks].)

A head left in float (`--quant-head float`) shares nothing: the table is then quantized for the
embedding alone.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph_names import drop_unused

# the names ONNX Runtime's quantizers (and our streamed ones) give a weight's quantized tensors
NBITS_SUFFIXES = ("_Q4", "_Q8")
INT8_SUFFIX = "_quantized"


def tied_heads(proto: onnx.ModelProto) -> dict[str, str]:
    """{head weight: table} for each Transpose(perm 1, 0) of the table the token embedding's
    Gather reads (`input_ids`): the tied heads, found before the fold makes them initializers."""
    inits = {t.name for t in proto.graph.initializer}
    tables = {n.input[0] for n in proto.graph.node
              if n.op_type == "Gather" and n.input[0] in inits and n.input[1] == "input_ids"}
    tied = {}
    for node in proto.graph.node:
        if node.op_type == "Transpose" and node.input[0] in tables:
            perm = next((tuple(a.ints) for a in node.attribute if a.name == "perm"), (1, 0))
            if perm == (1, 0):
                tied[node.output[0]] = node.input[0]
    return tied


def share_tied_table(proto: onnx.ModelProto, tied: dict[str, str], aliases: bool = False) -> bool:
    """Replace the quantized embedding of a tied table by rows of the quantized head (in place);
    False when there is nothing to share (untied, the head left float, or no quantized
    embedding). aliases: the embedding reads the head's large tensors under names of its own,
    placeholders of the same bytes (see _aliased)."""
    graph = proto.graph
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    dtypes = {t.name: t.data_type for t in graph.initializer}
    for head_weight, table in tied.items():
        head = next((n for n in graph.node if n.op_type in ("MatMulNBits", "MatMulInteger") and len(n.input) > 1
                     and n.input[1] in [head_weight + s for s in (*NBITS_SUFFIXES, INT8_SUFFIX)]), None)
        embedding = _quantized_embedding(graph, table)
        if head is None or embedding is None:
            continue
        ids, out = embedding[0].input[1], embedding[-1].output[0]
        if head.op_type == "MatMulNBits":
            nodes, constants = _rows_of_nbits(head, ids, out, shapes, dtypes)
        else:
            nodes, constants = _rows_of_int8(head, ids, out, shapes)
        if aliases and head.op_type == "MatMulNBits":  # int8's column gathers: measured slower, no lower peak
            _aliased(graph, nodes, set(head.input))
        at = list(graph.node).index(embedding[0])
        for node in embedding:
            graph.node.remove(node)
        for node in reversed(nodes):
            graph.node.insert(at, node)
        graph.initializer.extend(constants)
        drop_unused(graph)
        return True
    return False


def _aliased(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], head_inputs: set[str]) -> None:
    """The embedding's nodes made to read each of the head's placeholder tensors (streamed.py)
    under a second name: a second placeholder of the same bytes, which the writer stores once
    (export/files.py). ONNX Runtime maps each external tensor on its own and unmaps what it
    prepacks: the head's mapping goes once packed, and the embedding's stays, touched only where
    it gathers rows. Read through one name, the pages the packing read stay resident beside the
    packed copy: int4 BLOOM-560m's peak 1.10 -> 1.00 GB after 512 tokens (benchmarks/serving.md).
    Not for int8's MatMulInteger: its embedding gathers columns of the head's [K, N] weight, which
    brought every page back during a prompt (no lower peak) and made a step after 4096 tokens
    slower (73 -> 102 ms)."""
    placeholders = {t.name: t for t in graph.initializer if t.data_location == TensorProto.EXTERNAL}
    made = {}
    for node in nodes:
        for i, name in enumerate(node.input):
            if name in head_inputs and name in placeholders:
                if name not in made:
                    alias = TensorProto()
                    alias.CopyFrom(placeholders[name])
                    alias.name = made[name] = f"{name}_rows"
                    graph.initializer.append(alias)
                node.input[i] = made[name]


def _quantized_embedding(graph: onnx.GraphProto, table: str) -> list[onnx.NodeProto] | None:
    """The nodes that make the embedding of `table` once quantized: GatherBlockQuantized alone
    (int4), or Gather then its DequantizeLinear (int8)."""
    for node in graph.node:
        if node.op_type == "GatherBlockQuantized" and node.input[0] in [table + s for s in NBITS_SUFFIXES]:
            return [node]
        if node.op_type == "Gather" and node.input[0] == table + INT8_SUFFIX:
            dequantize = next((n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] == node.output[0]),
                              None)
            return [node, dequantize] if dequantize is not None else None
    return None


class _Builder:
    """Nodes and constants of the replacement, named after the embedding's output."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes, self.constants, self.count = prefix, [], [], 0

    def const(self, value: np.ndarray) -> str:
        name = f"{self.prefix}_tied_c{len(self.constants)}"
        self.constants.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        self.count += 1
        output = output or f"{self.prefix}_tied_{op_type.lower()}{self.count}"
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=f"{self.prefix}_tied_{self.count}", **attrs))
        return output

    def rows(self, name: str, ids: str) -> str:
        """[B, S, ..., 1]: the rows `ids` of a per-row tensor, a trailing axis to broadcast over a row's values."""
        return self.op("Unsqueeze", [self.op("Gather", [name, ids], axis=0), self.const(np.array([-1]))])

    def nibbles(self, packed: str) -> str:
        """[..., n] uint8 of two 4-bit values each -> [..., 2n] uint8 (low nibble first)."""
        low = self.op("BitwiseAnd", [packed, self.const(np.array(15, np.uint8))])
        high = self.op("BitShift", [packed, self.const(np.array(4, np.uint8))], direction="RIGHT")
        pairs = self.op("Concat", [self.op("Unsqueeze", [low, self.const(np.array([-1]))]),
                                   self.op("Unsqueeze", [high, self.const(np.array([-1]))])], axis=-1)
        shape = self.op("Concat", [self.op("Slice", [self.op("Shape", [packed]), self.const(np.array([0])),
                                                     self.const(np.array([-1]))]), self.const(np.array([-1]))], axis=0)
        return self.op("Reshape", [pairs, shape])


def _attr(node: onnx.NodeProto, name: str) -> int:
    return next(a.i for a in node.attribute if a.name == name)


def _rows_of_nbits(head: onnx.NodeProto, ids: str, out: str, shapes: dict, dtypes: dict):
    """Rows `ids` of MatMulNBits' weight, dequantized: (q - zero point) * scale per block, then
    the blocks' padding past K cut off."""
    k, bits, block = _attr(head, "K"), _attr(head, "bits"), _attr(head, "block_size")
    weight, scales = head.input[1], head.input[2]
    zero_points = head.input[3] if len(head.input) > 3 and head.input[3] else None
    n, blocks = shapes[weight][0], shapes[weight][1]
    if shapes[scales] != (n, blocks):
        raise ValueError(f"MatMulNBits scales {shapes[scales]} are not [N, blocks] ({n}, {blocks}): cannot share")
    dtype = dtypes[scales]
    b = _Builder(out)
    rows = b.op("Gather", [weight, ids], axis=0)  # [B, S, blocks, bytes]
    values = b.nibbles(rows) if bits == 4 else rows  # [B, S, blocks, block]
    quantized = b.op("Cast", [values], to=dtype)
    if zero_points:
        zero = b.op("Gather", [zero_points, ids], axis=0)  # [B, S, ceil(blocks/2)] (4 bits) or [B, S, blocks]
        if bits == 4:
            zero = b.op("Slice", [b.nibbles(zero), b.const(np.array([0])), b.const(np.array([blocks])),
                                  b.const(np.array([-1]))])
        zero = b.op("Unsqueeze", [b.op("Cast", [zero], to=dtype), b.const(np.array([-1]))])
    else:  # symmetric: the midpoint of the unsigned range
        zero = b.const(np.array(2 ** (bits - 1), helper.tensor_dtype_to_np_dtype(dtype)))
    scale = b.rows(scales, ids)
    dequantized = b.op("Mul", [b.op("Sub", [quantized, zero]), scale])  # [B, S, blocks, block]
    flat = b.op("Reshape", [dequantized, b.const(np.array([0, 0, blocks * block]))], None if k % block else out)
    if k % block:
        b.op("Slice", [flat, b.const(np.array([0])), b.const(np.array([k])), b.const(np.array([-1]))], out)
    return b.nodes, b.constants


def _rows_of_int8(head: onnx.NodeProto, ids: str, out: str, shapes: dict):
    """Columns `ids` of MatMulInteger's weight [K, N], dequantized with their own scale and zero
    point (per channel; or the weight's one scale and zero point, --quant-per-tensor), as rows
    [B, S, K]."""
    weight, weight_zero = head.input[1], head.input[3]
    scale = _int8_weight_scale(head)
    b = _Builder(out)

    def per_row(name: str) -> str:  # [B, S, 1] for a per-channel tensor, the scalar itself otherwise
        return b.rows(name, ids) if shapes.get(name) else name

    columns = b.op("Gather", [weight, ids], axis=1)  # [K, B, S]
    rows = b.op("Cast", [b.op("Transpose", [columns], perm=[1, 2, 0])], to=TensorProto.FLOAT)
    zero = b.op("Cast", [per_row(weight_zero)], to=TensorProto.FLOAT)
    b.op("Mul", [b.op("Sub", [rows, zero]), per_row(scale)], out)
    return b.nodes, b.constants


def _int8_weight_scale(head: onnx.NodeProto) -> str:
    """The weight's scale of a MatMulInteger quantize_dynamic wrote: the quantized weight's name
    with `_scale` for `_quantized` (`W_quantized` -> `W_scale`)."""
    return head.input[1][: -len(INT8_SUFFIX)] + "_scale"
