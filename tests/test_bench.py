"""`flashedu bench` and its subcommands: arguments refused before any work, the shared core
(shapes, FLOPs, records, tables), and each subcommand run on a tiny problem: on a CPU where it
can run there (numpy, decode --dry-run, correctness --smoke, notebooks, paper --cpu-dry-run in
tests/test_paper_repro.py), on a GPU for the rest (`pytest -m gpu tests/test_bench.py`; the
recorded full-size runs are in BENCHMARKS.md)."""

import json
import os
import re
import time

import numpy as np
import pytest
import torch

from flashedu import bench, cli
from flashedu.benchmarks import peers
from flashedu.benchmarks import core, overhead

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="times a CUDA GPU; none is visible here")
GPU_ONLY = ["overhead", "numba", "gpt", "tune", "speed", "forward", "correctness", "decode",
            "paper", "mods", "transformers"]


def run(argv, capsys):
    code = cli.main(["bench", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


# ----------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--n", "-5"], ["--n", "0"], ["--n", "abc"], ["--d", "300"], ["--d", "0"],
    ["--density", "2"], ["--density", "0"], ["--density", "-0.5"], ["--causal", "maybe"],
    ["--modes", "sideways"], ["--dtype", "int8"], ["--providers", "nobody"],
    ["--providers", "baseline"], ["--baseline", "/no/such/folder"],
    ["--json", os.path.join(__file__, "x.json")], ["--plot", "/"],
    ["overhead", "--shapes", "huge"], ["overhead", "--iters", "0"], ["overhead", "--iters", "-3"],
    ["overhead", "--causal", "maybe"], ["overhead", "--rounds", "0"], ["overhead", "--modes", "bwd"],
    ["overhead", "--providers", "naive"], ["overhead", "--dtype", "float64"],
    ["numpy", "--n", "0"], ["numpy", "--block", "x"], ["numpy", "--repeats", "-1"],
    ["decode", "--nk", "0"], ["decode", "--d", "512"], ["decode", "--dtype", "int8"],
    ["decode", "--heads", "6", "--kv-heads", "4"], ["decode", "--num-splits", "0"],
    ["gpt", "--seq-lens", "512,abc"], ["gpt", "--seq-lens", "0"], ["gpt", "--methods", "flash3"],
    ["gpt", "--steps", "0"], ["gpt", "--seq-lens", "4096", "--tokens-per-step", "1024"],
    ["numba", "everything"], ["numba"], ["numba", "check", "--log-dir", __file__],
    ["correctness", "--cases", "x"],
    ["paper", "--parts", "fig9"], ["paper", "--ncu-timeout", "0"], ["paper", "--out", __file__],
    ["paper"],
    ["tune", "--d", "0"], ["tune", "--causal", "2"], ["tune", "--n", "-1"],
    ["tune", "--dropout", "1"], ["tune", "--dropout", "x"],
    ["speed", "sideways"], ["speed", "regress", "--d", "96"], ["speed", "regress", "--n", "0"],
    ["forward"], ["forward", "--prev", "/no/such/forward.py"],
    ["forward", "--prev", __file__, "--only", "warp_drive"],
    ["notebooks", "/no/such.ipynb"], ["notebooks", "--timeout", "0"],
    ["mods", "--n", "0"], ["mods", "--windows", "-1"], ["mods", "--docs", "x"],
    ["mods", "--cap", "0"], ["mods", "--d", "300"], ["mods", "--dtype", "int8"],
    ["transformers", "--methods", "flash3"], ["transformers", "--heads", "6"],
    ["transformers", "--kv-heads", "3"], ["transformers", "--steps", "0"],
    ["fa3", "--set", "FOO=1"], ["fa3", "--set", "STAGES=two"], ["fa3", "--d", "96"],
    ["fa3", "--rounds", "0"],
])
def test_bench_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_every_subcommand_has_help(capsys):
    for name in bench.SUBCOMMANDS:
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", name, "--help"])
        assert exc.value.code == 0
        assert f"flashedu bench {name}" in capsys.readouterr().out, name


def test_bench_parses_good_arguments(tmp_path):
    args = bench.parse_args(["--n", "1024", "2048", "--d", "64", "--causal", "TRUE", "no",
                             "--density", "1", "0.25", "--providers", "sdpa-flash"])
    assert args.n == [1024, 2048] and args.d == [64] and args.causal == [True, False]
    assert args.density == [1.0, 0.25] and args.providers == ["flashedu", "sdpa-flash"]
    (tmp_path / "__init__.py").write_text("")
    args = bench.parse_args(["--baseline", str(tmp_path)])
    assert args.providers[:2] == ["flashedu", "baseline"]
    over = overhead.parse_args(["--shapes", "gpt", "--causal", "false", "--iters", "7",
                                "--rounds", "9"])
    assert over.shapes == ["gpt"] and over.causal == [False] and over.iters == 7
    assert over.rounds == 9
    assert over.providers[0] == "flashedu" and set(over.modes) == {"fwd", "fwd+bwd"}
    from flashedu.benchmarks import fa3

    sweep = fa3.parse_args(["--d", "64", "--set", "STAGES=4", "PINGPONG=0"])
    assert sweep.d == [64] and dict(sweep.set) == {"STAGES": 4, "PINGPONG": False}


