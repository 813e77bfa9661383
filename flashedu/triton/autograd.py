"""The tile table entry of one call: ``config.kernel_config`` for (d, dtype), with every tile
shrunk to divide the block mask's block.

Forward and backward are tied together for autograd by the ``torch.library`` operators of
:mod:`flashedu.ops` (``torch.ops.flashedu.triton_forward`` / ``triton_backward``): the forward
saves (O, L), the backward kernels consume them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .. import runtime
from . import sparse
from .config import KernelConfig, kernel_config


def resolve_config(d: int, dtype, block_mask, device=None) -> KernelConfig:
    """The tile table entry for (d, dtype) on ``device`` (None: the current CUDA device), with
    every tile shrunk to divide the mask's block."""
    interpreted = runtime.triton_interpreted()
    config = (kernel_config(d, dtype == torch.float32, interpreted) if device is None
              else kernel_config(d, dtype == torch.float32, interpreted, device=device))
    if block_mask is None:
        return config
    return fitted(config, block_mask.block_size)


@functools.lru_cache(maxsize=256)
def fitted(config: KernelConfig, block_size: tuple[int, int]) -> KernelConfig:
    """``config`` with every tile shrunk to divide ``block_size``: worked out once per pair
    (a block-mask call asks on every call, and the twenty ``replace`` calls cost more host time
    than its launch)."""

    def fit(t):
        Br, Bc = sparse.fit_tiles(block_size, t.Br, t.Bc)
        return dataclasses.replace(t, Br=Br, Bc=Bc)

    def fit_all(c):  # replace() keeps every other field (fused_backward, ...) as tuned
        if c is None:
            return None
        return dataclasses.replace(c, forward=fit(c.forward), dkdv=fit(c.dkdv), dq=fit(c.dq),
                                   causal_backward=fit_all(c.causal_backward),
                                   sparse_forward=c.sparse_forward and fit(c.sparse_forward),
                                   dropout_forward=c.dropout_forward and fit(c.dropout_forward),
                                   dropout_backward=fit_all(c.dropout_backward))

    return fit_all(config)
