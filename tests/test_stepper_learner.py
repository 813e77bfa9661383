"""TileLoopStepper(fn=...): the tile stepper runs the learner's own NumPy flash_forward.

The learner's reads and writes are counted from their code (row slices of Q, K, V and of an O
made like Q), set beside the paper's loop tensor by tensor; the stepper opens where their values
first leave the reference and marks the rows that differ inside that step's tile.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest

pytest.importorskip("ipywidgets")

from flashedu import io
from flashedu.viz import BlockMaskEditor, TileLoopStepper
from flashedu.viz.tile_grid import drawing


def q_outer(Q, K, V, Br, Bc, causal=False, rescale=True, reread_q=False):
    """FlashAttention-2's loop as a learner writes it (three ways to get it wrong)."""
    Nq, d = Q.shape
    O, L = np.zeros_like(Q), np.zeros_like(Q, shape=Nq)  # both in HBM, traced
    for i in range(math.ceil(Nq / Br)):
        rows = slice(i * Br, (i + 1) * Br)
        Q_i = Q[rows]
        O_i = np.zeros((len(Q_i), d))
        l_i, m_i = np.zeros(len(Q_i)), np.full(len(Q_i), -np.inf)
        for j in range(math.ceil(K.shape[0] / Bc)):
            if causal and j * Bc > i * Br + len(Q_i) - 1:
                break
            if reread_q:
                Q_i = Q[rows]  # an HBM read in every step
            K_j, V_j = K[j * Bc:(j + 1) * Bc], V[j * Bc:(j + 1) * Bc]
            S_ij = Q_i @ K_j.T / math.sqrt(d)
            if causal:
                r = np.arange(i * Br, i * Br + len(Q_i))[:, None]
                S_ij = np.where(np.arange(j * Bc, j * Bc + len(K_j)) <= r, S_ij, -np.inf)
            m_new = np.maximum(m_i, S_ij.max(axis=1))
            P_ij = np.exp(S_ij - m_new[:, None])
            alpha = np.exp(m_i - m_new)
            l_i = (alpha if rescale else 1.0) * l_i + P_ij.sum(axis=1)
            O_i = alpha[:, None] * O_i + P_ij @ V_j
            m_i = m_new
        O[rows] = O_i / l_i[:, None]
        L[rows] = m_i + np.log(l_i)
    return O, L


def test_a_correct_loop_is_stepped_with_its_own_traffic():
    s = TileLoopStepper(Nq=50, Nk=40, d=16, Br=16, Bc=16, fn=q_outer)
    assert s.valid and s.comparison.agrees and s.position == 0
    assert s.trace.info["order"] == "q_outer" and s.done == 4 * 3
    assert [(t.i, t.j) for t in s.trace.steps] == [(i, j) for i in range(4) for j in range(3)]
    assert "✓" in s.verdict.value and s.controls["order"].disabled
    assert s.controls["order"].value == "q_outer"  # the control shows the learner's order
    s.position = s.done
    mine = s.timeline.traffic_by_tensor(s.done)
    want = io.flash_forward_hbm_bytes(50, 40, 16, 16, 16, order="q_outer", itemsize=4)
    assert sum(v for (op, _), v in mine.items() if op == "load") == want["read"]
    assert mine[("store", "O")] == 50 * 16 * 4 and mine[("store", "L")] == 50 * 4
    assert "fe-tensor-differs" not in s.counters.value and s.counters.value.count("✓") == 5
    assert "Your q_outer's tile loop" in s.widget.children[0].value


def test_a_missing_rescale_opens_where_it_first_differs_with_the_rows_marked():
    s = TileLoopStepper(Nq=50, Nk=40, d=16, Br=16, Bc=16,
                        fn=partial(q_outer, rescale=False))
    div = s.comparison.first_divergence
    assert div.what == "l_i" and s.position == div.step == 2
    assert s.marked_rows == div.rows and len(div.rows) > 0
    bars = [sh for sh in drawing(s.timeline, s.position, s.marked_rows).shapes
            if sh[0] == "rect" and sh[9] == "row-differs"]
    assert len(bars) == len(div.rows)
    assert s.tiles.value.count("row-differs") == len(div.rows)
    assert "yours" in s.charts.value and s.learner_stats is not None  # their l_i beside
    s.controls["row"].value = div.rows[0]  # a row that differs: charted, yours apart
    m, l, known = s.learner_stats
    assert known[1:].all() and l[1] == pytest.approx(s.row_stats.l[1])
    assert l[2] != pytest.approx(s.row_stats.l[2])
    s.step()
    assert s.marked_rows == () and "row-differs" not in s.tiles.value


def test_a_loop_that_reads_Q_i_in_every_step_shows_the_extra_traffic():
    s = TileLoopStepper(Nq=48, Nk=48, d=8, Br=16, Bc=16,
                        fn=partial(q_outer, reread_q=True))
    assert s.comparison.agrees  # the values are right; the traffic is not the paper's
    s.position = s.done
    assert s.traffic("Q") == (4 * 48 * 8 * 4, 0)  # once per i, then once per (i, j): 1 + 3
    assert "<span class='fe-tensor-differs'>Q read 6,144 / 1,536 ✗</span>" in s.counters.value


def test_causal_runs_the_learners_mask():
    s = TileLoopStepper(Nq=40, Nk=40, d=8, Br=16, Bc=16, causal=True, fn=q_outer)
    assert s.comparison.agrees and s.done == 1 + 2 + 3  # tiles above the diagonal skipped
    assert "causal-masked" in s.tiles.value


def test_a_function_that_raises_first_says_so():
    def broken(Q, K, V, Br, Bc):
        raise ValueError("not written yet")

    s = TileLoopStepper(fn=broken)
    assert not s.valid and "no tile product" in s.error
    assert "ValueError" in s.verdict.value and "not written yet" in s.verdict.value


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="fn must be"):
        TileLoopStepper(fn="flash_forward")
    with pytest.raises(ValueError, match="not both"):
        TileLoopStepper(fn=q_outer, state=BlockMaskEditor(tiles=4).state)


def test_values_equal_up_to_rounding_are_charted_level():
    """float32 beside float64 differ by 1e-7: the chart must not spread that over its height."""
    from flashedu.viz.charts import line_panel

    d = line_panel([("a", np.array([2.0715, 2.0715]), "red", False),
                    ("b", np.array([2.07150021, 2.07150021]), "blue", True)], 0, "t", 1)
    ys = [p[0][1] for kind, p, *_ in d.shapes if kind == "poly"]
    assert len(ys) == 2 and abs(ys[0] - ys[1]) < 0.5  # pixels
