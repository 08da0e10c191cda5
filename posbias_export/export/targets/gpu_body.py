"""The body of posbias.BlockedAttention<Family> for the GPU-shaped export targets.

Same inputs, outputs and math as blocked_body.py's portable body, shaped for ONNX Runtime's
CUDA provider (measured there: benchmarks/gpu_attention.md):

    queries that fit one block (decode steps, prompts up to `block` rows):
        the family's bias on all (query, key) positions + masks -> ONE fused attention op
    longer inputs: a Loop over few, large query blocks (rows budgeted so a block's bias stays
        under GPU_ROW_BUDGET entries per head: no tensor near ONNX Runtime's 2^31-element
        index limit, bias memory linear in L):
        relative family, positions = indices: the family's function on a per-head vector of
        distances (causal mask folded in, cast to the model dtype there), once; each block,
        over keys aligned to multiples of 8, gathers its own mask from the vector with an int32
        index (gpu_table_script.py) -> the fused attention op
        otherwise (positions from a padding mask): the family's bias per block + masks -> fused op

fused = "onnx": the standard ONNX Attention op (opset 23) with the bias as attn_mask: any
runtime that implements opset 23. fused = "ort": ONNX Runtime's com.microsoft.MultiHeadAttention
with the bias as attention_bias: ONNX Runtime only (CPU and CUDA), its memory-efficient kernel.
Either way the op's scale is 1: queries are scaled by 1/sqrt(d) once, up front.

Before all that, a family with a whole-sequence path (BlockPlan.whole: ALiBi, none) serves an
input with as many queries as keys and no padding key with ONE fused causal call and no bias
tensor at all (_whole): the form ONNX Runtime's flash kernels take. Decode steps (fewer queries
than keys: the ops do not agree on where a causal mask then sits) and padded batches take the
blocks above.
"""
from __future__ import annotations

import onnx
import torch
from onnx import TensorProto, helper

from ...biases import MASK_PENALTY, AttentionBias
from ...nn.plans import FEATURE_WIDTH, BlockPlan
from .block_scaffold import (ELEM_TYPES, UNBOUNDED, blocked_function, budgeted_rows, call, graph, loop,
                             loop_scalar_carrier, padding_loops, scalar_node)

FUSED_OPS = ("onnx", "ort")
ORT_DOMAIN = "com.microsoft"
# The lowest mask value handed to the fused op per dtype: float16 cannot hold MASK_PENALTY (it
# would become -inf, and a row of -inf is NaN in a fused softmax), so it is clipped to float16's
# lowest finite value; in float32 the penalty passes as it is.
_MASK_FLOOR = {torch.float16: -65504.0}


