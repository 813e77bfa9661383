"""BlockMask: which (Q tile, K/V tile) pairs a block-sparse kernel computes.

A block mask is a grid of booleans, one per (Br x Bc) tile of the score matrix S. A kernel never
touches a tile marked False: it is skipped entirely, which is where block-sparse FlashAttention
gets its speed (time and HBM traffic fall with the density). Inside a tile marked True every
element is computed, unless ``is_causal`` is set: then the tile is also masked element-wise,
top-left aligned (query i sees key j only when j <= i), exactly as SDPA's ``is_causal``.

The blocks are stored as a (B, H, Tr, Tc) array where B and H may be 1 (broadcast over batch and
heads). Kernels read the same mask as lists: for each Q tile row, the K/V tiles to visit
(``kv_indices``), and for the backward's dK/dV pass, its transpose (``q_indices``).

A BlockMask is a value: immutable (its ``blocks`` array is read-only, also after pickling or
copying), equal to another with the same tiles, block size, lengths and causal flag, and
hashable consistently with that equality (it can key a dict of compiled kernels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


INT32_MAX = 2**31 - 1


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _pair(value, name: str) -> tuple[int, int]:
    """(a, b) from an int or a pair of ints, both >= 1."""
    if _is_int(value):
        value = (int(value), int(value))
    try:
        a, b = value
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}") from None
    if not all(_is_int(x) for x in (a, b)):
        raise TypeError(f"{name} must be a pair of ints, got {value!r}")
    if a < 1 or b < 1:
        raise ValueError(f"{name} must be positive, got {(int(a), int(b))}")
    if a > INT32_MAX or b > INT32_MAX:  # tile indices are int32, as FlexAttention's
        raise ValueError(f"{name} must be at most 2**31 - 1, got {(int(a), int(b))}")
    return int(a), int(b)


def _flag(value, name: str) -> bool:
    """A Python or NumPy bool; strings, ints and None are refused rather than read as truthy."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} "
                        f"{value!r}")
    return bool(value)


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Block-level sparsity pattern of attention. Build it with a classmethod:
    :meth:`from_dense`, :meth:`causal`, :meth:`sliding_window`, or :meth:`from_flex`."""

    blocks: np.ndarray  # bool (B, H, Tr, Tc); B, H may be 1
    block_size: tuple[int, int]  # (Br, Bc)
    seq_lens: tuple[int, int]  # (Nq, Nk)
    is_causal: bool = False  # also mask inside the tiles, top-left aligned (as SDPA's flag)

    def __post_init__(self):
        Br, Bc = _pair(self.block_size, "block_size")
        Nq, Nk = _pair(self.seq_lens, "seq_lens")
        is_causal = _flag(self.is_causal, "is_causal")
        blocks = np.asarray(self.blocks)
        if blocks.dtype != np.bool_:
            raise TypeError(f"blocks must be a bool array, got dtype {blocks.dtype}")
        if blocks.ndim == 2:
            blocks = blocks[None, None]
        if blocks.ndim != 4:
            raise ValueError(
                f"blocks must have shape (Tr, Tc) or (B, H, Tr, Tc), got {blocks.shape}")
        want = (math.ceil(Nq / Br), math.ceil(Nk / Bc))
        if blocks.shape[-2:] != want:
            raise ValueError(
                f"blocks must have {want} = (ceil(Nq/Br), ceil(Nk/Bc)) tiles for seq_lens "
                f"{(Nq, Nk)} and block_size {(Br, Bc)}, got {blocks.shape[-2:]}")
        blocks = np.array(blocks, order="C")  # our own copy: the caller's array stays writeable
        blocks.setflags(write=False)
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "block_size", (Br, Bc))
        object.__setattr__(self, "seq_lens", (Nq, Nk))
        object.__setattr__(self, "is_causal", is_causal)

    # ----- a value: pickles through the constructor, equal by content ---------------------
    def __reduce__(self):
        # Rebuilt through __init__, so the unpickled blocks are validated and read-only again.
        return (BlockMask, (self.blocks, self.block_size, self.seq_lens, self.is_causal))

    def __eq__(self, other):
        if not isinstance(other, BlockMask):
            return NotImplemented
        return (self.block_size == other.block_size and self.seq_lens == other.seq_lens
                and self.is_causal == other.is_causal and self.blocks.shape == other.blocks.shape
                and bool((self.blocks == other.blocks).all()))

    def __hash__(self):
        return hash((self.block_size, self.seq_lens, self.is_causal, self.blocks.shape,
                     self.blocks.tobytes()))

    # ----- constructors -------------------------------------------------------------------
    @classmethod
    def from_dense(cls, blocks, block_size=(128, 128), seq_lens=None, is_causal=False) -> BlockMask:
        """From a bool array (Tr, Tc) or (B, H, Tr, Tc). ``seq_lens`` defaults to whole tiles."""
        blocks = _as_bool_blocks(blocks)
        if blocks.ndim not in (2, 4):
            raise ValueError(
                f"blocks must have shape (Tr, Tc) or (B, H, Tr, Tc), got {blocks.shape}")
        Br, Bc = _pair(block_size, "block_size")
        if seq_lens is None:
            seq_lens = (blocks.shape[-2] * Br, blocks.shape[-1] * Bc)
        return cls(blocks, (Br, Bc), seq_lens, is_causal)

    @classmethod
    def causal(cls, seq_lens, block_size=(128, 128)) -> BlockMask:
        """Top-left causal: the tiles on or below the diagonal, masked element-wise inside."""
        Nq, Nk = _pair(seq_lens, "seq_lens")
        Br, Bc = _pair(block_size, "block_size")
        i = np.arange(math.ceil(Nq / Br))[:, None]
        j = np.arange(math.ceil(Nk / Bc))[None, :]
        # tile (i, j) holds a visible element iff its first key j*Bc <= its last query.
        last_q = np.minimum((i + 1) * Br, Nq) - 1
        return cls(j * Bc <= last_q, (Br, Bc), (Nq, Nk), is_causal=True)

    @classmethod
    def sliding_window(cls, seq_lens, block_size=(128, 128), window=256, causal=True) -> BlockMask:
        """Tiles within ``window`` keys of the query (behind it; ahead too when not causal)."""
        Nq, Nk = _pair(seq_lens, "seq_lens")
        Br, Bc = _pair(block_size, "block_size")
        if not _is_int(window):
            raise TypeError(f"window must be a positive int, got {type(window).__name__} {window!r}")
        if window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        window = min(int(window), Nq + Nk)  # any wider window sees the same pairs
        causal = _flag(causal, "causal")
        i = np.arange(math.ceil(Nq / Br))[:, None]
        j = np.arange(math.ceil(Nk / Bc))[None, :]
        q_lo, q_hi = i * Br, np.minimum((i + 1) * Br, Nq) - 1
        k_lo, k_hi = j * Bc, np.minimum((j + 1) * Bc, Nk) - 1
        near = (k_hi >= q_lo - window) & (k_lo <= q_hi + (0 if causal else window))
        return cls(near, (Br, Bc), (Nq, Nk), is_causal=causal)

    # ----- views --------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        """(Tr, Tc): tiles along queries and keys."""
        return self.blocks.shape[-2:]

    @property
    def density(self) -> float:
        """Fraction of tiles computed (1.0 is dense)."""
        return float(self.blocks.mean())

    def to_dense(self) -> np.ndarray:
        """The (B, H, Tr, Tc) bool tile grid (a copy)."""
        return self.blocks.copy()

    def element_mask(self) -> np.ndarray:
        """The (B, H, Nq, Nk) bool mask of visible (query, key) pairs, for references and tests."""
        Br, Bc = self.block_size
        Nq, Nk = self.seq_lens
        dense = self.blocks.repeat(Br, axis=-2).repeat(Bc, axis=-1)[..., :Nq, :Nk]
        if self.is_causal:
            dense = dense & np.tri(Nq, Nk, dtype=bool)
        return dense

    def expand(self, B: int, H: int) -> BlockMask:
        """Broadcast to an explicit batch and head count."""
        b, h = self.blocks.shape[:2]
        if b not in (1, B) or h not in (1, H):
            raise ValueError(
                f"block_mask has blocks for (B, H) = {(b, h)}, which does not broadcast to {(B, H)}")
        blocks = np.broadcast_to(self.blocks, (B, H) + self.shape)
        return BlockMask(blocks, self.block_size, self.seq_lens, self.is_causal)

    def kv_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """Per Q tile, the K/V tiles to visit: (kv_num_blocks (B,H,Tr), kv_indices (B,H,Tr,Tc)).

        Row r of kv_indices lists the visited tile indices in increasing order, padded with 0
        after kv_num_blocks[r] entries (FlexAttention's layout)."""
        return _lists(self.blocks)

    def q_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """The transpose, for the dK/dV pass: per K/V tile, the Q tiles that see it."""
        return _lists(np.swapaxes(self.blocks, -1, -2))

    def __repr__(self) -> str:
        return (f"BlockMask(tiles={self.blocks.shape}, block_size={self.block_size}, "
                f"seq_lens={self.seq_lens}, is_causal={self.is_causal}, density={self.density:.3f})")

    # ----- FlexAttention ------------------------------------------------------------------
    def to_flex(self, device="cpu"):
        """A ``torch.nn.attention.flex_attention.BlockMask`` with the same visible pairs.

        Tiles cut by the causal diagonal become FlexAttention's partial blocks (a causal
        mask_mod runs on them); the other selected tiles are its full blocks."""
        import torch
        from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

        Br, Bc = self.block_size
        Nq, Nk = self.seq_lens
        full = self.blocks.copy()
        partial = np.zeros_like(full)
        if self.is_causal:
            i = np.arange(self.shape[0])[:, None]
            j = np.arange(self.shape[1])[None, :]
            all_visible = (j + 1) * Bc - 1 <= i * Br  # last key <= first query
            partial = full & ~all_visible
            full = full & all_visible

        def as_torch(blocks):
            num, idx = _lists(blocks)
            return (torch.as_tensor(num, dtype=torch.int32, device=device),
                    torch.as_tensor(idx, dtype=torch.int32, device=device))

        # The mask_mod repeats the tile pattern element-wise: compiled FlexAttention skips by
        # the block lists alone, but its eager (math) path applies only the mask_mod.
        tiles = torch.as_tensor(self.blocks.copy(), device=device)
        per_b, per_h = int(tiles.shape[0] > 1), int(tiles.shape[1] > 1)
        is_causal = self.is_causal

        def mask_mod(b, h, q_idx, kv_idx):
            visible = tiles[b * per_b, h * per_h, q_idx // Br, kv_idx // Bc]
            return visible & (q_idx >= kv_idx) if is_causal else visible

        kv_num, kv_idx = as_torch(partial)
        full_num, full_idx = as_torch(full)
        return FlexBlockMask.from_kv_blocks(
            kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(Br, Bc), mask_mod=mask_mod,
            seq_lengths=(Nq, Nk))

    @classmethod
    def from_flex(cls, flex_mask, is_causal=False) -> BlockMask:
        """From a FlexAttention BlockMask: its partial and full blocks become our tiles.

        FlexAttention keeps the element-level rule in a ``mask_mod`` we cannot inspect; pass
        ``is_causal=True`` when that rule is the causal one."""
        needed = ("BLOCK_SIZE", "seq_lengths", "kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                  "full_kv_indices")
        if not all(hasattr(flex_mask, a) for a in needed):
            raise TypeError("flex_mask must be a torch.nn.attention.flex_attention.BlockMask "
                            f"(from create_block_mask), got {type(flex_mask).__name__}; for a "
                            "bool tile grid use BlockMask.from_dense")
        is_causal = _flag(is_causal, "is_causal")
        Br, Bc = flex_mask.BLOCK_SIZE
        Nq, Nk = flex_mask.seq_lengths
        blocks = _from_lists(flex_mask.kv_num_blocks, flex_mask.kv_indices, flex_mask)
        if flex_mask.full_kv_num_blocks is not None:
            blocks |= _from_lists(flex_mask.full_kv_num_blocks, flex_mask.full_kv_indices, flex_mask)
        Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
        return cls(blocks[..., :Tr, :Tc], (Br, Bc), (Nq, Nk), is_causal)


def _as_bool_blocks(blocks) -> np.ndarray:
    """A bool array from bools, or from numbers that are all 0 or 1 (a torch tensor too)."""
    if hasattr(blocks, "detach"):  # a torch tensor, possibly on a GPU
        blocks = blocks.detach().cpu().numpy()
    try:
        blocks = np.asarray(blocks)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"blocks must be a bool array, got {type(blocks).__name__} ({exc})") from None
    if blocks.dtype == np.bool_:
        return blocks
    if blocks.dtype.kind not in "iuf" or not np.isin(blocks, (0, 1)).all():
        raise TypeError(f"blocks must be a bool array (or only 0s and 1s), got dtype {blocks.dtype}")
    return blocks.astype(bool)


def _lists(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    num = blocks.sum(-1).astype(np.int32)
    # stable argsort of ~blocks puts the selected tile indices first, in increasing order
    idx = np.argsort(~blocks, axis=-1, kind="stable").astype(np.int32)
    idx = np.where(np.arange(blocks.shape[-1]) < num[..., None], idx, 0).astype(np.int32)
    return num, idx


def _from_lists(num, idx, flex_mask) -> np.ndarray:
    num = num.cpu().numpy()
    idx = idx.cpu().numpy()
    Tc = idx.shape[-1]
    blocks = np.zeros(idx.shape[:-1] + (Tc,), dtype=bool)
    take = np.arange(Tc) < num[..., None]
    b, h, r, c = np.nonzero(take)
    blocks[b, h, r, idx[b, h, r, c]] = True
    return blocks
