"""The compile gate: a Triton kernel must compile for a GPU, even on a machine without one.

Triton's interpreter runs any Python in a kernel body; a GPU compiler refuses it. Here the
learner's kernel (its source, the @triton.jit helpers it calls and the constants it reads) is
compiled for an H100 (``GPUTarget("cuda", 90, 32)``, to PTX and a cubin; no GPU is needed) in a
fresh process without the interpreter, for the launcher's signature (CAUSAL=True: one build,
a few seconds, run only once every case has passed). A
compilation error fails the check with Triton's message; a machine where Triton has no CUDA
backend skips the gate (the interpreter's run still grades the values).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

# The launchers' signatures (flashedu.checks.kernels), in Triton's notation.
PTR, F32, I32 = "*fp32", "fp32", "i32"
SIGNATURES = {
    "forward": ("Q K V O L".split(), "Nq Nk stride_q stride_k stride_v stride_o".split()),
    "dkdv": ("Q K V dO L Delta dK dV".split(),
             "Nq Nk stride_q stride_k stride_v stride_do stride_dk stride_dv".split()),
    "dq": ("Q K V dO L Delta dQ".split(), "Nq Nk stride_q stride_k stride_v stride_do stride_dq".split()),
}

_SCRIPT = r"""
import json, sys, importlib.util
spec = json.loads(sys.argv[1])
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
try:
    from triton.compiler.errors import CompilationError
except ImportError:
    CompilationError = Exception
m = importlib.util.spec_from_file_location("learner_kernel", spec["path"])
mod = importlib.util.module_from_spec(m)
m.loader.exec_module(mod)
fn = getattr(mod, spec["name"])
for causal in (True,):  # the causal build holds all of the kernel but the else branches
    consts = dict(spec["constexprs"], CAUSAL=causal)
    src = ASTSource(fn=fn, signature=spec["signature"], constexprs=consts)
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except CompilationError as exc:
        print("GATE-REFUSED:" + json.dumps(f"CAUSAL={causal}: {exc}"))
        sys.exit(0)
print("GATE-OK")
"""


def _module_source(root, inner, render, head: str) -> str:
    """Source of a module holding ``root``, the jitted functions it calls (recursively:
    ``inner`` maps a global to its Python function, or None when it is not one) each as
    ``render(fn)`` gives it, and the int/float/bool constants they read, under ``head``."""
    parts, consts, seen = [], {}, set()

    def add(fn):
        if fn in seen:
            return
        seen.add(fn)
        env = fn.__globals__
        for name in fn.__code__.co_names:
            value = env.get(name)
            if isinstance(value, (bool, int, float)):
                consts[name] = value
            elif inner(value) is not None:
                add(inner(value))
        parts.append(render(fn))

    add(root)
    head += "".join(f"{k} = {v!r}\n" for k, v in consts.items())
    return head + "\n\n".join(reversed(parts))


def kernel_module_source(kernel) -> tuple[str, str]:
    """(module source, kernel name): the kernel, the @triton.jit helpers it calls (recursively)
    and the int/float/bool constants they read, under triton / tl / math imports."""
    def inner(value):
        fn = getattr(value, "fn", None)
        return fn if inspect.isfunction(fn) and type(value).__module__.startswith("triton") \
            else None

    def render(fn):
        return textwrap.dedent(inspect.getsource(fn))

    head = "import math\nimport triton\nimport triton.language as tl\nfrom triton.language import *  # noqa\n"
    return _module_source(kernel.fn, inner, render, head), kernel.fn.__name__


def triton_gate(kernel, which: str, timeout: float = 180.0) -> str | None:
    """A message when ``kernel`` does not compile for a GPU, else None (also when this machine
    cannot tell)."""
    spec = triton_gate_source(kernel, which)
    return spec if not isinstance(spec, dict) else compile_triton(spec, timeout)


def triton_gate_source(kernel, which: str):
    """What the compile needs of ``kernel`` (runs where the kernel lives): a dict with the
    module source, the kernel's name and its signature; or a problem text; or None (nothing
    to check: the gate is off, or the source cannot be read)."""
    if os.environ.get("FLASHEDU_COMPILE_GATE", "1") == "0":
        return None
    try:
        source, name = kernel_module_source(kernel)
    except (OSError, TypeError, AttributeError):
        return None  # the kind check reports unreadable sources
    pointers, ints = SIGNATURES[which]
    signature = {p: PTR for p in pointers}
    signature["scale"] = F32
    signature.update({i: I32 for i in ints})
    signature.update({c: "constexpr" for c in ("D", "Br", "Bc", "CAUSAL")})
    # keep the argument order of the kernel itself
    params = list(inspect.signature(kernel.fn).parameters)
    if sorted(params) != sorted(signature):
        return (f"your kernel's parameters are {', '.join(params)}; the launcher passes "
                f"{', '.join(signature)}.")
    return {"kind": "triton", "source": source, "name": name,
            "signature": {p: signature[p] for p in params}}


def compile_triton(spec: dict, timeout: float = 180.0) -> str | None:
    """Compile a :func:`triton_gate_source` spec for sm_90 in a fresh process; a message when
    it does not compile. Runs anywhere (the grader's process too): the spec is plain data."""
    if os.environ.get("FLASHEDU_COMPILE_GATE", "1") == "0":
        return None
    with tempfile.TemporaryDirectory(prefix="flashedu-gate-") as folder:
        path = Path(folder) / "learner_kernel.py"
        path.write_text(str(spec["source"]))
        job = {"path": str(path), "name": str(spec["name"]), "signature": dict(spec["signature"]),
               "constexprs": {"D": 64, "Br": 64, "Bc": 32}}
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
        try:
            run = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(job)], env=env,
                                 capture_output=True, text=True, timeout=timeout, check=False,
                                 cwd=folder)
        except subprocess.TimeoutExpired:
            return None
    for line in run.stdout.splitlines():
        if line.startswith("GATE-REFUSED:"):
            text = json.loads(line[len("GATE-REFUSED:"):])
            return ("your kernel runs in Triton's interpreter but does not compile for a GPU "
                    f"(checked for an H100, sm_90):\n{text[-1500:]}")
    return None  # compiled, or this machine cannot compile for CUDA: nothing to say


