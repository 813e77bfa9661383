"""Attention in several processes at once on one GPU: does every call still give its answer?

Each process makes one call, then repeats it for ``--seconds`` (a sync every 20 calls) and
compares each output with its first, bit for bit; a CUDA error or a different output fails it.
The processes share the GPU by time-slicing, as a class's notebooks or two training jobs on
one GPU do. FlashAttention-3's Gluon kernels faulted this way until their mbarriers were
invalidated at the end of each program (BENCHMARKS.md, "FlashAttention-3's kernels and a GPU
shared by time-slicing", and the section after it). ``FLASHEDU_FA3=0`` leaves the calls to the
Triton kernels. Each process says which it ran.

    python scripts/gpu_shared_gpu.py --d 128                    # 4 processes, 30 s, forward
    python scripts/gpu_shared_gpu.py --d 64 --causal --backward
    FLASHEDU_FA3=0 python scripts/gpu_shared_gpu.py --d 128
    python scripts/gpu_shared_gpu.py --d 128 --fa3 PINGPONG=1 STAGES=2   # the Gluon forward
                                                                       # alone, settings changed
    python scripts/gpu_shared_gpu.py --d 128 --beside-triton   # one Gluon process, the others
                                                                # on the Triton kernels
    python scripts/gpu_shared_gpu.py --d 128 --json docs/bench/shared_gpu_h200_run.json

``--fa3`` starts ``flashedu.triton.fa3.forward`` directly, with the tile table's settings for
this head dim changed by the KEY=VALUE pairs given (its keywords: CONSUMERS, STAGES,
CONSUMER_REGS, PINGPONG, OVERLAP, LONGEST_FIRST, PERSISTENT), to find which part of the
schedule the faults follow. ``--no-realloc`` (a diagnostic only) compiles the Gluon kernels
without their register reallocation (no ``setmaxnreg``: the warp partitions keep the even
share, and the consumers spill), which the Triton kernels, clean on a shared GPU, do not use;
it reaches into Triton 3.6's Gluon internals, and its kernels are compiled into a cache
directory of their own.

``--json`` writes the run as a record: the environment, and each process's line parsed (clean
or failed, its calls, whether it ran the Gluon kernels).

Without a CUDA GPU it says so and exits.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time


def one_process(args) -> int:
    """The child: repeat one call, compare every output with the first; 0 if all agreed."""
    import torch

    from flashedu.triton import fa3

    if args.no_realloc:
        without_register_reallocation()
    torch.manual_seed(0)
    B, H, N, d = 4, 2048 // args.d, args.n, args.d
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=args.backward) for _ in range(3))
    dout = torch.randn_like(q)

    if args.fa3 is not None:
        call = fa3_call(q, k, v, args)
    else:
        call = api_call(q, k, v, dout, args)
    tag = f"pid {os.getpid()} (FlashAttention-3 kernels {fa3.status().split(':')[0]})"
    calls = 0
    try:
        first = call().clone()
        if not args.backward:  # the first answer right, not only repeated
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(t.detach().float() for t in (q, k, v)), is_causal=args.causal)
            error = (first.float() - ref).abs().max().item()
            if not error < 2e-2:
                print(f"FAILED {tag}: error {error:.3g} against SDPA in float32", flush=True)
                return 1
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            for _ in range(20):
                out = call()
            torch.cuda.synchronize()
            calls += 20
            if not torch.equal(out, first):
                print(f"FAILED {tag}: a different output after {calls} calls", flush=True)
                return 1
    except Exception as exc:  # noqa: BLE001 - a CUDA fault is what this looks for
        print(f"FAILED {tag} after {calls} calls: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:160]}", flush=True)
        return 1
    print(f"ok {tag}: {calls} calls", flush=True)
    return 0


def without_register_reallocation():
    """Gluon's warp_specialize with the partitions' requested registers dropped: the
    compiled kernel then has no setmaxnreg (checked on Triton 3.6 by compiling for sm_90)."""
    from triton.experimental.gluon.language import _semantic

    original = _semantic.GluonSemantic.warp_specialize

    class NoRegisters:  # the warp-specialize op, less its requested registers
        def __init__(self, op):
            self.op = op

        def __getattr__(self, name):
            return getattr(self.op, name)

        def set_requested_registers(self, registers):
            pass

    def warp_specialize(self, functions_and_args, num_warps, num_regs, generator):
        create = self.builder.create_warp_specialize
        self.builder.create_warp_specialize = lambda *a, **k: NoRegisters(create(*a, **k))
        try:
            return original(self, functions_and_args, num_warps, num_regs, generator)
        finally:
            self.builder.create_warp_specialize = create

    _semantic.GluonSemantic.warp_specialize = warp_specialize


def api_call(q, k, v, dout, args):
    """flashedu.attention's forward, or forward+backward (k's and v's gradients returned)."""
    import torch

    import flashedu

    def call():
        if not args.backward:
            with torch.no_grad():
                return flashedu.attention(q, k, v, is_causal=args.causal)
        for t in (q, k, v):
            t.grad = None
        flashedu.attention(q, k, v, is_causal=args.causal).backward(dout)
        return torch.cat([t.grad for t in (k, v)])  # dQ's adds may land in any order
    return call


