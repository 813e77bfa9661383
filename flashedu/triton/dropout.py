"""The dropout keep-mask Z_ij in Triton: the stream of :mod:`flashedu.dropout`.

    counter = (col & ~0b11001,  row & ~0b1000,  bh,  offset mod 2**32)
    r0..r3  = tl.philox(seed, counter, 7 rounds)
    keep    = byte 2 (row bit 3) + (col bit 0) of r_(col bits 3-4)  >=  threshold

The forward (after P_ij, before P_ij V_j) and both backward programs call :func:`dropped` with the
same (seed, offset, bh) and each entry's row and column in the sequence, so the backward drops
exactly the forward's entries without the mask ever being stored.

Every entry computes its own counter, which makes the mask the same for any tile and any
layout. What makes it cheap is the counter's shape: the 16 entries that share one are the 16
one thread holds in the result of a tensor-core multiply (rows r and r + 8, columns 2t, 2t + 1
and the same 8, 16 and 24 further), so their counters are the same values in the same thread,
and the compiler draws one Philox call for the 16 of them instead of 16. In the backward's dK/dV
program, whose tile is S_ij transposed, a thread holds 4 entries of a call (rows r, r + 8 and
columns c, c + 8) and draws a call for each 4.

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
def random_byte(seed, offset, bh, row0, r, col0, c, TRANSPOSED: tl.constexpr = False):
    """(word, b): for each entry (row0 + r, col0 + c) of a tile, the Philox word holding its
    random byte and which byte (0-3); the tile is (len(r), len(c)), or with TRANSPOSED
    (len(c), len(r)). row0: a multiple of 16, col0: of 32 (0 always is); r and c: int32
    vectors. The counters are computed on the vectors, before they are spread over the tile,
    so that the 16 entries of one call that a thread holds get visibly the same value, which
    the compiler then draws once."""
    ck = col0 + (c & ~0b11001)  # the entries of a call: columns differing in bits 0, 3, 4 ...
    rk = row0 + (r & ~0b1000)  # ... and rows differing in bit 3 (row0, col0 have none of them)
    w = (c >> 3) & 3  # which word
    b_c = c & 1  # which byte: 2 (row bit 3) + (col bit 0)
    b_r = (r >> 2) & 2
    if TRANSPOSED:
        c0, c1, w, b = ck[:, None], rk[None, :], w[:, None], b_r[None, :] | b_c[:, None]
    else:
        c0, c1, w, b = ck[None, :], rk[:, None], w[None, :], b_r[:, None] | b_c[None, :]
    c0, c1 = tl.broadcast(c0, c1)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, bh, (offset & 0xFFFFFFFF).to(tl.uint32), N_ROUNDS_C)
    word = tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))
    return word, b + tl.zeros_like(c0)


@triton.jit
def tile_start(start, SIZE: tl.constexpr, ALIGN: tl.constexpr):
    """(base, offsets): base + offsets = start + arange(SIZE), base a multiple of ALIGN (for
    random_byte); start is a multiple of SIZE, as a tile's first row or column is."""
    if SIZE % ALIGN == 0:
        return start, tl.arange(0, SIZE)
    else:
        return 0, start + tl.arange(0, SIZE)


@triton.jit
def keep_entries(seed, offset, bh, row, col, threshold):
    """Z: int1 (len(row), len(col)), True where entry (row, col) of head ``bh`` is kept;
    threshold = round(256 p)."""
    word, b = random_byte(seed, offset, bh, 0, row, 0, col)
    return ((word >> (8 * b).to(tl.uint32)) & 0xFF) >= tl.cast(threshold, tl.uint32)


@triton.jit
def dropped(x, state, start_m, start_n, TRANSPOSED: tl.constexpr = False):
    """x where its entry is kept, else 0: x is the tile of rows start_m.. and columns start_n..
    (x.shape), or with TRANSPOSED its transpose (columns down, rows across). state: the
    program's ``forward.dropout_state``. Two calls on the same tile
    (the backward's P_ij and dP_ij) share one draw: the compiler computes it once."""
    seed, offset, bh, threshold = state[0], state[1], state[2], state[3]
    if TRANSPOSED:
        col0, c = tile_start(start_n, x.shape[0], 32)
        row0, r = tile_start(start_m, x.shape[1], 16)
        word, b = random_byte(seed, offset, bh, row0, r, col0, c, True)
    else:
        row0, r = tile_start(start_m, x.shape[0], 16)
        col0, c = tile_start(start_n, x.shape[1], 32)
        word, b = random_byte(seed, offset, bh, row0, r, col0, c)
    if PTX:
        selector = (0x4440 + b).to(tl.uint32)
        thr = tl.full(word.shape, 0, tl.uint32) + tl.cast(threshold, tl.uint32)
        return tl.inline_asm_elementwise(_SELECT, "=f,f,r,r,r", [x, word, selector, thr],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        keep = ((word >> (8 * b).to(tl.uint32)) & 0xFF) >= tl.cast(threshold, tl.uint32)
        return tl.where(keep, x, 0.0)


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
