"""flashedu: FlashAttention from the naive formula to a fast Triton kernel.

    import flashedu
    out = flashedu.attention(q, k, v, is_causal=True)          # like F.scaled_dot_product_attention
    out = flashedu.attention(q, k, v, block_mask=flashedu.BlockMask.causal((N, N)))
    window = flashedu.BlockMask.from_mask_mod(flashedu.mods.sliding_window(256), None, None, N, N)
    out = flashedu.attention(q, k, v, block_mask=window, score_mod=flashedu.mods.softcap(30.0))
    out = flashedu.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)  # packed
    out = flashedu.decode.paged_attention(q, k_cache, v_cache, block_table, cache_seqlens)

Every stage of the course is importable: flashedu.reference (naive, softmax), flashedu.tiled
(NumPy FlashAttention), flashedu.numba_kernels, flashedu.triton, flashedu.io (HBM traffic).
flashedu.ops is the one autograd path to the kernels, and their torch.library operators
(torch.compile, meta tensors, vmap).
"""

from . import runtime

runtime.configure()  # before anything can import triton or numba: decides CPU emulation

__version__ = "0.1.0"
# the backends by name; the registry itself is flashedu.backends.BACKENDS (a test holds them equal)
BACKEND_NAMES = ("naive", "numpy", "numba", "triton")

__all__ = ["attention", "varlen_attention", "BlockMask", "mods", "BACKEND_NAMES", "available_backends", "__version__"]

# The API's names and the other modules come as attributes on first use: ``import flashedu``
# imports neither torch nor triton nor numba, so a NumPy notebook, the grader's command line
# and a learner's first cell start in a fraction of a second, and triton and numba come after
# runtime.configure(). A backend's module registers its kernels as torch.ops.flashedu.*
# operators when it loads (flashedu.backends.BACKENDS[name].load()).
API = {"attention": "api", "varlen_attention": "varlen", "BlockMask": "masks", "BACKENDS": "backends",
       "available_backends": "backends"}
SUBMODULES = ("ops", "mods", "api", "varlen", "arguments", "masks", "backends", "reference", "tiled",
              "trace", "io", "roofline", "merge", "decode", "distributed", "dropout", "tolerance",
              "numpy_backend", "numba_kernels", "triton", "triton_backend", "models", "viz",
              "checks", "course", "progress", "bench", "benchmarks", "cli", "tour")


def __getattr__(name):
    import importlib

    if name in API:
        value = getattr(importlib.import_module(f"{__name__}.{API[name]}"), name)
        globals()[name] = value
        return value
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *API, *SUBMODULES})
