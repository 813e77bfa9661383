"""The NumPy exercises: safe and online softmax, tiled forward and backward, block-sparse forward.

Signatures are the contract of DESIGN.md (the package's own functions in flashedu.reference and
flashedu.tiled pass every case). Cases run from the simplest to the hardest, so that the first
failure a learner sees is the most basic one. Every reference is computed in float64 by the
naive formulas of :mod:`flashedu.reference`; the same formulas in the case's dtype set the
tolerance (see :mod:`.compare`).
"""

from __future__ import annotations

import math
import time
from typing import ClassVar

import numpy as np

from .. import reference
from .engine import PREPARE, Case, Exercise, one_blas_thread, others_idle, run_seed

F32, F64 = np.float32, np.float64
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------------
# Hints: what each kind of case is about, in plain words.
# ----------------------------------------------------------------------------------------

H_ONE_TILE = ("One tile only, so this is plain attention: S = scale * Q K^T with scale = "
              "1/sqrt(d) by default, a softmax over each row of S, then O = P V. L_i is the "
              "natural-log logsumexp of row i of S.")
H_TILES = ("Several K_j, V_j tiles per row. When tile j raises the running max from m_i to "
           "m_new, rescale what was accumulated (l_i and O_i) by exp(m_i - m_new) before adding "
           "the new tile. Divide O_i by l_i once, after the last tile.")
H_EDGE = ("Nq and Nk are not multiples of Br and Bc, so the last tiles are smaller. Loop over "
          "ceil(N / B) tiles (not N // B) and cut the last tile at N.")
H_N1 = "N = 1 with tiles larger than N: a single query and key. O must equal V, L the one score."
H_NQNK = ("Nq != Nk: Q has Nq rows, K and V have Nk. Use Nq for the Q tiles and the outputs' "
          "rows, Nk for the K/V tiles.")
H_CAUSAL = ("causal=True: query i sees key j only when j <= i, with i and j global positions "
            "(tile start + offset in the tile), top-left aligned. Check the comparison (<=, not "
            "<) and skip only the tiles that lie wholly above the diagonal.")
H_SCALE = ("An explicit scale replaces 1/sqrt(d): S_ij = scale * Q_i K_j^T. Use it when given, "
           "and apply it exactly once.")
H_WIDE = ("Logits differ by hundreds here: exp overflows to inf above ~88 (float32) or ~709 "
          "(float64) and underflows to 0 far below. Subtract the running max m_i before exp, "
          "and compute L_i = m_i + log(l_i), not log(sum(exp(S))).")
H_F32 = "float32 inputs: return float32 arrays (allocate with the inputs' dtype)."
H_FUTURE = ("causal, and every query's future keys score far above its visible ones. Mask "
            "the scores (-inf for j > i) BEFORE taking the row max m_i: a max that includes a "
            "future key makes every visible exp(S_ij - m_i) underflow to 0 in float32.")
H_BLOCKS = ("Unusual tile sizes (1, unequal, or larger than N): do not assume Br == Bc or that "
            "a tile size divides N.")
H_MEMORY = ("A big problem (large Nq and Nk, small d): the answer must be right AND your "
            "function must never hold an Nq x Nk array, which is what FlashAttention avoids.")


# ----------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------


def _rng(seed):
    """The generator of one case: the check's run seed (fresh per check) and the case's own."""
    return np.random.default_rng((run_seed(), seed))


def _normal(seed, *shape):
    return _rng(seed).standard_normal(shape)


def _qkv(Nq, Nk, d, seed):
    rng = _rng(seed)
    return tuple(rng.standard_normal((n, d)) for n in (Nq, Nk, Nk))


def _wide_qkv(Nq, Nk, d, seed):
    """Scores that spread over hundreds: rows near +900 (exp overflows in float64 too) and rows
    near -900 (exp underflows to 0), with keys hundreds apart within a row."""
    rng = _rng(seed + 7919)
    Q, K, V = _qkv(Nq, Nk, d, seed)
    Q[:, 0] = rng.choice([-250.0, 250.0], Nq)
    K[:, 0] = 10.0 + rng.uniform(-3.0, 3.0, Nk)
    return Q, K, V


def _future_qkv(Nq, Nk, d, seed):
    """Causal inputs where each query's later keys score far higher than its visible ones
    (about 10 per position, hundreds within a tile): a kernel that takes the max before it
    masks subtracts a future key's score and its visible exps underflow to 0 in float32."""
    Q, K, V = _qkv(Nq, Nk, d, seed)
    Q[:, 0] = 30.0
    K[:, 0] = np.arange(Nk) + 0.1 * K[:, 0]
    return Q, K, V


def _cast(arrays, dtype):
    return tuple(np.asarray(a, dtype=dtype) for a in arrays)


_MEMO: dict = {}


def _memo(key, compute, *args):
    """compute() once per process: the references of a case never change, and the long
    sequences of the memory cases cost seconds to compute naively. Read-only: the learner is
    only ever given fresh inputs, never these arrays."""
    key = (run_seed(),) + tuple(key)
    if key not in _MEMO:
        if len(_MEMO) > 400:  # references of earlier checks' seeds
            _MEMO.clear()
        _MEMO[key] = tuple(_readonly(x) for x in compute(*args))
    return _MEMO[key]


