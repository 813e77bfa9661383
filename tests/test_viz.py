"""Headless tests of the flashedu.viz widgets: drive their controls, check their state.

The browser test (test_browser.py) checks that they render; these check that what they show
is right: the stepper's counters are the trace's, and equal flashedu.io's count at the end.
"""

import math
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ipywidgets")

from flashedu import io, runtime
from flashedu.masks import BlockMask
from flashedu.viz import BlockMaskEditor, SRAMOccupancy, TileLoopStepper, presets
from flashedu.viz.block_sparse import predict, scaled

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stepper():
    return TileLoopStepper()


# ----- TileLoopStepper -------------------------------------------------------------------


def test_stepper_steps_and_counters_grow(stepper):
    stepper.configure(Nq=48, Nk=40, d=8, Br=16, Bc=8, order="kv_outer", causal=False, mask="none")
    assert stepper.position == 0 and stepper.done == 3 * 5
    assert stepper.current is None and stepper.bytes_read == 0  # the start: nothing loaded yet
    stepper.step()
    first = stepper.current
    assert (first.i, first.j) == (0, 0) and first.computed
    assert {"Q", "K", "V", "O", "S_ij"} <= set(stepper.sram_live)
    read0 = stepper.bytes_read
    stepper.step()
    assert stepper.position == 2 and stepper.bytes_read > read0
    assert (stepper.current.i, stepper.current.j) == (1, 0)  # K/V outer: i moves fastest
    stepper.back()
    assert stepper.position == 1 and stepper.bytes_read == read0
    stepper.play.value = 5  # the Play widget drives the slider
    assert stepper.position == 5
    assert "step 5 of 15" in stepper.status.value
    assert f"{stepper.bytes_read:,} B" in stepper.counters.value
    assert stepper.tiles.value.count("class='tile sram'") >= 4  # Q, K, V, O tiles + S_ij


@pytest.mark.parametrize("order", ["kv_outer", "q_outer"])
@pytest.mark.parametrize("causal, mask", [(False, "none"), (True, "none"), (False, "BigBird"),
                                          (True, "strided")])
def test_stepper_totals_equal_io_at_the_end(stepper, order, causal, mask):
    stepper.configure(Nq=50, Nk=70, d=8, Br=16, Bc=16, order=order, causal=causal, mask=mask)
    stepper.position = stepper.done
    want = io.flash_forward_hbm_bytes(50, 70, 8, 16, 16, order=order, causal=causal,
                                      block_mask=stepper.block_mask)
    assert (stepper.bytes_read, stepper.bytes_written) == (want["read"], want["written"])
    assert (stepper.bytes_read, stepper.bytes_written) == (stepper.trace.bytes_read,
                                                           stepper.trace.bytes_written)
    assert "✓" in stepper.counters.value
    if mask != "none":
        assert any(not s.computed for s in stepper.trace.steps)


def test_fa1_and_fa2_move_different_O_traffic(stepper):
    o_traffic = {}
    for order in ("kv_outer", "q_outer"):
        stepper.configure(Nq=64, Nk=64, d=16, Br=16, Bc=16, order=order, causal=False, mask="none")
        stepper.position = stepper.done
        o_traffic[order] = stepper.traffic("O")
    Nq_d_bytes = 64 * 16 * 4
    assert o_traffic["q_outer"] == (0, Nq_d_bytes)  # FA2: O written once, never read
    assert o_traffic["kv_outer"] == (4 * Nq_d_bytes, 4 * Nq_d_bytes)  # FA1: Tc round trips


def test_stepper_row_statistics_end_at_the_kernels_logsumexp(stepper):
    stepper.configure(Nq=40, Nk=40, d=8, Br=8, Bc=16, order="q_outer", causal=True, mask="none",
                      row=21)
    rs = stepper.row_stats
    assert rs.row == 21 and rs.tiles_seen[-1] == 2  # keys 0..21 lie in K/V tiles 0 and 1
    np.testing.assert_allclose(rs.L, stepper.L[21], rtol=1e-5)
    assert np.all(np.diff(rs.m[np.isfinite(rs.m)]) >= 0)  # the running max never falls
    stepper.position = stepper.done
    assert f"{rs.m[-1]:.4f}" in stepper.counters.value


def test_stepper_invalid_setting_turns_stepping_off_and_shows_no_old_run():
    s = TileLoopStepper(Nq=64, Nk=64, Br=16, Bc=16)
    s.step()
    s.configure(Nq=100, Nk=100, Br=4, Bc=4)  # 25 x 25 tile pairs: refused
    assert not s.valid and "too many" in s.status.value and "Stepping is off" in s.status.value
    assert s.step_button.disabled and s.back_button.disabled and s.slider.disabled
    assert s.play.disabled and s.trace is None
    assert s.tiles.value == s.counters.value == s.charts.value == s.hbm_panel.value == ""
    s.step()  # the button is off; a call does nothing either
    assert s.position == 0 and s.current is None and "too many" in s.status.value
    s.configure(Br=16, Bc=16)  # valid again: the new run, from its start
    assert s.valid and not s.step_button.disabled and s.done == 49
    assert "Nq = 100" in s.run_info.value and "step 0 of 49" in s.status.value


def test_stepper_charts_have_a_cursor_at_the_position():
    import re

    s = TileLoopStepper(Nq=32, Nk=32, Br=8, Bc=8)
    def cursors():
        return [float(x) for x in re.findall(r"class='fe-cursor' x1='([\d.]+)'", s.charts.value)]
    first = cursors()
    assert len(first) == 3 and len(set(first)) == 1  # one cursor per chart, at position 0
    s.position = s.done
    last = cursors()
    assert all(b > a for a, b in zip(first, last))
    assert "fill:#000" not in s.charts.value and "var(--jp-ui-font-color1" in s.charts.value


def test_stepper_svg_text_follows_the_theme():
    import re

    s = TileLoopStepper()
    svg = s.tiles.value
    fills = re.findall(r"<text[^>]*style='fill:([^;]+);", svg)
    assert fills and all(f.startswith("var(--jp-ui-font-color1") or f == "#1f1f1f" for f in fills)
    headers = re.findall(r"<text[^>]*style='fill:([^;]+);[^>]*>([QKVOLlm]ᵀ?)</text>", svg)
    assert headers and all(f.startswith("var(") for f, _ in headers)  # labels on the background


