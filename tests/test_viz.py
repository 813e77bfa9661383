"""Headless tests of the flashedu.viz widgets: drive their controls, check their state.

The browser test (test_browser.py) checks that they render; these check that what they show
is right: the stepper's counters are the trace's, and equal flashedu.io's count at the end.
"""

import numpy as np
import pytest

pytest.importorskip("ipywidgets")

from flashedu import io
from flashedu.masks import BlockMask
from flashedu.viz import BlockMaskEditor, SRAMOccupancy, TileLoopStepper, presets
from flashedu.viz.block_sparse import predict, scaled


@pytest.fixture(scope="module")
def stepper():
    return TileLoopStepper()


# ----- TileLoopStepper -------------------------------------------------------------------


def test_stepper_steps_and_counters_grow(stepper):
    stepper.configure(Nq=48, Nk=40, d=8, Br=16, Bc=8, order="kv_outer", causal=False, mask="none")
    assert stepper.position == 0 and stepper.done == 3 * 5
    first = stepper.current
    assert (first.i, first.j) == (0, 0) and first.computed
    assert {"Q", "K", "V", "O", "S_ij"} <= set(stepper.sram_live)
    read0 = stepper.bytes_read
    stepper.step()
    assert stepper.position == 1 and stepper.bytes_read > read0
    assert (stepper.current.i, stepper.current.j) == (1, 0)  # K/V outer: i moves fastest
    stepper.back()
    assert stepper.position == 0 and stepper.bytes_read == read0
    stepper.play.value = 4  # the Play widget drives the slider
    assert stepper.position == 4
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
    assert w.bar.value[:4] == b"\x89PNG" and w.effect.value[:4] == b"\x89PNG"


# ----- BlockMaskEditor -------------------------------------------------------------------


def test_editor_toggles_change_density():
    e = BlockMaskEditor(tiles=8, preset="causal")
    assert e.density == pytest.approx(36 / 64) and e.block_mask.is_causal
    e.toggle(0, 7)
    assert e.density == pytest.approx(37 / 64) and e.blocks[0, 7]
    assert "fe-on" in e.buttons[0][7]._dom_classes  # coloured as kept
    assert "0.578" in e.info.value
    e.buttons[0][7].value = False  # what a click in the browser does
    assert e.density == pytest.approx(36 / 64)
    assert isinstance(e.block_mask, BlockMask) and e.block_mask.shape == (8, 8)


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


def test_editor_runs_a_cpu_check():
    e = BlockMaskEditor(tiles=4, preset="BigBird")
    results = e.run()
    numpy_result = next(r for r in results if r["backend"] == "numpy")
    assert numpy_result["ok"] and numpy_result["max_err"] < 1e-5
    for r in results:  # triton may be absent, but then it says why
        assert r["ok"] or r["note"].startswith("not run")
    assert "numpy: matches" in e.run_output.value
