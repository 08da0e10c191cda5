"""The body of posbias.BlockedAttention<Family> for the GPU-shaped export targets.

Same inputs, outputs and math as blocked_graph.py's portable body, shaped for ONNX Runtime's
CUDA provider (measured there: benchmarks/gpu_attention.md):

    queries that fit one block (decode steps, prompts up to `block` rows):
        the family's bias on all (query, key) positions + masks -> ONE fused attention op
    longer inputs: a Loop over few, large query blocks (rows budgeted so a block's bias stays
        under GPU_ROW_BUDGET entries per head: no tensor near ONNX Runtime's 2^31-element
        index limit, bias memory linear in L):
        relative family, positions = indices: the family's function on a per-head vector of
        distances (causal mask folded in, cast to the model dtype there), expanded to the
        distance table by one Gather; a block's mask is one Slice of it -> the fused attention op
        otherwise (positions from a padding mask): the family's bias per block + masks -> fused op

fused = "onnx": the standard ONNX Attention op (opset 23) with the bias as attn_mask: any
runtime that implements opset 23. fused = "ort": ONNX Runtime's com.microsoft.MultiHeadAttention
with the bias as attention_bias: ONNX Runtime only (CPU and CUDA), its memory-efficient kernel.
Either way the op's scale is 1: queries are scaled by 1/sqrt(d) once, up front.
"""
from __future__ import annotations

import onnx
import torch
from onnx import TensorProto, helper

from ..biases import MASK_PENALTY, AttentionBias
from ..biases.onnx_domain import DOMAIN, VERSION
from ..nn.blocked import GPU_ROW_BUDGET, function_name
from .blocked_graph import _ELEM_TYPES, _UNBOUNDED, scalar_node

FUSED_OPS = ("onnx", "ort")
ORT_DOMAIN = "com.microsoft"
# The lowest mask value handed to the fused op per dtype: float16 cannot hold MASK_PENALTY (it
# would become -inf, and a row of -inf is NaN in a fused softmax), so it is clipped to float16's
# lowest finite value; in float32 the penalty passes as it is.
_MASK_FLOOR = {torch.float16: -65504.0}