def test_stepper_follows_the_editor():
    e = BlockMaskEditor(tiles=4, block=16, preset="causal")
    s = TileLoopStepper(state=e.state)
    assert s.controls["Br"].disabled and s.controls["mask"].disabled
    np.testing.assert_array_equal(s.block_mask, e.block_mask.blocks[0, 0])
    e.toggle(3, 0)  # the stepper re-traces the edited mask
    np.testing.assert_array_equal(s.block_mask, e.block_mask.blocks[0, 0])
    assert not s.block_mask[3, 0] and any((st.i, st.j) == (3, 0) and not st.computed
                                          for st in s.trace.steps)
    e.controls["tiles"].value = 6
    assert s.block_mask.shape == (6, 6) and s.controls["Nq"].value == 96
    e.controls["causal"].value = False
    assert not s.controls["causal"].value and s.valid
    sram = SRAMOccupancy(state=e.state)
    assert (sram.controls["Br"].value, sram.controls["Bc"].value) == (16, 16)


def test_widgets_display_a_static_picture_beside_the_live_view():
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    InteractiveShell.instance()
    s = TileLoopStepper(Nq=16, Nk=16, Br=8, Bc=8)
    with capture_output() as cap:
        s._ipython_display_()
    live, picture = cap.outputs
    assert "application/vnd.jupyter.widget-view+json" in live.data
    assert "image/png" in picture.data
    assert b"\x89PNG" == s.static_png()[:4]


def test_stepper_takes_a_block_mask():
    mask = presets.make("sliding window", (64, 64), (16, 16), window=1)
    s = TileLoopStepper(block_mask=mask)
    assert s.controls["mask"].value == "custom" and s.controls["causal"].value
    np.testing.assert_array_equal(s.block_mask, mask.blocks[0, 0])
    skipped = {(st.i, st.j) for st in s.trace.steps if not st.computed}
    assert skipped == {(i, j) for i in range(4) for j in range(4) if not mask.blocks[0, 0, i, j]}
    s.configure(Br=8)  # the custom mask no longer fits the tiling: said, not crashed
    assert "custom block mask" in s.status.value


def test_stepper_refuses_too_many_tiles(stepper):
    stepper.configure(Nq=512, Nk=512, Br=4, Bc=4, mask="none")
    assert "too many" in stepper.status.value


# ----- SRAMOccupancy ---------------------------------------------------------------------


def test_sram_footprint_and_fit_flags():
    w = SRAMOccupancy()
    assert w.footprint == io.sram_footprint(128, 64, 64, "float16", 2)
    assert w.fits and "fits" in w.summary.value
    w.configure(gpu="T4", Br=256, Bc=256, d=128)
    assert not w.fits and w.total_bytes > w.capacity_bytes == 64 * 1024
    assert "does not fit" in w.summary.value
    assert w.largest_tile == io.largest_square_tile("T4", 128, "float16", 2)
    w.configure(Br=w.largest_tile, Bc=w.largest_tile)
    assert w.fits


def test_sram_ties_tile_to_the_papers_M_and_traffic():
    w = SRAMOccupancy(gpu="A100 SXM4 40GB", dtype="float16", d=64, N=2048)
    assert w.paper_M == 164 * 1024 // 2
    assert w.paper_blocks == io.paper_block_sizes(w.paper_M, 64)
    small = w.predicted["FA1 (K/V outer)"]
    w.configure(Br=32, Bc=32)
    assert w.predicted["FA1 (K/V outer)"] > small  # smaller tiles, more HBM passes
    assert w.predicted["standard attention"] == io.standard_attention_hbm_elements(2048, 64) * 2
    assert w.bar.value.startswith("<svg") and w.effect.value.startswith("<svg")
    assert w.static_png()[:4] == b"\x89PNG"  # the saved notebook's picture of both charts


def test_sram_chart_places_a_non_square_tile_where_each_order_depends_on_it():
    """FA1's traffic depends on Bc, FA2's on Br: the chart's marks agree with the table."""
    w = SRAMOccupancy(gpu="A100 SXM4 40GB", Br=128, Bc=64, d=64, N=4096)
    fa1, fa2 = "FA1 (K/V outer)", "FA2 (Q outer)"
    assert w.chart_points[fa1] == (64, w.predicted[fa1])
    assert w.chart_points[fa2] == (128, w.predicted[fa2])
    square = {o: io.flash_forward_hbm_bytes(4096, 4096, 64, B, B, order=o, itemsize=2)["total"]
              for o, B in (("kv_outer", 64), ("q_outer", 128))}
    assert w.predicted[fa1] == square["kv_outer"]  # on the FA1 curve at B = Bc
    assert w.predicted[fa2] == square["q_outer"]  # on the FA2 curve at B = Br
    assert f"{w.predicted[fa1] / 2**20:,.1f} MiB" == "99.0 MiB"


# ----- BlockMaskEditor -------------------------------------------------------------------


def test_editor_toggles_change_density():
    e = BlockMaskEditor(tiles=8, preset="causal")
    assert e.density == pytest.approx(36 / 64) and e.block_mask.is_causal
    e.toggle(7, 0)  # below the diagonal: kept by the causal preset already, now off
    assert e.density == pytest.approx(35 / 64) and not e.blocks[7, 0]
    assert "fe-on" not in e.buttons[7][0]._dom_classes
    assert "0.547" in e.info.value
    e.buttons[7][0].value = True  # what a click in the browser does
    assert e.density == pytest.approx(36 / 64) and "fe-on" in e.buttons[7][0]._dom_classes
    assert isinstance(e.block_mask, BlockMask) and e.block_mask.shape == (8, 8)


