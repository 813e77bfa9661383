"""The grader against its red team: kernels that are wrong in the ways the old cases missed,
cheats, unusual correct kernels, and notebooks that try to fool or hang ``flashedu check``.

Every wrong kernel and cheat must score 0; every correct variant must pass; every hostile
notebook must neither score nor hang. Sizes are small: the kernels run in numba's simulator and
Triton's interpreter here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest

from flashedu import runtime
from flashedu.checks import EXERCISES, check
from flashedu.checks.result import NOT_IMPLEMENTED
from test_checks import ROOT, assert_rejected, load

DKDV, DQ = "triton_backward_dkdv_kernel", "triton_backward_dq_kernel"
SEED = 20250611  # the correct variants run on one fixed draw; every draw: see below
TFWD, NUMBA = "triton_forward_kernel", "numba_forward_kernel"


# ------------------------------------------------------------------------------------------
# Wrong kernels the earlier cases let through
# ------------------------------------------------------------------------------------------

T_LOAD_K = "K_j = tl.load(K + cols[:, None] * stride_k + dims[None, :], mask=col_ok[:, None], other=0.0)"
T_LOAD_V = "V_j = tl.load(V + cols[:, None] * stride_v + dims[None, :], mask=col_ok[:, None], other=0.0)"
T_MASK = "S_ij = tl.where(visible, S_ij, float(\"-inf\"))"
WRONG = [
    # Triton forward
    (TFWD, "K and V loaded unmasked, the NaN discarded by tl.where",
     [(T_LOAD_K, "K_j = tl.load(K + cols[:, None] * stride_k + dims[None, :])"),
      (T_LOAD_V, "V_j = tl.load(V + cols[:, None] * stride_v + dims[None, :])"),
      ("P_ij = tl.exp(S_ij - m_new[:, None])", "P_ij = tl.where(visible, tl.exp(S_ij - m_new[:, None]), 0.0)"),
      ("O_i = alpha[:, None] * O_i + tl.dot(P_ij, V_j)", "O_i = alpha[:, None] * O_i + tl.dot(P_ij, tl.where(col_ok[:, None], V_j, 0.0))"),
      ("S_ij = tl.dot(Q_i, tl.trans(K_j)) * scale", "S_ij = tl.dot(Q_i, tl.trans(tl.where(col_ok[:, None], K_j, 0.0))) * scale")],
     ["loaded", "outside its tensors"]),
    (TFWD, "Q loaded unmasked, NaN rows never stored",
     [("Q_i = tl.load(Q + rows[:, None] * stride_q + dims[None, :], mask=row_ok[:, None], other=0.0)",
       "Q_i = tl.load(Q + rows[:, None] * stride_q + dims[None, :])\n    Q_i = tl.where(row_ok[:, None], Q_i, 0.0)")],
     ["outside its tensors"]),
    (TFWD, "rows addressed with D instead of stride_q",
     [("rows[:, None] * stride_q", "rows[:, None] * D")], ["row strides differ"]),
    (TFWD, "K addressed with stride_q",
     [("cols[:, None] * stride_k", "cols[:, None] * stride_q")], ["row strides differ"]),
    (TFWD, "O stored with D as its row stride",
     [("rows[:, None] * stride_o", "rows[:, None] * D")], ["row strides differ"]),
    (TFWD, "masks after the max (a future key dominates)",
     [(T_MASK, ""),
      ("m_new = tl.maximum(m_i, tl.max(S_ij, 1))  # finite: key 0 lies in the first tile",
       "m_new = tl.maximum(m_i, tl.max(tl.where(col_ok[None, :], S_ij, float('-inf')), 1))\n        S_ij = tl.where(visible, S_ij, float(\"-inf\"))")],
     ["causal"]),
    (TFWD, "causal loop bound in tiles of Bc, not rows of Br",
     [("end = tl.minimum(Nk, (i + 1) * Br)", "end = tl.minimum(Nk, (i + 1) * Bc)")], ["causal"]),
    (TFWD, "only the first 128 keys",
     [("for start in range(0, end, Bc):", "for start in range(0, tl.minimum(end, 128), Bc):")],
     ["Nq=Nk=300"]),
    (TFWD, "exp of unmasked scores in float16",
     [("P_ij = tl.exp(S_ij - m_new[:, None])", "P_ij = tl.exp((S_ij - m_new[:, None]).to(tl.float16)).to(tl.float32)")],
     []),
    (TFWD, "L stored without m_i",
     [("m_i + tl.log(l_i)", "tl.log(l_i)")], ["L"]),
    # Triton backward
    (DKDV, "Q loaded unmasked, rows discarded by the visible mask",
     [("Q_i = tl.load(Q + rows[:, None] * stride_q + dims[None, :], mask=row_ok[:, None], other=0.0)",
       "Q_i = tl.where(row_ok[:, None], tl.load(Q + rows[:, None] * stride_q + dims[None, :]), 0.0)")],
     ["outside its tensors"]),
    (DQ, "L_i loaded unmasked, discarded by tl.where",
     [("L_i = tl.load(L + rows, mask=row_ok, other=0.0)", "L_i = tl.where(row_ok, tl.load(L + rows), 0.0)")],
     ["outside its tensors"]),
    (DKDV, "only the first 128 query rows",
     [("for start in range(lo, Nq, Br):", "for start in range(lo, tl.minimum(Nq, 128), Br):")], ["Nq=Nk=300"]),
    (DQ, "only the first 128 keys",
     [("for start in range(0, end, Bc):", "for start in range(0, tl.minimum(end, 128), Bc):")], ["Nq=Nk=300"]),
    (DKDV, "dK addressed with stride_dv",
     [("cols[:, None] * stride_dk", "cols[:, None] * stride_dv")], ["row strides differ"]),
    (DQ, "dO addressed with stride_q",
     [("rows[:, None] * stride_do", "rows[:, None] * stride_q")], ["row strides differ"]),
    (DKDV, "Delta_i taken as zero",
     [("Delta_i = tl.load(Delta + rows, mask=row_ok, other=0.0)", "Delta_i = tl.zeros((Br,), tl.float32)")],
     ["wrong"]),
    (DQ, "dQ not scaled",
     [("dQ_i * scale, mask", "dQ_i, mask")], ["scale"]),
    # numba
    (NUMBA, "Br hard-coded to 8",
     [("Br = cuda.blockDim.x  # query rows per block: one per thread", "Br = 8")], ["threads a block"]),
    (NUMBA, "causal loop bound in blocks of BC, not of Br",
     [("end = min(Nk, (cuda.blockIdx.x + 1) * Br)", "end = min(Nk, (cuda.blockIdx.x + 1) * BC)")],
     ["causal"]),
    (NUMBA, "masks after the max (a future key dominates)",
     [("                if causal and start + r > i:\n                    s = -math.inf\n", ""),
      ("            m_new = max(m_i, m_ij)", "            m_new = max(m_i, m_ij)\n            for r in range(n):\n                if causal and start + r > i:\n                    S_ij[r] = -math.inf")],
     ["future key dominates"]),
    (NUMBA, "reads K[j - 1] for the first key (negative index)",
     [("K_j[r, c] = K[start + r, c]", "K_j[r, c] = K[start + r, c] if start + r > 0 or K[start + r - 1, c] == K[start + r - 1, c] else 0.0")],
     ["negative index"]),
    (NUMBA, "only the first 128 keys",
     [("for start in range(0, end, BC):", "for start in range(0, min(end, 128), BC):")], ["Nq=Nk=300"]),
    (NUMBA, "no syncthreads after the copy",
     [("        cuda.syncthreads()  # the tile is complete before anyone reads it\n", "")],
     ["data race on shared memory", "wrote", "syncthreads"]),
    # NumPy
    ("flash_forward", "masks after the max (a future key dominates)",
     [("m_new = np.maximum(m_i, S_ij.max(axis=1))", "m_new = np.maximum(m_i, (scale * (Q_i @ K[c0:c1].T)).max(axis=1))")],
     ["future key dominates"]),
    ("block_sparse_forward", "computes every tile, zeroes the skipped ones (NaN discarded)",
     [("for j in np.flatnonzero(block_mask[i]):", "for j in range(block_mask.shape[1]):"),
      ("S_ij = scale * (Q_i @ K[c0:c1].T)", "keep = block_mask[i, j]\n            S_ij = np.where(keep, scale * (Q_i @ np.where(keep, K[c0:c1], 0.0).T), -np.inf)"),
      ("P_ij = np.exp(S_ij - m_new[:, None])", "m_safe = np.where(np.isinf(m_new), 0.0, m_new)\n            P_ij = np.exp(S_ij - m_safe[:, None])"),
      ("alpha = np.exp(m_i - m_new)", "alpha = np.where(np.isinf(m_new), 1.0, np.exp(m_i - m_safe))"),
      ("P_ij @ V[c0:c1]", "P_ij @ np.where(keep, V[c0:c1], 0.0)")],
     ["block_mask skips", "not be read"]),
    ("block_sparse_forward", "computes every tile on plain copies of K and V (no read to see)",
     [("    for i in range(math.ceil(Nq / Br)):\n",
       "    K, V = np.array(K), np.array(V)  # plain arrays: reads leave no trace\n"
       "    K[np.isnan(K)] = 0.0\n    V[np.isnan(V)] = 0.0\n"
       "    for i in range(math.ceil(Nq / Br)):\n"),
      ("for j in np.flatnonzero(block_mask[i]):", "for j in range(block_mask.shape[1]):"),
      ("S_ij = scale * (Q_i @ K[c0:c1].T)", "S_ij = np.where(block_mask[i, j], scale * (Q_i @ K[c0:c1].T), -np.inf)"),
      ("P_ij = np.exp(S_ij - m_new[:, None])", "m_safe = np.where(np.isinf(m_new), 0.0, m_new)\n            P_ij = np.exp(S_ij - m_safe[:, None])"),
      ("alpha = np.exp(m_i - m_new)", "alpha = np.where(np.isinf(m_new), 1.0, np.exp(m_i - m_safe))")],
     ["CPU time", "skip"]),
    ("block_sparse_forward", "K @ whole, then picks the kept tiles",
     [("S_ij = scale * (Q_i @ K[c0:c1].T)", "S_ij = scale * (Q_i @ np.nan_to_num(K).T)[:, c0:c1]")],
     ["whole of K"]),
    # more Triton forward
    (TFWD, "O_i not rescaled", [("O_i = alpha[:, None] * O_i + tl.dot(P_ij, V_j)", "O_i = O_i + tl.dot(P_ij, V_j)")], []),
    (TFWD, "l_i not rescaled", [("l_i = alpha * l_i + tl.sum(P_ij, 1)", "l_i = l_i + tl.sum(P_ij, 1)")], []),
    (TFWD, "scale ignored", [("S_ij = tl.dot(Q_i, tl.trans(K_j)) * scale", "S_ij = tl.dot(Q_i, tl.trans(K_j))")], []),
    (TFWD, "O not divided by l_i", [("O_i / l_i[:, None], mask", "O_i, mask")], []),
    # more Triton backward
    (DKDV, "P_ij without L_i", [("P_ij = tl.exp(tl.where(visible, S_ij - L_i[:, None], float(\"-inf\")))",
                                 "P_ij = tl.exp(tl.where(visible, S_ij, float(\"-inf\")))")], []),
    (DQ, "last, partial key tile dropped", [("    end = Nk\n", "    end = Nk - Nk % Bc\n")], ["edge tiles"]),
    (DKDV, "dK_j overwritten, not accumulated", [("dK_j += tl.dot(tl.trans(dS_ij), Q_i)", "dK_j = tl.dot(tl.trans(dS_ij), Q_i)")], []),
    (DQ, "dQ_i from K_j transposed twice", [("dQ_i += tl.dot(dS_ij, K_j)", "dQ_i += tl.dot(dS_ij, K_j) * 0.5")], []),
    # more numba
    (NUMBA, "l_i not rescaled", [("                l_i *= alpha\n", "")], []),
    (NUMBA, "scale applied twice", [("                s *= scale\n", "                s *= scale * scale\n")], []),
    (NUMBA, "L without m_i", [("L[i] = m_i + math.log(l_i)", "L[i] = math.log(l_i)")], []),
    (NUMBA, "causal mask drops the diagonal", [("if causal and start + r > i:", "if causal and start + r >= i:")], []),
    # the races, bounds and formulas a learner gets wrong most
    (NUMBA, "no barrier before the next tile overwrites K_j, V_j (a race)",
     [("        cuda.syncthreads()  # everyone is done with the tile before it is overwritten\n", "")],
     ["data race on shared memory", "since the last cuda.syncthreads()"]),
    (NUMBA, "copy guard start + r <= Nk (one key past the end)",
     [("if start + r < Nk:", "if start + r <= Nk:")], ["IndexError", "out of bounds", "guard"]),
    (DQ, "Delta_i computed in the kernel from Q_i instead of O",
     [("Delta_i = tl.load(Delta + rows, mask=row_ok, other=0.0)", "Delta_i = tl.sum(dO_i * Q_i, 1)")],
     ["dQ is wrong", "rowsum(dO_i * Q_i)", "rowsum(dO_i * O_i)"]),
    (DKDV, "Delta_i computed in the kernel from Q_i instead of O",
     [("Delta_i = tl.load(Delta + rows, mask=row_ok, other=0.0)", "Delta_i = tl.sum(dO_i * Q_i, 1)")],
     ["dK is wrong", "rowsum(dO_i * Q_i)", "the forward's output"]),
    (DQ, "causal K/V loop ends at i * Br (the diagonal tile left out)",
     [("end = tl.minimum(Nk, (i + 1) * Br)", "end = tl.minimum(Nk, i * Br)")],
     ["causal, Nq=Nk=64", "dQ is wrong", "min(Nk, (i + 1) * Br)"]),
    (DQ, "causal mask with <, the diagonal hidden",
     [("cols[None, :] <= rows[:, None]", "cols[None, :] < rows[:, None]")],
     ["causal", "j < i instead of j <= i"]),
    (DKDV, "causal Q loop starts one Q tile too late",
     [("lo = (j * Bc) // Br * Br", "lo = (j * Bc) // Br * Br + Br")],
     ["causal", "dK and dV are both wrong", "start its Q loop"]),
    (TFWD, "m_i starts at 0, not -inf (exp underflows to 0/0)",
     [('m_i = tl.full((Br,), float("-inf"), tl.float32)', "m_i = tl.zeros((Br,), tl.float32)")],
     ["logits in the hundreds", "NaN", "running max"]),
    (TFWD, "causal mask compares keys with the tile's first row",
     [("cols[None, :] <= rows[:, None]", "cols[None, :] <= i * Br")],
     ["causal, Nq=Nk=64", "O is wrong", "global positions"]),
]


def _check_source(name, replace, tmp_path):
    return check(name, load(name, replace, tmp_path))


@pytest.mark.parametrize("name, mistake, replace, words", WRONG, ids=[f"{w[0]}: {w[1]}" for w in WRONG])
def test_wrong_kernel_is_rejected(name, mistake, replace, words, tmp_path):
    from flashedu import runtime
    if "outside its tensors" in words and not runtime.triton_interpreted():
        pytest.skip("loads are counted in Triton's interpreter only (on a GPU: compute-sanitizer)")
    if "negative index" in words and not runtime.numba_simulated():
        pytest.skip("negative indices are seen in numba's simulator only")
    if "IndexError" in words and not runtime.numba_simulated():
        pytest.skip("a read past the end raises IndexError in numba's simulator only; on a GPU "
                    "it reads the padding and changes no output")
    if "data race on shared memory" in words and not runtime.numba_simulated():
        pytest.skip("races are found in numba's simulator only (on a GPU: compute-sanitizer "
                    "--tool racecheck)")
    assert_rejected(_check_source(name, replace, tmp_path), *words)


# ------------------------------------------------------------------------------------------
# Cheats: the answer from somewhere else
# ------------------------------------------------------------------------------------------

def _cheat_reference(Q, K, V, block_q, block_k, causal=False, scale=None):
    from flashedu import reference
    return reference.naive_attention(Q, K, V, causal=causal, scale=scale)


def _cheat_tiled(Q, K, V, block_q, block_k, causal=False, scale=None):
    import flashedu.tiled
    return flashedu.tiled.flash_forward(Q, K, V, block_q, block_k, causal=causal, scale=scale)


def _cheat_attention(Q, K, V, block_q, block_k, causal=False, scale=None):
    import torch

    import flashedu
    q, k, v = (torch.from_numpy(np.ascontiguousarray(a))[None, None] for a in (Q, K, V))
    out, lse = flashedu.attention(q, k, v, is_causal=causal, scale=scale, return_lse=True)
    return out[0, 0].numpy().astype(Q.dtype), lse[0, 0].numpy().astype(Q.dtype)


def _cheat_sdpa(Q, K, V, block_q, block_k, causal=False, scale=None):
    import torch
    q, k, v = (torch.from_numpy(np.ascontiguousarray(a)) for a in (Q, K, V))
    O = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=causal, scale=scale)[0]
    return O.numpy(), np.zeros(len(Q), Q.dtype)


def _cheat_torch_softmax(x):
    import torch
    return torch.softmax(torch.from_numpy(np.asarray(x)), dim=-1).numpy()


def _cheat_tensor_softmax(x, block_size):
    import torch
    return torch.from_numpy(np.asarray(x)).softmax(-1).numpy()


def _cheat_stack(Q, K, V, block_q, block_k, causal=False, scale=None):
    """Reads the expected answer off the grader's stack."""
    import inspect
    for frame in inspect.stack():
        case = frame.frame.f_locals.get("case")
        if case is not None and getattr(case, "expected", None):
            return tuple(np.asarray(e, dtype=Q.dtype) for e in case.expected)
    raise RuntimeError("no answer found")