def test_fa3_bench_reads_the_matmul_in_its_rounds_by_its_own_flops():
    """The matrix product timed among a case's columns counts 2 * 8192^3 FLOPs, a backward
    column the backward's, every other column the forward's; the printed line ends with the
    product's TFLOP/s and the forward's share of it."""
    from flashedu.benchmarks import fa3

    ms = {"fa3": 2.0, "sdpa-cudnn bwd": 4.0, "matmul": 1.5, "flashedu bwd": 5.0}
    got = fa3.case_tflops(ms, fwd_flops=8e12, bwd_flops=20e12)
    assert got["fa3"] == pytest.approx(4000)
    assert got["matmul"] == pytest.approx(2 * 8192 ** 3 / 1.5e9)
    assert got["sdpa-cudnn bwd"] == pytest.approx(5000)
    assert got["flashedu bwd"] == pytest.approx(4000)
    t = {**got, "sdpa-cudnn": 3200.0, "triton bwd": 3000.0}
    line = fa3.table_line({"d": 128, "N": 4096, "causal": False, "tflops": t}, ["fa3", "flex"])
    assert len(line) == 3 + 2 + len(fa3.TAIL)
    assert line[:5] == [128, 4096, False, "4000", "-"]  # flex did not run: "-"
    assert line[-2:] == [f"{got['matmul']:.0f}", f"{4000 / got['matmul']:.3f}"]


def test_overhead_providers_take_turns_and_keep_their_best_round(monkeypatch):
    """Each round runs every provider's calls in turn (a slow spell of the host then hits all
    of that round), and each provider keeps its fastest round: here provider "a" is slow only
    in its first round, provider "b" only in its second."""
    import torch

    clock, order = [0.0], []
    slow = {("a", 0), ("b", 1)}
    seen = {"a": 0, "b": 0}

    def call(name, iters):
        def fn():
            order.append(name)
            rnd = (seen[name] - 3) // (2 * iters)  # after 3 warm-up calls; 2 passes a round
            seen[name] += 1
            clock[0] += 5e-6 if (name, rnd) in slow else 1e-6
        return fn, []

    monkeypatch.setattr(overhead.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(overhead.core, "time_ms", lambda fn, grad_to_none=None: 0.25)
    got = overhead.measure({"a": call("a", 4), "b": call("b", 4)}, iters=4, rounds=2)
    assert order[6:] == ["a"] * 8 + ["b"] * 8 + ["a"] * 8 + ["b"] * 8  # turns, after warm-up
    for p in "ab":
        assert got[p]["host_us"] == pytest.approx(1.0) and got[p]["wall_us"] == pytest.approx(1.0)
        assert got[p]["bench_us"] == 250


def test_interleaved_timing_turns_the_order_around_and_keeps_medians(monkeypatch):
    """Two functions timed in turn: A B, B A, A B; each one's median round."""
    order, times = [], {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 9.0])}

    def fake_time_ms(fn, cpu_repeats=3, **kw):
        order.append(fn())
        return next(times[order[-1]])

    monkeypatch.setattr(core, "time_ms", fake_time_ms)
    ms, rounds = core.interleaved_ms({"a": (lambda: "a", {}), "b": (lambda: "b", {})}, 3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert ms == {"a": 2.0, "b": 5.0} and rounds == {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 9.0]}


def test_bench_rounds_take_turns_and_keep_the_median_round(monkeypatch):
    """``flashedu bench --rounds 3``: each case's providers in turn, order turned around each
    round; each row is its provider's median round, with every round's ms."""
    order = []
    ms = {"flashedu": iter([2.0, 3.0, 1.0]), "baseline": iter([4.0, 6.0, 5.0])}

    def fake_measure(provider, case):
        order.append(provider)
        t = next(ms[provider])
        return {"ms": t, "tflops": 1 / t, "peak_mb": 1.0}

    monkeypatch.setattr(bench, "measure", fake_measure)
    case = bench.build_cases(bench.parse_args(["--n", "256", "--d", "64", "--modes", "fwd",
                                               "--causal", "false", "--density"]))
    rows = bench.run_all(case, ["flashedu", "baseline"], progress=False, rounds=3)
    assert order == ["flashedu", "baseline", "baseline", "flashedu", "flashedu", "baseline"]
    got = {r["provider"]: r for r in rows}
    assert got["flashedu"]["ms"] == 2.0 and got["flashedu"]["rounds_ms"] == [2.0, 3.0, 1.0]
    assert got["baseline"]["ms"] == 5.0 and got["baseline"]["tflops"] == 1 / 5.0


