"""Grade one learner's notebook: run it in a kernel of its own, then check each exercise it owns.

In the kernel (jailed by :mod:`.classroom` and :mod:`.jail`), the notebook runs top to bottom
(nbclient), errors allowed so that one broken cell does not stop the grading, the notebook's own
check cells left out (they only show the learner a result). Then the grader, in this process,
checks each exercise that the notebook owns (by its name, e.g. ``02_flash_forward`` owns
``flash_forward``; see NOTEBOOK_EXERCISES): it draws fresh inputs, asks the kernel to call the
learner's function on them, one case at a time (see :mod:`.worker`), and compares what comes
back with its own float64 reference. Expected answers, tolerances and the comparison never enter
the learner's kernel; the score comes from here, never from the notebook's output. A GPU
kernel's cases do not run in the notebook's kernel at all: it sends only the kernel's
description, which a process of the grader's checks, loads and runs (:mod:`.runner`).
``flashedu check`` (:mod:`.command`) grades a class of notebooks this way.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import nbformat

from . import EXERCISES
from .engine import grade_cases, new_seed, run_seed, set_seed
from .gate import compile_spec
from .memory import Watch
from .result import CheckResult
from .sandbox import Call, RemoteError

_CHECK_CALL = re.compile(r"""check\(\s*["'](\w+)["']""")

# Which exercises each course notebook owns: its rows in the table, whatever its cells say.
NOTEBOOK_EXERCISES = {
    "01_softmax": ("safe_softmax", "online_softmax"),
    "02_flash_forward": ("flash_forward",),
    "03_flash_backward": ("flash_backward",),
    "04_block_sparse": ("block_sparse_forward",),
    "05_numba_kernel": ("numba_forward_kernel",),
    "06_triton_kernel": ("triton_forward_kernel",),
    "07_triton_backward": ("triton_backward_dkdv_kernel", "triton_backward_dq_kernel"),
}
NOT_GRADED = "not graded"


def exercises_in(nb) -> list[str]:
    """Exercise names of a notebook's nbgrader grade cells, by grade_id ``check_<name>`` or by
    the ``check("<name>", ...)`` call in their source."""
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


def owned_exercises(path: Path, nb) -> list[str]:
    """The exercises notebook ``path`` is graded on: those of the course notebook its file name
    contains (``alice_02_flash_forward.ipynb`` too), else of the course notebook that owns the
    first exercise its grade cells check. Extra grade cells never add rows."""
    for stem, names in NOTEBOOK_EXERCISES.items():
        if stem in path.name:
            return list(names)
    for name in exercises_in(nb):
        for names in NOTEBOOK_EXERCISES.values():
            if name in names:
                return list(names)
    return []


def score_row(notebook, exercise, points, max_points, passed, message, status=None):
    return {"notebook": str(notebook), "exercise": exercise, "points": points,
            "max_points": max_points, "passed": passed,
            "status": status or ("passed" if passed else "failed"), "message": message}


class _Kernel:
    """The learner's notebook kernel, driven cell by cell under a per-notebook deadline."""

    def __init__(self, client, deadline: float, cell_timeout: float):
        self.client, self.deadline, self.cell_timeout = client, deadline, cell_timeout

    def run(self, source: str, timeout: float | None = None):
        """Execute ``source`` as a new cell; raises TimeoutError when it runs out of time."""
        from nbclient.exceptions import CellTimeoutError

        left = self.deadline - time.monotonic()
        limit = min(self.cell_timeout if timeout is None else timeout, left)
        if limit <= 0:
            raise TimeoutError("the notebook's time budget is spent")
        cell = nbformat.v4.new_code_cell(source)
        self.client.nb.cells.append(cell)  # nbclient writes the outputs by index
        self.client.timeout = max(1, int(limit))
        try:
            self.client.execute_cell(cell, len(self.client.nb.cells) - 1)
        except CellTimeoutError as exc:
            raise TimeoutError(f"a cell ran past {limit:.0f} s") from exc
        finally:
            del self.client.nb.cells[-1]  # the grader's cells are not kept
        return cell


def _grading_client(nb, **kwargs):
    """nbclient's NotebookClient, keeping no output: the grade never reads a cell's output,
    and a notebook that prints without end must not fill the grader's memory."""
    from nbclient import NotebookClient

    class GradingClient(NotebookClient):
        def output(self, outs, msg, display_id, cell_index):
            return None

    return GradingClient(nb, **kwargs)


def _kernel_manager(kernel_name: str, jail):
    """A kernel manager whose kernel starts inside ``jail`` (:mod:`.jail`), its connection
    file in the jail's home."""
    from jupyter_client.manager import AsyncKernelManager

    from .jail import prefix

    before = prefix(jail)

    class JailedKernelManager(AsyncKernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            return before + super().format_kernel_cmd(extra_arguments)

    km = JailedKernelManager(kernel_name=kernel_name)
    km.connection_file = str(jail.home / ".kernel.json")
    return km


def grade_notebook(path: Path, timeout: float = 600, kernel_name: str | None = None,
                   budget: float = 1800, seed: int | None = None,
                   jail=None) -> tuple[list[dict], bool]:
    """(one row per exercise the notebook at ``path`` owns, whether it could be graded).

    With ``jail`` (a :class:`.jail.Jail`), the kernel runs inside it and the cases go through
    its exchange folder; :mod:`.classroom` builds one per submission."""
    from nbclient.exceptions import DeadKernelError

    path = Path(path)
    if not path.is_file():
        return [score_row(path, "-", 0, 0, False, f"no such file: {path}", NOT_GRADED)], False
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one row of the table
        return [score_row(path, "-", 0, 0, False, f"cannot read the notebook: {exc}",
                          NOT_GRADED)], False
    names = owned_exercises(path, nb)
    if not names:
        return [score_row(path, "-", 0, 0, False, "no exercises found: the file name names no "
                          "course notebook and no grade cell checks an exercise",
                          NOT_GRADED)], False
    for cell in nb.cells:  # the learner's check cells: feedback for them, not the grade
        if cell.cell_type == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
            cell.source = ""
    kernel_name = kernel_name or nb.metadata.get("kernelspec", {}).get("name", "python3")
    km = _kernel_manager(kernel_name, jail) if jail is not None else None
    client = _grading_client(nb, km=km, timeout=int(timeout), allow_errors=True,
                     interrupt_on_timeout=False, shutdown_kernel="immediate",
                     kernel_name=kernel_name,
                     resources={"metadata": {"path": str(path.parent.resolve())}})
    kernel = _Kernel(client, time.monotonic() + budget, timeout)
    folder = jail.exchange if jail is not None else Path(tempfile.mkdtemp(prefix="flashedu-check-"))
    results: dict[str, CheckResult] = {}
    problem = None
    try:
        with client.setup_kernel(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code" or not cell.source.strip():
                    continue
                left = kernel.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the notebook's time budget is spent")
                client.timeout = max(1, int(min(timeout, left)))
                from nbclient.exceptions import CellTimeoutError
                try:
                    client.execute_cell(cell, index)
                except CellTimeoutError as exc:
                    raise TimeoutError(f"cell {index} ran past {client.timeout} s") from exc
            # learner hooks that would run around the grader's cells are dropped
            kernel.run("for _flashedu_cbs in get_ipython().events.callbacks.values():\n"
                       "    _flashedu_cbs.clear()\n", timeout=30)
            for name in names:
                results[name] = _grade_remote(EXERCISES[name], kernel, folder, seed, jail)
    except TimeoutError as exc:
        problem = (f"{exc}: the kernel was stopped ({timeout:g} s a cell, {budget:g} s a "
                   "notebook; an endless loop, or a cell that ignores interrupts?)")
    except DeadKernelError as exc:
        problem = f"the notebook's kernel died ({exc})"
    except Exception as exc:  # noqa: BLE001 - e.g. a missing kernel: one row per exercise
        problem = f"could not run the notebook: {type(exc).__name__}: {exc}"
    finally:
        if jail is None:
            shutil.rmtree(folder, ignore_errors=True)
    rows = []
    for name in names:
        r = results.get(name)
        if r is None:
            rows.append(score_row(path, name, 0, EXERCISES[name].points, False,
                                  f"{problem or 'not graded'}; exercise not graded",
                                  NOT_GRADED))
        else:
            rows.append(score_row(path, name, r.points, r.max_points, r.passed, r.message,
                                  r.status))
    return rows, problem is None


def _grade_remote(ex, kernel: _Kernel, folder: Path, seed: int | None, jail=None) -> CheckResult:
    """Grade exercise ``ex``: the learner's calls in the kernel, everything else here. A GPU
    kernel's cases run in a process of the grader's instead (:mod:`.runner`): only the kernel's
    description comes from the notebook."""
    from . import worker
    from .engine import make_result

    counter = iter(range(10**9))
    token = secrets.token_hex(8)
    source = Path(worker.__file__).resolve()

    def ask(payload, timeout):
        request = f"r{next(counter)}"
        worker.write(folder / request, payload)
        kernel.run(f"import importlib.util as _flashedu_u\n"
                   f"_flashedu_s = _flashedu_u.spec_from_file_location("
                   f"'_flashedu_worker_{token}', {str(source)!r})\n"
                   f"_flashedu_w = _flashedu_u.module_from_spec(_flashedu_s)\n"
                   f"_flashedu_s.loader.exec_module(_flashedu_w)\n"
                   f"_flashedu_w.serve(globals(), {str(folder)!r}, {request!r})\n"
                   f"del _flashedu_u, _flashedu_s, _flashedu_w\n", timeout=timeout)
        try:
            return worker.read(folder / (request + "-reply"))
        except Exception:  # noqa: BLE001 - no reply, or a reply that is not ours
            return None

    set_seed(new_seed() if seed is None else seed)
    reply = ask({"what": "preflight", "exercise": ex.name}, 120)
    if reply is None or not isinstance(reply, dict):
        return make_result(ex, False, "failed", "the grader got no answer from the notebook's "
                       "kernel (see the notebook's last cells)", [])
    early = reply.get("preflight")
    if early:
        return make_result(ex, False, str(early[0]), str(early[1]), [])

    if ex.gate is not None:
        spec = ask({"what": "gate", "exercise": ex.name}, 120)
        spec = spec.get("gate") if isinstance(spec, dict) else None
        with _kernel_runner(ex, spec, folder, jail) as runner:
            if isinstance(runner, str):
                return make_result(ex, False, "failed", runner, [])
            # the gate compiles the description the cases ran, here (a patched gate in the
            # learner's kernel changes nothing)
            return _grade_cases(ex, runner.ask, lambda: compile_spec(spec))
    return _grade_cases(ex, ask, None)


def _grade_cases(ex, ask, gate) -> CheckResult:
    """The cases of ``ex``, each call made through ``ask`` (the notebook's worker, or the
    grader's own process for a GPU kernel), compared here."""
    from . import engine, worker

    def execute(case) -> Call:
        measured = case.memory_budget is not None or case.cpu_budget is not None
        if case.cpu_budget is not None:  # the worker's thread pools to one thread and idle
            # before the watch starts: pool threads spinning after earlier work (the
            # notebook's cells, earlier cases) would be billed to this case
            ask({"what": "settle", "exercise": ex.name}, 30)
        watch = Watch() if measured else None
        answer = ask(worker.request_payload(ex, case), ex.timeout + 60)
        if not isinstance(answer, dict):
            call = Call(error=RemoteError("Error", "the grader got no answer for this case "
                                          "(the call did not end, or its process died)"))
            call.inputs_after = None
            return call
        call = worker.payload_to_call(answer)
        if watch is not None:  # the kernel's own figures could be made up: measured here
            call.rss_bytes = watch.growth() if case.memory_budget is not None else None
            call.cpu_seconds = watch.cpu() if case.cpu_budget is not None else None
        return call

    def hint(case):
        payload = dict(worker.request_payload(ex, case), what="hint")
        answer = ask(payload, engine.HINT_SECONDS + 30)
        text = answer.get("hint") if isinstance(answer, dict) else None
        return text[:800] if isinstance(text, str) else None

    seed_used = run_seed()
    result = grade_cases(ex, execute, gate, hint if ex.hint else None)
    assert run_seed() == seed_used
    return result


@contextlib.contextmanager
def _kernel_runner(ex, spec, folder: Path, jail):
    """A started :class:`.runner.Runner` for the kernel ``spec`` describes, in a jail of its
    own beside the notebook's; or, when it cannot start, why (the gate's words)."""
    from .runner import Runner

    if not isinstance(spec, dict):  # the kernel side's own problem text, or nothing
        yield str(compile_spec(spec))
        return
    if jail is not None:
        from .jail import Jail

        base = jail.home.parent
        (base / "runner-home").mkdir(exist_ok=True)
        own = Jail(home=base / "runner-home", exchange=base / f"runner-{ex.name}",
                   hide=[*jail.hide, jail.home, jail.exchange], cpu_seconds=jail.cpu_seconds,
                   memory_bytes=jail.memory_bytes)
        own.exchange.mkdir()
        where = own.exchange
    else:
        own, where = None, Path(tempfile.mkdtemp(prefix="flashedu-runner-", dir=folder))
    runner = Runner(ex, spec, where, own)
    problem = runner.start()
    try:
        yield problem if problem else runner
    finally:
        runner.close()
