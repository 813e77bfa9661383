"""The compile gate: a kernel must compile for a GPU, even on a machine without one.

Triton's interpreter and numba's simulator run any Python in a kernel body; a GPU compiler
refuses it. So, once every case has passed, the learner's kernel is compiled for an H100 (sm_90;
Triton to a cubin, numba to PTX with NVVM; no GPU is needed) in a fresh process that has neither
the interpreter nor the simulator:

- Triton: for every launch the exercise's cases make, specialized as Triton specializes a launch
  (the constexprs D, Br, Bc, CAUSAL, the dtypes, and an integer argument equal to 1 made a
  constant). Triton compiles only the branches of an ``if`` on constants that a launch takes: a
  configuration that no case launches would leave the branches the cases take unchecked.
  Launches that differ only in the alignment of their integers take the same branches; one of
  them is compiled.
- numba: for the argument types of the cases' launches, the kernel and the
  ``@cuda.jit(device=True)`` functions it calls (compiled for sm_90 as a GPU would; numba
  otherwise asks the CUDA driver which GPU to compile them for).

Two halves, as for a case. The kernel's side (:func:`triton_gate_source`,
:func:`numba_gate_source`, run where the learner's code lives) describes the kernel as plain
data: the source of each function, and the constants, modules and kernel-language names it
reads. The grader's side (:func:`compile_spec`) takes the launches from the exercise's own cases
and hands both to a fresh process. That process checks the description before any of it runs
(function definitions under a plain ``@triton.jit`` / ``@cuda.jit``, constants, the kernel
language's modules; no other code at module level, nothing outside the kernel language
reachable from a Triton kernel), writes the module itself and compiles.

The verdict: a :class:`~.engine.Remark` (what was compiled, or why this machine could not
compile for CUDA) when the process said so explicitly; anything else (a compiler's refusal, a
module that does not import, a missing or garbled answer, a timeout) is a refusal, with the
compiler's message. No setting turns the gate off: it reads no switch, and what it compiles
(the launches) and whether it can (a CUDA backend, NVVM) are decided on the grader's side.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import types

from .engine import Remark
from .sandbox import _names

# The launchers' parameters (flashedu.checks.triton_forward, .triton_backward): pointers, then
# the integers.
SIGNATURES = {
    "forward": ("Q K V O L".split(), "Nq Nk stride_q stride_k stride_v stride_o".split()),
    "dkdv": ("Q K V dO L Delta dK dV".split(),
             "Nq Nk stride_q stride_k stride_v stride_do stride_dk stride_dv".split()),
    "dq": ("Q K V dO L Delta dQ".split(), "Nq Nk stride_q stride_k stride_v stride_do stride_dq".split()),
}
CONSTEXPRS = ("D", "Br", "Bc", "CAUSAL")
TIMEOUT = 240.0  # seconds for one kernel's launches, the process's start included
# processes compiling one kernel's launches side by side (each launch is compiled on its own)
WORKERS = max(1, min(4, os.cpu_count() or 1))
# which ("numba", "forward", "dkdv", "dq") -> the launches its exercise's cases make, as plain
# data. The exercises (.kernels) hand it over when they are defined: the gate compiles the
# launches it is given and knows no exercise.
_LAUNCHES = None


def use_launches(launches) -> None:
    """Set the function that gives the launches to compile for a kernel (``which``)."""
    global _LAUNCHES
    _LAUNCHES = launches
TARGET = "an H100 (sm_90)"


def parameters(which: str) -> list[str]:
    """The launcher's parameter names for kernel ``which``, in the launcher's order."""
    pointers, ints = SIGNATURES[which]
    return [*pointers, "scale", *ints, *CONSTEXPRS]


# ------------------------------------------------------------------------------------------
# The kernel's side: describe the kernel as plain data
# ------------------------------------------------------------------------------------------


def _names_read(fn) -> list[str]:
    """Global names the function's code reads (its nested code objects included), sorted:
    the sandbox's walk (``sandbox._names``), as plain data."""
    return sorted(_names(fn.__code__))