def test_baseline_provider_calls_the_other_checkout_as_flashedu_is_called(monkeypatch,
                                                                          tmp_path):
    """``baseline`` goes through the other checkout's public ``attention`` (checks included),
    as the ``flashedu`` provider does: the columns differ only by the code between them."""
    import sys

    import torch

    (tmp_path / "__init__.py").write_text(  # a stand-in checkout that records its calls
        "CALLS = []\nBlockMask = None\n"
        "def attention(q, k, v, **kw):\n    CALLS.append(kw)\n    return q\n")
    monkeypatch.setattr(peers, "_BASELINE", {"path": None, "module": None})
    monkeypatch.setitem(sys.modules, "flashedu_baseline", None)  # restored afterwards
    peers.set_baseline(str(tmp_path))
    case = peers.Case(48, 16, True, "fwd", None, "float32")
    q, k, v = (torch.randn(1, 2, 48, 16) for _ in range(3))
    assert peers.make_forward("baseline", case, q, k, v)() is q
    assert peers.baseline_package().CALLS == [
        {"is_causal": True, "block_mask": None, "backend": "triton"}]


@pytest.mark.skipif(CUDA, reason="a GPU is present: these subcommands would measure")
@pytest.mark.parametrize("argv", [
    ["overhead", "--shapes", "tiny"], ["numba", "check"], ["gpt", "--seq-lens", "256"],
    ["tune", "--n", "256"], ["speed", "regress"], ["forward", "--prev", __file__],
    ["correctness"], ["decode"], ["paper", "--out", "unused"], ["transformers"], ["fa3"],
])
def test_gpu_only_subcommands_say_so_without_a_gpu(argv, capsys):
    code, text = run(argv, capsys)
    assert code == 1 and "needs a CUDA GPU" in text
    assert not os.path.exists("unused")


# ----------------------------------------------------------------------------------------
# The core
# ----------------------------------------------------------------------------------------


def test_shape_and_flop_rule():
    assert core.batch_heads(8192, 64) == (2, 32) and core.batch_heads(32768, 256) == (1, 8)
    B, H = core.batch_heads(4096, 128)
    assert B * 4096 == core.TOKENS and H * 128 == core.WIDTH
    f = core.attention_flops(2, 3, 100, 50, 16)
    assert f == 4 * 2 * 3 * 100 * 50 * 16
    assert core.attention_flops(2, 3, 100, 50, 16, causal=True, mode="bwd") == f * 0.5 * 2.5
    assert core.attention_flops(2, 3, 100, 50, 16, mode="fwd+bwd", density=0.25) == f * 3.5 / 4
    assert core.flops(8192, 64, causal=True) == core.attention_flops(2, 32, 8192, 8192, 64,
                                                                     causal=True)
    assert core.tflops(1e12, 1000.0) == pytest.approx(1.0)
    case = peers.Case(2048, 64, True, "bwd", 0.5, "bfloat16")
    assert (case.B, case.H) == core.batch_heads(2048, 64)
    assert case.flops() == core.attention_flops(case.B, case.H, 2048, 2048, 64, causal=True,
                                                mode="bwd", density=0.5)


def test_environment_records_where_it_ran(monkeypatch):
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    env = core.environment(["numpy", "--n", "64"], extra=1)
    assert env["commit"] == "abc1234" and env["command"] == "flashedu bench numpy --n 64"
    assert env["extra"] == 1 and env["torch"] == torch.__version__ and env["triton"]
    assert env["device"] == (torch.cuda.get_device_name(0) if CUDA else env["device"])
    assert env["date"].startswith("20") and "T" in env["date"]
    monkeypatch.delenv("GIT_COMMIT")
    assert core.environment("python3 x.py")["commit"] not in ("", "abc1234")


def test_json_table_and_output_types(tmp_path):
    path = tmp_path / "deeper" / "out.json"
    core.write_json(str(path), {"a": np.float32(0.5), "b": np.int64(3), "c": torch.tensor(2.0),
                                "d": object})
    data = json.loads(path.read_text())
    assert data["a"] == 0.5 and data["b"] == 3 and data["c"] == 2.0 and "object" in data["d"]
    text = core.format_table(["name", "ms"], [["a", 1.5], ["longer", 10]])
    lines = text.splitlines()
    assert lines[0] == "  name   ms" and set(lines[1]) == {"-", " "} and lines[3].endswith("10")
    assert core.output_file(str(tmp_path / "new" / "x.json"))
    with pytest.raises(Exception, match="folder, not a file"):
        core.output_file(str(tmp_path))
    with pytest.raises(Exception, match="is a file"):
        core.output_dir(__file__)


def test_time_ms_on_the_host():
    calls = []
    ms = core.time_ms(lambda: calls.append(1), host=True, cpu_repeats=3)
    assert ms >= 0 and len(calls) == 4  # one warm-up, three timed
    assert core.try_time_ms(lambda: 1 / 0, host=True) == float("inf")


def test_overhead_shapes_are_the_measured_ones():
    assert overhead.SHAPES["gpt"] == (8, 12, 512, 64)
    assert overhead.SHAPES["n1024"] == (4, 32, 1024, 64)
    assert all(n > 0 for shape in overhead.SHAPES.values() for n in shape)


