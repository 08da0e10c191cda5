"""Query-blocked attention in PyTorch: memory linear in L per block instead of H * L^2.

Queries are cut into blocks of `block` rows; each block sees only the keys it can reach: in a
causal model those at or before its last row (everything above the diagonal is skipped), in a
bidirectional one all keys, and under a local window only those within the window. Its bias is
built for that block alone, so nothing holds the [H, L, L] bias or score matrix. With float64
this is the reference we judge long inputs against (the plain float64 form would need 17 GB at
16k). During ONNX export it is ONE posbias.BlockedAttention<Family> node;
export/targets/blocked_body.py builds that function's body (an ONNX Loop over the same blocks).
"""
from __future__ import annotations

import math

import torch

from ..biases import MASK_PENALTY, AttentionBias, floor_scores
from .plans import BlockPlan

def keep_mask(key_mask: torch.Tensor | None, k_len, device=None) -> torch.Tensor:
    """Key-padding mask as bool [B|1, 1, 1, Lk]; all true without a mask."""
    if key_mask is None:
        return torch.ones(1, 1, 1, k_len, dtype=torch.bool, device=device)
    return key_mask.to(torch.bool)[:, None, None, :]


def blocked_attention(q, k, v, q_pos, k_pos, keep, bias: AttentionBias, block: int, plan: BlockPlan,
                      as_function: bool = False):
    """softmax(q k^T / sqrt(d) + bias, (causal if bias.causal) & keep) v, one query block at a time.

    q [B, H, Lq, d], k/v [B, H, Lk, d] (queries are the last Lq key positions), q_pos [..., Lq],
    k_pos [..., Lk], keep bool [B|1, 1, 1, Lk]; `plan` (block_plan.py) says how each block gets
    its bias, exactly as the ONNX body does. as_function: this is being traced for ONNX export;
    the whole computation is ONE posbias.BlockedAttention<Family> node. Returns [B, H, Lq, d].
    """
    if as_function:
        tensors, _ = bias.function_inputs()
        tensors = [t.float() if t.is_floating_point() else t for t in tensors]
        return torch.onnx.ops.symbolic(
            f"posbias::{plan.name}", [q, k, v, q_pos, k_pos, keep, *tensors], {},
            dtype=q.dtype, shape=q.shape, version=1,
        )
    Lq, Lk = q.shape[2], k.shape[2]
    offset = Lk - Lq
    if plan.needs_indices and not torch.equal(k_pos, torch.arange(Lk, device=k_pos.device)):
        raise ValueError("this block plan slices a distance table: it needs positions equal to the key indices")
    direct = Lq <= plan.one_block_rows(block, Lk)  # as the ONNX If: one block, every key, no Loop
    block = Lq if direct else plan.rows(block, Lk)
    reach, ahead = (None, None) if direct else (plan.lookback, plan.lookahead)
    scale = 1.0 / math.sqrt(q.shape[-1])
    work = torch.promote_types(q.dtype, torch.float32)  # float32 scores, as the plain form; float64 stays
    table = distance_table(bias, plan, block, Lk, work, q.device) if plan.uses_table and not direct else None
    padded = not bool(keep.all())  # HasPadding: the padded Loop adds the padding penalty
    outputs = []
    for start in range(0, Lq, block):
        stop = min(start + block, Lq)
        lo = 0 if reach is None else max(0, offset + start - reach)
        end = Lk if ahead is None else min(Lk, offset + stop + ahead)  # causal: offset + stop
        q_idx = torch.arange(offset + start, offset + stop, device=q.device)[:, None]  # [Bq, 1]
        k_idx = torch.arange(lo, end, device=q.device)  # [W]
        scores = (q[:, :, start:stop] * scale) @ k[:, :, lo:end].transpose(-1, -2)  # [B, H, Bq, W]
        if table is not None:  # the masks are in the table (causal) or added only when padded
            first = lo - (offset + start) + Lk  # SliceByDistance
            masked_bias = table[:, : stop - start, first:first + end - lo]  # [H|1, Bq, W]
            if padded:  # AddPaddingPenalty
                masked_bias = masked_bias + torch.where(keep[..., lo:end], 0.0, MASK_PENALTY).to(work)  # [B|1, H|1, Bq, W]
            if plan.path == "folded":  # the key row (BlockAttendFolded: inside the MatMul) is the bias up to a row constant
                block_bias = bias.from_positions(q_pos[..., start:stop], k_pos[..., lo:end])  # [B|1, H, Bq, W]
                masked_bias = masked_bias + block_bias.to(work)
        else:
            allowed = keep[..., lo:end] & ((k_idx <= q_idx) if bias.causal else True)  # [B|1, 1, Bq|1, W]
            penalty = torch.where(allowed, 0.0, MASK_PENALTY).to(work)  # [B|1, 1, Bq, W], see BlockAttend
            block_bias = bias.from_positions(q_pos[..., start:stop], k_pos[..., lo:end]).to(work)  # [.., H|1, Bq, W]
            masked_bias = block_bias + penalty
        probs = torch.softmax(floor_scores(scores.to(work) + masked_bias), dim=-1)  # [B, H, Bq, W], FlooredSoftmax
        outputs.append(probs.to(v.dtype) @ v[:, :, lo:end])  # [B, H, Bq, d]
    return torch.cat(outputs, dim=2)  # [B, H, Lq, d]


def distance_table(bias: AttentionBias, plan: BlockPlan, block: int, k_len: int, work: torch.dtype, device):
    """The table every block slices its bias from, table[h, r, m] = g_h(r - m + Lk), masked as
    the ONNX body masks it: [1, Bq, M] causal mask alone (folded), else the family's values
    (causal: the mask folded in). M = Lk + min(Lk, Bq + lookahead)."""
    reach_ahead = k_len if plan.lookahead is None else min(k_len, block + plan.lookahead)
    rows, cols = torch.arange(block, device=device), torch.arange(k_len + reach_ahead, device=device) - k_len  # [Bq], [M]
    if plan.path == "folded":  # MaskTable
        return torch.where(cols[None, :] <= rows[:, None], 0.0, MASK_PENALTY).to(work)[None]  # [1, Bq, M]
    # DistanceVectorPositions -> the family's values on T = Bq - 1 + M distances -> ExpandDistanceVector
    last = torch.tensor([block - 1], device=device)  # [1]
    vector_cols = torch.arange(block - 1 + len(cols), device=device) - k_len  # [T]
    vector = bias.from_positions(last, vector_cols).to(work)  # [H|1, 1, T]
    if bias.causal:  # MaskFutureInTable on the vector: key after query where vector_cols[t] > Bq - 1
        vector = vector + torch.where(vector_cols <= last, 0.0, MASK_PENALTY).to(work)
    idx = (block - 1 - rows)[:, None] + torch.arange(len(cols), device=device)  # [Bq, M]
    return vector[:, 0, idx]  # [H|1, Bq, M]
