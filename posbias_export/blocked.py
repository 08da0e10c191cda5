"""Query-blocked causal attention: memory linear in L per block instead of H * L^2.

The default form of causal exports. Queries are cut into blocks of `block` rows; each block
sees only the keys at or before its last row (causality skips everything above the
diagonal), and a local window only the keys it can reach. Its bias is built for that block
alone, inside the loop, by the family's own posbias function, so nothing ever holds the
[H, L, L] bias or score matrix.

- eager: blocked_attention() runs the same loop in PyTorch (any dtype: with float64 it is the
  reference we judge long inputs against, where the plain fp64 form would need 17 GB at 16k);
- export: the layer emits ONE posbias.BlockedAttention<Family> node; function_proto() builds
  its body (an ONNX Loop over blocks calling the ONNX Script pieces of blocked_script.py;
  an If skips the Loop when all queries fit one block, as in a decode step).

Causal ALiBi takes a shortcut that is exact under the causal mask: a key-only bias row per
block (see AlibiKeyRow), so the per-block bias is H*W values instead of H*Bq*W.
"""
from __future__ import annotations

import math

import onnx
import torch
from onnx import TensorProto, helper

from .biases import AttentionBias
from .biases.onnx_domain import DOMAIN, VERSION

DEFAULT_BLOCK = 128  # query rows per block: at L=8192 within 5% of the fastest (256) at ~half its peak RSS (README)
ATTENTION_FORMS = ("blocked", "plain")
MASK_PENALTY = -1e30  # added to masked scores (blocked_script.BlockAttend explains the value)
_UNBOUNDED = 1 << 40  # "look back as far as you like" (more keys than any input has)
_ELEM_TYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.float64: TensorProto.DOUBLE}


def lookback(bias: AttentionBias) -> int | None:
    """How many keys before its own position a query can attend to (None: all)."""
    window = getattr(bias, "window", None)
    return None if window is None else window - 1


def keep_mask(key_mask: torch.Tensor | None, k_len, device=None) -> torch.Tensor:
    """Key-padding mask as bool [B|1, 1, 1, Lk]; all true without a mask."""
    if key_mask is None:
        return torch.ones(1, 1, 1, k_len, dtype=torch.bool, device=device)
    return key_mask.to(torch.bool)[:, None, None, :]