_TABLE = {}


def _cheat_table(Q, K, V, block_q, block_k, causal=False, scale=None):
    """A table of answers recorded for the inputs of an earlier check."""
    return _TABLE[(Q.shape, K.shape, causal)]


def _cheat_patch_compare(Q, K, V, block_q, block_k, causal=False, scale=None):
    from flashedu.checks import compare
    compare.tolerance = lambda *a, **k: float("inf")
    compare.error = lambda *a, **k: 0.0
    return np.zeros_like(Q), np.zeros(len(Q), Q.dtype)


def _cheat_dense_torch(Q, K, V, block_q, block_k, causal=False, scale=None):
    """Dense scores in torch: tracemalloc does not see torch's allocator."""
    import torch
    q, k, v = (torch.from_numpy(np.ascontiguousarray(a)) for a in (Q, K, V))
    s = (q @ k.T) * (1 / np.sqrt(Q.shape[1]) if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
    m = s.max(dim=1, keepdim=True).values
    p = torch.exp(s - m)
    l = p.sum(dim=1, keepdim=True)
    return (p @ v / l).numpy().astype(Q.dtype), (m + torch.log(l))[:, 0].numpy().astype(Q.dtype)


def _cheat_asarray_softmax(x, block_size):
    """Drops the grader's watching array class with np.asarray, then takes whole rows."""
    x = np.asarray(x)
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isneginf(m), 0, m))
    l = e.sum(axis=-1, keepdims=True)
    return e / np.where(l == 0, 1, l)


