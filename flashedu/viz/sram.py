"""SRAMOccupancy: what one thread block of the forward pass keeps in shared memory.

Pick a GPU from :data:`flashedu.io.GPUS`, the tile (Br, Bc), head dim d, dtype and pipeline
stages: a stacked bar of :func:`flashedu.io.sram_footprint` against the SM's capacity, a flag when
it does not fit, the largest square tile that does, and what the tile buys: the paper's M (SRAM
in elements), its block sizes, and the predicted HBM traffic (:func:`flashedu.io`'s exact count)
as the tile grows, which is the paper's block-size effect (Fig. 2, middle).

Made with ``state=editor.state`` it describes the editor's problem: Br, Bc are the editor's tile,
and N, d, dtype and GPU are shared (a change here reaches the editor and back).
"""

from __future__ import annotations

import functools

import ipywidgets as W

from .. import io
from . import static
from .charts import block_size_effect, sram_bar
from .controls import set_quietly
from .render import FG_MUTED, kib

TILES = [16, 32, 64, 128, 256, 512]
ORDER_NAMES = {"kv_outer": "FA1 (K/V outer)", "q_outer": "FA2 (Q outer)"}
SHARED = ("N", "d", "dtype", "gpu")  # the settings a linked widget shares with the editor


@functools.lru_cache(maxsize=512)
def _traffic(N: int, d: int, B: int, order: str, itemsize: int) -> int:
    return io.flash_forward_hbm_bytes(N, N, d, B, B, order=order, itemsize=itemsize)["total"]


