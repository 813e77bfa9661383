"""The learner's half of ``flashedu check``: runs inside the learner's notebook kernel.

The grader (:mod:`.grade`, another process) writes one request at a time into a folder only it
created: the exercise, the case's inputs and how to call the learner's object. A cell it adds to
the notebook loads this file under a fresh module name and calls :func:`serve`, which calls the
learner's object on those inputs (:func:`.engine.execute_case`) and writes back what happened:
the outputs, an error, the time, the memory, what the watchers saw. References, tolerances and
comparisons never enter the kernel, so nothing the learner's code does there can change a
grade except its own outputs.

Both directions use JSON plus NumPy's ``.npz`` without pickle (``allow_pickle=False``): reading
a reply cannot run code. Anything that is not an array, a number, a string, a list, a tuple or
a dict travels as its type name only (:class:`Opaque`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


class Opaque:
    """Stands in for an object that cannot travel (its type's name is kept for the message)."""

    length: int | None = None


def encode(value, arrays: dict):
    """A JSON-able form of ``value``; arrays go into ``arrays`` (name -> ndarray)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        key = f"a{len(arrays)}"
        arrays[key] = np.array(value, copy=True, subok=False)
        return {"nd": key}
    if isinstance(value, np.generic):
        return {"np": value.dtype.str, "v": value.item()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"f": repr(value)}
    if isinstance(value, (tuple, list)):
        return {"seq": type(value).__name__ if type(value) in (tuple, list) else "tuple",
                "items": [encode(v, arrays) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k, arrays), encode(v, arrays)] for k, v in value.items()]}
    length = None
    try:
        length = len(value)
    except Exception:  # noqa: BLE001 - the learner's object may raise anything here
        pass
    return {"opaque": type(value).__name__[:80], "len": length}


def decode(value, arrays):
    if isinstance(value, dict):
        if "nd" in value:
            return arrays[value["nd"]]
        if "np" in value:
            return np.dtype(value["np"]).type(value["v"])
        if "f" in value:
            return float(value["f"])
        if "seq" in value:
            items = [decode(v, arrays) for v in value["items"]]
            return tuple(items) if value["seq"] == "tuple" else items
        if "dict" in value:
            return {decode(k, arrays): decode(v, arrays) for k, v in value["dict"]}
        if "opaque" in value:
            name = str(value["opaque"]) if str(value["opaque"]).isidentifier() else "object"
            obj = type(name, (Opaque,), {})()
            obj.length = value.get("len")
            return obj
    return value


def write(path: Path, payload) -> None:
    """``path.npz`` then ``path.json`` (the reader waits for the second), each written to a new
    file and renamed into place: a link planted in the folder is replaced, never followed."""
    arrays: dict = {}
    meta = encode(payload, arrays)
    with _new_file(path.with_suffix(".tmp.npz")) as out:
        np.savez(out, **arrays)
    path.with_suffix(".tmp.npz").replace(path.with_suffix(".npz"))
    with _new_file(path.with_suffix(".tmp.json")) as out:
        out.write(json.dumps(meta).encode())
    path.with_suffix(".tmp.json").replace(path.with_suffix(".json"))


def read(path: Path):
    with _existing_file(path.with_suffix(".json")) as f:
        meta = json.loads(f.read().decode())
    with _existing_file(path.with_suffix(".npz")) as f, np.load(f, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    return decode(meta, arrays)


def _new_file(path: Path):
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb")


def _existing_file(path: Path):
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")


def call_to_payload(call) -> dict:
    """What the grader needs of a :class:`~.sandbox.Call`, in plain data."""
    from flashedu.checks.sandbox import RemoteError, Shortcut, error_text

    error = None
    if call.error is not None:
        kind = type(call.error).__name__
        if isinstance(call.error, Shortcut):
            kind = "Shortcut"
        error = {"kind": kind, "text": error_text(call.error)}
        if isinstance(call.error, RemoteError):
            error["kind"] = call.error.kind
    buffers = None
    if call.buffers is not None:
        buffers = {side: [list(entry) for entry in entries] for side, entries in call.buffers.items()}
    return {"value": call.value if error is None and not call.timed_out else None,
            "error": error, "timed_out": bool(call.timed_out), "seconds": float(call.seconds),
            "peak_bytes": call.peak_bytes, "rss_bytes": call.rss_bytes,
            "inputs_after": call.inputs_after, "evidence": call.evidence,
            "reads": call.reads, "buffers": buffers, "finding": call.finding}


def payload_to_call(payload: dict):
    from flashedu.checks.sandbox import Call, RemoteError

    call = Call()
    call.value = payload.get("value")
    error = payload.get("error")
    if error is not None:
        call.error = RemoteError(str(error.get("kind", "Error")), str(error.get("text", "")))
    call.timed_out = bool(payload.get("timed_out"))
    call.seconds = float(payload.get("seconds") or 0.0)
    call.peak_bytes = payload.get("peak_bytes")
    call.rss_bytes = payload.get("rss_bytes")
    call.inputs_after = payload.get("inputs_after")
    call.evidence = payload.get("evidence") or {}
    call.reads = payload.get("reads")
    finding = payload.get("finding")
    call.finding = str(finding) if finding is not None else None
    buffers = payload.get("buffers")
    if buffers is not None:
        call.buffers = {side: [tuple(entry) for entry in entries] for side, entries in buffers.items()}
    return call


def serve(namespace: dict, folder: str, request: str) -> None:
    """Answer one request of the grader (called from the cell the grader adds)."""
    from flashedu.checks import EXERCISES
    from flashedu.checks.engine import (execute_case, one_thread_for_good, others_idle,
                                        preflight)

    folder = Path(folder)
    ask = read(folder / request)
    ex = EXERCISES[ask["exercise"]]
    fn = namespace.get(ex.symbol)
    if ask["what"] == "gate":  # the kernel's source; the grader compiles it
        spec = ex.gate.source(fn) if ex.gate is not None and hasattr(ex.gate, "source") else None
        write(folder / (request + "-reply"), {"gate": spec})
        return
    if ask["what"] == "preflight":
        answer = preflight(ex, fn)
        write(folder / (request + "-reply"), {"preflight": list(answer) if answer else None})
        return
    if ask["what"] == "hint":
        from flashedu.checks.engine import learner_hint

        text = learner_hint(ex, fn, tuple(ask["args"])) if ex.hint else None
        write(folder / (request + "-reply"), {"hint": text})
        return
    if ask["what"] == "settle":  # before a timed case: see grade._grade_cases
        one_thread_for_good()
        others_idle()
        write(folder / (request + "-reply"), {"settled": True})
        return
    call = execute_case(ex, fn, case_from_request(ask))
    write(folder / (request + "-reply"), call_to_payload(call))


def request_payload(ex, case) -> dict:
    """What the learner's side needs of a case: its inputs and how to call, nothing else."""
    return {"what": "case", "exercise": ex.name, "label": case.label,
            "args": tuple(np.asarray(a).view(np.ndarray) if isinstance(a, np.ndarray) else a
                          for a in case.args),
            "kwargs": dict(case.kwargs), "prepare": list(case.prepare) if case.prepare else None,
            "memory_budget": case.memory_budget, "timed": case.cpu_budget is not None}


def case_from_request(ask: dict):
    """The case as the learner's side sees it: inputs and how to call, no expected answer."""
    from flashedu.checks.engine import Case

    return Case(label=ask["label"], hint="", args=tuple(ask["args"]), outputs=(), expected=(),
                kwargs=ask["kwargs"], prepare=tuple(ask["prepare"]) if ask["prepare"] else None,
                memory_budget=ask["memory_budget"],
                cpu_budget=_judged_by_the_grader if ask.get("timed") else None)


def _judged_by_the_grader():
    raise RuntimeError("a case's CPU budget is computed and judged on the grader's side")
