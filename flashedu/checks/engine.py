"""Run one exercise's cases against a learner's function and turn what happens into a result.

An :class:`Exercise` is a list of :class:`Case` objects (inputs, float64 reference outputs, a hint
in plain words) and a way to call the learner's object on a case (directly for the NumPy
exercises, through a launcher for the numba and Triton kernels). Each case is checked in this
order, and the first problem found is the one reported:

1. it finished in time, and did not raise;
2. it returned what the contract says (a tuple of the right length, arrays of the right shape
   and dtype);
3. it left its inputs alone;
4. every output is within tolerance of the float64 reference (see :mod:`.compare`);
5. the case's probe agrees (memory, blocks it must skip, shared memory, reads and writes out of
   bounds).

Running a case has two halves. :func:`execute_case` calls the learner's object and gathers what
happened (the :class:`~.sandbox.Call`: the value, an error, the time, the memory, what the
probes counted, the inputs after the call); :func:`judge_case` compares that with the case's
reference. The two halves always live in two processes: the notebook's ``check()``
(:func:`.child.run_exercise`) runs the first half in a child forked from the notebook before
any input exists (see :mod:`.child`;
in-process only where a fork cannot run the code), ``flashedu check`` runs it in the
learner's kernel (see :mod:`.grade`); references, tolerances and comparisons stay on the side
where the learner's code never runs.

Inputs are drawn fresh for every check from a seed (``run_seed()``) that the message reports,
so that a failure can be reproduced (``check(name, fn, seed=...)``) and no table of answers
for fixed inputs can pass.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import compare
from .result import FAILED, NOT_IMPLEMENTED, PASSED, SKIPPED, CaseResult, CheckResult
from .sandbox import Call, call_limited, error_text, forbidden_uses, shortcuts_blocked

# bound at import: a learner's cell that patches flashedu.checks.compare changes nothing here
_TOLERANCE, _ERROR, _BAD_ROWS = compare.tolerance, compare.error, compare.bad_rows
_SEED = threading.local()  # each grading thread (flashedu check --jobs) its own


class Remark(str):
    """A gate's verdict that is not a refusal: a line for the passing result (what the gate
    compiled, or why this machine could not compile for a GPU)."""


def run_seed() -> int:
    """The random seed of the inputs of the check being built (fresh for every check)."""
    return getattr(_SEED, "value", 0)


def new_seed() -> int:
    return secrets.randbelow(2**31)


def set_seed(seed: int) -> None:
    _SEED.value = int(seed)


@dataclass
class Case:
    label: str
    hint: str  # what this case is about, and the mistake it catches, in plain words
    args: tuple
    outputs: tuple  # names of the returned arrays, e.g. ("O", "L")
    expected: tuple  # float64 reference of each output
    naive: tuple = ()  # each output computed naively in the case's dtype: sets the tolerance
    # other correct computations in the case's dtype (each a tuple of outputs, e.g. O kept
    # normalized key by key, or D_i = rowsum(P_ij * dP_ij)): the tolerance covers the worst
    variants: tuple = ()
    kwargs: dict = field(default_factory=dict)
    inputs: tuple = ()  # names of the array arguments, in order (for the mutation check)
    dtype: object = np.float64
    memory_budget: int | None = None  # most bytes the call may allocate at once
    memory_note: str = ""  # what the forbidden array would have cost, for the message
    probe: Callable | None = None  # probe(call, outputs) -> problem text or None
    needs_pass: bool = False  # run only if every earlier case passed (the costly probes)
    floor_scale: float = 1.0  # widen the dtype's error floor (e.g. TF32 dots on a GPU)
    # each output's allowance from the rounding a correct kernel can make on this draw
    # (flashedu.tolerance.attention_rounding), normalized as compare.error is; the allowance is
    # the larger of it and NAIVE_FACTOR x the error of the candidates (naive, variants)
    rounding: tuple = ()
    block_q: int | None = None  # Br, when the case has Q tiles (for the diagnosis)
    # (name, *params) of a PREPARE function run where the learner's code runs, just before the
    # call: it wraps the inputs in watchers; what they saw comes back as call.evidence
    prepare: tuple | None = None
    # () -> (most CPU seconds the call may take, what that stands for): work measured where the
    # learner's code cannot reach it (the supervisor reads the kernel's CPU time from /proc
    # under flashedu check). Called only once everything else about the case has passed.
    cpu_budget: Callable | None = None


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
    unfilled: Callable | None = None  # (fn) -> True while it is still the exact skeleton
    inspect: Callable | None = None  # (fn) -> problem text when fn is not a kernel (or None)
    blocked: bool = True  # flashedu's references, torch softmax/SDPA off during the call
    # (fn) -> problem text, or None / a Remark when it passes; run once every case has passed
    # (it costs seconds): the compile gate
    gate: Callable | None = None
    # (fn, args) -> one more line for the first failed case's message, or None (e.g. where the
    # stepper shows the learner's kernel leaving the reference); runs where the learner's
    # code runs, only after a case failed, and never fails a check itself
    hint: Callable | None = None


# name -> prepare(args, *params) -> (args, collect); collect() -> evidence dict. Filled by the
# exercise modules; looked up by name so that a case can travel to another process.
PREPARE: dict[str, Callable] = {}


def preflight(ex: Exercise, fn) -> tuple[str, str] | None:
    """(status, message) when ``fn`` cannot be graded at all, else None. Runs where the
    learner's code lives (it looks at the object)."""
    problem = _not_checkable(ex, fn)
    if problem:
        return FAILED, problem
    if is_unfilled(ex, fn):
        return NOT_IMPLEMENTED, ""
    unavailable = ex.requires() if ex.requires else None
    if unavailable:
        return FAILED, f"cannot run this check here: {unavailable}"
    problem = ex.inspect(fn) if ex.inspect else None
    if problem is None and ex.blocked:
        problem = forbidden_uses(fn)
    if problem:
        return FAILED, problem
    return None


