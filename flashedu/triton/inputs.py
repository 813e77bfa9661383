"""What the Triton kernels take: float16, bfloat16 or float32; a head dim up to MAX_HEAD_DIM;
CPU tensors while Triton runs in its interpreter, CUDA tensors when it compiles. Checked by the
backend's entry point and by split-KV decoding before any launch."""

from __future__ import annotations

import torch

from .. import runtime
from .config import MAX_HEAD_DIM

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check(q, k, v):
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k, v: the triton backend takes {[str(t) for t in SUPPORTED_DTYPES]}, "
                        f"got {q.dtype}")
    d = q.shape[-1]
    if d > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim d={d} is not supported by the triton backend "
                         f"(1 <= d <= {MAX_HEAD_DIM})")
    if _shapes_only(q):  # the operator's fake implementation runs, wherever they "are"
        return
    if runtime.triton_interpreted():
        if q.device.type != "cpu":
            raise ValueError(f"q, k, v must be CPU tensors while Triton runs in its interpreter "
                             f"(TRITON_INTERPRET=1), got device {q.device}")
    elif q.device.type != "cuda":
        raise ValueError(f"q, k, v must be CUDA tensors for the compiled triton backend, got "
                         f"device {q.device}; move them with .cuda()")


def _shapes_only(t) -> bool:
    """A meta tensor, or a fake one (FakeTensorMode, torch.compile's tracing): shapes, no data.
    A fake tensor reports the device it stands for (often the CPU), which says nothing about
    where the kernels would run."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type == "meta" or isinstance(t, FakeTensor)