class SRAMOccupancy:
    """State: ``footprint`` (buffer -> bytes), ``total_bytes``, ``capacity_bytes``, ``fits``,
    ``largest_tile``, ``paper_M`` (elements), ``paper_blocks`` (Br, Bc), ``predicted`` (bytes
    of HBM traffic of a forward pass with this tile, per order, and of standard attention),
    ``chart_points`` (curve -> (B, bytes) where the chart marks this tile: FA1 at B = Bc, FA2
    at B = Br, the values of the table)."""

    def __init__(self, gpu="A100 SXM4 40GB", Br=128, Bc=64, d=64, dtype="float16", stages=2,
                 N=4096, state=None):
        c = self.controls = {
            "gpu": W.Dropdown(options=list(io.GPUS), value=gpu, description="GPU"),
            "Br": W.Dropdown(options=TILES, value=Br, description="Br", layout=_narrow()),
            "Bc": W.Dropdown(options=TILES, value=Bc, description="Bc", layout=_narrow()),
            "d": W.Dropdown(options=[32, 64, 128, 256], value=d, description="d",
                            layout=_narrow()),
            "dtype": W.Dropdown(options=list(io.DTYPE_BYTES), value=dtype, description="dtype",
                                layout=W.Layout(width="190px")),
            "stages": W.IntSlider(stages, min=1, max=4, description="stages",
                                  layout=W.Layout(width="auto", flex="1 1 240px",
                                                  max_width="320px")),
            "N": W.Dropdown(options=[1024, 2048, 4096, 8192], value=N, description="N",
                            layout=_narrow()),
        }
        self.linked_note = W.HTML()
        self.summary = W.HTML()  # the fit, above the charts
        self.details = W.HTML()  # the paper's M and the traffic table, below them
        self.bar = W.HTML(layout=_chart())
        self.effect = W.HTML(layout=_chart())
        wrap = dict(flex_flow="row wrap", align_items="center", max_width="100%")
        self.widget = W.VBox([
            W.HTML(static.HIDE_WHEN_LIVE
                   + "<b>SRAM occupancy</b> of one thread block (forward pass)"),
            self.linked_note,
            W.HBox([c["gpu"], c["dtype"], c["stages"]], layout=W.Layout(**wrap)),
            W.HBox([c["Br"], c["Bc"], c["d"], c["N"]], layout=W.Layout(**wrap)),
            self.summary, self.bar, self.effect, self.details,
        ], layout=W.Layout(max_width="100%", overflow="hidden"))
        self.widget.add_class("flashedu-sram")
        self.widget.add_class("flashedu-live")
        self._holding = False
        self.state = state
        for name, w in c.items():
            w.observe(lambda ch, name=name: None if self._holding else self._on_control(name),
                      names="value")
        if state is not None:
            c["Br"].disabled = c["Bc"].disabled = True
            self._take_settings(state.settings)
            state.follow_settings(self._follow_settings)
            state.follow(self._follow)
        else:
            self._update()

    def _on_control(self, name) -> None:
        if self.state is not None and name in SHARED:
            self.state.update(**{name: self.controls[name].value})  # comes back to us redrawn
        else:
            self._update()

    def _take_settings(self, settings) -> None:
        """Set N, d, dtype, GPU quietly to the shared ones (adding an option that is missing)."""
        self._holding = True
        try:
            for name in SHARED:
                w = self.controls[name]
                if settings[name] not in w.options:
                    w.options = sorted({*w.options, settings[name]}, key=str) \
                        if name in ("dtype", "gpu") else sorted({*w.options, settings[name]})
                w.value = settings[name]
        finally:
            self._holding = False

    def _follow_settings(self, settings) -> None:
        self._take_settings(settings)
        self._update()

    def _follow(self, block_mask) -> None:
        Br, Bc = block_mask.block_size
        self._holding = True
        try:
            for name, size in (("Br", Br), ("Bc", Bc)):
                if size not in self.controls[name].options:
                    self.controls[name].options = sorted({*self.controls[name].options, size})
        finally:
            self._holding = False
        if (Br, Bc) != (self.controls["Br"].value, self.controls["Bc"].value) \
                or not hasattr(self, "footprint"):
            self.configure(Br=Br, Bc=Bc)

    def static_png(self) -> bytes:
        """The two charts stacked, as the widget shows them."""
        return static.stack_png(self.drawings, "SRAM occupancy of one thread block")

    def configure(self, **values) -> None:
        """Set several controls (keys of ``controls``) and redraw once."""
        set_quietly(self, ((self.controls[name], value) for name, value in values.items()))
        self._update()

    def _update(self):
        v = {name: w.value for name, w in self.controls.items()}
        gpu, d, dtype, stages, N = io.GPUS[v["gpu"]], v["d"], v["dtype"], v["stages"], v["N"]
        isz = io.itemsize_of(dtype)
        self.footprint = io.sram_footprint(v["Br"], v["Bc"], d, dtype, stages)
        self.total_bytes = sum(self.footprint.values())
        self.capacity_bytes = gpu.smem_per_sm_kib * 1024
        self.fits = self.total_bytes <= self.capacity_bytes
        self.largest_tile = io.largest_square_tile(gpu, d, dtype, stages)
        self.paper_M = self.capacity_bytes // isz
        self.paper_blocks = io.paper_block_sizes(self.paper_M, d)
        self.predicted = {
            "standard attention": io.standard_attention_hbm_elements(N, d) * isz,
            **{ORDER_NAMES[o]: io.flash_forward_hbm_bytes(N, N, d, v["Br"], v["Bc"], order=o,
                                                          itemsize=isz)["total"]
               for o in ORDER_NAMES},
            "Theorem 2: N²d²/M": io.flash_hbm_elements_theta(N, d, self.paper_M) * isz,
        }
        self.summary.value, self.details.value = self._summary_html(v, gpu)
        self.linked_note.value = self._linked_html(v) if self.state is not None else ""
        self.drawings = [
            sram_bar(self.footprint, self.capacity_bytes,
                     f"{gpu.name}: {kib(self.total_bytes)} of {kib(self.capacity_bytes)} per SM"),
            self._effect(N, d, dtype, stages, isz, gpu, v)]
        self.bar.value, self.effect.value = (x.svg() for x in self.drawings)
        static.update(self)

    def _effect(self, N, d, dtype, stages, isz, gpu, v):
        tiles = [B for B in TILES if B <= N]
        traffic = {ORDER_NAMES[o]: [_traffic(N, d, B, o, isz) for B in tiles] for o in ORDER_NAMES}
        traffic["standard attention"] = [self.predicted["standard attention"]] * len(tiles)
        fits = [sum(io.sram_footprint(B, B, d, dtype, stages).values()) <= self.capacity_bytes
                for B in tiles]
        # FA1's traffic depends on Bc only, FA2's on Br only: the chosen tile sits on each
        # curve at the size that curve depends on, with the value the table shows.
        fa1, fa2 = ORDER_NAMES["kv_outer"], ORDER_NAMES["q_outer"]
        self.chart_points = {fa1: (v["Bc"], self.predicted[fa1]),
                             fa2: (v["Br"], self.predicted[fa2])}
        return block_size_effect(tiles, traffic, fits, self.chart_points, self.largest_tile,
                                 f"block-size effect: N = {N}, d = {d}, {dtype} on {gpu.name}",
                                 f"your tile {v['Br']} x {v['Bc']}")

    def _linked_html(self, v) -> str:
        mask = self.state.block_mask
        where = ""
        if mask is not None:
            T = mask.shape[0]
            where = (f" The editor's model runs the same pattern at N = {v['N']} with its "
                     f"{T} x {T} tiles grown to {v['N'] // T}; here the tile is the mask's own "
                     f"{v['Br']} x {v['Bc']}, the one a kernel would keep in SRAM.")
        return (f"<small class='fe-linked' style='color:{FG_MUTED}'>Linked to the block-mask "
                f"editor: N = {v['N']}, d = {v['d']}, {v['dtype']}, {v['gpu']} are shared (a "
                "change here changes the editor too); Br and Bc are the editor's tiles." + where
                + "</small>")

    def _summary_html(self, v, gpu) -> tuple[str, str]:
        if self.fits:
            flag = (f"<b class='fe-fit' style='color:var(--jp-success-color1, #2a7d2a)'>fits</b>: "
                    f"{kib(self.capacity_bytes - self.total_bytes)} to spare")
        else:
            flag = ("<b class='fe-fit' style='color:var(--jp-error-color1, #c62828)'>does not "
                    "fit</b>: "
                    f"{kib(self.total_bytes - self.capacity_bytes)} over; the kernel would not "
                    "launch (or spill): pick a smaller tile or fewer stages")
        Br, Bc = self.paper_blocks
        rows = "".join(f"<tr><td>{name}</td><td>{kib(b)}</td></tr>"
                       for name, b in self.predicted.items())
        return (
            f"Br = {v['Br']}, Bc = {v['Bc']}, d = {v['d']}, {v['dtype']}, {v['stages']} stage(s): "
            f"<b>{kib(self.total_bytes)}</b> of {kib(self.capacity_bytes)} shared memory per SM "
            f"({gpu.sms} SMs): {flag}. "
            f"Largest square tile that fits: <b class='fe-largest'>B = {self.largest_tile}</b>."
        ), (
            f"The paper's M (SRAM in elements) is {self.paper_M:,}; its Algorithm 1 picks "
            f"Bc = ceil(M / 4d) = {Bc}, Br = min(Bc, d) = {Br}.<br>"
            f"Predicted HBM traffic of one head's forward pass, N = {v['N']} "
            "(exact counts from flashedu.io; bigger tiles mean fewer passes over Q/O or K/V):"
            f"<table>{rows}</table>")

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self):
        static.display_with_fallback(self)


def _narrow():
    return W.Layout(width="150px")


def _chart():
    # no margin: ipywidgets' 2 px would push a 100 % wide chart past the output area
    return W.Layout(width="100%", max_width="850px", margin="0")
