"""The grader's own run of a learner's kernel, for ``flashedu check``.

A notebook's kernel process is the learner's: anything in it (the worker, the launcher, the
watchers that count out-of-bounds loads) can be patched by a cell. So for the kernel exercises
only the kernel's description crosses from it to the grader, as plain data (the same one the
compile gate reads, :mod:`.gate`): the source of the ``@triton.jit`` / ``@cuda.jit`` functions and
the constants they read. A fresh process of the grader's, in a jail of its own, checks that
description as the gate does (kernel-language functions and constants, nothing else), writes the
module itself, and answers the grader's cases with flashedu's own launcher and watchers
(:func:`.worker.serve`). What the learner's kernel computed is what is graded, and nothing else
the notebook's process does reaches the grade.

The process reads one JSON line (the description), says ``RUNNER-READY:`` or
``RUNNER-REFUSED:{...}``, then takes request names, one per line, answering each in the exchange
folder (:mod:`.worker`) and saying ``RUNNER-DONE:<name>``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from . import gate, worker

_SERVE = r'''
def serve_forever():
    global job
    job = JOBS[0]
    import flashedu  # Triton's interpreter and numba's simulator where there is no GPU
    try:
        source, _ = module()
        kernel = load(source)
    except (Refused, SyntaxError, ValueError, KeyError) as exc:
        print("RUNNER-REFUSED:" + json.dumps({"kind": "description", "text": str(exc)}), flush=True)
        return
    except Exception as exc:
        print("RUNNER-REFUSED:" + json.dumps({"kind": "import", "text": short(exc)}), flush=True)
        return
    from flashedu.checks import worker
    namespace = {job["symbol"]: kernel}
    print("RUNNER-READY:", flush=True)
    for line in sys.stdin:
        request = line.strip()
        worker.serve(namespace, job["folder"], request)
        print("RUNNER-DONE:" + request, flush=True)


serve_forever()
'''
START_SECONDS = 180.0  # a fresh process imports torch and Triton, then writes the module


class Runner:
    """One kernel, rebuilt from its description in a process of the grader's. Use as a
    context manager; :meth:`ask` answers one request like the notebook's worker does."""

    def __init__(self, ex, spec: dict, folder: Path, jail=None):
        self.folder, self.kind = folder, spec["kind"]
        self.lines: queue.Queue = queue.Queue()
        self.counter = 0
        job = {"index": 0, "kind": spec["kind"], "name": spec.get("name"),
               "functions": spec["functions"], "globals": spec["globals"],
               "symbol": ex.symbol, "folder": str(folder),
               "path": str(folder / "learner_kernel.py")}
        before = []
        if jail is not None:
            from .jail import prefix

            before = prefix(jail)
        self.log = open(folder / "runner.log", "wb")
        self.proc = subprocess.Popen(
            [*before, sys.executable, "-P", "-c", gate._DESCRIBE + _SERVE],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            cwd=folder, env=_environment())
        threading.Thread(target=self._read, daemon=True).start()
        self.proc.stdin.write(json.dumps([job]) + "\n")
        self.proc.stdin.flush()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # the process ended

    def _next(self, timeout: float) -> str | None:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def start(self) -> str | None:
        """None once the kernel is loaded, else why it could not be (the gate's words)."""
        while True:
            line = self._next(START_SECONDS)
            if line is None:
                self.close()
                tail = _tail(self.folder / "runner.log")
                return ("the grader could not load your kernel in its own process (no answer"
                        f"{': ' + tail if tail else ''}).")
            tag, _, payload = line.partition(":")
            if tag == "RUNNER-READY":
                return None
            if tag == "RUNNER-REFUSED":
                self.close()
                try:
                    said = json.loads(payload)
                except ValueError:
                    said = None
                if not isinstance(said, dict):
                    said = {"kind": "import", "text": payload[:500]}
                return gate._refusal_text(self.kind, said, "the grader's process")

    def ask(self, payload, timeout: float):
        """The reply to one request, or None (no answer in ``timeout`` seconds: the process is
        stopped, so every later request gets None too)."""
        if self.proc.poll() is not None:
            return None
        request = f"k{self.counter}"
        self.counter += 1
        worker.write(self.folder / request, payload)
        try:
            self.proc.stdin.write(request + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        while True:
            line = self._next(timeout)
            if line is None:
                self.close()
                return None
            if line == "RUNNER-DONE:" + request:
                break
        try:
            return worker.read(self.folder / (request + "-reply"))
        except Exception:  # noqa: BLE001 - no reply (the learner's kernel raised inside serve)
            return None

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _environment() -> dict:
    """The grader's environment without what would run code or swap a kernel at import."""
    drop = ("PYTHONSTARTUP", "PYTHONINSPECT", "TRITON_KERNEL_OVERRIDE", "TRITON_OVERRIDE_DIR")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""
