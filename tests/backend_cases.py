"""What each backend can do, so that one test-suite can run them all.

Emulated backends (the Triton interpreter, the numba CUDA simulator) are slow on a CPU, so they
run a small subset of the shapes (``max_n``), but the same checks.
"""

from dataclasses import dataclass

import torch

import flashedu


@dataclass(frozen=True)
class Caps:
    dtypes: tuple  # input dtypes to test
    backward: bool  # has an autograd backward
    max_n: int  # largest Nq / Nk the CPU tests give it
    block_mask: bool = True  # supports flashedu.BlockMask
    min_d: int = 1  # smallest head dim supported


CAPS = {
    "naive": Caps((torch.float64, torch.float32), backward=True, max_n=10**9),
    "numpy": Caps((torch.float64, torch.float32), backward=True, max_n=10**9),
    "triton": Caps((torch.float32, torch.float16), backward=True, max_n=80, min_d=16),
    "numba": Caps((torch.float32,), backward=False, max_n=48),
}


def device(name):
    """Where the tests make this backend's tensors: the GPU for compiled Triton kernels, else
    the CPU (the interpreter, and numba, which copies to the device itself)."""
    if name == "triton":
        return flashedu.runtime.kernel_device()
    return torch.device("cpu")


def unavailable(name):
    """Why the backend cannot be imported here, or None."""
    return flashedu.available_backends()[name]
