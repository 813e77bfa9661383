"""The dropout keep-mask Z_ij in Triton: the stream of :mod:`flashedu.dropout`.

    counter = (col & ~0b11001,  row & ~0b1000,  bh,  offset mod 2**32)
    r0..r3  = tl.philox(seed, counter, 7 rounds)
    keep    = byte 2 (row bit 3) + (col bit 0) of r_(col bits 3-4)  >=  threshold

The forward (after P_ij, before P_ij V_j) and both backward programs call :func:`dropped` with
the same (seed, offset, bh) and each entry's row and column in the sequence, so the backward
drops exactly the forward's entries without the mask ever being stored.

A tile whose rows come in 16s and columns in 32s is drawn in the call's own shape: reshaped
to (row // 16, row bit 3, row bits 0-2, col // 32, col bits 3-4, col bits 1-2, col bit 0), the
counters take the shape without the bits that pick a byte (row bit 3, col bits 0, 3, 4), so
each call is drawn once and broadcast over its 16 entries; the reshape moves no data. The 16
entries of a call are those one thread holds in the result of a tensor-core multiply (rows r and
r + 8, columns 2t, 2t + 1 and the same 8, 16 and 24 further), so a thread draws each of its
calls once and uses all of its bytes. The backward's dK/dV program holds S_ij transposed,
where a thread has 4 entries of a call (rows r, r + 8 and columns c, c + 8): it draws a call
for each 4. Other tiles (and the mask kernel) compute each entry's counter on its own.

On a GPU the byte's test and the select are three instructions an entry (byte permute,
compare, select) in a few lines of PTX; Triton's own form (the interpreter's) shifts and masks.
:func:`dropout_mask` runs the stream in a tiny kernel that writes the mask, for tests.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..dropout import N_ROUNDS

N_ROUNDS_C = tl.constexpr(N_ROUNDS)
# Triton's interpreter has no inline PTX; it takes Triton's form of the byte test.
PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")

# prmt: byte b of the word, zero-extended (selector 0x4440 + b); keep where it is >= threshold
_SELECT = tl.constexpr("{ .reg .pred %keep; .reg .b32 %byte; prmt.b32 %byte, $2, 0, $3; "
                       "setp.ge.u32 %keep, %byte, $4; selp.f32 $0, $1, 0f00000000, %keep; }")


@triton.jit
def _call_words(seed, offset, bh, c0, c1, jj):
    """The word jj (col bits 3-4) of the Philox call with counters (c0, c1, bh, offset)."""
    c0, c1 = tl.broadcast(c0, c1)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, bh, (offset & 0xFFFFFFFF).to(tl.uint32), N_ROUNDS_C)
    return tl.where(jj == 0, r0, tl.where(jj == 1, r1, tl.where(jj == 2, r2, r3)))


@triton.jit
def random_byte(seed, offset, bh, r, c, TRANSPOSED: tl.constexpr = False):
    """(word, b) of each entry (r, c) of a tile, each with its own counter: the Philox word
    holding its random byte and which byte (0-3). r, c: int32 vectors of the rows and
    columns; the tile is (len(r), len(c)), or with TRANSPOSED (len(c), len(r))."""
    ck = c & ~0b11001  # the entries of a call: columns differing in bits 0, 3, 4 ...
    rk = r & ~0b1000  # ... and rows differing in bit 3
    w = (c >> 3) & 3  # which word
    b_c = c & 1  # which byte: 2 (row bit 3) + (col bit 0)
    b_r = (r >> 2) & 2
    if TRANSPOSED:
        word = _call_words(seed, offset, bh, ck[:, None], rk[None, :], w[:, None])
        return word, b_r[None, :] | b_c[:, None]
    else:
        word = _call_words(seed, offset, bh, ck[None, :], rk[:, None], w[None, :])
        return word, b_r[:, None] | b_c[None, :]


@triton.jit
def keep_entries(seed, offset, bh, row, col, threshold):
    """Z: int1 (len(row), len(col)), True where entry (row, col) of head ``bh`` is kept;
    threshold = round(256 p)."""
    word, b = random_byte(seed, offset, bh, row, col)
    return ((word >> (8 * b).to(tl.uint32)) & 0xFF) >= tl.cast(threshold, tl.uint32)


@triton.jit
def _select(x, word, b, threshold):
    """x where byte b of word is >= threshold, else 0."""
    if PTX:
        x, word = tl.broadcast(x, word)
        x, b = tl.broadcast(x, b)
        word, b = tl.broadcast(word, b)
        selector = (0x4440 + b).to(tl.uint32)
        thr = tl.full(word.shape, 0, tl.uint32) + tl.cast(threshold, tl.uint32)
        return tl.inline_asm_elementwise(_SELECT, "=f,f,r,r,r", [x, word, selector, thr],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        keep = ((word >> (8 * b).to(tl.uint32)) & 0xFF) >= tl.cast(threshold, tl.uint32)
        return tl.where(keep, x, 0.0)


@triton.jit
def _dropped_by_calls(x, seed, offset, bh, threshold, start_m, start_n,
                      R: tl.constexpr, C: tl.constexpr, TRANSPOSED: tl.constexpr):
    """dropped() for an R x C tile (rows in 16s, columns in 32s, starts multiples of them),
    drawn in the calls' shape: see the module's doc."""
    a = tl.arange(0, R // 16)  # row // 16 in the tile
    g = tl.arange(0, 8)  # row bits 0-2
    h = tl.arange(0, 2)  # row bit 3
    blk = tl.arange(0, C // 32)  # col // 32 in the tile
    jj = tl.arange(0, 4)  # col bits 3-4: which word
    t = tl.arange(0, 4)  # col bits 1-2
    dl = tl.arange(0, 2)  # col bit 0
    if TRANSPOSED:  # (col // 32, bits 3-4, bits 1-2, bit 0, row // 16, bit 3, bits 0-2)
        x = tl.reshape(x, (C // 32, 4, 4, 2, R // 16, 2, 8))
        c0 = start_n + 32 * blk[:, None, None, None, None, None, None] \
            + 2 * t[None, None, :, None, None, None, None]
        c1 = start_m + 16 * a[None, None, None, None, :, None, None] \
            + g[None, None, None, None, None, None, :]
        word = _call_words(seed, offset, bh, c0, c1, jj[None, :, None, None, None, None, None])
        b = 2 * h[None, None, None, None, None, :, None] + dl[None, None, None, :, None, None, None]
        return tl.reshape(_select(x, word, b, threshold), (C, R))
    else:  # (row // 16, bit 3, bits 0-2, col // 32, bits 3-4, bits 1-2, bit 0)
        x = tl.reshape(x, (R // 16, 2, 8, C // 32, 4, 4, 2))
        c0 = start_n + 32 * blk[None, None, None, :, None, None, None] \
            + 2 * t[None, None, None, None, None, :, None]
        c1 = start_m + 16 * a[:, None, None, None, None, None, None] \
            + g[None, None, :, None, None, None, None]
        word = _call_words(seed, offset, bh, c0, c1, jj[None, None, None, None, :, None, None])
        b = 2 * h[None, :, None, None, None, None, None] + dl[None, None, None, None, None, None, :]
        return tl.reshape(_select(x, word, b, threshold), (R, C))


@triton.jit
def dropped(x, state, start_m, start_n, TRANSPOSED: tl.constexpr = False):
    """x where its entry is kept, else 0: x is the tile of rows start_m.. and columns start_n..
    (x.shape), or with TRANSPOSED its transpose (columns down, rows across); start_m and
    start_n are multiples of the tile's sides. state: the program's
    ``forward.dropout_state``."""
    seed, offset, bh, threshold = state[0], state[1], state[2], state[3]
    if TRANSPOSED:
        C: tl.constexpr = x.shape[0]
        R: tl.constexpr = x.shape[1]
    else:
        R: tl.constexpr = x.shape[0]
        C: tl.constexpr = x.shape[1]
    if R % 16 == 0 and C % 32 == 0:
        return _dropped_by_calls(x, seed, offset, bh, threshold, start_m, start_n, R, C,
                                 TRANSPOSED)
    else:  # each entry's own counter
        r = start_m + tl.arange(0, R)
        c = start_n + tl.arange(0, C)
        word, b = random_byte(seed, offset, bh, r, c, TRANSPOSED)
        return _select(x, word, b, threshold)


@triton.jit
def _mask_kernel(RNG, Z, threshold, H, Nq, Nk, stride_zbh, Br: tl.constexpr, Bc: tl.constexpr):
    """Writes the keep-mask of tile (i, j) of head bh into Z (int8, (B*H, Nq, Nk))."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    bh = tl.program_id(2)
    seed = tl.load(RNG)
    offset = tl.load(RNG + 1)
    rows = i * Br + tl.arange(0, Br)
    cols = j * Bc + tl.arange(0, Bc)
    keep = keep_entries(seed, offset, bh, rows, cols, threshold)
    ok = (rows[:, None] < Nq) & (cols[None, :] < Nk)
    tl.store(Z + bh * stride_zbh + rows[:, None] * Nk + cols[None, :], keep.to(tl.int8), mask=ok)