def gpu_function_proto(bias: AttentionBias, block: int, dtype: torch.dtype, opset: int, by_distance: bool,
                       fused: str) -> onnx.FunctionProto:
    """posbias.BlockedAttention<Family>(q, k, v, q_pos, k_pos, keep, *bias tensors) -> out, GPU-shaped.

    by_distance: the layer's positions are the key indices (nn/blocked.py slices_by_distance with
    the key-row shortcut off): a relative family then slices a distance table.
    """
    if fused not in FUSED_OPS:
        raise ValueError(f"fused must be one of {FUSED_OPS}, got {fused!r}")
    if fused == "onnx" and opset < 23:
        raise ValueError("the ONNX Attention op needs opset 23")
    tensors, attrs = bias.function_inputs()
    params = [f"bias_input_{i}" for i in range(len(tensors))]
    reach, ahead = bias.lookback, bias.lookahead
    by_distance = by_distance and bias.relative
    out_type = _ELEM_TYPES[dtype]
    heads = bias.num_heads

    def call(op_type, inputs, outputs, **attributes):
        return helper.make_node(op_type, inputs, outputs, domain=DOMAIN, **attributes)

    def no_causal_mask(name):  # one index past every key: only padding is masked
        return [helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1, 1],
                                                                                   [_UNBOUNDED]))]

    def in_model_dtype(x, out):
        """float32 mask -> the model dtype the fused op wants (clipped to what float16 holds)."""
        if dtype == torch.float32:
            return [helper.make_node("Identity", [x], [out])]
        floor = helper.make_tensor(out + "_floor", TensorProto.FLOAT, [], [_MASK_FLOOR[dtype]])
        return [helper.make_node("Constant", [], [out + "_floor"], value=floor),
                helper.make_node("Max", [x, out + "_floor"], [out + "_clipped"]),
                helper.make_node("Cast", [out + "_clipped"], [out], to=out_type)]

    def as_4d(x, out):  # [H|1, Bq, W] or [B|1, H|1, Bq, W] -> [B|1, H|1, Bq, W]
        return [helper.make_node("Shape", [x], [out + "_shape"], start=-3),
                helper.make_node("Constant", [], [out + "_lead"], value=helper.make_tensor(
                    out + "_lead", TensorProto.INT64, [1], [-1])),
                helper.make_node("Concat", [out + "_lead", out + "_shape"], [out + "_4d"], axis=0),
                helper.make_node("Reshape", [x, out + "_4d"], [out])]

    def attend(q, k, v, mask, out):
        """The fused op: q [B, H, Bq, d] (scaled), k/v [B, H, W, d], mask [B|1, H|1, Bq, W] -> [B, H, Bq, d]."""
        mask4 = mask + "_4d"
        nodes = as_4d(mask, mask4)
        if fused == "onnx":
            return nodes + [helper.make_node("Attention", [q, k, v, mask4], [out], scale=1.0)]
        # MultiHeadAttention takes [B, S, H*d] (BSNH flattened) and returns the same
        def to_bsd(x):
            return [helper.make_node("Transpose", [x], [x + "_bsnh"], perm=[0, 2, 1, 3]),
                    helper.make_node("Reshape", [x + "_bsnh", "bsd_shape"], [x + "_bsd"])]
        return nodes + [
            helper.make_node("Constant", [], ["bsd_shape"], value=helper.make_tensor("bsd_shape", TensorProto.INT64,
                                                                                     [3], [0, 0, -1])),
            *to_bsd(q), *to_bsd(k), *to_bsd(v),
            helper.make_node("MultiHeadAttention", [q + "_bsd", k + "_bsd", v + "_bsd", "", "", mask4],
                             [out + "_bsd"], domain=ORT_DOMAIN, num_heads=heads, scale=1.0),
            helper.make_node("Shape", [q], [out + "_shape"]),
            helper.make_node("Constant", [], [out + "_perm_shape"], value=helper.make_tensor(
                out + "_perm_shape", TensorProto.INT64, [4], [0, 2, 1, 3])),
            helper.make_node("Gather", [out + "_shape", out + "_perm_shape"], [out + "_bsnh_shape"]),
            helper.make_node("Reshape", [out + "_bsd", out + "_bsnh_shape"], [out + "_bsnh"]),
            helper.make_node("Transpose", [out + "_bsnh"], [out], perm=[0, 2, 1, 3]),
        ]

    def bias_node(q_pos, k_pos, out):
        return call(bias.function_name, [q_pos, k_pos, *params], [out], **attrs)

    def floor_node(name):  # the mask value in the model dtype (padding keys)
        value = _MASK_FLOOR.get(dtype, MASK_PENALTY)
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, out_type, [], [value]))

    def typed_table(rows, out):
        """The masked distance table [H|1, rows, M] in the model dtype: the family's function on
        the table's generating vector (T values per head), masked and cast there, then ONE Gather."""
        return [
            call("DistanceVectorPositions", ["k", rows, "lookahead"], [out + "_row", out + "_cols", out + "_idx"]),
            call(bias.function_name, [out + "_row", out + "_cols", *params],
                 [out + "_vec_unmasked" if bias.causal else out + "_vec"], **attrs),
            *([call("MaskFutureInTable", [out + "_vec_unmasked", out + "_row", out + "_cols"], [out + "_vec"])]
              if bias.causal else []),
            *in_model_dtype(out + "_vec", out + "_vec_typed"),
            call("ExpandDistanceVector", [out + "_vec_typed", out + "_idx"], [out]),
        ]

    # --- one block: every key (a window: its reach), no Loop --------------------------------
    k, v, k_pos, keep = ("k_w", "v_w", "k_pos_w", "keep_w") if reach is not None else ("k", "v", "k_pos", "keep")
    q_idx_direct = "q_idx_all" if bias.causal else "q_idx_none"
    direct = helper.make_graph(
        [
            *([scalar_node("direct_lookback", reach),
               call("DirectWindowKeys", ["q", "k", "v", "k_pos", "keep", "direct_lookback"], [k, v, k_pos, keep])]
              if reach is not None else []),
            call("GpuDirectPrepare", ["q", k], ["q_scaled", "q_idx_all", "k_idx_all"]),
            bias_node("q_pos", k_pos, "bias_all"),
            *([] if bias.causal else no_causal_mask("q_idx_none")),
            call("MaskedBias", ["bias_all", q_idx_direct, "k_idx_all", keep], ["mask_all_f32"]),
            *in_model_dtype("mask_all_f32", "mask_all"),
            *attend("q_scaled", k, v, "mask_all", "out_direct"),
        ],
        "one_block", [], [helper.make_tensor_value_info("out_direct", out_type, None)],
    )

    # --- a Loop over query blocks ------------------------------------------------------------
    def loop_body(mask_nodes):
        return helper.make_graph(
            [
                call("BlockQueries", ["it", "q_pad", "q_pos_pad", "block", "offset"], ["q_b", "q_pos_b", "q_idx"]),
                call("GpuBlockKeys", ["it", "k", "v", "k_pos", "keep", "block", "offset", "lookback", "lookahead"],
                     ["k_b", "v_b", "k_pos_b", "k_idx", "keep_b"]),
                *mask_nodes,
                *attend("q_b", "k_b", "v_b", "mask_b", "attended_b"),
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

    def loop(mask_nodes, out):  # [n, 1, B, H, Bq, d] (or [n, B, ...])
        return helper.make_node("Loop", ["n_blocks", "go"], [out], body=loop_body(mask_nodes))

    if by_distance:
        # Per Loop: unpadded inputs slice the typed table; padded ones also put the mask value on
        # padding keys (two Loops: an If inside the body would copy each block's mask).
        def branch(padded):
            name = "blocks_padded" if padded else "blocks_unpadded"
            mask_nodes = [call("SliceByDistance", ["distance_table", "q_idx", "k_idx", "k"],
                               ["bias_slice" if padded else "mask_b"])]
            if padded:
                mask_nodes += [floor_node("padding_floor"),
                               call("ReplacePadding", ["bias_slice", "keep_b", "padding_floor"], ["mask_b"])]
            return helper.make_graph([loop(mask_nodes, name)], name, [],
                                     [helper.make_tensor_value_info(name, out_type, None)])
        table = [
            *typed_table("block", "distance_table"),
            call("HasPadding", ["keep"], ["has_padding"]),
            helper.make_node("If", ["has_padding"], ["blocks"], then_branch=branch(True), else_branch=branch(False)),
        ]
    else:
        q_idx_loop = "q_idx" if bias.causal else "q_idx_none"
        table = [loop([
            bias_node("q_pos_b", "k_pos_b", "bias_b"),
            *([] if bias.causal else no_causal_mask("q_idx_none")),
            call("MaskedBias", ["bias_b", q_idx_loop, "k_idx", "keep_b"], ["mask_b_f32"]),
            *in_model_dtype("mask_b_f32", "mask_b"),
        ], "blocks")]
    blocks = helper.make_graph(
        [
            scalar_node("lookback", _UNBOUNDED if reach is None else reach),
            scalar_node("go", True, TensorProto.BOOL),
            call("GpuBlockPrepare", ["q", "k", "q_pos", "loop_block"], ["q_pad", "q_pos_pad", "block", "n_blocks", "offset"]),
            *table,
            call("BlockAssemble", ["blocks", "q", "block"], ["out_blocks"]),
        ],
        "query_blocks", [], [helper.make_tensor_value_info("out_blocks", out_type, None)],
    )
    nodes = [
        scalar_node("max_block", block),
        scalar_node("lookahead", _UNBOUNDED if ahead is None else ahead),
        # rows budgeted by the keys' width (nn/blocked.py table_block with GPU_ROW_BUDGET): a
        # block's bias [H, rows, W] stays under the budget, in the one-block branch too
        scalar_node("row_budget", GPU_ROW_BUDGET),
        scalar_node("one_row", 1),
        helper.make_node("Shape", ["k"], ["k_len_1d"], start=2, end=3),
        helper.make_node("Squeeze", ["k_len_1d"], ["k_len"]),
        helper.make_node("Min", ["k_len", "lookahead"], ["k_ahead"]),
        helper.make_node("Add", ["k_len", "k_ahead"], ["table_width"]),
        helper.make_node("Div", ["row_budget", "table_width"], ["budget_rows"]),
        helper.make_node("Max", ["budget_rows", "one_row"], ["budget_rows_1"]),
        helper.make_node("Min", ["max_block", "budget_rows_1"], ["loop_block"]),
        call("FitsOneBlock", ["q", "loop_block"], ["fits"]),
        helper.make_node("If", ["fits"], ["out"], then_branch=direct, else_branch=blocks),
    ]
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, VERSION)]
    if fused == "ort":
        imports.append(helper.make_opsetid(ORT_DOMAIN, 1))
    return helper.make_function(DOMAIN, function_name(bias, by_distance), ["q", "k", "v", "q_pos", "k_pos", "keep", *params],
                                ["out"], nodes, imports)
