"""The NumPy loops of notebooks 02-04, one step each: the safe softmax and the online softmax's
running statistics (02), Algorithm 1's and FlashAttention-2's tiled forward (03), the gradients
without tiles and the tiled backward (04).

Each step's function has the notebook's signature, smaller than the exercise's (no causal mask,
no explicit scale, no memory limit): exercises/ asks for those. Inputs are drawn fresh from the
check's run seed, references are the float64 formulas of :mod:`flashedu.reference`, and the same
formulas in the inputs' dtype set the tolerance, as for the exercises.
"""

from __future__ import annotations

import math

import numpy as np

from ... import reference
from ...tolerance import FLOOR
from ..numpy_exercises import (
    H_EDGE,
    H_N1,
    H_NQNK,
    H_WIDE,
    _backward_in_dtype,
    _diagnose_backward,
    _diagnose_forward,
    _forward_refs,
    _inputs,
    _memo,
    _normal,
    _softmax_inputs,
    stepper_hint,
)
from ..steptools import as_arrays, case, function_step, untouched

F32, F64 = np.float32, np.float64
# float32 inputs whose outputs come back as float64 (the notebook's loops keep m_i, l_i in
# float64): compared in float64, with float32's error floor
F32_FLOOR = FLOOR["float32"] / FLOOR["float64"]


# ----------------------------------------------------------------------------------------
# 02: the safe softmax
# ----------------------------------------------------------------------------------------

H_SAFE = ("Subtract each row's max m before exp: e = exp(x - m) with m = x.max(axis=-1, "
          "keepdims=True), then divide e by its sum over the same axis.")
H_BIG = ("Logits near +-1000 here: exp overflows to inf above ~88 (float32) or ~709 (float64), "
         "and inf / inf is NaN. Subtract the row's max before exp, so that every exponent is "
         "<= 0.")


def _safe_softmax_cases():
    cases = []
    # every input of the exercise's check but its last (rows of -inf): the exercise asks that
    for label, hint, x in _softmax_inputs()[:-1]:
        expected = reference.safe_softmax(np.asarray(x, dtype=F64))
        if label.startswith("random") and x.dtype == F64:
            hint = H_SAFE
        elif "hundreds" in label:
            hint = H_BIG
        cases.append(case(label, hint, (x,), ("softmax",), (expected,),
                          naive=(reference.safe_softmax(x),), dtype=x.dtype, inputs=("x",)))
    return cases


# ----------------------------------------------------------------------------------------
# 02: the online softmax's running statistics
# ----------------------------------------------------------------------------------------

H_STATS = ("For each block x_j: m_j = rowmax(x_j), l_j = rowsum(exp(x_j - m_j)); then m_new = "
           "max(m, m_j), l = exp(m - m_new) * l + exp(m_j - m_new) * l_j, and m = m_new.")
H_RISING = ("The row max rises block after block here, so every block rescales what l holds: "
            "l = exp(m - m_new) * l + exp(m_j - m_new) * l_j. Adding l_j alone (no rescale) "
            "sums terms taken relative to different maxima.")


def _stats_of(x):
    m = x.max(axis=1)
    return m, np.exp(x - m[:, None]).sum(axis=1)


def _streaming_probe(Bc):
    def probe(call, outputs):
        whole = call.evidence.get("whole_rows") if isinstance(call.evidence, dict) else None
        if whole:
            return (f"m and l are right, but your code took a {whole[0]} at once, while Bc is "
                    f"{Bc}: work on the block x_j only (its m_j and l_j), and fold it into the "
                    "running m and l.")
        return None
    return probe