def test_editor_causal_flag_skips_tiles_above_the_diagonal_in_every_view():
    """A kept tile wholly above the diagonal is skipped by a causal kernel: its colour, the
    density, the HBM traffic and the speedup all say so, together."""
    e = BlockMaskEditor(tiles=8, preset="causal")
    e.toggle(0, 7)  # above the diagonal
    assert e.blocks[0, 7] and not e.block_mask.blocks[0, 0, 0, 7]
    assert "fe-causal-skip" in e.buttons[0][7]._dom_classes
    assert "fe-on" not in e.buttons[0][7]._dom_classes
    assert e.density == pytest.approx(36 / 64) and "0.562" in e.info.value
    e.apply_preset("dense")  # not causal: every tile computed
    dense_speedup = e.prediction["speedup"]
    e.controls["causal"].value = True
    upper = np.triu(np.ones((8, 8), bool), 1)
    assert all("fe-causal-skip" in e.buttons[i][j]._dom_classes for i, j in zip(*upper.nonzero()))
    assert e.density == pytest.approx(36 / 64)
    p = predict(scaled(e.block_mask, e.model_N), e.d, e.controls["gpu"].value)
    assert e.prediction == p and e.prediction["speedup"] > 1.5 * dense_speedup
    N = e.model_N
    want = io.flash_forward_hbm_bytes(N, N, e.d, N // 8, N // 8, causal=True, itemsize=2)
    assert e.prediction["sparse_bytes"] == want["total"]  # the same as a plain causal pass


def test_editor_slider_keeps_the_clicked_tiles():
    e = BlockMaskEditor(tiles=8, preset="sliding window")
    e.toggle(7, 0)
    e.toggle(5, 4)  # inside the window: kept by the preset, clicked off
    assert e.blocks[7, 0] and not e.blocks[5, 4]
    e.controls["window"].value = 3  # a slider move re-applies the preset...
    assert e.blocks[7, 0] and not e.blocks[5, 4]  # ...and keeps the clicks
    assert e.blocks[6, 3]  # while the wider window is there
    assert "2 tile(s) clicked" in e.clicks_note.value
    assert e.controls["stride"].disabled and not e.controls["window"].disabled
    e.controls["preset"].value = "causal"  # a new preset starts afresh
    assert e.clicked == {} and e.blocks[5, 4]
    np.testing.assert_array_equal(e.blocks, presets.make("causal", (512, 512), (64, 64))
                                  .blocks[0, 0])


def test_editor_check_result_is_marked_stale_when_the_mask_changes():
    e = BlockMaskEditor(tiles=4, preset="causal")
    e.run()
    assert not e.results_stale and "stale" not in e.run_output.value
    e.toggle(3, 0)
    assert e.results_stale and "stale: this result is for the previous mask" in e.run_output.value
    e.toggle(3, 0)  # back to the mask that was checked
    assert not e.results_stale and "stale" not in e.run_output.value


def test_one_colour_meaning_across_widgets():
    from flashedu.viz import mask_editor, render, tile_grid

    assert render.COLORS["done"] in mask_editor.TILE_CSS  # kept tile = computed, as in the stepper
    assert tile_grid.FILL["done"] == render.COLORS["done"]
    assert render.COLORS["sram"] not in mask_editor.TILE_CSS  # orange only means "in SRAM now"


@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_editor_presets(name):
    e = BlockMaskEditor(tiles=8)
    e.apply_preset(name)
    want = presets.make(name, (512, 512), (64, 64), window=1, stride=3, density=0.3, seed=0)
    np.testing.assert_array_equal(e.blocks, want.blocks[0, 0])
    assert e.block_mask.is_causal == (name in ("causal", "sliding window", "strided"))
    assert e.prediction["speedup"] == pytest.approx(1 / e.density, rel=0.02)  # compute-bound
    assert e.blocks.diagonal().all() or name == "dense"  # every query tile sees itself


def test_editor_knobs_and_size():
    e = BlockMaskEditor(tiles=8, preset="sliding window")
    narrow = e.density
    e.apply_preset(window=3)
    assert e.density > narrow
    e.controls["tiles"].value = 4
    assert e.blocks.shape == (4, 4) and e.block_mask.seq_lens == (256, 256)


def test_model_counts_bytes_like_io():
    mask = presets.make("strided", (512, 512), (64, 64))
    p = predict(mask, d=64)
    want = io.flash_forward_hbm_bytes(512, 512, 64, 64, 64, causal=True,
                                      block_mask=mask.blocks[0, 0], itemsize=2)
    assert p["sparse_bytes"] == want["total"] and p["sparse_bytes"] < p["dense_bytes"]
    big = scaled(mask, 8192)
    assert big.block_size == (1024, 1024) and big.density == mask.density


def test_editor_runs_the_check_of_its_machine():
    """On a CPU the backends against the reference; on a GPU the mask timed against dense."""
    e = BlockMaskEditor(tiles=4, preset="BigBird")
    results = e.run()
    if runtime.configure()["gpu"] and not runtime.triton_interpreted():  # it times the GPU
        assert "error" not in results and results["speedup"] > 0, results
        assert results["max_err"] < 2e-2 and "ms" in e.run_output.value
        return
    numpy_result = next(r for r in results if r["backend"] == "numpy")
    assert numpy_result["ok"] and numpy_result["max_err"] < 1e-5
    for r in results:  # triton may be absent, but then it says why
        assert r["ok"] or r["note"].startswith("not run")
    assert "numpy: matches" in e.run_output.value


# ----- compare_trace: the learner's own kernel beside the reference ---------------------------


def _kernel(rescale=True, diagonal=0, tiles=math.ceil, rescale_l=True):
    """A learner's Q-outer flash_forward in the exercise's names, with one bug switched on:
    rescale=False leaves O_i unscaled by alpha (rescale_l=False: l_i); diagonal=k lets query r
    see keys c <= r + k; tiles=lambda x: int(x) drops the last, ragged K/V tile."""

    def flash_forward(Q, K, V, block_q, block_k, causal=False, scale=None):
        Nq, d = Q.shape
        Nk = K.shape[0]
        Br, Bc = block_q, block_k
        scale = 1 / math.sqrt(d) if scale is None else scale
        O = np.zeros_like(Q)
        L = np.zeros(Nq, dtype=Q.dtype)
        for i in range(math.ceil(Nq / Br)):
            r0, r1 = i * Br, min((i + 1) * Br, Nq)
            rows = np.arange(r0, r1)
            Q_i = Q[r0:r1]
            m_i = np.full(r1 - r0, -np.inf, dtype=Q.dtype)
            l_i = np.zeros(r1 - r0, dtype=Q.dtype)
            O_i = np.zeros((r1 - r0, d), dtype=Q.dtype)
            for j in range(tiles(Nk / Bc)):
                c0, c1 = j * Bc, min((j + 1) * Bc, Nk)
                if causal and c0 > r1 - 1 + diagonal:
                    break
                S_ij = scale * (Q_i @ K[c0:c1].T)
                if causal:
                    S_ij = np.where(np.arange(c0, c1)[None, :] <= rows[:, None] + diagonal,
                                    S_ij, -np.inf)
                m_new = np.maximum(m_i, S_ij.max(axis=1))
                P_ij = np.exp(S_ij - m_new[:, None])
                alpha = np.exp(m_i - m_new)
                l_i = (alpha * l_i if rescale_l else l_i) + P_ij.sum(axis=1)
                O_i = (alpha[:, None] * O_i if rescale else O_i) + P_ij @ V[c0:c1]
                m_i = m_new
            O[r0:r1] = O_i / l_i[:, None]
            L[r0:r1] = m_i + np.log(l_i)
        return O, L

    return flash_forward


def _algorithm1(Q, K, V, block_q, block_k, causal=False, scale=None):
    """The paper's Algorithm 1 (K/V outer, O, l, m kept in HBM), as a learner writes it."""
    Nq, d = Q.shape
    Nk = K.shape[0]
    scale = 1 / math.sqrt(d) if scale is None else scale
    O = np.zeros_like(Q)
    l = np.zeros(Nq)
    m = np.full(Nq, -np.inf)
    for j in range(math.ceil(Nk / block_k)):
        c0, c1 = j * block_k, min((j + 1) * block_k, Nk)
        K_j, V_j = K[c0:c1], V[c0:c1]
        for i in range(math.ceil(Nq / block_q)):
            r0, r1 = i * block_q, min((i + 1) * block_q, Nq)
            if causal and c0 > r1 - 1:
                continue
            Q_i, m_i, l_i = Q[r0:r1], m[r0:r1], l[r0:r1]
            S_ij = scale * (Q_i @ K_j.T)
            if causal:
                S_ij = np.where(np.arange(c0, c1)[None, :] <= np.arange(r0, r1)[:, None],
                                S_ij, -np.inf)
            m_ij = S_ij.max(axis=1)
            P_ij = np.exp(S_ij - m_ij[:, None])
            m_new = np.maximum(m_i, m_ij)
            l_new = np.exp(m_i - m_new) * l_i + np.exp(m_ij - m_new) * P_ij.sum(axis=1)
            O[r0:r1] = ((l_i * np.exp(m_i - m_new))[:, None] * O[r0:r1]
                        + np.exp(m_ij - m_new)[:, None] * (P_ij @ V_j)) / l_new[:, None]
            l[r0:r1], m[r0:r1] = l_new, m_new
    return O, m + np.log(l)


def _solution_kernel():
    import nbformat

    nb = nbformat.read(ROOT / "solutions" / "02_flash_forward.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id")
                == "flash_forward")
    namespace = {"math": math, "np": np}
    exec(cell.source, namespace)
    return namespace["flash_forward"]


