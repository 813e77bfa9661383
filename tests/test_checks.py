"""The autograder against a bank of wrong implementations, and the right ones.

Every wrong implementation is the course's own solution (from solutions/*.ipynb) with one
mistake that learners make, so the bank stays in step with the solutions. Each must be rejected,
with a message that points at the mistake; the solutions, the package's functions and other
correct variants (the other loop order, exp2, float64 accumulation) must pass.
"""

from __future__ import annotations

import importlib.util
import itertools
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest

from flashedu import reference, tiled
from flashedu.checks import EXERCISES, check
from flashedu.checks.result import NOT_IMPLEMENTED

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = {
    "safe_softmax": "01_softmax", "online_softmax": "01_softmax",
    "flash_forward": "02_flash_forward", "flash_backward": "03_flash_backward",
    "block_sparse_forward": "04_block_sparse", "numba_forward_kernel": "05_numba_kernel",
    "triton_forward_kernel": "06_triton_kernel",
    "triton_backward_dkdv_kernel": "07_triton_backward", "triton_backward_dq_kernel": "07_triton_backward",
}
_counter = itertools.count()


def solution_source(name: str) -> str:
    """The setup cell and the solution cell of exercise ``name``, as one module's source."""
    nb = nbformat.read(ROOT / "solutions" / f"{NOTEBOOKS[name]}.ipynb", as_version=4)
    cells = {c.metadata.get("nbgrader", {}).get("grade_id"): c.source for c in nb.cells}
    return cells["setup"] + "\n\n" + cells[name] + "\n"


def load(name: str, replace=(), tmp_path=None):
    """The learner's object for ``name``: the solution with each (old, new) replacement made.

    Written to a file and imported, because @triton.jit reads its function's source."""
    source = solution_source(name)
    for old, new in replace:
        assert old in source, f"the mutation no longer applies to the solution: {old!r}"
        source = source.replace(old, new)
    path = Path(tmp_path) / f"learner_{next(_counter)}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, EXERCISES[name].symbol)


def assert_rejected(result, *fragments):
    assert not result.passed and result.points == 0, str(result)
    text = result.message.lower()
    missing = [f for f in fragments if f.lower() not in text]
    assert not missing, f"message lacks {missing}:\n{result.message}"


# ------------------------------------------------------------------------------------------
# The bank: (exercise, the mistake, replacements, words the message must contain)
# ------------------------------------------------------------------------------------------