def dropout_mask(rng, B: int, H: int, Nq: int, Nk: int, p: float, Br: int = 16, Bc: int = 16):
    """The keep-mask (B, H, Nq, Nk) bool as the Triton kernels draw it, tile by tile (Br x Bc
    tiles): equal to ``flashedu.dropout.dropout_mask(seed, offset, ...)`` for
    rng = tensor([seed, offset]), for any tiling. For small sizes and tests."""
    import torch

    from ..dropout import threshold

    Z = torch.empty((B * H, Nq, Nk), dtype=torch.int8, device=rng.device)
    grid = (triton.cdiv(Nq, Br), triton.cdiv(Nk, Bc), B * H)
    _mask_kernel[grid](rng, Z, threshold(p), H, Nq, Nk, Z.stride(0), Br=Br, Bc=Bc)
    return Z.view(B, H, Nq, Nk).bool()


@triton.jit
def _dropped_kernel(RNG, Out, bh, start_m, start_n, threshold, R: tl.constexpr, C: tl.constexpr,
                    TRANSPOSED: tl.constexpr):
    """Writes dropped() of a tile of ones: 1 where kept, 0 where dropped."""
    state = (tl.load(RNG), tl.load(RNG + 1), bh, threshold, 1.0, start_m)
    if TRANSPOSED:
        i, j = tl.arange(0, C)[:, None], tl.arange(0, R)[None, :]
        ones = tl.full((C, R), 1.0, tl.float32)
        tl.store(Out + i * R + j, dropped(ones, state, start_m, start_n, TRANSPOSED=True))
    else:
        i, j = tl.arange(0, R)[:, None], tl.arange(0, C)[None, :]
        ones = tl.full((R, C), 1.0, tl.float32)
        tl.store(Out + i * C + j, dropped(ones, state, start_m, start_n))


def kept_by_kernels(rng, bh: int, p: float, rows: int, cols: int, start_m: int, start_n: int,
                    transposed: bool = False):
    """bool (rows, cols): what :func:`dropped`, as the attention kernels call it, keeps of the
    tile of rows start_m.. and columns start_n.. of head ``bh`` (with ``transposed``, of the
    transposed tile, as the dK/dV program holds it; returned in (row, col) order). For tests."""
    import torch

    from ..dropout import threshold

    out = torch.zeros(rows * cols, dtype=torch.float32, device=rng.device)
    _dropped_kernel[(1,)](rng, out, bh, start_m, start_n, threshold(p), R=rows, C=cols,
                          TRANSPOSED=transposed)
    kept = out.view((cols, rows) if transposed else (rows, cols)) == 1.0
    return kept.T if transposed else kept