# what the learner's copy has where an answer was (flashedu.course.build writes it)
PLACEHOLDER = ("# YOUR CODE HERE", "raise NotImplementedError()")


def is_unfilled(ex: Exercise, fn) -> bool:
    if ex.unfilled is not None:
        return bool(ex.unfilled(fn))
    return source_has_placeholder(fn, PLACEHOLDER)


def source_has_placeholder(fn, placeholder) -> bool:
    """True while the source of ``fn`` still holds the exercise's placeholder, line for line
    (``# YOUR CODE HERE`` then ``raise NotImplementedError()``): a NotImplementedError that
    the learner raises on purpose (a guard) does not count."""
    import inspect
    import re

    inner = getattr(fn, "py_func", None) or getattr(fn, "fn", None) or fn
    try:
        source = inspect.getsource(inner)
    except (OSError, TypeError):
        return False
    pattern = r"^[ \t]*" + re.escape(placeholder[0]) + r"[ \t]*\n[ \t]*" + \
        re.escape(placeholder[1]) + r"[ \t]*$"
    return re.search(pattern, source, re.MULTILINE) is not None


def learner_hint(ex: Exercise, fn, args) -> str | None:
    """``ex.hint(fn, args)`` on copies of the inputs, time-limited, with the shortcuts off;
    None whatever goes wrong (a hint must never break a check)."""
    args = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
    try:
        with shortcuts_blocked(ex.blocked):
            call = call_limited(ex.hint, (fn, args), timeout=HINT_SECONDS)
    except Exception:  # noqa: BLE001
        return None
    if call.timed_out or call.error is not None or not isinstance(call.value, str):
        return None
    return call.value[:800]


HINT_SECONDS = 10.0


def grade_cases(ex: Exercise, execute: Callable, gate: Callable | None = None,
                hint: Callable | None = None) -> CheckResult:
    """Judge every case of ``ex``; ``execute(case) -> Call`` runs the learner's code; ``gate()``
    (a problem; None or a :class:`Remark` when it passes) runs last, once every case passed;
    ``hint(case)`` (text or None) adds a line to the message of the first failed case."""
    rows, first = [], None
    stop = False
    for case in ex.cases():
        if stop or (case.needs_pass and first is not None):
            why = "skipped: fix the cases above first" if not stop else "skipped"
            rows.append(CaseResult(case.label, SKIPPED, why))
            continue
        row, message, status = judge_case(ex, case, execute(case))
        rows.append(row)
        if row.status == FAILED and first is None:
            first = message
            if hint is not None and row.max_error is not None:  # the values were compared
                extra = hint(case)
                if extra:
                    first += f"\nStepper: {extra}"
        stop = stop or status == "timeout"
    seed_note = f"(inputs drawn with seed {run_seed()}: check(..., seed={run_seed()}) repeats them)"
    note = ""
    if first is None and gate is not None:
        first = gate()
        if isinstance(first, Remark):
            note, first = f" {first}", None
    if first is None:
        return make_result(ex, True, PASSED, f"All {len(rows)} cases passed.{note} {seed_note}", rows)
    return make_result(ex, False, FAILED, f"{first}\n{seed_note}", rows)


