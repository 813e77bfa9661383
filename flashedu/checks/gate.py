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


def kernel_module_source(kernel) -> tuple[str, str]:
    """(module source, kernel name): the kernel, the @triton.jit helpers it calls (recursively)
    and the int/float/bool constants they read, under triton / tl / math imports."""
    parts, consts, seen = [], {}, set()

    def add(obj):
        fn = getattr(obj, "fn", obj)
        if fn in seen:
            return
        seen.add(fn)
        env = fn.__globals__
        for name in fn.__code__.co_names:
            value = env.get(name)
            if isinstance(value, (bool, int, float)):
                consts[name] = value
            elif hasattr(value, "fn") and inspect.isfunction(getattr(value, "fn", None)) and \
                    type(value).__module__.startswith("triton"):
                add(value)
        parts.append(textwrap.dedent(inspect.getsource(fn)))

    add(kernel)
    head = "import math\nimport triton\nimport triton.language as tl\nfrom triton.language import *  # noqa\n"
    head += "".join(f"{k} = {v!r}\n" for k, v in consts.items())
    return head + "\n\n".join(reversed(parts)), kernel.fn.__name__


def triton_gate(kernel, which: str, timeout: float = 180.0) -> str | None:
    """A message when ``kernel`` does not compile for a GPU, else None (also when this machine
    cannot tell)."""
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
    signature = {p: signature[p] for p in params}
    with tempfile.TemporaryDirectory(prefix="flashedu-gate-") as folder:
        path = Path(folder) / "learner_kernel.py"
        path.write_text(source)
        spec = {"path": str(path), "name": name, "signature": signature,
                "constexprs": {"D": 64, "Br": 64, "Bc": 32}}
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
        try:
            run = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(spec)], env=env,
                                 capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return None
    for line in run.stdout.splitlines():
        if line.startswith("GATE-REFUSED:"):
            text = json.loads(line[len("GATE-REFUSED:"):])
            return ("your kernel runs in Triton's interpreter but does not compile for a GPU "
                    f"(checked for an H100, sm_90):\n{text[-1500:]}")
    return None  # compiled, or this machine cannot compile for CUDA: nothing to say
