"""``flashedu.attention``: one entry point, shaped like torch's scaled_dot_product_attention.

It checks every argument once (so no backend ever sees malformed input), folds the block mask's
causal flag into ``is_causal``, and hands over to the chosen backend.

A plain call (no attn_mask, score mod or lse; a block mask, with its mask mod, and dropout are
allowed) whose signature an earlier call had (the same options, rate and block mask; inputs
with the same shapes, strides, dtype, device and alignment) passed those checks already: it
goes straight to the repeat its backend left for that signature (``Backend.repeater``; the
triton backend's is ``flashedu.triton_backend.make_repeat``, which draws each call's dropout
state as the general path does) and skips the general path, whose host time is more than a
small attention's kernels take on a GPU.
"""

from __future__ import annotations

import torch

from . import ops
from .arguments import (check_attn_mask, check_block_mask, check_dropout, check_flag,
                        check_score_mod, check_scale, check_sinks, check_tensors)
from .backends import BACKENDS, backends_with, resolve_backend
from .dropout import threshold
from .masks import BlockMask

# A plain call's signature -> its backend's repeat (``Backend.repeater``): a later call with the
# same signature skips the checks it passed and the general path it took.
REPEATS: dict = {}
_MAX_REPEATS = 256


def attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0,
              block_mask=None, score_mod=None, enable_gqa=False, return_lse=False,
              sinks=None, backend="auto"):
    """Exact attention softmax(scale * q k^T) v, computed by a FlashAttention backend.

    q: (B, H, Nq, d); k, v: (B, Hkv, Nk, d); returns (B, H, Nq, d) in q's dtype. Empty inputs
    give SDPA's empty result (Nk = 0: zeros, an lse of -inf).
    attn_mask: SDPA's: a bool tensor (True: the pair takes part) or a float tensor added to
    the scores, broadcastable to (B, H, Nq, Nk) (a 1-D (Nk,) mask too, which SDPA refuses). A
    finite value is a bias, not a mask: a row whose every entry is ``finfo.min`` (Hugging
    Face's "masked") weighs its keys equally (the mean of v), as the formula and SDPA's CPU
    path do; only -inf (or False) hides a pair. Not together with is_causal: SDPA documents
    that as an error (its CPU kernel applies both); put the causal rule into the mask, or use
    a block mask from flashedu.mods.causal().
    The triton backend turns a bool mask into a block mask on every call; for a mask reused
    across calls, pass ``block_mask=BlockMask.from_bool_mask(mask)`` built once instead.
    is_causal: query i sees keys j <= i (top-left aligned, as SDPA's is_causal).
    scale: defaults to 1/sqrt(d). dropout_p: in [0, 1]; 1 drops every weight (zeros, as
    SDPA); the mask draws it in steps of 1/256, kept weights scaled by the inverse of the keep
    rate drawn (:mod:`flashedu.dropout`), and a rate in (0, 1/512) or [1 - 1/512, 1) is
    refused. block_mask: a :class:`flashedu.BlockMask`; tiles it marks False are skipped, its
    mask mod masks its partial tiles element-wise (:meth:`BlockMask.from_mask_mod`).
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` (:mod:`flashedu.mods`), applied to
    scale * q k^T before attn_mask is added and the masks apply (``mods.alibi`` needs one
    slope per query head). enable_gqa: allow H to be a multiple of Hkv (grouped-query
    attention).
    return_lse: also return the natural-log logsumexp of each row's (modified) scores,
    (B, H, Nq), float32 (float64 for float64 inputs), -inf for a row that sees nothing:
    ``out, lse = attention(..., return_lse=True)``; gradients flow through it too.
    sinks: attention sinks (gpt-oss), a (H,) tensor with one logit per query head that joins
    every row's softmax denominator and takes no value: P_ij = exp(S_ij) / (exp(sink_h) +
    sum_j exp(S_ij)), so a row may give less than all of its weight to the keys (a row that
    sees no key gives zeros). The lse then includes the sink. Differentiable: the sink's
    gradient is -sum_i P_i,sink (D_i - dlse_i), its column of dS = P * (dP - D).
    backend: "naive", "numpy", "numba", "triton", or "auto" (triton for CUDA tensors on a CUDA
    GPU, numpy for CPU tensors, naive for tensors of another device).
    A query row that sees no key gives zeros. A backend without a feature that the call uses
    raises NotImplementedError naming the backends that have it. numpy and triton have no
    double backward (naive has): a second backward through their gradients raises.

    Accepted as SDPA accepts them: Python or NumPy bools for the flags, Python or NumPy reals for
    ``scale`` (within float32's normal range, see ``SCALE_RANGE``), and tensors that are views
    with the negative or conjugate bit (``torch._neg_view``, ``.conj()``): they are resolved
    first. Anything else raises a TypeError or ValueError that names the argument.
    """
    key = _repeat_key(q, k, v, attn_mask, is_causal, scale, dropout_p, block_mask, score_mod,
                      enable_gqa, return_lse, backend, sinks)
    if key is not None:
        repeat = REPEATS.get(key)
        if repeat is not None:
            out = repeat(q, k, v, sinks)
            if out is not None:
                return out
    name = _check_backend(backend, q)
    spec = BACKENDS[name]
    q, k, v, is_causal, scale, return_lse = checked_arguments(q, k, v, is_causal, enable_gqa,
                                                              scale, return_lse)
    dropout_p = check_dropout(dropout_p)
    extras = {}  # features a backend receives only when the call uses them
    if attn_mask is not None:
        extras["attn_mask"] = check_attn_mask(attn_mask, q, k, is_causal)
    if score_mod is not None:
        extras["score_mod"] = check_score_mod(score_mod, q, k)
    if return_lse:
        extras["return_lse"] = True
    if sinks is not None:
        extras["sinks"] = check_sinks(sinks, q)
    if block_mask is not None:
        check_block_mask(block_mask, q, k)
        is_causal = is_causal or block_mask.is_causal
    _check_features(name, spec, extras, block_mask)
    if dropout_p > 0 and not spec.has_dropout:
        with_dropout = [n for n, s in BACKENDS.items() if s.has_dropout]
        raise NotImplementedError(
            f"backend {name!r} does not implement dropout (dropout_p={dropout_p}); "
            f"use one of {with_dropout}, or dropout_p=0.0")
    if q.numel() == 0 or k.numel() == 0:
        return _empty_attention(q, k, v, is_causal, scale, block_mask, **extras)
    if dropout_p == 1.0:
        return _all_dropped(spec, q, k, v, is_causal, scale, block_mask, extras)
    fn = spec.load()
    out = fn(q, k, v, is_causal=is_causal, scale=scale, block_mask=block_mask, dropout_p=dropout_p,
             **extras)
    # once per signature: a signature the backend cannot repeat stays None, and a repeat that
    # handed one call back (a dispatch mode) keeps the launches it learned
    if (key is not None and key not in REPEATS and spec.repeater is not None
            and ops.plain_eager(q, k, v, *(() if sinks is None else (sinks,)))):
        if len(REPEATS) >= _MAX_REPEATS:  # shapes that change every call: start over
            REPEATS.clear()
        REPEATS[key] = spec.repeater()(q, k, v, is_causal, scale, block_mask, dropout_p)
    return out


