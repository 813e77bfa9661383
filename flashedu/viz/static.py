"""A static picture beside each live widget, so that a saved notebook still shows something.

A widget lives in the kernel: after saving and reopening a notebook its view has no model and
JupyterLab writes "Error displaying widget". So each widget is displayed as two outputs: the
live widget, and a PNG of what it shows (updated when what it shows changes). While the widget
is live, a style sheet inside it hides the PNG of its own output area; in a reopened notebook
the style sheet is gone with the widget, and the picture shows. After a kernel restart the
style sheet hides the dead controls instead, says to run the cell again, and the picture shows.
"""

from __future__ import annotations

import base64

from .drawing import Drawing
from .render import new_figure, png

# After a kernel restart the widget's view stays on the page without its model: ipywidgets
# marks every part of it `jupyter-widgets-disconnected` and clicks do nothing. Then the dead
# controls are hidden, a line says what happened, and the picture of the last state shows.
RESTART_NOTE = ("The kernel restarted, so this widget lost its state and its controls do "
                "nothing: run the cell again for a live one. Below: what it showed last.")
HIDE_WHEN_LIVE = (
    "<style>"
    ".jp-OutputArea:has(.flashedu-live:not(.jupyter-widgets-disconnected)) > "
    ".jp-OutputArea-child:has(.jp-RenderedImage) { display: none; }"
    ".flashedu-live.jupyter-widgets-disconnected > * { display: none !important; }"
    ".flashedu-live.jupyter-widgets-disconnected::before {"
    f" content: '{RESTART_NOTE}'; font-family: var(--jp-ui-font-family, sans-serif);"
    " font-size: var(--jp-content-font-size1, 14px); padding: 4px 0;"
    " color: var(--jp-warn-color0, #e65100); }"
    "</style>")


def stack_png(drawings: list[Drawing], title: str) -> bytes:
    """The first drawing on top, the others side by side below it, with a title."""
    top, rest = drawings[0], drawings[1:]
    title_h = 24.0
    row_w = sum(d.width for d in rest)
    row_h = max((d.height for d in rest), default=0.0)
    W, H = max(top.width, row_w, 7.0 * len(title) + 20), title_h + top.height + row_h
    fig = new_figure(W / 90, H / 90)
    fig.set_layout_engine("none")
    fig.text(0.01, 1 - 12 / H, title, fontsize=9, va="center", color="#333")

    def place(d: Drawing, x: float, y: float):
        ax = fig.add_axes((x / W, 1 - (y + d.height) / H, d.width / W, d.height / H))
        d.draw_into(ax)

    place(top, 0.0, title_h)
    x = 0.0
    for d in rest:
        place(d, x, title_h + top.height)
        x += d.width
    return png(fig)


def message_png(text: str) -> bytes:
    fig = new_figure(7.0, 0.5)
    fig.set_layout_engine("none")
    fig.text(0.01, 0.5, text, fontsize=9, va="center", color="#b00")
    return png(fig)


def _bundle(owner) -> dict:
    data = owner.static_png()
    caption = owner.static_caption() if hasattr(owner, "static_caption") else ""
    return {"image/png": base64.b64encode(data).decode("ascii"),
            "text/plain": f"<static picture of {type(owner).__name__}"
                          + (f" ({caption})" if caption else "")
                          + ": run the cell for the live widget>"}


def display_with_fallback(owner) -> None:
    """Display ``owner.widget`` and, below it, the static picture (kept up to date)."""
    from IPython.display import display

    display(owner.widget)
    owner._static_handle = display(_bundle(owner), raw=True, display_id=True)


def update(owner) -> None:
    """Redraw the static picture of ``owner`` if it has been displayed."""
    handle = getattr(owner, "_static_handle", None)
    if handle is not None:
        handle.update(_bundle(owner), raw=True)
