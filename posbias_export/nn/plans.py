"""The block plan: how query-blocked attention runs for one layer, decided once.

Four places used to derive it on their own (the PyTorch twin in blocked.py, the portable and
GPU-shaped ONNX bodies in export/, a test); now each reads a BlockPlan made by `block_plan`
from (bias, body shape, dtype, whether the positions are the key indices).

Paths a block's bias can take:
  positions  the family's function (or its key-row shortcut) on each block's own positions
  table      a slice of one table of per-distance values, built once per call (a relative
             family whose positions are the key indices)
  folded     causal key-row families (ALiBi, Falcon's): the table holds the causal mask alone
             and the key row rides inside the MatMul ([q, 1] [k^T; row]); any positions
  two_sided  bidirectional ALiBi: no table, the row rides in the MatMul on both sides of the
             diagonal (see BlockAttendTwoSided); any positions

GPU-shaped bodies first try one fused call over the whole sequence (`whole`), no bias tensor
and no Loop, when the input allows it (as many queries as keys, no padding key):
  features   causal ALiBi: the bias rides in four extra query/key features (gpu_script.py)
  plain      no bias, no window: the fused op's own causal (or no) mask
  window     a causal local window in float16: GroupQueryAttention's local_window_size (ONNX
             Runtime's op; it has float16 CUDA kernels only, and ONNX Attention-23 no window)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..biases import AttentionBias

DEFAULT_BLOCK = 256  # query rows per block: the fastest measured at L=8192 and 16384 (README, benchmarks/attention.md)
# The distance-table path holds a [H, rows, Lk + reach] table and a slice of it per block on top of
# the scores: its rows are capped so the table has at most TABLE_ROW_BUDGET entries per head and
# per Lk-wide half (causal: 256 rows at 8192, 128 at 16384; a bidirectional table, 2 Lk wide, gets
# twice the entries and so the same rows), which keeps 16384 under 1 GiB (256 causal rows there:
# 1.20 GB measured, and no faster; 128 bidirectional rows: 0.99 GB, 1.2x faster than 64).
TABLE_ROW_BUDGET = 1 << 21
# GPU-shaped bodies (one fused attention op per block): entries per head of one block's bias.
# 2^26 keeps [H=8, rows, W] at 2^29 elements (1 GB in float16), far from ONNX Runtime CUDA's
# 2^31-element index limit: 4096 rows at L=16384, 2048 at 32768.
GPU_ROW_BUDGET = 1 << 26
GPU_DEFAULT_BLOCK = 4096
FUNCTION_PREFIX = "BlockedAttention"
PATHS = ("positions", "table", "folded", "two_sided")
WHOLE_PATHS = ("features", "plain", "window")
# Columns the features take ahead of q and k (zeros after them): 16 keeps them in their own
# k-chunk of a GPU tensor-core product (16 wide in float16) and the head size a multiple of 8,
# as flash kernels want (64 -> 80).
FEATURE_WIDTH = 16


@dataclass(frozen=True)
class BlockPlan:
    """What every builder of one layer's blocked attention reads.

    name: the posbias function the layer's node calls (BlockedAttention<Family>[ByDistance]).
    fused: the GPU-shaped body (each block ends in one fused attention op), else the portable one.
    path: how a block gets its bias (see the module docstring).
    key_row: the family's key-row function, where it stands for the bias of a block that
      computes its own (the one-block branch, the positions path, the folded row), else None.
    table_heads: heads of the distance table (1: a mask-only table or a head-independent family).
    row_budget: table entries per table head that cap the rows of a block (None: no cap).
    lookback / lookahead: keys before / after its own position a query can see (None: all).
    whole: the fused whole-sequence call of a GPU-shaped body (WHOLE_PATHS), else None.
    far: on the portable table path, the distance from which the family's bias is one constant
      per side (AttentionBias.far_distance): each block adds it inside the MatMul for the keys
      that far from all its queries and slices the table for the rest only (fewer bytes per
      score); None: the whole block's bias is sliced. The PyTorch twin computes the same sums.
    """

    name: str
    fused: bool
    path: str
    key_row: str | None
    table_heads: int
    row_budget: int | None
    lookback: int | None
    lookahead: int | None
    whole: str | None = None
    far: int | None = None

    @property
    def by_distance(self) -> bool:
        return self.path != "positions"

    @property
    def uses_table(self) -> bool:
        return self.path in ("table", "folded")

    @property
    def needs_indices(self) -> bool:
        """The table's values are per index distance: positions must be the key indices."""
        return self.path == "table"

    def rows(self, block: int, k_len: int) -> int:
        """Query rows per block at this key length: `block`, capped by the row budget for a
        table as wide as the ONNX body computes it (Lk + min(Lk, lookahead))."""
        if self.row_budget is None:
            return block
        width = k_len + (k_len if self.lookahead is None else min(k_len, self.lookahead))
        return min(block, max(1, self.row_budget // width))

    def one_block_rows(self, block: int, k_len: int) -> int:
        """The most queries the direct (Loop-free) branch takes: GPU-shaped bodies budget it
        too (no bias tensor near the 2^31-element limit); the portable one does not."""
        return self.rows(block, k_len) if self.fused else block


def function_name(bias: AttentionBias, by_distance: bool = False) -> str:
    """BlockedAttention<Family>, or ...ByDistance for the body that runs on the key indices."""
    return FUNCTION_PREFIX + bias.function_name + ("ByDistance" if by_distance else "")


def _portable_path(bias: AttentionBias, dtype: torch.dtype, indices: bool) -> str:
    """The portable body's path. The folded and two-sided paths carry the bias in a key row at
    whatever the positions are (the masks come from the key indices), so they serve positions
    from a padding mask too; a table holds values per index distance, so it needs positions
    that are the indices."""
    float32 = dtype != torch.float16  # a row inside the MatMul needs float32 scores
    if bias.uses_key_row() and bias.causal and not bias.head_independent and float32:
        return "folded"
    if bias.key_row_mirrors and not bias.causal and bias.lookback is None and float32:
        return "two_sided"
    # an exact key row (bidirectional), or a per-head row in float16, stays per block
    if indices and bias.relative and (not bias.uses_key_row() or (bias.causal and bias.head_independent)):
        return "table"
    return "positions"


def block_plan(bias: AttentionBias, fused: bool = False, dtype: torch.dtype = torch.float32,
               indices: bool = True) -> BlockPlan:
    """The plan of one layer: `fused` picks the GPU-shaped body, `indices` says the layer's
    positions are the key indices (1-D positions; those from a padding mask are not)."""
    if fused:
        path = "table" if indices and bias.relative else "positions"
        key_row, budget = None, GPU_ROW_BUDGET
    else:
        path = _portable_path(bias, dtype, indices)
        key_row, budget = (bias.key_row_name() if bias.uses_key_row() else None), None
    folded = path == "folded"
    heads = 1 if bias.head_independent or folded else bias.num_heads
    if not fused and path in ("table", "folded"):
        # TABLE_ROW_BUDGET per head of the model: a one-head table gets H times the rows, a
        # bidirectional one (keys on both sides, twice as wide) twice the entries
        budget = TABLE_ROW_BUDGET * (1 if bias.causal else 2) * bias.num_heads // heads
    # a far constant rides in the MatMul: float32 scores only (a float16 product would round it); its
    # table holds the keys near a block only ([H, rows, rows + 2 far - 1]), so a causal block needs no row
    # budget (T5 at 16384: 256 rows, 0.91 GB); a bidirectional block's scores span every key, and 256
    # rows there peaked at 1.21 GB: it keeps the table's budget (128 rows at 16384)
    # the GPU-shaped body fuses each block's bias into one attention op: no far constant there
    far = bias.far_distance if not fused and path == "table" and dtype != torch.float16 and bias.lookback is None else None
    budget = None if far is not None and bias.causal else budget
    return BlockPlan(function_name(bias, path != "positions"), fused, path, key_row, heads, budget,
                     bias.lookback, bias.lookahead, _whole_path(bias, dtype) if fused else None, far)


def _whole_path(bias: AttentionBias, dtype: torch.dtype) -> str | None:
    """The GPU-shaped body's fused whole-sequence call, if the family has one."""
    if bias.slope_features and bias.causal:
        return "features"
    if bias.mask_only and bias.lookback is None:
        return "plain"
    if bias.mask_only and bias.causal and dtype == torch.float16:
        return "window"
    return None
