"""Every exercise's solution graded on many input seeds: how often the grader would refuse a
correct answer. Each seed draws fresh inputs for every case (as ``check`` does); the cases run
in this process, without the compile gate (which no seed changes).

    PYTHONPATH=$PWD python docs/bench/experiments/solution_seeds.py SEEDS [EXERCISE ...]

Seeds 1..SEEDS, spread over the CPU's cores (the GPU's exercises share the one GPU). Prints one
line per exercise and writes solution_seeds.json into the folder that the OUT environment
variable names (the current folder without it).
"""

import json
import multiprocessing
import os
import sys
import tempfile
import time

TESTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests")


def grade(job):
    """(exercise, failures among seeds first..last)."""
    name, first, last = job
    sys.path.insert(0, TESTS)
    from test_checks import load

    from flashedu.checks import EXERCISES, engine

    ex = EXERCISES[name]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        fn = load(name, (), tmp)
        for seed in range(first, last + 1):
            engine.set_seed(seed)
            result = engine.grade_cases(ex, lambda case: engine.execute_case(ex, fn, case))
            if not result.passed:
                failures.append({"seed": seed, "message": result.message.splitlines()[:3]})
    return name, last - first + 1, failures


def main():
    seeds = int(sys.argv[1])
    from flashedu import runtime
    from flashedu.checks import EXERCISES

    names = sys.argv[2:] or list(EXERCISES)
    workers = max(1, (os.cpu_count() or 2) - 1)
    # small jobs, seeds in rounds across the exercises: a run stopped early has every
    # exercise's first seeds, and the JSON is rewritten after each job
    chunk = 25
    jobs = [(n, s, min(seeds, s + chunk - 1)) for s in range(1, seeds + 1, chunk) for n in names]
    start = time.perf_counter()
    totals = {n: [0, []] for n in names}
    record = {"device": "interpreter" if runtime.triton_interpreted() else "gpu",
              "seconds": 0.0, "exercises": {}}
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for name, count, failures in pool.imap_unordered(grade, jobs):
            totals[name][0] += count
            totals[name][1] += failures
            record["seconds"] = round(time.perf_counter() - start, 1)
            record["exercises"] = {n: {"seeds": c, "failures": f} for n, (c, f) in totals.items()}
            with open(os.path.join(os.environ.get("OUT", "."), "solution_seeds.json"), "w") as f:
                json.dump(record, f, indent=1)
    for name, (count, failures) in totals.items():
        print(f"{name}: {count - len(failures)}/{count} seeds pass"
              + (f"; first failures {failures[:2]}" if failures else ""), flush=True)


if __name__ == "__main__":
    main()
