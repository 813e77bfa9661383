"""FlashAttention-3's schedule on Hopper (``flashedu/triton/fa3.py``): the forward's TFLOP/s
with the tile table's settings, with each of the schedule's ideas turned off in turn, beside
the Triton kernel of ``forward.py``, SDPA's cuDNN and FlashAttention-2 backends and
FlexAttention, in one process; the backward (flashedu's: FlashAttention-3's of
``fa3_backward.py`` where the tile table asks for it; the Triton kernels'; cuDNN's) beside
them, and a bf16 matrix product for the card's measured peak (timed once before the cases,
and in every case's rounds beside the kernels: "fwd / matmul").

    flashedu bench fa3 --json docs/bench/fa3_h200.json

The shapes: N = 4096, 8192, 16384 at d = 64 and 128, causal or not, with B * N = 16384
tokens and H * d = 2048 (``core.batch_heads``), bf16. Needs an sm_90 GPU (H100, H200) and the
Triton whose Gluon API the kernel is written against. It turns the kernels on in its own
process even where FLASHEDU_FA3=0 is set.
"""

from __future__ import annotations

import os
import sys

from . import core

NS = (4096, 8192, 16384)
DS = (64, 128)
# the schedule's ideas, each turned off (or flipped) alone: (label, settings over the table's,
# None where the idea does not apply)
ABLATIONS = (("ping-pong flipped", lambda s, causal: {"PINGPONG": not s["PINGPONG"]}),
             ("no overlap", lambda s, causal: {"OVERLAP": False}),
             ("2 stages", lambda s, causal: {"STAGES": 2} if s["STAGES"] != 2 else None),
             ("shortest first", lambda s, causal: {"LONGEST_FIRST": False} if causal else None),
             # longest first one head at a time, not heads in groups (fa3._in_groups)
             ("one head at a time", lambda s, causal: ({"HEADS_TOGETHER": 1}
                                                       if causal and not s["PERSISTENT"]
                                                       else None)),
             # three consumers of 160 registers against two of 240 (d = 64)
             ("2 consumers", lambda s, causal: ({"CONSUMERS": 2, "CONSUMER_REGS": 240}
                                                if s["CONSUMERS"] == 3 else None)),
             ("persistent flipped", lambda s, causal: {"PERSISTENT": not s["PERSISTENT"]}),
             # O_i through shared memory and the copy engine, or from registers
             ("store flipped", lambda s, causal: {"TMA_STORE": not s["TMA_STORE"]}),
             # a persistent program's next Q tile loaded during this one, or after it
             ("Q buffers flipped", lambda s, causal: ({"Q_BUFFERS": 3 - s["Q_BUFFERS"]}
                                                      if s["PERSISTENT"] else None)),
             # causal persistent programs dealt their Q tiles in a snake, or by the host's plan
             ("plan flipped", lambda s, causal: ({"PLANNED": not s["PLANNED"]}
                                                 if causal and s["PERSISTENT"] else None)),
             # a control: the table's settings again, timed after the columns above (in rounds
             # turned around, before them); its gap to "fa3" is what a column's place in the
             # order alone moves a reading (the first column has read 2-6% low)
             ("fa3 again", lambda s, causal: {}))
PEERS = ("triton", "sdpa-cudnn", "sdpa-flash", "flex")


def forward_fns(q, k, v, causal, settings) -> dict:
    """{label: zero-argument forward}: fa3 with the table's settings and each ablation, the
    Triton kernel, and the peers."""
    import torch

    from ..ops import Call
    from ..triton import fa3, launch
    from ..triton.autograd import resolve_config
    from .peers import Case, make_forward

    B, H, N, d = q.shape
    scale = d ** -0.5
    o = torch.empty_like(q)
    lse2 = torch.empty(B, H, N, dtype=torch.float32, device=q.device)

    def fa3_fn(extra):
        return lambda: fa3.forward(q, k, v, o, lse2, is_causal=causal, scale=scale,
                                   **{**settings, **extra})

    fns = {"fa3": fa3_fn({})}
    for label, change in ABLATIONS:
        extra = change(settings, causal)
        if extra is not None and fa3.shared_bytes(d, **_memory({**settings, **extra})) <= (
                fa3.SHARED_MEMORY):
            fns[label] = fa3_fn(extra)
    tiles = resolve_config(d, q.dtype, None, q.device).forward_tiles(None, N)
    call = Call(causal, scale)
    fns["triton"] = lambda: launch.forward(q, k, v, call, tiles=tiles)
    case = Case(n=N, d=d, causal=causal, mode="fwd", density=None, dtype="bf16")
    for provider in PEERS[1:]:
        fns[provider] = make_forward(provider, case, q, k, v)
    return fns


