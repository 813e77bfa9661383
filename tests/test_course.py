"""The course as a whole: every notebook gives the learner practice, stays free of outputs in
git, and speaks of the algorithm, the paper and measurements only."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
COURSE_NOTEBOOKS = NOTEBOOKS + sorted((ROOT / "solutions").rglob("*.ipynb")) + sorted(
    (ROOT / "exercises").glob("*.ipynb"))

# Words about how the project was made, which a reader of the course should never meet.
# (Random seeds, `torch.manual_seed` and the like are fine: the patterns need the word's context.)
# Also the names of the machines, folders and tools the work was done with, and "round" as a
# name for a stage of the work ("round2" in a file name); a timing "round" is fine.
MAKING_OF = re.compile(
    r"issue\s*#?\d|issue's|\bround\s*\d|_round\d|shared/seeds|\bthe seed\b|\bseed'?s\s+"
    r"(article|repo|readme|config|claims?|gpt)|\bseed\s+(article|repository|readme|document)|"
    r"nvidia-h[12]00|h[12]00-x\d|\$OUT\b|/tmp/(np|site)\b|\bwas lent\b|\bsubagent|"
    r"\bhelper session|\bsearch`? tool|\bdevice tool|farm-studio|\bthe brief\b", re.IGNORECASE)
TEXT_FILES = [p for pattern in ("flashedu/**/*.py", "scripts/*.py", "tests/*.py", "docs/**/*.md",
                                "docs/**/*.json", "docs/**/*.log", "*.md", "exercises/*.py",
                                "solutions/*.py")
              for p in ROOT.glob(pattern) if p.name != "test_course.py"]


def _project_files() -> list[Path]:
    import os

    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in (".git", ".venv", "__pycache__", "bench-out")
                   and not d.endswith(".egg-info")]
        found += [Path(folder) / name for name in dirs + files]
    return found


FILE_NAMES = _project_files()


def practice_cells(nb) -> list:
    return [c for c in nb.cells if "practice" in c.metadata.get("tags", [])]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_notebook_has_practice(path):
    nb = nbformat.read(path, as_version=4)
    cells = practice_cells(nb)
    assert len(cells) >= 2, (f"{path.name}: {len(cells)} cell(s) tagged 'practice'; each "
                             "notebook asks the learner to predict and to modify at least twice")
    assert any(c.cell_type == "code" for c in cells), f"{path.name}: no practice cell to run"


@pytest.mark.parametrize("path", COURSE_NOTEBOOKS, ids=[p.name for p in COURSE_NOTEBOOKS])
def test_notebooks_are_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    with_outputs = [i for i, c in enumerate(nb.cells)
                    if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not with_outputs, f"{path.name}: cells {with_outputs} carry outputs; clear them"


@pytest.mark.parametrize("path", COURSE_NOTEBOOKS, ids=[p.name for p in COURSE_NOTEBOOKS])
def test_notebooks_speak_of_the_algorithm_only(path):
    nb = nbformat.read(path, as_version=4)
    hits = [(i, m.group(0)) for i, c in enumerate(nb.cells)
            for m in MAKING_OF.finditer(c.source)]
    assert not hits, f"{path.name}: words about how the course was made, cell/word: {hits}"


def test_code_and_docs_speak_of_the_algorithm_only():
    hits = [f"{p.relative_to(ROOT)}:{n}: {m.group(0)!r}"
            for p in TEXT_FILES
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            for m in MAKING_OF.finditer(line)]
    assert not hits, "words about how the project was made:\n" + "\n".join(hits)


def test_file_names_speak_of_the_algorithm_only():
    hits = [str(p.relative_to(ROOT)) for p in FILE_NAMES if MAKING_OF.search(p.name)]
    assert not hits, "file names about how the project was made: " + ", ".join(hits)


def test_the_pattern_catches_what_it_should_and_nothing_else():
    for bad in ("see issue 8", "the issue's target", "round 2 measured", "the seed article",
                "shared/seeds/000.txt", "The seed's GPT config", "speed_h100_round2.json",
                "H100 (nvidia-h100-x1)", "--json $OUT/x.json", "PYTHONPATH=/tmp/np:$PWD",
                "no machine was lent", "the `search` tool found", "as the brief gives it"):
        assert MAKING_OF.search(bad), bad
    for good in ("torch.manual_seed(0)", "seed=1234", "a fixed seed", "the RNG seed", "rounds",
                 "within each round, best round kept", "silently", "bench-out/x.json",
                 "a brief header"):
        assert not MAKING_OF.search(good), good
