"""FlashAttention in Triton: the course's last stage, the kernels of the "triton" backend.

    forward.py   one program per (Q tile, batch*head), FlashAttention-2 order, exp2 softmax
    backward.py  D = rowsum(dO * O), then dK/dV (K/V-outer) and dQ (Q-outer): no atomics
    launch.py    the host side: outputs, float32 copies, launch plans, smaller tiles on retry
    decode.py    split-KV decoding: a few queries against a long K/V cache
    autograd.py  the tile table entry of a call (tiles fitted to a block mask); the autograd
                 link of forward and backward is flashedu.ops (torch.library operators)
    sparse.py    BlockMask -> per-tile index lists (kv_indices, q_indices)
    config.py    tile sizes per head dim
    fast.py      launching: compiled kernels started directly, a plan of each call's
                 launches, Hopper's copy engine (TMA) and warp specialization
    ablations.py slower variants, only to be measured against the kernels (notebook 10)

The backend's entry point and the repeat of a plain call (an earlier call's signature: from
flashedu.attention straight to its launches) are :mod:`flashedu.triton_backend`, above
:mod:`flashedu.ops`, which calls these kernels.

On a machine without a CUDA GPU the same kernels run in Triton's interpreter on CPU tensors
(``flashedu.runtime`` sets TRITON_INTERPRET=1 before triton is imported). The interpreter's
16-bit tl.dot is unreliable, so there the launch code hands the kernels float32 copies of
16-bit inputs and casts the results back (``launch.interpreter_fp32``).
"""

from __future__ import annotations

from .config import MAX_HEAD_DIM

__all__ = ["MAX_HEAD_DIM"]
