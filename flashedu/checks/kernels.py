"""The GPU-kernel exercises: a numba.cuda kernel and a Triton kernel of the FlashAttention forward,
and the two Triton kernels of its backward (the paper's Algorithm 4: a dK/dV pass, a dQ pass).

The learner writes the kernel itself; the launchers below (shown in the notebooks) allocate the
outputs and launch it. On a laptop the kernels run in numba's CUDA simulator and in Triton's
interpreter (``import flashedu`` arranges both), so the cases stay small.

What the checks enforce beyond the values:
- bounds: inputs are views into buffers padded with NaN, and outputs into buffers padded with a
  sentinel, so a kernel that reads past the last row (a missing load mask) returns NaN and one
  that writes past it is caught; in numba's simulator an unguarded index raises IndexError;
- outputs that start as garbage: the outputs start as NaN (``torch.empty`` may hold anything),
  so an output row never stored, or an accumulator that adds to what the output held, shows;
  one case per exercise calls the kernel twice into the same outputs (holding the first
  call's answer), so a kernel that accumulates across calls fails;
- every tile: one case per exercise has Nq = Nk = 300, more than a 256-row tile, so a kernel
  that loads all of Q or K as one tile fails;
- the allowance: each output may be off by 4x the error of correct float32 computations on
  the same draw (naive attention, FlashAttention's loop at the case's tiles, O kept normalized
  key by key; the backward's two ways to get Delta_i), or by the rounding a correct kernel can
  make on that draw (:func:`flashedu.tolerance.attention_rounding`), whichever is larger;
- compiling: once every case passed, the kernel is compiled for a GPU for every launch the
  cases made (:mod:`.gate`);
- strides (Triton backward): one case hands views whose rows are further apart than d, each
  tensor its own row stride, with NaN and the sentinel in the gaps, so a kernel that addresses
  row r as ``X + r * D`` instead of ``X + r * stride_x`` fails;
- shared memory (numba): in the simulator every read of K and V from global memory is counted.
  A block that stages K_j, V_j in shared memory reads each element once per block; a kernel
  where every thread reads K and V from global memory reads each element once per thread. On a
  GPU reads cannot be counted; there the compiled kernel (its PTX) must load from shared memory
  in at least two places, one for K_j and one for V_j.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re

import numpy as np

from .. import reference, runtime, tiled
from . import compare
from .engine import Case, Exercise, allowance, rows_text
from .gate import compile_spec, numba_gate_source, parameters, triton_gate_source, use_launches
from .numpy_exercises import (
    F64,
    H_CAUSAL,
    H_EDGE,
    H_N1,
    H_NQNK,
    H_SCALE,
    H_TILES,
    H_FUTURE,
    H_WIDE,
    _backward_in_dtype,
    normalized_key_by_key,
    _inputs,
    _memo,
    _normal,
)
from .sandbox import Call, call_limited

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
    negative = 0  # reads at a negative index: NumPy wraps them, a GPU reads before the array

    def __getitem__(self, idx):
        value = super().__getitem__(idx)
        if not isinstance(value, np.ndarray):  # a single element read from global memory
            type(self).reads += 1
            if any(isinstance(i, (int, np.integer)) and i < 0
                   for i in (idx if isinstance(idx, tuple) else (idx,))):
                type(self).negative += 1
        return value


class _RaceWatched(np.ndarray):
    """A shared-memory array of the simulator that finds data races, as compute-sanitizer's
    racecheck does on a GPU. Between two cuda.syncthreads() of a block (an epoch), an element
    written by one thread and read or written by another is a race, whatever order the
    simulator's threads happened to run in: on a GPU the order is not fixed. Each element keeps
    the epoch and thread of its last write and of its last reads."""

    def _watch(self, name):
        n = self.size
        self._name, self._race, self._lock = name, None, __import__("threading").Lock()
        self._w_epoch = np.full(n, -1, dtype=np.int64)
        self._writer = np.full(n, -1, dtype=np.int64)
        self._r_epoch = np.full(n, -1, dtype=np.int64)
        self._reader = np.full(n, -1, dtype=np.int64)  # -2: several threads read it
        return self

    def __getitem__(self, idx):
        value = super().__getitem__(idx)
        if not isinstance(value, np.ndarray):
            self._touch(idx, False)
        return value

    def __setitem__(self, idx, value):
        super().__setitem__(idx, value)
        self._touch(idx, True)

    def _touch(self, idx, write):
        import threading

        if getattr(self, "_w_epoch", None) is None:
            return  # a view made by slicing: not watched
        thread = threading.current_thread()
        tid = getattr(thread, "thread_id", None)
        block = getattr(thread, "blockIdx", None)
        if tid is None or block is None:
            return
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != self.ndim or not all(isinstance(i, (int, np.integer)) for i in idx):
            return
        flat = 0
        for i, n in zip(idx, self.shape):
            flat = flat * n + int(i) % n
        epoch = ((block.x * 4096 + block.y) * 4096 + block.z) * 10**6 + \
            getattr(thread, "_flashedu_epoch", 0)
        with self._lock:
            other, what = None, None
            if self._w_epoch[flat] == epoch and self._writer[flat] != tid:
                other, what = int(self._writer[flat]), "wrote"
            elif write and self._r_epoch[flat] == epoch and self._reader[flat] not in (tid, -1):
                other, what = int(self._reader[flat]), "read"
            if other is not None and self._race is None:
                who = f"thread {other}" if other >= 0 else "other threads"
                where = f"{self._name}[{', '.join(str(int(i)) for i in idx)}]"
                self._race = (f"a data race on shared memory: thread {tid} of block "
                              f"{block.x} {'wrote' if write else 'read'} {where}, which "
                              f"{who} {what} since the last cuda.syncthreads(). On a GPU the "
                              "threads of a block run in no fixed order, so the value depends "
                              "on timing.")
            if write:
                self._w_epoch[flat], self._writer[flat] = epoch, tid
            elif self._r_epoch[flat] != epoch:
                self._r_epoch[flat], self._reader[flat] = epoch, tid
            elif self._reader[flat] != tid:
                self._reader[flat] = -2


@contextlib.contextmanager
def _race_watch():
    """In numba's simulator, every cuda.shared.array of the launch is a :class:`_RaceWatched`
    and each cuda.syncthreads() starts a new epoch of its thread. Yields the list of watched
    arrays."""
    import sys
    import threading
    import traceback

    from numba.cuda.simulator import kernel as sim_kernel, kernelapi

    watched, lock = [], threading.Lock()
    shared, sync = kernelapi.FakeCUDAShared.array, sim_kernel.BlockThread.syncthreads

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return shared(self, shape, dtype, alignment)
        caller = traceback.extract_stack(sys._getframe())[-2]  # as the simulator keys them
        with lock:  # the block's threads all ask at once: one array for all of them
            res = self._allocations.get(tuple(caller[0:2]))
            if res is None:
                line = (caller.line or "").split("=")[0].strip()
                name = line if line.isidentifier() else "a shared array"
                plain = shared(kernelapi.FakeCUDAShared(0), shape, dtype)  # its dtype rules
                res = plain.view(_RaceWatched)._watch(name)
                watched.append(res)
                self._allocations[tuple(caller[0:2])] = res
        return res

    def syncthreads(self):
        sync(self)
        self._flashedu_epoch = getattr(self, "_flashedu_epoch", 0) + 1

    kernelapi.FakeCUDAShared.array, sim_kernel.BlockThread.syncthreads = array, syncthreads
    try:
        yield watched
    finally:
        kernelapi.FakeCUDAShared.array, sim_kernel.BlockThread.syncthreads = shared, sync


@contextlib.contextmanager
def _polite_blocks(pause=1e-4):
    """numba's simulator runs a block's threads as Python threads while its own thread polls
    them, round after round without a pause, holding the interpreter lock the threads need:
    most of a launch's time goes to the polling. This is the same loop with a pause between
    rounds (a 300-row case runs ten times faster); what the threads do is unchanged."""
    import time

    from numba.cuda.simulator import kernel as sim_kernel

    original = sim_kernel.BlockManager.run

    def run(self, grid_point, *args):
        threads, blocked = [], set()
        for block_point in np.ndindex(*self._block_dim):
            def target():
                self._f(*args)
            thread = sim_kernel.BlockThread(target, self, grid_point, block_point, self._debug)
            thread.start()
            threads.append(thread)
        live = set(threads)
        while live:
            time.sleep(pause)
            for thread in live:
                if thread.syncthreads_blocked:
                    blocked.add(thread)
                elif thread.exception:
                    for other in threads:  # abort the others, as the simulator does
                        other.abort = True
                        other.syncthreads_blocked = False
                        other.syncthreads_event.set()
                    raise thread.exception[0].with_traceback(thread.exception[1])
            if live == blocked:  # every live thread waits at cuda.syncthreads(): release them
                for thread in blocked:
                    thread.syncthreads_blocked = False
                    thread.syncthreads_event.set()
                blocked = set()
            live = {thread for thread in live if thread.is_alive()}
        for thread in threads:
            if thread.exception:
                raise thread.exception[0].with_traceback(thread.exception[1])

    known = all(hasattr(sim_kernel, n) for n in ("BlockManager", "BlockThread"))
    if known:
        sim_kernel.BlockManager.run = run
    try:
        yield
    finally:
        if known:
            sim_kernel.BlockManager.run = original


def _numba_invoke(fn, case, timeout, measure):
    if not runtime.numba_simulated():
        return _numba_invoke_gpu(fn, case, timeout, measure)
    # The simulator bounds-checks every index (IndexError) and lets us count reads and find
    # races on shared memory.
    Q, K, V, causal, scale, threads, twice, watch_races = _numba_args(case.args)
    Q, K, V = (a.view(type(f"{n}_counted", (_CountedReads,), {"reads": 0, "negative": 0}))
               for n, a in zip("QKV", (Q, K, V)))
    again = []

    def run():
        O, L = launch_numba_forward(fn, Q, K, V, causal, scale, threads)
        if not twice:
            return O, L
        first = (O.copy(), L.copy())
        launch_numba_forward(fn, Q, K, V, causal, scale, threads, out=(O, L))
        again.extend([("O", O.copy()), ("L", L.copy())])
        return first

    with _polite_blocks(), _race_watch() if watch_races else contextlib.nullcontext([]) as watched:
        call = call_limited(run, timeout=timeout, measure_memory=measure)
    call.reads = {"K": type(K).reads, "V": type(V).reads,
                  "negative": sum(type(a).negative for a in (Q, K, V))}
    if twice:
        call.buffers = {"again": again}
    races = [w._race for w in watched if w._race]
    if races and not call.timed_out:
        call.finding = (f"{races[0]} Put a cuda.syncthreads() between the threads' writes of "
                        "a tile and the reads of it, and another before the next tile "
                        "overwrites it (every thread of the block must reach each one).")
    return call


def _numba_args(args):
    """(Q, K, V, causal, scale, threads, twice, watch_races) of a numba case's arguments."""
    q, k, v, causal, scale, threads, *rest = args
    twice = bool(rest[0]) if len(rest) > 0 else False
    watch_races = bool(rest[1]) if len(rest) > 1 else True
    return q, k, v, causal, scale, threads, twice, watch_races


