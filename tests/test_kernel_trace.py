"""flashedu.viz.trace_kernel: the loads and stores of a learner's own Triton and numba kernels,
record by record against a count by hand, and the widget that steps through them.

Triton runs in its interpreter and numba.cuda in its simulator (``import flashedu`` arranges
both on a machine without a GPU); on a GPU the tests skip, as tracing needs them."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from flashedu import reference, runtime
from flashedu.viz import KernelTraceView, trace_kernel
from flashedu.viz.kernel_view import CURRENT, EARLIER, MASKED, OUT, UNTOUCHED

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the course installs triton
    triton = None
try:
    from numba import cuda
except Exception:  # noqa: BLE001 - any import failure: no numba here
    cuda = None

TRITON = triton is not None and runtime.triton_interpreted()
NUMBA = cuda is not None and runtime.numba_simulated()
needs_triton = pytest.mark.skipif(not TRITON, reason="tracing a Triton kernel needs Triton's "
                                  "interpreter (TRITON_INTERPRET=1; triton installed)")
needs_numba = pytest.mark.skipif(not NUMBA, reason="tracing a numba kernel needs numba's CUDA "
                                 "simulator (NUMBA_ENABLE_CUDASIM=1; numba-cuda installed)")


# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def vector_add(x_ptr, y_ptr, out_ptr, N, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        x = tl.load(x_ptr + offs, mask=ok)
        y = tl.load(y_ptr + offs, mask=ok)
        tl.store(out_ptr + offs, x + y, mask=ok)

    @triton.jit
    def vector_add_unmasked(x_ptr, y_ptr, out_ptr, N, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)  # no mask: the last program reads past the end of x
        y = tl.load(y_ptr + offs, mask=offs < N)
        tl.store(out_ptr + offs, x + y)  # and writes past the end of out

    @triton.jit
    def copy_rows(src, dst, n_rows, stride_s, stride_d0, stride_d1, ROWS: tl.constexpr,
                  COLS: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)
        ok = rows[:, None] < n_rows
        tile = tl.load(src + rows[:, None] * stride_s + cols[None, :], mask=ok)
        tl.store(dst + rows[:, None] * stride_d0 + cols[None, :] * stride_d1, tile, mask=ok)

    @triton.jit
    def reshape_wrongly(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < N)
        y = tl.reshape(x, (BLOCK + 1,))  # not a power of two: the kernel raises
        tl.store(out_ptr + offs, y, mask=offs < N)

    @triton.jit
    def copy_by_descriptor(src_desc, dst, N, BLOCK: tl.constexpr, D: tl.constexpr):
        pid = tl.program_id(0)
        tile = src_desc.load([pid * BLOCK, 0])
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + rows[:, None] * D + tl.arange(0, D)[None, :], tile,
                 mask=rows[:, None] < N)

if cuda is not None:
    @cuda.jit
    def shift_right(x, out):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i < out.shape[0]:
            out[i] = x[i - 1]  # i = 0 reads x[-1]: before the array on a GPU

    @cuda.jit
    def shift_left(x, out):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i < out.shape[0]:
            out[i] = x[i + 1]  # the last thread reads one past the end

    @cuda.jit(device=True)
    def twice(v):
        return 2 * v


def line_of(kernel, text: str) -> int:
    """The line of ``kernel``'s source file that holds ``text``."""
    fn = getattr(kernel, "fn", None) or kernel.py_func
    lines, start = inspect.getsourcelines(fn)
    hits = [start + k for k, line in enumerate(lines) if text in line]
    assert len(hits) == 1, (text, hits)
    return hits[0]


def rec(a):
    return (a.kind, a.tensor, a.line, a.elements, a.masked_off, a.out_of_bounds)


def column(*rows):
    return [(r, 0) for r in rows]


def block(rows, cols):
    return [(r, c) for r in rows for c in cols]


def solved(name, tmp_path, replace=()):
    """The course's solved kernel (from solutions/), written to a file and imported."""
    from test_checks import load

    return load(name, replace=replace, tmp_path=tmp_path)


# ------------------------------------------------------------------------------------------
# (a) a vector add with a tail
# ------------------------------------------------------------------------------------------


