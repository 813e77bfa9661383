"""The checks of the steps of notebook 13 (flashedu/checks/steps/inference.py): each solved step
passes, the learner's skeleton is "not implemented yet", and typical wrong answers fail with a
message that names the mistake. NumPy only: seconds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import step_loading

from flashedu import course
from flashedu.checks import check

STEPS = {  # step id -> its check
    "13.decode_intensity": "step_decode_intensity",
    "13.read_cache": "step_read_cache",
    "13.online_sink": "step_online_sink",
    "13.sink_gradient": "step_sink_gradient",
    "13.packed_visible": "step_packed_visible",
}
HEADER = "import math\n\nimport numpy as np\n\n"


def namespace():
    """What the step cells find in their notebook: NumPy, math, and (13.sink_gradient) the
    solved online softmax with a sink."""
    scope = {"np": np, "math": math}
    scope["online_sink_attention"] = course.reference("13.online_sink", dict(scope))
    return scope


load, mutant = step_loading.loaders(HEADER, namespace)


test_solved_step_passes, test_skeleton_is_not_implemented_yet = \
    step_loading.solved_and_skeleton_tests(STEPS, namespace, load)


WHOLE_ROWS = """    S = (Q @ K.T) * d ** -0.5
    m = np.maximum(S.max(axis=1), sink)
    P = np.exp(S - m[:, None])
    l = P.sum(axis=1) + np.exp(sink - m)
    return (P @ V) / l[:, None], m + np.log(l)
    m = np.full(Nq, sink, dtype=Q.dtype)"""

MUTANTS = [  # step, what is wrong, replacements, words the message must hold
    ("13.decode_intensity", "K and V read once per query head",
     [("2 * Hkv * N * d", "2 * H * N * d")], ["once per query head"]),
    ("13.decode_intensity", "one product only", [("2 * (2 * H * N * d)", "2 * H * N * d")],
     ["two products"]),
    ("13.decode_intensity", "numbers, not bytes", [(" * itemsize", "")], ["per number"]),
    ("13.read_cache", "the pool read in order, the table ignored",
     [("cache[pages[j // page_size], j % page_size]",
       "cache.reshape(-1, *cache.shape[2:])[:n]")], ["pool's first n rows"]),
    ("13.read_cache", "page and row swapped",
     [("cache[pages[j // page_size], j % page_size]",
       "cache[pages[j % page_size], j // page_size]")], ["page_size"]),
    ("13.online_sink", "started from nothing, the sink forgotten",
     [("m = np.full(Nq, sink, dtype=Q.dtype)", "m = np.full(Nq, -np.inf, dtype=Q.dtype)"),
      ("l = np.ones(Nq, dtype=Q.dtype)", "l = np.zeros(Nq, dtype=Q.dtype)")],
     ["Start each row from the sink"]),
    ("13.online_sink", "the old O not rescaled",
     [("O = alpha[:, None] * O + P @ V[j:j + Bc]", "O = O + P @ V[j:j + Bc]")], ["Bc"]),
    ("13.online_sink", "a whole row block of scores at once",
     [("    m = np.full(Nq, sink, dtype=Q.dtype)", WHOLE_ROWS)], ["never", "MiB"]),
    ("13.sink_gradient", "the sign flipped", [("return -(np.exp", "return (np.exp")],
     ["sign is flipped"]),
    ("13.sink_gradient", "D left out", [("* D).sum()", ").sum()")], ["D_i"]),
    ("13.packed_visible", "causal over the whole packed row",
     [("seen &= b[None, :] <= (a + shift)[:, None]",
       "seen &= np.arange(Tk)[None, :] <= np.arange(Tq)[:, None]")], ["whole packed row"]),
    ("13.packed_visible", "top-left within each sequence",
     [("(a + shift)[:, None]", "a[:, None]")], ["bottom-right"]),
]


@pytest.mark.parametrize("step_id, what, replace, words", MUTANTS,
                         ids=[f"{m[0]}: {m[1]}" for m in MUTANTS])
def test_typical_mistake_fails_with_a_useful_message(step_id, what, replace, words, tmp_path):
    result = check(STEPS[step_id], mutant(step_id, replace, tmp_path), seed=0)
    assert not result.passed, f"{step_id} with {what} passed its check"
    for word in words:
        assert word in result.message, f"{word!r} not in:\n{result.message}"


def test_another_correct_sink_gradient_passes(tmp_path):
    """Another correct gradient (from the keys' logsumexp and the merge, not the loop) passes."""
    source = '''def sink_gradient(Q, K, V, sink, dO):
    S = (Q @ K.T) * Q.shape[1] ** -0.5
    L = np.logaddexp(np.log(np.exp(S - S.max(1, keepdims=True)).sum(1)) + S.max(1), sink)
    O = np.exp(S - L[:, None]) @ V
    return -(np.exp(sink - L) * (dO * O).sum(1)).sum()
'''
    result = check("step_sink_gradient", load("13.sink_gradient", source, tmp_path), seed=0)
    assert result.passed, str(result)
