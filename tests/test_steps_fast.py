"""Notebook 10: the checks of its steps (flashedu/checks/steps/fast.py) and the compiler behind
its first section (`flashedu.benchmarks.sass.compile_kernel`: a learner's Triton kernel compiled
for an H100 on a machine without a GPU).

The steps are plain Python: each solved step passes, the skeleton is "not implemented yet", and
typical wrong answers fail with a message that names the mistake. The compiler tests skip where
this Triton has no NVIDIA tools (ptxas, cuobjdump, nvdisasm)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from flashedu import course
from flashedu.checks import check
from flashedu.course.build import strip_source
from flashedu.checks.result import NOT_IMPLEMENTED
from flashedu.checks.steps import fast
from flashedu.course.notebooks import find, solution_code

STEPS = {  # step id -> its check
    "10.kv_tiles": "step_kv_tiles",
    "10.smem": "step_smem",
    "10.programs_per_sm": "step_programs_per_sm",
    "10.ring": "step_ring_slot",
    "10.deal": "step_persistent_deal",
    "10.own": "step_own_tiles",
    "10.finish": "step_finish_time",
    "10.plan": "step_plan_tiles",
    "10.exp2_cubic": "step_exp2_cubic",
}


def define(step_id, source):
    """The step's function from ``source``, written to a file first (the engine reads a
    function's source to tell a skeleton from an answer)."""
    import importlib.util
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="steps_fast_"))
    path = folder / f"step_{step_id.replace('.', '_')}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, find(step_id, "step").symbol)


def mutant(step_id, replace):
    """The solved step with each (old, new) replacement made."""
    source = solution_code(find(step_id, "step"))
    for old, new in replace:
        assert old in source, f"the mutation no longer applies to {step_id}: {old!r}"
        source = source.replace(old, new)
    return define(step_id, source)


@pytest.mark.parametrize("step_id", list(STEPS))
def test_solved_step_passes(step_id):
    result = check(STEPS[step_id], course.reference(step_id, {}), seed=0)
    assert result.passed, str(result)


@pytest.mark.parametrize("step_id", list(STEPS))
def test_skeleton_is_not_implemented_yet(step_id):
    skeleton = strip_source(find(step_id, "step").source)
    assert "# YOUR CODE HERE" in skeleton
    result = check(STEPS[step_id], define(step_id, skeleton), seed=0)
    assert result.status == NOT_IMPLEMENTED, str(result)


