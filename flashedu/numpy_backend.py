"""The "numpy" backend: torch tensors in, the NumPy tiled kernels of :mod:`flashedu.tiled` per
(batch, head), autograd through :func:`flashedu.tiled.flash_backward`.

Slow by design (a Python loop over heads and tiles); it exists so that the exact algorithm a
learner reads in NumPy is the one tested against every other backend, on any machine. PyTorch
sees it as the operators ``torch.ops.flashedu.numpy_forward`` / ``numpy_backward``
(:mod:`flashedu.ops`), so torch.compile, meta tensors and vmap handle it as one node.
"""

from __future__ import annotations

import numpy as np
import torch

from . import tiled

DEFAULT_BLOCK = (64, 64)  # (Br, Bc) when no block mask fixes the tiling


def attention(q, k, v, *, is_causal, scale, block_mask, dropout_p):
    """Backend entry point (inputs already checked by flashedu.attention)."""
    from . import ops

    return ops.attention("numpy", q, k, v, is_causal=is_causal, scale=scale,
                         block_mask=block_mask, dropout_p=dropout_p)


def forward(q, k, v, *, is_causal, scale, block_mask, dropout_p=0.0, rng=None):
    """(O, L) for every (batch, head): L is the natural-log logsumexp (B, H, Nq) in the
    computing dtype (float64 for float64 inputs, else float32), on q's device.
    ``dropout_p`` > 0: dropout with rng = tensor([seed, offset]) (``flashedu.dropout``)."""
    blocks, (Br, Bc) = _tiling(block_mask, q.shape[0], q.shape[1])
    seed, offset = _rng(dropout_p, rng)
    qn, kn, vn = (_to_numpy(t) for t in (q, k, v))
    B, H, Nq, d = qn.shape
    group = H // kn.shape[1]
    O = np.empty_like(qn)
    L = np.empty((B, H, Nq), dtype=qn.dtype)
    for b in range(B):
        for h in range(H):
            O[b, h], L[b, h] = tiled.flash_forward(
                qn[b, h], kn[b, h // group], vn[b, h // group], Br, Bc, is_causal, scale,
                block_mask=None if blocks is None else blocks[b, h],
                dropout_p=dropout_p, seed=seed, offset=offset, bh=b * H + h)
    return _to_torch(O, q), torch.from_numpy(L).to(q.device)


def backward(q, k, v, out, lse, d_out, *, is_causal, scale, block_mask, dropout_p=0.0,
             rng=None):
    """(dQ, dK, dV) from the forward's (O, L), one head at a time (Algorithm 4 of the paper);
    with dropout, the forward's ``rng`` regenerates its mask."""
    blocks, (Br, Bc) = _tiling(block_mask, q.shape[0], q.shape[1])
    seed, offset = _rng(dropout_p, rng)
    qn, kn, vn, on, dOn = (_to_numpy(t) for t in (q, k, v, out, d_out))
    Ln = lse.detach().cpu().numpy()
    B, H = qn.shape[:2]
    group = H // kn.shape[1]
    dQ = np.zeros_like(qn)
    dK = np.zeros_like(kn)  # K/V heads shared by a group accumulate its gradients
    dV = np.zeros_like(vn)
    for b in range(B):
        for h in range(H):
            dq, dk, dv = tiled.flash_backward(
                qn[b, h], kn[b, h // group], vn[b, h // group], on[b, h], dOn[b, h],
                Ln[b, h], Br, Bc, is_causal, scale,
                block_mask=None if blocks is None else blocks[b, h],
                dropout_p=dropout_p, seed=seed, offset=offset, bh=b * H + h)
            dQ[b, h] = dq
            dK[b, h // group] += dk
            dV[b, h // group] += dv
    return _to_torch(dQ, q), _to_torch(dK, k), _to_torch(dV, v)


def _rng(dropout_p, rng):
    """(seed, offset) as ints for the NumPy loops; (0, 0) without dropout."""
    if dropout_p == 0:
        return 0, 0
    from .dropout import rng_values

    return rng_values(rng)


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