def _cheat_view_softmax(x, block_size):
    """The same through a plain view and NumPy's functions (np.max, np.sum)."""
    x = x.view(np.ndarray)
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isneginf(m), 0, m))
    l = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(l == 0, 1, l)


CHEATS = [
    ("online_softmax", _cheat_asarray_softmax, ["maximum over 7 columns at once", "block_size is"]),
    ("online_softmax", _cheat_view_softmax, ["at once", "block by block"]),
    ("flash_forward", _cheat_dense_torch, ["memory", "grew"]),
    ("flash_forward", _cheat_reference, ["flashedu.reference"]),
    ("flash_forward", _cheat_tiled, ["flashedu.tiled"]),
    ("flash_forward", _cheat_attention, ["attention"]),
    ("flash_forward", _cheat_sdpa, ["scaled_dot_product_attention"]),
    ("safe_softmax", _cheat_torch_softmax, ["softmax"]),
    ("online_softmax", _cheat_tensor_softmax, ["softmax"]),
    ("flash_forward", _cheat_stack, ["no answer found"]),
    ("flash_forward", _cheat_table, ["KeyError"]),
]


@pytest.mark.parametrize("name, fn, words", CHEATS, ids=[c[1].__name__ for c in CHEATS])
def test_cheat_is_rejected(name, fn, words):
    assert_rejected(check(name, fn), *words)


