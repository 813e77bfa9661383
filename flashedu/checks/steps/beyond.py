"""Steps of the notebooks around the kernels: arithmetic intensity (00), standard attention
(01), and the merge rule with split-KV decoding built on it (12).

- ``step_intensity_matmul``: FLOPs per byte of a matrix product C = A B, A (M, K), B (K, N).
- ``step_naive_attention``: the paper's Algorithm 0 for one head, (O, L).
- ``step_merge_two``: two partial results (O_a, L_a), (O_b, L_b) over disjoint keys into the
  result over their union; a part that saw no key of a row has O = 0, L = -inf there, and a
  row that saw no key in either part must come out O = 0, L = -inf, never NaN.
- ``step_partial_attention``: what one split-KV program computes: attention of the queries over
  one chunk of keys (bottom-right causal), the partial result the merge takes.
- ``step_split_kv``: cut the keys into chunks, a partial result per chunk, merged.
- ``step_sink_attention``: attention with a sink logit (gpt-oss), one more term of each row's
  softmax with no value: the merge of the keys' result with the sink's (O = 0, L = sink).

References are float64 attention over the whole key set (:mod:`flashedu.reference`); a correct
computation in the inputs' dtype (the package's own merge, or the formula) sets the tolerance.
"""

from __future__ import annotations

import math
import types

import numpy as np

from ... import reference
from ..numpy_exercises import H_N1, H_NQNK, H_WIDE, _qkv, _rng, _wide_qkv
from ..steptools import case, function_step, untouched

F32, F64 = np.float32, np.float64


def _cast(arrays, dtype):
    return tuple(np.asarray(a, dtype=dtype) for a in arrays)


def _inputs(Nq, Nk, d, seed, dtype, wide=False):
    """(float64 copies of what the learner gets, what the learner gets)."""
    qkv = (_wide_qkv if wide else _qkv)(Nq, Nk, d, seed)
    given = _cast(qkv, dtype)
    return _cast(given, F64), given


# ----------------------------------------------------------------------------------------
# 00: arithmetic intensity of a matrix product
# ----------------------------------------------------------------------------------------

H_INTENSITY = ("C = A B with A (M, K) and B (K, N): each of the M N entries of C is K "
               "multiply-adds, 2 FLOPs each, so 2 M N K FLOPs. Bytes: read A (M K numbers) and "
               "B (K N) once, write C (M N) once, each number `itemsize` bytes. I = FLOPs / bytes.")


def _intensity(M, N, K, itemsize):
    return 2 * M * N * K / ((M * K + K * N + M * N) * itemsize)


def _intensity_cases():
    specs = [  # (label, (M, N, K, itemsize), hint)
        ("square, n = 256, fp16", (256, 256, 256, 2), H_INTENSITY),
        ("S = Q K^T: M = N = 4096, K = d = 64, fp16", (4096, 4096, 64, 2), H_INTENSITY +
         " Here C (N x N) is far larger than A and B: writing it dominates the bytes."),
        ("matrix times vector: M = 4096, N = 1, K = 4096, fp16", (4096, 1, 4096, 2),
         H_INTENSITY + " With N = 1, B is a vector: about one multiply-add per number of A."),
        ("non-square, float32: M = 128, N = 256, K = 64", (128, 256, 64, 4), H_INTENSITY +
         " M, N and K differ here: A is M x K, B is K x N, C is M x N."),
        ("one number: M = N = K = 1, float64", (1, 1, 1, 8), H_INTENSITY),
    ]
    return [case(label, hint, args, ("I",), (_intensity(*args),)) for label, args, hint in specs]


