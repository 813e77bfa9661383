"""Split-KV decoding against the plain Triton kernel: batch 1, a few queries, a long K/V cache.

One decoding step reads the whole cache once: the time is bounded by HBM bandwidth, so the table
shows GB/s of K/V read (an H100 SXM peaks near 3350). The plain kernel (flashedu.attention,
backend="triton") runs B * H programs for Nq = 1, far fewer than the GPU's SMs; split-KV
(flashedu.triton.decode) gives each program a chunk of the keys and merges.

    flashedu bench decode --json docs/bench/decode.json
    flashedu bench decode --dry-run        # tiny sizes (the CPU and Triton's interpreter
                                           # where there is no GPU)
"""

from __future__ import annotations

import sys

from . import core

DTYPES = ("bf16", "fp16", "fp32")


def one_case(Nk, args, device, dtype) -> dict:
    import torch

    import flashedu
    from flashedu import runtime, tolerance
    from flashedu.reference import reference_attention
    from flashedu.triton.decode import sm_count, split_kv_attention, split_plan

    H, Hkv, Nq, d = args.heads, args.kv_heads, args.nq, args.d
    g = torch.Generator(device=device).manual_seed(Nk)
    q = torch.randn(1, H, Nq, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, Hkv, Nk, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, Hkv, Nk, d, device=device, dtype=dtype, generator=g)
    row = {"Nk": Nk, "B": 1, "H": H, "Hkv": Hkv, "Nq": Nq, "d": d, "dtype": args.dtype}
    with torch.no_grad():
        plain = lambda: flashedu.attention(q, k, v, enable_gqa=True, backend="triton")  # noqa: E731
        split = lambda: split_kv_attention(q, k, v, num_splits=args.num_splits)  # noqa: E731
        ref = reference_attention(q, k, v, enable_gqa=True)
        # the plain kernel is the baseline: split-KV may miss by 2x its error (+ 2 floors)
        row["max_err_split"] = tolerance.max_error(split(), ref)
        row["max_err_plain"] = tolerance.max_error(plain(), ref)
        limit = tolerance.allowed_error(dtype, row["max_err_plain"], floor_scale=2.0)
        del ref
        if row["max_err_split"] > limit:
            row["error"] = (f"split-KV error {row['max_err_split']:.3g} > {limit:.3g} "
                            f"(plain {row['max_err_plain']:.3g})")
        row["plain_ms"] = core.time_ms(plain, cpu_repeats=args.reps)
        row["split_ms"] = core.time_ms(split, cpu_repeats=args.reps)
    interp = runtime.triton_interpreted()
    row["num_splits"] = split_plan(1, H, Hkv, Nq, Nk, d, dtype, sm_count(q.device, interp),
                                   interp, args.num_splits)[2]
    kv_bytes = 2 * k.numel() * k.element_size()
    row["speedup"] = row["plain_ms"] / row["split_ms"]
    row["plain_GBps"] = kv_bytes / row["plain_ms"] / 1e6
    row["split_GBps"] = kv_bytes / row["split_ms"] / 1e6
    return row


def parse_args(argv):
    p = core.parser("decode", __doc__)
    p.add_argument("--nk", type=core.positive_int, nargs="+",
                   default=[4096, 8192, 16384, 32768, 65536, 131072], help="K/V cache lengths")
    p.add_argument("--heads", type=core.positive_int, default=32)
    p.add_argument("--kv-heads", type=core.positive_int, default=8)
    p.add_argument("--nq", type=core.positive_int, default=1)
    p.add_argument("--d", type=core.head_dim, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--num-splits", type=core.positive_int, default=None,
                   help="default: the heuristic")
    p.add_argument("--reps", type=core.positive_int, default=5,
                   help="dry run only: timed repetitions")
    p.add_argument("--json", type=core.output_file, help="write the results here")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU and Triton's interpreter with tiny sizes: checks this benchmark")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        args.nk = [n for n in args.nk if n <= 256] or [64, 256]
        args.heads, args.kv_heads, args.d, args.dtype, args.reps = 4, 2, 32, "fp32", 2
    device = core.bench_device(args.dry_run, "decode")
    if device is None:
        return 1
    import torch

    dtype = core.torch_dtype(args.dtype)
    out = {"environment": core.environment(["decode", *argv]), "cases": []}
    print(core.headline(out["environment"]), flush=True)
    head = ["Nk", "plain ms", "split ms", "speedup", "splits", "plain GB/s", "split GB/s", "err"]
    lines = []
    for Nk in args.nk:
        try:
            row = one_case(Nk, args, device, dtype)
        except torch.cuda.OutOfMemoryError as e:
            row = {"Nk": Nk, "error": f"out of memory: {str(e).splitlines()[0]}"}
            torch.cuda.empty_cache()
        out["cases"].append(row)
        if "plain_ms" in row:
            lines.append([Nk, f"{row['plain_ms']:.4f}", f"{row['split_ms']:.4f}",
                          f"{row['speedup']:.2f}x", row["num_splits"],
                          f"{row['plain_GBps']:.0f}", f"{row['split_GBps']:.0f}",
                          f"{row['max_err_split']:.1e}"])
        if "error" in row:
            print(f"Nk={Nk} ERROR: {row['error']}", flush=True)
    print(core.format_table(head, lines))
    if args.json:
        core.write_json(args.json, out)
        print(f"wrote {args.json}")
    return 1 if any("error" in r for r in out["cases"]) else 0