FWD_LOOP = "for j in range(math.ceil(Nk / Bc)):"
BANK = [
    # safe softmax
    ("safe_softmax", "no max subtraction (overflow)",
     [("e = np.exp(x - m)", "e = np.exp(x)")], ["hundreds", "NaN"]),
    ("safe_softmax", "softmax over the first axis",
     [("m = x.max(axis=-1, keepdims=True)", "m = x.max(axis=0, keepdims=True)"),
      ("l = e.sum(axis=-1, keepdims=True)", "l = e.sum(axis=0, keepdims=True)")],
     ["random, 5 x 7", "is wrong"]),
    ("safe_softmax", "axis=1 only works in 2-D",
     [("axis=-1", "axis=1")], ["1-D input", "raised", "last axis"]),
    ("safe_softmax", "a row of all -inf gives NaN",
     [("m = np.where(np.isneginf(m), 0, m)", "pass"),
      ("e / np.where(l == 0, 1, l)", "e / l")], ["all -inf", "NaN", "zeros"]),
    ("safe_softmax", "subtracts the max in place",
     [("e = np.exp(x - m)", "x -= m\n    e = np.exp(x)")], ["changed its input x"]),
    ("safe_softmax", "returns float64 for float32",
     [("return e / np.where(l == 0, 1, l)", "return (e / np.where(l == 0, 1, l)).astype(np.float64)")],
     ["float32", "dtype"]),
    # online softmax
    ("online_softmax", "forgot to rescale l",
     [("l = l * np.exp(m - m_safe) +", "l = l +")], ["block_size", "rescale"]),
    ("online_softmax", "max over the whole row at once",
     [("m_new = np.maximum(m, x_j.max(axis=-1, keepdims=True))",
       "m_new = np.maximum(m, x.max(axis=-1, keepdims=True))")], ["at once", "block by block"]),
    ("online_softmax", "drops the last, partial block",
     [("range(0, n, block_size)", "range(0, n - n % block_size, block_size)")], ["is wrong"]),
    # tiled forward
    ("flash_forward", "forgot to rescale O_i",
     [("O_i = alpha[:, None] * O_i +", "O_i = O_i +")], ["several tiles", "L is right", "rescale"]),
    ("flash_forward", "forgot to rescale l_i",
     [("l_i = alpha * l_i +", "l_i = l_i +")], ["several tiles", "rescale"]),
    ("flash_forward", "causal mask with < instead of <=",
     [("np.arange(c0, c1)[None, :] <= rows[:, None]", "np.arange(c0, c1)[None, :] < rows[:, None]")],
     ["causal", "<="]),
    ("flash_forward", "causal tiles skipped one too early",
     [("if causal and c0 > r1 - 1:", "if causal and c0 >= r1 - 1:")], ["causal"]),
    ("flash_forward", "causal mask aligned bottom-right",
     [("np.arange(c0, c1)[None, :] <= rows[:, None]",
       "np.arange(c0, c1)[None, :] <= rows[:, None] + (Nk - Nq)"),
      ("if causal and c0 > r1 - 1:", "if causal and c0 > r1 - 1 + max(Nk - Nq, 0):")],
     ["causal, Nq=20 < Nk=33", "top-left"]),
    ("flash_forward", "drops the edge tiles (N // B)",
     [("range(math.ceil(Nq / Br))", "range(Nq // Br)"), (FWD_LOOP, "for j in range(Nk // Bc):")],
     ["edge tiles", "ceil"]),
    ("flash_forward", "does not divide by l_i at the end",
     [("O[r0:r1] = O_i / l_i[:, None]", "O[r0:r1] = O_i")], ["one tile", "L is right"]),
    ("flash_forward", "L in log base 2",
     [("L[r0:r1] = m_i + np.log(l_i)", "L[r0:r1] = (m_i + np.log(l_i)) / math.log(2)")],
     ["base-2", "O is right"]),
    ("flash_forward", "L without m",
     [("L[r0:r1] = m_i + np.log(l_i)", "L[r0:r1] = np.log(l_i)")], ["O is right", "m_i + log(l_i)"]),
    ("flash_forward", "scale applied twice",
     [("S_ij = scale * (Q_i @ K[c0:c1].T)", "S_ij = scale * scale * (Q_i @ K[c0:c1].T)")],
     ["one tile", "scale"]),
    ("flash_forward", "scale not applied",
     [("S_ij = scale * (Q_i @ K[c0:c1].T)", "S_ij = Q_i @ K[c0:c1].T")], ["one tile", "scale"]),
    ("flash_forward", "explicit scale ignored",
     [("scale = 1 / math.sqrt(d) if scale is None else scale", "scale = 1 / math.sqrt(d)")],
     ["explicit scale"]),
    ("flash_forward", "no running max (exp(S) overflows)",
     [("P_ij = np.exp(S_ij - m_new[:, None])", "P_ij = np.exp(S_ij)"),
      ("alpha = np.exp(m_i - m_new)", "alpha = np.ones_like(m_i)"), ("L[r0:r1] = m_i + np.log(l_i)", "L[r0:r1] = np.log(l_i)")],
     ["hundreds", "subtract the running max"]),
    ("flash_forward", "scores in float16",
     [("S_ij = scale * (Q_i @ K[c0:c1].T)", "S_ij = (scale * (Q_i @ K[c0:c1].T)).astype(np.float16).astype(Q.dtype)")],
     ["is wrong"]),
    ("flash_forward", "builds the Nq x Nk score matrix",
     [("for i in range(math.ceil(Nq / Br)):", "S_full = scale * (Q @ K.T)\n    for i in range(math.ceil(Nq / Br)):"),
      ("S_ij = scale * (Q_i @ K[c0:c1].T)", "S_ij = S_full[r0:r1, c0:c1]")],
     ["memory", "allocated", "Nq x Nk"]),
    ("flash_forward", "builds an Nq x Nk causal mask",
     [("S_ij = np.where(np.arange(c0, c1)[None, :] <= rows[:, None], S_ij, -np.inf)",
       "S_ij = np.where(np.tri(Nq, Nk, dtype=bool)[r0:r1, c0:c1], S_ij, -np.inf)")],
     ["memory", "causal", "allocated"]),
    ("flash_forward", "scales Q in place",
     [("Q_i = Q[r0:r1]", "Q_i = Q[r0:r1]\n        Q_i *= scale  # a view: this writes into Q"),
      ("S_ij = scale * (Q_i @ K[c0:c1].T)", "S_ij = Q_i @ K[c0:c1].T")], ["changed its input Q"]),
    ("flash_forward", "O in float64 whatever the inputs",
     [("O = np.zeros_like(Q)", "O = np.zeros(Q.shape)")], ["float32", "dtype"]),
    ("flash_forward", "L of shape (Nq, 1)",
     [("L = np.zeros(Nq, dtype=Q.dtype)", "L = np.zeros((Nq, 1), dtype=Q.dtype)"),
      ("L[r0:r1] = m_i + np.log(l_i)", "L[r0:r1, 0] = m_i + np.log(l_i)")], ["shape", "(8,)"]),
    ("flash_forward", "returns O only",
     [("    return O, L", "    return O")], ["expected a tuple (O, L)"]),
    ("flash_forward", "returns (O, L, m)",
     [("    return O, L", "    return O, L, L")], ["length 3"]),
    ("flash_forward", "raises (a typo)",
     [("P_ij = np.exp(S_ij - m_new[:, None])", "P_ij = np.exp(S_ij - m_nwe[:, None])")],
     ["raised", "NameError", "m_nwe"]),
    # tiled backward
    ("flash_backward", "missing D term",
     [("dS_ij = P_ij * (dP_ij - D[r0:r1, None])", "dS_ij = P_ij * dP_ij")], ["dV is right", "D_i"]),
    ("flash_backward", "wrong sign in dS",
     [("dS_ij = P_ij * (dP_ij - D[r0:r1, None])", "dS_ij = P_ij * (D[r0:r1, None] - dP_ij)")],
     ["dQ and dK"]),
    ("flash_backward", "forgot scale in dQ and dK",
     [("dQ[r0:r1] += scale * (dS_ij @ K_j)", "dQ[r0:r1] += dS_ij @ K_j"),
      ("dK_j += scale * (dS_ij.T @ Q_i)", "dK_j += dS_ij.T @ Q_i")], ["dQ and dK", "scale"]),
    ("flash_backward", "dQ overwritten, not accumulated",
     [("dQ[r0:r1] += scale * (dS_ij @ K_j)", "dQ[r0:r1] = scale * (dS_ij @ K_j)")], ["only dQ"]),
    ("flash_backward", "P_ij from exp(S) without L",
     [("P_ij = np.exp(S_ij - L[r0:r1, None])", "P_ij = np.exp(S_ij)")], ["dV is wrong", "L_i"]),
    ("flash_backward", "no causal mask",
     [("            if causal:\n                visible", "            if False:\n                visible")],
     ["causal"]),
    ("flash_backward", "drops the edge tiles",
     [("for j in range(math.ceil(Nk / Bc)):", "for j in range(Nk // Bc):"),
      ("for i in range(math.ceil(Nq / Br)):", "for i in range(Nq // Br):")], ["edge tiles"]),
    ("flash_backward", "builds the Nq x Nk matrix P",
     [("D = (dO * O).sum(axis=1)", "D = (dO * O).sum(axis=1)\n    P_full = np.exp(scale * (Q @ K.T) - L[:, None])"),
      ("P_ij = np.exp(S_ij - L[r0:r1, None])", "P_ij = np.where(np.isneginf(S_ij), 0, P_full[r0:r1, c0:c1])")],
     ["memory", "allocated"]),
    ("flash_backward", "modifies dO in place",
     [("D = (dO * O).sum(axis=1)", "dO *= 1.0\n    dO[0] += 0.5\n    D = (dO * O).sum(axis=1)")],
     ["changed its input dO"]),
    # block-sparse forward
    ("block_sparse_forward", "computes every tile and masks afterwards",
     [("for j in np.flatnonzero(block_mask[i]):", "for j in range(block_mask.shape[1]):"),
      ("S_ij = scale * (Q_i @ K[c0:c1].T)",
       "S_ij = np.where(block_mask[i, j], scale * (Q_i @ K[c0:c1].T), -np.inf)")],
     ["NaN", "skip"]),
    ("block_sparse_forward", "ignores the mask",
     [("for j in np.flatnonzero(block_mask[i]):", "for j in range(block_mask.shape[1]):")],
     ["skipped key tile"]),
    ("block_sparse_forward", "0/0 for a query tile with no kept tile",
     [("O[r0:r1] = O_i / l_safe[:, None]", "O[r0:r1] = O_i / l_i[:, None]"),
      ("L[r0:r1] = np.where(seen, m_i + np.log(l_safe), -np.inf)", "L[r0:r1] = m_i + np.log(l_i)")],
     ["no kept tile", "NaN"]),
    ("block_sparse_forward", "mask read transposed",
     [("np.flatnonzero(block_mask[i])", "np.flatnonzero(block_mask[:, i])")], ["skipped key tile"]),
    ("block_sparse_forward", "expands the mask to Nq x Nk",
     [("for i in range(math.ceil(Nq / Br)):",
       "dense = np.repeat(np.repeat(block_mask, Br, 0), Bc, 1)[:Nq, :Nk]\n    for i in range(math.ceil(Nq / Br)):")],
     ["memory", "allocated"]),
]


