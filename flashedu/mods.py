"""Mask mods and score mods: FlexAttention's way of saying which keys a query sees and how a
score is changed before the softmax (Dong, Feng, Guessous, Liang, He, 2024, "Flex Attention: A
Programming Model for Generating Optimized Attention Kernels", arXiv:2412.05496).

A **mask mod** answers "may query ``q_idx`` see key ``kv_idx``?" for batch ``b`` and query head
``h``::

    def mask_mod(b, h, q_idx, kv_idx) -> bool

A **score mod** changes one score ``S_ij`` (already multiplied by ``scale``) before the softmax::

    def score_mod(score, b, h, q_idx, kv_idx) -> score

flashedu calls both on whole tensors of indices at once, shaped to broadcast against each other:
``b`` (B, 1, 1, 1), ``h`` (1, H, 1, 1), ``q_idx`` (1, 1, Nq, 1), ``kv_idx`` (1, 1, 1, Nk) (or a
tile's rows and columns only), ``score`` (B, H, Nq, Nk). So a mod is written with torch ops that
broadcast: ``&``, ``|``, ``~`` and ``torch.where`` instead of Python's ``and``, ``or`` and ``if``,
and captured tensors indexed with the index tensors (``doc_ids[q_idx]``). Most mods written for
FlexAttention work unchanged. A score mod must be pointwise (each output element depends on its
own score only), as FlexAttention requires too.

The library mods below are small objects that are callable as mods and also carry their
parameters as attributes (``kind``, ``alignment``, ``window``, ``doc_ids``, ``prefix_len``,
``slopes``, ``cap``), so a kernel can compile them natively instead of calling Python.

Alignment. With Nq queries and Nk keys, "top_left" puts query i at key position i (SDPA's
``is_causal``); "bottom_right" puts the last query on the last key, query i at position
i + Nk - Nq (flash-attn's causal, and what a KV cache needs: the new queries come last). A
bottom-right mod needs the lengths: :meth:`bind` gives them, and
:meth:`flashedu.BlockMask.from_mask_mod` and :func:`evaluate_mask_mod` bind it for you.

Order inside attention: S = scale * Q K^T, then the score mod, then a float ``attn_mask`` is
added, then every masked pair becomes -inf (Gemma 2's order: softcap first, mask after).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

ALIGNMENTS = ("top_left", "bottom_right")

__all__ = ["causal", "sliding_window", "document", "packed", "prefix_lm", "and_masks", "or_masks",
           "alibi", "alibi_slopes", "softcap", "triton_score_mod", "evaluate_mask_mod",
           "score_mod_and_grad",
           "MaskMod", "ScoreMod", "ALIGNMENTS"]


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _alignment(alignment) -> str:
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    return alignment


def _seq_lens(seq_lens) -> tuple[int, int]:
    try:
        Nq, Nk = seq_lens
    except (TypeError, ValueError):
        raise TypeError(f"seq_lens must be a pair of ints (Nq, Nk), got {seq_lens!r}") from None
    if not (_is_int(Nq) and _is_int(Nk)) or Nq < 1 or Nk < 1:
        raise ValueError(f"seq_lens must be a pair of positive ints (Nq, Nk), got {seq_lens!r}")
    return int(Nq), int(Nk)


def _key(value):
    """A hashable stand-in for a parameter (tensors by content)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return ("tensor", str(t.dtype), tuple(t.shape), t.numpy().tobytes())
    if isinstance(value, tuple):
        return tuple(_key(v) for v in value)
    return value


