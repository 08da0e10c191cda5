"""The in-place KV cache (`--kv-cache --target ort`): one posbias.CachedAttention<Family> function
per family, whose body hands the step to ONNX Runtime's com.microsoft.GroupQueryAttention with
the family's bias for the step's rows as its `attention_bias`.

    CachedAttention<Family>(q [B, H, S, d], k, v [B, H, S, d] (the S new rows), past_key,
                            past_value [B, H, P|capacity, d], mask [B, T], *bias tensors)
        -> out [B, H, S, d], present_key, present_value [B, H, T|capacity, d]

Why GroupQueryAttention: bound to ONE [B, H, capacity, d] buffer as both past and present (what
onnxruntime-genai's `past_present_share_buffer` does), its CPU kernel sees the shared pointer
and writes only the S new rows; unbound, present is past + new, as the Concat file's. Measured
exact (<= 2.7e-7 against numpy, ALiBi) on ORT 1.22-1.32 CPU (docs/serving.md).

Every row's new keys are written at slots T-S..T-1 (seqlens_k = T - 1 for every row, T the
mask's length), as the Concat file appends them: left padding and holes in the mask (right-
padded batches that go on decoding) are slots masked by the bias, not skipped. The bias is the
family's, from positions cumsum(mask) - 1 (BLOOM's convention, as every file of ours), unfloored
(a floor on a bias alone is not exact: biases/base.py), plus the lowest float32 on padded keys;
GroupQueryAttention adds its own causal mask by slot, which is
the queries-are-the-last-S convention. [B, H|1, S, T] is small for a decode step; a long prompt
is run through the buffer in blocks of rows by the runner (memory linear in the prompt).
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ...biases import FLOAT32_LOWEST, AttentionBias
from ...biases.onnx_domain import DOMAIN, VERSION
from .block_scaffold import call

MS_DOMAIN = "com.microsoft"
INPUTS = ["q", "k", "v", "past_key", "past_value", "mask"]


def function_name(bias: AttentionBias, from_mask: bool = True) -> str:
    """One per family and position convention (a model's key/value heads are baked in: one
    model, one config)."""
    return f"CachedAttention{bias.function_name}{'' if from_mask else 'Indices'}"


def _const(name: str, value, elem=TensorProto.INT64, dims=()) -> onnx.NodeProto:
    values = value if isinstance(value, list) else [value]
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, elem, list(dims), values))


def _positions(from_mask: bool) -> list[onnx.NodeProto]:
    """k_pos [B, T] = max(cumsum(mask) - 1, 0), or the slots 0..T-1 [T] (models that count key
    indices, MPT); q_pos its last S columns; T, S; keep [B, 1, 1, T]."""
    if from_mask:
        counted = [helper.make_node("CumSum", ["mask64", "axis1"], ["counted"]),  # [B, T]
                   helper.make_node("Sub", ["counted", "one"], ["counted0"]),
                   helper.make_node("Max", ["counted0", "zero"], ["k_pos"])]  # [B, T]
    else:
        counted = [helper.make_node("Shape", ["mask"], ["t_only"], start=1, end=2),
                   helper.make_node("Squeeze", ["t_only"], ["t_end"]),
                   helper.make_node("Range", ["zero", "t_end", "one"], ["k_pos"])]  # [T]
    return [
        _const("one", 1), _const("zero", 0), _const("axis1", 1), _const("axes12", [1, 2], dims=[2]),
        _const("minus1", [-1], dims=[1]), _const("max_index", [2**62], dims=[1]),
        helper.make_node("Cast", ["mask"], ["mask64"], to=TensorProto.INT64),
        *counted,
        helper.make_node("Shape", ["q"], ["s_shape"], start=2, end=3),  # [S]
        helper.make_node("Neg", ["s_shape"], ["minus_s"]),
        helper.make_node("Slice", ["k_pos", "minus_s", "max_index", "minus1"], ["q_pos"]),  # [B, S] or [S]
        helper.make_node("Shape", ["mask"], ["t_shape"], start=1, end=2),  # [T]
        helper.make_node("Cast", ["mask64"], ["keep_flat"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["keep_flat", "axes12"], ["keep"]),  # [B, 1, 1, T]
    ]


def _heads_last(name: str, out: str) -> list[onnx.NodeProto]:
    """[B, H, S, d] -> [B, S, H * d], GroupQueryAttention's layout."""
    return [helper.make_node("Transpose", [name], [f"{name}_bshd"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [f"{name}_bshd", "bs_hd"], [out])]


FLOAT16_LOWEST = -65504.0  # float16's lowest finite value (float32 holds it exactly)


def function_proto(bias: AttentionBias, opset: int, kv_heads: int | None = None,
                   from_mask: bool = True, float16: bool = False) -> onnx.FunctionProto:
    """posbias.CachedAttention<Family> for this bias (its attributes baked in, its tensors
    inputs): q has the bias's heads, the cache `kv_heads` (fewer for multi-query and grouped
    layouts; GroupQueryAttention repeats them), both baked into the node's attributes.
    from_mask: positions cumsum(mask) - 1 (ours, BLOOM, Falcon), else the key indices (MPT).
    float16: a padded key's bias is float16's lowest (float32's would cast to -inf)."""
    tensors, attrs = bias.function_inputs()
    params = [f"bias_input_{i}" for i in range(len(tensors))]
    heads = bias.num_heads
    nodes = [
        *_positions(from_mask),
        call(bias.function_name, ["q_pos", "k_pos", *params], ["family_bias"], **attrs),  # [B, H|1, S, T]
        _const("lowest", FLOAT16_LOWEST if float16 else FLOAT32_LOWEST, TensorProto.FLOAT),
        helper.make_node("Where", ["keep", "family_bias", "lowest"], ["masked_bias"]),  # padded keys: lowest
        helper.make_node("CastLike", ["masked_bias", "q"], ["attention_bias"]),
        _const("bs_hd", [0, 0, -1], dims=[3]),
        *_heads_last("q", "q3"), *_heads_last("k", "k3"), *_heads_last("v", "v3"),
        helper.make_node("Shape", ["q"], ["b_shape"], start=0, end=1),  # [B]
        helper.make_node("Sub", ["t_shape", "one"], ["last_slot"]),  # [1]: every row writes at T-S..T-1
        helper.make_node("Expand", ["last_slot", "b_shape"], ["seqlens64"]),
        helper.make_node("Cast", ["seqlens64"], ["seqlens_k"], to=TensorProto.INT32),  # [B]
        helper.make_node("Squeeze", ["t_shape"], ["t_scalar"]),
        helper.make_node("Cast", ["t_scalar"], ["total_length"], to=TensorProto.INT32),  # scalar
        helper.make_node("GroupQueryAttention",
                         ["q3", "k3", "v3", "past_key", "past_value", "seqlens_k", "total_length", "", "", "",
                          "attention_bias"],
                         ["out3", "present_key", "present_value"], domain=MS_DOMAIN, num_heads=heads,
                         kv_num_heads=kv_heads or heads),
        _const("bshd", [0, 0, heads, -1], dims=[4]),
        helper.make_node("Reshape", ["out3", "bshd"], ["out_bshd"]),
        helper.make_node("Transpose", ["out_bshd"], ["out"], perm=[0, 2, 1, 3]),  # [B, H, S, d]
    ]
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, VERSION), helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_function(DOMAIN, function_name(bias, from_mask), [*INPUTS, *params],
                                ["out", "present_key", "present_value"], nodes, imports)
