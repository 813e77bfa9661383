"""The "numpy" backend: torch tensors in, the NumPy tiled kernels of :mod:`flashedu.tiled` per
(batch, head), autograd through :func:`flashedu.tiled.flash_backward`. This module holds the
backend's forward and backward, which :data:`KERNELS` hands to the one autograd path of
:mod:`flashedu.ops` (its ``entry`` is what :mod:`flashedu.backends` registers).

Slow by design (a Python loop over heads and tiles); it exists so that the exact algorithm a
learner reads in NumPy is the one tested against every other backend, on any machine. PyTorch
sees it as the operators ``torch.ops.flashedu.numpy_forward`` / ``numpy_backward``
(:mod:`flashedu.ops`), so torch.compile, meta tensors and vmap handle it as one node.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import ops, tiled

DEFAULT_BLOCK = (64, 64)  # (Br, Bc) when no block mask fixes the tiling


def prepare(q, k, v, attn_mask, block_mask, score_mod):
    """What this backend does to a checked call before its kernels run: refuse a score mod
    that computes with tensors requiring grad (:func:`refuse_captured_grad`). Calls with
    element-level rules (attn_mask, a score mod, a block mask whose partial tiles need its mask
    mod) or return_lse run eagerly under torch.compile (a graph break): the operators carry tile
    grids only."""
    refuse_captured_grad(q, score_mod)
    return attn_mask, block_mask


def forward(q, k, v, *, is_causal, scale, block_mask, dropout_p=0.0, rng=None, attn_mask=None,
            score_mod=None, sinks=None):
    """(O, L) for every (batch, head): L is the natural-log logsumexp (B, H, Nq) in the
    computing dtype (float64 for float64 inputs, else float32), on q's device.
    ``dropout_p`` > 0: dropout with rng = tensor([seed, offset]) (``flashedu.dropout``).
    ``attn_mask``, ``score_mod`` and the block mask's mask mod: see :func:`_head_mods`.
    ``sinks`` (H,): each head's sink logit (``tiled.flash_forward``'s ``sink``)."""
    blocks, (Br, Bc) = _tiling(block_mask, q.shape[0], q.shape[1])
    blocks, head_mods = _head_mods(q, k, block_mask, blocks, Br, Bc, attn_mask, score_mod)
    seed, offset = _rng(dropout_p, rng)
    qn, kn, vn = (_to_numpy(t) for t in (q, k, v))
    B, H, Nq, d = qn.shape
    group = H // kn.shape[1]
    O = np.empty_like(qn)
    L = np.empty((B, H, Nq), dtype=qn.dtype)
    sink = [None] * H if sinks is None else _to_numpy(sinks).tolist()
    for b in range(B):
        for h in range(H):
            O[b, h], L[b, h] = tiled.flash_forward(
                qn[b, h], kn[b, h // group], vn[b, h // group], Br, Bc, is_causal, scale,
                block_mask=None if blocks is None else blocks[b, h],
                dropout_p=dropout_p, seed=seed, offset=offset, bh=b * H + h,
                mods=head_mods(b, h), sink=sink[h])
    return _to_torch(O, q), torch.from_numpy(L).to(q.device)


def backward(q, k, v, out, lse, d_out, *, is_causal, scale, block_mask, dropout_p=0.0,
             rng=None, attn_mask=None, score_mod=None, d_lse=None, mask_grad=False):
    """(dQ, dK, dV) from the forward's (O, L), one head at a time (Algorithm 4 of the paper);
    with dropout, the forward's ``rng`` regenerates its mask. ``d_lse``: the gradient reaching
    the returned logsumexp (B, H, Nq), or None. ``mask_grad=True`` (a float attn_mask):
    also the gradient of attn_mask, summed to its shape; it is dS_ij itself, the gradient at the
    final score, since the mask is added last."""
    blocks, (Br, Bc) = _tiling(block_mask, q.shape[0], q.shape[1])
    blocks, head_mods = _head_mods(q, k, block_mask, blocks, Br, Bc, attn_mask, score_mod)
    dLn = None if d_lse is None else d_lse.detach().cpu().double().numpy()
    seed, offset = _rng(dropout_p, rng)
    qn, kn, vn, on, dOn = (_to_numpy(t) for t in (q, k, v, out, d_out))
    Ln = lse.detach().cpu().numpy()
    B, H = qn.shape[:2]
    group = H // kn.shape[1]
    dQ = np.zeros_like(qn)
    dK = np.zeros_like(kn)  # K/V heads shared by a group accumulate its gradients
    dV = np.zeros_like(vn)
    dM = np.zeros((B, H, qn.shape[2], kn.shape[2]), qn.dtype) if mask_grad else None
    for b in range(B):
        for h in range(H):
            mods_bh = head_mods(b, h)
            if mask_grad:
                mods_bh.dbias = dM[b, h]
            dq, dk, dv = tiled.flash_backward(
                qn[b, h], kn[b, h // group], vn[b, h // group], on[b, h], dOn[b, h],
                Ln[b, h], Br, Bc, is_causal, scale,
                block_mask=None if blocks is None else blocks[b, h],
                dropout_p=dropout_p, seed=seed, offset=offset, bh=b * H + h,
                mods=mods_bh, dL=None if dLn is None else dLn[b, h])
            dQ[b, h] = dq
            dK[b, h // group] += dk
            dV[b, h // group] += dv
    grads = _to_torch(dQ, q), _to_torch(dK, k), _to_torch(dV, v)
    if mask_grad:
        return (*grads, _to_torch(dM, attn_mask).sum_to_size(attn_mask.shape))
    return grads


def refuse_captured_grad(q, score_mod) -> None:
    """The numpy backend differentiates a score mod with respect to the score only: a mod that
    computes with tensors that require grad (a learned bias) is refused, not silently frozen.
    Called before the kernels run, when gradients are on."""
    if score_mod is None or not torch.is_grad_enabled():
        return
    s = torch.zeros(1, 1, 1, 1, dtype=q.dtype if q.is_floating_point() else torch.float32)
    idx = [torch.zeros(1, 1, 1, 1, dtype=torch.int64) for _ in range(4)]
    try:
        with torch.enable_grad():
            out = score_mod(s, *idx)
    except Exception:  # noqa: BLE001 - the kernel reports a failing mod with its own message
        return
    if isinstance(out, torch.Tensor) and out.requires_grad:
        raise NotImplementedError(
            "the numpy backend gives no gradient to tensors a score_mod computes with (this "
            "one uses a tensor that requires grad); use backend='naive', whose autograd "
            "reaches them, or detach them")


def _rng(dropout_p, rng):
    """(seed, offset) as ints for the NumPy loops; (0, 0) without dropout."""
    if dropout_p == 0:
        return 0, 0
    from .dropout import rng_values

    return rng_values(rng)


def _head_mods(q, k, block_mask, blocks, Br, Bc, attn_mask, score_mod):
    """(blocks, head_mods): the tile grid to visit and a function (b, h) -> tiled.TileMods or
    None, from the block mask's mask mod, SDPA's attn_mask and the score mod.

    A bool attn_mask becomes a mask mod (and tiles where it is all False are skipped); a float
    one a score mod that adds it, after ``score_mod`` (see flashedu.mods for the order)."""
    from . import mods

    B, H, Nq, Nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
    mask_mods, score_mods = [], []
    full = None if blocks is None else np.ones((B, H, Tr, Tc), bool)
    if block_mask is not None and block_mask.needs_mask_mod:
        mask_mods.append(block_mask.mask_mod)
        full = np.broadcast_to(block_mask.full_blocks, (B, H, Tr, Tc))
    if score_mod is not None:
        score_mods.append(score_mod)
    if attn_mask is not None:
        shape = (B, H, Nq, Nk)
        if attn_mask.dtype == torch.bool:
            mask_mods.append(mods._DenseMask(attn_mask.detach().cpu(), shape))
            seen, every = _tile_any_all(attn_mask.detach().cpu().expand(shape).numpy(), Br, Bc)
            blocks = seen if blocks is None else blocks & seen
            full = every if full is None else full & every
        else:
            score_mods.append(mods._Bias(attn_mask.detach().cpu(), shape))
    if not mask_mods and not score_mods:
        return blocks, lambda b, h: None
    mask_mod = None if not mask_mods else (
        mask_mods[0] if len(mask_mods) == 1 else mods.and_masks(*mask_mods))
    s_mod = None if not score_mods else (
        score_mods[0] if len(score_mods) == 1 else mods._Chain(score_mods))

    def head_mods(b, h):
        return tiled.TileMods(Nq, Nk, Br, Bc, b=b, h=h, mask_mod=mask_mod, score_mod=s_mod,
                              full=None if full is None else full[b, h])

    return blocks, head_mods


def _tile_any_all(mask, Br, Bc):
    """Per (Br x Bc) tile of a (B, H, Nq, Nk) bool array: any True, all True."""
    B, H, Nq, Nk = mask.shape
    Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
    padded = np.zeros((B, H, Tr * Br, Tc * Bc), bool)
    padded[..., :Nq, :Nk] = mask
    valid = np.zeros((Tr * Br, Tc * Bc), bool)
    valid[:Nq, :Nk] = True
    tiles = (B, H, Tr, Br, Tc, Bc)
    return (padded.reshape(tiles).any(axis=(3, 5)),
            (padded | ~valid).reshape(tiles).all(axis=(3, 5)))


def _tiling(block_mask, B, H):
    if block_mask is None:
        return None, DEFAULT_BLOCK
    return block_mask.expand(B, H).blocks, block_mask.block_size


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """float64 stays float64; every other dtype computes in float32."""
    t = t.detach().cpu()
    return t.numpy() if t.dtype == torch.float64 else t.float().numpy()


def _to_torch(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=like.device, dtype=like.dtype)


# ----- the kernels, as the autograd path calls them (module names looked up at each call) -----


def _call_forward(q, k, v, call):
    score_mod = call.mods and call.mods.score_mod  # the mask mod rides on the block mask
    return forward(q, k, v, is_causal=call.is_causal, scale=call.scale,
                   block_mask=call.block_mask, dropout_p=call.dropout_p, rng=call.rng,
                   attn_mask=call.attn_mask, score_mod=score_mod, sinks=call.sinks)


def _call_backward(q, k, v, out, lse, dout, call, dlse=None, mask_grad=False, D=None):
    # (the NumPy loop computes its own D, as tiled.flash_backward teaches)
    score_mod = call.mods and call.mods.score_mod
    return backward(q, k, v, out, lse, dout, is_causal=call.is_causal, scale=call.scale,
                    block_mask=call.block_mask, dropout_p=call.dropout_p, rng=call.rng,
                    attn_mask=call.attn_mask, score_mod=score_mod, d_lse=dlse,
                    mask_grad=mask_grad)


def _row_dot(out, dout):
    acc = _lse_dtype(out.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1)


def _empty_outputs(*tensors):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# its lse is the natural log already
KERNELS = ops.Kernels("numpy", _call_forward, _call_backward, _row_dot, lambda lse: lse,
                      _empty_outputs, _lse_dtype, prepare=prepare)
