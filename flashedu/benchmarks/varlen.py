"""Packed variable-length batches: ``flashedu.varlen_attention`` against FlexAttention with a
document mask on the same packed batch, and against padded dense attention (SDPA-flash).

Each case packs documents of random lengths (a fixed seed) into ``--tokens`` positions, causal
within each document. flashedu's call includes building its block mask from cu_seqlens, as a
training step pays it for every new batch; FlexAttention is timed with its block mask built
once (``create_block_mask`` timed on its own, per batch); the padded batch holds every document
in a row of the longest one's length. The output of flashedu and Flex is checked to agree.
Then, as a training loop runs, calls that each bring a new packing (``--new-packings``, each
run once untimed, then timed as new tensors of the same values): flashedu checks the new cuts
(and, where its kernels cannot read them, builds its tiles from them), Flex builds its block
mask, every call.

    flashedu bench varlen --json docs/bench/varlen_h200.json
    flashedu bench varlen --dry-run      # tiny sizes (no GPU: Triton's interpreter, eager Flex)
"""

from __future__ import annotations

import sys
import time

from . import core


def lengths_of(tokens: int, low: int, high: int, seed: int) -> list[int]:
    """Random document lengths in [low, high] that add up to ``tokens``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    while sum(out) < tokens:
        out.append(int(min(rng.integers(low, high + 1), tokens - sum(out))))
    return out


def packed(lengths, device):
    """(cu_seqlens, the longest length, each token's document id) of documents packed in order."""
    import torch

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device,
                      dtype=torch.int32)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(lengths, device=device))
    return cu, max(lengths), doc


def document_mask(doc, total, device):
    """FlexAttention's block mask of causal attention within each document."""
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    return create_block_mask(document_causal, None, None, total, total, device=device)


def ours(q, k, v, cu, longest):
    """flashedu's varlen attention of the packed q, k, v (total, H, d), causal per document."""
    import flashedu

    return flashedu.varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=True,
                                     backend="triton")


def theirs(flex, q, k, v, mask, device):
    """FlexAttention on the same packed row, as one sequence of batch 1 with the mask."""
    # FlexAttention refuses inputs that require grad on a CPU (it has no CPU backward)
    qb, kb, vb = (t.transpose(0, 1)[None] for t in ((q, k, v) if device != "cpu" else
                                                    (q.detach(), k.detach(), v.detach())))
    return flex(qb, kb, vb, block_mask=mask)[0].transpose(0, 1)


def one_case(lengths, H, d, args, device, dtype) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    from flashedu import tolerance

    total = sum(lengths)
    g = torch.Generator(device=device).manual_seed(total + d)
    q, k, v = (torch.randn(total, H, d, device=device, dtype=dtype, generator=g,
                           requires_grad=True) for _ in range(3))
    cu, longest, doc = packed(lengths, device)

    def flex_mask():
        return document_mask(doc, total, device)

    mask = flex_mask()
    flex = flex_attention if device == "cpu" else core.compiled_flex()

    def fe():
        return ours(q, k, v, cu, longest)

    def fx():
        return theirs(flex, q, k, v, mask, device)

    padded = [torch.zeros(len(lengths), H, longest, d, device=device, dtype=dtype,
                          requires_grad=True) for _ in range(3)]

    # the padded batch on SDPA's flash kernel (16-bit on a GPU); the efficient one takes a GPU
    # dry run's float32, the math one a CPU's
    chosen = SDPBackend.MATH
    if device != "cpu":
        chosen = (SDPBackend.FLASH_ATTENTION if dtype in (torch.float16, torch.bfloat16)
                  else SDPBackend.EFFICIENT_ATTENTION)

    def pad():
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(*padded, is_causal=True)

    row = {"tokens": total, "docs": len(lengths), "longest": longest, "H": H, "d": d,
           "dtype": args.dtype}
    with torch.no_grad():
        row["max_diff"] = tolerance.max_error(fe(), fx().double())
    row["flex_mask_ms"] = core.time_ms(flex_mask, cpu_repeats=args.reps)
    dout = torch.randn(total, H, d, device=device, dtype=dtype)
    dpad = torch.randn_like(padded[0])
    for name, call, out_grad, inputs in (("flashedu", fe, dout, [q, k, v]),
                                         ("flex", fx, dout, [q, k, v]),
                                         ("padded", pad, dpad, padded)):
        with torch.no_grad():
            row[f"{name}_fwd_ms"] = core.time_ms(call, cpu_repeats=args.reps)
        if device == "cpu" and name == "flex":  # FlexAttention has no CPU backward
            row["flex_fwdbwd_ms"] = float("nan")
            continue

        def step(call=call, out_grad=out_grad):
            call().backward(out_grad)

        row[f"{name}_fwdbwd_ms"] = core.time_ms(step, grad_to_none=inputs,
                                                cpu_repeats=args.reps)
    for mode in ("fwd", "fwdbwd"):
        row[f"{mode}_vs_flex"] = row[f"flex_{mode}_ms"] / row[f"flashedu_{mode}_ms"]
        row[f"{mode}_vs_padded"] = row[f"padded_{mode}_ms"] / row[f"flashedu_{mode}_ms"]
    if args.new_packings:
        row.update(new_packing_times(total, H, d, args, device, dtype, (q, k, v), dout, flex))
    return row


