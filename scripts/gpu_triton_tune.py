"""Time candidate tile configs of each Triton kernel on a GPU and print the fastest per head dim.

The winners go into flashedu/triton/config.py by hand (one reviewed table beats an autotuner
that silently changes between machines). Shapes as ``flashedu bench``: B * N = 16384, H * d = 2048.

    PYTHONPATH=$PWD python3 scripts/gpu_triton_tune.py --n 8192 --d 64 128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from triton.testing import do_bench

from flashedu.triton.backward import backward
from flashedu.triton.config import Tiles, kernel_config
from flashedu.triton.forward import forward

FWD = [Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 3), Tiles(128, 128, 8, 3), Tiles(128, 128, 8, 2),
       Tiles(128, 64, 8, 4), Tiles(64, 64, 4, 3), Tiles(128, 32, 4, 3)]
DKDV = [Tiles(32, 128, 4, 3), Tiles(64, 128, 8, 3), Tiles(64, 128, 4, 2), Tiles(32, 128, 8, 3),
        Tiles(64, 64, 4, 3), Tiles(16, 128, 4, 3)]
DQ = [Tiles(128, 32, 4, 3), Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 3), Tiles(128, 32, 8, 3),
      Tiles(64, 32, 4, 3)]


def bench(fn):
    try:
        return do_bench(fn, warmup=10, rep=40, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
        print("   skipped:", type(exc).__name__, str(exc).splitlines()[0][:100])
        return float("inf")


def tune(n, d, causal, log):
    B, H = 16384 // n, 2048 // d
    q, k, v, do = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = d ** -0.5
    base = kernel_config(d, False, False)
    fl = 4 * B * H * n * n * d * (0.5 if causal else 1)
    best = {}
    times = {}
    for t in FWD:
        times[t] = bench(lambda: forward(q, k, v, is_causal=causal, scale=scale, block_mask=None,
                                         tiles=t, interpreted=False))
    best["forward"] = min(times, key=times.get)
    log(f"d={d} causal={causal} forward: " + ", ".join(
        f"{t.Br}x{t.Bc}/w{t.num_warps}/s{t.num_stages} {fl / times[t] / 1e9:.0f}TF"
        for t in FWD))
    o, lse2 = forward(q, k, v, is_causal=causal, scale=scale, block_mask=None,
                      tiles=best["forward"], interpreted=False)
    for name, cands in (("dkdv", DKDV), ("dq", DQ)):
        times = {}
        for t in cands:
            chosen = {"dkdv": best["dkdv"]} if "dkdv" in best else {}
            cfg = dataclasses.replace(base, **{**chosen, name: t})
            times[t] = bench(lambda: backward(q, k, v, o, lse2, do, is_causal=causal, scale=scale,
                                              block_mask=None, config=cfg, interpreted=False))
        best[name] = min(times, key=times.get)
        log(f"d={d} causal={causal} bwd varying {name}: " + ", ".join(
            f"{t.Br}x{t.Bc}/w{t.num_warps}/s{t.num_stages} {2.5 * fl / times[t] / 1e9:.0f}TF"
            for t in cands))
    return {k: dataclasses.asdict(v) for k, v in best.items()}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = {}
    for d in args.d:
        for causal in args.causal:
            out[f"d={d} causal={bool(causal)}"] = tune(args.n, d, bool(causal),
                                                       lambda s: print(s, flush=True))
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
