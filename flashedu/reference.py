"""Ground truth: softmax three ways, and standard (naive) attention in NumPy and torch.

Standard attention materializes the whole Nq x Nk score matrix S and probability matrix P.
That is exactly what FlashAttention avoids, and exactly what makes these functions the simplest
correct reference: every other implementation in flashedu is tested against them in float64.

Conventions shared by the whole package: scores are S = scale * Q K^T with scale = 1/sqrt(d) by
default; L is the natural-log logsumexp of each row of S over the visible keys (-inf for a row
that sees no key); a row that sees no key outputs zeros, never NaN.
"""

from __future__ import annotations

import math

import numpy as np

# ----------------------------------------------------------------------------------------
# Softmax, from the textbook formula to the streaming form FlashAttention is built on.
# ----------------------------------------------------------------------------------------


def naive_softmax(x):
    """exp(x) / sum(exp(x)) over the last axis. Overflows for logits above ~88 (float32)."""
    x = np.asarray(x)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def safe_softmax(x):
    """Softmax over the last axis, computed as exp(x - max) / sum(exp(x - max)).

    Subtracting the row maximum m changes nothing mathematically (the factor e^-m cancels) but
    keeps every exponent <= 0, so nothing overflows. A row of all -inf (nothing visible) gives
    zeros instead of NaN.
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)  # all -inf row: exp(-inf - 0) = 0 everywhere
    e = np.exp(x - m)
    s = e.sum(axis=-1, keepdims=True)
    return e / np.where(s == 0, 1, s)


def online_softmax(x, block_size):
    """Safe softmax whose statistics are streamed over column blocks of ``block_size``.

    One pass keeps, per row, the running maximum m and the running sum l of exp(x - m). When a
    new block raises the maximum from m to m_new, the old sum is rescaled by exp(m - m_new):
    that rescaling identity is the whole trick behind FlashAttention. A second pass normalizes.
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    n = x.shape[-1]
    m = np.full(x.shape[:-1] + (1,), -np.inf, dtype=x.dtype)
    l = np.zeros(x.shape[:-1] + (1,), dtype=x.dtype)
    for start in range(0, n, block_size):
        x_j = x[..., start:start + block_size]
        m_new = np.maximum(m, x_j.max(axis=-1, keepdims=True))
        m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
        l = l * np.exp(m - m_safe) + np.exp(x_j - m_safe).sum(axis=-1, keepdims=True)
        m = m_new
    m_safe = np.where(np.isneginf(m), 0.0, m)
    return np.exp(x - m_safe) / np.where(l == 0, 1, l)


def logsumexp(x):
    """log(sum(exp(x))) over the last axis, stably; -inf for an all -inf row."""
    x = np.asarray(x)
    m = x.max(axis=-1)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    with np.errstate(divide="ignore"):
        return m_safe + np.log(np.exp(x - m_safe[..., None]).sum(axis=-1))


# ----------------------------------------------------------------------------------------
# Standard attention (single head, NumPy): the paper's Algorithm 0.
# ----------------------------------------------------------------------------------------


def causal_mask(Nq: int, Nk: int) -> np.ndarray:
    """(Nq, Nk) bool, True where query i may see key j: j <= i (top-left aligned, as SDPA)."""
    return np.tri(Nq, Nk, dtype=bool)