def checked_arguments(q, k, v, is_causal, enable_gqa, scale, return_lse):
    """(q, k, v, is_causal, scale, return_lse) after the checks every entry makes of the
    arguments it shares with SDPA: the flags, the tensors (grouped-query attention where
    enable_gqa), the scale (None: 1/sqrt(d)); q, k, v with any negative or conjugate bit
    resolved."""
    is_causal = check_flag(is_causal, "is_causal")
    enable_gqa = check_flag(enable_gqa, "enable_gqa")
    check_tensors(q, k, v, enable_gqa)
    q, k, v = (t.resolve_neg().resolve_conj() for t in (q, k, v))
    scale = check_scale(scale, q.shape[-1])
    return_lse = check_flag(return_lse, "return_lse")
    return q, k, v, is_causal, scale, return_lse


def _empty_attention(q, k, v, is_causal, scale, block_mask, return_lse=False, **features):
    """SDPA's result for empty inputs. No key (Nk = 0): every row sees nothing, so zeros and
    an lse of -inf; otherwise the output is empty itself and the formula (the naive backend,
    whose reductions run over the non-empty key axis) gives its shapes and any lse."""
    B, H, Nq, d = q.shape
    if k.shape[2] == 0 and "sinks" not in features:  # (with sinks, each row sees its sink)
        out = _Zeros.apply(q, k, v)
        if not return_lse:
            return out
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return out, torch.full((B, H, Nq), float("-inf"), dtype=lse_dtype, device=q.device)
    naive = BACKENDS["naive"].load()
    return naive(q, k, v, is_causal=is_causal, scale=scale, block_mask=block_mask,
                 enable_gqa=True, return_lse=return_lse, **features)


def _all_dropped(spec, q, k, v, is_causal, scale, block_mask, extras):
    """dropout_p = 1 drops every attention weight: zeros, as SDPA gives (the kernels' 1 / (1 -
    p) would be a division by zero). The lse, which dropout never changes, comes from the
    backend without dropout."""
    out = _Zeros.apply(q, k, v)
    if not extras.get("return_lse"):
        return out
    _, lse = spec.load()(q, k, v, is_causal=is_causal, scale=scale, block_mask=block_mask,
                         dropout_p=0.0, **extras)
    return out, lse


