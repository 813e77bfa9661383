"""One decoding step of `flashedu bench paged`'s cells (H = 32, Hkv = 8, d = 128, bf16), paged,
contiguous or SDPA-cuDNN on the contiguous cache, each warm, the third call between
cudaProfilerStart/Stop, for Nsight Compute (ncu --profile-from-start off):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python docs/bench/experiments/ncu_decode.py paged --b 32 --nk 1024 --page 256
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashedu  # noqa: F401 - first: decides GPU or interpreter before triton loads
from flashedu.benchmarks.core import profile_once
from flashedu.benchmarks.paged import step_inputs
from flashedu.decode import paged_attention
from flashedu.triton.decode import split_kv_attention

p = argparse.ArgumentParser()
p.add_argument("who", choices=["paged", "contiguous", "cudnn"])
p.add_argument("--b", type=int, default=32)
p.add_argument("--nk", type=int, default=1024)
p.add_argument("--page", type=int, default=256)
args = p.parse_args()

q, k, v, kc, vc, table, seqlens = step_inputs(args.b, args.nk, args.page, 32, 8, 128, "cuda",
                                               torch.bfloat16)
if args.who == "paged":
    def call():
        paged_attention(q, kc, vc, table, seqlens, check_indices=False)
elif args.who == "contiguous":
    def call():
        split_kv_attention(q, k, v)
else:
    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
profile_once(call)
