"""The roofline model, measured on the machine you are sitting at.

A kernel that does F floating-point operations while moving B bytes to and from main memory has
arithmetic intensity I = F / B (FLOP per byte). On a machine with peak compute P (FLOP/s) and
memory bandwidth W (byte/s) it can run at most

    attainable(I) = min(P, W * I)

FLOP/s: below the ridge point I* = P / W it waits on memory (memory-bound), above it on the
arithmetic units (compute-bound). This module measures P and W where the course runs (NumPy on
the CPU, torch on a CUDA GPU when there is one), lists the steps of standard attention with
their FLOPs and bytes, and draws the picture.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

# ----------------------------------------------------------------------------------------
# The model.
# ----------------------------------------------------------------------------------------


def attainable_flops(peak_flops: float, bandwidth: float, intensity):
    """min(peak, bandwidth * intensity), in the units of ``peak_flops`` (FLOP/s).

    ``bandwidth`` in byte/s, ``intensity`` in FLOP/byte (scalar or array)."""
    return np.minimum(peak_flops, bandwidth * np.asarray(intensity, dtype=float))


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """Arithmetic intensity (FLOP/byte) where the roofline turns from slope to flat."""
    return peak_flops / bandwidth


@dataclass(frozen=True)
class KernelStep:
    """One kernel of a computation: its FLOPs and the bytes it moves to/from main memory."""

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


# FLOPs per element of the elementwise/reduction steps (a convention: each compare, add,
# multiply, exp counts as one operation).
MASK_FLOPS_PER_ELEMENT = 1  # one select
SOFTMAX_FLOPS_PER_ELEMENT = 5  # max, subtract, exp, sum, divide
DROPOUT_FLOPS_PER_ELEMENT = 2  # compare with a random number, multiply by 1/(1-p)


def naive_attention_steps(N: int, d: int, itemsize: int = 2, Nk: int | None = None,
                          mask: bool = True, dropout: bool = True) -> list[KernelStep]:
    """The kernels of standard attention for one head, as a framework runs them one by one.

    Every step reads its inputs from main memory (HBM) and writes its output back:
      S = Q K^T          reads Q, K     writes S      2 N Nk d FLOPs
      mask(S)            reads S        writes S      1 per element
      P = softmax(S)     reads S        writes P      5 per element
      dropout(P)         reads P        writes P      2 per element (the random bits not counted)
      O = P V            reads P, V     writes O      2 N Nk d FLOPs
    Without mask and dropout this is the paper's Algorithm 0 (4 N d + 4 N Nk elements moved).
    """
    Nk = N if Nk is None else Nk
    NN = N * Nk
    steps = [KernelStep("S = QK^T", 2 * NN * d, (N * d + Nk * d + NN) * itemsize)]
    if mask:
        steps.append(KernelStep("mask", MASK_FLOPS_PER_ELEMENT * NN, 2 * NN * itemsize))
    steps.append(KernelStep("softmax", SOFTMAX_FLOPS_PER_ELEMENT * NN, 2 * NN * itemsize))
    if dropout:
        steps.append(KernelStep("dropout", DROPOUT_FLOPS_PER_ELEMENT * NN, 2 * NN * itemsize))
    steps.append(KernelStep("O = PV", 2 * NN * d, (NN + Nk * d + N * d) * itemsize))
    return steps


def roofline_time(step: KernelStep, peak_flops: float, bandwidth: float) -> float:
    """The least time a step can take: max(FLOPs / peak, bytes / bandwidth), in seconds."""
    return max(step.flops / peak_flops, step.bytes / bandwidth)


# ----------------------------------------------------------------------------------------
# Measuring the machine.
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """A measured machine: peak (matmul) FLOP/s and copy bandwidth in byte/s."""

    device: str
    flops: float
    bandwidth: float
    detail: dict

    @property
    def ridge(self) -> float:
        return ridge_point(self.flops, self.bandwidth)


def _best_time(fn, repeats: int, sync=None) -> float:
    fn()  # warm up (page faults, lazy init)
    if sync:
        sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t0)
    return best


def numpy_copy_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of ``np.copyto`` between two float32 arrays of ``nbytes`` each.

    A copy reads nbytes and writes nbytes, so 2 * nbytes move per copy. Arrays much larger than
    the CPU caches (the default is 64 MiB) measure main-memory (DRAM) bandwidth."""
    n = max(1, nbytes // 4)
    src = np.ones(n, dtype=np.float32)
    dst = np.empty_like(src)
    t = _best_time(lambda: np.copyto(dst, src), repeats)
    return 2 * src.nbytes / t


def numpy_matmul_flops(n: int = 1024, dtype=np.float32, repeats: int = 3) -> float:
    """FLOP/s of an n x n by n x n NumPy matmul (2 n^3 FLOPs): the BLAS peak, near enough."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    out = np.empty((n, n), dtype=dtype)
    t = _best_time(lambda: np.matmul(a, b, out=out), repeats)
    return 2 * n**3 / t


def torch_copy_bandwidth(device: str = "cuda", nbytes: int = 1 * 2**30, repeats: int = 10) -> float:
    """Bytes/s of ``dst.copy_(src)`` on a torch device (2 * nbytes moved per copy)."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else None
    t = _best_time(lambda: dst.copy_(src), repeats, sync)
    return 2 * src.numel() * src.element_size() / t


def torch_matmul_flops(device: str = "cuda", n: int = 8192, dtype=None, repeats: int = 10) -> float:
    """FLOP/s of an n x n torch matmul (fp16 on a GPU, so tensor cores are used)."""
    import torch

    dtype = dtype or (torch.float16 if device != "cpu" else torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if a.is_cuda else None
    t = _best_time(lambda: a @ b, repeats, sync)
    return 2 * n**3 / t


def measure_cpu(copy_bytes: int = 64 * 2**20, matmul_n: int = 1024) -> Measured:
    """Measure this CPU with NumPy: float32 matmul FLOP/s and copy bandwidth."""
    bw = numpy_copy_bandwidth(copy_bytes)
    fl = numpy_matmul_flops(matmul_n)
    return Measured("cpu (numpy)", fl, bw, {"copy_bytes": copy_bytes, "matmul_n": matmul_n,
                                            "dtype": "float32"})


def measure_cuda(copy_bytes: int = 2**30, matmul_n: int = 8192) -> Measured:
    """Measure the current CUDA GPU with torch: fp16 matmul FLOP/s and copy bandwidth."""
    import torch

    bw = torch_copy_bandwidth("cuda", copy_bytes)
    fl = torch_matmul_flops("cuda", matmul_n)
    return Measured(torch.cuda.get_device_name(), fl, bw,
                    {"copy_bytes": copy_bytes, "matmul_n": matmul_n, "dtype": "float16"})


# ----------------------------------------------------------------------------------------
# The picture.
# ----------------------------------------------------------------------------------------


def plot_roofline(ax, peak_flops: float, bandwidth: float, label: str = "", points=(),
                  intensity_range=(0.05, 2000.0), color=None, unit: float = 1e9):
    """Draw a roofline on a log-log matplotlib ``ax``; ``points`` are (name, intensity, flops)
    triples (achieved FLOP/s, or None to place the point on the roof). Values are divided by
    ``unit`` (1e9: GFLOP/s; 1e12: TFLOP/s)."""
    x = np.geomspace(*intensity_range, 200)
    line, = ax.loglog(x, attainable_flops(peak_flops, bandwidth, x) / unit, color=color,
                      label=label or None)
    ax.axvline(ridge_point(peak_flops, bandwidth), color=line.get_color(), ls=":", lw=0.8)
    for name, intensity, flops in points:
        y = attainable_flops(peak_flops, bandwidth, intensity) if flops is None else flops
        ax.plot(intensity, y / unit, "o", color=line.get_color())
        ax.annotate(name, (intensity, y / unit), textcoords="offset points", xytext=(4, -10),
                    fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("GFLOP/s" if unit == 1e9 else "TFLOP/s" if unit == 1e12 else "FLOP/s")
    return ax
