"""Matplotlib charts of the widgets, each a function of plain data returning PNG bytes."""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import NullFormatter, ScalarFormatter

from .render import COLORS, new_figure, png
from .timeline import RowStats, Timeline


def run_chart(tl: Timeline, stats: RowStats) -> bytes:
    """The whole traced run: HBM bytes so far at each position, and the chosen row's m_i, l_i."""
    fig = new_figure(8.0, 2.4)
    left, right = fig.subplots(1, 2)
    x = np.arange(tl.done + 1)
    left.plot(x, tl.read_until / 1024, color="#4e79a7", label="read")
    left.plot(x, tl.written_until / 1024, color="#e15759", label="written")
    left.set_title(f"HBM KiB so far ({tl.trace.info['order']})", fontsize=9)
    left.set_xlabel("position (loop step; last = done)", fontsize=8)
    left.legend(fontsize=7, frameon=False)
    m = np.where(np.isfinite(stats.m), stats.m, np.nan)
    right.step(x, m, where="post", color="#59a14f", label="m_i (running max)")
    right.set_xlabel("position", fontsize=8)
    twin = right.twinx()
    twin.step(x, stats.l, where="post", color="#b07aa1", ls="--", label="l_i (running sum)")
    right.set_title(f"row {stats.row}: online-softmax statistics", fontsize=9)
    right.legend(handles=right.get_lines() + twin.get_lines(), fontsize=7, frameon=False,
                 loc="lower right")
    for ax in (left, right, twin):
        ax.tick_params(labelsize=7)
    return png(fig)


def sram_bar(footprint: dict, capacity: int, title: str) -> bytes:
    """A horizontal stacked bar of what one thread block keeps in shared memory, against the
    SM's capacity (the dashed line)."""
    fig = new_figure(8.0, 2.1)
    ax = fig.subplots()
    colors = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1"]
    start = 0.0
    for (name, nbytes), color in zip(footprint.items(), colors):
        ax.barh(0, nbytes / 1024, left=start, color=color, edgecolor="k", lw=0.5, label=name)
        start += nbytes / 1024
    total = start * 1024
    ax.axvline(capacity / 1024, color=COLORS["over"] if total > capacity else COLORS["ok"],
               ls="--", lw=2, label="SM capacity")
    ax.set_xlim(0, max(total, capacity) * 1.08 / 1024)
    ax.set_yticks([])
    ax.set_xlabel("KiB of shared memory (SRAM) per thread block", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    fig.legend(ncol=8, fontsize=7, frameon=False, loc="outside lower center")
    return png(fig)


def block_size_effect(tiles, traffic: dict, fits, chosen: int, largest: int, title: str,
                      chosen_label: str = "") -> bytes:
    """Predicted HBM traffic against the square tile size B (the paper's Fig. 2, middle):
    bigger tiles mean fewer passes over Q/O (FA1) or K/V (FA2), until SRAM runs out."""
    fig = new_figure(8.0, 2.5)
    ax = fig.subplots()
    tiles = np.asarray(tiles)
    for label, values in traffic.items():
        ax.plot(tiles, np.asarray(values) / 2**20, marker="o", ms=3, label=label)
    no_fit = tiles[~np.asarray(fits)]
    if no_fit.size:
        ax.axvspan(no_fit.min() - 8, tiles.max() + 8, color=COLORS["over"], alpha=0.12,
                   label="does not fit in SRAM")
    ax.axvline(chosen, color="k", lw=1, label=chosen_label or f"chosen B = {chosen}")
    if largest:
        ax.axvline(largest, color=COLORS["ok"], ls=":", lw=1.5, label=f"largest fitting B = {largest}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(tiles, [str(t) for t in tiles])
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("square tile Br = Bc = B", fontsize=8)
    ax.set_ylabel("HBM MiB (forward)", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return png(fig)
