"""The autograder of the exercises.

    from flashedu.checks import check
    result = check("flash_forward", flash_forward)   # shows a tick or a cross in a notebook
    assert result.passed, result.message

Exercise names: safe_softmax, online_softmax, flash_forward, flash_backward, block_sparse_forward
(NumPy, signatures as DESIGN.md's contract), numba_forward_kernel and triton_forward_kernel (the
learner's kernel, run through the launchers in :mod:`flashedu.checks.numba_forward` and
:mod:`flashedu.checks.triton_forward`), and triton_backward_dkdv_kernel and
triton_backward_dq_kernel (the two kernels of the backward, each graded on its own outputs: dK
and dV, or dQ; ``launch_triton_backward`` in :mod:`flashedu.checks.triton_backward` runs the
pair). :mod:`flashedu.checks.kernels` gathers the four.

A check never raises for anything the learner's code does: errors, wrong shapes, NaN, infinite
loops (time limit) all become a failed result with a message and a hint. Unfilled exercises
(the placeholder ``# YOUR CODE HERE`` / ``raise NotImplementedError()`` still in place) report
"not implemented yet"; a NotImplementedError that a finished function raises is an error like
any other. Inputs are drawn fresh for each check; the message names the random seed. During a check,
flashedu's references, ``flashedu.attention`` and torch's softmax and attention are off, and the
learner's function runs in a child process (:mod:`.child`) while the grading stays in this one.
"""

from __future__ import annotations

from .child import run_exercise
from .engine import Exercise
from .kernels import EXERCISES as _KERNEL_EXERCISES
from .numpy_exercises import EXERCISES as _NUMPY_EXERCISES
from .result import NOT_IMPLEMENTED, CaseResult, CheckResult
from .steps import collect as _collect_steps

# the graded exercises of exercises/ (``flashedu check`` grades these)
EXERCISES: dict[str, Exercise] = {ex.name: ex for ex in _NUMPY_EXERCISES + _KERNEL_EXERCISES}
# the notebooks' steps (practice: checked the same way, never graded; see flashedu.course)
STEPS: dict[str, Exercise] = {ex.name: ex for ex in _collect_steps()}
_clash = set(EXERCISES) & set(STEPS)
assert not _clash, f"step checks named as exercises: {_clash}"


def check(name: str, fn, seed: int | None = None) -> CheckResult:
    """Grade ``fn`` as exercise (or step check) ``name``; see the module docstring. ``seed``
    repeats the inputs of an earlier check (its message names the random seed)."""
    ex = EXERCISES.get(name) or STEPS.get(name)
    if ex is None:
        raise ValueError(f"unknown exercise {name!r}; the exercises are: {', '.join(EXERCISES)}"
                         f"; the notebooks' steps: {', '.join(STEPS)}")
    try:
        result = run_exercise(ex, fn, seed)
    except Exception as exc:  # noqa: BLE001 - a bug of the grader must not end the learner's cell
        return CheckResult(name, False, f"the checker itself failed (a bug in flashedu.checks, "
                           f"please report it): {type(exc).__name__}: {exc}", 0.0, ex.points)
    if name in EXERCISES:
        from .. import progress

        progress.record("exercises", name, passed=result.passed, status=result.status)
    return result


__all__ = ["EXERCISES", "NOT_IMPLEMENTED", "STEPS", "CaseResult", "CheckResult", "check"]
