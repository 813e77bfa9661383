"""Steps of notebook 13, attention at inference time.

- ``step_decode_intensity``: FLOPs per byte of one decoding step (one query per head against a
  cache of N keys): 4 H N d FLOPs over the 2 Hkv N d numbers of K and V.
- ``step_read_cache``: the page lookup: a sequence's first n rows of a paged cache, row j
  from page ``pages[j // page_size]``, row ``j % page_size``.
- ``step_online_sink``: the online softmax over K/V tiles, started from a sink logit.
- ``step_sink_gradient``: d loss / d sink, from the forward's (O, L) and dO.
- ``step_packed_visible``: which (query, key) pairs a packed batch lets attend: same
  sequence, and with causal, bottom-right within it.

References: float64 attention over the whole key set (:mod:`flashedu.reference`), the merge
rule for the sink, explicit loops for the packed rule.
"""

from __future__ import annotations

import numpy as np

from ... import reference
from ...merge import merge
from ..numpy_exercises import H_N1, H_WIDE, _qkv, _wide_qkv
from ..steptools import case, function_step, untouched

F32, F64 = np.float32, np.float64


def _number(value):
    """A returned number as a 0-d array of its own dtype (a Python float is float64)."""
    if isinstance(value, (float, int, np.generic)) and not isinstance(value, bool):
        return np.asarray(value)
    return value


# ----------------------------------------------------------------------------------------
# the arithmetic intensity of a decoding step
# ----------------------------------------------------------------------------------------

H_INTENSITY = ("One query per query head: S = q K^T is N d multiply-adds per head, O = P V "
               "another N d, 2 FLOPs each: 4 H N d FLOPs. Bytes: K and V are read once, Hkv "
               "heads of N x d each, `itemsize` bytes per number (q and the output are tiny "
               "beside them: leave them out).")


def _intensity(H, Hkv, N, d, itemsize):
    return 4 * H * N * d / (2 * Hkv * N * d * itemsize)


def _intensity_cases():
    specs = [  # label, (H, Hkv, N, d, itemsize)
        ("a Llama-like layer: H = 32, Hkv = 8, N = 4096, d = 128, bf16", (32, 8, 4096, 128, 2)),
        ("multi-head (Hkv = H = 12), N = 1024, d = 64, fp16", (12, 12, 1024, 64, 2)),
        ("the same Llama-like layer in float32", (32, 8, 4096, 128, 4)),
        ("multi-query: H = 64, Hkv = 1, N = 100, d = 64, bf16", (64, 1, 100, 64, 2)),
        ("one key, fp8 (itemsize 1): H = 8, Hkv = 2, N = 1, d = 16", (8, 2, 1, 16, 1)),
    ]
    return [case(label, H_INTENSITY, args, ("I",), (_intensity(*args),)) for label, args in specs]


def _diagnose_intensity(case_, wrong, outputs):
    H, Hkv, N, d, itemsize = case_.args
    got, right = float(outputs["I"]), _intensity(*case_.args)
    if np.isclose(got, right * Hkv / H):
        return ("Your bytes read K and V once per query head: with grouped-query attention the "
                "H query heads share Hkv K/V heads, read once each.")
    if np.isclose(got, right / 2):
        return "Half the answer: two products (q K^T and P V), each N d multiply-adds of 2 FLOPs."
    if np.isclose(got, right * itemsize):
        return "That is FLOPs per number, not per byte: multiply the numbers by itemsize."
    if np.isclose(got, right * 2):
        return "Twice the answer: did you count only K's bytes? V is read too."
    return None


# ----------------------------------------------------------------------------------------
# the page lookup
# ----------------------------------------------------------------------------------------

H_PAGES = ("Row j of the sequence lives in page pages[j // page_size], at row j % page_size "
           "of that page: cache[pages[j // page_size], j % page_size] is its (Hkv, d) block. "
           "Return the rows j = 0 .. n-1 stacked, shape (n, Hkv, d).")
H_SCATTERED = (" Here the sequence's pages are not in order in the pool: look each one up in "
               "`pages`, do not assume page p of the sequence is page p of the pool.")
H_UNUSED = (" Only the first ceil(n / page_size) entries of `pages` belong to the sequence; the "
            "rest of the table row is padding (here -1): never read past what n needs.")


