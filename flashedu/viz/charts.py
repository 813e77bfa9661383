"""Charts of the widgets, each a function of plain data.

Every chart is a :class:`~flashedu.viz.drawing.Drawing`: inline SVG in the theme's colours
while the widget is live (the stepper's line charts are redrawn at every step in microseconds,
with a cursor at the current position), and the same drawing as a PNG for a saved notebook.
"""

from __future__ import annotations

import math

import numpy as np
from .drawing import Drawing
from .render import BORDER, COLORS, FG, FG_MUTED, ON_TILE
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
    if hi - lo < 1e-4 * max(1.0, abs(lo), abs(hi)):
        # values equal up to rounding (float32 beside float64) are drawn level, not spread
        # over the whole height
        mid, half = (lo + hi) / 2, 0.05 * max(1.0, abs(lo), abs(hi))
        lo, hi = mid - half, mid + half
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


def run_panels(tl: Timeline, stats: RowStats, position: int, mine=None) -> list[Drawing]:
    """The stepper's charts at ``position``: HBM bytes so far, and the chosen row's m_i, l_i
    as the online softmax gives them over this loop. ``mine``: (m, l, known) of a learner's
    own function at each position, drawn beside them (dashed)."""
    n = tl.done
    hbm = line_panel([("read", tl.read_until / 1024, COLORS["read"], False),
                      ("written", tl.written_until / 1024, COLORS["written"], True)],
                     position, f"HBM KiB so far ({tl.trace.info['order']})", n, cls="fe-hbm")
    m_series = [("m_i (running max)", stats.m, COLORS["m"], False)]
    l_series = [("l_i (running sum)", stats.l, COLORS["l"], False)]
    if mine is not None:
        m_mine, l_mine, known = mine
        m_series.append(("yours", m_mine, COLORS["cursor"], True, known))
        l_series.append(("yours", l_mine, COLORS["cursor"], True, known))
    m = line_panel(m_series, position, f"row {stats.row}: m_i", n, steps=True, cls="fe-m-chart")
    l = line_panel(l_series, position, f"row {stats.row}: l_i", n, steps=True, cls="fe-l-chart")
    return [hbm, m, l]


# ----- the SRAM widget's charts -----------------------------------------------------------
BAR_COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1"]
CURVE_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1"]
LEGEND_SIZE = 11  # px: legends as legible as the widget's own text
# Drawn no wider than a notebook's output area beside the file browser on a 1024 px screen,
# so the browser does not scale the text down.
CHART_WIDTH = 600.0


def _nice_step(span: float, ticks: int = 6) -> float:
    raw = span / ticks
    unit = 10 ** math.floor(math.log10(raw))
    return next(k * unit for k in (1, 2, 5, 10) if k * unit >= raw)


def _legend(d: Drawing, entries, x0: float, y: float, right: float, row_h: float = 16.0):
    """Swatches and labels in rows from (x0, y), wrapping at ``right``; returns the y below.
    ``entries``: (label, draw_swatch(x, y)) pairs."""
    x = x0
    for label, swatch in entries:
        w = 22 + 6.2 * len(label)
        if x > x0 and x + w > right:
            x, y = x0, y + row_h
        swatch(x, y)
        d.text(x + 17, y, label, FG, size=LEGEND_SIZE, anchor="start", cls="fe-legend")
        x += w + 10
    return y + row_h


def sram_bar(footprint: dict, capacity: int, title: str, width: float = CHART_WIDTH) -> Drawing:
    """A horizontal stacked bar of what one thread block keeps in shared memory, against the
    SM's capacity: a dashed line in the text colour (no buffer's colour), drawn on top."""
    d = Drawing(width, 150.0, "fe-sram-bar")
    left, right, top, bar_h = 14.0, 14.0, 30.0, 34.0
    pw = width - left - right
    total = sum(footprint.values())
    hi = max(total, capacity) * 1.08 / 1024

    def X(kib_: float) -> float:
        return left + pw * kib_ / hi

    d.text(width / 2, 11, title, FG, size=12, bold=True)
    start = 0.0
    for (name, nbytes), color in zip(footprint.items(), BAR_COLORS):
        d.rect(X(start), top, X(start + nbytes / 1024) - X(start), bar_h, color, ON_TILE, 0.5,
               cls="fe-buffer")
        start += nbytes / 1024
    step = _nice_step(hi)
    k = 0.0
    while k <= hi:
        d.line(X(k), top + bar_h, X(k), top + bar_h + 4, BORDER)
        d.text(X(k), top + bar_h + 12, f"{k:g}", FG_MUTED, size=10)
        k += step
    d.line(left, top + bar_h, left + pw, top + bar_h, BORDER)
    d.text(left + pw / 2, top + bar_h + 27, "KiB of shared memory (SRAM) per thread block",
           FG_MUTED, size=11)
    over = total > capacity
    d.line(X(capacity / 1024), top - 6, X(capacity / 1024), top + bar_h + 6, FG, 2.5, "6 3",
           cls="fe-capacity")

    def box(color):
        return lambda x, y: d.rect(x, y - 6, 12, 12, color, ON_TILE, 0.5)

    entries = [("SM capacity (exceeded)" if over else "SM capacity",
                lambda x, y: d.line(x, y, x + 13, y, FG, 2.5, "4 2"))]
    entries += [(name, box(c)) for name, c in zip(footprint, BAR_COLORS)]
    bottom = _legend(d, entries, left, top + bar_h + 48, width - right)
    d.height = bottom
    return d