# ------------------------------------------------------------------------------------------
# numba: compiled to PTX for sm_90 with NVVM (the nvidia-nvvm and nvidia-cuda-nvrtc wheels)
# ------------------------------------------------------------------------------------------

# The launcher's call (flashedu.checks.kernels.launch_numba_forward):
# kernel(Q, K, V, O, L, scale, causal) on float32 arrays, a float32 scale and a bool.
NUMBA_SIGNATURE = "(float32[:, :], float32[:, :], float32[:, :], float32[:, :], float32[:], float32, boolean)"

_NUMBA_SCRIPT = r"""
import json, os, sys, importlib.util
spec = json.loads(sys.argv[1])
try:
    from numba import cuda
    from numba.cuda.cudadrv import nvvm
    if not nvvm.is_available():
        raise RuntimeError("NVVM (libnvvm) was not found")
except Exception as exc:
    print("GATE-SKIP:" + json.dumps(f"{type(exc).__name__}: {exc}"))
    sys.exit(0)
m = importlib.util.spec_from_file_location("learner_kernel", spec["path"])
mod = importlib.util.module_from_spec(m)
try:
    m.loader.exec_module(mod)
    fn = getattr(mod, spec["name"])
    cuda.compile_ptx(getattr(fn, "py_func", fn), spec["signature"], cc=(9, 0))
except Exception as exc:
    text = str(exc)
    if type(exc).__name__ in ("DynamicLibNotFoundError", "NvvmSupportError", "CudaSupportError"):
        print("GATE-SKIP:" + json.dumps(f"{type(exc).__name__}: {text[:300]}"))
    else:
        lines = []
        for t in text.splitlines():
            if t.startswith("There are") or len(lines) == 3:
                break
            if t.strip():
                lines.append(t)
        loc = getattr(exc, "loc", None)
        line = getattr(loc, "line", None)
        if line:
            code = open(spec["path"]).read().splitlines()[line - 1].strip()
            lines.append(f"in the line: {code}")
        print("GATE-REFUSED:" + json.dumps(f"{type(exc).__name__}: " + "\n".join(lines)))
    sys.exit(0)
print("GATE-OK")
"""


