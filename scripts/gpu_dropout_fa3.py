"""Dropout in FlashAttention-3's schedule on an sm_90 GPU: what p = 0.1 costs the forward and
the backward against p = 0, under the tile table's choice and under other schedules of the fa3
forward, beside the Triton kernels with dropout (the kernels alone, ``triton.testing.do_bench``
medians in microseconds, each shape's calls timed in one process).

    python scripts/gpu_dropout_fa3.py                       # prints the table
    python scripts/gpu_dropout_fa3.py --json out/drop_fa3.json

The schedules are those the table could give a dropout call: the p = 0 schedule at d = 64 (three
consumers of 160 registers, persistent), two consumers of 240 registers with or without
ping-pong, persistent or a program per Q tile. Also the fa3 backward with dropout's select
flipped (``BackwardSchedule.select_once``: P_ij selected once in float32, or P_ij in 16 bits
and dP_ij in float32). Without an sm_90 GPU and Triton 3.6 it says so and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import flashedu  # noqa: F401  (before triton)

SHAPES = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (8, 16, 4096, 64, False),
          (8, 16, 4096, 64, True), (8, 12, 2048, 64, True)]
SCHEDULES = {
    "c3 r160 persistent": dict(CONSUMERS=3, STAGES=3, CONSUMER_REGS=160, PERSISTENT=True),
    "c2 r240 persistent": dict(CONSUMERS=2, STAGES=3, CONSUMER_REGS=240, PINGPONG=False,
                               PERSISTENT=True),
    "c2 r240 pingpong persistent": dict(CONSUMERS=2, STAGES=3, CONSUMER_REGS=240,
                                        PERSISTENT=True),
    "c2 r240": dict(CONSUMERS=2, STAGES=3, CONSUMER_REGS=240, PINGPONG=False),
}


def one_shape(B, H, N, d, causal, p) -> dict:
    """Microseconds of each forward and backward of one shape."""
    import torch
    from triton.testing import do_bench

    from flashedu.dropout import draw_rng
    from flashedu.ops import Call
    from flashedu.triton import fa3, launch
    from flashedu.triton.config import GPU_16BIT

    g = torch.Generator(device="cuda").manual_seed(N + d)
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    scale = d ** -0.5
    plain, dropped = Call(causal, scale), Call(causal, scale, dropout_p=p,
                                               rng=draw_rng(q.device))
    entry = GPU_16BIT[d]
    triton_only = dataclasses.replace(entry, schedule=None, dropout_schedule=None,
                                      backward_schedule=None)
    us = {}

    def timed(name, fn):
        fn()
        us[name] = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3

    for tag, call in (("p0", plain), ("p", dropped)):
        timed(f"fwd {tag} table", lambda call=call: launch.forward(q, k, v, call,
                                                                    interpreted=False))
        o, lse2 = launch.forward(q, k, v, call, interpreted=False)
        timed(f"bwd {tag} table", lambda call=call, o=o, lse2=lse2: launch.backward(
            q, k, v, o, lse2, do, call, interpreted=False))
    tiles = entry.forward_tiles(None, N, True)
    timed("fwd p triton", lambda: launch.forward(q, k, v, dropped, tiles=tiles,
                                                 interpreted=False))
    o, lse2 = launch.forward(q, k, v, dropped, interpreted=False)
    timed("bwd p triton", lambda: launch.backward(q, k, v, o, lse2, do, dropped,
                                                  config=triton_only, interpreted=False))
    if entry.backward_schedule is not None:  # the fa3 backward with the mask's select flipped
        schedule = entry.backward_schedule
        flipped = dataclasses.replace(entry, backward_schedule=dataclasses.replace(
            schedule, select_once=not schedule.select_once))
        label = "bwd p select " + ("twice" if schedule.select_once else "once")
        timed(label, lambda: launch.backward(
            q, k, v, o, lse2, do, dropped, config=flipped, interpreted=False))
    o, lse2 = torch.empty_like(q), torch.empty(B, H, N, device="cuda")
    for name, settings in SCHEDULES.items():
        if d == 128 and settings["CONSUMERS"] == 3:
            continue  # three consumers of d=128 do not fit the registers
        timed(f"fwd p {name}", lambda settings=settings: fa3.forward(
            q, k, v, o, lse2, is_causal=causal, scale=scale, dropout_p=p, rng=dropped.rng,
            **settings))
    return us


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    import torch

    from flashedu.triton import fa3

    probe = torch.empty(1, 1, 1, 64, device="cuda" if torch.cuda.is_available() else "cpu",
                        dtype=torch.bfloat16)
    from flashedu.ops import Call

    if not fa3.usable(probe, probe, probe, Call(False, 1.0)):
        print(f"no fa3 here ({fa3.status()}): nothing to time")
        return 0
    rows = []
    for B, H, N, d, causal in SHAPES:
        us = one_shape(B, H, N, d, causal, args.p)
        rows.append({"B": B, "H": H, "N": N, "d": d, "causal": causal, "p": args.p, "us": us})
        base = us["fwd p0 table"] + us["bwd p0 table"]
        print(f"B{B} H{H} N{N} d{d}{' causal' if causal else ''}: p=0 forward "
              f"{us['fwd p0 table']:.0f}, backward {us['bwd p0 table']:.0f} us; p={args.p}: "
              f"table {us['fwd p table']:.0f} + {us['bwd p table']:.0f} "
              f"({(us['fwd p table'] + us['bwd p table']) / base:.2f}x), Triton kernels "
              f"{us['fwd p triton']:.0f} + {us['bwd p triton']:.0f} "
              f"({(us['fwd p triton'] + us['bwd p triton']) / base:.2f}x)")
        for times in ("once", "twice"):
            if f"bwd p select {times}" in us:
                print(f"    fa3 backward with the mask's select flipped (P_ij selected "
                      f"{times}): {us[f'bwd p select {times}']:.0f}")
        print("    fa3 forward with dropout: " + ", ".join(
            f"{name} {us[f'fwd p {name}']:.0f}" for name in SCHEDULES
            if f"fwd p {name}" in us), flush=True)
    if args.json:
        from flashedu.benchmarks import core

        env = core.environment(" ".join(["python", "scripts/gpu_dropout_fa3.py", *sys.argv[1:]]))
        core.write_json(args.json, {"env": env, "rows": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
