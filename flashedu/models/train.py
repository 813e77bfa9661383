"""Train a GPT on the shipped text: AdamW, warmup then cosine, gradient accumulation, bf16
autocast, optional torch.compile, exact checkpoints, a tqdm bar, a loss plot.

    python -m flashedu.models.train --steps 300                       # tiny model, CPU, ~20 s
    python -m flashedu.models.train --steps 300 --checkpoint ck.pt    # ... saving at the end
    python -m flashedu.models.train --resume ck.pt --steps 600        # go on to step 600

Exact resume: a checkpoint holds the model, the optimizer, the step (the schedule is a function
of it), the trainer's batch generator and torch's RNG states (dropout). A resumed run therefore
draws the same batches and dropout masks as the uninterrupted run and, on the same machine, its
losses are bit-identical (tests/test_models.py checks it). A model trained with your own
attention function saves that function's name only: pass the function again to ``resume``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from . import data as text
from .config import GPTConfig
from .gpt import GPT


@dataclass
class TrainSettings:
    """What a run does, as opposed to what the model is (GPTConfig)."""

    batch_size: int = 8  # sequences per micro-batch (x gradient_accumulation_steps per step)
    seq_len: int = 128
    max_steps: int | None = None  # optimizer steps; None: config.epochs passes over the text
    seed: int = 0
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    min_lr_ratio: float = 0.1  # where cosine / linear decay end, as a fraction of lr
    eval_every: int = 0  # steps between validation losses; 0: never
    eval_batches: int = 4
    checkpoint_path: str | None = None
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end (if a path is set)
    progress: bool = True  # tqdm bar

    def __post_init__(self):
        for name in ("batch_size", "seq_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise ValueError(f"max_steps must be None or an int >= 1, got {self.max_steps!r}")


def tiny_config(**overrides) -> GPTConfig:
    """A model small enough to train on a laptop CPU in seconds (byte vocabulary).

    lr 2e-3: at 3e-3 the loss of this model jumps from 3.3 to 7.4 for one step at the end of
    warmup (the same on CPU and GPU, every backend), then recovers.
    """
    fields = {"vocab_size": text.VOCAB_SIZE, "d_model": 64, "n_layers": 2, "n_heads": 4,
              "d_ff": 256, "max_seq_len": 64, "dropout": 0.0, "lr": 2e-3, "warmup_steps": 20,
              "weight_decay": 0.01, "gradient_accumulation_steps": 1, "mixed_precision": False,
              "compile_model": False, "device": "cpu", "epochs": 1, "attention_backend": "naive"}
    fields.update(overrides)
    return GPTConfig(**fields)


def lr_factor(step: int, warmup: int, total: int, decay: str, min_ratio: float) -> float:
    """Multiplier of config.lr at optimizer step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup  # linear warmup; never 0, so step 0 already learns
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if decay == "linear":
        return 1 - (1 - min_ratio) * progress
    return 1.0


