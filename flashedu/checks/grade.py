"""``flashedu check NOTEBOOK.ipynb [...]``: run learners' notebooks and print a score table.

Each notebook runs top to bottom in a fresh kernel (nbclient), with errors allowed so that one
broken cell does not stop the grading, and a time limit per cell. Then one more cell, added by the
grader, checks every exercise of the notebook on the function the learner defined under its
expected name (so an edited check cell cannot change what is graded; a check the notebook
already ran on that same function is reused). An instructor runs this over a folder:

    flashedu check submissions/*/*.ipynb            # the table
    flashedu check submissions/*/*.ipynb --json     # one JSON list of rows

The exit code is 0 whatever the scores; 2 only for a usage error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat

from . import EXERCISES, RESULTS_MARKER

_CHECK_CALL = re.compile(r"""check\(\s*["'](\w+)["']""")


def exercises_in(nb) -> list[str]:
    """Exercise names of a notebook: its nbgrader grade cells, by grade_id ``check_<name>`` or
    by the ``check("<name>", ...)`` call in their source."""
    names = []
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade"):
            continue
        found = _CHECK_CALL.findall(cell.source)
        grade_id = meta.get("grade_id", "")
        if grade_id.startswith("check_"):
            found.append(grade_id[len("check_"):])
        for name in found:
            if name in EXERCISES and name not in names:
                names.append(name)
    return names


def _row(notebook, exercise, points, max_points, passed, message, status=None):
    return {"notebook": str(notebook), "exercise": exercise, "points": points,
            "max_points": max_points, "passed": passed,
            "status": status or ("passed" if passed else "failed"), "message": message}


def grade_notebook(path: Path, timeout: float = 600, kernel_name: str | None = None) -> list[dict]:
    """One row per exercise of the notebook at ``path``."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one row of the table
        return [_row(path, "-", 0, 0, False, f"cannot read the notebook: {exc}")]
    names = exercises_in(nb)
    if not names:
        return [_row(path, "-", 0, 0, False, "no exercises found (no nbgrader grade cell "
                     "calling flashedu.checks.check)")]
    nb.cells.append(nbformat.v4.new_code_cell(
        f"import flashedu.checks as _flashedu_checks\n"
        f"_flashedu_checks.print_namespace_results(globals(), {names!r})"))
    client = NotebookClient(nb, timeout=timeout, allow_errors=True, interrupt_on_timeout=True,
                            kernel_name=kernel_name or nb.metadata.get("kernelspec", {}).get("name", "python3"),
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    problem = None
    try:
        client.execute()
    except DeadKernelError as exc:
        problem = f"the notebook's kernel died ({exc}); exercises not graded"
    except Exception as exc:  # noqa: BLE001 - e.g. a missing kernel: one row per exercise
        problem = f"could not run the notebook: {type(exc).__name__}: {exc}"
    results = _results(nb.cells[-1]) if problem is None else None
    if results is None:
        problem = problem or "the grading cell did not report (see the notebook's last cell)"
        return [_row(path, n, 0, EXERCISES[n].points, False, problem, "not graded") for n in names]
    return [_row(path, r["name"], r["points"], r["max_points"], r["passed"], r["message"],
                 r["status"]) for r in results]


def _results(cell):
    for output in cell.get("outputs", []):
        for line in output.get("text", "").splitlines():
            if line.startswith(RESULTS_MARKER):
                return json.loads(line[len(RESULTS_MARKER):])
    return None


def table(rows: list[dict]) -> str:
    """The score table, one line per exercise, then the total per notebook."""
    head = ("notebook", "exercise", "points", "passed", "message")
    lines = [[Path(r["notebook"]).name, r["exercise"], f"{r['points']:g}/{r['max_points']:g}",
              "yes" if r["passed"] else "no", _first_line(r)] for r in rows]
    totals = {}
    for r in rows:
        got, most = totals.get(r["notebook"], (0, 0))
        totals[r["notebook"]] = (got + r["points"], most + r["max_points"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    widths[-1] = len(head[-1])
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line) for line in lines]
    out += [f"total {Path(nb).name}: {got:g}/{most:g}" for nb, (got, most) in totals.items()]
    return "\n".join(out)


def _first_line(row) -> str:
    text = " ".join(row["message"].split("\n")[:2]) if not row["passed"] else row["message"]
    return text if len(text) <= 100 else text[:97] + "..."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flashedu check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per cell")
    parser.add_argument("--kernel", help="Jupyter kernel name (default: the notebook's)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at once")
    args = parser.parse_args(argv)
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        graded = pool.map(lambda p: grade_notebook(p, args.timeout, args.kernel), args.notebooks)
        rows = [row for rows in graded for row in rows]
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