@needs_triton
def test_vector_add_with_a_tail_program_by_program():
    x, y = torch.arange(10.0), torch.full((10,), 100.0)
    out = torch.zeros(10)
    trace = trace_kernel(vector_add, (3,), x, y, out, 10, BLOCK=4)
    assert trace.error is None and trace.backend == "triton"
    assert torch.equal(out, x + y)  # the launch had its effect
    assert trace.programs == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    lx, ly, lo = (line_of(vector_add, t) for t in ("tl.load(x_ptr", "tl.load(y_ptr",
                                                    "tl.store(out_ptr"))
    for p in range(3):
        rows = [r for r in range(4 * p, 4 * p + 4) if r < 10]
        off = 4 - len(rows)
        assert [rec(a) for a in trace.accesses(p)] == [
            ("load", "x_ptr", lx, column(*rows), off, 0),
            ("load", "y_ptr", ly, column(*rows), off, 0),
            ("store", "out_ptr", lo, column(*rows), off, 0)]
    last = trace.accesses(2)[0]
    assert last.masked == column(10, 11) and last.source == "x = tl.load(x_ptr + offs, mask=ok)"
    assert trace.accesses((2,)) == trace.accesses(2) == trace.accesses((2, 0, 0))
    assert trace.totals() == {("x_ptr", "load"): 10, ("y_ptr", "load"): 10,
                              ("out_ptr", "store"): 10}
    assert trace.touched(2, "x_ptr", "load").tolist() == [False] * 8 + [True] * 2
    assert not trace.touched(2, "x_ptr", "store").any()
    assert trace.touched(None, "out_ptr").all() and trace.out_of_bounds() == []
    assert trace.describe(last) == ("program 2 loaded 2 elements of x_ptr (elements 8..9); 2 "
                                    "lanes masked off (line %d: x = tl.load(x_ptr + offs, "
                                    "mask=ok))" % lx)


# ------------------------------------------------------------------------------------------
# (b) a strided 2-D copy
# ------------------------------------------------------------------------------------------


@needs_triton
def test_strided_copy_maps_addresses_to_rows_and_columns():
    buf = torch.full((6, 8), float("nan"))
    src = buf[:5, :4]  # rows 8 apart: a gap of 4 between them
    src.copy_(torch.arange(20.0).reshape(5, 4))
    dst = torch.zeros(4, 5).T  # column-major: strides (1, 5)
    trace = trace_kernel(copy_rows, 3, src, dst, 5, src.stride(0), dst.stride(0), dst.stride(1),
                         ROWS=2, COLS=4)
    assert torch.equal(dst, src) and trace.out_of_bounds() == []
    ls, ld = line_of(copy_rows, "tl.load(src"), line_of(copy_rows, "tl.store(dst")
    for p in range(3):
        rows = [r for r in (2 * p, 2 * p + 1) if r < 5]
        off = 4 * (2 - len(rows))
        assert [rec(a) for a in trace.accesses(p)] == [
            ("load", "src", ls, block(rows, range(4)), off, 0),
            ("store", "dst", ld, block(rows, range(4)), off, 0)]
    # the masked-off row 5 of src lies past its last row (inside the buffer, but not src's)
    assert trace.accesses(2)[0].masked == block([5], range(4))
    assert trace.touched(None, "src").all() and trace.touched(None, "dst", "store").all()


@needs_triton
def test_a_host_tensor_descriptor_is_traced_as_its_tensor():
    descriptors = pytest.importorskip("triton.tools.tensor_descriptor")
    src, dst = torch.arange(320.0).reshape(20, 16), torch.zeros(20, 16)
    desc = descriptors.TensorDescriptor.from_tensor(src, [16, 16])
    trace = trace_kernel(copy_by_descriptor, 2, desc, dst, 20, BLOCK=16, D=16)
    assert torch.equal(dst, src) and trace.out_of_bounds() == []
    load = trace.accesses(1)[0]
    assert (load.tensor, load.elements, load.masked_off) == \
        ("src_desc", block(range(16, 20), range(16)), 192)


@needs_triton
def test_one_row_or_one_column_is_named_in_the_singular():
    src, dst = torch.arange(20.0).reshape(5, 4), torch.zeros(5, 4)
    trace = trace_kernel(copy_rows, 3, src, dst, 5, 4, 4, 1, ROWS=2, COLS=4)
    last = trace.accesses(2)[0]  # row 4 real, row 5 masked off
    assert trace.describe(last).startswith("program 2 loaded 4 elements of src (row 4, columns "
                                           "0..3); 4 lanes masked off")
    src1, dst1 = src[:, :1], torch.zeros(5, 1)  # one column, rows 4 apart
    trace = trace_kernel(copy_rows, 1, src1, dst1, 5, 4, 1, 1, ROWS=8, COLS=1)
    assert torch.equal(dst1, src1)
    assert trace.describe(trace.accesses(0)[0]).startswith(
        "program 0 loaded 5 elements of src (rows 0..4, column 0); 3 lanes masked off")


# ------------------------------------------------------------------------------------------
# (c) the course's Triton forward kernel
# ------------------------------------------------------------------------------------------