def test_table_of_answers_for_one_seed_fails_on_the_next(tmp_path):
    """Inputs are fresh per check: answers recorded on one run do not fit the next. (The
    learner's code runs in a child process: the table goes through a file to the next check.)"""
    import pickle

    from flashedu.checks import engine
    real = load("flash_forward", (), tmp_path)
    store = tmp_path / "answers.pkl"

    def recorder(Q, K, V, block_q, block_k, causal=False, scale=None):
        out = real(Q, K, V, block_q, block_k, causal, scale)
        table = pickle.loads(store.read_bytes()) if store.exists() else {}
        table[(Q.shape, K.shape, causal)] = out
        store.write_bytes(pickle.dumps(table))
        return out

    def replay(Q, K, V, block_q, block_k, causal=False, scale=None):
        return pickle.loads(store.read_bytes())[(Q.shape, K.shape, causal)]

    assert check("flash_forward", recorder).passed
    first = engine.run_seed()
    result = check("flash_forward", replay)
    assert engine.run_seed() != first
    assert_rejected(result, "is wrong")


def test_side_effects_of_the_learners_code_stay_in_its_process():
    """check() runs the learner's function in a forked child: a global it writes, or a patch of
    the grader, does not reach the notebook's process; its prints do."""
    import contextlib
    import io

    from flashedu.checks import child, engine
    if child.usable(EXERCISES["flash_forward"]) is not None:
        pytest.skip(f"check() runs in this process here: {child.usable(EXERCISES['flash_forward'])}")
    _TABLE.clear()

    def meddler(Q, K, V, block_q, block_k, causal=False, scale=None):
        _TABLE["ran"] = True
        engine._TOLERANCE = lambda *a, **k: float("inf")
        print("debug print from the learner")
        return np.zeros_like(Q), np.zeros(len(Q), Q.dtype)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = check("flash_forward", meddler)
    assert_rejected(result, "is wrong")
    assert "ran" not in _TABLE and engine._TOLERANCE is engine.compare.tolerance
    assert "debug print from the learner" in out.getvalue()


def test_patching_compare_does_not_help():
    result = check("flash_forward", _cheat_patch_compare)
    import importlib

    from flashedu.checks import compare
    importlib.reload(compare)  # undo the cheat for the other tests
    assert not result.passed


def test_python_function_standing_in_for_a_kernel(tmp_path):
    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None
    assert_rejected(check(TFWD, FakeKernel()))
    assert_rejected(check(NUMBA, FakeKernel()))
    FakeKernel.__call__ = lambda self, *a: None
    assert_rejected(check(TFWD, FakeKernel()), "not a @triton.jit kernel")
    assert_rejected(check(NUMBA, FakeKernel()), "not a @cuda.jit kernel")


def test_kernel_calling_plain_python_is_rejected(tmp_path):
    replace = [("    ### BEGIN SOLUTION", "    helper_value = np.zeros(1)\n    ### BEGIN SOLUTION")]
    assert_rejected(check(NUMBA, load(NUMBA, replace, tmp_path)), "np.zeros", "not compile")


# ------------------------------------------------------------------------------------------
# Correct, if unusual: must pass
# ------------------------------------------------------------------------------------------

