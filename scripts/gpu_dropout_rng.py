"""Where fused dropout's time goes (GPU): forward and backward alone, p=0 against p=0.1, and
variants of the p=0.1 launch:
- keep16, keep8: keep-masks that draw more entries from each Philox call (8 from 16-bit
  halves, 16 from bytes) in place of the shipped one (4 per call, 31-bit words). They only time
  the cost: their masks are not flashedu.dropout's stream, and their keep rates are rounded.
- small_tiles: the shipped mask with smaller tiles (fewer Philox states and a smaller P_ij
  live at once): candidates for a dropout entry of the tile table.

    python scripts/gpu_dropout_rng.py                 # every variant, one process each

Shapes: N=4096, bf16, B=4, H*d=2048; d=128 causal and not, d=64 not. Each compiled kernel's
registers and spills are printed with the times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import flashedu  # noqa: F401  (before triton: it decides whether Triton is interpreted)
import triton
import triton.language as tl


@triton.jit
def _halves(seed, offset, bh, rows, groups):
    """The 16-bit halves of one Philox call's four words per (row, group), shape
    (rows, groups, 2, 2, 2): 8 values per call, counters as the shipped stream's."""
    zero = rows[:, None] * 0 + groups[None, :] * 0
    c3 = (offset & 0xFFFFFFFF).to(tl.uint32) + zero.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, groups[None, :] + zero, rows[:, None] + zero, bh + zero,
                               c3, 7)
    a = tl.join(tl.join(r0 & 0xFFFF, r0 >> 16), tl.join(r1 & 0xFFFF, r1 >> 16))
    b = tl.join(tl.join(r2 & 0xFFFF, r2 >> 16), tl.join(r3 & 0xFFFF, r3 >> 16))
    return tl.join(a, b)


@triton.jit
def keep16(seed, offset, bh, rows, start_n, threshold, Bc: tl.constexpr):
    """8 entries per Philox call: the 16-bit halves of its four words."""
    w = _halves(seed, offset, bh, rows, start_n // 8 + tl.arange(0, Bc // 8))
    return tl.reshape(w, (rows.shape[0], Bc)).to(tl.int32) >= (threshold >> 15)


@triton.jit
def keep8(seed, offset, bh, rows, start_n, threshold, Bc: tl.constexpr):
    """16 entries per Philox call: the bytes of its four words."""
    w = _halves(seed, offset, bh, rows, start_n // 16 + tl.arange(0, Bc // 16))
    r = tl.reshape(tl.join(w & 0xFF, w >> 8), (rows.shape[0], Bc))
    return r.to(tl.int32) >= (threshold >> 23)


def one(which: str) -> dict:
    import torch
    from triton.testing import do_bench

    import flashedu
    from flashedu.triton import backward, fast, forward

    if which in ("keep16", "keep8"):  # the kernels read keep_tile from here when they compile
        forward.keep_tile = backward.keep_tile = globals()[which]
    if which == "small_tiles":
        from flashedu.triton import config
        from flashedu.triton.config import KernelConfig, Tiles

        config.GPU_16BIT[128] = KernelConfig(Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 2),
                                             Tiles(64, 64, 4, 2), fused_backward=False)
        config.GPU_16BIT[64] = KernelConfig(Tiles(64, 64, 4, 3), Tiles(32, 64, 4, 3),
                                            Tiles(64, 64, 4, 3), fused_backward=False)
    res = {"variant": which}
    for d, causal in ((128, False), (128, True), (64, False)):
        B, H, N = 4, 2048 // d, 4096
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        for p in ((0.0, 0.1) if which == "shipped" else (0.1,)):
            f = lambda: flashedu.attention(q, k, v, is_causal=causal, dropout_p=p,  # noqa: E731
                                           backend="triton")
            o = f()
            g = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # noqa: E731
            g()
            for name, fn in (("fwd", f), ("bwd", g)):
                ms = do_bench(fn, warmup=30, rep=200, return_mode="median")
                res[f"d{d} causal={causal} p={p} {name} ms"] = round(ms, 4)
    res["kernels (name, register cap, registers, spills)"] = [
        (n, c.get("maxnreg"), k.n_regs, k.n_spills) for n, c, k in fast.compiled_kernels()]
    return res


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print("RESULT", json.dumps(one(sys.argv[2])), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure (the CPU tests are tests/test_dropout.py)")
        return 0
    rows = []
    # a process each: the kernels compile afresh
    for which in ("shipped", "keep16", "keep8", "small_tiles"):
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", which],
                             capture_output=True, text=True)
        line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
        rows.append(json.loads(line[0][7:]) if line else {"variant": which,
                                                          "error": run.stderr[-300:]})
        print(rows[-1], flush=True)
    with open("gpu_dropout_rng.json", "w") as f:
        json.dump(rows, f, indent=1)
    print("wrote gpu_dropout_rng.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