def _on(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t if t.device == like.device else t.to(like.device)


class _Mod:
    """Shared by library mods: equality, hashing and repr by parameters."""

    kind = "mod"
    _params: tuple = ()

    def _values(self):
        return tuple(getattr(self, p) for p in self._params)

    def __eq__(self, other):
        return type(other) is type(self) and _key(self._values()) == _key(other._values())

    def __hash__(self):
        return hash((type(self).__name__, _key(self._values())))

    def __repr__(self):
        def show(v):
            if isinstance(v, torch.Tensor):
                return f"tensor{tuple(v.shape)}" if v.numel() > 8 else repr(v.tolist())
            return repr(v)
        args = ", ".join(f"{p}={show(getattr(self, p))}" for p in self._params)
        return f"mods.{self.kind}({args})"


# ----------------------------------------------------------------------------------------------
# Mask mods
# ----------------------------------------------------------------------------------------------

class MaskMod(_Mod):
    """Base of the library's mask mods: ``mod(b, h, q_idx, kv_idx)`` -> bool tensor.

    ``bind((Nq, Nk))`` returns the mod with the lengths it needs (bottom-right alignment);
    ``is_causal_top_left`` is True when the mod is exactly SDPA's ``is_causal``;
    ``implies_causal`` when it never shows a key after the query (top-left aligned)."""

    seq_lens = None
    is_causal_top_left = False
    implies_causal = False

    def bind(self, seq_lens) -> MaskMod:
        return self

    def __call__(self, b, h, q_idx, kv_idx):
        raise NotImplementedError


class _Aligned(MaskMod):
    """A mask mod whose query position may be aligned to the bottom right."""

    def __init__(self, alignment, seq_lens):
        self.alignment = _alignment(alignment)
        self.seq_lens = None if seq_lens is None else _seq_lens(seq_lens)

    @property
    def offset(self) -> int:
        """Key position of query 0: 0 top-left, Nk - Nq bottom-right."""
        if self.alignment == "top_left":
            return 0
        if self.seq_lens is None:
            raise ValueError(f"{self!r} is aligned to the bottom right, which depends on Nq and "
                             f"Nk: bind it first with .bind((Nq, Nk)) (BlockMask.from_mask_mod, "
                             f"evaluate_mask_mod and flashedu.attention do)")
        return self.seq_lens[1] - self.seq_lens[0]

    def bind(self, seq_lens):
        if self.alignment == "top_left":
            return self
        bound = object.__new__(type(self))
        bound.__dict__.update(self.__dict__, seq_lens=_seq_lens(seq_lens))
        return bound


class _Causal(_Aligned):
    kind = "causal"
    _params = ("alignment",)

    def __init__(self, alignment="top_left", seq_lens=None):
        super().__init__(alignment, seq_lens)
        self.is_causal_top_left = self.implies_causal = self.alignment == "top_left"

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + self.offset


def causal(alignment="top_left", seq_lens=None) -> MaskMod:
    """Query i sees key j iff j <= i (top-left, SDPA's ``is_causal``), or
    j <= i + Nk - Nq (bottom-right, flash-attn's ``causal=True``; with Nq > Nk the first
    Nq - Nk queries see nothing and give zeros). ``seq_lens=(Nq, Nk)`` binds it now."""
    return _Causal(alignment, seq_lens)


class _SlidingWindow(_Aligned):
    kind = "sliding_window"
    _params = ("window", "alignment", "lookahead")

    def __init__(self, window, alignment="top_left", lookahead=0, seq_lens=None):
        if not _is_int(window):
            raise TypeError(f"window must be a positive int, got {type(window).__name__} {window!r}")
        if window < 1:
            raise ValueError(f"window must be a positive int (the query's own key counts), got {window}")
        if not _is_int(lookahead) or lookahead < 0:
            raise ValueError(f"lookahead must be an int >= 0, got {lookahead!r}")
        super().__init__(alignment, seq_lens)
        self.window, self.lookahead = int(window), int(lookahead)
        self.implies_causal = self.alignment == "top_left" and self.lookahead == 0

    @property
    def left(self) -> int:
        """Keys before the query that it sees (flash-attn's window_size[0])."""
        return self.window - 1

    def __call__(self, b, h, q_idx, kv_idx):
        pos = q_idx + self.offset
        return (kv_idx > pos - self.window) & (kv_idx <= pos + self.lookahead)


def sliding_window(window, alignment="top_left", *, lookahead=0, seq_lens=None) -> MaskMod:
    """Mistral's sliding window: query i sees the ``window`` keys i - window + 1, ..., i (its
    own position included), so i - window < j <= i.

    This is Hugging Face Mistral's ``sliding_window=window`` and flash-attn's
    ``causal=True, window_size=(window - 1, 0)``. FlexAttention's documentation example
    ``q_idx - kv_idx <= W`` is ``window = W + 1`` here. ``lookahead`` also lets the query see
    that many keys after its own position (flash-attn's window_size[1]); ``alignment`` places
    the query as in :func:`causal`."""
    return _SlidingWindow(window, alignment, lookahead, seq_lens)


class _Document(MaskMod):
    """Packed sequences (documents): query i sees key j iff both lie in one document.

    ``document(doc_ids)``: one id per position, a tensor (N,) or (B, N) (per batch entry).
    ``document.from_lengths([n0, n1, ...])``: the ids of documents of those lengths, packed.
    Combine with :func:`causal` for causal language modelling:
    ``and_masks(causal(), document(ids))``.
    """

    kind = "document"
    _params = ("doc_ids",)

    def __init__(self, doc_ids):
        ids = torch.as_tensor(doc_ids)
        if ids.dtype in (torch.bool,) or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"doc_ids must hold ints (one document id per position), got {ids.dtype}")
        if ids.dim() not in (1, 2) or ids.shape[-1] == 0:
            raise ValueError(f"doc_ids must have shape (N,) or (B, N) with N >= 1, got "
                             f"{tuple(ids.shape)}")
        self.doc_ids = ids.to(torch.int64)
        self._per_device = {}

    @classmethod
    def from_lengths(cls, lengths) -> MaskMod:
        """Packed sequences: ``lengths`` [n0, n1, ...] gives ids 0 (n0 times), 1 (n1 times), ...;
        a list of such lists (one per batch entry, equal totals) gives (B, N) ids."""
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        lengths = list(lengths)
        nested = bool(lengths) and not _is_int(lengths[0])
        rows = [list(r) for r in lengths] if nested else [lengths]
        ids = []
        for row in rows:
            row = [int(n) if _is_int(n) else n for n in row]
            if not all(_is_int(n) and n >= 1 for n in row):
                raise ValueError(f"lengths must be positive ints, got {list(row)}")
            ids.append(torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)))
        if len({len(r) for r in ids}) != 1:
            raise ValueError(f"every batch entry's lengths must add up to one N, got "
                             f"{[len(r) for r in ids]}")
        return cls(torch.stack(ids) if nested else ids[0])

    @property
    def length(self) -> int:
        return self.doc_ids.shape[-1]

    def _ids(self, like):
        if like.device not in self._per_device:
            self._per_device[like.device] = self.doc_ids.to(like.device)
        return self._per_device[like.device]

    def bind(self, seq_lens):
        Nq, Nk = _seq_lens(seq_lens)
        if max(Nq, Nk) > self.length:
            raise ValueError(f"document(doc_ids) has {self.length} positions but the attention "
                             f"has (Nq, Nk) = {(Nq, Nk)}: give one id per position")
        return self

    def __call__(self, b, h, q_idx, kv_idx):
        ids = self._ids(q_idx)
        if ids.dim() == 1:
            return ids[q_idx] == ids[kv_idx]
        return ids[b, q_idx] == ids[b, kv_idx]

    def __getstate__(self):
        return {"doc_ids": self.doc_ids}

    def __setstate__(self, state):
        self.doc_ids, self._per_device = state["doc_ids"], {}


