"""Packed variable-length batches: attention over many sequences of different lengths, stored
one after another with no padding, as flash-attn's ``flash_attn_varlen_func`` takes them.

    out = flashedu.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, is_causal=True)

q is (total_q, H, d), k and v (total_k, Hkv, d); sequence s holds the rows
cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1 of q and cu_seqlens_k[s] .. cu_seqlens_k[s+1] - 1 of
k and v. The packed tokens are one long sequence whose block mask shows each sequence its own
keys (:func:`flashedu.mods.packed`, the tiles worked out from the cuts alone by
:meth:`BlockMask.from_packed`): tiles that hold no pair of one sequence are never computed,
tiles inside one sequence run unmasked, and only the tiles on a sequence's border apply the
rule, which the triton backend compiles into its kernels (a sequence id and an offset read per
row and column). So the whole batch is one launch of the kernels, with neither padding nor a
mask per pair, forward and backward, on every backend with mask mods.
"""

from __future__ import annotations

import torch

from .masks import BlockMask


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
    block mask (the kernels' tiles divide it). The rest as :func:`flashedu.attention`."""
    total_q, total_k = _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, block_size)
    mask = None  # no query or no key: nothing to mask (a query that sees no key gives zeros)
    if total_q and total_k:
        mask = BlockMask.from_packed(cu_seqlens_q, cu_seqlens_k, is_causal,
                                     (block_size, block_size))
    # (total, H, d) -> (1, H, total, d): views; the kernels index rows and heads by stride
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    from .api import attention

    out = attention(qb, kb, vb, block_mask=mask, scale=scale, dropout_p=dropout_p,
                    enable_gqa=True, return_lse=return_lse, backend=backend)
    if return_lse:
        out, lse = out
        return out[0].transpose(0, 1), lse[0]
    return out[0].transpose(0, 1)


def _check(q, k, v, cu_q, cu_k, max_q, max_k, block_size):
    """(total_q, total_k) after checking the packed layout; a ValueError or TypeError naming
    the argument otherwise (the tensors themselves are checked by flashedu.attention)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total, heads, d), the sequences packed one "
                             f"after another, got shape {tuple(t.shape)}")
    lengths = []
    for name, cu, total, longest in (("cu_seqlens_q", cu_q, q.shape[0], max_q),
                                     ("cu_seqlens_k", cu_k, k.shape[0], max_k)):
        if not isinstance(cu, torch.Tensor) or cu.is_floating_point() or cu.dtype == torch.bool:
            raise TypeError(f"{name} must be an int tensor (batch + 1,), got "
                            f"{type(cu).__name__ if not isinstance(cu, torch.Tensor) else cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got "
                             f"{tuple(cu.shape)}")
        values = cu.detach().cpu().to(torch.int64)
        if values[0] != 0 or (values.diff() < 0).any() or values[-1] != total:
            raise ValueError(f"{name} must start at 0, never decrease and end at the total "
                             f"{total}, got {values.tolist()}")
        if isinstance(longest, bool) or not isinstance(longest, int):
            raise TypeError(f"max_seqlen_{name[-1]} must be an int, got {type(longest).__name__}")
        if longest < int(values.diff().max()):
            raise ValueError(f"max_seqlen_{name[-1]} = {longest} is shorter than the longest "
                             f"sequence, {int(values.diff().max())}")
        lengths.append(values)
    if lengths[0].numel() != lengths[1].numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe one batch, got "
                         f"{lengths[0].numel() - 1} and {lengths[1].numel() - 1} sequences")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16:
        raise ValueError(f"block_size must be an int >= 16, got {block_size!r}")
    return q.shape[0], k.shape[0]
