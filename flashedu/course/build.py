"""``flashedu exercises build [--check]``: generate exercises/ and notebooks/ from solutions/.

solutions/ holds the course's exercise notebooks, and solutions/notebooks/ the course's
notebooks, in nbgrader's format: each answer sits between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` in a cell whose metadata says ``nbgrader.solution: true``. The learner's
notebook is the same notebook with each answer replaced by ``# YOUR CODE HERE`` and
``raise NotImplementedError()`` (at the marker's indentation, so the skeleton around it stays
valid Python) and every output cleared. In a prediction cell (metadata ``flashedu.prediction``)
each ``name = answer`` line of the answer becomes ``name = None  # YOUR ANSWER HERE``: the
learner's guess, graded by the cell that measures the answer (see :mod:`flashedu.course`).
``--check`` writes nothing and fails when exercises/ or notebooks/ is not what solutions/
generates (a test runs it).
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

from ..checks.engine import PLACEHOLDER
from .notebooks import BEGIN, END, index_text, read_steps

ANSWER = "None  # YOUR ANSWER HERE"
# (solved source, generated learner copy), relative to the project's root
FOLDERS = ((Path("solutions"), Path("exercises")),
           (Path("solutions") / "notebooks", Path("notebooks")))


def strip_source(source: str, where: str = "cell", prediction: bool = False) -> str:
    """``source`` with each BEGIN/END SOLUTION block replaced by the placeholder (or, in a
    prediction cell, each assignment's value by ``None``)."""
    out, inside = [], False
    for line in source.split("\n"):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"{where}: nested '{BEGIN}'")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            if not prediction:
                out += [indent + p for p in PLACEHOLDER]
        elif marker == END:
            if not inside:
                raise ValueError(f"{where}: '{END}' without '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
        elif prediction:
            assignment = re.match(r"^(\s*[A-Za-z_]\w*\s*=)(?!=)", line)
            if assignment:
                out.append(f"{assignment.group(1).rstrip()} {ANSWER}")
    if inside:
        raise ValueError(f"{where}: '{BEGIN}' without '{END}'")
    return "\n".join(out)


def exercise_notebook(nb, name: str = "notebook"):
    """The exercise version of solution notebook ``nb`` (a new object)."""
    nb = copy.deepcopy(nb)
    for index, cell in enumerate(nb.cells):
        where = f"{name}, cell {index}"
        is_solution = cell.get("metadata", {}).get("nbgrader", {}).get("solution", False)
        prediction = "prediction" in cell.get("metadata", {}).get("flashedu", {})
        has_markers = BEGIN in cell.source or END in cell.source
        if has_markers and not is_solution:
            raise ValueError(f"{where}: solution markers in a cell not marked nbgrader.solution")
        if is_solution and cell.cell_type == "code":
            cell.source = strip_source(cell.source, where, prediction)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def render(nb) -> str:
    import nbformat  # here: importing it costs seconds (jsonschema), and a check needs none

    return nbformat.writes(nb) + "\n"


def plan(solutions: Path, exercises: Path) -> dict[Path, str]:
    """Every generated notebook that should exist in ``exercises``, with its text."""
    out = {}
    for src in sorted(solutions.glob("*.ipynb")):
        import nbformat

        nb = nbformat.read(src, as_version=4)
        out[exercises / src.name] = render(exercise_notebook(nb, src.name))
    return out


def stale(solutions: Path, exercises: Path) -> list[str]:
    """What differs between ``exercises`` and what ``solutions`` generates (empty: up to
    date)."""
    wanted = plan(solutions, exercises)
    problems = [f"{p}: missing" for p in wanted if not p.exists()]
    problems += [f"{p}: out of date" for p, text in wanted.items()
                 if p.exists() and p.read_text(encoding="utf-8") != text]
    problems += [f"{p}: has no solution notebook" for p in sorted(exercises.glob("*.ipynb"))
                 if p not in wanted]
    return problems


def release(pairs, target: Path | None) -> int:
    """Write what a class gets: for each (solutions, learner) pair, the learner's notebooks in
    ``target/<learner folder name>``; nothing with a solution in it."""
    if target is None:
        print("flashedu exercises release: name the folder to write (release DIR)",
              file=sys.stderr)
        return 2
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        print(f"flashedu exercises release: {target} exists and is not an empty folder",
              file=sys.stderr)
        return 2
    written = 0
    for src, dst in pairs:
        folder = target / dst.name
        folder.mkdir(parents=True, exist_ok=True)
        for path, text in plan(src, folder).items():
            if BEGIN in text or END in text:  # the builder replaced every region
                raise AssertionError(f"{path}: a solution survived the build")
            path.write_text(text, encoding="utf-8")
            written += 1
    print(f"wrote {written} notebooks to {target}/ ({', '.join(d.name for _, d in pairs)}), "
          "without solutions")
    return 0


def index_plan(root: Path) -> dict[Path, str]:
    """The course's index of steps and predictions, generated from the solved notebooks."""
    folder = root / "solutions" / "notebooks"
    index = root / "flashedu" / "course" / "steps.json"
    return {index: index_text(read_steps(folder))} if folder.is_dir() else {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flashedu exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["build", "release"],
                        help="build: regenerate exercises/ and notebooks/; release DIR: write "
                             "the learner's notebooks and exercises, without solutions, to DIR")
    parser.add_argument("dir", nargs="?", type=Path, help="release: the folder to write")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when exercises/ or notebooks/ is out of date")
    parser.add_argument("--root", type=Path, default=Path("."),
                        help="the project's root, holding solutions/ (default: here)")
    args = parser.parse_args(argv)
    if not (args.root / "solutions").is_dir():
        print(f"no solutions/ in {args.root}: run from the project's root or pass --root",
              file=sys.stderr)
        return 2
    pairs = [(args.root / src, args.root / dst) for src, dst in FOLDERS
             if (args.root / src).is_dir()]
    if args.action == "release":
        return release(pairs, args.dir)
    if args.dir is not None:
        parser.error("build takes no folder (did you mean `release DIR`?)")
    if args.check:
        problems = [line for src, dst in pairs for line in stale(src, dst)]
        problems += [f"{p}: out of date" for p, text in index_plan(args.root).items()
                     if not p.exists() or p.read_text(encoding="utf-8") != text]
        for line in problems:
            print(line)
        if problems:
            print("generated notebooks are out of date: run `flashedu exercises build`",
                  file=sys.stderr)
            return 1
        print(", ".join(f"{dst}/" for _, dst in pairs) + " up to date with their sources")
        return 0
    for src, dst in pairs:
        dst.mkdir(parents=True, exist_ok=True)
        wanted = plan(src, dst)
        for path, text in wanted.items():
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")
                print(f"wrote {path}")
        for path in sorted(dst.glob("*.ipynb")):
            if path not in wanted:
                path.unlink()
                print(f"removed {path} (no solved notebook)")
    for path, text in index_plan(args.root).items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    return 0
