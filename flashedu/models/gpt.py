"""A GPT (decoder-only transformer, GPT-2 layout) whose attention is ``flashedu.attention``.

    x = tok_emb[ids] + pos_emb[:T]
    for each block:  x = x + Attn(LN(x));  x = x + MLP(LN(x))      (pre-LayerNorm)
    logits = LN(x) @ tok_emb^T                                     (weight tying)

Only the attention call differs between backends, so comparing them compares attention alone.
``GPTConfig.attention_backend`` may also be your own function ``fn(q, k, v, *, is_causal)``
(see flashedu.models.learner for one built from your Triton exercise kernels).
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..api import attention
from .config import GPTConfig, qualified_name

ACTIVATION = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.backend = config.backend
        self.attn_dropout = config.attention_dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.proj.is_residual_out = True  # GPT-2 scales its init (see GPT._init_weights)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, attend=None) -> torch.Tensor:
        """``attend(q, k, v) -> y``: another attention for this call (None: the model's own)."""
        B, T, C = x.shape
        # (B, T, 3C) -> three (B, H, T, d) views; the last dim stays contiguous for the kernels
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        y = (self.attend if attend is None else attend)(q, k, v)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)))

    def attend(self, q, k, v) -> torch.Tensor:
        p = self.attn_dropout if self.training else 0.0
        if self.backend == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        if callable(self.backend):
            return call_attention_fn(self.backend, q, k, v, p)
        if self.backend == "numba":  # no torch.library operator: compile steps around it
            return _opaque_attention(q, k, v, p, self.backend)
        return attention(q, k, v, is_causal=True, dropout_p=p, backend=self.backend)


def call_attention_fn(fn, q, k, v, dropout_p):
    """Call a user's attention function; a wrong signature or a wrong output is an error that
    names attention_backend and the form it must have."""
    kwargs = {"is_causal": True}
    if dropout_p:  # GPTConfig allows dropout only for a function with a dropout_p keyword
        kwargs["dropout_p"] = dropout_p
    try:
        out = fn(q, k, v, **kwargs)
    except TypeError as exc:
        raise TypeError(f"attention_backend={qualified_name(fn)} failed on q, k, v of shape "
                        f"{tuple(q.shape)} (B, H, T, d): it must be callable as "
                        f"fn(q, k, v, *, is_causal) -> out of the same shape ({exc})") from exc
    if not isinstance(out, torch.Tensor) or out.shape != q.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"attention_backend={qualified_name(fn)} returned {got}; it must "
                         f"return a tensor of q's shape {tuple(q.shape)} (B, H, T, d)")
    return out


# With compile_model=True, torch.compile traces through flashedu.attention: the naive backend
# is plain torch ops, the Triton and NumPy kernels are torch.library operators (flashedu.ops)
# that compile keeps as calls. The numba kernel has no operator, so it stays an opaque call
# that compile steps around.
@torch.compiler.disable
def _opaque_attention(q, k, v, dropout_p, backend):
    return attention(q, k, v, is_causal=True, dropout_p=dropout_p, backend=backend)


def _warn_if_attention_dropout_is_off(config: GPTConfig):
    """dropout > 0 but the backend cannot drop attention probabilities: say so, once a model."""
    if config.attn_dropout is None and config.dropout > 0 and not config.backend_has_dropout:
        how = ("give the function a dropout_p keyword" if callable(config.backend)
               else "use attention_backend='naive' or 'sdpa'")
        warnings.warn(
            f"the attention backend {config.backend_name!r} has no dropout: dropout={config.dropout}"
            " applies to the embeddings and the residual branches, not to the attention "
            f"probabilities. Set attn_dropout=0.0 to say that is intended, or {how}.",
            UserWarning, stacklevel=3)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff)
        self.act = ACTIVATION[config.activation]()
        self.proj = nn.Linear(config.d_ff, config.d_model)
        self.proj.is_residual_out = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x, attend=None):
        x = x + self.attn(self.ln1(x), attend)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a flashedu.models.GPTConfig, got {type(config).__name__}")
        self.config = config
        _warn_if_attention_dropout_is_off(config)
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if getattr(module, "is_residual_out", False):
                # each block adds two residual branches: keep the sum's variance from growing
                std = std / math.sqrt(2 * self.config.n_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(self, ids: torch.Tensor, positions=None, attend=None) -> torch.Tensor:
        """ids: (B, T) int64 token ids -> logits (B, T, vocab_size).

        For decoding from a KV cache (:mod:`flashedu.models.generate`): ``positions`` (B, T),
        the tokens' places in their sequences (None: 0 .. T-1), and ``attend(layer, q, k, v)
        -> y`` in place of each layer's own attention."""
        self._check_ids(ids)
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.dropout(self.tok_emb(ids) + self.pos_emb(positions))
        for layer, block in enumerate(self.blocks):
            x = block(x, None if attend is None else functools.partial(attend, layer))
        return self.ln_f(x) @ self.tok_emb.weight.T  # weight tying: the embedding reads out

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (computed in float32 even under autocast)."""
        logits = self(ids)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _check_ids(self, ids):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be an int64 tensor (B, T) of token ids, got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)} "
                             f"{tuple(getattr(ids, 'shape', ()))}")
        if ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"ids has {ids.shape[1]} tokens per sequence, more than "
                             f"max_seq_len={self.config.max_seq_len}")
        # Out-of-range ids would fail inside the embedding ("index out of range in self", or a
        # device-side assert on a GPU). The check reads two numbers back from the device, so it
        # is left out where that cannot happen: while compiling and during CUDA graph capture.
        if (ids.numel() == 0 or torch.compiler.is_compiling()
                or (ids.is_cuda and torch.cuda.is_current_stream_capturing())):
            return
        low, high = (int(x) for x in torch.aminmax(ids))
        vocab = self.config.vocab_size
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"ids must be token ids in [0, vocab_size={vocab}), got {bad} "
                             f"(ids range over [{low}, {high}]); tokenize with the vocabulary "
                             f"the model was built for, or build it with a larger "
                             f"GPTConfig(vocab_size=...)")
