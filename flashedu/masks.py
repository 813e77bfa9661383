"""BlockMask: which (Q tile, K/V tile) pairs a block-sparse kernel computes.

A block mask is a grid of booleans, one per (Br x Bc) tile of the score matrix S. A kernel never
touches a tile marked False: it is skipped entirely, which is where block-sparse FlashAttention
gets its speed (time and HBM traffic fall with the density). Inside a tile marked True every
element is computed, unless ``is_causal`` is set: then the tile is also masked element-wise,
top-left aligned (query i sees key j only when j <= i), exactly as SDPA's ``is_causal``.

The blocks are stored as a (B, H, Tr, Tc) array where B and H may be 1 (broadcast over batch and
heads). Kernels read the same mask as lists: for each Q tile row, the K/V tiles to visit
(``kv_indices``), and for the backward's dK/dV pass, its transpose (``q_indices``).

Element-level rules come from a **mask mod** (FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``,
see :mod:`flashedu.mods`): :meth:`BlockMask.from_mask_mod` evaluates it tile by tile and sorts the
tiles into three kinds, as FlexAttention's ``create_block_mask`` does:

- **empty**: no visible pair; ``blocks`` is False there and the kernel skips the tile;
- **full**: every pair visible (``full`` is True); the kernel computes the tile unmasked;
- **partial**: some pairs visible; the kernel applies the mask mod element-wise
  (``partial_tiles()`` lists them, ``tile_masks()`` gives their element masks).

The mask keeps its mod (``block_mask.mask_mod``) through ``expand``, pickling, ``to_flex`` and
``from_flex``.

A BlockMask is a value: immutable (its ``blocks`` array is read-only, also after pickling or
copying), equal to another with the same tiles, full tiles, block size, lengths, causal flag and
mask mod (everything that changes what a kernel computes), and hashable consistently with that
equality (it can key a dict of compiled kernels). ``full_blocks`` given to the constructor must
agree with the rule: a tile marked full whose pairs the causal flag or the mask mod partly
hide, or that ``blocks`` skips, is refused (a kernel would run it unmasked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import mods as _mods

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
    :meth:`from_dense`, :meth:`causal`, :meth:`sliding_window`, :meth:`from_mask_mod`,
    :meth:`from_bool_mask` or :meth:`from_flex`."""

    blocks: np.ndarray  # bool (B, H, Tr, Tc); B, H may be 1
    block_size: tuple[int, int]  # (Br, Bc)
    seq_lens: tuple[int, int]  # (Nq, Nk)
    is_causal: bool = False  # also mask inside the tiles, top-left aligned (as SDPA's flag)
    # the element-level rule inside the selected tiles (a flashedu.mods mask mod or a user's
    # function); None: every pair of a selected tile is visible (besides is_causal)
    mask_mod: object = None
    # bool like blocks: tiles where every pair is visible (computed from is_causal if None;
    # given, it is checked against the causal flag and the mask mod)
    full_blocks: object = None

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
        if self.mask_mod is not None and not callable(self.mask_mod):
            raise TypeError(f"mask_mod must be callable as mask_mod(b, h, q_idx, kv_idx) or None, "
                            f"got {type(self.mask_mod).__name__}")
        full = self.full_blocks
        checked = isinstance(full, _Derived)
        if checked:
            full = full.tiles
        elif full is not None and self.mask_mod is None and not is_causal:
            checked = True  # without a rule inside the tiles, every selected tile is full
        if full is None:
            checked = True
            full = blocks & _diagonal_free(blocks.shape[-2:], (Br, Bc), (Nq, Nk), is_causal)
            if self.mask_mod is not None and not (is_causal and _mods.is_causal_top_left(self.mask_mod)):
                full = np.zeros_like(blocks)  # unknown: every selected tile is partial
        full = np.asarray(full)
        if full.ndim == 2:
            full = full[None, None]
        if full.dtype != np.bool_ or full.shape != blocks.shape:
            raise ValueError(f"full_blocks must be a bool array of blocks' shape {blocks.shape}, "
                             f"got {full.dtype} {full.shape}")
        if (full & ~blocks).any():
            tile = tuple(int(x) for x in np.argwhere(full & ~blocks)[0])
            raise ValueError(f"full_blocks marks tile (b, h, i, j) = {tile} full, but blocks "
                             f"skips it: a full tile must be a selected one (full_blocks & blocks)")
        full = np.array(full, order="C")
        full.setflags(write=False)
        object.__setattr__(self, "full_blocks", full)
        # tiles where blocks and is_causal alone already give the exact pairs (no mod needed)
        plain = self.mask_mod is None or (is_causal and _mods.is_causal_top_left(self.mask_mod))
        object.__setattr__(self, "blocks", blocks)
        _set_exact(self, blocks if plain else full)
        object.__setattr__(self, "block_size", (Br, Bc))
        object.__setattr__(self, "seq_lens", (Nq, Nk))
        object.__setattr__(self, "is_causal", is_causal)
        if not checked:
            _check_full(self)

    # ----- a value: pickles through the constructor, equal by content ---------------------
    def __reduce__(self):
        # Rebuilt through __init__, so the unpickled blocks are validated and read-only again.
        # (A mask mod that is a lambda or a local function cannot be pickled, as any function.)
        return (_rebuild, ((self.blocks, self.block_size, self.seq_lens, self.is_causal,
                            self.mask_mod, self.full_blocks), self._exact))

    def _mod_key(self):
        """The mod as far as it matters: a top-left causal mod adds nothing to is_causal."""
        if self.mask_mod is None or (self.is_causal and _mods.is_causal_top_left(self.mask_mod)):
            return None
        return self.mask_mod

    def __eq__(self, other):
        # Everything a kernel reads of the mask: the tiles it visits, those it runs unmasked
        # (full), whether the others need the mod, and the mod. Caches of launches and tile
        # lists key on the mask, so two masks equal here must compute the same thing.
        if other is self:  # the kernels' caches look a mask up on every call: no array compare
            return True
        if not isinstance(other, BlockMask):
            return NotImplemented
        return (self.block_size == other.block_size and self.seq_lens == other.seq_lens
                and self.is_causal == other.is_causal and self.blocks.shape == other.blocks.shape
                and self._needs_mask_mod == other._needs_mask_mod
                and bool((self.blocks == other.blocks).all())
                and bool((self.full_blocks == other.full_blocks).all())
                and self._mod_key() == other._mod_key())

    def __hash__(self):
        # computed once: the blocks are read-only, and hashing their bytes on every kernel
        # call (the tile-list caches key on the mask) cost more host time than the launch
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.block_size, self.seq_lens, self.is_causal, self.blocks.shape,
                      self._needs_mask_mod, self.blocks.tobytes(), self.full_blocks.tobytes(),
                      self._mod_key()))
            object.__setattr__(self, "_hash", h)
        return h

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
        return cls(j * Bc <= last_q, (Br, Bc), (Nq, Nk), is_causal=True,
                   mask_mod=_mods.causal())

    @classmethod
    def sliding_window(cls, seq_lens, block_size=(128, 128), window=256, causal=True) -> BlockMask:
        """Exactly the pairs within ``window`` positions of the query: query i sees key j iff
        i - window <= j <= i (causal), or |i - j| <= window (``causal=False``).

        That is ``window + 1`` keys for a causal query: the mask mod is
        ``flashedu.mods.sliding_window(window + 1)`` (Mistral's convention counts the query's
        own key in the window). Tiles cut by the band's edges are partial: their pairs are
        masked element-wise, never rounded to whole tiles."""
        Nq, Nk = _pair(seq_lens, "seq_lens")
        Br, Bc = _pair(block_size, "block_size")
        if not _is_int(window):
            raise TypeError(f"window must be a positive int, got {type(window).__name__} {window!r}")
        if window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        window = min(int(window), Nq + Nk)  # any wider window sees the same pairs
        causal = _flag(causal, "causal")
        mod = _mods.sliding_window(window + 1, lookahead=0 if causal else window)
        return cls.from_mask_mod(mod, 1, 1, Nq, Nk, (Br, Bc))

    @classmethod
    def from_mask_mod(cls, mask_mod, B, H, Nq, Nk, block_size=(128, 128),
                      device="cpu") -> BlockMask:
        """The block mask a mask mod implies (FlexAttention's ``create_block_mask``).

        ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (see :mod:`flashedu.mods`); B, H: the batch
        and head counts it depends on, or None (or 1) when it is the same for all. The mod is
        evaluated tile by tile (a few rows of tiles at a time, never the whole Nq x Nk grid at
        once), on ``device`` (a GPU evaluates a long sequence's mod many times faster): empty
        tiles are skipped, full ones run unmasked, partial ones apply the mod element-wise. A
        mod that never shows a later key (causal, sliding_window, ... and combinations) sets
        ``is_causal``, so kernels also skip the tiles above the diagonal (and so does this
        evaluation)."""
        import torch

        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable as mask_mod(b, h, q_idx, kv_idx), got "
                            f"{type(mask_mod).__name__}")
        B = _count(B, "B")
        H = _count(H, "H")
        Nq, Nk = _pair((Nq, Nk), "seq_lens")
        Br, Bc = _pair(block_size, "block_size")
        mod = _mods.bind(mask_mod, (Nq, Nk))
        is_causal = _mods.implies_causal(mod)
        Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
        shape = (B, H, Tr, Tc)
        any_, all_, exact = (np.zeros(shape, bool) for _ in range(3))
        b = torch.arange(B, device=device).view(B, 1, 1, 1)
        h = torch.arange(H, device=device).view(1, H, 1, 1)
        per_chunk = max(1, (1 << 22) // (B * H * Br * Tc * Bc))  # tile rows per evaluation
        for i0 in range(0, Tr, per_chunk):
            i1 = min(Tr, i0 + per_chunk)
            # a causal mod shows no key after the chunk's last query: those tiles stay empty
            tc = min(Tc, math.ceil(i1 * Br / Bc)) if is_causal else Tc
            rows = torch.arange(i0 * Br, i1 * Br, device=device).view(1, 1, -1, 1)
            cols = torch.arange(tc * Bc, device=device).view(1, 1, 1, -1)
            m = _mods.evaluate_mask_mod(mod, b, h, rows, cols, seq_lens=(Nq, Nk))
            m = m.expand(B, H, rows.shape[2], cols.shape[3])
            padded = i1 * Br > Nq or tc * Bc > Nk
            valid = (rows < Nq) & (cols < Nk)
            tiles = (B, H, i1 - i0, Br, tc, Bc)

            def per_tile(x, reduce):  # NumPy's reductions are the fastest on a CPU
                if x.device.type == "cpu":
                    x = np.ascontiguousarray(x.numpy()).reshape(tiles)
                    return x.any(axis=(3, 5)) if reduce == "any" else x.all(axis=(3, 5))
                x = x.reshape(tiles)
                return (x.amax(dim=(3, 5)) if reduce == "any" else x.amin(dim=(3, 5))).cpu().numpy()

            any_[:, :, i0:i1, :tc] = per_tile(m, "any")
            all_[:, :, i0:i1, :tc] = per_tile(m | ~valid if padded else m, "all")
        exact = all_.copy()  # tiles where the tile grid (and causal flag) alone give the pairs
        if is_causal:
            # below the diagonal the causal rule shows everything: exact where full; above it
            # nothing; a tile cut by the diagonal is exact where the mod equals the causal rule
            i = np.arange(Tr)[:, None]
            j = np.arange(Tc)[None, :]
            cut = ~_diagonal_free((Tr, Tc), (Br, Bc), (Nq, Nk), True) & (j * Bc <= np.minimum(
                (i + 1) * Br, Nq) - 1)
            cut = np.broadcast_to(cut, shape) & any_
            tiles = np.argwhere(cut)
            if len(tiles):
                t = torch.as_tensor(tiles, device=device).view(-1, 4, 1, 1)
                q = t[:, 2] * Br + torch.arange(Br, device=device).view(1, Br, 1)
                kv = t[:, 3] * Bc + torch.arange(Bc, device=device).view(1, 1, Bc)
                m = _mods.evaluate_mask_mod(mod, t[:, 0], t[:, 1], q, kv, seq_lens=(Nq, Nk))
                rule = (kv <= q) & (q < Nq) & (kv < Nk)
                exact[tuple(tiles.T)] = (m == rule).flatten(1).all(1).cpu().numpy()
        mask = cls(any_, (Br, Bc), (Nq, Nk), is_causal, mask_mod=mod,
                   full_blocks=_Derived(all_ & any_))
        _set_exact(mask, np.array(exact & any_ | ~any_, order="C"))
        return mask

    @classmethod
    def from_packed(cls, cu_seqlens_q, cu_seqlens_k, causal=False,
                    block_size=(128, 128)) -> BlockMask:
        """The block mask of packed variable-length sequences (``mods.packed``), worked out from
        the cuts alone: a tile is visited when its rows' and its columns' sequences overlap,
        and full when all its rows and columns lie in one sequence (and, causal, its last key
        is visible to its first query). O(Tr * Tc) on the host, no pair evaluated; the mask
        mod stays on the mask for the partial tiles (the triton backend compiles it)."""
        mod = _mods.packed(cu_seqlens_q, cu_seqlens_k, causal)
        cu_q, cu_k = mod.cu_seqlens_q.numpy(), mod.cu_seqlens_k.numpy()
        Nq, Nk = int(cu_q[-1]), int(cu_k[-1])
        Br, Bc = _pair(block_size, "block_size")
        # each tile's first and last row (column), and their sequences
        r0 = np.arange(0, Nq, Br)
        r1 = np.minimum(r0 + Br, Nq) - 1
        c0 = np.arange(0, Nk, Bc)
        c1 = np.minimum(c0 + Bc, Nk) - 1
        fq, lq = (np.searchsorted(cu_q[1:], r, side="right") for r in (r0, r1))
        fk, lk = (np.searchsorted(cu_k[1:], c, side="right") for c in (c0, c1))
        # Sequence ids only grow along a row of tiles, so each rule below holds on one run of
        # columns per tile row: worked out per row (O(Tr log Tc)), drawn once (O(Tr * Tc)).
        # Visited: the row's sequences [fq, lq] and the column's [fk, lk] overlap.
        lo = np.searchsorted(lk, fq, side="left")
        hi = np.searchsorted(fk, lq, side="right") - 1
        # Tiles of one sequence s (a row tile within s, a column tile within s): [a, b].
        single = fq == lq
        a = np.where(single, np.searchsorted(fk, fq, side="left"), len(c0))
        b = np.where(single, np.searchsorted(lk, fq, side="right") - 1, -1)
        full_end = b
        cut = np.full(len(r0), len(c0))  # columns from here on: hidden from every row
        if causal:  # query n of Lq sees its sequence's keys 0 .. n + Lk - Lq
            s = np.minimum(fq, len(cu_q) - 2)
            shift = (cu_k[s + 1] - cu_k[s]) - (cu_q[s + 1] - cu_q[s]) - cu_q[s] + cu_k[s]
            last_key = r1 + shift  # the last key position the tile's last row sees (global)
            first_key = r0 + shift  # ... and its first row
            # within s: a column tile is hidden when its first key is past last_key, and full
            # when its last key is at most first_key
            cut = np.where(single, np.searchsorted(c0, last_key, side="right"), cut)
            full_end = np.minimum(b, np.searchsorted(c1, first_key, side="right") - 1)
        if mod.implies_causal:  # the kernels skip the tiles above the diagonal themselves
            hi = np.minimum(hi, r1 // Bc)
        cols = np.arange(len(c0))[None]
        lo, hi, a, b, cut, full_end = (x[:, None] for x in (lo, hi, a, b, cut, full_end))
        any_ = (cols >= lo) & (cols <= hi) & ~((cols >= a) & (cols <= b) & (cols >= cut))
        full = any_ & (cols >= a) & (cols <= full_end)
        return cls(any_[None, None], (Br, Bc), (Nq, Nk), mod.implies_causal, mask_mod=mod,
                   full_blocks=_Derived(full[None, None]))

    @classmethod
    def from_bool_mask(cls, mask, block_size=(128, 128), seq_lens=None) -> BlockMask:
        """The block mask of an element-level bool mask, as SDPA's ``attn_mask`` (True: the
        pair takes part): shape (Nk,), (Nq, Nk) or up to (B, H, Nq, Nk), where B, H, Nq or Nk
        may be 1 to broadcast (then ``seq_lens=(Nq, Nk)`` gives the lengths). Tiles with no
        True are skipped, tiles all True run unmasked, and the rest read the mask element-wise
        (the mask mod reads the tensor).

        The same tiles as ``from_mask_mod`` with a mod that reads the mask, but the tile grid
        comes from per-tile reductions of the mask where it lies (one pass, broadcast axes not
        expanded), not from the mod evaluated pair by pair. Built once and reused, its tile
        lists are built once too."""
        import torch

        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool torch.Tensor, got "
                            f"{getattr(mask, 'dtype', type(mask).__name__)}")
        if not 1 <= mask.dim() <= 4:  # SDPA broadcasts a mask from the right, (Nk,) too
            raise ValueError(f"mask must have shape (Nk,), (Nq, Nk) or up to (B, H, Nq, Nk), "
                             f"got {tuple(mask.shape)}")
        m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        B0, H0, Q0, K0 = m.shape
        Nq, Nk = (Q0, K0) if seq_lens is None else _pair(seq_lens, "seq_lens")
        if Q0 not in (1, Nq) or K0 not in (1, Nk):
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to "
                             f"seq_lens {(Nq, Nk)}")
        Br, Bc = _pair(block_size, "block_size")
        Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
        # a broadcast axis is its own tile: its one value stands for every position
        tr, br = (Tr, Br) if Q0 > 1 else (1, 1)
        tc, bc = (Tc, Bc) if K0 > 1 else (1, 1)

        def any_per_tile(x):  # x uint8; positions past Nq, Nk count as 0
            if tr * br > Q0 or tc * bc > K0:
                x = torch.nn.functional.pad(x, (0, tc * bc - K0, 0, tr * br - Q0))
            x = x.reshape(B0, H0, tr, br, tc, bc).amax(dim=(3, 5)).bool()
            return x.expand(B0, H0, Tr, Tc).cpu().numpy()

        any_ = any_per_tile(m.to(torch.uint8))
        all_ = ~any_per_tile((~m).to(torch.uint8))  # padding shows nothing hidden

        def reads_mask(b, h, q_idx, kv_idx):  # on the indices' device, whichever it is
            where = q_idx.device
            b, h, q_idx, kv_idx = (t.to(m.device) for t in (b, h, q_idx, kv_idx))
            return m[b * (B0 > 1), h * (H0 > 1), q_idx * (Q0 > 1), kv_idx * (K0 > 1)].to(where)

        out = cls(any_, (Br, Bc), (Nq, Nk), False, mask_mod=reads_mask,
                  full_blocks=_Derived(all_ & any_))
        _set_exact(out, np.array(all_ | ~any_, order="C"))
        return out

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

    @property
    def full(self) -> np.ndarray:
        """(B, H, Tr, Tc) bool: tiles whose every pair is visible (computed without a mask)."""
        return self.full_blocks

    @property
    def partial(self) -> np.ndarray:
        """(B, H, Tr, Tc) bool: selected tiles that are not full (masked element-wise)."""
        return self.blocks & ~self.full_blocks

    @property
    def needs_mask_mod(self) -> bool:
        """True when some selected tile needs the mask mod element-wise: the tile grid and the
        causal flag alone (all a kernel without mask mods reads) would show too many pairs."""
        return self._needs_mask_mod

    def partial_tiles(self) -> np.ndarray:
        """(n, 4) int64 rows (b, h, i, j) of the partial tiles, in (b, h, i, j) order; b or h is
        0 when the mask is shared over batch or heads."""
        return np.argwhere(self.partial).astype(np.int64)

    def tile_masks(self, tiles=None):
        """Element masks of tiles: a bool tensor (n, Br, Bc), True where query Q_i[r] sees key
        K_j[c] (mask mod, causal flag and the sequence ends together). ``tiles``: (n, 4) rows
        (b, h, i, j), by default :meth:`partial_tiles`. Only these tiles are evaluated."""
        import torch

        tiles = self.partial_tiles() if tiles is None else np.asarray(tiles, dtype=np.int64)
        if tiles.ndim != 2 or tiles.shape[1] != 4:
            raise ValueError(f"tiles must be an (n, 4) array of (b, h, i, j), got {tiles.shape}")
        Br, Bc = self.block_size
        t = torch.as_tensor(tiles).view(-1, 4, 1, 1)
        b, h = t[:, 0], t[:, 1]
        q = t[:, 2] * Br + torch.arange(Br).view(1, Br, 1)
        kv = t[:, 3] * Bc + torch.arange(Bc).view(1, 1, Bc)
        return self._rule(b, h, q, kv)

    def visible(self, b, h, q_idx, kv_idx, *, selected=False):
        """The bool tensor of visible pairs at broadcast index tensors (tiles, causal flag, mask
        mod and sequence ends together): what a kernel evaluates for its partial tiles.
        ``selected=True``: every index lies in a tile the grid selects (a kernel's listed
        tiles), so the grid is not looked up pair by pair."""
        return self._rule(b, h, q_idx, kv_idx, selected)

    def _rule(self, b, h, q, kv, selected=False):
        """Visible pairs at broadcast indices: tiles, causal flag, mask mod, sequence ends."""
        import torch

        Br, Bc = self.block_size
        Nq, Nk = self.seq_lens
        out = (q < Nq) & (kv < Nk)
        if not selected:
            grid = torch.from_numpy(np.ascontiguousarray(self.blocks).copy())
            per_b, per_h = int(grid.shape[0] > 1), int(grid.shape[1] > 1)
            out = grid[b * per_b, h * per_h, (q // Br).clamp(max=grid.shape[2] - 1),
                       (kv // Bc).clamp(max=grid.shape[3] - 1)] & out
        if self.is_causal:
            out = out & (kv <= q)
        if self.mask_mod is not None:
            out = out & _mods.evaluate_mask_mod(self.mask_mod, b, h, q, kv, seq_lens=(Nq, Nk))
        return out

    def element_mask(self) -> np.ndarray:
        """The (B, H, Nq, Nk) bool mask of visible (query, key) pairs, for references and tests
        (it holds Nq x Nk booleans: kernels never build it)."""
        Br, Bc = self.block_size
        Nq, Nk = self.seq_lens
        dense = self.blocks.repeat(Br, axis=-2).repeat(Bc, axis=-1)[..., :Nq, :Nk]
        if self.is_causal:
            dense = dense & np.tri(Nq, Nk, dtype=bool)
        if self.mask_mod is not None:
            b, h = dense.shape[:2]
            dense = dense & _mods.evaluate_mask_mod(self.mask_mod, range(b), range(h), range(Nq),
                                                    range(Nk), seq_lens=(Nq, Nk)).cpu().numpy()
        return dense

    def expand(self, B: int, H: int) -> BlockMask:
        """Broadcast to an explicit batch and head count (the mask mod comes along)."""
        b, h = self.blocks.shape[:2]
        if b not in (1, B) or h not in (1, H):
            raise ValueError(
                f"block_mask has blocks for (B, H) = {(b, h)}, which does not broadcast to {(B, H)}")
        shape = (B, H) + self.shape
        mask = BlockMask(np.broadcast_to(self.blocks, shape), self.block_size, self.seq_lens,
                         self.is_causal, self.mask_mod,
                         _Derived(np.broadcast_to(self.full_blocks, shape)))
        _set_exact(mask, np.broadcast_to(self._exact, shape))
        return mask

    def kv_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """Per Q tile, the K/V tiles to visit: (kv_num_blocks (B,H,Tr), kv_indices (B,H,Tr,Tc)).

        Row r of kv_indices lists the visited tile indices in increasing order, padded with 0
        after kv_num_blocks[r] entries (FlexAttention's layout)."""
        return _lists(self.blocks)

    def q_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """The transpose, for the dK/dV pass: per K/V tile, the Q tiles that see it."""
        return _lists(np.swapaxes(self.blocks, -1, -2))

    def __repr__(self) -> str:
        mod = "" if self.mask_mod is None else f", mask_mod={getattr(self.mask_mod, '__qualname__', self.mask_mod)!r}"
        return (f"BlockMask(tiles={self.blocks.shape}, block_size={self.block_size}, "
                f"seq_lens={self.seq_lens}, is_causal={self.is_causal}, density={self.density:.3f}"
                f"{mod})")

    # ----- FlexAttention ------------------------------------------------------------------
    def to_flex(self, device="cpu"):
        """A ``torch.nn.attention.flex_attention.BlockMask`` with the same visible pairs.

        Our full tiles become its full blocks, our partial tiles its partial blocks; its
        ``mask_mod`` is the whole element rule (tiles, causal flag and our mask mod), since
        eager FlexAttention applies the mask_mod alone. ``from_flex`` of the result gives this
        mask back, mod included."""
        import torch
        from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

        Br, Bc = self.block_size
        Nq, Nk = self.seq_lens

        def as_torch(blocks):
            num, idx = _lists(blocks)
            return (torch.as_tensor(num, dtype=torch.int32, device=device),
                    torch.as_tensor(idx, dtype=torch.int32, device=device))

        tiles = torch.as_tensor(self.blocks.copy(), device=device)
        per_b, per_h = int(tiles.shape[0] > 1), int(tiles.shape[1] > 1)
        is_causal, own = self.is_causal, self.mask_mod

        def mask_mod(b, h, q_idx, kv_idx):
            visible = tiles[b * per_b, h * per_h, q_idx // Br, kv_idx // Bc]
            if is_causal:
                visible = visible & (q_idx >= kv_idx)
            return visible if own is None else visible & own(b, h, q_idx, kv_idx)

        mask_mod.flashedu_block_mask = self  # from_flex gives this mask back
        kv_num, kv_idx = as_torch(self.partial)
        full_num, full_idx = as_torch(self.full_blocks)
        return FlexBlockMask.from_kv_blocks(
            kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(Br, Bc), mask_mod=mask_mod,
            seq_lengths=(Nq, Nk))

    @classmethod
    def from_flex(cls, flex_mask, is_causal=False) -> BlockMask:
        """From a FlexAttention BlockMask: its partial and full blocks become our tiles and its
        ``mask_mod`` our mask mod (applied on the partial tiles, as FlexAttention does).

        ``is_causal=True`` adds the causal rule on top (it was needed when the mod was
        dropped; now it only lets kernels skip and mask the diagonal natively). A mask_mod
        that cannot be evaluated on broadcast index tensors is refused, saying why."""
        needed = ("BLOCK_SIZE", "seq_lengths", "kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                  "full_kv_indices")
        if not all(hasattr(flex_mask, a) for a in needed):
            raise TypeError("flex_mask must be a torch.nn.attention.flex_attention.BlockMask "
                            f"(from create_block_mask), got {type(flex_mask).__name__}; for a "
                            "bool tile grid use BlockMask.from_dense")
        is_causal = _flag(is_causal, "is_causal")
        mod = getattr(flex_mask, "mask_mod", None)
        ours = getattr(mod, "flashedu_block_mask", None)
        if isinstance(ours, BlockMask):  # made by to_flex: the exact original
            if is_causal and not ours.is_causal:
                return cls.from_dense(ours.blocks, ours.block_size, ours.seq_lens, True) \
                    if ours.mask_mod is None else _with(ours, is_causal=True)
            return ours
        Br, Bc = flex_mask.BLOCK_SIZE
        Nq, Nk = flex_mask.seq_lengths
        Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
        blocks = _from_lists(flex_mask.kv_num_blocks, flex_mask.kv_indices, flex_mask)
        full = np.zeros_like(blocks)
        if flex_mask.full_kv_num_blocks is not None:
            full = _from_lists(flex_mask.full_kv_num_blocks, flex_mask.full_kv_indices, flex_mask)
            blocks |= full
        blocks, full = blocks[..., :Tr, :Tc], full[..., :Tr, :Tc]
        if mod is None or getattr(mod, "__name__", "") == "noop_mask":
            mod = None
        if is_causal:  # a full block of theirs is cut by our diagonal
            full = full & _diagonal_free((Tr, Tc), (Br, Bc), (Nq, Nk), True)
        # FlexAttention's full blocks are taken as given, as FlexAttention itself runs them
        mask = cls(blocks, (Br, Bc), (Nq, Nk), is_causal, mask_mod=mod, full_blocks=_Derived(full))
        if mod is not None:
            try:  # FlexAttention calls mods under vmap; we call them on broadcast tensors
                mask.tile_masks(mask.partial_tiles()[:1])
            except (TypeError, ValueError) as exc:
                raise TypeError(f"from_flex cannot carry this FlexAttention mask_mod: {exc}") from None
        return mask


def _with(mask: BlockMask, **changes) -> BlockMask:
    args = dict(blocks=mask.blocks, block_size=mask.block_size, seq_lens=mask.seq_lens,
                is_causal=mask.is_causal, mask_mod=mask.mask_mod, full_blocks=None)
    args.update(changes)
    return BlockMask(**args)


def _rebuild(args, exact) -> BlockMask:
    mask = BlockMask(*args[:5], _Derived(args[5]))  # checked when the original was built
    _set_exact(mask, exact)
    return mask


class _Derived:
    """``full_blocks`` that a constructor worked out from the mask's own rule (or took from a
    FlexAttention mask, as FlexAttention does): the constructor does not check them again."""

    __slots__ = ("tiles",)

    def __init__(self, tiles):
        self.tiles = tiles


def _check_full(mask: BlockMask) -> None:
    """ValueError unless every pair of every tile marked full is visible under the causal flag
    and the mask mod (a kernel runs full tiles unmasked). Evaluates the rule on the full tiles,
    a bounded number of them at a time."""
    tiles = np.argwhere(mask.full_blocks)
    Br, Bc = mask.block_size
    Nq, Nk = mask.seq_lens
    per_chunk = max(1, (1 << 22) // (Br * Bc))
    for start in range(0, len(tiles), per_chunk):
        chunk = tiles[start:start + per_chunk]
        q = chunk[:, 2, None, None] * Br + np.arange(Br)[None, :, None]
        kv = chunk[:, 3, None, None] * Bc + np.arange(Bc)[None, None, :]
        hidden = ~mask.tile_masks(chunk).cpu().numpy() & (q < Nq) & (kv < Nk)
        if hidden.any():
            n, r, c = (int(x) for x in np.argwhere(hidden)[0])
            rule = " and ".join(name for name, used in (("is_causal", mask.is_causal),
                                                        ("the mask mod", mask.mask_mod is not None))
                                if used)
            raise ValueError(
                f"full_blocks marks tile (b, h, i, j) = {tuple(int(x) for x in chunk[n])} full, "
                f"but {rule} {'hide' if ' and ' in rule else 'hides'} its "
                f"pair (q_idx, kv_idx) = ({int(q[n, r, 0])}, {int(kv[n, 0, c])}); a full tile "
                f"runs unmasked. Leave full_blocks=None (every selected tile then applies the "
                f"mod), or build the mask with BlockMask.from_mask_mod, which finds the full tiles")


def _count(n, name: str) -> int:
    """B or H of from_mask_mod: None (the mod is the same for all) or a positive int."""
    if n is None:
        return 1
    if not _is_int(n) or n < 1:
        raise ValueError(f"{name} must be a positive int or None, got {n!r}")
    return int(n)


def _diagonal_free(shape, block_size, seq_lens, is_causal) -> np.ndarray:
    """(Tr, Tc) bool: tiles the causal diagonal leaves whole (all True when not causal)."""
    Tr, Tc = shape
    if not is_causal:
        return np.ones(shape, bool)
    (Br, Bc), Nk = block_size, seq_lens[1]
    i = np.arange(Tr)[:, None]
    j = np.arange(Tc)[None, :]
    return np.minimum((j + 1) * Bc, Nk) - 1 <= i * Br  # last key <= first query


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


def _set_exact(mask, exact) -> None:
    """The tiles whose pairs the grid and causal flag give exactly, and whether some selected
    tile needs the mask mod: a plain bool fixed here, so torch.compile reads it as a constant."""
    object.__setattr__(mask, "_exact", exact)
    object.__setattr__(mask, "_needs_mask_mod", bool((mask.blocks & ~exact).any()))