def _readonly(x):
    if isinstance(x, tuple):
        return tuple(_readonly(a) for a in x)
    x = np.asarray(x)
    x.setflags(write=False)
    return x


def _mib(n):
    return f"{n / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------------------
# Softmax
# ----------------------------------------------------------------------------------------


def _softmax_inputs():
    """(label, hint, x) from simple to hard."""
    wide = np.array([[1000.0, 999.0, 0.0, 998.0, -5.0, 1001.0, 3.0],
                     [0.0, 1.0, 2.0, 500.0, 501.0, 3.0, -200.0],
                     [-1000.0, -1001.0, -1002.0, -1000.5, -1003.0, -1004.0, -1000.2]])
    masked = np.array([[0.5, -np.inf, 1.5, -np.inf, 0.0], [-np.inf] * 5, [2.0, 1.0, -np.inf, 0.0, 3.0]])
    return [
        ("random, 5 x 7, float64", ("The textbook case: exp(x - max) / sum(exp(x - max)) over "
         "the last axis of each row."), _normal(1, 5, 7)),
        ("random, 4 x 9, float32", H_F32, _normal(2, 4, 9).astype(F32)),
        ("logits in the hundreds (overflow, underflow), float64", H_WIDE, wide),
        ("logits in the hundreds, float32", H_WIDE, wide.astype(F32)),
        ("1-D input of 6", ("Softmax is over the LAST axis, whatever the number of axes: use "
         "axis=-1 and keepdims=True."), _normal(3, 6)),
        ("3-D input 2 x 3 x 5", ("Softmax is over the LAST axis, whatever the number of axes: "
         "use axis=-1 and keepdims=True."), _normal(4, 2, 3, 5)),
        ("rows of length 1", "A row of a single logit has softmax 1.", _normal(5, 3, 1)),
        ("-inf entries and a row of all -inf", ("A -inf logit (a masked key) gets probability "
         "0. A row of only -inf (a query that sees no key) must give zeros, not NaN: its max "
         "is -inf, so use 0 in its place before exp."), masked),
    ]


def _softmax_cases():
    cases = []
    for label, hint, x in _softmax_inputs():
        expected = reference.safe_softmax(np.asarray(x, dtype=F64))
        cases.append(Case(label, hint, (x,), ("softmax",), (expected,),
                          naive=(reference.safe_softmax(x),), inputs=("x",), dtype=x.dtype))
    return cases


class _Streamed(np.ndarray):
    """An input that notices a max or a sum over a whole row at once (a row longer than the
    block). Arrays computed from it (x - m, exp(x - m), ...) are watched too. Subclassed per
    case: ``block`` and ``whole_rows`` live on the class, shared by all views."""

    block: ClassVar[int] = 0
    whole_rows: ClassVar[list] = []

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        cls = type(self)
        if method == "reduce" and isinstance(inputs[0], np.ndarray):
            arr, axis = inputs[0], kwargs.get("axis", 0)
            if _covers_last_axis(arr.ndim, axis) and arr.shape[-1] > cls.block:
                cls.whole_rows.append(f"{ufunc.__name__} over {arr.shape[-1]} columns")
        plain = [i.view(np.ndarray) if isinstance(i, _Streamed) else i for i in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, _Streamed) else o
                                  for o in kwargs["out"])
        result = getattr(ufunc, method)(*plain, **kwargs)
        if method == "__call__" and isinstance(result, np.ndarray):
            return result.view(cls)
        return result


def _covers_last_axis(ndim, axis) -> bool:
    if axis is None:
        return True
    axes = axis if isinstance(axis, tuple) else (axis,)
    return any(a % max(ndim, 1) == ndim - 1 for a in axes)


# NumPy's Python-level reductions: every x.max(...), x.sum(...), np.max(...), np.sum(...),
# np.amax(...) passes through one of these, whatever the class of the array.
_REDUCERS = {"_amax", "_amin", "_sum", "_wrapreduction"}


def _prepare_stream(args, block):
    """Wrap x in a fresh watching class (where the learner's code runs), and watch NumPy's
    reductions in the threads the call starts: ``np.asarray(x)`` or ``x.view(np.ndarray)``
    drops the watching class, but a max or a sum over a whole row still passes through NumPy's
    reduction functions, seen here by a profile hook on the learner's thread."""
    import os
    import threading

    spy = type("Streamed", (_Streamed,), {"block": block, "whole_rows": []})
    x = args[0]
    n = x.shape[-1] if x.ndim else 0
    numpy_dir = os.path.dirname(np.__file__)

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name not in _REDUCERS or \
                not frame.f_code.co_filename.startswith(numpy_dir):
            return
        local = frame.f_locals
        a = local.get("a", local.get("obj"))
        if frame.f_code.co_name == "_wrapreduction" and \
                getattr(local.get("ufunc"), "__name__", "") not in ("maximum", "minimum", "add"):
            return
        if isinstance(a, np.ndarray) and not isinstance(a, _Streamed) and a.ndim and \
                a.shape[-1] == n > block and _covers_last_axis(a.ndim, local.get("axis")):
            name = {"_amax": "maximum", "_amin": "minimum", "_sum": "add"}.get(
                frame.f_code.co_name, getattr(local.get("ufunc"), "__name__", "reduction"))
            spy.whole_rows.append(f"{name} over {n} columns")

    threading.setprofile(profile)  # the call's thread starts after this: it is watched

    def collect():
        threading.setprofile(None)
        return {"whole_rows": list(spy.whole_rows)}

    return (x.view(spy),) + tuple(args[1:]), collect