def _forward_args(Nq, Nk, d):
    g = torch.Generator().manual_seed(3)
    Q, K, V = (torch.randn(n, d, generator=g) for n in (Nq, Nk, Nk))
    O, L = torch.empty(Nq, d), torch.empty(Nq)
    return (Q, K, V, O, L, 1 / math.sqrt(d), Nq, Nk, Q.stride(0), K.stride(0), V.stride(0),
            O.stride(0))


def _tile_summary(trace, program):
    """(kind, tensor, rows, elements, masked-off lanes) of each access of ``program``."""
    out = []
    for a in trace.accesses(program):
        rows = sorted({r for r, _ in a.elements})
        out.append((a.kind, a.tensor, (rows[0], rows[-1]), len(a.elements), a.masked_off,
                    a.out_of_bounds))
    return out


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
def test_course_forward_kernel_tiles(tmp_path, causal):
    kernel = solved("triton_forward_kernel", tmp_path)
    args = _forward_args(20, 20, 16)
    trace = trace_kernel(kernel, (2,), *args, D=16, Br=16, Bc=16, CAUSAL=causal)
    assert trace.error is None
    Q, K, V, O, L = (a.double().numpy() for a in args[:5])
    O_ref, L_ref = reference.naive_attention(Q, K, V, causal=causal)
    assert np.abs(O - O_ref).max() < 1e-5 and np.abs(L - L_ref).max() < 1e-5
    full, tail = 16 * 16, 4 * 16  # a tile of 16 rows; the last K/V tile has rows 16..19
    kv = lambda j: [("load", "K", (16 * j, min(16 * j + 15, 19)), full if j == 0 else tail,
                     0 if j == 0 else 192, 0),
                    ("load", "V", (16 * j, min(16 * j + 15, 19)), full if j == 0 else tail,
                     0 if j == 0 else 192, 0)]
    # program 0: Q rows 0..15; causal skips K/V tile 1 (keys 16..19 lie above the diagonal)
    assert _tile_summary(trace, 0) == [("load", "Q", (0, 15), full, 0, 0)] + kv(0) + \
        ([] if causal else kv(1)) + [("store", "O", (0, 15), full, 0, 0),
                                     ("store", "L", (0, 15), 16, 0, 0)]
    # program 1: Q rows 16..19, its 12 other rows masked off (12 x 16 lanes); both K/V tiles
    assert _tile_summary(trace, 1) == [("load", "Q", (16, 19), tail, 192, 0)] + kv(0) + \
        kv(1) + [("store", "O", (16, 19), tail, 192, 0), ("store", "L", (16, 19), 4, 12, 0)]
    q1 = trace.accesses(1)[0]
    assert q1.elements == block(range(16, 20), range(16))
    assert q1.masked == block(range(20, 32), range(16))  # where the masked rows point
    assert q1.line == line_of(kernel, "Q_i = tl.load(")
    assert trace.touched(1, "Q", "load")[16:].all() and not trace.touched(1, "Q")[:16].any()
    totals = trace.totals()
    # K: rows 0..19 (320 elements) in each program; causal: only rows 0..15 in program 0
    assert totals[("K", "load")] == (256 if causal else 320) + 320
    assert totals[("O", "store")] == 20 * 16 and totals[("L", "store")] == 20


# ------------------------------------------------------------------------------------------
# (d) out of bounds: flagged, never performed
# ------------------------------------------------------------------------------------------


@needs_triton
def test_unmasked_access_past_the_end_is_flagged_and_not_performed():
    xbuf, obuf = torch.full((16,), float("nan")), torch.full((16,), 7.0)
    x, out = xbuf[:10], obuf[:10]
    x.copy_(torch.arange(10.0))
    y = torch.ones(10)
    trace = trace_kernel(vector_add_unmasked, 3, x, y, out, 10, BLOCK=4)
    assert trace.error is None
    assert torch.equal(out, x + 1) and (obuf[10:] == 7).all()  # the stray store was dropped
    lx, lo = line_of(vector_add_unmasked, "x = tl.load"), line_of(vector_add_unmasked,
                                                                  "tl.store(out_ptr")
    assert [rec(a) for a in trace.accesses(2)] == [
        ("load", "x_ptr", lx, column(8, 9), 0, 2),
        ("load", "y_ptr", line_of(vector_add_unmasked, "y = tl.load"), column(8, 9), 2, 0),
        ("store", "out_ptr", lo, column(8, 9), 0, 2)]
    bad = trace.out_of_bounds()
    assert [(a.program, a.kind, a.outside) for a in bad] == [
        ((2, 0, 0), "load", column(10, 11)), ((2, 0, 0), "store", column(10, 11))]
    assert trace.describe(bad[0]).startswith(
        "program 2 loaded 2 elements of x_ptr (elements 8..9) and 2 elements past the end of "
        "x_ptr (elements 10..11 if x_ptr went on)")
    assert "program 2 stored" in trace.notes()[1] and "4 elements out of bounds" in \
        trace.headline


