"""Attention dropout from a counter-based random number generator: one definition, in NumPy.

The paper's Algorithm 2 drops entries of P_ij inside the fused kernel, and its Algorithm 4
drops the same entries again in the backward: the mask Z (Nq x Nk per head) is never stored,
it is regenerated from a small saved RNG state. That needs a generator whose number for entry
(row, column) can be computed on its own, in any order, by any program: a counter-based
generator. flashedu uses Philox4x32 (Salmon et al. 2011, "Parallel random numbers: as easy as
1, 2, 3"), the one of FlashAttention's CUDA kernels, of cuRAND and of Triton's ``tl.philox``.

The stream, shared by every backend (this module is its NumPy form, ``flashedu.triton.dropout``
its Triton form, :func:`keep_mask_torch` its torch form for the naive backend):

    key      = seed (64 bits: low word k0, high word k1)
    counter  = (col & ~0b11001,  row & ~0b1000,  bh,  offset mod 2**32)
    r0..r3   = Philox4x32-7(counter, key)          7 rounds, as FlashAttention-2
    byte     = byte 2 (row bit 3) + (col bit 0)  of word r_(col bits 3-4)
    keep     = byte >= threshold(p)                threshold = round(256 p)

One call gives 16 bytes, one per entry, as FlashAttention-2 draws them: the 16 entries whose
positions differ only in bit 3 of the row and bits 0, 3 and 4 of the column, i.e. rows
{r, r + 8} and columns {c, c + 1, c + 8, c + 9, c + 16, c + 17, c + 24, c + 25}. They are the
16 entries one thread of a GPU holds in the result of a tensor-core matrix multiply (rows
lane / 4 and 8 more, columns 2 (lane % 4), one more, and the same 8, 16, 24 further), so a
kernel draws one call for 16 of its own entries and never moves random numbers between
threads (``flashedu.triton.dropout``).

With 8 bits an entry the rate drawn is threshold / 256: p in steps of 1/256 (p = 0.1 draws
26/256 = 0.1016). :func:`keep_scale` is 256 / (256 - threshold), the inverse of the keep rate
drawn, so that the dropped P_ij is P_ij on average exactly. A rate that rounds to 0 or to 1
(0 < p < 1/512, p >= 1 - 1/512) is refused rather than silently changed into no dropout or
dropping everything. Rows and columns are the query and key positions in the whole sequence,
not in a tile: any tiling gives the same mask. The numbers are integers throughout, so NumPy,
torch and a GPU agree bit for bit.

(seed, offset) come from torch's generator of the inputs' device (:func:`draw_rng`): a run
after ``torch.manual_seed`` repeats, two calls drop differently.
"""

from __future__ import annotations

import math

import numpy as np

# Philox4x32 constants (Salmon et al. 2011; the same in triton.language.random and cuRAND)
PHILOX_ROUND_A = 0xD2511F53  # multiplies c0
PHILOX_ROUND_B = 0xCD9E8D57  # multiplies c2
PHILOX_KEY_A = 0x9E3779B9  # added to k0 after every round (the golden ratio)
PHILOX_KEY_B = 0xBB67AE85  # added to k1 (sqrt(3) - 1)
N_ROUNDS = 7  # FlashAttention-2's choice; 7 rounds pass BigCrush, Triton's default is 10
ENTRIES = 16  # entries per Philox call: one byte each
KEEP_BITS = 8  # the bits of an entry compared with the threshold

_U32 = np.uint32
_MASK32 = 0xFFFFFFFF


def threshold(p: float) -> int:
    """The integer t with keep = byte >= t: 256 p rounded half up. The rate drawn is t / 256."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    t = math.floor(p * 2 ** KEEP_BITS + 0.5)
    if p > 0 and not 0 < t < 2 ** KEEP_BITS:
        raise ValueError(f"dropout_p={p} rounds to {t}/256: the kernels draw the rate in steps "
                         f"of 1/256, so use 0, or a rate in [1/512, 1 - 1/512)")
    return t


def drawn_rate(p: float) -> float:
    """The rate the mask drops at: threshold(p) / 256 (0.1 -> 0.1015625)."""
    return threshold(p) / 2 ** KEEP_BITS


def keep_scale(p: float) -> float:
    """What a kept entry is multiplied by: 1 / (1 - drawn_rate(p)), so that the dropped
    P_ij is P_ij on average exactly (1 for p = 0)."""
    return 2 ** KEEP_BITS / (2 ** KEEP_BITS - threshold(p))


def philox(seed: int, c0, c1, c2, c3, n_rounds: int = N_ROUNDS):
    """Philox4x32 on uint32 arrays (broadcast together): the twin of ``tl.philox(seed, c0, c1,
    c2, c3, n_rounds)`` (triton.language.random, the same in Triton 3.6 and 3.9). Returns the
    four output words."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    k0, k1 = seed & _MASK32, seed >> 32
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=_U32) for c in (c0, c1, c2, c3)))
    for _ in range(n_rounds):
        prod0 = c0.astype(np.uint64) * np.uint64(PHILOX_ROUND_A)  # exact: < 2**64
        prod2 = c2.astype(np.uint64) * np.uint64(PHILOX_ROUND_B)
        hi0, lo0 = (prod0 >> np.uint64(32)).astype(_U32), prod0.astype(_U32)
        hi2, lo2 = (prod2 >> np.uint64(32)).astype(_U32), prod2.astype(_U32)
        c0, c1, c2, c3 = hi2 ^ c1 ^ _U32(k0), lo2, hi0 ^ c3 ^ _U32(k1), lo0
        k0 = (k0 + PHILOX_KEY_A) & _MASK32
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def counters(rows, cols):
    """(c0, c1) of each entry's Philox call: 16 entries share one (see the module's doc)."""
    return cols & ~0b11001, rows & ~0b1000