def _number(value):
    """["bool" | "int" | "float", text] of a plain number, or None."""
    if isinstance(value, bool):
        return ["bool", str(value)]
    if isinstance(value, int):
        return ["int", str(value)]
    if isinstance(value, float):
        return ["float", repr(value)]
    return None


def _describe(root, inner, classify) -> dict:
    """{"functions": [[name, source]], "globals": [[name, kind, *data]]}: ``root``, the
    functions it calls (``inner(value)`` gives a global's Python function when it is a kernel
    of the same kind, else None) and what ``classify(value)`` says of the other globals they
    read (None: leave it out; the compiler then reports the name)."""
    functions, entries, seen = [], {}, set()

    def add(fn):
        if fn in seen:
            return
        seen.add(fn)
        functions.append([fn.__name__, textwrap.dedent(inspect.getsource(fn))])
        env = fn.__globals__
        for name in _names_read(fn):
            if name not in env or name in entries:
                continue
            value = env[name]
            sub = inner(value)
            if sub is not None:
                add(sub)
                if name != sub.__name__:
                    entries[name] = ["alias", sub.__name__]
                continue
            entry = classify(value)
            if entry is not None:
                entries[name] = entry

    add(root)
    return {"functions": functions, "globals": [[k, *v] for k, v in entries.items()]}


def _triton_entry(value):
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        inner = value.value
        if isinstance(inner, tl.dtype):
            return ["constexpr_dtype", _dtype_name(inner)]
        number = _number(inner) or (["str", inner] if isinstance(inner, str) else None) or \
            (["none", ""] if inner is None else None)
        return ["constexpr", *number] if number else None
    if isinstance(value, tl.dtype):
        return ["dtype", _dtype_name(value)]
    number = _number(value)
    if number:
        return ["number", *number]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    return _from_entry(value, ("triton.language", "triton.language.math"))


def _dtype_name(dtype) -> str:
    import triton.language as tl

    return next((n for n in dir(tl) if not n.startswith("_") and getattr(tl, n) is dtype), "")


def _from_entry(value, modules):
    """["from", module, name] for an object imported by name from one of ``modules``."""
    import importlib

    names = [n for n in (getattr(value, "__name__", None), getattr(value, "name", None))
             if isinstance(n, str) and n.isidentifier()]
    owner = getattr(value, "__module__", None)
    for module in (*modules, *([owner] if isinstance(owner, str) else [])):
        for name in names:
            try:
                if getattr(importlib.import_module(module), name, None) is value:
                    return ["from", module, name]
            except Exception:  # noqa: BLE001 - not importable here: not a module to offer
                break
    return None


def triton_gate_source(kernel, which: str):
    """What the compile needs of ``kernel`` (runs where the kernel lives): a dict, or a problem
    text when the kernel's parameters are not the launcher's."""
    def inner(value):
        fn = getattr(value, "fn", None)
        return fn if inspect.isfunction(fn) and type(value).__module__.startswith("triton") \
            else None

    fn = inner(kernel)
    if fn is None:
        return "the grader could not read your kernel to compile it: it is not a @triton.jit kernel."
    params = list(inspect.signature(fn).parameters)
    expected = parameters(which)
    if sorted(params) != sorted(expected):
        return (f"your kernel's parameters are {', '.join(params)}; the launcher passes "
                f"{', '.join(expected)}.")
    try:
        spec = _describe(fn, inner, _triton_entry)
    except (OSError, TypeError) as exc:
        return f"the grader could not read your kernel's source to compile it ({exc})."
    return {"kind": "triton", "which": which, "name": fn.__name__, **spec}


def numba_gate_source(kernel):
    """What the compile needs of the numba ``kernel`` (runs where the kernel lives): a dict,
    or a problem text."""
    def inner(obj):
        fn = getattr(obj, "py_func", None)
        return fn if inspect.isfunction(fn) and \
            type(obj).__module__.split(".")[0] in ("numba", "numba_cuda") else None

    def classify(value):
        number = _number(value)
        if number:
            return ["number", *number]
        if isinstance(value, types.ModuleType):
            return ["module", value.__name__]
        return _from_entry(value, ("numba", "numba.cuda", "math", "numpy"))

    fn = inner(kernel)
    if fn is None:
        return "the grader could not read your kernel to compile it: it is not a @cuda.jit kernel."
    try:
        spec = _describe(fn, inner, classify)
    except (OSError, TypeError) as exc:
        return f"the grader could not read your kernel's source to compile it ({exc})."
    return {"kind": "numba", "which": "numba", "name": fn.__name__, **spec}


