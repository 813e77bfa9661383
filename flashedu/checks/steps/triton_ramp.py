"""Notebook 06's ramp to the FlashAttention forward, one Triton idea a step."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

import numpy as np

from ... import runtime
from ..engine import Exercise, run_seed
from ..kernel_common import (
    SENTINEL,
    _diagnose_kernel,
    _kernel_problem,
    _numpy,
    _padded_rows,
    _still_skeleton,
    _triton_unavailable,
    _watch_loads,
    tf32,
)
from ..sandbox import call_limited
from ..steptools import case, kernel_step
from ..triton_forward import _triton_cases, _triton_invoke

F32 = np.float32


def _launch_add(kernel, x, y, BLOCK):
    import torch
    import triton

    device = runtime.kernel_device()
    xt, yt = (torch.from_numpy(a).to(device) for a in (x, y))
    # the output padded with NaN past n: a store past the end shows up as a changed pad
    buf = torch.full((len(x) + 64,), float("nan"), device=device)
    out = buf[: len(x)]
    kernel[(triton.cdiv(len(x), BLOCK),)](xt, yt, out, len(x), BLOCK=BLOCK)
    tail = buf[len(x):].cpu().numpy()
    if not np.isnan(tail).all():
        raise IndexError(f"the kernel wrote {int((~np.isnan(tail)).sum())} element(s) past "
                         f"out[{len(x) - 1}]: mask the store with offs < n")
    return out.cpu().numpy()


def _add_cases():
    rng = np.random.default_rng()
    hint = ("Each program owns BLOCK elements starting at pid * BLOCK: offs = pid * BLOCK + "
            "tl.arange(0, BLOCK); load x and y there, store x + y; mask = offs < n keeps the "
            "last program inside the arrays.")
    cases = []
    for n, block in ((16, 16), (13, 8), (100, 32), (1, 4)):
        x, y = rng.standard_normal(n).astype(F32), rng.standard_normal(n).astype(F32)
        label = f"n={n}, BLOCK={block}" + (" (a partial last block)" if n % block else "")
        cases.append(case(label, hint, (x, y, block), ("out",), (x.astype(np.float64) + y,),
                          naive=((x + y),), dtype=F32, inputs=("x", "y")))
    return cases


# ------------------------------------------------------------------------------------------
# The ramp's other kernels: each launched on views into padded buffers (NaN after and between
# the input rows, a sentinel after and between the output rows), so a missing mask or a
# wrong stride shows up as a NaN, a changed sentinel or a counted load from outside.
# ------------------------------------------------------------------------------------------

GAP = 5  # extra elements between two rows of a "strided" input buffer
# ... and of an output buffer: more than any tile's width, so that a store past the end of a
# row (a missing column mask) lands in the gap, where the sentinel shows it, never on the
# next row
OUT_GAP = 32


def _rng(seed):
    """The generator of one case: the check's run seed (fresh per check) and the case's own."""
    return np.random.default_rng((run_seed(), seed))


def _ramp_invoke(setup):
    """An engine invoke for a ramp kernel. ``setup(*case.args)`` makes the tensors and returns
    (launch, ins, outs, watched): ``launch(kernel)`` runs it; ins = [(name, padded buffer)]
    that must stay unchanged; outs = [(name, padded buffer, view)], the views returned and the
    buffers' sentinel checked around them; watched = the tensors a load may read."""

    def invoke(fn, view, timeout, measure):
        import torch

        launch, ins, outs, watched = setup(*view.args)
        before = [buf.clone() for _, buf in ins]
        seen = {}

        def run():
            with _watch_loads(watched) as counted:
                launch(fn)
            seen.update(counted)
            if runtime.kernel_device().type == "cuda":
                torch.cuda.synchronize()
            got = tuple(out.cpu().numpy().copy() for _, _, out in outs)
            return got if len(got) > 1 else got[0]

        call = call_limited(run, timeout=timeout, measure_memory=measure)
        call.reads = dict(seen)
        call.buffers = {"in": [(name, buf, old) for (name, buf), old in zip(ins, before)],
                        "out": [(name, buf, tuple(out.shape)) for name, buf, out in outs]}
        return call

    return invoke


