"""The pieces of query-blocked attention, as ONNX Script functions in domain posbias.

blocked_body.py strings them together: BlockPrepare, then a Loop over query blocks whose body is
BlockQueries -> BlockKeys -> (the family's bias function on the block) -> BlockAttend, then
BlockAssemble. Only standard opset-18 ops. Per block, memory is H * block * (keys it sees):
linear in L, never H * L^2. Causality skips the key blocks above the diagonal.
"""
from __future__ import annotations

from onnxscript import BOOL, FLOAT, INT64, script
from onnxscript import opset18 as op

from ...biases import MASK_PENALTY, SCORE_FLOOR
from ...biases.onnx_domain import posbias


@script(posbias, default_opset=op)
def PadQueries(q: FLOAT, k: FLOAT, q_pos: INT64, max_block: INT64):
    """Scale and pad the queries once: q_pad [B, H, n*Bq, d] (scaled by 1/sqrt(d)), q_pos_pad
    [..., n*Bq] (the last position repeated), block Bq = min(max_block, Lq), n_blocks,
    offset = Lk - Lq (queries are the last Lq key positions). Both bodies start with it (the
    GPU-shaped one hands the scaled queries to a fused op with scale 1).

    PyTorch: Bq = min(max_block, Lq); n = ceil(Lq / Bq); q_pad = F.pad(q / sqrt(d), (0, 0, 0, n*Bq - Lq))
    """
    q_len = op.Shape(q, start=2, end=3)  # [1]
    k_len = op.Shape(k, start=2, end=3)  # [1]
    head_dim = op.CastLike(op.Shape(q, start=3, end=4), q)  # [1]
    block = op.Min(op.Reshape(max_block, [1]), q_len)  # [1]
    n_blocks = op.Div(op.Sub(op.Add(q_len, block), [1]), block)  # [1], ceil division
    pad = op.Sub(op.Mul(n_blocks, block), q_len)  # [1]
    zero = op.Constant(value_ints=[0])
    q_pad = op.Pad(op.Div(q, op.Sqrt(head_dim)), op.Concat(zero, pad, axis=0), None, [2])  # [B, H, n*Bq, d]
    q_pos_pad = op.Pad(q_pos, op.Concat(zero, pad, axis=0), None, [-1], mode="edge")  # [..., n*Bq]
    offset = op.Sub(k_len, q_len)  # [1]
    return q_pad, q_pos_pad, op.Squeeze(block), op.Squeeze(n_blocks), op.Squeeze(offset)


@script(posbias, default_opset=op)
def BlockPrepare(q: FLOAT, k: FLOAT, v: FLOAT, q_pos: INT64, max_block: INT64):
    """PadQueries, and the keys transposed once for the blocks' MatMuls: q_pad, k_t [B, H, d, Lk],
    q_pos_pad, block, n_blocks, offset.

    PyTorch: PadQueries(...) and k.transpose(-1, -2)
    """
    q_pad, q_pos_pad, block, n_blocks, offset = PadQueries(q, k, q_pos, max_block)
    k_t = op.Transpose(k, perm=[0, 1, 3, 2])  # [B, H, d, Lk]
    return q_pad, k_t, q_pos_pad, block, n_blocks, offset


@script(posbias, default_opset=op)
def FitsOneBlock(q: FLOAT, max_block: INT64) -> BOOL:
    """True when the queries fit in one block (decode steps, short prompts): no Loop needed.

    PyTorch: q.shape[2] <= max_block
    """
    return op.LessOrEqual(op.Squeeze(op.Shape(q, start=2, end=3)), max_block)


@script(posbias, default_opset=op)
def DirectQueries(q: FLOAT, k: FLOAT):
    """All queries as one block, without Loop or padding: q scaled by 1/sqrt(d) [B, H, Lq, d],
    q_idx [Lq, 1] and k_idx [Lk] for the causal mask (both bodies' one-block branch).

    PyTorch: q / sqrt(d), arange(Lk - Lq, Lk)[:, None], arange(Lk)
    """
    q_len = op.Squeeze(op.Shape(q, start=2, end=3))  # scalar
    k_len = op.Squeeze(op.Shape(k, start=2, end=3))  # scalar
    head_dim = op.CastLike(op.Shape(q, start=3, end=4), q)  # [1]
    one = op.Constant(value_int=1)
    q_idx = op.Unsqueeze(op.Range(op.Sub(k_len, q_len), k_len, one), [1])  # [Lq, 1]
    k_idx = op.Range(op.Constant(value_int=0), k_len, one)  # [Lk]
    return op.Div(q, op.Sqrt(head_dim)), q_idx, k_idx


