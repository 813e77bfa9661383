"""KernelTraceView: step through one program's loads and stores of a traced kernel.

Shows a :class:`flashedu.viz.kernel_trace.KernelTrace`: pick a program (a Triton program id or
a numba block), then step through its accesses in order. Each tensor is a small grid of its
elements (rows down, columns across; a 1-D tensor is one column); shared memory has grids of
its own. Orange: the elements the current access touches; blue: touched earlier by this
program; grey with a cross: lanes the mask switched off; red: lanes out of bounds; purple:
elements whose value is wrong (:meth:`KernelTrace.compare`'s view). Lanes that
point past the last row (or between the rows of a strided tensor) are drawn in a dashed area
beyond the tensor, as if its rows went on.

Drawn as inline SVG (a step redraws in microseconds, text follows the notebook's theme); a
tensor too big for one square per element is drawn with one square per block of elements,
coloured by the most telling state in the block.
"""

from __future__ import annotations

import html
import math
import textwrap

import ipywidgets as W
import numpy as np

from . import static
from .controls import set_quietly
from .drawing import Drawing
from .render import BG, BORDER, COLORS, ERROR, FG, FG_MUTED

# States of an element at the current access; a larger number wins where blocks are merged.
UNTOUCHED, EARLIER, MASKED, CURRENT, OUT, WRONG = 0, 1, 2, 3, 4, 5
STATE_NAMES = {UNTOUCHED: "untouched", EARLIER: "earlier", MASKED: "masked", CURRENT: "current",
               OUT: "oob", WRONG: "wrong"}
FILL = {UNTOUCHED: BG, EARLIER: COLORS["done"], MASKED: COLORS["skipped"],
        CURRENT: COLORS["sram"], OUT: COLORS["over"], WRONG: COLORS["l"]}
LEGEND_TEXT = ((CURRENT, "this access"), (EARLIER, "earlier in this {unit}"),
               (MASKED, "masked off"), (OUT, "out of bounds"), (WRONG, "wrong value"))
MAX_CELLS = 40  # squares a grid draws along each axis; more elements share a square
MAX_PAST, MAX_BEFORE, MAX_GAP = 16, 4, 8  # rows past the end, before the start, columns between