def fa3_call(q, k, v, args):
    """The Gluon forward alone, started again through its launch plan, with the tile table's
    settings for this head dim changed by ``args.fa3`` (KEY=VALUE strings)."""
    import torch

    from flashedu.triton import config, fa3

    entry = config.table("sm90", False)[args.d]
    settings = entry.schedule.settings(args.causal)
    for pair in args.fa3:
        key, _, value = pair.partition("=")
        if key not in settings:
            raise SystemExit(f"--fa3: {key!r} is not one of {', '.join(settings)}")
        settings[key] = type(settings[key])(int(value))
    print(f"fa3.forward settings: {settings}", flush=True)
    o = torch.empty_like(q)
    lse2 = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    plan = fa3.forward(q, k, v, o, lse2, is_causal=args.causal, scale=q.shape[-1] ** -0.5,
                       **settings)

    def call():
        plan.start(q, k, v, o, lse2)
        return o
    return call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--d", type=int, default=128, choices=(64, 128))
    p.add_argument("--n", type=int, default=4096, help="sequence length (B=4, H=2048/d)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="forward+backward calls")
    p.add_argument("--fa3", nargs="*", metavar="KEY=VALUE",
                   help="the Gluon forward alone, the table's settings changed by these")
    p.add_argument("--no-realloc", action="store_true",
                   help="the Gluon kernels compiled without register reallocation (diagnostic)")
    p.add_argument("--beside-triton", action="store_true",
                   help="every process but the first runs the Triton kernels (FLASHEDU_FA3=0)")
    p.add_argument("--json", help="write the run here (each process's line parsed)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return one_process(args)
    import torch

    if not torch.cuda.is_available():
        print("gpu_shared_gpu.py: needs a CUDA GPU; none is visible here.", file=sys.stderr)
        return 1
    # one process first, alone: it compiles the kernels the others then find in the cache
    child = [sys.executable, __file__, "--child", *(argv if argv is not None else sys.argv[1:])]
    env = dict(os.environ)
    if args.no_realloc:  # Triton's cache key does not see the change: a cache of their own
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashedu-no-realloc-")
    subprocess.run([*child, "--seconds", "1"], check=False, env=env)
    # --beside-triton: does a Gluon process fault when the GPU's other work is not its own?
    from flashedu.runtime import FA3_SWITCH_ENV

    others = {**env, FA3_SWITCH_ENV: "0"} if args.beside_triton else env
    procs = [subprocess.Popen(child, env=env if i == 0 else others, stdout=subprocess.PIPE,
                              text=True) for i in range(args.processes)]
    results = []
    for proc in procs:
        text = proc.communicate()[0]
        print(text, end="", flush=True)
        results.append(process_result(text, proc.returncode))
    clean = sum(r["clean"] for r in results)
    print(f"{clean} of {args.processes} processes gave their answer throughout")
    if args.json:
        from flashedu.benchmarks import core

        argv_text = " ".join(argv if argv is not None else sys.argv[1:])
        core.write_json(args.json, {
            "environment": core.environment(f"python scripts/gpu_shared_gpu.py {argv_text}"),
            "processes": results, "clean": clean, "all_clean": clean == args.processes})
        print(f"wrote {args.json}")
    return 0 if clean == args.processes else 1


def process_result(text: str, returncode: int) -> dict:
    """One child's outcome from its output and exit code: clean (its "ok" line and exit 0),
    its calls, whether it ran the Gluon kernels ("on"/"off"), and its last line."""
    lines = [x for x in text.splitlines() if x.startswith(("ok ", "FAILED "))]
    line = lines[-1] if lines else f"no result line (exit code {returncode})"
    calls = re.search(r"(\d+) calls", line)
    kernels = re.search(r"FlashAttention-3 kernels (\w+)", line)
    return {"clean": returncode == 0 and line.startswith("ok "),
            "calls": int(calls.group(1)) if calls else None,
            "kernels": kernels.group(1) if kernels else None, "line": line}


if __name__ == "__main__":
    sys.exit(main())
