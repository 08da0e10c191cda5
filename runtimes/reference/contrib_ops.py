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


CONTRIB_OPS = [MultiHeadAttention]


class ContribEvaluator(ReferenceEvaluator):
    """The reference evaluator with CONTRIB_OPS everywhere: it builds the evaluators of a
    model's local functions (and their subgraphs) with its own class, but without the new_ops
    it was given, so the ops are the class's default here."""

    def __init__(self, proto, *args, new_ops=None, **kwargs):
        super().__init__(proto, *args, new_ops=[*(new_ops or []), *CONTRIB_OPS], **kwargs)
