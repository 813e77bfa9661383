"""``flashedu bench sass``: registers, spills and instruction mix of the Triton kernels as a GPU
runs them, compiled on this machine (no GPU needed).

The launches are the package's own: ``forward`` and ``backward`` of ``flashedu.triton`` run on
CPU tensors of the benchmark's shapes with their launches captured instead of run, and each
captured kernel is compiled by Triton's NVIDIA backend (ptxas) for the target GPU, with the
specialization Triton gives those arguments on a GPU (16-byte aligned pointers, integers
divisible by 16 marked so, ones as constants). ``cuobjdump`` then reports registers and stack
bytes, and ``nvdisasm`` the SASS, whose instructions are counted by opcode.
``compile_kernel(kernel, args, constexprs)`` does the same for a kernel of one's own (notebook 10
compiles the learner's forward of exercise 06 with it).

What the numbers say:
- registers: with 8 warps, more than 128 per thread leaves one program per SM instead of two
  (notebook 10, BENCHMARKS.md "Registers"); 255 is the ceiling.
- spills: STL/LDL instructions move registers through local memory (slow; stack > 0).
- instructions: the count is static (a loop body counts once) but compares variants of one
  kernel. With the tensor cores busy for a fixed time per tile, more instructions per tile
  make a kernel issue-bound: the dropout forward's Philox rounds show up as IMAD and LOP3.

    flashedu bench sass                                   # d=64 and 128, bf16, sm_90 table
    flashedu bench sass --d 128 --variants plain dropout --modes fwd --json sass.json
    flashedu bench sass --table sm75 --dtype fp16        # another GPU's table and target
    flashedu bench sass --variants fa3 causal-fa3 --modes fwd   # the Gluon forward's schedule
    flashedu bench sass --variants fa3 dropout-fa3 --modes fwd --n 4096   # and its dropout

The shared memory column is what the compiled kernel asks for per program; a table built for a
smaller GPU (``--table sm75``: 64 KB per block) must stay within it, which running that table on
an H100 cannot show.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

# resume: ring attention's forward_into; sinks: one sink logit per head; packed: the batch's
# sequences packed into one row, causal, the kernels reading the cuts (varlen_attention);
# fa3, causal-fa3, dropout-fa3: FlashAttention-3's forward in Gluon (triton/fa3.py) with the
# tile table's schedule, as an sm_90 runs it from 4096 keys (the backward is the Triton
# kernel's; ``scripts/compile_fa3_backward.py`` compiles fa3's own)
VARIANTS = ("plain", "causal", "dropout", "resume", "sinks", "causal-dropout", "packed", "fa3",
            "causal-fa3", "dropout-fa3")
MODES = ("fwd", "bwd")
COUNTED = ("HGMMA", "HMMA", "MUFU", "FFMA", "FMUL", "IMAD", "LOP3", "SHF", "PRMT", "SEL",
           "STS", "LDS", "BAR")
DROPOUT_P = 0.1


def main(argv=None) -> int:
    from . import core

    args = _parser().parse_args(argv)
    if not can_compile():
        print("flashedu bench sass: this Triton has no NVIDIA backend tools (ptxas, cuobjdump, "
              "nvdisasm): nothing can be compiled for a GPU here", file=sys.stderr)
        return 1
    try:
        rows = kernel_stats(args.d, args.variants, args.modes, n=args.n, table=args.table,
                            dtype=args.dtype)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    record = core.environment(sys.argv[1:] if argv is None else ["sass", *argv],
                              target=args.table, rows=rows)
    print(core.headline(record))
    headers = ["kernel", "variant", "d", "tiles", "smem KB", "regs", "stack B", "STL",
               "instrs", *COUNTED]
    print(core.format_table(headers, [
        [r["kernel"], r["variant"], r["d"], r["tiles"], f"{r['shared_bytes'] / 1024:.0f}",
         r["registers"], r["stack_bytes"], r["spill_stores"], r["instructions"],
         *(r["ops"].get(op, 0) for op in COUNTED)] for r in rows]))
    from ..triton.config import SMEM_PER_BLOCK

    over = [r for r in rows if r["shared_bytes"] > SMEM_PER_BLOCK[args.table]]
    print(f"shared memory: {len(rows) - len(over)} of {len(rows)} kernels within the "
          f"{SMEM_PER_BLOCK[args.table] // 1024} KB per block of {args.table}")
    if args.json:
        core.write_json(args.json, record)
        print(f"wrote {args.json}")
    return 0


def can_compile() -> bool:
    """True where Triton has its NVIDIA backend's tools (ptxas, cuobjdump, nvdisasm)."""
    try:
        tools = _tools_dir()
    except ImportError:
        return False
    return all(os.path.exists(os.path.join(tools, t)) for t in ("ptxas", "cuobjdump",
                                                                 "nvdisasm"))


