"""What every ``flashedu bench`` subcommand shares: the record of where a run ran, one timing
function, one shape and FLOP rule, argument types, JSON and tables.

Shapes follow FlashAttention's own benchmarks: B * N = 16384 tokens and H = 2048 / d heads, so
that every size moves the same number of tokens and the model width H * d is 2048.
TFLOPs = 4 * B * H * Nq * Nk * d / t, x0.5 causal, x2.5 for a backward, x density when
block-sparse. Time is the median of ``triton.testing.do_bench`` on a GPU (a CPU run, for the
dry runs and the NumPy benchmark, takes the median of a few ``time.perf_counter`` calls).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time

TOKENS = 16384  # B * N
WIDTH = 2048  # H * d


# ----------------------------------------------------------------------------------------
# Where a run ran
# ----------------------------------------------------------------------------------------


def environment(command, **extra) -> dict:
    """Device, versions, date (UTC), commit ($GIT_COMMIT, else this checkout's) and the
    command, as every benchmark record starts. ``command``: the argv after ``flashedu bench``
    (a list) or a whole command line (a string)."""
    import torch

    from ..runtime import git_commit

    try:
        import triton

        triton_version = triton.__version__
    except ImportError as exc:
        triton_version = f"unavailable: {exc}"
    fa3_status = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = props.name
        memory = f"{props.total_memory / 2**30:.0f} GiB"
        from ..triton import fa3  # FLASHEDU_FA3=0 turns them off: a record says which ran

        fa3_status = fa3.status()
    else:
        device, memory = f"cpu ({platform.processor() or platform.machine()})", None
    if not isinstance(command, str):
        command = " ".join(["flashedu bench", *command])
    env = {"device": device, "device_memory": memory,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(short=False), "torch": torch.__version__,
           "cuda": torch.version.cuda, "triton": triton_version,
           "python": platform.python_version(), "command": command,
           "flashattention3_kernels": fa3_status}
    return {**env, **extra}


def headline(env: dict) -> str:
    return (f"{env['device']}  torch {env['torch']}  triton {env['triton']}  "
            f"commit {env['commit'][:10]}  {env['date']}")


def gpu_available() -> bool:
    from .. import runtime

    return bool(runtime.configure()["gpu"])


def bench_device(dry_run: bool, name: str) -> str | None:
    """Where ``flashedu bench NAME`` runs: for a dry run the kernels' device (the CPU under
    Triton's interpreter, else the GPU), else "cuda" where there is a GPU; None where there is
    none, having said so (the caller then exits with 1)."""
    if dry_run:
        from .. import runtime

        return str(runtime.kernel_device())
    if not gpu_available():
        needs_gpu(f"flashedu bench {name} (or --dry-run for a CPU check)")
        return None
    return "cuda"


def needs_gpu(prog: str) -> int:
    """Say that ``prog`` times a CUDA GPU and none is visible; the exit status (1)."""
    print(f"{prog}: needs a CUDA GPU; none is visible here, so nothing was measured.",
          file=sys.stderr)
    return 1


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------


def time_ms(fn, *, warmup: int = 25, rep: int = 100, grad_to_none=None,
            cpu_repeats: int = 3, host: bool = False) -> float:
    """Median milliseconds of ``fn()``: ``triton.testing.do_bench`` on a GPU; on a CPU (dry
    runs) or for host code (``host=True``: NumPy) one warm-up call, then the median of
    ``cpu_repeats`` timed calls."""
    if not host and gpu_available():
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                              return_mode="median"))
    fn()
    samples = []
    for _ in range(cpu_repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def device_us(fn, calls: int = 30) -> float | None:
    """Microseconds per call that ``fn``'s kernels spend on the GPU, summed over its kernels
    by torch.profiler: the device's share alone, without the host's time between launches
    (which ``time_ms`` includes where the host is the slower side). None without a GPU."""
    if not gpu_available():
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / calls


def graph_us(calls, steps: int = 16) -> float | None:
    """Microseconds per call inside a CUDA graph of ``steps`` calls, the zero-argument
    ``calls`` taken in turn (each over its own copy of the inputs, so that a small cache is
    not served from L2 by the call before it): a decoding step as inference servers run it,
    captured once and replayed, without the host's time and with the GPU's gaps between
    launches. None without a GPU, or where a call cannot be captured (the reason printed)."""
    if not gpu_available():
        return None
    import torch
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture asks
            for fn in calls:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(steps):
                calls[i % len(calls)]()
    except RuntimeError as exc:
        print(f"  (not captured in a CUDA graph: {error_text(exc)})", flush=True)
        return None
    return float(do_bench(graph.replay, return_mode="median")) * 1e3 / steps


def in_turn(names, rounds: int):
    """``names`` once per round, in an order that turns around every round (A B, B A, ...),
    as one sequence. A GPU's clock and temperature drift over seconds: timing all of one and
    then all of the other puts the drift between them, which at a few percent is what a
    comparison of two kernels is asking."""
    names = list(names)
    for r in range(rounds):
        yield from (names if r % 2 == 0 else names[::-1])


def interleaved_ms(timed: dict, rounds: int, cpu_repeats: int = 3,
                   contexts: dict | None = None) -> tuple[dict, dict]:
    """({name: median ms}, {name: [ms per round]}) of the functions in ``timed`` (name ->
    (fn, time_ms keywords)), each timed once per round, in turn (:func:`in_turn`).
    ``contexts``: {name: a function making a context entered around that function's timing}
    (one SDPA kernel selected, say: entered inside each call, its Python would be timed too)."""
    contexts = contexts or {}
    samples = {name: [] for name in timed}
    for name in in_turn(timed, rounds):
        fn, kw = timed[name]
        with contexts[name]() if name in contexts else contextlib.nullcontext():
            samples[name].append(time_ms(fn, cpu_repeats=cpu_repeats, **kw))
    return {name: statistics.median(ms) for name, ms in samples.items()}, samples


def profile_once(call, warm: int = 2) -> None:
    """``call()`` ``warm`` times (compiled, caches and clocks warm), then once between
    cudaProfilerStart and Stop: what Nsight Compute profiles under ``--profile-from-start
    off`` (the drivers in docs/bench/experiments)."""
    import torch

    for _ in range(warm):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def synchronize(device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def try_time_ms(fn, **kw) -> float:
    """``time_ms``, or inf (saying why) for a candidate that cannot run, e.g. a tile
    configuration that needs more shared memory than the GPU has."""
    try:
        return time_ms(fn, **kw)
    except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is not chosen
        print("   skipped:", error_text(exc), flush=True)
        return float("inf")


def torch_dtype(name: str):
    """The torch dtype of a --dtype choice: "bf16", "fp16" or "fp32"."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


_FLEX = []


def compiled_flex():
    """flex_attention compiled once per process. Every new mask or score mod is a new closure
    and compiles again; past torch's recompile limit (8) torch would silently run the eager
    flex_attention, which materializes the N x N scores, so the limits are raised."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if not _FLEX:
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 1024)
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def peak_bytes(fn) -> float:
    """Bytes allocated at the peak of one ``fn()`` over what was allocated before it (torch's
    CUDA allocator statistics)."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() - base)


def error_text(exc: BaseException, width: int = 200) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:width]}"


