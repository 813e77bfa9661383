"""The practice loop of the notebooks: you write a step, a check grades it, the notebook runs on.

    from flashedu import course
    # the cell above defines your flash_forward_kernel (or still says # YOUR CODE HERE)
    flash_forward_kernel = course.check("06.flash_forward", flash_forward_kernel)

``check`` grades the step with the engine that grades the exercises (:mod:`flashedu.checks`),
shows the verdict with the failing case and a hint, records it (``flashedu progress``), and
returns the function the rest of the notebook should use: yours when it passes, else the
reference, saying so in one line. So a notebook runs top to bottom with steps unwritten, and
you can work through it in any order.

    guess = 7                                   # the prediction cell
    course.check_prediction("06.programs", guess, programs, why="ceil(100 / 16) = 7")

compares your guess with what the notebook measured, says right or wrong and why, and keeps
score. Stuck on a step? ``course.reveal("06.flash_forward")`` shows the solution of that step
only.

The solved notebooks (``solutions/notebooks/``) are the source of the course; the step's cell
there is both the solution ``reveal`` shows and the reference ``check`` falls back to.
``FLASHEDU_COURSE_STRICT=1`` (set by the test-suite) turns a written step that fails, or a
prediction that is wrong, into an AssertionError: the solved notebooks must pass every check.
"""

from __future__ import annotations

import hashlib
import html
import importlib
import math
import os
import re
import sys
from dataclasses import dataclass

from .. import progress
from .notebooks import Step, find, solution_code, solution_region, steps

__all__ = ["check", "check_prediction", "reveal", "reference", "steps", "Prediction"]


def strict() -> bool:
    return os.environ.get("FLASHEDU_COURSE_STRICT", "") not in ("", "0")


def _show(obj) -> None:
    """display() in a notebook, print() elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(obj)
        return
    if get_ipython() is None:
        print(obj)
    else:
        display(obj)


# ------------------------------------------------------------------------------------------
# Steps
# ------------------------------------------------------------------------------------------


def check(step_id: str, fn, *, seed: int | None = None, quiet: bool = False):
    """Grade ``fn`` as step ``step_id``; return ``fn`` if it passes, else the reference."""
    from ..checks import check as run_check
    from ..checks.result import NOT_IMPLEMENTED

    step = find(step_id, "step")
    result = run_check(step.exercise, fn, seed=seed)
    progress.record("steps", step.id, passed=result.passed, status=result.status)
    if not quiet:
        _show(result)
    if result.passed:
        print(f"{step.id}: yours passes; the notebook uses your {step.symbol} from here on")
        return fn
    if result.status == NOT_IMPLEMENTED:
        note = "not written yet: using the reference"
    else:
        if strict():
            raise AssertionError(f"step {step.id} fails its check:\n{result.message}")
        note = "does not pass yet: using the reference"
    try:
        fallback = reference(step_id, _caller_globals())
    except FileNotFoundError as exc:  # an installation without the solved notebooks
        print(f"{step.id}: {note.split(':')[0]}, and {exc}")
        return fn
    print(f"{step.id}: {note} {step.symbol} for the cells below "
          f"(stuck? course.reveal({step.id!r}) shows this step's solution)")
    return fallback


def _caller_globals() -> dict:
    frame = sys._getframe(2)  # the notebook cell that called check()
    return frame.f_globals


def reference(step_id: str, namespace: dict | None = None):
    """The solved step's ``symbol``: its cell run in a copy of ``namespace`` (the notebook's
    globals: the step may use the notebook's imports and earlier definitions). The cell is
    compiled from a real file, because Triton's @jit reads a kernel's source from its file."""
    from ..models.learner import cache_folder

    step = find(step_id, "step")
    code = solution_code(step)
    digest = hashlib.sha256(code.encode()).hexdigest()[:12]
    folder = cache_folder()
    folder = folder / "course_steps"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step.id.replace('.', '_')}_{digest}.py"
    if not path.exists() or path.read_text(encoding="utf-8") != code:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(code, encoding="utf-8")
        os.replace(tmp, path)
    scope = dict(namespace if namespace is not None else {})
    for name, module in _USUAL_IMPORTS.items():  # what a notebook has imported by then
        if name not in scope and re.search(rf"\b{name}\.", code):
            scope[name] = importlib.import_module(module)
    scope["__name__"] = f"flashedu_step_{step.id.replace('.', '_')}"
    exec(compile(code, str(path), "exec"), scope)  # noqa: S102 - the course's own solved cell
    if step.symbol not in scope:
        raise RuntimeError(f"the solved cell of {step.id} does not define {step.symbol}")
    return scope[step.symbol]


_USUAL_IMPORTS = {"np": "numpy", "math": "math", "torch": "torch", "triton": "triton",
                  "tl": "triton.language", "cuda": "numba.cuda"}


def reveal(step_id: str) -> None:
    """Show the solution of one step (what goes where the cell says # YOUR CODE HERE)."""
    step = find(step_id)
    solution = Solution(step, solution_region(step))
    if step.kind == "step":
        progress.record("steps", step.id, **{**progress.load()["steps"].get(step.id, {}),
                                             "revealed": True})
    _show(solution)


@dataclass
class Solution:
    """One step's solution: plain text in a terminal, a code block in a notebook."""

    step: Step
    code: str

    def _title(self) -> str:
        return f"{self.step.id}: {self.step.title}" if self.step.title else self.step.id

    def __str__(self) -> str:
        return f"Solution of {self._title()}:\n{self.code}"

    __repr__ = __str__

    def _repr_markdown_(self) -> str:
        return (f"**Solution of {self._title()}** (in `solutions/notebooks/{self.step.notebook}`)"
                f"\n```python\n{self.code}\n```")


# ------------------------------------------------------------------------------------------
# Predictions
# ------------------------------------------------------------------------------------------


@dataclass
class Prediction:
    id: str
    guess: object
    answer: object
    right: bool | None  # None: no guess made
    why: str

    def __str__(self) -> str:
        if self.right is None:
            head = f"{self.id}: no prediction made (guess is None). The answer: {_fmt(self.answer)}"
        elif self.right:
            head = f"{self.id}: right! You said {_fmt(self.guess)}; it is {_fmt(self.answer)}"
        else:
            head = f"{self.id}: not quite. You said {_fmt(self.guess)}; it is {_fmt(self.answer)}"
        return head + (f"\n  why: {self.why}" if self.why else "")

    __repr__ = __str__

    def _repr_html_(self) -> str:
        colour = {None: "#57606a", True: "#1a7f37", False: "#cf222e"}[self.right]
        lines = html.escape(str(self)).replace("\n", "<br>")
        return f'<div style="border-left:4px solid {colour};padding-left:8px">{lines}</div>'


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_fmt(v) for v in value) + ")"
    return repr(value) if isinstance(value, str) else str(value)


