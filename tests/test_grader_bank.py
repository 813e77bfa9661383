"""The kernel exercises' grader against a bank of kernels: wrong ones that must score 0 with a
message that names the mistake, and unusual correct ones that must pass, the compile gate
included.

Each kernel is the course's solution with a mistake or a variation written in as source (the
replacements below), loaded as a learner's cell would define it. The cases run in this process
on one fixed seed; a wrong kernel is judged up to its first failing case, as the check's message
reports only that one. The kernels that pass every case (the correct variants, and the wrong
ones only a GPU compiler refuses) go through the compile gate together: one process for the
Triton kernels, one for the numba ones.
"""

from __future__ import annotations

import pytest

from flashedu import runtime
from flashedu.checks import EXERCISES, engine, gate
from test_checks import load

TFWD, DKDV, DQ, NUMBA = ("triton_forward_kernel", "triton_backward_dkdv_kernel",
                         "triton_backward_dq_kernel", "numba_forward_kernel")
WHICH = {TFWD: "forward", DKDV: "dkdv", DQ: "dq", NUMBA: None}
SEED = 20250611

# ------------------------------------------------------------------------------------------
# Pieces of the solutions, replaced below
# ------------------------------------------------------------------------------------------

F_DEF = "@triton.jit\ndef flash_forward_kernel"
F_LOOP_HEAD = "    for start in range(0, end, Bc):\n        cols = start + tl.arange(0, Bc)\n"
F_MASK = 'S_ij = tl.where(visible, S_ij, float("-inf"))'
F_STORE_O = "tl.store(O + rows[:, None] * stride_o + dims[None, :], O_i / l_i[:, None], mask=row_ok[:, None])"
F_STORE_L = "tl.store(L + rows, m_i + tl.log(l_i), mask=row_ok)"
F_SCORES = "S_ij = tl.dot(Q_i, tl.trans(K_j)) * scale"
F_BODY_START = "    row_ok = rows < Nq\n"
F_BODY_END = "    tl.store(L + rows, m_i + tl.log(l_i), mask=row_ok)\n"
DKDV_STORES = (
    "    tl.store(dK + cols[:, None] * stride_dk + dims[None, :], dK_j * scale, mask=col_ok[:, None])\n"
    "    tl.store(dV + cols[:, None] * stride_dv + dims[None, :], dV_j, mask=col_ok[:, None])\n")
DQ_STORE = "tl.store(dQ + rows[:, None] * stride_dq + dims[None, :], dQ_i * scale, mask=row_ok[:, None])"
P_LINE = 'P_ij = tl.exp(tl.where(visible, S_ij - L_i[:, None], float("-inf")))'
N_STORE = "            O[i, c] = o[c] / l_i"
N_DEF = "@cuda.jit\ndef flash_forward_kernel"

# One tile of 256 keys in place of the loop over K/V tiles: right while Nk <= 256.
ONE_TILE_FORWARD = '''    row_ok = rows < Nq
    Q_i = tl.load(Q + rows[:, None] * stride_q + dims[None, :], mask=row_ok[:, None], other=0.0)
    cols = tl.arange(0, 256)
    col_ok = cols < Nk
    K_all = tl.load(K + cols[:, None] * stride_k + dims[None, :], mask=col_ok[:, None], other=0.0)
    V_all = tl.load(V + cols[:, None] * stride_v + dims[None, :], mask=col_ok[:, None], other=0.0)
    S = tl.dot(Q_i, tl.trans(K_all)) * scale
    visible = col_ok[None, :]
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None])
    S = tl.where(visible, S, float("-inf"))
    m_i = tl.max(S, 1)
    P = tl.exp(S - m_i[:, None])
    l_i = tl.sum(P, 1)
    tl.store(O + rows[:, None] * stride_o + dims[None, :], tl.dot(P, V_all) / l_i[:, None], mask=row_ok[:, None])
    tl.store(L + rows, m_i + tl.log(l_i), mask=row_ok)
'''

ONE_TILE_DQ = '''    row_ok = rows < Nq
    Q_i = tl.load(Q + rows[:, None] * stride_q + dims[None, :], mask=row_ok[:, None], other=0.0)
    dO_i = tl.load(dO + rows[:, None] * stride_do + dims[None, :], mask=row_ok[:, None], other=0.0)
    L_i = tl.load(L + rows, mask=row_ok, other=0.0)
    Delta_i = tl.load(Delta + rows, mask=row_ok, other=0.0)
    cols = tl.arange(0, 256)
    col_ok = cols < Nk
    K_all = tl.load(K + cols[:, None] * stride_k + dims[None, :], mask=col_ok[:, None], other=0.0)
    V_all = tl.load(V + cols[:, None] * stride_v + dims[None, :], mask=col_ok[:, None], other=0.0)
    S = tl.dot(Q_i, tl.trans(K_all)) * scale
    visible = row_ok[:, None] & col_ok[None, :]
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None])
    P = tl.exp(tl.where(visible, S - L_i[:, None], float("-inf")))
    dS = P * (tl.dot(dO_i, tl.trans(V_all)) - Delta_i[:, None])
    tl.store(dQ + rows[:, None] * stride_dq + dims[None, :], tl.dot(dS, K_all) * scale, mask=row_ok[:, None])
'''


