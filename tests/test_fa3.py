"""FlashAttention-3's schedule (flashedu/triton/fa3.py, fa3_backward.py): on an sm_90 GPU with
the Triton its Gluon is written against, every switch of the forward's schedule and the
backward's settings against the float64 reference on ragged, GQA and causal shapes, and the
public API taking both from the tile table. Elsewhere the kernels are not used (``usable`` says
no), which the CPU tests check, with the dispatch to them, and the switch that turns them off
(FLASHEDU_FA3=0): each test here runs with it unset (``switched_on``)."""

import dataclasses
import json

import pytest
import torch

import flashedu  # first: decides GPU or interpreter before triton loads
from flashedu import ops, tolerance
from flashedu.reference import naive_attention_torch, reference_attention
from flashedu.triton import fa3
from flashedu.triton.config import GPU_16BIT

CUDA = torch.cuda.is_available()


def _fa3_here() -> bool:
    if not CUDA or flashedu.runtime.triton_interpreted():
        return False
    probe = torch.empty(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(fa3.SWITCH_ENV, raising=False)
        return fa3.usable(probe, probe, probe, ops.Call(False, 1.0))


FA3 = _fa3_here()
needs_fa3 = pytest.mark.skipif(not FA3, reason="needs an sm_90 GPU and Triton "
                               f"{' or '.join(fa3.TESTED_TRITON)} (fa3's Gluon API)")


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    """The kernels on for each test (FLASHEDU_FA3 unset), whatever the shell running the
    tests set."""
    monkeypatch.delenv(fa3.SWITCH_ENV, raising=False)


# (B, H, Hkv, Nq, Nk, d, causal, dtype): ragged lengths, Nq != Nk, GQA, one Q row past a tile
SHAPES = [(2, 4, 4, 1000, 1000, 128, False, torch.bfloat16),
          (2, 4, 4, 1000, 1000, 128, True, torch.bfloat16),
          (1, 8, 2, 777, 1300, 64, False, torch.float16),
          (1, 8, 2, 1300, 777, 64, True, torch.bfloat16),
          (1, 2, 2, 129, 129, 128, True, torch.float16),
          (1, 2, 1, 64, 300, 128, False, torch.bfloat16)]
# O_i stored from registers or through shared memory (TMA_STORE), each with one and many
# programs; the tails of 777, 1000 and 129 queries leave consumers with no row at all
SETTINGS = [dict(CONSUMERS=2, STAGES=2, CONSUMER_REGS=240),
            dict(CONSUMERS=2, STAGES=3, CONSUMER_REGS=240, PINGPONG=False, TMA_STORE=True),
            dict(CONSUMERS=2, STAGES=2, CONSUMER_REGS=240, OVERLAP=False, LONGEST_FIRST=False),
            dict(CONSUMERS=3, STAGES=3, CONSUMER_REGS=160, TMA_STORE=True),
            dict(CONSUMERS=2, STAGES=3, CONSUMER_REGS=240, PINGPONG=False, PERSISTENT=True,
                 TMA_STORE=True),
            dict(CONSUMERS=2, STAGES=3, CONSUMER_REGS=240, PERSISTENT=True, TMA_STORE=True),
            dict(CONSUMERS=3, STAGES=3, CONSUMER_REGS=160, PERSISTENT=True),
            dict(CONSUMERS=3, STAGES=3, CONSUMER_REGS=160, PERSISTENT=True, TMA_STORE=True)]


def _inputs(B, H, Hkv, Nq, Nk, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, n, N, d, device="cuda", dtype=dtype, generator=g)
            for n, N in ((H, Nq), (Hkv, Nk), (Hkv, Nk))]


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_every_schedule_matches_the_float64_reference(shape, settings):
    B, H, Hkv, Nq, Nk, d, causal, dtype = shape
    if settings["CONSUMERS"] == 3 and d == 128:
        pytest.skip("three consumers of d=128 do not fit the registers (not in the table)")
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, d, dtype, seed=Nq + Nk + d)
    scale = d ** -0.5
    o = torch.empty_like(q)
    lse2 = torch.empty(B, H, Nq, device="cuda")
    fa3.forward(q, k, v, o, lse2, is_causal=causal, scale=scale, **settings)
    ref, lse = reference_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True,
                                   return_lse=True)
    plain = naive_attention_torch(q, k, v, is_causal=causal, scale=scale, enable_gqa=True,
                                  upcast=False)
    tolerance.check(o, ref, plain, dtype=dtype)
    # L_i in base 2, as the backward reads it: float32 rounding of a sum of Nk terms
    assert tolerance.max_error(lse2 / fa3.LOG2E, lse) < 1e-4


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("tma_store,q_buffers,planned", [(False, 1, False), (True, 1, True),
                                                         (False, 2, True), (True, 2, False)])
