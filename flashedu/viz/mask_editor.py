"""BlockMaskEditor: click the tiles of a block-sparse mask and see what it buys.

A grid of toggle buttons, one per (Q tile, K/V tile) pair; presets (causal, sliding window,
strided, random, BigBird) fill it. Beside it: the density, the model's HBM traffic and
roofline speedup (:func:`flashedu.viz.block_sparse.predict`), and a button that runs the mask:
on a GPU the block-sparse Triton kernel against the dense one (do_bench), on a CPU a small
check of ``flashedu.attention`` (numpy backend, Triton interpreter) against the reference.

Everything shown is derived from one mask, :attr:`BlockMaskEditor.block_mask`: with "causal
inside diagonal tiles" a kept tile that lies wholly above the diagonal is skipped by the kernel,
so it is drawn striped (not blue), and the density, traffic and speedup all count it as skipped.
The mask is published on :attr:`state` (a :class:`flashedu.viz.state.SharedMask`) for the
widgets that follow it, with the settings the model uses (N, d, dtype, GPU): a linked widget
that changes one changes it here too. Tiles the learner clicked stay clicked when a preset's
slider moves; a new preset or grid size starts from the preset. The causal box is set by a
preset until the learner ticks or unticks it; from then on no control changes it. A result of
"check"/"measure" is marked stale as soon as the mask changes, and its note is redrawn at
every change.
"""

from __future__ import annotations

import html

import ipywidgets as W
import numpy as np

from .. import io, runtime
from ..masks import BlockMask
from . import block_sparse, presets, static
from .controls import set_quietly
from .drawing import Drawing
from .render import BORDER, COLORS, FG, FG_MUTED, WARN, error_html, kib
from .state import SharedMask

# ToggleButton has no colour style: a tile's class picks its colour from this sheet, in the
# palette every widget uses (blue: computed, grey: skipped).
TILE_CSS = (
    "<style>.fe-tile { background-color: " + COLORS["skipped"] + " !important; color: #1f1f1f; }"
    " .fe-tile.fe-on { background-color: " + COLORS["done"] + " !important; }"
    " .fe-tile.fe-causal-skip { background: repeating-linear-gradient(45deg, "
    + COLORS["done"] + " 0 3px, " + COLORS["skipped"] + " 3px 7px) !important; }"
    " .fe-stale { opacity: 0.55; }</style>")
CAUSAL_PRESETS = {"causal", "sliding window", "strided"}
KNOBS = {"window": {"sliding window", "strided", "BigBird"}, "stride": {"strided"},
         "density": {"random"}, "seed": {"random", "BigBird"}}


