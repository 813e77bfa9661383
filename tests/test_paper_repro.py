"""scripts/paper_repro.py: its model arithmetic, its ncu CSV parser, and one CPU dry run of the
whole pipeline (children, fake ncu CSV, tables, JSON)."""

import json
import math
import os
import subprocess
import sys

import pytest

from script_loading import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "paper_repro.py")


@pytest.fixture(scope="module")
def pr():
    return load_script("paper_repro")


def test_parse_ncu_csv_sums_units_and_separators(pr):
    kernels = [("ampere_fp16_gemm", 1_234_567.0, 89_000.0), ("softmax", 2_000_000.0, 1_000_000.0),
               ("elementwise", 10.0, 20.0)]
    text = "app output line\n" + pr.fake_ncu_csv(kernels) + "==PROF== Disconnected\n"
    parsed = pr.parse_ncu_csv(text)
    assert [k["name"] for k in parsed] == [k[0] for k in kernels]
    for got, (_, read, write) in zip(parsed, kernels):
        assert got["read"] == pytest.approx(read, abs=1) and got["write"] == pytest.approx(write, abs=1)
    total = pr.summarize_kernels(parsed)
    assert total["kernels"] == 3
    assert total["hbm_bytes"] == pytest.approx(sum(r + w for _, r, w in kernels), abs=3)


def test_parse_ncu_csv_rejects_unknown_units_and_ignores_other_metrics(pr):
    head = pr.fake_ncu_csv([]).splitlines()[1]
    other = ('"0","1","p","h","k","1","7","(1,1,1)","(1,1,1)","0","9.0","S",'
             '"sm__cycles_elapsed.avg","cycle","5"')
    assert pr.parse_ncu_csv(head + "\n" + other) == []
    bad = other.replace("sm__cycles_elapsed.avg", pr.NCU_METRICS[0]).replace('"cycle"', '"furlong"')
    with pytest.raises(ValueError, match="furlong"):
        pr.parse_ncu_csv(head + "\n" + bad)


def test_standard_model_is_algorithms_0_and_3(pr):
    s = pr.Shape(1, 1, 1024, 64)
    N, d = 1024, 64
    assert pr.standard_bytes(s, backward=False) == 2 * (4 * N * N + 4 * N * d)
    assert pr.standard_bytes(s) == 2 * (11 * N * N + 12 * N * d)
    # The model scales with batch * heads, and the floor sits under every flash count.
    s64 = pr.Shape(64, 16, N, d)
    assert pr.standard_bytes(s64) == 1024 * pr.standard_bytes(s)
    assert pr.minimum_bytes(s64) < pr.flashedu_bytes(s64) < pr.standard_bytes(s64)


