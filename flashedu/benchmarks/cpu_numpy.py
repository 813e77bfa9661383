"""NumPy FlashAttention against naive NumPy attention on this CPU: time and peak memory.

    flashedu bench numpy [--n 4096] [--d 64] [--block 128] [--json docs/bench/numpy_cpu.json]

The goal: the tiled forward within 3x of naive NumPy's time, and under 1/20 of its peak memory.
Peak memory is what tracemalloc sees (NumPy reports its buffers to it); time is the median of
several runs without tracemalloc.
"""

from __future__ import annotations

import sys
import tracemalloc

from . import core


def peak_bytes(fn) -> int:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def parse_args(argv):
    p = core.parser("numpy", __doc__)
    p.add_argument("--n", type=core.positive_int, default=4096, help="sequence length")
    p.add_argument("--d", type=core.positive_int, default=64, help="head dim")
    p.add_argument("--block", type=core.positive_int, default=128, help="Br = Bc")
    p.add_argument("--repeats", type=core.positive_int, default=5, help="timed runs each")
    p.add_argument("--json", type=core.output_file, default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import numpy as np

    from .. import reference, tiled

    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((args.n, args.d), dtype=np.float32) for _ in range(3))
    b = args.block
    runs = {
        "naive NumPy": lambda: reference.naive_attention(Q, K, V),
        "tiled, Q outer (FA2)": lambda: tiled.flash_forward(Q, K, V, b, b),
        "tiled, K/V outer (FA1)": lambda: tiled.flash_forward(Q, K, V, b, b, order="kv_outer"),
    }
    O_ref = runs["naive NumPy"]()[0]
    rows = []
    for name, fn in runs.items():
        err = float(np.abs(fn()[0] - O_ref).max())
        seconds = core.time_ms(fn, cpu_repeats=args.repeats, host=True) / 1e3
        rows.append(dict(name=name, seconds=seconds, peak_bytes=peak_bytes(fn),
                         max_abs_diff_vs_naive=err))
    base = rows[0]
    for r in rows:
        r["time_ratio"] = r["seconds"] / base["seconds"]
        r["memory_ratio"] = r["peak_bytes"] / base["peak_bytes"]
    env = core.environment(["numpy", *argv])
    print(f"N={args.n} d={args.d} Br=Bc={b} float32, {env['device']}")
    print(core.format_table(
        ["implementation", "time (s)", "x naive", "peak MiB", "/ naive", "max |diff|"],
        [[r["name"], f"{r['seconds']:.3f}", f"{r['time_ratio']:.2f}",
          f"{r['peak_bytes'] / 2**20:.1f}", f"{r['memory_ratio']:.3f}",
          f"{r['max_abs_diff_vs_naive']:.1e}"] for r in rows]))
    if args.json:
        core.write_json(args.json, {**env, "args": vars(args), "rows": rows})
    return 0