def _numba_invoke_gpu(fn, case, timeout, measure):
    """On a GPU nothing bounds-checks: the arrays are views into device buffers padded with
    NaN (inputs) and a sentinel (outputs), checked after the launch, as in the Triton check."""
    from numba import cuda

    q, k, v, causal, scale, threads, twice, _ = _numba_args(case.args)

    def padded(a, fill):
        buf = np.full((a.shape[0] + PAD,) + a.shape[1:], fill, dtype=F32)
        buf[: a.shape[0]] = a
        return cuda.to_device(buf), buf

    ins = [padded(a, np.nan) for a in (q, k, v)]
    outs = [padded(np.full_like(a, np.nan), SENTINEL) for a in (q, q[:, 0])]

    again = []

    def launch():
        launch_numba_forward(fn, *(d[: len(a)] for (d, _), a in zip(ins, (q, k, v))), causal,
                             scale, threads, out=tuple(d[: len(q)] for d, _ in outs))
        cuda.synchronize()
        return tuple(d.copy_to_host()[: len(q)] for d, _ in outs)

    def run():
        first = launch()
        if twice:  # the same output buffers, holding the first call's answer
            again.extend(zip("OL", launch()))
        return first

    call = call_limited(run, timeout=timeout, measure_memory=measure)
    # reads cannot be counted on a GPU; the compiled kernel's loads from shared memory can
    call.reads = {"shared_loads": shared_loads(fn)}
    if call.error is None and not call.timed_out:
        call.buffers = {"in": [(n, d.copy_to_host(), b) for n, (d, b) in zip("QKV", ins)],
                        "out": [(n, d.copy_to_host(), len(q)) for n, (d, _) in zip("OL", outs)],
                        "again": again}
    return call


def shared_loads(kernel) -> int | None:
    """Load instructions from shared memory in a compiled numba kernel's PTX (over the
    signatures it was compiled for), or None when its PTX cannot be read."""
    try:
        ptx = kernel.inspect_asm()
    except Exception:  # noqa: BLE001 - not a numba kernel, or nothing compiled: no evidence
        return None
    text = "\n".join(ptx.values()) if isinstance(ptx, dict) else str(ptx)
    return len(re.findall(r"\bld(?:\.volatile)?\.shared\b", text))


def _shared_memory_probe(case):
    Q, K, threads = case.args[0], case.args[1], case.args[5]
    Nq, Nk, d = Q.shape[0], K.shape[0], K.shape[1]
    per_block = math.ceil(Nq / threads) * Nk * d  # each element once per block

    def probe(call, outputs):
        reads = call.reads or {}
        if "shared_loads" in reads:  # a real GPU: the compiled kernel's code is the evidence
            problem = _bounds_probe(call, outputs)
            if problem is None and reads["shared_loads"] is not None \
                    and reads["shared_loads"] < 2:
                problem = (f"the answer is right, but your compiled kernel loads from shared "
                           f"memory in {reads['shared_loads']} place(s) (ld.shared in its PTX), "
                           "so it must read K or V from global memory. Each block should copy "
                           "a K_j, V_j tile into shared memory once (cuda.shared.array, then "
                           "cuda.syncthreads()) and let all its threads read both there.")
            return problem
        if call.reads is None:
            return _bounds_probe(call, outputs)
        problem = _loads_problem(call)
        if problem:
            return problem
        for name in ("K", "V"):
            n = call.reads.get(name, 0)
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
H_THREADS = ("Another block size: Br is cuda.blockDim.x, whatever it is (32, 64, 128), never "
             "a constant. The block copies K_j, V_j together in steps of blockDim.x elements, "
             "and a causal block stops at its own last row, (blockIdx.x + 1) * blockDim.x.")
H_NUMBA_GUARD = (" Threads past the last row (row >= Nq) and key rows past Nk (j >= Nk) must "
                 "not read or write; but every thread must still reach each syncthreads().")


def _numba_case(label, hint, shape, causal, scale, kind, threads, seed, twice=False,
                races=True, **extra):
    (Q, K, V), (q, k, v) = _inputs(shape, kind, F32, seed)

    def compute():
        ref = reference.naive_attention(Q, K, V, causal=causal, scale=scale)
        naive = reference.naive_attention(q, k, v, causal=causal, scale=scale)
        # NumPy 2 keeps float32 * a Python float in float32 in the simulator, where a GPU would
        # compute in float64: a correct kernel may be as far off as float32 arithmetic
        # throughout, e.g. with O kept normalized key by key
        variant = normalized_key_by_key(q, k, v, causal, scale)
        return ref, naive, variant, _forward_rounding(q, k, v, causal, scale, ref, gpu=False)

    (O, L), naive, variant, rounding = _memo(("numba", label), compute)
    rounding = tuple(float(r) for r in rounding)
    case = Case(label, hint, (q, k, v, causal, scale, threads, twice, races), ("O", "L"),
                (O, L), naive, inputs=("Q", "K", "V"), dtype=F32, probe=_bounds_probe,
                variants=(variant,), rounding=rounding, floor_scale=0.0, **extra)
    if twice:
        case.probe = _repeat_probe(case, _bounds_probe)
    return case


