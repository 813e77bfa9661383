"""The step checks of notebooks 02-04 (flashedu/checks/steps/numpy_loops.py): each solved step
passes, and typical wrong answers fail with a message that names the mistake."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashedu import course
from flashedu.checks import STEPS, check

NS = {"np": np, "math": math}

# step id -> the check that grades it
STEP_CHECKS = {
    "02.safe_softmax": "step_safe_softmax",
    "02.online_stats": "step_online_stats",
    "03.kv_outer": "step_forward_kv_outer",
    "03.q_outer": "step_forward_q_outer",
    "04.gradients": "step_attention_grads",
    "04.backward": "step_backward_loop",
}


def grade(name, fn, seed=0):
    return check(name, fn, seed=seed)


@pytest.mark.parametrize("step_id", STEP_CHECKS)
def test_the_solved_step_passes(step_id):
    step = course.notebooks.find(step_id, "step")
    assert step.exercise == STEP_CHECKS[step_id] and step.exercise in STEPS
    result = grade(step.exercise, course.reference(step_id, NS))
    assert result.passed, result.message


@pytest.mark.parametrize("step_id", ["03.q_outer", "04.backward"])
def test_the_solved_step_passes_on_other_inputs(step_id):
    # float32 cases compare against float32's rounding: a few more draws of the inputs
    fn = course.reference(step_id, NS)
    for seed in (1, 2, 3):
        result = grade(STEP_CHECKS[step_id], fn, seed=seed)
        assert result.passed, result.message


# ---------------------------------------------------------------------------------------
# 02
# ---------------------------------------------------------------------------------------


def test_safe_softmax_without_the_max_fails_on_large_logits():
    def naive(x):
        e = np.exp(x)
        return e / e.sum(axis=-1, keepdims=True)

    result = grade("step_safe_softmax", naive)
    assert not result.passed
    assert "NaN" in result.message and "Subtract the row's max" in result.message


def test_safe_softmax_over_the_wrong_axis_fails():
    def first_axis(x):
        e = np.exp(x - x.max(axis=0, keepdims=True))
        return e / e.sum(axis=0, keepdims=True)

    result = grade("step_safe_softmax", first_axis)
    assert not result.passed and "softmax is wrong" in result.message


def _stats(update):
    def online_stats(x, Bc):
        m = np.full(x.shape[0], -np.inf)
        l = np.zeros(x.shape[0])
        history = [(m.copy(), l.copy())]
        for start in range(0, x.shape[1], Bc):
            m, l = update(x, x[:, start:start + Bc], m, l)
            history.append((m.copy(), l.copy()))
        return m, l, history
    return online_stats


def test_online_stats_without_the_rescale_fails():
    def no_rescale(x, x_j, m, l):
        m_j = x_j.max(axis=1)
        return np.maximum(m, m_j), l + np.exp(x_j - m_j[:, None]).sum(axis=1)

    result = grade("step_online_stats", _stats(no_rescale))
    assert not result.passed
    assert "m is right but l is not" in result.message and "exp(m - m_new)" in result.message


def test_online_stats_that_reads_whole_rows_fails():
    def whole_row(x, x_j, m, l):
        m = x.max(axis=1)  # right, but not streamed
        return m, np.exp(x - m[:, None]).sum(axis=1)

    result = grade("step_online_stats", _stats(whole_row))
    assert not result.passed and "at once" in result.message


def test_online_stats_that_forgets_to_move_m_fails():
    def stale_m(x, x_j, m, l):
        m_j = x_j.max(axis=1)
        m_new = np.maximum(m, m_j)
        l_j = np.exp(x_j - m_j[:, None]).sum(axis=1)
        return m, np.exp(m - m_new) * l + np.exp(m_j - m_new) * l_j

    result = grade("step_online_stats", _stats(stale_m))
    assert not result.passed and "m is wrong" in result.message


# ---------------------------------------------------------------------------------------
# 03
# ---------------------------------------------------------------------------------------


def test_q_outer_without_alpha_fails_and_points_at_the_rescale():
    def forgot_alpha(Q, K, V, Br, Bc):
        O, L = np.empty_like(Q), np.empty(Q.shape[0])
        for i in range(math.ceil(Q.shape[0] / Br)):
            rows = slice(i * Br, (i + 1) * Br)
            Q_i = Q[rows]
            O_i, l_i, m_i = np.zeros_like(Q_i), np.zeros(len(Q_i)), np.full(len(Q_i), -np.inf)
            for j in range(math.ceil(K.shape[0] / Bc)):
                K_j, V_j = K[j * Bc:(j + 1) * Bc], V[j * Bc:(j + 1) * Bc]
                S_ij = Q_i @ K_j.T / math.sqrt(Q.shape[1])
                m_new = np.maximum(m_i, S_ij.max(axis=1))
                P_ij = np.exp(S_ij - m_new[:, None])
                alpha = np.exp(m_i - m_new)
                l_i = alpha * l_i + P_ij.sum(axis=1)
                O_i = O_i + P_ij @ V_j  # the bug: alpha * O_i
                m_i = m_new
            O[rows], L[rows] = O_i / l_i[:, None], m_i + np.log(l_i)
        return O, L

    result = grade("step_forward_q_outer", forgot_alpha)
    assert not result.passed
    assert "L is right" in result.message and "exp(m_i - m_new)" in result.message


def test_kv_outer_that_never_writes_back_l_and_m_fails():
    def no_write_back(Q, K, V, Br, Bc):
        Nq, d = Q.shape
        scale = 1 / math.sqrt(d)
        O, l, m = np.zeros_like(Q), np.zeros(Nq), np.full(Nq, -np.inf)
        for j in range(math.ceil(K.shape[0] / Bc)):
            K_j, V_j = K[j * Bc:(j + 1) * Bc], V[j * Bc:(j + 1) * Bc]
            for i in range(math.ceil(Nq / Br)):
                rows = slice(i * Br, (i + 1) * Br)
                Q_i, O_i, l_i, m_i = Q[rows], O[rows], l[rows], m[rows]
                S_ij = scale * Q_i @ K_j.T
                m_ij = S_ij.max(axis=1)
                P_ij = np.exp(S_ij - m_ij[:, None])
                m_new = np.maximum(m_i, m_ij)
                l_new = np.exp(m_i - m_new) * l_i + np.exp(m_ij - m_new) * P_ij.sum(axis=1)
                O[rows] = ((l_i * np.exp(m_i - m_new))[:, None] * O_i
                           + np.exp(m_ij - m_new)[:, None] * (P_ij @ V_j)) / l_new[:, None]
                # the bug: l_i and m_i never go back to l and m
        with np.errstate(divide="ignore", invalid="ignore"):
            return O, m + np.log(l)

    result = grade("step_forward_kv_outer", no_write_back)
    assert not result.passed
    assert "Failed case: one tile" in result.message and "L" in result.message


# ---------------------------------------------------------------------------------------
# 04
# ---------------------------------------------------------------------------------------


def test_gradients_without_the_scale_in_dq_fail():
    solved = course.reference("04.gradients", NS)

    def no_scale(Q, K, V, dO, scale):
        dQ, dK, dV = solved(Q, K, V, dO, scale)
        return dQ / scale, dK, dV

    result = grade("step_attention_grads", no_scale)
    assert not result.passed and "Only dQ is wrong" in result.message


def test_gradients_with_d_from_dp_alone_fail():
    def wrong_d(Q, K, V, dO, scale):
        S = scale * Q @ K.T
        P = np.exp(S - S.max(axis=1, keepdims=True))
        P = P / P.sum(axis=1, keepdims=True)
        dP = dO @ V.T
        dS = P * (dP - dP.sum(axis=1, keepdims=True))  # the bug: rowsum(dP), not rowsum(P dP)
        return scale * dS @ K, scale * dS.T @ Q, P.T @ dO

    result = grade("step_attention_grads", wrong_d)
    assert not result.passed and "dV is right (so P is)" in result.message


def _loop(update):
    def flash_backward_loop(Q, K, V, O, dO, L, Br, Bc):
        Nq, d = Q.shape
        scale = 1 / math.sqrt(d)
        dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
        D = (dO * O).sum(axis=1)
        for j in range(math.ceil(K.shape[0] / Bc)):
            cols = slice(j * Bc, (j + 1) * Bc)
            K_j, V_j = K[cols], V[cols]
            dK_j, dV_j = np.zeros_like(K_j), np.zeros_like(V_j)
            for i in range(math.ceil(Nq / Br)):
                rows = slice(i * Br, (i + 1) * Br)
                update(scale, Q[rows], K_j, V_j, dO[rows], L[rows], D[rows], dQ, rows, dK_j, dV_j)
            dK[cols], dV[cols] = dK_j, dV_j
        return dQ, dK, dV
    return flash_backward_loop


def test_backward_loop_that_overwrites_dq_fails():
    def overwrite(scale, Q_i, K_j, V_j, dO_i, L_i, D_i, dQ, rows, dK_j, dV_j):
        P_ij = np.exp(scale * Q_i @ K_j.T - L_i[:, None])
        dV_j += P_ij.T @ dO_i
        dS_ij = P_ij * (dO_i @ V_j.T - D_i[:, None])
        dQ[rows] = scale * dS_ij @ K_j  # the bug: = instead of +=
        dK_j += scale * dS_ij.T @ Q_i

    result = grade("step_backward_loop", _loop(overwrite))
    assert not result.passed
    assert "Only dQ is wrong" in result.message and "accumulate" in result.message


def test_backward_loop_that_renormalizes_p_per_tile_fails():
    def tile_softmax(scale, Q_i, K_j, V_j, dO_i, L_i, D_i, dQ, rows, dK_j, dV_j):
        S_ij = scale * Q_i @ K_j.T
        P_ij = np.exp(S_ij - S_ij.max(axis=1, keepdims=True))
        P_ij = P_ij / P_ij.sum(axis=1, keepdims=True)  # the bug: a softmax of the tile alone
        dV_j += P_ij.T @ dO_i
        dS_ij = P_ij * (dO_i @ V_j.T - D_i[:, None])
        dQ[rows] += scale * dS_ij @ K_j
        dK_j += scale * dS_ij.T @ Q_i

    result = grade("step_backward_loop", _loop(tile_softmax))
    assert not result.passed
    assert "exp(S_ij - L_i)" in result.message