def new_packing_times(total, H, d, args, device, dtype, qkv, dout, flex) -> dict:
    """Wall ms per call when every call brings a packing not seen before, as a training loop
    does: flashedu builds its tiles from the cuts in the call, FlexAttention its block mask
    (create_block_mask) from the document ids. The same inputs, --new-packings packings."""
    import torch

    q, k, v = qkv
    packings = [packed(lengths_of(total, *args.lengths, args.seed + 1000 * seed), device)
                for seed in range(1, 3 * args.new_packings + 1)]

    def ours_new(packing):
        cu, longest, _ = packing
        return ours(q, k, v, cu, longest)

    def theirs_new(packing):
        return theirs(flex, q, k, v, document_mask(packing[2], total, device), device)

    def wall_ms(fn, chosen, backward):
        """Each packing run once untimed (whatever a kernel variant compiles for its lengths
        is compiled once in a training loop too), then timed as new tensors with the same
        values, as the next batch of a data loader brings them."""
        def run(packing):
            out = fn(packing)
            if backward:
                out.backward(dout)

        for packing in chosen:
            run(packing)
        fresh = [(cu.clone(), longest, doc.clone()) for cu, longest, doc in chosen]
        core.synchronize(device)
        start = time.perf_counter()
        for packing in fresh:
            run(packing)
        core.synchronize(device)
        return (time.perf_counter() - start) / len(chosen) * 1e3

    n = args.new_packings
    row = {}
    with torch.no_grad():
        row["new_flashedu_fwd_ms"] = wall_ms(ours_new, packings[:n], False)
        row["new_flex_fwd_ms"] = wall_ms(theirs_new, packings[:n], False)
    row["new_flashedu_fwdbwd_ms"] = wall_ms(ours_new, packings[n:2 * n], True)
    row["new_flex_fwdbwd_ms"] = (float("nan") if device == "cpu" else  # no CPU backward
                                 wall_ms(theirs_new, packings[2 * n:3 * n], True))
    for mode in ("fwd", "fwdbwd"):
        row[f"new_{mode}_vs_flex"] = row[f"new_flex_{mode}_ms"] / row[f"new_flashedu_{mode}_ms"]
    for t in (q, k, v):
        t.grad = None
    return row


def parse_args(argv):
    p = core.parser("varlen", __doc__)
    p.add_argument("--tokens", type=core.positive_int, nargs="+", default=[16384, 65536])
    p.add_argument("--lengths", type=core.positive_int, nargs=2, default=[256, 4096],
                   metavar=("LOW", "HIGH"), help="document lengths drawn in [LOW, HIGH]")
    p.add_argument("--d", type=core.head_dim, nargs="+", default=[64, 128])
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=core.positive_int, default=3,
                   help="dry run only: timed repetitions")
    p.add_argument("--new-packings", type=int, default=10,
                   help="also time calls that each bring a packing not seen before (this many "
                        "per kind; 0: skip)")
    p.add_argument("--json", type=core.output_file, help="write the results here")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, Triton's interpreter and eager FlexAttention at tiny sizes")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        args.tokens, args.lengths, args.d, args.dtype, args.reps = [96], [16, 48], [16], \
            "fp32", 1
        args.new_packings = min(args.new_packings, 2)
    device = core.bench_device(args.dry_run, "varlen")
    if device is None:
        return 1
    dtype = core.torch_dtype(args.dtype)
    out = {"environment": core.environment(["varlen", *argv]), "cases": []}
    print(core.headline(out["environment"]), flush=True)
    head = ["tokens", "docs", "d", "fwd ms", "vs Flex", "vs padded", "fwd+bwd ms", "vs Flex",
            "vs padded", "Flex mask ms", "max diff"]
    lines = []
    for tokens in args.tokens:
        lengths = lengths_of(tokens, *args.lengths, args.seed)
        for d in args.d:
            H = 2 if args.dry_run else core.WIDTH // d
            row = one_case(lengths, H, d, args, device, dtype)
            out["cases"].append(row)
            lines.append([tokens, row["docs"], d, f"{row['flashedu_fwd_ms']:.3f}",
                          f"{row['fwd_vs_flex']:.2f}x", f"{row['fwd_vs_padded']:.2f}x",
                          f"{row['flashedu_fwdbwd_ms']:.3f}", f"{row['fwdbwd_vs_flex']:.2f}x",
                          f"{row['fwdbwd_vs_padded']:.2f}x", f"{row['flex_mask_ms']:.3f}",
                          f"{row['max_diff']:.1e}"])
            print(" | ".join(str(x) for x in lines[-1]), flush=True)
            if args.new_packings:
                print(f"  a new packing every call: fwd {row['new_flashedu_fwd_ms']:.3f} ms "
                      f"({row['new_fwd_vs_flex']:.2f}x Flex with its mask built), fwd+bwd "
                      f"{row['new_flashedu_fwdbwd_ms']:.3f} ms "
                      f"({row['new_fwdbwd_vs_flex']:.2f}x)", flush=True)
    print(core.format_table(head, lines))
    if args.json:
        core.write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0
