"""CompareView: a learner's traced kernel beside the reference, step by step.

Shows a :class:`flashedu.viz.learner_trace.TraceComparison`: the verdict first (the learner's
exception and the line of their code that raised it, if any), then it opens at the first step
where the two differ, draws the tile grid (blue: computed by both so far, orange: the
reference's tile at this step, red dashes: yours), says for the step's m_i, l_i, O_i which rows
differ and how, and charts one row's m_i, l_i and a column of O_i / l_i over the steps with a
cursor at the current one (-inf and NaN marked on the chart's edge).
"""

from __future__ import annotations

import html
import math
import textwrap

import ipywidgets as W
import numpy as np

from . import static
from .charts import line_panel
from .drawing import Drawing
from .trace_states import (_normalized, _ranges, _values, gap_text, row_differences,
                           state_series)
from .render import BORDER, COLORS, ERROR, FG, FG_MUTED, OK, ON_TILE

class CompareView:
    """State: ``comparison``, ``step`` (1-based, the slider), ``row`` (the charted row)."""

    def __init__(self, comparison):
        self.comparison = c = comparison
        self.n = max(len(c.steps), len(c.reference_steps), 1)
        div = c.first_divergence
        start = min(div.step, self.n) if div is not None else 1
        row = div.rows[0] if div is not None and div.rows else 0
        self.verdict = W.HTML(self._verdict_html())
        self.slider = W.IntSlider(start, min=1, max=self.n, description="step",
                                  layout=W.Layout(flex="1 1 260px", min_width="220px",
                                                  max_width="480px"))
        self.row_box = W.BoundedIntText(row, min=0, max=c.Q.shape[0] - 1, description="row",
                                        layout=W.Layout(width="150px"))
        self.back_button = W.Button(description="◀ back", layout=W.Layout(width="80px"))
        self.step_button = W.Button(description="step ▶", layout=W.Layout(width="80px"))
        self.back_button.on_click(lambda _: self._move(-1))
        self.step_button.on_click(lambda _: self._move(1))
        self.grid = W.HTML()
        self.table = W.HTML()
        self.charts = W.HTML()
        self.chart_data: dict = {}  # what the charts draw: name -> (reference, yours)
        self.widget = W.VBox([
            self.verdict,  # first: the learner's exception, else the first difference
            W.HTML(static.HIDE_WHEN_LIVE + "<b>Your kernel beside the reference</b>, step by "
                   f"step ({c.order}, Br = {c.block_q}, Bc = {c.block_k}"
                   f"{', causal' if c.causal else ''})"),
            W.HBox([self.back_button, self.step_button, self.slider, self.row_box],
                   layout=W.Layout(flex_flow="row wrap", align_items="center",
                                   max_width="100%")),
            W.HBox([self.grid, self.table], layout=W.Layout(flex_flow="row wrap",
                                                            max_width="100%")),
            self.charts,
        ], layout=W.Layout(max_width="100%", overflow="hidden"))
        self.widget.add_class("flashedu-compare")
        self.widget.add_class("flashedu-live")
        self.slider.observe(lambda _: self._show(), names="value")
        self.row_box.observe(lambda _: self._show(), names="value")
        self._show()

    @property
    def step(self) -> int:
        return self.slider.value

    def _move(self, delta: int) -> None:
        self.slider.value = max(1, min(self.n, self.slider.value + delta))

    def _verdict_html(self) -> str:
        return verdict_html(self.comparison)

    # ----- drawing ---------------------------------------------------------------------------
    def _grid_drawing(self, k: int) -> Drawing:
        c = self.comparison
        Br, Bc = c.block_q, c.block_k
        Tr, Tc = math.ceil(c.Q.shape[0] / Br), math.ceil(c.K.shape[0] / Bc)
        u = max(16.0, min(36.0, 300 / max(Tr, Tc)))
        legend = ("orange: the reference's tile now", "red dashes: yours",
                  "red rows: where yours first differ")
        width = max(Tc * u + 60, 8 + max(len(t) for t in legend) * 6.0)  # 6 px a character
        d = Drawing(width, Tr * u + 74, "fe-compare-grid")
        x0, y0 = 40.0, 30.0
        d.text(x0 + Tc * u / 2, 10, "K/V tile j", FG, size=11)
        d.text(14, y0 + Tr * u / 2, "i", FG, size=11)
        ref_pairs = [s.pair(Br, Bc) for s in c.reference_steps]
        mine_pairs = [s.pair(Br, Bc) for s in c.steps]
        done_ref, done_mine = set(ref_pairs[:k - 1]), set(mine_pairs[:k - 1])
        Nq, Nk = c.Q.shape[0], c.K.shape[0]

        def h(i):  # tiles as they are: the last of a ragged edge is shorter
            return u * (min((i + 1) * Br, Nq) - i * Br) / Br

        def w(j):
            return u * (min((j + 1) * Bc, Nk) - j * Bc) / Bc

        for i in range(Tr):
            for j in range(Tc):
                if (i, j) not in ref_pairs:
                    fill = COLORS["skipped"]
                elif (i, j) in done_ref and (i, j) in done_mine:
                    fill = COLORS["done"]
                else:
                    fill = "var(--jp-layout-color0, #ffffff)"
                d.rect(x0 + j * u, y0 + i * u, w(j), h(i), fill, BORDER, 1.0, cls="tile",
                       data=f" data-name='S{i},{j}'")
        if k <= len(ref_pairs):
            i, j = ref_pairs[k - 1]
            d.rect(x0 + j * u + 1, y0 + i * u + 1, w(j) - 2, h(i) - 2, COLORS["sram"], ON_TILE,
                   2.0, cls="tile ref-now")
            d.text(x0 + j * u + w(j) / 2, y0 + i * u + h(i) / 2, "ref", ON_TILE,
                   size=min(10, u / 3))
            div = c.first_divergence
            if div is not None and k == div.step:  # the rows that differ, inside the tile
                for r in div.rows:
                    if i * Br <= r < (i + 1) * Br:
                        d.rect(x0 + j * u, y0 + i * u + (r - i * Br) * u / Br, w(j),
                               max(u / Br, 2.0), COLORS["cursor"], "none", 0,
                               cls="row-differs", opacity=0.75)
        if k <= len(mine_pairs):
            i, j = mine_pairs[k - 1]
            d.rect(x0 + j * u + 4, y0 + i * u + 4, max(w(j) - 8, 2), max(h(i) - 8, 2), "none",
                   COLORS["cursor"], 2.5, "4 2", cls="tile mine-now")
        for n, line in enumerate(legend):  # one line each: whole at any number of tiles
            d.text(4, y0 + Tr * u + 12 + 14 * n, line, FG_MUTED, size=10, anchor="start")
        return d

    def _table_html(self, k: int) -> str:
        c = self.comparison
        Br, Bc = c.block_q, c.block_k
        mine = c.steps[k - 1] if k <= len(c.steps) else None
        ref = c.reference_steps[k - 1] if k <= len(c.reference_steps) else None

        def pair(s):
            if s is None:
                return "(none)"
            i, j = s.pair(Br, Bc)
            return f"({i}, {j}): Q rows {s.q[0]}..{s.q[1] - 1}, K/V rows {s.k[0]}..{s.k[1] - 1}"

        rows = [f"<tr><td>tile pair</td><td>{pair(ref)}</td><td>{pair(mine)}</td></tr>"]
        error = c.error
        if error is not None and mine is not None and k == error.step:
            rows.append(f"<tr><td colspan=3 style='color:{ERROR}'>your function raised "
                        f"{html.escape(error.type)} during this step: its m_i, l_i, O_i are "
                        "not compared</td></tr>")
        elif mine is not None and ref is not None and mine.q == ref.q and mine.state is not None:
            tile = f"{mine.q[0]}..{mine.q[1] - 1}"
            for name, bad in row_differences(mine.state, ref.state).items():
                label = "O_i / l_i" if name == "O_i" else name
                if not bad.any():
                    rows.append(f"<tr><td>{label}</td><td colspan=2 style='color:{OK}'>same in "
                                f"rows {tile}</td></tr>")
                    continue
                differ = _ranges(np.arange(*mine.q)[bad])
                gap = gap_text(_values(mine.state, name), _values(ref.state, name), bad,
                               mine.q[0])
                rows.append(f"<tr><td>{label}</td><td colspan=2 style='color:{ERROR}'>rows "
                            f"{differ} differ (of {tile}): {html.escape(gap)}</td></tr>")
            if "O" not in mine.state:
                rows.append("<tr><td>O_i</td><td colspan=2>not found at this step</td></tr>")
        elif mine is not None and mine.state is None:
            rows.append("<tr><td colspan=3>your m_i, l_i, O_i were not found at this step"
                        "</td></tr>")
        return ("<table class='fe-compare-table' style='margin-left:12px'><tr><th></th>"
                "<th>reference</th><th>yours</th></tr>" + "".join(rows) + "</table>")

    def _series(self, steps, row: int, column: int):
        c = self.comparison
        skip = c.error.step if c.error is not None and steps is c.steps else None
        return state_series(steps, row, column, self.n, skip)

    def _column(self, row: int) -> int:
        """The column of O_i / l_i to chart: where yours is farthest from the reference (or
        non-finite) at some step, else 0."""
        c = self.comparison
        best, column = 0.0, 0
        for a, b in zip(c.steps, c.reference_steps):
            if a.state is None or "O" not in a.state or a.q != b.q or not a.q[0] <= row < a.q[1]:
                continue
            r = row - a.q[0]
            gap = np.abs(_normalized(a.state)[r] - _normalized(b.state)[r])
            gap = np.where(np.isfinite(gap), gap, np.inf)
            if gap.max() > best:
                best, column = float(gap.max()), int(np.argmax(gap))
        return column

    def _show(self) -> None:
        k, c, row = self.step, self.comparison, self.row_box.value
        self.grid.value = self._grid_drawing(k).svg()
        with np.errstate(all="ignore"):  # -inf and NaN of the learner are shown, not warned
            self.table.value = (f"<div class='fe-compare-status'>step {k} of {self.n}</div>"
                                + self._table_html(k))
            column = self._column(row)
            ref_m, ref_l, ref_o, ref_known, ref_known_o = self._series(c.reference_steps, row,
                                                                       column)
            my_m, my_l, my_o, my_known, my_known_o = self._series(c.steps, row, column)
        self.chart_data = {"m_i": (ref_m, my_m), "l_i": (ref_l, my_l),
                           "O_i": (ref_o, my_o), "O_i column": column}
        panels = [line_panel([("reference", ref_m, COLORS["m"], False, ref_known),
                              ("yours", my_m, COLORS["cursor"], True, my_known)], k,
                             f"row {row}: m_i after each step", self.n, steps=True),
                  line_panel([("reference", ref_l, COLORS["l"], False, ref_known),
                              ("yours", my_l, COLORS["cursor"], True, my_known)], k,
                             f"row {row}: l_i after each step", self.n, steps=True),
                  line_panel([("reference", ref_o, COLORS["read"], False, ref_known_o),
                              ("yours", my_o, COLORS["cursor"], True, my_known_o)], k,
                             f"row {row}: O_i / l_i, column {column}", self.n, steps=True,
                             cls="fe-o-chart")]
        self.charts.value = "".join(f"<div style='display:inline-block;margin-right:8px'>"
                                    f"{p.svg()}</div>" for p in panels)

    def static_png(self) -> bytes:
        title = textwrap.shorten(self.comparison.headline, 160, placeholder=" ...")
        return static.stack_png([self._grid_drawing(self.step)], title)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self):
        static.display_with_fallback(self)


def verdict_html(c) -> str:
    """The comparison's verdict as HTML: the learner's exception and its line first, else the
    first difference, else what agrees; then what was not compared."""
    notes = "".join(f"<br>{html.escape(n)}" for n in c.notes)
    div = c.first_divergence
    if div is None:
        return (f"<div class='fe-verdict'><span style='color:{OK}'>✓ "
                f"{html.escape(c.headline)}</span>{notes}</div>")
    if c.error is not None:
        e = c.error
        rest = str(div)[len(str(e)):].strip()
        source = (f"<pre style='margin:2px 0 2px 12px;white-space:pre-wrap'>"
                  f"{html.escape(e.source)}</pre>" if e.source else "<br>")
        return (f"<div class='fe-verdict'><span style='color:{ERROR}'>✗ your function "
                f"raised <b>{html.escape(e.type)}</b>: {html.escape(e.message)}</span>"
                f"<br>at {html.escape(e.where)}:{source}{html.escape(rest)}{notes}</div>")
    return (f"<div class='fe-verdict'><span style='color:{ERROR}'>✗ first divergence: "
            f"{html.escape(str(div))}</span>{notes}</div>")
