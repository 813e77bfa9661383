"""exercises/ is generated from solutions/ and up to date; the notebooks are valid nbgrader
notebooks; `flashedu check` gives the solutions full marks, the unfilled exercises "not
implemented yet", and grades what a learner defined even when the notebook is broken."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from flashedu.checks import EXERCISES, build
from flashedu.checks.grade import exercises_in

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISE_NBS = sorted((ROOT / "exercises").glob("*.ipynb"))
NBGRADER_KEYS = {"grade", "grade_id", "locked", "schema_version", "solution", "task"}


def test_exercises_and_notebooks_are_up_to_date():
    problems = [line for src, dst in build.FOLDERS for line in build.stale(ROOT / src, ROOT / dst)]
    assert not problems, "run `flashedu exercises build`:\n" + "\n".join(problems)
    assert build.main(["build", "--check", "--root", str(ROOT)]) == 0


def test_strip_keeps_the_skeleton_and_indentation():
    source = ("def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    for i in x:\n        y += i\n"
              "    ### END SOLUTION\n    return y")
    assert build.strip_source(source) == ("def f(x):\n    y = 1\n    # YOUR CODE HERE\n"
                                          "    raise NotImplementedError()\n    return y")
    for broken in ("### BEGIN SOLUTION\nx", "x\n### END SOLUTION",
                   "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION"):
        with pytest.raises(ValueError):
            build.strip_source(broken)


def test_a_prediction_keeps_its_question_and_loses_its_answer():
    source = "# your prediction: programs for Nq = 100, Br = 16\n### BEGIN SOLUTION\nguess = 7\n### END SOLUTION"
    assert build.strip_source(source, prediction=True) == (
        "# your prediction: programs for Nq = 100, Br = 16\nguess = None  # YOUR ANSWER HERE")


def test_build_check_reports_a_stale_exercise(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    nb = nbformat.read(SOLUTIONS[0], as_version=4)
    nbformat.write(nb, tmp_path / "solutions" / "a.ipynb")
    args = ["build", "--root", str(tmp_path)]
    assert build.main(args + ["--check"]) == 1  # missing
    assert build.main(args) == 0 and build.main(args + ["--check"]) == 0
    nb.cells[0].source += " (edited)"
    nbformat.write(nb, tmp_path / "solutions" / "a.ipynb")
    assert build.stale(tmp_path / "solutions", tmp_path / "exercises") == [
        f"{tmp_path / 'exercises' / 'a.ipynb'}: out of date"]


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.name for p in SOLUTIONS])
def test_solution_notebooks_carry_valid_nbgrader_metadata(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    ids = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells]
    assert len(ids) == len(set(ids)), "grade_id must be unique within a notebook"
    for cell in nb.cells:
        meta = cell.metadata["nbgrader"]
        assert NBGRADER_KEYS <= set(meta) and meta["schema_version"] == 3, cell.source[:60]
        assert not (meta["solution"] and meta["locked"]), "a solution cell must stay editable"
        if meta["solution"]:
            assert cell.cell_type == "code" and build.BEGIN in cell.source
        if meta["grade"]:
            name = meta["grade_id"].removeprefix("check_")
            assert meta["locked"] and meta["points"] == EXERCISES[name].points
            assert f'check("{name}"' in cell.source and "assert result.passed" in cell.source


def test_every_exercise_is_graded_exactly_once():
    graded = [name for path in SOLUTIONS for name in exercises_in(nbformat.read(path, as_version=4))]
    assert sorted(graded) == sorted(EXERCISES)


def test_pytest_nbval_does_not_collect_the_exercise_notebooks():
    """exercises/ and solutions/ hold the graded exercises: nbval runs none of them (the solved
    course notebooks in solutions/notebooks/ it runs)."""
    pytest.importorskip("nbval", reason="nbval is not installed here (the README's install "
                                        "brings it): the option --nbval-lax does not exist")
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--nbval-lax",
                          "-p", "no:cacheprovider", "exercises", "solutions"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    items = [ln for ln in run.stdout.splitlines() if "::" in ln]
    assert run.returncode == 0 and items, run.stdout + run.stderr
    assert all(ln.startswith("solutions/notebooks/") for ln in items), items[:5]


def _learner_notebook(tmp_path) -> Path:
    """A submission gone wrong in the usual ways: a cell that raises before the exercise, a
    forward that forgets to rescale O_i, and a check cell edited to check something else."""
    nb = nbformat.read(ROOT / "solutions" / "02_flash_forward.ipynb", as_version=4)
    cells = {c.metadata["nbgrader"]["grade_id"]: c for c in nb.cells}
    cells["setup"].source += "\nundefined_name  # a broken cell: grading must go on"
    cells["flash_forward"].source = cells["flash_forward"].source.replace(
        "O_i = alpha[:, None] * O_i +", "O_i = O_i +")
    cells["check_flash_forward"].source = (
        'import flashedu.tiled\nresult = check("flash_forward", flashedu.tiled.flash_forward)')
    path = tmp_path / "learner.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """`flashedu check --json` over the solutions, the exercises and one broken submission."""
    learner = _learner_notebook(tmp_path_factory.mktemp("submission"))
    notebooks = [str(p) for p in SOLUTIONS + EXERCISE_NBS] + [str(learner)]
    run = subprocess.run([sys.executable, "-m", "flashedu.checks.grade", "--json", "-", "--jobs", "2",
                          "--timeout", "300", *notebooks],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return _group(json.loads(run.stdout))


def _group(rows):
    """Rows by where the notebook came from: "solutions", "exercises" or "learner"."""
    out = {}
    for r in rows:
        key = "learner" if r["notebook"].endswith("learner.ipynb") else Path(r["notebook"]).parent.name
        out.setdefault(key, []).append(r)
    return out


def test_solutions_get_full_marks(graded):
    rows = graded["solutions"]
    assert sorted(r["exercise"] for r in rows) == sorted(EXERCISES)
    for r in rows:
        assert r["passed"] and r["points"] == r["max_points"] == EXERCISES[r["exercise"]].points, r


def test_unfilled_exercises_report_not_implemented_yet(graded):
    rows = graded["exercises"]
    assert sorted(r["exercise"] for r in rows) == sorted(EXERCISES)
    for r in rows:
        assert r["status"] == "not implemented yet" and r["points"] == 0, r
        assert "Traceback" not in r["message"]


def test_a_broken_submission_is_graded_on_what_the_learner_wrote(graded):
    (row,) = graded["learner"]
    assert row["exercise"] == "flash_forward" and not row["passed"] and row["points"] == 0
    assert "several tiles" in row["message"] and "rescale" in row["message"]
    # the stepper's line, computed in the learner's kernel from the failed case's inputs
    assert "open the stepper at step" in row["message"], row["message"]


# ------------------------------------------------------------------------------------------
# The kernel exercises' solutions pass on every draw of the inputs
# ------------------------------------------------------------------------------------------

KERNEL_EXERCISES = ["numba_forward_kernel", "triton_forward_kernel",
                    "triton_backward_dkdv_kernel", "triton_backward_dq_kernel"]


def _seeds() -> range:
    """FLASHEDU_SEEDS draws (default 5), from FLASHEDU_SEED_START (default 1): the same seeds
    on every run unless asked otherwise."""
    import os

    start = int(os.environ.get("FLASHEDU_SEED_START", "1"))
    return range(start, start + int(os.environ.get("FLASHEDU_SEEDS", "5")))


@pytest.mark.slow
@pytest.mark.parametrize("name", KERNEL_EXERCISES)
def test_kernel_solution_passes_every_seed(name, tmp_path):
    """The course's solution of each kernel exercise passes every case on each seed: each
    allowance is derived from the draw (the error of correct float32 computations on it, and
    the rounding a correct kernel can make on it), so no draw may fail a correct kernel. The
    cases run in this process; the compile gate, which no seed changes, is tested elsewhere."""
    from flashedu.checks import engine
    from test_checks import load

    ex = EXERCISES[name]
    fn = load(name, (), tmp_path)
    failed = []
    for seed in _seeds():
        engine.set_seed(seed)
        result = engine.grade_cases(ex, lambda case: engine.execute_case(ex, fn, case))
        if not result.passed:
            failed.append(f"seed {seed}: {result.message}")
    assert not failed, f"{len(failed)} of {len(_seeds())} seeds failed:\n" + "\n".join(failed[:3])
