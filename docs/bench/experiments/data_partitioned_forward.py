"""Experiment: a data-partitioned forward. One program owns HALVES independent Q sub-tiles
(each with its own m_i, l_i, O_i) that share every K_j, V_j load; with Triton's warp
specialization the two sub-tiles' chains (dot, softmax, dot) are independent, which lets the
two consumer warpgroups take turns (FA3's ping-pong) if the partitioner splits them.
Production softmax step; TMA K/V; contiguous (B, H, N, d), N % BM == 0."""

import json
import os
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashedu
from flashedu.triton import fast
from flashedu.triton.forward import LOG2E, _softmax_step, _store_output
from flashedu.triton.tiles import kv_tiles, masked_tile

fast.ensure_allocator()


@triton.jit
def dp_kernel(
    Q,
    K,
    V,
    O,
    L,
    qk_scale,
    H,
    N,
    BM: tl.constexpr,
    Bc: tl.constexpr,
    D: tl.constexpr,
    HALVES: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WS: tl.constexpr,
    DAMB: tl.constexpr = False,
):
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    HM: tl.constexpr = BM // HALVES
    base = bh.to(tl.int64) * N * D
    K_d = tl.make_tensor_descriptor(K + base, [N, D], [D, 1], [Bc, D])
    V_d = tl.make_tensor_descriptor(V + base, [N, D], [D, 1], [Bc, D])
    Q_d = tl.make_tensor_descriptor(Q + base, [N, D], [D, 1], [HM, D])
    dims = tl.arange(0, D)
    rows0 = i * BM + tl.arange(0, HM)
    q0 = Q_d.load([i * BM, 0])
    m0 = tl.full([HM], float("-inf"), dtype=tl.float32)
    l0 = tl.zeros([HM], dtype=tl.float32)
    o0 = tl.zeros([HM, D], dtype=tl.float32)
    if HALVES == 2:
        rows1 = rows0 + HM
        q1 = Q_d.load([i * BM + HM, 0])
        m1 = tl.full([HM], float("-inf"), dtype=tl.float32)
        l1 = tl.zeros([HM], dtype=tl.float32)
        o1 = tl.zeros([HM, D], dtype=tl.float32)
    num, num_full, u0, a0, na, b0, idx_row = kv_tiles(
        i, b, h, None, None, None, 0, 0, 0, 0, 0, N, N, BM, Bc, IS_CAUSAL, False
    )
    for t in tl.range(0, num_full, warp_specialize=WS, disallow_acc_multi_buffer=DAMB):
        start_n = (u0 + t) * Bc
        K_j = K_d.load([start_n, 0])
        V_j = V_d.load([start_n, 0])
        cols = start_n + tl.arange(0, Bc)
        o0, l0, m0 = _softmax_step(
            o0, l0, m0, q0, K_j, V_j, cols, rows0, N, qk_scale, IS_CAUSAL, False, "tf32"
        )
        if HALVES == 2:
            o1, l1, m1 = _softmax_step(
                o1, l1, m1, q1, K_j, V_j, cols, rows1, N, qk_scale, IS_CAUSAL, False, "tf32"
            )
    if IS_CAUSAL:
        for t in range(num_full, num):
            start_n = masked_tile(t, num_full, a0, na, b0, idx_row, False) * Bc
            K_j = K_d.load([start_n, 0])
            V_j = V_d.load([start_n, 0])
            cols = start_n + tl.arange(0, Bc)
            o0, l0, m0 = _softmax_step(
                o0, l0, m0, q0, K_j, V_j, cols, rows0, N, qk_scale, IS_CAUSAL, True, "tf32"
            )
            if HALVES == 2:
                o1, l1, m1 = _softmax_step(
                    o1, l1, m1, q1, K_j, V_j, cols, rows1, N, qk_scale, IS_CAUSAL, True, "tf32"
                )
    ok0 = rows0[:, None] < N
    dim_ok = dims[None, :] < D
    _store_output(o0, l0, m0, O, L, b, h, bh, rows0, dims, ok0, dim_ok, N, H * N * D, N * D, D)
    if HALVES == 2:
        _store_output(
            o1,
            l1,
            m1,
            O,
            L,
            b,
            h,
            bh,
            rows1,
            dims,
            rows1[:, None] < N,
            dim_ok,
            N,
            H * N * D,
            N * D,
            D,
        )


