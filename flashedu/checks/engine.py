"""Run one exercise's cases against a learner's function and turn what happens into a result.

An :class:`Exercise` is a list of :class:`Case` objects (inputs, float64 reference outputs, a hint
in plain words) and a way to call the learner's object on a case (directly for the NumPy
exercises, through a launcher for the numba and Triton kernels). Each case is checked in this
order, and the first problem found is the one reported:

1. it finished in time, and did not raise (NotImplementedError means "not implemented yet");
2. it returned what the contract says (a tuple of the right length, arrays of the right shape
   and dtype);
3. it left its inputs alone;
4. every output is within tolerance of the float64 reference (see :mod:`.compare`);
5. the case's probe agrees (memory, blocks it must skip, shared memory, writes out of bounds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import compare
from .result import FAILED, NOT_IMPLEMENTED, PASSED, SKIPPED, CaseResult, CheckResult
from .sandbox import Call, brief_traceback, call_limited


@dataclass
class Case:
    label: str
    hint: str  # what this case is about, and the mistake it catches, in plain words
    args: tuple
    outputs: tuple  # names of the returned arrays, e.g. ("O", "L")
    expected: tuple  # float64 reference of each output
    naive: tuple = ()  # each output computed naively in the case's dtype: sets the tolerance
    kwargs: dict = field(default_factory=dict)
    inputs: tuple = ()  # names of the array arguments, in order (for the mutation check)
    dtype: object = np.float64
    memory_budget: int | None = None  # most bytes the call may allocate at once
    memory_note: str = ""  # what the forbidden array would have cost, for the message
    probe: Callable | None = None  # probe(call, outputs) -> problem text or None
    needs_pass: bool = False  # run only if every earlier case passed (the costly probes)
    floor_scale: float = 1.0  # widen the dtype's error floor (e.g. TF32 dots on a GPU)
    block_q: int | None = None  # Br, when the case has Q tiles (for the diagnosis)


@dataclass
class Exercise:
    name: str
    points: float
    symbol: str  # what the learner defines in the notebook
    cases: Callable  # () -> list[Case]; built lazily: some need torch, numba or triton
    invoke: Callable | None = None  # (fn, case, timeout, measure) -> Call; None: fn(*args)
    diagnose: Callable | None = None  # (case, wrong: {name: rows}, outputs) -> extra hint
    timeout: float = 20.0
    requires: Callable | None = None  # () -> reason this machine cannot run it, or None
    unfilled: Callable | None = None  # (fn) -> True when it is still the skeleton (kernels)


def run_exercise(ex: Exercise, fn) -> CheckResult:
    problem = _not_checkable(ex, fn)
    if problem:
        return _result(ex, False, FAILED, problem, [])
    if ex.unfilled is not None and ex.unfilled(fn):
        return _result(ex, False, NOT_IMPLEMENTED, "", [])
    unavailable = ex.requires() if ex.requires else None
    if unavailable:
        return _result(ex, False, FAILED, f"cannot run this check here: {unavailable}", [])
    rows, first = [], None
    stop = False
    for case in ex.cases():
        if stop or (case.needs_pass and first is not None):
            why = "skipped: fix the cases above first" if not stop else "skipped"
            rows.append(CaseResult(case.label, SKIPPED, why))
            continue
        row, message, status = _run_case(ex, fn, case)
        rows.append(row)
        if status == NOT_IMPLEMENTED:
            return _result(ex, False, NOT_IMPLEMENTED, message, [])
        if row.status == FAILED and first is None:
            first = message
        stop = stop or status == "timeout"
    if first is None:
        return _result(ex, True, PASSED, f"All {len(rows)} cases passed.", rows)
    return _result(ex, False, FAILED, first, rows)


def _not_checkable(ex: Exercise, fn) -> str | None:
    if fn is None:
        return f"`{ex.symbol}` is not defined: run the cell that defines it, then this check."
    if not callable(fn):
        return (f"check('{ex.name}', ...) needs your function `{ex.symbol}`, got "
                f"{type(fn).__name__}: pass the function itself, without calling it.")
    return None


def _result(ex, passed, status, message, rows) -> CheckResult:
    if status == NOT_IMPLEMENTED:
        message = (f"`{ex.symbol}` is not implemented yet: replace `raise NotImplementedError()` "
                   "with your code, run the cell, then run this check again.")
    return CheckResult(name=ex.name, passed=passed, message=message,
                       points=ex.points if passed else 0.0, max_points=ex.points,
                       status=status, cases=rows)


def _run_case(ex: Exercise, fn, case: Case):
    """(CaseResult, message for the learner, status) for one case."""
    arrays = [a for a in case.args if isinstance(a, np.ndarray)]
    snapshot = [a.copy() for a in arrays]
    measure = case.memory_budget is not None
    if ex.invoke is None:
        call = call_limited(fn, case.args, case.kwargs, timeout=ex.timeout, measure_memory=measure)
    else:
        call = ex.invoke(fn, case, ex.timeout, measure)
    outputs, problem, status = None, None, FAILED
    if call.timed_out:
        problem, status = _timeout_text(ex, case), "timeout"
    elif call.not_implemented:
        return CaseResult(case.label, FAILED, "not implemented"), "", NOT_IMPLEMENTED
    elif call.error is not None:
        problem = f"your code raised an error:\n{brief_traceback(call.error)}"
        if isinstance(call.error, IndexError):
            problem += ("\nAn index ran past the end of an array: guard the last, partial "
                        "tiles (e.g. `if row < Nq`, `if j < Nk`).")
    else:
        outputs, problem = _unpack(case, call.value)
    problem = problem or _mutated(case, arrays, snapshot)
    max_err = None
    if problem is None:
        problem, max_err = _compare(ex, case, outputs)
    if problem is None:
        problem = _probe(case, call, outputs)
    row = CaseResult(case.label, PASSED if problem is None else FAILED,
                     "" if problem is None else problem, max_err, round(call.seconds, 3))
    if problem is None:
        return row, "", PASSED
    message = f"Failed case: {case.label}\n{problem}\nHint: {case.hint}"
    return row, message, status


def _timeout_text(ex, case) -> str:
    return (f"it did not finish within {ex.timeout:g} s. An infinite loop (a `while` whose "
            "index never moves, a `range` that never ends)? Or a Python loop over single "
            "elements where NumPy could work on a whole tile at once?")


def _unpack(case: Case, value):
    """The returned arrays by name, or a problem with the shape of what was returned."""
    n = len(case.outputs)
    names = ", ".join(case.outputs)
    if n == 1:
        values = (value,)
        if isinstance(value, (tuple, list)):
            return None, f"it returned a {type(value).__name__}; expected one array ({names})."
    else:
        if not isinstance(value, (tuple, list)) or len(value) != n:
            got = (f"a {type(value).__name__} of length {len(value)}"
                   if isinstance(value, (tuple, list)) else f"a {type(value).__name__}")
            return None, f"it returned {got}; expected a tuple ({names})."
        values = tuple(value)
    out = {}
    dtype = np.dtype(case.dtype)
    for name, v, ref in zip(case.outputs, values, case.expected):
        if not isinstance(v, np.ndarray):
            return None, f"{name} is a {type(v).__name__}; expected a NumPy array."
        if v.shape != ref.shape:
            return None, f"{name} has shape {v.shape}; expected {ref.shape}."
        if v.dtype != dtype:
            return None, (f"{name} has dtype {v.dtype}, but the inputs are {dtype}: return the "
                          f"inputs' dtype (allocate with np.zeros_like(...) or dtype=Q.dtype).")
        out[name] = v
    return out, None


def _mutated(case: Case, arrays, snapshot) -> str | None:
    names = case.inputs or tuple(f"argument {k}" for k in range(len(arrays)))
    for name, now, before in zip(names, arrays, snapshot):
        # plain views: comparing must not trigger an input's own ufunc hooks (see _Streamed)
        if not np.array_equal(np.asarray(now), np.asarray(before), equal_nan=True):
            return (f"your function changed its input {name} in place (an `{name} *= ...`, "
                    f"`{name}[...] = ...` or `{name} -= ...`). Leave inputs untouched: work on "
                    f"a new array, e.g. `{name} = {name} * scale`.")
    return None


def _compare(ex: Exercise, case: Case, outputs: dict):
    """(problem or None, max error over outputs)."""
    naive = case.naive or (None,) * len(case.outputs)
    wrong, lines, worst = {}, [], 0.0
    for name, ref, slow in zip(case.outputs, case.expected, naive):
        got = outputs[name]
        tol = compare.tolerance(case.dtype, slow, ref, case.floor_scale)
        err = compare.error(got, ref)
        worst = max(worst, err)
        if err > tol:
            rows = compare.bad_rows(got, ref, tol)
            wrong[name] = rows
            lines.append(_wrong_text(name, got, ref, err, tol, rows))
    if not wrong:
        return None, worst
    extra = ex.diagnose(case, wrong, outputs) if ex.diagnose else None
    if extra:
        lines.append(extra)
    return "\n".join(lines), worst


def _wrong_text(name, got, ref, err, tol, rows) -> str:
    n = ref.shape[0] if ref.ndim else 1
    where = compare.describe_rows(rows, n)
    if np.isnan(got).any():
        return f"{name} contains NaN (in {where})."
    if err == float("inf"):
        return (f"{name} has -inf/inf where the reference does not, or misses one "
                f"(in {where}).")
    return f"{name} is wrong: max error {err:.2e} (allowed {tol:.1e}), in {where}."


def _probe(case: Case, call: Call, outputs) -> str | None:
    if case.memory_budget is not None and call.peak_bytes is not None \
            and call.peak_bytes > case.memory_budget:
        return (f"the answer is right, but your function allocated {_mib(call.peak_bytes)} at "
                f"once, where a tiled kernel needs at most about {_mib(case.memory_budget)} "
                f"here. {case.memory_note} FlashAttention never holds an Nq x Nk array (scores, "
                "probabilities or a mask), nor whole rows of scores: work on one Br x Bc tile "
                "S_ij at a time.")
    if case.probe is not None:
        return case.probe(call, outputs)
    return None


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