def _body(name):
    """The solution's code between its markers, for a replacement of all of it."""
    from test_checks import solution_source

    return solution_source(name).split("### BEGIN SOLUTION\n")[1].split("    ### END SOLUTION")[0]


# ------------------------------------------------------------------------------------------
# Wrong kernels: (exercise, the mistake, replacements, words the message must contain)
# ------------------------------------------------------------------------------------------

WRONG = [
    # outputs that start as NaN, as torch.empty may leave them
    (TFWD, "L added to what L held (no initial value)",
     [(F_STORE_L, "tl.store(L + rows, tl.load(L + rows, mask=row_ok, other=0.0) + m_i + tl.log(l_i), mask=row_ok)")],
     ["L is wrong", "NaN in", "added to what O held"]),
    (TFWD, "O_i started from what O held instead of zeros",
     [("O_i = tl.zeros((Br, D), tl.float32)",
       "O_i = tl.load(O + rows[:, None] * stride_o + dims[None, :], mask=row_ok[:, None], other=0.0)")],
     ["O is wrong", "NaN in", "accumulator"]),
    (TFWD, "O added to what O held, NaN read as zero (accumulates across calls)",
     [(F_STORE_O, "prev = tl.load(O + rows[:, None] * stride_o + dims[None, :], mask=row_ok[:, None], other=0.0)\n"
                  "    prev = tl.where(prev == prev, prev, 0.0)\n"
                  "    tl.store(O + rows[:, None] * stride_o + dims[None, :], prev + O_i / l_i[:, None], mask=row_ok[:, None])")],
     ["called twice", "second call", "O wrong in"]),
    (DKDV, "dV_j started from what dV held instead of zeros",
     [("dV_j = tl.zeros((Bc, D), tl.float32)",
       "dV_j = tl.load(dV + cols[:, None] * stride_dv + dims[None, :], mask=col_ok[:, None], other=0.0)")],
     ["dV is wrong", "NaN in", "accumulator added"]),
    (DKDV, "K/V tiles that no query sees (causal, Nk > Nq) never stored",
     [(DKDV_STORES, "    if lo < Nq:\n" + DKDV_STORES.replace("    tl.store", "        tl.store"))],
     ["causal, Nq=20 < Nk=53", "NaN in", "never stored"]),
    (DQ, "dQ added to what dQ held, NaN read as zero (accumulates across calls)",
     [(DQ_STORE, "prev = tl.load(dQ + rows[:, None] * stride_dq + dims[None, :], mask=row_ok[:, None], other=0.0)\n"
                 "    prev = tl.where(prev == prev, prev, 0.0)\n"
                 "    tl.store(dQ + rows[:, None] * stride_dq + dims[None, :], prev + dQ_i * scale, mask=row_ok[:, None])")],
     ["called twice into the same dQ", "second call"]),
    (NUMBA, "O added to, never set",
     [(N_STORE, "            O[i, c] += o[c] / l_i")], ["O is wrong", "NaN in"]),
    (NUMBA, "O added to what O held, NaN read as zero (accumulates across calls)",
     [(N_STORE, "            O[i, c] = (O[i, c] if O[i, c] == O[i, c] else 0.0) + o[c] / l_i")],
     ["called twice", "second call", "O wrong in"]),
    # one tile where there must be a loop: right until Nq or Nk passes 256
    (TFWD, "all of K and V as one tile of 256 keys",
     [(None, ONE_TILE_FORWARD)], ["Nq=Nk=300", "O is wrong"]),
    (DQ, "all of K and V as one tile of 256 keys",
     [(None, ONE_TILE_DQ)], ["Nq=Nk=300", "dQ is wrong"]),
    (DKDV, "Q tiles only up to row 256",
     [("for start in range(lo, Nq, Br):", "for start in range(lo, tl.minimum(Nq, 256), Br):")],
     ["Nq=Nk=300", "both wrong"]),
    (NUMBA, "rows from 256 on never computed",
     [("    valid = i < Nq\n", "    valid = i < min(Nq, 256)\n")], ["Nq=Nk=300", "NaN in"]),
    (NUMBA, "keys from 256 on never seen",
     [("for start in range(0, end, BC):", "for start in range(0, min(end, 256), BC):")],
     ["Nq=Nk=300", "O is wrong"]),
    # the classics
    (TFWD, "K and V loaded without a mask at the edge tiles",
     [("K_j = tl.load(K + cols[:, None] * stride_k + dims[None, :], mask=col_ok[:, None], other=0.0)",
       "K_j = tl.load(K + cols[:, None] * stride_k + dims[None, :])"),
      ("V_j = tl.load(V + cols[:, None] * stride_v + dims[None, :], mask=col_ok[:, None], other=0.0)",
       "V_j = tl.load(V + cols[:, None] * stride_v + dims[None, :])")],
     ["edge tiles", "NaN"]),
    (TFWD, "scale left out of the scores", [(F_SCORES, "S_ij = tl.dot(Q_i, tl.trans(K_j))")],
     ["one tile", "is wrong"]),
    (TFWD, "causal mask one key short (j < i)",
     [("cols[None, :] <= rows[:, None]", "cols[None, :] < rows[:, None]")], ["causal", "is wrong"]),
    (DKDV, "dK and dV swapped",
     [(DKDV_STORES, DKDV_STORES.replace("dK_j * scale, mask", "@@").replace("dV_j, mask", "dK_j * scale, mask")
       .replace("@@", "dV_j, mask"))],
     ["one tile", "dK and dV are both wrong"]),
    (DQ, "scale left out of dQ", [(DQ_STORE, DQ_STORE.replace("dQ_i * scale", "dQ_i"))],
     ["one tile", "without the factor scale"]),
    (DKDV, "causal mask one key short (j < i)",
     [("cols[None, :] <= rows[:, None]", "cols[None, :] < rows[:, None]")],
     ["causal", "j < i instead of j <= i"]),
    (NUMBA, "no guard on the key tile's last, partial rows",
     [("            if start + r < Nk:\n", "            if True:\n")], ["IndexError"]),
    # only a GPU compiler refuses these: the cases pass in the interpreter / simulator
    (TFWD, "Python (break) in a branch only Br = 64 compiles",
     [(F_LOOP_HEAD, "    for start in range(0, end, Bc):\n        if Br == 64:\n            if start >= Nk:\n"
                    "                break\n        cols = start + tl.arange(0, Bc)\n")],
     ["does not compile for a GPU", "Nq=Nk=300", "Br=64", "break"]),
    (TFWD, "Python (break) in a branch only CAUSAL = False compiles",
     [(F_LOOP_HEAD, "    for start in range(0, end, Bc):\n        if not CAUSAL:\n            if start >= Nk:\n"
                    "                break\n        cols = start + tl.arange(0, Bc)\n")],
     ["does not compile for a GPU", "CAUSAL=False", "break"]),
    (DQ, "Python (break) in a branch only Bc = 32 compiles",
     [("        cols = start + tl.arange(0, Bc)\n",
       "        if Bc == 32:\n            if start >= Nk:\n                break\n        cols = start + tl.arange(0, Bc)\n")],
     ["does not compile for a GPU", "Bc=32"]),
    (NUMBA, "a Python list in a device function",
     [(N_DEF, "@cuda.jit(device=True)\ndef rescaled(x, a):\n    t = [x, a]\n    return t[0] * t[1]\n\n\n" + N_DEF),
      ("                    o[c] *= alpha\n", "                    o[c] = rescaled(o[c], alpha)\n")],
     ["does not compile for a GPU", "sm_90"]),
    (NUMBA, "an array method (max) in the kernel",
     [("    valid = i < Nq\n", "    valid = i < Nq\n    top = K[0].max()\n")],
     ["does not compile for a GPU", "npy_max"]),
    # module-level constants Triton refuses on a GPU (it reads only tl.constexpr globals)
    (TFWD, "a module-level float that is not a tl.constexpr",
     [(F_DEF, 'NEG_INF = float("-inf")\n\n\n' + F_DEF), (F_MASK, "S_ij = tl.where(visible, S_ij, NEG_INF)")],
     ["does not compile for a GPU", "Cannot access global variable NEG_INF", "tl.constexpr(value)"]),
    (TFWD, "a module-level constant annotated tl.constexpr (an annotation makes none)",
     [(F_DEF, "LOG2E: tl.constexpr = 1.4426950408889634\n\n\n" + F_DEF),
      (F_SCORES, "S_ij = tl.dot(Q_i, tl.trans(K_j)) * (scale * LOG2E)"),
      ("P_ij = tl.exp(S_ij - m_new[:, None])", "P_ij = tl.exp2(S_ij - m_new[:, None])"),
      ("alpha = tl.exp(m_i - m_new)", "alpha = tl.exp2(m_i - m_new)"),
      ("m_i + tl.log(l_i)", "(m_i + tl.log2(l_i)) / LOG2E")],
     ["does not compile for a GPU", "LOG2E", "annotation"]),
]

