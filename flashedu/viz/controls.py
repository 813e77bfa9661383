"""Setting several controls of a widget at once, with one redraw instead of one per control."""

from __future__ import annotations


def set_quietly(owner, assignments) -> None:
    """Set ``widget.value = value`` for each pair while ``owner``'s observers stand still.

    Each widget's observers check ``owner._holding`` and skip their redraw while it is True; the
    caller redraws once afterwards.
    """
    owner._holding = True
    try:
        for widget, value in assignments:
            widget.value = value
    finally:
        owner._holding = False
