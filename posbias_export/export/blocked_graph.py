"""The body of posbias.BlockedAttention<Family>: an ONNX Loop over query blocks.

nn/blocked.py emits the node (and is its PyTorch twin); this builds the FunctionProto from
the ONNX Script pieces of blocked_script.py:

    BlockPrepare (scale and pad q, transpose k once)
    Loop over query blocks:
        BlockQueries -> BlockKeys (only the keys the block can see) ->
        the block's bias: the family's key-row shortcut, or a slice of the distance table
        (a relative family whose positions are the indices), or posbias.<Family> on the
        block's positions ->
        BlockAttend
    BlockAssemble (scan outputs -> [B, H, Lq, d])

An If skips the Loop when all queries fit one block (a decode step, a short prompt).
"""
from __future__ import annotations

import onnx
import torch
from onnx import TensorProto, helper

from ..biases import AttentionBias
from ..biases.onnx_domain import DOMAIN, VERSION
from ..nn.blocked import folds_key_row, folds_two_sided, function_name, table_budget

_UNBOUNDED = 1 << 30  # "look as far as you like": more keys than any input has, and within int32 (OpenVINO runs int64 index math in int32)
_ELEM_TYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.float64: TensorProto.DOUBLE}


def scalar_node(name, value, elem=TensorProto.INT64):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, elem, [], [value]))