# ------------------------------------------------------------------------------------------
# The grader's side: check the description, write the module, compile every launch
# ------------------------------------------------------------------------------------------

# Runs in a fresh process; nothing of the learner's runs before module() has checked it.
# _DESCRIBE checks a description and writes its module; the gate adds _COMPILE, the grader's
# own run of the kernel (.runner) adds its serving loop.
_DESCRIBE = r'''
import ast, importlib, json, keyword, math, sys, types
JOBS = json.loads(sys.stdin.readline())  # one or more kernels of one kind, on one line
KIND = JOBS[0]["kind"]
job = None  # the kernel being prepared


def say(tag, payload):
    print(tag + json.dumps({"job": job["index"], "verdict": payload}), flush=True)


class Refused(Exception):
    pass


def identifier(name):
    if not (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)
            and not name.startswith("__")):
        raise Refused(f"{name!r} is not a name the grader accepts")
    return name


def module_ok(name):
    if KIND == "triton":
        return name in ("math", "triton") or name == "triton.language" or \
            name.startswith("triton.language.")
    return name in ("math", "numpy", "numba") or name.startswith(("numba.", "numba_cuda."))


def literal(kind, text):
    value = {"bool": lambda t: {"True": True, "False": False}[t], "int": int, "float": float,
             "str": str, "none": lambda t: None}[kind](text)
    return f"float({repr(str(value))})" if kind == "float" else repr(value)


def plain(node, where):
    """Defaults, annotations and decorator arguments: names and constants, no calls."""
    for sub in ast.walk(node):
        if not isinstance(sub, (ast.Constant, ast.Name, ast.Attribute, ast.UnaryOp, ast.USub,
                                ast.UAdd, ast.Tuple, ast.List, ast.Load)):
            raise Refused(f"{where}: only names and constants are accepted there, found "
                          f"`{ast.unparse(sub)}`")
        if isinstance(sub, ast.Name):
            identifier(sub.id)
        if isinstance(sub, ast.Attribute) and sub.attr.startswith("_"):
            raise Refused(f"{where}: `{ast.unparse(sub)}`")


def decorator(node, fname):
    """The decorator text to write for a plain @triton.jit / @cuda.jit with constant
    arguments; refuses any other decorator."""
    call = node if isinstance(node, ast.Call) else None
    target = call.func if call else node
    last = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    if last != "jit":  # it is written anew: only which decorator it was matters
        raise Refused(f"`@{ast.unparse(node)}` on {fname}: the grader compiles a plain "
                      f"{'@triton.jit' if KIND == 'triton' else '@cuda.jit'} function")
    keywords = []
    for kw in (call.keywords if call and KIND == "triton" else []):
        if kw.arg not in ("do_not_specialize", "do_not_specialize_on_alignment", "debug",
                          "noinline"):
            raise Refused(f"`@{ast.unparse(node)}` on {fname}: the grader compiles a "
                          "@triton.jit with do_not_specialize, debug or noinline at most")
        keywords.append(f"{kw.arg}={repr(ast.literal_eval(kw.value))}")
    return keywords


# Python's ways to run or reach code beyond the kernel. No GPU compiler takes them, but Triton's
# interpreter and numba's simulator (where the grader runs a kernel's cases, .runner) would run
# them before the gate ever compiles the kernel.
ESCAPES = {"eval", "exec", "compile", "open", "globals", "locals", "vars", "setattr", "delattr",
           "breakpoint", "input", "help", "exit", "quit", "memoryview", "type", "object",
           "super", "classmethod", "staticmethod", "property"}


def function(name, source, env, root):
    tree = ast.parse(source)
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef) or \
            tree.body[0].name != name:
        raise Refused(f"the source sent for {name} is not one function definition")
    fdef = tree.body[0]
    keywords = []
    for node in fdef.decorator_list:
        keywords += decorator(node, name)
    args = fdef.args
    for node in [*args.defaults, *[d for d in args.kw_defaults if d is not None],
                 *[a.annotation for a in args.posonlyargs + args.args + args.kwonlyargs
                   if a.annotation is not None]] + ([fdef.returns] if fdef.returns else []):
        plain(node, f"the signature of {name}")
    body = ast.Module(body=fdef.body, type_ignores=[])
    parents = {}
    for parent in ast.walk(body):
        for child in ast.iter_child_nodes(parent):
            parents[child] = parent
    for node in ast.walk(body):
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            raise Refused(f"{name} names `{node.id}`")
        if isinstance(node, ast.Name) and node.id in ESCAPES:
            raise Refused(f"{name} names `{node.id}`, Python's way to run or reach other "
                          "code: no GPU kernel can call it")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise Refused(f"{name} reads `{ast.unparse(node)}`")
        if KIND == "triton" and isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr") and (
                    len(node.args) < 2 or not isinstance(node.args[1], ast.Constant)
                    or not isinstance(node.args[1].value, str) or node.args[1].value.startswith("_")):
            raise Refused(f"{name} calls `{ast.unparse(node)}`")
        if KIND == "triton" and isinstance(node, (ast.Name, ast.Attribute)) and \
                not isinstance(parents.get(node), ast.Attribute):
            reach(node, env, name, parents)
    body_start = fdef.lineno - 1  # the line of `def`: decorators are written anew
    lines = source.splitlines()[body_start:]
    if KIND == "triton":
        deco = "@triton.jit" + (f"({', '.join(keywords)})" if keywords else "")
    else:
        deco = "@cuda.jit" if root else "@cuda.jit(device=True)"
    return deco + "\n" + "\n".join(lines) + "\n"


def reach(node, env, fname, parents):
    """A Triton kernel reaches only the kernel language (triton.language, math) through the
    modules it names: Triton calls whatever Python function a kernel names while compiling."""
    chain = []
    base = node
    while isinstance(base, ast.Attribute):
        chain.append(base.attr)
        base = base.value
    if not isinstance(base, ast.Name) or base.id not in env:
        return
    chain.reverse()
    obj, path = env[base.id], base.id
    for attr in chain:
        if not isinstance(obj, types.ModuleType):
            return  # a value's attribute (a dtype's, a constexpr's): the compiler decides
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            return  # the compiler reports it
        path += "." + attr
        if isinstance(obj, types.ModuleType):
            if not module_ok(obj.__name__) or obj.__name__ == "triton":
                raise Refused(f"{fname} reaches the module {obj.__name__} (`{path}`): a kernel "
                              "calls only the kernel language")
            continue
        # Triton's interpreter wraps each kernel-language function (the grader's own run
        # of a kernel, .runner): the wrapped function's module is the one that counts
        inner = getattr(obj, "fn", None) \
            if type(obj).__module__ == "triton.runtime.interpreter" else None
        owner = getattr(inner or obj, "__module__", None) or type(obj).__module__ or ""
        if not (owner.startswith("triton.language") or owner == "math" or
                type(obj) in (bool, int, float) or
                path in ("triton.cdiv", "triton.next_power_of_2")):
            raise Refused(f"{fname} reaches `{path}`, which is not part of the kernel language")
    if isinstance(obj, types.ModuleType):
        raise Refused(f"{fname} uses the module `{path}` as a value: a kernel calls only "
                      "the kernel language's functions")


def module():
    """The module to compile, written here from the checked description; its names."""
    header = (["import math", "import triton", "import triton.language as tl"] if KIND == "triton"
              else ["import math", "import numpy", "import numba", "from numba import cuda"])
    env = {}
    imports, constants, aliases = [], [], []
    for entry in job["globals"]:
        name, kind, data = identifier(entry[0]), entry[1], entry[2:]
        if kind == "number":
            constants.append(f"{name} = {literal(*data)}")
        elif kind == "constexpr" and KIND == "triton":
            constants.append(f"{name} = tl.constexpr({literal(*data)})")
        elif kind in ("dtype", "constexpr_dtype") and KIND == "triton":
            import triton.language as tl
            if not isinstance(getattr(tl, identifier(data[0]), None), tl.dtype):
                raise Refused(f"{name}: tl.{data[0]} is not a dtype")
            value = f"tl.{data[0]}"
            constants.append(f"{name} = " + (f"tl.constexpr({value})" if kind == "constexpr_dtype" else value))
        elif kind == "module":
            if not module_ok(data[0]):
                raise Refused(f"your kernel's module names the module {data[0]} ({name}): a "
                              "kernel calls only the kernel language")
            parts = [identifier(p) for p in data[0].split(".")]
            imports.append(f"import {'.'.join(parts)} as {name}")
            env[name] = importlib.import_module(data[0])
        elif kind == "from":
            if not module_ok(data[0]):
                raise Refused(f"{name} comes from {data[0]}: a kernel calls only the kernel language")
            parts = [identifier(p) for p in data[0].split(".")]
            imports.append(f"from {'.'.join(parts)} import {identifier(data[1])} as {name}")
        elif kind == "alias":
            aliases.append(f"{name} = {identifier(data[0])}")
        else:
            raise Refused(f"{name}: the grader cannot write a global of kind {kind!r}")
    if KIND == "triton":
        import triton, triton.language as tl
        env.update(math=math, triton=triton, tl=tl)
    names = [identifier(n) for n, _ in job["functions"]]
    if len(set(names)) != len(names) or job["name"] not in names:
        raise Refused("the functions sent do not hold the kernel once")
    functions = [function(n, s, env, n == job["name"]) for n, s in reversed(job["functions"])]
    return "\n".join(header + imports + constants) + "\n\n\n" + "\n\n".join(functions) + \
        "\n" + "\n".join(aliases) + "\n", len(names) - 1


def load(source):
    import importlib.util
    with open(job["path"], "w") as f:
        f.write(source)
    name = f"learner_kernel_{job['index']}"
    spec = importlib.util.spec_from_file_location(name, job["path"])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, job["name"])


def short(exc):
    return f"{type(exc).__name__}: {exc}"
'''