def _not_checkable(ex: Exercise, fn) -> str | None:
    if fn is None:
        return f"`{ex.symbol}` is not defined: run the cell that defines it, then this check."
    if not callable(fn):
        return (f"check('{ex.name}', ...) needs your function `{ex.symbol}`, got "
                f"{type(fn).__name__}: pass the function itself, without calling it.")
    return None


def make_result(ex, passed, status, message, rows) -> CheckResult:
    """The CheckResult of ``ex`` (a not-implemented status says what to do)."""
    if status == NOT_IMPLEMENTED:
        message = (f"`{ex.symbol}` is not implemented yet: replace `raise NotImplementedError()` "
                   "with your code, run the cell, then run this check again.")
    return CheckResult(name=ex.name, passed=passed, message=message,
                       points=ex.points if passed else 0.0, max_points=ex.points,
                       status=status, cases=rows)


def execute_case(ex: Exercise, fn, case: Case) -> Call:
    """Call the learner's object on (copies of) the case's inputs; runs where their code runs."""
    args = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in case.args)
    collect = None
    if case.prepare is not None:
        args, collect = PREPARE[case.prepare[0]](args, *case.prepare[1:])
    measure = case.memory_budget is not None
    view = _CaseView(case, args)
    timed = case.cpu_budget is not None
    with shortcuts_blocked(ex.blocked), one_blas_thread(timed):
        if timed:
            others_idle()
        cpu = time.process_time()
        if ex.invoke is None:
            call = call_limited(_in_one_thread(fn) if timed else fn, args, case.kwargs,
                                timeout=ex.timeout, measure_memory=measure)
        else:
            call = ex.invoke(fn, view, ex.timeout, measure)
        if timed:  # this process's own figure (a supervisor takes its own), read before the
            # pools are restored: threads started by the restore spin for a while
            call.cpu_seconds = time.process_time() - cpu
    call.inputs_after = [np.asarray(a) for a in args if isinstance(a, np.ndarray)]
    call.evidence = collect() if collect is not None else {}
    return call


@contextlib.contextmanager
def one_blas_thread(active: bool = True):
    """The thread pools (NumPy's BLAS, OpenMP's for the calling thread) on one thread while
    active: where a case's CPU time is measured, since idle pool threads spin and bill CPU time
    in proportion to the cores, not the work (on a 16-core GPU host, OpenMP's made the
    course's own block-sparse solution bill 4x its budget)."""
    if not active:
        yield
        return
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        yield


def compiled_here(name: str) -> bool:
    """Whether exercise ``name``'s kernel runs compiled for a GPU here: a numba_ or triton_
    exercise where numba's simulator, or Triton's interpreter, is off."""
    from .. import runtime

    if name.startswith("numba_"):
        return not runtime.numba_simulated()
    return name.startswith("triton_") and not runtime.triton_interpreted()


def others_idle(most: float = 1.0, window: float = 0.02, quiet: int = 3) -> None:
    """Wait, up to ``most`` seconds, until this process's other threads stop spending CPU time,
    before a case's CPU time is counted process-wide: BLAS and OpenMP pool threads spin for a
    while after the work that woke them (an earlier case's, the grader's own), and on a
    16-core host that spinning alone billed the course's block-sparse solution four times its
    budget where the learner's code runs in the grader's process.

    Idle means ``quiet`` windows in a row in which the other threads spent under a tenth of
    the window: on a loaded machine a spinning thread can be off its core for one window."""
    deadline = time.monotonic() + most
    still = 0
    while time.monotonic() < deadline:
        process, thread = time.process_time(), time.thread_time()
        time.sleep(window)
        busy = (time.process_time() - process) - (time.thread_time() - thread) >= 0.1 * window
        still = 0 if busy else still + 1
        if still >= quiet:
            return


