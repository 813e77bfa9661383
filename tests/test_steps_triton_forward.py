"""The checks of notebook 06's steps (flashedu/checks/steps/triton_ramp.py): each solved step
passes, the learner's skeleton is "not implemented yet", and typical wrong kernels fail with a
message that names the mistake. Triton runs in its interpreter on a CPU: small cases, seconds."""

from __future__ import annotations


import pytest
import step_loading

import flashedu
from flashedu.checks import check
from flashedu.course.notebooks import find, solution_code

pytestmark = pytest.mark.skipif(flashedu.available_backends()["triton"] is not None,
                                reason="triton backend unavailable (no triton, or no GPU and no "
                                       "interpreter)")

STEPS = {  # step id -> its check
    "06.copy_tile": "triton_step_copy_tile",
    "06.matmul": "triton_step_matmul",
    "06.softmax": "triton_step_softmax",
    "06.flash_forward": "triton_step_flash_forward",
    "06.exp2": "triton_step_flash_forward_exp2",
}
HEADER = "import triton\nimport triton.language as tl\n\n"
load, mutant = step_loading.loaders(HEADER)


def namespace():
    import triton
    import triton.language as tl

    return {"triton": triton, "tl": tl}


test_solved_step_passes, test_skeleton_is_not_implemented_yet = \
    step_loading.solved_and_skeleton_tests(STEPS, namespace, load)


STORE_Y = "tl.store(Y + rows[:, None] * stride_ym + cols[None, :] * stride_yn, tile, mask=mask)"
MUTANTS = [  # step, what is wrong, replacements, words the message must hold
    ("06.copy_tile", "store without a mask", [(STORE_Y, STORE_Y.replace(", mask=mask", ""))],
     ["partial tiles", "wrote outside Y"]),
    ("06.copy_tile", "column stride taken as 1",
     [("cols[None, :] * stride_xn", "cols[None, :]")], ["a transpose", "NaN in Y", "stride_xn"]),
    ("06.copy_tile", "mask on the rows only",
     [("mask = (rows[:, None] < M) & (cols[None, :] < N)", "mask = rows[:, None] < M")],
     ["partial tiles", "cols < N"]),  # the interpreter sees the loads, a GPU the stores
    ("06.matmul", "the last partial step along K skipped",
     [("range(0, K, BK)", "range(0, K // BK * BK, BK)")],
     ["M=20, N=24, K=50", "C is wrong", "range(0, K, BK)"]),
    ("06.matmul", "A's K stride taken as 1",
     [("ks[None, :] * stride_ak", "ks[None, :]")], ["A is a transpose", "C is wrong", "stride_ak"]),
    ("06.matmul", "store without a mask",
     [("acc,\n             mask=(rows[:, None] < M) & (cols[None, :] < N))", "acc)")],
     ["M=20, N=24, K=50", "wrote outside C"]),
    ("06.softmax", "no max trick", [("p = tl.exp(x - m[:, None])", "p = tl.exp(x)")],
     ["logits in the hundreds", "NaN", "max trick"]),
    ("06.softmax", "padding columns left at 0",
     [('x = tl.where(cols[None, :] < N, x, float("-inf"))', "x = x")],
     ["M=10, N=37", "Y is wrong", "-inf"]),
    ("06.softmax", "rows addressed by N, not by their stride",
     [("rows[:, None] * stride_xm", "rows[:, None] * N")],
     ["rows further apart than N", "stride_xm"]),
    ("06.flash_forward", "O_i not rescaled by alpha",
     [("O_i = alpha[:, None] * O_i + ", "O_i = O_i + ")], ["several tiles", "O is wrong"]),
    ("06.flash_forward", "L_i without m_i",
     [("m_i + tl.log(l_i), mask=row_ok", "tl.log(l_i), mask=row_ok")],
     ["one tile", "O is right but L is not"]),
    ("06.flash_forward", "O stored without a mask",
     [("O_i / l_i[:, None], mask=row_ok[:, None])", "O_i / l_i[:, None])")],
     ["edge tiles", "wrote outside O"]),
    ("06.exp2", "L_i left in base 2",
     [("(m_i + tl.math.log2(l_i)) * 0.6931471805599453", "m_i + tl.math.log2(l_i)")],
     ["one tile", "O is right but L is not", "ln 2"]),
]


@pytest.mark.parametrize("step_id, mistake, replace, words", MUTANTS,
                         ids=[f"{m[0]}: {m[1]}" for m in MUTANTS])
def test_wrong_step_is_rejected(step_id, mistake, replace, words, tmp_path):
    result = check(STEPS[step_id], mutant(step_id, replace, tmp_path), seed=0)
    assert not result.passed, f"{mistake}: passed"
    for word in words:
        assert word in result.message, f"{mistake}: {word!r} not in\n{result.message}"


def test_exp2_step_refuses_tl_exp(tmp_path):
    """The forward kernel itself, renamed: right outputs, but not the step asked for."""
    source = solution_code(find("06.flash_forward", "step")).replace(
        "def flash_forward_kernel(", "def flash_forward_kernel_exp2(")
    result = check(STEPS["06.exp2"], load("06.exp2", source, tmp_path), seed=0)
    assert not result.passed and "still calls exp" in result.message, str(result)