@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (128, True)])
def test_a_persistent_program_takes_many_tiles_right(d, causal, tma_store, q_buffers, planned):
    """More Q tiles than SMs: each persistent program takes several, of different heads and
    lengths (causal: dealt in a snake or by the host's plan), with the K/V ring's count, the Q
    buffers and the ping-pong turns running on across them; a ragged last tile in every head,
    grouped-query heads."""
    B, H, Hkv, N = 3, 16, 4, 1000 + 77
    q, k, v = _inputs(B, H, Hkv, N, N, d, torch.bfloat16, seed=d + causal)
    settings = (dict(CONSUMERS=3, STAGES=3, CONSUMER_REGS=160) if d == 64 else
                dict(CONSUMERS=2, STAGES=3, CONSUMER_REGS=240))
    settings.update(TMA_STORE=tma_store, Q_BUFFERS=q_buffers, PLANNED=planned)
    if fa3.shared_bytes(d, settings["CONSUMERS"], settings["STAGES"], q_buffers) > (
            fa3.SHARED_MEMORY):
        pytest.skip(f"two Q buffers do not fit beside three stages at d = {d}")
    assert B * H * -(-N // (64 * settings["CONSUMERS"])) > 2 * torch.cuda.get_device_properties(
        0).multi_processor_count
    o, lse2 = torch.empty_like(q), torch.empty(B, H, N, device="cuda")
    fa3.forward(q, k, v, o, lse2, is_causal=causal, scale=d ** -0.5, PERSISTENT=True,
                **settings)
    ref, lse = reference_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                   return_lse=True)
    plain = naive_attention_torch(q, k, v, is_causal=causal, enable_gqa=True, upcast=False)
    tolerance.check(o, ref, plain, dtype=torch.bfloat16)
    assert tolerance.max_error(lse2 / fa3.LOG2E, lse) < 1e-4
    again = torch.empty_like(o)
    fa3.forward(q, k, v, again, lse2, is_causal=causal, scale=d ** -0.5, **settings)
    assert torch.equal(again, o)  # the same arithmetic as one program per tile


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_attention_takes_the_schedule_from_the_table(d, causal):
    """From the table's length on (4096 keys; causal at d=64 8192) the public API's forward
    and backward are fa3's (their launch plans say so), right against the reference, and
    right again when the plans start a second call."""
    from flashedu.triton import fa3_backward, fast

    fast.PLANS.clear()
    entry = GPU_16BIT[d]
    B, H = 1, 2
    N = max(entry.schedule_from, entry.schedule.causal_from if causal else 0) + 77
    q, k, v = (t.requires_grad_() for t in _inputs(B, H, H, N, N, d, torch.bfloat16, seed=d))
    out = flashedu.attention(q, k, v, is_causal=causal, backend="triton")
    kernels = {plan.kernel for plan in fast.PLANS.values()}
    assert fa3.fa3_forward_kernel in kernels
    dout = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    steps = [step for plan in fast.PLANS.values() if isinstance(plan, tuple) for step in plan[1]]
    assert any(isinstance(step, fa3_backward.Step) for step in steps)
    ref = reference_attention(q, k, v, is_causal=causal)
    ref = (ref, *torch.autograd.grad(ref, (q, k, v), dout.double()))
    plain = naive_attention_torch(q, k, v, is_causal=causal, upcast=False)
    plain = (plain, *torch.autograd.grad(plain, (q, k, v), dout))
    for n, (g, r, p) in enumerate(zip(got, ref, plain)):
        factor = tolerance.FORWARD if n == 0 else tolerance.GRADIENT
        tolerance.check(g, r, p, dtype=torch.bfloat16, factor=factor, floor_scale=factor,
                        name="out dq dk dv".split()[n])
    again = flashedu.attention(q, k, v, is_causal=causal, backend="triton")  # the plans' start
    assert torch.equal(again, out)
    grads = torch.autograd.grad(again, (q, k, v), dout)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref[1:], plain[1:]):
        tolerance.check(g, r, p, dtype=torch.bfloat16, factor=tolerance.GRADIENT,
                        floor_scale=tolerance.GRADIENT, name=name)


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_views_of_one_projection_take_the_schedule_as_contiguous_inputs(d, causal):
    """q, k, v split out of one (B, N, 3, H, d) projection (gaps between rows) at the table's
    lengths: the forward is fa3's on a copy of q laid out as its output, (B, N, H, d), and
    equals the contiguous inputs' bit for bit; the gradients are right, and a second call
    gives the same."""
    from flashedu.triton import fast

    fast.PLANS.clear()
    entry = GPU_16BIT[d]
    B, H = 1, 2
    N = max(entry.schedule_from, entry.schedule.causal_from if causal else 0) + 77
    g = torch.Generator(device="cuda").manual_seed(d + causal)
    qkv = torch.randn(B, N, 3, H, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = qkv.requires_grad_().permute(2, 0, 3, 1, 4)
    out = flashedu.attention(q, k, v, is_causal=causal, backend="triton")
    assert fa3.fa3_forward_kernel in {plan.kernel for plan in fast.PLANS.values()}
    assert out.transpose(1, 2).is_contiguous()
    dense = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    assert torch.equal(out, flashedu.attention(*dense, is_causal=causal, backend="triton"))
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    ref = reference_attention(*dense, is_causal=causal)
    ref = torch.autograd.grad(ref, dense, dout.double())
    plain = naive_attention_torch(*dense, is_causal=causal, upcast=False)
    plain = torch.autograd.grad(plain, dense, dout)
    for n, (name, r, p) in enumerate(zip(("dq", "dk", "dv"), ref, plain)):
        tolerance.check(dqkv[:, :, n].transpose(1, 2), r, p, dtype=torch.bfloat16,
                        factor=tolerance.GRADIENT, floor_scale=tolerance.GRADIENT, name=name)
    again = flashedu.attention(q, k, v, is_causal=causal, backend="triton")
    assert torch.equal(again, out)
    assert torch.equal(torch.autograd.grad(again, qkv, dout)[0], dqkv)


@pytest.mark.gpu
@needs_fa3
def test_deterministic_mode_gives_the_same_gradients_every_run():
    """Where the table takes FlashAttention-3's backward (dQ added in L2 in arrival order),
    torch.use_deterministic_algorithms makes the public API's backward bit-identical run to
    run (the Triton kernels take it: no fa3 step in its plan)."""
    from flashedu.triton import fa3_backward, fast

    d, N = 128, 4096 + 77
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 2, N, N, d, torch.bfloat16, seed=5))
    dout = torch.randn_like(q)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        fast.PLANS.clear()
        runs = []
        for _ in range(3):
            out = flashedu.attention(q, k, v, backend="triton")
            runs.append(torch.autograd.grad(out, (q, k, v), dout))
        steps = [s for plan in fast.PLANS.values() if isinstance(plan, tuple) for s in plan[1]]
        assert not any(isinstance(s, fa3_backward.Step) for s in steps)
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


