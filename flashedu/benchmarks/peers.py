"""Who runs a benchmark case: flashedu's triton backend, naive torch, SDPA's backends (each
selected explicitly), FlexAttention, or the triton backend of another checkout (``--baseline``);
the case itself and its block-sparse masks. Shared by ``flashedu bench`` (:mod:`flashedu.bench`)
and its subcommands."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from . import core

PROVIDERS = ("flashedu", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
# flashedu-dispatch: flashedu with every launch through Triton's own dispatch (no cached
# compiled kernels); baseline: the triton backend of another checkout (``--baseline``).
EXTRA_PROVIDERS = ("flashedu-dispatch", "baseline")
SPARSE_PROVIDERS = ("flashedu", "flex", "baseline")
MASK_BLOCK = 128  # block size of the block-sparse masks (FlexAttention's default)


@dataclass(frozen=True)
class Case:
    n: int
    d: int
    causal: bool
    mode: str  # "fwd" or "bwd"
    density: float | None  # None: dense; else block-sparse with this fraction of tiles
    dtype: str

    @property
    def B(self) -> int:
        return core.batch_heads(self.n, self.d)[0]

    @property
    def H(self) -> int:
        return core.batch_heads(self.n, self.d)[1]

    def flops(self) -> float:
        return core.attention_flops(self.B, self.H, self.n, self.n, self.d, causal=self.causal,
                                    mode=self.mode, density=self.density)

    def label(self) -> str:
        kind = "causal" if self.causal else "dense"
        if self.density is not None:
            kind = f"sparse {self.density:g}"
        return f"N={self.n} d={self.d} {kind} {self.mode}"


# ----------------------------------------------------------------------------------------
# Masks and the function each provider runs
# ----------------------------------------------------------------------------------------


def random_block_mask(n: int, density: float, seed: int = 0):
    """A BlockMask with the same number of tiles in every Q row (balanced work per program)."""
    import numpy as np

    from ..masks import BlockMask

    T = math.ceil(n / MASK_BLOCK)
    per_row = max(1, round(density * T))
    rng = np.random.default_rng(seed)
    blocks = np.zeros((T, T), dtype=bool)
    for r in range(T):
        blocks[r, rng.choice(T, per_row, replace=False)] = True
    return BlockMask.from_dense(blocks, (MASK_BLOCK, MASK_BLOCK), (n, n))


def make_forward(provider: str, case: Case, q, k, v):
    """A zero-argument function computing the case's attention with ``provider``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashedu
    from flashedu.masks import BlockMask
    from flashedu.reference import naive_attention_torch

    mask = random_block_mask(case.n, case.density) if case.density is not None else None
    if provider == "flashedu":
        return lambda: flashedu.attention(q, k, v, is_causal=case.causal, block_mask=mask,
                                          backend="triton")
    if provider == "flashedu-dispatch":
        from flashedu.triton import fast

        def dispatched():  # the kernels launched through Triton's dispatch every time
            fast.FAST_LAUNCH = False
            try:
                return flashedu.attention(q, k, v, is_causal=case.causal, block_mask=mask,
                                          backend="triton")
            finally:
                fast.FAST_LAUNCH = True
        return dispatched
    if provider == "baseline":  # the other checkout, through its public API as "flashedu"
        other = baseline_package()
        other_mask = None if mask is None else other.BlockMask.from_dense(
            mask.blocks, mask.block_size, mask.seq_lens)
        return lambda: other.attention(q, k, v, is_causal=case.causal, block_mask=other_mask,
                                       backend="triton")
    if provider == "naive":
        return lambda: naive_attention_torch(q, k, v, is_causal=case.causal, upcast=False)
    if provider.startswith("sdpa-"):
        backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION,
                   "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                   "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[provider]

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
        return run
    if provider == "flex":
        if mask is None and case.causal:
            mask = BlockMask.causal((case.n, case.n), (MASK_BLOCK, MASK_BLOCK))
        elif mask is None:  # all tiles: the same compiled kernel as the block-sparse cases
            mask = random_block_mask(case.n, 1.0)
        flex_mask = None if mask is None else mask.to_flex(device=q.device)
        from .core import compiled_flex

        flex = compiled_flex()
        return lambda: flex(q, k, v, block_mask=flex_mask)
    raise ValueError(f"provider must be one of {PROVIDERS + EXTRA_PROVIDERS}, got {provider!r}")


_BASELINE = {"path": None, "module": None}


def set_baseline(path) -> None:
    """Time the triton backend of another flashedu checkout too (provider "baseline"): ``path``
    is that checkout's package folder (the one holding its ``__init__.py``)."""
    import os

    if not os.path.isfile(os.path.join(path, "__init__.py")):
        raise ValueError(f"--baseline: {path!r} is not a package folder (no __init__.py)")
    _BASELINE.update(path=path, module=None)


def baseline_package():
    """The package of ``set_baseline``, imported once as ``flashedu_baseline``."""
    import importlib.util
    import os

    if _BASELINE["module"] is None:
        if _BASELINE["path"] is None:
            raise ValueError("provider 'baseline' needs --baseline PATH")
        spec = importlib.util.spec_from_file_location(
            "flashedu_baseline", os.path.join(_BASELINE["path"], "__init__.py"),
            submodule_search_locations=[_BASELINE["path"]])
        module = importlib.util.module_from_spec(spec)
        sys.modules["flashedu_baseline"] = module
        spec.loader.exec_module(module)
        _BASELINE["module"] = module
    return _BASELINE["module"]




def check_baseline(parser, args) -> None:
    """--baseline adds the "baseline" provider; asking for it without a path is an error."""
    if args.baseline is not None:
        try:
            set_baseline(args.baseline)
        except ValueError as exc:
            parser.error(str(exc))
        if "baseline" not in args.providers:
            args.providers.insert(1, "baseline")
    elif "baseline" in args.providers:
        parser.error("provider 'baseline' needs --baseline PATH")