document = _Document


class _Packed(MaskMod):
    """Packed variable-length sequences, as flash-attn's varlen functions take them: sequence
    s holds queries cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1 and keys cu_seqlens_k[s] ..
    cu_seqlens_k[s+1] - 1; a query sees the keys of its own sequence only, and with
    ``causal`` those up to its own position aligned to the sequence's bottom right (query n of
    a sequence of Lq queries and Lk keys sees its keys 0 .. n + Lk - Lq, flash-attn's
    ``causal=True``). With equal cuts and ``causal`` it never shows a later key (implies_causal).
    """

    kind = "packed"
    _params = ("cu_seqlens_q", "cu_seqlens_k", "causal")

    def __init__(self, cu_seqlens_q, cu_seqlens_k, causal=False):
        self.cu_seqlens_q, self.cu_seqlens_k = (
            torch.as_tensor(c).detach().to("cpu", torch.int64) for c in (cu_seqlens_q, cu_seqlens_k))
        self.causal = bool(causal)
        self.implies_causal = self.causal and torch.equal(self.cu_seqlens_q, self.cu_seqlens_k)
        self._per_device = {}

    def _tables(self, like):
        """(sequence of each query, sequence of each key, the last key offset each query sees,
        each key's offset in its sequence), on ``like``'s device, made once per device."""
        device = like.device
        if device not in self._per_device:
            cu_q, cu_k = self.cu_seqlens_q.to(device), self.cu_seqlens_k.to(device)
            pos_q = torch.arange(int(cu_q[-1]), device=device)
            pos_k = torch.arange(int(cu_k[-1]), device=device)
            seq_q = torch.bucketize(pos_q, cu_q[1:], right=True)
            seq_k = torch.bucketize(pos_k, cu_k[1:], right=True)
            len_q, len_k = cu_q.diff(), cu_k.diff()
            last = pos_q - cu_q[seq_q] + len_k[seq_q] - len_q[seq_q]
            self._per_device[device] = (seq_q, seq_k, last, pos_k - cu_k[seq_k])
        return self._per_device[device]

    def kernel_args(self, device):
        """What the kernels' compiled rule (``flashedu.triton.mods.packed``) reads: (seq_q,
        last, seq_k, offset_k) as int32 on ``device`` (last: the largest offset there is where
        the mod is not causal), then Nq and Nk."""
        key = ("kernel", torch.device(device))
        if key not in self._per_device:
            seq_q, seq_k, last, offset_k = self._tables(torch.empty(0, device=device))
            if not self.causal:
                last = torch.full_like(last, 2 ** 31 - 1)
            self._per_device[key] = (*(t.to(torch.int32).contiguous()
                                       for t in (seq_q, last, seq_k, offset_k)),
                                     int(seq_q.numel()), int(seq_k.numel()))
        return self._per_device[key]

    def __call__(self, b, h, q_idx, kv_idx):
        seq_q, seq_k, last, offset_k = self._tables(q_idx)
        same = seq_q[q_idx] == seq_k[kv_idx]
        if not self.causal:
            return same
        return same & (offset_k[kv_idx] <= last[q_idx])


