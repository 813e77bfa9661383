"""The stepper's picture: Q, K, V, O, l/m/L and the score grid S as tiles, at one position.

Drawn as inline SVG rather than matplotlib: a step redraws in microseconds instead of a second,
and a browser test can read the tiles (``rect`` elements carry a class: sram, done, skipped,
todo, acc). Layout: Q is a column of Tr tiles left of S; K^T and V^T are rows of Tc tiles
above S; O (and l, m, L) are columns right of S. A tile of an HBM tensor is orange while the
trace lists it in SRAM; each is annotated with how often it has been read (r) and written (w)
so far, which is where the two loop orders differ. The mask shows from the start: a tile pair
the run skips is grey before the loop reaches it, so position 0 (no tile highlighted, nothing
loaded) is the mask itself.
"""

from __future__ import annotations

from collections import Counter

from .drawing import Drawing
from .render import BG, BORDER, COLORS, FG, ON_TILE
from .timeline import Timeline

FILL = {"sram": COLORS["sram"], "done": COLORS["done"], "skipped": COLORS["skipped"],
        "todo": BG, "acc": COLORS["accumulator"]}


def _swatch(kind: str) -> str:
    return (f"<span style='display:inline-block;width:12px;height:12px;background:{FILL[kind]};"
            f"border:1px solid {BORDER};vertical-align:middle'></span>")


LEGEND = (
    "<div class='fe-legend' style='font-size:12px'>"
    + " ".join(f"<span style='white-space:nowrap'>{_swatch(k)} {text}</span> &nbsp;"
               for k, text in (("sram", "in SRAM now"), ("done", "computed"),
                               ("skipped", "skipped (masked out)"),
                               ("acc", "O_i accumulating on chip (FA2)")))
    + " &nbsp; r/w: times read / written in HBM so far</div>")


def _io_counts(tl: Timeline, position: int) -> Counter:
    """(op, tensor, tile) -> number of transfers so far."""
    return Counter((e.op, e.name, e.tile) for e, p in zip(tl.trace.events, tl.owner) if p <= position)


class _Grid:
    """Tiles in tile units on a :class:`Drawing`."""

    def __init__(self, unit: float, width: float, height: float):
        self.u = unit
        self.d = Drawing(width * unit, height * unit, "fe-tiles")

    def masked(self, x, y, rows, cols, w, h):
        """The causally masked elements (column > row) of a score tile of global ``rows``
        [r0, r1) and ``cols`` [c0, c1), drawn w x h, as one staircase in the skipped colour."""
        (r0, r1), (c0, c1) = rows, cols
        nr, nc = r1 - r0, c1 - c0
        first = [min(max(r + 1 - c0, 0), nc) for r in range(r0, r1)]  # first masked column
        if all(b == nc for b in first):
            return
        u, sx, sy = self.u, w / nc, h / nr
        pts = [((x + w) * u, y * u)]
        for a, b in enumerate(first):
            pts += [((x + b * sx) * u, (y + a * sy) * u),
                    ((x + b * sx) * u, (y + (a + 1) * sy) * u)]
        pts.append(((x + w) * u, (y + h) * u))
        self.d.polygon(pts, FILL["skipped"], "none", 0, cls="causal-masked")

    def rows_marked(self, x, y, rows, w, h, marked):
        """A red bar across each row of the tile (global ``rows`` [r0, r1)) in ``marked``."""
        r0, r1 = rows
        sy, u = h / (r1 - r0), self.u
        for r in sorted(set(marked)):
            if r0 <= r < r1:
                self.d.rect(x * u, (y + (r - r0) * sy) * u, w * u, max(sy * u, 2.0),
                            COLORS["cursor"], "none", 0, cls="row-differs", opacity=0.75)

    def tile(self, x, y, w, h, kind, label="", current=False, name=""):
        u, d = self.u, self.d
        stroke, sw = (FG, 3.0) if current else (BORDER, 1.0)
        d.rect(x * u, y * u, w * u, h * u, FILL[kind], stroke, sw, "4 2" if kind == "acc" else "",
               cls=f"tile {kind}" + (" current" if current else ""), data=f" data-name='{name}'")
        if kind == "skipped":  # a cross, so skipped reads without colour too
            d.line(x * u, y * u, (x + w) * u, (y + h) * u, "#8a8a8a")
            d.line(x * u, (y + h) * u, (x + w) * u, y * u, "#8a8a8a")
        if label:
            color = FG if kind == "todo" else ON_TILE
            size = min(11, u * 0.32, h * u * 0.8)  # a ragged edge's thin tile: smaller text
            if size >= 5:
                d.text((x + w / 2) * u, (y + h / 2) * u, label, color, size=size)

    def text(self, x, y, s, size=12, bold=False, anchor="middle"):
        self.d.text(x * self.u, y * self.u, s, FG, size, anchor, bold)