def _ramp_probe(rows="rows < M", cols="cols < N"):
    """Nothing loaded from outside the inputs, inputs unchanged, and the sentinel intact
    around every output (no store past the last row or column, nor between the rows)."""

    def probe(call, outputs):
        reads = getattr(call, "reads", None) or {}
        if reads.get("oob_loads"):
            return (f"the answer is right, but your kernel loaded {reads['oob_loads']} values "
                    "from outside its inputs (past the last row or column) and then threw them "
                    "away. On a GPU such a load can fault or read another tensor: mask every "
                    f"load, mask=({rows}) & ({cols}).")
        buffers = getattr(call, "buffers", None)
        if buffers is None:
            return None
        for name, buf, old in buffers["in"]:
            if not np.array_equal(_numpy(buf), _numpy(old), equal_nan=True):
                return f"your kernel wrote into its input {name}. Store only into its output."
        for name, buf, shape in buffers["out"]:
            outside = np.ones(buf.shape, dtype=bool)
            outside[tuple(slice(0, n) for n in shape)] = False
            if not (_numpy(buf)[outside] == SENTINEL).all():
                past = not (_numpy(buf)[shape[0]:] == SENTINEL).all()
                where = (f"past its last row: mask the store with {rows}" if past else
                         f"past the end of a row (a column >= N), or between its rows: mask "
                         f"the store with ({rows}) & ({cols}), and address row r with "
                         f"{name}'s own row stride")
                return f"your kernel wrote outside {name}, {where}."
        return None

    return probe


def _ramp_step(name, symbol, cases, setup, *, diagnose=None):
    """A Triton step launched on padded buffers, with the bounds probe of :func:`_ramp_probe`
    on every case."""
    probe = _ramp_probe()

    def with_probe():
        out = []
        for c in cases():
            c.probe = probe
            out.append(c)
        return out

    return Exercise(name, 0, symbol, with_probe, invoke=_ramp_invoke(setup), diagnose=diagnose,
                    timeout=120.0, requires=_triton_unavailable, unfilled=_still_skeleton,
                    inspect=lambda k: _kernel_problem(k, "triton"))


def _floor():
    """TF32 dots on a GPU read float32 with a 10-bit mantissa: a wider error floor there."""
    return 1.0 if runtime.triton_interpreted() else 100.0


# ------------------------------------------------------------------------------------------
# 2. The strided tile copy
# ------------------------------------------------------------------------------------------


def _view(a, transpose, rows, cols):
    """The same view of a NumPy array or a torch tensor: (a.T if transpose)[rows, cols],
    rows and cols (start, stop, step) with a positive step."""
    a = a.T if transpose else a
    return a[slice(*rows), slice(*cols)]


def _setup_copy(a, transpose, rows, cols, BM, BN):
    import triton

    device = runtime.kernel_device()
    abuf, A = _padded_rows(a, float("nan"), device, a.shape[1] + GAP)  # NaN around A's rows
    X = _view(A, transpose, rows, cols)
    M, N = X.shape
    ybuf, Y = _padded_rows(np.zeros((M, N), F32), SENTINEL, device, N + OUT_GAP)

    def launch(kernel):
        grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
        kernel[grid](X, Y, M, N, *X.stride(), *Y.stride(), BM=BM, BN=BN)

    return launch, [("X", abuf)], [("Y", ybuf, Y)], [A, Y]


H_COPY = ("Program (tl.program_id(0), tl.program_id(1)) owns the BM x BN tile that starts at "
          "row program_id(0) * BM and column program_id(1) * BN: rows = ... + tl.arange(0, BM), "
          "cols = ... + tl.arange(0, BN). Element (r, c) of X is at X + r * stride_xm + c * "
          "stride_xn (rows[:, None], cols[None, :]: a tile of pointers), of Y at Y + r * "
          "stride_ym + c * stride_yn. Load and store with mask = (rows[:, None] < M) & "
          "(cols[None, :] < N).")
H_COPY_EDGE = (" M and N are not multiples of the tile: the last tiles run past the end, and "
               "the mask must cut both the rows (rows < M) and the columns (cols < N).")
H_COPY_STRIDE = (" X is a view here whose column stride is not 1: multiply the column index by "
                 "stride_xn (and the row index by stride_xm), never assume 1 or N.")
H_COPY_BLOCKS = (" BM and BN differ: rows move by BM with tl.program_id(0), columns by BN with "
                 "tl.program_id(1).")