def _tools_dir() -> str:
    """Where Triton keeps its NVIDIA backend's binaries."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def kernel_stats(d, variants, modes, *, n=1024, table="sm90", dtype="bf16") -> list[dict]:
    """One dict per compiled launch (kernel, variant, d, mode, tiles, shared_bytes, registers,
    stack_bytes, spill_stores, spill_loads, instructions, ops: {opcode: count}), for head dims
    ``d``, VARIANTS ``variants`` and MODES ``modes``; compiled in a fresh process (this one may
    run Triton as its interpreter). Raises RuntimeError with the compiler's output if it fails."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "FLASHEDU_TILE_TABLE": table}
    request = json.dumps({"d": list(d), "variants": list(variants), "modes": list(modes),
                          "n": n, "table": table, "dtype": dtype})
    run = subprocess.run([sys.executable, "-P", "-m", __name__, "--worker", request], env=env,
                         capture_output=True, text=True)
    lines = [x for x in run.stdout.splitlines() if x.startswith("ROWS ")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"{run.stdout}{run.stderr}\nflashedu bench sass: the compile failed "
                           f"(above)")
    return json.loads(lines[0][5:])


def compile_kernel(kernel, args, constexprs, *, table: str = "sm90", timeout: float = 300.0):
    """Compile YOUR ``@triton.jit`` kernel for a GPU (an H100 by default) on this machine, as
    ``kernel[grid](*args, **constexprs)`` would compile on that GPU, and read the result.

    ``args``: the kernel's other arguments as you would pass them (torch tensors on any device:
    only their dtype and alignment matter; Python ints and floats). ``constexprs``: its
    ``tl.constexpr`` arguments plus the launch options (``num_warps``, ``num_stages``,
    ``maxnreg``), one dict; or a list of such dicts, compiled in one process (a list comes back).

    Each result: ``registers`` (per thread), ``stack_bytes`` (local memory per thread: spills),
    ``spill_stores``/``spill_loads`` (STL/LDL instructions), ``shared_bytes`` (per program),
    ``instructions`` and ``ops`` (SASS opcode -> count, static: a loop body counts once),
    ``mufu`` (the special-function unit's instructions by function: ``EX2``, ``RCP``, ``LG2``).

    The compile runs in a fresh process that imports only Triton (this one may run Triton as
    its interpreter); the kernel travels as source, with the modules, ``tl.constexpr`` globals
    and other ``@triton.jit`` functions it names. Raises RuntimeError with the compiler's
    message if it fails (``can_compile()`` says first whether the tools are here)."""
    many = isinstance(constexprs, (list, tuple))
    variants = list(constexprs) if many else [constexprs]
    source, name = _kernel_source(kernel.fn), kernel.fn.__name__
    launches, keys = [], []
    for consts in variants:
        signature, consts_in, attrs, options = _specialize(kernel, args, dict(consts))
        # a constant inside a tuple argument is keyed by its path (a tuple): JSON takes lists
        launch = {"signature": signature,
                  "constexprs": [[k if isinstance(k, str) else list(k), v]
                                 for k, v in consts_in.items()],
                  "attrs": [[list(k), v] for k, v in attrs.items()], "options": options}
        launches.append(launch)
        keys.append(json.dumps([source, name, table, launch], sort_keys=True, default=str))
    todo = [(k, launch) for k, launch in zip(keys, launches) if k not in _COMPILED]
    if todo:
        request = {"source": source, "name": name, "table": table,
                   "launches": [launch for _, launch in todo]}
        for (key, _), row in zip(todo, _run_compile(request, timeout)):
            _COMPILED[key] = row
    rows = [dict(_COMPILED[k]) for k in keys]
    return rows if many else rows[0]


_COMPILED: dict = {}  # compile_kernel's results in this process: a repeated request is free