def word_and_shift(rows, cols):
    """Which of the call's four words holds an entry's byte, and that byte's bit offset."""
    return (cols >> 3) & 3, 16 * ((rows >> 3) & 1) + 8 * (cols & 1)


def random_bytes(seed: int, offset: int, bh: int, rows, cols):
    """The random byte of every (row, col): uint32 in [0, 256), shape (len(rows), len(cols))."""
    rows = np.asarray(rows, dtype=np.int64)[:, None]
    cols = np.asarray(cols, dtype=np.int64)[None, :]
    c0, c1 = counters(rows, cols)
    words = philox(seed, c0, c1, bh, int(offset) & _MASK32)
    word, shift = (np.broadcast_to(x, words[0].shape) for x in word_and_shift(rows, cols))
    return (np.choose(word, words) >> shift.astype(_U32)) & _U32(0xFF)


def keep_tile(seed: int, offset: int, bh: int, rows, cols, p: float) -> np.ndarray:
    """Z_ij of one tile: bool (len(rows), len(cols)), True where P_ij is kept. ``rows`` and
    ``cols`` are the tile's query and key positions in the sequence; ``bh`` = b * H + h."""
    return random_bytes(seed, offset, bh, rows, cols) >= threshold(p)


def dropout_mask(seed: int, offset: int, B: int, H: int, Nq: int, Nk: int, p: float) -> np.ndarray:
    """The whole keep-mask Z, bool (B, H, Nq, Nk), for small sizes (it is what the kernels never
    store). Every backend drops exactly the entries where it is False, given the same
    (seed, offset). A call ``flashedu.attention(..., dropout_p=p)`` on CPU tensors right after
    ``torch.manual_seed(s)`` uses the (seed, offset) that ``draw_rng("cpu")`` returns right
    after ``torch.manual_seed(s)``."""
    if B * H * Nq * Nk > 2 ** 26:
        raise ValueError(f"dropout_mask is for small sizes; B*H*Nq*Nk = {B * H * Nq * Nk} "
                         "entries would need several GiB of temporaries")
    Z = np.empty((B, H, Nq, Nk), dtype=bool)
    for b in range(B):
        for h in range(H):
            Z[b, h] = keep_tile(seed, offset, b * H + h, np.arange(Nq), np.arange(Nk), p)
    return Z


# ----------------------------------------------------------------------------------------
# The RNG state: two int64 numbers drawn from torch's generator
# ----------------------------------------------------------------------------------------

SEED_RANGE = 2 ** 62  # seeds and offsets are drawn in [0, 2**62): non-negative int64


def draw_rng(device):
    """(seed, offset) as an int64 tensor of 2 on ``device``, drawn from torch's default
    generator for that device: ``torch.manual_seed`` makes it repeat, every call advances it.

    It is drawn by a torch op on the device, not read on the host: a CUDA graph that captures
    the call draws new numbers at every replay (torch's generator is graph-safe), and
    torch.compile sees an ordinary random op."""
    import torch

    return torch.randint(SEED_RANGE, (2,), dtype=torch.int64, device=device)


def rng_values(rng) -> tuple[int, int]:
    """(seed, offset) as Python ints from the tensor of :func:`draw_rng` (a host sync)."""
    seed, offset = (int(x) for x in rng.detach().cpu().tolist())
    return seed, offset


# ----------------------------------------------------------------------------------------
# The same stream in torch (int64 tensors, on any device): the naive backend's mask
# ----------------------------------------------------------------------------------------


def _mulhilo_torch(a, b: int):
    """(hi, lo) 32-bit words of a * b, a an int64 tensor in [0, 2**32), b < 2**32, without
    64-bit overflow: b is split in 16-bit halves."""
    t = a * (b & 0xFFFF)  # < 2**48
    u = a * (b >> 16) + (t >> 16)  # < 2**49
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def keep_mask_torch(rng, B: int, H: int, Nq: int, Nk: int, p: float):
    """The keep-mask Z (B, H, Nq, Nk) bool on ``rng``'s device: :func:`dropout_mask` computed
    with torch int64 ops (no host sync, so it runs inside CUDA graphs and torch.compile)."""
    import torch

    dev = rng.device
    seed, offset = rng[0], rng[1]
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    rows = torch.arange(Nq, device=dev).view(1, 1, Nq, 1)
    cols = torch.arange(Nk, device=dev).view(1, 1, 1, Nk)
    bh = torch.arange(B * H, device=dev).view(B, H, 1, 1)
    shape = (B, H, Nq, Nk)
    c0, c1 = (c.expand(shape) for c in counters(rows, cols))
    c2 = bh.expand(shape)
    c3 = (offset & _MASK32).expand(shape)
    for _ in range(N_ROUNDS):
        hi0, lo0 = _mulhilo_torch(c0, PHILOX_ROUND_A)
        hi2, lo2 = _mulhilo_torch(c2, PHILOX_ROUND_B)
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_KEY_A) & _MASK32
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    word, shift = word_and_shift(rows, cols)
    word = word.expand(shape)
    r = torch.where(word == 0, c0, torch.where(word == 1, c1, torch.where(word == 2, c2, c3)))
    return ((r >> shift) & 0xFF) >= threshold(p)