class KernelTraceView:
    """State: ``trace``, ``program`` (x, y, z), ``position`` (1-based index of the current
    access of that program, the slider), ``access`` (the :class:`Access`, None for a program
    without any), ``status`` (the access in words), ``cells`` (tensor -> array of states,
    UNTOUCHED .. OUT, one per element of the rows ``first_row[tensor]`` onwards, including the
    rows and columns drawn beyond the tensor) and ``notes`` (the program's out-of-bounds
    accesses in words). ``wrong`` ({tensor: [(row, column), ...]}) marks elements whose value
    is wrong, at every step; ``at`` (an :class:`Access` of ``program``) is where to open."""

    def __init__(self, trace, program=None, wrong=None, at=None):
        self.trace = t = trace
        self.wrong = {name: list(points) for name, points in (wrong or {}).items()}
        unknown = [name for name in self.wrong if name not in t.tensors]
        if unknown:
            raise ValueError(f"wrong: {', '.join(unknown)} is not traced here; the traced "
                             f"tensors are {', '.join(t.tensors)}")
        self.unit = "program" if t.backend == "triton" else "block"
        self.shown = [n for n in t.tensors if any(a.tensor == n for a in t.all_accesses())]
        options = [(f"{t.program_name(p)} ({len(t.accesses(p))} accesses)", p)
                   for p in t.programs] or [("no programs", (0, 0, 0))]
        self.picker = W.Dropdown(options=options, value=self._start(program),
                                 description=self.unit, layout=W.Layout(width="260px"))
        self.slider = W.IntSlider(1, min=1, max=1, description="access",
                                  layout=W.Layout(flex="1 1 240px", min_width="200px",
                                                  max_width="420px"))
        self.back_button = W.Button(description="◀ back", layout=W.Layout(width="80px"))
        self.step_button = W.Button(description="step ▶", layout=W.Layout(width="80px"))
        self.back_button.on_click(lambda _: self.back())
        self.step_button.on_click(lambda _: self.step())
        self.headline = W.HTML(self._headline_html())
        self.status_html = W.HTML()
        self.grids = W.HTML()
        self.notes_html = W.HTML()
        self.widget = W.VBox([
            W.HTML(static.HIDE_WHEN_LIVE + f"<b>Inside {html.escape(t.kernel_name)}</b>: its "
                   f"loads and stores, {self.unit} by {self.unit} (grid {t.grid_text()})"),
            self.headline,
            W.HBox([self.picker, self.back_button, self.step_button, self.slider],
                   layout=W.Layout(flex_flow="row wrap", align_items="center",
                                   max_width="100%")),
            self.status_html, self.grids, W.HTML(_legend_html(self.unit, bool(self.wrong))),
            self.notes_html,
        ], layout=W.Layout(max_width="100%", overflow="hidden"))
        self.widget.add_class("flashedu-kernel-trace")
        self.widget.add_class("flashedu-live")
        self._holding = False
        self.picker.observe(lambda _: self._new_program(), names="value")
        self.slider.observe(lambda _: None if self._holding else self._show(), names="value")
        self._new_program()
        if at is not None and at in self.accesses:
            self.slider.value = self.accesses.index(at) + 1

    def _start(self, program) -> tuple[int, int, int]:
        """The program to open at: ``program``, else the first that goes out of bounds, else
        the first that loads or stores anything."""
        t = self.trace
        if not t.programs:
            return (0, 0, 0)
        if program is not None:
            return t.program_id(program)
        bad = t.out_of_bounds()
        return bad[0].program if bad else next((p for p in t.programs if t.accesses(p)),
                                               t.programs[0])

    # ----- state -------------------------------------------------------------------------------
    @property
    def program(self) -> tuple[int, int, int]:
        return self.picker.value

    @property
    def position(self) -> int:
        return self.slider.value

    @property
    def accesses(self) -> list:
        return self.trace.accesses(self.program) if self.trace.programs else []

    @property
    def access(self):
        acc = self.accesses
        return acc[self.position - 1] if acc else None

    def step(self) -> None:
        self.slider.value = min(self.slider.max, self.slider.value + 1)

    def back(self) -> None:
        self.slider.value = max(1, self.slider.value - 1)

    def _new_program(self) -> None:
        n = max(len(self.accesses), 1)
        self._extent = {name: _extent(self.trace, name, self.accesses) for name in self.shown}
        # the value first: then the new max never clips it into a redraw of its own
        set_quietly(self, [(self.slider, 1)])
        self.slider.max = n
        self.slider.disabled = self.step_button.disabled = self.back_button.disabled = n == 1
        self._show()

    def _show(self) -> None:
        self.cells, self.first_row = {}, {}
        for name in self.shown:
            self.first_row[name] = self._extent[name][0]
            self.cells[name] = self._cells(name)
        a = self.access
        k, n = self.position, len(self.accesses)
        if a is not None:
            self.status = f"access {k} of {n}: {self.trace.describe(a)}"
        elif self.trace.programs:
            self.status = f"{self.trace.program_name(self.program)} made no loads or stores"
        else:
            self.status = "the grid has no programs"

        color = ERROR if a is not None and a.out_of_bounds else FG
        self.status_html.value = (f"<div class='fe-kernel-status' style='color:{color}'>"
                                  f"{html.escape(self.status)}</div>")
        self.grids.value = ("<div style='display:flex;flex-wrap:wrap;gap:6px 12px;"
                            "align-items:flex-start'>"
                            + "".join(f"<div>{d.svg()}</div>" for d in self.drawings())
                            + "</div>")
        self.notes = [self.trace.describe(x) for x in self.accesses if x.out_of_bounds]
        self.notes_html.value = "".join(
            f"<div style='color:{ERROR};font-size:12px'>{'▶ ' if x is a else ''}"
            f"{html.escape(self.trace.describe(x))}</div>"
            for x in self.accesses if x.out_of_bounds)
        static.update(self)

    def _cells(self, name: str) -> np.ndarray:
        """The state of each element of ``name`` at the current access (rows from
        ``first_row``), with the rows and columns beyond the tensor that this program's
        lanes point at."""
        top, bottom, width = self._extent[name]
        cells = np.full((bottom - top, width), UNTOUCHED, dtype=np.int8)

        def paint(points, state):
            if points:
                rc = np.asarray(points)
                r, c = rc[:, 0] - top, rc[:, 1]
                keep = (r >= 0) & (r < cells.shape[0]) & (c >= 0) & (c < width)
                np.maximum.at(cells, (r[keep], c[keep]), state)

        for a in self.accesses[:self.position - 1]:
            if a.tensor == name:
                paint(a.elements, EARLIER)
        a = self.access
        if a is not None and a.tensor == name:
            paint(a.masked, MASKED)
            paint(a.elements, CURRENT)
            paint(a.outside, OUT)
        paint(self.wrong.get(name, []), WRONG)
        return cells

    # ----- drawing -----------------------------------------------------------------------------
    def drawings(self) -> list[Drawing]:
        """A grid per tensor, all at one size of square, so that tiles compare by eye."""
        squares = [_squares(self.cells[n].shape) for n in self.shown]
        u = next((u for u in range(16, 3, -1) if _fits(squares, self.shown, u)), 3)
        return [_grid(self.trace, name, self.cells[name], self.first_row[name], float(u))
                for name in self.shown]

    def _headline_html(self) -> str:
        t = self.trace
        color = ERROR if t.error is not None or t.out_of_bounds() else FG_MUTED
        return (f"<div class='fe-kernel-headline' style='color:{color}'>"
                f"{html.escape(t.headline)}</div>")

    def static_png(self) -> bytes:
        return static.stack_png([_legend_drawing(self.unit, bool(self.wrong))] + self.drawings(),
                                textwrap.shorten(self.status, 160, placeholder=" ..."))

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self):
        static.display_with_fallback(self)