CORRECT = [
    (TFWD, "a NotImplementedError guard for an unsupported D",
     [("    i = tl.program_id(0)\n", "    i = tl.program_id(0)\n    if D > 256:\n        raise NotImplementedError(\"D > 256\")\n")]),
    (TFWD, "exp2 with log2(e) folded into the scale",
     [("S_ij = tl.dot(Q_i, tl.trans(K_j)) * scale", "S_ij = tl.dot(Q_i, tl.trans(K_j)) * (scale * 1.4426950408889634)"),
      ("P_ij = tl.exp(S_ij - m_new[:, None])", "P_ij = tl.exp2(S_ij - m_new[:, None])"),
      ("alpha = tl.exp(m_i - m_new)", "alpha = tl.exp2(m_i - m_new)"),
      ("m_i + tl.log(l_i)", "(m_i + tl.log2(l_i)) * 0.6931471805599453")]),
    (TFWD, "no causal loop bound (masks every tile)", [("end = tl.minimum(Nk, (i + 1) * Br)", "end = Nk")]),
    (DKDV, "causal Q loop from row 0", [("lo = (j * Bc) // Br * Br", "lo = 0")]),
    (DQ, "no causal loop bound", [("end = tl.minimum(Nk, (i + 1) * Br)", "end = Nk")]),
    (DQ, "P_ij with exp2",
     [("P_ij = tl.exp(tl.where(visible, S_ij - L_i[:, None], float(\"-inf\")))",
       "P_ij = tl.exp2(tl.where(visible, (S_ij - L_i[:, None]) * 1.4426950408889634, float(\"-inf\")))")]),
    (DQ, "scale applied inside the loop",
     [("dQ_i += tl.dot(dS_ij, K_j)", "dQ_i += tl.dot(dS_ij, K_j) * scale"), ("dQ_i * scale, mask", "dQ_i, mask")]),
    (NUMBA, "O kept normalized key by key",
     [("                for r in range(n):\n                    p = math.exp(S_ij[r] - m_new)\n                    l_i += p\n                    for c in range(d):\n                        o[c] += p * V_j[r, c]",
       "                for r in range(n):\n                    p = math.exp(S_ij[r] - m_new)\n                    l_new = l_i + p\n                    for c in range(d):\n                        o[c] = o[c] * (l_i / l_new) + (p / l_new) * V_j[r, c]\n                    l_i = l_new"),
      ("                l_i *= alpha\n                for c in range(d):\n                    o[c] *= alpha\n",
       "                l_i *= alpha\n"),
      ("            O[i, c] = o[c] / l_i", "            O[i, c] = o[c]")]),
    (NUMBA, "no causal loop bound", [("end = min(Nk, (cuda.blockIdx.x + 1) * Br)", "end = Nk")]),
    ("flash_forward", "a NotImplementedError guard",
     [("    Nq, d = Q.shape\n", "    Nq, d = Q.shape\n    if Q.ndim != 2:\n        raise NotImplementedError('batched inputs')\n")]),
    (DKDV, "causal Q loop from the tile's first key, not a Br boundary",
     [("lo = (j * Bc) // Br * Br", "lo = j * Bc")]),
    (NUMBA, "only thread 0 copies the tile",
     [("for idx in range(tx, BC * d, Br):", "for idx in range(0, BC * d if tx == 0 else 0):")]),
    (TFWD, "scores masked with a large negative number, not -inf",
     [(T_MASK, "S_ij = tl.where(visible, S_ij, -1.0e30)")]),
    ("block_sparse_forward", "kept tiles in reverse order",
     [("for j in np.flatnonzero(block_mask[i]):", "for j in np.flatnonzero(block_mask[i])[::-1]:")]),
    ("flash_backward", "D_i = rowsum(P_ij * dP_ij), summed over tiles in a first pass",
     [("    D = (dO * O).sum(axis=1)  # D_i = rowsum(dO_i * O_i)\n",
       "    D = np.zeros(Nq, dtype=Q.dtype)\n"
       "    for i in range(math.ceil(Nq / Br)):\n"
       "        r0, r1 = i * Br, min((i + 1) * Br, Nq)\n"
       "        for j in range(math.ceil(Nk / Bc)):\n"
       "            c0, c1 = j * Bc, min((j + 1) * Bc, Nk)\n"
       "            S = scale * (Q[r0:r1] @ K[c0:c1].T)\n"
       "            if causal:\n"
       "                S = np.where(np.arange(c0, c1)[None, :] <= np.arange(r0, r1)[:, None], S, -np.inf)\n"
       "            D[r0:r1] += (np.exp(S - L[r0:r1, None]) * (dO[r0:r1] @ V[c0:c1].T)).sum(axis=1)\n")]),
]


@pytest.fixture(scope="module")
def graded_variants(tmp_path_factory):
    """{variant: (result of every case, gate verdict or None)}: the cases as ``check`` runs
    them on one fixed draw, and the compile gate of every kernel variant in one process of
    each kind (as ``check`` would compile each, one at a time)."""
    from flashedu.checks import engine, gate

    tmp = tmp_path_factory.mktemp("variants")
    out, specs, keys = {}, [], []
    for name, variant, replace in CORRECT:
        ex, fn = EXERCISES[name], load(name, replace, tmp)
        engine.set_seed(SEED)
        out[variant] = [engine.grade_cases(ex, lambda case: engine.execute_case(ex, fn, case)), None]
        if ex.gate is not None:
            specs.append(ex.gate.source(fn))
            keys.append(variant)
    for key, verdict in zip(keys, gate.compile_specs(specs)):
        out[key][1] = verdict
    return out


@pytest.mark.parametrize("name, variant, replace", CORRECT, ids=[f"{c[0]}: {c[1]}" for c in CORRECT])
def test_correct_variant_passes(name, variant, replace, graded_variants):
    from flashedu.checks import engine

    result, verdict = graded_variants[variant]
    assert result.passed, str(result)
    if EXERCISES[name].gate is not None:
        assert isinstance(verdict, engine.Remark), verdict


