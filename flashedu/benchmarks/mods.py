"""Mask mods and score mods against FlexAttention on the same mods, forward and backward.

Each case builds the same rule twice: a flashedu mod (``flashedu.mods``, through
``BlockMask.from_mask_mod`` or ``score_mod=``) and its FlexAttention twin (``create_block_mask``
and a compiled ``flex_attention``), checks that the two outputs agree, and times both with the
call as users make it. ``visible`` is the fraction of (query, key) pairs the rule keeps: a
kernel that skips what is hidden takes time in proportion to it.

    flashedu bench mods --json docs/bench/mods_h100.json
    flashedu bench mods --dry-run      # tiny sizes (no GPU: Triton's interpreter, eager Flex)
"""

from __future__ import annotations

import sys

from . import core

DTYPES = ("bf16", "fp16", "fp32")


def cases(args):
    """(name, N, kind, parameter) of the run: windows, documents, ALiBi and softcap."""
    out = [("window", n, "window", w) for n in args.n for w in args.windows if w < n]
    out += [("documents", n, "documents", k) for n in args.doc_n for k in args.docs]
    out += [("alibi causal", n, "alibi", None) for n in args.score_n]
    out += [("softcap causal", n, "softcap", args.cap) for n in args.score_n]
    return out


def build(kind, param, N, H, device):
    """(flashedu keyword arguments, flex keyword arguments, visible fraction) of one rule."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from flashedu import BlockMask, mods

    if kind == "window":
        fe_mod = mods.sliding_window(param)

        def flex_mod(b, h, q, kv):
            return (kv <= q) & (q - kv < param)
    elif kind == "documents":
        lengths = torch.full((param,), N // param)
        lengths[: N % param] += 1
        doc = torch.repeat_interleave(torch.arange(param), lengths).to(device)
        fe_mod = mods.document(doc)

        def flex_mod(b, h, q, kv):
            return doc[q] == doc[kv]
    else:
        fe_mod = mods.causal()

        def flex_mod(b, h, q, kv):
            return kv <= q
    block = 128 if N >= 128 else 32
    fe = {"block_mask": BlockMask.from_mask_mod(fe_mod, 1, 1, N, N, block_size=(block, block),
                                                device=device)}
    flex = {"block_mask": create_block_mask(flex_mod, 1, 1, N, N, device=device,
                                            BLOCK_SIZE=block)}
    if kind == "alibi":
        slopes = mods.alibi_slopes(H).to(device)
        fe = {"is_causal": True, "score_mod": mods.alibi(slopes)}

        def alibi(score, b, h, q, kv):
            return score + slopes[h] * (kv - q)
        flex["score_mod"] = alibi
    elif kind == "softcap":
        fe = {"is_causal": True, "score_mod": mods.softcap(param)}

        def softcap(score, b, h, q, kv):
            return param * torch.tanh(score / param)
        flex["score_mod"] = softcap
    q_idx = torch.arange(N, device=device)
    visible = flex_mod(0, 0, q_idx[:, None], q_idx[None, :]).float().mean().item()
    return fe, flex, visible


def one_case(name, N, kind, param, d, args, device, dtype) -> dict:
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    import flashedu
    from flashedu import tolerance

    B, H = max(1, core.TOKENS // N), core.WIDTH // d
    if args.dry_run:
        B, H = 1, 2
    g = torch.Generator(device=device).manual_seed(N + d)
    q, k, v = (torch.randn(B, H, N, d, device=device, dtype=dtype, generator=g,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    fe_kw, flex_kw, visible = build(kind, param, N, H, device)
    # eager Flex on a CPU (it compiles only for GPUs); compiled on a GPU, dry run or not
    flex = flex_attention if device == "cpu" else core.compiled_flex()
    row = {"case": name, "N": N, "param": param, "d": d, "B": B, "H": H, "dtype": args.dtype,
           "visible": visible}
    calls = {"flashedu": lambda: flashedu.attention(q, k, v, backend="triton", **fe_kw),
             "flex": lambda: flex(q, k, v, **flex_kw)}
    if device == "cpu":  # FlexAttention refuses inputs that require grad on a CPU
        calls["flex"] = lambda: flex(q.detach(), k.detach(), v.detach(), **flex_kw)
    with torch.no_grad():
        a, b = calls["flashedu"](), calls["flex"]()
        row["max_diff"] = tolerance.max_error(a, b.double())
    for who, call in calls.items():
        def fwd_bwd(call=call):
            call().backward(dout)
        with torch.no_grad():
            row[f"{who}_fwd_ms"] = core.time_ms(call, cpu_repeats=args.reps)
        if device == "cpu" and who == "flex":  # FlexAttention has no backward on a CPU
            row["flex_fwdbwd_ms"] = float("nan")
            continue
        row[f"{who}_fwdbwd_ms"] = core.time_ms(fwd_bwd, grad_to_none=[q, k, v],
                                               cpu_repeats=args.reps)
    row["fwd_vs_flex"] = row["flex_fwd_ms"] / row["flashedu_fwd_ms"]
    row["fwdbwd_vs_flex"] = row["flex_fwdbwd_ms"] / row["flashedu_fwdbwd_ms"]
    return row


def _num(x, fmt, unit=""):
    """A table cell: "-" for a time not measured (NaN)."""
    return "-" if x != x else f"{x:{fmt}}{unit}"


def parse_args(argv):
    p = core.parser("mods", __doc__)
    p.add_argument("--n", type=core.positive_int, nargs="+", default=[8192, 16384, 32768],
                   help="sequence lengths of the sliding-window cases")
    p.add_argument("--windows", type=core.positive_int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--doc-n", type=core.positive_int, nargs="+", default=[16384],
                   help="sequence lengths of the document cases")
    p.add_argument("--docs", type=core.positive_int, nargs="+", default=[8, 64],
                   help="documents packed into one sequence")
    p.add_argument("--score-n", type=core.positive_int, nargs="+", default=[8192],
                   help="sequence lengths of the ALiBi and softcap cases")
    p.add_argument("--cap", type=float, default=30.0, help="softcap (Gemma 2 uses 50)")
    p.add_argument("--d", type=core.head_dim, nargs="+", default=[64, 128])
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--reps", type=core.positive_int, default=3,
                   help="dry run only: timed repetitions")
    p.add_argument("--json", type=core.output_file, help="write the results here")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, Triton's interpreter and eager FlexAttention at tiny sizes")
    args = p.parse_args(argv)
    if not args.cap > 0:
        p.error(f"--cap must be positive, got {args.cap}")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        args.n, args.windows, args.doc_n, args.docs = [128], [48], [128], [3]
        args.d, args.dtype = [32], "fp32"
    device = core.bench_device(args.dry_run, "mods")
    if device is None:
        return 1
    if args.dry_run:  # compiled Flex finds no kernel for a 64-position score mod on a GPU
        args.score_n = [64] if device == "cpu" else [128]
    import torch

    dtype = core.torch_dtype(args.dtype)
    out = {"environment": core.environment(["mods", *argv]), "cases": []}
    print(core.headline(out["environment"]), flush=True)
    head = ["case", "N", "param", "d", "visible", "fwd ms", "Flex fwd", "fwd vs Flex",
            "fwd+bwd ms", "Flex fwd+bwd", "fwd+bwd vs Flex", "max diff"]
    lines = []
    for name, N, kind, param in cases(args):
        for d in args.d:
            try:
                row = one_case(name, N, kind, param, d, args, device, dtype)
            except Exception as exc:  # noqa: BLE001 - one failed case is reported, not fatal
                row = {"case": name, "N": N, "param": param, "d": d,
                       "error": core.error_text(exc)}
                if device == "cuda":
                    torch.cuda.empty_cache()
            out["cases"].append(row)
            if "error" in row:
                print(f"{name} N={N} d={d} ERROR: {row['error']}", flush=True)
                continue
            lines.append([name, N, param if param is not None else "", d,
                          f"{row['visible']:.3f}", _num(row["flashedu_fwd_ms"], ".3f"),
                          _num(row["flex_fwd_ms"], ".3f"), _num(row["fwd_vs_flex"], ".2f", "x"),
                          _num(row["flashedu_fwdbwd_ms"], ".3f"),
                          _num(row["flex_fwdbwd_ms"], ".3f"),
                          _num(row["fwdbwd_vs_flex"], ".2f", "x"), f"{row['max_diff']:.1e}"])
            print(" | ".join(str(x) for x in lines[-1]), flush=True)
    print(core.format_table(head, lines))
    if args.json:
        core.write_json(args.json, out)
        print(f"wrote {args.json}")
    return 1 if any("error" in r for r in out["cases"]) else 0