def test_overhead_table_lists_every_provider_and_the_ratio():
    rows = [{"shape": "gpt", "causal": True, "mode": "fwd", "provider": "flashedu",
             "host_us": 50.0, "wall_us": 60.0, "bench_us": 20.0},
            {"shape": "gpt", "causal": True, "mode": "fwd", "provider": "sdpa-flash",
             "host_us": 30.0, "wall_us": 80.0, "bench_us": 25.0},
            {"shape": "gpt", "causal": True, "mode": "fwd", "provider": "flex",
             "error": "RuntimeError: no"}]
    text = overhead.table(rows, ["flashedu", "sdpa-flash", "flex"])
    line = next(x for x in text.splitlines() if x.startswith("gpt causal fwd"))
    assert "50 / 60 / 20" in line and "30 / 80 / 25" in line and "RuntimeError" in line
    assert line.rstrip().endswith("0.75x")


def test_overhead_measures_host_time_without_waiting_for_the_gpu(monkeypatch):
    """host: the calls alone (queued, never waited for inside the clock); wall: each call
    waits for its result. A stand-in GPU whose synchronize takes 2 ms shows the difference."""
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: time.sleep(0.002))
    monkeypatch.setattr(core, "time_ms", lambda fn, grad_to_none=None: 0.01)
    got = overhead.measure({"x": (lambda: None, [])}, iters=5, rounds=2)["x"]
    assert got["host_us"] < 1000 < 2000 <= got["wall_us"] and got["bench_us"] == 10.0


# ----------------------------------------------------------------------------------------
# Tiny runs on a CPU
# ----------------------------------------------------------------------------------------


def test_numpy_benchmark_runs_tiny(tmp_path, capsys):
    out = tmp_path / "numpy.json"
    code, text = run(["numpy", "--n", "40", "--d", "8", "--block", "16", "--repeats", "1",
                      "--json", str(out)], capsys)
    assert code == 0 and "tiled, Q outer (FA2)" in text
    data = json.loads(out.read_text())
    assert {"device", "date", "commit", "command", "torch"} <= set(data)
    assert len(data["rows"]) == 3 and all(r["max_abs_diff_vs_naive"] < 1e-5 for r in data["rows"])


def test_decode_dry_run(tmp_path, capsys):
    out = tmp_path / "decode.json"
    code, text = run(["decode", "--dry-run", "--nk", "64", "--json", str(out)], capsys)
    assert code == 0, text
    case = json.loads(out.read_text())["cases"][0]
    assert case["Nk"] == 64 and "error" not in case and case["max_err_split"] < 1e-4


def test_sass_compiles_the_package_launches_for_an_h100(tmp_path, capsys):
    """The launches forward() makes, compiled for sm_90 here: the d=64 table entry's register
    cap holds (two programs of 8 warps per SM), the tensor cores' HGMMA is used, and dropout
    (on its own tiles) adds the Philox rounds (IMAD) without spilling: one call for the 16
    entries of a call a thread holds, not one for every 4 (which a layout that split them
    would cost)."""
    from flashedu.benchmarks import sass

    if not sass.can_compile():
        pytest.skip("this Triton has no NVIDIA backend tools: nothing can compile for a GPU")
    out = tmp_path / "sass.json"
    code, text = run(["sass", "--d", "64", "--variants", "plain", "dropout", "--modes", "fwd",
                      "--json", str(out)], capsys)
    assert code == 0, text
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]
            if r["kernel"] == "forward_kernel"}
    plain, drop = rows["plain"], rows["dropout"]
    assert plain["tiles"].endswith("r128") and 0 < plain["registers"] <= 128, plain["tiles"]
    assert plain["ops"]["HGMMA"] > 0 and plain["spill_stores"] == 0
    Br, Bc, warps = map(int, re.match(r"(\d+)x(\d+) w(\d+)", drop["tiles"]).groups())
    per_thread = Br * Bc // (warps * 32)  # the tile's entries a thread holds
    philox = 2 * 7  # multiplies a call: two a round, 7 rounds
    added = drop["ops"]["IMAD"] - plain["ops"]["IMAD"]
    assert philox <= added < philox * per_thread // 4, added
    assert drop["ops"]["HGMMA"] > 0 and drop["registers"] <= 255 and drop["spill_stores"] == 0
    assert "forward_kernel" in text and "regs" in text


def _gluon_forward_rows(tmp_path, capsys):
    """The sm_90 table's d=128 fa3 forwards, dense and causal, compiled here by ``bench
    sass``."""
    from flashedu.benchmarks import sass
    from flashedu.triton import fa3

    if not sass.can_compile():
        pytest.skip("this Triton has no NVIDIA backend tools: nothing can compile for a GPU")
    if not fa3.GLUON:
        pytest.skip("this Triton has no Gluon Hopper API: the kernel cannot be compiled")
    out = tmp_path / "sass.json"
    code, text = run(["sass", "--d", "128", "--variants", "fa3", "causal-fa3", "--modes", "fwd",
                      "--n", "4096", "--json", str(out)], capsys)
    assert code == 0, text
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["fa3", "causal-fa3"]
    return rows