def packed(cu_seqlens_q, cu_seqlens_k, causal=False) -> MaskMod:
    """The mask mod of packed variable-length sequences (:class:`_Packed`)."""
    return _Packed(cu_seqlens_q, cu_seqlens_k, causal)


class _PrefixLM(MaskMod):
    kind = "prefix_lm"
    _params = ("prefix_len",)

    def __init__(self, prefix_len):
        if _is_int(prefix_len):
            if prefix_len < 0:
                raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
            self.prefix_len = int(prefix_len)
        else:
            t = torch.as_tensor(prefix_len)
            if t.is_floating_point() or t.dtype == torch.bool or t.dim() != 1 or (t < 0).any():
                raise TypeError(f"prefix_len must be an int >= 0 or a (B,) tensor of them, got "
                                f"{prefix_len!r}")
            self.prefix_len = t.to(torch.int64)

    def __call__(self, b, h, q_idx, kv_idx):
        n = self.prefix_len
        if isinstance(n, torch.Tensor):
            n = _on(n, b)[b]
        return (kv_idx < n) | (kv_idx <= q_idx)


def prefix_lm(prefix_len) -> MaskMod:
    """Prefix language model (T5, UniLM): the first ``prefix_len`` keys are seen by every query
    (bidirectional prefix), the rest causally: j < prefix_len or j <= i. ``prefix_len`` is an
    int or a (B,) tensor (one per batch entry). Top-left aligned."""
    return _PrefixLM(prefix_len)


