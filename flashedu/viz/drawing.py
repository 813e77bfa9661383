"""A tiny retained drawing: rectangles, lines and text, written as inline SVG or as a PNG.

The live widgets show the SVG (a redraw costs microseconds, the browser scales it to the output
width, text follows the notebook's theme through CSS variables). The same drawing rendered with
matplotlib gives the PNG that stays in a saved notebook, where no kernel runs the widget.
"""

from __future__ import annotations

import html
import re

from .render import new_figure, png

_VAR = re.compile(r"var\(--[\w-]+,\s*(#[0-9a-fA-F]{3,8})\)")


def _plain(color: str) -> str:
    """A CSS colour with its theme variable replaced by the fallback (for matplotlib)."""
    m = _VAR.fullmatch(color.strip())
    return m.group(1) if m else color


class Drawing:
    """Shapes in pixel coordinates (x right, y down)."""

    def __init__(self, width: float, height: float, css_class: str = ""):
        self.width, self.height, self.css_class = width, height, css_class
        self.shapes: list[tuple] = []

    def rect(self, x, y, w, h, fill, stroke="#555", stroke_width=1.0, dash="", cls="", data="",
             opacity=1.0):
        self.shapes.append(("rect", x, y, w, h, fill, stroke, stroke_width, dash, cls, data,
                            opacity))

    def polygon(self, points, fill, stroke, width=1.0, cls=""):
        """A closed, filled shape (a marker)."""
        self.shapes.append(("polygon", tuple(points), fill, stroke, width, cls))

    def line(self, x1, y1, x2, y2, stroke, width=1.0, dash="", cls=""):
        self.shapes.append(("line", x1, y1, x2, y2, stroke, width, dash, cls))

    def polyline(self, points, stroke, width=1.5, dash="", cls=""):
        self.shapes.append(("poly", tuple(points), stroke, width, dash, cls))

    def text(self, x, y, s, color, size=12.0, anchor="middle", bold=False, cls=""):
        self.shapes.append(("text", x, y, str(s), color, size, anchor, bold, cls))

    # ----- SVG ---------------------------------------------------------------------------
    def svg(self) -> str:
        out = []
        for s in self.shapes:
            kind = s[0]
            if kind == "rect":
                _, x, y, w, h, fill, stroke, sw, dash, cls, data, opacity = s
                alpha = f";fill-opacity:{opacity}" if opacity != 1.0 else ""
                out.append(f"<rect{_cls(cls)}{data} x='{x:.1f}' y='{y:.1f}' width='{w:.1f}' "
                           f"height='{h:.1f}' style='fill:{fill};stroke:{stroke};"
                           f"stroke-width:{sw}{_dash(dash)}{alpha}'/>")
            elif kind == "polygon":
                _, pts, fill, stroke, width, cls = s
                p = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
                out.append(f"<polygon{_cls(cls)} points='{p}' style='fill:{fill};"
                           f"stroke:{stroke};stroke-width:{width}'/>")
            elif kind == "line":
                _, x1, y1, x2, y2, stroke, width, dash, cls = s
                out.append(f"<line{_cls(cls)} x1='{x1:.1f}' y1='{y1:.1f}' x2='{x2:.1f}' "
                           f"y2='{y2:.1f}' style='stroke:{stroke};stroke-width:{width}"
                           f"{_dash(dash)}'/>")
            elif kind == "poly":
                _, pts, stroke, width, dash, cls = s
                p = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
                out.append(f"<polyline{_cls(cls)} points='{p}' style='fill:none;stroke:{stroke};"
                           f"stroke-width:{width}{_dash(dash)}'/>")
            else:
                _, x, y, text, color, size, anchor, bold, cls = s
                weight = ";font-weight:bold" if bold else ""
                out.append(f"<text{_cls(cls)} x='{x:.1f}' y='{y:.1f}' text-anchor='{anchor}' "
                           f"dominant-baseline='middle' style='fill:{color};"
                           f"font-size:{size:.0f}px{weight}'>{html.escape(text)}</text>")
        cls = f" {self.css_class}" if self.css_class else ""
        return (f"<svg class='fe-svg{cls}' xmlns='http://www.w3.org/2000/svg' "
                f"width='{self.width:.0f}' height='{self.height:.0f}' "
                f"viewBox='0 0 {self.width:.0f} {self.height:.0f}' "
                "style='max-width:100%;height:auto;font-family:sans-serif'>"
                + "".join(out) + "</svg>")

    # ----- PNG ---------------------------------------------------------------------------
    def draw_into(self, ax) -> None:
        """Draw on a matplotlib Axes whose data coordinates are this drawing's pixels."""
        from matplotlib.collections import PatchCollection
        from matplotlib.colors import to_rgba
        from matplotlib.patches import Polygon, Rectangle

        ax.set_xlim(0, self.width)
        ax.set_ylim(self.height, 0)
        ax.set_axis_off()
        k = 0.75  # px -> pt at 96 dpi, for line widths and font sizes
        rects = []  # one collection: a grid has thousands of squares, each a patch is slow
        for s in self.shapes:
            kind = s[0]
            if kind == "rect":
                _, x, y, w, h, fill, stroke, sw, dash, _, _, opacity = s
                face = _plain(fill)
                if face != "none" and opacity != 1.0:
                    face = to_rgba(face, opacity)
                rects.append(Rectangle((x, y), w, h, facecolor=face,
                                       edgecolor=_plain(stroke), lw=sw * k,
                                       ls="--" if dash else "-"))
            elif kind == "polygon":
                _, pts, fill, stroke, width, _ = s
                ax.add_patch(Polygon(pts, closed=True, facecolor=_plain(fill),
                                     edgecolor=_plain(stroke), lw=width * k, zorder=3))
            elif kind == "line":
                _, x1, y1, x2, y2, stroke, width, dash, _ = s
                ax.plot([x1, x2], [y1, y2], color=_plain(stroke), lw=width * k,
                        ls="--" if dash else "-")
            elif kind == "poly":
                _, pts, stroke, width, dash, _ = s
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, color=_plain(stroke), lw=width * k, ls="--" if dash else "-")
            else:
                _, x, y, text, color, size, anchor, bold, _ = s
                ax.text(x, y, text, color=_plain(color), fontsize=size * k,
                        ha={"middle": "center", "end": "right"}.get(anchor, "left"),
                        va="center", fontweight="bold" if bold else "normal")
        # rectangles lie under lines and text, in the order drawn, as separate patches did
        ax.add_collection(PatchCollection(rects, match_original=True, zorder=1))

    def png(self, scale: float = 1.0) -> bytes:
        fig = new_figure(self.width / 90 * scale, self.height / 90 * scale)
        fig.set_layout_engine("none")
        ax = fig.add_axes((0, 0, 1, 1))
        self.draw_into(ax)
        return png(fig)


def _cls(cls: str) -> str:
    return f" class='{cls}'" if cls else ""


def _dash(dash: str) -> str:
    return f";stroke-dasharray:{dash}" if dash else ""
