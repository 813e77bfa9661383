"""The GPU-kernel exercises: a numba.cuda kernel and a Triton kernel of the FlashAttention forward.

The learner writes the kernel itself; the launchers below (shown in the notebooks) allocate the
outputs and launch it. On a laptop the kernels run in numba's CUDA simulator and in Triton's
interpreter (``import flashedu`` arranges both), so the cases stay small.

What the checks enforce beyond the values:
- bounds: inputs are views into buffers padded with NaN, and outputs into buffers padded with a
  sentinel, so a kernel that reads past the last row (a missing load mask) returns NaN and one
  that writes past it is caught; in numba's simulator an unguarded index raises IndexError;
- shared memory (numba, in the simulator): every read of K and V from global memory is counted.
  A block that stages K_j, V_j in shared memory reads each element once per block; a kernel
  where every thread reads K and V from global memory reads each element once per thread.
"""

from __future__ import annotations

import inspect
import math
import re

import numpy as np

from .. import reference, runtime
from .engine import Case, Exercise
from .numpy_exercises import (
    H_CAUSAL,
    H_EDGE,
    H_N1,
    H_NQNK,
    H_SCALE,
    H_TILES,
    H_WIDE,
    _inputs,
)
from .sandbox import call_limited

F32 = np.float32
SENTINEL = 12345.0  # written into the padding around the outputs; must survive the launch
PAD = 128  # rows of padding after each input and output: more than a tile or two past the end


# ----------------------------------------------------------------------------------------
# numba.cuda
# ----------------------------------------------------------------------------------------


def launch_numba_forward(kernel, Q, K, V, causal=False, scale=None, threads=32, out=None):
    """Run ``kernel(Q, K, V, O, L, scale, causal)`` on float32 arrays: one thread per query
    row, ``threads`` rows per block, ceil(Nq / threads) blocks. Returns (O, L).

    O and L start as NaN, so a row the kernel never writes shows up. ``out`` = (O, L) writes
    into given (device) arrays instead."""
    Nq, d = Q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if out is None:
        out = (np.full((Nq, d), np.nan, dtype=F32), np.full(Nq, np.nan, dtype=F32))
    O, L = out
    blocks = math.ceil(Nq / threads)
    kernel[(blocks,), (threads,)](Q, K, V, O, L, F32(scale), bool(causal))
    return O, L


class _CountedReads(np.ndarray):
    """A kernel argument that counts element reads. numba's simulator keeps the array's class
    when it copies it to the "device", so the count lives on a class made for each launch."""

    reads = 0

    def __getitem__(self, idx):
        value = super().__getitem__(idx)
        if not isinstance(value, np.ndarray):  # a single element read from global memory
            type(self).reads += 1
        return value


def _numba_invoke(fn, case, timeout, measure):
    if not runtime.numba_simulated():
        return _numba_invoke_gpu(fn, case, timeout, measure)
    # The simulator bounds-checks every index (IndexError) and lets us count reads.
    Q, K, V, causal, scale, threads = case.args
    K = K.view(type("K_counted", (_CountedReads,), {"reads": 0}))
    V = V.view(type("V_counted", (_CountedReads,), {"reads": 0}))
    call = call_limited(launch_numba_forward, (fn, Q, K, V, causal, scale, threads),
                        timeout=timeout, measure_memory=measure)
    call.reads = {"K": type(K).reads, "V": type(V).reads}
    return call


def _numba_invoke_gpu(fn, case, timeout, measure):
    """On a GPU nothing bounds-checks: the arrays are views into device buffers padded with
    NaN (inputs) and a sentinel (outputs), checked after the launch, as in the Triton check."""
    from numba import cuda

    q, k, v, causal, scale, threads = case.args

    def padded(a, fill):
        buf = np.full((a.shape[0] + PAD,) + a.shape[1:], fill, dtype=F32)
        buf[: a.shape[0]] = a
        return cuda.to_device(buf), buf

    ins = [padded(a, np.nan) for a in (q, k, v)]
    outs = [padded(np.full_like(a, np.nan), SENTINEL) for a in (q, q[:, 0])]

    def run():
        launch_numba_forward(fn, *(d[: len(a)] for (d, _), a in zip(ins, (q, k, v))), causal,
                             scale, threads, out=tuple(d[: len(q)] for d, _ in outs))
        cuda.synchronize()
        return tuple(d.copy_to_host()[: len(q)] for d, _ in outs)

    call = call_limited(run, timeout=timeout, measure_memory=measure)
    call.reads = None  # reads cannot be counted on a GPU
    if call.error is None and not call.timed_out:
        call.buffers = {"in": [(n, d.copy_to_host(), b) for n, (d, b) in zip("QKV", ins)],
                        "out": [(n, d.copy_to_host(), len(q)) for n, (d, _) in zip("OL", outs)]}
    return call