# A case: (label, hint, (Nq, Nk, d), causal, scale, kind of inputs, threads a block, seed,
# extra keywords of _numba_case). The simulator runs each thread as a Python thread: the long
# case has d = 1 and is causal (half the pairs), and leaves the race watch to the others.
def _numba_specs():
    T, H = 8, H_THREADS
    return [
        ("one block, Nq=Nk=8, d=4", H_NUMBA, (8, 8, 4), False, None, "normal", T, 1, {}),
        ("several K tiles, Nq=16, Nk=40", H_TILES, (16, 40, 4), False, None, "normal", T, 2, {}),
        ("edge: Nq=13, Nk=21", H_EDGE + H_NUMBA_GUARD, (13, 21, 8), False, None, "normal", T, 3,
         {}),
        ("N=1", H_N1 + H_NUMBA_GUARD, (1, 1, 4), False, None, "normal", T, 4, {}),
        ("Nq=20 > Nk=6", H_NQNK + H_NUMBA_GUARD, (20, 6, 4), False, None, "normal", T, 5, {}),
        ("explicit scale=0.3", H_SCALE, (9, 18, 4), False, 0.3, "normal", T, 6, {}),
        ("logits in the hundreds", H_WIDE, (8, 24, 4), False, None, "wide", T, 7, {}),
        ("causal, Nq=Nk=19", H_CAUSAL, (19, 19, 4), True, None, "normal", T, 8, {}),
        ("causal, Nq=12, Nk=33", H_CAUSAL, (12, 33, 4), True, None, "normal", T, 9, {}),
        ("causal, a future key dominates", H_FUTURE, (24, 24, 4), True, None, "future", T, 11,
         {}),
        ("called twice into the same O and L, causal, Nq=12, Nk=20", H_TWICE, (12, 20, 4), True,
         None, "normal", T, 15, {"twice": True}),
        ("32 threads a block, causal, Nq=Nk=300, d=1", H_LONG + " " + H + " " + H_CAUSAL,
         (300, 300, 1), True, None, "normal", 32, 12, {"races": False}),
        ("64 threads a block, causal, Nq=Nk=70", H + " " + H_CAUSAL, (70, 70, 2), True, None,
         "normal", 64, 13, {}),
        ("128 threads a block, Nq=130, Nk=24", H, (130, 24, 2), False, None, "normal", 128, 14,
         {}),
    ]


def _numba_cases():
    cases = [_numba_case(*spec[:8], **spec[8]) for spec in _numba_specs()]
    shared = _numba_case("shared memory: Nq=Nk=32, 4 blocks of 8 threads", H_NUMBA,
                         (32, 32, 4), False, None, "normal", 8, 10, needs_pass=True)
    shared.probe = _shared_memory_probe(shared)
    return cases + [shared]


H_TWICE = ("The check calls your kernel twice with the same inputs, into the same output "
           "buffers (which hold the first call's answer: an output may hold anything when a "
           "kernel starts): start every accumulator at zero inside the kernel and write each "
           "output once; never add to what an output held.")
H_LONG = ("Nq = Nk = 300: more rows and keys than one tile of any size a kernel might hard-code "
          "(256): cover every query row and loop over every key tile up to Nk.")


def _forward_rounding(q, k, v, causal, scale, ref, gpu):
    """Each output's allowance from rounding on this draw (flashedu.tolerance): what a correct
    kernel in float32 can be off by, TF32 dot operands included on a GPU."""
    from .. import tolerance

    bounds = tolerance.attention_rounding(q, k, v, causal=causal, scale=scale, dtype="float32",
                                          dot_unit=tolerance.TF32_UNIT if gpu else None)
    return tuple(tolerance.ROUNDING_FACTOR * tolerance.normalized(b, r)
                 for b, r in zip(bounds, ref))


def _repeat_probe(case, base):
    """``base``, then: the second call, into the output buffers that hold the first call's
    answer, must be as right as the first."""
    def probe(call, outputs):
        problem = base(call, outputs)
        if problem:
            return problem
        again = dict((entry[0], entry[1]) for entry in
                     (getattr(call, "buffers", None) or {}).get("again", ()))
        names = " and ".join(case.outputs)
        for k, name in enumerate(case.outputs):
            got = again.get(name)
            if got is None:
                return f"the grader got no {name} back from the second call of your kernel."
            got = np.asarray(got, dtype=np.float64)
            ref, tol = case.expected[k], allowance(case, k)
            err = compare.error(got, ref)
            if err > tol:
                rows = compare.bad_rows(got, ref, tol)
                n = ref.shape[0]
                nan_rows = np.flatnonzero(np.isnan(got).reshape(n, -1).any(axis=1))
                how = (f"NaN in {rows_text(nan_rows, n)}" if len(nan_rows)
                       else f"off by up to {err:.2e}, allowed {tol:.1e}")
                return (f"the first call was right, but a second call with the same inputs, into "
                        f"the same {names} (still holding the first call's answer), gave {name} "
                        f"wrong in {rows_text(rows, n)} ({how}). Your kernel adds to what an "
                        "output held, or leaves part of it unwritten: set every accumulator to "
                        "zero inside the kernel and store each output once.")
        return None
    return probe


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