@pytest.mark.parametrize("name, mistake, replace, words", BANK, ids=[f"{b[0]}: {b[1]}" for b in BANK])
def test_wrong_implementation_is_rejected(name, mistake, replace, words, tmp_path):
    assert_rejected(check(name, load(name, replace, tmp_path)), *words)


def _rows_only_forward(Q, K, V, block_q, block_k, causal=False, scale=None):
    """Tiles Q but takes whole rows of scores (Br x Nk) with a plain softmax: right values,
    but not FlashAttention (no online softmax over K/V tiles)."""
    (Nq, d), Nk = Q.shape, K.shape[0]
    scale = 1 / np.sqrt(d) if scale is None else scale
    O, L = np.zeros_like(Q), np.zeros(Nq, Q.dtype)
    for r0 in range(0, Nq, block_q):
        r1 = min(r0 + block_q, Nq)
        S = scale * (Q[r0:r1] @ K.T)
        if causal:
            S = np.where(np.arange(Nk)[None] <= np.arange(r0, r1)[:, None], S, -np.inf)
        m = S.max(axis=1)
        P = np.exp(S - m[:, None])
        l = P.sum(axis=1)
        O[r0:r1], L[r0:r1] = P @ V / l[:, None], m + np.log(l)
    return O, L


def test_tiling_only_q_is_rejected():
    result = check("flash_forward", _rows_only_forward)
    assert_rejected(result, "memory", "whole rows")
    assert all(c.status == "passed" for c in result.cases if not c.label.startswith("memory"))