# ------------------------------------------------------------------------------------------
# Correct, if unusual: (exercise, the variation, replacements)
# ------------------------------------------------------------------------------------------

HELPER = '''@triton.jit
def online_update(m_i, l_i, O_i, S_ij, V_j):
    m_new = tl.maximum(m_i, tl.max(S_ij, 1))
    P_ij = tl.exp(S_ij - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return m_new, alpha * l_i + tl.sum(P_ij, 1), alpha[:, None] * O_i + tl.dot(P_ij, V_j)


'''

CORRECT = [
    (TFWD, "module-level tl.constexpr constants (NEG_INF, LOG2E, LN2) and exp2",
     [(F_DEF, 'NEG_INF = tl.constexpr(float("-inf"))\nLOG2E = tl.constexpr(1.4426950408889634)\n'
              "LN2: tl.constexpr = tl.constexpr(0.6931471805599453)\n\n\n" + F_DEF),
      (F_MASK, "S_ij = tl.where(visible, S_ij, NEG_INF)"),
      (F_SCORES, "S_ij = tl.dot(Q_i, tl.trans(K_j)) * (scale * LOG2E)"),
      ("P_ij = tl.exp(S_ij - m_new[:, None])", "P_ij = tl.math.exp2(S_ij - m_new[:, None])"),
      ("alpha = tl.exp(m_i - m_new)", "alpha = tl.math.exp2(m_i - m_new)"),
      ("m_i + tl.log(l_i)", "(m_i + tl.log2(l_i)) * LN2")]),
    (TFWD, "a module-level tile size BQ = tl.constexpr(16) for a static loop",
     [(F_DEF, "BQ = tl.constexpr(16)\n\n\n" + F_DEF),
      ('m_i = tl.full((Br,), float("-inf"), tl.float32)',
       'm_i = tl.full((Br,), float("-inf"), tl.float32)\n    for _ in tl.static_range(BQ // 16):\n        m_i = m_i + 0.0')]),
    (TFWD, "the online update in a @triton.jit helper",
     [(F_DEF, HELPER + F_DEF),
      ("        m_new = tl.maximum(m_i, tl.max(S_ij, 1))  # finite: key 0 lies in the first tile\n"
       "        P_ij = tl.exp(S_ij - m_new[:, None])\n"
       "        alpha = tl.exp(m_i - m_new)\n"
       "        l_i = alpha * l_i + tl.sum(P_ij, 1)\n"
       "        O_i = alpha[:, None] * O_i + tl.dot(P_ij, V_j)\n"
       "        m_i = m_new\n",
       "        m_i, l_i, O_i = online_update(m_i, l_i, O_i, S_ij, V_j)\n")]),
    (TFWD, "a while loop over the K/V tiles",
     [(F_LOOP_HEAD, "    start = 0\n    while start < end:\n        cols = start + tl.arange(0, Bc)\n"),
      ("        m_i = m_new\n", "        m_i = m_new\n        start += Bc\n")]),
    (TFWD, "masked probabilities zeroed with tl.where after the exp",
     [(F_MASK, 'S_m = tl.where(visible, S_ij, float("-inf"))'),
      ("m_new = tl.maximum(m_i, tl.max(S_ij, 1))", "m_new = tl.maximum(m_i, tl.max(S_m, 1))"),
      ("P_ij = tl.exp(S_ij - m_new[:, None])",
       "P_ij = tl.where(visible, tl.exp(tl.where(visible, S_ij, 0.0) - m_new[:, None]), 0.0)")]),
    (DKDV, "tl.range over the Q tiles, dS_ij in a helper",
     [("@triton.jit\ndef dkdv_kernel",
       "@triton.jit\ndef scores_grad(P_ij, dP_ij, Delta_i):\n    return P_ij * (dP_ij - Delta_i[:, None])\n\n\n"
       "@triton.jit\ndef dkdv_kernel"),
      ("for start in range(lo, Nq, Br):", "for start in tl.range(lo, Nq, Br):"),
      ("dS_ij = P_ij * (dP_ij - Delta_i[:, None])", "dS_ij = scores_grad(P_ij, dP_ij, Delta_i)")]),
    (DQ, "exp2 with log2(e) folded, a module-level tl.constexpr",
     [("@triton.jit\ndef dq_kernel", "LOG2E = tl.constexpr(1.4426950408889634)\n\n\n@triton.jit\ndef dq_kernel"),
      (P_LINE, 'P_ij = tl.math.exp2(tl.where(visible, (S_ij - L_i[:, None]) * LOG2E, float("-inf")))')]),
    (NUMBA, "cuda.grid(1), a module-level constant and a device function",
     [(N_DEF, "NEG_INF = -math.inf\n\n\n@cuda.jit(device=True)\ndef rescaled(x, a):\n    return x * a\n\n\n" + N_DEF),
      ("    i = cuda.blockIdx.x * Br + tx  # this thread's query row", "    i = cuda.grid(1)"),
      ("    m_i = -math.inf\n", "    m_i = NEG_INF\n"),
      ("                    o[c] *= alpha\n", "                    o[c] = rescaled(o[c], alpha)\n")]),
]