@contextlib.contextmanager
def _watch_loads(tensors):
    """Count, in Triton's interpreter, the loads (mask on) whose address lies outside every
    one of ``tensors`` (each a 1-D or 2-D view, strides included). Yields a dict."""
    seen = {"oob_loads": 0}
    if not runtime.triton_interpreted():
        yield seen
        return
    from triton.runtime import interpreter

    regions = [(t.data_ptr(), t.shape[0], t.shape[1] if t.dim() == 2 else 1,
                t.stride(0) if t.dim() == 2 else 1, t.element_size()) for t in tensors]
    original = interpreter.InterpreterBuilder.create_masked_load

    def masked_load(self, ptrs, mask, other, *args, **kwargs):
        addr = np.asarray(ptrs.data).astype(np.int64)
        on = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        inside = np.zeros(addr.shape, dtype=bool)
        for base, rows, cols, stride, size in regions:
            off = addr - base
            elem = off // size
            inside |= (off >= 0) & (off % size == 0) & (elem // stride < rows) & \
                (elem % stride < cols)
        seen["oob_loads"] += int((on & ~inside).sum())
        return original(self, ptrs, mask, other, *args, **kwargs)

    interpreter.InterpreterBuilder.create_masked_load = masked_load
    try:
        yield seen
    finally:
        interpreter.InterpreterBuilder.create_masked_load = original


def _padded(a, fill, device):
    """A torch view of ``a`` whose buffer has PAD more rows filled with ``fill``."""
    import torch

    buf = torch.full((a.shape[0] + PAD,) + a.shape[1:], fill, dtype=torch.float32)
    buf[: a.shape[0]] = torch.from_numpy(np.ascontiguousarray(a))
    buf = buf.to(device)
    return buf, buf[: a.shape[0]]


def _triton_invoke(fn, case, timeout, measure):
    import torch

    q, k, v, causal, scale, Br, Bc, strided = case.args[:8]
    twice = bool(case.args[8]) if len(case.args) > 8 else False
    device = runtime.kernel_device()
    width = (lambda name: STRIDES.get(name)) if strided else (lambda name: None)
    ins = [_padded_rows(a, float("nan"), device, width(n)) for n, a in zip("QKV", (q, k, v))]
    # O and L start as NaN, as torch.empty may leave them: a row never stored shows
    outs = [_padded_rows(np.full_like(a, np.nan), SENTINEL, device, width(n))
            for n, a in zip("OL", (q, q[:, 0]))]
    before = [buf.clone() for buf, _ in ins]
    again = []

    def launch():
        launch_triton_forward(fn, *(view for _, view in ins), causal, scale, Br, Bc,
                              out=tuple(view for _, view in outs))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return tuple(view.cpu().numpy().copy() for _, view in outs)

    def run():
        with _watch_loads([view for _, view in ins + outs]) as seen:
            first = launch()
            if twice:  # the same O and L, holding the first call's answer
                again.extend(zip("OL", launch()))
        call.reads = dict(seen)
        return first

    call = Call()
    done = call_limited(run, timeout=timeout, measure_memory=measure)
    done.reads = call.reads
    done.buffers = {"in": [(name, buf, old) for name, (buf, _), old in zip("QKV", ins, before)],
                    "out": [(name, buf, tuple(view.shape)) for name, (buf, view) in zip("OL", outs)],
                    "again": again}
    return done


def _loads_problem(call) -> str | None:
    reads = getattr(call, "reads", None) or {}
    if reads.get("negative"):
        return (f"your kernel read {reads['negative']} element(s) at a negative index (e.g. "
                "K[j] with j = -1): NumPy wraps around to the last row, a GPU reads memory "
                "before the array. Guard the index (j >= 0, j < Nk).")
    if reads.get("oob_loads"):
        return (f"the answer is right, but your kernel loaded {reads['oob_loads']} values from "
                "outside its tensors (past the last row, or between the rows of a strided "
                "tensor) and then threw them away. On a GPU such a load can fault or read "
                "another tensor: mask every load (mask=rows < Nq, cols < Nk, other=0.0). "
                "flashedu.viz.trace_kernel(kernel, grid, *args) shows each load of each "
                "program, its out-of-bounds lanes in red.")
    return None


def _bounds_probe(call, outputs):
    """Inputs (padding included) unchanged, and nothing written past the end of O or L."""
    problem = _loads_problem(call)
    if problem:
        return problem
    buffers = getattr(call, "buffers", None) or {}
    for name, buf, old in buffers.get("in", ()):
        if not np.array_equal(_numpy(buf), _numpy(old), equal_nan=True):
            return f"your kernel wrote into its input {name}. Store only into O and L."
    for name, buf, n in buffers.get("out", ()):
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


def _triton_case(label, hint, shape, tiles, causal, scale, kind, seed, strided=False,
                 twice=False):
    (Q, K, V), (q, k, v) = _inputs(shape, kind, F32, seed)
    on_gpu = not runtime.triton_interpreted()

    def compute():
        ref = reference.naive_attention(Q, K, V, causal=causal, scale=scale)
        naive = (_naive_tf32 if on_gpu else reference.naive_attention)(q, k, v, causal=causal,
                                                                       scale=scale)
        # correct kernels in float32 set the allowance too: O kept normalized key by key, and
        # FlashAttention's own loop at this case's tiles
        variants = (normalized_key_by_key(q, k, v, causal, scale),
                    tiled.flash_forward(q, k, v, *tiles, causal=causal, scale=scale))
        return ref, naive, variants, _forward_rounding(q, k, v, causal, scale, ref, on_gpu)

    (O, L), naive, variants, rounding = _memo(("triton forward", label), compute)
    case = Case(label, hint, (q, k, v, causal, scale) + tiles + (strided, twice), ("O", "L"),
                (O, L), naive, inputs=("Q", "K", "V"), dtype=F32, probe=_backward_bounds_probe,
                variants=variants, rounding=tuple(float(r) for r in rounding),
                floor_scale=100.0 if on_gpu else 0.0)  # TF32 dots: ~1e-3 relative
    if twice:
        case.probe = _repeat_probe(case, _backward_bounds_probe)
    return case


def tf32(a):
    """float32 values as the tensor cores read them for a TF32 dot (tl.dot's default for float32
    inputs on a GPU): the 13 low mantissa bits dropped, 10 kept."""
    bits = np.ascontiguousarray(a, dtype=F32).view(np.uint32)
    return (bits & np.uint32(0xFFFFE000)).view(F32)


def _scores_tf32(q, k, causal, scale):
    scale = 1.0 / math.sqrt(q.shape[1]) if scale is None else scale
    S = F32(scale) * (tf32(q) @ tf32(k).T)
    if causal:
        S = np.where(reference.causal_mask(*S.shape), S, -np.inf).astype(F32)
    return S, scale


def _naive_tf32(q, k, v, causal, scale):
    """Plain attention in float32 with every dot's operands read as TF32, as a Triton kernel's
    tl.dot reads them on a GPU. Its error sets the tolerance there: with logits in the
    hundreds, TF32 scores are off by ~|S| / 1000, so a correct kernel misses the float64 answer
    by far more than float32 arithmetic would. (cuBLAS with TF32 allowed is no model: it keeps
    small problems in full float32.)"""
    S, _ = _scores_tf32(q, k, causal, scale)
    m = S.max(axis=1, keepdims=True)
    P = np.exp(S - m)
    l = P.sum(axis=1, keepdims=True)
    return (tf32(P) @ tf32(v)) / l, (m + np.log(l))[:, 0]


def _triton_cases():
    return [_triton_case(*spec) for spec in _triton_specs()]


# A case: (label, hint, (Nq, Nk, d), (Br, Bc), causal, scale, kind of inputs, seed, strided,
# called twice).
def _triton_specs():
    d, t16 = 16, (16, 16)
    M = H_TRITON_MASK

    def t(label, hint, shape, tiles, causal, scale, kind, seed, strided=False, twice=False):
        return (label, hint, shape, tiles, causal, scale, kind, seed, strided, twice)

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
        t("causal, a future key dominates", H_FUTURE, (40, 40, d), t16, True, None, "future",
          18),
        t("row strides differ from d: Nq=21, Nk=27", H_STRIDES_FWD, (21, 27, d), t16, False,
          None, "normal", 19, strided=True),
        t("causal, Br=16, Bc=32, row strides differ from d", H_CAUSAL + " " + H_STRIDES_FWD,
          (45, 45, d), (16, 32), True, None, "normal", 20, strided=True),
        t("Nq=Nk=300, Br=64, Bc=32", H_LONG + M, (300, 300, d), (64, 32), False, None,
          "normal", 21),
        t("called twice into the same O and L, causal, Nq=37, Nk=45", H_TWICE, (37, 45, d), t16,
          True, None, "normal", 22, twice=True),
    ]


H_STRIDES_FWD = ("Each tensor's rows are further apart than D here (views into wider buffers, "
                 "each with its own row stride, NaN in the gaps): address row r of Q as Q + r * "
                 "stride_q, of K as K + r * stride_k, of O as O + r * stride_o; never r * D.")


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
        return ("NaN: a row was never stored (the check starts O and L as NaN, as torch.empty "
                "may leave them: every program stores all its rows, also where causal masking "
                "skips every tile), an accumulator added to what O held instead of starting at "
                "zero, a load that read past the last row (the Triton check keeps NaN there: mask "
                "the load), or exp(-inf - (-inf)) for a row whose keys are all masked so far.")
    if "L" in wrong and "O" not in wrong:
        return "O is right but L is not: L_i = m_i + log(l_i), natural log."
    if "O" in wrong and "L" not in wrong:
        return ("L is right, so m_i and l_i are: look at O_i's rescale by exp(m_i - m_new) and "
                "the final division by l_i.")
    return None


def _still_skeleton(kernel) -> bool:
    """True while the kernel's source still holds the exercise's placeholder. Checked on the
    source: compiled for a GPU, a kernel cannot raise (numba ignores it, Triton refuses to
    compile)."""
    from .engine import PLACEHOLDER, source_has_placeholder

    return source_has_placeholder(kernel, PLACEHOLDER)


