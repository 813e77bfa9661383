"""Call a learner's function without letting it hang or crash the notebook.

The call runs in a daemon thread. When its time is up, the grader raises :class:`TimeLimit` inside
that thread (and inside any thread it started, such as the numba simulator's one-thread-per-CUDA-
thread workers), which stops any loop that runs Python code. A thread stuck in one long C call
cannot be stopped this way; it is left behind as a daemon and the check still reports the timeout.

This runs where the learner's code runs: in the child process of the notebook's ``check()``
(:mod:`.child`) or in the learner's kernel under ``flashedu check`` (:mod:`.grade`); the
trusted half of grading is in another process in both cases.

During the call, the answers themselves are out of reach (:func:`shortcuts_blocked`):
flashedu's references and kernels, ``flashedu.attention``, torch's softmax and
scaled_dot_product_attention and SciPy's softmax raise :class:`Shortcut`; a learner's function
that holds one of them by name is refused before it runs (:func:`forbidden_uses`).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types
import warnings
import os
import threading
import time
import traceback
import tracemalloc
from dataclasses import dataclass, field

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
    cpu_seconds: float | None = None  # CPU time of the call, where a case measures it
    peak_bytes: int | None = None  # most bytes allocated at once during the call (if measured)
    rss_bytes: int | None = None  # growth of the process's peak resident memory (if measured)
    inputs_after: list | None = None  # the array arguments after the call (mutation check)
    evidence: dict = field(default_factory=dict)  # what the case's watchers saw
    reads: dict | None = None  # numba: global reads of K and V (simulator only)
    buffers: dict | None = None  # kernels: padded input and output buffers after the launch
    # what the grader saw go wrong while the code ran (a race on shared memory), reported
    # before the values: wrong values are only its symptom
    finding: str | None = None



class RemoteError(Exception):
    """An error raised by the learner's code in another process: its kind and its traceback."""

    def __init__(self, kind: str, text: str):
        super().__init__(text)
        self.kind, self.text = kind, text


class Shortcut(RuntimeError):
    """Raised when the learner's code calls the answer (a reference) during a check."""


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
        rss_before = _reset_peak_rss()
    worker = threading.Thread(target=work, name="flashedu-check", daemon=True)
    start = time.perf_counter()
    quiet = warnings.catch_warnings()  # the simulator's threads do not see errstate above
    quiet.__enter__()
    warnings.simplefilter("ignore", RuntimeWarning)
    worker.start()
    try:
        worker.join(timeout)
    except KeyboardInterrupt:  # the learner pressed stop: stop their code too
        _stop(worker, before)
        raise
    finally:
        quiet.__exit__(None, None, None)
        call.seconds = time.perf_counter() - start
        if measure_memory:
            call.peak_bytes = max(0, tracemalloc.get_traced_memory()[1] - baseline)
            rss_after = _peak_rss()
            if rss_before is not None and rss_after is not None:
                call.rss_bytes = max(0, rss_after - rss_before)
        if tracing:
            tracemalloc.stop()
    if worker.is_alive():
        call.timed_out = True
        _stop(worker, before)
    return call


def _peak_rss() -> int | None:
    """The process's peak resident memory (VmHWM) in bytes, or None where /proc lacks it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> int | None:
    """Reset VmHWM to the current resident size (Linux: clear_refs 5) and return it. Peak
    resident memory sees every allocation of the process (NumPy, torch, numba alike), which
    tracemalloc does not; None where it cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _peak_rss()


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


def error_text(exc: BaseException) -> str:
    if isinstance(exc, RemoteError):
        return exc.text
    return brief_traceback(exc)