def _rw(counts: Counter, name: str, tile: int) -> str:
    r, w = counts[("load", name, tile)], counts[("store", name, tile)]
    return " ".join(p for p in (f"r{r}" if r else "", f"w{w}" if w else "") if p)


def drawing(tl: Timeline, position: int, marks=None) -> Drawing:
    """The tile picture of ``tl`` at ``position``. ``marks``: query rows to mark inside the
    current score tile (where a learner's values first leave the reference's)."""
    info = tl.trace.info
    Tr, Tc, order = info["Tr"], info["Tc"], info["order"]
    steps = tl.trace.steps
    current = tl.step_at(position)
    live = current.sram if current is not None else {}
    counts = _io_counts(tl, position)
    right_cols = ["O", "l", "m", "L"] if order == "kv_outer" else ["O", "L"]
    width = 1.6 + Tc + 0.4 + 1.25 * len(right_cols) + 0.2
    height = 2.9 + Tr + 0.8
    g = _Grid(max(18.0, min(44.0, 620 / width, 460 / height)), width, height)
    x_S, y_S = 1.6, 2.9  # top-left corner of the score grid
    Br, Bc, Nq, Nk = info["Br"], info["Bc"], info["Nq"], info["Nk"]

    def rows(i):  # a tile is drawn as it is: the last one of a ragged edge is shorter
        return i * Br, min((i + 1) * Br, Nq)

    def cols(j):
        return j * Bc, min((j + 1) * Bc, Nk)

    def frac(span, size):
        return (span[1] - span[0]) / size

    def kind_of(name, tile):
        return "sram" if name in live and live[name][0] == tile else "todo"

    for name, x in [("Q", 0.2)] + [(n, x_S + Tc + 0.4 + 1.25 * k) for k, n in enumerate(right_cols)]:
        g.text(x + 0.55, y_S - 0.3, name, bold=True)
        for i in range(Tr):
            kind = kind_of(name, i)
            if name == "O" and order == "q_outer" and current is not None and current.i == i:
                kind = "acc"  # FA2 keeps O_i on chip until the row of tiles is done
            g.tile(x, y_S + i, 1.1, frac(rows(i), Br), kind, _rw(counts, name, i),
                   name=f"{name}{i}")
    for name, y in (("V", 0.2), ("K", 1.45)):
        g.text(x_S - 0.2, y + 0.5, name + "ᵀ", bold=True, anchor="end")
        for j in range(Tc):
            g.tile(x_S + j, y, frac(cols(j), Bc), 1, kind_of(name, j), _rw(counts, name, j),
                   name=f"{name}{j}")
    state = {(s.i, s.j): "skipped" for s in steps if not s.computed}  # the mask, from the start
    for s in steps[:position]:
        state[(s.i, s.j)] = "done" if s.computed else "skipped"
    for i in range(Tr):
        for j in range(Tc):
            kind = state.get((i, j), "todo")
            now = current is not None and (current.i, current.j) == (i, j)
            if now and current.computed:
                kind = "sram"
            w, h = frac(cols(j), Bc), frac(rows(i), Br)
            g.tile(x_S + j, y_S + i, w, h, kind, "S_ij" if now and current.computed else "",
                   current=now, name=f"S{i},{j}")
            if info.get("causal") and kind != "skipped":  # the diagonal inside its tiles
                g.masked(x_S + j, y_S + i, rows(i), cols(j), w, h)
            if marks is not None and now:
                g.rows_marked(x_S + j, y_S + i, rows(i), w, h, marks)
    g.text(x_S + Tc / 2, y_S + Tr + 0.45, "S = scale · Q Kᵀ, tile by tile (never in HBM)", size=12)
    return g.d


def svg(tl: Timeline, position: int) -> str:
    """The tile picture of ``tl`` at ``position`` as an SVG string."""
    return drawing(tl, position).svg()
