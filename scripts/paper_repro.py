"""Launcher of ``flashedu bench paper`` (flashedu/benchmarks/paper.py), which Nsight Compute
runs again as a child per measured case:

    PYTHONPATH=$PWD python3 scripts/paper_repro.py --out DIR   # = flashedu bench paper --out DIR

Loading this file gives the module's names (notebook 09 reads its model from them).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashedu.benchmarks.paper import *  # noqa: E402,F401,F403
from flashedu.benchmarks.paper import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
