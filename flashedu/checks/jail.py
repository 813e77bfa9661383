"""Where a submission's notebook kernel runs when ``flashedu check`` grades a class.

The kernel starts inside bubblewrap (Debian's ``bubblewrap``, the sandbox Flatpak builds on)
under resource limits (util-linux's ``prlimit``). Inside, it has:

- a read-only view of the system (``--ro-bind / /``): it cannot change the course, the grader,
  another submission or any file of the instructor's;
- a fresh, size-capped ``/tmp`` that holds only its own copy of the notebook (its home, working
  folder and ``TMPDIR``) and the folder the grader exchanges cases through; the grader's other
  folders are not in its view, and the class folders and the course's solutions are covered;
- process, IPC and UTS namespaces of its own and a user namespace with no capabilities: it sees
  only its own processes, cannot signal the grader, and every process it starts ends with it
  (bubblewrap's init holds the namespace; ``--die-with-parent``);
- limits on file size, CPU seconds and address space, and no core dumps;
- its stdout and stderr sent nowhere: the grader reads only the kernel's answers.

Without bubblewrap (not Linux, or not installed) :func:`unavailable` says why and the grader
runs kernels with the limits only; the README's instructor section says what that leaves open.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

TMP_SIZE = 1 << 30  # bytes of /tmp a kernel may fill (it lives in memory)
FILE_SIZE = 1 << 30  # the largest file a kernel may write
UID = 1000  # the kernel's user inside its namespace (not root, no capabilities)


@dataclass
class Jail:
    """Everything that shapes one kernel's jail."""

    home: Path  # its copy of the notebook, working folder, HOME and TMPDIR
    exchange: Path  # requests from the grader, replies from the kernel
    hide: list[Path] = field(default_factory=list)  # folders and files it must not see
    cpu_seconds: int = 3600
    memory_bytes: int | None = None  # address space; None: no limit


@functools.cache
def unavailable() -> str | None:
    """Why kernels cannot be jailed here (None: they can). Tried once per process."""
    if not sys.platform.startswith("linux"):
        return "bubblewrap needs Linux"
    for tool, package in (("bwrap", "bubblewrap"), ("prlimit", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt install {package})"
    probe = [*_namespaces(), "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"]
    try:
        run = subprocess.run([shutil.which("bwrap"), *probe], capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap did not start: {exc}"
    if run.returncode != 0:  # e.g. user namespaces switched off by the system
        return f"bubblewrap cannot make namespaces here: {run.stderr.strip()[:200]}"
    return None


def _namespaces() -> list[str]:
    return ["--unshare-all", "--share-net", "--uid", str(UID), "--gid", str(UID),
            "--die-with-parent", "--new-session"]


def limits(jail: Jail) -> list[str]:
    """prlimit's arguments: file size, core dumps, CPU seconds, address space."""
    cmd = [shutil.which("prlimit") or "prlimit", f"--fsize={FILE_SIZE}", "--core=0",
           f"--cpu={int(jail.cpu_seconds)}"]
    if jail.memory_bytes:
        cmd.append(f"--as={int(jail.memory_bytes)}")
    return cmd + ["--"]


def essentials() -> list[Path]:
    """What the kernel needs to start: the interpreter, its libraries and flashedu's source."""
    import flashedu

    found = [Path(sys.prefix), Path(sys.base_prefix), Path(os.path.realpath(sys.executable)).parent,
             Path(flashedu.__file__).resolve().parent.parent]
    found += [Path(p) for p in sys.path if p and Path(p).is_dir()]
    return _outermost(p.resolve() for p in found)


def _outermost(paths) -> list[Path]:
    """The paths, without those inside another one of them."""
    kept: list[Path] = []
    for p in sorted(set(paths), key=lambda p: len(p.parts)):
        if not any(p.is_relative_to(k) for k in kept):
            kept.append(p)
    return kept


def bwrap_args(jail: Jail) -> list[str]:
    """bubblewrap's arguments, in mount order: later mounts cover earlier ones."""
    tmp = Path("/tmp").resolve()
    needed = essentials()
    args = [*_namespaces(), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--size", str(TMP_SIZE), "--tmpfs", str(tmp)]
    visible = [p for p in needed if not p.is_relative_to(tmp)]
    for path in needed:  # what /tmp's fresh mount covered and the kernel needs, read-only
        if path.is_relative_to(tmp):
            args += ["--ro-bind", str(path), str(path)]
            visible.append(path)

    def seen(path: Path) -> bool:
        return not path.is_relative_to(tmp) or any(path.is_relative_to(v) for v in visible)

    for path in map(Path.resolve, jail.hide):
        if not path.exists() or not seen(path):
            continue
        if path.is_dir() and not any(e.is_relative_to(path) for e in needed):
            args += ["--tmpfs", str(path)]  # an empty folder in its place
        elif path.is_file():
            args += ["--ro-bind", "/dev/null", str(path)]
    for own in (jail.home, jail.exchange):
        args += ["--bind", str(own.resolve()), str(own.resolve())]
    home = str(jail.home.resolve())
    return args + ["--chdir", home, "--setenv", "HOME", home,
                   "--setenv", "TMPDIR", str(jail.home.resolve() / "tmp"),
                   "--setenv", "USER", "learner",
                   # ipykernel takes a parent of pid 1 for a dead one; here pid 1 is the jail's
                   # init, and --die-with-parent already ends the kernel with its manager
                   "--unsetenv", "JPY_PARENT_PID", "--"]


def prefix(jail: Jail) -> list[str]:
    """What goes before the kernel's own command."""
    (jail.home / "tmp").mkdir(exist_ok=True)
    if unavailable() is not None:
        return limits(jail) if shutil.which("prlimit") else []
    return [*limits(jail), shutil.which("bwrap"), *bwrap_args(jail)]
