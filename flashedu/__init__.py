"""flashedu: FlashAttention from the naive formula to a fast Triton kernel.

    import flashedu
    out = flashedu.attention(q, k, v, is_causal=True)          # like F.scaled_dot_product_attention
    out = flashedu.attention(q, k, v, block_mask=flashedu.BlockMask.causal((N, N)))

Every stage of the course is importable: flashedu.reference (naive, softmax), flashedu.tiled
(NumPy FlashAttention), flashedu.numba_kernels, flashedu.triton, flashedu.io (HBM traffic).
"""

from . import runtime

runtime.configure()  # before anything can import triton or numba: decides CPU emulation

from .api import attention  # noqa: E402
from .backends import BACKENDS, available_backends  # noqa: E402
from .masks import BlockMask  # noqa: E402

__version__ = "0.1.0"
backends = tuple(BACKENDS)

__all__ = ["attention", "BlockMask", "backends", "available_backends", "__version__"]
