"""The merge rule: two partial attention results over disjoint keys make the exact whole.

Attention over keys K = K_a ∪ K_b (disjoint) is a softmax over the union. With the per-row
logsumexp L_a = log Σ_{j∈a} e^{S_j} and O_a = Σ_{j∈a} e^{S_j - L_a} V_j (the same for b):

    L = log(e^{L_a} + e^{L_b}) = logaddexp(L_a, L_b)
    O = Σ_{j∈a∪b} e^{S_j - L} V_j = e^{L_a - L} O_a + e^{L_b - L} O_b

The two weights e^{L_a - L} and e^{L_b - L} are each part's share of the softmax mass; they sum
to 1. This is the online-softmax rescaling of FlashAttention written for finished parts, and it
is what lets attention be split across programs (split-KV decoding, ``flashedu.triton.decode``)
and across GPUs (ring attention, ``flashedu.distributed``).

A part that saw no key has L = -inf and O = 0 (the package's convention): its weight is 0 and it
contributes nothing. When no part saw a key, the merge gives L = -inf and O = 0 again.

Shapes: O is (..., N, d), L is (..., N). Every function here takes NumPy arrays or torch
tensors; the torch path is differentiable (no NaN gradients, even for rows that see nothing).
"""

from __future__ import annotations

import numpy as np


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def merge(O_a, L_a, O_b, L_b):
    """(O, L) over the union of two disjoint key sets, from each set's (O, L)."""
    if _is_torch(O_a):
        import torch

        return merge_stacked(torch.stack([O_a, O_b]), torch.stack([L_a, L_b]))
    return merge_stacked(np.stack([O_a, O_b]), np.stack([L_a, L_b]))


def merge_many(parts):
    """(O, L) over the union of any number of disjoint key sets; ``parts`` is [(O_p, L_p), ...].

    One pass (not a fold of :func:`merge`): L = logsumexp_p L_p and O = Σ_p e^{L_p - L} O_p.
    Because the merge is associative and commutative, the order of the parts does not matter.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("merge_many needs at least one (O, L) part, got none")
    Os, Ls = zip(*parts)
    if _is_torch(Os[0]):
        import torch

        return merge_stacked(torch.stack(Os), torch.stack(Ls))
    return merge_stacked(np.stack(Os), np.stack(Ls))


def merge_stacked(O, L):
    """Merge parts stacked on the first axis: O (P, ..., N, d), L (P, ..., N) -> (O, L)."""
    if _is_torch(O):
        return _merge_stacked_torch(O, L)
    return _merge_stacked_numpy(np.asarray(O), np.asarray(L))


def _merge_stacked_numpy(O, L):
    m = L.max(axis=0)  # the largest part's L: subtracting it keeps every exponent <= 0
    empty = np.isneginf(m)  # no part saw a key for this row
    m = np.where(empty, 0.0, m)
    w = np.exp(L - m)  # (P, ..., N): e^{L_p - m}, 0 for a part that saw no key
    s = w.sum(axis=0)  # >= 1 where some part saw a key, 0 where none did
    s_safe = np.where(empty, 1.0, s)
    with np.errstate(divide="ignore"):
        L_out = np.where(empty, -np.inf, m + np.log(s_safe))
    O_out = (w[..., None] * O).sum(axis=0) / s_safe[..., None]
    return O_out.astype(O.dtype, copy=False), L_out.astype(L.dtype, copy=False)


def _merge_stacked_torch(O, L):
    import torch

    # m only shifts the exponents and cancels out of both results, so it carries no gradient;
    # detaching it also keeps max()'s subgradient out of the picture.
    m = L.amax(dim=0).detach()
    empty = torch.isneginf(m)
    m = torch.where(empty, torch.zeros_like(m), m)
    w = torch.exp(L - m)  # exp(-inf) = 0 with gradient 0: empty parts stay out of the gradient
    s = w.sum(dim=0)
    s_safe = torch.where(empty, torch.ones_like(s), s)  # log and divide only see s >= 1
    L_out = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(s_safe))
    O_out = (w.unsqueeze(-1) * O).sum(dim=0) / s_safe.unsqueeze(-1)
    return O_out.to(O.dtype), L_out.to(L.dtype)


def merge_into(O, L, O_b, L_b):
    """Merge the part (O_b, L_b) into the running (O, L) **in place** (torch tensors, no autograd).

    The same rule as :func:`merge`, written for a running accumulator that must not be copied
    (ring attention keeps one per GPU): L' = logaddexp(L, L_b), O' = e^{L - L'} O + e^{L_b - L'} O_b.
    O and L may be views (row slices) of larger tensors; O_b may have another dtype than O.
    """
    import torch

    L_new = torch.logaddexp(L, L_b)  # -inf where neither part saw a key
    m = torch.where(torch.isneginf(L_new), torch.zeros_like(L_new), L_new)
    O.mul_(torch.exp(L - m).unsqueeze(-1))  # an empty part has e^{-inf} = 0: no NaN anywhere
    O.addcmul_(O_b, torch.exp(L_b.to(L.dtype) - m).unsqueeze(-1))
    L.copy_(L_new)
