"""--kv-dtype float16: an in-place file (--kv-cache --target ort) of float32 weights whose KV
cache is float16, half of float32's bytes, so a long context's cache reads half the bytes a step.

GroupQueryAttention's CPU kernel runs float16 with our additive bias (the --dtype float16 files
use it). Here only attention is float16: each layer's q, k, v are cast to float16 at the door of
its CachedAttention function, the family's bias too (padded keys at float16's lowest, not
float32's, which would cast to -inf), and its output cast back to float32. The weights, norms and
the head stay float32.

    past_key.N / present_key.N: [B, Hkv, P|capacity, d] float16 (float32 before)
    CachedAttention<Family>Half(...): the same body between Casts

Clients that make their own empty caches in the model's float dtype (Optimum, transformers.js)
cannot feed it: it is for onnxruntime's own loops (our runners and generate, IOBinding).
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ..targets.inplace_body import FLOAT16_LOWEST
from .kv_int8 import is_cached_attention, retyped_cache

CAST_IN = ("q", "k", "v")  # the new rows and the queries: float32 from the layer, float16 inside


def _float16_function(function: onnx.FunctionProto) -> onnx.FunctionProto:
    """CachedAttention<Family>Half: the function's body in float16 between Casts."""
    out = onnx.FunctionProto()
    out.CopyFrom(function)
    out.name = function.name + "Half"
    out.input[:] = [f"{name}_float32" if name in CAST_IN else name for name in out.input]
    body = [helper.make_node("Cast", [f"{name}_float32"], [name], to=TensorProto.FLOAT16) for name in CAST_IN]
    for node in out.node:
        if node.op_type == "Constant" and node.output[0] == "lowest":
            node.attribute[0].t.CopyFrom(helper.make_tensor("lowest", TensorProto.FLOAT, [], [FLOAT16_LOWEST]))
        node.output[:] = ["out_float16" if name == "out" else name for name in node.output]
        body.append(node)
    body.append(helper.make_node("Cast", ["out_float16"], ["out"], to=TensorProto.FLOAT))
    del out.node[:]
    out.node.extend(body)
    return out


def to_float16_cache(proto: onnx.ModelProto) -> int:
    """Rewrite a float32 in-place file (in place) for a float16 cache. Returns the number of
    layers. ValueError: not an in-place file, or not a float32 one."""
    calls = [n for n in proto.graph.node if is_cached_attention(n)]
    if not calls:
        raise ValueError("--kv-dtype float16 rewrites an in-place cache (--kv-cache --target ort); this file has none")
    cache_names = {name for node in calls for name in (node.input[3], node.input[4], node.output[1], node.output[2])}
    values = [v for v in (*proto.graph.input, *proto.graph.output) if v.name in cache_names]
    if any(v.type.tensor_type.elem_type != TensorProto.FLOAT for v in values):
        raise ValueError("--kv-dtype float16 is for a float32 file (a --dtype float16 file's cache is float16 already)")
    for function in [f for f in proto.functions if f.name in {n.op_type for n in calls}]:
        proto.functions.append(_float16_function(function))
    for node in calls:
        node.op_type += "Half"
    retyped_cache(proto, cache_names, TensorProto.FLOAT16)
    return len(calls)


def has_float16_cache(proto: onnx.ModelProto) -> bool:
    """Whether the file keeps a float16 cache with float32 weights (what its graph shows)."""
    return any(f.name.startswith("CachedAttention") and f.name.endswith("Half") for f in proto.functions)