def _qkv(Nq=40, Nk=50, d=8, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, d)).astype(np.float32) for n in (Nq, Nk, Nk)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["reference FA2", "reference FA1", "solution", "Algorithm 1",
                                  "exercise style"])
def test_compare_trace_agrees_for_correct_kernels(name, causal):
    from functools import partial

    from flashedu.tiled import flash_forward
    from flashedu.viz import compare_trace

    fn = {"reference FA2": flash_forward,
          "reference FA1": partial(flash_forward, order="kv_outer"),
          "solution": _solution_kernel(), "Algorithm 1": _algorithm1,
          "exercise style": _kernel()}[name]
    c = compare_trace(fn, *_qkv(), 16, 16, causal=causal)
    assert c.first_divergence is None, c.first_divergence
    assert len(c.steps) == len(c.reference_steps) == (6 if causal else 12)
    assert all(s.state is not None for s in c.steps)  # m_i, l_i, O_i were seen at every step
    assert c.order == ("kv_outer" if name in ("reference FA1", "Algorithm 1") else "q_outer")


def test_compare_trace_finds_a_missing_rescale_of_O_i():
    from flashedu.viz import compare_trace

    c = compare_trace(_kernel(rescale=False), *_qkv(), 16, 16)
    div = c.first_divergence
    assert div.what == "O_i" and div.step == 2  # the first step where m_i can move
    assert set(div.rows) <= set(range(16)) and "no rescale of O_i by alpha" in div.message
    assert str(div).startswith("step 2: O_i of rows")


def test_compare_trace_finds_a_wrong_causal_diagonal():
    from flashedu.viz import compare_trace

    Q, K, V = _qkv(Nq=40, Nk=50)
    c = compare_trace(_kernel(diagonal=10), Q, K, V, 16, 16, causal=True)  # bottom-right
    div = c.first_divergence
    assert div.step == 1 and div.what == "m_i" and 0 in div.rows
    assert "causal mask" in div.message


def test_compare_trace_finds_a_dropped_last_ragged_tile():
    from flashedu.viz import compare_trace

    c = compare_trace(_kernel(tiles=int), *_qkv(Nq=40, Nk=50), 16, 16)
    div = c.first_divergence
    assert div.what == "tile" and div.step == 4  # Tc = 4: the row's 4th tile is missing
    assert "(i=0, j=3)" in div.message and "ragged K/V tile" in div.message


def test_compare_trace_names_an_error_and_displays_as_a_stepper():
    from flashedu.viz import CompareView, compare_trace

    def crashes(Q, K, V, block_q, block_k, causal=False, scale=None):
        Q_i = Q[:block_q]
        S_ij = Q_i @ K[:block_k].T
        raise IndexError("tile out of range")

    c = compare_trace(crashes, *_qkv(), 16, 16)
    assert c.first_divergence.what == "error" and "IndexError" in str(c.first_divergence)
    bad = compare_trace(_kernel(rescale=False), *_qkv(), 16, 16)
    view = bad.view()
    assert isinstance(view, CompareView) and view.step == 2  # opens at the divergence
    assert "first divergence: step 2" in view.verdict.value
    assert "class='tile mine-now'" in view.grid.value and "differ" in view.table.value
    rows = bad.first_divergence.rows  # the rows that differ are red inside the tile
    assert rows and view.grid.value.count("class='row-differs'") == len(rows)
    view.step_button.click()
    assert view.step == 3 and "step 3 of 12" in view.table.value
    assert "row-differs" not in view.grid.value


def test_divergence_hint_for_a_graders_message():
    from flashedu.viz.learner_trace import divergence_hint

    Q, K, V = _qkv()
    assert divergence_hint(_kernel(), Q, K, V, 16, 16) is None
    hint = divergence_hint(_kernel(rescale=False), Q, K, V, 16, 16)
    assert hint.startswith("step 2: O_i of rows") and "open the stepper at step 2" in hint