class _Combined(MaskMod):
    _params = ("mods",)

    def __init__(self, mods):
        if not mods:
            raise ValueError(f"{self.kind} needs at least one mask mod")
        for m in mods:
            if not callable(m):
                raise TypeError(f"{self.kind} takes mask mods (callables), got {type(m).__name__}")
        self.mods = tuple(mods)

    def bind(self, seq_lens):
        bound = [bind(m, seq_lens) for m in self.mods]
        if all(a is b for a, b in zip(bound, self.mods)):
            return self
        return type(self)(bound)

    def __repr__(self):
        return f"mods.{self.kind}({', '.join(map(repr, self.mods))})"


class _And(_Combined):
    kind = "and_masks"

    def __init__(self, mods):
        super().__init__(mods)
        self.implies_causal = any(getattr(m, "implies_causal", False) for m in self.mods)

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.mods[0](b, h, q_idx, kv_idx)
        for m in self.mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out


class _Or(_Combined):
    kind = "or_masks"

    def __init__(self, mods):
        super().__init__(mods)
        self.implies_causal = all(getattr(m, "implies_causal", False) for m in self.mods)

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.mods[0](b, h, q_idx, kv_idx)
        for m in self.mods[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out


def and_masks(*mask_mods) -> MaskMod:
    """A key is visible iff every mask mod shows it (FlexAttention's ``and_masks``)."""
    return _And(mask_mods)


def or_masks(*mask_mods) -> MaskMod:
    """A key is visible iff some mask mod shows it (FlexAttention's ``or_masks``)."""
    return _Or(mask_mods)


class _DenseMask(MaskMod):
    """SDPA's boolean ``attn_mask`` as a mask mod (True: the pair takes part)."""

    kind = "attn_mask"
    _params = ("mask",)

    def __init__(self, mask, shape):
        self.mask = mask.expand(shape)  # (B, H, Nq, Nk), a view

    def __call__(self, b, h, q_idx, kv_idx):
        return _on(self.mask, q_idx)[b, h, q_idx, kv_idx]


# ----------------------------------------------------------------------------------------------
# Evaluating a mask mod
# ----------------------------------------------------------------------------------------------

def _index(x, axis: int, name: str) -> torch.Tensor:
    """An int, range, sequence or array on its own axis of the 4-D grid; a tensor as given."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer indices, got {x.dtype}")
        return x.to(torch.int64)
    if _is_int(x):
        return torch.tensor(int(x))  # a scalar: broadcasts with anything
    t = torch.as_tensor(np.asarray(x, dtype=np.int64))
    if t.dim() != 1:
        raise ValueError(f"{name} must be an int, a range, a 1-D sequence of ints or a tensor, "
                         f"got shape {tuple(t.shape)}")
    shape = [1, 1, 1, 1]
    shape[axis] = t.numel()
    return t.view(shape)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def evaluate_mask_mod(mask_mod, b, h, q_idx, kv_idx, *, seq_lens=None) -> torch.Tensor:
    """The bool tensor ``mask_mod(b, h, q_idx, kv_idx)`` over a grid of indices.

    Each index is an int (a scalar), a ``range`` or a 1-D sequence of ints, placed on its own
    axis of a (nb, nh, nq, nk) grid (``evaluate_mask_mod(m, range(B), range(H), range(128, 256),
    range(Nk))``: one row of tiles), or an int tensor used as given, so several tiles can be
    evaluated at once: b, h of shape (n, 1, 1), q_idx (n, Br, 1), kv_idx (n, 1, Bc) give an
    (n, Br, Bc) mask. The result is broadcast to the broadcast shape of the indices (a view).

    With ``seq_lens=(Nq, Nk)`` the mod is bound to the lengths (bottom-right alignment), and
    indices at or past Nq (or Nk), the padding of a last, cut tile, come out False without
    being shown to the mod (which may index a tensor of length N). A mod that cannot be
    evaluated on broadcast index tensors raises a TypeError saying how to write it.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable as mask_mod(b, h, q_idx, kv_idx), got "
                        f"{type(mask_mod).__name__}")
    idx = [_index(x, a, n) for a, (x, n) in enumerate(
        ((b, "b"), (h, "h"), (q_idx, "q_idx"), (kv_idx, "kv_idx")))]
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in idx))
    except RuntimeError:
        raise ValueError(f"b, h, q_idx, kv_idx must broadcast against each other, got shapes "
                         f"{[tuple(t.shape) for t in idx]}") from None
    inside = None
    if seq_lens is not None:
        Nq, Nk = _seq_lens(seq_lens)
        if hasattr(mask_mod, "bind"):
            mask_mod = mask_mod.bind((Nq, Nk))
        if bool((idx[2] >= Nq).any()) or bool((idx[3] >= Nk).any()):  # the padding of a cut tile
            inside = (idx[2] < Nq) & (idx[3] < Nk)
            idx[2] = idx[2].clamp(max=Nq - 1)
            idx[3] = idx[3].clamp(max=Nk - 1)
    try:
        out = mask_mod(*idx)
    except Exception as exc:  # noqa: BLE001 - any failure of a user's function gets the hint
        raise TypeError(
            f"mask_mod {_name(mask_mod)} failed on broadcast index tensors (b {tuple(idx[0].shape)}, "
            f"h {tuple(idx[1].shape)}, q_idx {tuple(idx[2].shape)}, kv_idx "
            f"{tuple(idx[3].shape)}): {type(exc).__name__}: {exc}. flashedu evaluates a mask mod "
            f"on whole tensors of indices: write it with torch ops that broadcast (&, |, ~, "
            f"torch.where instead of and, or, if; index captured tensors with the index "
            f"tensors, e.g. doc_ids[q_idx])") from exc
    if isinstance(out, (bool, np.bool_)):
        out = torch.tensor(bool(out))
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"mask_mod {_name(mask_mod)} must return a bool tensor (True: the key "
                        f"is visible), got {got}")
    try:
        out = torch.broadcast_to(out, shape)
    except RuntimeError:
        raise ValueError(f"mask_mod {_name(mask_mod)} returned shape {tuple(out.shape)}, which "
                         f"does not broadcast to the indices' shape {tuple(shape)}") from None
    if inside is not None:
        out = out & _on(inside, out)
    return out