def brief_traceback(exc: BaseException, limit: int = 4) -> str:
    """The last ``limit`` frames of the learner's own code, then the error line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not any(part in f.filename for part in _HIDDEN)]
    lines = traceback.format_list(frames[-limit:])
    lines += traceback.format_exception_only(type(exc), exc)
    text = "".join(lines).rstrip()
    return text if len(text) < 2000 else text[:2000] + " ..."


# ------------------------------------------------------------------------------------------
# The answers are out of reach during a check
# ------------------------------------------------------------------------------------------

# module -> attribute names that compute (part of) an exercise's answer
SHORTCUTS = {
    "flashedu": ("attention",),
    "flashedu.api": ("attention",),
    "flashedu.reference": ("naive_attention", "naive_attention_backward", "safe_softmax",
                           "online_softmax", "naive_attention_torch"),
    "flashedu.tiled": ("flash_forward", "flash_backward", "block_sparse_forward"),
    "torch": ("softmax", "log_softmax"),
    "torch.nn.functional": ("softmax", "log_softmax", "scaled_dot_product_attention"),
    "torch.special": ("softmax", "log_softmax"),
    "scipy.special": ("softmax", "log_softmax", "logsumexp"),
}
_SHORTCUT_PACKAGES = ("flashedu.numba_kernels", "flashedu.triton", "flashedu.tiled",
                      "flashedu.reference")


def _shortcut_objects() -> dict[int, str]:
    """id(object) -> its name, for every shortcut that is loaded now (nothing is imported)."""
    found = {}
    for module_name, names in SHORTCUTS.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in names:
            obj = vars(module).get(name)  # not getattr: a lazy name would be imported
            if obj is not None:
                found[id(obj)] = f"{module_name}.{name}"
    for module_name, module in list(sys.modules.items()):
        if module is not None and module_name.startswith(_SHORTCUT_PACKAGES):
            found[id(module)] = module_name
            for name, obj in vars(module).items():
                if callable(obj) and getattr(obj, "__module__", "") == module_name:
                    found[id(obj)] = f"{module_name}.{name}"
    return found


def forbidden_uses(fn) -> str | None:
    """A message when ``fn`` (or a function it reaches through its globals, closure or
    defaults) names one of the answers, else None."""
    shortcuts = _shortcut_objects()
    seen, todo = set(), [fn]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        inner = getattr(obj, "py_func", None) or getattr(obj, "fn", None) or obj
        code = getattr(inner, "__code__", None)
        if code is None:
            continue
        env = getattr(inner, "__globals__", {})
        values = [env.get(name) for name in _names(code)]
        values += [c.cell_contents for c in (getattr(inner, "__closure__", None) or ())
                   if _filled(c)]
        values += list(getattr(inner, "__defaults__", None) or ())
        values += list((getattr(inner, "__kwdefaults__", None) or {}).values())
        for value in values:
            if id(value) in shortcuts and value is not fn:
                return (f"your code uses {shortcuts[id(value)]}, which computes the answer "
                        "itself. Write the computation with NumPy (or the kernel language) "
                        "operations: that is the exercise.")
            if isinstance(value, types.FunctionType) or hasattr(value, "py_func") \
                    or hasattr(value, "fn"):
                todo.append(value)
    return None


def _names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def shortcuts_blocked(active: bool = True):
    """While active, every loaded shortcut (see SHORTCUTS) raises Shortcut when called."""
    if not active:
        yield
        return
    saved = []
    for module_name, names in SHORTCUTS.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        loaded = vars(module)
        for name in names:
            if name in loaded:
                saved.append((module, name, loaded[name]))
            elif name in getattr(module, "__all__", ()):  # a name the module imports on first
                saved.append((module, name, _LAZY))  # use (flashedu.attention): refused as is
            else:
                continue
            setattr(module, name, _refuse(f"{module_name}.{name}"))
    tensor = sys.modules.get("torch")
    tensor = getattr(tensor, "Tensor", None)
    if tensor is not None:
        for name in ("softmax", "log_softmax"):
            saved.append((tensor, name, getattr(tensor, name)))
            setattr(tensor, name, _refuse(f"torch.Tensor.{name}"))
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is _LAZY:
                delattr(owner, name)  # its first use imports it again
            else:
                setattr(owner, name, value)


_LAZY = object()  # a module's name that was not loaded when the check began


def _refuse(name):
    def refused(*args, **kwargs):
        raise Shortcut(f"{name} computes the answer itself and is off during a check: write "
                       "the computation yourself (that is the exercise).")
    refused.__name__ = name.rsplit(".", 1)[-1]
    return refused
