"""What the portable (blocked_body.py) and GPU-shaped (gpu_body.py) bodies of
posbias.BlockedAttention<Family> share: the Loop over query blocks and its body's frame, the
two Loops chosen by whether any key is padding, the rows budgeted by the keys' width, and the
function around an If that skips the Loop when the queries fit one block.

    max_block (, budgeted rows) -> FitsOneBlock -> If(one block: direct branch,
                                                      else: prepare -> Loop over blocks -> BlockAssemble)
"""
from __future__ import annotations

import onnx
import torch
from onnx import TensorProto, helper

from ...biases.onnx_domain import DOMAIN, VERSION

UNBOUNDED = 1 << 30  # "look as far as you like": more keys than any input has, and within int32 (OpenVINO runs int64 index math in int32)
ELEM_TYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.float64: TensorProto.DOUBLE}


def scalar_node(name, value, elem=TensorProto.INT64):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, elem, [], [value]))


def call(op_type, inputs, outputs, **attributes):
    """A node calling a posbias function."""
    return helper.make_node(op_type, inputs, outputs, domain=DOMAIN, **attributes)


def budgeted_rows(budget: int) -> list[onnx.NodeProto]:
    """loop_block = min(max_block, max(1, budget // (Lk + min(Lk, lookahead)))): the rows that
    keep a block's table (or bias) under `budget` entries per head (BlockPlan.rows)."""
    return [
        scalar_node("row_budget", budget),
        scalar_node("one_row", 1),
        helper.make_node("Shape", ["k"], ["k_len_1d"], start=2, end=3),
        helper.make_node("Squeeze", ["k_len_1d"], ["k_len"]),
        helper.make_node("Min", ["k_len", "lookahead"], ["k_ahead"]),
        helper.make_node("Add", ["k_len", "k_ahead"], ["table_width"]),
        helper.make_node("Div", ["row_budget", "table_width"], ["budget_rows"]),
        helper.make_node("Max", ["budget_rows", "one_row"], ["budget_rows_1"]),
        helper.make_node("Min", ["max_block", "budget_rows_1"], ["loop_block"]),
    ]


# The per-call scalars every Loop body reads on the host (Slice bounds, Range limits). ONNX Runtime
# CUDA computes a body's index arithmetic on the GPU when it starts from an enclosing graph's value
# and copies the result back, which asynchronous launches can read stale (wrong blocks, max error
# 1-5: benchmarks/gpu_cure.md); arithmetic that combines the iteration number with values of the
# body's own Shape nodes it computes on the host. So the enclosing graph hands the scalars over as
# the dims of an empty tensor, [0, Bq, offset, n], and the body reads them back with Shape
# (runtimes/common/host_reads.py replays the placement; benchmarks/gpu_cure_loops.md: no copy back).
LOOP_SCALARS = ("block", "offset", "n_blocks")


def loop_scalar_carrier() -> list[onnx.NodeProto]:
    """In front of the Loops: loop_scalars, an empty uint8 tensor whose dims are [0, *LOOP_SCALARS]."""
    one_d = helper.make_tensor("carrier_1d", TensorProto.INT64, [1], [1])
    return [
        helper.make_node("Constant", [], ["carrier_1d"], value=one_d),
        helper.make_node("Constant", [], ["carrier_zero"], value=helper.make_tensor("carrier_zero", TensorProto.INT64,
                                                                                   [1], [0])),
        *[helper.make_node("Reshape", [name, "carrier_1d"], [f"{name}_dim"]) for name in LOOP_SCALARS],
        helper.make_node("Concat", ["carrier_zero", *[f"{name}_dim" for name in LOOP_SCALARS]], ["carrier_dims"], axis=0),
        helper.make_node("ConstantOfShape", ["carrier_dims"], ["loop_scalars"],
                         value=helper.make_tensor("carrier_fill", TensorProto.UINT8, [1], [0])),
    ]


def _local_scalars() -> list[onnx.NodeProto]:
    """The body's own copies of LOOP_SCALARS (<name>_here, scalars), read from loop_scalars' shape."""
    nodes = [helper.make_node("Shape", ["loop_scalars"], ["loop_dims"])]
    for k, name in enumerate(LOOP_SCALARS, start=1):
        nodes += [scalar_node(f"{name}_at", k), helper.make_node("Gather", ["loop_dims", f"{name}_at"], [f"{name}_here"])]
    return nodes


