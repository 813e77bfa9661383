"""What attention dropout costs: p against p=0, forward and forward+backward, flashedu's fused
dropout beside SDPA-flash's (FlashAttention-2's CUDA dropout) in the same process.

The fused kernels drop entries of P_ij where they are made and draw the same entries again in
the backward from the saved RNG state: what dropout adds is the random numbers and the keep
test of every entry, in the forward and in each backward pass. The cost of a provider is its
time with dropout over its own time without, on the same inputs: by the calls' times (timed in
turn, ``--rounds``), and on a GPU by their kernels' time alone (torch.profiler), which is what
to read where a call is short enough for the host to set its pace.

    flashedu bench dropout --json docs/bench/dropout_cost_h200.json
    flashedu bench dropout --dry-run      # tiny sizes (no GPU: Triton's interpreter)

The shapes (B, H, N, d, causal): the two of FlashAttention-2's dropout figures at N=4096 and
the attention of GPT-2 small at T=1024 (B=8, H=12, d=64, causal).
"""

from __future__ import annotations

import sys

from . import core

SHAPES = ((4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (8, 16, 4096, 64, False),
          (8, 12, 1024, 64, True))
PROVIDERS = ("flashedu", "sdpa-flash")


def attention_fn(provider, q, k, v, causal, p):
    """A zero-argument call of ``provider``'s attention with dropout ``p``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashedu

    if provider == "flashedu":
        return lambda: flashedu.attention(q, k, v, is_causal=causal, dropout_p=p,
                                          backend="triton")

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
    return sdpa


def one_case(shape, args, device, dtype) -> dict:
    """One shape: each provider's forward and forward+backward at p=0 and at p, timed in turn
    (``core.interleaved_ms``), and on a GPU each call's kernel time alone (``core.device_us``:
    a short call's step time is the host's)."""
    import torch

    B, H, N, d, causal = shape
    g = torch.Generator(device=device).manual_seed(N + d + causal)
    q, k, v = (torch.randn(B, H, N, d, device=device, dtype=dtype, generator=g,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, N, d, device=device, dtype=dtype, generator=g)
    row = {"B": B, "H": H, "N": N, "d": d, "causal": causal, "p": args.p, "dtype": args.dtype}
    timed = {}
    for provider in args.providers:
        for p in (0.0, args.p):
            fn = attention_fn(provider, q, k, v, causal, p)

            def fwd(fn=fn):
                with torch.no_grad():
                    return fn()

            def fwd_bwd(fn=fn):
                for t in (q, k, v):  # a fresh gradient each call, not one added to the last
                    t.grad = None
                fn().backward(dout)

            tag = f"{provider}_p{p:g}"
            timed[f"{tag}_fwd"], timed[f"{tag}_fwdbwd"] = (fwd, {}), (fwd_bwd, {})
    ms, _ = core.interleaved_ms(timed, args.rounds, cpu_repeats=args.reps)
    for name, (fn, _) in timed.items():
        row[f"{name}_ms"] = ms[name]
        us = core.device_us(fn)
        if us is not None:
            row[f"{name}_gpu_us"] = us
    for provider in args.providers:
        for mode in ("fwd", "fwdbwd"):
            plain, dropped = f"{provider}_p0_{mode}", f"{provider}_p{args.p:g}_{mode}"
            row[f"{provider}_{mode}_cost"] = row[f"{dropped}_ms"] / row[f"{plain}_ms"]
            if f"{plain}_gpu_us" in row:
                row[f"{provider}_{mode}_gpu_cost"] = (row[f"{dropped}_gpu_us"]
                                                      / row[f"{plain}_gpu_us"])
    return row


def parse_args(argv):
    p = core.parser("dropout", __doc__)
    p.add_argument("--p", type=core.probability, default=0.1,
                   help="the dropout rate timed against p=0")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--rounds", type=core.positive_int, default=3,
                   help="each call timed this many times, the calls in turn (the median kept)")
    p.add_argument("--reps", type=core.positive_int, default=3,
                   help="dry run only: timed repetitions")
    p.add_argument("--json", type=core.output_file, help="write the results here")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU and Triton's interpreter at tiny sizes (flashedu only)")
    args = p.parse_args(argv)
    if args.p == 0:
        p.error("--p 0 is the baseline every case is timed against; give a rate in (0, 1)")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    shapes = SHAPES
    if args.dry_run:
        shapes, args.dtype, args.reps = [(1, 2, 64, 16, False), (1, 2, 64, 16, True)], "fp32", 1
        args.rounds = 1
        args.providers = ["flashedu"]
    device = core.bench_device(args.dry_run, "dropout")
    if device is None:
        return 1
    dtype = core.torch_dtype(args.dtype)
    out = {"environment": core.environment(["dropout", *argv]), "cases": []}
    print(core.headline(out["environment"]), flush=True)
    head = ["B", "H", "N", "d", "causal"]
    for provider in args.providers:
        head += [f"{provider} fwd cost", "fwd+bwd cost", "fwd+bwd ms p=0", f"p={args.p:g}",
                 "GPU: fwd cost", "fwd+bwd cost"]
    lines = []
    for shape in shapes:
        row = one_case(shape, args, device, dtype)
        out["cases"].append(row)
        line = list(shape)
        for provider in args.providers:
            line += [f"{row[f'{provider}_fwd_cost']:.2f}x",
                     f"{row[f'{provider}_fwdbwd_cost']:.2f}x",
                     f"{row[f'{provider}_p0_fwdbwd_ms']:.3f}",
                     f"{row[f'{provider}_p{args.p:g}_fwdbwd_ms']:.3f}",
                     *(f"{row[key]:.2f}x" if key in row else "-"
                       for key in (f"{provider}_fwd_gpu_cost", f"{provider}_fwdbwd_gpu_cost"))]
        lines.append(line)
        print(" | ".join(str(x) for x in line), flush=True)
    print(core.format_table(head, lines))
    if args.json:
        core.write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0