@script(posbias, default_opset=op)
def DirectPrepare(q: FLOAT, k: FLOAT):
    """DirectQueries, and k_t [B, H, d, Lk] (a Transpose ONNX Runtime fuses into the MatMul):
    q_scaled, k_t_all, q_idx, k_idx, without copies of the keys.

    PyTorch: q / sqrt(d), k.transpose(-1, -2), arange(Lk - Lq, Lk)[:, None], arange(Lk)
    """
    q_scaled, q_idx, k_idx = DirectQueries(q, k)
    return q_scaled, op.Transpose(k, perm=[0, 1, 3, 2]), q_idx, k_idx


@script(posbias, default_opset=op)
def DirectWindowKeys(q: FLOAT, k: FLOAT, v: FLOAT, k_pos: INT64, keep: BOOL, lookback: INT64):
    """The keys a local window lets the queries (the last Lq) see: [lo, Lk) with lo = max(0,
    Lk - Lq - lookback). A decode step then reads `lookback` cached keys, not the whole cache.

    Returns k_w, v_w [B, H, W, d], k_pos_w [..., W], keep_w [B|1, 1, 1, W].
    PyTorch: keys = slice(max(0, Lk - Lq - lookback), Lk); k[:, :, keys], v[:, :, keys], k_pos[..., keys], keep[..., keys]
    """
    q_len = op.Shape(q, start=2, end=3)  # [1]
    k_len = op.Shape(k, start=2, end=3)  # [1]
    lo = op.Max(op.Sub(op.Sub(k_len, q_len), op.Reshape(lookback, [1])), op.Constant(value_ints=[0]))  # [1]
    return (op.Slice(k, lo, k_len, [2]), op.Slice(v, lo, k_len, [2]), op.Slice(k_pos, lo, k_len, [-1]),
            op.Slice(keep, lo, k_len, [-1]))


@script(posbias, default_opset=op)
def BlockQueries(it: INT64, q_pad: FLOAT, q_pos_pad: INT64, block: INT64, offset: INT64):
    """Query block `it`: q_b [B, H, Bq, d], q_pos_b [..., Bq], and each row's index on the key
    axis, q_idx [Bq, 1] (= offset + row), which the causal mask compares with.

    PyTorch: rows = slice(it*Bq, (it+1)*Bq); q_pad[:, :, rows], q_pos_pad[..., rows], offset + arange(it*Bq, (it+1)*Bq)[:, None]
    """
    start = op.Reshape(op.Mul(it, block), [1])  # [1]
    stop = op.Add(start, op.Reshape(block, [1]))  # [1]
    q_b = op.Slice(q_pad, start, stop, [2])  # [B, H, Bq, d]
    q_pos_b = op.Slice(q_pos_pad, start, stop, [-1])  # [..., Bq]
    first = op.Squeeze(op.Add(start, offset))  # scalar
    q_idx = op.Unsqueeze(op.Range(first, op.Add(first, block), op.Constant(value_int=1)), [1])  # [Bq, 1]
    return q_b, q_pos_b, q_idx


@script(posbias, default_opset=op)
def BlockKeys(it: INT64, k_t: FLOAT, v: FLOAT, k_pos: INT64, keep: BOOL, block: INT64, offset: INT64,
              lookback: INT64, lookahead: INT64):
    """The keys query block `it` can see: [lo, end) with end = min(Lk, offset + (it+1)*Bq +
    lookahead) (causal: lookahead 0, nothing above the diagonal; bidirectional: a window's
    reach, or >= Lk for all keys) and lo = max(0, offset + it*Bq - lookback) (a local window
    sees at most `lookback` keys before its first query; others pass a lookback >= Lk).

    Returns k_t_b [B, H, d, W], v_b [B, H, W, d], k_pos_b [..., W], k_idx [W], keep_b [B|1, 1, 1, W].

    PyTorch: keys = slice(lo, end); k_t[..., keys], v[:, :, keys], k_pos[..., keys], arange(lo, end), keep[..., keys]
    """
    k_len = op.Shape(k_t, start=3, end=4)  # [1]
    first = op.Reshape(op.Add(op.Mul(it, block), offset), [1])  # [1] key index of the first query
    end = op.Min(op.Add(op.Add(first, op.Reshape(block, [1])), op.Reshape(lookahead, [1])), k_len)  # [1]
    lo = op.Max(op.Sub(first, op.Reshape(lookback, [1])), op.Constant(value_ints=[0]))  # [1]
    k_t_b = op.Slice(k_t, lo, end, [3])  # [B, H, d, W]
    v_b = op.Slice(v, lo, end, [2])  # [B, H, W, d]
    k_pos_b = op.Slice(k_pos, lo, end, [-1])  # [..., W]
    keep_b = op.Slice(keep, lo, end, [-1])  # [B|1, 1, 1, W]
    k_idx = op.Range(op.Squeeze(lo), op.Squeeze(end), op.Constant(value_int=1))  # [W]
    return k_t_b, v_b, k_pos_b, k_idx, keep_b


