"""Paged decoding's launch swept on a GPU: the split kernel's warps and pipeline stages and the
split count, each step timed in a CUDA graph (``flashedu bench paged``'s third measurement)
beside cuDNN on a contiguous cache, every variant of a cell in turn in one process.

A variant's launch plan is made once (``decode.SPLIT_LAUNCH`` and ``KEY_TILE`` set, the plan
caches cleared, one call) and then started directly, so that variants of one cell can alternate
round by round. Variant "rule" is the package's own plan; for each launch asked, the split
counts: ``choose_num_splits``'s, and one split (no merge launched) where the batch has at least
half as many K/V head groups as the GPU has SMs. The cells are
``flashedu bench paged``'s: H = 32, Hkv = 8, d = 128, bf16, pages scattered over the pool.

    python scripts/gpu_decode_sweep.py --json decode_sweep.json
    python scripts/gpu_decode_sweep.py --cells 32x1024 8x4096 --launches 4x2 2x3
    python scripts/gpu_decode_sweep.py --launches 2x2 --per-sm 2 4 5 6
    python scripts/gpu_decode_sweep.py --launches 2x2 2x4x32 4x2x128   # x Bc: K/V rows a step
    python scripts/gpu_decode_sweep.py --launches 2x2 2x3a --page-size 16   # a: pages ahead
    python scripts/gpu_decode_sweep.py --launches 2x2 2x3 --page-size 0   # a contiguous cache
    python scripts/gpu_decode_sweep.py --launches 2x2 --page-size 16 --in-order   # pages in order
    python scripts/gpu_decode_sweep.py --page-size 256 --set SIDE_BY_SIDE_MIN_KEYS=1024

Without a CUDA GPU it says so and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

CELLS = ("1x16384", "8x1024", "8x4096", "8x16384", "32x1024", "32x4096", "32x16384")
# num_warps x num_stages of the split kernel, and optionally x Bc (its K/V rows a step)
LAUNCHES = ("4x2", "2x2", "4x3", "2x3")
H, HKV, D = 32, 8, 128  # every cell's query heads, K/V heads and head dim (bench paged's)


def parse_launch(text: str) -> tuple:
    """({"num_warps", "num_stages", "AHEAD"}, Bc) of "WxS" or "WxSxBc" (Bc: the rule's,
    None), an "a" at the end for the pages looked up one tile ahead (``decode.PAGES_AHEAD``)."""
    ahead = text.endswith("a")
    parts = [int(x) for x in text.removesuffix("a").split("x")]
    if len(parts) not in (2, 3):
        raise ValueError(f"launch {text!r}: give warps x stages, optionally x Bc (2x3x32), "
                         "and an 'a' for the pages looked up ahead (2x3a)")
    return ({"num_warps": parts[0], "num_stages": parts[1], "AHEAD": ahead},
            (parts[2] if len(parts) == 3 else None))


@contextlib.contextmanager
def launched_as(launch, Bc):
    """Plans made inside use the split kernel's ``launch`` on tiles of Bc keys (None: the
    rule's) whatever the batch, the one- and two-an-SM rules off; ``launch`` None: the
    package's own rule, unchanged."""
    from flashedu.triton import decode

    saved = (decode.SPLIT_LAUNCH, decode.KEY_TILE, decode.DOUBLE_BUFFERED_PER_SM,
             decode.ONE_PER_SM)
    if launch is not None:
        decode.SPLIT_LAUNCH, decode.KEY_TILE = launch, Bc or decode.KEY_TILE
        decode.DOUBLE_BUFFERED_PER_SM, decode.ONE_PER_SM = None, False
    try:
        yield
    finally:
        (decode.SPLIT_LAUNCH, decode.KEY_TILE, decode.DOUBLE_BUFFERED_PER_SM,
         decode.ONE_PER_SM) = saved


