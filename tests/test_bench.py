"""The benchmark commands' arguments and tables (timings themselves need a GPU: see
BENCHMARKS.md for the recorded runs)."""

import pytest

from flashedu import bench, bench_overhead, cli


@pytest.mark.parametrize("argv", [
    ["--n", "-5"], ["--n", "0"], ["--n", "abc"], ["--d", "300"], ["--d", "0"],
    ["--density", "2"], ["--density", "0"], ["--density", "-0.5"], ["--causal", "maybe"],
    ["--modes", "sideways"], ["--dtype", "int8"], ["--providers", "nobody"],
    ["--providers", "baseline"], ["--baseline", "/no/such/folder"],
])
def test_bench_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--shapes", "huge"], ["--iters", "0"], ["--iters", "-3"], ["--causal", "maybe"],
    ["--modes", "bwd"], ["--providers", "naive"], ["--dtype", "float64"],
])
def test_overhead_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "overhead", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bench_parses_good_arguments(tmp_path):
    args = bench.parse_args(["--n", "1024", "2048", "--d", "64", "--causal", "TRUE", "no",
                             "--density", "1", "0.25", "--providers", "sdpa-flash"])
    assert args.n == [1024, 2048] and args.d == [64] and args.causal == [True, False]
    assert args.density == [1.0, 0.25] and args.providers == ["flashedu", "sdpa-flash"]
    (tmp_path / "__init__.py").write_text("")
    args = bench.parse_args(["--baseline", str(tmp_path)])
    assert args.providers[:2] == ["flashedu", "baseline"]
    over = bench_overhead.parse_args(["--shapes", "gpt", "--causal", "false", "--iters", "7"])
    assert over.shapes == ["gpt"] and over.causal == [False] and over.iters == 7
    assert over.providers[0] == "flashedu" and set(over.modes) == {"fwd", "fwd+bwd"}


def test_overhead_shapes_are_the_measured_ones():
    assert bench_overhead.SHAPES["gpt"] == (8, 12, 512, 64)
    assert bench_overhead.SHAPES["n1024"] == (4, 32, 1024, 64)
    assert all(n > 0 for shape in bench_overhead.SHAPES.values() for n in shape)


def test_overhead_table_lists_every_provider_and_the_ratio():
    rows = [{"shape": "gpt", "causal": True, "mode": "fwd", "provider": "flashedu",
             "wall_us": 60.0, "bench_us": 20.0},
            {"shape": "gpt", "causal": True, "mode": "fwd", "provider": "sdpa-flash",
             "wall_us": 80.0, "bench_us": 25.0},
            {"shape": "gpt", "causal": True, "mode": "fwd", "provider": "flex",
             "error": "RuntimeError: no"}]
    text = bench_overhead.table(rows, ["flashedu", "sdpa-flash", "flex"])
    line = next(x for x in text.splitlines() if x.startswith("gpt causal fwd"))
    assert "60 / 20" in line and "80 / 25" in line and "RuntimeError" in line
    assert line.rstrip().endswith("0.75x")


def test_overhead_without_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would time (see BENCHMARKS.md)")
    assert cli.main(["bench", "overhead", "--shapes", "tiny"]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