MUTANTS = [  # step, what is wrong, replacements, words the message must hold
    ("10.exp2_cubic", "masked scores not clamped",
     [("x = np.maximum(x, np.float32(-126))", "pass")], ["P is wrong", "Clamp x at -126"]),
    ("10.exp2_cubic", "round, not floor", [("n = np.floor(x)", "n = np.round(x)")],
     ["P is wrong", "not round(x)"]),
    ("10.exp2_cubic", "a quadratic", [("C2 + f * C3", "C2")], ["P is wrong", "off by up to"]),
    ("10.exp2_cubic", "the exponential itself",
     [("    return (p.view", "    return np.exp2(x).astype(np.float32)\n    return (p.view")],
     ["calls exp2", "this step replaces"]),
    ("10.finish", "the work spread evenly",
     [("return max(free)", "return sum(works) / sms")], ["finish is wrong", "spreads the work"]),
    ("10.finish", "the programs handed out in turn",
     [("for work in works:\n        heapq.heappush(free, heapq.heappop(free) + work)",
       "for k, work in enumerate(works):\n        free[k % sms] += work")],
     ["finish is wrong", "in turn"]),
    ("10.plan", "the items in the order given",
     [("sorted(range(len(works)), key=lambda k: -works[k])", "range(len(works))")],
     ["owner is wrong", "longest first"]),
    ("10.plan", "the items handed out in turn",
     [("    for k in sorted(", "    turn = 0\n    for k in sorted("),
      ("load, p = heapq.heappop(loads)", "load, p = 0, turn % programs\n        turn += 1")],
     ["owner is wrong", "in turn"]),
    ("10.ring", "the copy warp waits on the consumers' parity",
     [("1 - ready_phase", "ready_phase")], ["free_phase is wrong", "hang"]),
    ("10.ring", "the parity of the tile, not of the stage's fill",
     [("ready_phase = fill % 2", "ready_phase = j % 2")],
     ["ready_phase is wrong", "fills of stage"]),
    ("10.deal", "every deal in the same order",
     [("(p if m % 2 == 0 else P - 1 - p)", "p")], ["t is wrong", "same order"]),
    ("10.deal", "a program's tiles one after another",
     [("m * P + (p if m % 2 == 0 else P - 1 - p)", "p * P + m")], ["t is wrong", "one to each"]),
    ("10.own", "the consumer's first row decides",
     [("first + M - 1", "first")], ["tiles is wrong", "first row"]),
    ("10.own", "the tiles rounded down",
     [("-(-min(Nk, last_row + 1) // Bc)", "min(Nk, last_row + 1) // Bc")],
     ["tiles is wrong", "round up"]),
    ("10.own", "keys past the last one",
     [("min(Nk, last_row + 1)", "(last_row + 1)")], ["tiles is wrong", "past the last key"]),
    ("10.kv_tiles", "causal tiles judged by the last row",
     [("min(Nk, first_row + 1) if causal", "min(Nk, last_row + 1) if causal")],
     ["num_full is wrong", "FIRST row"]),
    ("10.kv_tiles", "the ragged last tile counted as unmasked",
     [("num_full = whole // Bc", "num_full = -(-whole // Bc)")],
     ["num_full is wrong", "need the mask"]),
    ("10.kv_tiles", "causal ignored when counting the visits",
     [("end = min(Nk, last_row + 1) if causal else Nk", "end = Nk")],
     ["num is wrong", "with causal the program stops"]),
    ("10.smem", "V_j forgotten",
     [("stages * 2 * Bc * d", "stages * Bc * d")], ["KiB is wrong", "V_j is loaded"]),
    ("10.smem", "bytes, not KiB", [(" / 1024", "")], ["KiB is wrong", "bytes, not KiB"]),
    ("10.smem", "Q_i loaded once per stage",
     [("(Br * d + stages * 2 * Bc * d)", "stages * (Br * d + 2 * Bc * d)")],
     ["Q_i counted once per stage"]),
    ("10.programs_per_sm", "registers not rounded up",
     [("per_thread = -(-registers // 8) * 8", "per_thread = registers")],
     ["169 registers", "programs is wrong", "rounded up"]),
    ("10.programs_per_sm", "registers only",
     [("min(by_registers, by_shared, by_threads)", "by_registers")],
     ["programs is wrong", "counts the registers only"]),
]


@pytest.mark.parametrize("step_id, mistake, replace, words", MUTANTS,
                         ids=[f"{m[0]}: {m[1]}" for m in MUTANTS])
def test_wrong_step_is_rejected(step_id, mistake, replace, words):
    result = check(STEPS[step_id], mutant(step_id, replace), seed=0)
    assert not result.passed, f"{mistake}: passed"
    for word in words:
        assert word in result.message, f"{mistake}: {word!r} not in\n{result.message}"