def test_compare_trace_of_a_kernel_that_hides_its_tiles_compares_the_result():
    from flashedu.tiled import flash_forward
    from flashedu.trace import Trace
    from flashedu.viz import compare_trace

    def plain(Q, K, V, block_q, block_k, causal=False, scale=None):
        # plain arrays and a trace of its own: nobody sees its tiles, only its result
        O, L = flash_forward(np.asarray(Q), np.asarray(K), np.asarray(V), block_q, block_k,
                             causal, scale, trace=Trace())
        return O * (1 + 1e-2), L

    c = compare_trace(plain, *_qkv(), 16, 16)
    assert c.steps == [] and "Only the result is compared" in c.notes[0]
    assert c.first_divergence.what == "O" and str(c.first_divergence).startswith("at the end")


@pytest.mark.parametrize("product", ["Q_i.dot(K_j.T)", "np.dot(Q_i, K_j.T)",
                                     "np.einsum('id,jd->ij', Q_i, K_j)"])
def test_compare_trace_sees_every_way_of_writing_the_product(product):
    from flashedu.viz import compare_trace

    def fn(Q, K, V, block_q, block_k, causal=False, scale=None):
        O, L = np.zeros_like(Q), np.zeros(len(Q), Q.dtype)
        for i in range(math.ceil(len(Q) / block_q)):
            rows = slice(i * block_q, (i + 1) * block_q)
            Q_i = Q[rows]
            m_i = np.full(len(Q_i), -np.inf)
            l_i, O_i = np.zeros(len(Q_i)), np.zeros((len(Q_i), Q.shape[1]))
            for j in range(math.ceil(len(K) / block_k)):
                K_j, V_j = K[j * block_k:(j + 1) * block_k], V[j * block_k:(j + 1) * block_k]
                S_ij = eval(product) / math.sqrt(Q.shape[1])
                m_new = np.maximum(m_i, S_ij.max(axis=1))
                P_ij, alpha = np.exp(S_ij - m_new[:, None]), np.exp(m_i - m_new)
                l_i, O_i, m_i = alpha * l_i + P_ij.sum(1), alpha[:, None] * O_i + P_ij @ V_j, m_new
            O[rows], L[rows] = O_i / l_i[:, None], m_i + np.log(l_i)
        return O, L

    c = compare_trace(fn, *_qkv(), 16, 16)
    assert len(c.steps) == 12 and c.first_divergence is None


# ----- compare_trace says first what is true -----------------------------------------------


def _p_v_transposed(Q, K, V, Br, Bc):
    """A learner's forward that multiplies P_ij by V_j.T: a shape error at step 1."""
    O, L = np.zeros_like(Q), np.zeros(len(Q))
    for i in range(math.ceil(len(Q) / Br)):
        Q_i = Q[i * Br:(i + 1) * Br]
        m_i, l_i = np.full(len(Q_i), -np.inf), np.zeros(len(Q_i))
        O_i = np.zeros((len(Q_i), Q.shape[1]))
        for j in range(math.ceil(len(K) / Bc)):
            K_j, V_j = K[j * Bc:(j + 1) * Bc], V[j * Bc:(j + 1) * Bc]
            S_ij = Q_i @ K_j.T / math.sqrt(Q.shape[1])
            m_new = np.maximum(m_i, S_ij.max(axis=1))
            P_ij = np.exp(S_ij - m_new[:, None])
            alpha = np.exp(m_i - m_new)
            l_i = alpha * l_i + P_ij.sum(axis=1)
            O_i = alpha[:, None] * O_i + P_ij @ V_j.T
            m_i = m_new
        O[i * Br:(i + 1) * Br], L[i * Br:(i + 1) * Br] = O_i / l_i[:, None], m_i + np.log(l_i)
    return O, L


def _renamed(Q, K, V, Br, Bc):
    """A correct Q-outer forward in the learner's own names, not the paper's."""
    O, L = np.zeros_like(Q), np.zeros(len(Q))
    for i in range(math.ceil(len(Q) / Br)):
        q = Q[i * Br:(i + 1) * Br]
        row_max, denom = np.full(len(q), -np.inf), np.zeros(len(q))
        acc_out = np.zeros((len(q), Q.shape[1]))
        for j in range(math.ceil(len(K) / Bc)):
            k, v = K[j * Bc:(j + 1) * Bc], V[j * Bc:(j + 1) * Bc]
            s = q @ k.T / math.sqrt(Q.shape[1])
            new_max = np.maximum(row_max, s.max(axis=1))
            p = np.exp(s - new_max[:, None])
            a = np.exp(row_max - new_max)
            denom, acc_out, row_max = a * denom + p.sum(1), a[:, None] * acc_out + p @ v, new_max
        O[i * Br:(i + 1) * Br], L[i * Br:(i + 1) * Br] = acc_out / denom[:, None], \
            row_max + np.log(denom)
    return O, L


def _o_renamed(Q, K, V, Br, Bc):
    """A correct Q-outer forward with the paper's m_i and l_i, and its own name for O_i."""
    O, L = np.zeros_like(Q), np.zeros(len(Q))
    for i in range(math.ceil(len(Q) / Br)):
        Q_i = Q[i * Br:(i + 1) * Br]
        m_i, l_i = np.full(len(Q_i), -np.inf), np.zeros(len(Q_i))
        acc_out = np.zeros((len(Q_i), Q.shape[1]))
        for j in range(math.ceil(len(K) / Bc)):
            K_j, V_j = K[j * Bc:(j + 1) * Bc], V[j * Bc:(j + 1) * Bc]
            S_ij = Q_i @ K_j.T / math.sqrt(Q.shape[1])
            m_new = np.maximum(m_i, S_ij.max(axis=1))
            P_ij, alpha = np.exp(S_ij - m_new[:, None]), np.exp(m_i - m_new)
            l_i, acc_out, m_i = alpha * l_i + P_ij.sum(1), alpha[:, None] * acc_out + P_ij @ V_j, \
                m_new
        O[i * Br:(i + 1) * Br], L[i * Br:(i + 1) * Br] = acc_out / l_i[:, None], m_i + np.log(l_i)
    return O, L


def _svg_texts(svg: str):
    """(x, text, size, anchor) of each <text> of an SVG, and the SVG's width."""
    import html as html_
    import re

    width = float(re.search(r"<svg[^>]* width='([\d.]+)'", svg).group(1))
    texts = [(float(x), html_.unescape(t), float(size), anchor) for x, anchor, size, t in
             re.findall(r"<text[^>]* x='([-\d.]+)'[^>]* text-anchor='(\w+)'[^>]*"
                        r"font-size:([\d.]+)px[^>]*>([^<]*)</text>", svg)]
    return width, texts


