"""Mask mods and score mods inside the Triton kernels (``flashedu.mods``, FlexAttention's idea).

Mask mods are evaluated by the host: it works out the block mask's rule (tile grid, causal
flag, mask mod, sequence ends) on the partial tiles only, the ones the kernels walk in their
masked loop, and hands them over as one uint8 tile (Br x Bc) per listed partial tile
(``sparse.element_lists``). Full tiles run without a mask, empty ones are not visited, so the
work and the extra memory grow with the partial tiles alone (a sliding window or documents:
O(N) tiles, not N x N). Any mask mod a user writes works this way.

One mask mod is compiled instead: the library's ``sliding_window`` (BAND). Its rule is two
compares, band_lo < key - query <= band_hi, cheaper than reading a byte per pair (the element
masks made the d=128 window forward 1.31-1.39x slower: BENCHMARKS.md, "Mask mods repeated").

Score mods are compiled: the library's ``softcap`` and ``alibi`` (their ``kind``) become
SCORE_MOD = 1 or 2 and change S_ij inside the step, forward and backward (with the derivative
the backward needs). A user's own score mod runs on the numpy and naive backends.

SDPA's float ``attn_mask`` is a bias added after the score mod (BIAS), read tile by tile with
its own strides (0 where it broadcasts); a bool one is a mask mod (``bool_mask_as_block_mask``).
A finite bias is a bias, not a mask: a row whose every score is ``finfo.min`` (Hugging Face's
"masked") weighs its keys equally, as the formula does. The base-2 exponent s * log2(e) would
overflow float32 to -inf there and turn the row into one that sees nothing, so finite scores
below ``SCORE_FLOOR`` are raised to it (only -inf hides a pair).

With a score mod or a bias the kernels move to natural units first: s_ij = scale * S_ij, the
mod, the bias, then the base-2 exponent s * log2(e) (``qk_scale`` = log2(e) in that case).
"""

from __future__ import annotations

import triton
import triton.language as tl

SCORE_MODS = {"softcap": 1, "alibi": 2}  # the library kinds compiled into the kernels
# The lowest finite score the kernels keep, in natural units: -2**127 * log2(e) is still a
# float32 with room to subtract a row maximum, where finfo(float32).min * log2(e) is -inf.
SCORE_FLOOR = tl.constexpr(-2.0 ** 127)


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1: portable across Triton versions and the interpreter
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def apply_score_mod(S_ij, mod_scale, cap, slope, kv_minus_q, SCORE_MOD: tl.constexpr):
    """s_ij = score_mod(scale * S_ij): softcap cap * tanh(s / cap), or ALiBi s + slope * (j - i)
    (``kv_minus_q`` = key index - query index, shaped like S_ij)."""
    s = S_ij * mod_scale
    if SCORE_MOD == 1:
        s = cap * _tanh(s / cap)
    if SCORE_MOD == 2:
        s = s + slope * kv_minus_q.to(tl.float32)
    return s


@triton.jit
def score_mod_grad(s_mod, cap, SCORE_MOD: tl.constexpr):
    """d s_mod / d s at the modded score: 1 - tanh^2 = 1 - (s_mod / cap)^2 for softcap, 1 for
    ALiBi (a shift)."""
    if SCORE_MOD == 1:
        t = s_mod / cap
        return 1.0 - t * t
    else:
        return 1.0


@triton.jit
def head_mods(SLOPES, BIAS_PTR, b, h, stride_bb, stride_bh, SCORE_MOD: tl.constexpr,
              BIAS: tl.constexpr):
    """(slope, B_head) of query head h in batch b: its ALiBi slope and where its attn_mask
    starts (0 where the launch has neither)."""
    slope = 0.0
    if SCORE_MOD == 2:
        slope = tl.load(SLOPES + h)
    B_head = 0
    if BIAS:
        B_head = BIAS_PTR + b * stride_bb + h * stride_bh
    return slope, B_head


