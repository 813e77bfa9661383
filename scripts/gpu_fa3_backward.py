"""FlashAttention-3's backward (flashedu/triton/fa3_backward.py) swept on an sm_90 GPU: each of
its settings beside cuDNN's backward and the Triton kernels' backward of the same call, in one
process: bf16, 16 heads, B x N = 32768 tokens at d = 128 and 65536 at d = 64.

    python scripts/gpu_fa3_backward.py --n 4096 8192 16384 --json docs/bench/fa3_backward.json

Each backward starts from its own saved forward; one ``triton.testing.do_bench`` each, in
TFLOP/s (2.5 x the forward's 4 B H N^2 d, causal half). The winner goes into the tile table
(flashedu/triton/config.py, ``BackwardSchedule``) by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import flashedu  # noqa: F401  (before triton)

# (STAGES, DQ_BUFFERS, FRESH_DESCRIPTORS): d = 128 fits 2 x 1 and 3 x 1 and 2 x 2 in 227 KB of
# shared memory
SETTINGS = {64: [(2, 1, False), (2, 2, False), (3, 2, False), (2, 1, True)],
            128: [(2, 1, False), (2, 1, True), (2, 2, True), (3, 1, True)]}


def one_case(N, d, causal):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from flashedu.benchmarks import core
    from flashedu.ops import Call
    from flashedu.triton import fa3_backward, launch
    from flashedu.triton.autograd import resolve_config

    B, H = 32768 // N * (2 if d == 64 else 1), 16  # 32K tokens of 16 heads (64K at d = 64)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    call = Call(causal, d ** -0.5)
    o, lse2 = launch.forward(q, k, v, call)
    flops = core.attention_flops(B, H, N, N, d, causal=causal, mode="bwd")
    row = {"B": B, "H": H, "N": N, "d": d, "causal": causal, "tflops": {}}
    for stages, buffers, fresh in SETTINGS[d]:
        ms = do_bench(lambda: fa3_backward.backward(q, k, v, o, lse2, do, is_causal=causal,
                                                    scale=call.scale, STAGES=stages,
                                                    DQ_BUFFERS=buffers,
                                                    FRESH_DESCRIPTORS=fresh))
        label = f"fa3 {stages} stages {buffers} dQ buffers" + (" fresh" if fresh else "")
        row["tflops"][label] = core.tflops(flops, ms)
    triton_only = dataclasses.replace(resolve_config(d, q.dtype, None, q.device),
                                      backward_schedule=None)
    ms = do_bench(lambda: launch.backward(q, k, v, o, lse2, do, call, config=triton_only))
    row["tflops"]["Triton kernels"] = core.tflops(flops, ms)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    ms = do_bench(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
    row["tflops"]["cuDNN"] = core.tflops(flops, ms)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--d", type=int, nargs="+", choices=(64, 128), default=[64, 128])
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    for N in args.n:
        for d in args.d:
            for causal in (False, True):
                row = one_case(N, d, causal)
                rows.append(row)
                cells = "  ".join(f"{name} {t:.0f}" for name, t in row["tflops"].items())
                print(f"N={N} d={d} causal={causal}:  {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
