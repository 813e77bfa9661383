"""The checks of the steps of notebooks 00, 01 and 12 (flashedu/checks/steps/beyond.py): each
solved step passes, the learner's skeleton is "not implemented yet", and typical wrong answers
fail with a message that names the mistake. NumPy only: seconds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import step_loading

from flashedu import course
from flashedu.checks import check

STEPS = {  # step id -> its check
    "00.intensity": "step_intensity_matmul",
    "01.naive_attention": "step_naive_attention",
    "12.merge": "step_merge_two",
    "12.partial": "step_partial_attention",
    "12.split_kv": "step_split_kv",
    "12.sink": "step_sink_attention",
}
HEADER = "import math\n\nimport numpy as np\n\n"


def namespace():
    """What the step cells find in their notebook: NumPy, math, and (12.split_kv) the solved
    merge and partial attention."""
    scope = {"np": np, "math": math}
    scope["merge_two"] = course.reference("12.merge", dict(scope))
    scope["partial_attention"] = course.reference("12.partial", dict(scope))
    return scope


# the step's function with the notebook's earlier steps beside it
load, mutant = step_loading.loaders(HEADER, namespace)


test_solved_step_passes, test_skeleton_is_not_implemented_yet = \
    step_loading.solved_and_skeleton_tests(STEPS, namespace, load)


PARTIAL_TAIL = """    m = S.max(axis=1)
    m = np.where(np.isneginf(m), 0, m)           # a row that sees no key: 0 in place of -inf
    E = np.exp(S - m[:, None])                   # 0 for every masked key
    l = E.sum(axis=1)
    seen = l > 0
    l_safe = np.where(seen, l, 1)
    O_s = (E @ V_s) / l_safe[:, None]            # a row that sees nothing: 0 / 1 = 0
    L_s = np.where(seen, m + np.log(l_safe), -np.inf)"""
PLAIN_TAIL = """    m = S.max(axis=1)
    E = np.exp(S - m[:, None])
    l = E.sum(axis=1)
    O_s = (E @ V_s) / l[:, None]
    L_s = m + np.log(l)"""

MUTANTS = [  # step, what is wrong, replacements, words the message must hold
    ("12.sink", "the sink left out of l", [(" + np.exp(sink - m)", "")], ["one more term"]),
    ("12.sink", "the sink left out of the row max",
     [("m = np.maximum(S.max(axis=1), sink)", "m = S.max(axis=1)")], ["sink"]),
    ("00.intensity", "C's write left out",
     [("(M * K + K * N + M * N)", "(M * K + K * N)")], ["leave out writing C"]),
    ("00.intensity", "a multiply-add as one FLOP", [("2 * M * N * K", "M * N * K")],
     ["a multiply-add is 2 FLOPs"]),
    ("01.naive_attention", "no scale", [(" * Q.shape[1] ** -0.5", "")], ["without the scale"]),
    ("01.naive_attention", "no max subtracted",
     [("np.exp(S - m)", "np.exp(S)"), ("m + np.log(l)", "0 * m + np.log(l)")],
     ["logits in the hundreds", "NaN", "Subtract"]),
    ("01.naive_attention", "a float64 scalar on float32 inputs",
     [("Q.shape[1] ** -0.5", "np.float64(Q.shape[1] ** -0.5)")], ["dtype float64", "d ** -0.5"]),
    ("12.merge", "no care for rows where both parts are empty",
     [("ref = np.where(np.isneginf(L), 0, L)", "ref = L")],
     ["both parts are empty", "NaN"]),
    ("12.merge", "exp(L) on its own",
     [("np.logaddexp(L_a, L_b)", "np.log(np.exp(L_a) + np.exp(L_b))")],
     ["L in the hundreds", "Never exponentiate L alone"]),
    ("12.merge", "the package's merge", [("    return w_a * O_a + w_b * O_b, L",
                                          "    from flashedu.merge import merge\n"
                                          "    return merge(O_a, L_a, O_b, L_b)")],
     ["flashedu.merge"]),
    ("12.partial", "top-left causal", [("(np.arange(Nq) + Nk - Nq)", "np.arange(Nq)")],
     ["bottom-right"]),
    ("12.partial", "chunk-local key positions",
     [("j = np.arange(lo, hi)", "j = np.arange(hi - lo)")], ["global position"]),
    ("12.partial", "no care for empty rows", [(PARTIAL_TAIL, PLAIN_TAIL)],
     ["NaN", "see no key of this chunk"]),
    ("12.split_kv", "the keys past num_splits * (Nk // num_splits) dropped",
     [("chunk = math.ceil(Nk / num_splits)", "chunk = Nk // num_splits"),
      ("range(0, Nk, chunk)", "range(0, num_splits * chunk, chunk)")],
     ["Nk = 10", "Do not drop the keys"]),
    ("12.split_kv", "each chunk overwrites the last",
     [("O, L = merge_two(O, L, O_s, L_s)", "O, L = O_s, L_s")], ["merge_two"]),
]


@pytest.mark.parametrize("step_id, what, replace, words", MUTANTS,
                         ids=[f"{m[0]}: {m[1]}" for m in MUTANTS])
def test_typical_mistake_fails_with_a_useful_message(step_id, what, replace, words, tmp_path):
    result = check(STEPS[step_id], mutant(step_id, replace, tmp_path), seed=0)
    assert not result.passed, f"{step_id} with {what} passed its check"
    for word in words:
        assert word in result.message, f"{word!r} not in:\n{result.message}"


def test_merge_accepts_the_max_trick_instead_of_logaddexp(tmp_path):
    """Another correct merge (the max of the two L, then the weights) passes too."""
    source = '''def merge_two(O_a, L_a, O_b, L_b):
    m = np.maximum(L_a, L_b)
    m = np.where(np.isneginf(m), 0, m)
    w_a, w_b = np.exp(L_a - m), np.exp(L_b - m)
    s = w_a + w_b
    safe = np.where(s > 0, s, 1)
    O = (w_a[:, None] * O_a + w_b[:, None] * O_b) / safe[:, None]
    L = np.where(s > 0, m + np.log(safe), -np.inf)
    return O.astype(O_a.dtype), L.astype(L_a.dtype)
'''
    result = check("step_merge_two", load("12.merge", source, tmp_path), seed=0)
    assert result.passed, str(result)
