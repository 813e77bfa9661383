"""``flashedu check`` on a class folder: every submission graded apart from the others.

1. **Stage.** Before anything runs, each submission is read once into a private copy in a folder
   of its own (``<tmp>/flashedu-grade-*/N/home``). A symlink, a hard link or anything but a regular
   file is refused ("not graded"): a link to the course's solutions, or to a classmate's file, is
   not a submission. What happens to the class folder during grading changes nothing.
2. **Supervise.** Each copy is graded by its own supervisor process (forked from a server that
   has imported the grader once), which runs the notebook's kernel in a jail (:mod:`.jail`) and
   grades it (:func:`.grade.grade_notebook`). It sends its rows back through a pipe that no
   kernel holds.
   A supervisor that dies, hangs past the notebook's budget or sends anything else makes that
   notebook's rows "not graded"; every other notebook is graded as usual. When a supervisor
   ends, every process it started is killed (it is a child subreaper: orphans come to it).
3. **Write.** The rows are written by this process alone, after every supervisor has ended:
   the JSON file through a temporary file renamed into place.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import stat
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SLACK = 120.0  # seconds a supervisor may take beyond the notebook's budget (start, teardown)
ROWS_LIMIT = 1 << 20  # bytes of rows a supervisor may send


@dataclass
class Submission:
    original: Path  # where the instructor's file is (the rows name it)
    folder: Path | None = None  # this submission's private folder; None when refused
    refused: str | None = None


def stage(paths: list[Path], root: Path) -> list[Submission]:
    """A private copy of each submission under ``root`` (one numbered folder each)."""
    staged = []
    for n, original in enumerate(paths):
        sub = Submission(Path(original))
        try:
            data = _read_plain_file(sub.original)
        except (OSError, ValueError) as exc:
            sub.refused = str(exc)
            staged.append(sub)
            continue
        sub.folder = root / str(n)
        for part in ("home", "exchange"):
            (sub.folder / part).mkdir(parents=True, mode=0o700)
        (sub.folder / "home" / sub.original.name).write_bytes(data)
        staged.append(sub)
    return staged


def _read_plain_file(path: Path) -> bytes:
    """The bytes of ``path`` if it is a regular file with one name (ValueError otherwise)."""
    if not os.path.lexists(path):
        raise ValueError(f"no such file: {path}")
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link: submit the notebook itself")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if info.st_nlink > 1:
            raise ValueError(f"{path} is a hard link ({info.st_nlink} names): submit a copy")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def hidden(submissions: list[Submission]) -> list[Path]:
    """What no kernel may see: the class folders, the submissions, the course's solutions."""
    import flashedu

    paths = {s.original.absolute() for s in submissions}
    paths |= {p.parent for p in paths}
    solutions = Path(flashedu.__file__).resolve().parent.parent / "solutions"
    if solutions.is_dir():
        paths.add(solutions)
    return sorted(paths)


def compile_bytecode() -> None:
    """Write flashedu's bytecode cache once, before any jail starts. A jailed kernel sees the
    package read-only and cannot cache what it compiles, so without this every kernel, runner
    and gate process of every notebook compiles flashedu's modules again (about 0.7 s each;
    a class of 5 spends a tenth of its grading on it). Where the package is not writable (a
    system install: pip wrote its bytecode then), nothing happens."""
    import compileall

    import flashedu

    package = Path(flashedu.__file__).resolve().parent
    if os.access(package, os.W_OK):
        compileall.compile_dir(package, quiet=2, workers=1)


def grade_class(paths: list[Path], timeout: float, kernel: str | None, budget: float,
                seed: int | None, jobs: int) -> list[tuple[list[dict], bool]]:
    """(rows, graded) per submission, in the order given."""
    from .grade import NOT_GRADED, score_row

    compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="flashedu-grade-") as root:
        submissions = stage(paths, Path(root))
        hide = [str(p) for p in hidden(submissions)]

        def one(sub: Submission):
            if sub.refused:
                return [score_row(sub.original, "-", 0, 0, False, sub.refused, NOT_GRADED)], False
            spec = {"notebook": str(sub.folder / "home" / sub.original.name),
                    "original": str(sub.original), "folder": str(sub.folder), "hide": hide,
                    "timeout": timeout, "kernel": kernel, "budget": budget, "seed": seed}
            return _supervise(spec, budget + SLACK)

        with ThreadPoolExecutor(max(1, jobs)) as pool:
            return list(pool.map(one, submissions))