# What a kernel body may call: the kernel language, math, a few builtins, and other kernels
# (device functions) of the same kind. Anything else (NumPy, torch, flashedu, a plain Python
# function, an object with __getitem__ in place of a kernel) runs in the simulator or the
# interpreter but would not compile for a GPU.
_BUILTINS_OK = {"range", "min", "max", "abs", "float", "int", "bool", "len", "print",
                "tl_range", "static_range"}


def _kernel_problem(kernel, kind: str) -> str | None:
    is_kernel, inner = _kernel_parts(kernel, kind)
    if not is_kernel:
        want = "@cuda.jit" if kind == "numba" else "@triton.jit"  # forward, dkdv, dq: Triton
        return (f"what was checked is a {type(kernel).__name__}, not a {want} kernel: define "
                f"the kernel with {want} (a GPU could not compile anything else).")
    return _calls_problem(inner, kind, set())


def gate_launches(which: str) -> list[dict]:
    """The launches the cases of kernel ``which`` ("numba", "forward", "dkdv", "dq") make, as
    plain data for the compile gate (:mod:`.gate`): each with the label of the first case
    that makes it. Triton: every argument (pointers by dtype, the scale, the integers, the
    constexprs), as the launcher passes it. numba: the argument types."""
    if which == "numba":
        # Q, K, V, O: C-contiguous float32 rows; L a float32 vector; a float32 scale; a bool
        array2, array1 = "float32[:, ::1]", "float32[::1]"
        signature = f"({', '.join([array2] * 4)}, {array1}, float32, boolean)"
        return [{"label": _numba_specs()[0][0], "signature": signature,
                 "config": "float32 arrays, a float32 scale, a bool causal"}]
    specs = _triton_specs() if which == "forward" else _backward_specs(which)
    pointers = parameters(which)[: parameters(which).index("scale")]
    launches = []
    for label, _, (Nq, Nk, d), (Br, Bc), causal, scale, _, _, strided, _ in specs:
        stride = {name: (STRIDES[name] if strided else d) for name in STRIDES}
        ints = {"Nq": Nq, "Nk": Nk, **{f"stride_{n.lower()}": stride[n] for n in STRIDES}}
        constexprs = {"D": d, "Br": Br, "Bc": Bc, "CAUSAL": bool(causal)}
        args = []
        for name in parameters(which):
            if name in pointers:
                args.append([name, "ptr", "float32"])
            elif name == "scale":
                args.append([name, "float", 1.0 / math.sqrt(d) if scale is None else scale])
            elif name in constexprs:
                args.append([name, "constexpr", constexprs[name]])
            else:
                args.append([name, "int", ints[name]])
        config = ", ".join(f"{k}={v}" for k, v in constexprs.items())
        ones = [n for n in ("Nq", "Nk") if ints[n] == 1]
        config += "".join(f", {n}=1" for n in ones)
        launches.append({"label": label, "config": config, "args": args})
    return launches


def _gate(which):
    def source(kernel):
        """The kernel's side of the gate (see :mod:`.gate`): its description, plain data."""
        return numba_gate_source(kernel) if which == "numba" else \
            triton_gate_source(kernel, which)

    def gate(kernel):
        """The grader's side: compile what was described, for the cases' launches; what
        decides (the launches, a GPU present) is read in the grader's process."""
        return compile_spec(source(kernel))

    gate.source = source  # flashedu check compiles in the grader what the kernel sent
    return gate


def _kernel_parts(obj, kind):
    kind = "numba" if kind == "numba" else "triton"
    if kind == "numba":
        names = {"FakeCUDAKernel", "CUDADispatcher", "Dispatcher"}
        inner = getattr(obj, "py_func", None) or getattr(obj, "fn", None)
    else:
        names = {"JITFunction", "InterpretedFunction"}
        inner = getattr(obj, "fn", None)
    mro = {c.__name__ for c in type(obj).__mro__}
    ok = bool(mro & names) and inspect.isfunction(inner) and \
        type(obj).__module__.split(".")[0] in ("numba", "numba_cuda", "triton")
    return ok, inner


