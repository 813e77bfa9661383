"""The d=128 dense backward from 4K to 128K keys (H=16, bf16, B*N = 16384 up to 16K, then
B=1): the table's entry (one fused launch, 2 stages) against two launches (2 or 3 stages) and
one launch with 3 stages. cuDNN's backward in the same process, up to 32K."""

import dataclasses
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashedu.triton.config import kernel_config
from flashedu.triton.launch import backward, forward

rows = []
H, d = 16, 128
base = kernel_config(d, False, False)
cands = {
    "prod (fused, 2 stages)": base,
    "split, 2 stages": dataclasses.replace(base, split_from=0),
    "split, 3 stages": dataclasses.replace(
        base,
        dkdv=dataclasses.replace(base.dkdv, num_stages=3),
        dq=dataclasses.replace(base.dq, num_stages=3),
        split_from=0,
    ),
    "fused, 3 stages": dataclasses.replace(
        base,
        dkdv=dataclasses.replace(base.dkdv, num_stages=3),
        dq=dataclasses.replace(base.dq, num_stages=3),
    ),
}
for n in (4096, 8192, 16384, 32768, 65536, 131072):
    B = max(1, 16384 // n)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    flops = 2.5 * 4 * B * n * n * H * d
    line = f"N={n}"
    if n <= 32768:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            oc = F.scaled_dot_product_attention(qq, kk, vv)
            t = do_bench(
                lambda: torch.autograd.grad(oc, (qq, kk, vv), do, retain_graph=True),
                warmup=5,
                rep=50,
            )
        rows.append(dict(n=n, B=B, variant="cudnn", ms=t, tflops=flops / t / 1e9))
        line += f" cudnn {flops / t / 1e9:.0f} TFLOPs"
        del qq, kk, vv, oc
    print(line, flush=True)
    o, lse2 = forward(
        q,
        k,
        v,
        is_causal=False,
        scale=d**-0.5,
        block_mask=None,
        tiles=base.forward_tiles(None, n),
        interpreted=False,
    )
    ref = None
    for name, cfg in cands.items():
        run = lambda cfg=cfg: backward(
            q,
            k,
            v,
            o,
            lse2,
            do,
            is_causal=False,
            scale=d**-0.5,
            block_mask=None,
            config=cfg,
            interpreted=False,
        )
        got = run()
        ref = ref or got
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
        ms = do_bench(run, warmup=5, rep=50)
        rows.append(dict(n=n, B=B, variant=name, ms=ms, tflops=flops / ms / 1e9, err=err))
        print(f"   {name}: {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOPs, err {err:.2g}", flush=True)
json.dump(
    {"device": torch.cuda.get_device_name(), "commit": os.environ.get("GIT_COMMIT"), "rows": rows},
    open(os.environ.get("OUT", ".") + "/long_dense_bwd.json", "w"),
    indent=1,
)
