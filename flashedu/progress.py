"""The learner's record: which steps pass, which predictions were right, which exercises pass.

One small JSON file per learner, in the user's data directory (``$XDG_DATA_HOME/flashedu`` or
``~/.local/share/flashedu``; ``FLASHEDU_PROGRESS`` names another file). Every check writes its
latest verdict there; ``flashedu progress`` (:mod:`flashedu.course.report`) prints it as a table
by notebook, with what to do next. This module is only the store: the grader writes to it
without knowing the course.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path


def progress_file() -> Path:
    explicit = os.environ.get("FLASHEDU_PROGRESS")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "flashedu" / "progress.json"


def load() -> dict:
    """{"steps": {id: entry}, "predictions": {id: entry}, "exercises": {name: entry}}."""
    record = {"steps": {}, "predictions": {}, "exercises": {}}
    path = progress_file()
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return record
    for key in record:
        if isinstance(stored.get(key), dict):
            record[key] = stored[key]
    return record


def record(section: str, key: str, **entry) -> None:
    """Keep the latest verdict of ``key``; a file that cannot be written never stops a check."""
    data = load()
    data[section][key] = {**entry, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = progress_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".progress.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except OSError:
        pass