@needs_triton
def test_a_missing_mask_in_the_course_kernel_reads_past_the_last_row_of_K(tmp_path):
    masked = "K_j = tl.load(K + cols[:, None] * stride_k + dims[None, :], mask=col_ok[:, None], " \
             "other=0.0)"
    kernel = solved("triton_forward_kernel", tmp_path,
                    replace=[(masked, "K_j = tl.load(K + cols[:, None] * stride_k + "
                              "dims[None, :])")])
    trace = trace_kernel(kernel, (2,), *_forward_args(20, 20, 16), D=16, Br=16, Bc=16,
                         CAUSAL=False)
    bad = trace.out_of_bounds()
    assert [(a.program, a.tensor, a.out_of_bounds, len(a.elements)) for a in bad] == [
        ((0, 0, 0), "K", 192, 64), ((1, 0, 0), "K", 192, 64)]
    assert bad[0].outside == block(range(20, 32), range(16))
    assert "program 1 loaded 64 elements of K (rows 16..19, columns 0..15) and 192 elements " \
        "past the last row of K (rows 20..31 if K went on)" in trace.describe(bad[1])


@needs_triton
def test_lanes_between_the_rows_of_a_strided_tensor():
    sbuf, dbuf = torch.full((6, 8), float("nan")), torch.full((6, 8), 7.0)
    src, dst = sbuf[:5, :4], dbuf[:5, :4]
    src.copy_(torch.arange(20.0).reshape(5, 4))
    trace = trace_kernel(copy_rows, 3, src, dst, 5, 8, 8, 1, ROWS=2, COLS=8)  # 8 columns, 4 real
    assert torch.equal(dst, src) and (dbuf[:, 4:] == 7).all()
    load = trace.accesses(0)[0]
    assert (load.elements, load.out_of_bounds) == (block([0, 1], range(4)), 8)
    assert load.outside == block([0, 1], range(4, 8))
    assert "8 elements between the rows of src (columns 4..7; src has 4)" in \
        trace.describe(load)
    last = trace.accesses(2)[0]  # row 4 real, row 5 masked off
    assert (len(last.elements), last.masked_off, last.out_of_bounds) == (4, 8, 4)


# ------------------------------------------------------------------------------------------
# (e) numba: global and shared memory, block by block
# ------------------------------------------------------------------------------------------


@needs_numba
def test_numba_forward_reads_global_and_shared_memory_per_block(tmp_path):
    kernel = solved("numba_forward_kernel", tmp_path)
    rng = np.random.default_rng(4)
    Q, K, V = (rng.standard_normal((n, 4)).astype(np.float32) for n in (16, 20, 20))
    O, L = np.full((16, 4), np.nan, np.float32), np.full(16, np.nan, np.float32)
    trace = trace_kernel(kernel, (2, 8), Q, K, V, O, L, np.float32(0.5), False)
    assert trace.error is None and trace.backend == "numba" and trace.block == (8, 1, 1)
    O_ref, L_ref = reference.naive_attention(*(a.astype(np.float64) for a in (Q, K, V)),
                                             scale=0.5)
    assert np.abs(O - O_ref).max() < 1e-5 and np.abs(L - L_ref).max() < 1e-5
    assert trace.tensors["K_j"].space == "shared" and trace.tensors["K_j"].shape == (16, 32)
    line = {name: line_of(kernel, text) for name, text in (
        ("Q", "q[c] = Q[i, c]"), ("K", "= K[start + r, c]"), ("V", "= V[start + r, c]"),
        ("K_j", "s += q[c] * K_j[r, c]"), ("V_j", "o[c] += p * V_j[r, c]"),
        ("O", "O[i, c] = "), ("L", "L[i] = "))}

    def tile(rows, n):  # K_j, V_j tile of n keys: copied in, then read by all 8 threads
        return [("load", "K", line["K"], set(block(rows, range(4))), 8),
                ("store", "K_j", line["K"], set(block(range(n), range(4))), 8),
                ("load", "V", line["V"], set(block(rows, range(4))), 8),
                ("store", "V_j", line["V"], set(block(range(n), range(4))), 8),
                ("load", "K_j", line["K_j"], set(block(range(n), range(4))), 8),
                ("load", "V_j", line["V_j"], set(block(range(n), range(4))), 8)]

    for b in range(2):
        rows = range(8 * b, 8 * b + 8)
        got = [(a.kind, a.tensor, a.line, set(a.elements), a.threads)
               for a in trace.accesses(b)]
        assert got == [("load", "Q", line["Q"], set(block(rows, range(4))), 8)] + \
            tile(range(16), 16) + tile(range(16, 20), 4) + \
            [("store", "O", line["O"], set(block(rows, range(4))), 8),
             ("store", "L", line["L"], set(column(*rows)), 8)]
        shared_reads = [len(a.elements) for a in trace.accesses(b) if a.tensor == "K_j"
                        and a.kind == "load"]
        assert shared_reads == [8 * 16 * 4, 8 * 4 * 4]  # every thread reads the whole tile
    # staged in shared memory: each block reads each element of K and V once from global memory
    totals = trace.totals()
    assert totals[("K", "load")] == totals[("V", "load")] == 2 * 20 * 4
    assert totals[("K_j", "load")] == 2 * 8 * 20 * 4 and totals[("Q", "load")] == 16 * 4
    assert trace.touched(1, "K_j", "store")[:16, :4].all()
    assert not trace.touched(1, "K_j")[:, 4:].any()
    assert trace.out_of_bounds() == []


