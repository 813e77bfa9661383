"""The practice loop of the notebooks (flashedu.course): steps the learner writes, checked by the
exercises' engine, a reference when unwritten, graded predictions, progress, one source of truth.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from flashedu import course
from flashedu.checks import EXERCISES, STEPS
from flashedu.course import build
from flashedu.course import notebooks as course_notebooks
from flashedu import progress

ROOT = Path(__file__).resolve().parents[1]
SOLVED = sorted((ROOT / "solutions" / "notebooks").glob("*.ipynb"))
# the notebooks whose GPU or masking code the learner writes: each must hold steps
WRITTEN_IN = ("05", "06", "07", "08", "08b", "12")


@pytest.fixture
def record(tmp_path, monkeypatch):
    path = tmp_path / "progress.json"
    monkeypatch.setenv("FLASHEDU_PROGRESS", str(path))
    return path


def _code_cells(path):
    nb = nbformat.read(path, as_version=4)
    return [c for c in nb.cells if c.cell_type == "code"]


# ----- the notebooks: every step and prediction wired up ------------------------------------


@pytest.mark.parametrize("path", SOLVED, ids=[p.name for p in SOLVED])
def test_every_step_is_checked_and_every_prediction_graded(path):
    cells = _code_cells(path)
    later = "\n".join(c.source for c in cells)
    for index, cell in enumerate(cells):
        meta = cell.metadata.get("flashedu")
        if not meta:
            continue
        assert cell.metadata.get("nbgrader", {}).get("solution"), f"{path.name}: {meta}"
        assert build.BEGIN in cell.source and build.END in cell.source, f"{path.name}: {meta}"
        rest = "\n".join(c.source for c in cells[index + 1:])
        if "step" in meta:
            assert meta["exercise"] in STEPS or meta["exercise"] in EXERCISES, meta
            assert re.search(rf"\bdef {meta['symbol']}\b", cell.source), meta
            call = rf'course\.check\(\s*"{re.escape(meta["step"])}",\s*{meta["symbol"]}\b'
            assert re.search(call, rest), \
                f"{path.name}: no course.check of step {meta['step']} after its cell"
        else:
            call = rf'course\.check_prediction\(\s*"{re.escape(meta["prediction"])}"'
            assert re.search(call, rest), \
                f"{path.name}: prediction {meta['prediction']} is never graded"
            assert "practice" in cell.metadata.get("tags", []), meta
    # no prediction outside this machinery: every guess is graded
    for cell in cells:
        if re.search(r"^\s*guess\w*\s*=", cell.source, re.MULTILINE):
            assert "prediction" in cell.metadata.get("flashedu", {}), \
                f"{path.name}: an ungraded guess: {cell.source[:120]!r}"
    assert later  # the notebook has code


def test_step_and_prediction_ids_are_unique_and_named_for_their_notebook():
    items = course_notebooks.steps()
    ids = [s.id for s in items]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    for item in items:
        assert item.id.split(".")[0] == course_notebooks.notebook_number(item.notebook), item


@pytest.mark.parametrize("number", WRITTEN_IN)
def test_the_learner_writes_in_each_gpu_notebook(number):
    written = [s for s in course_notebooks.steps()
               if s.kind == "step" and course_notebooks.notebook_number(s.notebook) == number]
    assert written, f"notebook {number} has no step for the learner to write"


@pytest.mark.parametrize("path", SOLVED, ids=[p.name for p in SOLVED])
def test_the_learner_notebook_holds_no_solution(path):
    learner = {c.metadata.get("flashedu", {}).get("step") or
               c.metadata.get("flashedu", {}).get("prediction"): c
               for c in _code_cells(ROOT / "notebooks" / path.name) if c.metadata.get("flashedu")}
    for cell in _code_cells(path):
        meta = cell.metadata.get("flashedu")
        if not meta:
            continue
        step_id = meta.get("step") or meta.get("prediction")
        mine = learner[step_id].source
        region = course_notebooks.solution_region(course_notebooks.find(step_id))
        assert build.BEGIN not in mine
        if "step" in meta:
            assert "# YOUR CODE HERE" in mine and "raise NotImplementedError()" in mine
            # what the learner writes is not there: the docstring may state a formula the
            # solution spells the same way (it is the spec), never most of the solution
            lines = [ln.strip() for ln in region.splitlines() if len(ln.strip()) > 12]
            found = [ln for ln in lines if ln in mine]
            assert len(found) <= len(lines) // 2, (step_id, found)
        else:
            assert "= None  # YOUR ANSWER HERE" in mine


# ----- checks, references, reveal ------------------------------------------------------------


def test_an_unwritten_step_falls_back_to_the_reference(record, capsys):
    import triton
    import triton.language as tl

    scope = {"triton": triton, "tl": tl}
    exec(compile(build.strip_source(course_notebooks.find("06.add").source), "<cell>", "exec"),
         scope)
    skeleton = scope["add_kernel"]
    # the skeleton's source must be readable for the placeholder test: compile it from a file
    got = course.check("06.add", _from_file(scope, "06.add", skeleton_source=True), quiet=True)
    out = capsys.readouterr().out
    assert "not written yet: using the reference" in out and got is not skeleton
    assert course.check("06.add", got, quiet=True) is got  # the reference passes its own check
    assert json.loads(record.read_text())["steps"]["06.add"]["passed"] is True


def test_a_written_step_that_fails_says_so_and_is_strict_in_the_solved_notebooks(
        record, capsys, monkeypatch):
    import triton
    import triton.language as tl

    source = course_notebooks.solution_code(course_notebooks.find("06.add"))
    wrong = source.replace("x + y, mask=mask", "x - y, mask=mask")
    assert wrong != source
    kernel = _compile_file(wrong, {"triton": triton, "tl": tl}, "add_kernel")
    monkeypatch.setenv("FLASHEDU_COURSE_STRICT", "0")
    got = course.check("06.add", kernel, quiet=True)
    assert got is not kernel and "does not pass yet: using the reference" in capsys.readouterr().out
    assert json.loads(record.read_text())["steps"]["06.add"]["passed"] is False
    monkeypatch.setenv("FLASHEDU_COURSE_STRICT", "1")
    with pytest.raises(AssertionError, match="06.add fails its check"):
        course.check("06.add", kernel, quiet=True)


def test_reveal_shows_one_step_and_records_it(record, capsys):
    course.reveal("06.add")  # a notebook shows it as a code block (_repr_markdown_)
    out = capsys.readouterr().out
    assert "tl.program_id(0)" in out and "BEGIN SOLUTION" not in out
    markdown = course.Solution(course_notebooks.find("06.add"), "x = 1")._repr_markdown_()
    assert "```python\nx = 1\n```" in markdown
    assert json.loads(record.read_text())["steps"]["06.add"]["revealed"] is True
    with pytest.raises(ValueError, match="no step or prediction called"):
        course.reveal("06.nothing")


def _compile_file(source, scope, symbol):
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    exec(compile(source, f.name, "exec"), scope)  # from a file: Triton reads the source back
    return scope[symbol]


def _from_file(scope, step_id, skeleton_source=False):
    step = course_notebooks.find(step_id)
    source = build.strip_source(step.source) if skeleton_source else course_notebooks \
        .solution_code(step)
    return _compile_file(source, dict(scope), step.symbol)


# ----- predictions ---------------------------------------------------------------------------


def test_predictions_are_compared_fairly():
    assert course.matches((7, 12), (7, 12)) and not course.matches((7, 11), (7, 12))
    assert course.matches(0.52, 0.5, within=0.05) and not course.matches(0.6, 0.5, within=0.05)
    assert course.matches(" Yes", "yes") and not course.matches("no", "yes")
    assert course.matches(2, 2) and not course.matches(2.0001, 2)
    assert not course.matches(True, 1) and course.matches(True, True)
    assert not course.matches([1, 2], (1, 2, 3))


def test_a_prediction_is_graded_and_recorded(record, capsys, monkeypatch):
    monkeypatch.setenv("FLASHEDU_COURSE_STRICT", "0")
    course.check_prediction("06.programs", None, (7, 12), why="ceil(100 / 16)")
    assert "no prediction made" in capsys.readouterr().out and not record.exists()
    course.check_prediction("06.programs", (7, 10), (7, 12), why="ceil(100 / 16)")
    out = capsys.readouterr().out
    assert "not quite" in out and "(7, 12)" in out and "ceil(100 / 16)" in out
    assert json.loads(record.read_text())["predictions"]["06.programs"]["right"] is False
    course.check_prediction("06.programs", (7, 12), (7, 12))
    assert "right!" in capsys.readouterr().out
    monkeypatch.setenv("FLASHEDU_COURSE_STRICT", "1")
    with pytest.raises(AssertionError):
        course.check_prediction("06.programs", (6, 12), (7, 12))
    with pytest.raises(ValueError):
        course.check_prediction("06.add", 1, 1)  # a step, not a prediction


# ----- progress ------------------------------------------------------------------------------


def _progress(env_path, *args):
    import os

    env = {**os.environ, "FLASHEDU_PROGRESS": str(env_path)}
    return subprocess.run([sys.executable, "-m", "flashedu.cli", "progress", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_progress_with_nothing_recorded(tmp_path):
    done = _progress(tmp_path / "none.json")
    assert done.returncode == 0, done.stderr
    assert "no progress recorded yet" in done.stdout and "next: write" in done.stdout


def test_progress_counts_steps_predictions_and_exercises(tmp_path):
    path = tmp_path / "p.json"
    first = course_notebooks.steps()[0]
    path.write_text(json.dumps({
        "steps": {"06.add": {"passed": True}},
        "predictions": {"06.programs": {"right": True}},
        "exercises": {"safe_softmax": {"passed": True}}}))
    done = _progress(path)
    assert done.returncode == 0, done.stderr
    row = next(ln for ln in done.stdout.splitlines() if ln.startswith("06_triton_forward"))
    n06 = [s for s in course_notebooks.steps() if s.notebook.startswith("06_")]
    steps06 = sum(s.kind == "step" for s in n06)
    assert f"1/{steps06}" in row and "1/1 of" in row
    assert f"exercises passed: 1/{len(EXERCISES)} (safe_softmax)" in done.stdout
    assert "next: " in done.stdout and first.id in done.stdout
    assert _progress(path, "--reset").returncode == 0 and not path.exists()


def test_a_broken_record_is_read_as_empty(record):
    record.write_text("{not json")
    assert progress.load() == {"steps": {}, "predictions": {}, "exercises": {}}


# ----- a class: the released notebooks, an installation without the solutions -----------------


def test_release_writes_the_learner_notebooks_without_solutions(tmp_path):
    target = tmp_path / "class"
    assert build.main(["release", str(target), "--root", str(ROOT)]) == 0
    written = sorted(p.relative_to(target).as_posix() for p in target.rglob("*.ipynb"))
    assert written == sorted([f"exercises/{p.name}" for p in (ROOT / "solutions").glob("*.ipynb")]
                             + [f"notebooks/{p.name}" for p in SOLVED])
    for path in target.rglob("*.ipynb"):
        text = path.read_text(encoding="utf-8")
        assert build.BEGIN not in text and build.END not in text, path
        assert text == (ROOT / path.relative_to(target)).read_text(encoding="utf-8")
    assert build.main(["release", str(target), "--root", str(ROOT)]) == 2  # not empty: refused
    assert build.main(["release", "--root", str(ROOT)]) == 2  # no folder named


def test_without_the_solved_notebooks_the_index_serves(monkeypatch, tmp_path, capsys, record):
    full = course_notebooks.steps()
    monkeypatch.setattr(course_notebooks, "solved_folder", lambda: tmp_path / "absent")
    course_notebooks.steps.cache_clear()
    try:
        index = course_notebooks.steps()
        assert [(s.id, s.exercise, s.symbol) for s in index] == \
            [(s.id, s.exercise, s.symbol) for s in full]
        with pytest.raises(FileNotFoundError, match="not in this installation"):
            course.reveal("06.add")

        def add_kernel():  # a skeleton, as the released notebook has it
            # YOUR CODE HERE
            raise NotImplementedError()

        assert course.check("06.add", add_kernel, quiet=True) is add_kernel
        assert "not written yet, and the solution of 06.add is not in this installation" in \
            capsys.readouterr().out
    finally:
        course_notebooks.steps.cache_clear()
