"""``flashedu bench overhead``: wall time per call where the host, not the GPU, sets the pace.

At small sizes an attention call costs what the Python around its kernels costs: argument
checks, allocations, and each launch's dispatch. This benchmark times one call two ways, for
flashedu's triton backend and its peers (SDPA's flash and cuDNN backends, selected explicitly
with ``sdpa_kernel``, and FlexAttention), in one process:

- host: ``time.perf_counter`` around many calls with no synchronization (the Python and
  driver time a call costs the CPU: what the GPU waits for when the host falls behind);
- wall: ``time.perf_counter`` around many calls, each followed by ``torch.cuda.synchronize()``
  (what a training step that waits for its result pays per call);
  each the best of ``--rounds`` rounds of ``--iters`` calls, the providers taking turns within
  a round, so that a slow spell of the host hits them alike (on a shared host a few rounds
  swing by a fifth between runs: a difference of a few percent needs ``--rounds 25 --iters
  200``, as BENCHMARKS.md's records of it use);
- do_bench: the median of ``triton.testing.do_bench`` (launches queued back to back: the GPU
  time once the host keeps ahead of it).

Modes: the forward alone, and forward + backward (one step of training: out, then
out.backward(dout)). Shapes (B, H, N, d): tiny (1, 2, 128, 64), gpt (8, 12, 512, 64; the
course's GPT), n1024 (4, 32, 1024, 64) and n1024-d128 (4, 16, 1024, 128).

    flashedu bench overhead                                   # causal, every shape and mode
    flashedu bench overhead --shapes gpt --causal true false --json overhead.json
    flashedu bench overhead --providers flashedu flashedu-dispatch sdpa-flash

``flashedu-dispatch`` is flashedu with every launch through Triton's own dispatch (the
compiled-kernel cache of ``flashedu.triton.fast`` off); ``--baseline PATH`` adds another
checkout's ``flashedu.attention(..., backend="triton")`` as ``baseline``: the same entry as
``flashedu``, so the two columns differ only by the code between them.
"""

from __future__ import annotations

import sys
import time

from .peers import EXTRA_PROVIDERS, Case, check_baseline, make_forward
from . import core

SHAPES = {  # (B, H, N, d)
    "tiny": (1, 2, 128, 64),
    "gpt": (8, 12, 512, 64),
    "n1024": (4, 32, 1024, 64),
    "n1024-d128": (4, 16, 1024, 128),
}
PROVIDERS = ("flashedu", "flashedu-dispatch", "sdpa-flash", "sdpa-cudnn", "flex")
MODES = ("fwd", "fwd+bwd")


def step(provider: str, shape, causal: bool, mode: str, dtype):
    """A zero-argument function running one call (one forward, or forward + backward)."""
    import torch

    B, H, N, d = shape
    case = Case(N, d, causal, "fwd", None, str(dtype).removeprefix("torch."))
    g = torch.Generator(device="cuda").manual_seed(B * N + d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=g,
                           requires_grad=mode != "fwd") for _ in range(3))
    forward = make_forward(provider, case, q, k, v)
    if mode == "fwd":
        return forward, []
    dout = torch.randn(shape, device="cuda", dtype=dtype, generator=g)

    def train_step():
        forward().backward(dout)
    return train_step, [q, k, v]


def _per_call_us(fn, grads, iters: int, sync: bool) -> float:
    """Microseconds per call over ``iters`` calls, each synchronized or not."""
    import torch

    start = time.perf_counter()
    for _ in range(iters):
        for t in grads:
            t.grad = None
        fn()
        if sync:
            torch.cuda.synchronize()
    spent = time.perf_counter() - start
    torch.cuda.synchronize()  # the queued work finishes outside the host clock
    return spent / iters * 1e6


def measure(calls: dict, iters: int, rounds: int) -> dict:
    """{provider: {"host_us", "wall_us", "bench_us"}} for ``calls`` = {provider: (fn, grads)}:
    the best of ``rounds`` rounds of ``iters`` unsynchronized and synchronized calls, the
    providers taking turns within each round (a slow spell of the host then hits every
    provider of the round, not one), and do_bench's median."""
    import torch

    for fn, _ in calls.values():
        for _ in range(3):  # compile, and fill every cache on the way
            fn()
    torch.cuda.synchronize()
    best = {p: {"host_us": float("inf"), "wall_us": float("inf")} for p in calls}
    for _ in range(rounds):
        for p, (fn, grads) in calls.items():
            for name, sync in (("host_us", False), ("wall_us", True)):
                best[p][name] = min(best[p][name], _per_call_us(fn, grads, iters, sync))
    for p, (fn, grads) in calls.items():
        best[p]["bench_us"] = core.time_ms(fn, grad_to_none=grads or None) * 1e3
    return best


