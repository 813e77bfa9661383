"""The numba.cuda exercise: the learner's FlashAttention forward kernel, one thread per query
row, K_j and V_j staged in shared memory. ``launch_numba_forward`` (shown in the notebook)
launches it; in numba's CUDA simulator the check counts the reads of K and V and watches every
shared array for data races. What the checks enforce: :mod:`.kernels`.
"""

from __future__ import annotations

import contextlib
import math
import re

import numpy as np

from .. import reference, runtime
from .engine import Case, Exercise
from .kernel_common import (
    F32,
    H_LONG,
    H_TWICE,
    PAD,
    SENTINEL,
    _diagnose_kernel,
    _forward_rounding,
    _gate,
    _kernel_problem,
    _loads_problem,
    _numpy,
    _repeat_probe,
    _still_skeleton,
)
from .numpy_exercises import (
    H_CAUSAL,
    H_EDGE,
    H_N1,
    H_NQNK,
    H_SCALE,
    H_TILES,
    H_FUTURE,
    H_WIDE,
    normalized_key_by_key,
    _inputs,
    _memo,
)
from .sandbox import call_limited


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


def _numba_unavailable():
    try:
        from numba import cuda
    except Exception as exc:  # noqa: BLE001 - any import failure means: cannot check here
        return f"numba.cuda does not import ({exc})"
    if not runtime.numba_simulated() and not cuda.is_available():
        return "no CUDA GPU and NUMBA_ENABLE_CUDASIM is not 1 (import flashedu before numba)"
    return None


EXERCISES = [
    Exercise("numba_forward_kernel", 3, "flash_forward_kernel", _numba_cases,
             invoke=_numba_invoke, diagnose=_diagnose_kernel, timeout=120.0,
             requires=_numba_unavailable, unfilled=_still_skeleton,
             inspect=lambda k: _kernel_problem(k, "numba"), gate=_gate("numba")),
]
