"""One forward of FlashAttention-3's Gluon kernel, of the readable Triton kernel or of SDPA-cuDNN
at one of `flashedu bench fa3`'s shapes (B * N = 16384, H * d = 2048, bf16), each warm, the
third call between cudaProfilerStart/Stop, for Nsight Compute (ncu --profile-from-start off):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python docs/bench/experiments/ncu_forward_fa3.py fa3 --d 64 --n 4096 --causal
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashedu  # noqa: F401 - first: decides GPU or interpreter before triton loads
from flashedu.benchmarks.core import batch_heads, profile_once
from flashedu.ops import Call
from flashedu.triton import fa3
from flashedu.triton.autograd import resolve_config
from flashedu.triton.launch import forward

p = argparse.ArgumentParser()
p.add_argument("who", choices=["fa3", "triton", "cudnn"])
p.add_argument("--d", type=int, default=128)
p.add_argument("--n", type=int, default=4096)
p.add_argument("--causal", action="store_true")
args = p.parse_args()

B, H = batch_heads(args.n, args.d)
N, d = args.n, args.d
torch.manual_seed(0)
q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
scale = d ** -0.5
config = resolve_config(d, q.dtype, None, q.device)
if args.who == "fa3":  # the table's settings, whether or not the table takes fa3 at this N
    o, lse2 = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    settings = config.schedule.settings(args.causal, N)

    def call():
        fa3.forward(q, k, v, o, lse2, is_causal=args.causal, scale=scale, **settings)
elif args.who == "triton":
    def call():
        forward(q, k, v, Call(args.causal, scale), tiles=config.forward_tiles(None, N))
else:
    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
profile_once(call)