def test_compare_trace_says_the_learners_exception_first_with_their_line():
    import inspect

    from flashedu.viz import compare_trace

    c = compare_trace(_p_v_transposed, *_qkv(), 16, 16)
    lines, first = inspect.getsourcelines(_p_v_transposed)
    lineno = first + next(n for n, line in enumerate(lines) if "P_ij @ V_j.T" in line)
    div = c.first_divergence
    assert div.what == "error" and div.step == 1 and isinstance(c.exception, ValueError)
    assert str(div).startswith("your function raised ValueError: matmul")
    assert f"{__file__}, line {lineno}: O_i = alpha[:, None] * O_i + P_ij @ V_j.T" in str(div)
    assert "m_i of rows" not in str(div) and "-inf" not in str(div)  # a half-made step
    assert repr(c).startswith("<TraceComparison: your function raised ValueError")
    assert str(c) == repr(c)
    view = c.view()
    assert view.widget.children[0] is view.verdict  # the first thing the widget shows
    verdict = view.verdict.value
    assert verdict.index("ValueError") < verdict.index("P_ij @ V_j.T") < verdict.index("step 1")
    assert "raised ValueError during this step" in view.table.value
    assert "differ" not in view.table.value


def test_compare_trace_names_the_notebook_cell_that_raised(monkeypatch):
    import types

    import IPython

    from flashedu.viz import compare_trace

    cells = {__file__: ("Cell", "In[7]")}  # as IPython names the code of a cell
    shell = types.SimpleNamespace(compile=types.SimpleNamespace(format_code_name=cells.get))
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    c = compare_trace(_p_v_transposed, *_qkv(), 16, 16)
    verdict = str(c.first_divergence)
    assert "- at Cell In[7], line " in verdict
    assert verdict.index("Cell In[7]") < verdict.index("P_ij @ V_j.T")


def test_compare_trace_names_minus_inf_and_nan_instead_of_a_huge_gap():
    from flashedu.viz import compare_trace

    # query 0 sees no key (c < 0): its m_i is -inf, its l_i NaN, where the reference's are finite
    with np.errstate(all="ignore"):
        c = compare_trace(_kernel(diagonal=-1), *_qkv(), 16, 16, causal=True)
    div = c.first_divergence
    ref_m0 = c.reference_steps[0].state["m"][0]
    assert div.step == 1 and div.what == "m_i" and div.rows[0] == 0
    assert f"yours -inf in row 0, where the reference is {ref_m0:.5g}" in str(div)
    view = c.view()
    assert view.row_box.value == 0
    assert "e+308" not in view.table.value + str(div) and "gap inf" not in view.table.value
    assert "yours NaN in row 0, where the reference is" in view.table.value  # l_i
    ref_m, my_m = view.chart_data["m_i"]
    assert my_m[1] == -np.inf and np.isfinite(ref_m[1])  # the values charted
    assert "fe-non-finite" in view.charts.value and ">-inf</text>" in view.charts.value
    assert ">NaN</text>" in view.charts.value  # l_i and O_i / l_i


@pytest.mark.parametrize("scale, words", [
    (1.0, ["S_ij is not scaled by 1/sqrt(d)", "is 2.828 = sqrt(d) for d = 8"]),
    (1 / 8, ["1/sqrt(d) is applied twice", "is 0.3536 = 1/sqrt(d) for d = 8"])],
    ids=["missing", "twice"])
def test_compare_trace_recognises_a_missing_or_doubled_scale(scale, words):
    from functools import partial

    from flashedu.viz import compare_trace

    c = compare_trace(partial(_kernel(), scale=scale), *_qkv(), 16, 16)
    div = c.first_divergence
    assert div.step == 1 and div.what == "m_i" and div.rows == tuple(range(16))
    for w in words:
        assert w in str(div), str(div)
    assert "m_new = max" not in str(div)
    # with the learner's own names only the result is compared, and the hint still comes
    no_scale = compare_trace(lambda Q, K, V, Br, Bc: _renamed(Q * math.sqrt(8), K, V, Br, Bc),
                             *_qkv(), 16, 16)
    assert no_scale.first_divergence.what == "O"
    assert "S_ij is not scaled by 1/sqrt(d)" in str(no_scale.first_divergence)


@pytest.mark.parametrize("rescale, rescale_l, what, words", [
    (False, True, "O_i", "no rescale of O_i by alpha = exp(m_i - m_new): O_i = alpha * O_i"),
    (True, False, "l_i", "no rescale of l_i by alpha = exp(m_i - m_new): l_i = alpha * l_i"),
    (False, False, "l_i", "no rescale of l_i and O_i by alpha")], ids=["O_i", "l_i", "both"])
def test_compare_trace_recognises_a_missing_rescale_by_alpha(rescale, rescale_l, what, words):
    from flashedu.viz import compare_trace

    c = compare_trace(_kernel(rescale=rescale, rescale_l=rescale_l), *_qkv(), 16, 16)
    div = c.first_divergence
    assert div.step == 2 and div.what == what and words in str(div), str(div)
    assert "?" not in str(div)  # a mistake named, not a question


@pytest.mark.parametrize("diagonal, words", [
    (-1, "yours hides c = r too, as c < r does"), (1, "yours also shows it key c = r + 1")],
    ids=["c < r", "c <= r + 1"])
def test_compare_trace_recognises_an_off_by_one_causal_diagonal(diagonal, words):
    from flashedu.viz import compare_trace

    with np.errstate(all="ignore"):
        c = compare_trace(_kernel(diagonal=diagonal), *_qkv(), 16, 16, causal=True)
    div = c.first_divergence
    assert div.step == 1 and div.what == "m_i"
    assert "the causal mask is off by one" in str(div) and words in str(div), str(div)


def test_compare_view_charts_O_i_where_m_i_and_l_i_agree():
    from flashedu.viz import compare_trace

    view = compare_trace(_kernel(rescale=False), *_qkv(), 16, 16).view()
    row = view.row_box.value
    assert view.comparison.first_divergence.rows[0] == row
    for name in ("m_i", "l_i"):  # same: the m_i and l_i charts cannot show the mistake
        ref, mine = view.chart_data[name]
        assert np.allclose(ref[1:13], mine[1:13])
    ref_O, my_O = view.chart_data["O_i"]
    column = view.chart_data["O_i column"]
    assert np.isclose(ref_O[1], my_O[1]) and not np.isclose(ref_O[2], my_O[2], atol=1e-3)
    ref_state = view.comparison.reference_steps[1].state
    assert np.isclose(ref_O[2], ref_state["O"][row, column] / ref_state["l"][row])
    assert "fe-o-chart" in view.charts.value
    assert f"row {row}: O_i / l_i, column {column}" in view.charts.value


