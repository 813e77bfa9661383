"""The checks of notebook 05's numba steps: each solved step passes, and a typical wrong version
fails with a message that names the mistake. Kernels run in numba's CUDA simulator on a CPU
(tiny shapes), or compiled where a GPU is."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashedu import course, runtime
from flashedu.checks import check
from flashedu.course.notebooks import find, solution_code

numba = pytest.importorskip("numba", reason="numba is not installed: the numba steps need it")
from numba import cuda, float32  # noqa: E402

from flashedu.checks.numba_forward import _numba_unavailable  # noqa: E402

if _numba_unavailable():
    pytest.skip(f"numba.cuda cannot run here: {_numba_unavailable()}", allow_module_level=True)

SIMULATED = runtime.numba_simulated()
NS = {"cuda": cuda, "float32": float32, "math": math, "np": np}
STEPS = {
    "05.where_am_i": "numba_step_where_am_i",
    "05.rotate": "numba_step_rotate",
    "05.matmul_naive": "numba_step_matmul_naive",
    "05.matmul_tiled": "numba_step_matmul_tiled",
    "05.flash_rows": "numba_step_flash_rows",
    "05.matmul_registers": "numba_step_matmul_registers",
}
simulator_only = pytest.mark.skipif(not SIMULATED, reason="reads and races are counted in "
                                    "numba's simulator only")


def variant(step_id, tmp_path, *edits):
    """The solved step with each (old, new) edit made: a typical wrong answer. Written to a
    file, as a notebook cell is, so that the checks can read its source."""
    code = solution_code(find(step_id, "step"))
    for old, new in edits:
        assert old in code, f"{step_id}: {old!r} is not in the solved cell"
        code = code.replace(old, new)
    path = tmp_path / f"wrong_{step_id.replace('.', '_')}.py"
    path.write_text(code, encoding="utf-8")
    scope = dict(NS)
    exec(compile(code, str(path), "exec"), scope)  # noqa: S102 - the course's own cell, edited
    return scope[find(step_id, "step").symbol]


def failing(step_id, fn):
    result = check(STEPS[step_id], fn, seed=0)
    assert not result.passed, f"{step_id}: a wrong version passed"
    return result.message


@pytest.mark.parametrize("step_id", list(STEPS))
def test_the_solved_step_passes(step_id):
    result = check(STEPS[step_id], course.reference(step_id, NS), seed=0)
    assert result.passed, result.message


def test_where_am_i_needs_the_global_index_and_the_guard(tmp_path):
    local = variant("05.where_am_i", tmp_path,
                    ("i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
                     "i = cuda.threadIdx.x"))
    assert "restarts at 0 in every block" in failing("05.where_am_i", local)
    unguarded = variant("05.where_am_i", tmp_path,
                        ("if i < out.shape[1]:", "if True:"))
    message = failing("05.where_am_i", unguarded)
    assert "out of bounds" in message or "wrote outside out" in message


@simulator_only
def test_rotate_without_its_barrier_races(tmp_path):
    racy = variant("05.rotate", tmp_path, ("if use_barrier:", "if False:"))
    assert "a data race on shared memory" in failing("05.rotate", racy)
    always = variant("05.rotate", tmp_path, ("if use_barrier:", "if True:"))
    assert "use_barrier=False no race showed" in failing("05.rotate", always)


def test_a_kernel_is_not_a_builder():
    message = failing("05.rotate", course.reference("05.where_am_i", NS))
    assert "plain function that defines the kernel" in message


def test_matmul_naive_needs_its_guard(tmp_path):
    unguarded = variant("05.matmul_naive", tmp_path,
                        ("if row < C.shape[0] and col < C.shape[1]:", "if True:"))
    message = failing("05.matmul_naive", unguarded)
    assert "out of bounds" in message or "wrote outside C" in message


@simulator_only
def test_matmul_tiled_catches_races_global_reads_and_a_lost_k_step(tmp_path):
    racy = variant("05.matmul_tiled", tmp_path, ("if barrier_2:", "if False:"))
    assert "a data race on shared memory" in failing("05.matmul_tiled", racy)
    from_global = variant("05.matmul_tiled", tmp_path,
                          ("acc += A_s[ty, kk] * B_s[kk, tx]",
                           "acc += (A[row, k0 + kk] * B[k0 + kk, col] if row < M and col < N "
                           "and k0 + kk < K else float32(0.0))"))
    assert "read A from global memory" in failing("05.matmul_tiled", from_global)
    short = variant("05.matmul_tiled", tmp_path,
                    ("for k0 in range(0, K, TILE):", "for k0 in range(0, K - K % TILE, TILE):"))
    assert "partial k-step" in failing("05.matmul_tiled", short)


@simulator_only
def test_flash_rows_must_stage_k_and_v_in_shared_memory(tmp_path):
    from_global = variant("05.flash_rows", tmp_path,
                          ("s += q[c] * K_j[r, c]", "s += q[c] * K[h, k0 + r, c]"),
                          ("O_i[c] += p * V_j[r, c]", "O_i[c] += p * V[h, k0 + r, c]"))
    assert "read K from global memory" in failing("05.flash_rows", from_global)


def test_flash_rows_without_the_rescale(tmp_path):
    no_alpha = variant("05.flash_rows", tmp_path,
                       ("O_i[c] = alpha * O_i[c]", "O_i[c] = O_i[c]"))
    message = failing("05.flash_rows", no_alpha)
    assert "O is wrong" in message and "L is right" in message


def test_matmul_registers_with_one_output_per_thread(tmp_path):
    one = variant("05.matmul_registers", tmp_path,
                  ("                for r in range(TM):\n                    for c in range(TN):\n"
                   "                        acc[r, c] += a[r] * b[c]",
                   "                acc[0, 0] += a[0] * b[0]"))
    message = failing("05.matmul_registers", one)
    assert "C is wrong" in message or "C contains NaN" in message
