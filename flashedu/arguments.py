"""The checks of :func:`flashedu.attention`'s arguments: each bad input is a TypeError or a
ValueError that names the argument, before any backend sees it. The entry points beside it
(split-KV decoding, ring attention) take the same checks from here.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .masks import BlockMask

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# Every backend multiplies by ``scale`` in float32 at least (the kernels hold it in a float32
# register), so a scale is accepted only where float32 holds it as a normal number: below
# 2**-126 it would turn into a subnormal or 0 and the scores would silently lose their meaning.
SCALE_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))


def check_flag(value, name: str) -> bool:
    """A Python or NumPy bool, as SDPA takes; "no", 1 or None are refused, not read as truthy."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} "
                        f"{value!r}")
    return bool(value)


def check_tensors(q, k, v, enable_gqa) -> None:
    import torch

    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise TypeError(f"{arg} must be a dense tensor (B, H, N, d), got a nested tensor; "
                            "pad the sequences to one length (or call .to_padded_tensor(0.0)) "
                            "and mask the padding with a block_mask")
        if t.layout != torch.strided:
            raise TypeError(f"{arg} must be a dense (strided) tensor, got layout {t.layout}; "
                            "call .to_dense() first")
        if t.dim() != 4:
            raise ValueError(f"{arg} must be 4-D (B, H, N, d), got shape {tuple(t.shape)}")
        if str(t.dtype).removeprefix("torch.") not in FLOAT_DTYPES:
            raise TypeError(f"{arg} must have a floating dtype {FLOAT_DTYPES}, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, Hkv, Nk, d), "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim d, got {q.shape[-1]} and {k.shape[-1]}")
    H, Hkv = q.shape[1], k.shape[1]
    if H != Hkv:
        if not enable_gqa:
            raise ValueError(f"q has {H} heads but k, v have {Hkv}: pass enable_gqa=True for "
                             "grouped-query attention, or give k, v as many heads as q")
        if Hkv == 0 or H % Hkv:
            raise ValueError(f"q's head count ({H}) must be a multiple of k's ({Hkv}) with enable_gqa")


def is_real(x) -> bool:
    """A Python or NumPy int or float (np.float32 included, as SDPA takes); never a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def as_float(x, name: str) -> float:
    try:
        return float(x)
    except OverflowError:  # a Python int beyond float64, e.g. 10**400
        raise ValueError(f"{name} must be a finite float, got an int of {x.bit_length()} bits") from None


def check_scale(scale, d: int) -> float:
    if scale is None:  # d = 0: every score is an empty sum, 0 at any scale
        return 1.0 / math.sqrt(d) if d else 1.0
    if not is_real(scale):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = as_float(scale, "scale")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    lo, hi = SCALE_RANGE
    if not lo <= scale <= hi:
        raise ValueError(f"scale={scale!r} is outside float32's normal range [{lo:.3g}, {hi:.3g}]: "
                         "the kernels multiply by it in float32, where it would underflow or "
                         "overflow; scale q or k instead")
    return scale


def check_dropout(p) -> float:
    if not is_real(p):
        raise TypeError(f"dropout_p must be a float in [0, 1], got {type(p).__name__}")
    p = as_float(p, "dropout_p")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {p}")
    if p < 1.0:
        from .dropout import threshold

        threshold(p)  # the rate must be one the stream can draw (steps of 1/256)
    return p


def check_attn_mask(attn_mask, q, k, is_causal):
    """SDPA's attn_mask: bool or float, on q's device, broadcastable to (B, H, Nq, Nk)."""
    import torch

    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor (bool: True takes part; float: added "
                        f"to the scores) or None, got {type(attn_mask).__name__}")
    if attn_mask.is_nested or attn_mask.layout != torch.strided:
        raise TypeError("attn_mask must be a dense (strided) tensor")
    if is_causal:
        raise ValueError("attn_mask and is_causal=True cannot be combined (SDPA documents this "
                         "as an error; its CPU kernel applies both): put the causal rule into "
                         "attn_mask (mask & torch.ones(Nq, Nk, dtype=torch.bool).tril()), or "
                         "pass a block mask from BlockMask.from_mask_mod(flashedu.mods.causal(), "
                         "...)")
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"attn_mask must be bool, or float with q's dtype ({q.dtype}) or "
                        f"float32, got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask must be on q's device {q.device}, got {attn_mask.device}")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    ok = attn_mask.dim() <= 4
    if ok:
        try:
            ok = torch.broadcast_shapes(attn_mask.shape, full) == torch.Size(full)
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(f"attn_mask must broadcast to (B, H, Nq, Nk) = {full}, got shape "
                         f"{tuple(attn_mask.shape)}")
    return attn_mask.resolve_neg().resolve_conj()


def check_score_mod(score_mod, q, k):
    from .mods import bind

    if not callable(score_mod):
        raise TypeError(f"score_mod must be callable as score_mod(score, b, h, q_idx, kv_idx) "
                        f"or None, got {type(score_mod).__name__}")
    slopes = getattr(score_mod, "slopes", None) if getattr(score_mod, "kind", None) == "alibi" \
        else None
    if slopes is not None and slopes.numel() != q.shape[1]:
        # FlexAttention's own alibi reads slopes[h] and ignores the rest: more slopes than
        # heads is most often slopes made for another model, so it is refused
        raise ValueError(f"score_mod=mods.alibi(slopes) has {slopes.numel()} slopes, but q has "
                         f"{q.shape[1]} heads: pass one slope per query head "
                         f"(mods.alibi_slopes({q.shape[1]}))")
    return bind(score_mod, (q.shape[2], k.shape[2]))


def check_sinks(sinks, q):
    """Attention sinks: one logit per query head, a (H,) floating tensor on q's device."""
    import torch

    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a (H,) tensor of logits or None, got "
                        f"{type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must have shape (H,) = ({q.shape[1]},), one logit per query "
                         f"head, got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")
    return sinks.resolve_neg().resolve_conj()


def check_num_splits(num_splits):
    """Split-KV decoding's number of key chunks: a positive int, or None (a heuristic picks)."""
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    return num_splits


def check_block_mask(block_mask, q, k) -> None:
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a flashedu.BlockMask (see BlockMask.from_dense / "
                        f".from_flex), got {type(block_mask).__name__}")
    B, H, Nq = q.shape[0], q.shape[1], q.shape[2]
    Nk = k.shape[2]
    if block_mask.seq_lens != (Nq, Nk):
        raise ValueError(f"block_mask was built for seq_lens {block_mask.seq_lens}, "
                         f"but q, k have (Nq, Nk) = {(Nq, Nk)}")
    b, h = block_mask.blocks.shape[:2]
    if b not in (1, B) or h not in (1, H):
        raise ValueError(f"block_mask has blocks for (B, H) = {(b, h)}; expected 1 or {B} "
                         f"for B and 1 or {H} for H")