_COMPILE = r'''
def triton_main():
    global job
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        backend.hash()  # finds ptxas
    except Exception as exc:
        for job in JOBS:
            say("GATE-SKIP:", "Triton cannot compile for CUDA here (" + short(exc)[:300] + ")")
        return
    helpers = {}
    for job in JOBS:  # check, load and specialize each kernel; compile them all below
        try:
            source, helpers[job["index"]] = module()
        except (Refused, SyntaxError, ValueError, KeyError) as exc:
            say("GATE-REFUSED:", {"kind": "description", "text": str(exc)})
            continue
        try:
            kernel = load(source)
        except Exception as exc:
            say("GATE-REFUSED:", {"kind": "import", "text": short(exc)})
            continue
        if sorted(kernel.arg_names) != sorted(job["params"]):
            say("GATE-REFUSED:", {"kind": "description", "text": "the kernel's parameters are "
                + ", ".join(kernel.arg_names) + "; the launcher passes " + ", ".join(job["params"])})
            continue
        todo = {}
        for launch in job["launches"]:
            signature, constexprs, attrs = specialize(kernel, backend, launch)
            key = json.dumps([sorted(signature.items()),
                              sorted((str(k), repr(v)) for k, v in constexprs.items())])
            todo.setdefault(key, (launch, signature, constexprs, attrs))
        WORK.extend((job, kernel, target, item) for item in todo.values())
    workers = min(len(WORK), max(int(j.get("workers", 1)) for j in JOBS))
    if workers > 1:  # forked before anything was compiled: each worker compiles a share
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            failures = pool.map(build, range(len(WORK)), chunksize=1)
    else:
        failures = [build(i) for i in range(len(WORK))]
    verdicts = {}
    for (job, *_), failure in zip(WORK, failures):
        done = verdicts.setdefault(job["index"], [job, None, 0])
        done[2] += 1
        if failure is not None and done[1] is None:
            done[1] = failure
    for job, failure, n in verdicts.values():
        if failure is not None:
            say("GATE-REFUSED:", failure)
        else:
            say("GATE-OK:", {"launches": n, "helpers": helpers[job["index"]]})


WORK = []  # (job, kernel, target, (launch, signature, constexprs, attrs)) to compile


def build(index):
    """Compile launch ``index`` of WORK: None, or what the compiler said."""
    import triton
    from triton.compiler import ASTSource
    _, kernel, target, (launch, signature, constexprs, attrs) = WORK[index]
    try:
        triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target)
    except Exception as exc:
        return {"kind": "compile", "label": launch["label"], "config": launch["config"],
                "text": short(exc)}
    return None


class Pointer:
    """A tensor as Triton's launch sees it: an address (aligned as a GPU allocation) and a dtype."""

    def __init__(self, dtype):
        import triton.language as tl
        self.dtype = getattr(tl, dtype)

    def data_ptr(self):
        return 1 << 20


def specialize(kernel, backend, launch):
    """(signature, constexprs, attrs) of this launch, as Triton's own launch makes them."""
    args = {name: (Pointer(value) if kind == "ptr" else value) for name, kind, value in launch["args"]}
    try:
        from triton.runtime.jit import create_function_from_signature
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, spec, options = binder(**args)
        _, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, spec, options)
        return signature, constexprs, attrs
    except Exception:  # another Triton's internals: the launch's types and constexprs alone
        signature, constexprs = {}, {}
        for name, kind, value in launch["args"]:
            if kind == "constexpr" or (kind == "int" and value == 1):
                signature[name], constexprs[name] = "constexpr", value
            else:
                signature[name] = {"ptr": "*" + {"float32": "fp32"}.get(value, value),
                                   "float": "fp32", "int": "i32"}[kind]
        return {n: signature[n] for n in kernel.arg_names}, constexprs, {}


def numba_main():
    global job
    try:
        from types import SimpleNamespace
        from numba import cuda
        from numba.cuda.cudadrv import nvvm
        if not nvvm.is_available():
            raise RuntimeError("NVVM (libnvvm) was not found")
        # Device functions are compiled for "the current device": make it an sm_90 GPU.
        import numba.cuda.api as api
        device = SimpleNamespace(compute_capability=(9, 0), supports_bfloat16=True,
                                 supports_fp8=True, id=0, name="sm_90")
        real = api.get_current_device
        api.get_current_device = lambda: device
        for mod in list(sys.modules.values()):
            if getattr(mod, "get_current_device", None) is real:
                mod.get_current_device = api.get_current_device
    except Exception as exc:
        for job in JOBS:
            say("GATE-SKIP:", "numba cannot compile for CUDA here (" + short(exc)[:300] + ")")
        return
    for job in JOBS:
        say(*numba_one(cuda))


def numba_one(cuda):
    try:
        source, helpers = module()
    except (Refused, SyntaxError, ValueError, KeyError) as exc:
        return "GATE-REFUSED:", {"kind": "description", "text": str(exc)}
    try:
        kernel = load(source)
    except Exception as exc:
        return "GATE-REFUSED:", {"kind": "import", "text": short(exc)}
    for launch in job["launches"]:
        try:
            cuda.compile_ptx(getattr(kernel, "py_func", kernel), launch["signature"], cc=(9, 0))
        except Exception as exc:
            name = type(exc).__name__
            if name in ("DynamicLibNotFoundError", "NvvmSupportError", "CudaSupportError"):
                return "GATE-SKIP:", ("numba needed a CUDA driver to compile part of your "
                                      "kernel, so it was not checked for a GPU here ("
                                      + short(exc)[:200] + ")")
            lines = []
            for line in str(exc).splitlines():
                if line.startswith("There are") or len(lines) == 3:
                    break
                if line.strip():
                    lines.append(line)
            where = getattr(getattr(exc, "loc", None), "line", None)
            if where:
                code = source.splitlines()[where - 1].strip()
                lines.append(f"in the line: {code}")
            return "GATE-REFUSED:", {"kind": "compile", "label": launch["label"],
                                     "config": launch["config"],
                                     "text": name + ": " + "\n".join(lines)}
    return "GATE-OK:", {"launches": len(job["launches"]), "helpers": helpers}


triton_main() if KIND == "triton" else numba_main()
'''
_SCRIPT = _DESCRIBE + _COMPILE


