"""Notebook 05's steps, one numba.cuda idea a step: the thread that knows where it is, a shared
tile and its barrier, a naive and a tiled matmul, FlashAttention with one query row per thread,
and register tiles.

Each check launches the learner's kernel on tiny shapes: numba's CUDA simulator runs every GPU
thread as a Python thread. What the simulator lets the check see (as for the graded numba
exercise, see :mod:`..numba_forward`): an index past an array raises IndexError, every read of an
input from global memory is counted, and every shared array is watched for data races between
two ``cuda.syncthreads()``. On a GPU the outputs are views into buffers with a sentinel around
them, so a write past an edge shows up there too.

Three steps (``make_rotate``, ``make_tiled_matmul``, ``make_matmul_registers``) are functions
that build a kernel for given compile-time sizes (numba takes the variables a kernel closes
over as constants): the check builds one for each case's sizes.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import numpy as np

from ... import reference, runtime
from ..kernel_common import SENTINEL, _diagnose_kernel, _kernel_parts, _kernel_problem, \
    _loads_problem
from ..numba_forward import H_NUMBA_GUARD, _CountedReads, _race_watch, _shared_memory_probe, \
    shared_loads
from ..numpy_exercises import H_EDGE, H_N1, H_NQNK, H_SCALE, H_TILES, H_WIDE, _inputs, _rng, \
    normalized_key_by_key
from ..steptools import case, kernel_step

F32 = np.float32
PAD = 8  # elements of sentinel after every axis of an output buffer
RACE_FIX = ("Put a cuda.syncthreads() between the threads' writes of a tile and the reads of "
            "it, and another before the next tile overwrites it (every thread of the block "
            "must reach each one).")


# ----------------------------------------------------------------------------------------
# What every launcher shares
# ----------------------------------------------------------------------------------------


def _output(shape, fill=np.nan):
    """(a float32 device view of ``shape`` filled with ``fill``, the buffer around it): the
    buffer is PAD larger along every axis and holds SENTINEL outside the view."""
    from numba import cuda

    buf = np.full(tuple(n + PAD for n in shape), SENTINEL, dtype=F32)
    inside = tuple(slice(0, n) for n in shape)
    buf[inside] = fill
    dev = cuda.to_device(buf)
    return dev[inside], dev


def _read_back(dev, shape, name):
    """The view's values; an IndexError when the kernel wrote outside it (on a GPU: the
    simulator raises at the write itself)."""
    from numba import cuda

    cuda.synchronize()
    buf = dev.copy_to_host()
    inside = tuple(slice(0, n) for n in shape)
    outside = np.ones(buf.shape, dtype=bool)
    outside[inside] = False
    if not (buf[outside] == SENTINEL).all():
        raise IndexError(f"your kernel wrote outside {name} (an index past its last row or "
                         "column): guard every write.")
    return buf[inside].copy()


def _built(make, sizes, symbol):
    """The kernel that the learner's ``make(*sizes)`` returns, or a TypeError that says why
    it is not one."""
    kernel = make(*sizes)
    problem = _kernel_problem(kernel, "numba")
    if problem:
        raise TypeError(f"{symbol}{tuple(sizes)} must return the @cuda.jit kernel it defines: "
                        f"{problem}")
    return kernel


def _factory_problem(make, symbol):
    """A builder step checks a plain function that returns a kernel."""
    is_kernel, _ = _kernel_parts(make, "numba")
    if is_kernel:
        return (f"what was checked is a @cuda.jit kernel; {symbol} is the plain function that "
                "defines the kernel inside it (for its compile-time sizes) and returns it.")
    if not inspect.isfunction(make):
        return f"what was checked is a {type(make).__name__}, not the function {symbol}."
    return None


def numba_step(name, symbol, cases, launch, *, count=(), diagnose=None, builder=False,
               shared_probe=False):
    """A ``kernel_step`` of kind numba whose launches, in the simulator, count the global reads
    of the arguments named in ``count`` ((position, name) pairs: ``call.reads[name]``) and
    watch every shared array for races. A case with ``kwargs={"race": flag}`` launches with
    that barrier switched off and passes when the watcher sees the race (its only output is an
    empty array): the notebook's cells switch the barriers off to show what they prevent.
    ``shared_probe``: on a GPU, count the compiled kernel's loads from shared memory instead
    (what :func:`..numba_forward._shared_memory_probe` reads there)."""
    ex = kernel_step(name, symbol, cases, launch, kind="numba", diagnose=diagnose)
    plain = ex.invoke
    if builder:
        ex.inspect = lambda make: _factory_problem(make, symbol)

    def invoke(fn, view, timeout, measure):
        flag = view.kwargs.get("race")
        if not runtime.numba_simulated():
            call = plain(fn, view, timeout, measure)
            if shared_probe:
                call.reads = {"shared_loads": shared_loads(fn)}
            return call
        args, counted = list(view.args), {}
        for k, label in count:
            args[k] = args[k].view(type(f"{label}_counted", (_CountedReads,),
                                        {"reads": 0, "negative": 0}))
            counted[label] = type(args[k])
        bare = SimpleNamespace(args=tuple(args), kwargs={}, label=view.label)
        with _race_watch() as watched:
            call = plain(fn, bare, timeout, measure)
        call.reads = {label: t.reads for label, t in counted.items()}
        call.reads["negative"] = sum(t.negative for t in counted.values())
        if call.timed_out or call.error is not None:
            return call
        races = [w._race for w in watched if w._race]
        if flag is None:
            if races:
                call.finding = f"{races[0]} {RACE_FIX}"
        elif races:
            call.value = np.zeros(0, dtype=F32)  # the race it should show: this case passes
        else:
            call.finding = (f"with {flag}=False no race showed: your kernel still waits at that "
                            f"barrier. Run its cuda.syncthreads() only `if {flag}:` (the cells "
                            "below switch it off to show what it prevents).")
        return call

    ex.invoke = invoke
    return ex


def _race_case(label, flag, args, hint):
    """A case that switches one barrier off: the watcher must see a race (simulator only)."""
    return case(label, hint, args, ("out",), (np.zeros(0),), naive=(np.zeros(0, dtype=F32),),
                dtype=F32, needs_pass=True, kwargs={"race": flag})


def _normal32(seed, *shape):
    return _rng(seed).standard_normal(shape).astype(F32)


# ----------------------------------------------------------------------------------------
# 05.where_am_i: the global index and the guard
# ----------------------------------------------------------------------------------------


def launch_where_am_i(kernel, n, threads):
    """``kernel[ceil(n / threads), threads](out)`` on a (4, n) table; returns it."""
    out, dev = _output((4, n))
    kernel[math.ceil(n / threads), threads](out)
    return _read_back(dev, (4, n), "out")


H_WHERE = ("Thread i's global index is cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x "
           "(cuda.grid(1) is the same number). Column i: out[0, i] = i, out[1, i] = "
           "cuda.grid(1), out[2, i] = cuda.threadIdx.x, out[3, i] = cuda.blockIdx.x.")
H_WHERE_GUARD = (" The launch rounds up, so the last block has threads past the end: only "
                 "threads with i < out.shape[1] write.")


def _where_cases():
    def one(label, hint, n, threads):
        i = np.arange(n)
        table = np.stack([i, i, i % threads, i // threads]).astype(np.float64)
        return case(label, hint, (n, threads), ("out",), (table,), naive=(table.astype(F32),),
                    dtype=F32)

    return [
        one("n=32, 32 threads a block: one block", H_WHERE, 32, 32),
        one("n=40, 16 threads a block: the last block sticks out", H_WHERE + H_WHERE_GUARD, 40,
            16),
        one("n=37, 8 threads a block", H_WHERE + H_WHERE_GUARD, 37, 8),
        one("n=1, 32 threads a block", H_WHERE + H_WHERE_GUARD, 1, 32),
    ]


def _diagnose_where(case_, wrong, outputs):
    out, (n, threads) = outputs["out"], case_.args
    i = np.arange(n)
    unwritten = np.flatnonzero(np.isnan(out).any(axis=0))
    first_block_only = n > threads and np.array_equal(unwritten, np.arange(threads, n))
    if first_block_only or (n > threads and np.array_equal(out[0], i % threads)):
        return ("every block wrote the same first columns: your global index restarts at 0 in "
                "every block, so it is threadIdx.x, the index inside the block. The global "
                "index adds the threads of the blocks before: blockIdx.x * blockDim.x + "
                "threadIdx.x.")
    if len(unwritten):
        return (f"column(s) {', '.join(map(str, unwritten[:6]))} were never written: every "
                "thread with i < n writes its whole column (the guard is i < n, not i < n - 1).")
    if n > threads and np.array_equal(out[2], i):
        return "row 2 is threadIdx.x, the index inside the block (0 .. blockDim.x - 1)."
    return None


# ----------------------------------------------------------------------------------------
# 05.rotate: a shared tile and cuda.syncthreads()
# ----------------------------------------------------------------------------------------


def launch_rotate(make, x, TPB, use_barrier=True):
    """``make(TPB)[len(x) // TPB, TPB](x, out, use_barrier)``; returns out."""
    kernel = _built(make, (TPB,), "make_rotate")
    out, dev = _output(x.shape)
    kernel[len(x) // TPB, TPB](x, out, bool(use_barrier))
    return _read_back(dev, x.shape, "out")


H_ROTATE = ("Thread t of block b handles i = b * TPB + t: tile[t] = x[i] into the shared array "
            "(TPB float32, cuda.shared.array), cuda.syncthreads() when use_barrier, then "
            "out[i] = tile[(t + 1) % TPB]: the neighbour's number, the last thread wrapping "
            "around to thread 0's.")


def _rotate_cases():
    def one(label, TPB, blocks, seed):
        x = _normal32(seed, blocks * TPB)
        expected = np.roll(x.reshape(blocks, TPB), -1, axis=1).ravel().astype(np.float64)
        return case(label, H_ROTATE, (x, TPB, True), ("out",), (expected,),
                    naive=(expected.astype(F32),), dtype=F32, inputs=("x",))

    cases = [one("TPB=8, 2 blocks", 8, 2, 1), one("TPB=4, 3 blocks", 4, 3, 2),
             one("TPB=16, 1 block", 16, 1, 3)]
    if runtime.numba_simulated():
        cases.append(_race_case(
            "use_barrier=False, TPB=8: the race must show", "use_barrier",
            (_normal32(4, 16), 8, False),
            "use_barrier=False skips the barrier, so that the cells below can show the race."))
    return cases


# ----------------------------------------------------------------------------------------
# 05.matmul_naive and 05.matmul_tiled
# ----------------------------------------------------------------------------------------


def _grid(M, N, tile):
    """Blocks of tile x tile threads over an M x N matrix (x along its columns)."""
    return (math.ceil(N / tile), math.ceil(M / tile)), (tile, tile)


def launch_matmul_naive(kernel, A, B, tile):
    """One thread per element of C: blocks of tile x tile threads over C (x along its
    columns). Returns C."""
    M, N = A.shape[0], B.shape[1]
    C, dev = _output((M, N))
    kernel[_grid(M, N, tile)](A, B, C)
    return _read_back(dev, (M, N), "C")


def launch_matmul_tiled(make, A, B, tile, barrier_1=True, barrier_2=True):
    """``make(tile)``'s kernel on blocks of tile x tile threads. Returns C."""
    kernel = _built(make, (tile,), "make_tiled_matmul")
    M, N = A.shape[0], B.shape[1]
    C, dev = _output((M, N))
    kernel[_grid(M, N, tile)](A, B, C, bool(barrier_1), bool(barrier_2))
    return _read_back(dev, (M, N), "C")


H_NAIVE = ("col, row = cuda.grid(2) (x runs along the columns of C, y along its rows); the "
           "thread sums A[row, k] * B[k, col] over k < K into a float32 and writes C[row, col].")
H_MM_GUARD = (" M, N or K is not a multiple of the tile here: threads past the last row or "
              "column of C (row >= M or col >= N) write nothing.")
H_TILED = ("For k0 in range(0, K, TILE): thread (ty, tx) copies A[row, k0 + tx] into "
           "A_s[ty, tx] and B[k0 + ty, col] into B_s[ty, tx] (0.0 past the edges of A and B), "
           "barrier (1), adds A_s[ty, kk] * B_s[kk, tx] for kk < TILE, barrier (2). Then "
           "C[row, col] = the sum, inside C only.")
H_TILED_EDGE = (" A partial last k-step: the copies past K must be 0.0, or the sum picks up "
                "whatever the tile held.")


def _matmul_case(label, hint, shape, args_after, seed, reads_probe=None):
    M, K, N = shape
    a, b = _normal32(seed, M, K), _normal32(seed + 100, K, N)
    c = case(label, hint, (a, b) + tuple(args_after), ("C",),
             (a.astype(np.float64) @ b.astype(np.float64),), naive=(a @ b,), dtype=F32,
             inputs=("A", "B"))
    if reads_probe is not None:
        c.probe = reads_probe(M, K, N)
    return c


def _tiled_reads_probe(block_m, block_n, what):
    """A staged kernel reads each element of A once per block column of C and each element of
    B once per block row (block_m x block_n tiles of C); allowed: 1.5 times that."""
    def make(M, K, N):
        least = {"A": M * K * math.ceil(N / block_n), "B": K * N * math.ceil(M / block_m)}

        def probe(call, outputs):
            problem = _loads_problem(call)
            if problem or not call.reads:
                return problem
            for name, n in least.items():
                got = call.reads.get(name)
                if got is not None and got > 1.5 * n:
                    size = M * K if name == "A" else K * N
                    per = math.ceil(N / block_n) if name == "A" else math.ceil(M / block_m)
                    return (f"the answer is right, but your kernel read {name} from global "
                            f"memory {got} times, {got / size:.1f} times each element, where "
                            f"a kernel that stages {what} reads each element {per} time(s) "
                            f"here (once per block {'column' if name == 'A' else 'row'} of C). "
                            "Copy each tile into shared memory once, cuda.syncthreads(), and "
                            "do the multiply-adds from shared memory only.")
            return None
        return probe
    return make


def _naive_cases():
    m = _matmul_case
    return [
        m("M=K=N=8, 4 x 4 threads a block", H_NAIVE, (8, 8, 8), (4,), 1),
        m("M=6, K=5, N=10: C is not square", H_NAIVE, (6, 5, 10), (4,), 2),
        m("M=7, K=9, N=5, 4 x 4 threads a block", H_NAIVE + H_MM_GUARD, (7, 9, 5), (4,), 3),
        m("M=K=N=1", H_NAIVE + H_MM_GUARD, (1, 1, 1), (4,), 4),
    ]


def _tiled_cases():
    def m(label, hint, shape, tile, seed):
        probe = _tiled_reads_probe(tile, tile, "TILE x TILE tiles")
        return _matmul_case(label, hint, shape, (tile, True, True), seed, probe)

    cases = [
        m("TILE=4, M=N=8, K=8", H_TILED, (8, 8, 8), 4, 1),
        m("TILE=2, M=4, K=6, N=2", H_TILED, (4, 6, 2), 2, 2),
        m("TILE=4, M=5, K=6, N=7: partial tiles everywhere", H_TILED + H_MM_GUARD +
          H_TILED_EDGE, (5, 6, 7), 4, 3),
        m("TILE=3, M=K=N=1", H_TILED + H_MM_GUARD + H_TILED_EDGE, (1, 1, 1), 3, 4),
    ]
    if runtime.numba_simulated():
        a, b = _normal32(5, 2, 4), _normal32(6, 4, 2)  # one block of 2 x 2 threads
        hint = ("barrier_1 and barrier_2 switch the two cuda.syncthreads() on and off, so that "
                "the cells below can show what each prevents.")
        cases += [_race_case("barrier_1=False: the race must show", "barrier_1",
                             (a, b, 2, False, True), hint),
                  _race_case("barrier_2=False: the race must show", "barrier_2",
                             (a, b, 2, True, False), hint)]
    return cases


def _diagnose_matmul(case_, wrong, outputs):
    A, B = (x.astype(np.float64) for x in case_.args[:2])
    C = outputs["C"]
    if np.isnan(C).any():
        return ("NaN: some elements of C were never written (C starts as NaN): every thread "
                "with row < M and col < N writes its element. cuda.grid(2) returns (x, y), and "
                "x runs along the columns of C: col, row = cuda.grid(2).")
    tile, K = case_.args[2], A.shape[1]
    full = (K // tile) * tile
    tiled = len(case_.args) == 5  # (A, B, TILE, barrier_1, barrier_2)
    if tiled and full < K and np.allclose(C, A[:, :full] @ B[:full], atol=1e-4):
        return ("C misses the last, partial k-step: loop k0 over range(0, K, TILE), "
                "zero-filling the tile past K.")
    return None


# ----------------------------------------------------------------------------------------
# 05.flash_rows: FlashAttention, one query row per thread
# ----------------------------------------------------------------------------------------


def launch_flash_rows(kernel, Q, K, V, scale=None, Br=8):
    """``kernel[(ceil(Nq / Br), H), Br](Q, K, V, O, L, scale)`` on (H, N, d) float32 arrays:
    one thread per query row, one block per Q tile and head. Returns (O, L) with the query
    rows first, (Nq, H, d) and (Nq, H), so that a message's "rows" are query rows."""
    H, Nq, d = Q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    O, dev_o = _output((H, Nq, d))
    L, dev_l = _output((H, Nq))
    kernel[(math.ceil(Nq / Br), H), Br](Q, K, V, O, L, F32(scale))
    O, L = _read_back(dev_o, (H, Nq, d), "O"), _read_back(dev_l, (H, Nq), "L")
    return np.ascontiguousarray(O.transpose(1, 0, 2)), np.ascontiguousarray(L.T)


H_ROWS = ("Thread i owns query row i of head h = cuda.blockIdx.y: its row of Q_i, m_i, l_i and "
          "its row of O_i in its own arrays. For each K_j, V_j tile (BC keys) the block copies "
          "the tile into shared memory, every thread helping, cuda.syncthreads(), the online "
          "softmax on the thread's row, cuda.syncthreads(). At the end O_i / l_i and L_i = "
          "m_i + log(l_i).")
H_HEADS = (" Two heads: block (x, y) handles Q tile x of head y = cuda.blockIdx.y; index Q, K, "
           "V, O and L with h first.")
H_BR = ("Another block size: Br is cuda.blockDim.x, whatever it is, never a constant; the "
        "block copies K_j, V_j in steps of blockDim.x elements.")


def _flash_case(label, hint, H, shape, scale, kind, Br, seed, **extra):
    heads = [_inputs(shape, kind, F32, seed + 1000 * h) for h in range(H)]
    q, k, v = (np.stack([low[n] for _, low in heads]) for n in range(3))
    refs = [reference.naive_attention(*high, scale=scale) for high, _ in heads]
    naive = [reference.naive_attention(*low, scale=scale) for _, low in heads]
    other = [normalized_key_by_key(*low, False, scale) for _, low in heads]
    stack = lambda outs, n: np.stack([o[n] for o in outs], axis=1)  # noqa: E731 (Nq, H, ...)
    return case(label, hint, (q, k, v, scale, Br), ("O", "L"),
                (stack(refs, 0), stack(refs, 1)), naive=(stack(naive, 0), stack(naive, 1)),
                variants=((stack(other, 0), stack(other, 1)),), dtype=F32,
                inputs=("Q", "K", "V"), **extra)


def _flash_cases():
    c, G = _flash_case, H_NUMBA_GUARD
    shared = c("shared memory: Nq=32, Nk=16, 4 blocks of 8 threads", H_ROWS, 1, (32, 16, 4),
               None, "normal", 8, 10, needs_pass=True)
    # the graded exercise's probe, on this head: each element of K and V read once per block
    q, k, v = shared.args[:3]
    shared.probe = _shared_memory_probe(SimpleNamespace(args=(q[0], k[0], v[0], False, None,
                                                              8)))
    return [
        c("one block: Nq=8, Nk=16, d=4", H_ROWS, 1, (8, 16, 4), None, "normal", 8, 1),
        c("several K_j tiles: Nq=8, Nk=40", H_TILES, 1, (8, 40, 4), None, "normal", 8, 2),
        c("two heads, edge tiles: Nq=13, Nk=21", H_EDGE + G + H_HEADS, 2, (13, 21, 4), None,
          "normal", 8, 3),
        c("N=1", H_N1 + G, 1, (1, 1, 4), None, "normal", 8, 4),
        c("Nq=12 > Nk=5", H_NQNK + G, 1, (12, 5, 4), None, "normal", 8, 5),
        c("explicit scale=0.3", H_SCALE, 1, (9, 18, 4), 0.3, "normal", 8, 6),
        c("logits in the hundreds", H_WIDE, 1, (8, 24, 4), None, "wide", 8, 7),
        c("16 threads a block: Nq=18, Nk=20, d=2", H_BR + G, 1, (18, 20, 2), None, "normal", 16,
          8),
        shared,
    ]


# ----------------------------------------------------------------------------------------
# 05.matmul_registers: register tiles
# ----------------------------------------------------------------------------------------


def launch_matmul_registers(make, A, B, TY, TX, TM, TN, BK):
    """``make(TY, TX, TM, TN, BK)``'s kernel: blocks of TY x TX threads, each block a
    (TY TM) x (TX TN) tile of C. Returns C."""
    kernel = _built(make, (TY, TX, TM, TN, BK), "make_matmul_registers")
    M, N = A.shape[0], B.shape[1]
    C, dev = _output((M, N))
    kernel[(math.ceil(N / (TX * TN)), math.ceil(M / (TY * TM))), (TX, TY)](A, B, C)
    return _read_back(dev, (M, N), "C")


H_REGS = ("Thread (ty, tx) owns the TM x TN block of C at rows row0 + ty * TM + r, columns "
          "col0 + tx * TN + c, summed in acc. Per k-step the block's TY * TX threads stage "
          "A_s (BM x BK) and B_s (BK x BN) together, in steps of TY * TX elements (0.0 past the "
          "edges), cuda.syncthreads(); for each k < BK: a[r] = A_s[ty * TM + r, k], "
          "b[c] = B_s[k, tx * TN + c], acc[r, c] += a[r] * b[c]; cuda.syncthreads().")
H_REGS_EDGE = (" M, N, K are not multiples of BM, BN, BK here: write only the elements of acc "
               "that lie inside C, and stage 0.0 past the edges.")


def _registers_cases():
    def m(label, hint, shape, tiles, seed):
        TY, TX, TM, TN, _ = tiles
        probe = _tiled_reads_probe(TY * TM, TX * TN, "BM x BK and BK x BN tiles")
        return _matmul_case(label, hint, shape, tiles, seed, probe)

    return [
        m("TY=TX=4, TM=TN=2, BK=4: M=N=8, K=8", H_REGS, (8, 8, 8), (4, 4, 2, 2, 4), 1),
        m("TY=2, TX=4, TM=2, TN=1, BK=3: M=5, K=7, N=6", H_REGS + H_REGS_EDGE, (5, 7, 6),
          (2, 4, 2, 1, 3), 2),
        m("TY=TX=2, TM=3, TN=2, BK=4 > K: M=5, K=3, N=6", H_REGS + H_REGS_EDGE, (5, 3, 6),
          (2, 2, 3, 2, 4), 3),
        m("M=K=N=1", H_REGS + H_REGS_EDGE, (1, 1, 1), (2, 2, 1, 1, 2), 4),
    ]


STEPS = [
    numba_step("numba_step_where_am_i", "where_am_i", _where_cases, launch_where_am_i,
               diagnose=_diagnose_where),
    numba_step("numba_step_rotate", "make_rotate", _rotate_cases, launch_rotate, builder=True),
    numba_step("numba_step_matmul_naive", "matmul_naive", _naive_cases, launch_matmul_naive,
               diagnose=_diagnose_matmul),
    numba_step("numba_step_matmul_tiled", "make_tiled_matmul", _tiled_cases,
               launch_matmul_tiled, count=((0, "A"), (1, "B")), diagnose=_diagnose_matmul,
               builder=True),
    numba_step("numba_step_flash_rows", "flash_rows", _flash_cases, launch_flash_rows,
               count=((0, "Q"), (1, "K"), (2, "V")), diagnose=_diagnose_kernel,
               shared_probe=True),
    numba_step("numba_step_matmul_registers", "make_matmul_registers", _registers_cases,
               launch_matmul_registers, count=((0, "A"), (1, "B")), diagnose=_diagnose_matmul,
               builder=True),
]
