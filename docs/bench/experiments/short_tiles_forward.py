"""Forward tiles at short N, d=128 (B*N=16384, H=16, bf16): the table's entry against other
tiles, SDPA-flash in the same process. do_bench of launch.forward (host time included)."""

import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashedu.triton.config import Tiles
from flashedu.triton.launch import forward

T = [
    Tiles(128, 128, 8, 3, tma=True, warp_specialize=True),
    Tiles(128, 128, 8, 2, tma=True, warp_specialize=True),
    Tiles(128, 64, 8, 3, tma=True, warp_specialize=True),
    Tiles(128, 64, 8, 3),
    Tiles(128, 64, 4, 3),
    Tiles(64, 64, 4, 3),
    Tiles(64, 128, 4, 3),
    Tiles(128, 128, 8, 3),
    Tiles(64, 64, 4, 3, tma=True, warp_specialize=True),
    Tiles(64, 128, 4, 2, tma=True, warp_specialize=True),
]
T64 = [
    Tiles(128, 64, 8, 3, maxnreg=128),
    Tiles(64, 64, 4, 3),
    Tiles(64, 32, 4, 3),
    Tiles(128, 32, 4, 3),
    Tiles(64, 64, 4, 2),
    Tiles(128, 64, 4, 3),
    Tiles(64, 128, 4, 3),
    Tiles(128, 128, 8, 3, maxnreg=128),
]
D = int(os.environ.get("D", "128"))
if D == 64:
    T = T64
rows = []
for n in (512, 1024, 2048):
    B, H, d = 16384 // n, 2048 // D, D
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)
    )
    for causal in (True, False):
        fl = 4 * B * H * n * n * d * (0.5 if causal else 1.0)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            tf = do_bench(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                warmup=25,
                rep=200,
            )
        line = f"N={n} causal={causal} sdpa-flash {tf * 1e3:.1f}us:"
        for t in T:
            try:
                o, _ = forward(
                    q,
                    k,
                    v,
                    is_causal=causal,
                    scale=d**-0.5,
                    block_mask=None,
                    tiles=t,
                    interpreted=False,
                )
                err = (o.float() - ref.float()).abs().max().item()
                ms = do_bench(
                    lambda: forward(
                        q,
                        k,
                        v,
                        is_causal=causal,
                        scale=d**-0.5,
                        block_mask=None,
                        tiles=t,
                        interpreted=False,
                    ),
                    warmup=25,
                    rep=200,
                )
                rows.append(
                    dict(
                        n=n,
                        causal=causal,
                        tiles=str(t),
                        ms=ms,
                        flash_ms=tf,
                        vs_flash=tf / ms,
                        err=err,
                    )
                )
                line += f" | {t.Br}x{t.Bc}w{t.num_warps}s{t.num_stages}{'tma' if t.tma else ''}{'ws' if t.warp_specialize else ''} {ms * 1e3:.1f}us {tf / ms:.2f}x"
            except Exception as exc:  # noqa: BLE001
                line += f" | {t} FAILED {type(exc).__name__}"
        print(line, flush=True)
json.dump(
    {"device": torch.cuda.get_device_name(), "commit": os.environ.get("GIT_COMMIT"), "rows": rows},
    open(os.environ.get("OUT", ".") + f"/short_tune_d{D}.json", "w"),
    indent=1,
)
