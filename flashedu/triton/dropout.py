"""The dropout keep-mask Z_ij in Triton: the stream of :mod:`flashedu.dropout`.

    counter = (col & ~0b11001,  row & ~0b1000,  bh,  offset mod 2**32)
    r0..r3  = Philox4x32-7(seed, counter)          (tl.philox's rounds, one wide multiply each)
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
for each 4 (with a causal mask on small K/V tiles it holds S_ij upright instead: backward.py).
Other tiles (and the mask kernel) compute each entry's counter on its own.

The byte test runs on whole words (:func:`keep_flags`, four entries at once: byte >= t is
the carry out of byte + (256 - t), found without carries crossing bytes), and a select then
only reads one flag: on a GPU a byte permute that spreads the flag's bit over a mask and an
AND, two instructions for a float32 entry and two for a pair of 16-bit ones (P_ij as the
product takes it); Triton's own form (the interpreter's) shifts and compares.
:func:`dropout_mask` runs the stream in a tiny kernel that writes the mask, for tests.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..dropout import (N_ROUNDS, PHILOX_KEY_A, PHILOX_KEY_B, PHILOX_ROUND_A,
                       PHILOX_ROUND_B)

N_ROUNDS_C = tl.constexpr(N_ROUNDS)
PHILOX_ROUND_A_C = tl.constexpr(PHILOX_ROUND_A)
PHILOX_ROUND_B_C = tl.constexpr(PHILOX_ROUND_B)
PHILOX_KEY_A_C = tl.constexpr(PHILOX_KEY_A)
PHILOX_KEY_B_C = tl.constexpr(PHILOX_KEY_B)
# Triton's interpreter has no inline PTX; it takes Triton's form of the byte test.
PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")

# mask = byte b's top bit spread over a word (prmt's sign mode: selector nibble 8 + b), then AND
_SELECT_32 = tl.constexpr("{ .reg .b32 %m; prmt.b32 %m, $2, 0, $3; and.b32 $0, $1, %m; }")
# two 16-bit entries in one register, each with its own flags and byte (selector byte 0x88 +
# 0x11 b): the second entry's flags are bytes 4-7 of the permute's pair of words, so its
# selector byte moves up by 0x44 into the mask's upper half; one permute builds both masks
_SELECT_16X2 = tl.constexpr("{ .reg .b32 %m; mad.lo.u32 %m, $3, 256, 17408; or.b32 %m, %m, $2; "
                            "prmt.b32 %m, $4, $5, %m; and.b32 $0, $1, %m; }")


# (hi, lo) of a round's product in one instruction (IMAD.WIDE.U32 in the SASS), where
# tl.math.umulhi and a multiply compile to two
_MUL_WIDE = "{{ .reg .b64 %p; mul.wide.u32 %p, $2, {:#x}; mov.b64 {{$1, $0}}, %p; }}"
_MUL_WIDE_A = tl.constexpr(_MUL_WIDE.format(PHILOX_ROUND_A))
_MUL_WIDE_B = tl.constexpr(_MUL_WIDE.format(PHILOX_ROUND_B))


@triton.jit
def _mul_wide(a, B: tl.constexpr, ASM: tl.constexpr):
    """(hi, lo) words of the uint32 product a * B; ASM: the product's instruction."""
    if PTX:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r", [a], dtype=(tl.uint32, tl.uint32),
                                         is_pure=True, pack=1)
    else:
        return tl.math.umulhi(a, B), tl.mul(a, B, sanitize_overflow=False)


