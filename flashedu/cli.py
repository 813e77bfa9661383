"""The ``flashedu`` command.

    flashedu doctor              versions, the device, what runs where
    flashedu tour                every available backend on a small problem, checked, as a table
    flashedu bench ...           benchmarks against peers, and its subcommands (flashedu.bench)
    flashedu exercises ...       build exercises/ from solutions/ (flashedu.course.build)
    flashedu check NOTEBOOK...   grade learners' notebooks (flashedu.checks.command)
    flashedu progress            your progress through the course, by notebook (flashedu.course)
    flashedu --version           the package version

Every subcommand validates its arguments before doing any work and exits non-zero (2 for bad
arguments, 1 for a failed run) when it did not do what was asked.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Subcommands that live in their own module, each with main(argv) -> int.
DELEGATED = {
    "bench": ("flashedu.bench", "benchmarks against peers; `flashedu bench --help` lists the "
              "subcommands (timings need a GPU)"),
    "exercises": ("flashedu.course.build", "generate exercises/ and notebooks/ from solutions/"),
    "check": ("flashedu.checks.command", "grade notebooks and print a score table"),
    "progress": ("flashedu.course.report", "your progress through the course, by notebook"),
}


# `flashedu check`'s options that take a value (the rest of its arguments are notebooks).
CHECK_VALUE_OPTIONS = ("--timeout", "--kernel", "--jobs", "--json", "--budget", "--seed")


def writable_file(path: str) -> str:
    """argparse type: a file path whose folder exists and can be written, checked up front."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a folder, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {path!r}: folder {folder!r} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path!r}: the file is not writable")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path!r}: folder {folder!r} is not writable")
    return path


def json_target(path: str) -> str:
    """argparse type of `flashedu check --json`: '-' (print the JSON) or a writable file."""
    return path if path == "-" else writable_file(path)


def seconds(text: str) -> float:
    """argparse type: a time limit in seconds, at least 1 (the grader's limits are whole
    seconds, and anything under 1 s would round up to 1 s without saying so)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value >= 1 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be at least 1 second (and finite), got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def missing_notebooks(argv) -> list[str]:
    """The notebook paths given to `flashedu check` that are not files."""
    missing, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in CHECK_VALUE_OPTIONS:
            skip = True
        elif not arg.startswith("-") and not os.path.isfile(arg):
            missing.append(arg)
    return missing


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="flashedu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"flashedu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="versions, device, and what runs where")
    tour = sub.add_parser("tour", help="run every available stage on a small problem")
    tour.add_argument("--json", type=writable_file, metavar="PATH",
                      help="also write the table as JSON to this path (its folder must exist)")
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        if argv[0] == "check" and "-h" not in argv and "--help" not in argv:
            missing = missing_notebooks(argv[1:])
            if missing:
                print(f"flashedu check: no such notebook: {', '.join(missing)}", file=sys.stderr)
                return 2
        module = importlib.import_module(DELEGATED[argv[0]][0])
        return int(module.main(argv[1:]) or 0)

    args = build_parser().parse_args(argv)

    if args.command == "doctor":
        from . import __version__, backends  # noqa: F401  backends adds its table
        from .runtime import doctor

        print(doctor(__version__))
        return 0
    if args.command == "tour":
        from .tour import run_tour

        return run_tour(json_path=args.json)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
