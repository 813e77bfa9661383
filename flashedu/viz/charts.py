"""Charts of the widgets, each a function of plain data.

The stepper's charts are small SVG line charts (:func:`line_panel`) with a cursor at the current
position: redrawn at every step in microseconds, in the theme's colours. The SRAM widget's charts
are matplotlib figures returned as PNG bytes (they change only when a control does).
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.ticker import NullFormatter, ScalarFormatter

from .drawing import Drawing
from .render import BORDER, COLORS, FG, FG_MUTED, new_figure, png
from .timeline import RowStats, Timeline


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"


def line_panel(series, position: int, title: str, n: int, width=300.0, height=170.0,
               steps=False, cls="") -> Drawing:
    """A small line chart over positions 0..n with a vertical cursor at ``position``.

    ``series``: (label, values (n + 1,), colour, dashed) tuples; NaN and +-inf leave gaps.
    A fifth element, a bool per position, says where a value exists: there -inf and NaN are
    values too, drawn as marks on the bottom (-inf) or top (inf, NaN) edge with their name.
    ``steps``: draw each value flat until the next position (a running statistic)."""
    d = Drawing(width, height, f"fe-chart {cls}".strip())
    left, right, top, bottom = 46.0, 10.0, 34.0, 26.0
    pw, ph = width - left - right, height - top - bottom
    finite = [v for _, vals, *_ in series for v in np.asarray(vals, float) if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    pad = 0.06 * (hi - lo)
    lo, hi = lo - pad, hi + pad

    def X(x):
        return left + pw * (x / max(n, 1))

    def Y(y):
        return top + ph * (1 - (y - lo) / (hi - lo))

    d.text(left, 9, title, FG, size=11, anchor="start", bold=True)
    d.rect(left, top, pw, ph, "none", BORDER, 1.0)
    for y in (lo + pad, (lo + hi) / 2, hi - pad):
        d.line(left - 3, Y(y), left, Y(y), BORDER)
        d.text(left - 5, Y(y), _fmt(y), FG_MUTED, size=9, anchor="end")
    for x in sorted({0, n}):
        d.text(X(x), top + ph + 10, str(x), FG_MUTED, size=9)
    d.text(left + pw / 2, top + ph + 10, "position", FG_MUTED, size=9)
    x_legend = left
    for label, vals, color, dashed, *known in series:
        d.line(x_legend, 24, x_legend + 14, 24, color, 2.0, "4 2" if dashed else "")
        d.text(x_legend + 17, 24, label, FG, size=9, anchor="start")
        x_legend += 24 + 5.6 * len(label)
        seg = []
        vals = np.asarray(vals, float)
        if known:
            _mark_non_finite(d, vals, np.asarray(known[0], bool), X, top, ph, color)
        for x, v in enumerate(vals):
            if not math.isfinite(v):
                if len(seg) > 1:
                    d.polyline(seg, color, 1.8, "4 2" if dashed else "")
                seg = []
                continue
            if steps and seg:
                seg.append((X(x), seg[-1][1]))
            seg.append((X(x), Y(v)))
        if steps and seg:
            seg.append((X(len(vals) - 1) + 0.0, seg[-1][1]))
        if len(seg) > 1:
            d.polyline(seg, color, 1.8, "4 2" if dashed else "")
        elif len(seg) == 1:
            d.rect(seg[0][0] - 2, seg[0][1] - 2, 4, 4, color, color)
    x = X(min(max(position, 0), n))
    d.line(x, top, x, top + ph, COLORS["cursor"], 2.0, cls="fe-cursor")
    return d


def _mark_non_finite(d: Drawing, vals, known, X, top: float, ph: float, color: str) -> None:
    """Small squares on the plot's edge where a value is -inf (bottom), inf or NaN (top), and
    the name once for each run of them."""
    previous = None
    for x, (v, k) in enumerate(zip(vals, known)):
        kind = None if not k or math.isfinite(v) else "NaN" if math.isnan(v) else \
            "-inf" if v < 0 else "inf"
        if kind is not None:
            y = top + ph - 4 if kind == "-inf" else top + 4
            d.rect(X(x) - 2.5, y - 2.5, 5, 5, color, color, cls="fe-non-finite")
            if kind != previous:  # on the side with room, so that the name is never cut
                right = X(x) < (X(0) + X(len(vals) - 1)) / 2
                d.text(X(x) + (5 if right else -5), y + (-8 if kind == "-inf" else 8), kind,
                       color, size=9, anchor="start" if right else "end")
        previous = kind


def run_panels(tl: Timeline, stats: RowStats, position: int) -> list[Drawing]:
    """The stepper's charts at ``position``: HBM bytes so far, and the chosen row's m_i, l_i."""
    n = tl.done
    hbm = line_panel([("read", tl.read_until / 1024, COLORS["read"], False),
                      ("written", tl.written_until / 1024, COLORS["written"], True)],
                     position, f"HBM KiB so far ({tl.trace.info['order']})", n, cls="fe-hbm")
    m = line_panel([("m_i (running max)", stats.m, COLORS["m"], False)], position,
                   f"row {stats.row}: m_i", n, steps=True, cls="fe-m-chart")
    l = line_panel([("l_i (running sum)", stats.l, COLORS["l"], False)], position,
                   f"row {stats.row}: l_i", n, steps=True, cls="fe-l-chart")
    return [hbm, m, l]


def sram_bar(footprint: dict, capacity: int, title: str) -> bytes:
    """A horizontal stacked bar of what one thread block keeps in shared memory, against the
    SM's capacity (the dashed line)."""
    fig = new_figure(8.0, 2.1)
    ax = fig.subplots()
    colors = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1"]
    start = 0.0
    for (name, nbytes), color in zip(footprint.items(), colors):
        ax.barh(0, nbytes / 1024, left=start, color=color, edgecolor="k", lw=0.5, label=name)
        start += nbytes / 1024
    total = start * 1024
    ax.axvline(capacity / 1024, color=COLORS["over"] if total > capacity else COLORS["ok"],
               ls="--", lw=2, label="SM capacity")
    ax.set_xlim(0, max(total, capacity) * 1.08 / 1024)
    ax.set_yticks([])
    ax.set_xlabel("KiB of shared memory (SRAM) per thread block", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    fig.legend(ncol=8, fontsize=7, frameon=False, loc="outside lower center")
    return png(fig)


def block_size_effect(tiles, traffic: dict, fits, points: dict, largest: int, title: str,
                      points_label: str = "your tile") -> bytes:
    """Predicted HBM traffic against the square tile size B (the paper's Fig. 2, middle):
    bigger tiles mean fewer passes over Q/O (FA1) or K/V (FA2), until SRAM runs out.

    ``points``: curve label -> (B, bytes) of the chosen tile, drawn on that curve. A tile
    Br x Bc sits at B = Bc on the FA1 curve (Q, O pass once per K/V tile: Tc = N / Bc) and at
    B = Br on the FA2 curve (K, V pass once per Q tile: Tr = N / Br)."""
    fig = new_figure(8.0, 2.5)
    ax = fig.subplots()
    tiles = np.asarray(tiles)
    colors = {}
    for label, values in traffic.items():
        (line,) = ax.plot(tiles, np.asarray(values) / 2**20, marker="o", ms=3, label=label)
        colors[label] = line.get_color()
    no_fit = tiles[~np.asarray(fits)]
    if no_fit.size:
        ax.axvspan(no_fit.min() / 1.4, tiles.max() * 1.4, color=COLORS["over"], alpha=0.12,
                   label="does not fit in SRAM")
    first = True
    for label, (x, y) in points.items():
        ax.plot([x], [y / 2**20], marker="*", ms=14, color=colors.get(label, "k"),
                markeredgecolor="k", ls="none", label=points_label if first else None, zorder=5)
        ax.annotate(f"{y / 2**20:,.1f} MiB", (x, y / 2**20), textcoords="offset points",
                    xytext=(6, 6), fontsize=7)
        first = False
    if largest:
        ax.axvline(largest, color=COLORS["ok"], ls=":", lw=1.5,
                   label=f"largest fitting B = {largest}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(tiles, [str(t) for t in tiles])
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("tile size B: FA1 at B = Bc, FA2 at B = Br (a square tile has Br = Bc = B)",
                  fontsize=8)
    ax.set_ylabel("HBM MiB (forward)", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return png(fig)
