"""The registry of attention backends: where each lives, and what it can do.

Every backend is a function with one signature, called by :func:`flashedu.attention` after the
inputs have been checked:

    fn(q, k, v, *, is_causal: bool, scale: float, block_mask: BlockMask | None,
       dropout_p: float) -> Tensor

q is (B, H, Nq, d); k and v are (B, Hkv, Nk, d) with H a multiple of Hkv (grouped-query
attention: query head h reads K/V head h // (H // Hkv)). ``is_causal`` already includes the block
mask's own causal flag.

Each backend's module is imported by a plain import inside its loader, on first use, so that
triton and numba are imported after :mod:`flashedu.runtime` has decided how they run. A plain
import is also what ``torch.compile`` traces through: the call from ``flashedu.attention`` to the
kernel stays in one graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import runtime


def _naive():
    from .reference import naive_attention_torch

    return naive_attention_torch


def _numpy():
    from .numpy_backend import attention

    return attention


def _numba():
    from .numba_kernels import attention

    return attention


def _triton():
    from .triton import attention

    return attention


@dataclass(frozen=True)
class Backend:
    name: str
    loader: Callable  # imports the backend's module and returns its entry point
    has_backward: bool
    has_dropout: bool
    runs_on: str  # "cpu", "gpu" (emulated on CPU without one), or "any"

    def load(self):
        """The backend's entry point (its module is imported on the first call)."""
        return self.loader()

    def where(self) -> str:
        return runtime.where(self.name)


BACKENDS: dict[str, Backend] = {
    "naive": Backend("naive", _naive, True, True, "any"),
    "numpy": Backend("numpy", _numpy, True, True, "cpu"),
    "numba": Backend("numba", _numba, False, False, "gpu"),
    "triton": Backend("triton", _triton, True, True, "gpu"),
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
        return runtime.auto_backend()
    return name


def backends_with_backward() -> list[str]:
    return [name for name, spec in BACKENDS.items() if spec.has_backward]


def report() -> list[str]:
    """The backend lines of ``flashedu doctor``: each backend and what it runs on."""
    lines = ["backends:"]
    available = available_backends()
    for name, spec in BACKENDS.items():
        status = available.get(name)
        where = spec.where() if status is None else f"unavailable ({status})"
        lines.append(f"  {name:<7}{where}")
    lines.append(f"  auto   -> {resolve_backend('auto')}")
    return lines


runtime.add_report(report)