def _read_local(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` reading each of LOOP_SCALARS from the body's own copy."""
    for node in nodes:
        for k, name in enumerate(node.input):
            if name in LOOP_SCALARS:
                node.input[k] = f"{name}_here"
    return nodes


def loop_body(block_nodes: list[onnx.NodeProto], out_type: int, own_queries: bool = False) -> onnx.GraphProto:
    """One query block: BlockQueries (unless the block nodes slice their own: own_queries), then
    `block_nodes` (keys, bias, attention -> attended_b), every per-call scalar read from the body's
    own copy (LOOP_SCALARS)."""
    queries = [] if own_queries else [
        call("BlockQueries", ["it", "q_pad", "q_pos_pad", "block", "offset"], ["q_b", "q_pos_b", "q_idx"])]
    return helper.make_graph(
        [
            *_local_scalars(),
            *_read_local([*queries, *block_nodes]),
            # a leading 1-axis: see BlockAssemble for why
            helper.make_node("Constant", [], ["axis0"], value=helper.make_tensor("axis0", TensorProto.INT64, [1], [0])),
            helper.make_node("Unsqueeze", ["attended_b", "axis0"], ["out_b"]),  # [1, B, H, Bq, d]
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "query_block",
        [helper.make_tensor_value_info("it", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("out_b", out_type, None)],
    )


def loop(block_nodes: list[onnx.NodeProto], out: str, out_type: int, own_queries: bool = False) -> onnx.NodeProto:
    """The Loop over n_blocks query blocks; scan output `out` [n, 1, B, H, Bq, d] (or [n, B, ...])."""
    return helper.make_node("Loop", ["n_blocks", "go"], [out], body=loop_body(block_nodes, out_type, own_queries))


def padding_loops(block_nodes, out_type: int, own_queries: bool = False, out: str = "blocks") -> onnx.NodeProto:
    """Two Loops, chosen once per call by has_padding: block_nodes(padded) builds each body (an
    If inside the body would copy each block's bias in ONNX Runtime). Output: `out`."""
    def branch(padded: bool) -> onnx.GraphProto:
        name = "blocks_padded" if padded else "blocks_unpadded"
        return helper.make_graph([loop(block_nodes(padded), name, out_type, own_queries)], name, [],
                                 [helper.make_tensor_value_info(name, out_type, None)])
    return helper.make_node("If", ["has_padding"], [out], then_branch=branch(True), else_branch=branch(False))


def graph(nodes, name: str, out: str, out_type: int) -> onnx.GraphProto:
    """An If branch: no inputs, one output."""
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, out_type, None)])


def blocked_function(name: str, params: list[str], head: list[onnx.NodeProto], fits_rows: str,
                     direct: onnx.GraphProto, blocks: onnx.GraphProto, opset: int,
                     extra_imports=(), whole: onnx.GraphProto | None = None) -> onnx.FunctionProto:
    """posbias.<name>(q, k, v, q_pos, k_pos, keep, *params) -> out: `head` nodes, then an If
    on FitsOneBlock(q, fits_rows) between the `direct` branch and the `blocks` one; with a
    `whole` branch, an If on WholeSequence(q, k, keep) first (GPU-shaped bodies)."""
    parts = [
        call("FitsOneBlock", ["q", fits_rows], ["fits"]),
        helper.make_node("If", ["fits"], ["out_parts" if whole else "out"], then_branch=direct, else_branch=blocks),
    ]
    if whole is not None:
        out_type = whole.output[0].type.tensor_type.elem_type
        parts = [call("WholeSequence", ["q", "k", "keep"], ["whole_sequence"]),
                 helper.make_node("If", ["whole_sequence"], ["out"], then_branch=whole,
                                  else_branch=graph(parts, "parts", "out_parts", out_type))]
    nodes = [*head, *parts]
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, VERSION), *extra_imports]
    return helper.make_function(DOMAIN, name, ["q", "k", "v", "q_pos", "k_pos", "keep", *params], ["out"], nodes, imports)
