"""The GPU-kernel exercises' solutions graded with many input seeds, and the compiled numba
kernel's loads from shared memory: how often a correct kernel fails on this machine, and what
the shared-memory probe sees in the solution and in a kernel that reads K, V from global memory.

    PYTHONPATH=$PWD python docs/bench/experiments/grader_seeds.py [SEEDS]
"""

import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))

from test_checks import DKDV, DQ, NUMBA_BANK, load  # noqa: E402

from flashedu import runtime  # noqa: E402
from flashedu.checks import check  # noqa: E402
from flashedu.checks.numba_forward import shared_loads  # noqa: E402

seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
record = {"device": "interpreter" if runtime.triton_interpreted() else "gpu", "exercises": {}}
with tempfile.TemporaryDirectory() as tmp:
    for name in ("numba_forward_kernel", "triton_forward_kernel", DKDV, DQ):
        fn = load(name, (), tmp)
        failures = []
        for seed in seeds:
            result = check(name, fn, seed=seed)
            if not result.passed:
                found = re.search(r"max error ([\d.e+-]+) \(allowed ([\d.e+-]+)\)", result.message)
                failures.append({"seed": seed, "first_line": result.message.splitlines()[0],
                                 "ratio": float(found[1]) / float(found[2]) if found else None})
        record["exercises"][name] = {"seeds": len(seeds), "failures": failures}
        print(f"{name}: {len(seeds) - len(failures)}/{len(seeds)} seeds pass; "
              f"{[(f['seed'], f['ratio']) for f in failures]}", flush=True)
    if not runtime.numba_simulated():
        mistake = next(b for b in NUMBA_BANK if b[0].startswith("no shared memory"))
        kernels = {"solution": load("numba_forward_kernel", (), tmp),
                   "no shared memory": load("numba_forward_kernel", mistake[1], tmp)}
        passed = {k: check("numba_forward_kernel", fn, seed=0).passed  # compiles each kernel
                  for k, fn in kernels.items()}
        record["ld_shared"] = {k: {"ld.shared": shared_loads(fn), "passed": passed[k]}
                               for k, fn in kernels.items()}
        print("ld.shared in the compiled PTX:", record["ld_shared"])
out = os.environ.get("OUT", ".")
with open(os.path.join(out, "grader_seeds.json"), "w") as f:
    json.dump(record, f, indent=1)