def _visible(shape, causal, mask):
    """(Nq, Nk) bool of the pairs standard attention keeps: ``mask`` and, if causal, j <= i."""
    visible = np.ones(shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    return visible & causal_mask(*shape) if causal else visible


def naive_attention(Q, K, V, causal=False, scale=None, mask=None):
    """Standard attention, materializing S and P. Returns (O, L).

    ``mask`` is an optional (Nq, Nk) bool array of visible pairs (combined with ``causal``).
    """
    Q, K, V = (np.asarray(a) for a in (Q, K, V))
    scale = 1.0 / math.sqrt(Q.shape[-1]) if scale is None else scale
    S = scale * (Q @ K.T)  # (Nq, Nk): the matrix FlashAttention never writes to HBM
    S = np.where(_visible(S.shape, causal, mask), S, -np.inf)
    P = safe_softmax(S)
    return P @ V, logsumexp(S).astype(Q.dtype)


def naive_attention_backward(Q, K, V, dO, causal=False, scale=None, mask=None):
    """Gradients of standard attention by the textbook chain rule, storing P. (dQ, dK, dV)."""
    Q, K, V, dO = (np.asarray(a) for a in (Q, K, V, dO))
    scale = 1.0 / math.sqrt(Q.shape[-1]) if scale is None else scale
    S = scale * (Q @ K.T)
    P = safe_softmax(np.where(_visible(S.shape, causal, mask), S, -np.inf))
    dV = P.T @ dO
    dP = dO @ V.T
    dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))  # softmax Jacobian, row by row
    return scale * dS @ K, scale * dS.T @ Q, dV


# ----------------------------------------------------------------------------------------
# Standard attention in torch: the "naive" backend and the float64 reference for tests.
# ----------------------------------------------------------------------------------------


