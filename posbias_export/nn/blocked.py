"""Query-blocked attention in PyTorch: memory linear in L per block instead of H * L^2.

Queries are cut into blocks of `block` rows; each block sees only the keys it can reach: in a
causal model those at or before its last row (everything above the diagonal is skipped), in a
bidirectional one all keys, and under a local window only those within the window. Its bias is
built for that block alone, so nothing holds the [H, L, L] bias or score matrix. With float64
this is the reference we judge long inputs against (the plain float64 form would need 17 GB at
16k). During ONNX export it is ONE posbias.BlockedAttention<Family> node;
export/blocked_graph.py builds that function's body (an ONNX Loop over the same blocks).
"""
from __future__ import annotations

import math

import torch

from ..biases import MASK_PENALTY, AttentionBias

DEFAULT_BLOCK = 256  # query rows per block: the fastest measured at L=8192 and 16384 (README, benchmarks/attention.md)
# The distance-table path holds a [H, rows, Lk + reach] table and a slice of it per block on top of
# the scores: its rows are capped so the table has at most TABLE_ROW_BUDGET entries per head and
# per Lk-wide half (causal: 256 rows at 8192, 128 at 16384; a bidirectional table, 2 Lk wide, gets
# twice the entries and so the same rows), which keeps 16384 under 1 GiB (256 causal rows there:
# 1.20 GB measured, and no faster; 128 bidirectional rows: 0.99 GB, 1.2x faster than 64).
TABLE_ROW_BUDGET = 1 << 21
# The GPU-shaped targets (export/gpu_graph.py): entries per head of one block's bias. 2^26 keeps
# [H=8, rows, W] at 2^29 elements (1 GB in float16), far from ONNX Runtime CUDA's 2^31-element
# index limit: 4096 rows at L=16384, 2048 at 32768.
GPU_ROW_BUDGET = 1 << 26
GPU_DEFAULT_BLOCK = 4096
TARGETS = ("portable", "cuda", "cuda-ort")  # cuda: ONNX Attention-23 per block; cuda-ort: com.microsoft.MultiHeadAttention
FUNCTION_PREFIX = "BlockedAttention"


def function_name(bias: AttentionBias, by_distance: bool = False) -> str:
    """BlockedAttention<Family>, or ...ByDistance for the body that slices a distance table."""
    return FUNCTION_PREFIX + bias.function_name + ("ByDistance" if by_distance else "")


def slices_by_distance(bias: AttentionBias, q_pos: torch.Tensor, target: str = "portable",
                       dtype: torch.dtype = torch.float32) -> bool:
    """A relative family whose positions are the key indices (1-D positions:
    query_key_positions; batched ones come from a padding mask and are not): each block's bias
    is a slice of one table of per-distance values, see DistanceTablePositions. On the portable
    target a family with a key-row shortcut takes the table only when causal (the table then
    carries the causal mask; a per-head row rides in the MatMul, see folds_key_row, which needs
    float32 scores: float16 models keep the per-block BlockAttend); the GPU targets always slice."""
    if not (bias.relative and q_pos.dim() == 1):
        return False
    if target != "portable" or not bias.uses_key_row():
        return True
    return bias.causal and (bias.head_independent or dtype != torch.float16)


def folds_key_row(bias: AttentionBias, target: str = "portable") -> bool:
    """On the table path of the portable target, a per-head key row (ALiBi) goes into the
    MatMul ([q, 1] [k^T; row] = q k^T + row: no [H, Bq, W] Add per block) and the table holds
    the causal mask alone, [1, Bq, M]; measured at L=8192 on ORT CPU: 0.35 s vs 0.43 s for the
    key row added per block (benchmarks/attention.md)."""
    return target == "portable" and bias.uses_key_row() and not bias.head_independent


def folds_two_sided(bias: AttentionBias, target: str = "portable", dtype: torch.dtype = torch.float32) -> bool:
    """Bidirectional ALiBi without a table: each block sees the keys up to its last row with the
    key row, and the keys from its first row on again with the row negated (the bias mirrored,
    see BlockAttendTwoSided), both inside the MatMul; only a one-head mask is added. Measured at
    L=16384 on ORT CPU: 3.38 s vs 4.61 s for the [H, Bq, 2L] table (64-row blocks under its
    budget then; fused non-causal SDPA without bias 3.22 s). float32 scores only, as folds_key_row."""
    return (target == "portable" and bias.key_row_mirrors and not bias.causal and bias.lookback is None
            and dtype != torch.float16)


def table_heads(bias: AttentionBias, target: str = "portable") -> int:
    """Heads of the distance table: 1 for a head-independent family or a mask-only table."""
    return 1 if bias.head_independent or folds_key_row(bias, target) else bias.num_heads


def table_budget(bias: AttentionBias, target: str = "portable") -> int:
    """Table entries one table may hold, per head of the model: TABLE_ROW_BUDGET per head, so
    a one-head table (mask alone, or a head-independent family) gets H times the rows; a
    bidirectional one (keys on both sides, twice as wide) twice the entries."""
    sides = 1 if bias.causal else 2
    return TABLE_ROW_BUDGET * sides * bias.num_heads // table_heads(bias, target)


