"""A trace of one tiled run: every tile read from or written to HBM, and what sits in SRAM.

The NumPy kernels in :mod:`flashedu.tiled` call ``tr.load(...)`` where the GPU kernel would read
a tile from HBM into SRAM, ``tr.store(...)`` where it would write one back, and
``tr.compute(i, j, ...)`` for each (Q tile, K/V tile) pair they work on. Passing no trace uses
:data:`NO_TRACE`, which does nothing, so the kernels read the same with or without it.

Both :mod:`flashedu.io` (HBM byte counts) and :mod:`flashedu.viz` (the tile-loop stepper) read a
:class:`Trace`, so the numbers the widgets show are the numbers the IO counter tests check.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

@dataclass(frozen=True)
class Event:
    """One HBM transfer: ``op`` is "load" (HBM -> SRAM) or "store" (SRAM -> HBM)."""

    op: str
    name: str  # the HBM tensor: "Q", "K", "V", "O", "l", "m", "L", "dO", "D", "dQ", "dK", "dV"
    tile: int  # tile index along the tensor's sequence axis (row block)
    nbytes: int
    step: int  # len(Trace.steps) when recorded: loads carry the step they feed, stores made
    # right after step k carry k + 1 (flashedu.viz.timeline assigns each to its owner step)


@dataclass(frozen=True)
class Step:
    """One (i, j) pair of the loop nest: computed, or skipped because masked out entirely."""

    i: int
    j: int
    computed: bool
    sram: dict  # name -> (tile, nbytes) live in SRAM during this step


@dataclass
class Trace:
    """Records the HBM transfers and SRAM contents of a tiled run."""

    events: list[Event] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # kernel, order, shapes, block sizes
    _live: dict = field(default_factory=dict)

    # --- called by the kernels -----------------------------------------------------------
    def load(self, name: str, tile: int, array):
        """Record a read of ``array`` (one tile of tensor ``name``) from HBM; return it."""
        nbytes = int(np.asarray(array).nbytes)
        self.events.append(Event("load", name, tile, nbytes, len(self.steps)))
        self._live[name] = (tile, nbytes)
        return array

    def store(self, name: str, tile: int, array) -> None:
        """Record a write of ``array`` (one tile of tensor ``name``) to HBM."""
        nbytes = int(np.asarray(array).nbytes)
        self.events.append(Event("store", name, tile, nbytes, len(self.steps)))
        self._live[name] = (tile, nbytes)

    def compute(self, i: int, j: int, **scratch) -> None:
        """Mark the step on tile pair (i, j); ``scratch`` holds on-chip-only arrays like S_ij."""
        live = dict(self._live)
        for name, array in scratch.items():
            live[name] = (None, int(np.asarray(array).nbytes))
        self.steps.append(Step(i, j, True, live))

    def skip(self, i: int, j: int) -> None:
        """Mark tile pair (i, j) as skipped: masked out, nothing loaded, nothing computed."""
        self.steps.append(Step(i, j, False, dict(self._live)))

    def drop(self, *names: str) -> None:
        """Forget tiles no longer live in SRAM."""
        for name in names:
            self._live.pop(name, None)

    # --- read by io and viz --------------------------------------------------------------
    @property
    def bytes_read(self) -> int:
        return sum(e.nbytes for e in self.events if e.op == "load")

    @property
    def bytes_written(self) -> int:
        return sum(e.nbytes for e in self.events if e.op == "store")

    @property
    def hbm_bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def by_tensor(self) -> dict[tuple[str, str], int]:
        """Bytes per (op, tensor name)."""
        totals: Counter = Counter()
        for e in self.events:
            totals[(e.op, e.name)] += e.nbytes
        return dict(totals)

    def totals_until(self, step: int) -> tuple[int, int]:
        """(bytes read, bytes written) of the events whose ``Event.step`` <= ``step``."""
        read = sum(e.nbytes for e in self.events if e.op == "load" and e.step <= step)
        written = sum(e.nbytes for e in self.events if e.op == "store" and e.step <= step)
        return read, written

    def peak_sram_bytes(self) -> int:
        """Largest SRAM live set over the computed steps."""
        return max((sum(n for _, n in s.sram.values()) for s in self.steps if s.computed),
                   default=0)


class _NoTrace:
    """Stands in for a Trace when nobody is watching: every call is a no-op, unless a learner
    trace is listening (see :func:`listen`)."""

    def load(self, name, tile, array):
        if _LISTENER is not None:
            _LISTENER.load(name, tile, array)
        return array

    def store(self, name, tile, array):
        if _LISTENER is not None:
            _LISTENER.store(name, tile, array)

    def compute(self, i, j, **scratch):
        if _LISTENER is not None:
            _LISTENER.compute(i, j, **scratch)

    def skip(self, i, j):
        if _LISTENER is not None:
            _LISTENER.skip(i, j)

    def drop(self, *names):
        pass


NO_TRACE = _NoTrace()

# ----- the learner-trace hook ---------------------------------------------------------------
# flashedu.viz.compare_trace runs a function it did not write (a learner's flash_forward, or
# the package's own). Code that calls the kernels of this package without a trace still reports
# its tile loads, stores and steps to the listener set here, with the values (S_ij, O_i, l_i,
# m_i) it passes; code that does not is traced by other means (flashedu.viz.learner_trace).
_LISTENER = None


class listen:
    """``with listen(recorder):`` sends every untraced kernel's ``load``, ``store``,
    ``compute`` and ``skip`` calls to ``recorder`` (an object with those methods)."""

    def __init__(self, recorder):
        self.recorder = recorder

    def __enter__(self):
        global _LISTENER
        self._previous, _LISTENER = _LISTENER, self.recorder
        return self.recorder

    def __exit__(self, *exc):
        global _LISTENER
        _LISTENER = self._previous
        return False
