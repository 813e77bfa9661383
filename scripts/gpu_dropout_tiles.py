"""Tiles for dropout, swept on a GPU: each candidate's forward and backward at p=0.1 beside the
tile table's p=0 call, at the shapes of ``flashedu bench dropout``.

    python scripts/gpu_dropout_tiles.py --json docs/bench/dropout_tiles.json

Each backward candidate replaces the dK/dV tiles of the entry a dropout call takes (one
launch: the dQ program runs with the dK/dV program's warps); each forward candidate is passed
as the forward's tiles. One ``triton.testing.do_bench`` each (ms); the ratio is against the
table's own p=0 call on the same inputs. The winners go into flashedu/triton/config.py by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import flashedu  # noqa: F401  (before triton)

SHAPES = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (8, 16, 4096, 64, False)]


def candidates():
    from flashedu.triton.config import Tiles

    dkdv = [Tiles(32, 128, 8, 3), Tiles(32, 128, 8, 3, maxnreg=128), Tiles(64, 128, 8, 3),
            Tiles(64, 128, 8, 2), Tiles(32, 128, 4, 3), Tiles(64, 64, 4, 3), Tiles(32, 64, 4, 3),
            Tiles(64, 128, 8, 3, maxnreg=168), Tiles(16, 128, 4, 3), Tiles(32, 64, 8, 3)]
    fwd = [Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 3, maxnreg=128),
           Tiles(128, 128, 8, 2, tma=True, warp_specialize=True), Tiles(128, 64, 4, 3),
           Tiles(64, 64, 4, 3), Tiles(128, 128, 8, 2), Tiles(128, 64, 8, 2)]
    return dkdv, fwd


def sweep(shape, p, log):
    import torch
    from triton.testing import do_bench

    from flashedu.dropout import draw_rng
    from flashedu.ops import Call
    from flashedu.triton.config import kernel_config
    from flashedu.triton.launch import backward, forward

    B, H, N, d, causal = shape
    g = torch.Generator(device="cuda").manual_seed(N + d)
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    plain, dropped = Call(causal, d ** -0.5), Call(causal, d ** -0.5, dropout_p=p,
                                                  rng=draw_rng(q.device))
    entry = kernel_config(d, False, False).backward_entry(causal, True, None, N)
    o, lse2 = forward(q, k, v, plain, interpreted=False)

    def bench(fn):
        try:
            return do_bench(fn, warmup=10, rep=60)
        except Exception as exc:  # a candidate that does not fit this GPU
            log(f"  {type(exc).__name__}: {str(exc)[:80]}")
            return float("nan")
    bwd0 = bench(lambda: backward(q, k, v, o, lse2, do, plain, interpreted=False))
    fwd0 = bench(lambda: forward(q, k, v, plain, interpreted=False))
    log(f"B={B} H={H} N={N} d={d} causal={causal}: p=0 forward {fwd0:.3f} ms, backward "
        f"{bwd0:.3f} ms")
    rows = []
    dkdv, fwd = candidates()
    for t in dkdv:
        cfg = dataclasses.replace(entry, dkdv=t)
        ms = bench(lambda: backward(q, k, v, o, lse2, do, dropped, config=cfg,
                                    interpreted=False))
        log(f"  dkdv {t}: {ms:.3f} ms ({ms / bwd0:.2f}x p=0)")
        rows.append(dict(shape=list(shape), kind="dkdv", tiles=dataclasses.asdict(t), ms=ms,
                         p0=bwd0))
    for t in fwd:
        ms = bench(lambda: forward(q, k, v, dropped, tiles=t, interpreted=False))
        log(f"  fwd {t}: {ms:.3f} ms ({ms / fwd0:.2f}x p=0)")
        rows.append(dict(shape=list(shape), kind="fwd", tiles=dataclasses.asdict(t), ms=ms,
                         p0=fwd0))
    return rows


def main(argv=None) -> int:
    import torch

    from flashedu.benchmarks import core

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=float, default=0.1, help="the dropout rate")
    parser.add_argument("--json", default="dropout_tiles.json", help="where the record goes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return 0
    def log(line):
        print(line, flush=True)
    cases = [row for shape in SHAPES for row in sweep(shape, args.p, log)]
    env = core.environment(["scripts/gpu_dropout_tiles.py", *(argv or sys.argv[1:])])
    core.write_json(args.json, {"environment": env, "cases": cases})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