def function_proto(bias: AttentionBias, block: int, dtype: torch.dtype, opset: int,
                   by_distance: bool = False) -> onnx.FunctionProto:
    """posbias.BlockedAttention<Family>(q, k, v, q_pos, k_pos, keep, *bias tensors) -> out.

    Block size, look-back and the family's attributes are baked in (one model, one config);
    learned bias tensors stay inputs, so every layer calls the same function. by_distance
    (a relative family whose positions are the key indices; the name says so, see
    nn/blocked.py): the family's function fills a [H|1, Bq, M] table of every distance once,
    before the Loop, and each block's bias is a slice of it.
    """
    tensors, attrs = bias.function_inputs()
    params = [f"bias_input_{i}" for i in range(len(tensors))]
    reach, ahead = bias.lookback, bias.lookahead
    key_row = bias.key_row_name() if bias.uses_key_row() else None
    by_distance = by_distance and bias.relative and (key_row is None or bias.causal)
    name = function_name(bias, by_distance)
    folded = by_distance and folds_key_row(bias)  # ALiBi: the table holds the mask, the row rides in the MatMul
    # bidirectional ALiBi: no table, the row rides in the MatMul on both sides of the diagonal
    two_sided = by_distance and folds_two_sided(bias, dtype=dtype)
    by_distance = by_distance and not two_sided  # from here: the distance-table path
    # BlockAttend masks keys past each query (k_idx <= q_idx); a bidirectional model compares
    # keys with one index past all of them instead ([1, 1]), so only padding is masked.
    def reach_of(q_idx):  # the index BlockAttend compares keys with
        return q_idx if bias.causal else q_idx + "_reach"

    def reach_nodes(q_idx):
        if bias.causal:
            return []
        reach = helper.make_tensor(reach_of(q_idx), TensorProto.INT64, [1, 1], [_UNBOUNDED])
        return [helper.make_node("Constant", [], [reach_of(q_idx)], value=reach)]

    def call(op_type, inputs, outputs, **attributes):
        return helper.make_node(op_type, inputs, outputs, domain=DOMAIN, **attributes)

    def bias_node(q_pos, k_pos, out):
        if key_row is not None:  # exact under the causal mask: one row per head per block
            return call(key_row, [q_pos, k_pos, *params], [out])
        return call(bias.function_name, [q_pos, k_pos, *params], [out], **attrs)

    block_keys = call("BlockKeys", ["it", "k_t", "v", "k_pos", "keep", "block", "offset", "lookback", "lookahead"],
                      ["k_t_b", "v_b", "k_pos_b", "k_idx", "keep_b"])

    def table_block_nodes(padded: bool):
        """A block's bias is a slice of the (masked) table, plus the padding penalty only in the
        Loop that runs when some key is padding: unpadded inputs see one Add over the scores."""
        slice_out = "bias_slice" if padded else "bias_b"
        return [
            block_keys,
            call("SliceByDistance", ["distance_table", "q_idx", "k_idx", "k"], [slice_out]),
            *([call("AddPaddingPenalty", ["bias_slice", "keep_b"], ["bias_b"])] if padded else []),
            *([call(key_row, ["q_pos_b", "k_pos_b", *params], ["key_row_b"]),
               call("BlockAttendFolded", ["q_b", "k_t_b", "v_b", "key_row_b", "bias_b"], ["attended_b"])] if folded else
              [call("BlockAttendMasked", ["q_b", "k_t_b", "v_b", "bias_b"], ["attended_b"])]),
        ]

    # The table path caps its rows (nn/blocked.py table_block): min(max_block, max(1, budget // (Lk + min(Lk, lookahead))))
    table_rows = [
        scalar_node("row_budget", table_budget(bias)),
        scalar_node("one_row", 1),
        helper.make_node("Shape", ["k"], ["k_len_1d"], start=2, end=3),
        helper.make_node("Squeeze", ["k_len_1d"], ["k_len"]),
        helper.make_node("Min", ["k_len", "lookahead"], ["k_ahead"]),
        helper.make_node("Add", ["k_len", "k_ahead"], ["table_width"]),
        helper.make_node("Div", ["row_budget", "table_width"], ["budget_rows"]),
        helper.make_node("Max", ["budget_rows", "one_row"], ["budget_rows_1"]),
        helper.make_node("Min", ["max_block", "budget_rows_1"], ["loop_block"]),
    ] if by_distance else []
    # Before the Loop: the table [H|1, Bq, M] (causal: with the mask folded in), and whether any
    # key is padding. Its values depend on r - m alone, so the family's own function runs on the
    # table's generating vector (Bq + M - 1 distances per head) and one Gather expands it: a
    # KERPLE or T5 table costs one pass instead of the family's passes over H*Bq*M values (the
    # GPU targets build theirs the same way, export/gpu_graph.py).
    distance_table = [
        *([call("DistanceTablePositions", ["k", "block", "lookahead"], ["table_rows", "table_cols"]),
           call("MaskTable", ["table_rows", "table_cols"], ["distance_table"])] if folded else [
            call("DistanceVectorPositions", ["k", "block", "lookahead"], ["table_row", "vector_cols", "table_idx"]),
            call(bias.function_name, ["table_row", "vector_cols", *params],
                 ["distance_vector_unmasked" if bias.causal else "distance_vector"], **attrs),
            *([call("MaskFutureInTable", ["distance_vector_unmasked", "table_row", "vector_cols"], ["distance_vector"])]
              if bias.causal else []),
            call("ExpandDistanceVector", ["distance_vector", "table_idx"], ["distance_table"])]),
        call("HasPadding", ["keep"], ["has_padding"]),
    ] if by_distance else []

    out_type = _ELEM_TYPES[dtype]

    def loop_body(bias_and_attend):
        return helper.make_graph(
            [
                call("BlockQueries", ["it", "q_pad", "q_pos_pad", "block", "offset"], ["q_b", "q_pos_b", "q_idx"]),
                *bias_and_attend,
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

    def loop(bias_and_attend, out):  # [n, 1, B, H, Bq, d] (or [n, B, ...])
        return helper.make_node("Loop", ["n_blocks", "go"], [out], body=loop_body(bias_and_attend))

    if by_distance:  # an If inside the body would copy each block's bias (ONNX Runtime), so two Loops
        def branch(padded):
            name = "blocks_padded" if padded else "blocks_unpadded"
            return helper.make_graph([loop(table_block_nodes(padded), name)], name, [],
                                     [helper.make_tensor_value_info(name, out_type, None)])
        query_loop = helper.make_node("If", ["has_padding"], ["blocks"], then_branch=branch(True),
                                      else_branch=branch(False))
    elif two_sided:  # the keys twice (up to the block's last row, from its first row on), one row per side
        row = bias.key_row_name()
        query_loop = loop([
            call("BlockKeysTwoSided", ["it", "k_t", "v", "k_pos", "keep", "block", "offset"],
                 ["k_t_b", "v_b", "k_pos_left", "k_pos_right", "k_idx_left", "k_idx_right", "keep_b"]),
            call(row, ["q_pos_b", "k_pos_left", *params], ["row_left"]),
            call(row, ["q_pos_b", "k_pos_right", *params], ["row_right"]),
            call(row, ["q_pos_b", "q_pos_b", *params], ["row_q"]),
            call("BlockAttendTwoSided", ["q_b", "k_t_b", "v_b", "row_left", "row_right", "row_q", "q_idx",
                                         "k_idx_left", "k_idx_right", "keep_b"], ["attended_b"]),
        ], "blocks")
    else:
        query_loop = loop([
            block_keys,
            bias_node("q_pos_b", "k_pos_b", "bias_b"),
            *reach_nodes("q_idx"),
            call("BlockAttend", ["q_b", "k_t_b", "v_b", "bias_b", reach_of("q_idx"), "k_idx", "keep_b"], ["attended_b"]),
        ], "blocks")
    blocks = helper.make_graph(
        [
            *([] if two_sided else [  # the two-sided keys are all keys
                scalar_node("lookback", _UNBOUNDED if reach is None else reach),
                scalar_node("lookahead", _UNBOUNDED if ahead is None else ahead)]),
            scalar_node("go", True, TensorProto.BOOL),
            *table_rows,
            call("BlockPrepare", ["q", "k", "v", "q_pos", "loop_block" if by_distance else "max_block"],
                 ["q_pad", "k_t", "q_pos_pad", "block", "n_blocks", "offset"]),
            *distance_table,
            query_loop,
            call("BlockAssemble", ["blocks", "q", "block"], ["out_blocks"]),
        ],
        "query_blocks", [], [helper.make_tensor_value_info("out_blocks", out_type, None)],
    )
    # One block's worth of queries (decode steps, short prompts): the same math without the
    # Loop, its padding and its copies of the key cache; a decode step costs what the plain form does.
    # A local window reads only the keys within its reach (indices then count from the first of them).
    k, v, k_pos, keep = ("k_w", "v_w", "k_pos_w", "keep_w") if reach is not None else ("k", "v", "k_pos", "keep")
    direct = helper.make_graph(
        [
            *([scalar_node("direct_lookback", reach),
               call("DirectWindowKeys", ["q", "k", "v", "k_pos", "keep", "direct_lookback"], [k, v, k_pos, keep])]
              if reach is not None else []),
            call("DirectPrepare", ["q", k], ["q_scaled", "k_t_all", "q_idx_all", "k_idx_all"]),
            bias_node("q_pos", k_pos, "bias_all"),
            *reach_nodes("q_idx_all"),
            call("BlockAttend", ["q_scaled", "k_t_all", v, "bias_all", reach_of("q_idx_all"), "k_idx_all", keep],
                 ["out_direct"]),
        ],
        "one_block", [], [helper.make_tensor_value_info("out_direct", out_type, None)],
    )
    nodes = [
        scalar_node("max_block", block),
        call("FitsOneBlock", ["q", "max_block"], ["fits"]),
        helper.make_node("If", ["fits"], ["out"], then_branch=direct, else_branch=blocks),
    ]
    return helper.make_function(
        DOMAIN, name, ["q", "k", "v", "q_pos", "k_pos", "keep", *params], ["out"], nodes,
        [helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, VERSION)],
    )