def _diagnose_intensity(case_, wrong, outputs):
    M, N, K, itemsize = case_.args
    got = float(outputs["I"])
    flops = 2 * M * N * K
    if math.isclose(got, flops / ((M * K + K * N) * itemsize), rel_tol=1e-6):
        return "Your bytes leave out writing C (M N numbers): the product is written back too."
    if math.isclose(got, 0.5 * _intensity(*case_.args), rel_tol=1e-6):
        return "Half the answer: a multiply-add is 2 FLOPs (a multiply and an add)."
    if math.isclose(got, _intensity(*case_.args) * itemsize, rel_tol=1e-6):
        return "That is FLOPs per number, not per byte: multiply the numbers by itemsize."
    return None


# ----------------------------------------------------------------------------------------
# 01: standard attention (Algorithm 0)
# ----------------------------------------------------------------------------------------

H_NAIVE = ("S = Q K^T / sqrt(d) (Nq x Nk); P = softmax of each row of S (subtract the row's max "
           "m_i before exp); O = P V; L_i = m_i + log(sum_j exp(S_ij - m_i)), the natural-log "
           "logsumexp of row i of S.")


def _naive_cases():
    specs = [  # (label, hint, (Nq, Nk, d), dtype, wide)
        ("Nq = Nk = 8, d = 4", H_NAIVE, (8, 8, 4), F64, False),
        ("Nq = 5 < Nk = 12, d = 8", H_NQNK + " " + H_NAIVE, (5, 12, 8), F64, False),
        ("Nq = 12 > Nk = 5, d = 8", H_NQNK + " " + H_NAIVE, (12, 5, 8), F64, False),
        ("N = 1", H_N1, (1, 1, 3), F64, False),
        ("d = 16: the scale is 1/sqrt(d) = 0.25", "Scale the scores once: S = Q K^T / sqrt(d), "
         "with d the number of columns of Q.", (6, 9, 16), F64, False),
        ("logits in the hundreds", H_WIDE, (10, 14, 8), F64, True),
        ("float32 inputs", "float32 in, float32 out: keep the inputs' dtype. np.sqrt(d) is a "
         "float64 NumPy scalar, and a float32 array divided by it becomes float64; d ** -0.5 "
         "or math.sqrt(d) (Python floats) keep float32.", (9, 11, 8), F32, False),
        ("logits in the hundreds, float32", H_WIDE, (10, 14, 8), F32, True),
    ]
    cases = []
    for seed, (label, hint, (Nq, Nk, d), dtype, wide) in enumerate(specs):
        (Q, K, V), (q, k, v) = _inputs(Nq, Nk, d, seed, dtype, wide)
        cases.append(case(label, hint, (q, k, v), ("O", "L"), reference.naive_attention(Q, K, V),
                          naive=reference.naive_attention(q, k, v), dtype=dtype,
                          inputs=("Q", "K", "V")))
    return cases


def _diagnose_naive(case_, wrong, outputs):
    q, k, v = (a.astype(F64) for a in case_.args)
    d = q.shape[1]
    if "O" in wrong:
        unscaled = reference.naive_attention(q, k, v, scale=1.0)[0]
        if np.allclose(outputs["O"], unscaled, rtol=1e-4, atol=1e-6):
            return "O is attention without the scale: S = Q K^T / sqrt(d)."
        S = (q @ k.T) / math.sqrt(d)
        with np.errstate(all="ignore"):
            e = np.exp(S - S.max(axis=0, keepdims=True))
            cols = (e / e.sum(axis=0, keepdims=True)) @ v
        if cols.shape == outputs["O"].shape and np.allclose(outputs["O"], cols, rtol=1e-4,
                                                            atol=1e-6):
            return ("The softmax ran down the columns (axis=0): each query's row of S is "
                    "normalized over the keys, axis=-1.")
    if "L" in wrong and "O" not in wrong:
        return ("O is right, L is not: L_i = m_i + log(sum_j exp(S_ij - m_i)) with S scaled, "
                "the natural log (np.log).")
    return None


# ----------------------------------------------------------------------------------------
# 12: the merge rule
# ----------------------------------------------------------------------------------------

H_MERGE = ("L = logaddexp(L_a, L_b) (np.logaddexp), O = exp(L_a - L) O_a + exp(L_b - L) O_b, "
           "row by row: each part weighted by its share of the softmax mass.")
