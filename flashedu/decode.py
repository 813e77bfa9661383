"""Decoding from a paged KV cache (vLLM's PagedAttention, flash-attn's ``block_table``).

A model that generates text keeps each layer's K and V of every token so far (the KV cache) and
attends one new query per sequence to them. Reserving one contiguous (max_len, Hkv, d) block
per sequence wastes the memory of every sequence that stops early; a paged cache instead cuts
the memory into pages of ``page_size`` token rows, hands pages out as sequences grow and takes
them back when a sequence ends. Sequence b's token j then lives in

    page  = block_table[b, j // page_size]       (the page lookup)
    row   = j % page_size

of the pool ``k_cache[page, row]`` of shape (num_pages, page_size, Hkv, d), flash-attn's and
vLLM's layout. Nothing else changes: the attention over those rows is the online softmax of the
course, split across programs and merged as in split-KV decoding (``flashedu.triton.decode``).

    cache = PagedKVCache(num_pages=64, page_size=16, num_kv_heads=4, head_dim=64)
    seq = cache.add_sequence()
    cache.extend([seq], 5)
    cache.write(0, [seq], k_new, v_new)                       # (1, Hkv, 5, d)
    out = cache.attention(0, q, [seq])                        # (1, H, 1, d)
    cache.free(seq)

``paged_attention`` runs on the triton backend (one launch for sequences of any lengths; CPU
through Triton's interpreter) and on numpy, the reference: the same page lookup and split-KV
merge written with NumPy arrays, in float64 when asked.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .arguments import check_num_splits, check_scale
from .merge import merge_many
from .reference import naive_attention

BACKENDS = ("triton", "numpy")


def paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, *, scale=None,
                    is_causal=False, num_splits=None, return_lse=False, backend="triton",
                    check_indices=True):
    """Attention of a few queries per sequence to that sequence's keys in a paged cache.

    q: (B, H, Nq, d), Nq small (one new token per sequence: Nq = 1); k_cache, v_cache:
    (num_pages, page_size, Hkv, d) with H a multiple of Hkv (GQA), pages of any size (vLLM
    uses 16 rows, flash-attn multiples of 256); block_table: (B, max_pages) int32, sequence
    b's pages in order; cache_seqlens: (B,) int32, sequence b's number of keys (its first
    cache_seqlens[b] rows).
    ``is_causal``: bottom-right aligned, the decoding convention (the Nq queries are the last Nq
    positions: query n sees keys j <= n + seqlen - Nq). ``num_splits``: chunks of keys per
    sequence (None: enough programs to fill the GPU).
    Returns out (B, H, Nq, d) in q's dtype, and with ``return_lse`` the natural-log logsumexp
    (B, H, Nq) (-inf where a query sees no key; its output is 0). Forward only.
    ``check_indices``: verify that each length fits the table and each page the sequences use
    is a page of the pool (a wrong one would read other memory). It costs one wait for the
    device per call; PagedKVCache, whose tables are right by construction, skips it.
    """
    if backend == "triton" and not check_indices and _REPEAT:  # a step laid out as before
        out = _REPEAT[0](q, k_cache, v_cache, block_table, cache_seqlens, scale, is_causal,
                         num_splits, return_lse)
        if out is not None:
            return out
    _check(q, k_cache, v_cache, block_table, cache_seqlens, backend)
    if check_indices:
        _check_indices(block_table, cache_seqlens, k_cache.shape[0], k_cache.shape[1])
    scale = check_scale(scale, q.shape[-1])
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    check_num_splits(num_splits)
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    if cache_seqlens.dtype != torch.int32:
        cache_seqlens = cache_seqlens.to(torch.int32)
    if backend == "numpy":
        out, lse = _paged_numpy(q, k_cache, v_cache, block_table, cache_seqlens, scale,
                                is_causal, num_splits)
        return (out, lse) if return_lse else out
    from .triton.decode import paged_kv_attention

    if not _REPEAT:  # imported here, once: triton loads after flashedu has configured it
        from .triton.decode import repeat_paged_step

        _REPEAT.append(repeat_paged_step)
    return paged_kv_attention(q, k_cache, v_cache, block_table.contiguous(),
                              cache_seqlens.contiguous(), num_splits=num_splits, scale=scale,
                              is_causal=is_causal, return_lse=return_lse)


_REPEAT: list = []  # triton.decode.repeat_paged_step, once the triton backend has run


def gather_pages(cache, pages, page_size: int, lo: int, hi: int):
    """Rows lo .. hi - 1 of one sequence, read through its pages (the page lookup): a NumPy
    (hi - lo, Hkv, d) array. ``pages`` is the sequence's row of the block table."""
    j = np.arange(lo, hi)
    return cache[pages[j // page_size], j % page_size]


def _paged_numpy(q, k_cache, v_cache, block_table, cache_seqlens, scale, is_causal, num_splits):
    """The reference: per sequence and head, each split's keys gathered page by page and attended
    to by the naive formula; the splits merged by the merge rule. Computes in q's precision
    (float64 in, float64 out)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    Q, Kc, Vc = (t.detach().cpu().to(work).numpy() for t in (q, k_cache, v_cache))
    dtype = Q.dtype
    table, lengths = block_table.cpu().numpy(), cache_seqlens.cpu().numpy()
    B, H, Nq, d = Q.shape
    page_size, Hkv = Kc.shape[1], Kc.shape[2]
    G = H // Hkv
    O = np.zeros((B, H, Nq, d), dtype)
    L = np.full((B, H, Nq), -np.inf, dtype)
    for b in range(B):
        n = int(lengths[b])
        pos = np.arange(Nq) + n - Nq  # bottom-right: query i sits at position n - Nq + i
        chunks = _chunks(n, num_splits, page_size)
        for h in range(H):
            parts = []
            for lo, hi in chunks:
                K = gather_pages(Kc, table[b], page_size, lo, hi)[:, h // G]
                V = gather_pages(Vc, table[b], page_size, lo, hi)[:, h // G]
                seen = (np.arange(lo, hi)[None, :] <= pos[:, None]) if is_causal else None
                parts.append(_attend(Q[b, h], K, V, scale, seen, dtype))
            if parts:
                O[b, h], L[b, h] = merge_many(parts)
    return (torch.from_numpy(O).to(device=q.device, dtype=q.dtype),
            torch.from_numpy(L).to(device=q.device))


def _chunks(n: int, num_splits, page_size: int):
    """The split-KV chunks [lo, hi) of n keys: num_splits of them (None: chunks of 4 pages)."""
    if n == 0:
        return []
    size = 4 * page_size if num_splits is None else math.ceil(n / num_splits)
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def _attend(Q, K, V, scale, seen, dtype):
    """(O, L) of one head over one chunk; a query that sees none of the chunk's keys gives the
    merge's empty part (O = 0, L = -inf)."""
    Nq = Q.shape[0]
    if seen is not None and not seen.any():
        return np.zeros((Nq, V.shape[1]), dtype), np.full(Nq, -np.inf, dtype)
    O, L = naive_attention(Q, K, V, scale=scale, mask=seen)
    blind = np.isneginf(L)  # rows whose keys are all hidden: the naive formula's NaN
    O = np.where(blind[:, None], 0.0, O).astype(dtype)
    return O, np.where(blind, -np.inf, L).astype(dtype)


def _check(q, k_cache, v_cache, block_table, cache_seqlens, backend):
    """Every argument's type, shape, dtype and device (no wait for the device)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (B, H, Nq, d), got shape {tuple(q.shape)}")
    if not q.is_floating_point() or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share one floating dtype, got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one 4-D shape (num_pages, page_size, "
                         f"Hkv, d), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    B, H, _, d = q.shape
    num_pages, page_size, Hkv, d_cache = k_cache.shape
    if d_cache != d:
        raise ValueError(f"k_cache's head dim ({d_cache}) must equal q's ({d})")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q's head count ({H}) must be a multiple of k_cache's ({Hkv})")
    if page_size == 0 or num_pages == 0:
        raise ValueError(f"k_cache must hold at least one page of at least one row, got shape "
                         f"{tuple(k_cache.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be (B, max_pages) = ({B}, ...), got "
                         f"{tuple(block_table.shape)}")
    if cache_seqlens.shape != (B,):
        raise ValueError(f"cache_seqlens must be (B,) = ({B},), got {tuple(cache_seqlens.shape)}")
    for name, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 tensor, got {t.dtype}")


def _check_indices(block_table, cache_seqlens, num_pages: int, page_size: int):
    """The lengths within [0, capacity] and the used pages within the pool (one device sync)."""
    capacity = block_table.shape[1] * page_size
    used = (torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size
            < cache_seqlens[:, None])  # the pages that hold some of each sequence's keys
    bad_len = (cache_seqlens < 0) | (cache_seqlens > capacity)
    bad_page = used & ((block_table < 0) | (block_table >= num_pages))
    if not bool(bad_len.any() | bad_page.any()):
        return
    if bool(bad_len.any()):
        b = int(bad_len.nonzero()[0, 0])
        raise ValueError(f"cache_seqlens[{b}] = {int(cache_seqlens[b])} is outside [0, "
                         f"{capacity}] (block_table's {block_table.shape[1]} pages of "
                         f"{page_size} rows)")
    b, j = (int(x) for x in bad_page.nonzero()[0])
    raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the "
                     f"pool (0 <= page < {num_pages})")


class PagedKVCache:
    """A pool of K/V pages shared by several sequences, for every layer of a model.

    k[layer], v[layer]: (num_pages, page_size, num_kv_heads, head_dim). Pages are handed out as
    sequences grow (``extend``) and taken back when one ends (``free``); a sequence's pages need
    not be adjacent, which is the point: no sequence reserves memory it may never use.
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 num_layers: int = 1, dtype=torch.float32, device="cpu"):
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.free_pages = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives page 0 first
        self.pages: dict[int, list[int]] = {}  # sequence -> its pages in order
        self.lengths: dict[int, int] = {}  # sequence -> tokens stored
        self._next_id = 0
        # seqs -> (block table, seqlens), and the slots of a write, until pages or lengths change
        self._tables = {}

    def add_sequence(self) -> int:
        """A new, empty sequence; returns its id."""
        seq, self._next_id = self._next_id, self._next_id + 1
        self.pages[seq], self.lengths[seq] = [], 0
        return seq

    def extend(self, seqs, n: int = 1):
        """Room for n more tokens in each sequence (new pages where the last one is full)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        seqs = self._known(seqs)
        needed = {s: math.ceil((self.lengths[s] + n) / self.page_size) - len(self.pages[s])
                  for s in seqs}
        if sum(needed.values()) > len(self.free_pages):
            raise RuntimeError(f"the KV cache's pool has {len(self.free_pages)} free pages, "
                               f"{sum(needed.values())} are needed: free a sequence or make "
                               "num_pages larger")
        for s in seqs:
            self.pages[s] += [self.free_pages.pop() for _ in range(needed[s])]
            self.lengths[s] += n
        self._tables.clear()

    def write(self, layer: int, seqs, k, v):
        """Store k, v of shape (len(seqs), Hkv, n, d) as the last n tokens of each sequence
        (made room for by ``extend``)."""
        seqs = self._known(seqs)
        n = k.shape[2]
        if k.shape != v.shape or k.shape[0] != len(seqs) or k.shape[1] != self.k.shape[3] \
                or k.shape[3] != self.k.shape[4]:
            raise ValueError(f"k and v must be (len(seqs), Hkv, n, d) = ({len(seqs)}, "
                             f"{self.k.shape[3]}, n, {self.k.shape[4]}), got {tuple(k.shape)} "
                             f"and {tuple(v.shape)}")
        page, row = self._slots(tuple(seqs), n)
        # (B, Hkv, n, d) -> one (Hkv, d) row per token, in the order of (page, row)
        Hkv, d = k.shape[1], k.shape[3]
        self.k[layer, page, row] = k.transpose(1, 2).reshape(-1, Hkv, d)
        self.v[layer, page, row] = v.transpose(1, 2).reshape(-1, Hkv, d)

    def free(self, seq: int):
        """End a sequence: its pages go back to the pool."""
        self._known([seq])
        self.free_pages += reversed(self.pages.pop(seq))
        del self.lengths[seq]
        self._tables.clear()

    def block_table(self, seqs) -> torch.Tensor:
        """(len(seqs), max_pages) int32: each sequence's pages, padded with 0 (never read)."""
        return self._table(seqs)[0]

    def seqlens(self, seqs) -> torch.Tensor:
        """(len(seqs),) int32: each sequence's number of tokens."""
        return self._table(seqs)[1]

    def attention(self, layer: int, q, seqs, **kwargs):
        """``paged_attention`` of q (len(seqs), H, Nq, d) over each sequence's cached keys."""
        table, seqlens = self._table(seqs)
        return paged_attention(q, self.k[layer], self.v[layer], table, seqlens,
                               check_indices=False, **kwargs)

    def _slots(self, seqs: tuple, n: int):
        """(page, row) of each sequence's last n tokens, in order: looked up once for all the
        layers of a step (kept until the pages or lengths change)."""
        key = ("slots", seqs, n)
        if key not in self._tables:
            pages, rows = [], []
            for s in seqs:
                if self.lengths[s] < n:
                    raise ValueError(f"sequence {s} holds {self.lengths[s]} tokens, fewer than "
                                     f"the {n} written: call extend first")
                j = np.arange(self.lengths[s] - n, self.lengths[s])
                pages.append(np.asarray(self.pages[s])[j // self.page_size])
                rows.append(j % self.page_size)
            device = self.k.device
            self._tables[key] = (torch.as_tensor(np.concatenate(pages), device=device),
                                 torch.as_tensor(np.concatenate(rows), device=device))
        return self._tables[key]

    def _table(self, seqs):
        """Built once per change of pages or lengths, so the layers of a step share one copy
        to the device."""
        seqs = tuple(self._known(seqs))
        if seqs not in self._tables:
            width = max([len(self.pages[s]) for s in seqs] + [1])
            rows = [self.pages[s] + [0] * (width - len(self.pages[s])) for s in seqs]
            device = self.k.device
            self._tables[seqs] = (torch.tensor(rows, dtype=torch.int32, device=device),
                                  torch.tensor([self.lengths[s] for s in seqs],
                                               dtype=torch.int32, device=device))
        return self._tables[seqs]

    def _known(self, seqs) -> list:
        seqs = list(seqs)
        for s in seqs:
            if s not in self.pages:
                raise KeyError(f"sequence {s!r} is not in the cache (add_sequence gives ids; "
                               "free ends them)")
        return seqs
