"""Time candidate tile configs of each Triton kernel on a GPU and print the fastest per head dim.

The winners go into flashedu/triton/config.py by hand (one reviewed table beats an autotuner
that silently changes between machines). Shapes as ``flashedu bench``: B * N = 16384, H * d = 2048.

    flashedu bench tune --n 8192 --d 64 128
    flashedu bench tune --n 4096 --d 64 128 --dropout 0.1   # the dropout entries
"""

from __future__ import annotations

import dataclasses
import json
import sys

from flashedu.triton.config import Tiles

from . import core

FWD = [Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 3), Tiles(128, 128, 8, 3), Tiles(128, 128, 8, 2),
       Tiles(128, 64, 8, 4), Tiles(64, 64, 4, 3), Tiles(128, 32, 4, 3)]
DKDV = [Tiles(32, 128, 4, 3), Tiles(64, 128, 8, 3), Tiles(64, 128, 4, 2), Tiles(32, 128, 8, 3),
        Tiles(64, 64, 4, 3), Tiles(16, 128, 4, 3)]
DQ = [Tiles(128, 32, 4, 3), Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 3), Tiles(128, 32, 8, 3),
      Tiles(64, 32, 4, 3)]

# Each 8-warp candidate also with its registers capped at 128, which lets two programs share an
# SM (the d<=64 entries of the table carry the cap: BENCHMARKS.md, "Registers").
FWD, DKDV, DQ = ([*c, *(dataclasses.replace(t, maxnreg=128) for t in c if t.num_warps == 8)]
                 for c in (FWD, DKDV, DQ))


def bench(fn) -> float:
    return core.try_time_ms(fn, warmup=10, rep=40)


def tune(n, d, causal, log, dropout_p=0.0):
    from flashedu.dropout import draw_rng
    from flashedu.ops import Call
    from flashedu.triton.config import kernel_config
    from flashedu.triton.launch import backward, forward

    q, k, v, do = core.standard_inputs(n, d)
    scale = d ** -0.5
    call = Call(causal, scale, dropout_p=dropout_p,
                rng=draw_rng(q.device) if dropout_p else None)
    # the entry such a call takes, without the entries it would hand over to (causal,
    # dropout, short): each candidate then replaces its tiles in what is launched
    base = dataclasses.replace(
        kernel_config(d, False, False).backward_entry(causal, dropout_p > 0, None, n),
        causal_backward=None, dropout_backward=None, short=None)
    fl = core.flops(n, d, causal)
    best = {}
    times = {}
    for t in FWD:
        times[t] = bench(lambda: forward(q, k, v, call, tiles=t, interpreted=False))
    best["forward"] = min(times, key=times.get)
    log(f"d={d} causal={causal} forward: " + ", ".join(
        f"{t.Br}x{t.Bc}/w{t.num_warps}/s{t.num_stages} {fl / times[t] / 1e9:.0f}TF"
        for t in FWD))
    o, lse2 = forward(q, k, v, call, tiles=best["forward"], interpreted=False)
    for name, cands in (("dkdv", DKDV), ("dq", DQ)):
        times = {}
        for t in cands:
            chosen = {"dkdv": best["dkdv"]} if "dkdv" in best else {}
            cfg = dataclasses.replace(base, **{**chosen, name: t})
            times[t] = bench(lambda: backward(q, k, v, o, lse2, do, call, config=cfg,
                                              interpreted=False))
        best[name] = min(times, key=times.get)
        log(f"d={d} causal={causal} bwd varying {name}: " + ", ".join(
            f"{t.Br}x{t.Bc}/w{t.num_warps}/s{t.num_stages} {2.5 * fl / times[t] / 1e9:.0f}TF"
            for t in cands))
    return {k: dataclasses.asdict(v) for k, v in best.items()}


def parse_args(argv):
    p = core.parser("tune", __doc__)
    p.add_argument("--n", type=core.positive_int, default=8192, help="sequence length")
    p.add_argument("--d", type=core.head_dim, nargs="+", default=[64, 128], help="head dims")
    p.add_argument("--causal", type=core.boolean, nargs="+", default=[False, True],
                   help="causal values to tune (true/false, 1/0)")
    p.add_argument("--dropout", type=core.probability, default=0.0,
                   help="tune calls with this dropout rate (the table's dropout entries)")
    p.add_argument("--json", type=core.output_file, default=None, help="write the winners here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not core.gpu_available():
        return core.needs_gpu("flashedu bench tune")
    out = {}
    for d in args.d:
        for causal in args.causal:
            out[f"d={d} causal={causal}"] = tune(args.n, d, causal,
                                                 lambda s: print(s, flush=True), args.dropout)
    print(json.dumps(out, indent=1))
    if args.json:
        core.write_json(args.json, {**core.environment(["tune", *argv]), "best": out})
    return 0