PREPARE["stream"] = _prepare_stream


def _streaming_probe(block):
    def probe(call, outputs):
        whole = call.evidence.get("whole_rows") if isinstance(call.evidence, dict) else None
        if whole is None:
            return "the grader could not see how your code read the row."
        if whole:
            return (f"the result is right, but your code took a {whole[0]} at once, "
                    f"while block_size is {block}. Online softmax sees each row block by "
                    "block: keep a running max m and sum l, update them with each block "
                    "(rescaling l by exp(m_old - m_new)), and normalize at the end.")
        return None
    return probe


def _online_softmax_cases():
    specs = [  # (index into _softmax_inputs, block sizes)
        (0, (3,)), (1, (4,)), (2, (2, 3)), (3, (3,)), (4, (4,)), (5, (2,)), (6, (1, 4)),
        (7, (2,)),
    ]
    inputs = _softmax_inputs()
    cases = []
    for idx, blocks in specs:
        label, hint, x = inputs[idx]
        for block in blocks:
            hint_b = (hint + " Several blocks per row: when a block raises the max from m to "
                      "m_new, rescale the running sum: l = l * exp(m - m_new) + sum(exp(x_j - m_new)).")
            cases.append(Case(f"{label}, block_size={block}", hint_b, (x, block),
                              ("softmax",), (reference.safe_softmax(np.asarray(x, dtype=F64)),),
                              naive=(reference.safe_softmax(x),), inputs=("x",),
                              dtype=x.dtype, probe=_streaming_probe(block),
                              prepare=("stream", block)))
    whole = _normal(6, 3, 10)
    cases.append(Case("block_size=16 larger than the row of 10", H_BLOCKS, (whole, 16),
                      ("softmax",), (reference.safe_softmax(whole),), inputs=("x",)))
    return cases


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------

# (label, hint, (Nq, Nk, d), (Br, Bc), causal, scale, kind, dtype)
FORWARD_SPECS = [
    ("one tile, Nq=Nk=8, d=4", H_ONE_TILE, (8, 8, 4), (8, 8), False, None, "normal", F64),
    ("several tiles, Nq=Nk=32, Br=8, Bc=8", H_TILES, (32, 32, 8), (8, 8), False, None, "normal", F64),
    ("edge tiles, Nq=37, Nk=53, Br=16, Bc=8", H_EDGE, (37, 53, 8), (16, 8), False, None, "normal", F64),
    ("N=1, Br=Bc=4", H_N1, (1, 1, 3), (4, 4), False, None, "normal", F64),
    ("Nq=10 < Nk=45, Br=4, Bc=16", H_NQNK, (10, 45, 8), (4, 16), False, None, "normal", F64),
    ("Nq=45 > Nk=10, Br=16, Bc=4", H_NQNK, (45, 10, 8), (16, 4), False, None, "normal", F64),
    ("tile sizes 1 x 3 and 64 x 64", H_BLOCKS, (5, 7, 4), (1, 3), False, None, "normal", F64),
    ("tiles larger than N: Br=Bc=64, Nq=Nk=10", H_BLOCKS, (10, 10, 4), (64, 64), False, None, "normal", F64),
    ("explicit scale=0.3", H_SCALE, (19, 23, 8), (8, 8), False, 0.3, "normal", F64),
    ("causal, Nq=Nk=37, Br=8, Bc=16", H_CAUSAL, (37, 37, 8), (8, 16), True, None, "normal", F64),
    ("causal, Nq=Nk=32, Br=Bc=8", H_CAUSAL, (32, 32, 8), (8, 8), True, None, "normal", F64),
    ("causal, Nq=20 < Nk=33", H_CAUSAL, (20, 33, 8), (8, 8), True, None, "normal", F64),
    ("causal, Nq=33 > Nk=20", H_CAUSAL, (33, 20, 8), (8, 8), True, None, "normal", F64),
    ("causal, N=1", H_CAUSAL, (1, 1, 4), (4, 4), True, None, "normal", F64),
    ("causal, explicit scale=2.0", H_SCALE, (21, 21, 4), (8, 4), True, 2.0, "normal", F64),
    ("logits in the hundreds, float64", H_WIDE, (24, 40, 8), (8, 8), False, None, "wide", F64),
    ("logits in the hundreds, causal", H_WIDE, (24, 40, 8), (8, 16), True, None, "wide", F64),
    ("edge tiles, float32", H_F32, (37, 53, 8), (16, 8), False, None, "normal", F32),
    ("causal, float32", H_F32, (37, 37, 8), (8, 16), True, None, "normal", F32),
    ("logits in the hundreds, float32", H_WIDE, (24, 40, 8), (8, 8), False, None, "wide", F32),
    ("causal, a future key dominates, float32", H_FUTURE, (40, 40, 8), (8, 16), True, None,
     "future", F32),
]

# The memory cases: (label, (Nq, Nk, d), (Br, Bc), causal). The first two catch an Nq x Nk array
# (scores, probabilities, a causal mask); the third, one Q tile against 256 K/V tiles, catches a
# kernel that tiles only Q and takes whole rows of scores (Br x Nk, 8 MiB there) at once.
MEMORY_SPECS = [
    ("memory: Nq=Nk=2048, d=4, Br=Bc=64", (2048, 2048, 4), (64, 64), False),
    ("memory: Nq=Nk=2048, d=4, Br=Bc=64, causal", (2048, 2048, 4), (64, 64), True),
    ("memory: Nq=64, Nk=16384, d=2, Br=Bc=64", (64, 16384, 2), (64, 64), False),
]


