"""The registry of attention backends: where each lives, and what it can do.

Every backend is a function with one signature, called by :func:`flashedu.attention` after the
inputs have been checked:

    fn(q, k, v, *, is_causal: bool, scale: float, block_mask: BlockMask | None,
       dropout_p: float) -> Tensor

q is (B, H, Nq, d); k and v are (B, Hkv, Nk, d) with H a multiple of Hkv (grouped-query
attention: query head h reads K/V head h // (H // Hkv)). ``is_causal`` already includes the block
mask's own causal flag. Modules are imported only when a backend is first used, so that triton
and numba are imported after :mod:`flashedu.runtime` has decided how they run.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from . import runtime


@dataclass(frozen=True)
class Backend:
    name: str
    module: str  # module holding the function
    function: str
    has_backward: bool
    has_dropout: bool
    runs_on: str  # "cpu", "gpu" (emulated on CPU without one), or "any"

    def load(self):
        return getattr(importlib.import_module(self.module), self.function)

    def where(self) -> str:
        gpu = runtime.configure()["gpu"]
        if self.name == "triton":
            return "CUDA GPU (compiled)" if gpu else "CPU, Triton interpreter (TRITON_INTERPRET=1)"
        if self.name == "numba":
            return "CUDA GPU (compiled)" if gpu else "CPU, numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
        if self.name == "naive":
            return "the input's device (torch ops)"
        return "CPU (NumPy)"


BACKENDS: dict[str, Backend] = {
    "naive": Backend("naive", "flashedu.reference", "naive_attention_torch", True, True, "any"),
    "numpy": Backend("numpy", "flashedu.numpy_backend", "attention", True, False, "cpu"),
    "numba": Backend("numba", "flashedu.numba_kernels", "attention", False, False, "gpu"),
    "triton": Backend("triton", "flashedu.triton", "attention", True, False, "gpu"),
}


def available_backends() -> dict[str, str | None]:
    """name -> None if the backend imports, else the reason it does not."""
    status = {}
    for name, spec in BACKENDS.items():
        try:
            spec.load()
            status[name] = None
        except Exception as exc:  # noqa: BLE001 - any import failure makes it unavailable
            status[name] = f"{type(exc).__name__}: {exc}"
    return status


def resolve_backend(name: str) -> str:
    """Map "auto" to a concrete backend: triton on a CUDA GPU, numpy on the CPU."""
    if name == "auto":
        return "triton" if runtime.configure()["gpu"] else "numpy"
    return name


def backends_with_backward() -> list[str]:
    return [name for name, spec in BACKENDS.items() if spec.has_backward]
