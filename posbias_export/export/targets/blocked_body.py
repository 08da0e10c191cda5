"""The portable body of posbias.BlockedAttention<Family>: an ONNX Loop over query blocks.

nn/blocked.py emits the node (and is its PyTorch twin); both read the layer's BlockPlan
(nn/block_plan.py). This builds the FunctionProto from the ONNX Script pieces of
blocked_script.py, in the frame of block_scaffold.py:

    BlockPrepare (scale and pad q, transpose k once)
    Loop over query blocks:
        BlockQueries -> BlockKeys (only the keys the block can see) ->
        the block's bias by the plan's path: the family's function or key-row shortcut on the
        block's positions; a slice of the distance table; the folded key row; or the two-sided
        fold -> BlockAttend (or its Masked / Folded / TwoSided forms)
    BlockAssemble (scan outputs -> [B, H, Lq, d])

An If skips the Loop when all queries fit one block (a decode step, a short prompt).
"""
from __future__ import annotations

import onnx
import torch
from onnx import TensorProto, helper

from ...biases import AttentionBias
from ...nn.plans import BlockPlan
from .block_scaffold import (ELEM_TYPES, UNBOUNDED, blocked_function, budgeted_rows, call, graph, loop,
                             loop_scalar_carrier, padding_loops, scalar_node)


class _Body:
    """The names and nodes one body's pieces share: the family's tensors and attributes, how a
    block computes its own bias, the causal index BlockAttend compares keys with."""

    def __init__(self, bias: AttentionBias, plan: BlockPlan):
        self.bias, self.plan = bias, plan
        tensors, self.attrs = bias.function_inputs()
        self.params = [f"bias_input_{i}" for i in range(len(tensors))]

    def bias_node(self, q_pos, k_pos, out):
        if self.plan.key_row is not None:  # exact under the causal mask: one row per head per block
            return call(self.plan.key_row, [q_pos, k_pos, *self.params], [out])
        return call(self.bias.function_name, [q_pos, k_pos, *self.params], [out], **self.attrs)

    def reach_of(self, q_idx):
        """The index BlockAttend masks keys past: the query's own (causal); a bidirectional model
        compares keys with one index past all of them instead ([1, 1]), so only padding is masked."""
        return q_idx if self.bias.causal else q_idx + "_reach"

    def reach_nodes(self, q_idx):
        if self.bias.causal:
            return []
        reach = helper.make_tensor(self.reach_of(q_idx), TensorProto.INT64, [1, 1], [UNBOUNDED])
        return [helper.make_node("Constant", [], [self.reach_of(q_idx)], value=reach)]

    def block_keys(self):
        return call("BlockKeys", ["it", "k_t", "v", "k_pos", "keep", "block", "offset", "lookback", "lookahead"],
                    ["k_t_b", "v_b", "k_pos_b", "k_idx", "keep_b"])


def _direct(body: _Body, out_type: int) -> onnx.GraphProto:
    """One block's worth of queries (decode steps, short prompts): the same math without the
    Loop, its padding and its copies of the key cache; a decode step costs what the plain form
    does. A local window reads only the keys within its reach (indices then count from the first of them)."""
    reach = body.plan.lookback
    k, v, k_pos, keep = ("k_w", "v_w", "k_pos_w", "keep_w") if reach is not None else ("k", "v", "k_pos", "keep")
    return graph([
        *([scalar_node("direct_lookback", reach),
           call("DirectWindowKeys", ["q", "k", "v", "k_pos", "keep", "direct_lookback"], [k, v, k_pos, keep])]
          if reach is not None else []),
        call("DirectPrepare", ["q", k], ["q_scaled", "k_t_all", "q_idx_all", "k_idx_all"]),
        body.bias_node("q_pos", k_pos, "bias_all"),
        *body.reach_nodes("q_idx_all"),
        call("BlockAttend", ["q_scaled", "k_t_all", v, "bias_all", body.reach_of("q_idx_all"), "k_idx_all", keep],
             ["out_direct"]),
    ], "one_block", "out_direct", out_type)


def _table(body: _Body) -> list[onnx.NodeProto]:
    """Before the Loop: the table [H|1, Bq, M] (causal: with the mask folded in), and whether
    any key is padding. Its values depend on r - m alone, so the family's own function runs on
    the table's generating vector (Bq + M - 1 distances per head) and one Gather expands it: a
    KERPLE or T5 table costs one pass instead of the family's passes over H*Bq*M values (the
    GPU targets build theirs the same way, gpu_body.py). The folded path's table is the
    causal mask alone."""
    bias = body.bias
    if body.plan.path == "folded":
        nodes = [call("DistanceTablePositions", ["k", "block", "lookahead"], ["table_rows", "table_cols"]),
                 call("MaskTable", ["table_rows", "table_cols"], ["distance_table"])]
    else:
        nodes = [
            *([scalar_node("far", body.plan.far),  # a near-far body's table holds the keys near a block only
               call("NearVectorPositions", ["block", "far"], ["table_row", "vector_cols", "table_idx"])]
              if body.plan.far is not None else
              [call("DistanceVectorPositions", ["k", "block", "lookahead"], ["table_row", "vector_cols", "table_idx"])]),
            call(bias.function_name, ["table_row", "vector_cols", *body.params],
                 ["distance_vector_unmasked" if bias.causal else "distance_vector"], **body.attrs),
            *([call("MaskFutureInTable", ["distance_vector_unmasked", "table_row", "vector_cols"], ["distance_vector"])]
              if bias.causal else []),
            call("ExpandDistanceVector", ["distance_vector", "table_idx"], ["distance_table"])]
    if body.plan.far is not None:  # the far constants ride in two more rows of the transposed keys
        nodes += [call("FarPositions", ["far"], ["far_q_pos", "far_k_pos"]),
                  call(bias.function_name, ["far_q_pos", "far_k_pos", *body.params], ["far_bias"], **body.attrs),
                  call("FarKeys", ["k_t", "far_bias"], ["k_t_ext"])]
    return nodes + [call("HasPadding", ["keep"], ["has_padding"])]