# ----------------------------------------------------------------------------------------------
# Score mods
# ----------------------------------------------------------------------------------------------

class ScoreMod(_Mod):
    """Base of the library's score mods: ``mod(score, b, h, q_idx, kv_idx)`` -> score, and
    ``derivative(score, b, h, q_idx, kv_idx)``: d(new score) / d(score), for the backward."""

    def bind(self, seq_lens) -> ScoreMod:
        return self

    def derivative(self, score, b, h, q_idx, kv_idx):
        raise NotImplementedError


class _Alibi(ScoreMod):
    kind = "alibi"
    _params = ("slopes",)

    def __init__(self, slopes):
        t = torch.as_tensor(slopes)
        if not t.is_floating_point():
            t = t.to(torch.float64)
        if t.dim() != 1 or t.numel() == 0 or not torch.isfinite(t).all():
            raise ValueError(f"slopes must be a 1-D tensor of finite floats, one per query head, "
                             f"got {tuple(t.shape)}")
        self.slopes = t.detach()

    def __call__(self, score, b, h, q_idx, kv_idx):
        slope = _on(self.slopes, score).to(score.dtype)[h]
        return score + slope * (kv_idx - q_idx).to(score.dtype)

    def derivative(self, score, b, h, q_idx, kv_idx):
        return torch.ones_like(score)


