"""TileLoopStepper: step, play or scrub through the (i, j) loop of a real traced run.

Every change of a control re-runs :func:`flashedu.tiled.flash_forward` with a fresh
:class:`flashedu.trace.Trace` on random Q, K, V; the picture and the counters are read from that
trace (through :mod:`flashedu.viz.timeline`), so at the last position the byte counters equal
:func:`flashedu.io.flash_forward_hbm_bytes`, the formula the IO tests check against the trace.

Made with ``fn=`` the stepper runs the learner's own NumPy ``flash_forward(Q, K, V, Br, Bc[,
causal])`` instead (traced by :func:`flashedu.viz.compare_trace`, laid out as a Trace by
:mod:`flashedu.viz.learner_run`): the tiles, SRAM and HBM counters are the learner's loop's, the
end sets their bytes beside the paper's loop tensor by tensor, and the stepper opens at the step
where their values first leave the reference, with the rows that differ marked in its tile.
Made with ``kernel=`` a function ``launch(Q, K, V, Br, Bc[, causal])`` that runs the learner's
Triton (or numba) kernel on torch tensors through :func:`flashedu.viz.trace_kernel`, it steps
through the kernel's programs (blocks) the same way, each load of a K tile a step, and opens at
the program whose store first wrote a wrong element of O.

The view never shows a run the controls do not describe: a setting that cannot be traced (too
many tiles, a block mask of another tiling) clears the picture, turns stepping off and says why.
Made with ``state=editor.state`` the stepper follows a :class:`BlockMaskEditor`: its tiling,
causal flag and block mask are the editor's, re-traced at every edit, and d is the shared one
where the stepper can trace it; its note says where the traced run differs from the editor's
model (float32 on the CPU, the mask's own N).

Positions count the steps done, and the slider shows the same number as the status: 0 is the
start (the mask, no tile highlighted, nothing loaded), k is step k of n, and n also carries the
final writes. The static picture for a saved notebook follows the position.
"""

from __future__ import annotations

import html
import math

import ipywidgets as W
import numpy as np

from .. import io
from ..masks import BlockMask
from ..tiled import flash_forward
from ..trace import Trace
from . import presets, static, timeline
from .charts import run_panels
from .controls import set_quietly
from .trace_states import state_series
from .render import ERROR, FG_MUTED, OK, error_html, kib
from .tile_grid import LEGEND, drawing

ORDERS = {"FA1: K/V outer (Algorithm 1)": "kv_outer", "FA2: Q outer": "q_outer"}
MASKS = ["none", "sliding window", "strided", "random", "BigBird"]
TILE_SIZES = [4, 8, 16, 32, 64]
MAX_STEPS = 400  # beyond this the grid is unreadable and each frame slow
LINKED = ("Nq", "Nk", "Br", "Bc", "causal", "mask")  # set by a followed editor