@script(posbias, default_opset=op)
def BlockKeysTwoSided(it: INT64, k_t: FLOAT, v: FLOAT, k_pos: INT64, keep: BOOL, block: INT64, offset: INT64):
    """Query block `it`'s keys for the two-sided fold (bidirectional, all keys): the keys up to
    its last row, [0, split) with split = min(Lk, first + Bq), then again those from its first
    row on, [first, Lk); the Bq keys between appear twice, once per side of the diagonal.

    Returns k_t_b [B, H, d, W], v_b [B, H, W, d], k_pos_left [..., W1], k_pos_right [..., W2],
    k_idx_left [W1], k_idx_right [W2], keep_b [B|1, 1, 1, W] with W = W1 + W2 = split + Lk - first.

    PyTorch: left, right = slice(0, split), slice(first, Lk); cat([k_t[..., left], k_t[..., right]], -1), ...
    """
    k_len = op.Shape(k_t, start=3, end=4)  # [1]
    zero = op.Constant(value_ints=[0])
    first = op.Reshape(op.Add(op.Mul(it, block), offset), [1])  # [1] key index of the first query
    split = op.Min(op.Add(first, op.Reshape(block, [1])), k_len)  # [1]
    k_t_b = op.Concat(op.Slice(k_t, zero, split, [3]), op.Slice(k_t, first, k_len, [3]), axis=3)  # [B, H, d, W]
    v_b = op.Concat(op.Slice(v, zero, split, [2]), op.Slice(v, first, k_len, [2]), axis=2)  # [B, H, W, d]
    keep_b = op.Concat(op.Slice(keep, zero, split, [-1]), op.Slice(keep, first, k_len, [-1]), axis=-1)  # [B|1, 1, 1, W]
    one = op.Constant(value_int=1)
    k_idx_left = op.Range(op.Constant(value_int=0), op.Squeeze(split), one)  # [W1]
    k_idx_right = op.Range(op.Squeeze(first), op.Squeeze(k_len), one)  # [W2]
    return (k_t_b, v_b, op.Slice(k_pos, zero, split, [-1]), op.Slice(k_pos, first, k_len, [-1]),
            k_idx_left, k_idx_right, keep_b)


@script(posbias, default_opset=op)
def DistanceTablePositions(k: FLOAT, block: INT64, lookahead: INT64):
    """Positions whose bias is the table every query block slices its own from, for a relative
    family (bias a function of i - j) with positions = indices: rows r = 0..Bq-1 and columns
    m - Lk for m = 0..M-1, M = Lk + min(Lk, Bq + lookahead), so that table[h, r, m] =
    g_h(r - m + Lk) covers every (query, key) pair of every block. Evaluating the family's own
    function on these is H*Bq*M values instead of H*L^2/2 (causal) across the Loop.

    PyTorch: arange(Bq), arange(Lk + min(Lk, Bq + lookahead)) - Lk
    """
    k_len = op.Squeeze(op.Shape(k, start=2, end=3))  # scalar Lk
    one = op.Constant(value_int=1)
    zero = op.Constant(value_int=0)
    ahead = op.Min(k_len, op.Add(block, lookahead))  # scalar
    rows = op.Range(zero, block, one)  # [Bq]
    cols = op.Sub(op.Range(zero, op.Add(k_len, ahead), one), k_len)  # [M]
    return rows, cols


@script(posbias, default_opset=op)
def DistanceVectorPositions(k: FLOAT, block: INT64, lookahead: INT64):
    """The positions of the distance table's generating vector: table[h, r, m] = g_h(r - m + Lk)
    depends on r - m alone, so the family's function runs on ONE query position (Bq - 1) and
    T = Bq - 1 + M key positions, and a Gather expands it: row [Bq - 1], cols [T] with
    cols[t] = t - Lk, and gather indices idx [Bq, M], idx[r, m] = Bq - 1 - r + m, so that
    vector[t] = g(Bq - 1 - cols[t]) = g(r - m + Lk) at t = idx[r, m]. M = Lk + min(Lk, Bq + lookahead).

    PyTorch: [Bq - 1], arange(Bq - 1 + M) - Lk, (Bq - 1 - arange(Bq))[:, None] + arange(M)
    """
    k_len = op.Squeeze(op.Shape(k, start=2, end=3))  # scalar Lk
    one = op.Constant(value_int=1)
    zero = op.Constant(value_int=0)
    last = op.Sub(block, one)  # scalar Bq - 1
    width = op.Add(k_len, op.Min(k_len, op.Add(block, lookahead)))  # scalar M
    row = op.Reshape(last, [1])  # [1]
    cols = op.Sub(op.Range(zero, op.Add(last, width), one), k_len)  # [T]
    idx = op.Add(op.Unsqueeze(op.Sub(last, op.Range(zero, block, one)), [1]), op.Range(zero, width, one))  # [Bq, M]
    return row, cols, idx