def backward_fns(q, k, v, causal) -> dict:
    """{label: zero-argument backward}: flashedu's (the public API: the tile table's choice,
    FlashAttention-3's backward of fa3_backward.py on sm_90 from 4096 keys), the Triton
    kernels' backward of the same call (the table's schedule turned off), and cuDNN's, each
    from its own saved forward."""
    import dataclasses

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashedu

    from ..ops import Call
    from ..triton import launch
    from ..triton.autograd import resolve_config

    dout = torch.randn_like(q)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashedu.attention(*inputs, is_causal=causal, backend="triton")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out_cudnn = F.scaled_dot_product_attention(*inputs, is_causal=causal)
    fns = {name: (lambda o=o: torch.autograd.grad(o, inputs, dout, retain_graph=True))
           for name, o in (("flashedu bwd", out), ("sdpa-cudnn bwd", out_cudnn))}
    call = Call(causal, q.shape[-1] ** -0.5)
    config = dataclasses.replace(resolve_config(q.shape[-1], q.dtype, None, q.device),
                                 backward_schedule=None)
    o, lse2 = launch.forward(q, k, v, call)
    fns["triton bwd"] = lambda: launch.backward(q, k, v, o, lse2, dout, call, config=config)
    return fns


MATMUL = 8192  # the matrix product's side
MATMUL_FLOPS = 2 * MATMUL ** 3