def _run_compile(request: dict, timeout: float) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    what = f"compiling {request['name']} for {request['table']}"
    try:
        run = subprocess.run([sys.executable, "-P", os.path.abspath(__file__), "--compile"],
                             input=json.dumps(request), env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{what} took over {timeout:.0f} s") from exc
    lines = [x for x in run.stdout.splitlines() if x.startswith("ROWS ")]
    if run.returncode != 0 or not lines:
        message = [x for x in run.stderr.strip().splitlines() if "FP_FUSION" not in x
                   and "warn_once" not in x]
        raise RuntimeError(f"{what} failed:\n" + "\n".join(message[-25:]))
    return json.loads(lines[0][5:])


def _kernel_source(fn, seen=None) -> str:
    """The kernel's source, preceded by what it names at module level: modules (imported
    again), ``tl.constexpr`` and plain-number globals, other ``@triton.jit`` functions (their
    source, recursively). Enough for a kernel written in a notebook cell or a module file."""
    import inspect
    import textwrap
    import types

    import triton.language as tl

    seen = set() if seen is None else seen
    seen.add(fn.__name__)
    head, helpers = [], []
    for name in fn.__code__.co_names:
        if name not in fn.__globals__ or name in seen:
            continue
        value = fn.__globals__[name]
        if isinstance(value, types.ModuleType):
            head.append(f"import {value.__name__} as {name}")
        elif isinstance(value, tl.constexpr):
            head.append(f"{name} = tl.constexpr({value.value!r})")
        elif isinstance(value, (bool, int, float)):
            head.append(f"{name} = {value!r}")
        elif hasattr(value, "fn") and callable(value.fn) and hasattr(value.fn, "__code__"):
            helpers.append(_kernel_source(value.fn, seen))  # another @triton.jit function
    body = textwrap.dedent(inspect.getsource(fn))
    return "\n".join([*head, *helpers, body])


def _compile_request(request: dict) -> list[dict]:
    """The worker of ``compile_kernel``: define the kernel from its source, compile each launch."""
    import importlib.util

    header = "import math\nimport triton\nimport triton.language as tl\nfrom triton import jit\n\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "your_kernel.py")  # Triton reads a kernel's source from a file
        with open(path, "w", encoding="utf-8") as f:
            f.write(header + request["source"] + "\n")
        spec = importlib.util.spec_from_file_location("your_kernel", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["your_kernel"] = module
        spec.loader.exec_module(module)
        kernel = getattr(module, request["name"])
        rows = []
        for launch in request["launches"]:
            attrs = {tuple(k): v for k, v in launch["attrs"]}
            signature = {n: _tuples(kind) for n, kind in launch["signature"].items()}
            rows.append({"kernel": request["name"], **_compile_specialized(
                kernel, signature,
                {k if isinstance(k, str) else tuple(k): v for k, v in launch["constexprs"]},
                attrs, launch["options"],
                request["table"])})
    return rows


def _tuples(x):
    """A tuple argument's kinds as Triton takes them: JSON brought them back as lists."""
    return tuple(_tuples(e) for e in x) if isinstance(x, list) else x


def _parser():
    from . import core

    p = core.parser("flashedu bench sass", __doc__)
    p.add_argument("--d", type=core.head_dim, nargs="+", default=[64, 128])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:3]))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--n", type=core.positive_int, default=1024,
                   help="sequence length of the captured launches (B, H as the benchmarks')")
    p.add_argument("--table", default="sm90", choices=["sm75", "sm80", "sm86", "sm89", "sm90"],
                   help="the tile table, and the GPU compiled for")
    p.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"],
                   help="the inputs' dtype (sm75 has no bfloat16 tensor cores: fp16)")
    p.add_argument("--json", type=core.output_file)
    return p


# ----------------------------------------------------------------------------------------
# The worker: capture the launches, compile them, read the cubins
# ----------------------------------------------------------------------------------------


def _worker(request: dict) -> list[dict]:
    rows = []
    for d in request["d"]:
        for variant in request["variants"]:
            for mode in request["modes"]:
                if variant in ("resume", "fa3", "causal-fa3") and mode == "bwd":
                    continue  # forward_into has no backward of its own; fa3 takes Triton's
                for kernel, args, consts in _captured(d, variant, mode, request["n"],
                                                      request["dtype"]):
                    rows.append({"d": d, "variant": variant, "mode": mode,
                                 **_compile_stats(kernel, args, consts, request["table"])})
    return rows


