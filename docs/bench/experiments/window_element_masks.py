"""What the element masks of a sliding window cost: the same tiles with and without the mask
mod (without it the partial tiles run unmasked: wrong, only timed), and FlexAttention."""

import json
import os

import torch
from triton.testing import do_bench

import flashedu
from flashedu import BlockMask, mods
from flashedu.benchmarks.core import compiled_flex

rows = []
for N, w, d in ((8192, 256, 128), (8192, 1024, 128), (8192, 1024, 64), (1024, 256, 128)):
    B, H = 16384 // N, 2048 // d
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    win = BlockMask.from_mask_mod(mods.sliding_window(w), 1, 1, N, N, device="cuda")
    tiles_only = BlockMask(win.blocks, win.block_size, win.seq_lens, is_causal=win.is_causal)
    t_el = do_bench(lambda: flashedu.attention(q, k, v, block_mask=win, backend="triton"))
    t_pl = do_bench(lambda: flashedu.attention(q, k, v, block_mask=tiles_only, backend="triton"))
    flex = compiled_flex()
    fm = win.to_flex(device=q.device)
    t_fx = do_bench(lambda: flex(q, k, v, block_mask=fm))
    partial = int(win.partial.sum())
    full = int(win.full_blocks.sum())
    print(
        f"N={N} w={w} d={d}: element masks {t_el:.3f} ms, tiles only {t_pl:.3f} ms "
        f"({t_el / t_pl:.2f}x), Flex {t_fx:.3f} ms; partial tiles {partial}, full {full}",
        flush=True,
    )
    rows.append(
        dict(
            N=N,
            window=w,
            d=d,
            element_ms=t_el,
            tiles_only_ms=t_pl,
            flex_ms=t_fx,
            partial=partial,
            full=full,
        )
    )
json.dump(
    {"device": torch.cuda.get_device_name(), "commit": os.environ.get("GIT_COMMIT"), "rows": rows},
    open(os.environ.get("OUT", ".") + "/window_probe.json", "w"),
    indent=1,
)
