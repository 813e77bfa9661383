"""Call a learner's function without letting it hang or crash the notebook.

The call runs in a daemon thread. When its time is up, the grader raises :class:`TimeLimit` inside
that thread (and inside any thread it started, such as the numba simulator's one-thread-per-CUDA-
thread workers), which stops any loop that runs Python code. A thread stuck in one long C call
cannot be stopped this way; it is left behind as a daemon and the check still reports the timeout.

Threads rather than a subprocess: the learner's function lives in the notebook's namespace (a
closure, a ``@triton.jit`` or ``@cuda.jit`` object) and cannot be sent to another process.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import traceback
import tracemalloc
from dataclasses import dataclass

import numpy as np


class TimeLimit(BaseException):
    """Raised inside the learner's thread when it runs past its time limit.

    A BaseException so that a learner's ``except Exception`` cannot swallow it."""


@dataclass
class Call:
    value: object = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0
    peak_bytes: int | None = None  # most bytes allocated at once during the call (if measured)

    @property
    def not_implemented(self) -> bool:
        return isinstance(self.error, NotImplementedError)


def call_limited(fn, args=(), kwargs=None, *, timeout: float, measure_memory: bool = False) -> Call:
    """fn(*args, **kwargs) in a worker thread, stopped after ``timeout`` seconds.

    With ``measure_memory``, tracemalloc records the peak of memory allocated during the call
    (NumPy reports its array buffers to tracemalloc), above what was allocated before it.
    """
    call = Call()
    before = set(threading.enumerate())

    def work():
        try:
            # NumPy's overflow / invalid warnings would only repeat, noisily, what the check
            # reports about NaN and inf in the outputs
            with np.errstate(all="ignore"):
                call.value = fn(*args, **(kwargs or {}))
        except BaseException as exc:  # noqa: BLE001 - everything is reported to the learner
            call.error = exc

    tracing = measure_memory and not tracemalloc.is_tracing()
    if tracing:
        tracemalloc.start()
    if measure_memory:
        tracemalloc.reset_peak()
        baseline = tracemalloc.get_traced_memory()[0]
    worker = threading.Thread(target=work, name="flashedu-check", daemon=True)
    start = time.perf_counter()
    worker.start()
    try:
        worker.join(timeout)
    except KeyboardInterrupt:  # the learner pressed stop: stop their code too
        _stop(worker, before)
        raise
    finally:
        call.seconds = time.perf_counter() - start
        if measure_memory:
            call.peak_bytes = max(0, tracemalloc.get_traced_memory()[1] - baseline)
        if tracing:
            tracemalloc.stop()
    if worker.is_alive():
        call.timed_out = True
        _stop(worker, before)
    return call


def _stop(worker: threading.Thread, before: set) -> None:
    """Raise TimeLimit in the worker and in every thread started since the call began."""
    targets = [t for t in threading.enumerate() if t not in before and t.ident is not None]
    for thread in targets:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                   ctypes.py_object(TimeLimit))
    deadline = time.monotonic() + 2.0
    for thread in targets:
        thread.join(max(0.0, deadline - time.monotonic()))


_HERE = os.path.dirname(os.path.abspath(__file__))
# Frames of these files are machinery, not the learner's code: left out of tracebacks.
_HIDDEN = (_HERE, os.sep + "threading.py", os.sep + "numba_cuda" + os.sep,
           os.sep + "numba" + os.sep, os.sep + "triton" + os.sep, os.sep + "concurrent" + os.sep)


def brief_traceback(exc: BaseException, limit: int = 4) -> str:
    """The last ``limit`` frames of the learner's own code, then the error line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not any(part in f.filename for part in _HIDDEN)]
    lines = traceback.format_list(frames[-limit:])
    lines += traceback.format_exception_only(type(exc), exc)
    text = "".join(lines).rstrip()
    return text if len(text) < 2000 else text[:2000] + " ..."