H_ONE_EMPTY = ("Some rows saw no key of one part: there L = -inf and O = 0 for that part, its "
               "weight exp(-inf - L) = 0, and the merge is the other part unchanged.")
H_BOTH_EMPTY = ("Some rows saw no key in either part: L_a = L_b = -inf, so L = -inf and "
                "L_a - L = -inf - (-inf) = NaN. Such a row is O = 0, L = -inf: take the "
                "weights relative to a finite value there (e.g. 0 where L = -inf).")
H_MERGE_WIDE = ("L_a and L_b are in the hundreds (or minus hundreds): exp(L_a) overflows to inf "
                "(or underflows to 0). Never exponentiate L alone: np.logaddexp(L_a, L_b) is "
                "safe, and exp(L_a - L) <= 1.")
H_F32_OUT = ("float32 inputs: return float32 O and L (the inputs' dtype). A float64 NumPy "
             "scalar such as np.sqrt(d) turns a float32 array into float64: use d ** -0.5.")


def _visible(Nq, Nk, kind, seed):
    """(Nq, Nk) bool: which keys each query sees. "all", "causal" (top-left), "rows" (some rows
    see nothing at all)."""
    if kind == "all":
        return np.ones((Nq, Nk), dtype=bool)
    if kind == "causal":
        return np.tri(Nq, Nk, dtype=bool)
    seen = _rng(seed + 500).random((Nq, Nk)) < 0.7
    seen[:: 3] = False  # every third row sees no key at all
    return seen