class Trainer:
    def __init__(self, config: GPTConfig, settings: TrainSettings | None = None, data=None):
        self.config, self.settings = config, settings or TrainSettings()
        if self.settings.seq_len > config.max_seq_len:
            raise ValueError(f"seq_len={self.settings.seq_len} is longer than the model's "
                             f"max_seq_len={config.max_seq_len}")
        corpus = text.load_corpus() if data is None else data
        self.train_data, self.val_data = text.split(corpus)
        torch.manual_seed(self.settings.seed)  # the initial weights depend on settings.seed alone
        self.device = torch.device(config.device)
        self.model = GPT(config).to(self.device)
        self.run_model = torch.compile(self.model) if config.compile_model else self.model
        # on a GPU one fused kernel updates every parameter (instead of a few kernels per
        # group of tensors); the CPU keeps the default implementation
        self.optimizer = torch.optim.AdamW(self._param_groups(), lr=config.lr, betas=config.betas,
                                           eps=config.eps, fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        self.generator = torch.Generator().manual_seed(self.settings.seed)
        self._prefetched = None  # the next step's first micro-batch, drawn ahead (_prefetch)
        self._generator_before_prefetch = None
        self.step = 0
        self.history: list[dict] = []

    # --- setup ---------------------------------------------------------------------------

    def _param_groups(self):
        # Decay matrices (weights, embeddings); never biases or LayerNorm gains.
        params = [p for p in self.model.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.config.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    def _lr_lambda(self, step):
        return lr_factor(step, self.config.warmup_steps, self.total_steps, self.config.lr_decay,
                         self.settings.min_lr_ratio)

    @property
    def tokens_per_step(self) -> int:
        s = self.settings
        return s.batch_size * s.seq_len * self.config.gradient_accumulation_steps

    @property
    def total_steps(self) -> int:
        if self.settings.max_steps is not None:
            return self.settings.max_steps
        per_epoch = max(1, len(self.train_data) // self.tokens_per_step)
        return self.config.epochs * per_epoch

    def autocast(self):
        """bf16 autocast on a GPU when mixed_precision; off on the CPU, where bf16 matmuls are
        slower than fp32 on most laptops and the interpreted kernels compute in fp32 anyway."""
        if self.config.mixed_precision and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # --- training ------------------------------------------------------------------------

    def train_step(self, prefetch: bool = True) -> float:
        """One optimizer step over gradient_accumulation_steps micro-batches; the mean loss.
        ``prefetch``: draw the next step's first micro-batch before waiting for this one's
        (``fit`` says no after its last step)."""
        self.model.train()
        accum = self.config.gradient_accumulation_steps
        total = torch.zeros((), device=self.device)
        for i in range(accum):
            x, y = self._first_batch() if i == 0 else self._batch(self.train_data, self.generator)
            with self.autocast():
                loss = self.run_model_loss(x, y) / accum
            loss.backward()  # gradients add up over micro-batches: their mean, as one big batch
            total += loss.detach()
        if self.settings.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if prefetch:
            self._prefetch()
        return total.item()  # waits for this step's kernels: the next batch is on its way

    def _prefetch(self):
        """Draw the next step's first micro-batch now, while the GPU still runs this step's
        kernels, and start its copy (from pinned memory, so that it does not wait for them).
        Drawn at the end of step s instead of the start of step s + 1, the batches are the
        same; a checkpoint keeps the generator's state from before this draw, so that a
        resumed run draws this batch again."""
        self._generator_before_prefetch = self.generator.get_state()
        self._prefetched = self._batch(self.train_data, self.generator)

    def _first_batch(self):
        """The batch _prefetch drew for this step, else one drawn now (also where the batch
        size or length changed since: drawn again from the generator's state before)."""
        batch, self._prefetched = self._prefetched, None
        if batch is not None and batch[0].shape != (self.settings.batch_size,
                                                   self.settings.seq_len):
            self.generator.set_state(self._generator_before_prefetch)
            batch = None
        self._generator_before_prefetch = None
        return self._batch(self.train_data, self.generator) if batch is None else batch

    def run_model_loss(self, x, y):
        logits = self.run_model(x)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def _batch(self, data, generator):
        """A batch drawn on the host and on its way to the device: from pinned memory on a
        GPU, so that the copy does not wait for the kernels queued before it."""
        x, y = text.get_batch(data, self.settings.batch_size, self.settings.seq_len, generator)
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss on the held-out text, over the same batches every time (own generator)."""
        self.model.eval()
        generator = torch.Generator().manual_seed(self.settings.seed + 1)
        losses = []
        for _ in range(self.settings.eval_batches):
            x, y = self._batch(self.val_data, generator)
            with self.autocast():
                losses.append(self.run_model_loss(x, y).item())
        return sum(losses) / len(losses)

    def fit(self, until: int | None = None) -> list[dict]:
        """Train up to optimizer step ``until`` (default: total_steps); returns the history."""
        from tqdm.auto import tqdm

        until = self.total_steps if until is None else until
        s = self.settings
        bar = tqdm(total=until, initial=self.step, disable=not s.progress, desc="train", unit="step")
        start = time.perf_counter()
        while self.step < until:
            row = {"step": self.step + 1, "lr": self.scheduler.get_last_lr()[0]}
            row["loss"] = self.train_step(prefetch=self.step + 1 < until)
            row["time"] = time.perf_counter() - start
            if s.eval_every and (self.step % s.eval_every == 0 or self.step == until):
                row["val_loss"] = self.evaluate()
            self.history.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}")
            if s.checkpoint_path and s.checkpoint_every and self.step % s.checkpoint_every == 0:
                self.save(s.checkpoint_path)
        bar.close()
        if s.checkpoint_path and not s.checkpoint_every:
            self.save(s.checkpoint_path)
        return self.history

    # --- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "settings": asdict(self.settings),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "history": self.history,
            "generator": (self.generator.get_state() if self._prefetched is None
                          else self._generator_before_prefetch),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def save(self, path) -> None:
        tmp = f"{path}.tmp"
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)  # atomic: a crash mid-save never leaves a torn checkpoint

    @classmethod
    def resume(cls, path, data=None, attention_backend=None, **settings_overrides) -> Trainer:
        """A trainer in exactly the state ``save`` left, ready to ``fit`` on.

        ``attention_backend``: required when the run used an attention function (a checkpoint
        holds only its name); a backend name or function here replaces the saved one."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        settings = TrainSettings(**{**state["settings"], **settings_overrides})
        config = GPTConfig.from_dict(state["config"], attention_backend=attention_backend)
        trainer = cls(config, settings, data=data)
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
        trainer.step, trainer.history = state["step"], list(state["history"])
        trainer.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])  # last: building the trainer drew from it
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        return trainer

    # --- using the model -----------------------------------------------------------------

    @torch.no_grad()
    def sample(self, prompt: str, n_tokens: int = 200, temperature: float = 0.8, seed: int = 0) -> str:
        """Continue ``prompt`` byte by byte (own generator: sampling leaves training RNG alone)."""
        self.model.eval()
        generator = torch.Generator(device=self.device).manual_seed(seed)
        ids = text.encode(prompt)[None].to(self.device)
        for _ in range(n_tokens):
            with self.autocast():
                logits = self.model(ids[:, -self.config.max_seq_len:])[:, -1].float()
            probs = torch.softmax(logits / temperature, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return text.decode(ids[0].tolist())


def plot_history(history: list[dict], path=None, title="GPT on the KJV text (bytes)"):
    """Training loss (and validation loss where measured) against the step; saved if ``path``."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], label="train", lw=1)
    val = [r for r in history if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats / byte)", title=title)
    ax.legend()
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


# --- command line ------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m flashedu.models.train", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps to train up to (default 300; on --resume, the saved run's)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--backend", default="naive", help="naive, numpy, triton, numba, sdpa or auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mixed-precision", action="store_true", help="bf16 autocast (GPU only)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--checkpoint", help="save a checkpoint here at the end")
    p.add_argument("--resume", help="go on from this checkpoint (its model and settings)")
    p.add_argument("--plot", help="write the loss plot to this PNG")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def build_trainer(args) -> Trainer:
    common = {"checkpoint_path": args.checkpoint, "progress": not args.no_progress}
    if args.resume:
        # A new --steps moves the end of the cosine schedule: the run is then no longer the
        # uninterrupted one, but a longer (or shorter) one.
        steps = {} if args.steps is None else {"max_steps": args.steps}
        return Trainer.resume(args.resume, **common, **steps)
    common["max_steps"] = 300 if args.steps is None else args.steps
    config = tiny_config(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                         d_ff=4 * args.d_model, max_seq_len=args.seq_len, lr=args.lr,
                         warmup_steps=args.warmup_steps, dropout=args.dropout,
                         gradient_accumulation_steps=args.grad_accum,
                         attention_backend=args.backend, device=args.device,
                         mixed_precision=args.mixed_precision, compile_model=args.compile)
    settings = TrainSettings(batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                             eval_every=args.eval_every, **common)
    return Trainer(config, settings)


def main(argv=None) -> int:
    args = parse_args(argv)
    trainer = build_trainer(args)
    print(f"GPT {trainer.model.num_params() / 1e6:.2f} M parameters, attention backend "
          f"{trainer.config.backend_name!r}, {trainer.tokens_per_step} tokens per step")
    history = trainer.fit()
    last = history[-1]
    print(f"step {last['step']}: loss {last['loss']:.3f}"
          + (f", validation {last['val_loss']:.3f}" if "val_loss" in last else "")
          + f", {last['time']:.1f} s")
    print(repr(trainer.sample("And God said, ", 120)))
    if args.plot:
        plot_history(history, args.plot)
        print(f"loss plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