@needs_numba
def test_numba_negative_index_is_flagged_and_wraps_as_numpy_does():
    x = np.arange(8, dtype=np.float32)
    out = np.zeros(8, dtype=np.float32)
    trace = trace_kernel(shift_right, (1, 8), x, out)
    assert trace.error is None
    assert out.tolist() == [7.0] + list(range(7))  # the simulator's behaviour, unchanged
    (bad,) = trace.out_of_bounds()
    assert (bad.tensor, bad.kind, bad.out_of_bounds, bad.outside, len(bad.elements)) == \
        ("x", "load", 1, [(-1, 0)], 7)
    assert bad.line == line_of(shift_right, "x[i - 1]")
    assert "1 element before the first element of x (elements -1 if x went on)" in \
        trace.describe(bad)


@needs_numba
def test_numba_index_past_the_end_is_flagged_and_its_error_kept():
    x, out = np.arange(8, dtype=np.float32), np.zeros(8, dtype=np.float32)
    trace = trace_kernel(shift_left, (1, 8), x, out)
    assert trace.error is not None and trace.error.type == "IndexError"
    assert "x[i + 1]" in trace.error.source
    assert trace.headline.startswith("your kernel raised IndexError")
    bad = [a for a in trace.out_of_bounds() if a.tensor == "x"]
    assert len(bad) == 1 and bad[0].outside == [(8, 0)]
    assert "past the end of x" in trace.describe(bad[0])


@needs_triton
def test_a_triton_kernel_that_raises_keeps_its_error_and_the_line():
    x, out = torch.zeros(10), torch.zeros(10)
    trace = trace_kernel(reshape_wrongly, 3, x, out, 10, BLOCK=4)
    assert trace.error.type == "ValueError" and "power of 2" in trace.error.message
    assert trace.error.source.startswith("y = tl.reshape(x, (BLOCK + 1,))")
    assert trace.headline.startswith("your kernel raised ValueError")
    assert [a.kind for a in trace.accesses(0)] == ["load"] and trace.accesses(1) == []


# ------------------------------------------------------------------------------------------
# (f) bad input
# ------------------------------------------------------------------------------------------


@needs_triton
def test_bad_input_to_a_triton_trace(tmp_path):
    x = torch.zeros(10)
    with pytest.raises(TypeError, match="kernel: 'plain' is not a @triton.jit or @cuda.jit"):
        def plain(x):
            return x
        trace_kernel(plain, 1, x)
    with pytest.raises(TypeError, match="grid"):
        trace_kernel(vector_add, "3", x, x, x, 10, BLOCK=4)
    with pytest.raises(TypeError, match="grid"):
        trace_kernel(vector_add, (1, 2, 3, 4), x, x, x, 10, BLOCK=4)
    with pytest.raises(TypeError, match="grid: a function"):
        trace_kernel(vector_add, lambda meta: (3,), x, x, x, 10, BLOCK=4)
    with pytest.raises(ValueError, match="grid: .* negative"):
        trace_kernel(vector_add, (-1,), x, x, x, 10, BLOCK=4)
    with pytest.raises(TypeError, match=r"args: .*vector_add\(x_ptr, y_ptr, out_ptr, N, BLOCK\)"):
        trace_kernel(vector_add, 3, x, x, BLOCK=4)
    with pytest.raises(ValueError, match="y_ptr: a tensor on meta"):
        trace_kernel(vector_add, 3, x, torch.zeros(10, device="meta"), x, 10, BLOCK=4)
    with pytest.raises(ValueError, match="x_ptr: its elements overlap"):
        trace_kernel(vector_add, 3, torch.zeros(1).expand(10), x, x, 10, BLOCK=4)
    compiled = triton.runtime.jit.JITFunction(vector_add.fn)  # as on a GPU, no interpreter
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        trace_kernel(compiled, 3, x, x, x, 10, BLOCK=4)
    trace = trace_kernel(vector_add, 3, x, x, x, 10, BLOCK=4)
    with pytest.raises(ValueError, match="program: 3 is not in the grid"):
        trace.accesses(3)
    with pytest.raises(ValueError, match="tensor: 'x' is not traced"):
        trace.touched(0, "x")
    with pytest.raises(ValueError, match="kind: 'read'"):
        trace.touched(0, "x_ptr", "read")


