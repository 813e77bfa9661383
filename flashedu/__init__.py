"""flashedu: FlashAttention from the naive formula to a fast Triton kernel.

    import flashedu
    out = flashedu.attention(q, k, v, is_causal=True)          # like F.scaled_dot_product_attention
    out = flashedu.attention(q, k, v, block_mask=flashedu.BlockMask.causal((N, N)))
    window = flashedu.BlockMask.from_mask_mod(flashedu.mods.sliding_window(256), None, None, N, N)
    out = flashedu.attention(q, k, v, block_mask=window, score_mod=flashedu.mods.softcap(30.0))

Every stage of the course is importable: flashedu.reference (naive, softmax), flashedu.tiled
(NumPy FlashAttention), flashedu.numba_kernels, flashedu.triton, flashedu.io (HBM traffic).
flashedu.ops holds the kernels as torch.library operators (torch.compile, meta tensors, vmap).
"""

from . import runtime

runtime.configure()  # before anything can import triton or numba: decides CPU emulation

from . import ops  # noqa: E402,F401  torch.ops.flashedu.*: the kernels as PyTorch operators
from . import mods  # noqa: E402  mask mods and score mods (FlexAttention's)
from .api import attention  # noqa: E402
from .backends import BACKENDS, available_backends  # noqa: E402
from .masks import BlockMask  # noqa: E402

__version__ = "0.1.0"
# ("naive", "numpy", "numba", "triton"); the registry itself is the module flashedu.backends
BACKEND_NAMES = tuple(BACKENDS)

__all__ = ["attention", "BlockMask", "mods", "BACKEND_NAMES", "available_backends", "__version__"]

# The other modules, as attributes on first use (``flashedu.merge.merge(...)`` after a bare
# ``import flashedu``): imported only then, so that ``import flashedu`` stays light and triton
# and numba come after runtime.configure().
SUBMODULES = ("reference", "tiled", "trace", "io", "roofline", "merge", "distributed", "dropout",
              "tolerance", "numpy_backend", "numba_kernels", "triton", "models", "viz", "checks",
              "course", "bench", "benchmarks", "cli", "tour")


def __getattr__(name):
    if name in SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
