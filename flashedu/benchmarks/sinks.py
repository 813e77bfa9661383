"""Attention sinks against none: what the sink costs the triton backend, forward and backward.

A sink is one more term of each row's softmax denominator: the forward starts its online
softmax from it (m_i = sink, l_i = 1) instead of from nothing, and the backward adds one
reduction for the sinks' gradient, -sum_i P_i,sink (D_i - dlse_i). Each case times the same
inputs with and without sinks, in turn over ``--rounds`` rounds (the medians are reported),
and checks the output with sinks against the merge rule applied to the output without them:
O_sink = O * exp(L - L_sink), L_sink = logaddexp(L, sink).

    flashedu bench sinks --json docs/bench/sinks_h100.json
    flashedu bench sinks --dry-run      # tiny sizes (no GPU: Triton's interpreter)
"""

from __future__ import annotations

import sys

from . import core

DTYPES = ("bf16", "fp16", "fp32")


def inputs(N, d, causal, args, device, dtype):
    import torch

    B, H = (1, 2) if args.dry_run else core.batch_heads(N, d)
    g = torch.Generator(device=device).manual_seed(N + d + causal)
    q, k, v = (torch.randn(B, H, N, d, device=device, dtype=dtype, generator=g,
                           requires_grad=True) for _ in range(3))
    sinks = torch.randn(H, device=device, generator=g).requires_grad_()
    return q, k, v, sinks


def merge_error(q, k, v, sinks, causal) -> float:
    """Largest gap between the output with sinks and the merge rule on the output without."""
    import torch

    import flashedu

    with torch.no_grad():
        out, L = flashedu.attention(q, k, v, is_causal=causal, return_lse=True, backend="triton")
        got = flashedu.attention(q, k, v, is_causal=causal, sinks=sinks, backend="triton")
        L_sink = torch.logaddexp(L, sinks.view(1, -1, 1))
        want = out.double() * torch.exp(L - L_sink).double()[..., None]
    return (got.double() - want).abs().max().item()


def one_case(N, d, causal, args, device, dtype) -> dict:
    import torch

    import flashedu

    q, k, v, sinks = inputs(N, d, causal, args, device, dtype)
    row = {"N": N, "d": d, "causal": causal, "B": q.shape[0], "H": q.shape[1],
           "dtype": args.dtype, "max_diff": merge_error(q, k, v, sinks, causal)}
    dout = q.detach().clone().normal_()
    forward, forward_backward = {}, {}
    for name, extra in (("none", {}), ("sinks", {"sinks": sinks})):
        def call(extra=extra):
            return flashedu.attention(q, k, v, is_causal=causal, backend="triton", **extra)

        def no_grad(call=call):
            with torch.no_grad():
                call()

        def step(call=call):
            call().backward(dout)

        forward[name] = (no_grad, {})
        forward_backward[name] = (step, {"grad_to_none": [q, k, v, sinks]})
    for mode, timed in (("fwd", forward), ("fwdbwd", forward_backward)):
        ms, rounds = core.interleaved_ms(timed, args.rounds, cpu_repeats=args.reps)
        for name in timed:
            row[f"{name}_{mode}_ms"] = ms[name]
            row[f"{name}_{mode}_rounds"] = rounds[name]
    row["fwd_cost"] = row["sinks_fwd_ms"] / row["none_fwd_ms"]
    row["fwdbwd_cost"] = row["sinks_fwdbwd_ms"] / row["none_fwdbwd_ms"]
    return row


def parse_args(argv):
    p = core.parser("sinks", __doc__)
    p.add_argument("--n", type=core.positive_int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--d", type=core.head_dim, nargs="+", default=[64, 128])
    p.add_argument("--causal", type=core.boolean, nargs="+", default=[False, True])
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--reps", type=core.positive_int, default=3,
                   help="dry run only: timed repetitions")
    p.add_argument("--rounds", type=core.positive_int, default=5,
                   help="rounds of timing none and sinks in turn (the median is reported)")
    p.add_argument("--json", type=core.output_file, help="write the results here")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU and Triton's interpreter at tiny sizes")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        args.n, args.d, args.dtype, args.reps, args.rounds = [48], [16], "fp32", 1, 2
    device = core.bench_device(args.dry_run, "sinks")
    if device is None:
        return 1
    dtype = core.torch_dtype(args.dtype)
    out = {"environment": core.environment(["sinks", *argv]), "cases": []}
    print(core.headline(out["environment"]), flush=True)
    head = ["N", "d", "causal", "fwd ms", "with sinks", "cost", "fwd+bwd ms", "with sinks",
            "cost", "max diff"]
    lines = []
    for N in args.n:
        for d in args.d:
            for causal in args.causal:
                row = one_case(N, d, causal, args, device, dtype)
                out["cases"].append(row)
                lines.append([N, d, causal, f"{row['none_fwd_ms']:.3f}",
                              f"{row['sinks_fwd_ms']:.3f}", f"{row['fwd_cost']:.3f}x",
                              f"{row['none_fwdbwd_ms']:.3f}", f"{row['sinks_fwdbwd_ms']:.3f}",
                              f"{row['fwdbwd_cost']:.3f}x", f"{row['max_diff']:.1e}"])
                print(" | ".join(str(x) for x in lines[-1]), flush=True)
    print(core.format_table(head, lines))
    if args.json:
        core.write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0