def test_tiled_delta_from_p_passes_every_draw(tmp_path, monkeypatch):
    """D_i = rowsum(P_ij * dP_ij) summed tile by tile misses by several times the untiled sum
    where dP_ij - D_i cancels (logits in the hundreds, float32): the allowance derived from the
    draw covers it on every seed, not only on the one the test above pins. The function runs
    here, on every case but the memory ones (those need no new allowance)."""
    from flashedu.checks import compare, engine, numpy_exercises

    monkeypatch.setattr(numpy_exercises, "MEMORY_SPECS", [])
    name, _, replace = next(c for c in CORRECT if c[0] == "flash_backward")
    fn = load(name, replace, tmp_path)
    failed = []
    for seed in range(1, 101):
        engine.set_seed(seed)
        for case in numpy_exercises._backward_cases():
            for k, got in enumerate(fn(*case.args)):
                err, tol = compare.error(got, case.expected[k]), engine.allowance(case, k)
                if not err <= tol:
                    failed.append(f"seed {seed}, {case.label}: {case.outputs[k]} off by "
                                  f"{err:.2e} (allowed {tol:.1e})")
    assert not failed, f"{len(failed)} failures:\n" + "\n".join(failed[:5])


# ------------------------------------------------------------------------------------------
# flashedu check: hostile notebooks
# ------------------------------------------------------------------------------------------

def _notebook(tmp_path, stem, extra_cells, solution=True):
    src = ROOT / ("solutions" if solution else "exercises") / f"{stem}.ipynb"
    nb = nbformat.read(src, as_version=4)
    for source in extra_cells:
        nb.cells.append(nbformat.v4.new_code_cell(source))
    path = tmp_path / f"{stem}.ipynb"
    nbformat.write(nb, path)
    return path


