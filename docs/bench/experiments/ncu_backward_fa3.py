"""One backward at one of `flashedu bench fa3`'s shapes (B * N = 16384, H * d = 2048, bf16):
FlashAttention-3's backward kernel alone with the tile table's settings ("table"), the same
with its persistent programs flipped ("flipped"), or SDPA-cuDNN's whole backward ("cudnn");
each warm, the third call between cudaProfilerStart/Stop, for Nsight Compute:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python docs/bench/experiments/ncu_backward_fa3.py table --d 64 --n 4096 --causal
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashedu  # noqa: F401 - first: decides GPU or interpreter before triton loads
from flashedu.benchmarks.core import batch_heads, profile_once
from flashedu.ops import Call
from flashedu.triton import fa3_backward, launch
from flashedu.triton.autograd import resolve_config

p = argparse.ArgumentParser()
p.add_argument("who", choices=["table", "flipped", "cudnn"])
p.add_argument("--d", type=int, default=64)
p.add_argument("--n", type=int, default=4096)
p.add_argument("--causal", action="store_true")
args = p.parse_args()

B, H = batch_heads(args.n, args.d)
torch.manual_seed(0)
q, k, v = (torch.randn(B, H, args.n, args.d, device="cuda", dtype=torch.bfloat16)
           for _ in range(3))
do = torch.randn_like(q)
call = Call(args.causal, args.d ** -0.5)
if args.who == "cudnn":
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(*leaves, is_causal=args.causal)

    def run():
        torch.autograd.grad(out, leaves, do, retain_graph=True)
else:
    config = resolve_config(args.d, q.dtype, None, q.device)
    settings = config.fa3_backward_settings(args.n, args.n, args.causal)
    if args.who == "flipped":
        settings["PERSISTENT"] = not settings["PERSISTENT"]
        settings["KV_BUFFERS"] = 1
    o, lse2 = launch.forward(q, k, v, call)
    lse2 = lse2.contiguous()
    D = launch.preprocess(o, do, config.preprocess_rows)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    kernel = fa3_backward.launch(q, k, v, do, lse2, D, acc, dk, dv, is_causal=args.causal,
                                 scale=call.scale, **settings)

    def run():
        kernel.start(q, k, v, do, lse2, D, acc, dk, dv)
profile_once(run)