def _near_far_block(padded: bool) -> list[onnx.NodeProto]:
    """A far-constant family (BlockPlan.far): the constants inside the MatMul for the far keys, a
    table slice for the near ones only (NearFarScores), the padding penalty in the padded Loop."""
    scores = "scores_unpadded" if padded else "scores_b"
    return [
        call("NearFarScores", ["it", "q_b", "k_t_ext", "v", "keep", "distance_table", "block", "offset", "far",
                               "lookahead"], [scores, "v_b", "keep_b"]),
        *([call("AddPaddingPenalty", [scores, "keep_b"], ["scores_b"])] if padded else []),
        call("AttendScores", ["scores_b", "v_b"], ["attended_b"]),
    ]


def _table_block(body: _Body, padded: bool) -> list[onnx.NodeProto]:
    """A block's bias is a slice of the (masked) table, plus the padding penalty only in the
    Loop that runs when some key is padding: unpadded inputs see one Add over the scores."""
    if body.plan.far is not None:
        return _near_far_block(padded)
    slice_out = "bias_slice" if padded else "bias_b"
    if body.plan.path == "folded":
        attend = [call(body.plan.key_row, ["q_pos_b", "k_pos_b", *body.params], ["key_row_b"]),
                  call("BlockAttendFolded", ["q_b", "k_t_b", "v_b", "key_row_b", "bias_b"], ["attended_b"])]
    else:
        attend = [call("BlockAttendMasked", ["q_b", "k_t_b", "v_b", "bias_b"], ["attended_b"])]
    return [
        body.block_keys(),
        call("SliceByDistance", ["distance_table", "it", "block", "offset", "lookback", "k_idx", "k"], [slice_out]),
        *([call("AddPaddingPenalty", ["bias_slice", "keep_b"], ["bias_b"])] if padded else []),
        *attend,
    ]


def _two_sided_block(body: _Body) -> list[onnx.NodeProto]:
    """The keys twice (up to the block's last row, from its first row on), one row per side."""
    row, params = body.bias.key_row_name(), body.params
    return [
        call("BlockKeysTwoSided", ["it", "k_t", "v", "k_pos", "keep", "block", "offset"],
             ["k_t_b", "v_b", "k_pos_left", "k_pos_right", "k_idx_left", "k_idx_right", "keep_b"]),
        call(row, ["q_pos_b", "k_pos_left", *params], ["row_left"]),
        call(row, ["q_pos_b", "k_pos_right", *params], ["row_right"]),
        call(row, ["q_pos_b", "q_pos_b", *params], ["row_q"]),
        call("BlockAttendTwoSided", ["q_b", "k_t_b", "v_b", "row_left", "row_right", "row_q", "q_idx",
                                     "k_idx_left", "k_idx_right", "keep_b"], ["attended_b"]),
    ]


def _positions_block(body: _Body) -> list[onnx.NodeProto]:
    """The family's function (or key row) on the block's own positions, then BlockAttend."""
    return [
        body.block_keys(),
        body.bias_node("q_pos_b", "k_pos_b", "bias_b"),
        *body.reach_nodes("q_idx"),
        call("BlockAttend", ["q_b", "k_t_b", "v_b", "bias_b", body.reach_of("q_idx"), "k_idx", "keep_b"], ["attended_b"]),
    ]


def _blocks(body: _Body, out_type: int) -> onnx.GraphProto:
    plan = body.plan
    if plan.uses_table:  # an If inside the body would copy each block's bias (ONNX Runtime), so two Loops
        query_loop = padding_loops(lambda padded: _table_block(body, padded), out_type)
    elif plan.path == "two_sided":
        query_loop = loop(_two_sided_block(body), "blocks", out_type)
    else:
        query_loop = loop(_positions_block(body), "blocks", out_type)
    return graph([
        *([] if plan.path == "two_sided" else [  # the two-sided keys are all keys
            *([] if plan.far is not None else  # a near-far block's keys start at 0
              [scalar_node("lookback", UNBOUNDED if plan.lookback is None else plan.lookback)]),
            scalar_node("lookahead", UNBOUNDED if plan.lookahead is None else plan.lookahead)]),
        scalar_node("go", True, TensorProto.BOOL),
        *(budgeted_rows(plan.row_budget) if plan.row_budget is not None else []),
        call("BlockPrepare", ["q", "k", "v", "q_pos", "loop_block" if plan.row_budget is not None else "max_block"],
             ["q_pad", "k_t", "q_pos_pad", "block", "n_blocks", "offset"]),
        *loop_scalar_carrier(),
        *(_table(body) if plan.uses_table else []),
        query_loop,
        call("BlockAssemble", ["blocks", "q", "block"], ["out_blocks"]),
    ], "query_blocks", "out_blocks", out_type)


def function_proto(bias: AttentionBias, plan: BlockPlan, block: int, dtype: torch.dtype,
                   opset: int) -> onnx.FunctionProto:
    """posbias.BlockedAttention<Family>(q, k, v, q_pos, k_pos, keep, *bias tensors) -> out.

    Block size, look-back and the family's attributes are baked in (one model, one config);
    learned bias tensors stay inputs, so every layer calls the same function.
    """
    body = _Body(bias, plan)
    out_type = ELEM_TYPES[dtype]
    return blocked_function(plan.name, body.params, [scalar_node("max_block", block)], "max_block",
                            _direct(body, out_type), _blocks(body, out_type), opset)