def _shared_memory_probe(case):
    Q, K, threads = case.args[0], case.args[1], case.args[5]
    Nq, Nk, d = Q.shape[0], K.shape[0], K.shape[1]
    per_block = math.ceil(Nq / threads) * Nk * d  # each element once per block

    def probe(call, outputs):
        if call.reads is None:  # on a real GPU reads cannot be counted; the simulator does it
            return _bounds_probe(call, outputs)
        for name, n in call.reads.items():
            if n > 2 * per_block:
                return (f"the answer is right, but your kernel read {name} from global memory "
                        f"{n} times: {n / (Nk * d):.1f} times each element, with "
                        f"{math.ceil(Nq / threads)} blocks of {threads} threads. Each block "
                        f"should copy a K_j, V_j tile into shared memory once "
                        "(cuda.shared.array, then cuda.syncthreads()) and let all its threads "
                        "read the tile there.")
        return None
    return probe


H_NUMBA = ("One thread per query row i, Br = blockDim.x rows per block. The block copies each "
           "K_j, V_j tile (BC rows) into shared memory, every thread helping, then "
           "cuda.syncthreads() before anyone reads it, and again before the next tile "
           "overwrites it. Each thread keeps m_i, l_i and its row of O_i in registers.")
H_NUMBA_GUARD = (" Threads past the last row (row >= Nq) and key rows past Nk (j >= Nk) must "
                 "not read or write; but every thread must still reach each syncthreads().")


def _numba_case(label, hint, shape, causal, scale, kind, threads, seed, **extra):
    (Q, K, V), (q, k, v) = _inputs(shape, kind, F32, seed)
    O, L = reference.naive_attention(Q, K, V, causal=causal, scale=scale)
    naive = reference.naive_attention(q, k, v, causal=causal, scale=scale)
    return Case(label, hint, (q, k, v, causal, scale, threads), ("O", "L"), (O, L), naive,
                inputs=("Q", "K", "V"), dtype=F32, probe=_bounds_probe, **extra)


def _numba_cases():
    T = 8  # threads per block: the simulator runs each as a Python thread
    cases = [
        _numba_case("one block, Nq=Nk=8, d=4", H_NUMBA, (8, 8, 4), False, None, "normal", T, 1),
        _numba_case("several K tiles, Nq=16, Nk=40", H_TILES, (16, 40, 4), False, None,
                    "normal", T, 2),
        _numba_case("edge: Nq=13, Nk=21", H_EDGE + H_NUMBA_GUARD, (13, 21, 8), False, None,
                    "normal", T, 3),
        _numba_case("N=1", H_N1 + H_NUMBA_GUARD, (1, 1, 4), False, None, "normal", T, 4),
        _numba_case("Nq=20 > Nk=6", H_NQNK + H_NUMBA_GUARD, (20, 6, 4), False, None, "normal", T, 5),
        _numba_case("explicit scale=0.3", H_SCALE, (9, 18, 4), False, 0.3, "normal", T, 6),
        _numba_case("logits in the hundreds", H_WIDE, (8, 24, 4), False, None, "wide", T, 7),
        _numba_case("causal, Nq=Nk=19", H_CAUSAL, (19, 19, 4), True, None, "normal", T, 8),
        _numba_case("causal, Nq=12, Nk=33", H_CAUSAL, (12, 33, 4), True, None, "normal", T, 9),
    ]
    shared = _numba_case("shared memory: Nq=Nk=32, 4 blocks of 8 threads", H_NUMBA,
                         (32, 32, 4), False, None, "normal", T, 10, needs_pass=True)
    shared.probe = _shared_memory_probe(shared)
    return cases + [shared]


def _numba_unavailable():
    try:
        from numba import cuda
    except Exception as exc:  # noqa: BLE001 - any import failure means: cannot check here
        return f"numba.cuda does not import ({exc})"
    if not runtime.numba_simulated() and not cuda.is_available():
        return "no CUDA GPU and NUMBA_ENABLE_CUDASIM is not 1 (import flashedu before numba)"
    return None


# ----------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------