def test_sass_compiles_the_gluon_forward_for_an_h100(tmp_path, capsys):
    """FlashAttention-3's forward (triton/fa3.py, Gluon) with the sm_90 table's d=128 schedule,
    compiled here: wgmma (HGMMA), O_i out by the copy engine (UTMASTG), three K/V stages
    within the H100's 227 KB of shared memory."""
    for r in _gluon_forward_rows(tmp_path, capsys):
        assert r["kernel"] == "fa3_forward_kernel" and r["tiles"].startswith("128x128 c2 s3")
        assert r["ops"]["HGMMA"] > 0 and r["ops"]["UTMASTG"] > 0
        assert 2 * 128 * 128 * 2 * 3 < r["shared_bytes"] <= 227 * 1024


def test_the_gluon_forward_masks_the_causal_diagonal_in_one_select_an_entry(tmp_path, capsys):
    """The causal d=128 forward's masked tiles (each consumer's diagonal): one compare with
    the row's last visible key and one select an entry. Both persistent (the table's), the
    causal kernel also carries each consumer's own K/V tiles and the plan's table: 1.11x the
    dense kernel's instructions here (Triton 3.9, sm_90); with "key < Nk and key <= row" the
    two conditions were combined as integers, and the same kernel compiled to 1.20x."""
    dense, causal = _gluon_forward_rows(tmp_path, capsys)
    assert causal["instructions"] < 1.15 * dense["instructions"], (causal, dense)


def test_the_gluon_forward_does_not_spill_on_the_triton_it_runs_on(tmp_path, capsys):
    """The consumers' registers, raised by setmaxnreg, hold the d=128 schedule without spills,
    as compiled by the Triton the kernel runs on (``fa3.TESTED_TRITON``; another Triton's
    compiler allots them otherwise: 3.9 keeps 32 bytes of the persistent program's
    loop-invariant values on the stack, and fa3 does not run there)."""
    from flashedu.triton import fa3
    from flashedu.triton.fast import TRITON

    if TRITON not in fa3.TESTED_TRITON:
        pytest.skip(f"the kernel runs on Triton {' or '.join(fa3.TESTED_TRITON)} only, this is "
                    f"{TRITON}: its spills here are not the ones that run")
    for r in _gluon_forward_rows(tmp_path, capsys):
        assert r["spill_stores"] == 0 and r["stack_bytes"] == 0, r


def test_sass_compiles_the_persistent_gluon_forward_without_a_gpu(tmp_path, capsys):
    """The d=64 table takes persistent programs for dense calls: their launch (one program per
    SM) is made and compiled here without a GPU, as an H100's 132 SMs would run it, its Q
    buffers and K/V stages in the shared memory ``fa3.shared_bytes`` counts."""
    from flashedu.benchmarks import sass
    from flashedu.triton import fa3
    from flashedu.triton.config import GPU_16BIT

    if not sass.can_compile():
        pytest.skip("this Triton has no NVIDIA backend tools: nothing can compile for a GPU")
    if not fa3.GLUON:
        pytest.skip("this Triton has no Gluon Hopper API: the kernel cannot be compiled")
    out = tmp_path / "sass.json"
    code, text = run(["sass", "--d", "64", "--variants", "fa3", "--modes", "fwd", "--n", "4096",
                      "--json", str(out)], capsys)
    assert code == 0, text
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tiles"].startswith("192x128 c3 s3") and " persistent" in row["tiles"]
    assert row["ops"]["HGMMA"] > 0
    q_buffers = GPU_16BIT[64].schedule.q_buffers
    assert 0 <= row["shared_bytes"] - fa3.shared_bytes(64, 3, 3, q_buffers) < 1024  # barriers


def test_sass_compiles_the_kernels_that_read_packed_cuts(tmp_path, capsys):
    """The forward and backward that read a packed batch's cuts (varlen_attention), compiled
    for sm_90 here: they build, the forward within the d=64 entry's register cap without
    spills, as the causal kernels they extend."""
    from flashedu.benchmarks import sass

    if not sass.can_compile():
        pytest.skip("this Triton has no NVIDIA backend tools: nothing can compile for a GPU")
    out = tmp_path / "sass.json"
    code, text = run(["sass", "--d", "64", "--variants", "causal", "packed", "--modes", "fwd",
                      "bwd", "--json", str(out)], capsys)
    assert code == 0, text
    rows = {(r["variant"], r["kernel"]): r for r in json.loads(out.read_text())["rows"]}
    forward, causal = rows[("packed", "forward_kernel")], rows[("causal", "forward_kernel")]
    assert 0 < forward["registers"] <= 128 and forward["spill_stores"] == 0
    assert forward["instructions"] < 1.1 * causal["instructions"]
    assert rows[("packed", "backward_kernel")]["registers"] <= 128


def test_host_times_the_call_path_with_and_without_plans(tmp_path, capsys):
    """The host code of the triton backend, launches stubbed, in a fresh process: a row per
    shape, mode and variant, each a positive time, and the table's ratio column."""
    out = tmp_path / "host.json"
    code, text = run(["host", "--shapes", "tiny", "--iters", "3", "--rounds", "2",
                      "--json", str(out)], capsys)
    assert code == 0, text
    rows = json.loads(out.read_text())["rows"]
    assert {(r["mode"], r["variant"]) for r in rows} == {
        (m, v) for m in ("fwd", "fwd+bwd") for v in ("repeat", "plans", "no plans", "floor")}
    assert all(r["shape"] == "tiny" and r["us"] > 0 for r in rows)
    assert "no plans / repeat" in text and text.count("tiny") == 2