# ------------------------------------------------------------------------------------------
# The stepper in the forward's failure message: where the learner's kernel leaves the reference
# ------------------------------------------------------------------------------------------

STEPPER_BANK = [  # the three kinds of wrong kernel the stepper must locate
    ("no rescale of O_i", [("O_i = alpha[:, None] * O_i +", "O_i = O_i +")],
     ["O_i of rows", "no rescale of O_i"]),
    ("causal diagonal hidden", [("np.arange(c0, c1)[None, :] <= rows[:, None]",
                                 "np.arange(c0, c1)[None, :] < rows[:, None]")],
     ["m_i of rows", "the causal mask", "causal=True"]),
    ("last K/V tile dropped", [(FWD_LOOP, "for j in range(Nk // Bc):")],
     ["the reference computes tile pair", "ragged K/V tile"]),
]


@pytest.mark.parametrize("mistake, replace, words", STEPPER_BANK, ids=[b[0] for b in STEPPER_BANK])
def test_forward_failure_names_the_stepper_step(mistake, replace, words, tmp_path):
    result = check("flash_forward", load("flash_forward", replace, tmp_path))
    assert_rejected(result, "open the stepper at step", "compare_trace(flash_forward", *words)


def test_stepper_hint_never_breaks_the_check(tmp_path, monkeypatch):
    """A hint that raises, or hangs, leaves the check's own message; a solution gets none."""
    import flashedu.viz.learner_trace as lt
    from flashedu.checks import engine

    wrong = load("flash_forward", STEPPER_BANK[0][1], tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("the stepper failed")
    monkeypatch.setattr(lt, "divergence_hint", broken)
    result = check("flash_forward", wrong)
    assert_rejected(result, "several tiles", "rescale")
    assert "Stepper" not in result.message and "the stepper failed" not in result.message

    def slow(*args, **kwargs):
        time.sleep(30)
    monkeypatch.setattr(lt, "divergence_hint", slow)
    monkeypatch.setattr(engine, "HINT_SECONDS", 0.5)
    start = time.perf_counter()
    result = check("flash_forward", wrong)
    assert time.perf_counter() - start < 10 and "Stepper" not in result.message
    assert_rejected(result, "several tiles")


# ------------------------------------------------------------------------------------------
# Correct implementations
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["safe_softmax", "online_softmax", "flash_forward",
                                  "flash_backward", "block_sparse_forward"])
def test_solution_passes(name, tmp_path):
    result = check(name, load(name, (), tmp_path))
    assert result.passed and result.points == EXERCISES[name].points, str(result)