def _inputs(shape, kind, dtype, seed):
    """(the inputs in float64, the same in ``dtype``): the reference sees exactly the values
    the learner's function sees, rounding included."""
    Nq, Nk, d = shape
    make = {"wide": _wide_qkv, "future": _future_qkv}.get(kind, _qkv)
    qkv = make(Nq, Nk, d, seed)
    cast = _cast(qkv, dtype)
    return _cast(cast, F64), cast


def _memory_budget(arrays, Br, Bc, itemsize=8):
    """Generous for a tiled kernel (three copies of every input and output, sixteen tiles
    alive at once), yet below an Nq x Nk array (even a bool one) and a Br x Nk row block at
    the memory cases' sizes."""
    return 3 * sum(a.nbytes for a in arrays) + 16 * Br * Bc * itemsize + 64 * 1024


def _memory_note(Nq, Nk, Br, itemsize=8):
    return (f"(Here an Nq x Nk array of scores is {_mib(Nq * Nk * itemsize)}, a bool Nq x Nk "
            f"mask {_mib(Nq * Nk)}, and a Br x Nk block of whole rows {_mib(Br * Nk * itemsize)}.)")


def _forward_cases():
    cases = []
    for seed, (label, hint, shape, (Br, Bc), causal, scale, kind, dtype) in enumerate(FORWARD_SPECS):
        (Q, K, V), (q, k, v) = _inputs(shape, kind, dtype, seed)
        (O, L), naive, streamed, rounding = _memo(("forward", label), _forward_refs, Q, K, V,
                                                  q, k, v, causal, scale)
        cases.append(Case(f"{label}, {np.dtype(dtype).name}" if "float" not in label else label,
                          hint, (q, k, v, Br, Bc, causal, scale), ("O", "L"), (O, L), naive,
                          inputs=("Q", "K", "V"), dtype=dtype, block_q=Br,
                          variants=(streamed,) if streamed else (), rounding=rounding))
    for seed, (label, shape, (Br, Bc), causal) in enumerate(MEMORY_SPECS, start=100):
        cases.append(_forward_memory_case(label, shape, Br, Bc, causal, seed))
    return cases


def _forward_refs(Q, K, V, q, k, v, causal, scale):
    """The float64 reference, two correct computations in the learner's dtype (the
    tolerance): the naive formula, and O kept normalized key by key (float32 only), and each
    output's allowance from the rounding a correct kernel can make on this draw. Without it
    the two candidates can both land closer than a third correct order of the sums: with
    logits in the hundreds in float32, a plain softmax over whole rows (P V / l) missed the
    candidates' allowance by 1.4x on one draw in a few hundred."""
    from .. import tolerance

    ref = reference.naive_attention(Q, K, V, causal=causal, scale=scale)
    streamed = normalized_key_by_key(q, k, v, causal, scale) if q.dtype == F32 else ()
    bounds = tolerance.attention_rounding(q, k, v, causal=causal, scale=scale,
                                          dtype=tolerance.dtype_name(q.dtype))
    return (ref, reference.naive_attention(q, k, v, causal=causal, scale=scale), streamed,
            tolerance.allowances(bounds, ref))


def normalized_key_by_key(q, k, v, causal, scale):
    """A correct forward that keeps O_i normalized after every key, all in the inputs' dtype:
    O_i = O_i * (alpha * l_i / l_new) + (p / l_new) V_j. Its float32 rounding is several times
    the naive formula's (one division per key), and a kernel written this way is right."""
    t = q.dtype.type
    Nq, d = q.shape
    s = t(1 / math.sqrt(d) if scale is None else scale)
    S = (q @ k.T) * s
    m = np.full(Nq, -np.inf, dtype=q.dtype)
    l = np.zeros(Nq, dtype=q.dtype)
    O = np.zeros_like(q)
    with np.errstate(all="ignore"):
        for j in range(k.shape[0]):
            s_j = S[:, j] if not causal else np.where(np.arange(Nq) >= j, S[:, j], -np.inf).astype(q.dtype)
            m_new = np.maximum(m, s_j)
            seen = np.isfinite(m_new)
            alpha = np.where(seen, np.exp(m - np.where(seen, m_new, 0)), 0).astype(q.dtype)
            p = np.where(seen, np.exp(s_j - np.where(seen, m_new, 0)), 0).astype(q.dtype)
            l_new = alpha * l + p
            safe = np.where(l_new > 0, l_new, 1).astype(q.dtype)
            O = O * (alpha * l / safe)[:, None] + (p / safe)[:, None] * v[j]
            m, l = m_new, l_new
        L = np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf).astype(q.dtype)
    return O, L


def _forward_memory_case(label, shape, Br, Bc, causal, seed):
    Nq, Nk, d = shape
    Q, K, V = _qkv(Nq, Nk, d, seed)
    O, L = _memo(("forward", label), lambda: reference.naive_attention(Q, K, V, causal=causal))
    return Case(label, H_MEMORY, (Q, K, V, Br, Bc, causal, None), ("O", "L"), (O, L),
                inputs=("Q", "K", "V"), memory_budget=_memory_budget((Q, K, V, O, L), Br, Bc),
                memory_note=_memory_note(Nq, Nk, Br), needs_pass=True)