class _GpuBody:
    """The names and node makers one GPU-shaped body shares."""

    def __init__(self, bias: AttentionBias, plan: BlockPlan, dtype: torch.dtype, fused: str):
        self.bias, self.plan, self.dtype, self.fused = bias, plan, dtype, fused
        tensors, self.attrs = bias.function_inputs()
        self.params = [f"bias_input_{i}" for i in range(len(tensors))]
        self.out_type = ELEM_TYPES[dtype]

    def bias_node(self, q_pos, k_pos, out):
        """The family's bias as it is (a floor on a bias alone is not exact: biases/base.py)."""
        return [call(self.bias.function_name, [q_pos, k_pos, *self.params], [out], **self.attrs)]

    def no_causal_mask(self, name):  # one index past every key: only padding is masked
        if self.bias.causal:
            return []
        return [helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1, 1],
                                                                                   [UNBOUNDED]))]

    def in_model_dtype(self, x, out):
        """float32 mask -> the model dtype the fused op wants (clipped to what float16 holds)."""
        if self.dtype == torch.float32:
            return [helper.make_node("Identity", [x], [out])]
        floor = helper.make_tensor(out + "_floor", TensorProto.FLOAT, [], [_MASK_FLOOR[self.dtype]])
        return [helper.make_node("Constant", [], [out + "_floor"], value=floor),
                helper.make_node("Max", [x, out + "_floor"], [out + "_clipped"]),
                helper.make_node("Cast", [out + "_clipped"], [out], to=self.out_type)]

    def floor_node(self, name):  # the mask value in the model dtype (padding keys)
        value = _MASK_FLOOR.get(self.dtype, MASK_PENALTY)
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, self.out_type, [], [value]))

    def attend(self, q, k, v, mask, out):
        """The fused op: q [B, H, Bq, d] (scaled), k/v [B, H, W, d], mask [B|1, H|1, Bq, W] -> [B, H, Bq, d]."""
        mask4 = mask + "_4d"
        nodes = _as_4d(mask, mask4)
        if self.fused == "onnx":
            return nodes + [helper.make_node("Attention", [q, k, v, mask4], [out], scale=1.0)]
        return nodes + _multi_head_attention(q, k, v, mask4, out, self.bias.num_heads)

    def attend_causal(self, q, k, v, out):
        """The fused op with its own mask and no bias tensor (the kernels' fastest form), as many
        queries as keys: q [B, H, L, d'] (scaled), k/v [B, H, L, d'] -> [B, H, L, d']."""
        causal = int(self.bias.causal)
        if self.fused == "onnx":
            return [helper.make_node("Attention", [q, k, v], [out], scale=1.0, is_causal=causal)]
        return _multi_head_attention(q, k, v, "", out, self.bias.num_heads, unidirectional=causal)


def _as_4d(x, out):  # [H|1, Bq, W] or [B|1, H|1, Bq, W] -> [B|1, H|1, Bq, W]
    return [helper.make_node("Shape", [x], [out + "_shape"], start=-3),
            helper.make_node("Constant", [], [out + "_lead"], value=helper.make_tensor(
                out + "_lead", TensorProto.INT64, [1], [-1])),
            helper.make_node("Concat", [out + "_lead", out + "_shape"], [out + "_4d"], axis=0),
            helper.make_node("Reshape", [x, out + "_4d"], [out])]


def _in_bsd(q, k, v, out, fused_node) -> list[onnx.NodeProto]:
    """ONNX Runtime's contrib attention ops take [B, S, H*d] (BSNH flattened) and return the
    same: q, k, v [B, H, L, d] in, fused_node(q_bsd, k_bsd, v_bsd, out_bsd) -> nodes, out [B, H, S, d]."""
    def to_bsd(x):
        return [helper.make_node("Transpose", [x], [x + "_bsnh"], perm=[0, 2, 1, 3]),
                helper.make_node("Reshape", [x + "_bsnh", "bsd_shape"], [x + "_bsd"])]
    return [
        helper.make_node("Constant", [], ["bsd_shape"], value=helper.make_tensor("bsd_shape", TensorProto.INT64,
                                                                                 [3], [0, 0, -1])),
        *to_bsd(q), *to_bsd(k), *to_bsd(v),
        *fused_node(q + "_bsd", k + "_bsd", v + "_bsd", out + "_bsd"),
        helper.make_node("Shape", [q], [out + "_shape"]),
        helper.make_node("Constant", [], [out + "_perm_shape"], value=helper.make_tensor(
            out + "_perm_shape", TensorProto.INT64, [4], [0, 2, 1, 3])),
        helper.make_node("Gather", [out + "_shape", out + "_perm_shape"], [out + "_bsnh_shape"]),
        helper.make_node("Reshape", [out + "_bsd", out + "_bsnh_shape"], [out + "_bsnh"]),
        helper.make_node("Transpose", [out + "_bsnh"], [out], perm=[0, 2, 1, 3]),
    ]


def _multi_head_attention(q, k, v, mask4, out, heads: int, unidirectional: int = 0) -> list[onnx.NodeProto]:
    """com.microsoft.MultiHeadAttention; mask4: its attention_bias, or "" for none."""
    return _in_bsd(q, k, v, out, lambda q3, k3, v3, out3: [helper.make_node(
        "MultiHeadAttention", [q3, k3, v3, "", "", mask4], [out3], domain=ORT_DOMAIN, num_heads=heads, scale=1.0,
        **({"unidirectional": unidirectional} if unidirectional else {}))])