@script(posbias, default_opset=op)
def ExpandDistanceVector(vector: FLOAT, idx: INT64) -> FLOAT:
    """vector [H|1, 1, T] -> table [H|1, Bq, M], table[h, r, m] = vector[h, 0, idx[r, m]]: one
    pass writing the table in the vector's dtype (the family's passes ran on T values only).

    PyTorch: vector[:, 0, idx]
    """
    return op.Squeeze(op.Gather(vector, idx, axis=2), [1])  # [H|1, 1, Bq, M] -> [H|1, Bq, M]


@script(posbias, default_opset=op)
def SliceByDistance(table: FLOAT, it: INT64, block: INT64, offset: INT64, lookback: INT64, k_idx: INT64,
                    k: FLOAT) -> FLOAT:
    """One block's bias as a slice of the distance table: table [H|1, Bq, M], query block `it`'s
    keys k_idx [W] (BlockKeys: [lo, lo + W)) -> [H|1, Bq, W]. Row r, key j:
    table[h, r, j - q0 + Lk] = g_h(q0 + r - j), q0 = it * Bq + offset the block's first query index.
    The bounds come from the scalars, as BlockKeys computes them, not from the index tensors'
    values: ONNX Runtime CUDA would copy those back to the host, which asynchronous launches can
    read stale.

    PyTorch: q0 = it * Bq + offset; lo = max(q0 - lookback, 0); start = lo - q0 + Lk; table[..., start:start + W]
    """
    k_len = op.Shape(k, start=2, end=3)  # [1]
    q0 = op.Reshape(op.Add(op.Mul(it, block), offset), [1])  # [1]
    lo = op.Max(op.Sub(q0, op.Reshape(lookback, [1])), op.Constant(value_ints=[0]))  # [1]
    start = op.Add(op.Sub(lo, q0), k_len)  # [1]
    stop = op.Add(start, op.Shape(k_idx))  # [1]
    return op.Slice(table, start, stop, [-1])  # [H|1, Bq, W]


@script(posbias, default_opset=op)
def NearVectorPositions(block: INT64, far: INT64):
    """The generating vector's positions of a near-far body's table: only the keys within `far`
    of some query of a block are ever read from it, so its columns c = 0..N-1 (N = Bq + 2 far - 1)
    stand for the keys first - far + 1 + c, whatever the block: table[h, r, c] = g_h(r + far - 1 - c),
    the family's function on one query position (Bq - 1) and T = Bq - 1 + N key positions
    cols[t] = t + 1 - far, expanded by idx[r, c] = Bq - 1 - r + c. [H, Bq, N] however long the input.

    PyTorch: [Bq - 1], arange(Bq - 1 + N) + 1 - far, (Bq - 1 - arange(Bq))[:, None] + arange(N)
    """
    one = op.Constant(value_int=1)
    zero = op.Constant(value_int=0)
    last = op.Sub(block, one)  # scalar Bq - 1
    width = op.Sub(op.Add(block, op.Add(far, far)), one)  # scalar N
    cols = op.Sub(op.Add(op.Range(zero, op.Add(last, width), one), one), far)  # [T]
    idx = op.Add(op.Unsqueeze(op.Sub(last, op.Range(zero, block, one)), [1]), op.Range(zero, width, one))  # [Bq, N]
    return op.Reshape(last, [1]), cols, idx


@script(posbias, default_opset=op)
def FarPositions(far: INT64):
    """Positions at which a family's far constants sit (AttentionBias.far_distance): one query
    at `far`, keys 0 (a distance of `far` before it) and 2 far (after it): the family's function
    on them gives [H|1, 1, 2], the bias of every key at least `far` before / after its query.

    PyTorch: [far], [0, 2 far]
    """
    at = op.Reshape(far, [1])  # [1]
    return at, op.Concat(op.Constant(value_ints=[0]), op.Add(at, at), axis=0)  # [1], [2]