def _merge_case(label, hint, shape, split, kind, dtype, seed, wide=False):
    """Q's attention split between keys A and B (``split``: "halves", "scattered", "first"
    (A = key 0 only) or an int, the first key of B)."""
    Nq, Nk, d = shape
    (Q, K, V), _ = _inputs(Nq, Nk, d, seed, F64, wide)
    seen = _visible(Nq, Nk, kind, seed)
    if split == "scattered":
        in_a = _rng(seed + 900).random(Nk) < 0.5
        in_a[0], in_a[-1] = True, False
    else:
        first_b = {"halves": Nk // 2, "first": 1}.get(split, split)
        in_a = np.arange(Nk) < first_b
    parts = []
    for keys in (in_a, ~in_a):
        O_p, L_p = reference.naive_attention(Q, K[keys], V[keys], mask=seen[:, keys])
        parts += [O_p, L_p]
    given = _cast(parts, dtype)  # the learner's four inputs, rounded to the case's dtype
    from ...merge import merge  # a correct merge in the case's dtype: the tolerance

    return case(label, hint, given, ("O", "L"),
                reference.naive_attention(Q, K, V, mask=seen), naive=merge(*given),
                dtype=dtype, inputs=("O_a", "L_a", "O_b", "L_b"))


def _merge_cases():
    return [
        _merge_case("two halves of 10 keys, Nq = 6", H_MERGE, (6, 10, 4), "halves", "all", F64, 1),
        _merge_case("keys scattered between the parts", H_MERGE, (5, 12, 4), "scattered", "all",
                    F64, 2),
        _merge_case("part A holds one key, Nq = 1", H_MERGE + " " + H_N1, (1, 7, 4), "first",
                    "all", F64, 3),
        _merge_case("causal: early rows see no key of part B", H_ONE_EMPTY, (6, 10, 4), 4,
                    "causal", F64, 4),
        _merge_case("rows that see no key at all (O = 0, L = -inf)", H_BOTH_EMPTY, (9, 10, 4),
                    "scattered", "rows", F64, 5),
        _merge_case("L in the hundreds", H_MERGE_WIDE, (8, 12, 8), "halves", "all", F64, 6,
                    wide=True),
        _merge_case("float32 parts", H_F32_OUT, (7, 9, 4), "scattered", "all", F32, 7),
        _merge_case("float32, rows that see no key at all", H_F32_OUT + " " + H_BOTH_EMPTY,
                    (9, 10, 4), "halves", "rows", F32, 8),
    ]


def _diagnose_merge(case_, wrong, outputs):
    O_a, L_a, O_b, L_b = case_.args
    notes = []
    both = np.isneginf(L_a) & np.isneginf(L_b)
    bad = np.isnan(outputs["O"]).any(axis=1) | np.isnan(outputs["L"])
    if (bad & both).any():
        notes.append("NaN in the rows where both parts are empty (L_a = L_b = -inf): "
                     "exp(L_a - L) is exp(-inf + inf) = exp(NaN) there. Give those rows O = 0, "
                     "L = -inf.")
    elif bad.any():
        notes.append("NaN in rows where some part saw keys: an inf - inf or 0 / 0 (an "
                     "exp(L) that overflowed, or a division by a weight that is 0?).")
    if "L" in wrong and "O" not in wrong:
        notes.append("O is right, L is not: L = log(e^L_a + e^L_b), np.logaddexp(L_a, L_b).")
    return " ".join(notes) or None


H_SINK = ("The sink is one more term of each row's sum with no value: with (O_k, L_k) the "
          "attention over the keys alone, L = logaddexp(L_k, sink) and O = exp(L_k - L) O_k "
          "(merge_two with the sink's part O = 0, L = sink). Or start the online softmax from "
          "it: m_i = sink, l_i = 1, O_i = 0.")
H_SINK_EMPTY = ("Rows that see no key see their sink only: O = 0 and L = sink there, never NaN "
                "(L_k = -inf, and exp(L_k - L) = exp(-inf) = 0).")


def _sink_case(label, hint, shape, sink, dtype, seed, wide=False, empty_rows=False):
    Nq, Nk, d = shape
    (Q, K, V), (q, k, v) = _inputs(Nq, Nk, d, seed, dtype, wide)
    seen = _visible(Nq, Nk, "rows", seed) if empty_rows else None
    from ...merge import merge

    def with_sink(Q, K, V, sink):
        O_k, L_k = reference.naive_attention(Q, K, V, mask=seen)
        return merge(O_k, L_k, np.zeros_like(O_k), np.full_like(L_k, sink))

    mask_arg = () if seen is None else (seen,)
    return case(label, hint, (q, k, v, dtype(sink), *mask_arg), ("O", "L"),
                with_sink(Q, K, V, sink), naive=with_sink(q, k, v, dtype(sink)), dtype=dtype,
                inputs=("Q", "K", "V"))


def _sink_cases():
    return [
        _sink_case("a sink of 0.5, Nq = 5, Nk = 9", H_SINK, (5, 9, 4), 0.5, F64, 1),
        _sink_case("a sink far below the scores (the keys take nearly all)", H_SINK,
                   (4, 12, 4), -30.0, F64, 2),
        _sink_case("a sink far above the scores (O near 0, L near the sink)", H_SINK,
                   (4, 12, 4), 40.0, F64, 3),
        _sink_case("Nq = 1, one key", H_SINK + " " + H_N1, (1, 1, 4), 0.0, F64, 4),
        _sink_case("rows that see no key (a mask)", H_SINK_EMPTY, (9, 10, 4), 1.0, F64, 5,
                   empty_rows=True),
        _sink_case("logits in the hundreds", H_SINK + " " + H_WIDE, (6, 16, 8), 150.0, F64, 6,
                   wide=True),
        _sink_case("float32", H_SINK + " " + H_F32_OUT, (7, 11, 8), -0.25, F32, 7),
    ]


# ----------------------------------------------------------------------------------------
# 12: split-KV decoding, the chunk each program computes, and the whole split
# ----------------------------------------------------------------------------------------

H_PARTIAL = ("Attention of Q over keys lo..hi-1 alone: S = Q K[lo:hi]^T / sqrt(d), the softmax "
             "of each row over these keys, O_s = P V[lo:hi], L_s = the logsumexp of the row.")
H_BOTTOM_RIGHT = ("causal is bottom-right: query n sits at position Nk - Nq + n (Nk = len(K), the "
                  "whole cache) and sees key j (a global position, lo + the index in the chunk) "
                  "when j <= Nk - Nq + n. Mask the others to -inf before the row max.")
H_EMPTY_CHUNK = ("Some queries see no key of this chunk: their row of S is all -inf, so the "
                 "max is -inf and exp(S - max) is NaN. Such a row is the partial result over "
                 "no key: O_s = 0, L_s = -inf (use 0 in place of the max there).")


def _bottom_right(Nq, Nk):
    return np.arange(Nk)[None, :] <= (np.arange(Nq) + Nk - Nq)[:, None]


def _partial_case(label, hint, shape, lo, hi, causal, dtype, seed, wide=False):
    Nq, Nk, d = shape
    (Q, K, V), (q, k, v) = _inputs(Nq, Nk, d, seed, dtype, wide)
    seen = _bottom_right(Nq, Nk)[:, lo:hi] if causal else None
    return case(label, hint, (q, k, v, lo, hi, causal), ("O_s", "L_s"),
                reference.naive_attention(Q, K[lo:hi], V[lo:hi], mask=seen),
                naive=reference.naive_attention(q, k[lo:hi], v[lo:hi], mask=seen), dtype=dtype,
                inputs=("Q", "K", "V"))


def _partial_cases():
    return [
        _partial_case("all keys, lo = 0, hi = Nk", H_PARTIAL, (2, 12, 4), 0, 12, False, F64, 1),
        _partial_case("a middle chunk, keys 5..10", H_PARTIAL + " Only K[lo:hi] and V[lo:hi].",
                      (3, 16, 4), 5, 11, False, F64, 2),
        _partial_case("one key, lo = 7, hi = 8", H_PARTIAL, (2, 9, 4), 7, 8, False, F64, 3),
        _partial_case("causal, the first chunk (every query sees it whole)", H_BOTTOM_RIGHT,
                      (3, 20, 4), 0, 8, True, F64, 4),
        _partial_case("causal, the last chunk (the queries see part of it)", H_BOTTOM_RIGHT,
                      (4, 20, 4), 14, 20, True, F64, 5),
        _partial_case("causal, Nq = 4, chunk = the last key: queries 0..2 see none of it",
                      H_EMPTY_CHUNK, (4, 20, 4), 19, 20, True, F64, 6),
        _partial_case("causal, Nq = 6 > Nk = 4: queries 0, 1 see no key at all", H_EMPTY_CHUNK
                      + " " + H_BOTTOM_RIGHT, (6, 4, 4), 0, 4, True, F64, 7),
        _partial_case("logits in the hundreds", H_WIDE, (4, 16, 8), 3, 13, False, F64, 8,
                      wide=True),
        _partial_case("float32, causal, queries with an empty chunk", H_F32_OUT + " " +
                      H_EMPTY_CHUNK, (5, 24, 8), 21, 24, True, F32, 9),
    ]


H_SPLIT = ("chunk = ceil(Nk / num_splits) keys; chunk s is keys s*chunk .. min((s+1)*chunk, Nk)"
           " - 1 (the last one may be shorter). One partial result per chunk "
           "(partial_attention), folded with merge_two from the result over no key at all "
           "(O = 0, L = -inf).")


def _split_case(label, hint, shape, num_splits, causal, dtype, seed, wide=False):
    Nq, Nk, d = shape
    (Q, K, V), (q, k, v) = _inputs(Nq, Nk, d, seed, dtype, wide)
    seen = _bottom_right(Nq, Nk) if causal else None
    return case(label, hint, (q, k, v, num_splits, causal), ("O", "L"),
                reference.naive_attention(Q, K, V, mask=seen),
                naive=reference.naive_attention(q, k, v, mask=seen), dtype=dtype,
                inputs=("Q", "K", "V"))


def _split_cases():
    return [
        _split_case("one split, Nk = 12", H_SPLIT, (1, 12, 4), 1, False, F64, 1),
        _split_case("3 splits of 4 keys, Nk = 12", H_SPLIT, (2, 12, 4), 3, False, F64, 2),
        _split_case("3 splits, Nk = 10 (chunks of 4, 4, 2)", H_SPLIT + " Do not drop the keys "
                    "past num_splits * (Nk // num_splits).", (2, 10, 4), 3, False, F64, 3),
        _split_case("7 splits, Nk = 20 (chunks of 3; the last has 2)", H_SPLIT, (3, 20, 4), 7,
                    False, F64, 4),
        _split_case("as many splits as keys", H_SPLIT, (1, 6, 4), 6, False, F64, 5),
        _split_case("causal, Nq = 3, a split per key: late chunks are empty for early queries",
                    H_EMPTY_CHUNK + " " + H_SPLIT, (3, 9, 4), 9, True, F64, 6),
        _split_case("causal, Nq = 5 > Nk = 3: queries 0, 1 see no key at all (O = 0, L = -inf)",
                    H_EMPTY_CHUNK, (5, 3, 4), 2, True, F64, 7),
        _split_case("logits in the hundreds, 4 splits", H_WIDE, (4, 20, 8), 4, False, F64, 8,
                    wide=True),
        _split_case("float32, causal, 5 splits", H_F32_OUT, (4, 23, 8), 5, True, F32, 9),
    ]


# ----------------------------------------------------------------------------------------
# The merge must be the learner's: flashedu.merge computes it whole.
# ----------------------------------------------------------------------------------------


def _merge_shortcut(fn) -> str | None:
    """A message when ``fn`` (or a function it calls through its globals) uses flashedu.merge,
    which is the answer of these steps; None else."""
    import sys

    module = sys.modules.get("flashedu.merge")
    if module is None:
        return None
    answers = {id(module): "flashedu.merge"}
    answers.update({id(obj): f"flashedu.merge.{name}" for name, obj in vars(module).items()
                    if isinstance(obj, types.FunctionType) and obj.__module__ == module.__name__})
    seen, todo = set(), [fn]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        code = getattr(obj, "__code__", None)
        if code is None:
            continue
        names = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names |= set(const.co_names)
        if any(n == "flashedu.merge" or n.startswith("flashedu.merge.") for n in names):
            return ("your code imports flashedu.merge, which computes the merge itself: write "
                    "the rule with NumPy operations (that is the step).")
        values = [obj.__globals__.get(n) for n in names]
        values += [c.cell_contents for c in (obj.__closure__ or ()) if _filled(c)]
        if "merge" in names and any(getattr(v, "__name__", "") == "flashedu" for v in values):
            return ("your code uses flashedu.merge, which computes the merge itself: write the "
                    "rule with NumPy operations (that is the step).")
        for value in values:
            if id(value) in answers:
                return (f"your code uses {answers[id(value)]}, which computes the merge itself: "
                        "write the rule with NumPy operations (that is the step).")
            if isinstance(value, types.FunctionType):
                todo.append(value)
    return None


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _merge_step(name, symbol, cases, diagnose=None):
    ex = function_step(name, symbol, cases, adapt=untouched, diagnose=diagnose)
    ex.inspect = _merge_shortcut
    return ex


STEPS = [
    function_step("step_intensity_matmul", "intensity_matmul", _intensity_cases,
                  diagnose=_diagnose_intensity),
    function_step("step_naive_attention", "naive_attention", _naive_cases, adapt=untouched,
                  diagnose=_diagnose_naive),
    _merge_step("step_merge_two", "merge_two", _merge_cases, _diagnose_merge),
    _merge_step("step_partial_attention", "partial_attention", _partial_cases),
    _merge_step("step_split_kv", "split_kv", _split_cases),
    _merge_step("step_sink_attention", "sink_attention", _sink_cases),
]
