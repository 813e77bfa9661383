"""From a :class:`flashedu.BlockMask` to the per-tile lists the kernels walk.

A kernel's tile (Br x Bc) may be smaller than the mask's block: it must divide it, so that each
mask block is covered by whole kernel tiles. The mask is refined to the kernel's grid here, tiles
above the causal diagonal are dropped (they would be computed only to be masked away), and the
result is handed over in FlexAttention's layout: for each Q tile the K/V tiles to visit
(``kv_indices``), and for the dK/dV pass the transpose (``q_indices``).
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from ..masks import BlockMask
from .config import MIN_TILE

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def largest_tile(block: int, preferred: int) -> int:
    """The largest power of two <= ``preferred`` that divides the mask's ``block``."""
    tile = preferred
    while tile > 1 and block % tile:
        tile //= 2
    return tile


def fit_tiles(block_mask: BlockMask, Br: int, Bc: int) -> tuple[int, int]:
    """Kernel tile sizes that divide ``block_mask.block_size``; ValueError when none is >= 16."""
    mBr, mBc = block_mask.block_size
    tile = (largest_tile(mBr, Br), largest_tile(mBc, Bc))
    if min(tile) < MIN_TILE:
        raise ValueError(
            f"block_mask.block_size {block_mask.block_size} is not supported by the triton "
            f"backend: each side must be a multiple of {MIN_TILE} (a kernel tile of 16, 32, 64 "
            f"or 128 rows must divide it; e.g. 64, 128 as FlexAttention's default 128x128)")
    return tile


def refine(block_mask: BlockMask, Br: int, Bc: int) -> np.ndarray:
    """The (b, h, ceil(Nq/Br), ceil(Nk/Bc)) bool grid of kernel tiles to compute."""
    mBr, mBc = block_mask.block_size
    Nq, Nk = block_mask.seq_lens
    fine = block_mask.blocks.repeat(mBr // Br, axis=-2).repeat(mBc // Bc, axis=-1)
    fine = fine[..., :math.ceil(Nq / Br), :math.ceil(Nk / Bc)]
    if block_mask.is_causal:
        i = np.arange(fine.shape[-2])[:, None]
        j = np.arange(fine.shape[-1])[None, :]
        fine = fine & (j * Bc <= np.minimum((i + 1) * Br, Nq) - 1)  # tile holds a visible pair
    return fine


def tile_lists(block_mask: BlockMask, Br: int, Bc: int, transpose: bool, device):
    """(num, idx) int32 torch tensors on ``device``: kv lists, or q lists when ``transpose``.

    Cached per mask object: a training loop reuses one mask for many calls."""
    import torch

    per_mask = _CACHE.setdefault(block_mask, {})
    key = (Br, Bc, transpose, str(device))
    if key not in per_mask:
        fine = BlockMask(refine(block_mask, Br, Bc), (Br, Bc), block_mask.seq_lens)
        num, idx = fine.q_indices() if transpose else fine.kv_indices()
        per_mask[key] = (torch.as_tensor(num, device=device), torch.as_tensor(idx, device=device))
    return per_mask[key]


def strides(num, idx):
    """Strides of (num, idx) over (batch, head, row), 0 where the mask broadcasts."""
    def s(t, dim):
        return 0 if t.shape[dim] == 1 else t.stride(dim)
    return s(num, 0), s(num, 1), s(idx, 0), s(idx, 1), idx.stride(2)