def _supervise(spec: dict, seconds: float) -> tuple[list[dict], bool]:
    """Run one supervisor; its rows, or rows saying why there are none."""
    ctx = _context()
    rows_in, rows_out = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_supervisor, args=(spec, rows_out), daemon=False)
    proc.start()
    rows_out.close()  # the supervisor holds the only writing end
    deadline = time.monotonic() + seconds
    blob = b""
    while (left := deadline - time.monotonic()) > 0:
        if rows_in.poll(min(1.0, left)):  # rows, or the end of the pipe
            try:
                blob = rows_in.recv_bytes(ROWS_LIMIT)
            except (EOFError, OSError):  # nothing sent, or more than a table of rows
                pass
            break
    proc.join(max(0.0, deadline - time.monotonic()))
    timed_out = proc.exitcode is None
    _kill_group(proc.pid)  # the supervisor leads its own session: it and what it left
    proc.join()
    rows_in.close()
    answer = _parse_rows(blob, spec["original"])
    if answer is not None and proc.exitcode == 0:
        return answer
    why = ("its grading ran past the notebook's budget" if timed_out else
           f"its grading ended without a result (exit status {proc.exitcode})")
    return _not_graded(spec, why), False


_CONTEXT = None


def _context():
    """Supervisors fork from a server that has imported the grader once (a fresh interpreter
    per notebook would import torch and flashedu again: seconds each)."""
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing

        _CONTEXT = multiprocessing.get_context("forkserver")
        # what every supervisor imports, among them what jupyter_client loads to find a kernel
        _CONTEXT.set_forkserver_preload([
            "flashedu.checks.classroom", "flashedu.checks.grade", "flashedu.checks.runner",
            "nbclient", "jupyter_client", "ipykernel.kernelspec", "psutil", "numpy.random"])
    return _CONTEXT


def _parse_rows(blob: bytes, original: str):
    if len(blob) > ROWS_LIMIT:
        return None
    try:
        answer = json.loads(blob.decode())
        rows, graded = answer["rows"], bool(answer["graded"])
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return None
    for r in rows:
        r["notebook"] = original
    return rows, graded


def _not_graded(spec: dict, why: str) -> list[dict]:
    """One "not graded" row per exercise the notebook owns (by the staged copy's name)."""
    import nbformat

    from . import EXERCISES
    from .grade import NOT_GRADED, score_row, owned_exercises

    path = Path(spec["notebook"])
    try:
        names = owned_exercises(path, nbformat.read(path, as_version=4))
    except Exception:  # noqa: BLE001 - an unreadable copy: one row for the notebook
        names = []
    message = f"{why}; exercise not graded"
    if not names:
        return [score_row(spec["original"], "-", 0, 0, False, message, NOT_GRADED)]
    return [score_row(spec["original"], n, 0, EXERCISES[n].points, False, message,
                      NOT_GRADED) for n in names]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def write_json(rows: list[dict], target: Path) -> None:
    """``target`` replaced in one step, so no reader ever sees half a file."""
    target = Path(target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(rows, out, indent=1)
    os.replace(tmp, target)


# ----- the supervisor ------------------------------------------------------------------------

PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Orphaned descendants (a kernel's detached processes) are reparented to this process."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _kill_descendants() -> None:
    """Kill every process below this one until none is left."""
    from .memory import descendants

    me = os.getpid()
    for _ in range(100):
        below = descendants(me)
        if not below:
            return
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in below:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _supervisor(spec: dict, rows_out) -> None:
    """A supervisor: grade one staged notebook, send its rows, leave nothing running."""
    from .grade import grade_notebook
    from .jail import Jail

    os.setsid()  # its own session and group: the top-level process kills it whole
    _die_with_parent()  # a grader stopped midway takes its supervisors (and their jails) along
    _become_subreaper()
    folder = Path(spec["folder"])
    log = os.open(folder / "supervisor.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)  # nothing of a supervisor's reaches the grader's own output
    os.dup2(log, 2)
    jail = Jail(home=folder / "home", exchange=folder / "exchange",
                hide=[Path(p) for p in spec["hide"]], cpu_seconds=int(spec["budget"]) * 4 + 60)
    try:
        rows, graded = grade_notebook(Path(spec["notebook"]), spec["timeout"], spec["kernel"],
                                      spec["budget"], spec["seed"], jail=jail)
    finally:
        _kill_descendants()
    rows_out.send_bytes(json.dumps({"rows": rows, "graded": graded}).encode())
    rows_out.close()