class TileLoopStepper:
    """Controls for the tiling, loop order, causal and a block mask; step / play / scrub.

    State for tests and notebooks: ``error`` (None, or why the controls' setting cannot be
    stepped; then ``trace`` is None and stepping is off), ``position`` (steps done: 0 is the
    start, ``done`` = n the last step with the final writes), ``trace``, ``timeline``,
    ``bytes_read`` / ``bytes_written`` (so far), ``predicted`` (flashedu.io's totals),
    ``current`` (the Step shown, None at the start),
    ``sram_live``, ``row_stats`` (m_i, l_i of the chosen row), ``block_mask`` (the (Tr, Tc)
    grid or None).
    """

    def __init__(self, Nq=64, Nk=64, d=16, Br=16, Bc=16, order="kv_outer", causal=False,
                 block_mask=None, row=0, seed=0, state=None, fn=None, kernel=None):
        for name, f, what in (("fn", fn, "flash_forward(Q, K, V, Br, Bc[, causal]) -> (O, L)"),
                              ("kernel", kernel, "launch(Q, K, V, Br, Bc[, causal]) -> "
                                                 "trace_kernel(...)")):
            if f is not None and not callable(f):
                raise TypeError(f"{name} must be your {what}, got {type(f).__name__}")
        if fn is not None and kernel is not None:
            raise ValueError("pass fn (a NumPy loop) or kernel (a traced launch), not both")
        if (fn or kernel) is not None and (state is not None or block_mask is not None):
            raise ValueError(f"{'fn' if fn is not None else 'kernel'} traces your own code, "
                             "which takes no block mask: pass it, or state / block_mask, not "
                             "both")
        self.fn, self.kernel = fn, kernel
        self.learner = fn if fn is not None else kernel  # whose loop the stepper shows
        self.comparison = None  # with fn: compare_trace's result for the traced run
        self.kernel_trace = self.kernel_comparison = None  # with kernel: its trace, O's check
        self.seed = seed
        self._custom_mask = None
        self._holding = False
        self.error = None
        self.trace = self.timeline = None
        self.state = state
        c = self.controls = {
            "Nq": W.BoundedIntText(Nq, min=1, max=1024, description="Nq", layout=_narrow()),
            "Nk": W.BoundedIntText(Nk, min=1, max=1024, description="Nk", layout=_narrow()),
            "d": W.Dropdown(options=[4, 8, 16, 32, 64], value=d, description="d", layout=_narrow()),
            "Br": W.Dropdown(options=TILE_SIZES, value=Br, description="Br", layout=_narrow()),
            "Bc": W.Dropdown(options=TILE_SIZES, value=Bc, description="Bc", layout=_narrow()),
            "order": W.ToggleButtons(options=list(ORDERS.items()), value=order,
                                     style={"button_width": "210px"},
                                     layout=W.Layout(width="auto", max_width="100%")),
            "causal": W.Checkbox(causal, description="causal", indent=False,
                                 layout=W.Layout(width="90px")),
            "mask": W.Dropdown(options=MASKS, value="none", description="block mask",
                               layout=W.Layout(width="240px")),
            "row": W.BoundedIntText(row, min=0, max=Nq - 1, description="row", layout=_narrow()),
        }
        self.slider = W.IntSlider(0, min=0, max=1, description="step", continuous_update=True,
                                  layout=W.Layout(flex="1 1 260px", min_width="220px",
                                                  max_width="480px"))
        self.play = W.Play(0, min=0, max=1, interval=700, description="play")
        W.link((self.play, "value"), (self.slider, "value"))
        self.step_button = W.Button(description="step ▶", tooltip="next (i, j) step",
                                    layout=W.Layout(width="80px"))
        self.back_button = W.Button(description="◀ back", tooltip="previous (i, j) step",
                                    layout=W.Layout(width="80px"))
        self.step_button.on_click(lambda _: self.step())
        self.back_button.on_click(lambda _: self.back())
        self.tiles = W.HTML()
        self.charts = W.HTML()
        self.status = W.HTML()
        self.run_info = W.HTML()
        self.counters = W.HTML()
        self.hbm_panel = W.HTML(layout=W.Layout(flex="1 1 280px"))
        self.sram_panel = W.HTML(layout=W.Layout(flex="1 1 280px"))
        self.linked_note = W.HTML()
        self.verdict = W.HTML()  # with fn: where the learner's run first leaves the reference
        whose = (f"<b>Your {html.escape(getattr(self.learner, '__name__', 'function'))}'s tile "
                 "loop</b>" if self.learner is not None else "<b>FlashAttention tile loop</b>")
        self.widget = W.VBox([
            W.HTML(static.HIDE_WHEN_LIVE + whose
                   + ": which tiles sit in SRAM, what moves over HBM"),
            self.linked_note, self.verdict,
            _wrap([c["Nq"], c["Nk"], c["d"], c["Br"], c["Bc"], c["causal"]]),
            _wrap([c["order"], c["mask"]]),
            # the buttons, the status and the tiles they move stay together on a laptop screen
            _wrap([self.back_button, self.step_button, self.play, self.slider, c["row"]]),
            self.status, self.tiles, W.HTML(LEGEND), self.counters, self.run_info,
            _wrap([self.hbm_panel, self.sram_panel]), self.charts,
        ], layout=W.Layout(max_width="100%", overflow="hidden"))
        self.widget.add_class("flashedu-stepper")
        self.widget.add_class("flashedu-live")
        for name, w in c.items():
            w.observe(self._on_config if name != "row" else self._on_row, names="value")
        self.slider.observe(lambda ch: self._show(), names="value")
        # while playing, the static picture waits for the stop (a PNG takes about half a second)
        self.play.observe(lambda ch: None if ch.new or self._holding else static.update(self),
                          names="playing")
        if self.learner is not None:  # the loop order is theirs; their code takes no mask
            c["order"].disabled = c["mask"].disabled = True
        if state is not None:
            for name in LINKED:
                c[name].disabled = True
            self._take_settings(state.settings)
            state.follow_settings(self._follow_settings)
            state.follow(self._follow)
        elif block_mask is not None:
            self.use_mask(block_mask)
        else:
            self._run()

    # ----- public actions ------------------------------------------------------------------
    @property
    def valid(self) -> bool:
        """True when the controls describe a run that has been traced and can be stepped."""
        return self.error is None

    @property
    def position(self) -> int:
        return self.slider.value

    @position.setter
    def position(self, value: int) -> None:
        if self.valid:
            self.slider.value = max(0, min(int(value), self.done))

    @property
    def done(self) -> int:
        return self.timeline.done if self.valid else 0

    def step(self) -> None:
        self.position = self.position + 1

    def back(self) -> None:
        self.position = self.position - 1

    def configure(self, **values) -> None:
        """Set several controls (keys of ``controls``) and re-run once."""
        set_quietly(self, ((self.controls[name], value) for name, value in values.items()))
        self._run()

    def use_mask(self, block_mask) -> None:
        """Run with a custom block mask: a flashedu.BlockMask (its tiling and causal flag are
        taken over) or a (Tr, Tc) bool array for the current tiling."""
        if isinstance(block_mask, BlockMask):
            (Nq, Nk), (Br, Bc) = block_mask.seq_lens, block_mask.block_size
            self._holding = True
            try:
                for name, size in (("Br", Br), ("Bc", Bc)):
                    if size not in self.controls[name].options:
                        self.controls[name].options = sorted({*self.controls[name].options, size})
                for name, n in (("Nq", Nq), ("Nk", Nk)):  # never clamp the mask's N
                    self.controls[name].max = max(self.controls[name].max, n)
            finally:
                self._holding = False
            self._custom_mask = np.asarray(block_mask.blocks[0, 0], bool)
            self._ensure_custom_option()
            self.configure(Nq=Nq, Nk=Nk, Br=Br, Bc=Bc, causal=block_mask.is_causal, mask="custom")
        else:
            self._custom_mask = np.asarray(block_mask, bool)
            self._ensure_custom_option()
            self.configure(mask="custom")

    # ----- state read by tests and panels ----------------------------------------------------
    @property
    def bytes_read(self) -> int:
        return self.timeline.totals(self.position)[0] if self.valid else 0

    @property
    def bytes_written(self) -> int:
        return self.timeline.totals(self.position)[1] if self.valid else 0

    @property
    def current(self):
        return self.timeline.step_at(self.position) if self.valid else None

    @property
    def sram_live(self) -> dict:
        return dict(self.current.sram) if self.current is not None else {}

    def traffic(self, name: str) -> tuple[int, int]:
        """(bytes read, bytes written) of HBM tensor ``name`` so far, e.g. "O"."""
        if not self.valid:
            return 0, 0
        by = self.timeline.traffic_by_tensor(self.position)
        return by.get(("load", name), 0), by.get(("store", name), 0)

    def static_png(self) -> bytes:
        """A picture of what the widget shows now (tiles and charts), for a saved notebook."""
        if not self.valid:
            return static.message_png(f"tile loop: {self.error}")
        return static.stack_png([drawing(self.timeline, self.position, self.marked_rows),
                                 *run_panels(self.timeline, self.row_stats, self.position,
                                             self.learner_stats)],
                                self.static_caption())

    def static_caption(self) -> str:
        """The title of the static picture: the run and the step it shows."""
        if not self.valid:
            return f"tile loop: {self.error}"
        return f"tile loop, {self._describe()}, step {self.position} of {self.done}"

    # ----- internals --------------------------------------------------------------------------
    def _follow(self, block_mask) -> None:
        self.use_mask(block_mask)

    def _take_settings(self, settings) -> None:
        """d from the shared settings when the stepper can trace it; the note says the rest."""
        if settings["d"] in self.controls["d"].options:
            set_quietly(self, [(self.controls["d"], settings["d"])])
        self._linked_settings = dict(settings)

    def _follow_settings(self, settings) -> None:
        before = self.controls["d"].value
        self._take_settings(settings)
        if self.controls["d"].value != before:
            self._run()
        else:
            self._show()

    def _linked_html(self) -> str:
        st = self._linked_settings
        Nq = self.controls["Nq"].value
        d = self.controls["d"].value
        differs = [f"N = {Nq} (the mask's own tiles; the editor's model scales the pattern to "
                   f"N = {st['N']})" if Nq != st["N"] else "",
                   f"d = {d} (the stepper traces d up to {max(self.controls['d'].options)}; "
                   f"the others use d = {st['d']})" if d != st["d"] else "",
                   f"float32 on the CPU (the others model {st['dtype']} on the {st['gpu']})"
                   if st["dtype"] != "float32" else ""]
        differs = [x for x in differs if x]
        return (f"<small class='fe-linked' style='color:{FG_MUTED}'>Nq, Nk, Br, Bc, causal and "
                "the block mask follow the block-mask editor: edit the mask there and this "
                "stepper re-traces it."
                + (" This traced run differs from the editor's model in: " + "; ".join(differs)
                   + "." if differs else "") + "</small>")

    def _advice(self, unlinked: str) -> str:
        """What to do, naming only controls that are enabled."""
        if self.state is None:
            return unlinked
        return "change the tiles or the preset in the block-mask editor, which this stepper follows"

    def _ensure_custom_option(self):
        if "custom" not in self.controls["mask"].options:
            self._holding = True
            try:
                self.controls["mask"].options = MASKS + ["custom"]
            finally:
                self._holding = False

    def _config(self) -> dict:
        return {name: w.value for name, w in self.controls.items()}

    def _mask_grid(self, cfg, Tr, Tc):
        name = cfg["mask"]
        if name in (None, "none"):
            return None
        if name == "custom":
            if self._custom_mask is None or self._custom_mask.shape != (Tr, Tc):
                shape = None if self._custom_mask is None else self._custom_mask.shape
                raise ValueError(f"the custom block mask has shape {shape},"
                                 f" this tiling needs (Tr, Tc) = {(Tr, Tc)}: "
                                 + self._advice("set Br, Bc back, or pick another mask"))
            return self._custom_mask
        mask = presets.make(name, (cfg["Nq"], cfg["Nk"]), (cfg["Br"], cfg["Bc"]), window=1,
                            stride=3, density=0.35, seed=self.seed)
        return mask.blocks[0, 0]

    def _on_config(self, change):
        if not self._holding:
            self._run()

    def _on_row(self, change):
        if self.valid and not self._holding:
            self._row_stats()
            self._show()

    def _invalid(self, reason: str) -> None:
        """Clear everything that described the previous run; stepping off until valid."""
        self.error = reason
        self.trace = self.timeline = self.block_mask = None
        self.predicted = self.row_stats = None
        for w in (self.step_button, self.back_button, self.play, self.slider,
                  self.controls["row"]):
            w.disabled = True
        self._holding = True
        try:
            self.play.playing = False
            self.play.value = 0
            self.slider.value = 0
        finally:
            self._holding = False
        self.status.value = error_html(f"cannot step this setting: {html.escape(reason)}. "
                                       "Stepping is off until the settings are valid.")
        for w in (self.run_info, self.counters, self.tiles, self.hbm_panel, self.sram_panel,
                  self.charts):
            w.value = ""
        if self.state is not None:
            self.linked_note.value = self._linked_html()
        static.update(self)

    def _run(self):
        """Trace a fresh run of flash_forward with the controls' configuration."""
        cfg = self._config()
        Nq, Nk, d, Br, Bc = (cfg[k] for k in ("Nq", "Nk", "d", "Br", "Bc"))
        Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
        try:
            if Tr * Tc > MAX_STEPS:
                raise ValueError(f"{Tr} x {Tc} = {Tr * Tc} tile pairs: too many to step through "
                                 f"(at most {MAX_STEPS}); "
                                 + self._advice("use larger tiles or shorter sequences"))
            blocks = self._mask_grid(cfg, Tr, Tc)
        except ValueError as exc:
            self._invalid(str(exc))
            return
        rng = np.random.default_rng(self.seed)
        self.Q, self.K, self.V = (rng.standard_normal((n, d)).astype(np.float32)
                                  for n in (Nq, Nk, Nk))
        self.scale = 1.0 / math.sqrt(d)
        self.block_mask = blocks
        if self.learner is not None:
            if not (self._run_learner(cfg) if self.fn is not None else self._run_kernel(cfg)):
                return
        else:
            self.trace = Trace()
            self.O, self.L = flash_forward(self.Q, self.K, self.V, Br, Bc, cfg["causal"],
                                           self.scale, order=cfg["order"], block_mask=blocks,
                                           trace=self.trace)
        self.timeline = timeline.build(self.trace)
        order = self.trace.info["order"]
        self.predicted = io.flash_forward_hbm_bytes(Nq, Nk, d, Br, Bc, order=order,
                                                    causal=cfg["causal"], block_mask=blocks,
                                                    itemsize=self.Q.itemsize)
        self.error = None
        self._holding = True
        try:
            for w in (self.step_button, self.back_button, self.play, self.slider):
                w.disabled = False
            self.controls["row"].disabled = False
            self.controls["row"].max = Nq - 1
            self.play.value = 0
            self.play.max = self.slider.max = self.done
            self.slider.value = self._opening_position()
        finally:
            self._holding = False
        self._row_stats()
        self._show()

    def _run_learner(self, cfg) -> bool:
        """Trace the learner's function on this run's Q, K, V beside the reference; False
        (and the view cleared, saying why) when it made no step to show."""
        from .compare_view import verdict_html
        from .learner_run import as_trace
        from .learner_trace import compare_trace

        self.comparison = cmp = compare_trace(self.fn, self.Q, self.K, self.V, cfg["Br"],
                                              cfg["Bc"], cfg["causal"])
        self.verdict.value = verdict_html(cmp)
        set_quietly(self, [(self.controls["order"], cmp.order)])  # the order the loop follows
        self.O, self.L = cmp.O, cmp.L
        self.trace = as_trace(cmp)
        paper = Trace()  # the package's loop in the learner's order, for the bytes per tensor
        flash_forward(self.Q, self.K, self.V, cfg["Br"], cfg["Bc"], cfg["causal"], self.scale,
                      order=cmp.order, trace=paper)
        self.paper_traffic = paper.by_tensor()
        if not self.trace.steps:
            self._invalid("your function made no tile product S_ij = Q_i K_j^T to step "
                          "through; the comparison above says what it found")
            return False
        return True

    def _run_kernel(self, cfg) -> bool:
        """Trace the learner's kernel launch on this run's Q, K, V and compare its O with the
        reference; False (and the view cleared, saying why) when no step can be shown."""
        import torch

        from .. import reference
        from .learner_run import kernel_as_trace
        from .learner_trace import _function_code, _learner_error

        args = [torch.from_numpy(x.copy()) for x in (self.Q, self.K, self.V)]
        try:
            kt = self.kernel(*args, cfg["Br"], cfg["Bc"], **({"causal": True}
                                                             if cfg["causal"] else {}))
        except Exception as exc:  # noqa: BLE001 - the learner's error is the finding
            error = _learner_error(exc, _function_code(self.kernel), 0)
            self.verdict.value = f"<div class='fe-verdict' style='color:{ERROR}'>✗ " \
                                 f"{html.escape(str(error))}</div>"
            self._invalid("your launch raised before the kernel ran (above)")
            return False
        self.kernel_trace = kt
        O_ref, _ = reference.naive_attention(self.Q, self.K, self.V, causal=cfg["causal"])
        found = kt.compare("O", O_ref.reshape(np.shape(kt.values["O"])))
        self.kernel_comparison = found
        ok = found.agrees and kt.error is None
        self.verdict.value = (f"<div class='fe-verdict' style='color:{OK if ok else ERROR}'>"
                              f"{'✓' if ok else '✗'} {html.escape(found.verdict)}</div>")
        try:
            self.trace = kernel_as_trace(kt, cfg["Br"], cfg["Bc"], cfg["causal"])
        except ValueError as exc:  # its tiles are not the controls' (or not one head)
            self._invalid(str(exc))
            return False
        self.O = np.asarray(kt.values["O"]).reshape(self.Q.shape)
        paper = Trace()
        flash_forward(self.Q, self.K, self.V, cfg["Br"], cfg["Bc"], cfg["causal"], self.scale,
                      order="q_outer", trace=paper)
        self.paper_traffic = paper.by_tensor()
        set_quietly(self, [(self.controls["order"], "q_outer")])
        if not self.trace.steps:
            self._invalid("your kernel loaded no K tile to step through; the comparison "
                          "above says what it found")
            return False
        return True

    def _first_difference(self):
        """(step, rows) where the learner's run first goes wrong, or None."""
        if self.comparison is not None:
            div = self.comparison.first_divergence
            return (div.step, div.rows) if div is not None else None
        found = getattr(self, "kernel_comparison", None)
        if self.kernel is None or found is None or found.first is None:
            return None
        program = found.first.program[0]  # its store ends the program's last step
        steps = [k for k, s in enumerate(self.trace.steps, start=1)
                 if s.i == self._program_tile(program)]
        rows = tuple(sorted({r for r, _ in found.elements}))
        return (steps[-1], rows) if steps else None

    def _program_tile(self, program: int) -> int:
        """The Q tile the program with x index ``program`` loaded."""
        for a in self.kernel_trace.accesses(program):
            if a.tensor == "Q" and a.elements:
                return min(r for r, _ in a.elements) // self.trace.info["Br"]
        return program

    def _opening_position(self) -> int:
        """0, or for the learner's code the step where their run first goes wrong."""
        first = self._first_difference()
        return min(first[0], self.done) if first is not None else 0

    @property
    def marked_rows(self) -> tuple:
        """The query rows whose values first differ, at the step where they do (else ())."""
        first = self._first_difference() if self.valid else None
        return first[1] if first is not None and self.position == first[0] else ()

    def _row_stats(self):
        row = min(self.controls["row"].value, self.Q.shape[0] - 1)
        self.row_stats = timeline.row_stats(self.trace, self.Q, self.K, row, self.scale,
                                            self.controls["causal"].value)
        self.learner_stats = None
        if self.comparison is not None:  # the learner's own m_i, l_i beside the replay
            cmp = self.comparison
            skip = cmp.error.step if cmp.error is not None else None
            m, l, _, known, _ = state_series(cmp.steps, row, 0, self.done, skip)
            if known.any():
                self.learner_stats = (m, l, known)

    def _describe(self) -> str:
        info = self.trace.info
        mask = self.controls["mask"].value
        if self.block_mask is not None:
            mask += f" ({int(self.block_mask.sum())} of {self.block_mask.size} tiles kept)"
        whose = "your function, " if self.learner is not None else ""
        return (f"{whose}Nq = {info['Nq']}, Nk = {info['Nk']}, d = {info['d']}, "
                f"Br = {info['Br']}, "
                f"Bc = {info['Bc']}, {'FA1' if info['order'] == 'kv_outer' else 'FA2'}, "
                f"{'causal' if info['causal'] else 'not causal'}, block mask: {mask}")

    def _show(self):
        if not self.valid or self._holding:
            return
        p, tl = self.position, self.timeline
        s = self.current
        if s is None:
            where = (f"step 0 of {tl.done}, the start: nothing loaded yet; the grid shows the "
                     "mask (grey: tile pairs the run skips)")
        else:
            what = "computed" if s.computed else "skipped (masked out: nothing loaded)"
            where = f"step {p} of {tl.done}: tile pair (i={s.i}, j={s.j}) {what}"
            if p == tl.done:
                where += ", then the final writes: done"
        self.status.value = f"<span class='fe-status'>{where}</span>"
        if self.state is not None:
            self.linked_note.value = self._linked_html()
        self.run_info.value = (f"<small class='fe-run-info' style='color:{FG_MUTED}'>traced run: "
                               f"{self._describe()}</small>")
        self.counters.value = self._counters_html()
        self.hbm_panel.value = self._hbm_html()
        self.sram_panel.value = self._sram_html()
        self.tiles.value = drawing(tl, p, self.marked_rows).svg()
        self.charts.value = "".join(
            f"<div style='display:inline-block;margin:0 8px 4px 0'>{d.svg()}</div>"
            for d in run_panels(tl, self.row_stats, p, self.learner_stats))
        if not self.play.playing:
            static.update(self)

    def _counters_html(self) -> str:
        read, written = self.bytes_read, self.bytes_written
        pred = self.predicted
        check = ""
        if self.position == self.done and self.learner is not None:
            check = " &nbsp; " + self._per_tensor_html()
        elif self.position == self.done:
            same = (read, written) == (pred["read"], pred["written"])
            check = (f" &nbsp; {'=' if same else '≠'} flashedu.io.flash_forward_hbm_bytes "
                     f"({pred['read']:,} / {pred['written']:,}) {'✓' if same else '✗'}")
        o_read, o_written = self.traffic("O")
        rs, k = self.row_stats, self.position
        m, l = rs.m[k], rs.l[k]
        return (f"HBM read <b class='fe-read'>{read:,} B</b>, written "
                f"<b class='fe-written'>{written:,} B</b> "
                f"(of {pred['read']:,} / {pred['written']:,} for the whole run"
                f"{', by the paper’s loop' if self.learner is not None else ''}){check}<br>"
                f"O traffic so far: read {o_read:,} B, written {o_written:,} B &nbsp;|&nbsp; "
                f"row {rs.row}: m_i = <span class='fe-m'>{m:.4f}</span>, "
                f"l_i = <span class='fe-l'>{l:.4f}</span> after {rs.tiles_seen[k]} K/V tiles")

    def _per_tensor_html(self) -> str:
        """The learner's bytes per tensor beside the paper's loop's, for the tensors the trace
        sees in the learner's code (reads of Q, K, V; writes into an O or L made *_like)."""
        mine, paper = self.timeline.traffic_by_tensor(self.done), self.paper_traffic
        parts = []
        for key in sorted(mine, key=lambda k: (k[0] != "load", "QKVOL".find(k[1]))):
            same = mine[key] == paper.get(key, 0)
            parts.append(f"<span class='fe-tensor-{'ok' if same else 'differs'}'>{key[1]} "
                         f"{'read' if key[0] == 'load' else 'written'} {mine[key]:,} / "
                         f"{paper.get(key, 0):,} {'✓' if same else '✗'}</span>")
        unseen = [f"{name} {'read' if op == 'load' else 'written'}"
                  for op, name in paper if (op, name) not in mine]
        note = (f"; not seen in your code: {', '.join(unseen)} (the trace counts row slices "
                "of Q, K, V and of arrays made like them, e.g. np.zeros_like(Q))"
                if unseen else "")
        return "by tensor, yours / the paper's loop: " + ", ".join(parts) + note

    def _hbm_html(self) -> str:
        moves = self.timeline.transfers_at(self.position)
        lines = [f"{e.op} {e.name}[{e.tile}] {kib(e.nbytes)}" for e in moves] or ["(none)"]
        by = self.timeline.traffic_by_tensor(self.position)
        names = sorted({n for _, n in by}, key="QKVOlmL".find)
        rows = "".join(f"<tr><td>{n}</td><td>{by.get(('load', n), 0):,}</td>"
                       f"<td>{by.get(('store', n), 0):,}</td></tr>" for n in names)
        return ("<b>HBM</b> transfers at this position: " + ", ".join(lines) +
                "<table><tr><th>tensor</th><th>read B</th><th>written B</th></tr>"
                f"{rows}</table>")

    def _sram_html(self) -> str:
        live = self.sram_live
        rows = "".join(f"<tr><td>{n}</td><td>{'' if t is None else t}</td><td>{b:,}</td></tr>"
                       for n, (t, b) in live.items())
        total = sum(b for _, b in live.values())
        return (f"<b>SRAM</b> live set: {total:,} B (peak of the run "
                f"{self.trace.peak_sram_bytes():,} B)"
                "<table><tr><th>buffer</th><th>tile</th><th>bytes</th></tr>"
                f"{rows}</table>")

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self):
        static.display_with_fallback(self)


def _narrow():
    return W.Layout(width="150px")


def _wrap(children):
    return W.HBox(children, layout=W.Layout(flex_flow="row wrap", align_items="center",
                                            max_width="100%"))