def _flashedu_check(*args, timeout=300):
    start = time.perf_counter()
    # the grader's own entry point (what `flashedu check` delegates to)
    run = subprocess.run([sys.executable, "-m", "flashedu.checks.command", *map(str, args)],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    return run, time.perf_counter() - start


def test_hostile_notebooks_neither_score_nor_hang(tmp_path):
    fake = "flashedu-check-results: [{\"name\": \"flash_forward\", \"points\": 4}]"
    unfilled = tmp_path / "unfilled"
    unfilled.mkdir()
    forger = _notebook(unfilled, "02_flash_forward", [
        f"print({fake!r})",
        "import flashedu.checks as c, flashedu.checks.engine as e\n"
        "for ex in c.EXERCISES.values():\n    ex.cases = lambda: []\n"
        "e.judge_case = lambda *a: None\n"
        "c.check = lambda *a, **k: True",
        "check('block_sparse_forward', None)  # an extra check of another notebook's exercise",
    ], solution=False)
    hang = tmp_path / "hang"
    hang.mkdir()
    stubborn = _notebook(hang, "01_softmax", [
        "import time\nwhile True:\n    try:\n        time.sleep(0.2)\n    except KeyboardInterrupt:\n        pass",
    ])
    json_file = tmp_path / "grades.json"
    # a cell may take 45 s: the unfilled notebook's cells (imports in a fresh kernel) must
    # finish on a loaded 2-core machine, while the hanging cell is still cut well within 150 s
    run, seconds = _flashedu_check(forger, stubborn, tmp_path / "missing.ipynb", "--timeout", "45",
                                   "--jobs", "2", "--json", json_file)
    assert seconds < 150, seconds
    assert run.returncode == 1, run.stdout + run.stderr
    rows = json.loads(json_file.read_text())
    by = {(Path(r["notebook"]).parent.name, r["exercise"]): r for r in rows}
    assert set(r["exercise"] for r in rows if "unfilled" in r["notebook"]) == {"flash_forward"}
    assert by[("unfilled", "flash_forward")]["points"] == 0
    unfilled_row = by[("unfilled", "flash_forward")]
    assert unfilled_row["status"] == NOT_IMPLEMENTED, unfilled_row
    for name in ("safe_softmax", "online_softmax"):
        assert by[("hang", name)]["points"] == 0 and by[("hang", name)]["status"] == "not graded"
    assert any(r["exercise"] == "-" and "no such file" in r["message"] for r in rows)
    assert "missing.ipynb" in run.stderr


def test_the_grade_comes_from_the_graders_process(tmp_path):
    """A filled notebook is graded on its own function whatever its cells do to the grader in
    the kernel; a notebook whose function hunts for the expected answers in every thread's
    frames, patches the comparison and prints a fake result finds nothing to copy."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    honest = _notebook(tmp_path / "a", "02_flash_forward", [
        "import flashedu.checks as c\nfor ex in c.EXERCISES.values():\n    ex.cases = lambda: []",
    ])
    thief = _notebook(tmp_path / "b", "02_flash_forward", [
        "import sys, numpy as np\n"
        "import flashedu.checks.compare as cmp\n"
        "cmp.error = lambda *a, **k: 0.0\n"
        "cmp.tolerance = lambda *a, **k: float('inf')\n"
        "def flash_forward(Q, K, V, block_q, block_k, causal=False, scale=None):\n"
        "    print('flashedu-check-results: all passed')\n"
        "    for frame in list(sys._current_frames().values()):\n"
        "        while frame is not None:\n"
        "            case = frame.f_locals.get('case')\n"
        "            if getattr(case, 'expected', None):\n"
        "                return tuple(np.asarray(e, dtype=Q.dtype) for e in case.expected)\n"
        "            frame = frame.f_back\n"
        "    return np.zeros_like(Q), np.zeros(len(Q), Q.dtype)\n",
    ])
    run, _ = _flashedu_check(honest, thief, "--jobs", "2", "--json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {Path(r["notebook"]).parent.name: r for r in json.loads(run.stdout)}
    assert rows["a"]["passed"] and rows["a"]["points"] == 4 and "All 2" in rows["a"]["message"]
    assert not rows["b"]["passed"] and rows["b"]["points"] == 0, rows["b"]


def test_a_gpu_kernel_runs_in_a_process_of_the_graders(tmp_path):
    """Only a kernel's description leaves the notebook: a wrong kernel whose notebook swaps in
    a correct one where the kernel's process calls it (or turns off the watcher of its loads)
    is graded on what it defines, in the grader's own process."""
    symbol = EXERCISES[TFWD].symbol
    nb = nbformat.read(ROOT / "solutions" / "06_triton_kernel.ipynb", as_version=4)
    cell = next(c for c in nb.cells if f"def {symbol}(" in c.source)
    good = cell.source.replace(f"def {symbol}(", "def _good(")
    cell.source = cell.source.replace("cols[None, :] <= rows[:, None]", "cols[None, :] < rows[:, None]")
    nb.cells += [nbformat.v4.new_code_cell(source) for source in (
        good,
        "import contextlib\n"
        "import flashedu.checks.engine as _e, flashedu.checks.triton_forward as _k\n"
        "_real = _e.execute_case\n"
        "_e.execute_case = lambda ex, fn, case: _real(ex, _good, case)\n"
        "_k._watch_loads = lambda tensors: contextlib.nullcontext({})\n")]
    (tmp_path / "swap").mkdir()
    nbformat.write(nb, tmp_path / "swap" / "06_triton_kernel.ipynb")
    run, _ = _flashedu_check(tmp_path / "swap" / "06_triton_kernel.ipynb", "--json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(run.stdout)
    assert row["points"] == 0 and not row["passed"], row
    assert "causal" in row["message"], row["message"]


# ------------------------------------------------------------------------------------------
# The compile gate: a Triton kernel must compile for a GPU (sm_90), not only interpret
# ------------------------------------------------------------------------------------------

def _can_compile_for_cuda() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.mark.skipif(not _can_compile_for_cuda(), reason="this Triton has no CUDA backend")
def test_kernel_that_only_interprets_is_refused(tmp_path):
    """`break` runs in the interpreter (it is Python) but Triton's compiler refuses it."""
    replace = [("        cols = start + tl.arange(0, Bc)\n",
                "        if start >= Nk:\n            break\n        cols = start + tl.arange(0, Bc)\n")]
    result = check(TFWD, load(TFWD, replace, tmp_path))
    if runtime.triton_interpreted():
        assert_rejected(result, "does not compile for a GPU", "sm_90")
        assert all(c.status == "passed" for c in result.cases)  # right in the interpreter
    else:  # on a GPU the kernel is compiled to run: the compiler's refusal is the message
        assert_rejected(result, "UnsupportedLanguageConstruct")


@pytest.mark.skipif(not _can_compile_for_cuda(), reason="this Triton has no CUDA backend")
def test_gate_passes_the_solutions_for_every_launch_of_the_cases(tmp_path):
    from flashedu.checks import engine, gate
    from flashedu.checks.kernels import gate_launches

    names = (TFWD, DKDV, DQ)
    specs = [EXERCISES[n].gate.source(load(n, (), tmp_path)) for n in names]
    for name, which, verdict in zip(names, ("forward", "dkdv", "dq"), gate.compile_specs(specs)):
        assert isinstance(verdict, engine.Remark) and verdict.startswith("Compiled for a GPU"), verdict
        launches = gate_launches(which)
        configs = {(a["config"].split(", N")[0]) for a in launches}
        assert len(configs) >= 6 and any("CAUSAL=False" in c for c in configs), configs
        assert f"{len({a['config'] for a in launches})} distinct launches" in verdict, verdict


def _only_interprets(tmp_path):
    replace = [("        cols = start + tl.arange(0, Bc)\n",
                "        if start >= Nk:\n            break\n        cols = start + tl.arange(0, Bc)\n")]
    return load(TFWD, replace, tmp_path)


@pytest.mark.skipif(not _can_compile_for_cuda(), reason="this Triton has no CUDA backend")
def test_no_setting_of_the_learners_process_turns_the_gate_off(tmp_path, monkeypatch):
    """The switch that once turned the gate off is gone; the grader's side refuses a missing
    or garbled description instead of passing it."""
    from flashedu.checks import engine, gate

    monkeypatch.setenv("FLASHEDU_COMPILE_GATE", "0")
    verdict = gate.triton_gate(_only_interprets(tmp_path), "forward")
    assert not isinstance(verdict, engine.Remark) and "does not compile for a GPU" in verdict
    for spec in (None, {}, {"kind": "triton"}, {"kind": "triton", "which": "forward",
                                                 "functions": "x", "globals": []}):
        verdict = gate.compile_spec(spec)
        assert not isinstance(verdict, engine.Remark) and "no description" in verdict, spec


def test_anything_but_an_explicit_ok_is_a_refusal(tmp_path, monkeypatch):
    """The compiling process must say OK for the kernel exactly once and exit cleanly; a crash
    (a module that does not import, an exception), silence or two answers are refusals. Only
    an explicit skip (no CUDA backend here) passes, with the reason in the message."""
    from flashedu.checks import engine, gate

    spec = gate.triton_gate_source(load(TFWD, (), tmp_path), "forward")
    ok = 'print("GATE-OK:" + json.dumps({"job": 0, "verdict": {"launches": 1, "helpers": 0}}))\n'
    head = "import json, sys\nsys.stdin.read()\n"
    for script, passes in ((head + ok, True), (head + "import no_such_module\n" + ok, False),
                           (head + ok + "raise SystemExit(1)\n", False), (head, False),
                           (head + ok + ok, False)):
        monkeypatch.setattr(gate, "_SCRIPT", script)
        verdict = gate.compile_spec(spec)
        assert isinstance(verdict, engine.Remark) == passes, (script, verdict)
        if not passes:
            assert "counts as not compiling" in verdict, verdict
    monkeypatch.setattr(gate, "_SCRIPT", head + 'print("GATE-SKIP:" + json.dumps({"job": 0, '
                        '"verdict": "Triton cannot compile for CUDA here (no backend)"}))\n')
    verdict = gate.compile_spec(spec)
    assert isinstance(verdict, engine.Remark) and "Not compiled for a GPU" in verdict and \
        "no backend" in verdict, verdict


def test_what_the_gate_runs_is_checked_before_it_runs(tmp_path):
    """The description comes from the learner's side: the compiling process writes the module
    itself and refuses, before running any of it, code at module level, modules outside the
    kernel language and a module that does not load."""
    from flashedu.checks import engine, gate

    spec = gate.triton_gate_source(load(TFWD, (), tmp_path), "forward")
    name, source = spec["functions"][0]

    def variant(globals_=(), old=None, new=None):
        out = dict(spec, globals=spec["globals"] + [list(g) for g in globals_])
        out["functions"] = [[name, source.replace(old, new) if old else source]]
        return out

    cases = [
        (variant([["os", "module", "os"]]), "module os"),
        (variant([["run", "from", "subprocess", "run"]]), "subprocess"),
        (variant(old="CAUSAL: tl.constexpr)", new="CAUSAL: tl.constexpr = print('GATE-OK'))"),
         "only names and constants"),
        (variant(old="@triton.jit", new="@triton.autotune(configs=[], key=[])\n@triton.jit"),
         "a plain @triton.jit"),
        (variant(old="    end = Nk\n", new="    end = Nk\n    tl.core.builtins.print('x')\n"),
         "reaches the module builtins"),
        (variant(old="    end = Nk\n", new="    end = Nk\n    g = getattr(tl, '__dict__')\n"),
         "getattr"),
        (variant(old="CAUSAL: tl.constexpr)", new="CAUSAL: tl.constexpr = NOT_DEFINED)"),
         "does not load"),
        (variant(old="    end = Nk\n", new="    end = Nk\n    eval(\"print('x')\")\n"), "`eval`"),
        (variant(old="    end = Nk\n", new="    end = Nk\n    f = open('/tmp/x', 'w')\n"), "`open`"),
    ]
    verdicts = gate.compile_specs([c[0] for c in cases])
    for (_, words), verdict in zip(cases, verdicts):
        assert not isinstance(verdict, engine.Remark) and words in verdict, (words, verdict)


@pytest.mark.skipif(not _can_compile_for_cuda(), reason="this Triton has no CUDA backend")
def test_flashedu_check_compiles_in_the_graders_process(tmp_path):
    """A notebook whose kernel only interprets, and which patches the gate in its kernel, is
    still refused: the kernel only sends its source; the grader compiles it."""
    nb = nbformat.read(ROOT / "solutions" / "06_triton_kernel.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "triton_forward_kernel":
            assert "        cols = start + tl.arange(0, Bc)\n" in cell.source
            cell.source = cell.source.replace(
                "        cols = start + tl.arange(0, Bc)\n",
                "        if start >= Nk:\n            break\n        cols = start + tl.arange(0, Bc)\n")
    nb.cells.append(nbformat.v4.new_code_cell(
        "import flashedu.checks.gate as g\n"
        "g.triton_gate = g.compile_triton = g.compile_spec = lambda *a, **k: None"))
    path = tmp_path / "06_triton_kernel.ipynb"
    nbformat.write(nb, path)
    run, _ = _flashedu_check(path, "--json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(run.stdout)
    refusal = ("does not compile for a GPU" if runtime.triton_interpreted()
               else "UnsupportedLanguageConstruct")  # on a GPU the compiler's own message
    assert row["points"] == 0 and refusal in row["message"], row


def _numba_gate_unavailable():
    from flashedu.checks.gate import numba_gate_unavailable
    return numba_gate_unavailable()


_NUMBA_GATE = _numba_gate_unavailable()


@pytest.mark.skipif(_NUMBA_GATE is not None, reason=f"no NVVM for numba here: {_NUMBA_GATE}")
def test_numba_kernel_that_only_simulates_is_refused(tmp_path):
    """A Python list in a kernel runs in the simulator; NVVM refuses it."""
    from flashedu import runtime
    if not runtime.numba_simulated():
        pytest.skip("on a GPU numba compiles the kernel when it is launched: no gate needed")
    replace = [("    valid = i < Nq\n", "    valid = i < Nq\n    spare = [0.0] * 4  # a list: Python only\n")]
    result = check(NUMBA, load(NUMBA, replace, tmp_path))
    assert_rejected(result, "does not compile for a GPU", "sm_90", "list(float64)")
    assert all(c.status == "passed" for c in result.cases)  # right in the simulator


@pytest.mark.skipif(_NUMBA_GATE is not None, reason=f"no NVVM for numba here: {_NUMBA_GATE}")
def test_numba_gate_compiles_the_solution_and_its_device_functions(tmp_path):
    """Without a CUDA driver numba cannot ask which GPU to compile a device function for; the
    gate compiles them for sm_90, so a device function is checked, not skipped, and the
    message says what was compiled."""
    from flashedu.checks import engine
    from flashedu.checks.gate import compile_specs
    if not runtime.numba_simulated():
        pytest.skip("a GPU is here: the cases compile numba kernels for it, and the gate "
                    "leaves them to the cases (test_grader_bank checks that)")
    helper = [("@cuda.jit\ndef flash_forward_kernel",
               "@cuda.jit(device=True)\ndef rescaled(x, a):\n    return x * a\n\n\n"
               "@cuda.jit\ndef flash_forward_kernel"),
              ("                    o[c] *= alpha\n", "                    o[c] = rescaled(o[c], alpha)\n")]
    wrong_helper = [(helper[0][0], helper[0][1].replace("return x * a", "t = [x, a]\n    return t[0] * t[1]")),
                    helper[1]]
    specs = [EXERCISES[NUMBA].gate.source(load(NUMBA, r, tmp_path)) for r in ((), helper, wrong_helper)]
    plain, with_helper, refused = compile_specs(specs)
    assert isinstance(plain, engine.Remark) and "with NVVM" in plain, plain
    assert isinstance(with_helper, engine.Remark) and "the 1 function it calls" in with_helper
    assert not isinstance(refused, engine.Remark) and "does not compile for a GPU" in refused
    result = check(NUMBA, load(NUMBA, helper, tmp_path))
    assert result.passed and "Compiled for a GPU" in result.message, str(result)
