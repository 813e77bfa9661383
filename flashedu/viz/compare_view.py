"""CompareView: a learner's traced kernel beside the reference, step by step.

Shows a :class:`flashedu.viz.learner_trace.TraceComparison`: it opens at the first step where
the two differ, draws the tile grid (blue: computed by both so far, orange outline: the
reference's tile at this step, red dashes: yours), lists the step's m_i, l_i, O_i side by side,
and charts one row's m_i and l_i over the steps with a cursor at the current one.
"""

from __future__ import annotations

import html
import math

import ipywidgets as W
import numpy as np

from . import static
from .charts import line_panel
from .drawing import Drawing
from .learner_trace import TraceComparison, _normalized
from .render import BORDER, COLORS, ERROR, FG, FG_MUTED, ON_TILE

OK = "var(--jp-success-color1, #2e7d32)"


class CompareView:
    """State: ``comparison``, ``step`` (1-based, the slider), ``row`` (the charted row)."""

    def __init__(self, comparison: TraceComparison):
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
        self.widget = W.VBox([
            W.HTML(static.HIDE_WHEN_LIVE + "<b>Your kernel beside the reference</b>, step by "
                   f"step ({c.order}, Br = {c.block_q}, Bc = {c.block_k}"
                   f"{', causal' if c.causal else ''})"),
            self.verdict,
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
        c = self.comparison
        notes = "".join(f"<br><small style='color:{FG_MUTED}'>{html.escape(n)}</small>"
                        for n in c.notes)
        if c.first_divergence is None:
            return (f"<span class='fe-verdict' style='color:{OK}'>✓ your trace agrees with the "
                    f"reference at all {len(c.reference_steps)} steps and at the end</span>{notes}")
        return (f"<span class='fe-verdict' style='color:{ERROR}'>✗ first divergence: "
                f"{html.escape(str(c.first_divergence))}</span>{notes}")

    # ----- drawing ---------------------------------------------------------------------------
    def _grid_drawing(self, k: int) -> Drawing:
        c = self.comparison
        Br, Bc = c.block_q, c.block_k
        Tr, Tc = math.ceil(c.Q.shape[0] / Br), math.ceil(c.K.shape[0] / Bc)
        u = max(16.0, min(36.0, 300 / max(Tr, Tc)))
        d = Drawing(Tc * u + 60, Tr * u + 46, "fe-compare-grid")
        x0, y0 = 40.0, 30.0
        d.text(x0 + Tc * u / 2, 10, "K/V tile j", FG, size=11)
        d.text(14, y0 + Tr * u / 2, "i", FG, size=11)
        ref_pairs = [s.pair(Br, Bc) for s in c.reference_steps]
        mine_pairs = [s.pair(Br, Bc) for s in c.steps]
        done_ref, done_mine = set(ref_pairs[:k - 1]), set(mine_pairs[:k - 1])
        for i in range(Tr):
            for j in range(Tc):
                if (i, j) not in ref_pairs:
                    fill = COLORS["skipped"]
                elif (i, j) in done_ref and (i, j) in done_mine:
                    fill = COLORS["done"]
                else:
                    fill = "var(--jp-layout-color0, #ffffff)"
                d.rect(x0 + j * u, y0 + i * u, u, u, fill, BORDER, 1.0, cls="tile",
                       data=f" data-name='S{i},{j}'")
        if k <= len(ref_pairs):
            i, j = ref_pairs[k - 1]
            d.rect(x0 + j * u + 1, y0 + i * u + 1, u - 2, u - 2, COLORS["sram"], ON_TILE, 2.0,
                   cls="tile ref-now")
            d.text(x0 + (j + 0.5) * u, y0 + (i + 0.5) * u, "ref", ON_TILE, size=min(10, u / 3))
        if k <= len(mine_pairs):
            i, j = mine_pairs[k - 1]
            d.rect(x0 + j * u + 4, y0 + i * u + 4, u - 8, u - 8, "none", COLORS["cursor"], 2.5,
                   "4 2", cls="tile mine-now")
        d.text(x0, y0 + Tr * u + 12, "orange: the reference's tile now; red dashes: yours",
               FG_MUTED, size=10, anchor="start")
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
        if mine is not None and ref is not None and mine.q == ref.q and mine.state is not None:
            for name, a, b in (("m_i", mine.state["m"], ref.state["m"]),
                               ("l_i", mine.state["l"], ref.state["l"]),
                               ("O_i / l_i", _normalized(mine.state), _normalized(ref.state))):
                with np.errstate(invalid="ignore"):
                    diff = np.abs(np.asarray(a, float) - np.asarray(b, float))
                same = np.isclose(a, b, rtol=2e-4, atol=2e-5) | (np.isneginf(a) & np.isneginf(b))
                worst = float(np.nanmax(np.where(same, 0, np.nan_to_num(diff, nan=np.inf))))
                color = OK if same.all() else ERROR
                rows.append(f"<tr><td>{name}</td><td colspan=2 style='color:{color}'>"
                            f"{'same' if same.all() else f'differ: largest gap {worst:.3g}'} "
                            f"(rows {mine.q[0]}..{mine.q[1] - 1})</td></tr>")
        elif mine is not None and mine.state is None:
            rows.append("<tr><td colspan=3>your m_i, l_i, O_i were not found at this step"
                        "</td></tr>")
        return ("<table class='fe-compare-table' style='margin-left:12px'><tr><th></th>"
                "<th>reference</th><th>yours</th></tr>" + "".join(rows) + "</table>")

    def _series(self, steps, row: int):
        m, l = [np.nan], [np.nan]  # position 0: before the first step
        for s in steps:
            mm, ll = m[-1], l[-1]
            if s.state is not None and s.q[0] <= row < s.q[1] and len(s.state["m"]) > row - s.q[0]:
                mm, ll = float(s.state["m"][row - s.q[0]]), float(s.state["l"][row - s.q[0]])
            m.append(mm), l.append(ll)
        pad = self.n + 1 - len(m)
        return np.array(m + [np.nan] * pad), np.array(l + [np.nan] * pad)

    def _show(self) -> None:
        k, c, row = self.step, self.comparison, self.row_box.value
        self.grid.value = self._grid_drawing(k).svg()
        self.table.value = (f"<div class='fe-compare-status'>step {k} of {self.n}</div>"
                            + self._table_html(k))
        ref_m, ref_l = self._series(c.reference_steps, row)
        my_m, my_l = self._series(c.steps, row)
        panels = [line_panel([("reference", ref_m, COLORS["m"], False),
                              ("yours", my_m, COLORS["cursor"], True)], k,
                             f"row {row}: m_i after each step", self.n, steps=True),
                  line_panel([("reference", ref_l, COLORS["l"], False),
                              ("yours", my_l, COLORS["cursor"], True)], k,
                             f"row {row}: l_i after each step", self.n, steps=True)]
        self.charts.value = "".join(f"<div style='display:inline-block;margin-right:8px'>"
                                    f"{p.svg()}</div>" for p in panels)

    def static_png(self) -> bytes:
        return static.stack_png([self._grid_drawing(self.step)],
                                str(self.comparison.first_divergence or "the traces agree"))

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self):
        static.display_with_fallback(self)

