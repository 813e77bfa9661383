"""Building blocks for the checks of the notebooks' steps (:mod:`flashedu.checks.steps`).

A step check is an ordinary :class:`~.engine.Exercise` with no points: the engine runs it as it
runs an exercise (the learner's code in a forked child, the references and the comparison
here), so a step gets the same messages: the failing case, the error against float64, a hint.

- :func:`function_step`: a Python/NumPy function, called as ``fn(*case.args)``; ``adapt`` turns
  what it returns into the arrays the case names (an int becomes a 0-d float64 array, ...).
- :func:`kernel_step`: a ``@triton.jit`` or ``@cuda.jit`` kernel, run by ``launch(kernel,
  *case.args)`` (which makes the tensors, launches, and returns NumPy arrays). A kernel step's
  name must start with ``triton_`` or ``numba_``: on a GPU such a check runs in this process
  (CUDA does not survive a fork).
"""

from __future__ import annotations

import numpy as np

from .engine import Case, Exercise
from .sandbox import call_limited


def untouched(value):
    """``adapt`` for a step whose outputs must keep the inputs' dtype: what it returned."""
    return value


def as_arrays(value, dtype=np.float64):
    """What a step returned, as float arrays: numbers, bools, tuples of them and arrays.
    Anything else is passed through, so that the engine reports its type."""
    def one(v):
        if isinstance(v, (bool, int, float, np.integer, np.floating, np.bool_)):
            return np.asarray(v, dtype=dtype)
        if isinstance(v, np.ndarray) and v.dtype != dtype and v.dtype.kind in "biuf":
            return v.astype(dtype)
        if hasattr(v, "detach"):  # a torch tensor
            return v.detach().cpu().double().numpy().astype(dtype)
        return v
    if isinstance(value, (tuple, list)):
        return tuple(one(v) for v in value)
    return one(value)


def case(label, hint, args, outputs, expected, *, naive=(), dtype=np.float64, **extra) -> Case:
    """A case whose ``expected`` is float64 (numbers become 0-d arrays)."""
    expected = tuple(np.asarray(e, dtype=np.float64) for e in expected)
    return Case(label, hint, tuple(args), tuple(outputs), expected, tuple(naive), dtype=dtype,
                **extra)


def function_step(name, symbol, cases, *, adapt=None, timeout=30.0, diagnose=None,
                  inspect=None) -> Exercise:
    """A step that is a plain function. ``adapt(value) -> arrays`` (default :func:`as_arrays`
    for float64 cases) runs on what the learner's function returns, in the learner's process.
    ``inspect(fn) -> problem text or None``: what the function may not use, looked at before
    it runs."""
    adapt = adapt or as_arrays

    def invoke(fn, view, timeout_, measure):
        return call_limited(lambda *a: adapt(fn(*a, **view.kwargs)), view.args,
                            timeout=timeout_, measure_memory=measure)

    return Exercise(name, 0, symbol, cases, invoke=invoke, timeout=timeout, diagnose=diagnose,
                    inspect=inspect)


def kernel_step(name, symbol, cases, launch, *, kind="triton", timeout=120.0,
                diagnose=None) -> Exercise:
    """A step that is a GPU kernel, launched by ``launch(kernel, *case.args)`` -> arrays."""
    from .kernel_common import _kernel_problem, _still_skeleton, _triton_unavailable
    from .numba_forward import _numba_unavailable

    if not name.startswith(kind + "_"):
        raise ValueError(f"a {kind} kernel step's name must start with {kind + '_'!r}: {name}")

    def invoke(fn, view, timeout_, measure):
        return call_limited(lambda *a: launch(fn, *a), view.args, timeout=timeout_,
                            measure_memory=measure)

    return Exercise(name, 0, symbol, cases, invoke=invoke, timeout=timeout, diagnose=diagnose,
                    requires=_triton_unavailable if kind == "triton" else _numba_unavailable,
                    unfilled=_still_skeleton, inspect=lambda k: _kernel_problem(k, kind))