@pytest.mark.parametrize("kernel, causal", [(_kernel(rescale=False), False),
                                            (_kernel(diagonal=-1), True)],
                         ids=["O_i of some rows", "m_i of some rows"])
def test_compare_view_table_and_verdict_name_the_same_rows(kernel, causal):
    from flashedu.viz import compare_trace
    from flashedu.viz.learner_trace import _ranges

    with np.errstate(all="ignore"):
        c = compare_trace(kernel, *_qkv(), 16, 16, causal=causal)
    div = c.first_divergence
    rows = _ranges(div.rows)
    assert rows != "0..15" and f"{div.what} of rows {rows} differ" in str(div)
    view = c.view()
    label = "O_i / l_i" if div.what == "O_i" else div.what
    assert f"<td>{label}</td><td colspan=2 style='color:var(--jp-error-color1, #c62828)'>" \
           f"rows {rows} differ (of 0..15)" in view.table.value


def test_compare_trace_with_the_learners_own_names_says_what_was_compared():
    from flashedu.viz import compare_trace

    c = compare_trace(_renamed, *_qkv(), 16, 16)
    assert c.first_divergence is None and all(s.state is None for s in c.steps)
    assert "at every step" not in c.verdict and "agrees with the reference at all" not in c.verdict
    assert c.verdict.startswith("your tiles at all 12 steps and your final O and L agree")
    assert "Only the tiles and the final O, L were compared" in c.verdict
    assert "named m_i, l_i, O_i" in c.verdict
    assert "acc_out" in c.verdict and "row_max" in c.verdict and "denom" in c.verdict
    assert c.verdict in repr(c)
    verdict = c.view().verdict.value
    assert "Only the tiles and the final O, L were compared" in verdict and "row_max" in verdict
    assert "<small" not in verdict  # said plainly, not as a footnote


def test_compare_trace_says_when_only_O_i_was_not_found():
    from flashedu.viz import compare_trace

    c = compare_trace(_o_renamed, *_qkv(), 16, 16)
    assert c.first_divergence is None and all("O" not in s.state for s in c.steps)
    assert c.verdict.startswith("your trace agrees with the reference at all 12 steps")
    assert "O_i was compared only at the end" in c.verdict and "acc_out" in c.verdict
    view = c.view()
    assert "<td>O_i</td><td colspan=2>not found at this step</td>" in view.table.value
    assert "same in rows 0..15" in view.table.value  # m_i and l_i


@pytest.mark.parametrize("Nk", [16, 50, 200])
def test_compare_view_legend_and_chart_text_are_whole(Nk):
    from flashedu.viz import compare_trace

    view = compare_trace(_kernel(rescale=False), *_qkv(Nk=Nk), 16, 16).view()
    svgs = [view.grid.value] + view.charts.value.split("</svg>")[:-1]
    assert "orange" in svgs[0] and "red dashes" in svgs[0]
    for svg in svgs:
        width, texts = _svg_texts(svg + ("" if svg.endswith("</svg>") else "</svg>"))
        for x, text, size, anchor in texts:
            w = 0.6 * size * len(text)  # a generous width of a sans-serif character
            x0 = {"start": x, "middle": x - w / 2, "end": x - w}[anchor]
            assert 0 <= x0 and x0 + w <= width, (text, x0, w, width)


def test_compare_trace_leaves_no_library_warning_in_the_learners_output():
    import warnings

    from flashedu.viz import compare_trace

    def casts(Q, K, V, Br, Bc):
        O, L = _kernel()(Q, K, V, Br, Bc)
        counts = np.zeros_like(Q, dtype=np.int64)
        counts[:Br] = np.where(O[:Br] > 0, np.nan, 1.0)  # the learner's own cast of a NaN
        return O, L

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = compare_trace(casts, *_qkv(), 16, 16)
        view = c.view()
        view.step_button.click()
        bad = compare_trace(_kernel(diagonal=-1), *_qkv(), 16, 16, causal=True)
        bad.view().step_button.click()
    assert c.first_divergence is None
    library = [w for w in caught if "flashedu" in Path(w.filename).parts]
    assert not library, [f"{w.filename}:{w.lineno}: {w.message}" for w in library]
    cast = [w for w in caught if "encountered in cast" in str(w.message)]
    assert cast and all(w.filename == __file__ for w in cast)  # shown at the learner's line


# ----- linked widgets: one honest state ------------------------------------------------------


def test_editor_slider_leaves_the_learners_causal_choice():
    e = BlockMaskEditor(tiles=8, preset="sliding window")
    e.controls["causal"].value = False  # the learner unticks it
    e.controls["window"].value = 3
    assert not e.controls["causal"].value and not e.block_mask.is_causal
    e.controls["tiles"].value = 6
    e.controls["preset"].value = "strided"
    assert not e.controls["causal"].value and "your choice" in e.info.value


def test_editor_stale_note_follows_the_density():
    e = BlockMaskEditor(tiles=4, preset="causal")
    e.run()
    e.toggle(3, 0)
    e.toggle(2, 0)
    assert e.results_stale and f"now {e.density:.3f})" in e.run_output.value


def test_stepper_saved_picture_follows_the_view():
    class Handle:
        def update(self, bundle, raw):
            self.caption = bundle["text/plain"]

    s = TileLoopStepper(Nq=32, Nk=32, Br=8, Bc=8)
    s._static_handle = Handle()
    s.position = s.done
    assert f"step {s.done} of {s.done}" in s._static_handle.caption
    s.back()
    assert f"step {s.done - 1} of {s.done}" in s._static_handle.caption


def test_linked_stepper_shows_the_mask_and_no_tile_at_position_0():
    e = BlockMaskEditor(tiles=4, block=16, preset="sliding window")
    s = TileLoopStepper(state=e.state)
    s.position = 0
    svg = s.tiles.value
    n_skipped = int((~e.block_mask.blocks[0, 0]).sum())
    assert n_skipped > 0 and svg.count("class='tile skipped'") == n_skipped
    assert "current" not in svg and "class='tile sram'" not in svg and s.current is None


