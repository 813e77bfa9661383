"""Launcher of ``flashedu bench gpt`` (flashedu/benchmarks/gpt.py), kept for notebook 11, which
imports ``gpu_gpt.main`` from here:

    PYTHONPATH=$PWD python3 scripts/gpu_gpt.py --out docs/bench/gpt_h100.json   # = flashedu bench gpt ...
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashedu.benchmarks.gpt import main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
