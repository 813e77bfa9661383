"""The numba.cuda FlashAttention kernel on a real GPU: correctness, speed, memory, sanitizers.

    flashedu bench numba check        # correct at N up to 16K (and 64K by sampled rows)
    flashedu bench numba bench        # time and peak memory vs naive fp32 PyTorch
    flashedu bench numba sanitize     # memcheck + racecheck on a small odd size
    flashedu bench numba all --json docs/bench/numba_h100.json --log-dir bench-out

Every check draws fresh random inputs, poisons the outputs with NaN before the launch and compares
with a float64 reference: the error must be at most 2x that of naive PyTorch attention computed
in float32 (TF32 off), plus a floor of 1e-6. The naive baseline runs with
``torch.backends.cuda.matmul.allow_tf32 = False``: exact float32 products, as the kernel does.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import torch

import flashedu
from flashedu import numba_kernels as nk
from flashedu import tolerance

from . import core

BH = 16  # batch * heads of the performance table (B=1, H=16)
BENCH_N = (1024, 2048, 4096, 8192, 16384, 65536)
TARGET_SPEEDUP = 0.25  # numba vs naive fp32 at N = 4096, d = 64


# ----------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------


def naive(q, k, v, is_causal=False, mask=None, rows=None):
    """softmax(scale q k^T) v in q's dtype, per head (an N x N score matrix each). ``rows``
    restricts to some query rows; ``mask`` is a (H or 1, Nq, Nk) bool of visible pairs."""
    B, H, Nq, d = q.shape
    group = H // k.shape[1]
    rows = torch.arange(Nq, device=q.device) if rows is None else rows
    out = torch.empty(B, H, len(rows), d, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, len(rows), dtype=q.dtype, device=q.device)
    cols = torch.arange(k.shape[2], device=q.device)
    for b in range(B):
        for h in range(H):
            S = (q[b, h, rows] @ k[b, h // group].T) / math.sqrt(d)
            visible = torch.ones_like(S, dtype=torch.bool)
            if is_causal:
                visible &= cols[None, :] <= rows[:, None]
            if mask is not None:
                visible &= mask[h % mask.shape[0]][rows]
            S = S.masked_fill(~visible, -math.inf)
            lse[b, h] = torch.logsumexp(S, -1)
            P = torch.softmax(S, -1).nan_to_num(0.0)  # a row with no visible key: zeros
            out[b, h] = P @ v[b, h // group]
            del S, P, visible
    return out, lse


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(x), finite):
        return math.inf  # NaN (an unwritten element) or a wrong -inf
    return ((x - ref)[finite].norm() / ref[finite].norm().clamp_min(1e-30)).item()


def check_case(B, H, Hkv, Nq, Nk, d, is_causal=False, block_mask=None, sample_rows=None, seed=0,
               device="cuda"):
    """One case on ``device`` ("cpu": numba's simulator). Errors are relative (norms), so the
    floor is 1e-6 (5% of float32's floor for absolute errors)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, Nq, d, device=device, generator=g)
    k = torch.randn(B, Hkv, Nk, d, device=device, generator=g)
    v = torch.randn(B, Hkv, Nk, d, device=device, generator=g)
    out, L = nk.forward(q, k, v, is_causal=is_causal, block_mask=block_mask, poison=True)
    if device == "cuda":
        torch.cuda.synchronize()
    rows = None
    if sample_rows:
        rows = torch.randperm(Nq, generator=g, device=device)[:sample_rows].sort().values
        out, L = out[:, :, rows], L[:, :, rows]
    mask = None
    if block_mask is not None:
        mask = torch.from_numpy(block_mask.element_mask()).to(device)[0]
    ref, ref_L = naive(q.double(), k.double(), v.double(), is_causal, mask, rows)
    fp32, _ = naive(q, k, v, is_causal, mask, rows)
    err, err_fp32, err_L = rel_err(out, ref), rel_err(fp32, ref), rel_err(L, ref_L)
    limit = tolerance.allowed_error(torch.float32, err_fp32, floor_scale=0.05)
    ok = err <= limit and err_L <= 1e-5 and not torch.isnan(out).any().item()
    return {"B": B, "H": H, "Hkv": Hkv, "Nq": Nq, "Nk": Nk, "d": d, "causal": is_causal,
            "block_mask": None if block_mask is None else repr(block_mask),
            "sampled_rows": sample_rows, "rel_err": err, "rel_err_naive_fp32": err_fp32,
            "rel_err_L": err_L, "passed": bool(ok)}


def check():
    cases = [dict(B=1, H=4, Hkv=4, Nq=N, Nk=N, d=64) for N in (1024, 2048, 4096, 8192, 16384)]
    cases += [
        dict(B=1, H=4, Hkv=4, Nq=16384, Nk=16384, d=64, is_causal=True),
        dict(B=2, H=4, Hkv=2, Nq=1000, Nk=1000, d=40, is_causal=True),  # odd N, odd d, GQA
        dict(B=1, H=2, Hkv=1, Nq=3001, Nk=2999, d=128),  # d = 128, Nq != Nk
        dict(B=1, H=2, Hkv=2, Nq=777, Nk=1500, d=16, is_causal=True),
        dict(B=1, H=2, Hkv=2, Nq=4099, Nk=4099, d=3),
        dict(B=1, H=2, Hkv=2, Nq=2048, Nk=2048, d=64,  # a causal band of whole 128-tiles
             block_mask=flashedu.BlockMask.from_dense(
                 torch.ones(16, 16, dtype=torch.bool).tril().triu(-2).numpy(), (128, 128),
                 (2048, 2048), is_causal=True)),
        dict(B=1, H=2, Hkv=2, Nq=1000, Nk=1000, d=64,  # mask blocks the tiles do not divide
             block_mask=flashedu.BlockMask.from_dense(
                 torch.rand(12, 12, generator=torch.Generator().manual_seed(1)).numpy() < 0.5,
                 (90, 90), (1000, 1000))),
        dict(B=1, H=BH, Hkv=BH, Nq=65536, Nk=65536, d=64, sample_rows=256),
    ]
    results = []
    for i, c in enumerate(cases):
        r = check_case(**c, seed=i)
        results.append(r)
        print(f"check {'ok  ' if r['passed'] else 'FAIL'} B={r['B']} H={r['H']} Hkv={r['Hkv']} "
              f"Nq={r['Nq']} Nk={r['Nk']} d={r['d']} causal={r['causal']} "
              f"mask={'yes' if r['block_mask'] else 'no'} rows={r['sampled_rows'] or 'all'}: "
              f"err {r['rel_err']:.2e} (naive fp32 {r['rel_err_naive_fp32']:.2e}), "
              f"L err {r['rel_err_L']:.2e}", flush=True)
        torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------------------------------
# Performance
# ----------------------------------------------------------------------------------------


def measure(fn, inputs_bytes, reps):
    """(median ms of ``do_bench``, peak bytes of one call: the inputs plus what it allocates)
    or (None, 'OOM'). The peak comes from a call of its own: ``do_bench`` allocates a buffer
    to flush the L2 cache (256 MiB) that is not the kernel's."""
    torch.cuda.empty_cache()
    try:
        ms = core.time_ms(fn, warmup=1, rep=reps)
        torch.cuda.empty_cache()
        peak = core.peak_bytes(fn)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, "OOM"
    return ms, int(peak) + inputs_bytes


def numba_attention(q, k, v, causal):
    return nk.forward(q, k, v, is_causal=causal)


def naive_attention(q, k, v, causal):
    S = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        N = q.shape[2]
        S = S.masked_fill(torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(S, -1) @ v


def bench(d=64):
    rows = []
    for N in BENCH_N:
        for causal in (False, True) if N == 4096 else (False,):
            q, k, v = (torch.randn(1, BH, N, d, device="cuda") for _ in range(3))
            inputs = 3 * q.numel() * 4
            flops = 4 * BH * N * N * d * (0.5 if causal else 1.0)
            reps = 1 if N >= 32768 else 100  # do_bench's budget in ms (at least one run)
            t_nb, m_nb = measure(functools.partial(numba_attention, q, k, v, causal), inputs, reps)
            # naive needs BH * N^2 * 4 bytes for S alone (256 GiB at N = 65536): it may OOM
            t_nv, m_nv = measure(functools.partial(naive_attention, q, k, v, causal), inputs, reps)
            row = {"N": N, "d": d, "BH": BH, "causal": causal, "dtype": "float32",
                   "numba_ms": t_nb, "numba_tflops": flops / t_nb / 1e9 if t_nb else None,
                   "numba_peak_bytes": m_nb,
                   "naive_ms": t_nv, "naive_tflops": flops / t_nv / 1e9 if t_nv else None,
                   "naive_peak_bytes": m_nv,
                   "speed_vs_naive": t_nv / t_nb if (t_nv and t_nb) else None}
            rows.append(row)
            print(fmt_row(row), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def fmt_mem(m):
    return m if isinstance(m, str) else f"{m / 2**20:,.0f} MiB"


def fmt_row(r):
    nb = f"{r['numba_ms']:9.2f} ms {r['numba_tflops']:6.2f} TF" if r["numba_ms"] else "   failed"
    nv = f"{r['naive_ms']:9.2f} ms {r['naive_tflops']:6.2f} TF" if r["naive_ms"] else f"{r['naive_peak_bytes']:>19}"
    sp = f"{r['speed_vs_naive']:.2f}x" if r["speed_vs_naive"] else "-"
    return (f"| {r['N']:>6} | {'causal' if r['causal'] else 'full  '} | {nb} | "
            f"{fmt_mem(r['numba_peak_bytes']):>11} | {nv} | {fmt_mem(r['naive_peak_bytes']):>11} | {sp:>6} |")


TABLE_HEAD = ("|      N | mask   | numba time, TFLOPs          | numba peak  | naive fp32 time, TFLOPs     "
              "| naive peak  | speed  |\n|---|---|---|---|---|---|---|")


# ----------------------------------------------------------------------------------------
# compute-sanitizer
# ----------------------------------------------------------------------------------------


def sanitize_target(barriers: bool):
    """A small odd size, run under compute-sanitizer by :func:`sanitize` (a child process)."""
    r = check_case(2, 2, 1, 67, 53, 40, is_causal=True)
    assert r["passed"], r
    if not barriers:  # the broken kernel: racecheck must see the hazards it has
        q, k, v = (torch.randn(1, 2, 67, 40, device="cuda") for _ in range(3))
        nk.forward(q, k, v, barriers=False)
        torch.cuda.synchronize()
    print("sanitize target done")


def find_sanitizer():
    for path in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer",
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if path and os.path.exists(path):
            return path
    raise FileNotFoundError("compute-sanitizer not found on PATH or in /usr/local/cuda")


def sanitize(log_dir=None):
    tool = find_sanitizer()
    runs = [("memcheck", True), ("racecheck", True), ("racecheck", False)]
    results = []
    for name, barriers in runs:
        # numba's driver bindings probe for entry points the driver lacks (cuGetProcAddress
        # answers "invalid argument"): host API noise, not kernel errors, so not reported.
        cmd = [tool, "--tool", name, "--target-processes", "all", "--report-api-errors", "no",
               sys.executable, "-m", "flashedu.bench", "numba", "sanitize-target"]
        cmd += [] if barriers else ["--no-barriers"]
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        text = p.stdout + p.stderr
        label = f"{name}{'' if barriers else '_no_barriers'}"
        if log_dir:
            with open(os.path.join(log_dir, f"sanitizer_{label}.log"), "w") as f:
                f.write(" ".join(cmd) + "\n" + text)
        errors = re.search(r"ERROR SUMMARY: (\d+) error", text)
        hazards = re.search(r"RACECHECK SUMMARY: (\d+) hazard", text)
        r = {"tool": name, "barriers": barriers, "returncode": p.returncode,
             "errors": int(errors.group(1)) if errors else None,
             "hazards": int(hazards.group(1)) if hazards else None,
             "target_finished": "sanitize target done" in text, "seconds": round(time.time() - t0, 1)}
        if barriers:
            found = r["hazards"] if name == "racecheck" else r["errors"]
            r["clean"] = r["returncode"] == 0 and found == 0 and r["target_finished"]
        else:  # the deliberately broken kernel must be caught
            r["race_detected"] = bool(r["errors"]) or bool(r["hazards"])
        results.append(r)
        print(f"sanitizer {label}: {r}", flush=True)
    return results


# ----------------------------------------------------------------------------------------


def environment(argv):
    import numba
    tiles = nk.choose_tiles(64)
    kernel = nk.build_kernel(tiles, 64, True)  # the cached kernel that forward() launches
    info = core.environment(["numba", *argv], numba=numba.__version__,
                            sms=torch.cuda.get_device_properties(0).multi_processor_count,
                            tiles_d64={"Br": tiles.Br, "Bc": tiles.Bc, "TY": tiles.TY,
                                       "TX": tiles.TX, "TM": tiles.TM, "TN": tiles.TN},
                            sram_bytes_d64=nk.sram_bytes(tiles, 64))
    q = torch.randn(1, 1, 64, 64, device="cuda")
    nk.forward(q, q, q)  # compile, then read the compiler's resource report
    try:
        info["registers_per_thread"] = next(iter(kernel.get_regs_per_thread().values()))
        info["local_bytes_per_thread"] = next(iter(kernel.get_local_mem_per_thread().values()))
        info["shared_bytes_per_block"] = next(iter(kernel.get_shared_mem_per_block().values()))
    except Exception as exc:  # noqa: BLE001 - the report is informative only
        info["resource_report_error"] = repr(exc)
    return info


def parse_args(argv):
    p = core.parser("numba", __doc__)
    p.add_argument("mode", choices=["check", "bench", "sanitize", "all", "sanitize-target"])
    p.add_argument("--json", type=core.output_file, help="write the results here")
    p.add_argument("--log-dir", type=core.output_dir, help="write sanitizer logs here")
    p.add_argument("--no-barriers", action="store_true",
                   help="(sanitize-target) also run the broken kernel")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not core.gpu_available() or flashedu.runtime.numba_simulated():
        return core.needs_gpu("flashedu bench numba (with compiled numba: NUMBA_ENABLE_CUDASIM "
                              "unset)")
    # exact float32 products in the naive baseline, as the kernel computes them
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.mode == "sanitize-target":
        sanitize_target(not args.no_barriers)
        return 0
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    out = {"environment": environment(argv)}
    print(core.headline(out["environment"]), flush=True)
    if args.mode in ("check", "all"):
        out["check"] = check()
    if args.mode in ("bench", "all"):
        print(TABLE_HEAD, flush=True)
        out["bench"] = bench()
    if args.mode in ("sanitize", "all"):
        out["sanitize"] = sanitize(args.log_dir)
    summary = summarize(out)
    out["summary"] = summary
    if args.json:
        core.write_json(args.json, out)
    if "bench" in out:
        print("\n" + TABLE_HEAD)
        for r in out["bench"]:
            print(fmt_row(r))
    print(json.dumps(summary, indent=1))
    return 0 if all(v for k, v in summary.items() if k.endswith("_ok")) else 1


def summarize(out):
    s = {}
    if "check" in out:
        s["check_ok"] = all(r["passed"] for r in out["check"])
    if "bench" in out:
        r4k = next(r for r in out["bench"] if r["N"] == 4096 and not r["causal"])
        s["speed_vs_naive_4096"] = r4k["speed_vs_naive"]
        s["speed_target_ok"] = bool(r4k["speed_vs_naive"] and r4k["speed_vs_naive"] >= TARGET_SPEEDUP)
        big = [r for r in out["bench"] if r["naive_peak_bytes"] == "OOM" and r["numba_ms"]]
        s["runs_where_naive_ooms"] = [r["N"] for r in big]
    if "sanitize" in out:
        s["sanitizer_ok"] = all(r.get("clean", True) for r in out["sanitize"])
        s["race_detected_without_barriers"] = any(r.get("race_detected") for r in out["sanitize"])
    return s