def blocked_attention(q, k, v, q_pos, k_pos, keep, bias: AttentionBias, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias, causal & keep) v, one query block at a time.

    q [B, H, Lq, d], k/v [B, H, Lk, d] (queries are the last Lq key positions), q_pos [..., Lq],
    k_pos [..., Lk], keep bool [B|1, 1, 1, Lk]. During ONNX export (bias.emit_function set)
    this is one posbias.BlockedAttention<Family> node. Returns [B, H, Lq, d].
    """
    if bias.emit_function and torch.onnx.is_in_onnx_export():
        tensors, _ = bias.function_inputs()
        tensors = [t.float() if t.is_floating_point() else t for t in tensors]
        return torch.onnx.ops.symbolic(
            f"posbias::{function_name(bias)}", [q, k, v, q_pos, k_pos, keep, *tensors], {},
            dtype=q.dtype, shape=q.shape, version=VERSION,
        )
    Lq, Lk = q.shape[2], k.shape[2]
    offset = Lk - Lq
    reach = lookback(bias) if Lq > block else None  # one block: every key, as the ONNX If's direct branch
    scale = 1.0 / math.sqrt(q.shape[-1])
    work = torch.promote_types(q.dtype, torch.float32)  # float32 scores, as the plain form; float64 stays
    outputs = []
    for start in range(0, Lq, block):
        stop = min(start + block, Lq)
        lo = 0 if reach is None else max(0, offset + start - reach)
        end = offset + stop
        q_idx = torch.arange(offset + start, offset + stop, device=q.device)[:, None]  # [Bq, 1]
        k_idx = torch.arange(lo, end, device=q.device)  # [W]
        scores = (q[:, :, start:stop] * scale) @ k[:, :, lo:end].transpose(-1, -2)  # [B, H, Bq, W]
        allowed = (k_idx <= q_idx) & keep[..., lo:end]  # [B|1, 1, Bq, W]
        penalty = torch.where(allowed, 0.0, MASK_PENALTY).to(work)  # [B|1, 1, Bq, W], see BlockAttend
        block_bias = bias.from_positions(q_pos[..., start:stop], k_pos[..., lo:end]).to(work)  # [.., H|1, Bq, W]
        probs = torch.softmax(scores.to(work) + (block_bias + penalty), dim=-1)  # [B, H, Bq, W]
        outputs.append(probs.to(v.dtype) @ v[:, :, lo:end])  # [B, H, Bq, d]
    return torch.cat(outputs, dim=2)  # [B, H, Lq, d]


def function_name(bias: AttentionBias) -> str:
    return "BlockedAttention" + bias.onnx_function().name


def function_proto(bias: AttentionBias, block: int, dtype: torch.dtype, opset: int) -> onnx.FunctionProto:
    """posbias.BlockedAttention<Family>(q, k, v, q_pos, k_pos, keep, *bias tensors) -> out.

    Block size, look-back and the family's attributes are baked in (one model, one config);
    learned bias tensors stay inputs, so every layer calls the same function.
    """
    tensors, attrs = bias.function_inputs()
    params = [f"bias_input_{i}" for i in range(len(tensors))]
    reach = lookback(bias)

    def call(op_type, inputs, outputs, **attributes):
        return helper.make_node(op_type, inputs, outputs, domain=DOMAIN, **attributes)

    def bias_node(q_pos, k_pos, out):
        if bias.name == "alibi" and bias.causal:
            return call("AlibiKeyRow", [q_pos, k_pos, *params], [out])
        return call(bias.onnx_function().name, [q_pos, k_pos, *params], [out], **attrs)

    def scalar(name, value, elem=TensorProto.INT64):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, elem, [], [value]))

    out_type = _ELEM_TYPES[dtype]
    body = helper.make_graph(
        [
            call("BlockQueries", ["it", "q_pad", "q_pos_pad", "block", "offset"], ["q_b", "q_pos_b", "q_idx"]),
            call("BlockKeys", ["it", "k_t", "v", "k_pos", "keep", "block", "offset", "lookback"],
                 ["k_t_b", "v_b", "k_pos_b", "k_idx", "keep_b"]),
            bias_node("q_pos_b", "k_pos_b", "bias_b"),
            call("BlockAttend", ["q_b", "k_t_b", "v_b", "bias_b", "q_idx", "k_idx", "keep_b"], ["attended_b"]),
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
    blocks = helper.make_graph(
        [
            scalar("lookback", _UNBOUNDED if reach is None else reach),
            scalar("go", True, TensorProto.BOOL),
            call("BlockPrepare", ["q", "k", "v", "q_pos", "max_block"],
                 ["q_pad", "k_t", "q_pos_pad", "block", "n_blocks", "offset"]),
            helper.make_node("Loop", ["n_blocks", "go"], ["blocks"], body=body),  # [n, 1, B, H, Bq, d] (or [n, B, ...])
            call("BlockAssemble", ["blocks", "q", "block"], ["out_blocks"]),
        ],
        "query_blocks", [], [helper.make_tensor_value_info("out_blocks", out_type, None)],
    )
    # One block's worth of queries (decode steps, short prompts): the same math without the
    # Loop, its padding and its copies of the key cache; a decode step costs what the plain form does.
    direct = helper.make_graph(
        [
            call("DirectPrepare", ["q", "k"], ["q_scaled", "k_t_all", "q_idx_all", "k_idx_all"]),
            bias_node("q_pos", "k_pos", "bias_all"),
            call("BlockAttend", ["q_scaled", "k_t_all", "v", "bias_all", "q_idx_all", "k_idx_all", "keep"], ["out_direct"]),
        ],
        "one_block", [], [helper.make_tensor_value_info("out_direct", out_type, None)],
    )
    nodes = [
        scalar("max_block", block),
        call("FitsOneBlock", ["q", "max_block"], ["fits"]),
        helper.make_node("If", ["fits"], ["out"], then_branch=direct, else_branch=blocks),
    ]
    return helper.make_function(
        DOMAIN, function_name(bias), ["q", "k", "v", "q_pos", "k_pos", "keep", *params], ["out"], nodes,
        [helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, VERSION)],
    )