@script(posbias, default_opset=op)
def FarKeys(k_t: FLOAT, far_bias: FLOAT) -> FLOAT:
    """The transposed keys with two more rows, the far constants before and after (far_bias
    [H|1, 1, 2]): k_t [B, H, d, Lk] -> [B, H, d + 2, Lk]. A query with the columns [q, 1, 0]
    then gets q.k + the constant before it, [q, 0, 1] the one after it, inside the MatMul.

    PyTorch: cat([k_t, far_bias.transpose(-1, -2)[..., None].expand(B, H, 2, Lk)], -2)
    """
    rows = op.Unsqueeze(op.Squeeze(far_bias, [1]), [-1])  # [H|1, 2, 1]
    shape = op.Concat(op.Shape(k_t, start=0, end=2), op.Constant(value_ints=[2]), op.Shape(k_t, start=3, end=4), axis=0)
    return op.Concat(k_t, op.Expand(op.CastLike(rows, k_t), shape), axis=2)  # [B, H, d + 2, Lk]


@script(posbias, default_opset=op)
def NearFarScores(it: INT64, q_b: FLOAT, k_t_ext: FLOAT, v: FLOAT, keep: BOOL, table: FLOAT, block: INT64,
                  offset: INT64, far: INT64, lookahead: INT64):
    """Query block `it`'s scores with a far-constant family's bias (positions = indices), float32:
    the keys at least `far` before every query of the block, [0, lo), get the constant before
    inside the MatMul ([q, 1, 0] k_t_ext), those at least `far` after every query, [hi, end),
    the constant after ([q, 0, 1] k_t_ext), and only the keys between, [lo, hi), add a slice of the
    (masked) near table (NearVectorPositions: column c is key first - far + 1 + c): H x Bq x (hi - lo)
    bias values per block instead of H x Bq x end. first = it Bq + offset, end = min(Lk, first + Bq
    + lookahead), hi = min(end, first + Bq - 1 + far), lo = clamp(first - far + 1, 0, hi).

    Returns scores [B, H, Bq, end], v_b [B, H, end, d], keep_b [B|1, 1, 1, end].
    PyTorch: cat([q1 @ k_ext[..., :lo], q @ k_t[..., lo:hi] + near[..., s:s + hi - lo], q2 @ k_ext[..., hi:end]], -1)
    """
    k_len = op.Shape(k_t_ext, start=3, end=4)  # [1]
    head_dim = op.Sub(op.Shape(k_t_ext, start=2, end=3), op.Constant(value_ints=[2]))  # [1]
    one = op.Constant(value_ints=[1])
    zero = op.Constant(value_ints=[0])
    rows = op.Reshape(block, [1])  # [1]
    first = op.Reshape(op.Add(op.Mul(it, block), offset), [1])  # [1] key index of the first query
    end = op.Min(op.Add(op.Add(first, rows), op.Reshape(lookahead, [1])), k_len)  # [1]
    hi = op.Min(end, op.Add(op.Sub(op.Add(first, rows), one), op.Reshape(far, [1])))  # [1]
    lo = op.Max(zero, op.Min(hi, op.Add(op.Sub(first, op.Reshape(far, [1])), one)))  # [1]
    ones = op.Expand(op.CastLike(op.Constant(value_float=1.0), q_b), op.Concat(op.Shape(q_b, start=0, end=3), one, axis=0))
    zeros = op.Sub(ones, ones)  # [B, H, Bq, 1]
    before = op.MatMul(op.Concat(q_b, ones, zeros, axis=-1), op.Slice(k_t_ext, zero, lo, [3]))  # [B, H, Bq, lo]
    start = op.Sub(op.Add(op.Sub(lo, first), op.Reshape(far, [1])), one)  # [1] the near table's column of key lo
    near_bias = op.Slice(table, start, op.Add(start, op.Sub(hi, lo)), [-1])  # [H|1, Bq, hi - lo]
    near_keys = op.Slice(k_t_ext, op.Concat(zero, lo, axis=0), op.Concat(head_dim, hi, axis=0), [2, 3])  # [B, H, d, hi - lo]
    near = op.Add(op.MatMul(q_b, near_keys), near_bias)  # [B, H, Bq, hi - lo]
    after = op.MatMul(op.Concat(q_b, zeros, ones, axis=-1), op.Slice(k_t_ext, hi, end, [3]))  # [B, H, Bq, end - hi]
    scores = op.Concat(before, near, after, axis=-1)  # [B, H, Bq, end]
    return scores, op.Slice(v, zero, end, [2]), op.Slice(keep, zero, end, [-1])


@script(posbias, default_opset=op)
def MaskTable(rows: INT64, cols: INT64) -> FLOAT:
    """The causal mask alone as a distance table, once per call, for a family whose bias goes
    into the MatMul (folded key row): 0 where cols[m] <= r, else MASK_PENALTY.

    rows [Bq], cols [M] -> [1, Bq, M]
    PyTorch: where(cols[None, :] <= rows[:, None], 0, -1e30)[None]
    """
    allowed = op.LessOrEqual(cols, op.Unsqueeze(rows, [1]))  # [Bq, M]
    return op.Unsqueeze(op.Where(allowed, op.Constant(value_float=0.0), op.Constant(value_float=MASK_PENALTY)), [0])