@triton.jit
def philox(seed, c0, c1, c2, c3):
    """Philox4x32 with N_ROUNDS rounds: tl.philox(seed, c0, c1, c2, c3, N_ROUNDS)'s words
    (triton.language.random; ``flashedu.dropout.philox`` is the NumPy twin), each round's two
    products made by one wide multiply apiece."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = c0.to(tl.uint32, bitcast=True)
    c1 = c1.to(tl.uint32, bitcast=True)
    c2 = c2.to(tl.uint32, bitcast=True)
    c3 = c3.to(tl.uint32, bitcast=True)
    for _ in tl.static_range(N_ROUNDS_C):
        hi0, lo0 = _mul_wide(c0, PHILOX_ROUND_A_C, _MUL_WIDE_A)
        hi2, lo2 = _mul_wide(c2, PHILOX_ROUND_B_C, _MUL_WIDE_B)
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
        k0 = tl.add(k0, PHILOX_KEY_A_C, sanitize_overflow=False)
        k1 = tl.add(k1, PHILOX_KEY_B_C, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def _call_words(seed, offset, bh, c0, c1, jj):
    """The word jj (col bits 3-4) of the Philox call with counters (c0, c1, bh, offset)."""
    c0, c1 = tl.broadcast(c0, c1)
    r0, r1, r2, r3 = philox(seed, c0, c1, bh, (offset & 0xFFFFFFFF).to(tl.uint32))
    return tl.where(jj == 0, r0, tl.where(jj == 1, r1, tl.where(jj == 2, r2, r3)))


# majority(word, y, top) in one three-input logic op (truth table 0xE8); spelled out in
# Triton, the compiler turns the uniform `top` into a select per word. `low` comes in as
# T's low seven bits and is spread over the bytes here by a byte permute: given as
# (T & 0x7F) * 0x01010101, the compiler fused that multiply into each word's add (a
# multiply-add, and a move of the uniform operand: two instructions a word more)
_MAJORITY = tl.constexpr("{ .reg .b32 %l, %y; prmt.b32 %l, $2, 0, 0; "
                         "and.b32 %y, $1, 0x7F7F7F7F; add.u32 %y, %y, %l; "
                         "lop3.b32 $0, $1, %y, $3, 0xE8; }")


@triton.jit
def keep_flags(word, threshold):
    """The keep test of a word's four bytes at once: bit 7 of each byte of the result is set
    where that byte is >= threshold. byte >= t is the carry out of byte + (256 - t): the low
    seven bits are added with no carry leaving a byte (bit 7 of the sum is the carry into
    bit 7), and the carry out is the majority of the byte's top bit, (256 - t)'s top bit and
    that carry."""
    T = 256 - tl.cast(threshold, tl.uint32)  # 1 .. 255
    top = tl.where(T >= 128, 0xFFFFFFFF, 0).to(tl.uint32)  # T's top bit, in every byte
    if PTX:  # T's low seven bits go in as they are: the asm spreads them over the bytes
        word, T = tl.broadcast(word, T & 0x7F)
        word, top = tl.broadcast(word, top)
        return tl.inline_asm_elementwise(_MAJORITY, "=r,r,r,r", [word, T, top],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    else:
        low = (T & 0x7F) * 0x01010101  # T's low seven bits, in every byte
        y = (word & 0x7F7F7F7F) + low
        return (word & y) | (word & top) | (y & top)


@triton.jit
def keep_rate(state):
    """1 / the keep scale of a program's dropout state: (256 - threshold) / 256, exact in
    float32, so that multiplying by it is dividing by the scale."""
    return (256 - state[3]).to(tl.float32) * 0.00390625


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
    return ((keep_flags(word, threshold) >> (8 * b + 7).to(tl.uint32)) & 1) != 0


@triton.jit
def _select(x, flags, b):
    """x where byte b of flags (``keep_flags``) has its top bit set, else 0. x float32, or
    16-bit (on a GPU: selected two entries a register)."""
    x, flags = tl.broadcast(x, flags)
    x, b = tl.broadcast(x, b)
    if PTX:
        if x.dtype.primitive_bitwidth == 16:  # two entries a register (pack=2)
            sel = (0x88 + 0x11 * b).to(tl.uint32)
            return tl.inline_asm_elementwise(_SELECT_16X2, "=r,r,r,r,r,r", [x, sel, flags],
                                             dtype=x.dtype, is_pure=True, pack=2)
        else:
            sel = (0x8888 + 0x1111 * b).to(tl.uint32)
            return tl.inline_asm_elementwise(_SELECT_32, "=r,r,r,r", [x, flags, sel],
                                             dtype=x.dtype, is_pure=True, pack=1)
    else:
        keep = ((flags >> (8 * b + 7).to(tl.uint32)) & 1) != 0
        return tl.where(keep, x, 0.0).to(x.dtype)


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
        return tl.reshape(_select(x, keep_flags(word, threshold), b), (C, R))
    else:  # (row // 16, bit 3, bits 0-2, col // 32, bits 3-4, bits 1-2, bit 0)
        x = tl.reshape(x, (R // 16, 2, 8, C // 32, 4, 4, 2))
        c0 = start_n + 32 * blk[None, None, None, :, None, None, None] \
            + 2 * t[None, None, None, None, None, :, None]
        c1 = start_m + 16 * a[:, None, None, None, None, None, None] \
            + g[None, None, :, None, None, None, None]
        word = _call_words(seed, offset, bh, c0, c1, jj[None, None, None, None, :, None, None])
        b = 2 * h[None, :, None, None, None, None, None] + dl[None, None, None, None, None, None, :]
        return tl.reshape(_select(x, keep_flags(word, threshold), b), (R, C))


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
        return _select(x, keep_flags(word, threshold), b)


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
    """Writes dropped() of a tile of ones of Out's type: 1 where kept, 0 where dropped."""
    state = (tl.load(RNG), tl.load(RNG + 1), bh, threshold, 1.0, start_m)
    dtype = Out.dtype.element_ty
    if TRANSPOSED:
        i, j = tl.arange(0, C)[:, None], tl.arange(0, R)[None, :]
        ones = tl.full((C, R), 1.0, dtype)
        tl.store(Out + i * R + j, dropped(ones, state, start_m, start_n, TRANSPOSED=True))
    else:
        i, j = tl.arange(0, R)[:, None], tl.arange(0, C)[None, :]
        ones = tl.full((R, C), 1.0, dtype)
        tl.store(Out + i * C + j, dropped(ones, state, start_m, start_n))


def kept_by_kernels(rng, bh: int, p: float, rows: int, cols: int, start_m: int, start_n: int,
                    transposed: bool = False, dtype=None):
    """bool (rows, cols): what :func:`dropped`, as the attention kernels call it, keeps of the
    tile of rows start_m.. and columns start_n.. of head ``bh`` (with ``transposed``, of the
    transposed tile, as the dK/dV program holds it; returned in (row, col) order), the tile
    of ``dtype`` (float32 by default; the forward selects P_ij in 16 bits). For tests."""
    import torch

    from ..dropout import threshold

    out = torch.zeros(rows * cols, dtype=dtype or torch.float32, device=rng.device)
    _dropped_kernel[(1,)](rng, out, bh, start_m, start_n, threshold(p), R=rows, C=cols,
                          TRANSPOSED=transposed)
    kept = out.view((cols, rows) if transposed else (rows, cols)) == 1.0
    return kept.T if transposed else kept
