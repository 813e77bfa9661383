"""The notebook's ``check()``: the learner's code in a child process, the grading in this one.

``flashedu check`` runs the learner's code in the notebook's own kernel and grades in its own
process (:mod:`.grade`). In a notebook, ``check(name, fn)`` gets the function itself, defined
in a cell: a closure, a ``@cuda.jit`` or ``@triton.jit`` object, whatever the cell made. It
cannot be sent to a fresh process (pickle by value misses the notebook's globals, and a
kernel's source must be found again there), so the check forks: the child is a copy of the
notebook's process, with the learner's function and everything it reads, made *before* the
check draws its inputs or computes a single expected answer. Then, one case at a time, this
process sends the child the inputs (JSON and ``.npz``, no pickle) and the child sends back
what the call did (:func:`.worker.call_to_payload`); references, tolerances and comparisons
never exist in the child, so nothing the learner's code does there (reading the grader's
stack, patching the comparison, recording answers in a global) can reach the grade. The
child's memory is measured as a whole (NumPy, torch and numba alike), a child that runs past
its time is killed, and what the learner's code prints comes back and is printed here.

Measured on a 2-core laptop-class CPU: a fork and its first answer cost 10-40 ms per check
with torch loaded; a fresh interpreter (spawn) costs 3-4 s (importing numpy, torch, numba and
flashedu again). So: fork where the platform has it (Linux), in-process elsewhere.

Where the child cannot run the code, the check runs in this process as before (same
shortcuts off, same memory measure of the whole process): on a platform without fork, and for
the GPU-kernel exercises on a machine with a CUDA GPU (CUDA does not survive a fork; there the
kernel runs on the GPU itself, which refuses what is not a kernel).
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import struct
import sys
import time
import warnings

import numpy as np

from . import worker
from .engine import (HINT_SECONDS, compiled_here, execute_case, grade_cases, learner_hint,
                     make_result, new_seed, one_thread_for_good, preflight, set_seed)
from .result import CheckResult

_HEADER = struct.Struct("<Q")
READY_SECONDS = 20.0  # the child must answer its first message within this time


def dumps(payload) -> bytes:
    """JSON plus ``.npz`` (no pickle) in one message."""
    arrays: dict = {}
    meta = json.dumps(worker.encode(payload, arrays)).encode()
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return _HEADER.pack(len(meta)) + meta + buf.getvalue()


def loads(blob: bytes):
    (n,) = _HEADER.unpack_from(blob)
    meta = json.loads(blob[_HEADER.size:_HEADER.size + n].decode())
    with np.load(io.BytesIO(blob[_HEADER.size + n:]), allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    return worker.decode(meta, arrays)


def _send(fd: int, blob: bytes) -> None:
    data = _HEADER.pack(len(blob)) + blob
    while data:
        data = data[os.write(fd, data):]


def _recv(fd: int, deadline: float | None = None) -> bytes | None:
    """One message, or None at end of file or past the deadline. A pipe hands over 64 KiB a
    read: the message grows in a bytearray (appending to bytes would copy it every time)."""
    out = bytearray()
    need = None
    while need is None or len(out) < need:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return None
        out += chunk
        if need is None and len(out) >= _HEADER.size:
            need = _HEADER.size + _HEADER.unpack_from(out)[0]
    return bytes(out[_HEADER.size:need])


def usable(ex) -> str | None:
    """Why ``ex`` cannot be checked in a forked child here (None: it can)."""
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return "this platform has no safe fork"
    if os.environ.get("FLASHEDU_CHECK_IN_PROCESS") == "1":
        return "FLASHEDU_CHECK_IN_PROCESS=1"
    if compiled_here(ex.name):
        return "GPU kernels run in this process: CUDA does not survive a fork"
    return None


class Child:
    """A forked copy of this process that runs the learner's ``fn`` on request."""

    def __init__(self, ex, fn):
        self.ex, self.pid = ex, None
        from_parent, to_child = os.pipe()  # (read end, write end)
        from_child, to_parent = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():  # "this process is multi-threaded" (a notebook is)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(to_child)
            os.close(from_child)
            _serve(ex, fn, from_parent, to_parent)
        os.close(from_parent)
        os.close(to_parent)
        self.pid, self.to_child, self.from_child = pid, to_child, from_child
        answer = self._ask({"what": "ready"}, READY_SECONDS)
        if not isinstance(answer, dict) or answer.get("ready") is not True:
            self.close()
            raise RuntimeError("the check's child process did not start")

    def _ask(self, payload, seconds):
        try:
            _send(self.to_child, dumps(payload))
        except OSError:
            return None
        blob = _recv(self.from_child, time.monotonic() + seconds)
        if blob is None:
            return None
        try:
            answer = loads(blob)
        except Exception:  # noqa: BLE001 - a reply that is not ours
            return None
        if isinstance(answer, dict) and isinstance(answer.get("stdout"), str) and answer["stdout"]:
            sys.stdout.write(answer["stdout"])  # the learner's prints, shown in the notebook
        return answer

    def execute(self, case):
        from .sandbox import Call, RemoteError

        if self.pid is None:
            return Call(error=RemoteError("Crash", "not run: the process running your code "
                                          "died in an earlier case"))
        start = time.perf_counter()
        cpu = self._cpu() if case.cpu_budget is not None else None
        answer = self._ask(worker.request_payload(self.ex, case), self.ex.timeout + 30)
        if not isinstance(answer, dict):
            alive = self._alive()
            self.close()
            call = Call(timed_out=alive, seconds=time.perf_counter() - start)
            if not alive:  # it died: a crash of the process (a segfault, os._exit, memory)
                call.error = RemoteError("Crash", "the process running your code died "
                                         "during this case (a crash, exit() or running out "
                                         "of memory)")
            return call
        call = worker.payload_to_call(answer)
        if cpu is not None:  # read here, from /proc: the child's own figure could be made up
            call.cpu_seconds = self._cpu() - cpu
        return call

    def _cpu(self) -> float:
        """CPU seconds the child and the processes below it have spent so far."""
        from .memory import cpu_seconds, descendants

        return cpu_seconds([self.pid, *descendants(self.pid)])

    def hint(self, case):
        if self.pid is None:
            return None
        payload = dict(worker.request_payload(self.ex, case), what="hint")
        answer = self._ask(payload, HINT_SECONDS + 10)
        text = answer.get("hint") if isinstance(answer, dict) else None
        return text[:800] if isinstance(text, str) else None

    def _alive(self) -> bool:
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        return pid == 0

    def close(self) -> None:
        if self.pid is None:
            return
        for fd in (self.to_child, self.from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.pid = None


def _serve(ex, fn, rfd: int, wfd: int) -> None:
    """The child's loop: answer requests until the parent closes the pipe, then exit."""
    code = 0
    try:
        out = io.StringIO()
        sys.stdout = sys.stderr = out  # the notebook's streams belong to the parent
        if "torch" in sys.modules:  # (never imported here)
            try:
                sys.modules["torch"].set_num_threads(1)  # OpenMP pools do not survive a fork
            except Exception:  # noqa: BLE001
                pass
        one_thread_for_good()  # this process runs the learner's code alone
        while True:
            blob = _recv(rfd)
            if blob is None:
                break
            ask = loads(blob)
            if ask.get("what") == "ready":
                reply = {"ready": True}
            elif ask.get("what") == "hint":
                reply = {"hint": learner_hint(ex, fn, tuple(ask["args"])) if ex.hint else None}
            else:
                case = worker.case_from_request(ask)
                reply = worker.call_to_payload(execute_case(ex, fn, case))
            reply["stdout"] = out.getvalue()[-10000:]
            out.seek(0)
            out.truncate()
            _send(wfd, dumps(reply))
    except BaseException:  # noqa: BLE001 - the parent sees the pipe close and reports it
        code = 1
        if os.environ.get("FLASHEDU_CHILD_LOG"):  # where to write the child's own failure
            import traceback

            with open(os.environ["FLASHEDU_CHILD_LOG"], "a") as log:
                log.write(traceback.format_exc())
    finally:
        os._exit(code)


def run_exercise(ex, fn, seed: int | None = None) -> CheckResult:
    """The notebook's ``check()``: the learner's calls in a forked child process made before
    any input or expected answer exists, the grading here (see the module's docstring); in
    this process where a child cannot run them."""
    early = preflight(ex, fn)
    if early is not None:
        set_seed(new_seed() if seed is None else seed)
        return make_result(ex, False, early[0], early[1], [])
    runner = None
    if usable(ex) is None:
        try:
            runner = Child(ex, fn)
        except (OSError, RuntimeError):
            runner = None
    set_seed(new_seed() if seed is None else seed)  # after the fork: the child never sees it
    if runner is None:
        return grade_cases(ex, lambda case: execute_case(ex, fn, case),
                           (lambda: ex.gate(fn)) if ex.gate else None,
                           (lambda case: learner_hint(ex, fn, case.args)) if ex.hint else None)
    try:
        return grade_cases(ex, runner.execute, (lambda: ex.gate(fn)) if ex.gate else None,
                           runner.hint if ex.hint else None)
    finally:
        runner.close()