# ----------------------------------------------------------------------------------------
# Shapes and FLOPs
# ----------------------------------------------------------------------------------------


def batch_heads(n: int, d: int) -> tuple[int, int]:
    """(B, H) for sequence length n and head dim d: B * n = TOKENS, H * d = WIDTH."""
    return max(1, TOKENS // n), max(1, WIDTH // d)


def attention_flops(B: int, H: int, Nq: int, Nk: int, d: int, *, causal: bool = False,
                    mode: str = "fwd", density: float | None = None) -> float:
    """4 B H Nq Nk d (two matrix products of 2 Nq Nk d each per head), x0.5 causal,
    x2.5 for the backward ("bwd"), x3.5 for both ("fwd+bwd"), x density when block-sparse."""
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]
    flops = 4.0 * B * H * Nq * Nk * d * factor * (0.5 if causal else 1.0)
    return flops * (1.0 if density is None else density)


def flops(n: int, d: int, causal: bool = False, mode: str = "fwd") -> float:
    """attention_flops at the standard shape of (n, d)."""
    B, H = batch_heads(n, d)
    return attention_flops(B, H, n, n, d, causal=causal, mode=mode)


def tflops(flop_count: float, ms: float) -> float:
    return flop_count / (ms * 1e-3) / 1e12


def standard_inputs(n: int, d: int, *, hkv: int | None = None, requires_grad: bool = False,
                    dtype=None, device: str = "cuda"):
    """[q, k, v, dout] at the standard shape of (n, d), seeded by (n, d); ``hkv`` K/V heads."""
    import torch

    dtype = dtype or torch.bfloat16
    B, H = batch_heads(n, d)
    g = torch.Generator(device=device).manual_seed(n + d)

    def make(heads):
        return torch.randn(B, heads, n, d, device=device, dtype=dtype, generator=g)
    q, k, v, dout = make(H), make(hkv or H), make(hkv or H), make(H)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)] + [dout]


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float32: how far two variants of one computation are apart."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tiles_name(t) -> str:
    """'128x64/w8/s3' (+ '/tma', '/ws', '/r128' for maxnreg) for a flashedu.triton.config.Tiles."""
    extra = ("/tma" if t.tma else "") + ("/ws" if t.warp_specialize else "")
    extra += f"/r{t.maxnreg}" if getattr(t, "maxnreg", None) else ""
    return f"{t.Br}x{t.Bc}/w{t.num_warps}/s{t.num_stages}{extra}"