def _online_stats_cases():
    rising = np.sort(_normal(13, 3, 24), axis=1) * 4  # the max moves on in every block
    wide = _softmax_inputs()[2][2]  # logits near +-1000: exp overflows in float64 too
    specs = [  # (label, hint, x, Bc)
        ("3 x 20, Bc=4", H_STATS, _normal(11, 3, 20) * 3, 4),
        ("4 x 23, Bc=5 (a partial last block)", H_STATS + " The last block is narrower: "
         "x_j = x[:, start:start + Bc] cuts it at the row's end.", _normal(12, 4, 23) * 3, 5),
        ("the max rises in every block, Bc=6", H_RISING, rising, 6),
        ("Bc=1 (one column a block)", H_STATS, _normal(14, 2, 9), 1),
        ("one row, 1 x 7, Bc=3", H_STATS, _normal(15, 1, 7), 3),
        ("Bc=32 wider than the row of 10", H_STATS, _normal(16, 3, 10), 32),
        ("logits near +-1000, Bc=2", H_BIG + " Here: exp(x_j - m_j), exp(m - m_new) and "
         "exp(m_j - m_new).", wide, 2),
    ]
    cases = []
    for label, hint, x, Bc in specs:
        streamed = Bc < x.shape[1]
        cases.append(case(label, hint, (x, Bc), ("m", "l"), _stats_of(x), inputs=("x",),
                          prepare=("stream", Bc) if streamed else None,
                          probe=_streaming_probe(Bc) if streamed else None))
    return cases


def _adapt_stats(value):
    """(m, l, history) -> (m, l) as float64 arrays; anything else as returned."""
    if isinstance(value, tuple) and len(value) == 3:
        value = value[:2]
    return as_arrays(value)


def _diagnose_stats(case, wrong, outputs):
    if "m" in wrong:
        return ("m is wrong: after each block m must be the max of every column seen so far, "
                "m_new = np.maximum(m, m_j), then m = m_new.")
    return ("m is right but l is not: l must stay relative to the current m. When m rises to "
            "m_new, multiply the old l by exp(m - m_new) (it is <= 1) before adding the block's "
            "l_j * exp(m_j - m_new).")


# ----------------------------------------------------------------------------------------
# 03: the tiled forward, in both loop orders
# ----------------------------------------------------------------------------------------

H_KV = ("Algorithm 1: for the pair (i, j), S_ij = scale * Q_i K_j^T; the tile's own m_ij = "
        "rowmax(S_ij), P_ij = exp(S_ij - m_ij), l_ij = rowsum(P_ij); m_new = max(m_i, m_ij), "
        "l_new = exp(m_i - m_new) l_i + exp(m_ij - m_new) l_ij; O_i = (l_i exp(m_i - m_new) O_i "
        "+ exp(m_ij - m_new) P_ij V_j) / l_new, then write O_i, l_i = l_new, m_i = m_new back.")
H_Q = ("FlashAttention-2: for each K_j, V_j, S_ij = scale * Q_i K_j^T, m_new = max(m_i, "
       "rowmax(S_ij)), P_ij = exp(S_ij - m_new), alpha = exp(m_i - m_new); l_i = alpha l_i + "
       "rowsum(P_ij), O_i = alpha O_i + P_ij V_j, m_i = m_new. After the last tile: O_i / l_i "
       "and L_i = m_i + log(l_i), written once.")
H_ONE = ("One tile only, so this is plain attention: S = scale * Q K^T with scale = 1/sqrt(d), "
         "a softmax over each row of S, then O = P V. L_i is the natural-log logsumexp of row "
         "i of S.")
H_BIG_TILES = "Tiles larger than N: one tile, cut at N, holds every row and every key."
H_F32 = ("float32 inputs: the same loop; the check allows float32's rounding (compared in "
         "float64, whatever dtype you return).")

# (label, hint, (Nq, Nk, d), (Br, Bc), kind, dtype); hint None: the loop order's own
FORWARD_STEP_SPECS = [
    ("one tile, Nq=Nk=8, d=4", H_ONE, (8, 8, 4), (8, 8), "normal", F64),
    ("several tiles, Nq=Nk=32, Br=Bc=8", None, (32, 32, 8), (8, 8), "normal", F64),
    ("edge tiles, Nq=37, Nk=53, Br=16, Bc=8", H_EDGE, (37, 53, 8), (16, 8), "normal", F64),
    ("N=1, Br=Bc=4", H_N1, (1, 1, 3), (4, 4), "normal", F64),
    ("Nq=10 < Nk=45, Br=4, Bc=16", H_NQNK, (10, 45, 8), (4, 16), "normal", F64),
    ("Nq=45 > Nk=10, Br=16, Bc=4", H_NQNK, (45, 10, 8), (16, 4), "normal", F64),
    ("tiles larger than N: Br=Bc=64, Nq=Nk=10", H_BIG_TILES, (10, 10, 4), (64, 64), "normal", F64),
    ("logits in the hundreds", H_WIDE, (24, 40, 8), (8, 8), "wide", F64),
    ("edge tiles, float32", H_F32, (37, 53, 8), (16, 8), "normal", F32),
]