def matches(guess, answer, within: float = 0.0) -> bool:
    """Numbers within a relative ``within`` (exact when 0), element by element for tuples and
    lists, strings without case or surrounding blanks, anything else by ==."""
    if isinstance(answer, (tuple, list)):
        return (isinstance(guess, (tuple, list)) and len(guess) == len(answer)
                and all(matches(g, a, within) for g, a in zip(guess, answer)))
    if isinstance(answer, str):
        return isinstance(guess, str) and guess.strip().lower() == answer.strip().lower()
    if isinstance(answer, bool) or isinstance(guess, bool):
        return guess is answer or guess == answer and type(guess) is type(answer)
    if isinstance(answer, (int, float)) and isinstance(guess, (int, float)):
        if within == 0.0 and isinstance(answer, int):
            return guess == answer
        return math.isclose(guess, answer, rel_tol=max(within, 1e-9), abs_tol=1e-12)
    try:
        return bool(guess == answer)
    except Exception:  # noqa: BLE001 - an array compared to a scalar, say
        return False


def check_prediction(prediction_id: str, guess, answer, *, why: str = "",
                     within: float = 0.0) -> None:
    """Compare the learner's ``guess`` with the ``answer`` the notebook measured; show right or
    wrong and ``why``; record it. ``within``: the relative error a numeric guess may have."""
    find(prediction_id, "prediction")
    right = None if guess is None else matches(guess, answer, within)
    result = Prediction(prediction_id, guess, answer, right, why)
    if right is not None:
        progress.record("predictions", prediction_id, right=right, guess=_fmt(guess),
                        answer=_fmt(answer))
    _show(result)
    if right is False and strict():
        raise AssertionError(f"prediction {prediction_id}: the solved notebook's guess "
                             f"{_fmt(guess)} is not the measured {_fmt(answer)}")