@needs_numba
def test_bad_input_to_a_numba_trace():
    x, out = np.zeros(8, np.float32), np.zeros(8, np.float32)
    with pytest.raises(TypeError, match="grid: 8; for a numba kernel"):
        trace_kernel(shift_right, 8, x, out)
    with pytest.raises(TypeError, match="grid's threads"):
        trace_kernel(shift_right, (1, "8"), x, out)
    with pytest.raises(TypeError, match="BLOCK: a numba kernel takes its arguments by position"):
        trace_kernel(shift_right, (1, 8), x, out, BLOCK=4)
    with pytest.raises(TypeError, match=r"args: shift_right takes 2 arguments \(x, out\), got 1"):
        trace_kernel(shift_right, (1, 8), x)
    with pytest.raises(TypeError, match="device function"):
        trace_kernel(twice, (1, 8), x)
    on_gpu = type("CUDADispatcher", (), {"__module__": "numba.cuda.dispatcher"})()
    with pytest.raises(ValueError, match="NUMBA_ENABLE_CUDASIM=1"):
        trace_kernel(on_gpu, (1, 8), x, out)


# ------------------------------------------------------------------------------------------
# (g) the widget
# ------------------------------------------------------------------------------------------


@needs_triton
def test_view_steps_through_a_program_and_marks_out_of_bounds():
    pytest.importorskip("ipywidgets")
    xbuf = torch.zeros(16)
    x, y, out = xbuf[:10], torch.ones(10), torch.zeros(16)[:10]
    trace = trace_kernel(vector_add_unmasked, 3, x, y, out, 10, BLOCK=4)
    view = trace.view()
    assert isinstance(view, KernelTraceView)
    assert view.program == (2, 0, 0) and view.position == 1  # opens at the first stray access
    assert "2 elements past the end of x_ptr" in view.status
    cells = view.cells["x_ptr"]  # rows 0..11: the tensor and two rows past its end
    assert view.first_row["x_ptr"] == 0 and cells.shape == (12, 1)
    assert cells[:, 0].tolist() == [UNTOUCHED] * 8 + [CURRENT] * 2 + [OUT] * 2
    assert "cell oob" in view.grids.value and "cell current" in view.grids.value
    assert len(view.notes) == 2 and "▶" in view.notes_html.value
    view.step()
    assert view.position == 2 and view.access.tensor == "y_ptr"
    assert view.cells["x_ptr"][8:10, 0].tolist() == [EARLIER] * 2
    assert view.cells["y_ptr"][:, 0].tolist() == [UNTOUCHED] * 8 + [CURRENT] * 2 + [MASKED] * 2
    view.step()
    view.step()  # past the last access: stays there
    assert view.position == 3 and view.access.kind == "store"
    view.back()
    assert view.position == 2
    view.picker.value = (0, 0, 0)
    assert view.position == 1 and view.slider.max == 3 and view.notes == []
    assert view.status.startswith("access 1 of 3: program 0 loaded 4 elements of x_ptr")
    assert all(d.width <= 960 for d in view.drawings())  # fits a 1024 x 768 screen
    assert view.static_png().startswith(b"\x89PNG")


@needs_numba
def test_view_draws_shared_memory_of_a_numba_block(tmp_path):
    pytest.importorskip("ipywidgets")
    kernel = solved("numba_forward_kernel", tmp_path)
    rng = np.random.default_rng(5)
    Q, K, V = (rng.standard_normal((n, 4)).astype(np.float32) for n in (8, 20, 20))
    O, L = np.zeros((8, 4), np.float32), np.zeros(8, np.float32)
    trace = trace_kernel(kernel, (1, 8), Q, K, V, O, L, np.float32(0.5), False)
    view = KernelTraceView(trace)
    assert view.program == (0, 0, 0) and view.picker.description == "block"
    assert [d.svg().count(" shared") > 0 for d in view.drawings()] == \
        [False] * 5 + [True] * 2  # Q, K, V, O, L, then K_j and V_j in shared memory
    view.slider.value = 3  # the block stores its first K_j tile into shared memory
    assert view.access.tensor == "K_j" and view.access.kind == "store"
    assert (view.cells["K_j"][:16, :4] == CURRENT).all() and \
        (view.cells["K_j"][:, 4:] == UNTOUCHED).all()
    assert "block 0 wrote 64 elements of K_j (rows 0..15, columns 0..3); by 8 threads" in \
        view.status


