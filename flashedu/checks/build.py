"""``flashedu exercises build [--check]``: generate exercises/ from solutions/.

solutions/ holds the course's exercise notebooks in nbgrader's format, with each answer between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` in a cell whose metadata says
``nbgrader.solution: true``. The exercise notebook is the same notebook with each answer replaced
by ``raise NotImplementedError()`` (at the marker's indentation, so the skeleton around it stays
valid Python) and every output cleared. ``--check`` writes nothing and fails when exercises/ is
not what solutions/ generates (a test runs it).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
PLACEHOLDER = ("# YOUR CODE HERE", "raise NotImplementedError()")


def strip_source(source: str, where: str = "cell") -> str:
    """``source`` with each BEGIN/END SOLUTION block replaced by the placeholder."""
    out, inside = [], False
    for line in source.split("\n"):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"{where}: nested '{BEGIN}'")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + p for p in PLACEHOLDER]
        elif marker == END:
            if not inside:
                raise ValueError(f"{where}: '{END}' without '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: '{BEGIN}' without '{END}'")
    return "\n".join(out)


def exercise_notebook(nb, name: str = "notebook"):
    """The exercise version of solution notebook ``nb`` (a new object)."""
    nb = copy.deepcopy(nb)
    for index, cell in enumerate(nb.cells):
        where = f"{name}, cell {index}"
        is_solution = cell.get("metadata", {}).get("nbgrader", {}).get("solution", False)
        has_markers = BEGIN in cell.source or END in cell.source
        if has_markers and not is_solution:
            raise ValueError(f"{where}: solution markers in a cell not marked nbgrader.solution")
        if is_solution and cell.cell_type == "code":
            cell.source = strip_source(cell.source, where)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def render(nb) -> str:
    import nbformat  # here: importing it costs seconds (jsonschema), and a check needs none

    return nbformat.writes(nb) + "\n"


def plan(solutions: Path, exercises: Path) -> dict[Path, str]:
    """Every exercise file that should exist, with its text."""
    out = {}
    for src in sorted(solutions.glob("*.ipynb")):
        import nbformat

        nb = nbformat.read(src, as_version=4)
        out[exercises / src.name] = render(exercise_notebook(nb, src.name))
    return out


def stale(solutions: Path, exercises: Path) -> list[str]:
    """What differs between exercises/ and what solutions/ generates (empty: up to date)."""
    wanted = plan(solutions, exercises)
    problems = [f"{p}: missing" for p in wanted if not p.exists()]
    problems += [f"{p}: out of date" for p, text in wanted.items()
                 if p.exists() and p.read_text(encoding="utf-8") != text]
    problems += [f"{p}: has no solution notebook" for p in sorted(exercises.glob("*.ipynb"))
                 if p not in wanted]
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flashedu exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["build"])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when exercises/ is out of date")
    parser.add_argument("--solutions", type=Path, default=Path("solutions"))
    parser.add_argument("--exercises", type=Path, default=Path("exercises"))
    args = parser.parse_args(argv)
    if not args.solutions.is_dir():
        print(f"no {args.solutions}/ here: run from the project's root or pass --solutions",
              file=sys.stderr)
        return 2
    if args.check:
        problems = stale(args.solutions, args.exercises)
        for line in problems:
            print(line)
        if problems:
            print("exercises/ is out of date: run `flashedu exercises build`", file=sys.stderr)
            return 1
        print(f"{args.exercises}/ is up to date with {args.solutions}/")
        return 0
    args.exercises.mkdir(parents=True, exist_ok=True)
    wanted = plan(args.solutions, args.exercises)
    for path, text in wanted.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    for path in sorted(args.exercises.glob("*.ipynb")):
        if path not in wanted:
            path.unlink()
            print(f"removed {path} (no solution notebook)")
    return 0
