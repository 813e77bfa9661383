"""Which tiles a program visits: one iterator for dense, causal and block-sparse attention.

Every kernel walks its tiles in two runs: first the tiles that need no element mask (wholly
visible and inside both sequences), then those that do (the causal diagonal, the ragged last
tile, the partial tiles of a mask mod, whose element masks ``mods.py`` reads). A program asks
once how many tiles there are of each kind, then for the t-th one:

    num, num_full, u0, a0, na, b0, idx_row, e0 = kv_tiles(i, b, h, LISTS, ELEM, ...)
    for t in range(0, num_full):              # no element mask
        j = full_tile(t, u0, idx_row, LISTS)
    for t in range(num_full, num):            # masked
        j = masked_tile(t, num_full, a0, na, b0, idx_row, LISTS)

With a block mask the tiles come from its lists (``sparse.kernel_lists``; LISTS is None
without one: for each row the num_full unmasked tiles first, then the rest, as FlexAttention's
full and partial blocks); without one they follow from the geometry: the unmasked tiles form
one run starting at tile u0, the masked ones at most two runs (na tiles from a0, then the rest
from b0). This is the GPU
twin of ``TileMask`` in ``flashedu.tiled``: the NumPy loops ask the same question per tile.
Split-KV decoding (decode.py) walks one chunk of keys the same way (``chunk_tiles``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sequence(SEQS, b, H, Nq, Nk):
    """Where a program's rows lie: (q0, k0, base, Nq, Nk, diag), its sequence's first query
    and key row in Q and K, where its rows begin in the row tensors L and D (head h's at base
    + h * Nq, Nq as given), the sequence's lengths, and where its causal diagonal runs: query
    row r sees keys up to r + diag (0: top-left, as SDPA's is_causal; packed sequences are
    aligned to their bottom right, as flash-attn's varlen: diag = Nk - Nq).
    Packed sequences (SEQS = (cu_seqlens_q, cu_seqlens_k, longest q, longest k)): b is the
    sequence, whose rows are cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 of the packed
    (1, H, total, d) tensors (Nq, Nk: the totals), as flash-attn's varlen kernels read them;
    otherwise batch b of (B, H, Nq, d). The first rows come in 64 bits: a row times a row
    stride passes 2**31 in a batch of a few million tokens."""
    if SEQS is not None:
        q0 = tl.load(SEQS[0] + b)
        k0 = tl.load(SEQS[1] + b)
        Lq = tl.load(SEQS[0] + b + 1) - q0
        Lk = tl.load(SEQS[1] + b + 1) - k0
        return q0.to(tl.int64), k0.to(tl.int64), q0, Lq, Lk, Lk - Lq
    else:
        return 0, 0, b * H * Nq, Nq, Nk, 0


@triton.jit
def starts_inside(SEQS, b, start, AXIS: tl.constexpr):
    """Whether a tile whose first row is ``start`` (queries: AXIS 0, keys: 1) begins inside
    packed sequence b (``sequence``); always, without packed sequences."""
    if SEQS is not None:
        return start < tl.load(SEQS[AXIS] + b + 1) - tl.load(SEQS[AXIS] + b)
    else:
        return True


@triton.jit
def listed(row, b, h, LISTS, ELEM):
    """(num, num_full, idx_row, e0) of one row of a block mask's lists (``sparse.kernel_lists``):
    the row's tile count, how many of them need no element mask, where its indices are, and
    (with element masks, ELEM) the index of its first element mask less num_full, so that
    masked tile t (t >= num_full) has its element mask at e0 + t."""
    NUM, FULL, IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ir = LISTS
    num = tl.load(NUM + b * stride_nb + h * stride_nh + row)
    num_full = tl.load(FULL + b * stride_nb + h * stride_nh + row)
    e0 = 0
    if ELEM is not None:  # (E, E_base): E_base is laid out like NUM
        e0 = tl.load(ELEM[1] + b * stride_nb + h * stride_nh + row) - num_full
    return num, num_full, IDX + b * stride_ib + h * stride_ih + row * stride_ir, e0


@triton.jit
def kv_tiles(i, b, h, LISTS, ELEM, Nq, Nk, diag, Br: tl.constexpr, Bc: tl.constexpr,
             IS_CAUSAL: tl.constexpr):
    """The K/V tiles that Q tile i (rows i*Br ..) visits, for the forward and the dQ pass:
    (num, num_full, u0, a0, na, b0, idx_row, e0), from the lists or (LISTS None) the geometry.

    Dense: tiles [0, num_full) lie wholly before the first query row's diagonal and inside Nk;
    [num_full, num) hold the diagonal or the ragged edge; tiles past the last row's diagonal
    are not visited at all. Causal: query row r sees keys up to r + diag (``sequence``); a
    tile whose rows see no key has none to visit."""
    u0 = 0
    a0 = 0
    na = 0
    b0 = 0
    idx_row = 0
    e0 = 0
    if LISTS is not None:
        num, num_full, idx_row, e0 = listed(i, b, h, LISTS, ELEM)
    else:
        if IS_CAUSAL:  # (the counts clamped at 0: rows before the diagonal see nothing)
            end = tl.maximum(tl.minimum(Nk, (i + 1) * Br + diag), 0)  # keys < this are seen
            num_full = tl.maximum(tl.minimum(i * Br + 1 + diag, Nk), 0) // Bc  # seen by all
        else:
            end = Nk
            num_full = Nk // Bc
        num = tl.cdiv(end, Bc)
        a0 = num_full
        na = num - num_full
    return num, num_full, u0, a0, na, b0, idx_row, e0


@triton.jit
def q_tiles(j, b, h, LISTS, ELEM, Nq, Nk, diag, Br: tl.constexpr, Bc: tl.constexpr,
            IS_CAUSAL: tl.constexpr):
    """The Q tiles that see K/V tile j (keys j*Bc ..), for the dK/dV pass (returns as
    ``kv_tiles``).

    Dense: the masked ones are the tiles crossing the causal diagonal (a run from a0) and the
    ragged last tile (from b0); the unmasked ones lie between them. Rows before the tile's first
    key see none of it and are not visited."""
    u0 = 0
    a0 = 0
    na = 0
    b0 = 0
    idx_row = 0
    e0 = 0
    if LISTS is not None:
        num, num_full, idx_row, e0 = listed(j, b, h, LISTS, ELEM)
    else:
        Tr = tl.cdiv(Nq, Br)
        full_end = Nq // Br  # tiles from full_end on hold rows past Nq
        if IS_CAUSAL:  # row r sees keys up to r + diag
            # the first tile with a row that sees key j*Bc
            a0 = tl.maximum(j * Bc - diag, 0) // Br
            # tiles from diag_end on see all of the tile's keys, its last one included
            diag_end = tl.minimum(tl.cdiv(tl.maximum(j * Bc + Bc - 1 - diag, 0), Br), Tr)
            na = tl.maximum(diag_end - a0, 0)
            u0 = diag_end
            num_full = tl.maximum(full_end - diag_end, 0)
            b0 = tl.maximum(diag_end, full_end)
        else:
            num_full = full_end
            b0 = full_end
        num = na + num_full + (Tr - b0)
    return num, num_full, u0, a0, na, b0, idx_row, e0


@triton.jit
def chunk_tiles(lo, hi, Nq, Nk, Bc: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """The K/V tiles of keys [lo, hi) (lo a multiple of Bc) for split-KV decoding, whose
    queries sit at the end of the cache (query n at position Nk - Nq + n, bottom-right causal):
    unmasked the tiles every query sees whole, masked the one that holds the first query's
    diagonal and those after it, and the ragged tile at Nk."""
    if IS_CAUSAL:
        seen_by_all = tl.minimum(hi, Nk - Nq + 1)  # keys < this are visible to every query
    else:
        seen_by_all = hi
    num_full = tl.maximum(seen_by_all - lo, 0) // Bc
    num = tl.cdiv(hi - lo, Bc)
    u0 = lo // Bc
    return num, num_full, u0, u0 + num_full, num - num_full, 0, 0, 0


@triton.jit
def full_tile(t, u0, idx_row, LISTS):
    """The t-th tile (t < num_full) of a program's unmasked run."""
    if LISTS is not None:
        return tl.load(idx_row + t)
    else:
        return u0 + t


@triton.jit
def masked_tile(t, num_full, a0, na, b0, idx_row, LISTS):
    """The t-th tile (num_full <= t < num) of a program's masked tiles."""
    if LISTS is not None:
        return tl.load(idx_row + t)
    else:
        k = t - num_full
        return tl.where(k < na, a0 + k, b0 + k - na)


@triton.jit
def element_origin(ELEM, e0, t, q0, k0, Br: tl.constexpr, Bc: tl.constexpr):
    """Masked tile t's element mask (queries by keys, Br x Bc, stored at E + (e0 + t) Br Bc),
    shifted by the tile's first query q0 and key k0: the entry of (query, key) is then at
    origin + query * Bc + key, which reads it in either orientation of the tile."""
    return ELEM[0] + (e0 + t) * (Br * Bc) - q0 * Bc - k0