@pytest.mark.gpu
@needs_fa3
def test_bench_fa3_runs_small(tmp_path, capsys):
    """``flashedu bench fa3`` on one small case: a table, and JSON that says where it ran."""
    import json

    from flashedu import bench

    out = tmp_path / "fa3.json"
    code = bench.main(["fa3", "--n", "4096", "--d", "64", "--rounds", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "fwd / cuDNN" in text
    data = json.loads(out.read_text())
    assert data["environment"]["command"].startswith("flashedu bench fa3")
    assert data["matmul_tflops"] > 0
    assert [(c["N"], c["d"], c["causal"]) for c in data["cases"]] == [(4096, 64, False),
                                                                      (4096, 64, True)]
    for case in data["cases"]:
        assert all(t > 0 for t in case["tflops"].values())


@pytest.mark.gpu
@needs_fa3
def test_the_kernels_survive_a_gpu_shared_with_other_processes(tmp_path):
    """Three processes on the GPU at once, each repeating the d = 128 forward for a few seconds
    and comparing every answer with its first (``scripts/gpu_shared_gpu.py``): all clean.
    Before each program invalidated its mbarriers, the kernels faulted within a few hundred
    calls of such a run (BENCHMARKS.md, "FlashAttention-3's kernels and a GPU shared by
    time-slicing")."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_shared_gpu.py"
    record = tmp_path / "shared_gpu.json"
    run = subprocess.run([sys.executable, str(script), "--d", "128", "--processes", "3",
                          "--seconds", "8", "--json", str(record)], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 of 3 processes gave their answer throughout" in run.stdout
    processes = json.loads(record.read_text())["processes"]
    assert len(processes) == 3 and all(p["clean"] and p["calls"] > 0 for p in processes)
    assert all(p["kernels"] == "on" for p in processes)  # the Gluon kernels ran


def test_the_table_asks_for_the_schedule_only_where_it_was_measured():
    """d=64 and d=128 from 4096 queries and keys, forward and backward; below, and at other
    head dims, the Triton kernels."""
    for d in (64, 128):
        for settings in (GPU_16BIT[d].fa3_settings, GPU_16BIT[d].fa3_backward_settings):
            assert settings(4096, 4096) is not None
            assert settings(4095, 8192) is None
            assert settings(8192, 2048) is None
    # persistent programs for dense calls, and for causal calls with their Q tiles by the
    # host's plan (each measured faster so at both head dims)
    for d in (64, 128):
        assert GPU_16BIT[d].fa3_settings(4096, 4096)["PERSISTENT"] is True
        assert GPU_16BIT[d].fa3_settings(4096, 4096)["PLANNED"] is False
        for n in (4096, 8192, 16384):
            causal = GPU_16BIT[d].fa3_settings(n, n, is_causal=True)
            assert causal["PERSISTENT"] is True and causal["PLANNED"] is True
    # with dropout: two consumers of 240 registers at both head dims, persistent when dense
    for d in (64, 128):
        settings = GPU_16BIT[d].fa3_settings(4096, 4096, dropout=True)
        assert settings["CONSUMERS"] == 2 and settings["PERSISTENT"] is True
    assert GPU_16BIT[64].fa3_settings(4096, 4096, is_causal=True, dropout=True) is None
    assert GPU_16BIT[128].fa3_settings(4096, 4096, True, True)["PERSISTENT"] is False
    # the backward: persistent at d=64 (two K/V buffers), and at d=128 dense; with dropout
    # one program per K/V tile (persistent programs were measured without it)
    backward = {d: GPU_16BIT[d].fa3_backward_settings for d in (64, 128)}
    for n in (4096, 8192, 16384):
        assert backward[64](n, n)["PERSISTENT"] and backward[64](n, n, True)["PERSISTENT"]
        assert backward[64](n, n)["KV_BUFFERS"] == 2
        assert backward[128](n, n)["PERSISTENT"] and not backward[128](n, n, True)["PERSISTENT"]
        for d in (64, 128):
            for causal in (False, True):
                with_dropout = backward[d](n, n, causal, dropout=True)
                assert not with_dropout["PERSISTENT"] and with_dropout["KV_BUFFERS"] == 1
    for d in (16, 32, 256):
        assert GPU_16BIT[d].fa3_settings(16384, 16384) is None
        assert GPU_16BIT[d].fa3_backward_settings(16384, 16384) is None
    for config in GPU_16BIT.values():  # the launch plans key calls by their entry
        hash(config)


def test_the_shared_gpu_run_reads_each_process_line():
    """``scripts/gpu_shared_gpu.py --json`` records each process from its line and exit code
    (what BENCHMARKS' tables of that run were transcribed from before)."""
    from script_loading import load_script

    script = load_script("gpu_shared_gpu")
    ok = script.process_result("fa3.forward settings: {}\n"
                               "ok pid 7 (FlashAttention-3 kernels on): 4620 calls\n", 0)
    assert ok == {"clean": True, "calls": 4620, "kernels": "on",
                  "line": "ok pid 7 (FlashAttention-3 kernels on): 4620 calls"}
    fault = script.process_result("FAILED pid 8 (FlashAttention-3 kernels on) after 160 calls: "
                                  "AcceleratorError: CUDA error: unspecified launch failure\n", 1)
    assert not fault["clean"] and fault["calls"] == 160 and fault["kernels"] == "on"
    off = script.process_result("ok pid 9 (FlashAttention-3 kernels off): 5500 calls\n", 0)
    assert off["clean"] and off["kernels"] == "off"
    died = script.process_result("", -11)  # killed before it printed its line
    assert not died["clean"] and died["calls"] is None and "exit code -11" in died["line"]


@pytest.mark.skipif(not fa3.GLUON, reason="this Triton has no Gluon Hopper API (fa3.py's "
                    "functions are not defined)")
def test_heads_in_groups_start_every_tile_once_longest_first_within_each_group():
    """``_in_groups`` (written in plain operators, so Python runs the kernel's own function):
    every (tile, head) once; each head's tiles in rank order; the heads in contiguous groups
    of at most heads_together, their sizes within one of each other; one head at a time the
    order of a (tiles, heads) grid."""
    in_groups = fa3._in_groups.fn
    for n in range(1, 8):
        for heads in range(1, 41):
            for together in range(1, 18):
                order = [in_groups(t, n, heads, together) for t in range(n * heads)]
                assert sorted(order) == [(r, h) for r in range(n) for h in range(heads)]
                span = {}  # head -> (its first program, its last)
                for t, (r, h) in enumerate(order):
                    assert r == sum(1 for x in order[:t] if x[1] == h)  # ranks in order
                    span[h] = (span.get(h, (t, t))[0], t)
                groups = []  # heads whose programs interleave, in the order they start
                for h in sorted(span, key=lambda h: span[h][0]):
                    if groups and span[h][0] < span[groups[-1][-1]][1]:
                        groups[-1].append(h)
                    else:
                        groups.append([h])
                sizes = [len(g) for g in groups]
                assert max(sizes) <= together and max(sizes) - min(sizes) <= 1
                assert [h for g in groups for h in g] == list(range(heads))
                for g in groups:  # a group's tiles rank by rank across its heads
                    ranks = [r for r, h in order if h in g]
                    assert ranks == sorted(ranks)
                if together == 1:
                    assert order == [(t % n, t // n) for t in range(n * heads)]
    assert fa3.heads_together(2 * 4096 * 128 * 2, grouped=True) == 12
    assert fa3.heads_together(1 << 30, grouped=True) == 1
    assert fa3.heads_together(1, grouped=False) == 1


@pytest.mark.parametrize("change", ["cpu", "float32", "d96", "mask", "sinks"])
def test_calls_the_schedule_cannot_serve_are_refused(change):
    """``usable`` says no to what the kernel does not compute: the readable kernel takes it."""
    device = "cuda" if CUDA else "cpu"
    dtype = torch.float32 if change == "float32" else torch.bfloat16
    d = 96 if change == "d96" else 64
    q = torch.empty(1, 2, 256, d, device="cpu" if change == "cpu" else device, dtype=dtype)
    call = ops.Call(False, 1.0)
    if change == "mask":
        call = ops.Call(False, 1.0, block_mask=object())
    elif change == "sinks":
        call = ops.Call(False, 1.0, sinks=torch.zeros(2))
    assert not fa3.usable(q, q, q, call)


def _snake(Nq, Nk, heads, programs, consumers):
    """Each program's work under the kernel's snake deal (``_tile_of`` without a plan)."""
    n_q = -(-Nq // (64 * consumers))
    total = n_q * heads
    loads = [0] * programs
    for m in range(-(-total // programs)):
        for p in range(programs):
            t = m * programs + (p if m % 2 == 0 else programs - 1 - p)
            if t < total:
                loads[p] += fa3.q_tile_work(n_q - 1 - t // heads, Nq, Nk, consumers)
    return loads


@pytest.mark.parametrize("together", [0, 8])
@pytest.mark.parametrize("Nq,Nk,heads,programs,consumers",
                         [(4096, 4096, 128, 132, 3), (8192, 8192, 64, 132, 3),
                          (4096, 4096, 64, 132, 2), (1077, 1077, 48, 132, 3),
                          (1300, 777, 8, 5, 3), (129, 129, 2, 1, 2), (4096, 4096, 32, 114, 2)])
def test_the_causal_plan_deals_every_tile_once_and_evens_the_work(Nq, Nk, heads, programs,
                                                                  consumers, together):
    """``plan_causal``: every (Q tile, head) once; each program's list group by group (heads
    in groups of ``together``; 0: one group), longest first within a group (or, reversed,
    shortest first); no program more than one tile's work over the mean (the greedy's bound).
    At d = 64 and 4096 keys, where the snake's longest program counts 5% over the mean,
    within 1% in one group and 2% in groups of 8."""
    n_q = -(-Nq // (64 * consumers))
    plan = fa3.plan_causal(Nq, Nk, heads, programs, consumers, heads_together=together)
    assert sorted(t for tiles in plan for t in tiles) == list(range(n_q * heads))
    work = [fa3.q_tile_work(i, Nq, Nk, consumers) for i in range(n_q)]
    loads = [sum(work[t // heads] for t in tiles) for tiles in plan]
    size = together or heads
    for tiles in plan:
        keys = [((t % heads) // size, -work[t // heads]) for t in tiles]
        assert keys == sorted(keys)
    mean = sum(loads) / programs
    assert max(loads) <= mean + max(work)
    shortest = fa3.plan_causal(Nq, Nk, heads, programs, consumers, False, together)
    assert shortest == [tiles[::-1] for tiles in plan]
    if (Nq, heads, programs, consumers) == (4096, 128, 132, 3):
        assert max(loads) < (1.02 if together else 1.01) * mean
        assert max(_snake(Nq, Nk, heads, programs, 3)) > 1.04 * mean


def test_a_q_tiles_work_counts_each_consumers_own_tiles():
    """``q_tile_work``: one for the tile, plus each consumer's K/V tiles as the course counts
    them (``own_by_counting``, the step of ``_own_tiles``), one for a consumer past the last
    query."""
    from flashedu.checks.steps.fast import own_by_counting

    for Nq, Nk, consumers in ((4096, 4096, 3), (1300, 777, 3), (777, 1300, 2), (129, 129, 2)):
        for i in range(-(-Nq // (64 * consumers))):
            firsts = [(i * consumers + c) * 64 for c in range(consumers)]
            want = 1 + sum(own_by_counting(f, 64, Nk, 128) if f < Nq else 1 for f in firsts)
            assert fa3.q_tile_work(i, Nq, Nk, consumers) == want


def test_the_plan_reaches_the_kernel_as_rounds_of_programs():
    """``_plan_tensor``: program p's m-th item at [m, p], ``total`` (no item) past the end of
    its list; its rows are the rounds the persistent loops run."""
    table, rounds = fa3._plan_tensor(1300, 777, 8, 5, 3, True, 0, torch.device("cpu"))
    plan = fa3.plan_causal(1300, 777, 8, 5, 3)
    total = 7 * 8
    assert table.dtype == torch.int32 and tuple(table.shape) == (rounds, 5)
    assert rounds == max(map(len, plan))
    for p, tiles in enumerate(plan):
        assert table[:, p].tolist() == tiles + [total] * (rounds - len(tiles))


@pytest.mark.parametrize("together", [0, 16])
@pytest.mark.parametrize("Nq,Nk,heads,programs", [(4096, 4096, 128, 132), (1300, 777, 8, 5),
                                                  (777, 1300, 6, 7), (129, 129, 2, 1)])
def test_the_backward_plan_deals_every_kv_tile_once_and_evens_the_work(Nq, Nk, heads,
                                                                       programs, together):
    """``plan_backward``: every (K/V tile, head) once; each program's list group by group,
    longest first within a group; no program more than one tile's work over the mean."""
    from flashedu.triton import fa3_backward

    n_kv = -(-Nk // 128)
    plan = fa3_backward.plan_backward(Nq, Nk, heads, programs, together)
    assert sorted(t for tiles in plan for t in tiles) == list(range(n_kv * heads))
    work = [fa3_backward.kv_tile_work(j, Nq) for j in range(n_kv)]
    size = together or heads
    for tiles in plan:
        keys = [((t % heads) // size, -work[t // heads]) for t in tiles]
        assert keys == sorted(keys)
    loads = [sum(work[t // heads] for t in tiles) for tiles in plan]
    assert max(loads) <= sum(loads) / programs + max(work)


def test_a_kv_tiles_work_counts_the_q_tiles_that_see_it():
    """``kv_tile_work``: one for the tile, plus the Q tiles of 64 rows from its first key's
    (causal: none before it), none for a tile past the last query."""
    from flashedu.triton import fa3_backward

    assert [fa3_backward.kv_tile_work(j, 4096) for j in (0, 1, 31)] == [65, 63, 3]
    assert fa3_backward.kv_tile_work(0, 129) == 4  # a ragged last Q tile counts
    assert fa3_backward.kv_tile_work(5, 300) == 1  # keys past every query


def test_the_kv_buffers_are_one_or_two_and_counted_in_shared_memory():
    """``KV_BUFFERS`` other than 1 or 2, or more shared memory than a program may take, is
    refused by name before anything is launched; d = 64 holds two K/V buffers beside the
    stages, d = 128 one, as the table's schedules ask."""
    from flashedu.triton import fa3_backward

    q = torch.empty(1, 2, 256, 64, dtype=torch.bfloat16)
    D = torch.empty(1, 2, 256)
    args = (q, q, q, q, D, D, q.float(), q, q)
    kw = dict(is_causal=False, scale=1.0, STAGES=2, DQ_BUFFERS=1, CONSUMER_REGS=240,
              FRESH_DESCRIPTORS=False, PERSISTENT=True)
    with pytest.raises(ValueError, match="KV_BUFFERS"):
        fa3_backward.launch(*args, KV_BUFFERS=3, **kw)
    wide = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        fa3_backward.launch(wide, wide, wide, wide, D, D, wide.float(), wide, wide,
                            KV_BUFFERS=2, **kw)
    assert fa3_backward.shared_bytes(64, 2, 1, 2) <= fa3.SHARED_MEMORY
    assert fa3_backward.shared_bytes(128, 2, 1, 1) <= fa3.SHARED_MEMORY
    assert fa3_backward.shared_bytes(128, 2, 1, 2) > fa3.SHARED_MEMORY
    for d in (64, 128):
        b = GPU_16BIT[d].backward_schedule
        assert fa3_backward.shared_bytes(d, b.stages, b.dq_buffers,
                                         b.kv_buffers) <= fa3.SHARED_MEMORY


def test_the_q_buffers_are_one_or_two_and_counted_in_shared_memory():
    """``Q_BUFFERS`` other than 1 or 2 is refused by name before anything is launched; the
    shared memory it takes is what the table's choice relies on (d = 64: two fit beside
    three stages; d = 128: one)."""
    q = torch.empty(1, 2, 256, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Q_BUFFERS"):
        fa3.forward(q, q, q, q, torch.empty(1, 2, 256), is_causal=False, scale=1.0,
                    CONSUMERS=3, STAGES=3, CONSUMER_REGS=160, PERSISTENT=True, Q_BUFFERS=3)
    assert fa3.shared_bytes(64, 3, 3, 1) == 120 << 10 and fa3.shared_bytes(64, 3, 3, 2) == 144 << 10
    assert fa3.shared_bytes(128, 2, 3, 1) <= fa3.SHARED_MEMORY < fa3.shared_bytes(128, 2, 3, 2)
    table = GPU_16BIT
    for d in (64, 128):
        s = table[d].schedule
        assert fa3.shared_bytes(d, s.consumers, s.stages, s.q_buffers) <= fa3.SHARED_MEMORY
    assert table[64].schedule.settings(False)["Q_BUFFERS"] == 2
    assert table[64].schedule.settings(True)["Q_BUFFERS"] == 2  # causal persistent too
    assert table[128].schedule.settings(True)["Q_BUFFERS"] == 1  # persistent, one buffer


def test_the_schedule_runs_unless_the_environment_turns_it_off(monkeypatch):
    """With FLASHEDU_FA3=0 a call the kernel would serve goes to the readable kernels, forward
    and backward, and ``flashedu doctor`` says why; unset, or any other value, leaves them on."""
    import types

    from flashedu.triton import fa3_backward, fast

    monkeypatch.setattr(fa3, "GLUON", True)
    monkeypatch.setattr(fast, "TRITON", fa3.TESTED_TRITON[0])
    monkeypatch.setattr(fast, "tma_ok", lambda *tensors: True)
    monkeypatch.setattr(fa3, "_capability", lambda index: (9, 0))
    q = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16,
                              shape=(1, 2, 4096, 64), is_contiguous=lambda: True)
    call = ops.Call(True, 0.125)
    for value in (None, "1", "yes"):
        if value is None:
            monkeypatch.delenv(fa3.SWITCH_ENV, raising=False)
        else:
            monkeypatch.setenv(fa3.SWITCH_ENV, value)
        assert fa3.usable(q, q, q, call) and fa3_backward.usable(q, q, q, q, call)
    for value in ("0", " 0 "):
        monkeypatch.setenv(fa3.SWITCH_ENV, value)
        assert not fa3.usable(q, q, q, call) and not fa3_backward.usable(q, q, q, q, call)
        assert fa3.status().startswith("off: FLASHEDU_FA3=0 turns them off")


def test_do_is_copied_for_the_schedule_only_where_it_runs(monkeypatch):
    """FlashAttention-3's backward reads dO with q's one descriptor: a transposed dO of a
    contiguous q is made contiguous for it, and kept as it is (no copy) where the kernels do
    not run (another device, or switched off), the Triton kernels taking its strides."""
    import types

    from flashedu.triton import launch

    q = torch.zeros(2, 4, 8, 16)
    do = torch.zeros(2, 8, 4, 16).transpose(1, 2)
    assert launch.dout_layout(q, do) is do  # a CPU tensor: the kernels do not run here
    monkeypatch.setattr(fa3, "GLUON", True)
    monkeypatch.setattr(fa3, "_capability", lambda index: (9, 0))
    monkeypatch.setattr("flashedu.triton.fast.TRITON", fa3.TESTED_TRITON[0])
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0), is_contiguous=lambda: True)
    assert launch.dout_layout(on_gpu, do).is_contiguous()
    monkeypatch.setenv(fa3.SWITCH_ENV, "0")
    assert launch.dout_layout(on_gpu, do) is do
    monkeypatch.delenv(fa3.SWITCH_ENV)
    view = torch.zeros(2, 8, 4, 16).transpose(1, 2)  # q as a layer's view: never a copy
    assert launch.dout_layout(view, do) is do


def test_the_forward_takes_the_schedule_where_the_table_and_the_call_allow(monkeypatch):
    """launch.forward's dispatch, without a GPU (fa3's launch replaced by a recorder): a table
    entry that asks for the schedule and a call it can serve go to fa3.forward once, later
    calls laid out alike start its launch plan, and explicit tiles keep the Triton kernel (its
    launch replaced by a sentinel: CPU tensors, on any machine)."""
    from flashedu.triton import config, fast, launch
    from flashedu.triton import forward as fwd

    class Recorded:  # what fa3.forward returns: a launch to start again
        starts = 0
        hit = device = None  # (what fast.stream_for reads: no compiled kernel to start)

        def start(self, q, k, v, o, lse2):
            self.starts += 1
            o.fill_(2.0)

    plan, settings_seen = Recorded(), []

    def fake_forward(q, k, v, o, lse2, *, is_causal, scale, dropout_p, rng, **settings):
        settings_seen.append(settings)
        o.fill_(1.0)
        lse2.fill_(0.5)
        return plan

    entry = dataclasses.replace(config.INTERPRETER, schedule=config.Schedule(2, 3, 240),
                                schedule_from=64)
    monkeypatch.setattr(launch, "resolve_config", lambda *a, **kw: entry)
    monkeypatch.setattr(fa3, "usable", lambda *a: True)
    monkeypatch.setattr(fa3, "forward", fake_forward)
    monkeypatch.setattr(fast, "PLANS", {})
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    call = ops.Call(True, 0.25)
    o, lse2 = launch.forward(q, k, v, call, interpreted=False)
    assert settings_seen == [entry.schedule.settings(True)]
    assert (o == 1).all() and (lse2 == 0.5).all() and o.shape == q.shape
    keep = []
    o, _ = launch.forward(q, k, v, call, interpreted=False, keep=keep)
    assert len(settings_seen) == 1 and plan.starts == 1 and keep == [plan] and (o == 2).all()
    monkeypatch.setattr(fwd, "launch_args", _triton_kernels_reached)
    with pytest.raises(_TritonKernelsReached):  # tiles given
        launch.forward(q, k, v, call, tiles=entry.forward, interpreted=True)
    assert len(settings_seen) == 1


def _replace_fa3_launches(monkeypatch, forward, made):
    """Without a GPU: fa3's forward launch and its backward step replaced by ``forward`` and
    ``made``, both taken wherever the table asks for them, no launch plan kept yet."""
    from flashedu.triton import fa3_backward, fast, launch

    monkeypatch.setattr(launch, "FA3_BACKWARD", True)
    monkeypatch.setattr(fa3, "usable", lambda *a: True)
    monkeypatch.setattr(fa3_backward, "usable", lambda *a: True)
    monkeypatch.setattr(fa3, "forward", forward)
    monkeypatch.setattr(fa3_backward.Step, "made", staticmethod(made))
    monkeypatch.setattr(fast, "PLANS", {})


def test_a_dropout_call_hands_its_rng_to_the_schedule(monkeypatch):
    """A call with dropout goes to the fa3 forward and backward with its rate and its RNG
    state, and a repeat starts their plans with the new call's RNG state (each call draws its
    own mask); a call without dropout keeps plans of its own."""
    from flashedu.triton import config, launch

    seen = []

    class Recorded:  # a launch to start again: records what each start was given
        hit = device = None  # (what fast.stream_for reads: no compiled kernel to start)

        def __init__(self, kind):
            self.kind = kind

        def start(self, *tensors, stream=None):
            seen.append((self.kind, "start", tensors[-1]))

    def fake_forward(q, k, v, o, lse2, *, dropout_p, rng, **settings):
        seen.append(("forward", dropout_p, rng))
        o.zero_()
        lse2.zero_()
        return Recorded("forward")

    def made(*live, dropout_p, **settings):
        seen.append(("backward", dropout_p, live[9] if len(live) > 9 else None))
        return Recorded("backward")

    entry = dataclasses.replace(config.INTERPRETER, schedule=config.Schedule(2, 3, 240),
                                schedule_from=64, backward_schedule=config.BackwardSchedule())
    monkeypatch.setattr(launch, "resolve_config", lambda *a, **kw: entry)
    _replace_fa3_launches(monkeypatch, fake_forward, made)
    q, k, v, do = (torch.randn(1, 2, 64, 16) for _ in range(4))
    D = torch.zeros(1, 2, 64)
    rngs = [torch.tensor([s, 7]) for s in (1, 2)]
    for rng in rngs:
        call = ops.Call(False, 0.25, dropout_p=0.1, rng=rng)
        o, lse2 = launch.forward(q, k, v, call, interpreted=False)
        launch.backward(q, k, v, o, lse2, do, call, D=D, interpreted=False)
    assert seen == [("forward", 0.1, rngs[0]), ("backward", 0.1, rngs[0]),
                    ("forward", "start", rngs[1]), ("backward", "start", rngs[1])]
    launch.forward(q, k, v, ops.Call(False, 0.25), interpreted=False)
    assert seen[-1] == ("forward", 0.0, None)


def test_a_call_with_other_settings_does_not_repeat_a_plan_made_with_others(monkeypatch):
    """Two table entries whose schedules differ, one call layout: each entry's first call
    launches with its own settings (a plan repeats only what was made with the same ones),
    and a second call with the first entry starts that entry's plan again."""
    from flashedu.triton import config, launch

    made = []

    class Recorded:  # a launch to start again
        hit = device = None  # (what fast.stream_for reads: no compiled kernel to start)

        def __init__(self, kind, settings):
            self.kind, self.settings = kind, settings

        def start(self, *tensors, stream=None):
            made.append((self.kind, "start", self.settings))

    def fake_forward(q, k, v, o, lse2, *, dropout_p, rng, **settings):
        made.append(("forward", "made", settings["CONSUMERS"]))
        o.zero_()
        lse2.zero_()
        return Recorded("forward", settings["CONSUMERS"])

    def fake_step(*live, dropout_p, SELECT_ONCE, **settings):
        made.append(("backward", "made", SELECT_ONCE))
        return Recorded("backward", SELECT_ONCE)

    entries = [dataclasses.replace(config.INTERPRETER, schedule=config.Schedule(n, 3, 240),
                                   schedule_from=64,
                                   backward_schedule=config.BackwardSchedule(select_once=once))
               for n, once in ((2, False), (3, True))]
    _replace_fa3_launches(monkeypatch, fake_forward, fake_step)
    q, k, v, do = (torch.randn(1, 2, 64, 16) for _ in range(4))
    D = torch.zeros(1, 2, 64)
    call = ops.Call(False, 0.25)
    for entry in (*entries, entries[0]):
        monkeypatch.setattr(launch, "resolve_config", lambda *a, entry=entry, **kw: entry)
        o, lse2 = launch.forward(q, k, v, call, interpreted=False)
        launch.backward(q, k, v, o, lse2, do, call, D=D, config=entry, interpreted=False)
    assert made == [("forward", "made", 2), ("backward", "made", False),
                    ("forward", "made", 3), ("backward", "made", True),
                    ("forward", "start", 2), ("backward", "start", False)]


def test_the_backward_takes_the_schedule_where_the_table_and_the_call_allow(monkeypatch):
    """launch.backward's dispatch, without a GPU (the kernel's step replaced by a recorder): a
    table entry that asks for the schedule and a call it can serve make the step once, later
    calls laid out alike start it again (and hand the plan to ``keep``), and a call the step
    does not serve (an lse gradient here) takes the Triton kernels (their launch replaced by a
    sentinel)."""
    from flashedu.triton import backward as bwd
    from flashedu.triton import config, fa3_backward, fast, launch

    class Recorded:  # what Step.made returns: a step to start again
        starts = 0
        hit = device = None  # (what fast.stream_for reads: no compiled kernel to start)

        def start(self, q, k, v, do, lse2, D, dq, dk, dv, stream=None):
            self.starts += 1
            for grad in (dq, dk, dv):
                grad.fill_(2.0)

    step, seen = Recorded(), []

    def made(q, k, v, do, lse2, D, dq, dk, dv, *, is_causal, scale, dropout_p, **settings):
        seen.append((is_causal, scale, settings))
        for grad in (dq, dk, dv):
            grad.fill_(1.0)
        return step

    entry = dataclasses.replace(config.INTERPRETER, schedule_from=64,
                                backward_schedule=config.BackwardSchedule(2, 2))
    monkeypatch.setattr(launch, "resolve_config", lambda *a, **kw: entry)
    monkeypatch.setattr(fa3_backward, "usable", lambda *a: True)
    monkeypatch.setattr(fa3_backward.Step, "made", staticmethod(made))
    monkeypatch.setattr(fast, "PLANS", {})
    q, k, v, o, do = (torch.randn(1, 2, 64, 16) for _ in range(5))
    lse2, D = torch.zeros(1, 2, 64), torch.zeros(1, 2, 64)  # D given: no preprocess launch
    call = ops.Call(True, 0.25)
    grads = launch.backward(q, k, v, o, lse2, do, call, D=D, interpreted=False)
    assert seen == [(True, 0.25, entry.backward_schedule.settings(is_causal=True))]
    assert all((g == 1).all() and g.shape == x.shape for g, x in zip(grads, (q, k, v)))
    keep = []
    grads = launch.backward(q, k, v, o, lse2, do, call, D=D, interpreted=False, keep=keep)
    assert len(seen) == 1 and step.starts == 1 and keep == [(None, [step])]
    assert all((g == 2).all() for g in grads)
    monkeypatch.setattr(bwd, "launch_args", _triton_kernels_reached)
    with pytest.raises(_TritonKernelsReached):
        launch.backward(q, k, v, o, lse2, do, call, dlse=torch.zeros(1, 2, 64), D=D,
                        interpreted=True)
    assert len(seen) == 1 and step.starts == 1


class _TritonKernelsReached(Exception):
    """Raised where the Triton kernels would launch (on CPU tensors they cannot start on a
    machine that compiles for its GPU, nor without one)."""


def _triton_kernels_reached(*args, **kwargs):
    raise _TritonKernelsReached


def _fa3_backward_offered(monkeypatch, made):
    """launch.backward with a table entry that asks for the fa3 backward, fa3_backward.usable
    true, ``made`` in place of the fa3 step's first launch and _TritonKernelsReached in place
    of the Triton kernels' launch. Returns a plain call's (q, k, v, o, lse2, do, D)."""
    from flashedu.triton import backward as bwd
    from flashedu.triton import config, fa3_backward, fast, launch

    entry = dataclasses.replace(config.INTERPRETER, schedule_from=64,
                                backward_schedule=config.BackwardSchedule())
    monkeypatch.setattr(launch, "resolve_config", lambda *a, **kw: entry)
    monkeypatch.setattr(launch, "FA3_BACKWARD", True)
    monkeypatch.setattr(fa3_backward, "usable", lambda *a: True)
    monkeypatch.setattr(fa3_backward.Step, "made", staticmethod(made))
    monkeypatch.setattr(bwd, "launch_args", _triton_kernels_reached)
    monkeypatch.setattr(fast, "PLANS", {})
    q, k, v, o, do = (torch.randn(1, 2, 64, 16) for _ in range(5))
    return q, k, v, o, torch.zeros(1, 2, 64), do, torch.zeros(1, 2, 64)


def test_a_backward_whose_first_launch_fails_leaves_the_call_to_the_triton_kernels(monkeypatch):
    """A first launch that raises (before computing anything) warns once and turns the fa3
    backward off for the process: this call and later ones take the Triton kernels (here
    their launch is replaced by a sentinel: without a GPU they cannot start)."""
    from flashedu.triton import launch

    def refuse(*args, **kwargs):
        raise RuntimeError("Kernel requires a runtime memory allocation")

    q, k, v, o, lse2, do, D = _fa3_backward_offered(monkeypatch, refuse)
    with pytest.warns(UserWarning, match="FlashAttention-3's backward failed to launch"):
        with pytest.raises(_TritonKernelsReached):
            launch.backward(q, k, v, o, lse2, do, ops.Call(False, 0.25), D=D, interpreted=False)
    assert launch.FA3_BACKWARD is False
    with pytest.raises(_TritonKernelsReached):  # no second attempt
        launch.backward(q, k, v, o, lse2, do, ops.Call(False, 0.25), D=D, interpreted=False)


def test_a_backward_that_copies_k_and_v_keeps_no_plan_for_the_repeat(monkeypatch):
    """k, v views of one projection (gaps between rows): the fa3 backward takes copies laid out
    as dK, dV (it writes them with K's and V's strides), so a repeat must not start its plan
    with the caller's k, v: ``keep`` gets nothing; the gradients come back in those layouts."""
    from flashedu.triton import launch

    def made(q, k, v, do, lse2, D, dq, dk, dv, **settings):
        assert k.stride() == dk.stride() and v.stride() == dv.stride()
        for grad in (dq, dk, dv):
            grad.fill_(1.0)
        return object()

    q, _, _, o, lse2, do, D = _fa3_backward_offered(monkeypatch, made)
    k, v = torch.randn(1, 64, 2, 2, 16).permute(2, 0, 3, 1, 4)  # (1, 2, 64, 16) views
    keep = []
    grads = launch.backward(q, k, v, o, lse2, do, ops.Call(False, 0.25), D=D,
                            interpreted=False, keep=keep)
    assert keep == [] and all((g == 1).all() for g in grads)
    assert grads[1].transpose(1, 2).is_contiguous() and grads[2].transpose(1, 2).is_contiguous()


def test_deterministic_mode_leaves_the_backward_to_the_triton_kernels(monkeypatch):
    """FlashAttention-3's backward adds dQ in L2 in arrival order, so its dQ differs in the
    last bits from run to run: under torch.use_deterministic_algorithms the Triton kernels
    (whose dQ pass adds nothing) take the call (their launch replaced by a sentinel here), and
    the public API keeps a separate repeat for each mode."""
    from flashedu import api
    from flashedu.triton import launch

    def made(*args, **kwargs):
        raise AssertionError("the fa3 backward was launched in deterministic mode")

    q, k, v, o, lse2, do, D = _fa3_backward_offered(monkeypatch, made)
    key = lambda: api._repeat_key(q, k, v, None, False, None, 0.0, None, None,  # noqa: E731
                                  False, False, "triton")
    free_key = key()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(_TritonKernelsReached):
            launch.backward(q, k, v, o, lse2, do, ops.Call(False, 0.25), D=D, interpreted=False)
        assert key() != free_key
    finally:
        torch.use_deterministic_algorithms(was)


def test_doctor_says_whether_the_schedule_runs_here():
    from flashedu import runtime

    import flashedu.backends  # noqa: F401  the layer that adds the backends' section

    line = next(x for x in runtime.doctor(flashedu.__version__).splitlines()
                if "FlashAttention-3's forward" in x)
    assert line.endswith(fa3.status())
    assert fa3.status().startswith("on" if FA3 else "off: ")


# ------------------------------------------------------------------------------------------
# The backward (fa3_backward.py)
# ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("stages,dq_buffers,fresh", [(2, 1, False), (2, 1, True), (2, 2, False),
                                                     (3, 1, True)])
def test_the_backward_matches_the_float64_reference(shape, stages, dq_buffers, fresh):
    """dQ, dK, dV from the fa3 forward's O and L against the float64 reference's gradients,
    each allowed what plain attention in the inputs' dtype errs by, times flash-attention's
    factor."""
    from flashedu.triton import fa3_backward

    B, H, Hkv, Nq, Nk, d, causal, dtype = shape
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, d, dtype, seed=Nq + Nk + d + 1)
    scale = d ** -0.5
    o, lse2 = torch.empty_like(q), torch.empty(B, H, Nq, device="cuda")
    fa3.forward(q, k, v, o, lse2, is_causal=causal, scale=scale, CONSUMERS=2, STAGES=2,
                CONSUMER_REGS=240)
    dout = torch.randn_like(q)
    got = fa3_backward.backward(q, k, v, o, lse2, dout, is_causal=causal, scale=scale,
                                STAGES=stages, DQ_BUFFERS=dq_buffers, FRESH_DESCRIPTORS=fresh)
    _check_gradients(got, q, k, v, dout, causal, scale)


def _check_gradients(got, q, k, v, dout, causal, scale):
    """dq, dk, dv ``got`` against the float64 reference's gradients, each finite and allowed
    what plain attention in q's dtype errs by, times flash-attention's factor."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, is_causal=causal, scale=scale, enable_gqa=True)
    ref = torch.autograd.grad(ref, leaves, dout.double())
    plain = naive_attention_torch(*leaves, is_causal=causal, scale=scale, enable_gqa=True,
                                  upcast=False)
    plain = torch.autograd.grad(plain, leaves, dout)
    for name, g, r, p in zip(("dq", "dk", "dv"), got, ref, plain):
        assert torch.isfinite(g).all(), name
        tolerance.check(g, r, p, dtype=q.dtype, factor=tolerance.GRADIENT,
                        floor_scale=tolerance.GRADIENT, name=name)


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("kv_buffers,dropout", [(1, False), (2, False), (1, True), (2, True)])
@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (128, True)])
def test_a_persistent_backward_takes_many_kv_tiles_right(d, causal, kv_buffers, dropout):
    """More K/V tiles than SMs: each persistent program takes several, of different heads and
    lengths (causal: by the host's plan), its stage, dS and dQ counts running on across them
    and its K/V buffers refilled as they free. dK and dV equal one program per tile's bit for
    bit (each tile's sums in the same order); dQ, added in another order, is right against
    the float64 reference; with dropout each tile draws its own heads' mask."""
    from flashedu.dropout import draw_rng
    from flashedu.triton import fa3_backward

    if fa3_backward.shared_bytes(d, 2, 1, kv_buffers) > fa3.SHARED_MEMORY:
        pytest.skip(f"two K/V buffers do not fit beside the stages at d = {d}")
    B, H, Hkv, N = 4, 16, 8, 1077  # 9 K/V tiles of 8 heads in 4 batches: 288 items
    q, k, v = _inputs(B, H, Hkv, N, N, d, torch.bfloat16, seed=d + causal + 3)
    assert B * Hkv * -(-N // 128) > 2 * torch.cuda.get_device_properties(
        0).multi_processor_count
    scale, p = d ** -0.5, (0.2 if dropout else 0.0)
    rng = draw_rng(q.device) if dropout else None
    o, lse2 = torch.empty_like(q), torch.empty(B, H, N, device="cuda")
    fa3.forward(q, k, v, o, lse2, is_causal=causal, scale=scale, CONSUMERS=2, STAGES=2,
                CONSUMER_REGS=240, dropout_p=p, rng=rng)
    dout = torch.randn_like(q)
    kw = dict(is_causal=causal, scale=scale, FRESH_DESCRIPTORS=d == 128, dropout_p=p, rng=rng)
    got = fa3_backward.backward(q, k, v, o, lse2, dout, PERSISTENT=True,
                                KV_BUFFERS=kv_buffers, **kw)
    one_each = fa3_backward.backward(q, k, v, o, lse2, dout, **kw)
    assert torch.equal(got[1], one_each[1]) and torch.equal(got[2], one_each[2])
    if dropout:
        _check_with_the_same_mask(o, got, q, k, v, dout, is_causal=causal, scale=scale,
                                  enable_gqa=True, dropout_p=p, dropout_rng=rng)
    else:
        _check_gradients(got, q, k, v, dout, causal, scale)


def _check_with_the_same_mask(out, grads, q, k, v, dout, **kw):
    """``out`` and ``grads`` (dq, dk, dv) of attention with dropout against float64 naive
    attention that draws the same mask (kw: its options, dropout_rng the call's), each allowed
    what plain attention in q's dtype errs by (the gradients times flash-attention's factor).
    Returns the reference's output and lse, and its float64 leaves."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, lse = naive_attention_torch(*leaves, return_lse=True, **kw)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    low = [t.detach().requires_grad_() for t in (q, k, v)]
    plain = naive_attention_torch(*low, upcast=False, **kw)
    plain_grads = torch.autograd.grad(plain, low, dout)
    tolerance.check(out, ref, plain, dtype=q.dtype)
    for name, g, r, pl in zip(("dq", "dk", "dv"), grads, ref_grads, plain_grads):
        assert torch.isfinite(g).all(), name
        tolerance.check(g, r, pl, dtype=q.dtype, factor=tolerance.GRADIENT,
                        floor_scale=tolerance.GRADIENT, name=name)
    return ref, lse, leaves


DROPOUT_SETTINGS = [dict(CONSUMERS=2, STAGES=2, CONSUMER_REGS=240),
                    dict(CONSUMERS=2, STAGES=3, CONSUMER_REGS=240, PINGPONG=False,
                         PERSISTENT=True, TMA_STORE=True),
                    dict(CONSUMERS=3, STAGES=3, CONSUMER_REGS=160, PERSISTENT=True,
                         TMA_STORE=True)]


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("settings", DROPOUT_SETTINGS, ids=str)
def test_dropout_drops_the_streams_entries_forward_and_backward(shape, settings):
    """With dropout the forward and the backward (each setting of the table's kinds) drop the
    entries of ``flashedu.dropout``'s stream: O, L and the gradients against the float64
    reference that draws the same mask, allowed what plain attention in the inputs' dtype
    errs by."""
    from flashedu.dropout import draw_rng
    from flashedu.triton import fa3_backward

    B, H, Hkv, Nq, Nk, d, causal, dtype = shape
    if settings["CONSUMERS"] == 3 and d == 128:
        pytest.skip("three consumers of d=128 do not fit the registers (not in the table)")
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, d, dtype, seed=Nq + Nk + d + 2)
    scale, p = d ** -0.5, 0.2
    rng = draw_rng(q.device)
    o, lse2 = torch.empty_like(q), torch.empty(B, H, Nq, device="cuda")
    fa3.forward(q, k, v, o, lse2, is_causal=causal, scale=scale, dropout_p=p, rng=rng,
                **settings)
    dout = torch.randn_like(q)
    got = fa3_backward.backward(q, k, v, o, lse2, dout, is_causal=causal, scale=scale,
                                FRESH_DESCRIPTORS=d == 128, dropout_p=p, rng=rng)
    kw = dict(is_causal=causal, scale=scale, enable_gqa=True, dropout_p=p, dropout_rng=rng)
    ref, lse, leaves = _check_with_the_same_mask(o, got, q, k, v, dout, **kw)
    assert tolerance.max_error(lse2 / fa3.LOG2E, lse) < 1e-4  # the undropped scores' lse
    # the mask drops: without it the output is another
    undropped = naive_attention_torch(*leaves, **{**kw, "dropout_p": 0.0})
    assert (undropped - ref).abs().max() > 0.05


@pytest.mark.gpu
@needs_fa3
def test_the_api_takes_the_schedule_with_dropout_and_repeats_with_new_masks():
    """flashedu.attention with dropout at a length the table gives the schedule: forward and
    backward as the float64 reference with the same mask, call after call (the repeat's plan
    takes each call's RNG state), and reproducible under torch.manual_seed."""
    from flashedu.dropout import draw_rng

    B, H, N, d = 1, 4, 4096 + 77, 64
    q, k, v = _inputs(B, H, H, N, N, d, torch.bfloat16, seed=5)
    dout = torch.randn_like(q)
    outs = []
    for torch_seed in (1, 2, 1):
        torch.manual_seed(torch_seed)
        rng = draw_rng(q.device)
        torch.manual_seed(torch_seed)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flashedu.attention(*leaves, dropout_p=0.1, backend="triton")
        grads = torch.autograd.grad(out, leaves, dout)
        _check_with_the_same_mask(out, grads, q, k, v, dout, dropout_p=0.1, dropout_rng=rng)
        outs.append(out)
    assert (outs[0] - outs[1]).abs().max() > 0.01  # two seeds, two masks
    assert torch.equal(outs[0], outs[2])  # the same seed, the same mask


def test_every_thread_gets_the_scratch_allocator():
    """Device-side descriptors need Triton's allocator, which lives in a context variable per
    thread; autograd runs the backward on a thread of its own, so ensure_allocator must set it
    there too (a process-wide "done" flag left that thread without one)."""
    import threading

    from triton.runtime import _allocation

    from flashedu.triton import fast

    fast.ensure_allocator()
    seen = []

    def other_thread():
        fast.ensure_allocator()
        seen.append(_allocation._allocator.get())

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert len(seen) == 1 and not isinstance(seen[0], _allocation.NullAllocator)


@pytest.mark.skipif(not flashedu.runtime.triton_interpreted(),
                    reason="the interpreter's path (CPU tensors through Triton's launcher); on a "
                           "GPU the plan starts its compiled kernel directly")
def test_a_plan_started_on_another_thread_brings_the_allocator_there():
    """A launch plan started on a thread other than the one that made it (autograd's, for a
    backward) goes through Triton's launcher where it cannot start directly (here: the
    interpreter), which takes scratch from that thread's allocator: Launch.start sets it."""
    import threading

    from triton.runtime import _allocation

    from flashedu.triton import launch

    o, do = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    D = torch.empty(1, 2, 8)
    planned = launch._preprocess(o, do, D, 64, planned=True)
    D.zero_()
    seen = []

    def other_thread():
        planned.start(o, do, D)
        seen.append(_allocation._allocator.get())

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert len(seen) == 1 and not isinstance(seen[0], _allocation.NullAllocator)
    torch.testing.assert_close(D, (o * do).sum(-1))