def alibi(slopes) -> ScoreMod:
    """ALiBi (Press, Smith, Lewis, 2022): score + slopes[h] * (j - i), a penalty growing with
    the distance behind the query (FlexAttention's example; flash-attn's ``alibi_slopes``
    subtracts slopes[h] * |i + Nk - Nq - j|, the same for causal attention with Nq = Nk).
    ``slopes``: one per query head; :func:`alibi_slopes` gives the paper's."""
    return _Alibi(slopes)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes 2^(-8 h / H), h = 1..H (for H a power of two; otherwise the
    paper's interleaving of the next power of two)."""
    if not _is_int(num_heads) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")

    def power_of_two(n):
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]

    n = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(n)
    if n < num_heads:
        slopes += power_of_two(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


class _Softcap(ScoreMod):
    kind = "softcap"
    _params = ("cap",)

    def __init__(self, cap):
        if not isinstance(cap, numbers.Real) or isinstance(cap, (bool, np.bool_)):
            raise TypeError(f"cap must be a positive float, got {type(cap).__name__}")
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"cap must be a positive finite float, got {cap}")
        self.cap = float(cap)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(score / self.cap)

    def derivative(self, score, b, h, q_idx, kv_idx):
        return 1 - torch.tanh(score / self.cap) ** 2


def softcap(cap) -> ScoreMod:
    """Tanh softcapping (Gemma 2, Grok): cap * tanh(score / cap) keeps every score in
    (-cap, cap). Its derivative, for the backward, is 1 - tanh(score / cap)^2."""
    return _Softcap(cap)


class _Bias(ScoreMod):
    """SDPA's float ``attn_mask`` as a score mod: score + attn_mask[b, h, i, j]."""

    kind = "bias"
    _params = ("bias",)

    def __init__(self, bias, shape):
        self.bias = bias.expand(shape)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + _on(self.bias, score)[b, h, q_idx, kv_idx].to(score.dtype)

    def derivative(self, score, b, h, q_idx, kv_idx):
        return torch.ones_like(score)


class _Chain(ScoreMod):
    """Score mods applied one after the other."""

    kind = "chain"
    _params = ("mods",)

    def __init__(self, mods):
        self.mods = tuple(mods)

    def bind(self, seq_lens):
        return _Chain([bind(m, seq_lens) for m in self.mods])

    def __call__(self, score, b, h, q_idx, kv_idx):
        for m in self.mods:
            score = m(score, b, h, q_idx, kv_idx)
        return score


class _TritonScoreMod(ScoreMod):
    kind = "triton"
    _params = ("hook", "args")

    def __init__(self, hook, reference, args):
        self.hook, self.reference, self.args = hook, reference, args

    def __call__(self, score, b, h, q_idx, kv_idx):
        if self.reference is None:
            raise NotImplementedError(
                f"{self!r} was given no reference= in torch: it runs on backend 'triton' only")
        return self.reference(score, b, h, q_idx, kv_idx)

    def __repr__(self):
        name = getattr(self.hook, "__name__", self.hook)
        return f"mods.triton_score_mod({name}, args={self.args!r})"


