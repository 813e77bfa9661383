"""Split-KV decoding against the plain Triton kernel: batch 1, a few queries, a long K/V cache.

One decoding step reads the whole cache once: the time is bounded by HBM bandwidth, so the table
shows GB/s of K/V read (an H100 SXM peaks near 3350). The plain kernel (flashedu.attention,
backend="triton") runs B * H programs for Nq = 1, far fewer than the GPU's SMs; split-KV
(flashedu.triton.decode) gives each program a chunk of the keys and merges.

    PYTHONPATH=$PWD python3 scripts/gpu_decode.py --json docs/bench/decode.json
    PYTHONPATH=$PWD python3 scripts/gpu_decode.py --dry-run        # CPU interpreter, tiny sizes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

import flashedu
from flashedu.reference import reference_attention
from flashedu.runtime import git_commit
from flashedu.triton.decode import split_kv_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_ms(fn, dry_run: bool, reps: int) -> float:
    """Median milliseconds of fn(): triton's do_bench on the GPU, a wall clock in a dry run."""
    if dry_run:
        fn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return sorted(samples)[len(samples) // 2]
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def one_case(Nk, args, device, dtype):
    H, Hkv, Nq, d = args.heads, args.kv_heads, args.nq, args.d
    g = torch.Generator(device=device).manual_seed(Nk)
    q = torch.randn(1, H, Nq, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, Hkv, Nk, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, Hkv, Nk, d, device=device, dtype=dtype, generator=g)
    row = {"Nk": Nk, "B": 1, "H": H, "Hkv": Hkv, "Nq": Nq, "d": d, "dtype": args.dtype}
    with torch.no_grad():
        plain = lambda: flashedu.attention(q, k, v, enable_gqa=True, backend="triton")
        split = lambda: split_kv_attention(q, k, v, num_splits=args.num_splits)
        ref = reference_attention(q, k, v, enable_gqa=True)
        err_plain = (plain().double() - ref).abs().max().item()
        err_split = (split().double() - ref).abs().max().item()
        del ref
        row["max_err_plain"], row["max_err_split"] = err_plain, err_split
        if err_split > 2 * err_plain + 2e-2:
            row["error"] = f"split-KV error {err_split:.3g} vs plain {err_plain:.3g}"
        row["plain_ms"] = time_ms(plain, args.dry_run, args.reps)
        row["split_ms"] = time_ms(split, args.dry_run, args.reps)
    from flashedu import runtime
    from flashedu.triton.decode import sm_count, split_plan

    interp = runtime.triton_interpreted()
    row["num_splits"] = split_plan(1, H, Hkv, Nq, Nk, d, dtype, sm_count(q.device, interp),
                                   interp, args.num_splits)[2]
    kv_bytes = 2 * k.numel() * k.element_size()
    row["speedup"] = row["plain_ms"] / row["split_ms"]
    row["plain_GBps"] = kv_bytes / row["plain_ms"] / 1e6
    row["split_GBps"] = kv_bytes / row["split_ms"] / 1e6
    return row


def environment(device):
    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__,
           "command": " ".join(sys.argv)}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"unavailable: {e}"
    env["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    env["commit"] = git_commit(short=False)
    return env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nk", type=int, nargs="+",
                    default=[4096, 8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--nq", type=int, default=1)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--num-splits", type=int, default=None, help="default: the heuristic")
    ap.add_argument("--reps", type=int, default=5, help="dry run only: timed repetitions")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU and Triton's interpreter with tiny sizes: checks this script")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.nk = [n for n in args.nk if n <= 256] or [64, 256]
        args.heads, args.kv_heads, args.d, args.dtype, args.reps = 4, 2, 32, "fp32", 2
        device = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("gpu_decode.py needs a CUDA GPU (or --dry-run for a CPU check of the script)")
    else:
        device = "cuda"
    dtype = DTYPES[args.dtype]
    out = {"environment": environment(device), "cases": []}
    print(json.dumps(out["environment"]), flush=True)
    print(f"{'Nk':>7} {'plain ms':>9} {'split ms':>9} {'speedup':>8} {'splits':>6} "
          f"{'plain GB/s':>10} {'split GB/s':>10} {'err':>8}", flush=True)
    failed = False
    for Nk in args.nk:
        try:
            row = one_case(Nk, args, device, dtype)
        except torch.cuda.OutOfMemoryError as e:
            row = {"Nk": Nk, "error": f"out of memory: {str(e).splitlines()[0]}"}
            torch.cuda.empty_cache()
        out["cases"].append(row)
        if "plain_ms" in row:
            print(f"{Nk:>7} {row['plain_ms']:>9.4f} {row['split_ms']:>9.4f} "
                  f"{row['speedup']:>7.2f}x {row['num_splits']:>6} {row['plain_GBps']:>10.0f} "
                  f"{row['split_GBps']:>10.0f} {row['max_err_split']:>8.1e}", flush=True)
        if "error" in row:
            failed = True
            print(f"{Nk:>7} ERROR: {row['error']}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