def block_size_effect(tiles, traffic: dict, fits, points: dict, largest: int, title: str,
                      points_label: str = "your tile", width: float = CHART_WIDTH) -> Drawing:
    """Predicted HBM traffic against the square tile size B (the paper's Fig. 2, middle):
    bigger tiles mean fewer passes over Q/O (FA1) or K/V (FA2), until SRAM runs out. Both axes
    are logarithmic.

    ``points``: curve label -> (B, bytes) of the chosen tile, drawn on that curve. A tile
    Br x Bc sits at B = Bc on the FA1 curve (Q, O pass once per K/V tile: Tc = N / Bc) and at
    B = Br on the FA2 curve (K, V pass once per Q tile: Tr = N / Br)."""
    d = Drawing(width, 270.0, "fe-block-size-effect")
    left, right, top, bottom = 50.0, 14.0, 46.0, 44.0
    pw, ph = width - left - right, d.height - top - bottom
    tiles = [int(t) for t in tiles]
    mib = {k: [v / 2**20 for v in vals] for k, vals in traffic.items()}
    ys = [v for vals in mib.values() for v in vals] + [b / 2**20 for _, b in points.values()]
    lo, hi = math.log10(min(ys)) - 0.1, math.log10(max(ys)) + 0.1
    x_lo, x_hi = math.log2(tiles[0]) - 0.3, math.log2(tiles[-1]) + 0.3

    def X(B: float) -> float:
        return left + pw * (math.log2(B) - x_lo) / (x_hi - x_lo)

    def Y(v: float) -> float:
        return top + ph * (1 - (math.log10(v) - lo) / (hi - lo))

    d.text(left, 11, title, FG, size=12, anchor="start", bold=True)
    d.text(left - 44, 30, "HBM MiB of one forward pass (log scale)", FG_MUTED, size=11,
           anchor="start")
    no_fit = [B for B, ok in zip(tiles, fits) if not ok]
    if no_fit:
        # the largest fitting B (a multiple of 16) is where SRAM runs out; else between tiles
        x0 = X(largest) if largest else X(min(no_fit)) - 0.5 * (
            X(tiles[1]) - X(tiles[0]) if len(tiles) > 1 else 20)
        d.rect(max(x0, left), top, left + pw - max(x0, left), ph, COLORS["over"], "none", 0,
               cls="fe-no-fit", opacity=0.16)
    d.rect(left, top, pw, ph, "none", BORDER, 1.0)
    for e in range(math.ceil(lo), math.floor(hi) + 1):
        d.line(left - 4, Y(10**e), left, Y(10**e), BORDER)
        d.line(left, Y(10**e), left + pw, Y(10**e), BORDER, 0.4, "2 3")
        d.text(left - 7, Y(10**e), f"{10**e:g}", FG_MUTED, size=10, anchor="end")
    for B in tiles:
        d.line(X(B), top + ph, X(B), top + ph + 4, BORDER)
        d.text(X(B), top + ph + 13, str(B), FG_MUTED, size=10)
    d.text(left + pw / 2, top + ph + 31, "tile size B: FA1 at B = Bc, FA2 at B = Br",
           FG_MUTED, size=11)
    colors = dict(zip(traffic, CURVE_COLORS))
    for label, vals in mib.items():
        d.polyline([(X(B), Y(v)) for B, v in zip(tiles, vals)], colors[label], 2.0,
                   cls="fe-curve")
        for B, v in zip(tiles, vals):
            d.rect(X(B) - 2.5, Y(v) - 2.5, 5, 5, colors[label], colors[label])
    if largest:
        d.line(X(largest), top, X(largest), top + ph, COLORS["ok"], 2.0, "2 3",
               cls="fe-largest-line")
    for label, (B, nbytes) in points.items():
        x, y = X(B), Y(nbytes / 2**20)
        d.polygon(_diamond(x, y, 8), colors.get(label, FG), FG, 1.2, cls="fe-your-tile")
        d.text(x + 10, y - 10, f"{nbytes / 2**20:,.1f} MiB", FG, size=11, anchor="start")

    def curve(c):
        return lambda x, y: d.line(x, y, x + 13, y, c, 2.0)

    entries = [(label, curve(colors[label])) for label in traffic]
    entries.append((points_label, lambda x, y: d.polygon(_diamond(x + 6, y, 6), FG_MUTED, FG,
                                                         1.0)))
    if no_fit:
        entries.append(("does not fit in SRAM", lambda x, y: d.rect(
            x, y - 6, 13, 12, COLORS["over"], "none", 0, opacity=0.3)))
    if largest:
        entries.append((f"largest fitting B = {largest}",
                        lambda x, y: d.line(x, y, x + 13, y, COLORS["ok"], 2.0, "2 3")))
    d.height = _legend(d, entries, left, top + ph + 50, width - right)
    return d


def _diamond(x: float, y: float, r: float):
    return [(x, y - r), (x + r, y), (x, y + r), (x - r, y)]