class _Zeros(torch.autograd.Function):
    """Zeros shaped like q whose gradients are zeros: attention where every weight is 0."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        return torch.zeros_like(q, memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, dout):
        return tuple(torch.zeros(shape, dtype=dtype, device=device)
                     for shape, dtype, device in ctx.inputs)


def _repeat_key(q, k, v, attn_mask, is_causal, scale, dropout_p, block_mask, score_mod,
                enable_gqa, return_lse, backend, sinks=None):
    """The signature of a plain call, or None: no attn_mask, score mod or lse, a dropout rate
    the stream draws (a block mask, with its mask mod, is a value; sinks are data, their
    layout is in the key);
    the options of their plain types; q, k, v (and the sinks) plain dense tensors, neither
    negative nor conjugate views.
    Everything the checks and the general path read of such a call is in it, so two calls with
    one signature pass the same checks and launch the same kernels."""
    if (attn_mask is not None or score_mod is not None
            or not (block_mask is None or type(block_mask) is BlockMask)
            or return_lse is not False or type(is_causal) is not bool
            or type(enable_gqa) is not bool or type(backend) is not str
            or not (scale is None or type(scale) is float)
            or not _repeatable_rate(dropout_p) or torch.compiler.is_compiling()):
        return None
    layouts = (_layout(q), _layout(k), _layout(v))
    if sinks is not None:
        layouts += (_layout(sinks),)
    if None in layouts:
        return None
    # a block mask is a value, hashed once (BlockMask.__hash__); the same object, as a
    # training loop passes it, compares by identity. Deterministic mode picks other kernels
    # (launch.backward), so a repeat is kept for each
    return (backend, is_causal, scale, enable_gqa, block_mask, dropout_p,
            torch.are_deterministic_algorithms_enabled(), *layouts)


def _repeatable_rate(p) -> bool:
    """A plain float or int dropout rate the kernels draw: 0, or in (0, 1) on the stream's
    steps (anything else takes the general path, which says what is wrong with it)."""
    if type(p) not in (float, int):
        return False
    if p == 0:
        return True
    try:
        return 0 < p < 1 and threshold(p) > 0
    except ValueError:
        return False


def _layout(t):
    """(shape, strides, dtype, device, 16-byte aligned) of a plain dense tensor, else None."""
    if (type(t) is not torch.Tensor or t.is_nested or t.layout is not torch.strided
            or t.is_neg() or t.is_conj()):
        return None
    try:
        return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0
    except RuntimeError:  # a tensor without storage of its own (a torch.func wrapper)
        return None


def _check_features(name, spec, extras, block_mask) -> None:
    """NotImplementedError, naming the backends that have it, for a feature ``name`` lacks."""
    wanted = [f for f in ("attn_mask", "score_mod", "return_lse", "sinks") if f in extras]
    if block_mask is not None and block_mask.needs_mask_mod:
        kind = getattr(block_mask.mask_mod, "kind", None)
        if not spec.has_mask_mod and kind not in spec.mask_mod_kinds:
            have = backends_with("mask_mod")
            raise NotImplementedError(
                f"backend {name!r} does not apply a block mask's mask mod inside its partial "
                f"tiles (block_mask.mask_mod = {block_mask.mask_mod!r}); use one of {have}")
    if "score_mod" in extras and not spec.has_score_mod:
        kind = getattr(extras["score_mod"], "kind", None)
        if kind not in spec.score_mod_kinds:
            raise NotImplementedError(
                f"backend {name!r} compiles only the library score mods "
                f"{sorted(spec.score_mod_kinds)}, got {extras['score_mod']!r}; any score mod "
                f"runs on {backends_with('score_mod')}")
        wanted.remove("score_mod")
    if "attn_mask" in extras and spec.has_attn_mask:
        kind = "float" if extras["attn_mask"].is_floating_point() else "bool"
        if kind not in spec.attn_mask_kinds:
            have = [n for n, s in BACKENDS.items() if s.has_attn_mask and kind in s.attn_mask_kinds]
            raise NotImplementedError(
                f"backend {name!r} does not implement a {kind} attn_mask; use one of {have} "
                f"(or, on {name!r}, a bool attn_mask or a mask mod)")
    for feature in wanted:
        if not getattr(spec, f"has_{feature}"):
            raise NotImplementedError(f"backend {name!r} does not implement {feature}; use one "
                                      f"of {backends_with(feature)}")


def _check_backend(backend, q=None) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    name = resolve_backend(backend, q)
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {['auto', *BACKENDS]}, got {backend!r}")
    return name


