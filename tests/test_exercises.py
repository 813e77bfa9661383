"""exercises/ is generated from solutions/ and up to date; the notebooks are valid nbgrader
notebooks; the kernel exercises' solutions pass on every draw. (`flashedu check` on the solutions,
the unfilled exercises and a broken submission: tests/test_class_folder.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from flashedu.checks import EXERCISES
from flashedu.course import build
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
