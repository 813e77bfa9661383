"""Split-KV decoding ("flash-decoding"): a few queries against a long K/V cache.

The plain forward (``forward.py``) gives each program one Q tile of Br rows. When a model
decodes one token at a time there is one query row per head: B * H programs in all (16 for one
sequence with 16 heads), each walking the whole cache alone, while an H100 has 132 SMs. Most of
the GPU idles, and the time is that of one program reading Nk keys.

Split-KV gives the keys to several programs instead:

1. ``split_kernel``: program (s, g) runs the forward's inner loop (the same ``_softmax_step``)
   over chunk s of the keys only and writes a *partial* result: O_s normalized by its own l, and
   its logsumexp L_s (base 2), exactly the (O, L) pair of ``flashedu.merge``.
2. ``combine_kernel``: one program per query row merges the num_splits partials with the merge
   rule, L = log Σ_s e^{L_s}, O = Σ_s e^{L_s - L} O_s (in base 2 here; ``merge``).

With one split (many sequences already fill the GPU, or ``num_splits=1``) the split kernel's
partial result is the answer: it writes O and L itself and no merge is launched.

Decoding is a stream of reads, and its speed is how many bytes are in flight. Where the splits
can give every SM one program, evenly, and a tile's keys lie in one page (``one_per_sm_plan``),
that program reads tiles of 128 rows on four warps (128 keys of its K/V head, or where the
groups alone fill the SMs twice, 64 keys of two K/V heads side by side), loading the next while
it computes on this one; where they can give every SM two (``double_buffered``: one program a
group when the batch alone fills the SMs twice, else as many splits as that takes), each does
the same with tiles of 64 keys on two warps; elsewhere a program reads one tile at a time, and
more programs, four an SM, keep the loads going. In a paged cache the next tile can load early
because its page is looked up during the tile before (``PAGES_AHEAD``).

Grouped-query attention is packed: the query heads that share one K/V head go into the rows of
one program (row r is head r // Nq, query r % Nq), so each K/V tile is read once per group
instead of once per query head, and tl.dot's minimum of 16 rows is filled by real work.

Causal here is *bottom-right* aligned, the decoding convention (flash_attn_with_kvcache,
torch.nn.attention.bias.causal_lower_right): the Nq queries are the last Nq positions of the
sequence, so query n sees keys j <= n + Nk - Nq. SDPA's ``is_causal`` (and flashedu.attention's)
is top-left aligned, which for one query would mean "see key 0 only": useless for decoding. The
two agree when Nq == Nk. A query that sees no key (Nq > Nk) gives zeros.

A paged cache (vLLM's PagedAttention; ``paged_kv_attention``) changes one thing: where a K/V
row is read from. The cache is a pool of pages of PAGE_SIZE rows, and sequence b's key j lies
in row j % PAGE_SIZE of page ``block_table[b, j // PAGE_SIZE]``: each tile of Bc keys looks up
the page of each of its rows, so tiles keep their size whatever the page size. Each sequence
has its own length, ``cache_seqlens[b]``, read by the kernel, so one launch serves sequences of
any lengths.

On Hopper and newer the two kernels are launched as programmatic dependent launches (PDL):
the combine's programs are set up while the split's last programs run, and wait on the GPU
(``gdc_wait``) for the split's partial results, where otherwise the GPU idles for a launch
between the two kernels (0.3-0.7 us of a step in a CUDA graph on an H200: 9.8 -> 9.1 us at one
sequence of 1K keys; BENCHMARKS.md). The split kernel waits the same way before it reads Q and
the cache and overwrites the partial results that the previous step's merge reads, so it may
be launched as a dependent too.

Forward only (inference); for training use flashedu.attention.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import runtime
from ..arguments import check_num_splits, check_scale, check_tensors
from . import fast
from .config import padded_head_dim
from .forward import LOG2E, _softmax_step, dot_precision, load_tile
from .launch import interpreter_fp32
from .tiles import chunk_tiles, full_tile, masked_tile

MAX_ROWS = 64  # query rows (heads x queries) one program holds in registers
MAX_SPLITS = 128
# the split kernel's launch on a GPU: two warps were 0.1-2.8% faster than four in every cell
# of two sweeps of seven cells (BENCHMARKS.md, "Decoding: two warps, at most four programs an
# SM"); with two stages a program takes 38 KB of shared memory
SPLIT_LAUNCH = {"num_warps": 2, "num_stages": 2}
# programs an SM at once: five fit (38 KB of shared memory; 168 registers a thread at pages of
# 16, 162 at 256, compiled for sm_90), but five were 1-3% slower than four at 8 sequences
# (BENCHMARKS.md, "Decoding between 32 and 64 sequences")
RESIDENT = 4
MERGE_TILE = 8192  # partial values one step of the merge loads: all in flight together
KEY_TILE = 64  # Bc on a GPU where d <= 128 in 16 bits (a buffer of K_j and V_j: 32 KB)
# Two K/V tiles in flight a program (three stages: one tile read while the next loads; 70 KB of
# shared memory, three fit on an SM), where the split count can give every SM two programs,
# evenly: cuDNN's kernel also keeps more than one tile in flight, one program an SM. H200 sweeps
# (BENCHMARKS.md, "Decoding: two K/V tiles in flight"), us a step in pages of 256 / 16: 32
# sequences of 1K keys (256 groups, no split) 35.2 / 36.3 against 37.3 / 38.5 for 128-key
# steps one tile in flight, cuDNN 35.0; 8 x 4K (64 groups, 4 splits) 37.5 / 38.9 against 38.9 /
# 40.1 for 8 splits of one tile in flight, cuDNN 37.5; one sequence of 16K keys (32 splits)
# 22.7 / 23.8 against 24.1 / 25.4, cuDNN 23.6. Three programs an SM were slower.
DOUBLE_BUFFERED_LAUNCH = {"num_warps": 2, "num_stages": 3}
DOUBLE_BUFFERED_PER_SM = 2  # programs an SM; None: off
EVEN_SHARE = 0.9  # the programs fill at least this share of their last round over the SMs
# Where the batch's groups and a split count give every SM ONE program, evenly, that program
# takes twice the tile and twice the warps, two tiles in flight (136 KB of shared memory): the
# same bytes in flight an SM as two double-buffered programs, half the programs and merges.
# Only where a tile's keys lie in one page (pages of a multiple of 128 rows, or no pages): a
# 128-key tile across 8 pages of 16 reads 8 table entries, and lost in 5 of 10 cells there
# (4 x 4K: 23.3 us against 22.8). H200 sweep in pages of 256 (BENCHMARKS.md, "Decoding: one
# program an SM"), us a step against two an SM: 16 sequences of 4K keys (no split) 63.8
# against 66.5, cuDNN 63.6; 8 x 64K (2 splits) 469.5 against 478.1, cuDNN 470.9; one sequence
# of 64K (16 splits) 65.7 against 66.7, cuDNN 67.0; level or faster in all 10 cells.
ONE_PER_SM_LAUNCH = {"num_warps": 4, "num_stages": 3}
ONE_PER_SM_TILE = 128  # rows of K_j: Bc keys times the K/V heads a program reads
ONE_PER_SM = True  # False: off
ONE_PER_SM_KV_HEADS = (1, 2)  # K/V heads a program, side by side: each tried in turn
# Two K/V heads a program only where each program reads this many keys or more: at 32
# sequences (256 groups, 128 programs of two heads, or 256 of one two an SM), in pages of 256,
# 4K keys 124.5 us against 125.3, 16K 477.3 against 486.4, but 1K 36.5 against 35.9, where
# two programs an SM hide each other's start and end (BENCHMARKS.md, "Decoding: two K/V heads
# a program"; cuDNN 124.5, 475.1, 35.6)
SIDE_BY_SIDE_MIN_KEYS = 4096
# each unmasked tile's page looked up during the tile before (split_kernel): without it,
# Triton's pipeliner gives the page's load a stage and keeps one K/V tile in flight whatever
# num_stages says
PAGES_AHEAD = True


@triton.jit
def tile_pages(start_n, ok, b, block_table, width, Nk, Bc: tl.constexpr,
               PAGE_SIZE: tl.constexpr):
    """The pages that keys start_n .. start_n + Bc - 1 of sequence b lie in: entry
    j // PAGE_SIZE of the block table's row b (its rows ``width`` entries apart) for key j.
    Where pages hold whole tiles (PAGE_SIZE a multiple of Bc; tiles start at multiples of Bc)
    the tile reads one entry; where tiles hold whole pages (Bc a multiple of PAGE_SIZE), the
    entry of each of its Bc // PAGE_SIZE pages (``cache_rows`` hands each row its page's);
    else each row its own. Only where ``ok`` (the tile is one of this program's) and the
    keys are within the sequence (< Nk); elsewhere 0, no entry read. A contiguous cache (no
    block table) has no pages."""
    if block_table is None:
        return 0
    elif PAGE_SIZE % Bc == 0:  # start_n < Nk for any tile of the program's
        return tl.load(block_table + b * width + start_n // PAGE_SIZE, mask=ok, other=0)
    elif Bc % PAGE_SIZE == 0:
        p = start_n // PAGE_SIZE + tl.arange(0, Bc // PAGE_SIZE)  # keys >= 0: "< 0" is none
        return tl.load(block_table + b * width + p, mask=p * PAGE_SIZE < tl.where(ok, Nk, 0),
                       other=0)
    else:
        j = start_n + tl.arange(0, Bc)
        return tl.load(block_table + b * width + j // PAGE_SIZE, mask=j < tl.where(ok, Nk, 0),
                       other=0)


@triton.jit
def cache_rows(page, j, b, block_table, stride_kb, stride_kn, stride_vb, stride_vn,
               Bc: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Where keys j of sequence b lie in K and in V, as offsets from the head's start: rows j
    of batch b in a contiguous cache (no block_table); in a paged one, row j % PAGE_SIZE of
    ``page`` (``tile_pages``), stride_kb, stride_vb then being the pages' strides. The page
    is the only difference, looked up once for K and V."""
    if block_table is None:  # b in 64 bits: past 2^31 elements, b * stride_kb overflows 32
        b = b.to(tl.int64)
        return b * stride_kb + j * stride_kn, b * stride_vb + j * stride_vn
    else:
        if PAGE_SIZE < Bc and Bc % PAGE_SIZE == 0:  # the tile's pages: each row's own
            # (among a warp's registers: per-row entries, loaded, went through shared memory
            # to the rows' layout, a barrier each tile)
            page = tl.gather(page, tl.arange(0, Bc) // PAGE_SIZE, 0)
        page = page.to(tl.int64)
        row = j % PAGE_SIZE
        return page * stride_kb + row * stride_kn, page * stride_vb + row * stride_vn


@triton.jit
def own_kv_head(b, h, q_idx, kv_idx, args):
    """The mask of a program that reads KV_HEADS K/V heads side by side (``split_step``):
    query head h sees the rows of its own K/V head, row kv_idx holding head kv_idx % KV_HEADS
    of the program's (the first being h_kv); args = (GROUP, h_kv, KV_HEADS)."""
    return (h[:, None] // args[0] - args[1]) == kv_idx % args[2]


@triton.jit
def split_step(O_i, l_i, m_i, Q_i, K_head, V_head, start_n, page, b, block_table,
               stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, pos, dims,
               Nk, d, qk_scale, ctx, Bc: tl.constexpr, IS_CAUSAL: tl.constexpr,
               MASK: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
               PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr = 1):
    """Load K_j, V_j (keys start_n .., in ``page``: tile_pages) from the cache, then the
    forward's softmax step.

    With KV_HEADS K/V heads a program, row c of K_j and V_j is key start_n + c // KV_HEADS
    of head c % KV_HEADS: a key's heads side by side, as the pool holds them, so a tile reads
    KV_HEADS times the bytes in one run. A query row sees its own head's rows only
    (``own_kv_head``), and the softmax step counts positions in rows, KV_HEADS to a key: the
    keys before Nk are the rows before KV_HEADS * Nk, and a query at position pos sees the
    rows up to its key's last, KV_HEADS * pos + KV_HEADS - 1."""
    c = tl.arange(0, Bc * KV_HEADS)
    j = start_n + c // KV_HEADS
    row_ok = j < Nk
    dim_ok = dims[None, :] < d
    K_rows, V_rows = cache_rows(page, j, b, block_table, stride_kb, stride_kn, stride_vb,
                                stride_vn, Bc, PAGE_SIZE)
    if KV_HEADS > 1:
        K_rows += (c % KV_HEADS) * stride_kh
        V_rows += (c % KV_HEADS) * stride_vh
    K_j = load_tile(K_head + K_rows[:, None] + dims[None, :], row_ok[:, None], dim_ok, MASK,
                    not EVEN_D)
    V_j = load_tile(V_head + V_rows[:, None] + dims[None, :], row_ok[:, None], dim_ok, MASK,
                    not EVEN_D)
    if KV_HEADS == 1:
        return _softmax_step(O_i, l_i, m_i, Q_i, K_j, V_j, start_n, pos, Nk, qk_scale, ctx,
                             None, None, IS_CAUSAL, MASK, DOT_PREC)
    else:
        return _softmax_step(O_i, l_i, m_i, Q_i, K_j, V_j, KV_HEADS * start_n,
                             KV_HEADS * pos + KV_HEADS - 1, KV_HEADS * Nk, qk_scale, ctx, None,
                             None, IS_CAUSAL, True, DOT_PREC, MASK_MOD=own_kv_head)


@triton.jit
def split_kernel(Q, K, V, O_part, L_part, block_table, seqlens, qk_scale,
                 stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, H, GROUP, HEADS, Nq, Nk, d, chunk, num_splits,
                 width, stride_ob, stride_oh, stride_on,
                 BLOCK_M: tl.constexpr, Bc: tl.constexpr, HEAD_DIM: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
                 PAGE_SIZE: tl.constexpr = 0, PDL: tl.constexpr = False,
                 FINAL: tl.constexpr = False, AHEAD: tl.constexpr = False,
                 KV_HEADS: tl.constexpr = 1):
    """Program (s, g): chunk s of the keys for the query heads of group g: HEADS query heads
    that share KV_HEADS consecutive K/V heads (one, or where HEADS = KV_HEADS * GROUP several
    side by side: ``split_step``). For a paged cache,
    ``block_table`` (rows ``width`` entries apart) and ``seqlens``, each sequence's cache
    length (K and V are then pools of pages whose stride_kb, stride_vb are the pages' strides);
    both None where the cache is one contiguous (B, Hkv, Nk, d) block, and then not compiled.
    PDL: launched as a dependent launch (module docstring): wait for the kernel before it.
    FINAL: the only split (num_splits = 1), whose partial result is the answer: O_part is the
    output itself (strides stride_ob, stride_oh, stride_on; d columns) and L_part its base-2
    lse, so that no merge is launched."""
    # several K/V heads a program read a key's heads side by side: within one page (in
    # tiles across pages of 16, 32 sequences of 4K and 16K keys, they measured 11% slower
    # than two programs an SM; BENCHMARKS.md)
    tl.static_assert(KV_HEADS == 1 or PAGE_SIZE % Bc == 0)
    if PDL:  # before reading Q or the cache, and writing the partials (which the previous
        gdc_wait()  # step's combine reads), the kernel before this one must be done
    qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile may hand a float64 scalar
    s = tl.program_id(0)  # which chunk of keys
    g = tl.program_id(1)  # which (batch, group of HEADS query heads sharing one K/V head)
    heads_per_b = H // HEADS
    b = g // heads_per_b
    h0 = (g % heads_per_b) * HEADS  # first query head of this program
    h_kv = h0 // GROUP
    if seqlens is not None:
        Nk = tl.load(seqlens + b)  # this sequence's cache length

    r = tl.arange(0, BLOCK_M)
    h = h0 + r // Nq  # packed rows: query head of each row ...
    n = r % Nq  # ... and its query index
    row_ok = r < HEADS * Nq
    pos = n + Nk - Nq  # bottom-right causal: query n sits at position Nk - Nq + n
    dims = tl.arange(0, HEAD_DIM)
    dim_ok = dims[None, :] < d
    Q_i = load_tile(Q + b * stride_qb + h[:, None] * stride_qh + n[:, None] * stride_qn
                    + dims[None, :], row_ok[:, None], dim_ok, True, not EVEN_D)
    K_head = K + h_kv * stride_kh
    V_head = V + h_kv * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    O_i = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo = s * chunk
    hi = tl.maximum(tl.minimum(lo + chunk, Nk), lo)  # a chunk past this sequence's end is empty
    # this chunk's tiles (tiles.py): those every query sees whole need no mask (the first
    # query sits at position Nk - Nq); the diagonal and the ragged edge pay for one
    num, num_full, u0, a0, na, b0, idx_row, e0 = chunk_tiles(lo, hi, Nq, Nk, Bc, IS_CAUSAL)
    # no mods here; with several K/V heads, the arguments of own_kv_head
    ctx = (b, h, Nq, qk_scale, None, None, (GROUP, h_kv, KV_HEADS) if KV_HEADS > 1 else None)
    # the page of each unmasked tile is looked up one tile ahead (AHEAD): the K/V loads then
    # wait on no load of their own iteration, and the pipeline holds num_stages - 1 tiles of
    # them in flight (a page load in the same iteration takes a stage of its own instead)
    page = tile_pages(u0 * Bc, num_full > 0, b, block_table, width, Nk, Bc, PAGE_SIZE)
    for t in range(0, num_full):
        j = full_tile(t, u0, idx_row, None)
        if AHEAD:
            here = page
            page = tile_pages((j + 1) * Bc, t + 1 < num_full, b, block_table, width, Nk, Bc,
                              PAGE_SIZE)
        else:
            here = tile_pages(j * Bc, t < num_full, b, block_table, width, Nk, Bc, PAGE_SIZE)
        O_i, l_i, m_i = split_step(O_i, l_i, m_i, Q_i, K_head, V_head, j * Bc, here, b,
                                   block_table, stride_kb, stride_kh, stride_kn, stride_vb,
                                   stride_vh, stride_vn, pos, dims, Nk, d, qk_scale, ctx, Bc,
                                   IS_CAUSAL, False, EVEN_D, DOT_PREC, PAGE_SIZE, KV_HEADS)
    for t in range(num_full, num):  # the diagonal and the ragged end: a tile or two
        j = masked_tile(t, num_full, a0, na, b0, idx_row, None)
        here = tile_pages(j * Bc, t < num, b, block_table, width, Nk, Bc, PAGE_SIZE)
        O_i, l_i, m_i = split_step(O_i, l_i, m_i, Q_i, K_head, V_head, j * Bc, here, b,
                                   block_table, stride_kb, stride_kh, stride_kn, stride_vb,
                                   stride_vh, stride_vn, pos, dims, Nk, d, qk_scale, ctx, Bc,
                                   IS_CAUSAL, True, EVEN_D, DOT_PREC, PAGE_SIZE, KV_HEADS)

    if PDL:  # the keys are read: the combine's programs may be set up (they wait for us)
        gdc_launch_dependents()
    # The partial result in the merge's convention: O_s = O_i / l_i and L_s = m_i + log2(l_i);
    # a row that saw no key of this chunk gives O_s = 0, L_s = -inf (weight 0 in the merge).
    seen = l_i > 0
    O_i = O_i / tl.where(seen, l_i, 1.0)[:, None]
    L_i = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    row = (b * H + h) * num_splits + s  # O_part: (B, H, S, Nq, HEAD_DIM), L_part: (B, H, S, Nq)
    if FINAL:  # the answer: O in the output's dtype and layout
        O_rows = b * stride_ob + h * stride_oh + n * stride_on
        tl.store(O_part + O_rows[:, None] + dims[None, :], O_i.to(O_part.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok)
    else:
        tl.store(O_part + (row * Nq + n)[:, None] * HEAD_DIM + dims[None, :], O_i,
                 mask=row_ok[:, None])
    tl.store(L_part + row * Nq + n, L_i, mask=row_ok)


@triton.jit
def merge(O_part, L_part, part, row_ok, Nq, num_splits, dims, SPLITS: tl.constexpr,
          HEAD_DIM: tl.constexpr):
    """The merge rule of ``flashedu.merge`` (base 2) over the num_splits partial results
    (O_s, L_s) of some query rows: m = max_s L_s, w_s = 2^(L_s - m), O = sum_s w_s O_s /
    sum_s w_s, L = m + log2 sum_s w_s. ``part``: each row's entry of split 0 in L_part (split
    s's is s * Nq further on; O_part's rows are HEAD_DIM wide). A row that no split saw a key
    of gives O = 0, L = -inf. Returns (O, L).

    SPLITS splits a step, each step's L_s and O_s loaded together, and the running max m
    rescaled as the online softmax rescales m_i: no load waits for another, where a first
    pass for m over every L_s would cost one more round trip to L2 before any O_s is read.
    The registers stay bounded for any number of splits."""
    m = tl.full([part.shape[0]], float("-inf"), dtype=tl.float32)
    total = tl.zeros([part.shape[0]], dtype=tl.float32)
    O = tl.zeros([part.shape[0], HEAD_DIM], dtype=tl.float32)
    step = tl.arange(0, SPLITS)
    for s0 in range(0, num_splits, SPLITS):
        at = (s0 + step)[:, None] * Nq + part[None, :]  # (split, row): where its L_s is
        ok = (s0 + step < num_splits)[:, None] & row_ok[None, :]
        L_s = tl.load(L_part + at, mask=ok, other=float("-inf"))
        O_s = tl.load(O_part + at[:, :, None] * HEAD_DIM + dims[None, None, :],
                      mask=ok[:, :, None], other=0.0)
        m_new = tl.maximum(m, tl.max(L_s, 0))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: every weight is 0
        alpha = tl.math.exp2(m - base)  # the earlier steps' rescale (0 while m is -inf)
        w = tl.math.exp2(L_s - base[None, :])
        total = total * alpha + tl.sum(w, 0)
        O = O * alpha[:, None] + tl.sum(w[:, :, None] * O_s, 0)
        m = m_new
    seen = total > 0
    O = O / tl.where(seen, total, 1.0)[:, None]
    L = tl.where(seen, m + tl.math.log2(tl.where(seen, total, 1.0)), float("-inf"))
    return O, L


@triton.jit
def combine_kernel(O_part, L_part, O, L, stride_ob, stride_oh, stride_on, H, Nq, d, num_splits,
                   MERGE_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PDL: tl.constexpr = False):
    """Program (b * H + h, n): the merge of query row n of head h's num_splits partials.
    PDL: started before the split kernel ends, it waits here until the partials are written."""
    if PDL:
        gdc_wait()
    bh = tl.program_id(0)
    n = tl.program_id(1) + tl.arange(0, 1)  # the row, as a vector of one (merge's form)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = n < Nq
    O_n, L_n = merge(O_part, L_part, bh * num_splits * Nq + n, row_ok, Nq, num_splits, dims,
                     MERGE_SPLITS, HEAD_DIM)
    row = (bh // H) * stride_ob + (bh % H) * stride_oh + n * stride_on
    tl.store(O + row[:, None] + dims[None, :], O_n.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (dims[None, :] < d))
    if L is not None:  # asked for (return_lse): else not compiled
        tl.store(L + bh * Nq + n, L_n, mask=row_ok)


def split_kv_attention(q, k, v, *, num_splits=None, scale=None, is_causal=False,
                       return_lse=False):
    """Attention for a few queries against a long K/V cache, with the keys split across programs.

    q: (B, H, Nq, d) with Nq small (1 to 16 is the design point, at most 64); k, v:
    (B, Hkv, Nk, d) with H a multiple of Hkv (grouped-query attention is always allowed).
    ``num_splits``: how many chunks of keys (None: enough programs to fill the GPU).
    ``is_causal``: bottom-right aligned (query n sees keys j <= n + Nk - Nq; see the module
    docstring). Returns out (B, H, Nq, d), and with ``return_lse`` also L (B, H, Nq), the
    natural-log logsumexp (-inf for a row that sees no key). Forward only.
    """
    from .inputs import check

    check_tensors(q, k, v, enable_gqa=True)
    check(q, k, v)  # dtype, head dim, device for compiled vs interpreted triton
    Hkv, Nk = k.shape[1], k.shape[2]
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    # (B, Hkv, Nk, d): the batch's stride, the head's, the row's
    cache = (k, v, (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2)))
    return _split_kv(q, cache, Hkv, Nk, None, 0, num_splits, scale, is_causal, return_lse,
                     "split_kv_attention")


def paged_kv_attention(q, k_cache, v_cache, block_table, cache_seqlens, *, num_splits=None,
                       scale=None, is_causal=False, return_lse=False):
    """Split-KV decoding from a paged cache, one launch for sequences of any lengths.

    q: (B, H, Nq, d); k_cache, v_cache: (num_pages, page_size, Hkv, d), a pool of pages
    (flash-attn's and vLLM's layout: appending a token writes one contiguous (Hkv, d) row);
    block_table: (B, max_pages) int32, the pages of each sequence in order; cache_seqlens: (B,)
    int32, how many keys each sequence has. Arguments are checked by
    ``flashedu.decode.paged_attention``, the public entry; the rest as split_kv_attention.
    """
    from .inputs import check

    check(q, k_cache, v_cache)
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    capacity = block_table.shape[1] * page_size  # the longest cache the table can describe
    # (num_pages, page_size, Hkv, d): the page's stride, the head's, the row's
    cache = (k_cache, v_cache, (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1)),
             (v_cache.stride(0), v_cache.stride(2), v_cache.stride(1)))
    pages = (block_table, cache_seqlens, block_table.stride(0))
    return _split_kv(q, cache, Hkv, capacity, pages, page_size, num_splits, scale, is_causal,
                     return_lse, "paged_kv_attention")


def repeat_paged_step(q, k_cache, v_cache, block_table, cache_seqlens, scale, is_causal,
                      num_splits, return_lse):
    """A paged decoding step laid out as an earlier one (shapes, strides, dtypes, devices and
    options alike): that step's launches started again with these tensors, without the
    checks, which depend on nothing else and passed then. None where no step was laid out so,
    or where anything differs that the checks would look at: the full path then runs (and
    raises what it raises). A decoding loop calls this once a layer a token, where the host's
    time is most of a short step's."""
    tensors = (q, k_cache, v_cache, block_table, cache_seqlens)
    Tensor = torch.Tensor  # exact types: a subclass (a fake tensor, say) takes the full path
    if (type(is_causal) is not bool or type(return_lse) is not bool
            or not (num_splits is None or type(num_splits) is int)
            or type(q) is not Tensor or type(k_cache) is not Tensor
            or type(v_cache) is not Tensor or type(block_table) is not Tensor
            or type(cache_seqlens) is not Tensor):
        return None
    try:
        scale = check_scale(scale, q.shape[-1])
    except (TypeError, ValueError):
        return None
    plan = fast.PLANS.get(_plan_key(tensors, scale, is_causal, num_splits, return_lse))
    device = q.device  # the key holds q's device only: the others are checked here
    if (plan is None or k_cache.device != device or v_cache.device != device
            or block_table.device != device or cache_seqlens.device != device):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad
                                    or v_cache.requires_grad):
        return None  # the full path says that decoding is forward-only
    out, lse2 = _repeat(plan, tensors)
    return (out, lse2 * math.log(2.0)) if return_lse else out


def _plan_key(given, scale, is_causal, num_splits, return_lse) -> tuple:
    """The key of a step's launches in fast.PLANS: its tensors' layouts and its options."""
    return fast.signature(given, id(split_kernel), scale, is_causal, num_splits, return_lse)


def _split_kv(q, cache, Hkv, Nk, pages, page_size, num_splits, scale, is_causal, return_lse,
              name):
    """Both launches (split, then combine) for a contiguous or a paged cache. Nk: the cache's
    length, or for a paged one the table's capacity (each sequence's own length is read by the
    kernel from seqlens, so the host never waits for the device). ``pages``: None, or (block
    table, seqlens, the table's row stride)."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    k, v, stride_k, stride_v = cache
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(f"{name} is forward-only (decoding): call it under "
                           "torch.no_grad(), or use flashedu.attention to train")
    scale = check_scale(scale, q.shape[-1])
    B, H, Nq, d = q.shape
    if Nq > MAX_ROWS:
        raise ValueError(f"q: {name} is for a few queries (Nq <= {MAX_ROWS}), got "
                         f"Nq={Nq}; use flashedu.attention for long query blocks")
    check_num_splits(num_splits)  # before the plan's cache: True would hash as 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    dtype = q.dtype
    interpreted = runtime.triton_interpreted()
    q, k, v = interpreter_fp32(interpreted, q, k, v)
    table, seqlens, width = (None, None, 0) if pages is None else pages
    given = (q, k, v) if pages is None else (q, k, v, table, seqlens)
    # a decoding step repeats the last one's layout: its launches are kept as a plan and
    # started again with this call's tensors (fast.PLANS), the host's time being the step's
    # budget at small caches
    plan_key = _plan_key(given, scale, is_causal, num_splits, return_lse)
    plan = fast.PLANS.get(plan_key)
    if plan is not None:
        out, lse2 = _repeat(plan, given)
    else:
        S, chunk, heads, split_consts, combine_consts = _launch_plan(
            B, H, Hkv, Nq, Nk, d, dtype, sm_count(q.device, interpreted), interpreted,
            num_splits, is_causal, page_size, major(q.device, interpreted))
        shapes = ((B, H, S, Nq, split_consts["HEAD_DIM"]), (B, H, S, Nq), (B, H, Nq))
        O_part, L_part, out, lse2 = _buffers(q, shapes, return_lse)
        sq, so = q.stride(), out.stride()
        final = combine_consts is None  # one split: the split kernel writes the answer
        targets = _split_targets(final, O_part, L_part, out, lse2)
        split = (split_kernel, (S, B * H // heads),
                 (q, k, v, *targets, table, seqlens, scale * LOG2E, sq[0], sq[1], sq[2],
                  *stride_k, *stride_v, H, H // Hkv, heads, Nq, Nk, d, chunk, S, width,
                  so[0], so[1], so[2]),
                 split_consts)
        fast.run(*split)
        # the call's own tensors lead each launch's arguments (the paged ones: table, lengths)
        split_launch = fast.Launch(*split, tuple(range(len(given) + 2)))
        combine_launch = None
        if not final:
            combine = (combine_kernel, (B * H, Nq),
                       (O_part, L_part, out, lse2, so[0], so[1], so[2], H, Nq, d, S),
                       combine_consts)
            fast.run(*combine)
            combine_launch = fast.Launch(*combine, tuple(range(4 if return_lse else 3)))
        fast.remember(plan_key, (split_launch, combine_launch, shapes, return_lse))
    if out.dtype != dtype:
        out = out.to(dtype)  # float32 under the interpreter: cast back
    return (out, lse2 * math.log(2.0)) if return_lse else out  # -inf stays -inf


_PARTIALS: dict = {}  # (device, stream, shapes) -> (O_part, L_part) that calls reuse
_MAX_PARTIALS = 64  # kept before the cache starts over (shapes that change every call)


def _buffers(q, shapes, return_lse):
    """The split's partial results (O_s, L_s), then the output and (if asked) its base-2 lse.

    The partial results live only from the split's launch to the combine's, on one stream:
    a decoding step, whose host time is its budget at small caches, takes the ones an earlier
    step on that stream used (two allocations fewer a step; the combine of the earlier step
    has read them before the split of this one writes them, in stream order). During CUDA
    graph capture they are fresh, as the graph keeps their addresses."""
    device = q.device
    if device.type == "cuda":
        if torch._C._cuda_isCurrentStreamCapturing():
            key = None
        else:
            key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), shapes)
    else:  # the interpreter: each launch has finished when it returns
        key = (device.type, None, shapes)
    parts = _PARTIALS.get(key) if key is not None else None
    if parts is None:
        parts = (torch.empty(shapes[0], dtype=torch.float32, device=device),
                 torch.empty(shapes[1], dtype=torch.float32, device=device))
        if key is not None:
            if len(_PARTIALS) >= _MAX_PARTIALS:
                _PARTIALS.clear()
            _PARTIALS[key] = parts
    lse2 = torch.empty(shapes[2], dtype=torch.float32, device=device) if return_lse else None
    return (*parts, torch.empty_like(q), lse2)


def _split_targets(final, O_part, L_part, out, lse2):
    """The two tensors the split kernel writes: the partial results; or, where it is the only
    split (``final``), the output and the lse asked for, else the partial L buffer (a slot of
    the launch needs a tensor; B * H * Nq floats, written and unread)."""
    if not final:
        return O_part, L_part
    return out, (L_part if lse2 is None else lse2)


def _repeat(plan, given):
    """A call laid out as the one that made ``plan``: its launches (the split, and the combine
    unless the split is the only one) with new buffers. Returns (out, its base-2 lse or None)."""
    split, combine, shapes, return_lse = plan
    O_part, L_part, out, lse2 = _buffers(given[0], shapes, return_lse)
    stream = fast.stream_for(split, combine)
    split.start(*given[:3], *_split_targets(combine is None, O_part, L_part, out, lse2),
                *given[3:], stream=stream)
    if combine is not None:
        combine.start(O_part, L_part, out, *(() if lse2 is None else (lse2,)), stream=stream)
    return out, lse2


@functools.lru_cache(maxsize=256)
def _launch_plan(B, H, Hkv, Nq, Nk, d, dtype, sms, interpreted, num_splits, is_causal,
                 page_size, device_major):
    """(S, chunk, heads, the split kernel's constexprs, the combine kernel's or None where the
    split is the only one and writes the answer): worked out once per problem shape, since a
    model decodes the same shapes step after step (the host's time is a decoding step's
    budget)."""
    heads, Bc, S, chunk, launch = _plan(B, H, Hkv, Nq, Nk, d, dtype, sms, interpreted,
                                        num_splits, page_size)
    HEAD_DIM = padded_head_dim(d)
    kv_heads = kv_heads_per_program(heads, H, Hkv)
    dependent = pdl_launch(device_major, interpreted)
    # a launch setting may name AHEAD too (the sweep's variants): it then replaces the rule's
    split_consts = {**dict(BLOCK_M=max(16, triton.next_power_of_2(heads * Nq)), Bc=Bc,
                           HEAD_DIM=HEAD_DIM, IS_CAUSAL=is_causal, EVEN_D=HEAD_DIM == d,
                           DOT_PREC=dot_precision(dtype), PAGE_SIZE=page_size, FINAL=S == 1,
                           AHEAD=PAGES_AHEAD, KV_HEADS=kv_heads),
                    **launch,
                    **dependent}
    if S == 1:
        return S, chunk, heads, split_consts, None
    return S, chunk, heads, split_consts, {**merge_consts(S, HEAD_DIM), **dependent}


# dependent launches where the GPU has them; False: plain launches, to compare (set it before
# the first call: a shape's launch settings are worked out once and kept, _launch_plan)
PDL = True


def pdl_launch(device_major: int, interpreted: bool) -> dict:
    """The constexpr and launch option of a programmatic dependent launch: on Hopper (compute
    capability 9) and newer, compiled; none under the interpreter."""
    if not PDL or interpreted or device_major < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}


def merge_consts(S: int, HEAD_DIM: int) -> dict:
    """combine_kernel's constexprs for S splits: how many splits a step of ``merge`` loads,
    all S where they make at most MERGE_TILE values, else MERGE_TILE values' worth."""
    return dict(HEAD_DIM=HEAD_DIM,
                MERGE_SPLITS=max(1, min(triton.next_power_of_2(S), MERGE_TILE // HEAD_DIM)))


def split_plan(B, H, Hkv, Nq, Nk, d, dtype, sms, interpreted=False, num_splits=None,
               page_size=0):
    """(heads per program, Bc, number of splits S, keys per split): the launch of a problem
    (``page_size``: the cache's pages, 0 for a contiguous cache)."""
    return _plan(B, H, Hkv, Nq, Nk, d, dtype, sms, interpreted, num_splits, page_size)[:4]


def tiles_in_flight(B, H, Hkv, Nq, Nk, d, dtype, sms, interpreted=False,
                    num_splits=None, page_size=0) -> int:
    """The K/V tiles each program of ``split_plan``'s launch keeps in flight: one fewer than
    its pipeline's stages (its page looked up a tile ahead: ``PAGES_AHEAD``); one under the
    interpreter."""
    launch = _plan(B, H, Hkv, Nq, Nk, d, dtype, sms, interpreted, num_splits, page_size)[4]
    return launch["num_stages"] - 1 if launch else 1


def _plan(B, H, Hkv, Nq, Nk, d, dtype, sms, interpreted, num_splits, page_size=0):
    """``split_plan``'s four, and the split kernel's launch settings: ONE_PER_SM_LAUNCH where
    the groups and a split count give every SM one program evenly (``one_per_sm_plan``), else
    DOUBLE_BUFFERED_LAUNCH where they give it two (``double_buffered``), else SPLIT_LAUNCH
    (none under the interpreter)."""
    heads = heads_per_program(H // Hkv, Nq)
    groups = B * H // heads
    if num_splits is None:
        plan = one_per_sm_plan(B, H, Hkv, Nq, Nk, d, dtype, sms, interpreted, page_size)
        if plan is not None:
            return plan
    Bc = key_tile(d, dtype, interpreted)
    S = None
    if num_splits is None and DOUBLE_BUFFERED_PER_SM is not None:
        # the most splits that give the SMs at most DOUBLE_BUFFERED_PER_SM programs each
        S, chunk = split_chunks(Nk, Bc, max(1, min(DOUBLE_BUFFERED_PER_SM * sms // groups,
                                                   MAX_SPLITS)))
        if not double_buffered(groups * S, sms, d, dtype, interpreted):
            S = None
    if S is None:
        S, chunk = split_chunks(Nk, Bc, choose_num_splits(groups, Nk, Bc, sms, num_splits))
    if interpreted:
        launch = {}
    elif double_buffered(groups * S, sms, d, dtype, interpreted):
        launch = DOUBLE_BUFFERED_LAUNCH
    else:
        launch = SPLIT_LAUNCH
    return heads, Bc, S, chunk, launch


def split_chunks(Nk: int, Bc: int, asked: int) -> tuple:
    """(S, chunk): the splits that run when ``asked`` are, and the keys each reads. A chunk is
    a whole number of K/V tiles, so rounding it up may leave the last splits empty, and they
    are dropped (9 asked of 64 tiles run as 8 chunks of 8 tiles)."""
    chunk = math.ceil(math.ceil(Nk / asked) / Bc) * Bc
    return math.ceil(Nk / chunk), chunk


def double_buffered(programs: int, sms: int, d: int, dtype, interpreted: bool) -> bool:
    """Whether ``programs`` programs of the split kernel each keep two K/V tiles in flight
    (DOUBLE_BUFFERED_LAUNCH): where they give every SM DOUBLE_BUFFERED_PER_SM, evenly (the
    step takes as long as the SMs with the most programs), on a GPU, in 16 bits, d <= 128
    (compiled for sm_90: 70 KB of shared memory)."""
    return (DOUBLE_BUFFERED_PER_SM is not None and not interpreted
            and even(programs, sms, DOUBLE_BUFFERED_PER_SM)
            and dtype != torch.float32 and padded_head_dim(d) <= 128)


def even(programs: int, sms: int, per_sm: int) -> bool:
    """Whether ``programs`` give the SMs per_sm programs each, evenly: at most per_sm on the
    busiest SM (the step takes as long as those), and at least EVEN_SHARE of the slots that
    round offers filled."""
    rounds = math.ceil(programs / sms)  # programs an SM, on the busiest SMs
    return rounds == per_sm and programs >= EVEN_SHARE * rounds * sms


def one_per_sm_plan(B, H, Hkv, Nq, Nk, d, dtype, sms, interpreted, page_size):
    """``_plan``'s five where the programs of ONE_PER_SM_LAUNCH fill every SM once, evenly
    (``one_per_sm_fits``), else None. A program reads the K/V heads of ONE_PER_SM_KV_HEADS in
    turn, the first that fills the SMs: one K/V head in tiles of 128 keys; or two side by side
    in tiles of 64 keys (the same 128 rows), where the groups alone fill the SMs twice (32
    sequences of 8 K/V heads: 256 groups, 128 programs) and each reads at least
    SIDE_BY_SIDE_MIN_KEYS keys."""
    group = H // Hkv
    heads = heads_per_program(group, Nq)
    for kv_heads in ONE_PER_SM_KV_HEADS:
        if kv_heads > 1 and (heads != group or Hkv % kv_heads
                             or kv_heads * heads * Nq > MAX_ROWS):
            continue  # the program's query rows: every head of its K/V heads
        Bc = ONE_PER_SM_TILE // kv_heads
        if not one_per_sm_fits(d, dtype, page_size, interpreted, Bc):
            continue
        programs = B * H // (heads * kv_heads)
        S, chunk = split_chunks(Nk, Bc, max(1, min(sms // programs, MAX_SPLITS)))
        if kv_heads > 1 and chunk < SIDE_BY_SIDE_MIN_KEYS:
            continue
        if even(programs * S, sms, 1):
            return heads * kv_heads, Bc, S, chunk, ONE_PER_SM_LAUNCH
    return None


def one_per_sm_fits(d: int, dtype, page_size: int, interpreted: bool,
                    Bc: int = ONE_PER_SM_TILE) -> bool:
    """Whether ONE_PER_SM_LAUNCH may run on tiles of Bc keys: on a GPU, in 16 bits, d <= 128
    (two K/V buffers of 128 rows: 136 KB of shared memory compiled for sm_90), each tile in
    one page."""
    return (ONE_PER_SM and not interpreted and dtype != torch.float32
            and padded_head_dim(d) <= 128 and page_size % Bc == 0)


def kv_heads_per_program(heads: int, H: int, Hkv: int) -> int:
    """The K/V heads a program of ``heads`` query heads reads: one, or several side by side
    (``one_per_sm_plan``) where it holds every query head of each."""
    return max(1, heads // (H // Hkv))


def heads_per_program(group: int, Nq: int) -> int:
    """The most query heads of one GQA group that fit in MAX_ROWS rows (a divisor of group)."""
    return max(h for h in range(1, group + 1) if group % h == 0 and h * Nq <= MAX_ROWS)


def key_tile(d: int, dtype, interpreted: bool) -> int:
    """Bc, the K/V rows per step. Small under the interpreter, so tests cross many tiles."""
    if interpreted:
        return 16
    if dtype == torch.float32 or padded_head_dim(d) >= 256:
        return 32
    return KEY_TILE


def major(device, interpreted: bool) -> int:
    """The device's compute capability's major number (0 under the interpreter)."""
    return 0 if interpreted else fast._major(device.index)


def sm_count(device, interpreted: bool) -> int:
    """Streaming multiprocessors to fill (the interpreter pretends 4, so tests see splits)."""
    return 4 if interpreted else torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(programs: int, Nk: int, Bc: int, sms: int, num_splits=None) -> int:
    """How many chunks of keys: as many programs as fit on the GPU at once (RESIDENT an SM:
    one wave), a chunk being at least one K/V tile. Decoding is a stream of reads, and more
    programs keep more loads in flight; a second wave leaves its programs to run with the
    GPU mostly idle. Swept on an H200 in CUDA graphs (BENCHMARKS.md, "Decoding: two warps, at
    most four programs an SM"): 32 sequences of 1K keys took 38.7 us a step at 2 splits (512
    programs), 45.2 at 3 (768: a second wave) and 38.9 at one; one sequence of 16K keys 23.8
    us at 64 splits (512 programs) against 24.5 at 43 and 27.3 at 86 (688); 8 sequences of 16K
    keys in pages of 16 172 us at 9 splits (576 programs, 48 of them a second wave) against 133
    at 7. (The count asked for here is rounded down by ``split_plan``'s whole-tile chunks.)"""
    if check_num_splits(num_splits) is not None:
        return min(num_splits, math.ceil(Nk / Bc))
    wanted = RESIDENT * sms // programs
    return max(1, min(wanted, math.ceil(Nk / Bc), MAX_SPLITS))