def test_the_references_agree_with_the_package():
    """The checks count from the definitions; the package's kernels use formulas. Same answers."""
    solved = course.reference("10.kv_tiles", {})
    for Nk in (1, 15, 16, 17, 100, 512):
        for Br, Bc in ((16, 16), (32, 64), (64, 32), (128, 128)):
            for i in range(math.ceil(Nk / Br)):
                for causal in (False, True):
                    want = fast.kv_tiles_by_keys(i, Br, Bc, Nk, causal)
                    assert solved(i, Br, Bc, Nk, causal) == want, (i, Br, Bc, Nk, causal)
    deal = course.reference("10.deal", {})
    for P in (1, 2, 7, 132):
        for p in range(P):
            for m in range(6):
                assert deal(m, p, P) == fast.deal_by_dealing(m, p, P), (m, p, P)
    finish = course.reference("10.finish", {})
    rng = __import__("random").Random(0)
    for _ in range(200):
        works = [rng.randint(1, 40) for _ in range(rng.randint(1, 60))]
        sms = rng.randint(1, 12)
        assert finish(works, sms) == fast.finish_by_clock(works, sms), (works, sms)
    plan = course.reference("10.plan", {})
    for _ in range(200):
        works = [rng.randint(1, 40) for _ in range(rng.randint(1, 60))]
        programs = rng.randint(1, 12)
        assert plan(works, programs) == fast.plan_by_scanning(works, programs), (works, programs)
    from flashedu.triton import fa3  # the kernel's plan, one group of heads: the same owners

    for N, heads, programs, consumers in ((4096, 128, 132, 3), (1077, 6, 7, 2), (300, 3, 1, 3)):
        n_q = -(-N // (64 * consumers))
        works = [fa3.q_tile_work(t // heads, N, N, consumers) for t in range(n_q * heads)]
        owner = fast.plan_by_scanning(works, programs)
        in_order = sorted(range(len(works)), key=lambda t: -works[t])
        assert fa3.plan_causal(N, N, heads, programs, consumers) == [
            [t for t in in_order if owner[t] == p] for p in range(programs)]
    own = course.reference("10.own", {})  # fa3.py's _own_tiles, for a consumer of a program
    for Nk in (1, 63, 64, 300, 777, 4096):
        for M, Bc in ((64, 64), (64, 128), (16, 32)):
            for first in range(0, Nk + 2 * M, M):
                kernel = max(1, -(-min(Nk, first + M) // Bc))
                assert own(first, M, Nk, Bc) == kernel == fast.own_by_counting(first, M, Nk, Bc)
    ring = course.reference("10.ring", {})
    for j in range(40):
        for stages in range(1, 6):
            assert ring(j, stages) == fast.ring_by_running(j, stages), (j, stages)
    programs = course.reference("10.programs_per_sm", {})
    for regs in (24, 64, 127, 128, 129, 168, 255):
        for warps in (2, 4, 8):
            for shared in (0, 16384, 65536, 114688, 229376):
                assert programs(regs, warps, shared) == fast.programs_by_filling(regs, warps,
                                                                                 shared)


# ------------------------------------------------------------------------------------------
# sass.compile_kernel: a kernel of one's own, compiled for an H100 without a GPU
# ------------------------------------------------------------------------------------------

def _compiler():
    from flashedu.benchmarks import sass

    if not sass.can_compile():
        pytest.skip("this Triton has no NVIDIA backend tools (ptxas, cuobjdump, nvdisasm)")
    return sass


def test_compile_kernel_reads_registers_and_instructions_of_ones_own_kernel(tmp_path):
    sass = _compiler()
    import torch

    module = _kernel_module(tmp_path)
    x = torch.empty(64, 64, dtype=torch.float16)
    out = torch.empty(64, 64, dtype=torch.float32)
    rows = sass.compile_kernel(module.tile_kernel, (x, out, 64),
                               [dict(BM=64, num_warps=4), dict(BM=16, num_warps=4)])
    big, small_ = rows
    assert big["kernel"] == "tile_kernel" and big["registers"] > 0
    assert big["ops"].get("HGMMA", 0) > 0 and big["mufu"].get("EX2", 0) > 0  # wgmma, exp2
    assert small_["ops"].get("HGMMA", 0) == 0 and small_["ops"].get("HMMA", 0) > 0
    assert big["shared_bytes"] > 0 and big["stack_bytes"] == 0
    again = sass.compile_kernel(module.tile_kernel, (x, out, 64), dict(BM=64, num_warps=4))
    assert again == big  # remembered: no second compile


def test_compile_kernel_says_why_a_kernel_does_not_compile(tmp_path):
    sass = _compiler()
    import torch

    module = _kernel_module(tmp_path)
    x = torch.empty(64, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="not_a_function"):
        sass.compile_kernel(module.broken_kernel, (x,), dict(BM=16))


KERNELS = '''
import flashedu  # noqa: F401
import triton
import triton.language as tl

SCALE = tl.constexpr(2.0)


@triton.jit
def _twice(x):
    return x * SCALE


@triton.jit
def tile_kernel(X, OUT, stride, BM: tl.constexpr):
    rows = tl.arange(0, BM)
    cols = tl.arange(0, 64)
    x = tl.load(X + rows[:, None] * stride + cols[None, :])
    y = tl.load(X + cols[:, None] * stride + tl.arange(0, 64)[None, :])
    acc = tl.dot(x, y)
    tl.store(OUT + rows[:, None] * stride + cols[None, :], tl.math.exp2(_twice(acc)))


@triton.jit
def broken_kernel(X, BM: tl.constexpr):
    tl.store(X + tl.arange(0, BM), tl.not_a_function(BM))
'''


def _kernel_module(tmp_path):
    import importlib.util

    path = tmp_path / "kernels_for_sm90.py"
    path.write_text(KERNELS, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