def numba_module_source(kernel) -> tuple[str, str]:
    """(module source, kernel name): the kernel, the @cuda.jit device functions it calls
    (recursively) and the int/float/bool constants they read, under numba / math imports."""
    def inner(obj):
        fn = getattr(obj, "py_func", None)
        return fn if inspect.isfunction(fn) and \
            type(obj).__module__.split(".")[0] in ("numba", "numba_cuda") else None

    def render(fn):
        lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
        body = "\n".join(line for line in lines if not line.lstrip().startswith("@")) + "\n"
        # a device function is decorated as one, whatever it said
        return body if fn is kernel_fn else "@cuda.jit(device=True)\n" + body

    kernel_fn = inner(kernel)
    if kernel_fn is None:
        raise TypeError("not a numba kernel")
    head = "import math\nimport numba\nfrom numba import *  # noqa\nfrom numba import cuda\n"
    return _module_source(kernel_fn, inner, render, head), kernel_fn.__name__


def numba_gate_unavailable() -> str | None:
    """Why this machine cannot compile numba kernels for a GPU (None when it can)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-c", "from numba.cuda.cudadrv import nvvm; "
                          "print('NVVM', nvvm.is_available())"], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    if "NVVM True" in run.stdout:
        return None
    return ("numba-cuda finds no libnvvm here (pip install nvidia-nvvm nvidia-cuda-nvrtc, the "
            "CUDA 13 wheels): " + (run.stdout + run.stderr).strip()[-300:])


def numba_gate(kernel, timeout: float = 180.0) -> str | None:
    """A message when the numba ``kernel`` does not compile to PTX for an H100 (sm_90), else
    None (also when this machine cannot tell: no libnvvm). Without a GPU, numba's simulator
    runs any Python; NVVM compiles only what a GPU can run."""
    spec = numba_gate_source(kernel)
    return spec if not isinstance(spec, dict) else compile_numba(spec, timeout)


def numba_gate_source(kernel):
    """What the compile needs of ``kernel`` (runs where the kernel lives): a dict, or None."""
    if os.environ.get("FLASHEDU_COMPILE_GATE", "1") == "0":
        return None
    try:
        source, name = numba_module_source(kernel)
    except (OSError, TypeError, AttributeError):
        return None  # the kind check reports objects that are not kernels
    return {"kind": "numba", "source": source, "name": name, "signature": NUMBA_SIGNATURE}


def compile_numba(spec: dict, timeout: float = 180.0) -> str | None:
    """Compile a :func:`numba_gate_source` spec to PTX for sm_90 in a fresh process without
    the simulator; a message when it does not compile. Runs anywhere: the spec is plain data."""
    if os.environ.get("FLASHEDU_COMPILE_GATE", "1") == "0":
        return None
    with tempfile.TemporaryDirectory(prefix="flashedu-gate-") as folder:
        path = Path(folder) / "learner_kernel.py"
        path.write_text(str(spec["source"]))
        job = {"path": str(path), "name": str(spec["name"]), "signature": NUMBA_SIGNATURE}
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
        env["NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING"] = "1"
        try:
            run = subprocess.run([sys.executable, "-c", _NUMBA_SCRIPT, json.dumps(job)],
                                 env=env, capture_output=True, text=True, timeout=timeout,
                                 check=False, cwd=folder)
        except subprocess.TimeoutExpired:
            return None
    for line in run.stdout.splitlines():
        if line.startswith("GATE-REFUSED:"):
            text = json.loads(line[len("GATE-REFUSED:"):])
            return ("your kernel runs in numba's simulator but does not compile for a GPU "
                    f"(checked for an H100, sm_90, with NVVM):\n{text[:1500]}\nInside a "
                    "kernel only scalars, cuda.local / cuda.shared arrays, the kernel's "
                    "array arguments, math.* and @cuda.jit(device=True) functions work: no "
                    "lists, NumPy calls or Python objects.")
    return None  # compiled, or this machine cannot compile for CUDA: nothing to say


def compile_spec(spec) -> str | None:
    """The grader's half of ``flashedu check``'s gate: compile what the kernel sent (a spec
    of either kind), or pass on its problem text."""
    if isinstance(spec, str):
        return spec[:2000]
    if not isinstance(spec, dict) or not isinstance(spec.get("source"), str):
        return None
    if spec.get("kind") == "numba":
        return compile_numba(spec)
    if spec.get("kind") == "triton" and isinstance(spec.get("signature"), dict):
        return compile_triton(spec)
    return None
