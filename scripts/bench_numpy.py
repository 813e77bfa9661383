"""NumPy FlashAttention vs naive NumPy attention on this CPU: time and peak memory.

    python scripts/bench_numpy.py [--n 4096] [--d 64] [--block 128] [--json docs/bench/numpy_cpu.json]

The goal: the tiled forward within 3x of naive NumPy's time, and under 1/20
of its peak memory. Peak memory is what tracemalloc sees (NumPy reports its buffers to it);
time is the median of several runs without tracemalloc.
"""

import argparse
import json
import platform
import statistics
import time
import tracemalloc

import numpy as np

from flashedu import reference, tiled
from flashedu.runtime import git_commit


def _time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak_bytes(fn):
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((args.n, args.d), dtype=np.float32) for _ in range(3))
    runs = {
        "naive NumPy": lambda: reference.naive_attention(Q, K, V),
        "tiled, Q outer (FA2)": lambda: tiled.flash_forward(Q, K, V, args.block, args.block),
        "tiled, K/V outer (FA1)": lambda: tiled.flash_forward(Q, K, V, args.block, args.block,
                                                               order="kv_outer"),
    }
    O_ref = runs["naive NumPy"]()[0]
    rows = []
    for name, fn in runs.items():
        err = float(np.abs(fn()[0] - O_ref).max())
        rows.append(dict(name=name, seconds=_time(fn, args.repeats), peak_bytes=_peak_bytes(fn),
                         max_abs_diff_vs_naive=err))
    base = rows[0]
    print(f"N={args.n} d={args.d} Br=Bc={args.block} float32, {platform.processor() or platform.machine()}")
    print(f"{'implementation':<24}{'time (s)':>10}{'x naive':>9}{'peak MiB':>10}{'/ naive':>9}{'max |diff|':>12}")
    for r in rows:
        r["time_ratio"] = r["seconds"] / base["seconds"]
        r["memory_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        print(f"{r['name']:<24}{r['seconds']:>10.3f}{r['time_ratio']:>9.2f}"
              f"{r['peak_bytes'] / 2**20:>10.1f}{r['memory_ratio']:>9.3f}{r['max_abs_diff_vs_naive']:>12.1e}")
    if args.json:
        commit = git_commit()
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), commit=commit, date=time.strftime("%Y-%m-%d"),
                           cpu=platform.processor() or platform.machine(), rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
