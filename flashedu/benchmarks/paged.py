"""Decoding from a paged KV cache against a contiguous cache and against SDPA.

One decoding step: B sequences, one new query each, attend to their Nk cached keys. The same
keys are held twice: contiguous, (B, Hkv, Nk, d), and paged, pages of --page-size rows scattered
at random over a pool (the worst case for locality). Timed in one process, each call once per
round in turn (--rounds; the median kept):
- paged: ``flashedu.decode.paged_attention`` (one launch for the batch; check_indices=False, as
  PagedKVCache calls it), and the same with its index check (one wait for the device);
- contiguous: split-KV decoding (``flashedu.triton.decode.split_kv_attention``);
- SDPA on the contiguous cache, each of its kernels selected explicitly (grouped-query through
  enable_gqa where the kernel takes it, else with K and V expanded to every query head).
A step reads the whole cache once, so the table shows GB/s of K/V read, and the plan of the
split kernel (its splits, and the K/V tiles each program keeps in flight). Each call is also
measured by its kernels' time on the GPU alone (torch.profiler): at small caches a call's time
is the host's (Python, launches), and the two columns tell the host's share from the kernels'.
Third, as inference servers run a step: captured in a CUDA graph of 16 calls and replayed
(each call over its own copy of the cache where the copies together are at most twice the L2,
as a model's layers each read their own cache), which counts the kernels and the GPU's gaps
between them but not the host. Under the table, the cells that meet each goal (paged within
10% of contiguous, paged at least SDPA's best) are counted all three ways.

    flashedu bench paged --json docs/bench/paged.json
    flashedu bench paged --dry-run      # tiny sizes (no GPU: Triton's interpreter)
"""

from __future__ import annotations

import contextlib
import sys

from . import core