@script(posbias, default_opset=op)
def MaskFutureInTable(table: FLOAT, rows: INT64, cols: INT64) -> FLOAT:
    """The causal mask folded into the distance table (or its generating vector), once per call:
    entry (r, m) is a key after its query when cols[m] > r (distance r - cols[m] < 0), and gets
    MASK_PENALTY there, so a block's slice already carries its causal mask (one [H, Bq, W] Add
    and a Where per block fewer).

    table [H|1, Bq, M], rows [Bq], cols [M] -> [H|1, Bq, M] (a vector: rows [1], [H|1, 1, T])
    PyTorch: table + where(cols[None, :] <= rows[:, None], 0, -1e30)
    """
    return op.Add(table, MaskTable(rows, cols))


@script(posbias, default_opset=op)
def HasPadding(keep: BOOL) -> BOOL:
    """True when some key is padding (keep [B|1, 1, 1, Lk] has a false), checked once per call so
    unpadded inputs skip the padding penalty in every block.

    PyTorch: not keep.all()

    Counted from the SHAPE of NonZero's output, not from a reduction's value: a shape is known on
    the host, so ONNX Runtime CUDA computes the If's condition there instead of copying a GPU
    value back, which it can read before the GPU wrote it (export/hoist.py, benchmarks/gpu_cure.md).
    """
    padded = op.Shape(op.NonZero(op.Not(keep)), start=1, end=2)  # [1]: how many keys are padding
    return op.Squeeze(op.Greater(padded, op.Constant(value_ints=[0])))


@script(posbias, default_opset=op)
def AddPaddingPenalty(bias: FLOAT, keep_b: BOOL) -> FLOAT:
    """bias [H|1, Bq, W] plus MASK_PENALTY on padding keys (keep_b [B|1, 1, 1, W]) -> [B|1, H|1, Bq, W].

    PyTorch: bias + where(keep_b, 0, -1e30)
    """
    return op.Add(bias, op.Where(keep_b, op.Constant(value_float=0.0), op.Constant(value_float=MASK_PENALTY)))


@script(posbias, default_opset=op)
def FlooredSoftmax(scores: FLOAT) -> FLOAT:
    """Softmax over the last axis after flooring each score at its row's maximum minus
    SCORE_FLOOR (64): no probability is then a subnormal float32, which Intel cores process
    through a slow assist in this Softmax and again in the MatMul with V, in every session that
    does not set session.set_denormal_as_zero (no client does). A key whose weight was below
    e^-64 of the row's largest gets that weight: outputs move by at most W * 1.6e-28 * max|v|
    (biases/base.py: SCORE_FLOOR). Two passes over the scores, free while a block's scores
    stay in cache (measured in benchmarks/attention.md).

    scores [..., W] float32 -> [..., W]
    PyTorch: softmax(maximum(s, s.amax(-1, keepdim=True) - 64), -1)
    """
    floor = op.Sub(op.ReduceMax(scores, [-1], keepdims=1), op.CastLike(SCORE_FLOOR, scores))  # [..., 1]
    return op.Softmax(op.Max(scores, floor), axis=-1)  # [..., W]


@script(posbias, default_opset=op)
def AttendScores(scores: FLOAT, v_b: FLOAT) -> FLOAT:
    """softmax(scores) v_b for scores that carry their bias and masks already: [B, H, Bq, W] x
    [B, H, W, d] -> [B, H, Bq, d].

    PyTorch: softmax(scores, -1) @ v_b
    """
    return op.MatMul(FlooredSoftmax(scores), v_b)


@script(posbias, default_opset=op)
def BlockAttendMasked(q_b: FLOAT, k_t_b: FLOAT, v_b: FLOAT, bias: FLOAT) -> FLOAT:
    """softmax(q_b k_b^T + bias) v_b, [B, H, Bq, d], for a bias that already carries the masks
    (a slice of a masked distance table): one Add over the scores instead of BlockAttend's two.

    PyTorch: softmax((q_b @ k_t_b).float() + bias, -1).to(v_b.dtype) @ v_b
    """
    scores = op.Add(op.Cast(op.MatMul(q_b, k_t_b), to=1), bias)  # [B, H, Bq, W] float32
    probs = FlooredSoftmax(scores)  # [B, H, Bq, W]
    return op.MatMul(op.CastLike(probs, v_b), v_b)  # [B, H, Bq, d]