class BlockMaskEditor:
    """State: ``blocks`` (the (T, T) bool grid of kept tiles, as clicked), ``block_mask`` (what
    the kernel computes: kept tiles, less those above the diagonal when causal), ``density``,
    ``prediction`` (the model's dict), ``results`` (the last run's numbers) and
    ``results_stale`` (the mask changed since), ``clicked`` ((i, j) -> value the learner set,
    only tiles that differ from the preset), ``causal_choice`` (None, or the learner's own
    tick of the causal box), ``buttons[i][j]``, ``state`` (the shared mask and settings)."""

    def __init__(self, tiles=8, block=64, preset="causal", d=64, gpu="H100 SXM5", model_N=8192,
                 state=None, dtype="float16"):
        self.block, self.d, self.model_N, self.dtype = block, d, model_N, dtype
        self.results, self.results_stale, self._results_mask = None, False, None
        self.clicked: dict[tuple[int, int], bool] = {}
        self.causal_choice: bool | None = None
        self.state = state if state is not None else SharedMask()
        self.state.update(N=model_N, d=d, dtype=dtype, gpu=gpu)
        self._holding = False
        c = self.controls = {
            "tiles": W.Dropdown(options=[4, 6, 8, 12, 16], value=tiles, description="tiles",
                                layout=W.Layout(width="150px")),
            "preset": W.Dropdown(options=list(presets.PRESETS), value=preset,
                                 description="preset", layout=W.Layout(width="240px")),
            "window": W.IntSlider(1, min=1, max=6, description="window", layout=_slider()),
            "stride": W.IntSlider(3, min=2, max=8, description="stride", layout=_slider()),
            "density": W.FloatSlider(0.3, min=0.05, max=1.0, step=0.05, description="random p",
                                     layout=_slider()),
            "seed": W.IntSlider(0, min=0, max=20, description="seed", layout=_slider()),
            "causal": W.Checkbox(True, description="causal inside diagonal tiles", indent=False,
                                 layout=W.Layout(width="auto")),
            "gpu": W.Dropdown(options=list(io.GPUS), value=gpu, description="model GPU",
                              layout=W.Layout(width="260px")),
        }
        self.grid = W.GridBox(layout=W.Layout(grid_gap="2px"))
        self.info = W.HTML(layout=W.Layout(max_width="100%"))
        self.clicks_note = W.HTML()
        self.run_button = W.Button(description="measure on GPU" if runtime.configure()["gpu"]
                                   else "check on CPU", button_style="info")
        self.run_button.on_click(lambda _: self.run())
        self.run_output = W.HTML()
        wrap = dict(flex_flow="row wrap", align_items="center", max_width="100%")
        self.widget = W.VBox([
            W.HTML(TILE_CSS + static.HIDE_WHEN_LIVE
                   + "<b>Block-sparse mask</b>: click tiles (rows: Q tiles i, columns: K/V tiles"
                   " j; blue: computed, grey: skipped, striped: kept but wholly above the causal"
                   " diagonal, so skipped)"),
            W.HBox([c["tiles"], c["preset"], c["causal"]], layout=W.Layout(**wrap)),
            W.HBox([c["window"], c["stride"], c["density"], c["seed"]], layout=W.Layout(**wrap)),
            self.clicks_note,
            W.HBox([self.grid, W.VBox([c["gpu"], self.info],
                                      layout=W.Layout(margin="0 0 0 16px", flex="1 1 260px"))],
                   layout=W.Layout(**wrap)),
            W.HBox([self.run_button]), self.run_output,
        ], layout=W.Layout(max_width="100%", overflow="hidden"))
        self.widget.add_class("flashedu-mask-editor")
        self.widget.add_class("flashedu-live")
        c["tiles"].observe(lambda _: None if self._holding else self._rebuild(), names="value")
        c["preset"].observe(lambda _: None if self._holding else self._new_preset(),
                            names="value")
        for name in KNOBS:
            c[name].observe(lambda _: None if self._holding else self.apply_preset(),
                            names="value")
        c["causal"].observe(self._on_causal, names="value")
        c["gpu"].observe(lambda ch: None if self._holding else self.state.update(gpu=ch.new),
                         names="value")
        self.state.follow_settings(self._follow_settings)
        self._rebuild()

    # ----- public ------------------------------------------------------------------------
    @property
    def tiles(self) -> int:
        return self.controls["tiles"].value

    @property
    def blocks(self) -> np.ndarray:
        """The kept tiles, as the grid shows them (before the causal flag skips any)."""
        return np.array([[b.value for b in row] for row in self.buttons], dtype=bool)

    @property
    def causal_skipped(self) -> np.ndarray:
        """Kept tiles that the causal flag skips: every query of the tile is before every key."""
        T = self.tiles
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        return self.blocks & (j > i) if self.controls["causal"].value else np.zeros((T, T), bool)

    @property
    def block_mask(self) -> BlockMask:
        """The mask the kernel runs: kept tiles less the causally skipped ones."""
        N = self.tiles * self.block
        return BlockMask.from_dense(self.blocks & ~self.causal_skipped, (self.block, self.block),
                                    (N, N), is_causal=self.controls["causal"].value)

    @property
    def density(self) -> float:
        return self.block_mask.density

    def toggle(self, i: int, j: int) -> None:
        """Flip tile (i, j), as a click does."""
        self.buttons[i][j].value = not self.buttons[i][j].value

    def apply_preset(self, name: str | None = None, **knobs) -> None:
        """Fill the grid with a preset (the dropdown's, or ``name``); ``knobs`` set sliders.
        The learner's clicked tiles are kept on top of it; a new ``name`` clears them."""
        if name is not None and name != self.controls["preset"].value:
            self.clicked.clear()
        chosen = [("preset", name)] if name is not None else []
        set_quietly(self, ((self.controls[k], v) for k, v in [*chosen, *knobs.items()]))
        name = self.controls["preset"].value
        N = self.tiles * self.block
        values = {k: self.controls[k].value for k in KNOBS}
        blocks = presets.make(name, (N, N), (self.block, self.block), **values).blocks[0, 0].copy()
        self._preset_blocks = blocks.copy()
        for (i, j), value in self.clicked.items():
            blocks[i, j] = value
        self._set_blocks(blocks)
        causal = name in CAUSAL_PRESETS if self.causal_choice is None else self.causal_choice
        set_quietly(self, [(self.controls["causal"], causal)])
        for knob, users in KNOBS.items():
            self.controls[knob].disabled = name not in users
        self._update()

    def clear_clicks(self) -> None:
        """Forget the clicked tiles: back to the preset."""
        self.clicked.clear()
        self.apply_preset()

    def run(self) -> dict | list:
        """Measure on the GPU, or check on the CPU; the numbers land in ``results``."""
        mask = self.block_mask
        self.run_output.value = "<i>running…</i>"
        try:
            if runtime.configure()["gpu"] and not runtime.triton_interpreted():
                self.results = block_sparse.gpu_bench(mask, N=self.model_N, d=self.d)
                self._run_html = _gpu_html(self.results)
            else:
                self.results = block_sparse.cpu_check(mask, d=32)
                self._run_html = _cpu_html(self.results, mask)
        except Exception as exc:  # noqa: BLE001 - shown to the learner, not swallowed
            self.results = {"error": f"{type(exc).__name__}: {exc}"}
            self._run_html = (f"<span class='fe-run'>"
                              f"{error_html('failed: ' + html.escape(self.results['error']))}"
                              "</span>")
        self._results_mask, self.results_stale = mask, False
        self.run_output.value = self._run_html
        return self.results

    def static_png(self) -> bytes:
        return static.stack_png([self._grid_drawing()],
                                f"block mask, {self.tiles} x {self.tiles} tiles of {self.block}: "
                                f"density {self.density:.3f}, predicted speedup "
                                f"{self.prediction['speedup']:.2f}x")

    # ----- internals --------------------------------------------------------------------
    def _rebuild(self):
        T = self.tiles
        self.clicked.clear()
        self.buttons = [[W.ToggleButton(False, tooltip=f"tile (i={i}, j={j})",
                                        layout=W.Layout(width="30px", height="26px", padding="0"))
                         for j in range(T)] for i in range(T)]
        for i, row in enumerate(self.buttons):
            for j, b in enumerate(row):
                b.add_class("fe-tile")
                b._fe_ij = (i, j)
                b.observe(self._on_toggle, names="value")
        self.grid.children = [b for row in self.buttons for b in row]
        self.grid.layout.grid_template_columns = f"repeat({T}, 30px)"
        self.apply_preset()

    def _new_preset(self):
        self.clicked.clear()
        self.apply_preset()

    def _set_blocks(self, blocks):
        set_quietly(self, ((b, bool(blocks[i, j])) for i, row in enumerate(self.buttons)
                           for j, b in enumerate(row)))

    def _on_toggle(self, change):
        if not self._holding:
            i, j = change.owner._fe_ij
            if bool(change.new) == self._preset_blocks[i, j]:
                self.clicked.pop((i, j), None)  # toggled back: no longer a change
            else:
                self.clicked[(i, j)] = bool(change.new)
            self._update()

    def _on_causal(self, change):
        if not self._holding:
            self.causal_choice = bool(change.new)
            self._update()

    def _follow_settings(self, settings):
        self.model_N, self.d, self.dtype = settings["N"], settings["d"], settings["dtype"]
        if settings["gpu"] != self.controls["gpu"].value:
            set_quietly(self, [(self.controls["gpu"], settings["gpu"])])
        if hasattr(self, "prediction"):
            self._update()

    @property
    def clicked_count(self) -> int:
        """Tiles whose state differs from the preset's (a tile toggled back does not count)."""
        preset = self._preset_blocks
        return sum(value != preset[i, j] for (i, j), value in self.clicked.items())

    def _paint(self):
        skipped = self.causal_skipped
        for i, row in enumerate(self.buttons):
            for j, b in enumerate(row):
                kind = ("fe-causal-skip" if skipped[i, j] else "fe-on") if b.value else None
                for cls in ("fe-on", "fe-causal-skip"):
                    if cls == kind and cls not in b._dom_classes:
                        b.add_class(cls)
                    elif cls != kind and cls in b._dom_classes:
                        b.remove_class(cls)
                b.tooltip = (f"tile (i={i}, j={j}): "
                             + ("computed" if kind == "fe-on" else
                                "kept, but wholly above the causal diagonal: skipped"
                                if kind else "skipped"))

    def _update(self):
        self._paint()
        mask = self.block_mask
        big = block_sparse.scaled(mask, self.model_N)
        self.prediction = block_sparse.predict(big, self.d, self.controls["gpu"].value, self.dtype)
        p = self.prediction
        n_causal = int(self.causal_skipped.sum())
        causal_note = (f"; {n_causal} kept tile(s) wholly above the diagonal skipped by causal"
                       if n_causal else "")
        self.info.value = (
            f"density <b class='fe-density'>{mask.density:.3f}</b> "
            f"({int(mask.blocks.sum())} of {mask.blocks[0, 0].size} tiles computed"
            f"{causal_note})<br>"
            f"model, one head, N = {big.seq_lens[0]} (this pattern scaled: tiles of "
            f"{big.block_size[0]} x {big.block_size[1]}), d = {self.d}, {self.dtype}:"
            f"<br>HBM traffic <span class='fe-traffic'>{kib(p['sparse_bytes'])}</span> vs "
            f"{kib(p['dense_bytes'])} dense"
            f"<br>roofline time {p['sparse_s'] * 1e6:.1f} µs vs {p['dense_s'] * 1e6:.1f} µs: "
            f"predicted speedup <b class='fe-speedup'>{p['speedup']:.2f}x</b>"
            "<br><small>(FlexAttention measured about (1.1 · density)x the dense time)</small>")
        preset_causal = self.controls["preset"].value in CAUSAL_PRESETS
        if self.causal_choice is not None and self.causal_choice != preset_causal:
            self.info.value += (
                f"<br><small class='fe-causal-choice' style='color:{FG_MUTED}'>causal "
                f"{'on' if self.causal_choice else 'off'}: your choice (this preset has it "
                f"{'on' if preset_causal else 'off'}); presets and sliders leave it as you set it"
                "</small>")
        n_clicked = self.clicked_count
        self.clicks_note.value = (
            f"<small class='fe-clicks' style='color:{FG_MUTED}'>{n_clicked} tile(s) "
            "clicked (differ from the preset): kept when a slider moves; a new preset or grid size clears "
            "them</small>" if n_clicked else "")
        if self._results_mask is not None and mask != self._results_mask:
            self.results_stale = True  # the note is redrawn at every change: its numbers are now's
            self.run_output.value = (
                f"<div class='fe-stale-note' style='color:{WARN}'>stale: this result is for the "
                f"previous mask (density {self._results_mask.density:.3f}, now "
                f"{mask.density:.3f}); press the button to run this one</div>"
                f"<div class='fe-stale'>{self._run_html}</div>")
        elif self._results_mask is not None and self.results_stale and mask == self._results_mask:
            self.results_stale = False  # edited back to the mask that was run
            self.run_output.value = self._run_html
        self.state.set(mask)
        static.update(self)

    def _grid_drawing(self) -> Drawing:
        T, u = self.tiles, 22.0
        d = Drawing(T * u + 40, T * u + 30, "fe-mask-grid")
        skipped = self.causal_skipped
        d.text(40 + T * u / 2, 10, "K/V tile j →", FG, size=10)
        d.text(18, 30 + T * u / 2, "i", FG, size=10)
        for i, row in enumerate(self.buttons):
            for j, b in enumerate(row):
                fill = (COLORS["done"] if b.value and not skipped[i, j] else COLORS["skipped"])
                d.rect(40 + j * u, 22 + i * u, u - 2, u - 2, fill, BORDER, 1.0,
                       "3 2" if b.value and skipped[i, j] else "")
        return d

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self):
        static.display_with_fallback(self)