def test_host_times_a_paged_decoding_step(tmp_path, capsys):
    """--shapes decode: a paged decoding step's host code (one mode, "step"), each variant a
    positive time, beside an attention shape's rows."""
    out = tmp_path / "host.json"
    code, text = run(["host", "--shapes", "decode", "tiny", "--iters", "3", "--rounds", "2",
                      "--json", str(out)], capsys)
    assert code == 0, text
    rows = [r for r in json.loads(out.read_text())["rows"] if r["shape"] == "decode"]
    assert {(r["mode"], r["variant"]) for r in rows} == {
        ("step", v) for v in ("repeat", "plans", "no plans", "floor")}
    assert all(r["us"] > 0 for r in rows) and text.count("decode") == 1


@pytest.mark.parametrize("flag, value, key, label", [
    ("--density", "0.5", "density", "tiny sparse 0.5"),
    ("--window", "32", "window", "tiny window 32"),
])
def test_host_times_a_block_mask_call(tmp_path, capsys, flag, value, key, label):
    """--density passes a block mask built once, --window a sliding window's (a mask mod):
    the rows say so, and so does the table."""
    out = tmp_path / "host.json"
    code, text = run(["host", "--shapes", "tiny", "--iters", "3", "--rounds", "2",
                      flag, value, "--json", str(out)], capsys)
    assert code == 0, text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8 and all(r[key] == float(value) and r["us"] > 0 for r in rows)
    assert text.count(label) == 2


def test_mods_dry_run(tmp_path, capsys):
    """Each mod through flashedu (Triton's interpreter) and eager FlexAttention: the same
    output, and the visible fraction of each rule."""
    out = tmp_path / "mods.json"
    code, text = run(["mods", "--dry-run", "--json", str(out)], capsys)
    assert code == 0, text
    rows = json.loads(out.read_text())["cases"]
    assert {r["case"] for r in rows} == {"window", "documents", "alibi causal", "softcap causal"}
    assert all("error" not in r and r["max_diff"] < 1e-4 and 0 < r["visible"] < 1 for r in rows)


def test_sinks_dry_run(tmp_path, capsys):
    """Sinks against none through the triton backend (Triton's interpreter): the output with
    sinks is the merge rule's on the output without them, and both have times."""
    out = tmp_path / "sinks.json"
    code, text = run(["sinks", "--dry-run", "--json", str(out)], capsys)
    assert code == 0, text
    rows = json.loads(out.read_text())["cases"]
    assert {r["causal"] for r in rows} == {False, True}
    assert all(r["max_diff"] < 1e-5 and r["fwd_cost"] > 0 and r["fwdbwd_cost"] > 0
               for r in rows)


def test_varlen_dry_run(tmp_path, capsys):
    """A packed batch through flashedu's varlen (Triton's interpreter), eager FlexAttention
    with a document mask and padded SDPA: flashedu and Flex agree, all three have times, and
    so do calls that each bring a new packing."""
    out = tmp_path / "varlen.json"
    code, text = run(["varlen", "--dry-run", "--json", str(out)], capsys)
    assert code == 0, text
    rows = json.loads(out.read_text())["cases"]
    assert rows and all(r["max_diff"] < 1e-4 and r["docs"] > 1 and r["padded_fwd_ms"] > 0
                        for r in rows)
    assert all(r["new_flashedu_fwd_ms"] > 0 and r["new_flashedu_fwdbwd_ms"] > 0
               and r["new_flex_fwd_ms"] > 0 for r in rows)
    assert "a new packing every call" in text


@pytest.mark.slow
def test_transformers_dry_run(tmp_path, capsys):
    """A one-layer Llama through transformers on flashedu (Triton's interpreter) and on SDPA's
    math kernel: logits within the allowance, and a time for each (about 10 s)."""
    pytest.importorskip("transformers", reason='pip install "flashedu[transformers]"')
    out = tmp_path / "hf.json"
    code, text = run(["transformers", "--dry-run", "--json", str(out)], capsys)
    assert code == 0, text
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["rows"]] == ["flashedu", "sdpa-math"]
    assert data["check"] == "ok"
    assert all(r["train_tokens_per_s"] > 0 and r["generate_tokens_per_s"] > 0
               for r in data["rows"])
    assert data["environment"]["transformers"] and "flashedu x" in text


@pytest.mark.slow
def test_correctness_smoke(capsys):
    """The real-size check's tiny cases (two batches, one packed batch) and the ablation
    variants (Triton's interpreter on a CPU, about 20 s)."""
    code, text = run(["correctness", "--smoke"], capsys)
    assert code == 0, text
    assert "3/3 cases passed" in text and "production kernels: ok" in text
    assert "ok   packed [20, 0, 45] keys [30, 5, 40]" in text


