"""A traced run laid out as positions a learner can step through (no widgets here).

A :class:`flashedu.trace.Trace` numbers each HBM transfer with the index of the loop step that
comes next (``Event.step``), so a store made right after step k carries k + 1, and the
Algorithm-1 epilogue (L = m + log l) carries ``len(steps)``. To show a step together with the
traffic it causes, each transfer is given an *owner* position. Positions count the steps done:

- position 0 is the start, before any step: nothing loaded yet;
- position k (1 .. n) is step k, the k-th (i, j) tile pair; a load belongs to the step it
  feeds (``Event.step`` + 1), a store to the step just computed (``Event.step``), unless a load
  of the same index came before it (then it is part of that later step);
- the last position, n, also carries the final writes (the epilogue), so it is "done".

Totals at n are the trace's own ``bytes_read`` / ``bytes_written``, which
:func:`flashedu.io.flash_forward_hbm_bytes` predicts exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..trace import Event, Trace


@dataclass(frozen=True)
class Timeline:
    trace: Trace
    owner: np.ndarray  # (len(events),) position each transfer belongs to
    read_until: np.ndarray  # (n + 1,) bytes read up to and including position p
    written_until: np.ndarray  # (n + 1,) bytes written likewise

    @property
    def done(self) -> int:
        """The last position: step n, and every transfer."""
        return len(self.trace.steps)

    def step_at(self, position: int):
        """The Step shown at ``position`` (None at the start, position 0)."""
        return self.trace.steps[position - 1] if position >= 1 else None

    def totals(self, position: int) -> tuple[int, int]:
        """(bytes read, bytes written) from the start through ``position``."""
        return int(self.read_until[position]), int(self.written_until[position])

    def transfers_at(self, position: int) -> list[Event]:
        """The HBM transfers this position makes (loads it needs, stores it causes)."""
        return [e for e, p in zip(self.trace.events, self.owner) if p == position]

    def traffic_by_tensor(self, position: int) -> dict[tuple[str, str], int]:
        """Bytes per (op, tensor) from the start through ``position``."""
        out: dict[tuple[str, str], int] = {}
        for e, p in zip(self.trace.events, self.owner):
            if p <= position:
                out[(e.op, e.name)] = out.get((e.op, e.name), 0) + e.nbytes
        return out


def build(trace: Trace) -> Timeline:
    n = len(trace.steps)
    owner = np.empty(len(trace.events), dtype=int)
    loaded_at = -1  # the largest Event.step index a load has been seen with
    for t, e in enumerate(trace.events):
        if e.op == "load":
            loaded_at = e.step
            owner[t] = e.step
        else:
            owner[t] = e.step if loaded_at == e.step else e.step - 1
    owner = np.clip(owner + 1, 1, n)  # position 0, the start, makes no transfer
    reads, writes = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
    for e, p in zip(trace.events, owner):
        (reads if e.op == "load" else writes)[p] += e.nbytes
    return Timeline(trace, owner, np.cumsum(reads), np.cumsum(writes))


@dataclass(frozen=True)
class RowStats:
    """The online-softmax statistics of one query row after each position."""

    row: int
    m: np.ndarray  # (n + 1,) running max m_i after each position (-inf at the start)
    l: np.ndarray  # (n + 1,) running sum l_i of exp(score - m_i)
    tiles_seen: np.ndarray  # (n + 1,) K/V tiles folded into the row so far

    @property
    def L(self) -> float:
        """The logsumexp the kernel writes for this row: m_i + log(l_i) at the end."""
        m, l = self.m[-1], self.l[-1]
        return float(m + np.log(l)) if l > 0 else -np.inf


def row_stats(trace: Trace, Q, K, row: int, scale: float, causal: bool) -> RowStats:
    """Replay the online softmax of query ``row`` over the steps of ``trace``, in its order.

    It folds in the score tile S_ij[row] at each computed step (i, j) of the row's Q tile,
    exactly as the kernel's lines for m_i and l_i do; a skipped tile changes nothing."""
    Br, Bc, Nk = trace.info["Br"], trace.info["Bc"], trace.info["Nk"]
    scores = scale * (np.asarray(Q, np.float64)[row] @ np.asarray(K, np.float64).T)
    if causal:
        scores = np.where(np.arange(Nk) <= row, scores, -np.inf)
    m, l, seen = -np.inf, 0.0, 0
    ms, ls, counts = [m], [l], [seen]  # position 0, the start
    for s in trace.steps:
        if s.computed and s.i == row // Br:
            S = scores[s.j * Bc:min((s.j + 1) * Bc, Nk)]
            m_new = max(m, S.max())
            if np.isfinite(m_new):  # a tile fully masked for this row leaves m, l as they were
                l = l * np.exp(m - m_new) + np.exp(S - m_new).sum()
                m = m_new
            seen += 1
        ms.append(m), ls.append(l), counts.append(seen)
    return RowStats(row, np.array(ms), np.array(ls), np.array(counts))