def _local_window_attention(q, k, v, out, heads: int, window: int) -> list[onnx.NodeProto]:
    """com.microsoft.GroupQueryAttention over the whole sequence (no cache) with its local window:
    each query sees itself and the window - 1 keys before it (checked against the window family
    on ONNX Runtime CPU). seqlens_k is L - 1 for every row (no padding), total length L."""
    def gqa(q3, k3, v3, out3):
        return [
            helper.make_node("Shape", [k3], [out + "_k_shape"]),
            helper.make_node("Slice", [out + "_k_shape", "gqa_zero", "gqa_one"], [out + "_batch"]),
            helper.make_node("Slice", [out + "_k_shape", "gqa_one", "gqa_two"], [out + "_len"]),
            helper.make_node("Sub", [out + "_len", "gqa_one"], [out + "_last"]),
            helper.make_node("Expand", [out + "_last", out + "_batch"], [out + "_last_b"]),
            helper.make_node("Cast", [out + "_last_b"], [out + "_seqlens"], to=TensorProto.INT32),  # [B]
            helper.make_node("Squeeze", [out + "_len"], [out + "_len_0d"]),
            helper.make_node("Cast", [out + "_len_0d"], [out + "_total"], to=TensorProto.INT32),  # []
            helper.make_node("GroupQueryAttention", [q3, k3, v3, "", "", out + "_seqlens", out + "_total"],
                             [out3, out + "_present_k", out + "_present_v"], domain=ORT_DOMAIN, num_heads=heads,
                             kv_num_heads=heads, local_window_size=window, scale=1.0),
        ]
    consts = [helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], [value]))
              for name, value in (("gqa_zero", 0), ("gqa_one", 1), ("gqa_two", 2))]
    return consts + _in_bsd(q, k, v, out, gqa)


def _slim_vector(body: _GpuBody) -> list[onnx.NodeProto]:
    """The per-distance vector [H|1, T] in the model dtype (gpu_table_script.py): the family's
    function on T distances, the causal mask folded in, cast there once."""
    bias = body.bias
    family = "vector_unmasked" if bias.causal else "vector_f32"
    return [
        call("SlimVectorPositions", ["k", "block", "lookahead"], ["vector_row", "vector_cols"]),
        call(bias.function_name, ["vector_row", "vector_cols", *body.params], [family], **body.attrs),
        *([call("MaskFutureInTable", [family, "vector_row", "vector_cols"], ["vector_f32"])] if bias.causal else []),
        *body.in_model_dtype("vector_f32", "vector_3d"),
        helper.make_node("Constant", [], ["vector_axis"], value=helper.make_tensor("vector_axis", TensorProto.INT64,
                                                                                   [1], [1])),
        helper.make_node("Squeeze", ["vector_3d", "vector_axis"], ["vector"]),  # [H|1, 1, T] -> [H|1, T]
        call("SlimWindows", ["vector"], ["windows"]),  # [H|1, T - 7, 8]
    ]


def _slim_block(body: _GpuBody, padded: bool) -> list[onnx.NodeProto]:
    """One query block of the slim table path: its aligned keys and its bias gathered from the
    vector (padding keys, and the alignment keys of a bidirectional family, get the mask value)."""
    bias_out = "bias_b" if padded else "mask_b"
    return [
        call("SlimBlock", ["it", "k", "q_pad", "k8", "v8", "keep8", "block", "n_blocks", "offset", "lookback", "lookahead"],
             ["q_b", "k_b", "v_b", "keep_b", "idx_b"]),
        call("GatherBlockBias", ["windows", "idx_b"], [bias_out]),
        *([body.floor_node("padding_floor"), call("ReplacePadding", ["bias_b", "keep_b", "padding_floor"], ["mask_b"])]
          if padded else []),
        *body.attend("q_b", "k_b", "v_b", "mask_b", "attended_b"),
    ]