def _extent(trace, name: str, accesses) -> tuple[int, int, int]:
    """(first row, row after the last, columns) to draw for ``name`` in a program: the tensor,
    and as many rows past its end (or before its start) and columns between its rows as the
    program's lanes point at, within limits."""
    shape = trace.tensors[name].shape
    rows = math.prod(shape[:-1]) if len(shape) >= 2 else (shape[0] if shape else 1)
    cols = shape[-1] if len(shape) >= 2 else 1
    top, bottom, width = 0, rows, cols
    for a in accesses:
        if a.tensor == name:
            for r, c in a.outside + a.masked:
                top, bottom, width = min(top, r), max(bottom, r + 1), max(width, c + 1)
    return (max(top, -MAX_BEFORE), min(bottom, rows + MAX_PAST), min(width, cols + MAX_GAP))


WIDTH, HEIGHT = 960.0, 470.0  # room for the grids in a 1024 x 768 window, with the controls
LEFT, HEAD = 30.0, 30.0  # a grid's margins: row numbers, title


def _fits(squares, names, u: float) -> bool:
    """Whether grids of ``squares`` at ``u`` px a square, wrapped into rows WIDTH wide, stay
    within HEIGHT."""
    height, row_w, row_h = 0.0, 0.0, 0.0
    for (R, C), name in zip(squares, names):
        w, h = max(LEFT + C * u + 8, 8 + 6.5 * (len(name) + 14)), HEAD + R * u + 4
        if row_w and row_w + w + 12 > WIDTH:
            height, row_w, row_h = height + row_h + 6, 0.0, 0.0
        row_w, row_h = row_w + w + 12, max(row_h, h)
    return height + row_h <= HEIGHT and all(LEFT + C * u + 8 <= WIDTH for _, C in squares)


def _squares(shape) -> tuple[int, int]:
    """(rows, columns) of squares a grid of ``shape`` elements is drawn with."""
    R, C = shape
    return (math.ceil(R / math.ceil(R / MAX_CELLS)) if R else 1,
            math.ceil(C / math.ceil(C / MAX_CELLS)) if C else 1)