def test_notebooks_runner_runs_a_notebook(tmp_path, capsys):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 6 * 7\nassert x == 42")])
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    bad = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")])
    nbformat.write(bad, tmp_path / "bad.ipynb")
    out, tar = tmp_path / "times.json", tmp_path / "executed.tar.gz"
    code, text = run(["notebooks", str(path), str(tmp_path / "bad.ipynb"), "--json", str(out),
                      "--executed", str(tar)], capsys)
    assert code == 1 and "1/2 ran top to bottom" in text and "ZeroDivisionError" in text
    rows = json.loads(out.read_text())["notebooks"]
    assert [r["ok"] for r in rows] == [True, False] and tar.stat().st_size > 0


def test_numba_check_case_on_the_simulator():
    from flashedu.benchmarks import numba_gpu

    result = numba_gpu.check_case(1, 2, 1, 21, 19, 6, is_causal=True, sample_rows=9,
                                  device="cpu")
    assert result["passed"], result


# ----------------------------------------------------------------------------------------
# Tiny runs on a GPU (pytest -m gpu tests/test_bench.py)
# ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("argv", [
    ["--n", "1024", "--d", "64", "--modes", "fwd", "bwd", "--causal", "true", "--density",
     "0.5", "--providers", "sdpa-flash", "flex", "--no-progress"],
    ["overhead", "--shapes", "tiny", "--iters", "5", "--providers", "sdpa-flash", "--quiet"],
    ["correctness", "--smoke"],
    ["decode", "--nk", "4096", "16384", "--heads", "8", "--kv-heads", "2"],
    ["gpt", "--n-layers", "1", "--seq-lens", "256,512", "--warmup", "1", "--steps", "1",
     "--tokens-per-step", "2048"],
    ["tune", "--n", "1024", "--d", "64", "--causal", "1"],
    ["tune", "--n", "1024", "--d", "64", "--causal", "1", "--dropout", "0.1"],
    ["speed", "regress", "--n", "1024", "--d", "64"],
    ["speed", "ncu-fwd"],
    ["forward", "--prev", "flashedu/triton/forward.py", "--only", "compile", "peers"],
    ["paper", "--quick", "--parts", "memory"],
    ["transformers", "--hidden", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2",
     "--vocab", "1000", "--batch", "2", "--seq-len", "256", "--prompt", "16", "--new-tokens",
     "8", "--warmup", "1", "--steps", "2"],
], ids=lambda a: " ".join(a[:2]))
def test_gpu_subcommand_runs_small(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    json_flag = {"gpt": "--out", "paper": "--out"}.get(argv[0], "--json")
    target = tmp_path / ("out" if json_flag == "--out" and argv[0] == "paper" else "out.json")
    extra = [] if argv[0] == "speed" and argv[1] == "ncu-fwd" else [json_flag, str(target)]
    code, text = run(argv + extra, capsys)
    assert code == 0, text[-3000:]
    if extra:
        path = target / "paper_repro.json" if target.suffix == "" else target
        data = json.loads(path.read_text())
        env = data.get("environment", data)
        assert env["device"] and env["commit"] and env["command"].startswith("flashedu bench")


@pytest.mark.gpu
@needs_cuda
def test_numba_check_case_on_the_gpu():
    from flashedu import runtime
    from flashedu.benchmarks import numba_gpu

    if runtime.numba_simulated():
        pytest.skip("numba runs its simulator here (NUMBA_ENABLE_CUDASIM is set)")
    result = numba_gpu.check_case(1, 2, 1, 1000, 777, 64, is_causal=True)
    assert result["passed"], result


def test_paged_dry_run(tmp_path, capsys):
    """Paged decoding through the triton backend (Triton's interpreter) against the same keys
    held contiguously: both agree with the reference, and every timing is there."""
    out = tmp_path / "paged.json"
    code, text = run(["paged", "--dry-run", "--json", str(out)], capsys)
    assert code == 0, text
    rows = json.loads(out.read_text())["cases"]
    assert rows and all("error" not in r and r["max_err_paged"] < 1e-5 and r["paged_ms"] > 0
                        and r["checked_ms"] > 0 and r["contiguous_ms"] > 0 for r in rows)
    assert "paged within 10% of contiguous" in text  # the goals, counted under the table
    # the plan of each cell: 2 sequences x 2 K/V heads on the interpreter's 4 "SMs", 40 keys
    # in tiles of 16: three splits (a chunk a tile), one tile in flight (no pipeline there)
    assert all(r["splits"] == 3 and r["tiles_in_flight"] == 1 and r["key_tile"] == 16
               and r["kv_heads"] == 1 for r in rows)
    assert "splits x tiles x Bc" in text and "3 x 1 x 16" in text


def test_paged_goals_count_the_cells_that_meet_them():
    """Within 10% of contiguous and at least SDPA's best, by the step's time, by the GPU's
    time and by a CUDA graph's time where a row has them; a row without SDPA (a CPU run)
    counts for neither SDPA goal."""
    from flashedu.benchmarks.paged import goals

    rows = [dict(paged_ms=1.05, contiguous_ms=1.0, sdpa_best_ms=1.2, paged_gpu_us=9.0,
                 contiguous_gpu_us=8.0, sdpa_best_gpu_us=9.5, paged_graph_us=10.0,
                 contiguous_graph_us=10.0, sdpa_best_graph_us=9.0),
            dict(paged_ms=1.2, contiguous_ms=1.0, sdpa_best_ms=1.0, paged_gpu_us=5.0,
                 contiguous_gpu_us=5.0, sdpa_best_gpu_us=4.0),
            dict(paged_ms=0.5, contiguous_ms=1.0)]
    got = goals(rows)
    assert got["paged_within_10pct_of_contiguous"] == [2, 3]
    assert got["paged_within_10pct_of_contiguous_gpu"] == [1, 2]  # 9 / 8 is 1.125x
    assert got["paged_within_10pct_of_contiguous_graph"] == [1, 1]
    assert got["paged_at_least_sdpa"] == [1, 2] and got["paged_at_least_sdpa_gpu"] == [1, 2]
    assert got["paged_at_least_sdpa_graph"] == [0, 1]  # 9 us against paged's 10
    assert got["lines"][0] == ("paged within 10% of contiguous: 2 of 3 cells by the step's "
                               "time, 1 of 2 cells by the GPU's time, 1 of 1 cells by a CUDA "
                               "graph's time")


def test_dropout_dry_run(tmp_path, capsys):
    """Dropout against p=0 through the triton backend (Triton's interpreter): both rates have
    times for the forward and the forward+backward, and the costs are their ratios."""
    out = tmp_path / "dropout.json"
    code, text = run(["dropout", "--dry-run", "--json", str(out)], capsys)
    assert code == 0, text
    rows = json.loads(out.read_text())["cases"]
    assert {r["causal"] for r in rows} == {False, True}
    for r in rows:
        for mode in ("fwd", "fwdbwd"):
            p0, p1 = r[f"flashedu_p0_{mode}_ms"], r[f"flashedu_p0.1_{mode}_ms"]
            assert p0 > 0 and p1 > 0 and r[f"flashedu_{mode}_cost"] == p1 / p0
        assert not [key for key in r if "gpu" in key]  # no kernel times without a GPU ...
    assert "GPU: fwd cost" in text  # ... and the table says so with "-"


def test_bench_host_times_the_python_of_a_call_with_dropout(tmp_path, capsys):
    """``flashedu bench host --dropout``: every row of a dropout call's forward and backward
    timed (the worker stubs the launches: no GPU needed), the rate in the record and the
    table's label."""
    from flashedu.benchmarks import host

    out = tmp_path / "host.json"
    assert host.main(["--shapes", "tiny", "--iters", "2", "--rounds", "1", "--dropout", "0.1",
                      "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["variant"], r["mode"]) for r in rows} == {(v, m) for v in host.VARIANTS
                                                         for m in host.MODES}
    assert all(r["dropout"] == 0.1 and r["us"] > 0 for r in rows)
    assert "tiny dropout 0.1" in capsys.readouterr().out


def test_gpt_times_the_methods_one_step_each_in_turn(monkeypatch):
    """``flashedu bench gpt`` takes one step of each method in turn (a slow stretch of the GPU
    then falls on all of them); a method that fails at one T is not run at a longer one, and a
    step that fails marks only its own method."""
    from flashedu.benchmarks import gpt

    taken = []

    class Trainer:
        def __init__(self, method, T):
            self.method, self.T = method, T

        def train_step(self):
            taken.append(self.method)
            if self.method == "naive" and self.T == 2048:
                raise torch.OutOfMemoryError("2048 keys do not fit")
            return 1.5

    def warm_up(method, T, args, data):
        return {"method": method, "seq_len": T, "batch": 8, "peak_gib": 1.0}, Trainer(method, T)

    monkeypatch.setattr(gpt, "warm_up", warm_up)
    monkeypatch.setattr(gpt, "free_memory", lambda: None)
    args = gpt.parse_args(["--steps", "3", "--seq-lens", "1024"])
    methods, failed = ["naive", "flashedu-triton", "sdpa-flash"], {}
    rows = gpt.train_runs(methods, 1024, args, None, failed)
    assert taken == methods * 3
    for row in rows:
        assert row["status"] == "ok" and len(row["step_ms_each"]) == 3 and row["last_loss"] == 1.5
        assert row["step_ms"] == pytest.approx(sum(row["step_ms_each"]) / 3, abs=0.01)
        assert row["step_ms_median"] == pytest.approx(sorted(row["step_ms_each"])[1], abs=0.01)
    taken.clear()
    rows = gpt.train_runs(methods, 2048, args, None, failed)
    assert [r["status"] for r in rows] == ["oom", "ok", "ok"] and failed == {"naive": "oom"}
    assert taken == ["naive"] + methods[1:] * 3
    rows = gpt.train_runs(methods, 4096, args, None, failed)
    assert rows[0]["status"] == "oom" and "not run" in rows[0]["note"]