def _copy_cases():
    full = lambda n: (0, n, 1)  # noqa: E731
    spec = [  # label, hint, A's shape, transpose, rows, cols, BM, BN
        ("contiguous 8 x 8, tiles 4 x 4", H_COPY, (8, 8), False, full(8), full(8), 4, 4),
        ("contiguous 6 x 10, tiles 4 x 4 (partial tiles)", H_COPY + H_COPY_EDGE, (6, 10),
         False, full(6), full(10), 4, 4),
        ("a transpose A.T, 6 x 10", H_COPY + H_COPY_STRIDE, (10, 6), True, full(6), full(10),
         4, 4),
        ("a slice A[1:, ::3], 5 x 4", H_COPY + H_COPY_STRIDE, (6, 10), False, (1, 6, 1),
         (0, 10, 3), 4, 4),
        ("tiles 8 x 2 on 11 x 7", H_COPY + H_COPY_BLOCKS + H_COPY_EDGE, (11, 7), False,
         full(11), full(7), 8, 2),
        ("one row, 1 x 13", H_COPY + H_COPY_EDGE, (1, 13), False, full(1), full(13), 4, 4),
        ("one column of a transpose, 9 x 1", H_COPY + H_COPY_STRIDE + H_COPY_EDGE, (3, 9),
         True, full(9), (2, 3, 1), 4, 4),
    ]
    cases = []
    for seed, (label, hint, shape, transpose, rows, cols, BM, BN) in enumerate(spec):
        a = _rng(seed).standard_normal(shape).astype(F32)
        want = np.ascontiguousarray(_view(a, transpose, rows, cols))
        cases.append(case(label, hint, (a, transpose, rows, cols, BM, BN), ("Y",),
                          (want.astype(np.float64),), naive=(want,), dtype=F32, inputs=("A",)))
    return cases


def _diagnose_copy(case_, wrong, outputs):
    if np.isnan(outputs["Y"]).any():
        return ("NaN in Y: the kernel read from the NaN this check keeps past and between the "
                "rows of X's buffer, so it addressed elements outside the view (a wrong or "
                "missing stride, or an unmasked load).")
    return None


# ------------------------------------------------------------------------------------------
# 3. The tiled matmul
# ------------------------------------------------------------------------------------------


def _setup_matmul(a, b, BM, BN, BK, transpose_a):
    import triton

    device = runtime.kernel_device()
    if transpose_a:  # A handed as the transpose of a (K, M) buffer: stride_ak != 1
        abuf, At = _padded_rows(np.ascontiguousarray(a.T), float("nan"), device)
        A, watch_a = At.T, At
    else:
        abuf, A = _padded_rows(a, float("nan"), device)
        watch_a = A
    bbuf, B = _padded_rows(b, float("nan"), device)
    M, K = a.shape
    N = b.shape[1]
    cbuf, C = _padded_rows(np.zeros((M, N), F32), SENTINEL, device, N + OUT_GAP)

    def launch(kernel):
        grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
        kernel[grid](A, B, C, M, N, K, *A.stride(), *B.stride(), *C.stride(), BM=BM, BN=BN,
                     BK=BK)

    return launch, [("A", abuf), ("B", bbuf)], [("C", cbuf, C)], [watch_a, B, C]


H_MATMUL = ("One program per BM x BN tile of C: acc = tl.zeros((BM, BN), dtype=tl.float32); for "
            "k0 in range(0, K, BK): ks = k0 + tl.arange(0, BK), load the (BM, BK) tile of A at "
            "rows x ks and the (BK, BN) tile of B at ks x cols (each masked, other=0.0), acc += "
            "tl.dot(A_tile, B_tile); after the loop store acc at C + rows[:, None] * stride_cm + "
            "cols[None, :] * stride_cn, masked with rows < M and cols < N.")
H_MATMUL_K = (" K is not a multiple of BK: the loop must include the last, partial step "
              "(range(0, K, BK)), and the mask ks < K with other=0.0 keeps the next row of A "
              "and the memory past B out of the sum (zeros add nothing to a dot product).")
H_MATMUL_EDGE = (" M and N are not multiples of the tile: mask the loads of A by rows < M, of B "
                 "by cols < N, and the store by both.")
H_MATMUL_STRIDE = (" A is a transpose here: its column stride stride_ak is not 1. Address A[r, "
                   "k] as A + r * stride_am + k * stride_ak, and B, C with their own strides.")