def _last_tile_only(case, rows) -> bool:
    """True when every wrong row lies in the last, partial Q tile."""
    Nq, Br = case.args[0].shape[0], case.block_q
    if Br is None:
        return False
    first = (math.ceil(Nq / Br) - 1) * Br
    return Nq % Br != 0 and len(rows) > 0 and rows.min() >= first


def _diagnose_forward(case, wrong, outputs):
    notes = []
    if "L" in wrong and "O" not in wrong:
        notes.append("O is right but L is not: L_i = m_i + log(l_i), the natural-log "
                     "logsumexp of the scaled scores (with the max m_i added back).")
    if "L" in wrong:
        L, ref = outputs["L"].astype(F64), case.expected[1]
        finite = np.isfinite(ref) & np.isfinite(L)
        if finite.any() and np.allclose(L[finite] * LN2, ref[finite], rtol=1e-4, atol=1e-6):
            notes.append("Your L looks like a base-2 logarithm: if you used exp2, convert back "
                         "(multiply by ln 2).")
    if "O" in wrong and "L" not in wrong:
        notes.append("L is right, so m_i and l_i are right: look at O_i, its rescale by "
                     "exp(m_i - m_new) at each tile and the division by l_i at the end.")
    for name, rows in wrong.items():
        if _last_tile_only(case, rows):
            notes.append(f"Only rows of the last, partial Q tile are wrong in {name}: check the "
                         "loop bounds and where the last tile is cut.")
            break
    return " ".join(notes) or None


# ----------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------

BACKWARD_SPECS = [spec for spec in FORWARD_SPECS if "tiles larger" not in spec[0]]


def _backward_case(label, hint, Q, K, V, q, k, v, Br, Bc, causal, scale, dtype, seed, **extra):
    def compute():
        O, L = reference.naive_attention(Q, K, V, causal=causal, scale=scale)
        dO = _normal(seed + 1000, *O.shape)
        o, l, do = _cast((O, L, dO), dtype)
        # in float64 too: with logits in the hundreds dS = P (dP - D) cancels, and a correct
        # backward that takes D from P dP can miss by over the float64 floor (5% of seeds did)
        naive = _backward_in_dtype(q, k, v, o, do, l, causal, scale)
        other = _backward_in_dtype(q, k, v, o, do, l, causal, scale, delta="P dP")
        grads = reference.naive_attention_backward(Q, K, V, dO, causal=causal, scale=scale)
        # the memory cases (float64, plain inputs, Nq = Nk = 2048) need no bound beyond the
        # candidates' and the float64 floor; computing it would cost seconds every check
        rounding = () if "memory_budget" in extra else \
            _backward_rounding(q, k, v, o, do, l, causal, scale, grads)
        return (o, l, do), grads, naive, other, rounding

    given, (dQ, dK, dV), naive, other, rounding = _memo(("backward", label), compute)
    o, l, do = (a.copy() for a in given)  # the learner's own, writable copies
    return Case(label, hint, (q, k, v, o, do, l, Br, Bc, causal, scale), ("dQ", "dK", "dV"),
                (dQ, dK, dV), naive, inputs=("Q", "K", "V", "O", "dO", "L"), dtype=dtype,
                variants=(other,), rounding=tuple(float(r) for r in rounding), **extra)


def _backward_rounding(q, k, v, o, do, l, causal, scale, grads):
    """(dQ, dK, dV)'s allowances from rounding on this draw (flashedu.tolerance). The learner
    computes D_i, by either formula: a tiled rowsum(P_ij * dP_ij) can miss by several times
    the untiled one where dP_ij - D_i cancels, so the two candidates alone do not bound it."""
    from .. import tolerance

    bounds = tolerance.attention_backward_rounding(
        q, k, v, do, l, (do * o).sum(axis=1), causal=causal, scale=scale,
        dtype=tolerance.dtype_name(q.dtype), delta_from_p=True)
    return tolerance.allowances(bounds, grads)


def _backward_in_dtype(Q, K, V, O, dO, L, causal, scale, delta="dO O"):
    """The backward's formulas without tiles, computed in the inputs' dtype from the given L.

    Its error sets the tolerance: with logits in the hundreds, exp(S_ij - L_i) in float32 is off
    by |S| * eps however it is tiled, because S and L are rounded separately. ``delta="P dP"``
    takes D_i = rowsum(P_ij * dP_ij) instead of rowsum(dO_i * O_i): equal in exact arithmetic,
    and a correct kernel may use either; their float32 errors differ."""
    scale = 1.0 / math.sqrt(Q.shape[1]) if scale is None else scale
    S = Q.dtype.type(scale) * (Q @ K.T)
    if causal:
        S = np.where(reference.causal_mask(*S.shape), S, -np.inf)
    with np.errstate(all="ignore"):
        P = np.exp(S - L[:, None])
        dP = dO @ V.T
        D = (dO * O).sum(axis=1, keepdims=True) if delta == "dO O" else \
            (P * dP).sum(axis=1, keepdims=True)
        dS = P * (dP - D)
    return scale * dS @ K, scale * dS.T @ Q, P.T @ dO


