"""Where the course's notebooks are, and what their cells say about the steps a learner writes.

The solved notebooks in ``solutions/notebooks/`` are the source of the course; ``notebooks/`` is
generated from them (``flashedu exercises build``). Two kinds of cells carry a ``flashedu`` key in
their metadata:

- a **step**, ``{"step": "06.flash_forward", "exercise": "triton_step_flash_forward",
  "symbol": "flash_forward_kernel", "title": "..."}``: a code cell the learner writes. In the
  solved notebook its answer sits between ``### BEGIN SOLUTION`` and ``### END SOLUTION``; the
  learner's copy has ``# YOUR CODE HERE`` there. The cell only defines things (it runs nothing),
  so that the same source can be replayed as the reference when the learner's step is unwritten.
  ``exercise`` names the check in :data:`flashedu.checks.EXERCISES` that grades ``symbol``.
- a **prediction**, ``{"prediction": "06.programs", "title": "..."}``: a code cell that sets
  ``guess``. The learner's copy sets it to ``None``; the solved one to the right answer.

``flashedu exercises build`` also writes the index of every step and prediction (without their
solutions) to ``flashedu/course/steps.json``, so that checks and ``flashedu progress`` work in an
installation without the solved notebooks; ``reveal`` and the fallback to the reference need
them. Only JSON is read here (no nbformat): ``flashedu progress`` answers in a fraction of a
second.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


@dataclass(frozen=True)
class Step:
    id: str  # "06.flash_forward": the notebook's number, then a name
    notebook: str  # file name of the notebook, e.g. "06_triton_forward.ipynb"
    kind: str  # "step" or "prediction"
    title: str  # one line: what the learner writes or predicts
    exercise: str = ""  # steps: the check that grades it
    symbol: str = ""  # steps: the name the cell defines and the check grades
    source: str = ""  # the solved cell's source, markers included


def repo_root() -> Path:
    """The checkout that holds this package (the README installs it editable)."""
    return Path(__file__).resolve().parents[2]


def solved_folder() -> Path:
    return repo_root() / "solutions" / "notebooks"


def learner_folder() -> Path:
    return repo_root() / "notebooks"


def _cells(path: Path) -> list[dict]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return nb["cells"]


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


INDEX = Path(__file__).with_name("steps.json")


def read_steps(folder: Path) -> tuple[Step, ...]:
    """Every step and prediction in the solved notebooks of ``folder``, in notebook order."""
    found = []
    for path in sorted(folder.glob("*.ipynb")):
        for cell in _cells(path):
            meta = cell.get("metadata", {}).get("flashedu")
            if not meta:
                continue
            kind = "step" if "step" in meta else "prediction"
            found.append(Step(id=meta[kind], notebook=path.name, kind=kind,
                              title=meta.get("title", ""), exercise=meta.get("exercise", ""),
                              symbol=meta.get("symbol", ""), source=_source(cell)))
    return tuple(found)


def index_text(items) -> str:
    """The index as ``steps.json`` holds it: everything but the solutions."""
    rows = [{k: v for k, v in vars(s).items() if k != "source"} for s in items]
    return json.dumps(rows, indent=1) + "\n"


@lru_cache(maxsize=1)
def steps() -> tuple[Step, ...]:
    """Every step and prediction of the course: from the solved notebooks where they are here
    (their sources included), else from the index shipped with the package."""
    if solved_folder().is_dir():
        return read_steps(solved_folder())
    return tuple(Step(**row) for row in json.loads(INDEX.read_text(encoding="utf-8")))


def need_source(step: Step) -> Step:
    if not step.source:
        raise FileNotFoundError(
            f"the solution of {step.id} is not in this installation (the solved notebooks are "
            f"not at {solved_folder()}): write the step, or work from a checkout of flashedu")
    return step


def find(step_id: str, kind: str | None = None) -> Step:
    """The step or prediction called ``step_id``; a ValueError that lists the known ones else."""
    for step in steps():
        if step.id == step_id and (kind is None or step.kind == kind):
            return step
    known = ", ".join(s.id for s in steps() if kind is None or s.kind == kind)
    what = kind or "step or prediction"
    raise ValueError(f"no {what} called {step_id!r}; the course has: {known}")


def solution_code(step: Step) -> str:
    """The solved cell as plain Python: the markers gone, notebook-only lines (%, !) left out."""
    need_source(step)
    lines = [ln for ln in step.source.split("\n")
             if ln.strip() not in (BEGIN, END) and not ln.lstrip().startswith(("%", "!"))]
    return "\n".join(lines)


def solution_region(step: Step) -> str:
    """Only what the learner writes: the lines between the markers, dedented to the marker."""
    need_source(step)
    text = re.findall(rf"^([ \t]*){re.escape(BEGIN)}\n(.*?)^[ \t]*{re.escape(END)}",
                      step.source, re.MULTILINE | re.DOTALL)
    parts = []
    for indent, body in text:
        parts.append("\n".join(ln[len(indent):] if ln.startswith(indent) else ln
                               for ln in body.rstrip("\n").split("\n")))
    return "\n...\n".join(parts)


def notebook_number(notebook: str) -> str:
    """ "06_triton_forward.ipynb" -> "06"."""
    return notebook.split("_", 1)[0]
