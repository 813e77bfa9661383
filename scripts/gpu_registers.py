"""Registers and occupancy of the d=64 kernels on a GPU: two programs of 8 warps share an SM
only while each uses at most 128 registers per thread (65536 per SM).

    python scripts/gpu_registers.py                       # maxnreg 128 against none, this tree
    python scripts/gpu_registers.py --trees OLD/ NEW/     # the same cases for other checkouts
                                                          # (each a folder holding flashedu/)

The A/B run replaces the d=64 entry of the tile table in one process (each Tiles object has its
own compiled kernels), twice in alternation, and prints forward and backward TFLOPs at N=4096
(B=4, H=16) and N=16384 (B=1, H=16), bf16, causal and not, with each compiled kernel's
registers and spills. ``--trees`` runs the N=4096 cases once per tree, each in its own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys


def measure(N, B, H, causal, d=64):
    import torch
    from triton.testing import do_bench

    import flashedu

    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    fwd = lambda: flashedu.attention(q, k, v, is_causal=causal, backend="triton")  # noqa: E731
    o = fwd()
    bwd = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # noqa: E731
    bwd()
    flop = 4 * B * H * N * N * d * (0.5 if causal else 1)
    def ms(fn):
        return do_bench(fn, warmup=30, rep=200, return_mode="median")
    return {"fwd_TF": round(flop / ms(fwd) / 1e9, 1),
            "bwd_TF": round(2.5 * flop / ms(bwd) / 1e9, 1)}


def kernels():
    from flashedu.triton import fast

    found = getattr(fast, "compiled_kernels", None)
    return [] if found is None else [(n, c.get("maxnreg"), k.n_regs, k.n_spills)
                                     for n, c, k in found()]


def ab() -> list:
    from flashedu.triton import config as C

    base = C.GPU_16BIT[64]

    def with_maxnreg(m):
        r = lambda t: dataclasses.replace(t, maxnreg=m)  # noqa: E731
        return dataclasses.replace(base, forward=r(base.forward), dkdv=r(base.dkdv),
                                   dq=r(base.dq))
    rows = []
    for N, B, H in ((4096, 4, 16), (16384, 1, 16)):
        for causal in (False, True):
            for rep in range(2):
                for m in (None, 128):
                    C.GPU_16BIT[64] = with_maxnreg(m)
                    C._device_config.cache_clear()
                    row = dict(N=N, causal=causal, maxnreg=m, rep=rep,
                               **measure(N, B, H, causal))
                    print(row, flush=True)
                    rows.append(row)
    C.GPU_16BIT[64] = base
    return rows


def one_tree() -> dict:
    row = {f"{'causal' if c else 'dense'} {k}": v for c in (False, True)
           for k, v in measure(4096, 4, 16, c).items()}
    return {**row, "kernels (name, maxnreg, registers, spills)": kernels()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="*", default=None, help="folders that hold a flashedu/")
    ap.add_argument("--one-tree", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="gpu_registers.json")
    args = ap.parse_args()
    if args.one_tree:  # a child of --trees: flashedu comes from PYTHONPATH
        print("RESULT", json.dumps(one_tree()), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return 0
    out = {}
    if args.trees:
        out["trees"] = {}
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--one-tree"],
                                 env=env, capture_output=True, text=True, cwd="/")
            line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
            out["trees"][tree] = json.loads(line[0][7:]) if line else {"error": run.stderr[-300:]}
            print(tree, out["trees"][tree], flush=True)
    else:
        out["maxnreg_ab"] = ab()
        out["kernels (name, maxnreg, registers, spills)"] = kernels()
        print(out["kernels (name, maxnreg, registers, spills)"])
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
