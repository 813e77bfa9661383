"""Colours, theme-aware SVG text and matplotlib figures as PNG bytes, shared by every widget.

One palette for every widget, so a colour means the same thing everywhere: orange is a tile
*in SRAM now*, blue a tile *computed* (earlier in the stepper, kept in the mask editor), grey a
tile *skipped* (masked out, never loaded). Text drawn into SVG takes JupyterLab's theme colours
(CSS variables such as ``--jp-ui-font-color1``) so it reads in the light and the dark theme;
text on a coloured tile stays dark, because the tile colours are light in both themes.

Matplotlib figures are drawn with the object-oriented API on an Agg canvas, never through
pyplot: no global figure state, no dependence on the notebook's matplotlib backend, and the
same bytes in a test as in the browser.
"""

from __future__ import annotations

import io

from matplotlib.figure import Figure

COLORS = {
    "sram": "#f28e2b",  # tile live in SRAM now
    "done": "#8cb8e0",  # tile computed (at an earlier step; or kept in a block mask)
    "skipped": "#c8c8c8",  # tile skipped: masked out, never loaded
    "todo": "#ffffff",  # not reached yet (drawn in the theme's background colour)
    "accumulator": "#ffbe7d",  # on-chip accumulator (O_i, m_i, l_i in the Q-outer order)
    "edge": "#4e4e4e",
    "over": "#e15759",  # does not fit
    "ok": "#59a14f",
    "read": "#4e79a7",
    "written": "#e15759",
    "m": "#59a14f",
    "l": "#b07aa1",
    "cursor": "#d62728",
}

# Theme colours of JupyterLab, with fallbacks for a page without its CSS (e.g. a saved HTML).
FG = "var(--jp-ui-font-color1, #1f1f1f)"
FG_MUTED = "var(--jp-ui-font-color2, #616161)"
BG = "var(--jp-layout-color0, #ffffff)"
BORDER = "var(--jp-border-color1, #9e9e9e)"
ERROR = "var(--jp-error-color1, #c62828)"
WARN = "var(--jp-warn-color1, #e65100)"
OK = "var(--jp-success-color1, #2e7d32)"
ON_TILE = "#1f1f1f"  # text on a light tile colour, in either theme


def error_html(text: str) -> str:
    return f"<span class='fe-error' style='color:{ERROR}'>{text}</span>"


def new_figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), dpi=90, layout="constrained")


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def kib(nbytes: float) -> str:
    """Bytes as a short human string (B, KiB, MiB, GiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:,.1f} {unit}"
    return f"{int(nbytes):,} B"
