"""FlashAttention in Triton: the course's last stage, and the "triton" backend.

    forward.py   one program per (Q tile, batch*head), FlashAttention-2 order, exp2 softmax
    backward.py  D = rowsum(dO * O), then dK/dV (K/V-outer) and dQ (Q-outer): no atomics
    decode.py    split-KV decoding: a few queries against a long K/V cache
    autograd.py  the tile table entry of a call (tiles fitted to a block mask); the autograd
                 link of forward and backward is flashedu.ops (torch.library operators)
    sparse.py    BlockMask -> per-tile index lists (kv_indices, q_indices)
    config.py    tile sizes per head dim
    fast.py      launching: compiled kernels started directly, a plan of each call's
                 launches, Hopper's copy engine (TMA) and warp specialization
    repeat.py    a plain call with an earlier call's signature: from flashedu.attention
                 straight to that call's launches, forward and backward
    ablations.py slower variants, only to be measured against the kernels (notebook 10)

On a machine without a CUDA GPU the same kernels run in Triton's interpreter on CPU tensors
(``flashedu.runtime`` sets TRITON_INTERPRET=1 before triton is imported). The interpreter's
16-bit tl.dot is unreliable, so there the launch code hands the kernels float32 copies of
16-bit inputs and casts the results back (``forward.interpreter_fp32``).
"""

from __future__ import annotations

import math

import torch

from .. import ops, runtime
from . import backward, forward  # noqa: F401  the kernels: this import fails where triton does
from .config import MAX_HEAD_DIM

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

__all__ = ["attention", "forward_with_lse", "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]


def attention(q, k, v, *, is_causal, scale, block_mask, dropout_p, attn_mask=None,
              score_mod=None, return_lse=False):
    """Backend entry point (inputs already checked by flashedu.attention).

    A bool ``attn_mask`` becomes a block mask whose mask mod reads it (only its partial tiles
    are read element-wise), a float one a bias the kernels read tile by tile; ``score_mod``
    must be a library mod the kernels compile (``mods.SCORE_MODS``)."""
    _check(q, k, v)
    if (attn_mask is not None and not attn_mask.is_floating_point()
            and not ops.holds_no_values(q, attn_mask)):  # meta or fake: shapes only
        block_mask = bool_mask_as_block_mask(attn_mask, block_mask, q.shape[2], k.shape[2])
        attn_mask = None
    return ops.attention("triton", q, k, v, is_causal=is_causal, scale=float(scale),
                         block_mask=block_mask, dropout_p=dropout_p, attn_mask=attn_mask,
                         score_mod=score_mod, return_lse=return_lse)


def bool_mask_as_block_mask(attn_mask, block_mask, Nq: int, Nk: int):
    """The BlockMask of SDPA's bool ``attn_mask`` (True: the pair takes part), within
    ``block_mask`` if one is given: tiles with no True are skipped, tiles all True run
    unmasked, the rest read the mask element-wise. Built on every call (the mask is data)."""
    from ..masks import BlockMask

    own = BlockMask.from_bool_mask(attn_mask, block_size=(128, 128), seq_lens=(Nq, Nk))
    if block_mask is None:
        return own
    B, H = own.blocks.shape[:2]
    inner = block_mask.expand(max(B, block_mask.blocks.shape[0]),
                              max(H, block_mask.blocks.shape[1]))

    def both(b, h, q_idx, kv_idx):  # own.mask_mod reads the attn_mask
        return own.mask_mod(b, h, q_idx, kv_idx) & inner.visible(b, h, q_idx, kv_idx)

    return BlockMask.from_mask_mod(both, *inner.blocks.shape[:2], Nq, Nk,
                                   block_size=block_mask.block_size, device=attn_mask.device)


def forward_with_lse(q, k, v, *, is_causal=False, scale=None, block_mask=None):
    """(O, L): the output and the natural-log logsumexp (B, H, Nq) of the scaled scores, as
    ``flashedu.tiled.flash_forward`` returns per head (-inf for a row that sees no key)."""
    _check(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o, lse2 = ops.triton_forward(q, k, v, is_causal, scale, *ops.mask_args(block_mask))
    return o, ops.LSE_TO_NATURAL["triton"](lse2)


def _check(q, k, v):
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k, v: the triton backend takes {[str(t) for t in SUPPORTED_DTYPES]}, "
                        f"got {q.dtype}")
    d = q.shape[-1]
    if d > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim d={d} is not supported by the triton backend "
                         f"(1 <= d <= {MAX_HEAD_DIM})")
    if q.device.type == "meta":  # shapes only: the operator's fake implementation runs
        return
    if runtime.triton_interpreted():
        if q.device.type != "cpu":
            raise ValueError(f"q, k, v must be CPU tensors while Triton runs in its interpreter "
                             f"(TRITON_INTERPRET=1), got device {q.device}")
    elif q.device.type != "cuda":
        raise ValueError(f"q, k, v must be CUDA tensors for the compiled triton backend, got "
                         f"device {q.device}; move them with .cuda()")