def table_block(block: int, k_len: int, lookahead: int | None, budget: int = TABLE_ROW_BUDGET) -> int:
    """Query rows per block on the distance-table path: at most `budget` table entries per
    table head, the table being Lk + min(Lk, lookahead) wide (as the ONNX body computes it)."""
    width = k_len + (k_len if lookahead is None else min(k_len, lookahead))
    return min(block, max(1, budget // width))


def keep_mask(key_mask: torch.Tensor | None, k_len, device=None) -> torch.Tensor:
    """Key-padding mask as bool [B|1, 1, 1, Lk]; all true without a mask."""
    if key_mask is None:
        return torch.ones(1, 1, 1, k_len, dtype=torch.bool, device=device)
    return key_mask.to(torch.bool)[:, None, None, :]


def blocked_attention(q, k, v, q_pos, k_pos, keep, bias: AttentionBias, block: int, as_function: bool = False,
                      target: str = "portable"):
    """softmax(q k^T / sqrt(d) + bias, (causal if bias.causal) & keep) v, one query block at a time.

    q [B, H, Lq, d], k/v [B, H, Lk, d] (queries are the last Lq key positions), q_pos [..., Lq],
    k_pos [..., Lk], keep bool [B|1, 1, 1, Lk]. During ONNX export with as_function this is one
    posbias.BlockedAttention<Family> node (its body shaped for `target`). Returns [B, H, Lq, d].
    The GPU targets budget their rows by GPU_ROW_BUDGET, also in the one-block branch.
    """
    by_distance = slices_by_distance(bias, q_pos, target, q.dtype)
    folded = by_distance and folds_key_row(bias, target)
    two_sided = by_distance and folds_two_sided(bias, target, q.dtype)  # no table: per-block bias below
    if as_function and torch.onnx.is_in_onnx_export():
        tensors, _ = bias.function_inputs()
        tensors = [t.float() if t.is_floating_point() else t for t in tensors]
        return torch.onnx.ops.symbolic(
            f"posbias::{function_name(bias, by_distance)}", [q, k, v, q_pos, k_pos, keep, *tensors], {},
            dtype=q.dtype, shape=q.shape, version=1,
        )
    Lq, Lk = q.shape[2], k.shape[2]
    offset = Lk - Lq
    if target != "portable":  # rows budgeted by width before the one-block test, as gpu_graph.py
        block = table_block(block, Lk, bias.lookahead, GPU_ROW_BUDGET)
    # one block: every key, as the ONNX If's direct branch
    reach, ahead = (bias.lookback, bias.lookahead) if Lq > block else (None, None)
    scale = 1.0 / math.sqrt(q.shape[-1])
    work = torch.promote_types(q.dtype, torch.float32)  # float32 scores, as the plain form; float64 stays
    table = None
    if by_distance and not two_sided and Lq > block:  # as the ONNX Loop branch: table[h, r, m] = g_h(r - m + Lk)
        if not torch.onnx.is_in_onnx_export() and not torch.equal(k_pos, torch.arange(Lk, device=k_pos.device)):
            raise ValueError("the distance table needs positions equal to the key indices")
        if target == "portable":
            block = table_block(block, Lk, bias.lookahead, table_budget(bias, target))
        reach_ahead = Lk if bias.lookahead is None else min(Lk, block + bias.lookahead)
        rows, cols = torch.arange(block, device=q.device), torch.arange(Lk + reach_ahead, device=q.device) - Lk  # [Bq], [M]
        if folded:  # MaskTable: the causal mask alone, [1, Bq, M]
            table = torch.where(cols[None, :] <= rows[:, None], 0.0, MASK_PENALTY).to(work)[None]
        else:  # DistanceVectorPositions -> the family's values on T = Bq - 1 + M distances -> ExpandDistanceVector
            last = torch.tensor([block - 1], device=q.device)  # [1]
            vector_cols = torch.arange(block - 1 + len(cols), device=q.device) - Lk  # [T]
            vector = bias.from_positions(last, vector_cols).to(work)  # [H|1, 1, T]
            if bias.causal:  # MaskFutureInTable on the vector: key after query where vector_cols[t] > Bq - 1
                vector = vector + torch.where(vector_cols <= last, 0.0, MASK_PENALTY).to(work)
            idx = (block - 1 - rows)[:, None] + torch.arange(len(cols), device=q.device)  # [Bq, M]
            table = vector[:, 0, idx]  # [H|1, Bq, M]: table[h, r, m] = g_h(r - m + Lk)
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
            if folded:  # the key row (BlockAttendFolded: inside the MatMul) equals the bias up to a row constant
                masked_bias = masked_bias + bias.from_positions(q_pos[start:stop], k_pos[lo:end]).to(work)  # [B|1, H, Bq, W]
        else:
            allowed = keep[..., lo:end] & ((k_idx <= q_idx) if bias.causal else True)  # [B|1, 1, Bq|1, W]
            penalty = torch.where(allowed, 0.0, MASK_PENALTY).to(work)  # [B|1, 1, Bq, W], see BlockAttend
            block_bias = bias.from_positions(q_pos[..., start:stop], k_pos[..., lo:end]).to(work)  # [.., H|1, Bq, W]
            masked_bias = block_bias + penalty
        probs = torch.softmax(scores.to(work) + masked_bias, dim=-1)  # [B, H, Bq, W]
        outputs.append(probs.to(v.dtype) @ v[:, :, lo:end])  # [B, H, Bq, d]
    return torch.cat(outputs, dim=2)  # [B, H, Lq, d]
