"""One state that the widgets of a notebook share: the problem and the block mask.

The problem is (N, d, dtype, GPU) in :attr:`SharedMask.settings` plus (Br, Bc, causal), which
come from the block mask. The block-mask editor publishes every change of its mask and of its
settings here; a stepper or an SRAM widget made with ``state=editor.state`` follows both, and a
change of d, dtype or GPU made in any linked widget reaches the others, so every view describes
the same problem::

    editor = BlockMaskEditor(tiles=8)
    stepper = TileLoopStepper(state=editor.state)   # walks the editor's tiles, always
    sram = SRAMOccupancy(state=editor.state)        # sizes the editor's Br x Bc tile

Where a view cannot take a setting (the stepper traces float32 NumPy on the CPU, at the mask's
own N, so that each step is a tile of the mask) it says so in its linked note.
"""

from __future__ import annotations

from typing import Callable

SETTINGS = {"N": 8192, "d": 64, "dtype": "float16", "gpu": "H100 SXM5"}


class SharedMask:
    """The current :class:`flashedu.BlockMask`, the shared settings, and who follows them.

    ``settings``: N (the sequence length the models use), d, dtype and gpu. ``version`` counts
    the changes of the mask; a follower that stored the version it last drew can tell whether
    what it shows is stale."""

    def __init__(self, block_mask=None, **settings):
        self.block_mask = block_mask
        self.settings = {**SETTINGS, **settings}
        self.version = 0
        self._followers: list[Callable] = []
        self._setting_followers: list[Callable] = []

    @property
    def problem(self) -> dict:
        """(N, d, dtype, gpu, Br, Bc, causal): what every linked view describes."""
        out = dict(self.settings)
        if self.block_mask is not None:
            out["Br"], out["Bc"] = self.block_mask.block_size
            out["causal"] = self.block_mask.is_causal
        return out

    def set(self, block_mask) -> None:
        self.block_mask = block_mask
        self.version += 1
        for fn in list(self._followers):
            fn(block_mask)

    def update(self, **settings) -> None:
        """Change settings (keys of ``settings``); followers hear only of a real change."""
        changed = {k: v for k, v in settings.items() if self.settings.get(k) != v}
        if not changed:
            return
        self.settings.update(changed)
        for fn in list(self._setting_followers):
            fn(dict(self.settings))

    def follow(self, fn: Callable) -> None:
        """Call ``fn(block_mask)`` now (when there is a mask) and after every change."""
        self._followers.append(fn)
        if self.block_mask is not None:
            fn(self.block_mask)

    def follow_settings(self, fn: Callable) -> None:
        """Call ``fn(settings)`` after every change of the settings (not now)."""
        self._setting_followers.append(fn)
