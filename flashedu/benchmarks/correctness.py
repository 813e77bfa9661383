"""Correctness of the triton backend at real sizes, on a CUDA GPU.

The rule of :mod:`flashedu.tolerance` (as tests/test_attention.py): error against a float64
reference at most 2x (forward) or 3x (gradients) the error of plain PyTorch attention in the
same dtype, plus a small floor. Also: backward determinism (two runs bit-identical under
``torch.use_deterministic_algorithms(True)``, which is what flashedu promises: by default the
Hopper backward adds dQ's shares in the order its programs arrive), zeros for
fully masked rows, and the slower variants of flashedu/triton/ablations.py against the
production kernels (notebook 10 times them, so they must compute the same thing), and
packed batches of uneven sequences (``varlen_attention``) against each sequence alone.

    flashedu bench correctness              # all cases
    flashedu bench correctness --smoke      # two tiny cases (on a CPU: Triton's interpreter)
    compute-sanitizer --tool memcheck python3 -m flashedu.bench correctness --sanitize
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

import flashedu
from flashedu import tolerance
from flashedu.reference import naive_attention_torch, reference_attention

from . import core

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32

# (B, H, Hkv, Nq, Nk, d, dtype, causal, mask): mask None, or (density, block size, seed)
CASES = [
    (1, 2, 2, 16384, 16384, 128, bf16, True, None),
    (1, 1, 1, 16384, 16384, 64, bf16, False, None),
    (2, 4, 4, 4096, 4096, 64, bf16, False, None),
    (1, 2, 2, 4096, 4096, 256, bf16, True, None),
    (1, 2, 2, 2048, 2048, 256, bf16, False, None),
    (2, 8, 2, 1000, 1531, 128, bf16, True, None),  # GQA, odd sizes, Nq < Nk
    (1, 4, 1, 777, 333, 80, fp16, True, None),  # MQA, Nq > Nk, padded head dim
    (1, 2, 2, 1111, 999, 40, bf16, False, None),
    (1, 2, 2, 1500, 1500, 96, fp16, True, None),
    (2, 4, 2, 4096, 4096, 128, bf16, False, (0.25, 128, 0)),  # block-sparse, GQA
    (1, 2, 2, 4096, 4096, 64, bf16, True, (0.5, 128, 1)),  # block-sparse and causal
    (1, 2, 2, 3000, 2900, 128, bf16, False, (0.3, 64, 2)),  # odd sizes, 64x64 blocks
    (1, 2, 2, 2048, 2048, 64, bf16, False, (0.2, 256, 3)),  # mask block > kernel tile
    (1, 2, 2, 1024, 1024, 64, fp32, True, None),
    (1, 1, 1, 600, 477, 128, fp32, False, None),
]
# --smoke: a few tiny cases (on a CPU: in Triton's interpreter), to check this benchmark itself
SMOKE = [(1, 2, 1, 50, 40, 40, fp16, True, None), (1, 2, 2, 64, 64, 32, fp32, False, (0.5, 32, 0))]

# Packed batches (varlen_attention, the kernels reading the cuts): (query lengths, key lengths
# or None for the same cuts, H, Hkv, d, dtype, causal). Empty sequences, sequences ending
# inside a tile, more keys than queries and more queries than keys (bottom-right causal: the
# first rows see nothing).
PACKED = [
    ([1000, 37, 2500, 0, 700], None, 8, 2, 128, bf16, True),
    ([300, 1200, 64, 2049], [1500, 900, 64, 17], 4, 4, 64, fp16, True),
    ([513, 0, 1800], [77, 1300, 1800], 4, 1, 96, bf16, False),
]
PACKED_SMOKE = [([20, 0, 45], [30, 5, 40], 2, 1, 16, fp32, True)]


def random_mask(Nq, Nk, density, block, seed, H):
    """Per-head random tiles; some Q rows get none (fully masked rows must give zeros)."""
    rng = np.random.default_rng(seed)
    Tr, Tc = -(-Nq // block), -(-Nk // block)
    blocks = rng.random((1, H, Tr, Tc)) < density
    blocks[:, :, 0] = False  # the first Q tile sees nothing
    return flashedu.BlockMask.from_dense(blocks, (block, block), (Nq, Nk))


err = tolerance.max_error


def deterministic(gradients) -> bool:
    """Whether ``gradients()`` gives the same tensors bit for bit twice under
    ``torch.use_deterministic_algorithms(True)`` (warnings only, for other ops)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        first, second = gradients(), gradients()
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    return all(torch.equal(a, b) for a, b in zip(first, second))


