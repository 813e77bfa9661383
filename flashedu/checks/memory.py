"""Memory and CPU time measured from outside the process that runs the learner's code.

Under ``flashedu check`` the learner's function runs in the notebook's kernel, a process the
notebook controls: a figure it reports about itself could be made up. So the supervisor measures
the kernel's resident memory itself, from ``/proc``: before a case it resets the peak resident
size (VmHWM) of every process below it (``clear_refs`` 5, Linux), after the case it sums those
peaks. The growth covers everything the case allocated (NumPy, torch, numba, a helper process
alike), plus the kernel's own reading of the inputs and writing of the reply. CPU time is summed
the same way (each process's own and its ended children's, from ``/proc/PID/stat``): the work a
case made, which a process can add to but never take away from.
"""

from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _status(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def cpu_seconds(pids: list[int], ended_children_of: int | None = None) -> float:
    """User and system time of ``pids`` and of their children that have ended and been waited
    for (utime, stime, cutime, cstime of /proc/PID/stat), plus those ended children alone of
    ``ended_children_of`` (a process whose own time is not counted)."""
    ticks = 0
    for pid, first in [(p, 11) for p in pids] + \
            ([(ended_children_of, 13)] if ended_children_of is not None else []):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(x) for x in fields[first:15])
        except (OSError, IndexError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


class Watch:
    """The growth of the peak resident memory of the processes below this one across a case,
    and the CPU time they spent in it."""

    def __init__(self, root: int | None = None):
        self.root = os.getpid() if root is None else root
        self.before = None
        pids = descendants(self.root)
        self.cpu_before = cpu_seconds(pids, self.root)
        try:
            for pid in pids:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:  # not Linux, or not allowed: no figure
            return
        self.before = sum(_status(pid, "VmRSS") for pid in pids)

    def growth(self) -> int | None:
        if self.before is None:
            return None
        return max(0, sum(_status(pid, "VmHWM") for pid in descendants(self.root)) - self.before)

    def cpu(self) -> float:
        """CPU seconds spent below this process since the watch began."""
        return max(0.0, cpu_seconds(descendants(self.root), self.root) - self.cpu_before)
