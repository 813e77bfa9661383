"""Block-sparsity patterns of the literature as (Tr, Tc) bool tile grids.

Each preset takes the tiling (seq_lens, block_size) and its own knobs, all in tiles, and returns
a :class:`flashedu.BlockMask`. Causal and sliding window come from BlockMask itself; the others
are the patterns of Sparse Transformers (strided) and BigBird (global + window + random).
"""

from __future__ import annotations

import math

import numpy as np

from ..masks import BlockMask


def _grid(seq_lens, block_size):
    (Nq, Nk), (Br, Bc) = seq_lens, block_size
    Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
    return np.arange(Tr)[:, None], np.arange(Tc)[None, :]


def dense(seq_lens, block_size) -> BlockMask:
    i, j = _grid(seq_lens, block_size)
    return BlockMask.from_dense(np.ones((i.size, j.size), bool), block_size, seq_lens)


def causal(seq_lens, block_size) -> BlockMask:
    return BlockMask.causal(seq_lens, block_size)


def sliding_window(seq_lens, block_size, window=2) -> BlockMask:
    """Causal, each query sees the ``window`` tiles of keys before its own (in tiles)."""
    return BlockMask.sliding_window(seq_lens, block_size, window=window * block_size[1], causal=True)


def strided(seq_lens, block_size, window=1, stride=3) -> BlockMask:
    """Sparse Transformers' strided pattern, causal: a local band of ``window`` tiles plus every
    ``stride``-th key tile (the "summary" columns that carry information across the gaps)."""
    i, j = _grid(seq_lens, block_size)
    blocks = (j <= i) & ((i - j <= window) | (j % stride == stride - 1))
    return BlockMask.from_dense(blocks, block_size, seq_lens, is_causal=True)


def random(seq_lens, block_size, density=0.3, seed=0) -> BlockMask:
    """Each tile kept with probability ``density``; the diagonal is always kept so that no query
    tile is left with nothing to attend to."""
    i, j = _grid(seq_lens, block_size)
    keep = np.random.default_rng(seed).random((i.size, j.size)) < density
    return BlockMask.from_dense(keep | (j == np.minimum(i, j.size - 1)), block_size, seq_lens)


def bigbird(seq_lens, block_size, window=1, globals_=1, randoms=1, seed=0) -> BlockMask:
    """BigBird: ``globals_`` tiles that see and are seen by everything, a band of ``window``
    tiles on each side of the diagonal, and ``randoms`` random key tiles per query tile."""
    i, j = _grid(seq_lens, block_size)
    blocks = (np.abs(i - j) <= window) | (i < globals_) | (j < globals_)
    rng = np.random.default_rng(seed)
    for row in range(i.size):
        blocks[row, rng.choice(j.size, size=min(randoms, j.size), replace=False)] = True
    return BlockMask.from_dense(blocks, block_size, seq_lens)


PRESETS = {
    "dense": dense,
    "causal": causal,
    "sliding window": sliding_window,
    "strided": strided,
    "random": random,
    "BigBird": bigbird,
}


def make(name: str, seq_lens, block_size, **knobs) -> BlockMask:
    """The preset ``name`` for this tiling; ``knobs`` it does not take are ignored."""
    fn = PRESETS[name]
    accepted = fn.__code__.co_varnames[2:fn.__code__.co_argcount]
    return fn(tuple(seq_lens), tuple(block_size), **{k: v for k, v in knobs.items() if k in accepted})
