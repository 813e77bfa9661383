"""A learner's steps and the statistics after each (no widgets, no tracing): the data that
:mod:`flashedu.viz.learner_trace` records and compares and :mod:`flashedu.viz.compare_view`
and :mod:`flashedu.viz.stepper` show, and the readings both sides make of it (the rows that
differ, the text of a gap, a row's series over the steps), so that the verdict and the picture
name the same rows."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class Step:
    """One S_ij = Q_i K_j^T: rows [q0, q1) of Q against rows [k0, k1) of K."""

    q: tuple[int, int]
    k: tuple[int, int]
    v: tuple[int, int] | None = None  # rows of V in the P_ij V_j that followed
    state: dict | None = None  # "m", "l" (rows,), "O" (rows, d), "O_normalized": bool

    def pair(self, Br: int, Bc: int) -> tuple[int, int]:
        return self.q[0] // Br, self.k[0] // Bc



def _ranges(rows) -> str:
    rows = sorted(int(r) for r in rows)
    parts, start = [], None
    for a, b in zip(rows, rows[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}..{a}")
            start = None
    return ", ".join(parts)


def _close(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return np.zeros(b.shape[:1], bool)
    with np.errstate(all="ignore"):
        ok = np.isclose(a, b, rtol=2e-4, atol=2e-5) | (np.isneginf(a) & np.isneginf(b))
    return ok.reshape(ok.shape[0], -1).all(axis=1) if ok.ndim > 1 else ok


def _normalized(state):
    O, l = state["O"], state["l"]
    if state["O_normalized"]:
        return O
    with np.errstate(divide="ignore", invalid="ignore"):
        return O / np.where(l > 0, l, 1)[:, None]


def state_series(steps: list[Step], row: int, column: int, n: int, skip: int | None = None):
    """m_i, l_i and column ``column`` of O_i / l_i of query ``row`` after each of n steps
    (position 0: before the first), and where each exists (there -inf and NaN are values, not
    gaps). A step whose state is unknown keeps the previous values; step ``skip`` (1-based: the
    one that raised half way) has none and is a gap."""
    m, l, o = np.full(n + 1, np.nan), np.full(n + 1, np.nan), np.full(n + 1, np.nan)
    known, known_o = np.zeros(n + 1, bool), np.zeros(n + 1, bool)
    for x, s in enumerate(steps[:n], start=1):
        if x == skip:
            continue
        m[x], l[x], o[x] = m[x - 1], l[x - 1], o[x - 1]
        known[x], known_o[x] = known[x - 1], known_o[x - 1]
        if s.state is None or not s.q[0] <= row < s.q[1] or len(s.state["m"]) <= row - s.q[0]:
            continue
        r = row - s.q[0]
        m[x], l[x], known[x] = float(s.state["m"][r]), float(s.state["l"][r]), True
        if "O" in s.state:
            o[x], known_o[x] = float(_normalized(s.state)[r, column]), True
    return m, l, o, known, known_o


def row_differences(mine: dict, ref: dict) -> dict[str, np.ndarray]:
    """For each of m_i, l_i, O_i in the learner's state ``mine``: one bool per row of the step's
    Q tile, True where it differs from ``ref``. The verdict and the stepper's table both read
    it, so both name the same rows. O_i agrees when O_i / l_i does (or O_i, for a kernel that
    keeps O_i normalized)."""
    out = {"m_i": ~_close(mine["m"], ref["m"]), "l_i": ~_close(mine["l"], ref["l"])}
    if "O" in mine:
        ref_O = _normalized(ref)
        out["O_i"] = ~(_close(_normalized(mine), ref_O) | _close(mine["O"], ref_O))
    return out


def _values(state: dict, what: str):
    """The values the comparison of ``what`` reads (O_i as O_i / l_i)."""
    return _normalized(state) if what == "O_i" else state["m" if what == "m_i" else "l"]


def _num(v: float) -> str:
    return "NaN" if math.isnan(v) else "-inf" if v == -math.inf else "inf" if v == math.inf \
        else f"{v:.5g}"


def _kind(row) -> str | None:
    """"NaN", "-inf" or "inf" when the row holds one (in that order), else None."""
    if np.isnan(row).any():
        return "NaN"
    if np.isneginf(row).any():
        return "-inf"
    return "inf" if np.isposinf(row).any() else None


def gap_text(mine, ref, bad, first_row: int = 0) -> str:
    """What differs on the rows where ``bad`` is True (index 0 is query row ``first_row``):
    each kind of -inf, inf and NaN by name, where it is and how many rows have it; then the
    largest gap among the rows where both are finite. A gap is never inf."""
    mine, ref = np.asarray(mine, np.float64), np.asarray(ref, np.float64)
    if mine.shape != ref.shape:
        return f"yours has shape {mine.shape}, the reference {ref.shape}"
    scalar = mine.ndim == 1
    m2, r2 = mine.reshape(len(mine), -1), ref.reshape(len(ref), -1)
    bad = np.asarray(bad, bool)
    groups: dict[tuple, list[int]] = {}
    finite = np.zeros(len(m2), bool)
    for r in np.flatnonzero(bad):
        km, kr = _kind(m2[r]), _kind(r2[r])
        if km is None and kr is None:
            finite[r] = True
        else:
            groups.setdefault((km, kr), []).append(int(r))
    parts = []
    for (km, kr), rows in groups.items():
        r, where = rows[0], _ranges([first_row + x for x in rows])
        if len(rows) == 1:
            yours = _num(m2[r, 0]) if scalar else (km or "finite")
            theirs = _num(r2[r, 0]) if scalar else (kr or "finite")
            parts.append(f"yours {yours} in row {where}, where the reference is {theirs}")
        else:
            example = ""
            if scalar and kr is None:
                example = f" (the reference {_num(r2[r, 0])} in row {first_row + r})"
            elif scalar and km is None:
                example = f" (yours {_num(m2[r, 0])} in row {first_row + r})"
            parts.append(f"yours {km or 'finite'} in rows {where}, where the reference is "
                         f"{kr or 'finite'}{example}")
    if finite.any():
        with np.errstate(all="ignore"):
            gaps = np.where(finite, np.abs(m2 - r2).max(axis=1), -1.0)
        r = int(np.argmax(gaps))
        values = (f": yours {_num(m2[r, 0])}, the reference {_num(r2[r, 0])}" if scalar
                  else "")
        parts.append(f"largest gap {gaps[r]:.3g} at row {first_row + r}{values}")
    return "; ".join(parts)