def _exp2_forward(Q, K, V, block_q, block_k, causal=False, scale=None):
    """FlashAttention-2 in base 2 (as GPU kernels do): scores times log2(e), exp2, L back in ln."""
    log2e = 1.0 / np.log(2.0)
    (Nq, d), Nk = Q.shape, K.shape[0]
    scale = 1 / np.sqrt(d) if scale is None else scale
    O, L = np.empty_like(Q), np.empty(Nq, Q.dtype)
    for r0 in range(0, Nq, block_q):
        r1 = min(r0 + block_q, Nq)
        m, l, acc = np.full(r1 - r0, -np.inf), np.zeros(r1 - r0), np.zeros((r1 - r0, d))
        for c0 in range(0, Nk, block_k):
            c1 = min(c0 + block_k, Nk)
            S = (Q[r0:r1] @ K[c0:c1].T) * (scale * log2e)
            if causal:
                S = np.where(np.arange(c0, c1)[None] <= np.arange(r0, r1)[:, None], S, -np.inf)
            m_new = np.maximum(m, S.max(axis=1))
            safe = np.where(np.isneginf(m_new), 0, m_new)
            P = np.exp2(S - safe[:, None])
            alpha = np.exp2(m - safe)
            l, acc, m = alpha * l + P.sum(axis=1), alpha[:, None] * acc + P @ V[c0:c1], m_new
        O[r0:r1] = acc / l[:, None]
        L[r0:r1] = (m + np.log2(l)) / log2e
    return O, L


def _float64_inside(fn):
    """Computes in float64 and returns the inputs' dtype: a fine way to get float32 right."""
    def wrapped(*args):
        dtype = args[0].dtype
        outs = fn(*(a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype != bool else a
                    for a in args))
        return tuple(o.astype(dtype) for o in outs)
    return wrapped


CORRECT = [  # flashedu's own functions are refused as shortcuts: learner-style code only
    ("flash_forward", _exp2_forward),
    ("flash_forward", _float64_inside(_exp2_forward)),
]


@pytest.mark.parametrize("name, fn", CORRECT, ids=[f"{n}-{k}" for k, (n, _) in enumerate(CORRECT)])
def test_correct_variant_passes(name, fn):
    result = check(name, fn)
    assert result.passed, str(result)


# ------------------------------------------------------------------------------------------
# What a learner meets first: unfilled cells, crashes, infinite loops, the display
# ------------------------------------------------------------------------------------------

def test_unfilled_exercise_is_not_implemented_yet():
    def flash_forward(Q, K, V, block_q, block_k, causal=False, scale=None):
        # YOUR CODE HERE
        raise NotImplementedError()

    result = check("flash_forward", flash_forward)
    assert result.status == NOT_IMPLEMENTED and not result.passed
    assert "not implemented yet" in result.message and "Traceback" not in result.message


def test_infinite_loop_times_out(tmp_path, monkeypatch):
    monkeypatch.setattr(EXERCISES["flash_forward"], "timeout", 1.0)
    learner = load("flash_forward", [(FWD_LOOP, "for j in iter(int, 1):  # j never moves")], tmp_path)
    start = time.perf_counter()
    result = check("flash_forward", learner)
    assert time.perf_counter() - start < 10
    assert_rejected(result, "did not finish within 1 s", "infinite loop")
    assert sum(c.status == "skipped" for c in result.cases) == len(result.cases) - 1


def test_error_shows_the_learners_line_only():
    def flash_forward(Q, K, V, block_q, block_k, causal=False, scale=None):
        return Q[None] @ K.T[:, :, None]  # shapes that do not broadcast

    result = check("flash_forward", flash_forward)
    assert_rejected(result, "raised", "ValueError", "Q[None] @ K.T")
    assert "sandbox.py" not in result.message and "threading.py" not in result.message


def test_not_a_function_and_unknown_name():
    assert_rejected(check("flash_forward", None), "not defined")
    assert_rejected(check("flash_forward", tiled.flash_forward(*[np.ones((2, 2))] * 3, 2, 2)),
                    "pass the function itself")
    with pytest.raises(ValueError, match="flash_forward"):
        check("flash_fwd", tiled.flash_forward)


def test_result_renders_for_notebook_and_terminal(tmp_path):
    good = check("safe_softmax", reference.safe_softmax)
    bad = check("flash_forward", load("flash_forward", [("O_i = alpha[:, None] * O_i +", "O_i = O_i +")], tmp_path))
    assert "&#10004;" in good._repr_html_() and "<table" in good._repr_html_()
    assert "&#10008;" in bad._repr_html_() and "several tiles" in bad._repr_html_()
    assert str(bad).startswith("flash_forward: FAILED (0/4 points)")
    assert bad.to_dict()["cases"][0]["status"] == "passed"


