"""Experiment: the one-pass backward (FA2's atomics, FA3's layout): each dK/dV program also
adds dS_ij K_j into a float32 dQ through the copy engine's reduce (a TMA descriptor's
atomic_add, cp.reduce.async.bulk), so S_ij and dP_ij are computed once (5 matmuls, not 7).
Dense, non-causal or causal, N % 128 == 0, contiguous. Timed against the production backward
and cuDNN's, each as the backward of one retained forward."""

import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashedu
from flashedu.triton import fast
from flashedu.triton.forward import LOG2E

fast.ensure_allocator()


@triton.jit
def bwd_one_pass(
    Q,
    K,
    V,
    dO,
    L,
    D,
    dQ32,
    dK,
    dV,
    qk_scale,
    scale,
    N,
    Br: tl.constexpr,
    Bc: tl.constexpr,
    HD: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    TMA_LOADS: tl.constexpr,
):
    j = tl.program_id(0)
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * N * HD
    cols = j * Bc + tl.arange(0, Bc)
    dims = tl.arange(0, HD)
    K_j = tl.load(K + base + cols[:, None] * HD + dims[None, :])
    V_j = tl.load(V + base + cols[:, None] * HD + dims[None, :])
    dK_j = tl.zeros([Bc, HD], dtype=tl.float32)
    dV_j = tl.zeros([Bc, HD], dtype=tl.float32)
    dQ_d = tl.make_tensor_descriptor(dQ32 + base, [N, HD], [HD, 1], [Br, HD])
    Q_d = tl.make_tensor_descriptor(Q + base, [N, HD], [HD, 1], [Br, HD])
    dO_d = tl.make_tensor_descriptor(dO + base, [N, HD], [HD, 1], [Br, HD])
    start = 0
    if IS_CAUSAL:
        start = (j * Bc) // Br
    for i in range(start, N // Br):
        rows = i * Br + tl.arange(0, Br)
        if TMA_LOADS:
            Q_i = Q_d.load([i * Br, 0])
            dO_i = dO_d.load([i * Br, 0])
        else:
            Q_i = tl.load(Q + base + rows[:, None] * HD + dims[None, :])
            dO_i = tl.load(dO + base + rows[:, None] * HD + dims[None, :])
        L_i = tl.load(L + bh * N + rows)
        D_i = tl.load(D + bh * N + rows)
        S_T = tl.dot(K_j, tl.trans(Q_i))
        P_T = tl.math.exp2(S_T * qk_scale - L_i[None, :])
        if IS_CAUSAL:
            P_T = tl.where(cols[:, None] <= rows[None, :], P_T, 0.0)
        dV_j += tl.dot(P_T.to(dO_i.dtype), dO_i)
        dP_T = tl.dot(V_j, tl.trans(dO_i))
        dS_T = (P_T * (dP_T - D_i[None, :])).to(Q_i.dtype)
        dK_j += tl.dot(dS_T, Q_i)
        dQ_i = tl.dot(tl.trans(dS_T), K_j)
        dQ_d.atomic_add([i * Br, 0], dQ_i)
    tl.store(dK + base + cols[:, None] * HD + dims[None, :], (dK_j * scale).to(dK.dtype.element_ty))
    tl.store(dV + base + cols[:, None] * HD + dims[None, :], dV_j.to(dV.dtype.element_ty))


def one_pass(q, k, v, o, lse2, do, causal, Br, Bc, warps, stages, tma_loads):
    B, H, N, d = q.shape
    D = (o.float() * do.float()).sum(-1)
    dq32 = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    bwd_one_pass[(N // Bc, B * H)](
        q,
        k,
        v,
        do,
        lse2,
        D,
        dq32,
        dk,
        dv,
        d**-0.5 * LOG2E,
        d**-0.5,
        N,
        Br=Br,
        Bc=Bc,
        HD=d,
        IS_CAUSAL=causal,
        TMA_LOADS=tma_loads,
        num_warps=warps,
        num_stages=stages,
    )
    return (dq32 * d**-0.5).to(q.dtype), dk, dv


VARIANTS = [
    (64, 128, 8, 2, False),
    (64, 128, 8, 2, True),
    (64, 128, 8, 3, True),
    (32, 128, 8, 2, True),
    (64, 64, 4, 2, True),
    (128, 128, 8, 2, True),
    (64, 128, 4, 2, True),
]


def main():
    from flashedu.triton.config import kernel_config
    from flashedu.triton.launch import forward

    rows, out = [], os.environ.get("OUT", ".")
    for d, B, H, N in ((128, 2, 16, 8192), (128, 4, 16, 4096), (64, 4, 16, 8192)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (
            torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(4)
        )
        for causal in (False, True):
            fl = 2.5 * 4 * B * H * N * N * d * (0.5 if causal else 1.0)
            base = dict(d=d, B=B, H=H, N=N, causal=causal)
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                oc = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                t_c = do_bench(lambda: torch.autograd.grad(oc, (qq, kk, vv), do, retain_graph=True))
            of = flashedu.attention(qq, kk, vv, is_causal=causal, backend="triton")
            ref = torch.autograd.grad(of, (qq, kk, vv), do, retain_graph=True)
            t_p = do_bench(lambda: torch.autograd.grad(of, (qq, kk, vv), do, retain_graph=True))
            print(
                f"d={d} N={N} causal={causal}: cudnn {t_c:.3f} ms ({fl / t_c / 1e9:.0f} TF), "
                f"production {t_p:.3f} ms ({fl / t_p / 1e9:.0f} TF)",
                flush=True,
            )
            rows += [
                {**base, "variant": "cudnn", "ms": t_c},
                {**base, "variant": "production", "ms": t_p},
            ]
            o, lse2 = forward(
                q,
                k,
                v,
                is_causal=causal,
                scale=d**-0.5,
                block_mask=None,
                tiles=kernel_config(d, False, False).forward_tiles(None, N),
                interpreted=False,
            )
            for var in VARIANTS:
                name = "Br{} Bc{} w{} s{}{}".format(*var[:4], " tma" if var[4] else "")
                row = {**base, "variant": name}
                try:
                    got = one_pass(q, k, v, o, lse2, do, causal, *var)
                    torch.cuda.synchronize()
                    row["err"] = max(
                        (a.float() - b.float()).abs().max().item() for a, b in zip(got, ref)
                    )
                    ms = do_bench(lambda: one_pass(q, k, v, o, lse2, do, causal, *var))
                    row.update(ms=ms, tflops=fl / ms / 1e9, vs_prod=t_p / ms, vs_cudnn=t_c / ms)
                    print(
                        f"  {name}: {ms:.3f} ms {fl / ms / 1e9:.0f} TF vs prod {t_p / ms:.2f}x "
                        f"vs cudnn {t_c / ms:.2f}x err {row['err']:.3g}",
                        flush=True,
                    )
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"  {name}: FAILED {row['error'][:200]}", flush=True)
                rows.append(row)
                json.dump(
                    {
                        "device": torch.cuda.get_device_name(),
                        "commit": os.environ.get("GIT_COMMIT"),
                        "rows": rows,
                    },
                    open(f"{out}/bwd_atomic.json", "w"),
                    indent=1,
                )


if __name__ == "__main__":
    main()
