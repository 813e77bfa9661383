"""``GPTConfig``: the GPT-3-style configuration of the PyTorch implementation
PeTeRr0/FlashAttention-pytorch (its README's ``GPT3Config``) as a checked dataclass.

Every field and default is that ``GPT3Config``'s (GPT-2 small sizes: d_model 768, 12 layers,
12 heads), plus ``attention_backend``, which picks the attention (a backend name, or your own
function), and ``attn_dropout``. A bad value raises ValueError or TypeError naming the field,
when the config is built rather than deep inside a training run.

Attention dropout (on the attention weights P) runs on the "naive", "numpy" and "triton"
backends (all three draw the same Philox mask, ``flashedu.dropout``; numpy and triton inside
the tiled kernels, the paper's Algorithms 2 and 4), on "sdpa" (torch's own generator), and on a
function that takes ``dropout_p``. The "numba" backend has no dropout: with it the attention
dropout is 0.0, and the config says so (see ``attn_dropout``).

A function as ``attention_backend`` cannot be saved by value: ``to_dict`` (the checkpoint)
stores its qualified name, and ``from_dict`` asks for the function again.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields

# flashedu.attention's backends, plus torch's own fused SDPA for comparison.
ATTENTION_BACKENDS = ("auto", "naive", "numpy", "numba", "triton", "sdpa")
CALLABLE_MARK = "callable:"  # to_dict's stand-in for a function: "callable:module.qualname"
LR_DECAYS = ("cosine", "linear", "constant")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class GPTConfig:
    # Model architecture
    vocab_size: int = 50257  # GPT-2/3 BPE vocabulary; the byte tokenizer of the course uses 256
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    dropout: float = 0.1  # embeddings, residual branches, attention (not numba's: attn_dropout)
    max_seq_len: int = 512  # length of the learned position table: the longest sequence

    # Optimization
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 1000  # linear warmup from 0 to lr
    lr_decay: str = "cosine"  # after warmup: "cosine", "linear" (both to 10% of lr) or "constant"

    # FlashAttention / blocking
    block_size: int = 128  # GPT3Config's tile size for block-sparse attention (unused by dense GPT)
    use_flash_attention: bool = True  # False: the naive (materialized N x N) attention

    # Model details
    activation: str = "gelu"
    initializer_range: float = 0.02

    # Training setup
    gradient_accumulation_steps: int = 16
    mixed_precision: bool = True  # bf16 autocast on a GPU (off on the CPU, see train.py)
    compile_model: bool = True  # torch.compile the model
    device: str = field(default_factory=_default_device)
    epochs: int = 5

    # flashedu additions
    # One of ATTENTION_BACKENDS, or a function fn(q, k, v, *, is_causal) -> out with SDPA's
    # shapes (q, k, v, out: (B, H, T, d)); it gets dropout_p too if it has that keyword.
    attention_backend: str | Callable = "auto"
    # Dropout on the attention probabilities. None: `dropout` when the backend implements it
    # (naive, numpy, triton, so "auto" too; sdpa; a function with a dropout_p keyword), else
    # 0.0 (numba, or a function without dropout_p) and GPT warns when it is built. A number > 0
    # with a backend that has no dropout is an error.
    attn_dropout: float | None = None

    def __post_init__(self):
        self.betas = tuple(self.betas)  # a list from JSON or a checkpoint reads the same
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len",
                     "block_size", "gradient_accumulation_steps", "epochs"):
            _positive_int(self, name)
        _non_negative_int(self, "warmup_steps")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads "
                             f"({self.n_heads}): each head gets d_model // n_heads dims")
        for name in ("lr", "eps", "initializer_range"):
            _positive_float(self, name)
        _probability(self, "dropout", self.dropout)
        if self.attn_dropout is not None:
            _probability(self, "attn_dropout", self.attn_dropout)
        if not isinstance(self.weight_decay, (int, float)) or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be a float >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1
                                           for b in self.betas):
            raise ValueError(f"betas must be two floats in [0, 1), got {self.betas!r}")
        _choice(self, "lr_decay", LR_DECAYS)
        _choice(self, "activation", ACTIVATIONS)
        _check_backend(self.attention_backend)
        for name in ("use_flash_attention", "mixed_precision", "compile_model"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        self._check_attention()

    def _check_attention(self):
        if not self.use_flash_attention and (callable(self.attention_backend)
                                             or self.attention_backend not in ("auto", "naive")):
            raise ValueError(
                f"use_flash_attention=False selects naive attention, but attention_backend is "
                f"{self.backend_name!r}: leave attention_backend='auto' or set "
                "use_flash_attention=True")
        if self.attn_dropout and not self.backend_has_dropout:
            raise ValueError(
                f"attn_dropout={self.attn_dropout}, but the {self.backend_name!r} attention "
                "backend has no dropout: use attention_backend 'naive', 'numpy', 'triton' or "
                "'sdpa' (or a function with a dropout_p keyword), or attn_dropout=0.0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def backend(self) -> str | Callable:
        """The attention that runs: 'sdpa', a flashedu backend, with 'auto' resolved by
        ``device`` (triton on 'cuda', numpy on 'cpu', as flashedu.attention's own 'auto'), or
        the function given as ``attention_backend``."""
        if not self.use_flash_attention:
            return "naive"
        if self.attention_backend == "auto":
            return "triton" if self.device.startswith("cuda") else "numpy"
        return self.attention_backend

    @property
    def backend_name(self) -> str:
        """``backend`` as text: the backend's name, or the function's qualified name."""
        backend = self.backend
        return qualified_name(backend) if callable(backend) else backend

    @property
    def backend_has_dropout(self) -> bool:
        if callable(self.backend):
            return takes_dropout(self.backend)
        if self.backend == "sdpa":
            return True
        from ..backends import BACKENDS

        return BACKENDS[self.backend].has_dropout

    @property
    def attention_dropout(self) -> float:
        """The dropout probability applied to attention weights (see ``attn_dropout``)."""
        if self.attn_dropout is not None:
            return float(self.attn_dropout)
        return float(self.dropout) if self.backend_has_dropout else 0.0

    def to_dict(self) -> dict:
        """The fields as plain data (for a checkpoint). A function as attention_backend is
        stored as "callable:<module>.<qualname>": only its name can be saved."""
        # not asdict: it deep-copies every value, and a function object need not be copyable
        fields = {f.name: getattr(self, f.name) for f in dataclass_fields(self)}
        if callable(self.attention_backend):
            fields["attention_backend"] = CALLABLE_MARK + qualified_name(self.attention_backend)
        return fields

    @classmethod
    def from_dict(cls, fields: dict, attention_backend: str | Callable | None = None) -> GPTConfig:
        """The config ``to_dict`` saved. ``attention_backend``, when given, replaces the saved
        one; it is required when the saved one was a function (stored by name only)."""
        fields = dict(fields)
        saved = fields.get("attention_backend")
        if attention_backend is not None:
            fields["attention_backend"] = attention_backend
        elif isinstance(saved, str) and saved.startswith(CALLABLE_MARK):
            raise ValueError(
                f"this config was saved with the attention function {saved[len(CALLABLE_MARK):]}"
                " as attention_backend, and a function cannot be saved by value: pass it again, "
                "e.g. Trainer.resume(path, attention_backend=fn) or "
                "GPTConfig.from_dict(fields, attention_backend=fn)")
        return cls(**fields)


def qualified_name(fn) -> str:
    """module.qualname of a function (or of a callable object's class)."""
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", repr(fn))
    return f"{module}.{name}" if module else name


def takes_dropout(fn) -> bool:
    """True if ``fn`` accepts a dropout_p keyword (SDPA's name for it)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature
        return False
    return "dropout_p" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _check_backend(value):
    if callable(value):
        return
    if isinstance(value, str) and value.startswith(CALLABLE_MARK):
        raise ValueError(
            f"attention_backend {value!r} is the name a saved config keeps for an attention "
            "function: pass the function itself (GPTConfig.from_dict(fields, "
            "attention_backend=fn), or Trainer.resume(path, attention_backend=fn))")
    if not isinstance(value, str):
        raise TypeError(
            f"attention_backend must be a backend name (one of {list(ATTENTION_BACKENDS)}) or a "
            f"function fn(q, k, v, *, is_causal) -> out, got {type(value).__name__} {value!r}")
    if value not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)} or a "
                         f"function fn(q, k, v, *, is_causal), got {value!r}")


def _positive_int(cfg, name):
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _non_negative_int(cfg, name):
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def _positive_float(cfg, name):
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite float, got {value}")


def _probability(cfg, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")


def _choice(cfg, name, allowed):
    value = getattr(cfg, name)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
