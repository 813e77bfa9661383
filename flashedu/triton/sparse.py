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


def fit_tiles(block_size: tuple[int, int], Br: int, Bc: int) -> tuple[int, int]:
    """Kernel tile sizes that divide a block mask's ``block_size``; ValueError when none is
    >= 16."""
    mBr, mBc = block_size
    tile = (largest_tile(mBr, Br), largest_tile(mBc, Bc))
    if min(tile) < MIN_TILE:
        raise ValueError(
            f"block_mask.block_size {tuple(block_size)} is not supported by the triton "
            f"backend: each side must be a multiple of {MIN_TILE} (a kernel tile of 16, 32, 64 "
            f"or 128 rows must divide it; e.g. 64, 128 as FlexAttention's default 128x128)")
    return tile


def refine(block_mask: BlockMask, Br: int, Bc: int, is_causal: bool = False) -> np.ndarray:
    """The (b, h, ceil(Nq/Br), ceil(Nk/Bc)) bool grid of kernel tiles to compute (causal when
    the mask or the call says so)."""
    mBr, mBc = block_mask.block_size
    Nq, Nk = block_mask.seq_lens
    fine = block_mask.blocks.repeat(mBr // Br, axis=-2).repeat(mBc // Bc, axis=-1)
    fine = fine[..., :math.ceil(Nq / Br), :math.ceil(Nk / Bc)]
    if is_causal or block_mask.is_causal:
        i = np.arange(fine.shape[-2])[:, None]
        j = np.arange(fine.shape[-1])[None, :]
        fine = fine & (j * Bc <= np.minimum((i + 1) * Br, Nq) - 1)  # tile holds a visible pair
    return fine


def needs_mask(is_causal, Nq, Nk, Br, Bc) -> bool:
    """Whether some listed tiles may need element masks: causal, or a ragged edge tile. When
    none can, the kernels walk the list in one unmasked loop."""
    return bool(is_causal or Nq % Br or Nk % Bc)


def unmasked(shape, Br: int, Bc: int, seq_lens, is_causal: bool) -> np.ndarray:
    """The (Tr, Tc) bool grid of tiles that need no element mask: inside both sequences and,
    when causal, wholly at or below the diagonal (last key <= first query row)."""
    Nq, Nk = seq_lens
    i = np.arange(shape[0])[:, None]
    j = np.arange(shape[1])[None, :]
    ok = ((i + 1) * Br <= Nq) & ((j + 1) * Bc <= Nk)
    if is_causal:
        ok = ok & ((j + 1) * Bc - 1 <= i * Br)
    return ok


def tile_lists(block_mask: BlockMask, Br: int, Bc: int, transpose: bool, device,
               is_causal: bool = False):
    """(num, num_full, idx) int32 torch tensors on ``device``: kv lists, or q lists when
    ``transpose``; ``is_causal`` is the call's flag (the mask's own counts too).

    Each row of idx lists its num tiles with the num_full tiles that need no element mask
    first, so that a kernel runs them in a loop without masks and only the rest (causal
    diagonal, ragged edge, partial tiles of a mask mod) in a masked loop. Cached per mask
    object: a training loop reuses one mask for many calls."""
    return _lists(block_mask, Br, Bc, transpose, device, is_causal)[:3]


def element_lists(block_mask: BlockMask, Br: int, Bc: int, transpose: bool, device,
                  is_causal: bool = False):
    """(E, E_base) of the same lists: when the mask's partial tiles need its mask mod, E holds
    one uint8 element mask (Br x Bc, queries by keys) per masked tile of the lists, row after
    row, and E_base (shaped like num) the index of each row's first one; else (None, None).
    Built on the first request only: a mask mod the kernels compile (the sliding window) never
    asks for them."""
    per_mask = _CACHE.setdefault(block_mask, {})
    key = ("elements", *_key(block_mask, Br, Bc, transpose, device, is_causal))
    if key not in per_mask:
        partial = _lists(block_mask, Br, Bc, transpose, device, is_causal)[3]
        per_mask[key] = (None, None) if partial is None else tuple(
            _element_masks(block_mask, partial, Br, Bc, transpose, device, key[-1]))
    return per_mask[key]


def _key(block_mask, Br, Bc, transpose, device, is_causal):
    """A mask's cache key for lists of Br x Bc tiles; a causal call or mask counts alike."""
    return Br, Bc, transpose, str(device), bool(is_causal or block_mask.is_causal)


def _lists(block_mask, Br, Bc, transpose, device, is_causal):
    """(num, num_full, idx, the grid of partial tiles or None), cached per mask."""
    import torch

    per_mask = _CACHE.setdefault(block_mask, {})
    key = _key(block_mask, Br, Bc, transpose, device, is_causal)
    is_causal = key[-1]
    if key not in per_mask:
        fine = refine(block_mask, Br, Bc, is_causal)
        full = fine & unmasked(fine.shape[-2:], Br, Bc, block_mask.seq_lens, is_causal)
        partial = False  # some tile needs the mask mod element-wise
        if block_mask.needs_mask_mod and getattr(block_mask.mask_mod, "kind", None) == "packed":
            fine, full, partial = _packed_tiles(block_mask, fine, full, Br, Bc, is_causal)
        elif block_mask.needs_mask_mod:
            fine, full, partial = _with_mask_mod(block_mask, fine, full, Br, Bc, is_causal)
        if transpose:
            fine, full = np.swapaxes(fine, -1, -2), np.swapaxes(full, -1, -2)
        # sort key per tile: 0 listed and unmasked, 1 listed and masked, 2 not listed
        order = np.argsort(np.where(full, 0, np.where(fine, 1, 2)), axis=-1, kind="stable")
        num = fine.sum(-1).astype(np.int32)
        idx = np.where(np.arange(fine.shape[-1]) < num[..., None], order, 0).astype(np.int32)
        lists = [torch.as_tensor(a, device=device)
                 for a in (num, full.sum(-1).astype(np.int32), idx)]
        per_mask[key] = (*lists, fine & ~full if partial else None)
    return per_mask[key]


def _tile_rule(block_mask, tiles: np.ndarray, Br: int, Bc: int, transpose: bool,
               is_causal: bool):
    """Element masks (n, Br, Bc), queries by keys, of the kernel tiles (b, h, row, col) of a
    list (row, col = i, j; or j, i for the transposed lists); ``is_causal``: the call's flag."""
    import torch

    t = torch.as_tensor(tiles, dtype=torch.int64).view(-1, 4, 1, 1)
    i, j = (t[:, 3], t[:, 2]) if transpose else (t[:, 2], t[:, 3])
    q = i * Br + torch.arange(Br).view(1, Br, 1)
    kv = j * Bc + torch.arange(Bc).view(1, 1, Bc)
    out = block_mask.visible(t[:, 0], t[:, 1], q, kv, selected=True)  # listed tiles only
    return out & (kv <= q) if is_causal else out


def _with_mask_mod(block_mask, fine, full, Br, Bc, is_causal):
    """The grids refined by the mask mod: a kernel tile inside a full mask block is full;
    the others are evaluated element by element, and dropped if no pair is visible, full if
    every pair is. Returns (fine, full, whether some tile stays partial)."""
    full = _inside_full_blocks(block_mask, full, Br, Bc)
    fine, full = np.array(np.broadcast_arrays(fine, full))
    todo = np.argwhere(fine & ~full)
    for start in range(0, len(todo), 4096):  # bounded host memory for long sequences
        part = todo[start:start + 4096]
        m = _tile_rule(block_mask, part, Br, Bc, False, is_causal).reshape(len(part), -1).cpu().numpy()
        b, h, i, j = part.T
        fine[b, h, i, j] = m.any(1)
        full[b, h, i, j] = m.all(1)
    return fine, full, bool((fine & ~full).any())


def _packed_tiles(block_mask, fine, full, Br, Bc, is_causal):
    """The grids of a packed batch's mask at the kernels' tiles, from its cuts alone
    (``BlockMask.from_packed`` at Br x Bc), where another mask mod is evaluated element by
    element: a new packing every training step would otherwise pay for every pair of its
    border tiles on the host. The cuts' tiles are conservative (visited where a pair may be
    visible, full only where every pair is), and full tiles stay inside both sequences and off
    the causal diagonal, as the kernels' unmasked loop needs."""
    mod = block_mask.mask_mod
    cuts = BlockMask.from_packed(mod.cu_seqlens_q, mod.cu_seqlens_k, mod.causal, (Br, Bc))
    fine = fine & cuts.blocks
    inside = unmasked(fine.shape[-2:], Br, Bc, block_mask.seq_lens, is_causal)
    full = (_inside_full_blocks(block_mask, full, Br, Bc) | (cuts.full_blocks & inside)) & fine
    fine, full = np.array(np.broadcast_arrays(fine, full))
    return fine, full, bool((fine & ~full).any())


def _inside_full_blocks(block_mask, full, Br, Bc):
    """``full`` (kernel tiles clear of the edges and the causal diagonal) kept only inside the
    mask's own full blocks: elsewhere its mask mod may hide pairs."""
    mBr, mBc = block_mask.block_size
    fine_full = block_mask.full.repeat(mBr // Br, axis=-2).repeat(mBc // Bc, axis=-1)
    fine_full = fine_full[..., :full.shape[-2], :full.shape[-1]]
    return full & np.broadcast_to(fine_full, full.shape)


def _element_masks(block_mask, masked, Br, Bc, transpose, device, is_causal):
    """(E, E_base) for the masked tiles of the lists (``masked``: the listed tiles that need a
    mask, in the lists' orientation): E (n, Br, Bc) uint8 row after row, E_base int32."""
    import torch

    tiles = np.argwhere(masked)  # (b, h, row, col): row-major, the order the kernels walk
    E = _tile_rule(block_mask, tiles, Br, Bc, transpose, is_causal).to(torch.uint8)
    counts = masked.sum(-1).astype(np.int64)
    base = (np.cumsum(counts.ravel()) - counts.ravel()).reshape(counts.shape).astype(np.int32)
    return E.contiguous().to(device), torch.as_tensor(base, device=device)


def kernel_lists(block_mask, Br: int, Bc: int, transpose: bool, device, is_causal: bool):
    """The LISTS argument of the kernels: (num, num_full, idx, and the strides of num and idx
    over (batch, head, row)), or None without a block mask."""
    if block_mask is None:
        return None
    num, full, idx = tile_lists(block_mask, Br, Bc, transpose, device, is_causal)
    return (num, full, idx, *strides(num, idx))


def strides(num, idx):
    """Strides of (num, idx) over (batch, head, row), 0 where the mask broadcasts."""
    def s(t, dim):
        return 0 if t.shape[dim] == 1 else t.stride(dim)
    return s(num, 0), s(num, 1), s(idx, 0), s(idx, 1), idx.stride(2)
