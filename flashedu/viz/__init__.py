"""Widgets that make FlashAttention's tiles and SRAM visible (ipywidgets + matplotlib).

    from flashedu.viz import TileLoopStepper, SRAMOccupancy, BlockMaskEditor
    TileLoopStepper()      # step through the (i, j) loop of a traced flash_forward run
    SRAMOccupancy()        # what one thread block holds in shared memory, against a real GPU
    BlockMaskEditor()      # click tiles of a block-sparse mask; model, check and time it
    compare_trace(my_flash_forward, Q, K, V, 16, 16)   # your kernel beside the reference
    trace_kernel(my_kernel, (Tr,), Q, K, V, ...)      # your GPU kernel's loads and stores
    trace.compare("O", O_expected)                  # the first store that wrote a wrong element

One notebook, one state: ``TileLoopStepper(state=editor.state)`` and
``SRAMOccupancy(state=editor.state)`` follow a mask editor (:mod:`flashedu.viz.state`).

Each widget displays itself (or its ``.widget``) and keeps its state in plain attributes, so
tests drive it without a browser. The numbers come from :mod:`flashedu.trace` and
:mod:`flashedu.io`, the same code the IO tests check.

The widget classes are imported lazily: the pure modules here (``timeline``, ``presets``,
``block_sparse``, ``learner_trace``) work where ipywidgets is not installed, e.g. on a bare GPU
machine.
"""

from __future__ import annotations

import importlib

_WIDGETS = {
    "TileLoopStepper": "stepper",
    "SRAMOccupancy": "sram",
    "BlockMaskEditor": "mask_editor",
    "CompareView": "compare_view",
    "compare_trace": "learner_trace",  # pure: no ipywidgets until the result is displayed
    "SharedMask": "state",
    "trace_kernel": "kernel_trace",  # pure: no ipywidgets until the trace is displayed
    "KernelTraceView": "kernel_view",
}

__all__ = list(_WIDGETS)


def __getattr__(name):
    if name in _WIDGETS:
        return getattr(importlib.import_module(f".{_WIDGETS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