def _captured(d: int, variant: str, mode: str, n: int, dtype: str):
    """The (kernel, args, consts) the package launches for this call, in launch order."""
    import torch

    from .. import ops
    from ..triton import fast, launch
    from ..triton.autograd import resolve_config
    from . import core

    launches = []

    def capture(kernel, grid, args, consts, switches=None, slots=()):
        launches.append((kernel, args, {**consts, **(switches or {})}))

    def sm90_switches(tiles, interpreted, *tensors):  # as on an sm_90 with aligned tensors
        return {"TMA": bool(tiles.tma), "WARP_SPECIALIZE": bool(tiles.tma and
                                                                tiles.warp_specialize)}

    B, H = core.batch_heads(n, d)
    q, k, v, do = (torch.empty(B, H, n, d, dtype=core.torch_dtype(dtype)) for _ in range(4))
    seqs = None
    if variant == "packed":  # the B sequences of n tokens one after another, in batch 1
        from ..varlen import Packing

        q, k, v, do = (t.reshape(1, H, B * n, d) for t in (q, k, v, do))
        cu = torch.arange(0, B * n + 1, n, dtype=torch.int32)
        seqs = Packing(cu, cu, n, n)
    config = resolve_config(d, q.dtype, None, q.device)
    kw = dict(is_causal=variant.startswith("causal") or variant == "packed", scale=d ** -0.5,
              interpreted=False)
    drop = ({"dropout_p": DROPOUT_P, "rng": torch.tensor([1, 0])}
            if "dropout" in variant.split("-") else {})
    sinks = {"sinks": torch.zeros(H)} if variant == "sinks" else {}
    call = ops.Call(kw["is_causal"], kw["scale"], None, drop.get("dropout_p", 0.0),
                    drop.get("rng"), None, sinks.get("sinks"), seqs)
    saved = fast.run, fast.launch, fast.switches
    fast.run, fast.launch, fast.switches = capture, capture, sm90_switches
    try:
        if variant.endswith("fa3"):
            from ..triton import fa3
            from ..triton.config import TABLE_ENV

            settings = config.fa3_settings(n, n, kw["is_causal"], bool(drop))
            if settings is None:
                raise ValueError(f"the {os.environ.get(TABLE_ENV, 'sm90')} table runs no fa3 "
                                 f"forward at d={d}, N={n} (it asks for it at d=64 and d=128 "
                                 "from 4096 keys)")
            fa3.forward(q, k, v, torch.empty_like(q), torch.empty(q.shape[:3]),
                        is_causal=kw["is_causal"], scale=kw["scale"], **drop, **settings)
        elif variant == "resume":
            o, lse2 = torch.zeros(q.shape), torch.full(q.shape[:3], float("inf"))
            launch.forward_into(q, k, v, o, lse2, tiles=config.forward_tiles(None, n), **kw)
        else:
            o, lse2 = launch.forward(q, k, v, call, interpreted=False,
                                     tiles=config.forward_tiles(None, n, bool(drop)))
        if mode == "bwd":
            launches.clear()
            D = None  # with sinks, D and the sinks' gradient come from one preprocess pass
            if sinks:
                D, _ = launch.preprocess(o, do, config.preprocess_rows, sinks["sinks"], lse2)
            launch.backward(q, k, v, o, lse2, do, call, D=D, config=config, interpreted=False)
    finally:
        fast.run, fast.launch, fast.switches = saved
    return launches


def _compile_stats(kernel, args, consts, table: str) -> dict:
    """Compile one captured launch for the table's GPU; its registers, spills and opcodes."""
    signature, constexprs, attrs, options = _specialize(kernel, args, consts)
    return {"kernel": kernel.fn.__name__, "tiles": _tiles_text(consts),
            **_compile_specialized(kernel, signature, constexprs, attrs, options, table)}


