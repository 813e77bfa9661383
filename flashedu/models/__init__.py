"""A GPT trained with flashedu's attention: the course's end-to-end chapter (notebook 11).

    from flashedu.models import GPT, GPTConfig, Trainer, TrainSettings, tiny_config
    trainer = Trainer(tiny_config(), TrainSettings(batch_size=16, seq_len=64, max_steps=300))
    trainer.fit()

config.py   GPTConfig: the fields and defaults of the GPT3Config in the README of the PyTorch
            implementation PeTeRr0/FlashAttention-pytorch, checked
gpt.py      GPT: pre-LayerNorm decoder, weight tying, attention through flashedu.attention
            or any function fn(q, k, v, *, is_causal)
learner.py  your Triton exercise kernels (notebooks 06, 07) as such a function, with autograd
data.py     the shipped public-domain text (flashedu/data/kjv.txt) and a byte tokenizer
generate.py generate: several prompts at once from one paged KV cache
train.py    Trainer: AdamW, warmup + cosine, accumulation, bf16, exact checkpoints; CLI
"""

from .config import ATTENTION_BACKENDS, GPTConfig
from .generate import generate
from .gpt import GPT
from .learner import ExerciseAttention, load_exercise_kernels
from .train import Trainer, TrainSettings, lr_factor, plot_history, tiny_config

__all__ = ["ATTENTION_BACKENDS", "GPT", "ExerciseAttention", "GPTConfig", "TrainSettings",
           "Trainer", "generate", "load_exercise_kernels", "lr_factor", "plot_history", "tiny_config"]
