"""Matplotlib figures as PNG bytes for an ``ipywidgets.Image``.

Figures are drawn with the object-oriented API on an Agg canvas, never through pyplot: no global
figure state, no dependence on the notebook's matplotlib backend, and the same bytes in a test
as in the browser.
"""

from __future__ import annotations

import io

from matplotlib.figure import Figure

# One palette for every widget, so a colour means the same thing everywhere.
COLORS = {
    "sram": "#f28e2b",  # tile live in SRAM now
    "done": "#a0cbe8",  # tile computed at an earlier step
    "skipped": "#d3d3d3",  # tile skipped: masked out, never loaded
    "todo": "#ffffff",
    "accumulator": "#ffbe7d",  # on-chip accumulator (O_i, m_i, l_i in the Q-outer order)
    "edge": "#4e4e4e",
    "over": "#e15759",  # does not fit
    "ok": "#59a14f",
}


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
