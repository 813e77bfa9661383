"""``flashedu bench``: flashedu's Triton kernels against the attention implementations people use.

Peers: naive torch (``flashedu.reference.naive_attention_torch``), SDPA's flash (FlashAttention-2),
cuDNN and memory-efficient backends (each selected explicitly with ``sdpa_kernel``: on an H100
plain SDPA picks cuDNN), and FlexAttention (``torch.compile``'d, given the same block mask through
``BlockMask.to_flex``). Block-sparse cases run flashedu and FlexAttention only; the others
cannot skip tiles.

Shapes, FLOPs and timing are those of :mod:`flashedu.benchmarks.core`: B * N = 16384 tokens,
H * d = 2048; TFLOPs = 4 * B * H * N^2 * d / t, x0.5 when causal, x2.5 for the backward (which
is timed alone, as the backward of one retained forward), x density for block-sparse; time is
the median of ``triton.testing.do_bench``; peak memory is what the call allocates on top of its
inputs (torch's allocator statistics).

    flashedu bench                         # bf16, N=8192, d=64/128, causal and not, fwd/bwd,
                                           #   block-sparse densities 0.1/0.25/0.5
    flashedu bench --n 2048 4096 --d 64 --modes fwd --json out.json --plot out.png
    flashedu bench --baseline OTHER/flashedu   # also time another checkout's triton backend
    flashedu bench SUBCOMMAND --help       # the other benchmarks (SUBCOMMANDS below)
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import asdict

from .benchmarks import core
from .benchmarks.peers import (EXTRA_PROVIDERS, PROVIDERS, SPARSE_PROVIDERS, Case,
                               check_baseline, make_forward)
from .benchmarks.core import TOKENS, WIDTH, boolean, density, head_dim, positive_int  # noqa: F401

# `flashedu bench NAME ...`: each a module with main(argv) -> exit status.
SUBCOMMANDS = {
    "overhead": ("flashedu.benchmarks.overhead", "wall time per call at small sizes (GPU)"),
    "host": ("flashedu.benchmarks.host",
             "the Python host code per call, launches stubbed (CPU or GPU machine)"),
    "correctness": ("flashedu.benchmarks.correctness",
                    "the triton backend against float64 at real sizes (GPU; --smoke on a CPU)"),
    "numba": ("flashedu.benchmarks.numba_gpu",
              "the numba.cuda kernel: check, bench, sanitize (GPU)"),
    "decode": ("flashedu.benchmarks.decode",
               "split-KV decoding against the plain kernel (GPU; --dry-run on a CPU)"),
    "gpt": ("flashedu.benchmarks.gpt", "GPT-2 small training: naive, flashedu, SDPA-flash (GPU)"),
    "paper": ("flashedu.benchmarks.paper",
              "the paper's figures with ncu's byte counts (GPU; --cpu-dry-run on a CPU)"),
    "tune": ("flashedu.benchmarks.tune", "candidate tile configs of each kernel (GPU)"),
    "speed": ("flashedu.benchmarks.speed", "backward sweep, ablations, ncu launches (GPU)"),
    "fa3": ("flashedu.benchmarks.fa3",
            "FlashAttention-3's schedule on Hopper: the forward with each idea turned off, "
            "beside the Triton kernel, cuDNN, FlashAttention-2 and FlexAttention (GPU)"),
    "forward": ("flashedu.benchmarks.forward_variants",
                "forward variants against an earlier forward.py (GPU)"),
    "numpy": ("flashedu.benchmarks.cpu_numpy", "NumPy FlashAttention against naive NumPy (CPU)"),
    "mods": ("flashedu.benchmarks.mods",
             "mask mods and score mods against FlexAttention (GPU; --dry-run on a CPU)"),
    "varlen": ("flashedu.benchmarks.varlen",
               "packed variable-length batches against FlexAttention's document mask and "
               "padded SDPA (GPU; --dry-run on a CPU)"),
    "sinks": ("flashedu.benchmarks.sinks",
              "attention sinks against none, forward and backward (GPU; --dry-run on a CPU)"),
    "paged": ("flashedu.benchmarks.paged",
              "decoding from a paged KV cache against a contiguous one and SDPA (GPU; "
              "--dry-run on a CPU)"),
    "dropout": ("flashedu.benchmarks.dropout",
                "what dropout costs against p=0, flashedu beside SDPA-flash (GPU; --dry-run on "
                "a CPU)"),
    "notebooks": ("flashedu.benchmarks.notebooks", "run the notebooks top to bottom, timed"),
    "sass": ("flashedu.benchmarks.sass",
             "registers, spills and instruction mix of the kernels for a GPU (CPU: compiles)"),
    "transformers": ("flashedu.benchmarks.hf",
                     "a Hugging Face Llama: training and generation, flashedu against SDPA "
                     "(GPU; --dry-run on a CPU)"),
}

def build_cases(args) -> list[Case]:
    cases = []
    for n in args.n:
        for d in args.d:
            for mode in args.modes:
                for causal in args.causal:
                    cases.append(Case(n, d, causal, mode, None, args.dtype))
                for s in args.density:
                    cases.append(Case(n, d, False, mode, s, args.dtype))
    return cases


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------


def measure(provider: str, case: Case) -> dict:
    """{"ms", "tflops", "peak_mb"} for one provider on one case, or {"error": why}."""
    import torch

    dtype = getattr(torch, case.dtype)
    torch.manual_seed(0)
    shape = (case.B, case.H, case.n, case.d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=case.mode == "bwd")
               for _ in range(3))
    try:
        fn = make_forward(provider, case, q, k, v)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        if case.mode == "bwd":
            dout = torch.randn_like(out)
            out.backward(dout, retain_graph=True)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            ms = core.time_ms(lambda: out.backward(dout, retain_graph=True),
                              grad_to_none=[q, k, v])
        else:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            del out
            ms = core.time_ms(fn)
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run this case is reported
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    finally:
        torch.cuda.empty_cache()
    return {"ms": ms, "tflops": core.tflops(case.flops(), ms), "peak_mb": peak / 2**20}


def run_all(cases, providers, progress=True, on_row=None, rounds=1) -> list[dict]:
    """One row per (case, provider). With ``rounds`` > 1 each case's providers are timed in
    turn, round after round, in an order that turns around every round, and the median round
    is kept (``core.in_turn`` says why)."""
    from tqdm.auto import tqdm

    rows = []
    bar = tqdm(cases, desc="bench", disable=not progress)
    for case in bar:
        chosen = [p for p in providers if case.density is None or p in SPARSE_PROVIDERS]
        bar.set_postfix_str(case.label())
        results = {p: [] for p in chosen}
        for provider in core.in_turn(chosen, rounds):
            results[provider].append(measure(provider, case))
        for provider in chosen:
            rows.append({**asdict(case), "label": case.label(), "provider": provider,
                         **_median_round(results[provider])})
        if on_row is not None:
            on_row(rows)
    return rows


def _median_round(results: list[dict]) -> dict:
    """The round with the median time (its TFLOPs and memory), and every round's ms; the
    first error if a round failed."""
    failed = [r for r in results if "error" in r]
    if failed:
        return failed[0]
    ordered = sorted(results, key=lambda r: r["ms"])
    return {**ordered[(len(ordered) - 1) // 2], "rounds_ms": [r["ms"] for r in results]}


# ----------------------------------------------------------------------------------------
# Report: table, plot, JSON
# ----------------------------------------------------------------------------------------


def _by_case(rows):
    cases = {}
    for r in rows:
        cases.setdefault(r["label"], {})[r["provider"]] = r
    return cases


def dense_twin(label: str) -> str:
    """The dense, non-causal case a block-sparse label is compared with."""
    head, _, mode = label.rpartition(" ")
    return head.split(" sparse")[0] + " dense " + mode


def table(rows, providers) -> str:
    """One line per case: flashedu's ms, TFLOPs, peak memory, then each peer's TFLOPs and
    flashedu's speed ratio to it (peer time / flashedu time; > 1 means flashedu is faster)."""
    cases = _by_case(rows)
    peers = [p for p in providers if p != "flashedu"]
    head = f"{'case':<30}{'ms':>8}{'TFLOPs':>8}{'MB':>8}" + "".join(f"{p:>22}" for p in peers)
    lines = [head, "-" * len(head)]
    for label, by in cases.items():
        me = by.get("flashedu", {})
        if "ms" in me:
            line = f"{label:<30}{me['ms']:>8.3f}{me['tflops']:>8.1f}{me['peak_mb']:>8.0f}"
        else:
            line = f"{label:<30}{'failed: ' + me.get('error', '?'):>24}"
        for p in peers:
            r = by.get(p)
            if r is None:
                cell = ""
            elif "ms" not in r:
                cell = r["error"][:20]
            else:
                ratio = f"{r['ms'] / me['ms']:.2f}x" if "ms" in me else "-"
                cell = f"{r['tflops']:.0f} TF {ratio}"
            line += f"{cell:>22}"
        if " sparse " in label and "ms" in me:
            dense = cases.get(dense_twin(label), {}).get("flashedu", {})
            if "ms" in dense:
                line += f"   time/dense {me['ms'] / dense['ms']:.2f}"
        lines.append(line)
    return "\n".join(lines)


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = [r for r in rows if r["density"] is None and "tflops" in r]
    labels = list(dict.fromkeys(r["label"] for r in dense))
    providers = list(dict.fromkeys(r["provider"] for r in dense))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(labels)), 4.5))
    width = 0.8 / max(1, len(providers))
    for n, p in enumerate(providers):
        ys = [next((r["tflops"] for r in dense if r["label"] == lab and r["provider"] == p), 0)
              for lab in labels]
        ax.bar([x + n * width for x in range(len(labels))], ys, width, label=p)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOPs")
    ax.set_title("attention throughput (higher is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    p = core.parser("", __doc__)
    p.epilog = "subcommands (flashedu bench NAME --help):\n" + "\n".join(
        f"  {name:<12} {what}" for name, (_, what) in SUBCOMMANDS.items())
    p.add_argument("--n", type=positive_int, nargs="+", default=[8192], help="sequence lengths")
    p.add_argument("--d", type=head_dim, nargs="+", default=[64, 128], help="head dims")
    p.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--causal", type=boolean, nargs="+", default=[False, True],
                   help="causal values to run (true/false)")
    p.add_argument("--density", type=density, nargs="*", default=[0.1, 0.25, 0.5],
                   help="block-sparse densities in (0, 1] (non-causal, 128x128 blocks)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS),
                   choices=PROVIDERS + EXTRA_PROVIDERS)
    p.add_argument("--baseline", default=None, metavar="PATH",
                   help="another checkout's flashedu/ folder: its triton backend is timed too")
    p.add_argument("--json", type=core.output_file, default=None, help="write the results here")
    p.add_argument("--plot", type=core.output_file, default=None,
                   help="write a bar chart (png) here")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="time each case's providers in turn this many rounds (the median)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if "flashedu" not in args.providers:
        args.providers.insert(0, "flashedu")
    check_baseline(p, args)
    return args


