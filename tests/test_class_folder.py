"""``flashedu check`` on a class folder of five submissions covering every exercise and one broken
notebook, run as an instructor would: every notebook's kernel runs for real (a minute or more on
2 cores; the time is printed: pytest -s shows it). The same grading shows that the solutions get
full marks, the unfilled exercises "not implemented yet", and that a broken notebook is graded
on what the learner wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from flashedu.checks import EXERCISES
from flashedu.checks.grade import NOTEBOOK_EXERCISES

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISE_NBS = {p.name: p for p in (ROOT / "exercises").glob("*.ipynb")}
POINTS = {stem: sum(EXERCISES[n].points for n in names) for stem, names in NOTEBOOK_EXERCISES.items()}


def _wrong(nb_path: Path, old: str, new: str) -> nbformat.NotebookNode:
    nb = nbformat.read(nb_path, as_version=4)
    for cell in nb.cells:
        if old in cell.source:
            cell.source = cell.source.replace(old, new)
            return nb
    raise AssertionError(f"{old!r} not in {nb_path.name}")


@pytest.fixture(scope="module")
def class_folder(tmp_path_factory):
    """Learners: every exercise with full marks (alice) and unfilled (bob), three wrong kernels
    (carol), a mix (dan); frank handed in one notebook gone wrong in the usual ways. Graded once
    with `flashedu check --jobs 2 --json`: (rows, expected points, seconds)."""
    tmp_path = tmp_path_factory.mktemp("class")
    cls = tmp_path / "class"
    expected = {}
    for student in ("alice", "bob", "carol", "dan", "frank"):
        (cls / student).mkdir(parents=True)
    for sol in SOLUTIONS:
        stem, full = sol.stem, POINTS[sol.stem]
        shutil.copy(sol, cls / "alice" / sol.name)
        expected[("alice", stem)] = full
        shutil.copy(EXERCISE_NBS[sol.name], cls / "bob" / sol.name)
        expected[("bob", stem)] = 0
    # dan: one notebook solved, one not: each notebook is graded on its own
    shutil.copy(SOLUTIONS[0], cls / "dan" / SOLUTIONS[0].name)
    expected[("dan", SOLUTIONS[0].stem)] = POINTS[SOLUTIONS[0].stem]
    shutil.copy(EXERCISE_NBS[SOLUTIONS[3].name], cls / "dan" / SOLUTIONS[3].name)
    expected[("dan", SOLUTIONS[3].stem)] = 0
    carol = {  # wrong in the ways learners are: each costs that notebook's points
        "02_flash_forward": ("O_i = alpha[:, None] * O_i +", "O_i = O_i +"),
        "05_numba_kernel": ("        cuda.syncthreads()  # everyone is done with the tile before it is overwritten\n", ""),
        "06_triton_kernel": ("cols[None, :] <= rows[:, None]", "cols[None, :] < rows[:, None]"),
    }
    for sol in SOLUTIONS:
        if sol.stem in carol:
            nbformat.write(_wrong(sol, *carol[sol.stem]), cls / "carol" / sol.name)
            expected[("carol", sol.stem)] = 0
    nbformat.write(_broken_submission(), cls / "frank" / "02_flash_forward.ipynb")
    expected[("frank", "02_flash_forward")] = 0
    notebooks = sorted(cls.glob("*/*.ipynb"))
    assert len(notebooks) == 2 * len(SOLUTIONS) + len(carol) + 3
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "flashedu.checks.command", "--jobs", "2", "--json",
                          str(tmp_path / "grades.json"), *map(str, notebooks)],
                         cwd=ROOT, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=1200, check=False)
    seconds = time.perf_counter() - start
    print(f"\nflashedu check: 5 submissions, {len(notebooks)} notebooks, --jobs 2: {seconds:.0f} s "
          f"(load average {os.getloadavg()[0]:.1f})")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]  # the table says why
    return json.loads((tmp_path / "grades.json").read_text()), expected, seconds


def _broken_submission() -> nbformat.NotebookNode:
    """A submission gone wrong in the usual ways: a cell that raises before the exercise, a
    forward that forgets to rescale O_i, and a check cell edited to check something else."""
    nb = nbformat.read(ROOT / "solutions" / "02_flash_forward.ipynb", as_version=4)
    cells = {c.metadata["nbgrader"]["grade_id"]: c for c in nb.cells}
    cells["setup"].source += "\nundefined_name  # a broken cell: grading must go on"
    cells["flash_forward"].source = cells["flash_forward"].source.replace(
        "O_i = alpha[:, None] * O_i +", "O_i = O_i +")
    cells["check_flash_forward"].source = (
        'import flashedu.tiled\nresult = check("flash_forward", flashedu.tiled.flash_forward)')
    return nb


def _rows_of(rows, student):
    return [r for r in rows if Path(r["notebook"]).parent.name == student]


def test_flashedu_check_grades_a_class_folder(class_folder):
    rows, expected, seconds = class_folder
    expected = dict(expected)
    got = {}
    for r in rows:
        key = (Path(r["notebook"]).parent.name, Path(r["notebook"]).stem)
        got[key] = got.get(key, 0) + r["points"]
    from flashedu import runtime
    if not runtime.numba_simulated():  # on a GPU a race may or may not show in the values
        got.pop(("carol", "05_numba_kernel"))
        expected.pop(("carol", "05_numba_kernel"))
    assert got == expected
    if runtime.numba_simulated():  # races are found in the simulator
        assert "data race on shared memory" in " ".join(
            r["message"] for r in rows if "carol" in r["notebook"] and "05_" in r["notebook"])
    assert seconds < 900  # a hang guard; the bar is 3 minutes on 2 idle cores (printed above)


def test_solutions_get_full_marks(class_folder):
    rows = _rows_of(class_folder[0], "alice")
    assert sorted(r["exercise"] for r in rows) == sorted(EXERCISES)
    for r in rows:
        assert r["passed"] and r["points"] == r["max_points"] == EXERCISES[r["exercise"]].points, r


def test_unfilled_exercises_report_not_implemented_yet(class_folder):
    rows = _rows_of(class_folder[0], "bob")
    assert sorted(r["exercise"] for r in rows) == sorted(EXERCISES)
    for r in rows:
        assert r["status"] == "not implemented yet" and r["points"] == 0, r
        assert "Traceback" not in r["message"]


def test_a_broken_submission_is_graded_on_what_the_learner_wrote(class_folder):
    (row,) = _rows_of(class_folder[0], "frank")
    assert row["exercise"] == "flash_forward" and not row["passed"] and row["points"] == 0
    assert "several tiles" in row["message"] and "rescale" in row["message"]
    # the stepper's line, computed in the learner's kernel from the failed case's inputs
    assert "open the stepper at step" in row["message"], row["message"]
