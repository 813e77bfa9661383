"""One backward of flashedu and of SDPA-cuDNN (B=2, H=16, N=8192, d=128, bf16), each warm, the
third backward between cudaProfilerStart/Stop (ncu --profile-from-start off)."""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashedu
from flashedu.benchmarks.core import profile_once

who = sys.argv[1]
q, k, v = (
    torch.randn(2, 16, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3)
)
do = torch.randn(2, 16, 8192, 128, device="cuda", dtype=torch.bfloat16)
if who == "flashedu":
    out = flashedu.attention(q, k, v, backend="triton")
else:
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v)
profile_once(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
