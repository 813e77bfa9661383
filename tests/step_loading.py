"""Loading a notebook step from source for the tests of its check: the solved cell, its
skeleton, or a mutant of the solution (the solved cell with a mistake put in)."""

from __future__ import annotations

import importlib.util
import itertools

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