def launch_triton_forward(kernel, Q, K, V, causal=False, scale=None, Br=16, Bc=16, out=None):
    """Run the Triton kernel on torch tensors Q (Nq, d), K, V (Nk, d) of float32:
    one program per Q tile of Br rows, grid (ceil(Nq / Br),). Returns (O, L).

    The kernel's signature: kernel(Q, K, V, O, L, scale, Nq, Nk, stride_q, stride_k, stride_v,
    stride_o, D: tl.constexpr, Br: tl.constexpr, Bc: tl.constexpr, CAUSAL: tl.constexpr),
    with D = d a power of two >= 16. ``out`` = (O, L) writes into given tensors."""
    import torch
    import triton

    Nq, d = Q.shape
    Nk = K.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if out is None:
        out = (torch.empty_like(Q), torch.empty(Nq, dtype=torch.float32, device=Q.device))
    O, L = out
    kernel[(triton.cdiv(Nq, Br),)](Q, K, V, O, L, float(scale), Nq, Nk, Q.stride(0),
                                   K.stride(0), V.stride(0), O.stride(0), D=d, Br=Br, Bc=Bc,
                                   CAUSAL=bool(causal))
    return O, L


def _padded(a, fill, device):
    """A torch view of ``a`` whose buffer has PAD more rows filled with ``fill``."""
    import torch

    buf = torch.full((a.shape[0] + PAD,) + a.shape[1:], fill, dtype=torch.float32)
    buf[: a.shape[0]] = torch.from_numpy(np.ascontiguousarray(a))
    buf = buf.to(device)
    return buf, buf[: a.shape[0]]


def _triton_invoke(fn, case, timeout, measure):
    import torch

    q, k, v, causal, scale, Br, Bc = case.args
    device = runtime.kernel_device()
    ins = [_padded(a, float("nan"), device) for a in (q, k, v)]
    outs = [_padded(np.zeros_like(a), SENTINEL, device) for a in (q, q[:, 0])]
    before = [buf.clone() for buf, _ in ins]

    def run():
        launch_triton_forward(fn, *(view for _, view in ins), causal, scale, Br, Bc,
                              out=tuple(view for _, view in outs))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return tuple(view.cpu().numpy().copy() for _, view in outs)

    call = call_limited(run, timeout=timeout, measure_memory=measure)
    call.buffers = {"in": [(name, buf, old) for name, (buf, _), old in zip("QKV", ins, before)],
                    "out": [(name, buf, n) for name, (buf, _), n in zip("OL", outs, (len(q),) * 2)]}
    return call


def _bounds_probe(call, outputs):
    """Inputs (padding included) unchanged, and nothing written past the end of O or L."""
    buffers = getattr(call, "buffers", None)
    if buffers is None:
        return None
    for name, buf, old in buffers["in"]:
        if not np.array_equal(_numpy(buf), _numpy(old), equal_nan=True):
            return f"your kernel wrote into its input {name}. Store only into O and L."
    for name, buf, n in buffers["out"]:
        if not (_numpy(buf)[n:] == SENTINEL).all():
            return (f"your kernel wrote past the end of {name} (rows >= Nq): guard or mask "
                    f"the store (rows < Nq).")
    return None


def _numpy(a):
    return a.cpu().numpy() if hasattr(a, "cpu") else np.asarray(a)


H_TRITON = ("One program per Q tile: load Q_i (Br x D) once, loop over K_j, V_j tiles of Bc "
            "rows, S_ij = tl.dot(Q_i, tl.trans(K_j)) * scale, online softmax on m_i, l_i, "
            "O_i += tl.dot(P_ij, V_j) after rescaling; store O_i / l_i and L_i = m_i + log(l_i).")
H_TRITON_MASK = (" Rows past Nq and keys past Nk: load with mask=... and other=0.0, set the "
                 "scores of keys >= Nk to -inf, and store with a mask. (Here the memory after "
                 "the last row holds NaN: an unmasked load brings it in.)")


def _triton_case(label, hint, shape, tiles, causal, scale, kind, seed):
    (Q, K, V), (q, k, v) = _inputs(shape, kind, F32, seed)
    O, L = reference.naive_attention(Q, K, V, causal=causal, scale=scale)
    on_gpu = not runtime.triton_interpreted()
    naive = (_naive_tf32 if on_gpu else reference.naive_attention)(q, k, v, causal=causal,
                                                                   scale=scale)
    return Case(label, hint, (q, k, v, causal, scale) + tiles, ("O", "L"), (O, L), naive,
                inputs=("Q", "K", "V"), dtype=F32, probe=_bounds_probe,
                floor_scale=100.0 if on_gpu else 1.0)  # TF32 dots: ~1e-3 relative