def _backward_cases():
    cases = []
    for seed, (label, hint, shape, (Br, Bc), causal, scale, kind, dtype) in enumerate(BACKWARD_SPECS):
        (Q, K, V), (q, k, v) = _inputs(shape, kind, dtype, seed)
        hint = hint if hint not in (H_ONE_TILE, H_TILES) else H_BACKWARD
        cases.append(_backward_case(label, hint, Q, K, V, q, k, v, Br, Bc, causal, scale,
                                    dtype, seed))
    for seed, (label, (Nq, Nk, d), (Br, Bc), causal) in enumerate(MEMORY_SPECS, start=200):
        Q, K, V = _qkv(Nq, Nk, d, seed)
        budget = _memory_budget((Q, K, V) * 2 + (Q, Q), Br, Bc)  # Q, K, V, O, dO, dQ, dK, dV
        cases.append(_backward_case(label, H_MEMORY, Q, K, V, Q, K, V, Br, Bc, causal, None,
                                    F64, seed, memory_budget=budget,
                                    memory_note=_memory_note(Nq, Nk, Br), needs_pass=True))
    return cases


H_BACKWARD = ("The backward recomputes P_ij = exp(S_ij - L_i) tile by tile (masked like the "
              "forward), with D_i = rowsum(dO_i * O_i): dV_j += P_ij^T dO_i; dP_ij = dO_i V_j^T; "
              "dS_ij = P_ij * (dP_ij - D_i); dQ_i += scale * dS_ij K_j; dK_j += scale * dS_ij^T Q_i.")


def _diagnose_backward(case, wrong, outputs):
    names = set(wrong)
    if "dV" in names:
        return ("dV is wrong, so P_ij is: recompute it as exp(S_ij - L_i) with S_ij = scale * "
                "Q_i K_j^T and the same mask as the forward; then dV_j += P_ij^T dO_i over all "
                "Q tiles i.")
    if names == {"dQ", "dK"}:
        return ("dV is right (so P_ij is), but dQ and dK are not: check dS_ij = P_ij * (dP_ij "
                "- D_i), with dP_ij = dO_i V_j^T and D_i = rowsum(dO_i * O_i), and the factor "
                "scale in both gradients.")
    if names == {"dQ"}:
        return ("Only dQ is wrong: dQ_i += scale * dS_ij K_j, summed over every K/V tile j "
                "(accumulate, do not overwrite).")
    if names == {"dK"}:
        return ("Only dK is wrong: dK_j += scale * dS_ij^T Q_i, summed over every Q tile i "
                "(accumulate, do not overwrite).")
    return None


# ----------------------------------------------------------------------------------------
# Block-sparse forward
# ----------------------------------------------------------------------------------------

H_SPARSE = ("block_mask[i, j] False means: skip tile (i, j) entirely, never read K_j, V_j for "
            "it. This case fills K_j and V_j of key tiles that every query tile skips with NaN: "
            "NaN in your O means a skipped tile was computed. A Q tile with no kept tile sees no "
            "key: O_i = 0 and L_i = -inf (no 0/0).")


def _element_mask(blocks, Nq, Nk, Br, Bc):
    return np.repeat(np.repeat(blocks, Br, axis=0), Bc, axis=1)[:Nq, :Nk]


def _sparse_case(label, hint, shape, Br, Bc, blocks, scale, dtype, seed, **extra):
    Nq, Nk, _ = shape
    (Q, K, V), (q, k, v) = _inputs(shape, "normal", dtype, seed)
    blocks = np.asarray(blocks, dtype=bool)
    mask = _element_mask(blocks, Nq, Nk, Br, Bc)
    (O, L), naive = _memo(("block sparse", label), lambda: (
        reference.naive_attention(Q, K, V, scale=scale, mask=mask),
        reference.naive_attention(q, k, v, scale=scale, mask=mask)))
    k, v = k.copy(), v.copy()
    for j in np.flatnonzero(~blocks.any(axis=0)):  # key tiles nobody may read: poisoned
        k[j * Bc:(j + 1) * Bc] = np.nan
        v[j * Bc:(j + 1) * Bc] = np.nan
    return Case(label, hint, (q, k, v, blocks, Br, Bc, scale), ("O", "L"), (O, L), naive,
                inputs=("Q", "K", "V", "block_mask"), dtype=dtype, block_q=Br,
                prepare=("watch_kv",), probe=_tile_probe(blocks, Bc, Nk), **extra)


