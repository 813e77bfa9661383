"""``flashedu check NOTEBOOK.ipynb [...]``: grade learners' notebooks and print a score table.

    flashedu check submissions/*/*.ipynb                      # the table
    flashedu check submissions/*/*.ipynb --json grades.json   # and every row as JSON in a file

Each submission is copied, graded by a supervisor process of its own, and its kernel runs in a
jail (:mod:`.classroom`, :mod:`.jail`: what a notebook cannot reach, and why). In it, the
notebook runs top to bottom in a fresh kernel, and the supervisor checks each exercise that the
notebook owns against its own float64 reference (:mod:`.grade`): expected answers, tolerances and
the comparison never enter the learner's kernel; the score comes from the supervisor, never from
the notebook's output.

Time: each cell has ``--timeout`` seconds and each notebook ``--budget`` seconds in all; a cell
that runs past either (one that swallows KeyboardInterrupt included) has its kernel killed, and
that notebook's remaining exercises are not graded (0 points, status "not graded").

Exit code: 0 when every notebook was graded (whatever the scores); 1 when one could not be (a
missing or unreadable file, a kernel that died or ran out of time); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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
    from ..cli import json_target, positive_int, seconds  # checked before any grading starts

    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--json", metavar="FILE", type=json_target, help="also write every row "
                        "as JSON to FILE ('-': print the JSON instead of the table)")
    parser.add_argument("--timeout", type=seconds, default=600, help="seconds per cell")
    parser.add_argument("--budget", type=seconds, default=1800, help="seconds per notebook")
    parser.add_argument("--kernel", help="Jupyter kernel name (default: the notebook's)")
    parser.add_argument("--jobs", type=positive_int, default=1, help="notebooks graded at once")
    parser.add_argument("--seed", type=int, help="the inputs' seed (default: fresh per exercise)")
    args = parser.parse_args(argv)
    from . import classroom, jail  # after the arguments are checked: they import the grader

    if jail.unavailable():
        print(f"flashedu check: the notebooks' kernels run without a jail ({jail.unavailable()}): "
              "a notebook can read and change files this user can; see the README's "
              "instructor section", file=sys.stderr)
    graded = classroom.grade_class(args.notebooks, args.timeout, args.kernel, args.budget,
                                   args.seed, args.jobs)
    rows = [row for rows, _ in graded for row in rows]
    if args.json == "-":
        print(json.dumps(rows, indent=1))
    else:
        print(table(rows))
        if args.json:
            classroom.write_json(rows, Path(args.json))
    failed = [str(p) for p, (_, ok) in zip(args.notebooks, graded) if not ok]
    if failed:
        print(f"could not grade {len(failed)} notebook(s): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