def test_triton_forward_model_depends_on_br_not_bc(pr):
    s = pr.Shape(1, 1, 1024, 64)
    assert pr.triton_forward_bytes(s, 128, 16) == pr.triton_forward_bytes(s, 128, 256)
    assert pr.triton_forward_bytes(s, 64, 64) > pr.triton_forward_bytes(s, 128, 64)
    # Q outer: Q once, K and V once per Q tile, O once (fp16), L once (fp32).
    N, d, Br = 1024, 64, 128
    assert pr.triton_forward_bytes(s, Br, 64) == 2 * (N * d + 2 * N * d * (N // Br) + N * d) + 4 * N


def test_matmul_counts(pr):
    s = pr.Shape(64, 16, 1024, 64)
    unit = 2 * 1024 * 1024 * 64 * 1024 / 1e9  # one N x N x d product over all heads, GFLOP
    assert pr.matmul_gflops("naive", s) == pytest.approx(6 * unit)
    assert pr.matmul_gflops("sdpa-flash", s) == pytest.approx(7 * unit)
    assert pr.matmul_gflops("flashedu", s) == pytest.approx(9 * unit)
    assert pr.matmul_gflops("naive", s, backward=False) == pytest.approx(2 * unit)


def test_popular_claims_follow_from_d128(pr):
    assert pr.claims_model(4096)["traffic_ratio"] == pytest.approx(33.0)
    assert pr.claims_model(16384)["traffic_ratio"] == pytest.approx(129.0)
    assert pr.claims_model(4096)["memory_ratio"] == pytest.approx(9.0, rel=0.01)
    assert pr.claims_model(4096)["score_matrix_gib"] == pytest.approx(1.0)
    # Algorithm 0's IO over 32 heads: 4N^2 + 4Nd elements per head, 2 bytes each.
    N, d = 4096, 128
    assert pr.claims_model(N)["standard_io_bytes"] == 32 * 2 * (4 * N * N + 4 * N * d)
    # With d=64 (the paper's GPT-2 setting) the same claims would read 65x and 257x.
    assert pr.claims_model(4096, d=64)["traffic_ratio"] == pytest.approx(65.0)


def test_l2_model_sits_between_floor_and_two_level_model(pr):
    s = pr.Shape(64, 16, 1024, 64)
    # Forward: Q, K, V, O once (fp16) and L (fp32): the floor plus L.
    assert pr.flashedu_l2_bytes(s, backward=False) == pr.minimum_bytes(s, backward=False) + 4 * 1024 * 1024
    assert pr.minimum_bytes(s) < pr.flashedu_l2_bytes(s) < pr.flashedu_bytes(s)
    # Each backward kernel re-reads what the previous one wrote or read: 17 (N, d) tensors in all.
    N, d = 1024, 64
    assert pr.flashedu_l2_bytes(pr.Shape(1, 1, N, d)) == 17 * N * d * 2 + 6 * N * 4


def test_verdicts(pr):
    assert pr.verdict(33, 30, 33) == "holds"
    assert pr.verdict(33, 90, 33) == "holds under stated assumptions"
    assert pr.verdict(33, None, 33) == "holds under stated assumptions"
    assert pr.verdict(33, 90, 60) == "does not hold"
    assert pr.verdict(1.0, 3.1, 1.0, at_least=True) == "holds"
    assert pr.verdict(1.0, 0.2, 0.5, at_least=True) == "does not hold"


def test_paper_block_sizes_for_gpus(pr):
    m = pr.paper_algorithm_bytes(pr.Shape(64, 16, 1024, 64), "A100 SXM4 40GB")
    assert m["M_elements"] == 164 * 1024 // 2
    assert (m["Br"], m["Bc"]) == (min(math.ceil(m["M_elements"] / 256), 64), math.ceil(m["M_elements"] / 256))
    assert m["fwd_bytes"] < m["fwdbwd_bytes"]


@pytest.mark.slow
def test_cpu_dry_run_end_to_end(tmp_path):
    """The whole pipeline on CPU: providers run (Triton interpreted), ncu children re-invoke the
    script and print a fake CSV that the parent parses, tables print, the JSON is complete."""
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), "--cpu-dry-run"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "paper_repro.json").read_text())
    assert data["dry_run"] and "errors" not in data, data.get("errors")
    for key in ("device", "date", "commit", "command", "torch", "triton"):
        assert data[key]
    for p, row in data["fig2"]["rows"].items():
        assert "error" not in row and "error" not in row["ncu"], (p, row)
        assert row["ncu"]["kernels"] == 2 and row["ncu"]["fake"]
        assert row["ms"] > 0
    # The fake CSV carried the model's bytes: parsing gave them back.
    assert data["fig2"]["rows"]["naive"]["ncu"]["hbm_bytes"] == pytest.approx(
        data["fig2"]["rows"]["naive"]["predicted_bytes"], rel=1e-3)
    sweep = data["sweep"]["rows"]
    assert sweep and all(r["ncu_bytes"] == pytest.approx(r["predicted_bytes"], rel=1e-3)
                         for r in sweep)
    mem = data["memory"]["rows"]
    assert {r["provider"] for r in mem} == {"naive", "flashedu", "sdpa-flash"}
    assert all("peak_extra_bytes" in r for r in mem)
    claims = data["popular_claims"]["claims"]
    assert len(claims) == 4 and all(c["verdict"] for c in claims)
    assert "Popular claims" in proc.stdout and "Fig. 2 left" in proc.stdout
