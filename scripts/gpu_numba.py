"""Launcher of ``flashedu bench numba`` (flashedu/benchmarks/numba_gpu.py), whose sanitize mode
runs its kernel under compute-sanitizer in a child process:

    python scripts/gpu_numba.py all --json bench-out/numba_h100.json   # = flashedu bench numba all ...

``check_case`` runs one correctness case on DEV ("cpu": numba's simulator).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashedu.benchmarks import numba_gpu  # noqa: E402

DEV = "cuda"


def check_case(*args, **kwargs):
    return numba_gpu.check_case(*args, device=DEV, **kwargs)


if __name__ == "__main__":
    sys.exit(numba_gpu.main())