def _forward_cases(order_hint):
    def cases():
        out = []
        for seed, (label, hint, shape, (Br, Bc), kind, dtype) in enumerate(FORWARD_STEP_SPECS):
            (Q, K, V), (q, k, v) = _inputs(shape, kind, dtype, seed)
            (O, L), naive, streamed, rounding = _memo(("step forward", label), _forward_refs,
                                                      Q, K, V, q, k, v, False, None)
            out.append(case(label, hint or order_hint, (q, k, v, Br, Bc), ("O", "L"), (O, L),
                            naive=naive, variants=(streamed,) if streamed else (),
                            rounding=rounding, inputs=("Q", "K", "V"), block_q=Br,
                            floor_scale=F32_FLOOR if dtype == F32 else 1.0))
        return out
    return cases


def _forward_hint(symbol):
    def hint(fn, args):
        text = stepper_hint(fn, tuple(args) + (False, None))
        return text and text.replace("compare_trace(flash_forward,", f"compare_trace({symbol},")
    return hint


# ----------------------------------------------------------------------------------------
# 04: the gradients without tiles, and the tiled backward
# ----------------------------------------------------------------------------------------

H_GRADS = ("Recompute the forward (S = scale * Q K^T, P = its row softmax, O = P V), then dV = "
           "P^T dO, dP = dO V^T, D_i = rowsum(dO_i * O_i), dS = P * (dP - D) (D broadcast "
           "along each row), dQ = scale * dS K, dK = scale * dS^T Q.")
H_SHAPES = ("Nq != Nk: dQ has Q's shape (Nq, d), dK and dV have K's (Nk, d). dK = scale * "
            "dS^T Q and dV = P^T dO need the transposes.")
H_SCALE = ("scale is an argument: S = scale * Q K^T, and the same factor comes back in dQ = "
           "scale * dS K and dK = scale * dS^T Q (dV has none).")
H_LOOP = ("D_i = rowsum(dO_i * O_i) for every row, before the loop. For each pair (i, j): "
          "S_ij = scale * Q_i K_j^T, P_ij = exp(S_ij - L_i); dV_j += P_ij^T dO_i; dP_ij = dO_i "
          "V_j^T; dS_ij = P_ij * (dP_ij - D_i); dQ_i += scale * dS_ij K_j; dK_j += scale * "
          "dS_ij^T Q_i.")

GRAD_STEP_SPECS = [  # (label, hint, (Nq, Nk, d), scale, dtype)
    ("Nq=Nk=6, d=4, scale=1/sqrt(d)", H_GRADS, (6, 6, 4), None, F64),
    ("Nq=9 < Nk=14, d=5", H_SHAPES, (9, 14, 5), None, F64),
    ("Nq=14 > Nk=9, d=3", H_SHAPES, (14, 9, 3), None, F64),
    ("explicit scale=0.3", H_SCALE, (11, 11, 8), 0.3, F64),
    ("N=1", "One query and one key: P = 1, so dV = dO and dQ = dK = 0.", (1, 1, 4), None, F64),
    ("float32, Nq=20, Nk=30, scale=2.0", H_SCALE, (20, 30, 8), 2.0, F32),
]


def _grads_cases():
    out = []
    for seed, (label, hint, shape, scale, dtype) in enumerate(GRAD_STEP_SPECS, start=40):
        (Q, K, V), (q, k, v) = _inputs(shape, "normal", dtype, seed)
        s = 1 / math.sqrt(shape[2]) if scale is None else scale

        def compute(Q=Q, K=K, V=V, q=q, k=k, v=v, s=s, seed=seed, shape=shape, dtype=dtype):
            dO = _normal(seed + 1000, shape[0], shape[2])
            do = dO.astype(dtype)
            o, l = reference.naive_attention(q, k, v, scale=s)
            naive = _backward_in_dtype(q, k, v, o, do, l, False, s)
            other = _backward_in_dtype(q, k, v, o, do, l, False, s, delta="P dP")
            expected = reference.naive_attention_backward(Q, K, V, do.astype(F64), scale=s)
            return (do,), expected, naive, other

        (do,), expected, naive, other = _memo(("step grads", label), compute)
        out.append(case(label, hint, (q, k, v, do.copy(), s), ("dQ", "dK", "dV"), expected,
                        naive=naive, variants=(other,), inputs=("Q", "K", "V", "dO"),
                        floor_scale=F32_FLOOR if dtype == F32 else 1.0))
    return out