def _grid(trace, name: str, cells: np.ndarray, top: int, u: float) -> Drawing:
    """One tensor: a square per element (or per block of elements), the area beyond the
    tensor dashed."""
    op = trace.tensors[name]
    shape = op.shape
    rows = math.prod(shape[:-1]) if len(shape) >= 2 else (shape[0] if shape else 1)
    cols = shape[-1] if len(shape) >= 2 else 1
    R, C = cells.shape
    if not cells.size:  # an empty tensor: its name only
        d = Drawing(max(120.0, 8 + 6.5 * len(name)), 24, "fe-kernel-grid")
        d.text(4, 10, f"{name} {tuple(shape)} (empty)", FG, size=12, anchor="start")
        return d
    fr, fc = math.ceil(R / MAX_CELLS), math.ceil(C / MAX_CELLS)  # elements a square
    shown = np.zeros((math.ceil(R / fr), math.ceil(C / fc)), dtype=np.int8)
    rr, cc = np.indices(cells.shape)
    np.maximum.at(shown, (rr // fr, cc // fc), cells)
    Rd, Cd = shown.shape
    left, head = LEFT, HEAD
    title = f"{name} {tuple(shape)}" + (" shared" if op.space == "shared" else "")
    width = max(left + Cd * u + 8, 8 + 6.5 * len(title))
    d = Drawing(width, head + Rd * u + 4, "fe-kernel-grid")
    d.text(4, 10, title, FG, size=12, anchor="start", bold=True)
    if fr > 1 or fc > 1:
        d.text(4, 22, f"a square: {fr} x {fc} elements", FG_MUTED, size=9, anchor="start")
    real = np.zeros(shown.shape, dtype=bool)  # squares holding an element of the tensor
    real[max(0, -top) // fr:(rows - top - 1) // fr + 1, :(cols - 1) // fc + 1] = True
    thin = u < 6  # no borders on tiny squares: they would hide the colours
    for i in range(Rd):
        for j in range(Cd):
            state = int(shown[i, j])
            if not real[i, j] and state == UNTOUCHED:
                continue
            x, y = left + j * u, head + i * u
            d.rect(x, y, u, u, FILL[state], FILL[state] if thin and state else BORDER,
                   0.5, cls=f"cell {STATE_NAMES[state]}" + ("" if real[i, j] else " beyond"))
            if state == MASKED and u >= 8:
                d.line(x + 2, y + 2, x + u - 2, y + u - 2, "#8a8a8a")
                d.line(x + 2, y + u - 2, x + u - 2, y + 2, "#8a8a8a")
    # the tensor's outline; beyond it, a dashed outline of what is drawn "as if it went on"
    y0, y1 = head + (max(0, -top) // fr) * u, head + ((rows - top - 1) // fr + 1) * u
    x1 = left + ((cols - 1) // fc + 1) * u
    d.rect(left, y0, x1 - left, y1 - y0, "none", FG, 1.5)
    if top < 0 or R + top > rows or C > cols:
        d.rect(left, head, Cd * u, Rd * u, "none", FG_MUTED, 1.0, "3 3", cls="beyond-area")
    for r in sorted({0, rows - 1}):  # first and last row numbers on the left
        i = (r - top) // fr
        d.text(left - 3, head + (i + 0.5) * u, str(r), FG_MUTED, size=9, anchor="end")
    return d


def _legend(wrong: bool):
    return [(s, text) for s, text in LEGEND_TEXT if wrong or s != WRONG]


def _legend_html(unit: str, wrong: bool = False) -> str:
    def swatch(state):
        return (f"<span style='display:inline-block;width:12px;height:12px;"
                f"background:{FILL[state]};border:1px solid {BORDER};vertical-align:middle'>"
                "</span>")

    return ("<div class='fe-legend' style='font-size:12px'>"
            + " ".join(f"<span style='white-space:nowrap'>{swatch(s)} "
                       f"{text.format(unit=unit)}</span> &nbsp;" for s, text in _legend(wrong))
            + " &nbsp; dashed: where lanes point beyond the tensor</div>")


def _legend_drawing(unit: str, wrong: bool = False) -> Drawing:
    d = Drawing(660, 22)
    x = 4.0
    for state, text in _legend(wrong):
        text = text.format(unit=unit)
        d.rect(x, 5, 12, 12, FILL[state], BORDER)
        d.text(x + 16, 11, text, FG, size=11, anchor="start")
        x += 26 + 6.5 * len(text)
    return d