def _gather(cache, pages, n, page_size):
    j = np.arange(n)
    return cache[np.asarray(pages)[j // page_size], j % page_size]


def _page_case(label, hint, num_pages, page_size, Hkv, d, n, seed, dtype=F64, shuffle=True):
    rng = np.random.default_rng(seed)
    cache = rng.standard_normal((num_pages, page_size, Hkv, d)).astype(dtype)
    used = -(-n // page_size)
    order = rng.permutation(num_pages) if shuffle else np.arange(num_pages)
    pages = np.full(used + 2, -1, dtype=np.int64)  # two entries of padding after the used ones
    pages[:used] = order[:used]
    return case(label, hint, (cache, pages, n, page_size), ("rows",),
                (_gather(cache, pages, n, page_size),), dtype=dtype, inputs=("cache", "pages"))


def _page_cases():
    return [
        _page_case("pages in order, n = 40, pages of 16 rows", H_PAGES + H_UNUSED, 5, 16, 2, 4,
                   40, 1, shuffle=False),
        _page_case("pages scattered over the pool, n = 40", H_PAGES + H_SCATTERED, 8, 16, 2, 4,
                   40, 2),
        _page_case("n a multiple of the page size: n = 48, pages of 16", H_PAGES + H_UNUSED, 8,
                   16, 1, 8, 48, 3),
        _page_case("pages of one row", H_PAGES + H_SCATTERED, 12, 1, 2, 3, 7, 4),
        _page_case("n = 1", H_PAGES + " " + H_N1, 4, 16, 3, 4, 1, 5),
        _page_case("float32 pool", H_PAGES + H_SCATTERED, 6, 8, 2, 4, 37, 6, dtype=F32),
    ]


def _diagnose_pages(case_, wrong, outputs):
    cache, pages, n, page_size = case_.args
    got = np.asarray(outputs["rows"])
    in_pool_order = cache.reshape(-1, *cache.shape[2:])[:n]
    if got.shape == in_pool_order.shape and np.allclose(got, in_pool_order):
        return ("Those are the pool's first n rows: the sequence's rows are in the pages the "
                "table names, cache[pages[j // page_size], j % page_size].")
    return None


# ----------------------------------------------------------------------------------------
# the sink in the online softmax, and its gradient
# ----------------------------------------------------------------------------------------

H_ONLINE_SINK = ("Start each row from the sink instead of from nothing: m_i = sink, l_i = 1, "
                 "O_i = 0. Then for each tile K_j, V_j (Bc keys): S_ij = Q K_j^T / sqrt(d), "
                 "m_new = max(m_i, rowmax S_ij), l_i = e^(m_i - m_new) l_i + rowsum "
                 "e^(S_ij - m_new), O_i = e^(m_i - m_new) O_i + e^(S_ij - m_new) V_j. At the "
                 "end O = O_i / l_i and L = m_i + log l_i.")
H_TILES = (" Nk is not a multiple of Bc here: the last tile is shorter.")
H_MEMORY = ("A big problem (Nk = 16384): the answer must be right AND the function must never "
            "hold a whole row block Nq x Nk of scores: one Nq x Bc tile at a time.")


def _with_sink(Q, K, V, sink):
    O_k, L_k = reference.naive_attention(Q, K, V)
    return merge(O_k, L_k, np.zeros_like(O_k), np.full_like(L_k, sink))


def _online_case(label, hint, shape, Bc, sink, dtype, seed, wide=False, **extra):
    Nq, Nk, d = shape
    Q, K, V = (_wide_qkv if wide else _qkv)(Nq, Nk, d, seed)
    q, k, v = (np.asarray(a, dtype=dtype) for a in (Q, K, V))
    Q, K, V = (np.asarray(a, dtype=F64) for a in (q, k, v))
    return case(label, hint, (q, k, v, dtype(sink), Bc), ("O", "L"), _with_sink(Q, K, V, sink),
                naive=_with_sink(q, k, v, dtype(sink)), dtype=dtype, inputs=("Q", "K", "V"),
                **extra)


def _online_cases():
    Nq, Nk, d, Bc = 64, 16384, 2, 64
    arrays = (np.zeros((Nq, d)), np.zeros((Nk, d)), np.zeros((Nk, d)), np.zeros((Nq, d)))
    budget = 3 * sum(a.nbytes for a in arrays) + 16 * Nq * Bc * 8 + 64 * 1024
    return [
        _online_case("Nq = 5, Nk = 32, Bc = 8, sink 0.5", H_ONLINE_SINK, (5, 32, 4), 8, 0.5, F64, 1),
        _online_case("Nk = 30, Bc = 8: a short last tile", H_ONLINE_SINK + H_TILES, (4, 30, 4), 8,
                     -1.0, F64, 2),
        _online_case("a sink far above the scores (O near 0, L near the sink)", H_ONLINE_SINK,
                     (3, 20, 4), 4, 40.0, F64, 3),
        _online_case("one tile holds every key (Bc > Nk)", H_ONLINE_SINK, (3, 6, 4), 16, 0.0, F64,
                     4),
        _online_case("Nq = 1, one key", H_ONLINE_SINK + " " + H_N1, (1, 1, 4), 4, 0.2, F64, 5),
        _online_case("logits in the hundreds", H_ONLINE_SINK + " " + H_WIDE, (6, 40, 8), 16,
                     150.0, F64, 6, wide=True),
        _online_case("float32", H_ONLINE_SINK + " float32 in, float32 out.", (7, 45, 8), 16,
                     -0.25, F32, 7),
        _online_case(f"memory: Nq = {Nq}, Nk = {Nk}, d = {d}, Bc = {Bc}", H_MEMORY, (Nq, Nk, d),
                     Bc, 1.0, F64, 8, memory_budget=budget, needs_pass=True,
                     memory_note=f"(A {Nq} x {Nk} float64 block of scores is "
                                 f"{Nq * Nk * 8 / 2**20:.0f} MiB.)"),
    ]


H_SINK_GRAD = ("The sink is one more column of the scores, with no value: its dP is 0, so its "
               "dS_i = P_i,sink (0 - D_i), with D_i = rowsum(dO_i * O_i) and P_i,sink = "
               "e^(sink - L_i) (L the logsumexp with the sink). d loss / d sink = sum over rows "
               "of its dS_i = -sum_i e^(sink - L_i) D_i. Compute O and L first (with the sink).")


def _sink_grad(Q, K, V, sink, dO):
    O, L = _with_sink(Q, K, V, sink)
    D = (dO * O).sum(axis=1)
    return -(np.exp(sink - L) * D).sum()


def _grad_case(label, hint, shape, sink, dtype, seed, wide=False):
    Nq, Nk, d = shape
    Q, K, V = (_wide_qkv if wide else _qkv)(Nq, Nk, d, seed)
    dO = np.random.default_rng(seed + 100).standard_normal((Nq, d))
    given = tuple(np.asarray(a, dtype=dtype) for a in (Q, K, V))
    dO_given = np.asarray(dO, dtype=dtype)
    exact = tuple(np.asarray(a, dtype=F64) for a in given)
    return case(label, hint, (*given, dtype(sink), dO_given), ("dsink",),
                (_sink_grad(*exact, sink, np.asarray(dO_given, F64)),),
                naive=(_sink_grad(*given, dtype(sink), dO_given),), dtype=dtype,
                inputs=("Q", "K", "V", "dO"))


def _grad_cases():
    return [
        _grad_case("Nq = 4, Nk = 9, sink 0.5", H_SINK_GRAD, (4, 9, 4), 0.5, F64, 1),
        _grad_case("a sink far below the scores (its gradient near 0)", H_SINK_GRAD, (3, 8, 4),
                   -30.0, F64, 2),
        _grad_case("a sink equal in size to the scores", H_SINK_GRAD, (6, 5, 8), 1.5, F64, 3),
        _grad_case("Nq = 1, one key", H_SINK_GRAD + " " + H_N1, (1, 1, 4), 0.0, F64, 4),
        _grad_case("logits in the hundreds", H_SINK_GRAD + " " + H_WIDE, (5, 12, 8), 120.0, F64,
                   5, wide=True),
        _grad_case("float32", H_SINK_GRAD, (5, 11, 8), -0.5, F32, 6),
    ]


def _diagnose_grad(case_, wrong, outputs):
    Q, K, V, sink, dO = case_.args
    got, right = float(outputs["dsink"]), float(case_.expected[0])
    if right != 0 and np.isclose(got, -right):
        return "The sign is flipped: dS = P (dP - D) and the sink's dP is 0, so it is -P D."
    O, L = _with_sink(*(np.asarray(a, F64) for a in (Q, K, V)), float(sink))
    if np.isclose(got, -np.exp(float(sink) - L).sum()):
        return "You left out D_i = rowsum(dO_i * O_i): each row's term is P_i,sink times D_i."
    return None


# ----------------------------------------------------------------------------------------
# packed sequences
# ----------------------------------------------------------------------------------------

H_PACKED = ("Query i belongs to the sequence s with cu_seqlens_q[s] <= i < cu_seqlens_q[s+1] "
            "(the same for keys with cu_seqlens_k). It sees key j only when j is in the same "
            "sequence s.")
H_PACKED_CAUSAL = (" With causal, within sequence s (lengths Lq = its queries, Lk = its keys), "
                   "query a (its position in the sequence) sees key b when b <= a + Lk - Lq: "
                   "bottom-right, the queries are the last Lq positions.")


def _packed_rule(cu_q, cu_k, causal):
    Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
    seen = np.zeros((Tq, Tk), dtype=bool)
    for s in range(len(cu_q) - 1):
        Lq, Lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for a in range(Lq):
            for b in range(Lk):
                seen[cu_q[s] + a, cu_k[s] + b] = (not causal) or b <= a + Lk - Lq
    return seen


def _packed_case(label, hint, lengths_q, lengths_k, causal):
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int64)
    return case(label, hint, (cu_q, cu_k, causal), ("visible",),
                (_packed_rule(cu_q, cu_k, causal),), inputs=("cu_seqlens_q", "cu_seqlens_k"))


def _packed_cases():
    return [
        _packed_case("three sequences, not causal", H_PACKED, [3, 5, 2], [3, 5, 2], False),
        _packed_case("three sequences, causal", H_PACKED + H_PACKED_CAUSAL, [3, 5, 2], [3, 5, 2],
                     True),
        _packed_case("more keys than queries (decoding with a prompt), causal",
                     H_PACKED + H_PACKED_CAUSAL, [1, 2, 1], [4, 6, 3], True),
        _packed_case("an empty sequence in the middle", H_PACKED + " An empty sequence has "
                     "cu_seqlens[s] == cu_seqlens[s+1]: no rows, no columns.", [2, 0, 3],
                     [2, 0, 3], True),
        _packed_case("one sequence: plain causal", H_PACKED + H_PACKED_CAUSAL, [6], [6], True),
        _packed_case("more queries than keys: the first queries see nothing",
                     H_PACKED + H_PACKED_CAUSAL, [4, 3], [2, 3], True),
    ]


def _diagnose_packed(case_, wrong, outputs):
    cu_q, cu_k, causal = case_.args
    got = np.asarray(outputs["visible"])
    Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
    if causal and got.shape == (Tq, Tk):
        top_left = _packed_rule(cu_q, cu_k, False) & np.tri(Tq, Tk, dtype=bool)
        if np.array_equal(got.astype(bool), top_left):
            return ("That is causal over the whole packed row (j <= i): each sequence's causal "
                    "rule is its own, counted from the sequence's first token.")
        per_seq_top_left = np.zeros_like(top_left)
        for s in range(len(cu_q) - 1):
            Lq, Lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
            per_seq_top_left[cu_q[s]:cu_q[s + 1], cu_k[s]:cu_k[s + 1]] = np.tri(Lq, Lk, dtype=bool)
        if np.array_equal(got.astype(bool), per_seq_top_left):
            return ("Top-left within each sequence: when a sequence has more keys than queries "
                    "(Lk > Lq), query a sees the keys b <= a + Lk - Lq (bottom-right).")
    return None


STEPS = [
    function_step("step_decode_intensity", "decode_intensity", _intensity_cases,
                  diagnose=_diagnose_intensity),
    function_step("step_read_cache", "read_cache", _page_cases, adapt=untouched,
                  diagnose=_diagnose_pages),
    function_step("step_online_sink", "online_sink_attention", _online_cases, adapt=untouched),
    function_step("step_sink_gradient", "sink_gradient", _grad_cases, adapt=_number,
                  diagnose=_diagnose_grad),
    function_step("step_packed_visible", "packed_visible", _packed_cases,
                  diagnose=_diagnose_packed),
]
