"""Packed variable-length batches: attention over many sequences of different lengths, stored
one after another with no padding, as flash-attn's ``flash_attn_varlen_func`` takes them.

    out = flashedu.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, is_causal=True)

q is (total_q, H, d), k and v (total_k, Hkv, d); sequence s holds the rows
cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1 of q and cu_seqlens_k[s] .. cu_seqlens_k[s+1] - 1 of
k and v.

Two ways to compute it, one result:
- The triton kernels read the cuts themselves (:class:`Packing`, ``tiles.sequence`` in the
  kernels), as flash-attn's varlen kernels do: one program per (Q tile of the longest
  sequence, sequence, head) finds its sequence's first row and length in cu_seqlens and runs
  the dense loop over that sequence alone; programs past their sequence's end return at
  once. Nothing per pair or per tile is built on the host, and the whole batch is one launch,
  forward and backward. Causal is each sequence's own, aligned to its bottom right (the
  kernels' diagonal moved by Lk - Lq).
- With dropout (whose mask is drawn at positions of the packed row), and on the numpy and
  naive backends, the packed tokens are one long sequence whose block mask shows each
  sequence its own keys (:func:`flashedu.mods.packed`, the tiles worked out from the cuts
  alone by :meth:`BlockMask.from_packed`): tiles that hold no pair of one sequence are never
  computed, tiles inside one sequence run unmasked, and only the tiles on a sequence's border
  apply the rule (the triton kernels compile it: a sequence id and an offset read per row and
  column). The numpy and naive backends compute the reference this way.

The cuts are checked on the host (a copy from the device); a cu_seqlens tensor checked once
and not changed since is not copied again, so a batch reused across calls costs no wait.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from .masks import BlockMask


class Packing(NamedTuple):
    """Packed sequences as the triton kernels read them (their SEQS argument): the cuts, int32
    on the inputs' device, and the longest query and key sequence, which size the grid,
    rounded up to a multiple of 16 (Triton compiles a kernel anew where an integer argument's
    divisibility by 16 changes: rounded, one kernel serves every packing)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     is_causal=False, scale=None, dropout_p=0.0, return_lse=False,
                     block_size=128, backend="auto"):
    """Attention of each packed sequence over its own keys; returns (total_q, H, d) in q's
    dtype, and with ``return_lse`` also the natural-log logsumexp (H, total_q), as flash-attn's
    ``softmax_lse``.

    cu_seqlens_q, cu_seqlens_k: int tensors (batch + 1,), 0 first, non-decreasing, the totals
    last (a sequence may be empty). max_seqlen_q, max_seqlen_k: at least the longest sequence
    (flash-attn sizes its grid by them; here they are checked). is_causal: flash-attn's, aligned
    to each sequence's bottom right (query n of Lq sees keys 0 .. n + Lk - Lq of its sequence).
    H must be a multiple of Hkv (grouped-query attention). ``block_size``: the tiles of the
    block mask, where one is used (the kernels' tiles divide it). The rest as
    :func:`flashedu.attention`."""
    total_q, total_k, longest = _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, block_size)
    # (total, H, d) -> (1, H, total, d): views; the kernels index rows and heads by stride
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    from .api import _check_backend, attention
    from .backends import BACKENDS

    spec = BACKENDS[_check_backend(backend, q)]
    if total_q and total_k and _reads_cuts(spec, dropout_p):
        packing = Packing(*(_on(cu, q.device) for cu in (cu_seqlens_q, cu_seqlens_k)),
                          *(-(-n // 16) * 16 for n in longest))
        out = _packed_call(spec, qb, kb, vb, packing, is_causal, scale, return_lse)
    else:
        mask = None  # no query or no key: nothing to mask (a query that sees no key gives zeros)
        if total_q and total_k:
            mask = BlockMask.from_packed(cu_seqlens_q, cu_seqlens_k, is_causal,
                                         (block_size, block_size))
        out = attention(qb, kb, vb, block_mask=mask, scale=scale, dropout_p=dropout_p,
                        enable_gqa=True, return_lse=return_lse, backend=backend)
    if return_lse:
        out, lse = out
        return out[0].transpose(0, 1), lse[0]
    return out[0].transpose(0, 1)


def _reads_cuts(spec, dropout_p) -> bool:
    """Whether the backend's kernels take the call as a :class:`Packing`: they read cuts,
    and there is no dropout."""
    return spec.has_packed and dropout_p == 0


def _packed_call(spec, q, k, v, packing, is_causal, scale, return_lse):
    """The backend's entry with the packing, after the checks :func:`flashedu.attention` makes
    of its arguments (the tensors as one batch of grouped-query attention, the flags, the
    scale)."""
    from .api import checked_arguments

    q, k, v, is_causal, scale, return_lse = checked_arguments(q, k, v, is_causal, True, scale,
                                                              return_lse)
    extras = {"return_lse": True} if return_lse else {}
    return spec.load()(q, k, v, is_causal=is_causal, scale=scale, block_mask=None,
                       seqs=packing, **extras)


def _on(cu, device):
    """A cu_seqlens tensor as the kernels read it: int32, contiguous, on ``device``."""
    return cu.to(device=device, dtype=torch.int32).contiguous()


# cu_seqlens tensors already checked: id -> (a weak reference, their version, their values)
_CHECKED: dict = {}


def _values(cu):
    """The int64 values of a cu_seqlens tensor on the host: copied from its device once, then
    reused while the same tensor is unchanged (its version counter)."""
    seen = _CHECKED.get(id(cu))
    if seen is not None and seen[0]() is cu and seen[1] == cu._version:
        return seen[2]
    values = cu.detach().cpu().to(torch.int64)
    if len(_CHECKED) >= 64:
        _CHECKED.clear()
    _CHECKED[id(cu)] = (weakref.ref(cu), cu._version, values)
    return values


def _check(q, k, v, cu_q, cu_k, max_q, max_k, block_size):
    """(total_q, total_k, (longest q, longest k)) after checking the packed layout; a
    ValueError or TypeError naming the argument otherwise (the tensors themselves are checked
    as flashedu.attention checks them)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total, heads, d), the sequences packed one "
                             f"after another, got shape {tuple(t.shape)}")
    longest_seen, counts = [], []  # the longest sequence, the number of cuts
    for name, cu, total, longest in (("cu_seqlens_q", cu_q, q.shape[0], max_q),
                                     ("cu_seqlens_k", cu_k, k.shape[0], max_k)):
        if not isinstance(cu, torch.Tensor) or cu.is_floating_point() or cu.dtype == torch.bool:
            raise TypeError(f"{name} must be an int tensor (batch + 1,), got "
                            f"{type(cu).__name__ if not isinstance(cu, torch.Tensor) else cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got "
                             f"{tuple(cu.shape)}")
        values = _values(cu)
        if values[0] != 0 or (values.diff() < 0).any() or values[-1] != total:
            raise ValueError(f"{name} must start at 0, never decrease and end at the total "
                             f"{total}, got {values.tolist()}")
        if isinstance(longest, bool) or not isinstance(longest, int):
            raise TypeError(f"max_seqlen_{name[-1]} must be an int, got {type(longest).__name__}")
        longest_seen.append(int(values.diff().max()))
        if longest < longest_seen[-1]:
            raise ValueError(f"max_seqlen_{name[-1]} = {longest} is shorter than the longest "
                             f"sequence, {longest_seen[-1]}")
        counts.append(values.numel())
    if counts[0] != counts[1]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe one batch, got "
                         f"{counts[0] - 1} and {counts[1] - 1} sequences")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16:
        raise ValueError(f"block_size must be an int >= 16, got {block_size!r}")
    return q.shape[0], k.shape[0], tuple(longest_seen)