def one_thread_for_good() -> None:
    """The thread pools on one thread for the rest of this process, where it runs the learner's
    code for the grader. A case timed by its CPU time limits them for the call and restores
    them after (one_blas_thread); restoring OpenBLAS to N threads starts N - 1 threads that
    spin before they sleep, and a supervisor that reads the process's CPU time after the
    answer billed them to the learner: 0.2-0.3 s on a 16-core host, four times the
    block-sparse budget, for the course's own solution. Limited for good, the restore starts
    nothing."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1)  # not as a context: kept until the process exits


def _in_one_thread(fn):
    """``fn`` with OpenMP on one thread in the thread that runs it: OpenMP's limit holds per
    calling thread, and the learner's function runs in a worker thread. (The BLAS limit is
    process-wide, set by the caller's one_blas_thread: set and restored here too, the restore
    would start BLAS threads that spin while the call's CPU time is still being counted.)"""
    from threadpoolctl import threadpool_limits

    def run(*args, **kwargs):
        with threadpool_limits(limits=1, user_api="openmp"):
            return fn(*args, **kwargs)
    return run


class _CaseView:
    """What an invoke function sees of a case: its arguments (the learner's copies)."""

    def __init__(self, case, args):
        self.args, self.kwargs, self.label = args, case.kwargs, case.label


def judge_case(ex: Exercise, case: Case, call: Call):
    """(CaseResult, message for the learner, status) for one case; runs on the trusted side."""
    arrays = [a for a in case.args if isinstance(a, np.ndarray)]
    outputs, problem, status = None, None, FAILED
    if call.timed_out:
        problem, status = _timeout_text(ex, case), "timeout"
    elif getattr(call, "finding", None):
        problem = call.finding
    elif call.error is not None:
        problem = f"your code raised an error:\n{error_text(call.error)}"
        if getattr(call.error, "kind", type(call.error).__name__) == "IndexError" \
                or isinstance(call.error, IndexError):
            problem += ("\nAn index ran past the end of an array: guard the last, partial "
                        "tiles (e.g. `if row < Nq`, `if j < Nk`).")
    else:
        outputs, problem = _unpack(case, call.value)
    problem = problem or _mutated(case, arrays, getattr(call, "inputs_after", None))
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


def _mutated(case: Case, arrays, after) -> str | None:
    if after is None:
        return None
    if len(after) != len(arrays):
        return "the grader could not read back your function's inputs after the call."
    names = case.inputs or tuple(f"argument {k}" for k in range(len(arrays)))
    for name, before, now in zip(names, arrays, after):
        if np.shape(now) != np.shape(before):
            return f"your function changed the shape of its input {name}."
        # plain views: comparing must not trigger an input's own ufunc hooks (see _Streamed)
        if not np.array_equal(np.asarray(now), np.asarray(before), equal_nan=True):
            return (f"your function changed its input {name} in place (an `{name} *= ...`, "
                    f"`{name}[...] = ...` or `{name} -= ...`). Leave inputs untouched: work on "
                    f"a new array, e.g. `{name} = {name} * scale`.")
    return None


def allowance(case: Case, k: int) -> float:
    """The largest error allowed for output ``k`` of ``case``: NAIVE_FACTOR x the worst error
    of the correct computations in the case's dtype (naive, variants) on this draw, or the
    case's rounding allowance, or the dtype's floor times floor_scale, whichever is larger."""
    naive = case.naive[k] if case.naive else None
    candidates = [naive] + [v[k] for v in case.variants]
    tol = _TOLERANCE(case.dtype, candidates, case.expected[k], case.floor_scale)
    return max(tol, float(case.rounding[k])) if case.rounding else tol


def _compare(ex: Exercise, case: Case, outputs: dict):
    """(problem or None, max error over outputs)."""
    wrong, lines, worst = {}, [], 0.0
    for k, (name, ref) in enumerate(zip(case.outputs, case.expected)):
        got = outputs[name]
        tol = allowance(case, k)
        err = _ERROR(got, ref)
        worst = max(worst, err)
        if err > tol:
            rows = _BAD_ROWS(got, ref, tol)
            wrong[name] = rows
            lines.append(_wrong_text(name, got, ref, err, tol, rows))
    if not wrong:
        return None, worst
    extra = ex.diagnose(case, wrong, outputs) if ex.diagnose else None
    if extra:
        lines.append(extra)
    return "\n".join(lines), worst