def _slider():
    return W.Layout(width="auto", flex="1 1 280px", min_width="220px", max_width="360px")


def _gpu_html(r: dict) -> str:
    return (f"<span class='fe-run'>{html.escape(r['device'])}, N = {r['N']}, {r['heads']} heads, "
            f"d = {r['d']}, fp16, tiles of {r['block_size']}: block-sparse "
            f"<b>{r['sparse_ms']:.3f} ms</b> vs dense <b>{r['dense_ms']:.3f} ms</b>: measured "
            f"speedup <b>{r['speedup']:.2f}x</b> (max error vs reference {r['max_err']:.1e})"
            "</span>")


def _cpu_html(results: list, mask: BlockMask) -> str:
    lines = []
    for r in results:
        if r["ok"] is None:
            lines.append(f"{r['backend']}: {html.escape(r['note'])}")
        else:
            verdict = "matches" if r["ok"] else "DIFFERS FROM"
            # no time shown: on a CPU it would time the interpreter, not the kernel
            lines.append(f"{r['backend']}: {verdict} the float64 reference (max error "
                         f"{r['max_err']:.1e})")
    return (f"<span class='fe-run'>no GPU: checked flashedu.attention with this mask on CPU "
            f"(N = {mask.seq_lens[0]}, d = 32, float32, density {mask.density:.3f}):<br>"
            + "<br>".join(lines) + "</span>")