def run_all(shapes, causals, modes, providers, dtype, iters, rounds=5,
            progress=True) -> list[dict]:
    import torch

    rows = []
    for name in shapes:
        for causal in causals:
            for mode in modes:
                case = {"shape": name, "BHNd": SHAPES[name], "causal": causal, "mode": mode}
                calls, errors = {}, {}
                for provider in providers:
                    try:
                        calls[provider] = step(provider, SHAPES[name], causal, mode, dtype)
                    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
                        errors[provider] = exc
                try:
                    got = measure(calls, iters, rounds)
                except Exception:  # noqa: BLE001 - one by one, to find the provider that failed
                    got = {}
                    for provider, call in calls.items():
                        try:
                            got.update(measure({provider: call}, iters, rounds))
                        except Exception as exc:  # noqa: BLE001
                            errors[provider] = exc
                del calls
                torch.cuda.empty_cache()
                for provider in providers:
                    row = {**case, "provider": provider, **got.get(provider, {})}
                    if provider in errors:
                        exc = errors[provider]
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                    rows.append(row)
                    if progress:
                        cell = (f"host {row['host_us']:.0f} us, wall {row['wall_us']:.0f} us, "
                                f"do_bench {row['bench_us']:.0f} us"
                                if "wall_us" in row else row["error"])
                        print(f"  {name} {'causal' if causal else 'dense'} {mode} {provider}: "
                              f"{cell}", file=sys.stderr, flush=True)
    return rows


def table(rows, providers) -> str:
    """One line per (shape, causal, mode): each provider's host / wall / do_bench
    microseconds, and flashedu's wall time over SDPA-flash's (< 1: flashedu's calls are
    cheaper)."""
    head = f"{'case':<26}" + "".join(f"{p:>20}" for p in providers) + f"{'wall vs sdpa-flash':>20}"
    lines = ["cells: host / wall / do_bench, us per call", head, "-" * len(head)]
    cases = {}
    for r in rows:
        cases.setdefault((r["shape"], r["causal"], r["mode"]), {})[r["provider"]] = r
    for (shape, causal, mode), by in cases.items():
        line = f"{shape + (' causal ' if causal else ' dense ') + mode:<26}"
        for p in providers:
            r = by.get(p, {})
            cell = (f"{r['host_us']:.0f} / {r['wall_us']:.0f} / {r['bench_us']:.0f}"
                    if "wall_us" in r else r.get("error", "")[:18])
            line += f"{cell:>20}"
        me, fa2 = by.get("flashedu", {}), by.get("sdpa-flash", {})
        ratio = f"{me['wall_us'] / fa2['wall_us']:.2f}x" if "wall_us" in me and "wall_us" in fa2 \
            else "-"
        lines.append(line + f"{ratio:>20}")
    return "\n".join(lines)


def parse_args(argv):
    p = core.parser("overhead", __doc__)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--causal", type=core.boolean, nargs="+", default=[True],
                   help="causal values to run (true/false)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS),
                   choices=PROVIDERS + EXTRA_PROVIDERS)
    p.add_argument("--baseline", default=None, metavar="PATH",
                   help="another checkout's flashedu/ folder: its triton backend is timed too")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=core.positive_int, default=100,
                   help="calls per round (unsynchronized, then synchronized)")
    p.add_argument("--rounds", type=core.positive_int, default=5,
                   help="rounds, the providers taking turns in each; the best round is kept")
    p.add_argument("--json", type=core.output_file, default=None, help="write the results here")
    p.add_argument("--quiet", action="store_true", help="no line per measurement")
    args = p.parse_args(argv)
    if "flashedu" not in args.providers:
        args.providers.insert(0, "flashedu")
    check_baseline(p, args)
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not core.gpu_available():
        return core.needs_gpu("flashedu bench overhead")
    import torch

    env = core.environment(["overhead", *argv])
    rows = run_all(args.shapes, args.causal, args.modes, args.providers,
                   getattr(torch, args.dtype), args.iters, args.rounds,
                   progress=not args.quiet)
    if args.json:
        core.write_json(args.json, {**env, "rows": rows})
    print(f"\n{env['device']}  torch {env['torch']}  triton {env['triton']}  "
          f"commit {env['commit']}  {args.dtype}")
    print(table(rows, args.providers))
    return 0

