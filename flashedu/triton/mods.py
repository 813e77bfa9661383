"""Mask mods and score mods inside the Triton kernels (``flashedu.mods``, FlexAttention's idea).

Mask mods are evaluated by the host: it works out the block mask's rule (tile grid, causal
flag, mask mod, sequence ends) on the partial tiles only, the ones the kernels walk in their
masked loop, and hands them over as one uint8 tile (Br x Bc) per listed partial tile
(``sparse.element_lists``). Full tiles run without a mask, empty ones are not visited, so the
work and the extra memory grow with the partial tiles alone (a sliding window or documents:
O(N) tiles, not N x N). Any mask mod a user writes works this way.

Two mask mods are compiled instead, hooks (below) that the kernels call where they apply the
visibility rule: the library's ``sliding_window``, two compares band_lo < key - query <=
band_hi, cheaper than reading a byte per pair (the element masks made the d=128 window forward
1.31-1.39x slower: BENCHMARKS.md, "Mask mods repeated"), and ``packed`` sequences (varlen), a
sequence id and an offset read per row and per column of a tile.

Score mods are hooks too: ``@triton.jit`` functions passed to the kernels as constexpr
arguments, inlined where the step computes S_ij, forward and backward (FlexAttention inlines
a mod the same way, through a template). The library's ``softcap`` and ``alibi`` are two of
them; a score mod written in Triton by its user (``flashedu.mods.triton_score_mod``) is
compiled the same way. A score mod written in torch runs on the numpy and naive backends.

SDPA's float ``attn_mask`` is a bias added after the score mod, read tile by tile with
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

# The lowest finite score the kernels keep, in natural units: -2**127 * log2(e) is still a
# float32 with room to subtract a row maximum, where finfo(float32).min * log2(e) is -inf.
SCORE_FLOOR = tl.constexpr(-2.0 ** 127)


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1: portable across Triton versions and the interpreter
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


# --- the hooks: score mods and compiled mask mods, as the kernels call them -------------------
#
# A score mod takes the scaled score s = scale * S_ij of a tile and returns the new score and
# its derivative d new / d s (the backward multiplies dS_ij by it; the forward does not use
# it, and the compiler drops it there):
#
#     score_mod(s, b, h, q_idx, kv_idx, args) -> (new s, d new / d s)
#
# A compiled mask mod answers FlexAttention's question for a tile:
#
#     mask_mod(b, h, q_idx, kv_idx, args) -> bool tile
#
# q_idx, kv_idx are the tile's query and key indices, broadcast to its shape; b, h the batch
# and query head; args the tuple the call handed over (``score_mod_args``, ``band_args``).


@triton.jit
def softcap(s, b, h, q_idx, kv_idx, args):
    """cap * tanh(s / cap), derivative 1 - tanh^2 (args: (cap,))."""
    t = _tanh(s / args[0])
    return args[0] * t, 1.0 - t * t


@triton.jit
def alibi(s, b, h, q_idx, kv_idx, args):
    """s + slopes[h] * (kv_idx - q_idx), derivative 1 (args: (slopes,), float32 per head)."""
    return s + tl.load(args[0] + h) * (kv_idx - q_idx).to(tl.float32), 1.0


@triton.jit
def sliding_window(b, h, q_idx, kv_idx, args):
    """The sliding window, compiled: band_lo < kv_idx - q_idx <= band_hi (args: (band_lo,
    band_hi), from ``band_args``)."""
    offset = kv_idx - q_idx
    return (offset > args[0]) & (offset <= args[1])


@triton.jit
def packed(b, h, q_idx, kv_idx, args):
    """Packed sequences, compiled: the query sees the key iff both lie in one sequence and the
    key's offset in it is at most the query's last visible offset (args: (seq_q, last, seq_k,
    offset_k, Nq, Nk), int32 per position, from ``flashedu.mods.packed``'s ``kernel_args``)."""
    seq_q, last, seq_k, offset_k, Nq, Nk = args
    q_ok = q_idx < Nq
    k_ok = kv_idx < Nk
    same = (tl.load(seq_q + q_idx, mask=q_ok, other=-1)
            == tl.load(seq_k + kv_idx, mask=k_ok, other=-2))
    return same & (tl.load(offset_k + kv_idx, mask=k_ok, other=0)
                   <= tl.load(last + q_idx, mask=q_ok, other=-1))


HOOKS = {"softcap": softcap, "alibi": alibi}  # the library score mods, by ``kind``


@triton.jit
def mod_scores(S, q_idx, kv_idx, Nk, ctx, SCORE_MOD: tl.constexpr):
    """(s, ds): s = score_mod(scale * S) plus, with a bias, SDPA's float attn_mask, in natural
    units; ds = the score mod's derivative at scale * S (1 without one), for the backward.
    ctx = (b, h, Nq, scale, bias, score_args, mask_args) of the program (``context``);
    q_idx, kv_idx as a hook takes them (S is Br x Bc in the forward and the dQ pass, its
    transpose in the dK/dV pass)."""
    b, h, Nq, scale, bias, score_args, mask_args = ctx
    s = S * scale
    ds = 1.0
    if SCORE_MOD is not None:
        s, ds = SCORE_MOD(s, b, h, q_idx, kv_idx, score_args)
    if bias is not None:  # the bias may be -inf: a pair it hides gets P = 0
        B_ptr, stride_bb, stride_bh, stride_bq, stride_bk = bias
        ok = (q_idx < Nq) & (kv_idx < Nk)
        s = s + tl.load(B_ptr + b * stride_bb + h * stride_bh + q_idx * stride_bq
                        + kv_idx * stride_bk, mask=ok, other=0.0).to(tl.float32)
        # a finite score stays finite in base 2 (SCORE_FLOOR); -inf and NaN pass as they are
        s = tl.where((s < SCORE_FLOOR) & (s != float("-inf")), SCORE_FLOOR, s)
    return s, ds


@triton.jit
def visible(q_idx, kv_idx, Nk, E, ctx, IS_CAUSAL: tl.constexpr, MASK_MOD: tl.constexpr):
    """The visibility rule, the one every kernel applies to a masked tile: key kv_idx is
    visible to query q_idx iff it lies before Nk, is not after the query (causal), is kept by
    the block mask's element mask of this tile (E = (origin, Bc) of ``tiles.element_origin``,
    or None) and by the compiled mask mod (or None)."""
    ok = kv_idx < Nk
    if IS_CAUSAL:
        ok = ok & (kv_idx <= q_idx)
    if E is not None:
        ok = ok & (tl.load(E[0] + q_idx * E[1] + kv_idx) != 0)
    if MASK_MOD is not None:
        ok = ok & MASK_MOD(ctx[0], ctx[1], q_idx, kv_idx, ctx[6])
    return ok


def band_args(mods, block_mask):
    """(band_lo, band_hi) of a block mask whose partial tiles need the library's sliding
    window (the kernels then compile its rule, the ``sliding_window`` hook), else None. Query
    i sees key j iff i + offset - window < j <= i + offset + lookahead (offset: Nk - Nq when
    aligned to the bottom right), that is band_lo < j - i <= band_hi."""
    mod = mods and mods.mask_mod
    if getattr(mod, "kind", None) != "sliding_window":
        return None
    mod = mod.bind(block_mask.seq_lens)
    return mod.offset - mod.window, mod.offset + mod.lookahead


def compiled_mask_mod(mods, block_mask, device):
    """(hook, args) of a launch whose block mask's partial tiles need a mask mod the kernels
    compile: the library's sliding window (``band_args``) and packed sequences (per-position
    tables); (None, None) for any other mod, whose partial tiles read element masks."""
    band = band_args(mods, block_mask)
    if band is not None:
        return sliding_window, band
    mod = mods and mods.mask_mod
    if getattr(mod, "kind", None) == "packed":
        return packed, mod.kernel_args(device)
    return None, None


def bias_args(attn_mask, B, H, Nq, Nk):
    """(BIAS_PTR, stride_bb, stride_bh, stride_bq, stride_bk) of a float attn_mask broadcast
    to (B, H, Nq, Nk) (stride 0 along broadcast dims: no copy), or None."""
    if attn_mask is None:
        return None
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    m = m.expand(B, H, Nq, Nk)
    return (m, *m.stride())


def score_mod_args(score_mod, device):
    """(hook, args) of a launch's score mod: the library's softcap and ALiBi, or a score mod
    written in Triton (``flashedu.mods.triton_score_mod``); (None, None) without one."""
    import torch

    if score_mod is None:
        return None, None
    kind = getattr(score_mod, "kind", None)
    if kind == "triton":
        return score_mod.hook, score_mod.args
    if kind not in HOOKS:
        raise NotImplementedError(
            f"the triton backend compiles the library score mods {sorted(HOOKS)} "
            f"(flashedu.mods.softcap, flashedu.mods.alibi) and score mods written in Triton "
            f"(flashedu.mods.triton_score_mod), got {score_mod!r}; a score mod in torch runs "
            f"on backend 'numpy' or 'naive'")
    if kind == "alibi":
        return alibi, (score_mod.slopes.to(device=device, dtype=torch.float32).contiguous(),)
    return softcap, (float(score_mod.cap),)