def _slim_table(body: _GpuBody) -> list[onnx.NodeProto]:
    """The vector, the aligned keys and every block's bounds once, then the two Loops. A causal
    family's alignment keys come after every query (masked by distance), so only real padding
    picks the padded Loop; a bidirectional one sees them, so they count as padding."""
    return [
        *_slim_vector(body),
        call("AlignKeys", ["k", "v", "keep"], ["k8", "v8", "keep8"]),
        call("HasPadding", ["keep" if body.bias.causal else "keep8"], ["has_padding"]),
        padding_loops(lambda padded: _slim_block(body, padded), body.out_type, own_queries=True,
                      out="blocks_last_first"),
        # the blocks ran last first (SlimBlock): back in order, [n, 1, B, H, Bq, d]
        *[helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], [value]))
          for name, value in (("reverse_start", -1), ("reverse_end", -(1 << 63)), ("reverse_axis", 0),
                              ("reverse_step", -1))],
        helper.make_node("Slice", ["blocks_last_first", "reverse_start", "reverse_end", "reverse_axis", "reverse_step"],
                         ["blocks"]),
    ]


def _direct(body: _GpuBody) -> onnx.GraphProto:
    """One block: every key (a window: its reach), aligned to a multiple of 8, no Loop."""
    reach = body.plan.lookback
    k, v, k_pos, keep = ("k_w", "v_w", "k_pos_w", "keep_w") if reach is not None else ("k", "v", "k_pos", "keep")
    q_idx = "q_idx_all" if body.bias.causal else "q_idx_none"
    return graph([
        *([scalar_node("direct_lookback", reach),
           call("DirectWindowKeys", ["q", "k", "v", "k_pos", "keep", "direct_lookback"], [k, v, k_pos, keep])]
          if reach is not None else []),
        call("DirectQueries", ["q", k], ["q_scaled", "q_idx_all", "k_idx_unaligned"]),
        # keys padded to a multiple of 8 (masked: not kept, after every query), as the blocks'
        call("AlignDirectKeys", [k, v, k_pos, keep], ["k_8", "v_8", "k_pos_8", "keep_8", "k_idx_all"]),
        *body.bias_node("q_pos", "k_pos_8", "bias_all"),
        *body.no_causal_mask("q_idx_none"),
        call("MaskedBias", ["bias_all", q_idx, "k_idx_all", "keep_8"], ["mask_all_f32"]),
        *body.in_model_dtype("mask_all_f32", "mask_all"),
        *body.attend("q_scaled", "k_8", "v_8", "mask_all", "out_direct"),
    ], "one_block", "out_direct", body.out_type)


def _whole(body: _GpuBody) -> onnx.GraphProto:
    """Every query in ONE fused causal call without a bias tensor (BlockPlan.whole): `plain` hands
    over q, k, v as they are; `window` too, to GroupQueryAttention's local window; `features` prepends ALiBi's features (SlopeFeatures; float16 models
    get each feature as a high and low float16 part), pads the values as wide, and drops the
    padding from the output."""
    nodes = [call("DirectQueries", ["q", "k"], ["q_whole", "whole_q_idx", "whole_k_idx"])]
    if body.plan.whole == "window":
        return graph(nodes + _local_window_attention("q_whole", "k", "v", "out_whole", body.bias.num_heads,
                                                      body.plan.lookback + 1), "whole", "out_whole", body.out_type)
    if body.plan.whole == "plain":
        return graph(nodes + body.attend_causal("q_whole", "k", "v", "out_whole"), "whole", "out_whole", body.out_type)
    slopes = body.params[0]  # the family declares its slopes the first function tensor (slope_features)
    parts = {side: (f"{side}_a", f"{side}_b") for side in ("q", "k")}
    for side in ("q", "k"):
        nodes.append(call("SlopeParts", [f"{side}_pos", slopes], list(parts[side])))
        if body.dtype == torch.float16:
            nodes.append(call("HalfParts", list(parts[side]), [f"{side}_hi", f"{side}_lo"]))
            parts[side] = (f"{side}_hi", f"{side}_lo")
    return graph(nodes + [
        call("SlopeFeatures", [*parts["q"], *parts["k"]], ["q_feat", "k_feat"]),
        scalar_node("feature_width", FEATURE_WIDTH),
        call("PrependFeatures", ["q_whole", "q_feat", "feature_width"], ["q_wide"]),
        call("PrependFeatures", ["k", "k_feat", "feature_width"], ["k_wide"]),
        call("PadValues", ["v", "feature_width"], ["v_wide"]),
        *body.attend_causal("q_wide", "k_wide", "v_wide", "out_wide"),
        call("DropPadding", ["out_wide", "v"], ["out_whole"]),
    ], "whole", "out_whole", body.out_type)


