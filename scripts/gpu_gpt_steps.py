"""Each optimizer step's time of the GPT configuration that ``flashedu bench gpt`` trains
(GPT-2 small, bf16, 16384 tokens a step), one provider after another in one process: the first
step (compiles and allocations included), then every later one, each ended by a sync. Where
``flashedu bench gpt`` reports a mean over a few steps, this shows whether one slow step or
every step makes it.

    python scripts/gpu_gpt_steps.py --dropout 0.1              # T = 1024, 16 steps each
    python scripts/gpu_gpt_steps.py --dropout 0.1 --check      # bench gpt's check first

Without a CUDA GPU it says so and exits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def steps_ms(method: str, T: int, steps: int, dropout: float, data) -> list[float]:
    """Milliseconds of each of ``steps`` optimizer steps of a fresh model on ``method``."""
    import torch

    from flashedu.benchmarks.gpt import attention_context, gpt_config
    from flashedu.models import Trainer, TrainSettings

    settings = TrainSettings(batch_size=16384 // T, seq_len=T, max_steps=1000, progress=False)
    trainer = Trainer(gpt_config(method, T, dropout=dropout), settings, data=data)
    each = []
    with attention_context(method):
        for _ in range(steps):
            torch.cuda.synchronize()
            began = time.perf_counter()
            trainer.train_step()
            torch.cuda.synchronize()
            each.append(1e3 * (time.perf_counter() - began))
    del trainer
    torch.cuda.empty_cache()
    return each


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="flashedu-triton,sdpa-flash")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--check", action="store_true",
                        help="run bench gpt's check of the triton backend first, as it does")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time")
        return 0
    if args.check:
        from flashedu.benchmarks.gpt import check_triton

        print("bench gpt's check:", check_triton() or "ok")
    data = torch.randint(0, 50257, (4_000_000,), generator=torch.Generator().manual_seed(0))
    for method in args.methods.split(","):
        each = steps_ms(method, args.seq_len, args.steps, args.dropout, data)
        print(f"{method}: " + " ".join(f"{ms:.1f}" for ms in each)
              + f" ms; median of steps 2-{args.steps}: {statistics.median(each[1:]):.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