def test_sram_capacity_line_has_its_own_colour_on_top_of_the_bars():
    w = SRAMOccupancy(gpu="T4", Br=256, Bc=256, d=128)  # over capacity: the line inside a bar
    bar = w.drawings[0]
    kinds = [(s[0], s[-1] if s[0] == "line" else s[-3]) for s in bar.shapes]
    buffers = [i for i, (k, cls) in enumerate(kinds) if k == "rect" and cls == "fe-buffer"]
    (line,) = [i for i, (k, cls) in enumerate(kinds) if k == "line" and cls == "fe-capacity"]
    assert len(buffers) == len(w.footprint)
    assert bar.shapes[line][5] not in {bar.shapes[i][5] for i in buffers}  # stroke vs fills
    assert line > max(buffers)  # drawn after them: on top
    assert "SM capacity (exceeded)" in w.bar.value


def test_sram_charts_follow_the_theme_with_legible_legends():
    """The charts are inline SVG whose text takes JupyterLab's theme colours, legends at 11 px,
    not white PNGs with 5 px legends in the dark theme."""
    w = SRAMOccupancy()
    for svg in (w.bar.value, w.effect.value):
        assert "var(--jp-ui-font-color1" in svg and "image/png" not in svg
        sizes = [int(x) for x in re.findall(r"class='fe-legend'[^>]*font-size:(\d+)px", svg)]
        assert sizes and min(sizes) >= 11
    legend = re.findall(r"class='fe-legend'[^>]*>([^<]+)<", w.effect.value)
    assert legend[:3] == ["FA1 (K/V outer)", "FA2 (Q outer)", "standard attention"]
    assert "your tile 128 x 64" in legend and "largest fitting B = 112" in legend


def test_linked_stepper_takes_long_masks_and_names_only_enabled_controls():
    e = BlockMaskEditor(tiles=12, block=128, preset="causal")
    s = TileLoopStepper(state=e.state)
    assert s.valid and s.controls["Nq"].value == 1536 and s.done == 144
    s.configure(Br=64)  # a tiling the editor's mask does not fit
    assert not s.valid and "Br" not in s.status.value.split("needs")[1]
    assert "block-mask editor" in s.status.value


def test_linked_widgets_describe_one_problem():
    e = BlockMaskEditor(tiles=4, block=64, preset="causal", d=64, gpu="H100 SXM5")
    s = TileLoopStepper(state=e.state)
    w = SRAMOccupancy(state=e.state)
    v = {k: c.value for k, c in w.controls.items()}
    assert (v["gpu"], v["d"], v["dtype"], v["N"]) == ("H100 SXM5", 64, "float16", e.model_N)
    assert (v["Br"], v["Bc"]) == e.block_mask.block_size and s.controls["d"].value == 64
    w.controls["gpu"].value = "A100 SXM4 40GB"  # a change in one linked view reaches the others
    assert e.controls["gpu"].value == "A100 SXM4 40GB" and e.state.problem["gpu"] == e.controls[
        "gpu"].value
    assert e.prediction == predict(scaled(e.block_mask, e.model_N), 64, "A100 SXM4 40GB")
    w.controls["d"].value = 128  # the stepper traces d <= 64: it says so
    assert e.d == 128 and "d = 64" in s.linked_note.value and "float32" in s.linked_note.value
    assert "A100 SXM4 40GB" in s.linked_note.value and f"N = {e.model_N}" in s.linked_note.value


def test_stepper_slider_and_status_say_the_same_step():
    s = TileLoopStepper(Nq=32, Nk=32, Br=16, Bc=16)
    assert s.slider.description == "step" and "step 0 of 4" in s.status.value
    for k in range(1, s.done + 1):
        s.slider.value = k
        assert f"step {k} of {s.done}:" in s.status.value
    assert "final writes" in s.status.value


def test_editor_counts_tiles_that_differ_from_the_preset():
    e = BlockMaskEditor(tiles=8, preset="causal")
    e.toggle(7, 0)
    e.toggle(7, 0)  # toggled back: the same as the preset
    e.toggle(0, 7)
    assert e.clicked_count == 1 and "1 tile(s) clicked" in e.clicks_note.value
    e.toggle(0, 7)
    assert e.clicks_note.value == ""


def _area(points) -> float:
    xs, ys = np.array(points).T
    return abs(np.dot(xs, np.roll(ys, 1)) - np.dot(ys, np.roll(xs, 1))) / 2


def test_tiles_are_drawn_as_they_are_ragged_edges_and_the_causal_diagonal():
    """A tile of a ragged edge is as short as its rows; inside a tile the diagonal crosses, the
    masked elements (column > row) are one staircase of exactly their area."""
    from flashedu.viz.tile_grid import drawing

    s = TileLoopStepper(Nq=50, Nk=40, Br=16, Bc=16, causal=True)
    d = drawing(s.timeline, s.done)
    tiles = {sh[10].split("'")[1]: sh for sh in d.shapes if sh[0] == "rect" and sh[10]}
    u = tiles["S0,0"][3]
    assert tiles["S3,0"][4] == pytest.approx(u * 2 / 16)  # rows 48..49 of 50
    assert tiles["K2"][3] == pytest.approx(u * 8 / 16)  # keys 32..39 of 40
    assert tiles["Q3"][4] == pytest.approx(u * 2 / 16)
    stairs = [sh[1] for sh in d.shapes if sh[0] == "polygon" and sh[-1] == "causal-masked"]
    # (0, 0), (1, 1): 16 x 16 with 120 masked; (2, 2): rows 32..47 x keys 32..39, 28 masked
    areas = sorted(_area(p) / (u * u / 256) for p in stairs)
    assert areas == pytest.approx([28, 120, 120])


def test_rows_that_differ_are_marked_inside_the_current_tile():
    from flashedu.viz.tile_grid import drawing

    s = TileLoopStepper(Nq=40, Nk=32, Br=16, Bc=16)
    at = next(p for p in range(1, s.done + 1) if s.timeline.step_at(p).i == 2)
    d = drawing(s.timeline, at, marks=[33, 35, 3])  # row 3 is not in tile i = 2
    bars = [sh for sh in d.shapes if sh[0] == "rect" and sh[9] == "row-differs"]
    assert len(bars) == 2
    tile = next(sh for sh in d.shapes if sh[0] == "rect" and "current" in sh[9])
    rows = {round((b[2] - tile[2]) / (tile[4] / 8)) for b in bars}
    assert rows == {1, 3}  # rows 33 and 35 of the tile's 32..39