def _apply(name, replace):
    """``replace`` with (None, body) standing for the whole of the solution's body."""
    return [(_body(name), new) if old is None else (old, new) for old, new in replace]


def _first_failure(ex, fn):
    """The first failing case's message, judged as the check judges it (None: all passed)."""
    for case in ex.cases():
        if case.needs_pass:
            continue
        row, message, _ = engine.judge_case(ex, case, engine.execute_case(ex, fn, case))
        if row.status != "passed":
            return message
    return None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{(exercise, label): (first failure or None, gate verdict or None)} for the correct
    variants and the wrong kernels that pass every case; the gate of all of them in one
    process of each kind."""
    engine.set_seed(SEED)
    tmp = tmp_path_factory.mktemp("bank")
    todo = [(n, label, r) for n, label, r in CORRECT] + \
        [(n, label, r) for n, label, r, words in WRONG if "does not compile for a GPU" in words]
    out, specs, keys = {}, [], []
    for name, label, replace in todo:
        ex = EXERCISES[name]
        fn = load(name, _apply(name, replace), tmp)
        out[(name, label)] = [_all_cases(ex, fn), None]
        specs.append(ex.gate.source(fn))
        keys.append((name, label))
    for key, verdict in zip(keys, gate.compile_specs(specs)):
        out[key][1] = verdict
    return out


def _all_cases(ex, fn):
    failure = _first_failure(ex, fn)
    if failure is None:  # the costly probes too (shared memory for numba)
        for case in ex.cases():
            if case.needs_pass:
                row, message, _ = engine.judge_case(ex, case, engine.execute_case(ex, fn, case))
                if row.status != "passed":
                    return message
    return failure


def test_the_bank_is_large_enough():
    assert len(WRONG) >= 20 and len(CORRECT) >= 8
    assert {w[0] for w in WRONG} == {c[0] for c in CORRECT} == set(WHICH)


@pytest.mark.parametrize("name, mistake, replace, words", WRONG, ids=[f"{w[0]}: {w[1]}" for w in WRONG])
def test_wrong_kernel_is_rejected(name, mistake, replace, words, compiled, tmp_path):
    ex = EXERCISES[name]
    if "IndexError" in words and not runtime.numba_simulated():
        pytest.skip("only numba's simulator checks indices; on a GPU the rows read past the "
                    "array's end go undetected (this kernel never uses their values)")
    if "does not compile for a GPU" in words:
        failure, verdict = compiled[(name, mistake)]
        if engine.compiled_here(name):  # on a GPU the cases compile it: they reject it
            assert failure is not None and "raised an error" in failure, failure
            return
        assert failure is None, f"the cases should pass in the interpreter:\n{failure}"
        assert not isinstance(verdict, engine.Remark), verdict
        message = verdict
    else:
        engine.set_seed(SEED)
        message = _first_failure(ex, load(name, _apply(name, replace), tmp_path))
        assert message is not None, "a wrong kernel passed every case"
    missing = [w for w in words if w.lower() not in message.lower()]
    assert not missing, f"message lacks {missing}:\n{message}"


@pytest.mark.parametrize("name, variant, replace", CORRECT, ids=[f"{c[0]}: {c[1]}" for c in CORRECT])
def test_correct_variant_passes(name, variant, replace, compiled):
    failure, verdict = compiled[(name, variant)]
    assert failure is None, failure
    # numba on a GPU: the cases compiled the kernel for it, and the gate says so
    said = ("numba compiled your kernel for this GPU" if name.startswith("numba_")
            and engine.compiled_here(name) else "Compiled for a GPU")
    assert isinstance(verdict, engine.Remark) and verdict.startswith(said), verdict