def _block(body: _GpuBody, mask_nodes) -> list[onnx.NodeProto]:
    """One query block: its keys, its mask (mask_b), the fused op."""
    return [
        call("GpuBlockKeys", ["it", "k", "v", "k_pos", "keep", "block", "offset", "lookback", "lookahead"],
             ["k_b", "v_b", "k_pos_b", "k_idx", "keep_b"]),
        *mask_nodes,
        *body.attend("q_b", "k_b", "v_b", "mask_b", "attended_b"),
    ]


def _blocks(body: _GpuBody) -> onnx.GraphProto:
    if body.plan.uses_table:
        table = _slim_table(body)  # two Loops: an If inside the body would copy each block's mask
    else:
        q_idx = "q_idx" if body.bias.causal else "q_idx_none"
        table = [loop(_block(body, [
            *body.bias_node("q_pos_b", "k_pos_b", "bias_b"),
            *body.no_causal_mask("q_idx_none"),
            call("MaskedBias", ["bias_b", q_idx, "k_idx", "keep_b"], ["mask_b_f32"]),
            *body.in_model_dtype("mask_b_f32", "mask_b"),
        ]), "blocks", body.out_type)]
    lookback = body.plan.lookback
    return graph([
        scalar_node("lookback", UNBOUNDED if lookback is None else lookback),
        scalar_node("go", True, TensorProto.BOOL),
        call("PadQueries", ["q", "k", "q_pos", "loop_block"], ["q_pad", "q_pos_pad", "block", "n_blocks", "offset"]),
        *loop_scalar_carrier(),
        *table,
        call("BlockAssemble", ["blocks", "q", "block"], ["out_blocks"]),
    ], "query_blocks", "out_blocks", body.out_type)


def gpu_function_proto(bias: AttentionBias, plan: BlockPlan, block: int, dtype: torch.dtype, opset: int,
                       fused: str) -> onnx.FunctionProto:
    """posbias.BlockedAttention<Family>(q, k, v, q_pos, k_pos, keep, *bias tensors) -> out, GPU-shaped."""
    if fused not in FUSED_OPS:
        raise ValueError(f"fused must be one of {FUSED_OPS}, got {fused!r}")
    if fused == "onnx" and opset < 23:
        raise ValueError("the ONNX Attention op needs opset 23")
    body = _GpuBody(bias, plan, dtype, fused)
    lookahead = plan.lookahead
    head = [
        scalar_node("max_block", block),
        scalar_node("lookahead", UNBOUNDED if lookahead is None else lookahead),
        # rows budgeted by the keys' width (BlockPlan.rows): a block's bias [H, rows, W] stays
        # under the budget, in the one-block branch too
        *budgeted_rows(plan.row_budget),
    ]
    extra = [helper.make_opsetid(ORT_DOMAIN, 1)] if fused == "ort" else []
    # ONNX Attention (opset 23) has no local window: a window stays on the blocks there
    whole = _whole(body) if plan.whole and (plan.whole != "window" or fused == "ort") else None
    return blocked_function(plan.name, body.params, head, "loop_block", _direct(body), _blocks(body), opset, extra,
                            whole)