BACKWARD_STEP_SPECS = [spec for spec in FORWARD_STEP_SPECS if spec[5] == F64] + [
    ("edge tiles, float32", H_F32, (37, 53, 8), (16, 8), "normal", F32)]


def _backward_loop_cases():
    out = []
    for seed, (label, hint, shape, (Br, Bc), kind, dtype) in enumerate(BACKWARD_STEP_SPECS,
                                                                        start=60):
        (Q, K, V), (q, k, v) = _inputs(shape, kind, dtype, seed)

        def compute(Q=Q, K=K, V=V, q=q, k=k, v=v, seed=seed, dtype=dtype):
            O, L = reference.naive_attention(Q, K, V)
            dO = _normal(seed + 1000, *O.shape)
            o, l, do = (a.astype(dtype) for a in (O, L, dO))
            naive = _backward_in_dtype(q, k, v, o, do, l, False, None)
            other = _backward_in_dtype(q, k, v, o, do, l, False, None, delta="P dP")
            expected = reference.naive_attention_backward(Q, K, V, do.astype(F64))
            return (o, l, do), expected, naive, other

        given, expected, naive, other = _memo(("step backward", label), compute)
        o, l, do = (a.copy() for a in given)
        out.append(case(label, hint if hint not in (None, H_ONE) else H_LOOP,
                        (q, k, v, o, do, l, Br, Bc), ("dQ", "dK", "dV"), expected, naive=naive,
                        variants=(other,), inputs=("Q", "K", "V", "O", "dO", "L"),
                        floor_scale=F32_FLOOR if dtype == F32 else 1.0))
    return out


def _diagnose_grads(case, wrong, outputs):
    names = set(wrong)
    if "dV" in names:
        return "dV is wrong: dV = P^T dO, with P the row softmax of S = scale * Q K^T."
    if names == {"dQ", "dK"}:
        return ("dV is right (so P is), but dQ and dK are not: check dS = P * (dP - D) with "
                "dP = dO V^T and D_i = rowsum(dO_i * O_i) (one number per row, subtracted along "
                "that row), and the factor scale in both gradients.")
    if names == {"dQ"}:
        return "Only dQ is wrong: dQ = scale * dS K (the factor scale, and K itself, not K^T)."
    if names == {"dK"}:
        return "Only dK is wrong: dK = scale * dS^T Q (dS transposed, then times Q)."
    return None


def _diagnose_loop(case, wrong, outputs):
    base = _diagnose_backward(case, wrong, outputs)
    if set(wrong) == {"dQ", "dK", "dV"}:
        return ("dQ, dK and dV are all wrong, so P_ij is: rebuild it as exp(S_ij - L_i) with "
                "S_ij = scale * Q_i K_j^T (L_i already holds the row max and the log of the "
                "sum: no max, no division).")
    return base


STEPS = [
    function_step("step_safe_softmax", "my_safe_softmax", _safe_softmax_cases, adapt=untouched),
    function_step("step_online_stats", "online_stats", _online_stats_cases, adapt=_adapt_stats,
                  diagnose=_diagnose_stats),
    function_step("step_forward_kv_outer", "flash_forward_kv_outer", _forward_cases(H_KV),
                  diagnose=_diagnose_forward),
    function_step("step_forward_q_outer", "flash_forward_q_outer", _forward_cases(H_Q),
                  diagnose=_diagnose_forward),
    function_step("step_attention_grads", "attention_grads", _grads_cases,
                  diagnose=_diagnose_grads),
    function_step("step_backward_loop", "flash_backward_loop", _backward_loop_cases,
                  diagnose=_diagnose_loop),
]
# the stepper (flashedu.viz.compare_trace) shows where a forward first leaves the reference
STEPS[2].hint = _forward_hint("flash_forward_kv_outer")
STEPS[3].hint = _forward_hint("flash_forward_q_outer")
