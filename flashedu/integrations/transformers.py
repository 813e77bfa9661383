"""``flashedu.attention`` as an attention implementation of Hugging Face transformers.

    from flashedu.integrations.transformers import register
    register()                                  # attn_implementation "edu", backend "auto"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="edu")

transformers calls an attention implementation as ``fn(module, query, key, value,
attention_mask, dropout=..., scaling=..., **kwargs)``: query (B, H, Nq, d), key and value
(B, Hkv, Nk, d); it takes back ``(out, weights)``, out (B, Nq, H, d). The mask comes from the
mask function registered under the same name, and a name without one gets
``attention_mask=None``: padding silently ignored. So :func:`register` registers both, the mask
function being the one "sdpa" has: a bool (B, 1, Nq, Nk) mask (True: the pair takes part) with
causality, padding, a sliding window and a KV cache's offset in it, or None where ``is_causal``
alone says it all.

The name must not contain "flash": transformers 5 takes every such name for a Flash Attention
implementation (``is_flash_attention_requested`` tests ``"flash" in name``), so
``from_pretrained`` looks for the flash-attn package, and models and ``generate`` switch to Flash
Attention's code paths. Hence "edu", not "flashedu".

What differs from "sdpa": ``softcap`` (Gemma 2) is applied, as ``flashedu.mods.softcap``; a
query row that sees no key (a left-padding position) gives zeros where SDPA's CPU path gives
the mean of v, which changes no real token. Attention sinks (``s_aux``, ``sinks``), a head mask
and ``output_attentions=True`` are refused.
"""

from __future__ import annotations

import torch

import flashedu
from flashedu import mods
from flashedu.backends import BACKENDS

# the keyword arguments a model may pass that change the result and that flashedu cannot honour
REFUSED = {"s_aux": "attention sinks", "sinks": "attention sinks", "head_mask": "a head mask"}


def register(name: str = "edu", backend: str = "auto") -> None:
    """Register ``flashedu.attention`` (on ``backend``) and SDPA's mask function with
    transformers as attention implementation ``name``: afterwards
    ``from_pretrained(..., attn_implementation=name)`` (or ``config._attn_implementation =
    name``) runs every attention layer of the model through flashedu. Registering a name again
    replaces it (another backend, say); transformers' own names ("sdpa", "eager", ...) are
    refused."""
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValueError(f"backend must be one of {['auto', *BACKENDS]}, got {backend!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(f"name {name!r} contains 'flash', which transformers takes for a Flash "
                         "Attention implementation (from_pretrained then looks for the flash-attn "
                         "package, and models take Flash Attention's code paths); choose another, "
                         "such as the default 'edu'")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError("flashedu.integrations.transformers needs Hugging Face transformers: "
                          'pip install "flashedu[transformers]"') from exc
    taken = AttentionInterface._global_mapping.get(name)
    if taken is not None and not getattr(taken, "flashedu_backend", None):
        raise ValueError(f"name {name!r} is transformers' own attention implementation; "
                         "register flashedu under another name")

    def flashedu_attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, backend=backend,
                                 **kwargs)

    flashedu_attention.flashedu_backend = backend
    AttentionInterface.register(name, flashedu_attention)
    # the mask SDPA gets: flashedu.attention takes SDPA's attn_mask and is_causal as they are
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping["sdpa"])


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, *, backend="auto", **kwargs):
    """transformers' attention call (that of ``sdpa_attention_forward``) on
    ``flashedu.attention``: returns ``(out (B, Nq, H, d), None)``."""
    for arg, what in REFUSED.items():
        if kwargs.get(arg) is not None:
            raise NotImplementedError(f"flashedu does not implement {what} ({arg}=...); use "
                                      "attn_implementation='eager' for this model")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("flashedu never forms the attention weights "
                                  "(output_attentions=True); use attn_implementation='eager'")
    Nq, Nk = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # As SDPA's adapter: is_causal only where no mask is given and more than one query comes.
    # transformers leaves the mask out for Nq > 1 only where Nq == Nk or the cache is still
    # empty (its keys past Nq not yet written): there top-left causal, flashedu's and SDPA's
    # is_causal, is the rule. A decoding step (Nq = 1) sees every key.
    is_causal = bool(is_causal) and attention_mask is None and Nq > 1
    _check_window(kwargs.get("sliding_window"), attention_mask, Nk)
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:  # T5's relative positions: a bias added to every score
        attention_mask = _bias_mask(position_bias, attention_mask, is_causal, Nq, Nk)
        is_causal = False
    softcap = kwargs.get("softcap")
    out = flashedu.attention(
        query, key, value, attn_mask=attention_mask, is_causal=is_causal, scale=scaling,
        dropout_p=dropout, score_mod=None if softcap is None else mods.softcap(softcap),
        enable_gqa=query.shape[1] != key.shape[1], backend=backend)
    return out.transpose(1, 2).contiguous(), None


def _check_window(window, attention_mask, Nk) -> None:
    """A sliding window lives in the mask (transformers builds it there); without a mask it is
    harmless only while no query can see a key ``window`` positions back."""
    if window is not None and attention_mask is None and Nk > window:
        raise ValueError(
            f"sliding_window={window} with no attention_mask for {Nk} keys: the window would be "
            "ignored. transformers puts it into the mask of the mask function registered with "
            "the attention implementation; register() registers it")


def _bias_mask(position_bias, attention_mask, is_causal, Nq, Nk):
    """The float mask of a position bias: the bias where a pair takes part, -inf elsewhere
    (the causal rule included), a float mask added to it."""
    if attention_mask is None and is_causal:
        attention_mask = torch.ones(Nq, Nk, dtype=torch.bool, device=position_bias.device).tril()
    if attention_mask is None:
        return position_bias
    if attention_mask.dtype == torch.bool:
        return position_bias.masked_fill(~attention_mask, float("-inf"))
    return position_bias + attention_mask