def run_dp(q, k, v, causal, BM, Bc, halves, warps, stages, ws, maxnreg=None, damb=False):
    B, H, N, d = q.shape
    o = torch.empty_like(q)
    L = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    dp_kernel[(N // BM, B * H)](
        q,
        k,
        v,
        o,
        L,
        d**-0.5 * LOG2E,
        H,
        N,
        BM=BM,
        Bc=Bc,
        D=d,
        HALVES=halves,
        IS_CAUSAL=causal,
        WS=ws,
        DAMB=damb,
        num_warps=warps,
        num_stages=stages,
        **extra,
    )
    return o


VARIANTS = {  # d -> (BM, Bc, halves, warps, stages, ws, maxnreg, disallow_acc_multi_buffer)
    128: [
        (128, 128, 1, 8, 3, True, None, False),
        (256, 128, 2, 4, 2, True, None, False),
        (256, 128, 2, 4, 2, True, None, True),
        (256, 128, 2, 4, 2, False, None, False),
        (256, 64, 2, 4, 3, True, None, True),
        (256, 64, 2, 4, 2, True, None, True),
        (256, 128, 2, 4, 2, True, 168, True),
        (128, 64, 2, 4, 3, True, None, True),
    ],
}


def main():
    rows = []
    out = os.environ.get("OUT", ".")
    for d, B, H in ((128, 2, 16),):
        N = 8192
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(3)
        )
        for causal in (False, True):
            flops = 4 * B * H * N * N * d * (0.5 if causal else 1.0)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                t_cudnn = do_bench(
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                )
            t_prod = do_bench(
                lambda: flashedu.attention(q, k, v, is_causal=causal, backend="triton")
            )
            base = {"d": d, "B": B, "H": H, "N": N, "causal": causal}
            rows.append(
                {**base, "variant": "cudnn", "ms": t_cudnn, "tflops": flops / t_cudnn / 1e9}
            )
            rows.append(
                {**base, "variant": "production", "ms": t_prod, "tflops": flops / t_prod / 1e9}
            )
            print(
                f"d={d} causal={causal}: cudnn {t_cudnn:.3f} ms ({flops / t_cudnn / 1e9:.0f} TF), "
                f"production {t_prod:.3f} ms ({flops / t_prod / 1e9:.0f} TF)",
                flush=True,
            )
            for var in VARIANTS[d]:
                BM, Bc, halves, warps, stages, ws, maxnreg, damb = var
                name = (
                    f"BM{BM} Bc{Bc} halves{halves} w{warps} s{stages}"
                    + (" WS" if ws else "")
                    + (f" r{maxnreg}" if maxnreg else "")
                    + (" damb" if damb else "")
                )
                row = {**base, "variant": name}
                t0 = time.time()
                try:
                    o = run_dp(q, k, v, causal, *var)
                    torch.cuda.synchronize()
                    row["err"] = (o.float() - ref.float()).abs().max().item()
                    ms = do_bench(lambda: run_dp(q, k, v, causal, *var))
                    row.update(
                        ms=ms, tflops=flops / ms / 1e9, vs_prod=t_prod / ms, vs_cudnn=t_cudnn / ms
                    )
                    print(
                        f"  {name}: {ms:.3f} ms {flops / ms / 1e9:.0f} TF vs prod {t_prod / ms:.2f}x "
                        f"vs cudnn {t_cudnn / ms:.2f}x err {row['err']:.3g} ({time.time() - t0:.0f}s)",
                        flush=True,
                    )
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"  {name}: FAILED {row['error'][:300]}", flush=True)
                rows.append(row)
                with open(f"{out}/dp.json", "w") as f:
                    json.dump(
                        {
                            "device": torch.cuda.get_device_name(),
                            "commit": os.environ.get("GIT_COMMIT"),
                            "rows": rows,
                        },
                        f,
                        indent=1,
                    )


if __name__ == "__main__":
    main()
