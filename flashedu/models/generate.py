"""Generating text for several prompts at once from one paged KV cache.

Each prompt is read once (the prefill: causal attention over the whole prompt, with the model's
own attention backend), its keys and values stored in the cache's pages; then every step feeds
one new token per sequence, stores its K and V, and attends to the sequence's cache with
``flashedu.decode.paged_attention``: one call for all sequences, whatever their lengths.
Without the cache, each new token would recompute the K and V of every earlier token.
"""

from __future__ import annotations

import math

import torch

from ..decode import PagedKVCache
from .gpt import GPT


@torch.no_grad()
def generate(model: GPT, prompts, max_new_tokens: int, *, temperature: float = 0.0,
             generator=None, page_size: int = 16, num_pages=None, backend=None):
    """Continue each prompt (a 1-D tensor of token ids) by max_new_tokens tokens.

    temperature 0 picks the likeliest token (greedy); above 0 samples from
    softmax(logits / temperature) with ``generator``. ``num_pages``: the pool's size (None:
    enough for every sequence to reach its full length). ``backend``: paged_attention's
    ("triton" on a GPU, "numpy" on a CPU by default). Returns the list of prompt + new tokens.
    """
    prompts = [torch.as_tensor(p, device=model.tok_emb.weight.device).long() for p in prompts]
    _check(model, prompts, max_new_tokens, temperature)
    cfg = model.config
    device, dtype = model.tok_emb.weight.device, model.tok_emb.weight.dtype
    if backend is None:
        backend = "triton" if device.type == "cuda" else "numpy"
    if num_pages is None:
        num_pages = sum(math.ceil((len(p) + max_new_tokens) / page_size) for p in prompts)
    cache = PagedKVCache(num_pages, page_size, cfg.n_heads, cfg.head_dim,
                         num_layers=cfg.n_layers, dtype=dtype, device=device)
    was_training = model.training
    model.eval()
    try:
        seqs, last = [], []
        for ids in prompts:  # prefill, one prompt at a time: the prompts' lengths differ
            seq = cache.add_sequence()
            seqs.append(seq)
            cache.extend([seq], len(ids))
            last.append(forward_with_cache(model, ids[None], cache, [seq], backend)[:, -1])
        out = [list(p.tolist()) for p in prompts]
        token = _pick(torch.cat(last), temperature, generator)
        for step in range(max_new_tokens):
            for o, t in zip(out, token.tolist()):
                o.append(t)
            if step == max_new_tokens - 1:
                break
            cache.extend(seqs, 1)  # room for the new token of every sequence
            token = _pick(forward_with_cache(model, token[:, None], cache, seqs, backend)[:, -1],
                          temperature, generator)
    finally:
        model.train(was_training)
    return [torch.tensor(o, device=device) for o in out]


def forward_with_cache(model: GPT, ids, cache: PagedKVCache, seqs, backend):
    """Logits (B, T, vocab) of the last T tokens of each sequence, whose room the cache has made
    (``extend``): their K, V are stored, and they attend to everything the cache holds. T > 1
    is a prefill (one sequence from its start); T = 1 a decoding step."""
    T = ids.shape[1]
    ends = cache.seqlens(seqs).long()  # each sequence's length, the new tokens included

    def attend(layer, q, k, v):
        cache.write(layer, seqs, k, v)
        if T > 1:  # the prompt: plain causal attention over itself, by the model's backend
            return model.blocks[layer].attn.attend(q, k, v)
        return cache.attention(layer, q.contiguous(), seqs, backend=backend)

    positions = ends[:, None] - T + torch.arange(T, device=ids.device)
    return model(ids, positions=positions, attend=attend)


def _pick(logits, temperature, generator):
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _check(model, prompts, max_new_tokens, temperature):
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a flashedu.models.GPT, got {type(model).__name__}")
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite float >= 0, got {temperature!r}")
    for i, p in enumerate(prompts):
        if p.dim() != 1 or len(p) == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D tensor of token ids, got "
                             f"shape {tuple(p.shape)}")
        if len(p) + max_new_tokens > model.config.max_seq_len:
            raise ValueError(f"prompts[{i}] ({len(p)} tokens) + max_new_tokens "
                             f"({max_new_tokens}) exceeds the model's max_seq_len "
                             f"({model.config.max_seq_len})")