def compile_spec(spec) -> str:
    """The grader's half of the gate: compile what the kernel's side described (a spec of
    either kind), for the launches of the exercise's cases. A :class:`~.engine.Remark` when it
    compiled (or this machine cannot compile for CUDA), else the refusal's text; the kernel's
    own problem text is passed on."""
    return compile_specs([spec])[0]


def compile_specs(specs: list, timeout: float = TIMEOUT) -> list[str]:
    """:func:`compile_spec` of several kernels, one process for each kind (their launches
    compiled side by side): one verdict for each spec, in order."""
    from .. import runtime

    if _LAUNCHES is None:
        raise RuntimeError("the compile gate has no launches: import flashedu.checks first")
    verdicts: list = [None] * len(specs)
    jobs: dict = {"triton": [], "numba": []}
    for index, spec in enumerate(specs):
        if isinstance(spec, str) and spec and not isinstance(spec, Remark):
            verdicts[index] = spec[:2000]
        elif not isinstance(spec, dict) or spec.get("kind") not in jobs or \
                not isinstance(spec.get("functions"), list) or \
                not isinstance(spec.get("globals"), list) or \
                spec.get("which") not in (*SIGNATURES, "numba"):
            verdicts[index] = (
                "the grader got no description of your kernel to compile for a GPU, so it "
                "cannot tell whether it compiles: run the check again from a notebook whose "
                "kernel is defined with @triton.jit or @cuda.jit.")
        elif spec["kind"] == "numba" and not runtime.numba_simulated():
            verdicts[index] = Remark("numba compiled your kernel for this GPU when the cases "
                                     "launched it.")
        else:
            which = "numba" if spec["kind"] == "numba" else spec["which"]
            if spec["kind"] == "triton" and which == "numba":
                verdicts[index] = "the grader got a description of an unknown kernel."
                continue
            job = {"index": index, "kind": spec["kind"], "name": spec.get("name"),
                   "functions": spec["functions"], "globals": spec["globals"],
                   "launches": _LAUNCHES(which), "workers": WORKERS}
            if spec["kind"] == "triton":
                job["params"] = parameters(which)
            jobs[spec["kind"]].append(job)
    for kind, batch in jobs.items():
        if batch:
            runner = "Triton's interpreter" if kind == "triton" else "numba's simulator"
            for index, verdict in _run(kind, batch, timeout, runner).items():
                verdicts[index] = verdict
    return verdicts


