"""torch.autograd glue: the forward kernel saves (O, L), the backward kernels consume them."""

from __future__ import annotations

import dataclasses

import torch

from .. import runtime
from . import sparse
from .backward import backward
from .config import KernelConfig, kernel_config
from .forward import forward


def resolve_config(d: int, dtype, block_mask) -> KernelConfig:
    """The tile table entry for (d, dtype), with every tile shrunk to divide the mask's block."""
    config = kernel_config(d, dtype == torch.float32, runtime.triton_interpreted())
    if block_mask is None:
        return config

    def fit(t):
        Br, Bc = sparse.fit_tiles(block_mask, t.Br, t.Bc)
        return dataclasses.replace(t, Br=Br, Bc=Bc)

    def fit_all(c):  # replace() keeps every other field (fused_backward, ...) as tuned
        if c is None:
            return None
        return dataclasses.replace(c, forward=fit(c.forward), dkdv=fit(c.dkdv), dq=fit(c.dq),
                                   causal_backward=fit_all(c.causal_backward),
                                   sparse_forward=c.sparse_forward and fit(c.sparse_forward))

    return fit_all(config)


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, block_mask, config):
        interpreted = runtime.triton_interpreted()
        o, lse2 = forward(q, k, v, is_causal=is_causal, scale=scale, block_mask=block_mask,
                          tiles=config.forward_tiles(block_mask), interpreted=interpreted)
        ctx.save_for_backward(q, k, v, o, lse2)
        ctx.params = (is_causal, scale, block_mask, config, interpreted)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse2 = ctx.saved_tensors
        is_causal, scale, block_mask, config, interpreted = ctx.params
        dq, dk, dv = backward(q, k, v, o, lse2, do.contiguous(), is_causal=is_causal,
                              scale=scale, block_mask=block_mask, config=config,
                              interpreted=interpreted)
        return dq, dk, dv, None, None, None, None
