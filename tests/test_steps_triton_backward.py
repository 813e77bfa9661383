"""The checks of notebook 07's steps (flashedu/checks/steps/triton_backward.py): the D kernel,
the dK/dV kernel and the dQ kernel. Each solved step passes, the learner's skeleton is "not
implemented yet", and typical wrong kernels fail with a message that names the mistake. The
dK/dV and dQ steps run the non-causal cases of exercise 07. Triton runs in its interpreter on a
CPU: small cases, seconds."""

from __future__ import annotations


import pytest
import step_loading

import flashedu
from flashedu.checks import EXERCISES, check
from flashedu.checks import STEPS as CHECKS

pytestmark = pytest.mark.skipif(flashedu.available_backends()["triton"] is not None,
                                reason="triton backend unavailable (no triton, or no GPU and no "
                                       "interpreter)")

STEPS = {  # step id -> its check
    "07.delta": "triton_step_delta",
    "07.dkdv": "triton_step_dkdv",
    "07.dq": "triton_step_dq",
}
HEADER = "import triton\nimport triton.language as tl\n\n"
load, mutant = step_loading.loaders(HEADER)


def namespace():
    import triton
    import triton.language as tl

    return {"triton": triton, "tl": tl}


test_solved_step_passes, test_skeleton_is_not_implemented_yet = \
    step_loading.solved_and_skeleton_tests(STEPS, namespace, load)


@pytest.mark.parametrize("which", ["dkdv", "dq"])
def test_steps_are_the_exercises_non_causal_cases(which):
    """The steps stop one step short of exercise 07: its cases, none of them causal."""
    step = CHECKS[f"triton_step_{which}"].cases()
    exercise = {c.label: c for c in EXERCISES[f"triton_backward_{which}_kernel"].cases()}
    assert len(step) >= 10 and not any(c.args[6] for c in step)
    assert all(c.label in exercise for c in step)
    assert any(c.args[6] for c in exercise.values())


DELTA_STORE = "tl.store(Delta + rows, tl.sum(dO_i * O_i, axis=1), mask=ok)"
DV_STORE = "dV_j, mask=col_ok[:, None])"
MUTANTS = [  # step, what is wrong, replacements, words the message must hold
    ("07.delta", "O_i * O_i", [("tl.sum(dO_i * O_i, axis=1)", "tl.sum(O_i * O_i, axis=1)")],
     ["one tile", "rowsum(O_i * O_i)"]),
    ("07.delta", "store without a mask", [(DELTA_STORE, DELTA_STORE.replace(", mask=ok", ""))],
     ["partial last tile", "wrote outside Delta"]),
    ("07.delta", "rows addressed by D, not by their stride",
     [("rows[:, None] * stride_o", "rows[:, None] * D")], ["row strides", "stride_o"]),
    ("07.dkdv", "Delta_i forgotten",
     [("dS_ij = P_ij * (dP_ij - Delta_i[:, None])", "dS_ij = P_ij * dP_ij")],
     ["dK is wrong", "without Delta_i"]),
    ("07.dkdv", "dV stored with scale", [(DV_STORE, DV_STORE.replace("dV_j,", "dV_j * scale,"))],
     ["dV is wrong but dK is right"]),
    ("07.dq", "dQ with scale twice",
     [("dQ_i += tl.dot(dS_ij, K_j)", "dQ_i += tl.dot(dS_ij, K_j) * scale")],
     ["dQ is wrong", "scale twice"]),
    ("07.dq", "rows addressed by D, not by their stride",
     [("rows[:, None] * stride_dq", "rows[:, None] * D")], ["row strides", "never r * D"]),
]


@pytest.mark.parametrize("step_id, mistake, replace, words", MUTANTS,
                         ids=[f"{m[0]}: {m[1]}" for m in MUTANTS])
def test_wrong_step_is_rejected(step_id, mistake, replace, words, tmp_path):
    result = check(STEPS[step_id], mutant(step_id, replace, tmp_path), seed=0)
    assert not result.passed, f"{mistake}: passed"
    for word in words:
        assert word in result.message, f"{mistake}: {word!r} not in\n{result.message}"