def _matmul_cases():
    spec = [  # label, hint, (M, N, K), (BM, BN, BK), transpose_a
        ("M=N=K=16: one tile, one step", H_MATMUL, (16, 16, 16), (16, 16, 16), False),
        ("M=20, N=24, K=50: partial tiles on every side", H_MATMUL + H_MATMUL_EDGE + H_MATMUL_K,
         (20, 24, 50), (16, 16, 16), False),
        ("K=5 < BK=16", H_MATMUL + H_MATMUL_K, (16, 16, 5), (16, 16, 16), False),
        ("M=1, N=17, K=33", H_MATMUL + H_MATMUL_EDGE + H_MATMUL_K, (1, 17, 33), (16, 16, 16),
         False),
        ("BM=32, BN=16, BK=32 on M=N=K=40", H_MATMUL + " BM, BN and BK differ: use each where "
         "it belongs." + H_MATMUL_K, (40, 40, 40), (32, 16, 32), False),
        ("A is a transpose (stride_ak != 1), M=20, N=16, K=24", H_MATMUL + H_MATMUL_STRIDE,
         (20, 16, 24), (16, 16, 16), True),
    ]
    cases = []
    for seed, (label, hint, (M, N, K), tiles, transpose_a) in enumerate(spec):
        rng = _rng(seed)
        a = rng.standard_normal((M, K)).astype(F32)
        b = rng.standard_normal((K, N)).astype(F32)
        # on a GPU tl.dot reads float32 as TF32 (10-bit mantissa): the naive product then
        # reads its inputs so too, and its error sets the tolerance
        naive = a @ b if runtime.triton_interpreted() else tf32(a) @ tf32(b)
        cases.append(case(label, hint, (a, b) + tiles + (transpose_a,), ("C",),
                          (a.astype(np.float64) @ b,), naive=(naive,), dtype=F32,
                          inputs=("A", "B"), floor_scale=_floor()))
    return cases


def _diagnose_matmul(case_, wrong, outputs):
    if np.isnan(outputs["C"]).any():
        return ("NaN in C: a load read past the end of A or B (the memory there holds NaN in "
                "this check): mask the loads along K with ks < K, other=0.0.")
    return None


# ------------------------------------------------------------------------------------------
# 4. The row softmax
# ------------------------------------------------------------------------------------------


def _setup_softmax(x, BR, strided):
    import triton

    device = runtime.kernel_device()
    M, N = x.shape
    width = N + GAP if strided else None
    xbuf, X = _padded_rows(x, float("nan"), device, width)
    ybuf, Y = _padded_rows(np.zeros_like(x), SENTINEL, device, N + OUT_GAP)

    def launch(kernel):
        kernel[(triton.cdiv(M, BR),)](X, Y, M, N, X.stride(0), Y.stride(0), BR=BR,
                                      BN=triton.next_power_of_2(N))

    return launch, [("X", xbuf)], [("Y", ybuf, Y)], [X, Y]


H_SOFTMAX = ("One program per BR rows, each row whole in one tile of BN >= N columns: load X "
             "at rows[:, None] * stride_xm + cols[None, :] (masked, other=0.0), set the padding "
             "columns (cols >= N) to -inf with tl.where, m = tl.max(x, axis=1), p = tl.exp(x - "
             "m[:, None]), y = p / tl.sum(p, axis=1)[:, None]; store y at Y + rows[:, None] * "
             "stride_ym + cols[None, :], masked.")
H_SOFTMAX_PAD = (" N is not a power of two, so the tile has BN - N padding columns. Loaded with "
                 "other=0.0 they would each add exp(0 - m) to the sum: set them to -inf before "
                 "the max and the exp (exp(-inf) = 0).")
H_SOFTMAX_WIDE = (" Logits in the hundreds: exp overflows float32 above about 88. Subtract each "
                  "row's max before tl.exp (the max trick): every exponent is then <= 0.")
H_SOFTMAX_STRIDE = (" The rows of X and Y are further apart than N here (NaN in X's gaps): "
                    "address row r as X + r * stride_xm and Y + r * stride_ym, never r * N.")


def _softmax_cases():
    spec = [  # label, hint, (M, N), BR, spread of the logits, strided
        ("M=4, N=16: one tile, no padding", H_SOFTMAX, (4, 16), 4, 1.0, False),
        ("M=10, N=37: padding columns and rows", H_SOFTMAX + H_SOFTMAX_PAD, (10, 37), 4, 1.0,
         False),
        ("logits in the hundreds, M=10, N=37", H_SOFTMAX + H_SOFTMAX_WIDE, (10, 37), 4, 100.0,
         False),
        ("N=1: every row's softmax is 1", H_SOFTMAX + H_SOFTMAX_PAD, (3, 1), 4, 1.0, False),
        ("M=7, N=64, BR=2", H_SOFTMAX, (7, 64), 2, 3.0, False),
        ("rows further apart than N: M=6, N=20", H_SOFTMAX + H_SOFTMAX_STRIDE, (6, 20), 4, 1.0,
         True),
    ]
    cases = []
    for seed, (label, hint, shape, BR, spread, strided) in enumerate(spec):
        x = (spread * _rng(seed).standard_normal(shape)).astype(F32)
        x64 = x.astype(np.float64)
        p64 = np.exp(x64 - x64.max(axis=1, keepdims=True))
        p32 = np.exp(x - x.max(axis=1, keepdims=True))
        cases.append(case(label, hint, (x, BR, strided), ("Y",),
                          (p64 / p64.sum(axis=1, keepdims=True),),
                          naive=(p32 / p32.sum(axis=1, keepdims=True),), dtype=F32,
                          inputs=("X",)))
    return cases