DTYPES = ("bf16", "fp16", "fp32")
SDPA_KERNELS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def paged_copy(k, v, page_size: int, generator):
    """(k_cache, v_cache, block_table, seqlens): k, v (B, Hkv, Nk, d) cut into pages of
    page_size rows, the pages placed at random in a pool (``generator`` None: in order, each
    sequence's pages one after another)."""
    import torch

    B, Hkv, Nk, d = k.shape
    per_seq = -(-Nk // page_size)
    num_pages = B * per_seq
    perm = (torch.arange(num_pages) if generator is None else
            torch.randperm(num_pages, generator=generator, device="cpu")).to(k.device)
    table = perm.view(B, per_seq).to(torch.int32)
    pools = []
    for t in (k, v):
        padded = torch.zeros(B, Hkv, per_seq * page_size, d, dtype=t.dtype, device=t.device)
        padded[:, :, :Nk] = t
        pages = padded.view(B, Hkv, per_seq, page_size, d).permute(0, 2, 3, 1, 4)
        pool = torch.empty(num_pages, page_size, Hkv, d, dtype=t.dtype, device=t.device)
        pool[table.flatten().long()] = pages.reshape(num_pages, page_size, Hkv, d)
        pools.append(pool)
    seqlens = torch.full((B,), Nk, dtype=torch.int32, device=k.device)
    return pools[0], pools[1], table, seqlens


def sdpa_calls(q, k, v) -> dict:
    """{kernel: (call, how, context) or (None, error text, None)}: each SDPA kernel on the
    contiguous cache, grouped-query through enable_gqa where it takes it, else with K and V
    expanded to every query head (once, the first time a kernel needs it); ``context`` selects
    the kernel (entered around the timing, not inside each call: a context per call would bill
    its Python to SDPA)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    G = q.shape[1] // k.shape[1]
    expanded = []

    def with_expanded():
        if not expanded:
            expanded.extend(t.repeat_interleave(G, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, *expanded)

    ways = (("gqa", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
            ("expanded", with_expanded))
    out = {}
    for name in SDPA_KERNELS:
        backend = getattr(SDPBackend, name)
        for how, call in ways:
            try:
                with sdpa_kernel(backend):
                    call()
            except RuntimeError as exc:
                out[name] = (None, core.error_text(exc), None)
                continue
            out[name] = (call, how, lambda backend=backend: sdpa_kernel(backend))
            break
    return out


def device_times(calls: dict) -> dict:
    """{name: microseconds per call of its kernels on the GPU} (core.device_us)."""
    out = {}
    for name, (fn, context) in calls.items():
        with context() if context else contextlib.nullcontext():
            out[name] = core.device_us(fn)
    return out


GRAPH_STEPS = 16  # calls captured in one CUDA graph


def cache_copies(kv_bytes: int, device) -> int:
    """How many copies of a cache of ``kv_bytes`` the graph's calls take in turn: enough that
    no call finds the cache in L2 from the call before (twice the L2 together), at most one
    per call, at least one."""
    import torch

    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(GRAPH_STEPS, -(-2 * l2 // kv_bytes)))


def step_inputs(B, Nk, page_size, H, Hkv, d, device, dtype, in_order=False):
    """(q, k, v, k_cache, v_cache, block_table, seqlens) of one decoding step: one query per
    head against Nk keys, seeded by the cell, and the same keys in a paged pool (its pages
    scattered, or ``in_order``)."""
    import torch

    g = torch.Generator(device=device).manual_seed(B * 7 + Nk)
    q = torch.randn(B, H, 1, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, Nk, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, Nk, d, device=device, dtype=dtype, generator=g)
    placing = None if in_order else torch.Generator().manual_seed(Nk)
    return (q, k, v, *paged_copy(k, v, page_size, placing))


def graph_copies(k, v, *more, device) -> list:
    """[(k, v, *more), then clones of them]: as many copies as ``cache_copies`` asks for a
    cache of k and v, for a graph's calls to take in turn."""
    n = cache_copies(2 * k.numel() * k.element_size(), device)
    first = (k, v, *more)
    return [first] + [tuple(t.clone() for t in first) for _ in range(n - 1)]


def graph_us_in_turn(ways: dict, rounds: int, contexts: dict | None = None) -> dict:
    """{name: [us per call, one per round]}: each entry of ``ways`` (name -> the calls a graph
    takes in turn, ``core.graph_us``) captured and timed once a round, in turn
    (``core.in_turn``); ``contexts``: {name: a function making the context entered around
    that name's timing} (an SDPA kernel selected, say)."""
    contexts = contexts or {}
    times = {name: [] for name in ways}
    for name in core.in_turn(ways, rounds):
        with contexts[name]() if name in contexts else contextlib.nullcontext():
            times[name].append(core.graph_us(ways[name], GRAPH_STEPS))
    return times


def graph_times(q, k, v, kc, vc, table, seqlens, device) -> dict:
    """{call: us per call in a CUDA graph} for paged, contiguous and each SDPA kernel, each
    over its own copies of the cache (``core.graph_us``)."""
    from flashedu.decode import paged_attention
    from flashedu.triton.decode import split_kv_attention

    caches = graph_copies(k, v, kc, vc, device=device)
    ways = {"paged": [lambda c=c: paged_attention(q, c[2], c[3], table, seqlens,
                                                  check_indices=False) for c in caches],
            "contiguous": [lambda c=c: split_kv_attention(q, c[0], c[1]) for c in caches]}
    contexts = {}
    for c in caches:
        for name, (call, how, context) in sdpa_calls(q, c[0], c[1]).items():
            if call is not None:
                ways.setdefault(f"sdpa_{name}", []).append(call)
                contexts[f"sdpa_{name}"] = context
    return {name: us[0] for name, us in graph_us_in_turn(ways, 1, contexts).items()}


def one_case(B, Nk, page_size, args, device, dtype) -> dict:
    import torch

    from flashedu import tolerance
    from flashedu.decode import paged_attention
    from flashedu.reference import reference_attention
    from flashedu.triton.decode import split_kv_attention

    H, Hkv, d = args.heads, args.kv_heads, args.d
    q, k, v, kc, vc, table, seqlens = step_inputs(B, Nk, page_size, H, Hkv, d, device, dtype)
    row = {"B": B, "Nk": Nk, "page_size": page_size, "H": H, "Hkv": Hkv, "d": d,
           "dtype": args.dtype}
    calls = {
        "paged": (lambda: paged_attention(q, kc, vc, table, seqlens, check_indices=False), None),
        "checked": (lambda: paged_attention(q, kc, vc, table, seqlens), None),
        "contiguous": (lambda: split_kv_attention(q, k, v), None)}
    with torch.no_grad():
        ref = reference_attention(q, k, v, enable_gqa=True)
        row["max_err_paged"] = tolerance.max_error(calls["paged"][0](), ref)
        row["max_err_contiguous"] = tolerance.max_error(calls["contiguous"][0](), ref)
        limit = tolerance.allowed_error(dtype, row["max_err_contiguous"], floor_scale=2.0)
        del ref
        if row["max_err_paged"] > limit:
            row["error"] = f"paged error {row['max_err_paged']:.3g} > {limit:.3g}"
        if device != "cpu":
            for name, (call, how, context) in sdpa_calls(q, k, v).items():
                row[f"sdpa_{name}_how"] = how
                if call is not None:
                    calls[f"sdpa_{name}"] = (call, context)
        ms = core.interleaved_ms({n: (fn, {}) for n, (fn, c) in calls.items()}, args.rounds,
                                 cpu_repeats=args.reps,
                                 contexts={n: c for n, (fn, c) in calls.items() if c})[0]
        gpu_us = device_times({n: c for n, c in calls.items() if n != "checked"})
        graph_us = (graph_times(q, k, v, kc, vc, table, seqlens, device) if device != "cpu"
                    else {})
    for name in calls:
        row[f"{name}_ms"] = ms[name]
        if gpu_us.get(name) is not None:
            row[f"{name}_gpu_us"] = gpu_us[name]
        if graph_us.get(name) is not None:
            row[f"{name}_graph_us"] = graph_us[name]
    sdpa = [n for n in calls if n.startswith("sdpa_")]
    if sdpa:
        best = min(sdpa, key=lambda n: ms[n])
        row["sdpa_best"], row["sdpa_best_ms"] = best[5:], ms[best]
        row["sdpa_best_vs_paged"] = ms[best] / ms["paged"]
        if gpu_us.get(best) is not None:
            row["sdpa_best_gpu_us"] = gpu_us[best]
            row["sdpa_best_vs_paged_gpu"] = gpu_us[best] / gpu_us["paged"]
        in_graph = [n for n in sdpa if graph_us.get(n) is not None]
        if in_graph and graph_us.get("paged") is not None:
            fastest = min(in_graph, key=lambda n: graph_us[n])
            row["sdpa_best_graph"], row["sdpa_best_graph_us"] = fastest[5:], graph_us[fastest]
            row["sdpa_best_vs_paged_graph"] = graph_us[fastest] / graph_us["paged"]
    row["splits"], row["tiles_in_flight"], row["key_tile"], row["kv_heads"] = launch_plan(
        B, H, Hkv, Nk, d, dtype, q.device, page_size)
    kv_bytes = 2 * k.numel() * k.element_size()
    row["paged_GBps"] = kv_bytes / row["paged_ms"] / 1e6
    row["paged_vs_contiguous"] = row["paged_ms"] / row["contiguous_ms"]
    return row


def launch_plan(B, H, Hkv, Nk, d, dtype, device, page_size) -> tuple:
    """(splits, K/V tiles each program keeps in flight, keys a tile, K/V heads a program) of a
    paged step's split kernel, one query a head: what ``flashedu.triton.decode`` plans for
    this shape and page size on this device."""
    from flashedu import runtime
    from flashedu.triton import decode

    interpreted = runtime.triton_interpreted()
    shape = (B, H, Hkv, 1, Nk, d, dtype, decode.sm_count(device, interpreted), interpreted)
    heads, Bc, S, _ = decode.split_plan(*shape, page_size=page_size)
    kv_heads = decode.kv_heads_per_program(heads, H, Hkv)
    return S, decode.tiles_in_flight(*shape, page_size=page_size), Bc, kv_heads


def plan_text(row) -> str:
    """A row's plan: splits x tiles in flight x keys a tile, and x K/V heads where a program
    reads more than one."""
    text = f"{row['splits']} x {row['tiles_in_flight']} x {row['key_tile']}"
    return text + (f" x {row['kv_heads']}" if row["kv_heads"] > 1 else "")


def parse_args(argv):
    p = core.parser("paged", __doc__)
    p.add_argument("--batch", type=core.positive_int, nargs="+", default=[1, 8, 32])
    p.add_argument("--nk", type=core.positive_int, nargs="+", default=[1024, 4096, 16384, 65536],
                   help="keys per sequence")
    p.add_argument("--page-size", type=core.positive_int, nargs="+", default=[16, 256])
    p.add_argument("--heads", type=core.positive_int, default=32)
    p.add_argument("--kv-heads", type=core.positive_int, default=8)
    p.add_argument("--d", type=core.head_dim, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--max-cache-gb", type=float, default=8.0,
                   help="skip cases whose cache (held twice) is larger")
    p.add_argument("--rounds", type=core.positive_int, default=3,
                   help="times each call is timed, the calls in turn (the median is kept)")
    p.add_argument("--reps", type=core.positive_int, default=3,
                   help="dry run only: timed repetitions")
    p.add_argument("--json", type=core.output_file, help="write the results here")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU and Triton's interpreter at tiny sizes")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def goals(cases) -> dict:
    """How many cells meet the two goals, paged within 10% of contiguous and at least SDPA's
    best, by the step's time and by the kernels' GPU time alone (where measured)."""
    def count(key_a, key_b, test):
        rows = [r for r in cases if r.get(key_a) is not None and r.get(key_b) is not None]
        return sum(test(r[key_a], r[key_b]) for r in rows), len(rows)

    within = lambda paged, contiguous: paged <= 1.10 * contiguous  # noqa: E731
    ahead = lambda paged, sdpa: paged <= sdpa  # noqa: E731
    counts = {"paged_within_10pct_of_contiguous": count("paged_ms", "contiguous_ms", within),
              "paged_within_10pct_of_contiguous_gpu": count("paged_gpu_us", "contiguous_gpu_us",
                                                            within),
              "paged_within_10pct_of_contiguous_graph": count(
                  "paged_graph_us", "contiguous_graph_us", within),
              "paged_at_least_sdpa": count("paged_ms", "sdpa_best_ms", ahead),
              "paged_at_least_sdpa_gpu": count("paged_gpu_us", "sdpa_best_gpu_us", ahead),
              "paged_at_least_sdpa_graph": count("paged_graph_us", "sdpa_best_graph_us", ahead)}
    lines = []
    for goal, key in (("paged within 10% of contiguous", "paged_within_10pct_of_contiguous"),
                      ("paged at least SDPA's best", "paged_at_least_sdpa")):
        said = [f"{met} of {of} cells by {how}" for (met, of), how in
                ((counts[key], "the step's time"), (counts[key + "_gpu"], "the GPU's time"),
                 (counts[key + "_graph"], "a CUDA graph's time"))
                if of]
        if said:
            lines.append(f"{goal}: " + ", ".join(said))
    return {**{name: list(v) for name, v in counts.items()}, "lines": lines}


def _sdpa_columns(row) -> list:
    """SDPA's best time and its ratio to paged's, then the GPU's time alone of paged,
    contiguous and SDPA's best kernel, and that ratio ("-" where not measured: a CPU run)."""
    def us(key):
        return "-" if row.get(key) is None else f"{row[key]:.1f}"

    best = row.get("sdpa_best_ms")
    return ["-" if best is None else f"{best:.4f} ({row['sdpa_best']})",
            "-" if best is None else f"{row['sdpa_best_vs_paged']:.2f}x",
            us("paged_gpu_us"), us("contiguous_gpu_us"), us("sdpa_best_gpu_us"),
            "-" if row.get("sdpa_best_vs_paged_gpu") is None
            else f"{row['sdpa_best_vs_paged_gpu']:.2f}x",
            us("paged_graph_us"), us("contiguous_graph_us"), us("sdpa_best_graph_us"),
            "-" if row.get("sdpa_best_vs_paged_graph") is None
            else f"{row['sdpa_best_vs_paged_graph']:.2f}x"]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        args.batch, args.nk, args.page_size = [2], [40], [16]
        args.heads, args.kv_heads, args.d, args.dtype, args.reps = 4, 2, 16, "fp32", 1
        args.rounds = 1
    device = core.bench_device(args.dry_run, "paged")
    if device is None:
        return 1
    dtype = core.torch_dtype(args.dtype)
    out = {"environment": core.environment(["paged", *argv]), "cases": []}
    print(core.headline(out["environment"]), flush=True)
    head = ["B", "Nk", "page", "paged ms", "checked ms", "contiguous ms", "paged/contig",
            "SDPA best ms", "SDPA/paged", "GPU us: paged", "contiguous", "SDPA best",
            "SDPA/paged", "graph us: paged", "contiguous", "SDPA best", "SDPA/paged",
            "paged GB/s", "splits x tiles x Bc (x K/V heads)", "err"]
    lines = []
    itemsize = 4 if args.dtype == "fp32" else 2
    for B in args.batch:
        for Nk in args.nk:
            if 2 * 2 * B * args.kv_heads * Nk * args.d * itemsize > args.max_cache_gb * 1e9:
                continue
            for page_size in args.page_size:
                row = one_case(B, Nk, page_size, args, device, dtype)
                out["cases"].append(row)
                lines.append([B, Nk, page_size, f"{row['paged_ms']:.4f}",
                              f"{row['checked_ms']:.4f}", f"{row['contiguous_ms']:.4f}",
                              f"{row['paged_vs_contiguous']:.3f}x",
                              *_sdpa_columns(row), f"{row['paged_GBps']:.0f}",
                              plan_text(row),
                              f"{row['max_err_paged']:.1e}"])
                print(" | ".join(str(x) for x in lines[-1]), flush=True)
                if "error" in row:
                    print(f"B={B} Nk={Nk} page={page_size} ERROR: {row['error']}", flush=True)
    print(core.format_table(head, lines))
    out["goals"] = goals(out["cases"])
    for line in out["goals"]["lines"]:
        print(line)
    if args.json:
        core.write_json(args.json, out)
        print(f"wrote {args.json}")
    return 1 if any("error" in r for r in out["cases"]) else 0