# ------------------------------------------------------------------------------------------
# (e) a wrong output traced back to the store that wrote it
# ------------------------------------------------------------------------------------------


def _expected_O(args, causal):
    Q, K, V = (a.double().numpy() for a in args[:3])
    return reference.naive_attention(Q, K, V, causal=causal)[0]


@needs_triton
def test_a_wrong_diagonal_is_found_in_the_store_that_wrote_it(tmp_path):
    """Keys strictly below the diagonal (< for <=): every row loses its own key; the first
    store with wrong elements is program 0's store of O, and row 0 (no key left) is NaN."""
    kernel = solved("triton_forward_kernel", tmp_path, replace=[(
        "(cols[None, :] <= rows[:, None])", "(cols[None, :] < rows[:, None])")])
    args = _forward_args(20, 20, 16)
    trace = trace_kernel(kernel, (2,), *args, D=16, Br=16, Bc=16, CAUSAL=True)
    found = trace.compare("O", _expected_O(args, True))
    assert not found.agrees and found.nan
    assert found.first.program == (0, 0, 0) and found.first.kind == "store"
    assert found.first.line == line_of(kernel, "tl.store(O + rows")
    assert {r for r, _ in found.elements} == set(range(16))  # every row of the tile
    assert found.wrong > 300 and found.never_stored == []  # a few land within 1e-3 by chance
    got, want = args[3].double().numpy(), _expected_O(args, True)
    wrong = ~(np.abs(got - want) <= 1e-3 * (1 + np.abs(want)))
    assert set(found.elements) == {(r, c) for r, c in np.argwhere(wrong) if r < 16}
    text = found.verdict
    assert text.startswith(f"O is wrong in {found.wrong} of 320 elements (NaN among them).")
    assert f"First: program 0 stored {len(found.elements)} wrong of the 256 it wrote there, " \
        "rows 0..15, columns 0..15 (line" in text
    view = found.view()
    assert view.program == (0, 0, 0) and view.access is found.first
    cells = view.cells["O"]  # wrong (5) wins over "this access" (3), the rest of the tile
    assert ((cells[:16] == 5) == wrong[:16]).all() and (cells[:16][~wrong[:16]] == 3).all()


@needs_triton
def test_a_right_kernel_agrees_and_rows_no_program_stored_are_named(tmp_path):
    kernel = solved("triton_forward_kernel", tmp_path)
    args = _forward_args(20, 20, 16)
    args[3].fill_(float("nan"))  # O as torch.empty may leave it
    trace = trace_kernel(kernel, (2,), *args, D=16, Br=16, Bc=16, CAUSAL=False)
    right = trace.compare("O", _expected_O(args, False), tol=1e-5)
    assert right.agrees and right.verdict == "O is right in all 320 elements (within 1e-05)."
    args[3].fill_(float("nan"))
    short = trace_kernel(kernel, (1,), *args, D=16, Br=16, Bc=16, CAUSAL=False)
    missing = short.compare("O", _expected_O(args, False))
    assert missing.first is None and missing.wrong == 4 * 16
    assert {r for r, _ in missing.never_stored} == set(range(16, 20))
    assert "No program stored rows 16..19 of O" in missing.verdict
    with pytest.raises(ValueError, match="tensor: 'P'"):
        trace.compare("P", _expected_O(args, False))
    with pytest.raises(ValueError, match=r"expected: shape \(20,\)"):
        trace.compare("O", np.zeros(20))
    with pytest.raises(ValueError, match="tol"):
        trace.compare("O", _expected_O(args, False), tol=-1)


def test_numba_output_compared_block_by_block(tmp_path):
    if not NUMBA:
        pytest.skip("numba's CUDA simulator is off here (a GPU machine): trace_kernel needs it")
    kernel = solved("numba_forward_kernel", tmp_path, replace=[("L[i] = ", "L[i] = 1.0 + ")])
    rng = np.random.default_rng(4)
    Q, K, V = (rng.standard_normal((n, 4)).astype(np.float32) for n in (16, 20, 20))
    O, L = np.full((16, 4), np.nan, np.float32), np.full(16, np.nan, np.float32)
    trace = trace_kernel(kernel, (2, 8), Q, K, V, O, L, np.float32(0.5), False)
    _, L_ref = reference.naive_attention(*(a.astype(np.float64) for a in (Q, K, V)), scale=0.5)
    found = trace.compare("L", L_ref)
    assert found.first.program == (0, 0, 0) and found.wrong == 16
    assert {r for r, _ in found.elements} == set(range(8))  # block 0 wrote L[0..7]
    assert trace.compare("O", reference.naive_attention(
        *(a.astype(np.float64) for a in (Q, K, V)), scale=0.5)[0]).agrees