class _TileWatch(np.ndarray):
    """K or V of a block-sparse case: records which rows each read takes (K[c0:c1] -> (c0,
    c1)) and any operation on the whole array. Slices come back as plain arrays. Subclassed
    per call: ``log`` lives on the class."""

    log: ClassVar[list] = []

    def __getitem__(self, idx):
        out = np.ndarray.__getitem__(self.view(np.ndarray), idx)
        rows = idx[0] if isinstance(idx, tuple) and idx else idx
        if isinstance(rows, slice):
            start, stop, step = rows.indices(self.shape[0])
            type(self).log.append([start, stop] if step == 1 else ["other"])
        elif isinstance(rows, (int, np.integer)):
            row = int(rows) % max(self.shape[0], 1)
            type(self).log.append([row, row + 1])
        else:
            type(self).log.append(["other"])
        return out

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        type(self).log.append(["whole"])
        plain = [i.view(np.ndarray) if isinstance(i, _TileWatch) else i for i in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, _TileWatch) else o
                                  for o in kwargs["out"])
        return getattr(ufunc, method)(*plain, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        if func not in (np.shape, np.ndim, np.size):
            type(self).log.append(["whole"])
        return func(*_plain(args), **_plain(kwargs))


def _plain(x):
    if isinstance(x, _TileWatch):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(i) for i in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _prepare_watch_kv(args):
    """Wrap K and V (arguments 1 and 2) in one fresh watching class (where the code runs)."""
    watch = type("Watched", (_TileWatch,), {"log": []})
    q, k, v = args[:3]
    return (q, k.view(watch), v.view(watch)) + tuple(args[3:]), lambda: {"reads": list(watch.log)}


PREPARE["watch_kv"] = _prepare_watch_kv


def _tile_probe(blocks, Bc, Nk):
    """Key tiles that block_mask skips for every query tile must never be read (not even read
    and thrown away), nor may K and V be used whole; and at most about one K_j, V_j read per
    kept tile."""
    blocks = np.asarray(blocks, dtype=bool)
    dead = np.zeros(Nk, dtype=bool)
    for j in np.flatnonzero(~blocks.any(axis=0)):
        dead[j * Bc:(j + 1) * Bc] = True
    kept = int(blocks.sum())

    def probe(call, outputs):
        reads = (call.evidence or {}).get("reads") if isinstance(call.evidence, dict) else None
        if not reads:  # nothing seen (e.g. np.asarray(K) dropped the watch): NaN poison only
            return None
        if dead.any() and any(r[0] == "whole" for r in reads):
            return ("the answer is right, but your code used the whole of K or V at once (a "
                    "product or an operation over all keys), so it computed tiles that "
                    "block_mask skips. Read K_j, V_j one kept tile at a time.")
        for r in reads:
            if r[0] not in ("whole", "other") and dead[int(r[0]):int(r[1])].any():
                return (f"the answer is right, but your code read rows {r[0]}..{int(r[1]) - 1} "
                        "of K or V, in a key tile that block_mask skips for every query tile "
                        "(the result was then thrown away). A skipped tile must not be read "
                        "at all: test block_mask[i, j] before touching K_j, V_j.")
        tiles = sum(1 for r in reads if r[0] not in ("whole", "other"))
        if tiles > 2 * (2 * kept + blocks.shape[1]):  # K and V: about 2 reads per kept tile
            return (f"the answer is right, but your code read {tiles} tiles of K and V where "
                    f"block_mask keeps {kept} (i, j) tiles: skip the others without reading.")
        return None
    return probe


def _sparse_blocks(Tr, Tc, seed, empty_row, empty_col):
    blocks = np.random.default_rng(seed).random((Tr, Tc)) < 0.6
    blocks[np.arange(Tr), np.arange(Tr) % Tc] = True
    blocks[:, empty_col] = False
    blocks[empty_row, :] = False
    return blocks


def _block_sparse_cases():
    T = True
    cases = [
        _sparse_case("all tiles kept (dense), Nq=Nk=24, Br=Bc=8", H_ONE_TILE, (24, 24, 4), 8, 8,
                     np.ones((3, 3)), None, F64, 1),
        _sparse_case("a skipped key tile, Nq=Nk=32, Br=Bc=8", H_SPARSE, (32, 32, 4), 8, 8,
                     [[T, 0, T, T], [0, 0, T, T], [T, 0, 0, T], [T, 0, T, 0]], None, F64, 2),
        _sparse_case("a query tile with no kept tile (O=0, L=-inf)", H_SPARSE, (32, 32, 4), 8, 8,
                     [[T, T, 0, T], [0, 0, 0, 0], [T, 0, T, T], [0, T, 0, T]], None, F64, 3),
        _sparse_case("edge tiles, Nq=37, Nk=45, Br=8, Bc=16", H_SPARSE + " " + H_EDGE,
                     (37, 45, 8), 8, 16, _sparse_blocks(5, 3, 4, 2, 1), None, F64, 4),
        _sparse_case("Nq=13 < Nk=50, explicit scale=0.5", H_SPARSE + " " + H_SCALE,
                     (13, 50, 8), 4, 8, _sparse_blocks(4, 7, 5, 3, 4), 0.5, F64, 5),
        _sparse_case("N=1, tile kept", H_N1, (1, 1, 4), 4, 4, [[T]], None, F64, 6),
        _sparse_case("N=1, tile skipped (O=0, L=-inf)", H_SPARSE, (1, 1, 4), 4, 4, [[False]],
                     None, F64, 7),
        _sparse_case("every tile skipped", H_SPARSE, (10, 12, 4), 4, 4, np.zeros((3, 3)), None,
                     F64, 8),
        _sparse_case("edge tiles, float32", H_SPARSE + " " + H_F32, (37, 45, 8), 8, 16,
                     _sparse_blocks(5, 3, 9, 0, 2), None, F32, 9),
    ]
    for seed, (label, shape, (Br, Bc), causal) in enumerate(MEMORY_SPECS, start=300):
        if causal:
            continue  # block-sparse has no causal flag: the other two cases
        Nq, Nk, d = shape
        Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
        band = np.abs(np.subtract.outer(np.arange(Tr), np.arange(Tc))) <= 2  # a sliding window
        band[:, -1] = True  # and one global key tile, so that the long-K case has two per row
        budget = _memory_budget(_qkv(Nq, Nk, d, 0) * 2, Br, Bc)
        cases.append(_sparse_case(label + ", banded mask", H_MEMORY, (Nq, Nk, d), Br, Bc, band,
                                  None, F64, seed, memory_budget=budget,
                                  memory_note=_memory_note(Nq, Nk, Br), needs_pass=True))
    cases.append(_work_case(400))
    return cases


H_WORK = ("The work must follow the mask: with 1 tile in 32 kept, a block-sparse kernel does "
          "about 1/32 of a dense one's work. Test block_mask[i, j] before computing "
          "S_ij, and skip the tile entirely when it is False.")
# Big enough that a dense pass costs a few tenths of a second of NumPy work (CPU time is read in
# ticks of 10 ms), with tiles large enough that NumPy, not Python's loop, sets the cost, and d
# small: the cost is the Nq x Nk exponentials, while the inputs that travel to the learner's
# process and back (a fixed cost of the call) stay small. Computing every tile and dropping the
# skipped ones costs about a dense tiled pass, however it is written.
WORK_SHAPE, WORK_TILE = (4096, 4096, 8), 128
# A sparse call may take this share of the grader's own dense tiled pass: the solution takes
# 0.15-0.25 of it (1/32 of the tiles, plus reading the inputs and sending the answer), a kernel
# that computes every tile and drops the skipped ones 1.4 (measured on a 2-core CPU).
WORK_SHARE = 0.5


def _work_case(seed):
    """One key tile kept per query tile row (32 of 1024 tiles; half the key tiles skipped by
    every row and filled with NaN), judged by its CPU time against a dense pass."""
    from .. import tiled

    Nq, Nk, d = WORK_SHAPE
    Tr, Tc = Nq // WORK_TILE, Nk // WORK_TILE
    blocks = np.zeros((Tr, Tc), dtype=bool)
    blocks[np.arange(Tr), 2 * (np.arange(Tr) // 2)] = True
    (Q, K, V), _ = _inputs(WORK_SHAPE, "normal", F64, seed)
    O, L = tiled.block_sparse_forward(Q, K, V, blocks, WORK_TILE, WORK_TILE)
    k, v = K.copy(), V.copy()
    for j in np.flatnonzero(~blocks.any(axis=0)):
        k[j * WORK_TILE:(j + 1) * WORK_TILE] = np.nan
        v[j * WORK_TILE:(j + 1) * WORK_TILE] = np.nan

    def budget():
        """WORK_SHARE of the grader's own dense tiled pass on these inputs, timed here (the
        best of two, in this process's CPU time)."""
        dense = np.ones((Tr, Tc), dtype=bool)
        best = math.inf
        with one_blas_thread():  # as the learner's call ran
            others_idle()
            for _ in range(2):
                start = time.process_time()
                tiled.block_sparse_forward(Q, K, V, dense, WORK_TILE, WORK_TILE)
                best = min(best, time.process_time() - start)
        return WORK_SHARE * best, (f"{WORK_SHARE:g} of a pass over every tile (the grader's "
                                   f"own, {best:.2f} s; yours keeps {int(blocks.sum())} of "
                                   f"{blocks.size})")

    return Case(f"work follows the mask: Nq=Nk={Nq}, Br=Bc={WORK_TILE}, 1 tile in 32 kept",
                H_WORK, (Q.copy(), k, v, blocks, WORK_TILE, WORK_TILE, None), ("O", "L"),
                (O, L), inputs=("Q", "K", "V", "block_mask"), dtype=F64, block_q=WORK_TILE,
                needs_pass=True, cpu_budget=budget)


def _diagnose_sparse(case, wrong, outputs):
    O = outputs["O"]
    if np.isnan(O).any():
        return ("NaN in O: this case put NaN in K_j, V_j of key tiles that block_mask skips for "
                "every query tile, so your code computed a tile it must skip (test "
                "block_mask[i, j] before touching K_j, V_j).")
    return _diagnose_forward(case, wrong, outputs)


# The stepper replays a kernel in Python with a line tracer: cheap on small cases only.
STEPPER_MAX_SCORES = 64 * 64


def stepper_hint(fn, args) -> str | None:
    """Where the learner's forward first leaves the reference, and the stepper call that shows
    it (:func:`flashedu.viz.learner_trace.divergence_hint`); None on large cases, on cases with
    an explicit scale (the stepper replays the default one) and when the traces agree."""
    Q, K, V, Br, Bc, causal, scale = args
    if scale is not None or Q.shape[0] * K.shape[0] > STEPPER_MAX_SCORES:
        return None
    from ..viz.learner_trace import divergence_hint

    return divergence_hint(fn, Q, K, V, Br, Bc, causal=bool(causal))


EXERCISES = [
    Exercise("safe_softmax", 1, "safe_softmax", _softmax_cases),
    Exercise("online_softmax", 2, "online_softmax", _online_softmax_cases),
    Exercise("flash_forward", 4, "flash_forward", _forward_cases, diagnose=_diagnose_forward,
             timeout=30.0, hint=stepper_hint),
    Exercise("flash_backward", 4, "flash_backward", _backward_cases, diagnose=_diagnose_backward,
             timeout=30.0),
    Exercise("block_sparse_forward", 3, "block_sparse_forward", _block_sparse_cases,
             diagnose=_diagnose_sparse, timeout=30.0),
]