def cpu_check() -> None:
    """Without a GPU: say so, and check the kernels once through the interpreter."""
    import torch

    import flashedu
    from flashedu import tolerance
    from flashedu.reference import naive_attention_torch, reference_attention

    print("flashedu bench: timing needs a CUDA GPU; none is visible here, so nothing is timed.\n"
          "Running a small correctness pass of the triton backend in Triton's interpreter:")
    torch.manual_seed(0)
    for causal in (False, True):
        q, k, v = (torch.randn(1, 2, 48, 64) for _ in range(3))
        out = flashedu.attention(q, k, v, is_causal=causal, backend="triton")
        ref = reference_attention(q, k, v, is_causal=causal)
        plain = naive_attention_torch(q, k, v, is_causal=causal, upcast=False)
        err, limit = tolerance.max_error(out, ref), tolerance.allowed_error(
            q.dtype, tolerance.max_error(plain, ref))
        print(f"  N=48 d=64 fp32 causal={causal}: max error vs float64 {err:.2e} "
              f"({'ok' if err <= limit else 'FAILED'}, allowed {limit:.1e})")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    args = parse_args(argv)
    if not core.gpu_available():
        wanted = [f"--{name} {path}" for name, path in (("json", args.json), ("plot", args.plot))
                  if path]
        if wanted:  # a file of timings was asked for, and there is nothing to time
            print(f"flashedu bench: {' and '.join(wanted)} asked for timings, which need a CUDA "
                  f"GPU; none is visible here, so nothing was timed or written. Run it on a GPU "
                  f"machine, or without --json/--plot for a correctness pass in Triton's "
                  f"interpreter.", file=sys.stderr)
            return 1
        cpu_check()
        return 0
    cases = build_cases(args)
    env = core.environment(argv)

    def save(rows):  # after every measurement, so that an interrupted run keeps its numbers
        if args.json:
            core.write_json(args.json, {**env, "rows": rows})

    rows = run_all(cases, args.providers, progress=not args.no_progress, on_row=save,
                   rounds=args.rounds)
    print("\n" + core.headline(env))
    print("cells: peer TFLOPs and flashedu's speed-up over it (peer ms / flashedu ms)\n")
    print(table(rows, args.providers))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
