"""BlockMaskEditor: click the tiles of a block-sparse mask and see what it buys.

A grid of toggle buttons, one per (Q tile, K/V tile) pair; presets (causal, sliding window,
strided, random, BigBird) fill it. Beside it: the density, the model's HBM traffic and
roofline speedup (:func:`flashedu.viz.block_sparse.predict`), and a button that runs the mask:
on a GPU the block-sparse Triton kernel against the dense one (do_bench), on a CPU a small
check of ``flashedu.attention`` (numpy backend, Triton interpreter) against the reference.
``block_mask`` is the current :class:`flashedu.BlockMask`.
"""

from __future__ import annotations

import html

import ipywidgets as W
import numpy as np

from .. import io, runtime
from ..masks import BlockMask
from . import block_sparse, presets
from .controls import set_quietly
from .render import kib

# ToggleButton has no colour style: a kept tile gets the class fe-on, coloured by this sheet.
TILE_CSS = ("<style>.fe-tile { background-color: #eeeeee; } "
            ".fe-tile.fe-on { background-color: #f28e2b !important; }</style>")
CAUSAL_PRESETS = {"causal", "sliding window", "strided"}


class BlockMaskEditor:
    """State: ``blocks`` (the (T, T) bool grid), ``block_mask``, ``density``, ``prediction``
    (the model's dict), ``results`` (the last run's numbers), ``buttons[i][j]``."""

    def __init__(self, tiles=8, block=64, preset="causal", d=64, gpu="H100 SXM5", model_N=8192):
        self.block, self.d, self.model_N = block, d, model_N
        self.results = None
        self._holding = False
        c = self.controls = {
            "tiles": W.Dropdown(options=[4, 6, 8, 12, 16], value=tiles, description="tiles",
                                layout=W.Layout(width="150px")),
            "preset": W.Dropdown(options=list(presets.PRESETS), value=preset,
                                 description="preset"),
            "window": W.IntSlider(1, min=1, max=6, description="window"),
            "stride": W.IntSlider(3, min=2, max=8, description="stride"),
            "density": W.FloatSlider(0.3, min=0.05, max=1.0, step=0.05, description="random p"),
            "seed": W.IntSlider(0, min=0, max=20, description="seed"),
            "causal": W.Checkbox(True, description="causal inside diagonal tiles", indent=False),
            "gpu": W.Dropdown(options=list(io.GPUS), value=gpu, description="model GPU"),
        }
        self.grid = W.GridBox(layout=W.Layout(grid_gap="2px"))
        self.info = W.HTML()
        self.run_button = W.Button(description="measure on GPU" if runtime.configure()["gpu"]
                                   else "check on CPU", button_style="info")
        self.run_button.on_click(lambda _: self.run())
        self.run_output = W.HTML()
        self.widget = W.VBox([
            W.HTML(TILE_CSS + "<b>Block-sparse mask</b>: click tiles (rows: Q tiles i, "
                   "columns: K/V tiles j; orange: computed, grey: skipped)"),
            W.HBox([c["tiles"], c["preset"], c["causal"]]),
            W.HBox([c["window"], c["stride"]]), W.HBox([c["density"], c["seed"]]),
            W.HBox([self.grid, W.VBox([c["gpu"], self.info],
                                      layout=W.Layout(margin="0 0 0 16px"))]),
            W.HBox([self.run_button]), self.run_output,
        ])
        self.widget.add_class("flashedu-mask-editor")
        c["tiles"].observe(lambda _: self._rebuild(), names="value")
        for name in ("preset", "window", "stride", "density", "seed"):
            c[name].observe(lambda _: None if self._holding else self.apply_preset(), names="value")
        for name in ("causal", "gpu"):
            c[name].observe(lambda _: self._update(), names="value")
        self._rebuild()

    # ----- public ------------------------------------------------------------------------
    @property
    def tiles(self) -> int:
        return self.controls["tiles"].value

    @property
    def blocks(self) -> np.ndarray:
        return np.array([[b.value for b in row] for row in self.buttons], dtype=bool)

    @property
    def block_mask(self) -> BlockMask:
        N = self.tiles * self.block
        return BlockMask.from_dense(self.blocks, (self.block, self.block), (N, N),
                                    is_causal=self.controls["causal"].value)

    @property
    def density(self) -> float:
        return self.block_mask.density

    def toggle(self, i: int, j: int) -> None:
        """Flip tile (i, j), as a click does."""
        self.buttons[i][j].value = not self.buttons[i][j].value

    def apply_preset(self, name: str | None = None, **knobs) -> None:
        """Fill the grid with a preset (the dropdown's, or ``name``); ``knobs`` set sliders."""
        chosen = [("preset", name)] if name is not None else []
        set_quietly(self, ((self.controls[k], v) for k, v in [*chosen, *knobs.items()]))
        name = self.controls["preset"].value
        N = self.tiles * self.block
        values = {k: self.controls[k].value for k in ("window", "stride", "density", "seed")}
        mask = presets.make(name, (N, N), (self.block, self.block), **values)
        self._set_blocks(mask.blocks[0, 0])
        self.controls["causal"].value = name in CAUSAL_PRESETS
        self._update()

    def run(self) -> dict | list:
        """Measure on the GPU, or check on the CPU; the numbers land in ``results``."""
        mask = self.block_mask
        self.run_output.value = "<i>running…</i>"
        try:
            if runtime.configure()["gpu"] and not runtime.triton_interpreted():
                self.results = block_sparse.gpu_bench(mask, N=self.model_N, d=self.d)
                self.run_output.value = _gpu_html(self.results)
            else:
                self.results = block_sparse.cpu_check(mask, d=32)
                self.run_output.value = _cpu_html(self.results, mask)
        except Exception as exc:  # noqa: BLE001 - shown to the learner, not swallowed
            self.results = {"error": f"{type(exc).__name__}: {exc}"}
            self.run_output.value = (f"<span class='fe-run' style='color:#c00'>failed: "
                                     f"{html.escape(self.results['error'])}</span>")
        return self.results

    # ----- internals --------------------------------------------------------------------
    def _rebuild(self):
        T = self.tiles
        self.buttons = [[W.ToggleButton(False, tooltip=f"tile (i={i}, j={j})",
                                        layout=W.Layout(width="30px", height="26px", padding="0"))
                         for j in range(T)] for i in range(T)]
        for i, row in enumerate(self.buttons):
            for j, b in enumerate(row):
                b.add_class("fe-tile")
                b.observe(self._on_toggle, names="value")
        self.grid.children = [b for row in self.buttons for b in row]
        self.grid.layout.grid_template_columns = f"repeat({T}, 30px)"
        self.apply_preset()

    def _set_blocks(self, blocks):
        set_quietly(self, ((b, bool(blocks[i, j])) for i, row in enumerate(self.buttons)
                           for j, b in enumerate(row)))

    def _on_toggle(self, change):
        (change.owner.add_class if change.new else change.owner.remove_class)("fe-on")
        if not self._holding:
            self._update()

    def _update(self):
        mask = self.block_mask
        big = block_sparse.scaled(mask, self.model_N)
        self.prediction = block_sparse.predict(big, self.d, self.controls["gpu"].value)
        p = self.prediction
        self.info.value = (
            f"density <b class='fe-density'>{mask.density:.3f}</b> "
            f"({int(mask.blocks.sum())} of {mask.blocks[0, 0].size} tiles)<br>"
            f"model, one head, N = {big.seq_lens[0]} (this pattern scaled), d = {self.d}, fp16:"
            f"<br>HBM traffic {kib(p['sparse_bytes'])} vs {kib(p['dense_bytes'])} dense"
            f"<br>roofline time {p['sparse_s'] * 1e6:.1f} µs vs {p['dense_s'] * 1e6:.1f} µs: "
            f"predicted speedup <b class='fe-speedup'>{p['speedup']:.2f}x</b>"
            "<br><small>(FlexAttention measured about (1.1 · density)x the dense time)</small>")

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def _gpu_html(r: dict) -> str:
    return (f"<span class='fe-run'>{html.escape(r['device'])}, N = {r['N']}, {r['heads']} heads, "
            f"d = {r['d']}, fp16, tiles of {r['block_size']}: block-sparse "
            f"<b>{r['sparse_ms']:.3f} ms</b> vs dense <b>{r['dense_ms']:.3f} ms</b>: measured "
            f"speedup <b>{r['speedup']:.2f}x</b> (max error vs reference {r['max_err']:.1e})</span>")


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
            f"(N = {mask.seq_lens[0]}, d = 32, float32):<br>" + "<br>".join(lines) + "</span>")
