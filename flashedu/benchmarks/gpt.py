"""GPT-2 small training throughput and memory: naive attention vs flashedu Triton vs SDPA-flash.

    flashedu bench gpt --out docs/bench/gpt_h100.json

For each attention and sequence length T (512 ... 8192) it trains GPTConfig's default model, the
GPT-3-style GPT3Config of the README of PeTeRr0/FlashAttention-pytorch (d_model 768, 12 layers,
12 heads, vocabulary 50257), under bf16 autocast with the same number of
tokens per optimizer step (batch = tokens / T), a few warmup steps, then timed steps, one step of
each method in turn (a slow stretch of the GPU's clocks then falls on all of them), and records
tokens/s and peak memory. Holding tokens per step fixed makes every cost outside attention the
same at every T, so what changes with T is attention's: FlashAttention's memory is linear in T per
sequence (flat here), naive attention's quadratic (growing here), until it runs out of memory.

A second, smaller measurement isolates one attention call (forward + backward, B x 12 heads x T x
64) and records its own peak memory, to show the linear / quadratic growth directly.
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashedu
from flashedu import tolerance
from flashedu.models import GPTConfig, Trainer, TrainSettings

from . import core

METHODS = {  # label -> GPTConfig.attention_backend
    "naive": "naive",
    "flashedu-triton": "triton",
    "sdpa-flash": "sdpa",
}


def seq_lens(text: str) -> list[int]:
    """argparse type: comma-separated positive sequence lengths, '512,1024'."""
    return [core.positive_int(t) for t in text.split(",")]


methods = core.names_of(METHODS)  # argparse type: comma-separated names of METHODS


def parse_args(argv):
    p = core.parser("gpt", __doc__)
    p.add_argument("--seq-lens", type=seq_lens, default=seq_lens("512,1024,2048,4096,8192"))
    p.add_argument("--tokens-per-step", type=core.positive_int, default=16384)
    p.add_argument("--methods", type=methods, default=list(METHODS))
    p.add_argument("--warmup", type=core.positive_int, default=3)
    p.add_argument("--steps", type=core.positive_int, default=20,
                   help="timed steps of each method, taken in turn with the others'")
    p.add_argument("--n-layers", type=core.positive_int, default=12,
                   help="12: GPT-2 small (GPTConfig's default)")
    p.add_argument("--dropout", type=core.probability, default=0.0,
                   help="GPTConfig.dropout: embeddings, residual branches and attention")
    p.add_argument("--out", type=core.output_file, default="gpt_bench.json")
    p.add_argument("--commit", default=None,
                   help="default: $GIT_COMMIT, else this checkout's commit")
    args = p.parse_args(argv)
    too_long = [T for T in args.seq_lens if T > args.tokens_per_step]
    if too_long:
        p.error(f"--seq-lens {too_long} longer than --tokens-per-step {args.tokens_per_step}")
    return args


def attention_context(method):
    """SDPA is pinned to its FlashAttention-2 kernel: left alone it picks cuDNN on an H100."""
    if method == "sdpa-flash":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    return contextlib.nullcontext()


def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


def check_triton() -> str | None:
    """None if flashedu's triton backend runs forward + backward on this GPU and agrees with
    SDPA's math backend; else why not."""
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(2, 12, 1000, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                   .requires_grad_() for _ in range(3))
        out = flashedu.attention(q, k, v, is_causal=True, backend="triton")
        out.float().square().sum().backward()
        with sdpa_kernel([SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(*(t.detach().float() for t in (q, k, v)),
                                                 is_causal=True)
        err = (out.float() - ref).abs().max().item()
        if not err <= tolerance.allowed_error(torch.bfloat16, floor_scale=2.0) \
                or not torch.isfinite(q.grad).all():
            return (f"triton output differs from SDPA-math by {err:.3g} (or its gradient is not "
                    f"finite)")
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means: report the backend missing
        return f"{type(exc).__name__}: {exc}"


def gpt_config(method, T, n_layers=12, dropout=0.0) -> GPTConfig:
    """The configuration this bench trains: GPTConfig's model with ``method``'s attention, bf16
    autocast, eager (no torch.compile), one micro-batch a step."""
    return GPTConfig(max_seq_len=T, n_layers=n_layers, dropout=dropout, mixed_precision=True,
                     compile_model=False, gradient_accumulation_steps=1, device="cuda",
                     warmup_steps=10, attention_backend=METHODS[method])


def warm_up(method, T, args, data):
    """A fresh model on ``method`` after its warmup steps: (row, trainer), the trainer None if
    it failed (row["status"] says how). The row's peak_gib is this model's own peak (its
    parameters, optimizer state, a step's activations), whatever else is resident."""
    B = args.tokens_per_step // T
    row = {"method": method, "seq_len": T, "batch": B}
    config = gpt_config(method, T, args.n_layers, args.dropout)
    settings = TrainSettings(batch_size=B, seq_len=T, max_steps=1000, progress=False)
    trainer = None
    try:
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(config, settings, data=data)
        with attention_context(method):
            for _ in range(args.warmup):
                trainer.train_step()
        row["peak_gib"] = (torch.cuda.max_memory_allocated() - resident) / 2**30
        return row, trainer
    except torch.OutOfMemoryError:
        row.update(status="oom", peak_gib=(torch.cuda.max_memory_allocated() - resident) / 2**30)
        if resident:
            row["note"] = f"beside {resident / 2**30:.1f} GiB of the other methods' models"
    except Exception as exc:  # noqa: BLE001 - record it, and measure the other configurations
        row.update(status="error", error=f"{type(exc).__name__}: {exc}")
    del trainer
    free_memory()
    return row, None


def timed_steps(runs, args) -> None:
    """Time ``args.steps`` optimizer steps of every (row, trainer) in ``runs``, one step of each
    in turn: a drift of the GPU's speed over the run (its clocks follow its power and
    temperature) then falls on every method alike, where timing one method's steps
    after another's would charge it to whichever ran in the slower stretch. Each step ends in
    its loss's .item(), a sync, so its host time is its whole time. Fills in each row."""
    each = {id(row): [] for row, _ in runs}
    losses = {}
    for _ in range(args.steps):
        for row, trainer in runs:
            if row.get("status"):
                continue  # failed in an earlier turn
            try:
                with attention_context(row["method"]):
                    began = time.perf_counter()
                    losses[id(row)] = trainer.train_step()
                    each[id(row)].append(1e3 * (time.perf_counter() - began))
            except torch.OutOfMemoryError:
                row.update(status="oom", note="out of memory beside the other methods' models")
            except Exception as exc:  # noqa: BLE001 - record it, and time the others
                row.update(status="error", error=f"{type(exc).__name__}: {exc}")
    for row, _ in runs:
        if row.get("status"):
            continue
        ms = each[id(row)]
        mean = statistics.mean(ms)
        # each step's time too: whether a mean is one slow step or every step slower
        row.update(status="ok", step_ms=mean, step_ms_median=statistics.median(ms),
                   step_ms_each=[round(t, 2) for t in ms],
                   tokens_per_s=row["batch"] * row["seq_len"] / (mean / 1e3),
                   last_loss=losses[id(row)])


def train_runs(methods, T, args, data, failed: dict) -> list[dict]:
    """One row per method at sequence length T: warmed up one after another, timed in turn.
    ``failed``: method -> the status that a shorter T ended in (those are not run)."""
    runs, rows = [], []
    for method in methods:
        if method in failed:  # tokens per step are fixed: a longer T never needs less memory
            rows.append({"method": method, "seq_len": T, "batch": args.tokens_per_step // T,
                         "status": failed[method], "note": "not run: a shorter T already failed"})
            continue
        row, trainer = warm_up(method, T, args, data)
        rows.append(row)
        if trainer is not None:
            runs.append((row, trainer))
    try:
        timed_steps(runs, args)
    finally:
        runs.clear()  # the trainers go before the next T's are built
        free_memory()
    for row in rows:
        if row["status"] != "ok":
            failed.setdefault(row["method"], row["status"])
    return rows


def attention_memory(method, T, args) -> dict:
    """Peak memory of one causal attention call, forward + backward, beyond its inputs."""
    B = args.tokens_per_step // T
    row = {"method": method, "seq_len": T, "batch": B}
    try:
        free_memory()
        q, k, v = (torch.randn(B, 12, T, 64, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with attention_context(method):
            if method == "sdpa-flash":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = flashedu.attention(q, k, v, is_causal=True, backend=METHODS[method])
            out.backward(grad)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        row.update(status="ok", mib=extra / 2**20, mib_per_seq=extra / 2**20 / B)
    except torch.OutOfMemoryError:
        row.update(status="oom")
    except Exception as exc:  # noqa: BLE001
        row.update(status="error", error=f"{type(exc).__name__}: {exc}")
    finally:
        free_memory()
    return row


def longest_fit(results, method):
    ok = [r["seq_len"] for r in results if r["method"] == method and r["status"] == "ok"]
    return max(ok) if ok else None


def print_table(results, seq_lens, methods):
    tokens = results[0]["batch"] * results[0]["seq_len"]
    print(f"\nGPT-2 small training, bf16, {tokens} tokens/step")
    print("step time: mean (median) of steps taken in turn with the other methods'")
    print(f"{'T':>6} | " + " | ".join(f"{m:>40}" for m in methods))
    for T in seq_lens:
        cells = []
        for m in methods:
            r = next(r for r in results if r["method"] == m and r["seq_len"] == T)
            cells.append(f"{r['step_ms']:6.1f} ({r['step_ms_median']:6.1f}) ms "
                         f"{r['tokens_per_s'] / 1e3:6.1f} ktok/s "
                         f"{r['peak_gib']:5.1f} GiB"
                         if r["status"] == "ok" else r["status"])
        print(f"{T:>6} | " + " | ".join(f"{c:>40}" for c in cells))


def environment(args, argv) -> dict:
    env = core.environment(["gpt", *argv])
    if args.commit:
        env["commit"] = args.commit
    return {**env, "device": f"{env['device']}, {env['device_memory']}",
            "tokens_per_step": args.tokens_per_step,
            "warmup_steps": args.warmup, "timed_steps": args.steps,
            "timing": "one step of each method in turn, each step ended by a sync",
            "model": {"d_model": 768, "n_layers": args.n_layers, "n_heads": 12, "d_ff": 3072,
                      "vocab_size": 50257, "dropout": args.dropout, "autocast": "bf16",
                      "optimizer": "AdamW", "grad_clip": 1.0}}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not core.gpu_available():
        return core.needs_gpu("flashedu bench gpt")

    seq_lens, methods = args.seq_lens, list(args.methods)
    report = environment(args, argv)
    report["triton_missing"] = check_triton() if "flashedu-triton" in methods else None
    if report["triton_missing"]:
        print(f"flashedu triton backend missing on this GPU: {report['triton_missing']}")
        methods.remove("flashedu-triton")
    report["methods"] = methods
    data = torch.randint(0, 50257, (4_000_000,), generator=torch.Generator().manual_seed(0))
    results, attn, failed = [], [], {}
    for T in seq_lens:
        for row in train_runs(methods, T, args, data, failed):
            print(json.dumps(row), flush=True)
            results.append(row)
        for method in methods:
            attn.append(attention_memory(method, T, args))
            print(json.dumps(attn[-1]), flush=True)
    report["results"], report["attention_memory"] = results, attn
    report["longest_fit"] = {m: longest_fit(results, m) for m in methods}
    print_table(results, seq_lens, methods)
    print("longest T that fits:", report["longest_fit"])
    core.write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0