def compile_triton(spec: dict, timeout: float = TIMEOUT) -> str:
    """Compile a :func:`triton_gate_source` spec for sm_90, for every launch of the cases of
    kernel ``spec["which"]``, in a fresh process."""
    return compile_specs([spec], timeout)[0]


def compile_numba(spec: dict, timeout: float = TIMEOUT) -> str:
    """Compile a :func:`numba_gate_source` spec to PTX for sm_90 with NVVM, for the argument
    types of the cases' launches, in a fresh process without the simulator."""
    return compile_specs([spec], timeout)[0]


def _environment() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_ENABLE_CUDASIM", "TRITON_KERNEL_OVERRIDE", "TRITON_OVERRIDE_DIR",
                        "TRITON_ALWAYS_COMPILE", "PYTHONSTARTUP", "PYTHONINSPECT")}
    env.update(TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING="1")
    return env


def _run(kind: str, jobs: list, timeout: float, runner: str) -> dict:
    """{job index: verdict} from one process compiling ``jobs``."""
    with tempfile.TemporaryDirectory(prefix="flashedu-gate-") as folder:
        for job in jobs:
            job["path"] = os.path.join(folder, f"learner_kernel_{job['index']}.py")
        env = _environment()
        env["TRITON_CACHE_DIR"] = os.path.join(folder, "cache")  # nothing compiled earlier counts
        try:
            run = subprocess.run([sys.executable, "-P", "-c", _SCRIPT], input=json.dumps(jobs),
                                 env=env, capture_output=True, text=True,
                                 timeout=timeout * len(jobs), check=False, cwd=folder)
        except subprocess.TimeoutExpired:
            return {job["index"]: (
                f"compiling your kernel for a GPU ({TARGET}) took over {timeout:.0f} s, so the "
                "grader cannot tell whether it compiles. A kernel this slow to compile unrolls "
                "too much: keep loops over tiles as plain range(...) loops.") for job in jobs}
    said: dict = {}
    for line in run.stdout.splitlines():
        tag, sep, payload = line.partition(":")
        if not sep or not tag.startswith("GATE-"):
            continue
        try:
            payload = json.loads(payload)
            said.setdefault(int(payload["job"]), []).append((tag, payload["verdict"]))
        except (ValueError, KeyError, TypeError):
            continue
    detail = (run.stderr.strip().splitlines() or ["(no output)"])[-1][:500]
    out = {}
    for job in jobs:
        heard = said.get(job["index"], [])
        tag, payload = heard[0] if len(heard) == 1 and run.returncode == 0 else ("", None)
        if tag == "GATE-OK" and isinstance(payload, dict):
            out[job["index"]] = Remark(_compiled_text(kind, payload))
        elif tag == "GATE-SKIP" and isinstance(payload, str):
            out[job["index"]] = Remark(f"Not compiled for a GPU: {payload}; only {runner} ran "
                                       "your kernel.")
        elif tag == "GATE-REFUSED" and isinstance(payload, dict):
            out[job["index"]] = _refusal_text(kind, payload, runner)
        else:
            out[job["index"]] = (
                "the grader could not compile your kernel for a GPU and got no verdict from "
                f"the compiler (exit status {run.returncode}: {detail}); it counts as not "
                "compiling.")
    return out