# ----------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------


def _plain(value):
    """JSON for what json cannot write: NumPy and torch scalars as numbers, the rest as text."""
    return value.item() if hasattr(value, "item") else str(value)


def write_json(path, data) -> None:
    """Write ``data`` to ``path`` (its folder is made), one level of indentation."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=_plain)


def format_table(headers, rows) -> str:
    """Columns right-aligned to their widest cell, a rule under the header."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Argument types (argparse): bad values are refused before any work
# ----------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def names_of(choices):
    """argparse type: comma-separated names, each one of ``choices`` (a dict or a list)."""
    def names(text: str) -> list[str]:
        found = text.split(",")
        bad = [n for n in found if n not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown method {', '.join(bad)}; choose from {', '.join(choices)}")
        return found

    return names


def head_dim(text: str) -> int:
    """argparse type: a head dim the triton backend takes (1..256)."""
    value = positive_int(text)
    if value > 256:
        raise argparse.ArgumentTypeError(f"head dims go up to 256, got {value}")
    return value


def density(text: str) -> float:
    """argparse type: a block-sparse density in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"a density is in (0, 1], got {value:g}")
    return value


def probability(text: str) -> float:
    """argparse type: a rate in [0, 1), as dropout takes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"a rate is in [0, 1), got {value:g}")
    return value


def boolean(text: str) -> bool:
    """argparse type: true/false (also 1/0, yes/no); anything else is an error."""
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    try:
        return words[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None


def output_file(path: str) -> str:
    """argparse type: a file to write; its folder is made when missing, so it must not be a
    file, and the path must not be a folder."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a folder, not a file")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path!r}: {folder!r} is not a "
                                         "writable folder")
    return path


def output_dir(path: str) -> str:
    """argparse type: a folder to write into (made when missing); not an existing file."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a file, not a folder")
    return path


def existing_file(path: str) -> str:
    """argparse type: a file that exists."""
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no such file: {path!r}")
    return path


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """An ArgumentParser named ``flashedu bench <prog>`` with the module docstring's first
    paragraph as description and the rest as epilog."""
    head, _, rest = doc.strip().partition("\n\n")
    return argparse.ArgumentParser(prog=f"flashedu bench {prog}".strip(), description=head,
                                   epilog=rest or None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