def _calls_problem(fn, kind, seen) -> str | None:
    kind = "numba" if kind == "numba" else "triton"
    import ast
    import builtins
    import textwrap
    import types

    if fn in seen:
        return None
    seen.add(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return "the grader cannot read your kernel's source (define it in a cell or a file)."
    env = dict(vars(builtins))
    env.update(fn.__globals__)
    allowed_modules = {"numba": ("numba", "math"), "triton": ("triton", "math")}[kind]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        base = node.func
        while isinstance(base, ast.Attribute):
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in env:
            continue  # a local value's method (acc.to(...)) or a name bound in the kernel
        value = env[base.id]
        if isinstance(value, types.ModuleType):
            if value.__name__.split(".")[0] in allowed_modules or \
                    value.__name__.startswith("numba_cuda"):
                continue
            return (f"your kernel calls {ast.unparse(node.func)}: a GPU kernel can only call "
                    f"the kernel language ({'cuda.*, math.*' if kind == 'numba' else 'tl.*'}) "
                    "and other kernels; this would not compile for a GPU.")
        if isinstance(node.func, ast.Name) and base.id in _BUILTINS_OK and \
                value is getattr(builtins, base.id, None):
            continue
        if isinstance(value, type) and issubclass(value, BaseException):
            continue  # raise ValueError(...): a guard (Triton checks it when compiling)
        is_kernel, inner = _kernel_parts(value, kind)
        if is_kernel:
            problem = _calls_problem(inner, kind, seen)
            if problem:
                return problem
            continue
        if getattr(type(value), "__module__", "").split(".")[0] in ("numba", "numba_cuda",
                                                                   "triton") or \
                getattr(value, "__module__", "") and str(getattr(value, "__module__", "")).split(".")[0] in ("numba", "numba_cuda", "triton"):
            continue  # a numba type (float32(...)) or a triton language object
        return (f"your kernel calls {ast.unparse(node.func)}, a plain Python "
                f"{type(value).__name__}: a GPU kernel can only call the kernel language and "
                "other kernels (decorate a helper with "
                f"{'@cuda.jit(device=True)' if kind == 'numba' else '@triton.jit'}).")
    return None


# ----------------------------------------------------------------------------------------
# Triton backward: a dK/dV kernel (K/V tiles outside) and a dQ kernel (Q tiles outside)
# ----------------------------------------------------------------------------------------


def launch_triton_backward(dkdv_kernel, dq_kernel, Q, K, V, O, dO, L, causal=False, scale=None,
                           Br=16, Bc=16):
    """The backward of one head: Q (Nq, d), K, V (Nk, d), O, dO (Nq, d) float32 torch tensors,
    L (Nq,) the natural-log logsumexp of the forward. Returns (dQ, dK, dV).

    Delta_i = rowsum(dO_i * O_i) (the paper's D_i) is computed here, in torch; then two
    launches: ``dkdv_kernel`` (one program per K/V tile, see launch_dkdv) and ``dq_kernel``
    (one program per Q tile, see launch_dq). No program adds into another's output."""
    import torch

    d = Q.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    Delta = (dO * O).sum(dim=1)  # one float per query row
    dQ = torch.empty(Q.shape, dtype=torch.float32, device=Q.device)
    dK = torch.empty(K.shape, dtype=torch.float32, device=K.device)
    dV = torch.empty(V.shape, dtype=torch.float32, device=V.device)
    launch_dkdv(dkdv_kernel, Q, K, V, dO, L, Delta, dK, dV, causal, scale, Br, Bc)
    launch_dq(dq_kernel, Q, K, V, dO, L, Delta, dQ, causal, scale, Br, Bc)
    return dQ, dK, dV


def launch_dkdv(kernel, Q, K, V, dO, L, Delta, dK, dV, causal, scale, Br, Bc):
    """One program per K/V tile j of Bc keys: grid (ceil(Nk / Bc),). The kernel writes dK, dV.

    kernel(Q, K, V, dO, L, Delta, dK, dV, scale, Nq, Nk, stride_q, stride_k, stride_v,
    stride_do, stride_dk, stride_dv, D: tl.constexpr, Br: tl.constexpr, Bc: tl.constexpr,
    CAUSAL: tl.constexpr); stride_x is the distance between two rows of x, in elements."""
    import triton

    (Nq, d), Nk = Q.shape, K.shape[0]
    kernel[(triton.cdiv(Nk, Bc),)](Q, K, V, dO, L, Delta, dK, dV, float(scale), Nq, Nk,
                                   Q.stride(0), K.stride(0), V.stride(0), dO.stride(0),
                                   dK.stride(0), dV.stride(0), D=d, Br=Br, Bc=Bc,
                                   CAUSAL=bool(causal))


def launch_dq(kernel, Q, K, V, dO, L, Delta, dQ, causal, scale, Br, Bc):
    """One program per Q tile i of Br rows: grid (ceil(Nq / Br),). The kernel writes dQ.

    kernel(Q, K, V, dO, L, Delta, dQ, scale, Nq, Nk, stride_q, stride_k, stride_v, stride_do,
    stride_dq, D: tl.constexpr, Br: tl.constexpr, Bc: tl.constexpr, CAUSAL: tl.constexpr)."""
    import triton

    (Nq, d), Nk = Q.shape, K.shape[0]
    kernel[(triton.cdiv(Nq, Br),)](Q, K, V, dO, L, Delta, dQ, float(scale), Nq, Nk,
                                   Q.stride(0), K.stride(0), V.stride(0), dO.stride(0),
                                   dQ.stride(0), D=d, Br=Br, Bc=Bc, CAUSAL=bool(causal))


def _padded_rows(a, fill, device, width=None):
    """(buffer, view): a torch view of ``a`` (1-D or 2-D) inside a buffer filled with ``fill``
    that has PAD more rows and, for 2-D ``a``, rows ``width`` elements apart (default: d)."""
    import torch

    a = np.ascontiguousarray(a, dtype=F32)
    shape = (a.shape[0] + PAD,) + ((width or a.shape[1],) if a.ndim == 2 else ())
    buf = torch.full(shape, fill, dtype=torch.float32)
    index = (slice(0, a.shape[0]),) + ((slice(0, a.shape[1]),) if a.ndim == 2 else ())
    buf[index] = torch.from_numpy(a)
    buf = buf.to(device)
    return buf, buf[index]


# The row strides (in elements) of the strided case, for d = 16: each tensor its own, so a
# kernel that uses one tensor's stride for another fails too.
STRIDES = {"Q": 48, "K": 32, "V": 40, "dO": 24, "dQ": 56, "dK": 20, "dV": 36, "O": 52}


def _backward_invoke(which):
    """Launch the learner's dK/dV kernel (which = "dkdv") or dQ kernel (which = "dq") alone,
    on NaN-padded inputs and sentinel-padded outputs."""

    def invoke(fn, case, timeout, measure):
        import torch

        q, k, v, o, do, l, causal, scale, Br, Bc, strided = case.args[:11]
        twice = bool(case.args[11]) if len(case.args) > 11 else False
        device = runtime.kernel_device()
        width = (lambda name: STRIDES.get(name)) if strided else (lambda name: None)
        ins = {name: _padded_rows(a, float("nan"), device, width(name))
               for name, a in (("Q", q), ("K", k), ("V", v), ("dO", do), ("L", l))}
        delta = (torch.from_numpy(do) * torch.from_numpy(o)).sum(dim=1).numpy()
        ins["Delta"] = _padded_rows(delta, float("nan"), device)
        before = {name: buf.clone() for name, (buf, _) in ins.items()}
        names = ("dK", "dV") if which == "dkdv" else ("dQ",)
        like = {"dQ": q, "dK": k, "dV": v}
        # the outputs start as NaN, as torch.empty may leave them: a tile never stored, or an
        # accumulator added to what the output held, shows
        outs = {name: _padded_rows(np.full_like(like[name], np.nan), SENTINEL, device,
                                   width(name))
                for name in names}
        s = 1.0 / math.sqrt(q.shape[1]) if scale is None else scale
        views = {name: view for name, (_, view) in ins.items()}

        seen, again = {}, []

        def launch():
            args = (fn, views["Q"], views["K"], views["V"], views["dO"], views["L"],
                    views["Delta"])
            if which == "dkdv":
                launch_dkdv(*args, outs["dK"][1], outs["dV"][1], causal, s, Br, Bc)
            else:
                launch_dq(*args, outs["dQ"][1], causal, s, Br, Bc)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return tuple(view.cpu().numpy().copy() for _, view in outs.values())

        def run():
            watched = list(views.values()) + [view for _, view in outs.values()]
            with _watch_loads(watched) as counted:
                got = launch()
                if twice:  # the same outputs, holding the first call's answer
                    again.extend(zip(names, launch()))
            seen.update(counted)
            return got if len(got) > 1 else got[0]

        call = call_limited(run, timeout=timeout, measure_memory=measure)
        call.reads = dict(seen)
        call.buffers = {"in": [(name, buf, before[name]) for name, (buf, _) in ins.items()],
                        "out": [(name, buf, like[name].shape) for name, (buf, _) in outs.items()],
                        "again": again}
        return call

    return invoke


def _backward_bounds_probe(call, outputs):
    """Inputs (padding included) unchanged; outside each output's (rows, d) view, the
    sentinel intact (no store past the last row, nor into the gap of a longer row stride)."""
    problem = _loads_problem(call)
    if problem:
        return problem
    buffers = getattr(call, "buffers", None) or {}
    for name, buf, old in buffers.get("in", ()):
        if not np.array_equal(_numpy(buf), _numpy(old), equal_nan=True):
            return f"your kernel wrote into its input {name}. Store only into its outputs."
    for name, buf, shape in buffers.get("out", ()):
        outside = np.ones(buf.shape, dtype=bool)
        outside[tuple(slice(0, n) for n in shape)] = False
        if not (_numpy(buf)[outside] == SENTINEL).all():
            past = not (_numpy(buf)[shape[0]:] == SENTINEL).all()
            where = ("past its last row: mask the store" if past else
                     "between its rows: address row r as " + name + " + r * stride_"
                     + name.lower() + ", not r * D")
            return f"your kernel wrote outside {name}, {where}."
    return None


H_DKDV = ("One program per K/V tile j: load K_j, V_j once, set dK_j = dV_j = 0, loop over the "
          "Q tiles i: S_ij = tl.dot(Q_i, tl.trans(K_j)) * scale, P_ij = exp(S_ij - L_i) (zero "
          "where masked), dV_j += tl.dot(tl.trans(P_ij), dO_i), dP_ij = tl.dot(dO_i, "
          "tl.trans(V_j)), dS_ij = P_ij * (dP_ij - Delta_i), dK_j += scale * "
          "tl.dot(tl.trans(dS_ij), Q_i); store dK_j and dV_j.")
H_DQ = ("One program per Q tile i: load Q_i, dO_i, L_i, Delta_i once, set dQ_i = 0, loop over "
        "the K/V tiles j: recompute S_ij, P_ij = exp(S_ij - L_i), dP_ij = tl.dot(dO_i, "
        "tl.trans(V_j)), dS_ij = P_ij * (dP_ij - Delta_i), dQ_i += scale * tl.dot(dS_ij, K_j); "
        "store dQ_i.")
H_BWD_MASK = (" Rows past Nq and keys past Nk: load Q_i, dO_i, L_i, Delta_i, K_j, V_j with "
              "mask=... and other=0.0, give masked pairs P_ij = 0, and store with a mask. (Here "
              "the memory after each input holds NaN: an unmasked load brings it in.)")
H_STRIDES = ("Each tensor's rows are further apart than D here (views into wider buffers, "
             "each with its own row stride): address row r of Q as Q + r * stride_q, of dO as "
             "dO + r * stride_do, and so on; never r * D, and never one tensor's stride for "
             "another.")
H_BWD_CAUSAL = {
    "dkdv": ("causal: key j is visible to query i when j <= i (the diagonal too), and masked "
             "pairs get P_ij = 0. The program of K/V tile j may skip only the Q rows before "
             "its first key j * Bc (they see none of the tile): start its Q loop at "
             "(j * Bc // Br) * Br, as Br and Bc may differ."),
    "dq": ("causal: key j is visible to query i when j <= i (the diagonal too), and masked "
           "pairs get P_ij = 0. The program of Q tile i may skip only the keys past its last "
           "row (i + 1) * Br - 1: end its K/V loop at min(Nk, (i + 1) * Br), as Br and Bc "
           "may differ."),
}
H_BWD_WIDE = ("Logits differ by hundreds: P_ij = exp(S_ij - L_i) with the saved L_i is already "
              "normalized and never overflows for a visible pair; keep masked pairs out of the "
              "exp (tl.where before it), or they can overflow to inf, and inf * 0 is NaN.")


def _backward_triton_case(label, hint, shape, tiles, causal, scale, kind, seed, outputs,
                          strided=False, twice=False):
    (Q, K, V), (q, k, v) = _inputs(shape, kind, F32, seed)
    on_gpu = not runtime.triton_interpreted()

    def compute():
        O, L = reference.naive_attention(Q, K, V, causal=causal, scale=scale)
        dO = _normal(seed + 1000, *O.shape)
        o, l, do = (np.asarray(a, dtype=F32) for a in (O, L, dO))
        grads = reference.naive_attention_backward(Q, K, V, do.astype(F64), causal=causal,
                                                   scale=scale)
        naive = (_naive_backward_tf32 if on_gpu else _backward_in_dtype)(q, k, v, o, do, l,
                                                                         causal, scale)
        other = _backward_in_dtype(q, k, v, o, do, l, causal, scale, delta="P dP")
        return (o, l, do), grads, naive, other, _backward_rounding(q, k, v, o, do, l, causal,
                                                                   scale, grads, on_gpu)

    (o, l, do), grads, naive, other, rounding = _memo(("triton backward", label), compute)
    pick = {"dQ": 0, "dK": 1, "dV": 2}
    case = Case(label, hint, (q, k, v, o.copy(), do.copy(), l.copy(), causal, scale) + tiles
                + (strided, twice), outputs, tuple(grads[pick[n]] for n in outputs),
                tuple(naive[pick[n]] for n in outputs), inputs=("Q", "K", "V", "O", "dO", "L"),
                dtype=F32, probe=_backward_bounds_probe,
                variants=(tuple(other[pick[n]] for n in outputs),),
                rounding=tuple(float(rounding[pick[n]]) for n in outputs),
                # TF32 dots on a GPU: the gradients chain two of them (dP, then dS^T Q), and
                # Triton's TF32 rounding is not cuBLAS's; measured on an H100, a correct kernel
                # reached 4.4x the naive TF32 error (2.7e-3) where the forward stays under 4x.
                # A wrong kernel misses by 1e-1 or more.
                floor_scale=250.0 if on_gpu else 0.0)
    case.float64_inputs = (Q, K, V, do.astype(F64), l.astype(F64), o.astype(F64))
    if twice:
        case.probe = _repeat_probe(case, _backward_bounds_probe)
    return case


def _backward_rounding(q, k, v, o, do, l, causal, scale, grads, gpu):
    """(dQ, dK, dV)'s allowances from rounding on this draw (flashedu.tolerance), with Delta as
    the launcher computes it (float32)."""
    from .. import tolerance

    delta = (do * o).sum(axis=1, dtype=F32)
    bounds = tolerance.attention_backward_rounding(
        q, k, v, do, l, delta, causal=causal, scale=scale, dtype="float32",
        dot_unit=tolerance.TF32_UNIT if gpu else None)
    return tuple(tolerance.ROUNDING_FACTOR * tolerance.normalized(b, r)
                 for b, r in zip(bounds, grads))


def _naive_backward_tf32(q, k, v, o, do, l, causal, scale):
    """The backward's formulas in float32 with every dot's operands read as TF32, as the
    kernels' tl.dot reads them on a GPU: its error sets the tolerance there (as _naive_tf32
    does for the forward)."""
    S, scale = _scores_tf32(q, k, causal, scale)
    with np.errstate(all="ignore"):
        P = np.exp(S - l[:, None])
        dS = P * (tf32(do) @ tf32(v).T - (do * o).sum(axis=1, keepdims=True))
    scale = F32(scale)
    return (scale * (tf32(dS) @ tf32(k)), scale * (tf32(dS).T @ tf32(q)), tf32(P).T @ tf32(do))


def _backward_triton_cases(which):
    outputs = {"dkdv": ("dK", "dV"), "dq": ("dQ",)}[which]
    return [_backward_triton_case(*spec[:8], outputs, *spec[8:])
            for spec in _backward_specs(which)]


# A case: (label, hint, (Nq, Nk, d), (Br, Bc), causal, scale, kind of inputs, seed, strided,
# called twice).
def _backward_specs(which):
    hint = {"dkdv": H_DKDV, "dq": H_DQ}[which]
    d, t16, M = 16, (16, 16), H_BWD_MASK

    def t(label, h, shape, tiles, causal, scale, kind, seed, strided=False, twice=False):
        return (label, h, shape, tiles, causal, scale, kind, seed, strided, twice)

    C = H_BWD_CAUSAL[which]
    out = {"dkdv": "dK and dV", "dq": "dQ"}[which]
    return [
        t("one tile, Nq=Nk=16", hint, (16, 16, d), t16, False, None, "normal", 1),
        t("several tiles, Nq=Nk=64", hint, (64, 64, d), t16, False, None, "normal", 2),
        t("edge tiles, Nq=37, Nk=53", H_EDGE + M, (37, 53, d), t16, False, None, "normal", 3),
        t("N=1", H_N1 + M, (1, 1, d), t16, False, None, "normal", 4),
        t("Nq=10 < Nk=45", H_NQNK + M, (10, 45, d), t16, False, None, "normal", 5),
        t("Nq=45 > Nk=10", H_NQNK + M, (45, 10, d), t16, False, None, "normal", 6),
        t("Br=32, Bc=16", "Br and Bc differ: Q tiles have Br rows, K/V tiles Bc.", (40, 40, d),
          (32, 16), False, None, "normal", 7),
        t("Br=16, Bc=32", "Br and Bc differ: Q tiles have Br rows, K/V tiles Bc.", (40, 40, d),
          (16, 32), False, None, "normal", 8),
        t("explicit scale=0.3", H_SCALE, (20, 30, d), t16, False, 0.3, "normal", 9),
        t("row strides differ from d: Nq=21, Nk=27", H_STRIDES, (21, 27, d), t16, False, None,
          "normal", 10, strided=True),
        t("logits in the hundreds", H_BWD_WIDE, (24, 40, d), t16, False, None, "wide", 11),
        t("causal, Nq=Nk=64", C, (64, 64, d), t16, True, None, "normal", 12),
        t("causal, Nq=Nk=37", C + M, (37, 37, d), t16, True, None, "normal", 13),
        t("causal, Nq=20 < Nk=53", C, (20, 53, d), t16, True, None, "normal", 14),
        t("causal, Nq=53 > Nk=20", C, (53, 20, d), t16, True, None, "normal", 15),
        t("causal, Br=32, Bc=16", C, (40, 40, d), (32, 16), True, None, "normal", 16),
        t("causal, Br=16, Bc=32", C, (40, 40, d), (16, 32), True, None, "normal", 17),
        t("causal, N=1", C, (1, 1, d), t16, True, None, "normal", 18),
        t("causal, scale=2.0, row strides differ from d", C + " " + H_STRIDES, (33, 29, d),
          t16, True, 2.0, "normal", 19, strided=True),
        t("causal, logits in the hundreds", H_BWD_WIDE, (24, 40, d), t16, True, None, "wide",
          20),
        t("causal, a future key dominates", C + " " + H_BWD_WIDE, (40, 40, d), t16, True, None,
          "future", 21),
        t("Nq=Nk=300, Br=64, Bc=32", H_LONG + " " + hint + M, (300, 300, d), (64, 32), False,
          None, "normal", 22),
        t(f"called twice into the same {out}, causal, Nq=37, Nk=45", H_TWICE, (37, 45, d), t16,
          True, None, "normal", 23, twice=True),
    ]


def _variants(case):
    """Gradients (dQ, dK, dV) of the usual mistakes, in float64, for the diagnosis."""
    Q, K, V, dO, L, O = case.float64_inputs
    causal, scale = case.args[6], case.args[7]
    s = 1.0 / math.sqrt(Q.shape[1]) if scale is None else scale
    S = s * (Q @ K.T)

    def grads(P, delta=True, of=O):
        dS = P * (dO @ V.T - ((dO * of).sum(1, keepdims=True) if delta else 0.0))
        return s * dS @ K, s * dS.T @ Q, P.T @ dO

    visible = reference.causal_mask(*S.shape) if causal else np.ones(S.shape, dtype=bool)
    P = np.where(visible, np.exp(np.where(visible, S, 0.0) - L[:, None]), 0.0)
    right = grads(P)
    out = {
        "without Delta_i (dS_ij = P_ij * dP_ij)": grads(P, delta=False),
        "with Delta_i = rowsum(dO_i * Q_i)": grads(P, of=Q),
        "without the factor scale": (right[0] / s, right[1] / s, right[2]),
        "with the factor scale twice": (right[0] * s, right[1] * s, right[2]),
    }
    if causal:
        strict = np.tri(*S.shape, k=-1, dtype=bool)
        Ps = np.where(strict, np.exp(np.where(strict, S, 0.0) - L[:, None]), 0.0)
        out["with the causal mask j < i instead of j <= i"] = grads(Ps)
    return out


H_VARIANT = {
    "without Delta_i (dS_ij = P_ij * dP_ij)": (
        "dS_ij = P_ij * (dP_ij - Delta_i): subtract Delta_i (loaded with the rows of the Q "
        "tile, one per row) before multiplying by P_ij."),
    "with Delta_i = rowsum(dO_i * Q_i)": (
        "Delta_i = rowsum(dO_i * O_i), with O the forward's output, not Q_i (the launcher "
        "computes it from O: load it from Delta, one value per row)."),
    "without the factor scale": (
        "S_ij = scale * Q_i K_j^T, so the chain rule brings scale into dQ and dK: "
        "dQ_i += scale * dS_ij K_j, dK_j += scale * dS_ij^T Q_i."),
    "with the factor scale twice": (
        "scale enters dQ and dK once: either inside the loop or at the store, not both."),
    "with the causal mask j < i instead of j <= i": (
        "query i sees key j when j <= i: the diagonal is visible."),
}


def _diagnose_backward_kernel(case, wrong, outputs):
    notes = []
    if any(np.isnan(outputs[name]).any() for name in wrong):
        names = " and ".join(case.outputs)
        notes.append("NaN:")
        if case.args[10]:  # the strided case
            notes.append("here each tensor has its own row stride, with NaN between the rows: "
                         "a kernel that addresses row r as X + r * D, or with another tensor's "
                         "stride, reads it, and a store addressed that way leaves rows of "
                         f"{names} never stored (address row r of {case.outputs[0]} as "
                         f"{case.outputs[0]} + r * stride_{case.outputs[0].lower()}). Or")
        notes.append(f"rows of {names} never stored (the check starts them as NaN, as "
                     "torch.empty may leave them: each program stores all of its tile), an "
                     "accumulator added to what the output held instead of starting at zero, a "
                     "load that read past the end of its tensor (the check keeps NaN after "
                     "each input: mask the loads of Q_i, dO_i, L_i, Delta_i with rows < Nq and "
                     "of K_j, V_j with cols < Nk, other=0.0), or exp that overflowed for a "
                     "masked pair (apply the mask before the exp) so that inf * 0 became NaN.")
        return " ".join(notes)
    pick = {"dQ": 0, "dK": 1, "dV": 2}
    ref = {name: case.expected[case.outputs.index(name)] for name in wrong}
    tol = {name: allowance(case, case.outputs.index(name)) for name in wrong}
    with np.errstate(all="ignore"):  # a mistake's gradients may overflow: they only compare
        variants = _variants(case)
    for label, grads in variants.items():
        mistake = {name: grads[pick[name]] for name in wrong}
        if all(compare.error(outputs[n], mistake[n]) <= tol[n] for n in wrong) and \
                all(compare.error(mistake[n], ref[n]) > tol[n] for n in wrong):
            return (f"Your {' and '.join(sorted(wrong))} {'is' if len(wrong) == 1 else 'are'} "
                    f"what one gets {label}: "
                    f"{H_VARIANT[label]}")
    if case.outputs == ("dK", "dV"):
        if wrong.keys() == {"dV"}:
            return ("dV is wrong but dK is right: check dV_j += P_ij^T dO_i (P_ij transposed: "
                    "tl.dot(tl.trans(P_ij), dO_i)), accumulated over every Q tile i.")
        if wrong.keys() == {"dK"}:
            return ("dV is right, so P_ij is; dK is not: check dP_ij = dO_i V_j^T, dS_ij = "
                    "P_ij * (dP_ij - Delta_i) and dK_j += scale * dS_ij^T Q_i, accumulated over "
                    "every Q tile i.")
        return ("dK and dV are both wrong, so P_ij is (dV needs nothing else): P_ij = "
                "exp(scale * Q_i K_j^T - L_i) with the forward's natural-log L_i, zero for "
                "masked pairs, and every Q tile that sees tile j visited.")
    return ("dQ_i = scale * sum over the K/V tiles j of dS_ij K_j, with P_ij = exp(scale * "
            "Q_i K_j^T - L_i) and dS_ij = P_ij * (dO_i V_j^T - Delta_i); every K/V tile that "
            "tile i sees must be visited.")


EXERCISES = [
    Exercise("numba_forward_kernel", 3, "flash_forward_kernel", _numba_cases,
             invoke=_numba_invoke, diagnose=_diagnose_kernel, timeout=120.0,
             requires=_numba_unavailable, unfilled=_still_skeleton,
             inspect=lambda k: _kernel_problem(k, "numba"), gate=_gate("numba")),
    Exercise("triton_forward_kernel", 4, "flash_forward_kernel", _triton_cases,
             invoke=_triton_invoke, diagnose=_diagnose_kernel, timeout=120.0,
             requires=_triton_unavailable, unfilled=_still_skeleton,
             inspect=lambda k: _kernel_problem(k, "forward"), gate=_gate("forward")),
    Exercise("triton_backward_dkdv_kernel", 4, "dkdv_kernel",
             lambda: _backward_triton_cases("dkdv"),
             invoke=_backward_invoke("dkdv"), diagnose=_diagnose_backward_kernel,
             timeout=120.0, requires=_triton_unavailable, unfilled=_still_skeleton,
             inspect=lambda k: _kernel_problem(k, "dkdv"), gate=_gate("dkdv")),
    Exercise("triton_backward_dq_kernel", 3, "dq_kernel",
             lambda: _backward_triton_cases("dq"),
             invoke=_backward_invoke("dq"), diagnose=_diagnose_backward_kernel,
             timeout=120.0, requires=_triton_unavailable, unfilled=_still_skeleton,
             inspect=lambda k: _kernel_problem(k, "dq"), gate=_gate("dq")),
]
use_launches(gate_launches)  # what the compile gate compiles: these cases' launches
