"""The autograder of the exercises.

    from flashedu.checks import check
    result = check("flash_forward", flash_forward)   # shows a tick or a cross in a notebook
    assert result.passed, result.message

Exercise names: safe_softmax, online_softmax, flash_forward, flash_backward, block_sparse_forward
(NumPy, signatures as DESIGN.md's contract), numba_forward_kernel and triton_forward_kernel (the
learner's kernel, run through the launchers in :mod:`flashedu.checks.kernels`), and
triton_backward_dkdv_kernel and triton_backward_dq_kernel (the two kernels of the backward, each
graded on its own outputs: dK and dV, or dQ; ``launch_triton_backward`` runs the pair).

A check never raises for anything the learner's code does: errors, wrong shapes, NaN, infinite
loops (time limit) all become a failed result with a message and a hint. Unfilled exercises
(``raise NotImplementedError()``) report "not implemented yet".
"""

from __future__ import annotations

import json

from .engine import Exercise, run_exercise
from .kernels import EXERCISES as _KERNEL_EXERCISES
from .numpy_exercises import EXERCISES as _NUMPY_EXERCISES
from .result import NOT_IMPLEMENTED, CaseResult, CheckResult

EXERCISES: dict[str, Exercise] = {ex.name: ex for ex in _NUMPY_EXERCISES + _KERNEL_EXERCISES}

# name -> (the object checked, its result): the last check of each exercise in this process,
# so that `flashedu check` need not re-run a check the notebook already ran on the same object.
_LAST: dict[str, tuple[object, CheckResult]] = {}

RESULTS_MARKER = "FLASHEDU-CHECK-RESULTS:"


def check(name: str, fn) -> CheckResult:
    """Grade ``fn`` as exercise ``name``; see the module docstring."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; the exercises are: {', '.join(EXERCISES)}")
    try:
        result = run_exercise(EXERCISES[name], fn)
    except Exception as exc:  # noqa: BLE001 - a bug of the grader must not end the learner's cell
        ex = EXERCISES[name]
        return CheckResult(name, False, f"the checker itself failed (a bug in flashedu.checks, "
                           f"please report it): {type(exc).__name__}: {exc}", 0.0, ex.points)
    _LAST[name] = (fn, result)
    return result


def grade_namespace(namespace: dict, names) -> list[dict]:
    """Results of exercises ``names`` for the objects a notebook defined (used by
    ``flashedu check``): the learner's function is looked up by its expected name, so an edited
    check cell cannot change what is graded; a check already run on that same object is reused.
    """
    out = []
    for name in names:
        fn = namespace.get(EXERCISES[name].symbol)
        last = _LAST.get(name)
        result = last[1] if last is not None and last[0] is fn and fn is not None else check(name, fn)
        out.append(result.to_dict())
    return out


def print_namespace_results(namespace: dict, names) -> None:
    """Print grade_namespace(...) as one JSON line that ``flashedu check`` finds in the output."""
    print(RESULTS_MARKER + json.dumps(grade_namespace(namespace, names)))


__all__ = ["EXERCISES", "NOT_IMPLEMENTED", "CaseResult", "CheckResult", "check"]