def _wrong_text(name, got, ref, err, tol, rows) -> str:
    """'O is wrong in all 37 rows: NaN in row 0 of 37; elsewhere off by up to 2.10e+00
    (allowed 2.0e-05).' Rows are the first axis (query rows; key rows for dK and dV)."""
    n = ref.shape[0] if ref.ndim else 1
    text = f"{name} is wrong in {rows_text(rows, n)}"

    def per_row(mask):
        return np.flatnonzero(np.asarray(mask).reshape(n, -1).any(axis=1))

    nan_rows = per_row(np.isnan(got))
    with np.errstate(invalid="ignore"):
        inf_rows = per_row(np.isinf(got) & ~np.isinf(ref))
        missed = per_row(np.isinf(ref) & (got != ref) & ~np.isnan(got))
    odd = [f"{what} in {rows_text(where, n)}" for what, where in (
        ("NaN", nan_rows), ("inf or -inf where the answer is finite", inf_rows),
        ("another value where the answer is -inf", missed)) if len(where)]
    if not odd:
        return f"{text}: off by up to {err:.2e} (allowed {tol:.1e})."
    if list(nan_rows) == [int(r) for r in rows] and len(odd) == 1:
        return f"{text}: NaN" + (" in all of them." if len(rows) > 1 else " in that row.")
    text += ": " + "; ".join(odd)
    if len(rows) > len(np.union1d(np.union1d(nan_rows, inf_rows), missed)):  # others too
        text += f"; elsewhere off by up to {_finite_max_error(got, ref):.2e} (allowed {tol:.1e})"
    return text + "."


def rows_text(rows, n: int) -> str:
    """'all 37 rows', 'row 0 of 37', 'rows 3 and 7 of 37', '5 of 37 rows (0, 1, 2, 3, 4)'."""
    rows = [int(r) for r in rows]
    if len(rows) == n and n > 1:
        return f"all {n} rows"
    if len(rows) == 1:
        return f"row {rows[0]} of {n}"
    if len(rows) == 2:
        return f"rows {rows[0]} and {rows[1]} of {n}"
    shown = ", ".join(str(r) for r in rows[:8]) + (", ..." if len(rows) > 8 else "")
    return f"{len(rows)} of {n} rows ({shown})"


# Peak resident memory moves in pages and allocator arenas, not bytes: allowed this much above
# the budget. Still far below the Nq x Nk arrays of the memory cases (32 MiB in float64).
RSS_SLACK = 16 * 2**20


def _probe(case: Case, call: Call, outputs) -> str | None:
    problem = _memory_problem(case, call)
    if problem is None and case.probe is not None:
        problem = case.probe(call, outputs)
    if problem is None and case.cpu_budget is not None and call.cpu_seconds is not None:
        limit, meaning = case.cpu_budget()
        if call.cpu_seconds > limit:
            problem = (f"the answer is right, but your function took {call.cpu_seconds:.2f} s "
                       f"of CPU time, where {meaning} takes {limit:.2f} s here: it does work "
                       "on tiles it was told to skip.")
    return problem


def _memory_problem(case: Case, call: Call) -> str | None:
    if case.memory_budget is not None and call.peak_bytes is not None \
            and call.peak_bytes > case.memory_budget:
        return (f"the answer is right, but your function allocated {_mib(call.peak_bytes)} at "
                f"once, where a tiled kernel needs at most about {_mib(case.memory_budget)} "
                f"here. {case.memory_note} FlashAttention never holds an Nq x Nk array (scores, "
                "probabilities or a mask), nor whole rows of scores: work on one Br x Bc tile "
                "S_ij at a time.")
    rss = getattr(call, "rss_bytes", None)
    if case.memory_budget is not None and rss is not None \
            and rss > case.memory_budget + RSS_SLACK:
        return (f"the answer is right, but the process's memory grew by {_mib(rss)} during "
                f"your function (NumPy, torch and every other allocation counted), where a "
                f"tiled kernel needs at most about {_mib(case.memory_budget)} here. "
                f"{case.memory_note} FlashAttention never holds an Nq x Nk array, in any "
                "library: work on one Br x Bc tile S_ij at a time.")
    return None


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _finite_max_error(got, ref) -> float:
    """The largest normalized error where both are finite (NaN and inf left out)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    both = np.isfinite(got) & np.isfinite(ref)
    if not both.any():
        return 0.0
    return float(np.max(np.abs(got[both] - ref[both]) / (1.0 + np.abs(ref[both]))))