def variants(B, Nk, launches, sms, per_sm=()):
    """{name: (launch, Bc, num_splits)} of one cell: "rule", the package's own plan (launch
    None); then for each launch the split count of ``choose_num_splits``, one split where the
    batch has at least half as many groups as the GPU has SMs, and the largest counts that
    give at most each of ``per_sm`` programs an SM (one wave). Each count is the one the
    launch runs (a chunk is a whole number of K/V tiles, so some asked counts run as fewer
    splits: 9 asked of 64 tiles run as 8 chunks of 8 tiles)."""
    import math

    from flashedu.triton import decode

    import torch

    heads = decode.heads_per_program(H // HKV, 1)
    groups = B * H // heads

    def splits_run(asked=None):  # the count a launch runs: chunks are whole K/V tiles
        return decode.split_plan(B, H, HKV, 1, Nk, D, torch.bfloat16, sms, False, asked)[2]
    out = {"rule": (None, None, None)}
    for text in launches:
        launch, Bc = parse_launch(text)
        with launched_as(launch, Bc):
            rule = splits_run()
            splits = [rule] + ([1] if rule > 1 and 2 * groups >= sms else [])
            for k in per_sm:
                S = splits_run(max(1, math.floor(k * sms / groups)))
                if S not in splits:
                    splits.append(S)
        tile = ("" if Bc is None else f"b{Bc}") + ("a" if launch["AHEAD"] else "")
        for S in splits:
            out[f"w{launch['num_warps']}s{launch['num_stages']}{tile}-S{S}"] = (launch, Bc, S)
    return out


def plan_for(q, cache, launch, Bc, S):
    """The launch plan of a decoding step from ``cache`` (paged: k and v pools, the block
    table, the lengths; contiguous: k and v) with the split kernel launched as ``launch`` on
    tiles of Bc keys, S splits (all None: the package's own plan)."""
    from flashedu.decode import paged_attention
    from flashedu.triton import decode, fast

    with launched_as(launch, Bc):
        decode._launch_plan.cache_clear()
        fast.PLANS.clear()
        if len(cache) == 2:
            decode.split_kv_attention(q, *cache, num_splits=S)
        else:
            paged_attention(q, *cache, num_splits=S, check_indices=False)
    (plan,) = fast.PLANS.values()
    return plan


def rule_plan(B, Nk, page, sms) -> list:
    """The rule's (heads a program, Bc, S, keys a split) for the cell: what "rule" ran."""
    import torch

    from flashedu.triton import decode

    return list(decode.split_plan(B, H, HKV, 1, Nk, D, torch.bfloat16, sms, page_size=page))


def one_cell(B, Nk, page, launches, rounds, per_sm=(), in_order=False):
    """One cell's variants and cuDNN, timed in turn; ``page`` 0: our kernels read the
    contiguous cache that cuDNN reads; ``in_order``: each sequence's pages one after another
    in the pool (else scattered at random)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashedu.benchmarks.paged import graph_copies, graph_us_in_turn, step_inputs
    from flashedu.triton import decode

    q, k, v, kc, vc, table, seqlens = step_inputs(B, Nk, page or 256, H, HKV, D, "cuda",
                                                  torch.bfloat16, in_order)
    copies = graph_copies(k, v, kc, vc, device="cuda")

    def given(c):  # one copy's arguments after q
        return (c[0], c[1]) if page == 0 else (c[2], c[3], table, seqlens)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ways = {}
    answer = None
    with torch.no_grad():
        for name, (launch, Bc, S) in variants(B, Nk, launches, sms, per_sm).items():
            plan = plan_for(q, given(copies[0]), launch, Bc, S)
            out, _ = decode._repeat(plan, (q, *given(copies[0])))
            answer = out if answer is None else answer
            error = (out.float() - answer.float()).abs().max().item()
            if not error < 2e-2:
                raise SystemExit(f"{name}: its answer differs from the first variant's by {error}")
            ways[name] = [lambda plan=plan, c=c: decode._repeat(plan, (q, *given(c)))
                          for c in copies]
        ways["cudnn"] = [lambda c=c: F.scaled_dot_product_attention(q, c[0], c[1],
                                                                    enable_gqa=True)
                         for c in copies]
        times = graph_us_in_turn(ways, rounds,
                                 {"cudnn": lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)})
    return {"B": B, "Nk": Nk, "page_size": page, "pages_in_order": in_order,
            "rule_plan": rule_plan(B, Nk, page, sms),
            "graph_us": {name: statistics.median(t) for name, t in times.items()},
            "each": times}


def rule_setting(text: str) -> tuple:
    """(name, value) of "NAME=VALUE": a setting of ``flashedu.triton.decode`` that the "rule"
    variant plans with (an int, or a float; the names its module defines in capitals)."""
    from flashedu.triton import decode

    name, _, value = text.partition("=")
    if not (name.isupper() and hasattr(decode, name)) or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=VALUE, NAME a setting of "
                                         "flashedu.triton.decode in capitals")
    try:
        return name, int(value)
    except ValueError:
        return name, float(value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", nargs="+", default=CELLS, help="BxNk, e.g. 32x1024")
    p.add_argument("--launches", nargs="+", default=LAUNCHES,
                   help="warpsxstages[xBc][a], e.g. 2x3, 2x4x32 or 2x3a (pages ahead)")
    p.add_argument("--per-sm", nargs="*", type=float, default=(),
                   help="also the split counts that give at most this many programs an SM")
    p.add_argument("--page-size", type=int, default=256,
                   help="0: a contiguous cache (the one cuDNN reads)")
    p.add_argument("--in-order", action="store_true",
                   help="each sequence's pages one after another in the pool (else at random)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--set", type=rule_setting, nargs="+", default=(), metavar="NAME=VALUE",
                   help="plan the rule variant with these settings of flashedu.triton.decode")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.in_order and args.page_size == 0:
        p.error("--in-order places pages: give a --page-size")
    import torch

    if not torch.cuda.is_available():
        print("gpu_decode_sweep.py: needs a CUDA GPU; none is visible here.", file=sys.stderr)
        return 1
    from flashedu.triton import decode

    for name, value in args.set:  # for the whole run: the launch variants turn the rules off
        setattr(decode, name, value)
    rows = []
    for cell in args.cells:
        B, Nk = (int(x) for x in cell.split("x"))
        row = one_cell(B, Nk, args.page_size, args.launches, args.rounds, args.per_sm,
                       args.in_order)
        rows.append(row)
        t = row["graph_us"]
        best = min((name for name in t if name != "cudnn"), key=t.get)
        print(f"B={B} Nk={Nk}: cuDNN {t['cudnn']:.1f} us; "
              + ", ".join(f"{name} {us:.1f}" for name, us in t.items() if name != "cudnn")
              + f"; best {best} (cuDNN / best {t['cudnn'] / t[best]:.3f})", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
