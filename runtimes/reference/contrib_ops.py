"""ONNX Runtime's contrib ops that our GPU-target files call, written for the ONNX reference
evaluator from their documentation (onnxruntime/docs/ContribOperators.md), so that those files
get the evaluator's independent opinion too. numpy only, like the evaluator.
"""
from __future__ import annotations

import numpy as np
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun


class MultiHeadAttention(OpRun):
    """com.microsoft.MultiHeadAttention, the subset our files use: query [B, S, H*d], key and
    value [B, L, H*d] (or [B, L, H*dv]), optional attention_bias [B|1, H|1, S, L] added to the
    scaled scores, `scale` (default 1/sqrt(d)), `unidirectional` (causal) only with S == L: ONNX
    Runtime's CPU kernel places the causal mask differently when S < L, so it is refused here."""

    op_domain = "com.microsoft"

    def _run(self, query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
             past_key=None, past_value=None, *rest, num_heads=None, scale=None, unidirectional=None,
             mask_filter_value=None):
        if bias is not None or key_padding_mask is not None or past_key is not None or rest:
            raise NotImplementedError("MultiHeadAttention: only query, key, value and attention_bias are supported here")
        if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
            raise NotImplementedError("MultiHeadAttention: only 3-D (B, S, H*d) query, key and value are supported here")
        heads = int(num_heads)
        (B, S, D), L = query.shape, key.shape[1]
        d, dv = D // heads, value.shape[2] // heads
        q = query.reshape(B, S, heads, d).transpose(0, 2, 1, 3).astype(np.float32)  # [B, H, S, d]
        k = key.reshape(B, L, heads, d).transpose(0, 2, 1, 3).astype(np.float32)  # [B, H, L, d]
        v = value.reshape(B, L, heads, dv).transpose(0, 2, 1, 3).astype(np.float32)  # [B, H, L, dv]
        scores = np.float32(1.0 / np.sqrt(d) if scale in (None, 0.0) else scale) * (q @ k.transpose(0, 1, 3, 2))
        if attention_bias is not None:
            scores = scores + attention_bias.astype(np.float32)  # [B, H, S, L]
        if unidirectional:
            if S != L:
                raise NotImplementedError("MultiHeadAttention: unidirectional with fewer queries than keys")
            scores = np.where(np.tril(np.ones((S, L), bool)), scores, -np.inf)
        scores = scores - scores.max(-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(-1, keepdims=True)
        out = (probs @ v).transpose(0, 2, 1, 3).reshape(B, S, heads * dv)  # [B, S, H*dv]
        return (out.astype(query.dtype),)


class GroupQueryAttention(OpRun):
    """com.microsoft.GroupQueryAttention, the subset our files use: no cache, every row's
    seqlens_k = total_sequence_length - 1 (no padding), query [B, S, H*d], key and value
    [B, S, Hkv*d]; causal, with `local_window_size` (each query sees itself and the
    local_window_size - 1 keys before it; -1: no window) and `scale`."""

    op_domain = "com.microsoft"

    def _run(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
             total_sequence_length=None, *rest, num_heads=None, kv_num_heads=None, local_window_size=None,
             scale=None, **unused):
        B, S, D = query.shape
        if past_key is not None or any(r is not None for r in rest) or key is None:
            raise NotImplementedError("GroupQueryAttention: only query, key, value without a cache are supported here")
        if int(total_sequence_length) != S or np.any(np.asarray(seqlens_k) != S - 1):
            raise NotImplementedError("GroupQueryAttention: only unpadded inputs (seqlens_k = S - 1) are supported here")
        heads, kv_heads = int(num_heads), int(kv_num_heads)
        d = D // heads
        q = query.reshape(B, S, heads, d).transpose(0, 2, 1, 3).astype(np.float32)  # [B, H, S, d]
        k, v = (np.repeat(x.reshape(B, S, kv_heads, d).transpose(0, 2, 1, 3).astype(np.float32), heads // kv_heads, 1)
                for x in (key, value))  # [B, H, S, d]
        scores = np.float32(1.0 / np.sqrt(d) if scale in (None, 0.0) else scale) * (q @ k.transpose(0, 1, 3, 2))
        i = np.arange(S)
        allowed = i[None, :] <= i[:, None]
        if local_window_size is not None and local_window_size > 0:
            allowed &= i[:, None] - i[None, :] < local_window_size
        scores = np.where(allowed, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = (probs @ v).transpose(0, 2, 1, 3).reshape(B, S, D).astype(query.dtype)
        return out, key, value  # present_key / present_value: the inputs (no cache was given)


CONTRIB_OPS = [MultiHeadAttention, GroupQueryAttention]


class ContribEvaluator(ReferenceEvaluator):
    """The reference evaluator with CONTRIB_OPS everywhere: it builds the evaluators of a
    model's local functions (and their subgraphs) with its own class, but without the new_ops
    it was given, so the ops are the class's default here."""

    def __init__(self, proto, *args, new_ops=None, **kwargs):
        super().__init__(proto, *args, new_ops=[*(new_ops or []), *CONTRIB_OPS], **kwargs)
