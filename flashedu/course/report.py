"""``flashedu progress``: the learner's record (:mod:`flashedu.progress`) as a table by
notebook, the exercises passed, and what to do next."""

from __future__ import annotations

import json

from ..checks import EXERCISES
from .notebooks import steps
from ..progress import load, progress_file


def table(record_: dict | None = None) -> str:
    """The learner's progress by notebook, then the next thing to do."""
    data = load() if record_ is None else record_
    rows, next_up = [], None
    by_notebook: dict[str, list] = {}
    for item in steps():
        by_notebook.setdefault(item.notebook, []).append(item)
    for notebook, items in by_notebook.items():
        written = [s for s in items if s.kind == "step"]
        asked = [s for s in items if s.kind == "prediction"]
        passed = sum(data["steps"].get(s.id, {}).get("passed", False) for s in written)
        answered = [data["predictions"][s.id] for s in asked if s.id in data["predictions"]]
        right = sum(a.get("right", False) for a in answered)
        todo = [s for s in written if not data["steps"].get(s.id, {}).get("passed", False)]
        todo += [s for s in asked if s.id not in data["predictions"]]
        if next_up is None and todo:
            next_up = todo[0]
        rows.append((notebook.removesuffix(".ipynb"), f"{passed}/{len(written)}",
                     f"{right}/{len(answered)} of {len(asked)}",
                     "done" if not todo else todo[0].id))
    exercises = data["exercises"]
    ex_passed = sum(exercises.get(name, {}).get("passed", False) for name in EXERCISES)
    head = ("notebook", "steps passed", "predictions right", "next")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(4)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    graded = list(EXERCISES)
    lines.append("")
    lines.append(f"exercises passed: {ex_passed}/{len(graded)}"
                 + (f" ({', '.join(n for n in graded if exercises.get(n, {}).get('passed'))})"
                    if ex_passed else ""))
    if next_up is None:
        lines.append("next: every step and prediction is done; the exercises are in exercises/")
    else:
        what = "write" if next_up.kind == "step" else "predict"
        lines.append(f"next: {what} {next_up.id} in notebooks/{next_up.notebook}"
                     + (f" ({next_up.title})" if next_up.title else ""))
    if not any(data.values()):
        lines.insert(0, f"no progress recorded yet ({progress_file()}); open notebooks/ in "
                        "JupyterLab and start with 00.\n")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="flashedu progress", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the raw record as JSON")
    parser.add_argument("--reset", action="store_true", help="forget all recorded progress")
    args = parser.parse_args(argv)
    if args.reset:
        progress_file().unlink(missing_ok=True)
        print(f"progress reset ({progress_file()})")
        return 0
    if args.json:
        print(json.dumps(load(), indent=1, sort_keys=True))
        return 0
    print(table())
    return 0