def _diagnose_softmax(case_, wrong, outputs):
    if np.isnan(outputs["Y"]).any():
        return ("NaN in Y: without the max trick exp(x) overflows to inf and inf / inf is NaN; "
                "or a load read the NaN this check keeps past and between X's rows (mask it, "
                "and address rows with stride_xm).")
    return None


# ------------------------------------------------------------------------------------------
# 5. The FlashAttention-2 forward (non-causal: the causal cases are exercise 06), and its exp2
# variant. Launched, padded and probed as exercise 06's grader does.
# ------------------------------------------------------------------------------------------


def _forward_cases():
    return [c for c in _triton_cases() if not c.args[3]]  # args: q, k, v, causal, ...


_EXP = re.compile(r"\b(tl|tl\.math|math|libdevice)\.exp\s*\(")


def _exp2_problem(kernel):
    """The exp2 step's extra rule: the kernel computes with tl.math.exp2, never tl.exp."""
    problem = _kernel_problem(kernel, "triton")
    if problem:
        return problem
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
    except (OSError, TypeError, AttributeError, SyntaxError):
        return None
    body = tree.body[0].body if tree.body and hasattr(tree.body[0], "body") else []
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring may name tl.exp; the code may not
    source = "\n".join(ast.unparse(node) for node in body)  # comments dropped too
    if _EXP.search(source):
        return ("your kernel still calls exp: this step asks for the base-2 version. Multiply "
                "the scores by qk_scale = scale * log2(e) and use tl.math.exp2 for P_ij and "
                "alpha.")
    if "exp2" not in source:
        return ("no exp2 in your kernel: P_ij and alpha come from tl.math.exp2 of base-2 "
                "scores (S_ij times qk_scale = scale * log2(e)).")
    return None


H_EXP2 = (" exp2 version: S_ij = tl.dot(Q_i, tl.trans(K_j)) * qk_scale with qk_scale = scale "
          "* log2(e), so m_i is in base 2; P_ij = exp2(S_ij - m_new), alpha = exp2(m_i - "
          "m_new); the stored L_i stays natural: (m_i + log2(l_i)) * ln 2.")


# the exp2 kernel differs from the forward in five lines: a few of its cases are enough
EXP2_CASES = ("one tile", "several tiles", "edge tiles", "N=1", "explicit scale",
              "logits in the hundreds")


def _exp2_cases():
    out = []
    for c in _forward_cases():
        if c.label.startswith(EXP2_CASES):
            c.hint = c.hint + H_EXP2
            out.append(c)
    return out


def _diagnose_exp2(case_, wrong, outputs):
    if "L" in wrong and "O" not in wrong:
        return ("O is right but L is not: m_i and log2(l_i) are in base 2; the stored L_i is "
                "natural, (m_i + log2(l_i)) * ln 2.")
    return _diagnose_kernel(case_, wrong, outputs)


def _forward_step(name, symbol, cases, diagnose, inspect_):
    return Exercise(name, 0, symbol, cases, invoke=_triton_invoke, diagnose=diagnose,
                    timeout=120.0, requires=_triton_unavailable, unfilled=_still_skeleton,
                    inspect=inspect_)


STEPS = [
    kernel_step("triton_step_add", "add_kernel", _add_cases, _launch_add),
    _ramp_step("triton_step_copy_tile", "copy_tile_kernel", _copy_cases, _setup_copy,
               diagnose=_diagnose_copy),
    _ramp_step("triton_step_matmul", "matmul_kernel", _matmul_cases, _setup_matmul,
               diagnose=_diagnose_matmul),
    _ramp_step("triton_step_softmax", "softmax_kernel", _softmax_cases, _setup_softmax,
               diagnose=_diagnose_softmax),
    _forward_step("triton_step_flash_forward", "flash_forward_kernel", _forward_cases,
                  _diagnose_kernel, lambda k: _kernel_problem(k, "forward")),
    _forward_step("triton_step_flash_forward_exp2", "flash_forward_kernel_exp2", _exp2_cases,
                  _diagnose_exp2, _exp2_problem),
]
