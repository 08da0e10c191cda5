"""ONNX Runtime's contrib ops that our GPU-target files call, written for the ONNX reference
evaluator from their documentation (onnxruntime/docs/ContribOperators.md), so that those files
get the evaluator's independent opinion too. numpy only, like the evaluator.
"""
from __future__ import annotations

import numpy as np
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun


class FusedAttention(OpRun):
    """What the fused attention ops share: one softmax over the last axis, a method so that a
    subclass can watch the probabilities (runtimes/reference/subnormals.py counts them)."""

    op_domain = "com.microsoft"

    def probabilities(self, scores: np.ndarray) -> np.ndarray:
        """softmax(scores, -1) in float32; -inf entries (masked keys) get 0."""
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        return probs / probs.sum(-1, keepdims=True)

    def weighted(self, probs: np.ndarray, v: np.ndarray) -> np.ndarray:
        """probs [.., S, L] @ v [.., L, dv]: the fused op's second product."""
        return probs @ v


class MultiHeadAttention(FusedAttention):
    """com.microsoft.MultiHeadAttention, the subset our files use: query [B, S, H*d], key and
    value [B, L, H*d] (or [B, L, H*dv]), optional attention_bias [B|1, H|1, S, L] added to the
    scaled scores, `scale` (default 1/sqrt(d)), `unidirectional` (causal) only with S == L: ONNX
    Runtime's CPU kernel places the causal mask differently when S < L, so it is refused here."""

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
        out = self.weighted(self.probabilities(scores), v).transpose(0, 2, 1, 3).reshape(B, S, heads * dv)  # [B, S, H*dv]
        return (out.astype(query.dtype),)


class GroupQueryAttention(FusedAttention):
    """com.microsoft.GroupQueryAttention, the subset our files use: query [B, S, H*d], key and
    value [B, S, Hkv*d] (the S new rows), an optional cache past_key / past_value [B, Hkv, P, d],
    seqlens_k [B] (each row's total length - 1) and total_sequence_length T, an optional
    attention_bias [B|1, H|1, S, T] added to the scaled scores; `local_window_size` (each query
    sees itself and the local_window_size - 1 keys before it; -1: no window) and `scale`.

    As ONNX Runtime's CPU kernel: a row's past length is seqlens_k + 1 - S (0 on a first prompt,
    S == T); query s sees the keys up to its own slot, past + s; present is the past with the
    new rows written at [past, past + S), max(P, T) slots long (past and present bound to one
    buffer, as onnxruntime-genai runs it, is the same arithmetic). Rotary, softcap, smooth
    softmax and packed QKV are refused."""

    def _run(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
             total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None, attention_bias=None,
             *rest, num_heads=None, kv_num_heads=None, local_window_size=None, scale=None, do_rotary=None,
             softcap=None, smooth_softmax=None, **unused):
        if key is None or any(x is not None for x in (cos_cache, sin_cache, position_ids, *rest)) or do_rotary \
                or softcap or smooth_softmax:
            raise NotImplementedError("GroupQueryAttention: rotary, softcap, smooth softmax, packed QKV and head "
                                      "sinks are not supported here")
        B, S, D = query.shape
        heads, kv_heads = int(num_heads), int(kv_num_heads)
        d, group = D // heads, heads // kv_heads
        total = int(total_sequence_length)
        lengths = np.asarray(seqlens_k).astype(np.int64).reshape(B) + 1  # [B] each row's total length
        first_prompt = S == total
        past_len = np.zeros(B, np.int64) if first_prompt else lengths - S  # [B]
        P = 0 if past_key is None else past_key.shape[2]
        slots = max(P, total)
        new_k, new_v = (x.reshape(B, S, kv_heads, d).transpose(0, 2, 1, 3) for x in (key, value))  # [B, Hkv, S, d]
        present_k, present_v = (np.zeros((B, kv_heads, slots, d), query.dtype) for _ in range(2))
        if P:
            present_k[:, :, :P], present_v[:, :, :P] = past_key, past_value
        for b in range(B):
            present_k[b, :, past_len[b]:past_len[b] + S] = new_k[b]
            present_v[b, :, past_len[b]:past_len[b] + S] = new_v[b]
        q = query.reshape(B, S, heads, d).transpose(0, 2, 1, 3).astype(np.float32)  # [B, H, S, d]
        k, v = (np.repeat(x[:, :, :total].astype(np.float32), group, 1) for x in (present_k, present_v))  # [B, H, T, d]
        scores = np.float32(1.0 / np.sqrt(d) if scale in (None, 0.0) else scale) * (q @ k.transpose(0, 1, 3, 2))
        if attention_bias is not None:
            scores = scores + attention_bias.astype(np.float32)  # [B, H, S, T]
        last = past_len[:, None, None, None] + np.arange(S)[None, None, :, None]  # [B, 1, S, 1] each query's slot
        slot = np.arange(total)[None, None, None, :]  # [1, 1, 1, T]
        allowed = slot <= last
        if local_window_size is not None and local_window_size > 0:
            allowed &= last - slot < local_window_size
        probs = self.probabilities(np.where(allowed, scores, -np.inf))  # [B, H, S, T]
        out = self.weighted(probs, v).transpose(0, 2, 1, 3).reshape(B, S, D).astype(query.dtype)
        return out, present_k, present_v


CONTRIB_OPS = [MultiHeadAttention, GroupQueryAttention]


class ContribEvaluator(ReferenceEvaluator):
    """The reference evaluator with CONTRIB_OPS everywhere: it builds the evaluators of a
    model's local functions (and their subgraphs) with its own class, but without the new_ops
    it was given, so the ops are the class's default here (a subclass names its own: OPS)."""

    OPS: list = CONTRIB_OPS

    def __init__(self, proto, *args, new_ops=None, **kwargs):
        super().__init__(proto, *args, new_ops=[*(new_ops or []), *self.OPS], **kwargs)
