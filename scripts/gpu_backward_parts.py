"""Where the time of flashedu's backward goes on an sm_90 GPU, piece by piece, beside cuDNN's.
The public API's backward is the preprocess (D = rowsum(dO * O)), dQ's float32 buffer zeroed,
FlashAttention-3's backward kernel (which adds dQ into that buffer) and the cast of dQ into
q's dtype; each piece is timed alone, and the kernel under other settings of its schedule
(``--variants``: more stages or dQ buffers, persistent programs with one or two K/V buffers,
one program per K/V tile).
bf16, the shapes of ``flashedu bench fa3`` (B * N = 16384 tokens, H * d = 2048); every
column timed in turn, ``--rounds`` times (``core.interleaved_ms``), the median kept.

    python scripts/gpu_backward_parts.py --n 4096 --rounds 3 --json docs/bench/backward_parts.json
    python scripts/gpu_backward_parts.py --n 4096 8192 --variants per-tile persistent persistent-kv2
"""

from __future__ import annotations

import argparse
import json

import flashedu  # noqa: F401  (before triton)

# the kernel's settings timed beside the table's, by name: what fits in 227 KB of shared
# memory at each d (d = 128 holds one K/V buffer only)
VARIANTS = {"stages2": dict(STAGES=2, DQ_BUFFERS=1), "dq2": dict(STAGES=2, DQ_BUFFERS=2),
            "stages3": dict(STAGES=3, DQ_BUFFERS=1), "stages3-dq2": dict(STAGES=3, DQ_BUFFERS=2),
            "persistent": dict(PERSISTENT=True, KV_BUFFERS=1),
            "persistent-kv2": dict(PERSISTENT=True, KV_BUFFERS=2),
            "per-tile": dict(PERSISTENT=False, KV_BUFFERS=1)}
FITS = {64: set(VARIANTS), 128: set(VARIANTS) - {"stages3-dq2", "persistent-kv2"}}
KERNEL = "kernel (the table's)"  # the kernel alone with the tile table's settings


def one_case(N, d, causal, rounds=1, variants=tuple(VARIANTS)) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashedu.benchmarks import core
    from flashedu.ops import Call
    from flashedu.triton import fa3_backward, launch
    from flashedu.triton.autograd import resolve_config

    B, H = core.batch_heads(N, d)  # the shapes of ``flashedu bench fa3``
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    call = Call(causal, d ** -0.5)
    config = resolve_config(d, q.dtype, None, q.device)
    table = config.fa3_backward_settings(N, N, causal)
    o, lse2 = launch.forward(q, k, v, call)
    lse2 = lse2.contiguous()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashedu.attention(*leaves, is_causal=causal, backend="triton")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out_cudnn = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    D = launch.preprocess(o, do, config.preprocess_rows)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fns = {"API backward": lambda: torch.autograd.grad(out, leaves, do, retain_graph=True),
           "cuDNN backward": lambda: torch.autograd.grad(out_cudnn, leaves, do,
                                                         retain_graph=True),
           "preprocess": lambda: launch.preprocess(o, do, config.preprocess_rows),
           "dQ buffer zeroed": acc.zero_,
           "dQ cast": lambda: dq.copy_(acc)}
    kernels = {KERNEL: table}
    for name in variants:
        settings = dict(table, **VARIANTS[name])
        if name in FITS[d] and settings != table:
            kernels[f"kernel {name}"] = settings
    for label, settings in kernels.items():
        kernel = fa3_backward.launch(q, k, v, do, lse2, D, acc, dk, dv, is_causal=causal,
                                     scale=call.scale, **settings)
        # acc keeps adding up across the repeats: only the time is read
        fns[label] = lambda kernel=kernel: kernel.start(q, k, v, do, lse2, D, acc, dk, dv)
    ms, _ = core.interleaved_ms({name: (fn, {}) for name, fn in fns.items()}, rounds)
    flops = core.attention_flops(B, H, N, N, d, causal=causal, mode="bwd")
    return {"B": B, "H": H, "N": N, "d": d, "causal": causal, "settings": table,
            "us": {name: t * 1000 for name, t in ms.items()},
            "tflops": {name: core.tflops(flops, ms[name])
                       for name in ("API backward", "cuDNN backward", *kernels)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[4096])
    p.add_argument("--d", type=int, nargs="+", choices=(64, 128), default=[64, 128])
    p.add_argument("--rounds", type=int, default=3, help="each column timed this many times")
    p.add_argument("--variants", nargs="*", choices=tuple(VARIANTS), default=list(VARIANTS),
                   help="the kernel's settings timed beside the table's")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    for N in args.n:
        for d in args.d:
            for causal in (False, True):
                row = one_case(N, d, causal, args.rounds, args.variants)
                rows.append(row)
                api = row["us"]["API backward"]
                print(f"d={d} N={N} causal={causal} (B={row['B']}, H={row['H']}):", flush=True)
                for name, t in row["us"].items():
                    tflops = row["tflops"].get(name)
                    rate = f"  {tflops:5.0f} TFLOP/s" if tflops else ""
                    print(f"   {name:32} {t:8.1f} us  {t / api:6.3f} of the API's{rate}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