@triton.jit
def mod_scores(S, q_idx, kv_idx, Nq, Nk, mod_scale, cap, slope, B_head, stride_bq, stride_bk,
               SCORE_MOD: tl.constexpr, BIAS: tl.constexpr):
    """(s, ds): s = score_mod(scale * S) plus, with BIAS, SDPA's float attn_mask, in natural
    units; ds = the score mod's derivative at s (before the bias), for the backward.
    q_idx, kv_idx: the tile's query and key indices, broadcast to S's shape (S is Br x Bc in
    the forward and the dQ pass, its transpose in the dK/dV pass)."""
    s = apply_score_mod(S, mod_scale, cap, slope, kv_idx - q_idx, SCORE_MOD)
    ds = score_mod_grad(s, cap, SCORE_MOD)
    if BIAS:  # the bias may be -inf: a pair it hides gets P = 0
        ok = (q_idx < Nq) & (kv_idx < Nk)
        s = s + tl.load(B_head + q_idx * stride_bq + kv_idx * stride_bk, mask=ok,
                        other=0.0).to(tl.float32)
        # a finite score stays finite in base 2 (SCORE_FLOOR); -inf and NaN pass as they are
        s = tl.where((s < SCORE_FLOOR) & (s != float("-inf")), SCORE_FLOOR, s)
    return s, ds


@triton.jit
def in_band(q_idx, kv_idx, band_lo, band_hi):
    """The compiled sliding window: key kv_idx is visible to query q_idx iff
    band_lo < kv_idx - q_idx <= band_hi (``band_args``), broadcast to the tile's shape."""
    offset = kv_idx - q_idx
    return (offset > band_lo) & (offset <= band_hi)


@triton.jit
def element_tile(E_tile, ROWS: tl.constexpr, COLS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The bool (ROWS x COLS) element mask stored at E_tile (row-major, ROWS x COLS), or, for
    the dK/dV pass, its transpose (stored COLS x ROWS)."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    if TRANSPOSED:
        return tl.load(E_tile + c[None, :] * ROWS + r[:, None]) != 0
    else:
        return tl.load(E_tile + r[:, None] * COLS + c[None, :]) != 0


@triton.jit
def element_start(ELEM_BASE, b, h, row, stride_numb, stride_numh, num_full,
                  ELEMENT: tl.constexpr):
    """Where a list row's element masks start, less num_full: masked tile t (t >= num_full) has
    its mask at index e0 + t (``sparse.element_lists``); 0 without element masks."""
    if ELEMENT:
        return tl.load(ELEM_BASE + b * stride_numb + h * stride_numh + row) - num_full
    else:
        return 0


@triton.jit
def element_ptr(ELEM, e0, t, TILE: tl.constexpr, ELEMENT: tl.constexpr):
    """The element mask of masked tile t (TILE = Br * Bc entries each), or 0 without."""
    if ELEMENT:
        return ELEM + (e0 + t) * TILE
    else:
        return 0


def band_args(mods, block_mask):
    """(band_lo, band_hi) of a block mask whose partial tiles need the library's sliding
    window (the kernels then compile its rule, BAND), else None. Query i sees key j iff
    i + offset - window < j <= i + offset + lookahead (offset: Nk - Nq when aligned to the
    bottom right), that is band_lo < j - i <= band_hi."""
    mod = mods and mods.mask_mod
    if getattr(mod, "kind", None) != "sliding_window":
        return None
    mod = mod.bind(block_mask.seq_lens)
    return mod.offset - mod.window, mod.offset + mod.lookahead


def bias_args(attn_mask, B, H, Nq, Nk):
    """(BIAS_PTR, stride_bb, stride_bh, stride_bq, stride_bk) of a float attn_mask broadcast
    to (B, H, Nq, Nk) (stride 0 along broadcast dims: no copy), or (None, 0, 0, 0, 0)."""
    if attn_mask is None:
        return None, 0, 0, 0, 0
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    m = m.expand(B, H, Nq, Nk)
    return (m, *m.stride())


def score_mod_args(score_mod, scale, device):
    """(SCORE_MOD, mod_scale, cap, SLOPES) for a launch: (0, scale, 1.0, None) without one
    (mod_scale is also what a bias alone needs: scores in natural units)."""
    import torch

    if score_mod is None:
        return 0, float(scale), 1.0, None
    kind = getattr(score_mod, "kind", None)
    if kind not in SCORE_MODS:
        raise NotImplementedError(
            f"the triton backend compiles the library score mods {sorted(SCORE_MODS)} "
            f"(flashedu.mods.softcap, flashedu.mods.alibi), got {score_mod!r}; a score mod of "
            f"your own runs on backend 'numpy' or 'naive'")
    slopes = None
    cap = 1.0
    if kind == "alibi":
        slopes = score_mod.slopes.to(device=device, dtype=torch.float32).contiguous()
    else:
        cap = float(score_mod.cap)
    return SCORE_MODS[kind], float(scale), cap, slopes