# ------------------------------------------------------------------------------------------
# Kernel exercises: in the simulator / interpreter, small and few (they are slow there)
# ------------------------------------------------------------------------------------------

NUMBA_BANK = [
    ("no shared memory: every thread reads K, V from global memory",
     [("s += q[c] * K_j[r, c]", "s += q[c] * K[start + r, c]"),
      ("o[c] += p * V_j[r, c]", "o[c] += p * V[start + r, c]")], ["shared memory", "read K"]),
    ("no guard on the query row",
     [("    valid = i < Nq\n", "    valid = True\n")], ["IndexError", "guard"]),
    ("forgot to rescale O_i", [("o[c] *= alpha", "o[c] *= 1.0")], ["several K tiles", "rescale"]),
    ("causal mask off by one", [("if causal and start + r > i:", "if causal and start + r >= i:")],
     ["causal"]),
]


@pytest.mark.parametrize("mistake, replace, words", NUMBA_BANK, ids=[b[0] for b in NUMBA_BANK])
def test_numba_wrong_kernel_is_rejected(mistake, replace, words, tmp_path):
    from flashedu import runtime

    if "IndexError" in words and not runtime.numba_simulated():
        pytest.skip("a read past the end raises IndexError in numba's simulator only; on a GPU "
                    "it reads the padding and changes no output")
    assert_rejected(check("numba_forward_kernel", load("numba_forward_kernel", replace, tmp_path)), *words)


TRITON_BANK = [
    ("K, V loaded without a mask",
     [("mask=col_ok[:, None], other=0.0)\n        V_j", ")\n        V_j"),
      ("V_j = tl.load(V + cols[:, None] * stride_v + dims[None, :], mask=col_ok[:, None], other=0.0)",
       "V_j = tl.load(V + cols[:, None] * stride_v + dims[None, :])")], ["edge tiles", "NaN"]),
    ("store without a mask",
     [("O_i / l_i[:, None], mask=row_ok[:, None])", "O_i / l_i[:, None])")], ["wrote outside O, past its last row"]),
    ("causal mask with <", [("cols[None, :] <= rows[:, None]", "cols[None, :] < rows[:, None]")], ["causal"]),
    ("L left in base 2 after exp2",
     [("P_ij = tl.exp(S_ij - m_new[:, None])", "P_ij = tl.exp2(S_ij - m_new[:, None])"),
      ("alpha = tl.exp(m_i - m_new)", "alpha = tl.exp2(m_i - m_new)"),
      ("S_ij = tl.dot(Q_i, tl.trans(K_j)) * scale", "S_ij = tl.dot(Q_i, tl.trans(K_j)) * (scale * 1.4426950408889634)"),
      ("m_i + tl.log(l_i)", "m_i + tl.log2(l_i)")], ["O is right", "L"]),
]


@pytest.mark.parametrize("mistake, replace, words", TRITON_BANK, ids=[b[0] for b in TRITON_BANK])
def test_triton_wrong_kernel_is_rejected(mistake, replace, words, tmp_path):
    assert_rejected(check("triton_forward_kernel", load("triton_forward_kernel", replace, tmp_path)), *words)


def test_unfilled_kernel_is_not_implemented_yet(tmp_path):
    replace = [(solution_source("triton_forward_kernel").split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0],
                "\n    # YOUR CODE HERE\n    raise NotImplementedError()\n    ")]
    result = check("triton_forward_kernel", load("triton_forward_kernel", replace, tmp_path))
    assert result.status == NOT_IMPLEMENTED, str(result)