@script(posbias, default_opset=op)
def BlockAttendFolded(q_b: FLOAT, k_t_b: FLOAT, v_b: FLOAT, key_row: FLOAT, mask: FLOAT) -> FLOAT:
    """softmax(q_b k_b^T + key_row + mask) v_b with the key row inside the MatMul: q_b gets a
    column of ones and k_t_b the row, so [q_b, 1] [k_t_b; key_row] = q_b k_t_b + key_row
    without an [B, H, Bq, W] Add; the mask (a slice of MaskTable, masks folded) is the one Add.

    q_b [B, H, Bq, d], k_t_b [B, H, d, W], key_row [.., H, 1, W], mask [B|1, 1, Bq, W] -> [B, H, Bq, d]
    PyTorch: s = cat([q_b, 1], -1) @ cat([k_t_b, key_row], -2) + mask; softmax(s, -1) @ v_b
    """
    ones_shape = op.Concat(op.Shape(q_b, start=0, end=3), op.Constant(value_ints=[1]), axis=0)  # [4]
    q_ext = op.Concat(q_b, op.Expand(op.CastLike(op.Constant(value_float=1.0), q_b), ones_shape), axis=-1)  # [B, H, Bq, d+1]
    row_shape = op.Concat(op.Shape(k_t_b, start=0, end=2), op.Constant(value_ints=[1]), op.Shape(k_t_b, start=3, end=4), axis=0)
    k_ext = op.Concat(k_t_b, op.Expand(op.CastLike(key_row, k_t_b), row_shape), axis=2)  # [B, H, d+1, W]
    scores = op.Add(op.MatMul(q_ext, k_ext), mask)  # [B, H, Bq, W]
    return op.MatMul(FlooredSoftmax(scores), v_b)  # [B, H, Bq, d]


@script(posbias, default_opset=op)
def BlockAttendTwoSided(q_b: FLOAT, k_t_b: FLOAT, v_b: FLOAT, row_left: FLOAT, row_right: FLOAT, row_q: FLOAT,
                        q_idx: INT64, k_idx_left: INT64, k_idx_right: INT64, keep_b: BOOL) -> FLOAT:
    """Bidirectional attention with a mirrored key-row bias (ALiBi: -m|i - j|), the row inside
    the MatMul on both sides of the diagonal. With r(j) the block's key row (m(j - p0)):
    keys j <= i: -m(i - j) = r(j) - r(i); keys j > i: -m(j - i) = -r(j) + 2 r(i) - r(i). Softmax
    ignores the row constant -r(i), so [q, 1, 2 r(i)] [k^T; r(j); 0] on the left copy of the
    keys and [q, 1, 2 r(i)] [k^T; -r(j); 1] on the right copy give the bias; a one-head mask keeps
    each copy to its side (left: j <= i, right: j > i) and drops padding. |r| <= m*Bq/2 near
    the diagonal, so float32 rounding stays small there (as BlockAttendFolded).

    q_b [B, H, Bq, d], k_t_b [B, H, d, W1 + W2], v_b [B, H, W1 + W2, d], row_left [.., H, 1, W1],
    row_right [.., H, 1, W2], row_q [.., H, 1, Bq] (the row at the queries' own positions),
    q_idx [Bq, 1], k_idx_left [W1], k_idx_right [W2], keep_b [B|1, 1, 1, W1 + W2] -> [B, H, Bq, d]
    PyTorch: s = cat([q_b, 1, 2 r_q], -1) @ cat([k_t_b, cat([r_l, -r_r], -1), cat([0, 1], -1)], -2) + mask; softmax(s, -1) @ v_b
    """
    ones_shape = op.Concat(op.Shape(q_b, start=0, end=3), op.Constant(value_ints=[1]), axis=0)  # [4]
    column_shape = op.Concat(op.Shape(row_q, start=0, end=-2), op.Shape(row_q, start=-1), op.Constant(value_ints=[1]), axis=0)
    twice_row_q = op.Reshape(op.Add(row_q, row_q), column_shape)  # [.., H, Bq, 1]
    q_ext = op.Concat(q_b, op.Expand(op.CastLike(op.Constant(value_float=1.0), q_b), ones_shape),
                      op.Expand(op.CastLike(twice_row_q, q_b), ones_shape), axis=-1)  # [B, H, Bq, d+2]
    left = op.Concat(row_left, op.Sub(row_left, row_left), axis=-2)  # [.., H, 2, W1]: r(j), 0
    right = op.Concat(op.Neg(row_right), op.Add(op.Sub(row_right, row_right), op.Constant(value_float=1.0)), axis=-2)  # [.., H, 2, W2]: -r(j), 1
    rows_shape = op.Concat(op.Shape(k_t_b, start=0, end=2), op.Constant(value_ints=[2]), op.Shape(k_t_b, start=3, end=4), axis=0)
    rows = op.Expand(op.CastLike(op.Concat(left, right, axis=-1), k_t_b), rows_shape)  # [B, H, 2, W]
    k_ext = op.Concat(k_t_b, rows, axis=2)  # [B, H, d+2, W]
    sides = op.Concat(op.LessOrEqual(k_idx_left, q_idx), op.Greater(k_idx_right, q_idx), axis=-1)  # [Bq, W]
    mask = op.Where(op.And(sides, keep_b), op.Constant(value_float=0.0), op.Constant(value_float=MASK_PENALTY))  # [B|1, 1, Bq, W]
    scores = op.Add(op.Cast(op.MatMul(q_ext, k_ext), to=1), mask)  # [B, H, Bq, W] float32
    probs = FlooredSoftmax(scores)  # [B, H, Bq, W]
    return op.MatMul(op.CastLike(probs, v_b), v_b)  # [B, H, Bq, d]


