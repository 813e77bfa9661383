"""The ``flashedu`` command.

    flashedu doctor              versions, the device, what runs where
    flashedu tour                every available backend on a small problem, checked, as a table
    flashedu bench ...           benchmarks against peers (flashedu.bench)
    flashedu exercises ...       build exercises/ from solutions/ (flashedu.checks.build)
    flashedu check NOTEBOOK...   grade learners' notebooks (flashedu.checks.grade)
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommands that live in their own module, each with main(argv) -> int.
DELEGATED = {
    "bench": ("flashedu.bench", "benchmarks against peers (needs a GPU for timings)"),
    "exercises": ("flashedu.checks.build", "generate exercises/ from solutions/"),
    "check": ("flashedu.checks.grade", "grade notebooks and print a score table"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        module = importlib.import_module(DELEGATED[argv[0]][0])
        return int(module.main(argv[1:]) or 0)

    parser = argparse.ArgumentParser(prog="flashedu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="versions, device, and what runs where")
    tour = sub.add_parser("tour", help="run every available stage on a small problem")
    tour.add_argument("--json", help="also write the table as JSON to this path")
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)

    if args.command == "doctor":
        from .runtime import doctor

        print(doctor())
        return 0
    if args.command == "tour":
        from .tour import run_tour

        return run_tour(json_path=args.json)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