# The Triton backward: each kernel graded on its own outputs (dK and dV, or dQ).
DKDV, DQ = "triton_backward_dkdv_kernel", "triton_backward_dq_kernel"
TRITON_BWD_BANK = [
    (DKDV, "missing Delta_i in dS_ij",
     [("dS_ij = P_ij * (dP_ij - Delta_i[:, None])", "dS_ij = P_ij * dP_ij")],
     ["one tile", "dK is wrong", "without Delta_i"]),
    (DQ, "missing Delta_i in dS_ij",
     [("dS_ij = P_ij * (dP_ij - Delta_i[:, None])", "dS_ij = P_ij * dP_ij")],
     ["one tile", "dQ is wrong", "without Delta_i"]),
    (DKDV, "causal Q loop starts at tile j of Br rows (j * Br), not at row j * Bc",
     [("lo = (j * Bc) // Br * Br", "lo = j * Br")],
     ["causal, Br=32, Bc=16", "both wrong", "(j * Bc // Br) * Br"]),
    (DQ, "causal K/V loop stops one tile early",
     [("end = tl.minimum(Nk, (i + 1) * Br)", "end = tl.minimum(Nk, i * Br + 1)")],
     ["causal, Br=32, Bc=16", "dQ is wrong", "min(Nk, (i + 1) * Br)"]),
    (DKDV, "dO_i loaded without a mask",
     [("dO_i = tl.load(dO + rows[:, None] * stride_do + dims[None, :], mask=row_ok[:, None], other=0.0)",
       "dO_i = tl.load(dO + rows[:, None] * stride_do + dims[None, :])")],
     ["edge tiles", "NaN", "mask the loads"]),
    (DQ, "K_j loaded without a mask",
     [("K_j = tl.load(K + cols[:, None] * stride_k + dims[None, :], mask=col_ok[:, None], other=0.0)",
       "K_j = tl.load(K + cols[:, None] * stride_k + dims[None, :])")],
     ["edge tiles", "NaN", "mask the loads"]),
    (DKDV, "scale left out of dK",
     [("dK_j * scale, mask", "dK_j, mask")], ["one tile", "dK is wrong", "without the factor scale"]),
    (DQ, "scale applied twice",
     [("dQ_i += tl.dot(dS_ij, K_j)", "dQ_i += tl.dot(dS_ij, K_j) * scale")],
     ["one tile", "scale twice"]),
    (DKDV, "rows addressed with D instead of the strides",
     [("rows[:, None] * stride_q", "rows[:, None] * D"), ("rows[:, None] * stride_do", "rows[:, None] * D")],
     ["row strides differ from d", "NaN", "stride_q"]),
    (DQ, "dQ stored with D as its row stride",
     [("rows[:, None] * stride_dq", "rows[:, None] * D")],
     ["row strides differ from d", "NaN", "never stored", "dQ + r * stride_dq"]),
    (DKDV, "dV stored without a mask",
     [("dims[None, :], dV_j, mask=col_ok[:, None])", "dims[None, :], dV_j)")],
     ["edge tiles", "wrote outside dV, past its last row"]),
    (DKDV, "P_ij not transposed in dV_j",
     [("dV_j += tl.dot(tl.trans(P_ij), dO_i)", "dV_j += tl.dot(P_ij, dO_i)")],
     ["one tile", "dV is wrong but dK is right", "P_ij^T dO_i"]),
    (DKDV, "causal mask with <",
     [("cols[None, :] <= rows[:, None]", "cols[None, :] < rows[:, None]")],
     ["causal, Nq=Nk=64", "j < i instead of j <= i"]),
]


@pytest.mark.parametrize("name, mistake, replace, words", TRITON_BWD_BANK,
                         ids=[f"{b[0]}: {b[1]}" for b in TRITON_BWD_BANK])
def test_triton_backward_wrong_kernel_is_rejected(name, mistake, replace, words, tmp_path):
    assert_rejected(check(name, load(name, replace, tmp_path)), *words)


@pytest.mark.parametrize("name", [DKDV, DQ])
def test_triton_backward_solution_passes(name, tmp_path):
    result = check(name, load(name, (), tmp_path))
    assert result.passed and result.points == EXERCISES[name].points, str(result)
    assert len(result.cases) >= 20 and any("strides" in c.label for c in result.cases)


@pytest.mark.parametrize("name", [DKDV, DQ])
def test_triton_backward_unfilled_is_not_implemented_yet(name, tmp_path):
    source = solution_source(name)
    body = source.split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0]
    result = check(name, load(name, [(body, "\n    # YOUR CODE HERE\n    raise NotImplementedError()\n    ")], tmp_path))
    assert result.status == NOT_IMPLEMENTED and "not implemented yet" in result.message, str(result)