@script(posbias, default_opset=op)
def BlockAttend(q_b: FLOAT, k_t_b: FLOAT, v_b: FLOAT, bias: FLOAT, q_idx: INT64, k_idx: INT64, keep_b: BOOL) -> FLOAT:
    """softmax(q_b k_b^T + bias + mask) v_b for one block, [B, H, Bq, d]. Scores, bias and
    softmax in float32 whatever the model dtype (as the plain form).

    The causal/padding mask is ADDED (0 or MASK_PENALTY = -1e30), and to the bias first: a
    Where over the full [B, H, Bq, W] scores was 27% of the kernel time at L=8192 (ORT profile),
    and a head-independent bias plus the mask stays [.., 1, Bq, W]. -1e30 absorbs any score (a
    masked key gets exp(-1e30 - max) = 0) yet cannot overflow to -inf even on top of a bias that
    masks with the float32 lowest value, so a fully masked row stays finite (uniform).

    PyTorch: s = (q_b @ k_t_b).float() + (bias + where((k_idx <= q_idx) & keep_b, 0, -1e30)); softmax(s, -1).to(v_b.dtype) @ v_b
    """
    allowed = op.And(op.LessOrEqual(k_idx, q_idx), keep_b)  # [B|1, 1, Bq, W]
    penalty = op.Where(allowed, op.Constant(value_float=0.0), op.Constant(value_float=MASK_PENALTY))  # [B|1, 1, Bq, W]
    scores = op.Add(op.Cast(op.MatMul(q_b, k_t_b), to=1), op.Add(bias, penalty))  # [B, H, Bq, W] float32
    probs = FlooredSoftmax(scores)  # [B, H, Bq, W]
    return op.MatMul(op.CastLike(probs, v_b), v_b)  # [B, H, Bq, d]


@script(posbias, default_opset=op)
def BlockAssemble(blocks: FLOAT, q: FLOAT, block: INT64) -> FLOAT:
    """Loop scan output -> [B, H, Lq, d] (padding rows dropped). Each iteration emits
    [1, B, H, Bq, d]: ONNX Runtime stacks those on a new axis ([n, 1, B, H, Bq, d]), the ONNX
    reference evaluator concatenates them ([n, B, H, Bq, d]); the spec's wording allows both
    (onnx/onnx#3122). Same elements in the same order, so an explicit reshape serves both.

    PyTorch: blocks.reshape(n, B, H, Bq, d).permute(1, 2, 0, 3, 4).reshape(B, H, n*Bq, d)[:, :, :Lq]
    """
    batch_heads = op.Shape(q, start=0, end=2)  # [2]
    head_dim = op.Shape(q, start=3, end=4)  # [1]
    per_block = op.Concat(op.Constant(value_ints=[-1]), batch_heads, op.Reshape(block, [1]), head_dim, axis=0)  # [5]
    stacked = op.Reshape(blocks, per_block)  # [n, B, H, Bq, d]
    joined_shape = op.Concat(batch_heads, op.Constant(value_ints=[-1]), head_dim, axis=0)  # [4]
    joined = op.Reshape(op.Transpose(stacked, perm=[1, 2, 0, 3, 4]), joined_shape)  # [B, H, n*Bq, d]
    return op.Slice(joined, [0], op.Shape(q, start=2, end=3), [2])  # [B, H, Lq, d]


BLOCK_FUNCTIONS = (FlooredSoftmax, FitsOneBlock, DirectQueries, DirectPrepare, DirectWindowKeys, PadQueries, BlockPrepare, BlockQueries, BlockKeys, BlockKeysTwoSided,
                   DistanceTablePositions, DistanceVectorPositions, ExpandDistanceVector, SliceByDistance, NearVectorPositions,
                   FarPositions,
                   FarKeys, NearFarScores, AttendScores, MaskTable,
                   MaskFutureInTable, HasPadding, AddPaddingPenalty, BlockAttend, BlockAttendMasked, BlockAttendFolded, BlockAttendTwoSided, BlockAssemble)