def _specialize(kernel, args, consts):
    """What a GPU launch ``kernel[grid](*args, **consts)`` compiles: the argument types
    (signature), the constants (constexprs, and integers equal to 1), the attributes (pointers
    16-byte aligned and integers divisible by 16 marked so) and the launch options."""
    import inspect

    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, native_specialize_impl

    params = (kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)).params
    names = [p.name for p in params]
    options = {n: c for n, c in consts.items() if n not in names}
    bound = inspect.signature(kernel.fn).bind(*args, **{n: c for n, c in consts.items()
                                                         if n in names})
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(params):
        value = bound.arguments[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[p.name] = kind
        _mark(kind, spec, (i,), constexprs, attrs, top=p.name)
    return signature, constexprs, attrs, options


def _mark(kind, spec, path, constexprs, attrs, top=None):
    """Record what Triton compiles in for one argument at ``path`` (its index, and inside a
    tuple argument the indices below it): None and integers 1 as constants, 16-byte aligned
    pointers and integers divisible by 16 as such."""
    if isinstance(kind, tuple):  # a tuple argument: each element specialized on its own
        for j, (k, s) in enumerate(zip(kind, spec)):
            _mark(k, s, (*path, j), constexprs, attrs)
    elif kind == "constexpr":  # None, or an integer 1: Triton compiles it in
        constexprs[top if top is not None else path] = spec
    elif spec == "D":
        attrs[path] = [["tt.divisibility", 16]]


def _compile_specialized(kernel, signature, constexprs, attrs, options, table: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():  # fa3.py's kernel, written in Gluon
        from triton.experimental.gluon._runtime import GluonASTSource as source
    target = GPUTarget("cuda", int(table[2:]), 32)
    compiled = triton.compile(source(kernel, signature, constexprs, attrs), target=target,
                              options=options)
    return {"shared_bytes": compiled.metadata.shared, **_cubin_stats(compiled.asm["cubin"])}


def _tiles_text(consts: dict) -> str:
    if "CONSUMERS" in consts:  # fa3: consumers of 64 rows, stages, registers, switches
        switches = "".join(f" {n.lower()}" for n in ("PINGPONG", "OVERLAP", "PERSISTENT",
                                                      "TMA_STORE") if consts.get(n))
        buffers = f" q{consts['Q_BUFFERS']}" if consts.get("Q_BUFFERS", 1) > 1 else ""
        return (f"{64 * consts['CONSUMERS']}x{consts['Bc']} c{consts['CONSUMERS']} "
                f"s{consts['STAGES']} r{consts['CONSUMER_REGS']}{switches}{buffers}")
    if "Br" in consts:
        shape = f"{consts['Br']}x{consts['Bc']}"
    else:  # the backward: its dK/dV programs' tiles, or a dQ launch's
        kind = consts.get("DKDV") or consts.get("DQ")
        shape = f"{kind[0]}x{kind[1]}" if kind else ""
    extra = "".join(f" {n[0]}" for n in ("TMA", "WARP_SPECIALIZE") if consts.get(n))
    cap = f" r{consts['maxnreg']}" if consts.get("maxnreg") else ""
    return f"{shape} w{consts.get('num_warps', 4)} s{consts.get('num_stages', 3)}{cap}{extra}"


def _run_both(*commands) -> list[str]:
    """The standard output of each command, the commands run side by side."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    outs = []
    for command, proc in zip(commands, procs):
        out, err = proc.communicate()
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, command, out, err)
        outs.append(out)
    return outs


def _cubin_stats(cubin: bytes) -> dict:
    tools = _tools_dir()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage, sass = _run_both([os.path.join(tools, "cuobjdump"), "-res-usage", path],
                                [os.path.join(tools, "nvdisasm"), "-c", path])
    full = [m.group(1) for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)]
    ops = collections.Counter(op.split(".")[0] for op in full)
    mufu = collections.Counter(op.split(".")[1] for op in full
                               if op.startswith("MUFU."))
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "spill_stores": ops.get("STL", 0), "spill_loads": ops.get("LDL", 0),
            "instructions": sum(ops.values()), "ops": dict(ops.most_common()),
            "mufu": dict(mufu.most_common())}


if __name__ == "__main__":
    if sys.argv[1:] == ["--compile"]:  # compile_kernel's worker: Triton only, request on stdin
        print("ROWS " + json.dumps(_compile_request(json.loads(sys.stdin.read()))), flush=True)
        sys.exit(0)
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        import flashedu  # noqa: F401  (TRITON_INTERPRET=0 from the parent: compiled kernels)

        print("ROWS " + json.dumps(_worker(json.loads(sys.argv[2]))), flush=True)
        sys.exit(0)
    sys.exit(main())