def _naive_tf32(q, k, v, causal, scale):
    """Plain attention on the GPU with TF32 matmuls, the precision tl.dot uses by default there.

    Its error sets the tolerance on a GPU: with logits in the hundreds, TF32 (10-bit mantissa)
    scores are off by ~|S| / 2000, so a correct kernel misses the float64 answer by far more
    than float32 arithmetic would."""
    import torch

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        q, k, v = (torch.from_numpy(a).cuda()[None, None] for a in (q, k, v))
        O, L = reference.naive_attention_torch(q, k, v, is_causal=causal, scale=scale,
                                               return_lse=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return O[0, 0].cpu().numpy(), L[0, 0].cpu().numpy()


def _triton_cases():
    d, t16, t = 16, (16, 16), _triton_case
    M = H_TRITON_MASK
    return [
        t("one tile, Nq=Nk=16", H_TRITON, (16, 16, d), t16, False, None, "normal", 1),
        t("several tiles, Nq=Nk=64", H_TILES, (64, 64, d), t16, False, None, "normal", 2),
        t("edge tiles, Nq=37, Nk=53", H_EDGE + M, (37, 53, d), t16, False, None, "normal", 3),
        t("N=1", H_N1 + M, (1, 1, d), t16, False, None, "normal", 4),
        t("Nq=10 < Nk=45", H_NQNK + M, (10, 45, d), t16, False, None, "normal", 5),
        t("Nq=45 > Nk=10", H_NQNK + M, (45, 10, d), t16, False, None, "normal", 6),
        t("Br=32, Bc=16", "Br and Bc differ: use each where it belongs.", (40, 40, d), (32, 16),
          False, None, "normal", 7),
        t("explicit scale=0.3", H_SCALE, (20, 30, d), t16, False, 0.3, "normal", 8),
        t("logits in the hundreds", H_WIDE, (24, 40, d), t16, False, None, "wide", 9),
        t("causal, Nq=Nk=64", H_CAUSAL, (64, 64, d), t16, True, None, "normal", 10),
        t("causal, Nq=Nk=37", H_CAUSAL + M, (37, 37, d), t16, True, None, "normal", 11),
        t("causal, Nq=20 < Nk=53", H_CAUSAL, (20, 53, d), t16, True, None, "normal", 12),
        t("causal, Nq=53 > Nk=20", H_CAUSAL, (53, 20, d), t16, True, None, "normal", 13),
        t("causal, Br=32, Bc=16", H_CAUSAL, (40, 40, d), (32, 16), True, None, "normal", 14),
        t("causal, Br=16, Bc=32", H_CAUSAL, (40, 40, d), (16, 32), True, None, "normal", 15),
        t("causal, N=1", H_CAUSAL, (1, 1, d), t16, True, None, "normal", 16),
        t("causal, logits in the hundreds", H_WIDE, (24, 40, d), t16, True, None, "wide", 17),
    ]


def _triton_unavailable():
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"triton does not import ({exc})"
    if not runtime.triton_interpreted() and not runtime.configure()["gpu"]:
        return "no CUDA GPU and TRITON_INTERPRET is not 1 (import flashedu before triton)"
    return None


def _diagnose_kernel(case, wrong, outputs):
    if any(np.isnan(outputs[name]).any() for name in wrong):
        return ("NaN: a row was never written (the numba check starts O and L as NaN), a load "
                "read past the last row (the Triton check keeps NaN there: mask the load), or "
                "exp(-inf - (-inf)) for a row whose keys are all masked so far.")
    if "L" in wrong and "O" not in wrong:
        return "O is right but L is not: L_i = m_i + log(l_i), natural log."
    if "O" in wrong and "L" not in wrong:
        return ("L is right, so m_i and l_i are: look at O_i's rescale by exp(m_i - m_new) and "
                "the final division by l_i.")
    return None


def _still_skeleton(kernel) -> bool:
    """True when the kernel's source still raises NotImplementedError. Checked on the source:
    compiled for a GPU, a kernel cannot raise (numba ignores it, Triton refuses to compile)."""
    inner = getattr(kernel, "py_func", None) or getattr(kernel, "fn", None) or kernel
    try:
        source = inspect.getsource(inner)
    except (OSError, TypeError):
        return False
    return re.search(r"^\s*raise\s+NotImplementedError\b", source, re.MULTILINE) is not None


EXERCISES = [
    Exercise("numba_forward_kernel", 3, "flash_forward_kernel", _numba_cases,
             invoke=_numba_invoke, diagnose=_diagnose_kernel, timeout=120.0,
             requires=_numba_unavailable, unfilled=_still_skeleton),
    Exercise("triton_forward_kernel", 4, "flash_forward_kernel", _triton_cases,
             invoke=_triton_invoke, diagnose=_diagnose_kernel, timeout=120.0,
             requires=_triton_unavailable, unfilled=_still_skeleton),
]
