"""The backward at N=4096 and 8192 (B*N = 16384, H*d = 2048, bf16), dense and causal: the
table's entries against other dK/dV and dQ tiles, warps, stages and register caps, one launch
or two. ``python backward_sweep.py 64`` sweeps d=64 (default 128)."""

import dataclasses
import json
import os
import sys

import torch
from triton.testing import do_bench

from flashedu.triton.config import Tiles, kernel_config
from flashedu.triton.launch import backward, forward

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
H = 2048 // d
base = kernel_config(d, False, False)
CANDIDATES = {  # name: (dK/dV tiles, dQ tiles)
    128: {
        "kv32x128w8s3/q128x64w8s3": (Tiles(32, 128, 8, 3), Tiles(128, 64, 8, 3)),
        "kv32x128w8s4/q128x64w8s3": (Tiles(32, 128, 8, 4), Tiles(128, 64, 8, 3)),
        "kv64x128w8s3/q64x128w8s3": (Tiles(64, 128, 8, 3), Tiles(64, 128, 8, 3)),
        "kv64x128w8s3/q128x32w8s3": (Tiles(64, 128, 8, 3), Tiles(128, 32, 8, 3)),
        "kv64x64w4s3/q64x64w4s3": (Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3)),
        "kv64x128w8s3/q64x64w4s3": (Tiles(64, 128, 8, 3), Tiles(64, 64, 4, 3)),
        "kv32x64w4s3/q64x64w4s3": (Tiles(32, 64, 4, 3), Tiles(64, 64, 4, 3)),
    },
    64: {
        "kv32x128w8s4r128/q128x64w8s3r128": (Tiles(32, 128, 8, 4, maxnreg=128),
                                             Tiles(128, 64, 8, 3, maxnreg=128)),
        "kv32x128w8s3/q128x64w8s3": (Tiles(32, 128, 8, 3), Tiles(128, 64, 8, 3)),
        "kv64x128w8s3/q128x64w8s3": (Tiles(64, 128, 8, 3), Tiles(128, 64, 8, 3)),
        "kv64x128w8s3r128/q128x64w8s3r128": (Tiles(64, 128, 8, 3, maxnreg=128),
                                             Tiles(128, 64, 8, 3, maxnreg=128)),
        "kv64x64w4s3/q64x64w4s3": (Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3)),
        "kv32x128w4s3/q128x32w4s3": (Tiles(32, 128, 4, 3), Tiles(128, 32, 4, 3)),
        "kv64x128w8s4r128/q128x64w8s4r128": (Tiles(64, 128, 8, 4, maxnreg=128),
                                             Tiles(128, 64, 8, 4, maxnreg=128)),
        "kv32x64w4s4/q64x64w4s4": (Tiles(32, 64, 4, 4), Tiles(64, 64, 4, 4)),
    },
}[d]
rows = []
for n in (4096, 8192):
    B = 16384 // n
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    for causal in (False, True):
        flops = 2.5 * 4 * B * n * n * H * d * (0.5 if causal else 1)
        prod = base.backward_entry(causal, False, None, n)
        cands = {"prod": prod}
        for name, (kv, dq) in CANDIDATES.items():
            for fused in (True, False):
                cands[f"{name} {'fused' if fused else 'split'}"] = dataclasses.replace(
                    prod, dkdv=kv, dq=dq, fused_backward=fused, split_from=None,
                    causal_backward=None,
                )
        o, lse2 = forward(q, k, v, is_causal=causal, scale=d**-0.5, block_mask=None,
                          tiles=base.forward_tiles(None, n), interpreted=False)
        ref = None
        print(f"N={n} causal={causal}", flush=True)
        for name, cfg in cands.items():
            run = lambda cfg=cfg: backward(q, k, v, o, lse2, do, is_causal=causal, scale=d**-0.5,
                                           block_mask=None, config=cfg, interpreted=False)
            try:
                got = run()
                ref = ref or got
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
                ms = do_bench(run, warmup=10, rep=100)
            except Exception as exc:  # noqa: BLE001  (a candidate that does not fit)
                print(f"   {name}: FAILED {type(exc).__name__} {str(exc)[:80]}", flush=True)
                continue
            rows.append(dict(n=n, causal=causal, variant=name, ms=ms, tflops=flops / ms / 1e9,
                             err=err))
            print(f"   {name}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOPs err {err:.2g}", flush=True)
json.dump(
    {"device": torch.cuda.get_device_name(), "commit": os.environ.get("GIT_COMMIT"), "rows": rows},
    open(os.environ.get("OUT", ".") + f"/backward_sweep_d{d}.json", "w"),
    indent=1,
)