def test_launch_triton_backward_pairs_the_kernels(tmp_path):
    """The launcher runs both solution kernels; they give the NumPy backward's gradients for
    contiguous and strided inputs, causal or not."""
    import torch

    from flashedu import runtime
    from flashedu.checks.triton_backward import launch_triton_backward

    device = runtime.kernel_device()
    tol = 1e-4 if runtime.triton_interpreted() else 3e-2  # TF32 dots on a GPU
    dkdv, dq = load(DKDV, (), tmp_path), load(DQ, (), tmp_path)
    rng = np.random.default_rng(0)
    Nq, Nk, d = 29, 35, 16
    for causal, strided in ((False, False), (True, True)):
        Q, K, V = (rng.standard_normal((n, d)).astype(np.float32) for n in (Nq, Nk, Nk))
        O, L = tiled.flash_forward(Q, K, V, 16, 16, causal=causal)
        dO = rng.standard_normal((Nq, d)).astype(np.float32)
        want = tiled.flash_backward(*(a.astype(np.float64) for a in (Q, K, V, O, dO, L)), 16, 16,
                                    causal=causal)
        t = [torch.from_numpy(a).to(device) for a in (Q, K, V, O, dO)]
        if strided:  # views whose rows are 2d apart
            t = [torch.cat([a, torch.full_like(a, float("nan"))], dim=1)[:, :d] for a in t]
            assert t[0].stride(0) == 2 * d
        got = launch_triton_backward(dkdv, dq, *t, torch.from_numpy(L).to(device), causal=causal,
                                     Br=16, Bc=16)
        for g, w in zip(got, want):
            assert np.abs(g.cpu().numpy() - w).max() < tol * (1 + np.abs(w).max()), (causal, strided)


def test_tf32_model_of_the_gpu_dots():
    """On a GPU the Triton exercises' tolerance comes from attention whose dot operands are read
    as TF32 (as tl.dot reads float32 there): 10 mantissa bits kept, and with logits in the
    hundreds an error far above float32 arithmetic's."""
    from flashedu.checks.kernel_common import tf32
    from flashedu.checks.triton_forward import _naive_tf32

    x = np.array([1 + 2**-10, 1 + 2**-11, -3.1415927], np.float32)
    assert tf32(x).tolist() == [1 + 2**-10, 1.0, -3.140625]
    rng = np.random.default_rng(0)
    q, k = (30 * rng.standard_normal((20, 16)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((20, 16)).astype(np.float32)
    _, L = reference.naive_attention(*(a.astype(np.float64) for a in (q, k, v)))
    err32 = np.abs(reference.naive_attention(q, k, v)[1] - L).max()
    err_tf32 = np.abs(_naive_tf32(q, k, v, False, None)[1] - L).max()
    assert err_tf32 > 100 * err32


def _plain_attention(Q, K, V, scale):
    # written out here: flashedu's own references are off while a check calls the function
    S = Q @ K.T * (1.0 / np.sqrt(Q.shape[1]) if scale is None else scale)
    m = S.max(axis=1, keepdims=True)
    P = np.exp(S - m)
    return P @ V / P.sum(axis=1, keepdims=True), (m + np.log(P.sum(axis=1, keepdims=True)))[:, 0]


def test_a_nan_row_is_told_apart_from_the_rows_that_are_only_wrong():
    def nan_first_row_rest_doubled(Q, K, V, block_q, block_k, causal=False, scale=None):
        O, L = _plain_attention(Q, K, V, scale)
        O = 2 * O + 1
        O[0] = np.nan
        return O, L

    def nan_first_row_only(Q, K, V, block_q, block_k, causal=False, scale=None):
        O, L = _plain_attention(Q, K, V, scale)
        O[0] = np.nan
        return O, L

    from flashedu.checks import engine

    ex = EXERCISES["flash_forward"]
    case = ex.cases()[2]
    n = case.expected[0].shape[0]
    for fn, wrong_too in ((nan_first_row_rest_doubled, True), (nan_first_row_only, False)):
        call = engine.execute_case(ex, fn, case)
        _, message, status = engine.judge_case(ex, case, call)
        assert status == "failed"
        if wrong_too:
            assert f"O is wrong in all {n} rows: NaN in row 0 of {n}; elsewhere off by up to" \
                in message, message
        else:
            assert f"O is wrong in row 0 of {n}: NaN in that row." in message, message


def test_the_api_is_refused_before_its_first_use(monkeypatch):
    """``import flashedu`` loads the API on first use; a learner's function that reaches for
    it during a check meets the refusal, and the name loads as usual afterwards."""
    import flashedu

    monkeypatch.delitem(vars(flashedu), "attention", raising=False)  # as if never used yet

    def safe_softmax(x):
        return flashedu.attention(x, x, x)

    assert_rejected(check("safe_softmax", safe_softmax), "flashedu.attention",
                    "off during a check")
    assert "attention" not in vars(flashedu)  # put back as it was: still lazy
    assert callable(flashedu.attention)