def check(case, device="cuda") -> tuple[list[str], str]:
    """(failures, summary of errors) of one case on ``device``."""
    B, H, Hkv, Nq, Nk, d, dtype, causal, mask = case
    torch.manual_seed(hash(case[:6]) % 2**31)
    q = torch.randn(B, H, Nq, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Nk, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Nk, d, device=device, dtype=dtype, requires_grad=True)
    bm = None if mask is None else random_mask(Nq, Nk, *mask, H)
    kw = dict(is_causal=causal, block_mask=bm, enable_gqa=True)
    out = flashedu.attention(q, k, v, backend="triton", **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    fails = []
    if not deterministic(lambda: torch.autograd.grad(
            flashedu.attention(q, k, v, backend="triton", **kw), (q, k, v), dout)):
        fails.append("backward not deterministic")
    # The references, one head at a time when large (the float64 N x N scores are big).
    errs = {n: [0.0, 0.0] for n in ("out", "dq", "dk", "dv")}
    group = H // Hkv
    for b in range(B):
        for h in range(H):
            sl = (slice(b, b + 1), slice(h, h + 1))
            kv = (slice(b, b + 1), slice(h // group, h // group + 1))
            qs = q.detach()[sl].requires_grad_()
            ks, vs = (t.detach()[kv].requires_grad_() for t in (k, v))
            bmh = None if bm is None else flashedu.BlockMask(bm.blocks[:, h:h + 1], bm.block_size,
                                                             bm.seq_lens, bm.is_causal)
            kwh = dict(is_causal=causal, block_mask=bmh)
            ref = reference_attention(qs, ks, vs, **kwh)
            plain = naive_attention_torch(qs, ks, vs, upcast=False, **kwh)
            g_ref = torch.autograd.grad(ref, (qs, ks, vs), dout[sl].double())
            g_plain = torch.autograd.grad(plain, (qs, ks, vs), dout[sl])
            mine = (out[sl], grads[0][sl], grads[1][kv], grads[2][kv])
            for n, m, r, p in zip(errs, mine, (ref, *g_ref), (plain, *g_plain)):
                if n in ("dk", "dv") and group > 1:
                    continue  # a shared K/V head sums its group: checked below
                errs[n][0] = max(errs[n][0], err(m, r))
                errs[n][1] = max(errs[n][1], err(p, r))
            del ref, plain, g_ref, g_plain
    if group > 1:  # dK, dV of grouped heads against expanded-head references
        ke, ve = (t.detach().repeat_interleave(group, 1).requires_grad_() for t in (k, v))
        qd = q.detach().requires_grad_()
        ref = reference_attention(qd, ke, ve, **{**kw, "enable_gqa": False})
        g = torch.autograd.grad(ref, (ke, ve), dout.double())
        plain = naive_attention_torch(qd, ke, ve, upcast=False, **{**kw, "enable_gqa": False})
        gp = torch.autograd.grad(plain, (ke, ve), dout)
        for n, mine, r, p in zip(("dk", "dv"), grads[1:], g, gp):
            r = r.unflatten(1, (Hkv, group)).sum(2)
            p = p.float().unflatten(1, (Hkv, group)).sum(2)
            errs[n] = [err(mine, r), err(p, r)]
    fails += over_allowance(errs, dtype)
    if bm is not None:
        dead = torch.as_tensor(~bm.element_mask().any(-1)).to(device).expand(B, H, Nq)
        if out.detach()[dead].abs().max().item() != 0 or grads[0][dead].abs().max().item() != 0:
            fails.append("fully masked rows are not zero")
    summary = errors_text(errs)
    return fails, summary


def over_allowance(errs: dict, dtype) -> list[str]:
    """The failures among ``errs`` ({"out" | "dq" | ...: [error, PyTorch's error]}): errors
    past the rule of :mod:`flashedu.tolerance` (2x PyTorch's forward, 3x its gradients)."""
    fails = []
    for n, (e, base) in errs.items():
        f = tolerance.FORWARD if n == "out" else tolerance.GRADIENT
        limit = tolerance.allowed_error(dtype, base, factor=f, floor_scale=1 if n == "out" else f)
        if not e <= limit:
            fails.append(f"{n} error {e:.3g} > {limit:.3g} (PyTorch's {base:.3g})")
    return fails


def errors_text(errs: dict) -> str:
    """``errs`` as the table prints them: name=error/PyTorch's error."""
    return " ".join(f"{n}={e:.2e}/{b:.2e}" for n, (e, b) in errs.items())


def check_packed(case, device="cuda") -> tuple[list[str], str]:
    """(failures, summary of errors) of one packed batch: varlen_attention's output and
    gradients against each sequence attended to alone in float64, by the same rule as
    :func:`check`, and its backward run twice bit for bit."""
    lengths_q, lengths_k, H, Hkv, d, dtype, causal = case
    lengths_k = lengths_q if lengths_k is None else lengths_k
    torch.manual_seed(sum(lengths_q) + d)
    cu_q, cu_k = (torch.tensor([0, *np.cumsum(n).tolist()], dtype=torch.int32, device=device)
                  for n in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q), H, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), Hkv, d, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))

    def call():
        return flashedu.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                         is_causal=causal, backend="triton")

    out = call()
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    fails = []
    if not deterministic(lambda: torch.autograd.grad(call(), (q, k, v), dout)):
        fails.append("backward not deterministic")
    errs = {n: [0.0, 0.0] for n in ("out", "dq", "dk", "dv")}
    for s in range(len(lengths_q)):
        a, b = int(cu_q[s]), int(cu_q[s + 1])
        c, e = int(cu_k[s]), int(cu_k[s + 1])
        if a == b:
            continue
        as_batch = (lambda t, lo, hi: t.detach()[lo:hi].transpose(0, 1)[None].requires_grad_())
        qs, ks, vs = as_batch(q, a, b), as_batch(k, c, e), as_batch(v, c, e)
        kw = dict(enable_gqa=True)
        if causal:  # flash-attn's: aligned to the sequence's bottom right
            n_q, n_k = b - a, e - c
            rule = flashedu.mods.causal("bottom_right", seq_lens=(n_q, n_k))
            kw["attn_mask"] = rule(0, 0, torch.arange(n_q, device=device)[:, None],
                                   torch.arange(n_k, device=device)[None, :])
        ref = reference_attention(qs, ks, vs, **kw)
        plain = naive_attention_torch(qs, ks, vs, upcast=False, **kw)
        back = lambda t: t[0].transpose(0, 1)  # noqa: E731 - (1, H, n, d) -> (n, H, d)
        d_out = dout[a:b].transpose(0, 1)[None]
        g_ref = torch.autograd.grad(ref, (qs, ks, vs), d_out.double())
        g_plain = torch.autograd.grad(plain, (qs, ks, vs), d_out)
        mine = (out[a:b], grads[0][a:b], grads[1][c:e], grads[2][c:e])
        for n, m, r, p in zip(errs, mine, (ref, *g_ref), (plain, *g_plain)):
            errs[n][0] = max(errs[n][0], err(m, back(r)))
            errs[n][1] = max(errs[n][1], err(back(p), back(r)))
    fails += over_allowance(errs, dtype)
    return fails, errors_text(errs)


