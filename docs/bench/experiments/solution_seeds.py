"""Every exercise's solution graded on many input seeds: how often the grader would refuse a
correct answer. Each seed draws fresh inputs for every case (as ``check`` does); the cases run
in this process, without the compile gate (which no seed changes).

    PYTHONPATH=$PWD python docs/bench/experiments/solution_seeds.py LAST [EXERCISE ...] [--first N]

Seeds FIRST..LAST (FIRST 1 unless given), spread over the CPU's cores (the GPU's exercises share
the one GPU), each worker with one BLAS thread (a worker per core already fills the CPU: more
threads only contend). Prints one line per exercise and writes solution_seeds.json into the
folder that the OUT environment variable names (the current folder without it).
"""

import argparse
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("last", type=int)
    parser.add_argument("exercises", nargs="*")
    parser.add_argument("--first", type=int, default=1)
    args = parser.parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"  # before any worker imports NumPy
    from flashedu import runtime
    from flashedu.checks import EXERCISES

    names = args.exercises or list(EXERCISES)
    workers = max(1, (os.cpu_count() or 2) - 1)
    # small jobs, seeds in rounds across the exercises: a run stopped early has every
    # exercise's first seeds, and the JSON is rewritten after each job
    chunk = 10
    jobs = [(n, s, min(args.last, s + chunk - 1))
            for s in range(args.first, args.last + 1, chunk) for n in names]
    start = time.perf_counter()
    totals = {n: [0, []] for n in names}
    record = {"device": "interpreter" if runtime.triton_interpreted() else "gpu",
              "first_seed": args.first, "last_seed": args.last, "seconds": 0.0, "exercises": {}}
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
