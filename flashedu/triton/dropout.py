"""The dropout keep-mask Z_ij of one tile, in Triton: the stream of :mod:`flashedu.dropout`.

    counter = (col // 4, row, bh, offset mod 2**32),  key = seed (64 bits)
    r0..r3  = tl.philox(seed, counter, 7 rounds);  r = r_(col % 4);  keep = (r >> 1) >= threshold

The forward (after P_ij, before P_ij V_j) and both backward programs call :func:`keep_tile`
with the same (seed, offset, bh) and the tile's global row and column positions, so the
backward drops exactly the forward's entries without the mask ever being stored.

One Philox call gives four words, so a tile of Br x Bc entries costs Br x Bc / 4 calls: the
words are computed on a (Br, Bc / 4) grid and interleaved into the tile's columns (join, then
reshape). :func:`dropout_mask` runs :func:`keep_tile` in a tiny kernel that writes the mask,
for tests against the NumPy form.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..dropout import N_ROUNDS, WORDS

N_ROUNDS_C = tl.constexpr(N_ROUNDS)


@triton.jit
def keep_tile(seed, offset, bh, rows, start_n, threshold, Bc: tl.constexpr):
    """Z_ij: int1 (len(rows), Bc), True where entry (row, start_n + c) of head ``bh`` is kept.

    seed: int64 scalar (the Philox key); offset: int64 scalar (its low 32 bits are the
    counter's last word); rows: int32 (Br,) query positions; start_n: the tile's first key
    position, a multiple of 4; threshold: round(p * 2**31) (``flashedu.dropout.threshold``)."""
    tl.static_assert(Bc % 4 == 0, "dropout tiles need Bc to be a multiple of 4")
    groups = start_n // 4 + tl.arange(0, Bc // 4)  # one Philox call per 4 key columns
    zero = rows[:, None] * 0 + groups[None, :] * 0  # int32 (Br, Bc // 4)
    c0 = groups[None, :] + zero
    c1 = rows[:, None] + zero
    c2 = bh + zero
    c3 = (offset & 0xFFFFFFFF).to(tl.uint32) + zero.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3, N_ROUNDS_C)
    # column 4q + t takes word r_t of call q: join gives [..., a, b] = r_(2a + b)
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (rows.shape[0], Bc))
    # (r >> 1) >= threshold, as one unsigned compare: r >= 2 * threshold (< 2**32)
    return r.to(tl.uint32, bitcast=True) >= tl.cast(threshold, tl.uint32) * 2


@triton.jit
def _mask_kernel(RNG, Z, threshold, H, Nq, Nk, stride_zbh, Br: tl.constexpr, Bc: tl.constexpr):
    """Writes keep_tile of tile (i, j) of head bh into Z (int8, (B*H, Nq, Nk))."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    bh = tl.program_id(2)
    seed = tl.load(RNG)
    offset = tl.load(RNG + 1)
    rows = i * Br + tl.arange(0, Br)
    cols = j * Bc + tl.arange(0, Bc)
    keep = keep_tile(seed, offset, bh, rows, j * Bc, threshold, Bc)
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
