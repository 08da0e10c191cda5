"""--kv-dtype int8: an in-place file (--kv-cache --target ort) whose KV cache is int8, a quarter
of float32's bytes, so a long context's cache reads four times fewer bytes per step.

GroupQueryAttention (ONNX Runtime >= 1.25, its CPU kernel with our additive bias checked on
1.32) keeps past and present as int8 with one float scale per tensor (k_quant_type /
v_quant_type PER_TENSOR, kv_cache_bit_width 8, inputs k_scale and v_scale): it quantizes each
step's new keys and values into the buffer and dequantizes them as it attends. The scales are
the file's: one per layer and per key/value, each the largest |value| the float file writes into
that cache on calibration text, over 127 (`calibrate`). A value past it saturates.

    past_key.N / present_key.N: [B, Hkv, P|capacity, d] int8 (float32 before)
    CachedAttention<Family>Int8(..., k_scale, v_scale): the same body, its GroupQueryAttention quantized

Clients that make their own empty caches in the model's float dtype (Optimum, transformers.js)
cannot feed it: it is for onnxruntime's own loops (our runners and generate, IOBinding).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...runners import runtimes_common
from ..targets.inplace_body import MS_DOMAIN

INT8_MAX = 127
# Text to calibrate on: the scales come from what the model writes into its cache reading it.
CALIBRATION_TEXT = (
    "The cache of a language model holds one key and one value per token and per layer. When a "
    "prompt is thousands of tokens long, reading that cache costs more than reading the weights, "
    "so each step spends most of its time in memory. Storing each number in one byte instead of "
    "four lets the same machine keep four times the context, or read it four times as fast. The "
    "price is rounding: every key and value is stored as a multiple of its layer's scale. "
)
CALIBRATION_TOKENS = 512
CALIBRATION_NOTE = f"largest |value| over {CALIBRATION_TOKENS} tokens of built-in English text, / 127"


def is_cached_attention(node: onnx.NodeProto) -> bool:
    return node.op_type.startswith("CachedAttention")


def calibration_ids(vocab_size: int, tokenizer: str | None = None) -> np.ndarray:
    """[1, CALIBRATION_TOKENS] ids: the text through the folder's tokenizer.json, or its bytes
    (our byte-level models); ids past the vocabulary (a tokenizer larger than the model) wrap."""
    if tokenizer:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(tokenizer).encode(CALIBRATION_TEXT).ids
    else:
        ids = list(CALIBRATION_TEXT.encode("utf-8"))
    ids = (ids * (CALIBRATION_TOKENS // max(len(ids), 1) + 1))[:CALIBRATION_TOKENS]
    return (np.array(ids, np.int64) % vocab_size)[None]


def calibrate(path: str, tokenizer: str | None = None) -> dict[str, float]:
    """present output name -> the largest |value| the float in-place file at `path` writes into
    that cache reading the calibration text (one prefill into an empty cache, unbound: present
    is the whole cache)."""
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    vocab = next(o.shape[-1] for o in session.get_outputs() if o.name == "logits")
    ids = calibration_ids(vocab, tokenizer)
    feeds = {}
    for value in session.get_inputs():
        if value.name == "input_ids":
            feeds[value.name] = ids
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones_like(ids)
        else:  # a past: [B, Hkv, 0, d] in the file's float dtype
            dtype = np.float16 if "float16" in value.type else np.float32
            feeds[value.name] = np.zeros((ids.shape[0], value.shape[1], 0, value.shape[3]), dtype)
    names = [o.name for o in session.get_outputs() if runtimes_common("cache").is_cache_output(o.name)]
    outputs = session.run(names, feeds)
    return {name: float(np.abs(out.astype(np.float32)).max()) for name, out in zip(names, outputs)}


def _int8_function(function: onnx.FunctionProto) -> onnx.FunctionProto:
    """CachedAttention<Family>Int8: the function with k_scale, v_scale inputs and its
    GroupQueryAttention's cache quantized per tensor to 8 bits."""
    out = onnx.FunctionProto()
    out.CopyFrom(function)
    out.name = function.name + "Int8"
    out.input.extend(["k_scale", "v_scale"])
    gqa = next(n for n in out.node if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN)
    inputs = list(gqa.input) + [""] * (14 - len(gqa.input))  # 11: head_sink, 12: k_scale, 13: v_scale
    inputs[12], inputs[13] = "k_scale", "v_scale"
    gqa.input[:] = inputs
    gqa.attribute.extend([helper.make_attribute("k_quant_type", "PER_TENSOR"),
                          helper.make_attribute("v_quant_type", "PER_TENSOR"),
                          helper.make_attribute("kv_cache_bit_width", 8)])
    return out


def to_int8_cache(proto: onnx.ModelProto, absmax: dict[str, float]) -> int:
    """Rewrite an in-place file (in place) for an int8 cache with the calibrated `absmax` (per
    present output). Returns the number of layers. ValueError: not an in-place file."""
    calls = [n for n in proto.graph.node if is_cached_attention(n)]
    if not calls:
        raise ValueError("--kv-dtype int8 rewrites an in-place cache (--kv-cache --target ort); this file has none")
    for function in [f for f in proto.functions if f.name in {n.op_type for n in calls}]:
        proto.functions.append(_int8_function(function))
    cache_names = set()
    for node in calls:
        present_key, present_value = node.output[1], node.output[2]
        for kind, name in (("key", present_key), ("value", present_value)):
            scale = max(absmax[name], 1e-6) / INT8_MAX  # an all-zero cache still gets a positive scale
            proto.graph.initializer.append(numpy_helper.from_array(np.array([scale], np.float32),
                                                                   f"kv_scale.{name}"))
        node.input.extend([f"kv_scale.{present_key}", f"kv_scale.{present_value}"])
        node.op_type += "Int8"
        cache_names.update([node.input[3], node.input[4], present_key, present_value])
    retyped_cache(proto, cache_names, TensorProto.INT8)
    return len(calls)


def retyped_cache(proto: onnx.ModelProto, cache_names: set[str], elem_type: int) -> None:
    """The past / present graph values named given `elem_type`, and the CachedAttention
    functions no node calls any more dropped (their rewritten copies are what the nodes call)."""
    for value in [*proto.graph.input, *proto.graph.output]:
        if value.name in cache_names:
            value.type.tensor_type.elem_type = elem_type
    used = {n.op_type for n in proto.graph.node}
    kept = [f for f in proto.functions if not (f.name.startswith("CachedAttention") and f.name not in used)]
    del proto.functions[:]
    proto.functions.extend(kept)


def has_int8_cache(proto: onnx.ModelProto) -> bool:
    """Whether the file keeps an int8 KV cache (what its graph shows, not a label)."""
    return any(f.name.startswith("CachedAttention") and f.name.endswith("Int8") for f in proto.functions)