# ------------------------------------------------------------------------------------------
# (h) the tile stepper on a learner's kernel
# ------------------------------------------------------------------------------------------


def _launcher(kernel):
    """What a learner writes to hand the stepper their kernel: a traced launch."""

    def launch(Q, K, V, Br, Bc, causal=False):
        Nq, d = Q.shape
        O, L = torch.empty(Nq, d), torch.empty(Nq)
        return trace_kernel(kernel, (triton.cdiv(Nq, Br),), Q, K, V, O, L, 1 / math.sqrt(d),
                            Nq, K.shape[0], Q.stride(0), K.stride(0), V.stride(0), O.stride(0),
                            D=d, Br=Br, Bc=Bc, CAUSAL=causal)

    return launch


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
def test_the_stepper_steps_through_a_learners_kernel(tmp_path, causal):
    from flashedu.viz import TileLoopStepper

    kernel = solved("triton_forward_kernel", tmp_path)
    s = TileLoopStepper(Nq=20, Nk=20, d=16, Br=16, Bc=16, causal=causal,
                        kernel=_launcher(kernel))
    assert s.valid and s.position == 0 and "✓" in s.verdict.value
    # program 0: K/V tile 0 (and tile 1 unless causal skips it); program 1: both
    pairs = [(0, 0)] + ([] if causal else [(0, 1)]) + [(1, 0), (1, 1)]
    assert [(t.i, t.j) for t in s.trace.steps] == pairs
    s.position = s.done
    assert s.controls["order"].value == "q_outer"
    assert "fe-tensor-differs" not in s.counters.value  # the paper's bytes, tensor by tensor
    assert s.counters.value.count("✓") == 5  # Q, K, V read; O, L written
    assert s.bytes_read == s.predicted["read"] and s.bytes_written == s.predicted["written"]


@needs_triton
def test_the_stepper_opens_a_wrong_kernel_at_the_program_that_stored_it(tmp_path):
    from flashedu.viz import TileLoopStepper

    kernel = solved("triton_forward_kernel", tmp_path,
                    replace=[("(cols[None, :] <= rows[:, None])",
                              "(cols[None, :] < rows[:, None])")])
    s = TileLoopStepper(Nq=20, Nk=20, d=16, Br=16, Bc=16, causal=True,
                        kernel=_launcher(kernel))
    found = s.kernel_comparison
    assert not found.agrees and "✗" in s.verdict.value and "O is wrong" in s.verdict.value
    assert found.first.program == (0, 0, 0)  # the diagonal off by one: row 0 sees no key
    assert s.position == 1 and s.current.i == 0  # program 0's last step: its store
    assert s.marked_rows == tuple(sorted({r for r, _ in found.elements}))
    assert "row-differs" in s.tiles.value


def test_the_stepper_names_what_a_launch_lacks():
    from flashedu.viz import TileLoopStepper

    with pytest.raises(TypeError, match="kernel must be"):
        TileLoopStepper(kernel=3)
    with pytest.raises(ValueError, match="not both"):
        TileLoopStepper(fn=lambda *a: None, kernel=lambda *a: None)

    def fails(Q, K, V, Br, Bc):
        raise RuntimeError("grid is wrong")

    s = TileLoopStepper(kernel=fails)
    assert not s.valid and "RuntimeError: grid is wrong" in s.verdict.value


@needs_numba
def test_the_stepper_steps_through_a_learners_numba_kernel(tmp_path):
    """A block per Q tile (a thread per query row), K_j, V_j staged in shared memory (Bc = 16
    in the kernel): the same steps and bytes as the paper's loop."""
    from flashedu.viz import TileLoopStepper

    kernel = solved("numba_forward_kernel", tmp_path)

    def launch(Q, K, V, Br, Bc):
        Q, K, V = (t.numpy() for t in (Q, K, V))
        O, L = np.zeros_like(Q), np.zeros(len(Q), np.float32)
        return trace_kernel(kernel, (math.ceil(len(Q) / Br), Br), Q, K, V, O, L,
                            np.float32(1 / math.sqrt(Q.shape[1])), False)

    s = TileLoopStepper(Nq=16, Nk=20, d=4, Br=8, Bc=16, kernel=launch)
    assert s.valid and "✓" in s.verdict.value
    assert [(t.i, t.j) for t in s.trace.steps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    s.position = s.done
    assert "fe-tensor-differs" not in s.counters.value and s.counters.value.count("✓") == 5
    wrong_tile = TileLoopStepper(Nq=16, Nk=20, d=4, Br=8, Bc=8, kernel=launch)
    assert not wrong_tile.valid and "loads rows 0..15 of K as one tile" in wrong_tile.error
    assert "Bc is 8: set it to your kernel's tile" in wrong_tile.error
