"""One state that the widgets of a notebook share: the block mask (tiling, causal flag, tiles).

The block-mask editor publishes every change of its mask here; a stepper or an SRAM widget
made with ``state=editor.state`` follows it, so every view is derived from the same mask and a
view never shows a mask the editor no longer has::

    editor = BlockMaskEditor(tiles=8)
    stepper = TileLoopStepper(state=editor.state)   # walks the editor's tiles, always
    sram = SRAMOccupancy(state=editor.state)        # sizes the editor's Br x Bc tile
"""

from __future__ import annotations

from typing import Callable


class SharedMask:
    """The current :class:`flashedu.BlockMask` and who follows it.

    ``version`` counts the changes; a follower that stored the version it last drew can tell
    whether what it shows is stale."""

    def __init__(self, block_mask=None):
        self.block_mask = block_mask
        self.version = 0
        self._followers: list[Callable] = []

    def set(self, block_mask) -> None:
        self.block_mask = block_mask
        self.version += 1
        for fn in list(self._followers):
            fn(block_mask)

    def follow(self, fn: Callable) -> None:
        """Call ``fn(block_mask)`` now (when there is a mask) and after every change."""
        self._followers.append(fn)
        if self.block_mask is not None:
            fn(self.block_mask)