def sanitize(device="cuda") -> None:
    """One small odd-sized forward and backward (one launch of each kernel), for memcheck."""
    torch.manual_seed(0)
    q = torch.randn(1, 3, 77, 40, device=device, dtype=bf16, requires_grad=True)
    k = torch.randn(1, 1, 45, 40, device=device, dtype=bf16, requires_grad=True)
    v = torch.randn(1, 1, 45, 40, device=device, dtype=bf16, requires_grad=True)
    for causal in (False, True):
        out = flashedu.attention(q, k, v, is_causal=causal, enable_gqa=True, backend="triton")
        out.backward(torch.randn_like(out))
    bm = flashedu.BlockMask.from_dense(np.array([[1], [0], [1]], bool), (32, 64), (77, 45))
    out = flashedu.attention(q, k, v, block_mask=bm, enable_gqa=True, backend="triton")
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print("sanitize run done")


def check_ablations(device="cuda") -> list[str]:
    """Each variant of ablations.py against the production kernel it is measured against."""
    from flashedu import runtime
    from flashedu.ops import Call
    from flashedu.triton import ablations
    from flashedu.triton.config import kernel_config
    from flashedu.triton.launch import backward, forward

    interpreted = runtime.triton_interpreted()
    fails = []
    for n, d, dtype in ((1000, 128, bf16), (777, 64, fp16)) if device == "cuda" else \
            ((50, 40, fp16),):
        torch.manual_seed(n)
        q, do = (torch.randn(2, 4, n, d, device=device, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(2, 2, n, d, device=device, dtype=dtype) for _ in range(2))
        cfg = kernel_config(d, False, interpreted)
        for causal in (False, True):
            kw = dict(is_causal=causal, scale=d ** -0.5, interpreted=interpreted)
            call = Call(causal, d ** -0.5)
            O, L = forward(q, k, v, call, tiles=cfg.forward, interpreted=interpreted)
            grads = backward(q, k, v, O, L, do, call, config=cfg, interpreted=interpreted)
            got = {"natural_exp": ablations.forward(q, k, v, tiles=cfg.forward, natural_exp=True,
                                                    **kw)[0],
                   "mask_every_tile": ablations.forward(q, k, v, tiles=cfg.forward,
                                                        mask_every_tile=True, **kw)[0]}
            for name, x in got.items():
                if err(x, O) > 2e-2:
                    fails.append(f"{name} d={d} causal={causal}: O differs by {err(x, O):.1e}")
            atomic = ablations.atomic_dq_backward(q, k, v, O, L, do, config=cfg, **kw)
            for name, x, y in zip(("dQ", "dK", "dV"), atomic, grads):
                rel = err(x, y) / y.double().abs().max().item()
                if rel > 2e-2:
                    fails.append(f"atomic dQ d={d} causal={causal}: {name} differs by {rel:.1e}")
    return fails


def case_name(case) -> str:
    """A case as the table and the JSON name it."""
    if len(case) == 7:  # a packed batch
        lengths_q, lengths_k, H, Hkv, d, dtype, causal = case
        keys = "" if lengths_k is None else f" keys {lengths_k}"
        return (f"packed {lengths_q}{keys} H={H} Hkv={Hkv} d={d} {str(dtype)[6:]} "
                f"causal={causal}")
    return (f"B={case[0]} H={case[1]} Hkv={case[2]} Nq={case[3]} Nk={case[4]} d={case[5]} "
            f"{str(case[6])[6:]} causal={case[7]} mask={case[8]}")


def parse_args(argv):
    p = core.parser("correctness", __doc__)
    p.add_argument("--sanitize", action="store_true", help="one small launch each, for memcheck")
    p.add_argument("--smoke", action="store_true",
                   help="two tiny cases (the only ones a CPU runs, in Triton's interpreter)")
    p.add_argument("--json", type=core.output_file, help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    gpu = core.gpu_available()
    if not gpu and (args.sanitize or not args.smoke):
        return core.needs_gpu("flashedu bench correctness (or --smoke for tiny cases on a CPU)")
    device, cases = ("cuda" if gpu else "cpu"), (SMOKE if args.smoke else CASES)
    if args.sanitize:
        sanitize(device)
        return 0
    env = core.environment(["correctness", *argv])
    print(core.headline(env))
    packed = PACKED_SMOKE if args.smoke else PACKED
    failed, rows = 0, []
    for run, case in [(check, c) for c in cases] + [(check_packed, c) for c in packed]:
        t = time.time()
        fails, summary = run(case, device)
        if gpu:
            torch.cuda.empty_cache()
        status = "FAIL " + "; ".join(fails) if fails else "ok"
        failed += bool(fails)
        print(f"{status:<4} {case_name(case)}  [{summary}]  {time.time() - t:.1f}s", flush=True)
        rows.append({"case": case_name(case), "failures": fails, "errors": summary})
    total = len(cases) + len(packed)
    print(f"{total - failed}/{total} cases passed")
    ablation_fails = check_ablations(device)
    print("ablations.py variants agree with the production kernels:",
          "; ".join(ablation_fails) if ablation_fails else "ok")
    if args.json:
        core.write_json(args.json, {**env, "cases": rows, "ablation_failures": ablation_fails})
    return 1 if failed or ablation_fails else 0
