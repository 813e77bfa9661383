"""What runs where.

The course's later kernels are written for a GPU (numba.cuda, Triton). On a laptop without one
they still run: Triton through its interpreter (``TRITON_INTERPRET=1``) and numba.cuda through
its simulator (``NUMBA_ENABLE_CUDASIM=1``). Both switches are read when triton / numba are first
imported, so :func:`configure` must run before that. ``import flashedu`` calls it, and every
kernel module imports triton or numba lazily, after it.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import platform
import subprocess
import sys
import warnings

_CONFIGURED: dict | None = None

INTERPRET_VARS = ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")
# "0" switches FlashAttention-3's Gluon kernels off (flashedu.triton.fa3): read at each call
FA3_SWITCH_ENV = "FLASHEDU_FA3"


def has_cuda() -> bool:
    """True when torch sees a CUDA GPU (never imports triton or numba). A machine without
    NVIDIA's driver has none, and learns it without importing torch (seconds on a laptop)."""
    if not _driver_present():
        return False
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver is a machine without a GPU for our purposes
        return False


def _driver_present() -> bool:
    """Whether NVIDIA's driver library loads here (no GPU is touched: the driver is not
    initialised, so a later fork stays free to use CUDA)."""
    import ctypes

    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def configure() -> dict:
    """Decide once per process whether kernels run on the GPU or are emulated on the CPU.

    Without a GPU, sets TRITON_INTERPRET=1 and NUMBA_ENABLE_CUDASIM=1 (unless the user set them),
    and warns if triton or numba were imported before we could set them.
    """
    global _CONFIGURED
    if _CONFIGURED is not None:
        return _CONFIGURED
    gpu = has_cuda()
    if not gpu:
        for var in INTERPRET_VARS:
            os.environ.setdefault(var, "1")
        late = [m for m in ("triton", "numba") if m in sys.modules]
        if late:
            warnings.warn(
                f"{', '.join(late)} was imported before flashedu; its CPU emulation may be off. "
                "Import flashedu first (or set TRITON_INTERPRET=1 / NUMBA_ENABLE_CUDASIM=1).",
                RuntimeWarning,
                stacklevel=3,
            )
    _CONFIGURED = {
        "gpu": gpu,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "numba_cudasim": os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
    }
    return _CONFIGURED


def triton_interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return configure()["triton_interpret"]


def numba_simulated() -> bool:
    """True when numba.cuda kernels run in the CPU simulator."""
    return configure()["numba_cudasim"]


def kernel_device():
    """The torch device that Triton / numba kernels take their tensors on."""
    import torch

    return torch.device("cuda") if configure()["gpu"] and not triton_interpreted() else torch.device("cpu")


def git_commit(short: bool = True) -> str:
    """The commit a benchmark record names: ``$GIT_COMMIT`` when set (a copy of the tree without
    .git, as on the GPU machine, cannot say), else ``git rev-parse`` of this project's checkout,
    else "unknown". Never git's own output of a failed call, and never the commit of another
    repository that happens to enclose a copy of the project (git's toplevel must be the project
    root, the folder above this package)."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    package = pathlib.Path(__file__).resolve().parent
    cmd = ["git", "rev-parse", "--show-toplevel", *(["--short"] if short else []), "HEAD"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=package)
    except OSError:
        return "unknown"
    lines = proc.stdout.split()
    if proc.returncode != 0 or len(lines) != 2:
        return "unknown"
    toplevel, commit = lines
    if pathlib.Path(toplevel).resolve() != package.parent:
        return "unknown"  # an enclosing repository, not this project's
    return commit


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def auto_backend() -> str:
    """The backend ``backend="auto"`` picks: triton on a CUDA GPU, numpy on the CPU."""
    return "triton" if configure()["gpu"] else "numpy"


def where(backend: str) -> str:
    """What a backend's kernels run on, on this machine."""
    gpu = configure()["gpu"]
    if backend == "triton":
        return "CUDA GPU (compiled)" if gpu else "CPU, Triton interpreter (TRITON_INTERPRET=1)"
    if backend == "numba":
        return ("CUDA GPU (compiled)" if gpu
                else "CPU, numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    if backend == "naive":
        return "the input's device (torch ops)"
    return "CPU (NumPy)"


# Sections that modules above this one add to doctor() (flashedu.backends adds its table):
# this module imports none of them, so the layers stay one-way (backends -> runtime).
_REPORTS: list = []


def add_report(section) -> None:
    """Add ``section() -> list[str]`` to the end of :func:`doctor`'s report."""
    if section not in _REPORTS:
        _REPORTS.append(section)


def doctor(version: str) -> str:
    """A report of versions (``version``: flashedu's own), the device, and what each backend
    will run on."""
    import torch

    cfg = configure()
    lines = [
        f"flashedu {version}",
        f"python     {platform.python_version()} ({sys.executable})",
    ]
    for dist in ("numpy", "torch", "triton", "numba", "numba-cuda", "ipywidgets", "jupyterlab"):
        lines.append(f"{dist:<11}{_version(dist)}")
    if cfg["gpu"]:
        props = torch.cuda.get_device_properties(0)
        lines.append(
            f"device     {props.name}: {props.multi_processor_count} SMs, "
            f"{props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor}"
        )
    else:
        lines.append("device     no CUDA GPU: kernels are emulated on the CPU")
    lines.append(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!s:<3} "
                 f"NUMBA_ENABLE_CUDASIM={os.environ.get('NUMBA_ENABLE_CUDASIM', '')}")
    for section in _REPORTS:
        lines.extend(section())
    return "\n".join(lines)