def matmul_fn():
    """A zero-argument bf16 MATMUL^3 matrix product (cuBLAS): the card's attainable peak."""
    import torch

    a, b = (torch.randn(MATMUL, MATMUL, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return lambda: a @ b


def matmul_peak(matmul) -> float:
    """TFLOP/s of the matrix product (``matmul_fn``'s) timed once, before the cases."""
    return core.tflops(MATMUL_FLOPS, core.time_ms(matmul))


def case_tflops(ms: dict, fwd_flops: float, bwd_flops: float) -> dict:
    """{label: TFLOP/s} of a case's timings: "matmul" by the product's FLOPs, a label ending in
    "bwd" by the backward's, the rest by the forward's."""
    def flops(name):
        if name == "matmul":
            return MATMUL_FLOPS
        return bwd_flops if name.endswith("bwd") else fwd_flops

    return {name: core.tflops(flops(name), t) for name, t in ms.items()}


def one_case(N, d, causal, settings, rounds, matmul) -> dict:
    """One shape's columns timed in turn, ``matmul`` (``matmul_fn``) among them: the card's peak
    read in the same rounds as the kernels, at their clocks and heat. Timed once before the
    cases, it read 694-805 TFLOP/s on H200s, a wider spread than the kernels'."""
    import torch

    B, H = core.batch_heads(N, d)
    g = torch.Generator(device="cuda").manual_seed(N + d + causal)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    fwd = forward_fns(q, k, v, causal, settings)
    bwd = backward_fns(q, k, v, causal)
    timed = {name: (fn, {}) for name, fn in {**fwd, **bwd, "matmul": matmul}.items()}
    ms, _ = core.interleaved_ms(timed, rounds)
    row = {"B": B, "H": H, "N": N, "d": d, "causal": causal, "settings": settings, "ms": ms}
    row["tflops"] = case_tflops(
        ms, core.attention_flops(B, H, N, N, d, causal=causal, mode="fwd"),
        core.attention_flops(B, H, N, N, d, causal=causal, mode="bwd"))
    return row


# the table's columns after the forward's
TAIL = ("fwd / cuDNN", "bwd flashedu", "bwd cuDNN", "bwd / cuDNN", "bwd Triton kernels",
        "matmul", "fwd / matmul")


def table_line(row: dict, names) -> list:
    """A case's line of the printed table: d, N, causal, the forward's columns ``names`` ("-"
    where a column did not run), then TAIL's."""
    t = row["tflops"]
    return [row["d"], row["N"], row["causal"],
            *(f"{t[n]:.0f}" if n in t else "-" for n in names),
            f"{t['fa3'] / t['sdpa-cudnn']:.2f}", f"{t['flashedu bwd']:.0f}",
            f"{t['sdpa-cudnn bwd']:.0f}", f"{t['flashedu bwd'] / t['sdpa-cudnn bwd']:.2f}",
            f"{t['triton bwd']:.0f}", f"{t['matmul']:.0f}", f"{t['fa3'] / t['matmul']:.3f}"]


def parse_args(argv):
    p = core.parser("fa3", __doc__)
    p.add_argument("--n", type=core.positive_int, nargs="+", default=list(NS))
    p.add_argument("--d", type=int, nargs="+", choices=DS, default=list(DS))
    p.add_argument("--rounds", type=core.positive_int, default=3,
                   help="each call timed this many times, the calls in turn (the median kept)")
    p.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE", type=_setting,
                   help="change the tile table's settings for every case, e.g. STAGES=2 "
                        "CONSUMERS=2 CONSUMER_REGS=240 PINGPONG=0")
    p.add_argument("--json", type=core.output_file, help="write the results here")
    return p.parse_args(argv)


SETTINGS = ("CONSUMERS", "STAGES", "CONSUMER_REGS", "Q_BUFFERS", "HEADS_TOGETHER", "PINGPONG",
            "OVERLAP", "LONGEST_FIRST", "PERSISTENT", "TMA_STORE", "PLANNED")


def _memory(settings: dict) -> dict:
    """The settings that size the forward's shared memory (``fa3.shared_bytes``)."""
    return {name: settings[name] for name in ("CONSUMERS", "STAGES", "Q_BUFFERS")}


def _setting(text: str) -> tuple:
    """NAME=VALUE of --set: a name of fa3.forward's settings and an integer (0/1 for the
    switches)."""
    import argparse

    name, _, value = text.partition("=")
    if name not in SETTINGS or not value.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=INTEGER with NAME one of "
                                         f"{', '.join(SETTINGS)}, got {text!r}")
    number = int(value)
    return name, bool(number) if name in SETTINGS[5:] else number


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if core.bench_device(False, "fa3") is None:
        return 1
    import torch

    from ..ops import Call
    from ..triton import fa3
    from ..triton.autograd import resolve_config

    os.environ[fa3.SWITCH_ENV] = "1"  # what this measures (the table's backward included)
    probe = torch.empty(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16)
    if not fa3.usable(probe, probe, probe, Call(False, 1.0)):
        print("flashedu bench fa3: the kernel needs an sm_90 GPU and Triton "
              f"{' or '.join(fa3.TESTED_TRITON)}; this is compute capability "
              f"{torch.cuda.get_device_capability()} with Triton {fa3.triton.__version__}",
              file=sys.stderr)
        return 1
    matmul = matmul_fn()
    out = {"environment": core.environment(["fa3", *argv]), "matmul_tflops": matmul_peak(matmul),
           "cases": []}
    print(core.headline(out["environment"]), flush=True)
    print(f"bf16 matmul 8192^3: {out['matmul_tflops']:.0f} TFLOP/s", flush=True)
    names = ["fa3", *(label for label, _ in ABLATIONS), *PEERS]  # the forward's columns
    head = ["d", "N", "causal", *names, *TAIL]
    lines = []
    for d in args.d:
        schedule = resolve_config(d, torch.bfloat16, None, "cuda").schedule
        for N in args.n:
            for causal in (False, True):
                settings = {**schedule.settings(causal), **dict(args.set)}
                row = one_case(N, d, causal, settings, args.rounds, matmul)
                out["cases"].append(row)
                line = table_line(row, names)
                lines.append(line)
                print(" | ".join(str(x) for x in line), flush=True)
    print("TFLOP/s (forward: 4 B H N^2 d, causal half; backward 2.5x that)")
    print(core.format_table(head, lines))
    if args.json:
        core.write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0
