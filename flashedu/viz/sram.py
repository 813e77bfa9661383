"""SRAMOccupancy: what one thread block of the forward pass keeps in shared memory.

Pick a GPU from :data:`flashedu.io.GPUS`, the tile (Br, Bc), head dim d, dtype and pipeline
stages: a stacked bar of :func:`flashedu.io.sram_footprint` against the SM's capacity, a flag when
it does not fit, the largest square tile that does, and what the tile buys: the paper's M (SRAM
in elements), its block sizes, and the predicted HBM traffic (:func:`flashedu.io`'s exact count)
as the tile grows, which is the paper's block-size effect (Fig. 2, middle).
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
        self.summary = W.HTML()
        self.bar = W.Image(format="png", layout=_image())
        self.effect = W.Image(format="png", layout=_image())
        wrap = dict(flex_flow="row wrap", align_items="center", max_width="100%")
        self.widget = W.VBox([
            W.HTML(static.HIDE_WHEN_LIVE
                   + "<b>SRAM occupancy</b> of one thread block (forward pass)"),
            self.linked_note,
            W.HBox([c["gpu"], c["dtype"], c["stages"]], layout=W.Layout(**wrap)),
            W.HBox([c["Br"], c["Bc"], c["d"], c["N"]], layout=W.Layout(**wrap)),
            self.summary, self.bar, self.effect,
        ], layout=W.Layout(max_width="100%", overflow="hidden"))
        self.widget.add_class("flashedu-sram")
        self.widget.add_class("flashedu-live")
        self._holding = False
        for w in c.values():
            w.observe(lambda _: None if self._holding else self._update(), names="value")
        if state is not None:
            c["Br"].disabled = c["Bc"].disabled = True
            self.linked_note.value = (f"<small style='color:{FG_MUTED}'>Br and Bc follow the "
                                      "block-mask editor's tiles.</small>")
            state.follow(self._follow)
        else:
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
        from io import BytesIO

        from PIL import Image

        a, b = (Image.open(BytesIO(x)) for x in (self.bar.value, self.effect.value))
        out = Image.new("RGB", (max(a.width, b.width), a.height + b.height), "white")
        out.paste(a, (0, 0))
        out.paste(b, (0, a.height))
        buf = BytesIO()
        out.save(buf, format="PNG")
        return buf.getvalue()

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
        self.summary.value = self._summary_html(v, gpu)
        self.bar.value = sram_bar(self.footprint, self.capacity_bytes,
                                  f"{gpu.name}: {kib(self.total_bytes)} of "
                                  f"{kib(self.capacity_bytes)} per SM")
        self.effect.value = self._effect_png(N, d, dtype, stages, isz, gpu, v)
        static.update(self)

    def _effect_png(self, N, d, dtype, stages, isz, gpu, v) -> bytes:
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

    def _summary_html(self, v, gpu) -> str:
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
            f"({gpu.sms} SMs): {flag}.<br>"
            f"Largest square tile that fits: <b class='fe-largest'>B = {self.largest_tile}</b>. "
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


def _image():
    # no margin: ipywidgets' 2 px would push a 100 % wide image past the output area
    return W.Layout(width="100%", max_width="850px", margin="0")
