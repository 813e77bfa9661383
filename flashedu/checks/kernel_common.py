"""What the GPU-kernel exercises' checks share (:mod:`.numba_forward`, :mod:`.triton_forward`,
:mod:`.triton_backward`): the padding around inputs and outputs and the probes that read it, the
second call into the same outputs, the TF32 model of ``tl.dot`` on a GPU, the diagnosis of a
wrong forward, and what makes a kernel a kernel (its placeholder, the calls its body may make,
the compile gate). What the checks enforce: :mod:`.kernels`.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import numpy as np

from .. import reference, runtime
from . import compare
from .engine import allowance, rows_text
from .gate import compile_spec, numba_gate_source, triton_gate_source


F32 = np.float32
SENTINEL = 12345.0  # written into the padding around the outputs; must survive the launch
PAD = 128  # rows of padding after each input and output: more than a tile or two past the end


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
    return tolerance.allowances(bounds, ref)


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


def _numpy(a):
    return a.cpu().numpy() if hasattr(a, "cpu") else np.asarray(a)


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