def expand_kv_heads(k, H: int):
    """Repeat each K/V head H // Hkv times (grouped-query attention), as SDPA's enable_gqa."""
    Hkv = k.shape[-3]
    return k if Hkv == H else k.repeat_interleave(H // Hkv, dim=-3)


def visible_mask_torch(Nq, Nk, *, is_causal=False, block_mask=None, device="cpu"):
    """Bool (…, Nq, Nk) tensor of visible pairs, or None when everything is visible."""
    import torch

    mask = None
    if block_mask is not None:
        mask = torch.as_tensor(_element_mask(block_mask), device=device)
    if is_causal:
        tri = torch.ones(Nq, Nk, dtype=torch.bool, device=device).tril()
        mask = tri if mask is None else mask & tri
    return mask


def _element_mask(block_mask) -> np.ndarray:
    """The block mask's visible pairs, worked out on real tensors: they are the block mask's,
    not the inputs', so a FakeTensorMode that gives the inputs shapes only must not reach them
    (torch.compile traces the call as it is)."""
    import torch

    if torch.compiler.is_compiling():
        return block_mask.element_mask()
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return block_mask.element_mask()


def naive_attention_torch(q, k, v, *, is_causal=False, scale=None, block_mask=None,
                          dropout_p=0.0, enable_gqa=False, return_lse=False, upcast=True,
                          dropout_rng=None, attn_mask=None, score_mod=None, sinks=None):
    """Standard attention on (B, H, N, d) tensors with torch ops; differentiable.

    ``upcast=True`` (the "naive" backend): float16 and bfloat16 inputs are computed in float32
    and the output is cast back, as SDPA's math backend does; 16-bit scores would overflow
    (float16 tops out at 65504, so q = k = 100 already gives inf - inf = NaN) or round away
    the differences between large logits (bfloat16 keeps 8 bits). ``upcast=False`` computes in
    the input dtype, as a plain PyTorch implementation would: the baseline of the tolerance rule
    (a kernel may miss by a few times what plain attention in its dtype misses). The lse, when
    returned, stays in the compute dtype. Rows with no visible key give zeros.

    Dropout (``dropout_p`` > 0, applied whenever it is > 0, also under torch.no_grad(), as
    SDPA does) drops the entries that :mod:`flashedu.dropout`'s stream drops, the numpy and
    triton backends' mask: ``dropout_rng`` = tensor([seed, offset]), drawn from torch's
    generator of q's device when None (so torch.manual_seed repeats it). The stream draws
    p in steps of 1/256 (``flashedu.dropout.drawn_rate``) and kept entries of P are scaled by
    ``keep_scale(p)`` = 1 / (1 - drawn rate); the lse is that of the undropped scores.

    The element rules, in order: S = scale * q k^T; ``score_mod(S, b, h, q_idx, kv_idx)`` (on
    the whole (B, H, Nq, Nk) matrix with broadcast index tensors, see :mod:`flashedu.mods`); a
    float ``attn_mask`` is added; then a pair is masked (-inf) unless the causal flag, the block
    mask (tiles and mask mod) and a bool ``attn_mask`` all let it through. Autograd
    differentiates through all of it, the score mod and a float attn_mask included.

    ``sinks`` (H,): each query head's sink logit, one more column of every row's softmax
    (never masked, no value): it takes its share of the weight, which no key receives; the
    lse includes it.
    """
    import torch

    if upcast and q.dtype in (torch.float16, torch.bfloat16):
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.float()
        out = naive_attention_torch(q.float(), k.float(), v.float(), is_causal=is_causal,
                                    scale=scale, block_mask=block_mask, dropout_p=dropout_p,
                                    enable_gqa=enable_gqa, return_lse=return_lse, upcast=False,
                                    dropout_rng=dropout_rng, attn_mask=attn_mask,
                                    score_mod=score_mod,
                                    sinks=None if sinks is None else sinks.float())
        if return_lse:
            return out[0].to(q.dtype), out[1]
        return out.to(q.dtype)
    H, Nq, Nk, d = q.shape[-3], q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = expand_kv_heads(k, H), expand_kv_heads(v, H)
    S = (q @ k.transpose(-2, -1)) * scale
    if score_mod is not None:
        from .mods import apply_score_mod, bind

        b, h, i, j = score_indices(S.shape, S.device)
        S = apply_score_mod(bind(score_mod, (Nq, Nk)), S, b, h, i, j)
    mask = visible_mask_torch(Nq, Nk, is_causal=is_causal, block_mask=block_mask, device=q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask if mask is None else mask & attn_mask
        else:
            S = S + attn_mask.to(S.dtype)
    if mask is not None:
        S = S.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # the sink's column: in the softmax, taken out before P @ v
        column = sinks.to(S.dtype).view(-1, 1, 1).expand(*S.shape[:-1], 1)
        S = torch.cat([S, column], dim=-1)
    m = S.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m).detach()
    P = torch.exp(S - m)
    l = P.sum(dim=-1, keepdim=True)
    seen = l != 0  # False only for a row that sees no key (NaN scores stay NaN)
    l_safe = torch.where(seen, l, torch.ones_like(l))  # log(1), x/1: no inf * 0 in the backward
    P = P / l_safe
    if sinks is not None:
        P = P[..., :-1]
    if dropout_p > 0:  # the paper's Z: one stream for every backend (flashedu.dropout)
        from .dropout import draw_rng, keep_mask_torch, keep_scale

        rng = draw_rng(q.device) if dropout_rng is None else dropout_rng.to(q.device)
        heads = math.prod(P.shape[:-2])
        Z = keep_mask_torch(rng, 1, heads, Nq, Nk, dropout_p).view(P.shape)
        P = torch.where(Z, P * keep_scale(dropout_p), torch.zeros_like(P))
    out = P @ v
    if return_lse:
        lse = torch.where(seen, m + torch.log(l_safe), float("-inf"))
        return out, lse.squeeze(-1)
    return out


def score_indices(shape, device="cpu"):
    """(b, h, q_idx, kv_idx) index tensors that broadcast to ``shape`` (B, H, Nq, Nk):
    (B, 1, 1, 1), (1, H, 1, 1), (1, 1, Nq, 1), (1, 1, 1, Nk), as mods receive them."""
    import torch

    B, H, Nq, Nk = shape
    return (torch.arange(B, device=device).view(B, 1, 1, 1),
            torch.arange(H, device=device).view(1, H, 1, 1),
            torch.arange(Nq, device=device).view(1, 1, Nq, 1),
            torch.arange(Nk, device=device).view(1, 1, 1, Nk))


def reference_attention(q, k, v, **kwargs):
    """float64 ground truth of :func:`naive_attention_torch`, returned in float64."""
    import torch

    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs["attn_mask"] = mask.to(torch.float64)
    return naive_attention_torch(*(t.to(torch.float64) for t in (q, k, v)), **kwargs)
