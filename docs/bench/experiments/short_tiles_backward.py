"""Backward tiles at short N, d=128 (B*N=16384, H=16, bf16): the table's entry against smaller
tiles, one launch (fused) or two; SDPA-flash and cuDNN backward in the same process."""

import dataclasses
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashedu.triton.config import Tiles, kernel_config
from flashedu.triton.launch import backward, forward

rows = []
for n in (512, 1024, 2048):
    B, H, d = 16384 // n, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    for causal in (True, False):
        base = kernel_config(d, False, False)
        prod = (base.causal_backward or base) if causal else base
        cands = {"prod": prod}
        for name, dkdv, dq in (
            ("kv64x64w4s3/q64x64w4s3", Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3)),
            ("kv32x128w8s3/q128x32w8s3", Tiles(32, 128, 8, 3), Tiles(128, 32, 8, 3)),
            ("kv64x128w8s3/q128x64w8s3", Tiles(64, 128, 8, 3), Tiles(128, 64, 8, 3)),
            ("kv32x64w4s3/q64x32w4s3", Tiles(32, 64, 4, 3), Tiles(64, 32, 4, 3)),
            ("kv64x64w4s2/q64x64w4s2", Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2)),
        ):
            for fused in (True, False):
                cands[f"{name} {'fused' if fused else 'split'}"] = dataclasses.replace(
                    base,
                    dkdv=dkdv,
                    dq=dq,
                    fused_backward=fused,
                    split_from=None,
                    causal_backward=None,
                )
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        line = f"N={n} causal={causal}"
        for prov, be in (
            ("flash", SDPBackend.FLASH_ATTENTION),
            ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ):
            with sdpa_kernel(be):
                oc = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                t = do_bench(
                    lambda: torch.autograd.grad(oc, (qq, kk, vv), do, retain_graph=True),
                    warmup=25,
                    rep=200,
                )
            line += f" {prov} {t * 1e3:.0f}us"
            rows.append(dict(n=n, causal=causal, variant=prov, ms=t))
        print(line, flush=True)
        o, lse2 = forward(
            q,
            k,
            v,
            is_causal=causal,
            scale=d**-0.5,
            block_mask=None,
            tiles=base.forward_tiles(None, n),
            interpreted=False,
        )
        ref = None
        for name, cfg in cands.items():
            try:
                run = lambda: backward(
                    q,
                    k,
                    v,
                    o,
                    lse2,
                    do,
                    is_causal=causal,
                    scale=d**-0.5,
                    block_mask=None,
                    config=cfg,
                    interpreted=False,
                )
                got = run()
                if ref is None:
                    ref = got
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
                ms = do_bench(run, warmup=25, rep=200)
                rows.append(dict(n=n, causal=causal, variant=name, ms=ms, err=err))
                print(f"   {name}: {ms * 1e3:.0f}us err {err:.2g}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"   {name}: FAILED {type(exc).__name__} {str(exc)[:100]}", flush=True)
json.dump(
    {"device": torch.cuda.get_device_name(), "commit": os.environ.get("GIT_COMMIT"), "rows": rows},
    open(os.environ.get("OUT", ".") + "/short_bwd.json", "w"),
    indent=1,
)
