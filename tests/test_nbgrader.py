"""The instructor's nbgrader path, run as an instructor would: generate the learners' version of
solutions/, autograde submissions into the gradebook (``flashedu check``, the other path, is in
tests/test_class_folder.py).

It runs real kernels on every notebook, so it takes a minute or more on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

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
    # alice hands in three solutions: NumPy (01), block-sparse with its timed case (04) and a
    # Triton kernel (06), each kind of graded cell; bob the released notebooks 01 and 02
    # unfilled. (Every solution's full marks are the class-folder test's, through
    # `flashedu check`: autograding all seven here would repeat it at twice the time.)
    handed_in = [p for p in SOLUTIONS if p.stem[:2] in ("01", "04", "06")]
    for student, files in (("alice", handed_in),
                           ("bob", [released / "01_softmax.ipynb", released / "02_flash_forward.ipynb"])):
        _nbgrader(course, "db", "student", "add", student)
        folder = course / "submitted" / student / "flashedu"
        folder.mkdir(parents=True)
        for nb in files:
            shutil.copy(nb, folder / Path(nb).name)
    start = time.perf_counter()
    _nbgrader(course, "autograde", "flashedu", "--force", timeout=1200)
    autograded = time.perf_counter() - start
    print(f"\nnbgrader: generate_assignment {generated:.0f} s, autograde of 5 notebooks "
          f"{autograded:.0f} s")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        alice = gb.find_submission("flashedu", "alice")
        scores = {nb.name: (nb.score, nb.max_score) for nb in alice.notebooks}
        # the notebooks not handed in are in the gradebook with no points
        assert scores == {stem: (POINTS[stem] if stem in {p.stem for p in handed_in} else 0,
                                 POINTS[stem]) for stem in POINTS}, scores
        bob = {nb.name: nb.score for nb in gb.find_submission("flashedu", "bob").notebooks}
        assert bob["01_softmax"] == 0 and bob["02_flash_forward"] == 0, bob
