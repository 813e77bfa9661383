"""``flashedu tour``: every stage of the course on one small problem, checked and timed.

Each available backend computes the same causal GQA attention, forward and (where it has one)
backward; each result is compared with a float64 reference and the table says whether it
passed. On a laptop the GPU backends run emulated, so the problem is small.
"""

from __future__ import annotations

import json
import time

import torch

from . import runtime
from .api import attention
from .backends import BACKENDS, available_backends
from .reference import reference_attention

# Small enough for the numba simulator and the Triton interpreter on a 2-core CPU.
CPU_PROBLEM = dict(B=1, H=4, Hkv=2, N=48, d=32)
GPU_PROBLEM = dict(B=2, H=8, Hkv=2, N=1024, d=64)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-3, torch.float16: 1e-2}


def _problem(gpu: bool):
    p = GPU_PROBLEM if gpu else CPU_PROBLEM
    g = torch.Generator().manual_seed(0)
    shapes = [(p["B"], p["H"], p["N"], p["d"])] + [(p["B"], p["Hkv"], p["N"], p["d"])] * 2
    return p, [torch.randn(s, generator=g, dtype=torch.float32) for s in shapes]


def _run_backend(name, q, k, v, device):
    q, k, v = (t.to(device).requires_grad_(BACKENDS[name].has_backward) for t in (q, k, v))
    t0 = time.perf_counter()
    out = attention(q, k, v, is_causal=True, enable_gqa=True, backend=name)
    grads = None
    if BACKENDS[name].has_backward:
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, grads, time.perf_counter() - t0


def _errors(out, grads, q, k, v):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, is_causal=True, enable_gqa=True)
    err = [(out.cpu().double() - ref).abs().max().item()]
    if grads is not None:
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), torch.ones_like(ref))
        err += [(g.cpu().double() - r).abs().max().item() for g, r in zip(grads, ref_grads)]
    return err


def run_tour(json_path=None) -> int:
    """Print the table; also write it to ``json_path`` (numbers as JSON numbers, null where a
    backend did not run). Returns 0 when every available backend agreed, else 1."""
    cfg = runtime.configure()
    p, (q, k, v) = _problem(cfg["gpu"])
    print(f"flashedu tour: causal GQA attention, B={p['B']} H={p['H']} Hkv={p['Hkv']} "
          f"N={p['N']} d={p['d']}, float32, checked against float64")
    rows, failed = [], 0
    for name, status in available_backends().items():
        spec = BACKENDS[name]
        if status is not None:
            rows.append(dict(backend=name, runs_on="-", forward="unavailable", backward="-",
                             max_err=None, seconds=None, ok=None, note=status[:60]))
            continue
        device = torch.device("cuda") if cfg["gpu"] and name != "numpy" else torch.device("cpu")
        try:
            out, grads, secs = _run_backend(name, q, k, v, device)
            errs = _errors(out, grads, q, k, v)
            ok = max(errs) < TOLERANCE[torch.float32]
            rows.append(dict(backend=name, runs_on=spec.where(), forward="yes",
                             backward="yes" if grads is not None else "no (forward only)",
                             max_err=max(errs), seconds=secs, ok=ok, note=""))
        except Exception as exc:  # noqa: BLE001 - the tour reports, it does not crash
            ok = False
            rows.append(dict(backend=name, runs_on=spec.where(), forward="error", backward="-",
                             max_err=None, seconds=None, ok=False, note=f"{type(exc).__name__}: {exc}"[:80]))
        failed += ok is False
    _print_table(rows)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(problem=p, gpu=cfg["gpu"], rows=rows), f, indent=2)
    print("all available stages agree with the reference" if not failed
          else f"{failed} stage(s) FAILED")
    return 1 if failed else 0


def _cell(col, value) -> str:
    if col == "ok":
        return {True: "PASS", False: "FAIL", None: "-"}[value]
    if value is None:
        return "-"
    if col == "max_err":
        return f"{value:.1e}"
    if col == "seconds":
        return f"{value:.2f}"
    return str(value)


def _print_table(rows):
    cols = ["backend", "runs_on", "forward", "backward", "max_err", "seconds", "ok"]
    text = [[_cell(c, r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in text)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for t, r in zip(text, rows):
        print("  ".join(x.ljust(w) for x, w in zip(t, widths)) + (f"  {r['note']}" if r["note"] else ""))