def triton_score_mod(hook, reference=None, args=()) -> ScoreMod:
    """A score mod written in Triton, compiled into the triton backend's forward and backward
    (the way the library's softcap and ALiBi are, and FlexAttention inlines a mod)::

        @triton.jit
        def hook(s, b, h, q_idx, kv_idx, args):   # s = scale * S_ij of a tile
            ...
            return new_s, d_new_s_by_d_s         # the derivative, for the backward

    ``args``: a tuple of numbers and tensors handed to ``hook`` as ``args`` (a tensor arrives as
    a pointer: ``tl.load(args[0] + h)``). ``reference``: the same mod in torch,
    ``reference(score, b, h, q_idx, kv_idx)``, for the numpy and naive backends (and a check of
    the hook against them); without it the mod runs on the triton backend only."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(hook, (JITFunction, InterpretedFunction)):  # compiled, or interpreted
        raise TypeError(f"hook must be a @triton.jit function, got {type(hook).__name__}")
    if reference is not None and not callable(reference):
        raise TypeError(f"reference must be callable as reference(score, b, h, q_idx, kv_idx) "
                        f"or None, got {type(reference).__name__}")
    if not isinstance(args, tuple) or not all(
            isinstance(a, (numbers.Real, torch.Tensor)) and not isinstance(a, bool) for a in args):
        raise TypeError(f"args must be a tuple of numbers and tensors, got {args!r}")
    return _TritonScoreMod(hook, reference, args)


def score_mod_and_grad(score_mod, score, b, h, q_idx, kv_idx):
    """(score_mod(score, ...), its derivative d new / d score), element by element.

    A library mod gives its derivative by formula (softcap: 1 - tanh^2, ALiBi: 1); any other
    mod is differentiated by torch autograd on this tile: the mod must be pointwise (each new
    score depends only on its own score), so the gradient of the sum is the derivative."""
    if isinstance(score_mod, _Chain):
        grad = torch.ones_like(score)
        for m in score_mod.mods:
            score, g = score_mod_and_grad(m, score, b, h, q_idx, kv_idx)
            grad = grad * g
        return score, grad
    if isinstance(score_mod, ScoreMod):
        return (apply_score_mod(score_mod, score, b, h, q_idx, kv_idx),
                score_mod.derivative(score, b, h, q_idx, kv_idx))
    with torch.enable_grad():
        s = score.detach().requires_grad_(True)
        new = apply_score_mod(score_mod, s, b, h, q_idx, kv_idx)
        if not new.requires_grad:  # the mod ignores the score: a constant
            return new.detach(), torch.zeros_like(score)
        grad, = torch.autograd.grad(new.sum(), s, allow_unused=True)
    return new.detach(), torch.zeros_like(score) if grad is None else grad


def apply_score_mod(score_mod, score, b, h, q_idx, kv_idx):
    """``score_mod(score, b, h, q_idx, kv_idx)``, checked: a tensor of score's shape and dtype
    kind, with a clear error when the mod cannot take broadcast index tensors."""
    try:
        out = score_mod(score, b, h, q_idx, kv_idx)
    except NotImplementedError:  # a mod that says itself where it runs (triton_score_mod)
        raise
    except Exception as exc:  # noqa: BLE001
        raise TypeError(
            f"score_mod {_name(score_mod)} failed on a score tile {tuple(score.shape)} with "
            f"broadcast index tensors: {type(exc).__name__}: {exc}. flashedu evaluates a score "
            f"mod on whole tensors: write it with torch ops that broadcast (torch.where "
            f"instead of if; index captured tensors with the index tensors, e.g. bias[h])") from exc
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"score_mod {_name(score_mod)} must return a float tensor, got {got}")
    if out.shape != score.shape:
        try:
            out = torch.broadcast_to(out, score.shape)
        except RuntimeError:
            raise ValueError(f"score_mod {_name(score_mod)} returned shape {tuple(out.shape)} for "
                             f"scores of shape {tuple(score.shape)}") from None
    return out


def bind(mod, seq_lens):
    """The mod bound to (Nq, Nk) when it needs them (a library mod); a user's function as is."""
    return mod.bind(seq_lens) if isinstance(mod, (MaskMod, ScoreMod)) else mod


def is_causal_top_left(mask_mod) -> bool:
    """True when ``mask_mod`` is exactly SDPA's is_causal (query i sees keys j <= i)."""
    return bool(getattr(mask_mod, "is_causal_top_left", False))


def implies_causal(mask_mod) -> bool:
    """True when ``mask_mod`` never shows a key after the query (top-left): a kernel may then
    skip the tiles above the diagonal and mask the diagonal ones as ``is_causal`` does."""
    return isinstance(mask_mod, MaskMod) and bool(getattr(mask_mod, "implies_causal", False))
