"""The registry of attention backends: where each lives, and what it can do.

Every backend is a function with one signature, called by :func:`flashedu.attention` after the
inputs have been checked:

    fn(q, k, v, *, is_causal: bool, scale: float, block_mask: BlockMask | None,
       dropout_p: float) -> Tensor

q is (B, H, Nq, d); k and v are (B, Hkv, Nk, d) with H a multiple of Hkv (grouped-query
attention: query head h reads K/V head h // (H // Hkv)). ``is_causal`` already includes the block
mask's own causal flag.

Features beyond that are keyword arguments that a backend receives only when the call uses
them, and only when its flag below says it has them (:func:`flashedu.attention` refuses the call
otherwise, naming the backends that do): ``attn_mask`` (SDPA's, a bool or float tensor
broadcastable to (B, H, Nq, Nk)), ``score_mod`` (a :mod:`flashedu.mods` score mod, already
bound to (Nq, Nk)), ``return_lse=True`` (return ``(out, lse)``, lse natural-log (B, H, Nq)),
``sinks`` (a (H,) tensor of sink logits), ``seqs`` (packed variable-length sequences that the
kernels find from their cuts, :class:`flashedu.varlen.Packing`; :func:`flashedu.varlen_attention`
hands them to a backend with ``has_packed``, a block mask of the packing to the others).
A block mask whose partial tiles need its mask mod (``block_mask.needs_mask_mod``) goes only to
a backend with ``has_mask_mod`` (or whose ``mask_mod_kinds`` compile that library kind). A
backend with a feature has it forward and backward.

The backends with kernels of their own (numpy, triton) describe them as a
:class:`flashedu.ops.Kernels` (forward, backward, their lse's convention, their outputs' layout,
what the backend does to a call first); their entry point is :func:`flashedu.ops.attention`
with those kernels, the one autograd path; naive is plain torch ops, which autograd
differentiates itself; numba has no backward.

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
    from .numpy_backend import KERNELS

    return KERNELS.entry


def _numba():
    from . import numba_kernels

    # its errors name the backends that have what it lacks
    numba_kernels.ALTERNATIVES.update(backward=tuple(backends_with_backward()),
                                      mask_mod=tuple(backends_with("mask_mod")))
    return numba_kernels.attention


def _triton():
    from .triton_backend import KERNELS

    return KERNELS.entry


def _triton_repeat():
    from .triton_backend import make_repeat

    return make_repeat


@dataclass(frozen=True)
class Backend:
    name: str
    loader: Callable  # imports the backend's module and returns its entry point
    has_backward: bool
    has_dropout: bool
    runs_on: str  # "cpu", "gpu" (emulated on CPU without one), or "any"
    has_attn_mask: bool = False  # SDPA's attn_mask, bool and float
    has_score_mod: bool = False  # any score mod (library and user), with its derivative
    has_mask_mod: bool = False  # any mask mod on the partial tiles of a block mask
    has_return_lse: bool = False  # return_lse=True
    has_sinks: bool = False  # sinks=, with their gradient
    has_packed: bool = False  # seqs=, packed sequences read from their cuts in the kernels
    # library mask mods (their ``kind``) compiled natively, when has_mask_mod is False
    mask_mod_kinds: frozenset = frozenset()
    # library score mods (their ``kind``) compiled natively, when has_score_mod is False
    score_mod_kinds: frozenset = frozenset()
    # attn_mask dtypes taken ("bool", "float"), when has_attn_mask is True
    attn_mask_kinds: frozenset = frozenset({"bool", "float"})
    # imports and returns make(q, k, v, is_causal, scale, block_mask): the repeat of a checked
    # plain call (no attn_mask, dropout, score mod or lse; a block mask, with its mask mod,
    # or none), which flashedu.attention keeps for its signature
    # and calls instead of the general path the next time (None: always the general path)
    repeater: Callable | None = None

    def load(self):
        """The backend's entry point (its module is imported on the first call)."""
        return self.loader()

    def where(self) -> str:
        return runtime.where(self.name)


BACKENDS: dict[str, Backend] = {
    "naive": Backend("naive", _naive, True, True, "any", has_attn_mask=True, has_score_mod=True,
                     has_mask_mod=True, has_return_lse=True, has_sinks=True),
    "numpy": Backend("numpy", _numpy, True, True, "cpu", has_attn_mask=True, has_score_mod=True,
                     has_mask_mod=True, has_return_lse=True, has_sinks=True),
    "numba": Backend("numba", _numba, False, False, "gpu"),
    # triton: any mask mod (its partial tiles' element masks are evaluated on the host), score
    # mods compiled into the kernels (the library's, and those written in Triton), attn_mask
    # (bool: as a mask mod; float: a bias read tile by tile)
    "triton": Backend("triton", _triton, True, True, "gpu", has_attn_mask=True,
                      has_score_mod=False, has_mask_mod=True, has_return_lse=True,
                      has_sinks=True, has_packed=True,
                      score_mod_kinds=frozenset({"softcap", "alibi", "triton"}),
                      repeater=_triton_repeat),
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


def resolve_backend(name: str, q=None) -> str:
    """Map "auto" to a concrete backend: triton on a CUDA GPU, numpy on the CPU. Given the
    query tensor ``q``, "auto" follows its device: CPU tensors take numpy on a GPU machine too,
    tensors of another device take naive (torch ops run wherever the tensors are)."""
    if name != "auto":
        return name
    device = getattr(getattr(q, "device", None), "type", None)
    if device is None or device == "cuda":
        return runtime.auto_backend()
    return "numpy" if device == "cpu" else "naive"


FEATURES = {"attn_mask": "has_attn_mask", "score_mod": "has_score_mod",
            "mask_mod": "has_mask_mod", "return_lse": "has_return_lse", "sinks": "has_sinks"}


def backends_with(feature: str) -> list[str]:
    """Names of the backends that implement ``feature`` (a key of FEATURES), forward and
    backward."""
    return [name for name, spec in BACKENDS.items() if getattr(spec, FEATURES[feature])]


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
        if name == "triton" and status is None:
            from .triton import fa3

            lines.append("         FlashAttention-3's forward and backward (Gluon): "
                         + fa3.status())
    lines.append(f"  auto   -> {resolve_backend('auto')}")
    return lines


runtime.add_report(report)
