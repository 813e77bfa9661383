"""The instructor's two paths, run as an instructor would: nbgrader (generate the learners'
version of solutions/, autograde submissions into the gradebook) and ``flashedu check`` on a
class folder of five submissions covering every exercise.

Both run real kernels on every notebook, so each takes a minute or more on 2 cores; the times
are printed (pytest -s shows them).
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


def _nbgrader(course: Path, *args, timeout=900):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env,
                         capture_output=True, text=True, timeout=timeout, check=False)
    assert run.returncode == 0, f"nbgrader {' '.join(args)}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    return run


def test_nbgrader_generates_and_autogrades_the_course(tmp_path):
    pytest.importorskip("nbgrader", reason="nbgrader is not installed (pip install nbgrader)")
    from nbgrader.api import Gradebook

    course = tmp_path / "course"
    source = course / "source" / "flashedu"
    source.mkdir(parents=True)
    for nb in SOLUTIONS:
        shutil.copy(nb, source / nb.name)
    (course / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        f"c.CourseDirectory.root = {str(course)!r}\n"
        "c.CourseDirectory.course_id = 'flashedu'\n"
        "c.ExecutePreprocessor.timeout = 600\n")
    start = time.perf_counter()
    _nbgrader(course, "db", "assignment", "add", "flashedu")
    _nbgrader(course, "generate_assignment", "flashedu", "--force")
    generated = time.perf_counter() - start
    released = course / "release" / "flashedu"
    assert sorted(p.name for p in released.glob("*.ipynb")) == [p.name for p in SOLUTIONS]
    # nbgrader's learner version is the exercise: no solution left in it
    for nb in released.glob("*.ipynb"):
        text = nb.read_text()
        assert "### BEGIN SOLUTION" not in text and "raise NotImplementedError()" in text, nb.name
    # alice hands in the solutions; bob hands in the released notebooks 01 and 02 unfilled
    for student, files in (("alice", SOLUTIONS),
                           ("bob", [released / "01_softmax.ipynb", released / "02_flash_forward.ipynb"])):
        _nbgrader(course, "db", "student", "add", student)
        folder = course / "submitted" / student / "flashedu"
        folder.mkdir(parents=True)
        for nb in files:
            shutil.copy(nb, folder / Path(nb).name)
    start = time.perf_counter()
    _nbgrader(course, "autograde", "flashedu", "--force", timeout=1200)
    autograded = time.perf_counter() - start
    print(f"\nnbgrader: generate_assignment {generated:.0f} s, autograde of 9 notebooks "
          f"{autograded:.0f} s")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        alice = gb.find_submission("flashedu", "alice")
        scores = {nb.name: (nb.score, nb.max_score) for nb in alice.notebooks}
        assert scores == {stem: (POINTS[stem], POINTS[stem]) for stem in POINTS}, scores
        bob = {nb.name: nb.score for nb in gb.find_submission("flashedu", "bob").notebooks}
        assert bob["01_softmax"] == 0 and bob["02_flash_forward"] == 0, bob


def _wrong(nb_path: Path, old: str, new: str) -> nbformat.NotebookNode:
    nb = nbformat.read(nb_path, as_version=4)
    for cell in nb.cells:
        if old in cell.source:
            cell.source = cell.source.replace(old, new)
            return nb
    raise AssertionError(f"{old!r} not in {nb_path.name}")


def test_flashedu_check_grades_a_class_folder(tmp_path):
    """Five learners, every exercise: full marks, unfilled, wrong kernels, a mix; printed time."""
    cls = tmp_path / "class"
    expected = {}
    for student in ("alice", "bob", "carol", "dan", "eve"):
        (cls / student).mkdir(parents=True)
    for sol in SOLUTIONS:
        stem, full = sol.stem, POINTS[sol.stem]
        shutil.copy(sol, cls / "alice" / sol.name)
        expected[("alice", stem)] = full
        shutil.copy(EXERCISE_NBS[sol.name], cls / "bob" / sol.name)
        expected[("bob", stem)] = 0
        shutil.copy(sol if stem < "04" else EXERCISE_NBS[sol.name], cls / "dan" / sol.name)
        expected[("dan", stem)] = full if stem < "04" else 0
        shutil.copy(EXERCISE_NBS[sol.name] if stem < "04" else sol, cls / "eve" / sol.name)
        expected[("eve", stem)] = 0 if stem < "04" else full
    carol = {  # wrong in the ways learners are: each costs that notebook's points
        "02_flash_forward": ("O_i = alpha[:, None] * O_i +", "O_i = O_i +"),
        "05_numba_kernel": ("        cuda.syncthreads()  # everyone is done with the tile before it is overwritten\n", ""),
        "06_triton_kernel": ("cols[None, :] <= rows[:, None]", "cols[None, :] < rows[:, None]"),
    }
    for sol in SOLUTIONS:
        if sol.stem in carol:
            nbformat.write(_wrong(sol, *carol[sol.stem]), cls / "carol" / sol.name)
            expected[("carol", sol.stem)] = 0
        else:
            shutil.copy(sol, cls / "carol" / sol.name)
            expected[("carol", sol.stem)] = POINTS[sol.stem]
    notebooks = sorted(cls.glob("*/*.ipynb"))
    assert len(notebooks) == 35
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "flashedu.checks.grade", "--jobs", "2", "--json",
                          str(tmp_path / "grades.json"), *map(str, notebooks)],
                         cwd=ROOT, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=1200, check=False)
    seconds = time.perf_counter() - start
    print(f"\nflashedu check: 5 submissions, 35 notebooks, --jobs 2: {seconds:.0f} s "
          f"(load average {os.getloadavg()[0]:.1f})")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "grades.json").read_text())
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
