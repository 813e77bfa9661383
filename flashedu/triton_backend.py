"""The "triton" backend: its entry point, and the repeat of a plain call.

The kernels and their launch are :mod:`flashedu.triton`; :mod:`flashedu.ops` puts their
forward and backward behind PyTorch's autograd (torch.library operators); this module is what
:mod:`flashedu.backends` registers: :func:`attention` checks what only this backend refuses
(dtypes, head dims, devices), turns a bool ``attn_mask`` into a block mask, and calls
``ops.attention("triton", ...)``. Importing the kernels fails where triton does: that is how
the registry tells that the backend is unavailable.

A repeated plain call is the backend's shortest path from ``flashedu.attention`` to the kernels.
A training step calls ``attention(q, k, v, is_causal=True)`` with tensors of one layout, step
after step: no attn_mask, no dropout, no logsumexp asked for, and at most a block mask built
once (with its mask mod, which the kernels apply on its partial tiles). The first such call
takes the general path (the argument checks, the backend, the tile table, the block mask's tile
lists, the launch plans of ``fast.PLANS``). Since everything it decided follows from the call's
signature (options, block mask, and the inputs' shapes, strides, dtype, device and alignment),
``flashedu.attention`` keeps a :class:`Repeat` for that signature, and a later call with the
same signature goes straight to it: one ``autograd.Function`` that allocates the outputs and
starts the planned launches, forward and backward. The general path's layers cost more host time
than the kernels of a small attention take on the GPU (BENCHMARKS.md, "A repeated call").

A Repeat learns its launches from the general path's own (the ``keep`` argument of
``forward.forward`` and ``backward.backward``) on its first forward and first backward, so the
launches it repeats are exactly the ones the general path made. Whatever it cannot repeat as
is (a gradient laid out differently, a transform or dispatch mode, the interpreter's float32
copies) it hands to the general path.
"""

from __future__ import annotations

import math

import torch

from . import ops, runtime
from .triton import backward as bwd
from .triton import fast
from .triton import forward as fwd
from .triton.autograd import resolve_config
from .triton.inputs import check


def attention(q, k, v, *, is_causal, scale, block_mask, dropout_p, attn_mask=None,
              score_mod=None, return_lse=False):
    """Backend entry point (inputs already checked by flashedu.attention).

    A bool ``attn_mask`` becomes a block mask whose mask mod reads it (only its partial tiles
    are read element-wise), a float one a bias the kernels read tile by tile; ``score_mod``
    must be one the kernels compile: the library's softcap and ALiBi, or one written in Triton
    (``flashedu.mods.triton_score_mod``)."""
    check(q, k, v)
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
    from .masks import BlockMask

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
    check(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o, lse2 = ops.triton_forward(q, k, v, is_causal, scale, *ops.mask_args(block_mask))
    return o, ops.LSE_TO_NATURAL["triton"](lse2)



# ----- the repeat of a plain call ---------------------------------------------------------


def make_repeat(q, k, v, is_causal: bool, scale: float, block_mask=None):
    """The Repeat of a checked plain call, or None where the call's inputs are copied by the
    general path (its launches then take other tensors than the caller's). ``is_causal`` has
    the block mask's causal flag folded in, as the general path's."""
    interpreted = runtime.triton_interpreted()
    if interpreted and q.dtype != torch.float32:  # the interpreter runs float32 copies
        return None
    for t in (q, k, v):  # the general path copies these: last dim strided, or memory that
        # overlaps or has gaps (its outputs could not take the input's strides)
        if t.stride(-1) != 1 or torch.empty_like(t).stride() != t.stride():
            return None
    config = resolve_config(q.shape[-1], q.dtype, block_mask, q.device)
    return Repeat(is_causal, scale, block_mask, config, interpreted)


class Repeat:
    """What a plain call's signature decided: its tile table entry and, once the general path
    has run them, its launches. Calling it runs the call (None: the general path must)."""

    __slots__ = ("is_causal", "scale", "block_mask", "mods", "config", "interpreted",
                 "forward_plan", "backward_plan", "dout_layout")

    def __init__(self, is_causal, scale, block_mask, config, interpreted):
        self.is_causal, self.scale, self.block_mask = is_causal, scale, block_mask
        self.mods = ops.Mods.of(None, None, block_mask)  # its mask mod, where tiles need it
        self.config, self.interpreted = config, interpreted
        self.forward_plan = self.backward_plan = self.dout_layout = None

    def __call__(self, q, k, v):
        if not ops.plain_eager(q, k, v):
            return None
        return _Repeated.apply(self, q, k, v)

    def forward(self, q, k, v):
        """(O, L2) as ``forward.forward`` returns them."""
        if self.forward_plan is None:
            kept = []
            tiles = self.config.forward_tiles(self.block_mask, k.shape[2])
            out = fwd.forward(q, k, v, is_causal=self.is_causal, scale=self.scale,
                              block_mask=self.block_mask, tiles=tiles,
                              interpreted=self.interpreted, mods=self.mods, keep=kept)
            self.forward_plan = kept[0] if kept else None
            return out
        o = torch.empty_like(q)
        lse2 = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        self.forward_plan.start(q, k, v, o, lse2)  # (one launch: start makes its own checks)
        return o, lse2

    def backward(self, q, k, v, o, lse2, do):
        """(dQ, dK, dV) as ``backward.backward`` returns them."""
        do = do.contiguous()  # as the general path hands it to the kernels
        layout = (do.stride(), do.dtype, do.data_ptr() % 16 == 0)
        if self.backward_plan is None or layout != self.dout_layout:
            kept = []
            grads = bwd.backward(q, k, v, o, lse2, do, is_causal=self.is_causal,
                                 scale=self.scale, block_mask=self.block_mask,
                                 config=self.config, interpreted=self.interpreted,
                                 mods=self.mods, keep=kept)
            if self.backward_plan is None and kept:
                self.backward_plan, self.dout_layout = kept[0], layout
            return grads
        first, launches = self.backward_plan
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        D = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        stream = fast.stream_for(first, *launches)  # the checks, once for all launches
        if first is not None:  # the preprocess: D = rowsum(dO * O)
            first.start(o, do, D, stream=stream)
        for launch in launches:
            launch.start(q, k, v, do, lse2, D, dq, dk, dv, stream=stream)
        return dq, dk, dv


class _Repeated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, repeat, q, k, v):
        o, lse2 = repeat.forward(q, k, v)
        ctx.save_for_backward(q, k, v, o, lse2)
        ctx.repeat = repeat
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse2 = ctx.saved_tensors
        repeat = ctx.repeat
        # create_graph=True: the operator, whose derivative says no (a mask mod's call has no
        # operator: its gradients, as the general path's, refuse a second backward)
        if torch.is_grad_enabled() and repeat.mods is None:
            grads = ops.BACKWARD_OPS["triton"](q, k, v, o, lse2, do, repeat.is_causal,
                                               repeat.scale, *ops.mask_args(repeat.block_mask),
                                               0.0, None)
        else:
            grads = ops.refuse_second_order("triton", repeat.backward(q, k, v, o, lse2, do),
                                            q, k, v, do)
        return (None, *grads)
