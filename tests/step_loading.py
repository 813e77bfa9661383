"""Loading a notebook step from source for the tests of its check: the solved cell, its
skeleton, or a mutant of the solution (the solved cell with a mistake put in)."""

from __future__ import annotations

import importlib.util
import itertools

import pytest

from flashedu import course
from flashedu.checks import check
from flashedu.checks.result import NOT_IMPLEMENTED
from flashedu.course.build import strip_source
from flashedu.course.notebooks import find, solution_code

_counter = itertools.count()


def loaders(header: str, namespace=None):
    """(load, mutant) for steps whose cells need ``header`` (their imports) and, where given,
    ``namespace()``: the notebook's earlier definitions the cell uses."""

    def load(step_id, source, tmp_path):
        """The step's symbol from ``source``, written to a file (@triton.jit reads its
        function's source back, and the skeleton test reads the placeholder)."""
        path = tmp_path / f"step_{next(_counter)}.py"
        path.write_text(header + source, encoding="utf-8")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        for name, value in (namespace() if namespace else {}).items():
            setattr(module, name, value)
        spec.loader.exec_module(module)
        return getattr(module, find(step_id, "step").symbol)

    def mutant(step_id, replace, tmp_path):
        """The solved step with each (old, new) replacement made."""
        source = solution_code(find(step_id, "step"))
        for old, new in replace:
            assert old in source, f"the mutation no longer applies to {step_id}: {old!r}"
            source = source.replace(old, new)
        return load(step_id, source, tmp_path)

    return load, mutant


def solved_and_skeleton_tests(steps, namespace, load):
    """The two tests of every notebook's steps (``steps``: step id -> its check): the solved
    step passes its check, and the learner's skeleton is "not implemented yet". A test module
    takes them as its own: ``test_solved_step_passes, test_skeleton_is_not_implemented_yet =
    solved_and_skeleton_tests(STEPS, namespace, load)``."""

    @pytest.mark.parametrize("step_id", list(steps))
    def test_solved_step_passes(step_id):
        result = check(steps[step_id], course.reference(step_id, namespace()), seed=0)
        assert result.passed, str(result)

    @pytest.mark.parametrize("step_id", list(steps))
    def test_skeleton_is_not_implemented_yet(step_id, tmp_path):
        skeleton = strip_source(find(step_id, "step").source)
        assert "# YOUR CODE HERE" in skeleton
        result = check(steps[step_id], load(step_id, skeleton, tmp_path), seed=0)
        assert result.status == NOT_IMPLEMENTED, str(result)

    return test_solved_step_passes, test_skeleton_is_not_implemented_yet