def _compiled_text(kind: str, payload: dict) -> str:
    n, helpers = int(payload.get("launches", 0)), int(payload.get("helpers", 0))
    with_helpers = f" and the {helpers} function{'s' if helpers != 1 else ''} it calls" \
        if helpers else ""
    if kind == "numba":
        return (f"Compiled for a GPU: your kernel{with_helpers} to PTX for {TARGET} with NVVM, for "
                "the cases' argument types.")
    return (f"Compiled for a GPU: your kernel{with_helpers} for {TARGET}, for each of the "
            f"{n} distinct launches (D, Br, Bc, CAUSAL and the sizes equal to 1) of the cases.")


def _refusal_text(kind: str, payload: dict, runner: str) -> str:
    text = str(payload.get("text", ""))
    what = payload.get("kind")
    if what == "description":
        return ("the grader compiles for a GPU only @triton.jit / @cuda.jit functions, plain "
                f"constants and the kernel language, and your kernel does more:\n{text[:1200]}")
    if what == "import":
        return ("the module of your kernel (its functions and the constants they read) does "
                f"not load, so it cannot compile for a GPU:\n{text[:1200]}")
    where = f"compiled for {TARGET}"
    if payload.get("label"):
        where += f" as case '{payload['label']}' launches it ({payload.get('config')})"
    message = (f"your kernel runs in {runner} but does not compile for a GPU: {where}, the "
               f"compiler says:\n")
    if kind == "triton":
        message += text[-1500:]
        if "Cannot access global variable" in text:
            message += ("\nTriton reads only the globals made with tl.constexpr: write "
                        "NAME = tl.constexpr(value) at module level (an annotation "
                        "`NAME: tl.constexpr = value` does not make one).")
        return message
    return (message + text[:1500] + "\nInside a kernel only scalars, cuda.local / cuda.shared "
            "arrays, the kernel's array arguments, math.* and @cuda.jit(device=True) functions "
            "work: no lists, NumPy calls or Python objects.")


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


def triton_gate(kernel, which: str) -> str:
    """The whole gate in this process (tests, scripts): describe, then compile."""
    return compile_spec(triton_gate_source(kernel, which))


def numba_gate(kernel) -> str:
    """The whole numba gate in this process (tests, scripts): describe, then compile."""
    return compile_spec(numba_gate_source(kernel))
