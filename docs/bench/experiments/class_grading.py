"""How long ``flashedu check`` takes to grade a class: STUDENTS copies of every exercise
notebook's solution, graded as an instructor would (a fresh supervisor and jail per notebook).

    PYTHONPATH=$PWD python docs/bench/experiments/class_grading.py [STUDENTS] [--jobs N]

Prints the wall time, the CPU time of the whole machine over the run (every supervisor, kernel,
runner and compiler process; read from /proc/stat, so run it on an otherwise idle machine) and
the points per notebook, and writes class_grading.json into the folder that the OUT
environment variable names (the current folder without it).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def machine_cpu_seconds() -> float:
    """CPU seconds spent by the whole machine since boot (user, nice, system)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return sum(int(x) for x in fields[1:4]) / os.sysconf("SC_CLK_TCK")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("students", type=int, nargs="?", default=5)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    notebooks = sorted((ROOT / "solutions").glob("0*.ipynb"))
    with tempfile.TemporaryDirectory(prefix="flashedu-class-") as folder:
        paths = []
        for student in range(1, args.students + 1):
            (Path(folder) / f"student{student}").mkdir()
            for nb in notebooks:
                paths.append(Path(shutil.copy(nb, Path(folder) / f"student{student}")))
        grades = Path(folder) / "grades.json"
        cpu, start = machine_cpu_seconds(), time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "flashedu.cli", "check", *map(str, paths),
                              "--jobs", str(args.jobs), "--json", str(grades)],
                             capture_output=True, text=True, check=False)
        wall, cpu = time.perf_counter() - start, machine_cpu_seconds() - cpu
        rows = json.loads(grades.read_text()) if grades.exists() else []
    points = sum(r["points"] for r in rows)
    most = sum(r["max_points"] for r in rows)
    record = {"students": args.students, "notebooks": len(paths), "jobs": args.jobs,
              "cores": os.cpu_count(), "exit_status": run.returncode,
              "wall_seconds": round(wall, 1), "machine_cpu_seconds": round(cpu, 1),
              "points": points, "max_points": most}
    print(f"| students | notebooks | jobs | cores | wall s | CPU s | points |\n|---|---|---|---|---|---|---|\n"
          f"| {args.students} | {len(paths)} | {args.jobs} | {os.cpu_count()} | {wall:.0f} | "
          f"{cpu:.0f} | {points}/{most} |")
    if run.returncode:
        print(run.stderr[-2000:], file=sys.stderr)
    with open(os.path.join(os.environ.get("OUT", "."), "class_grading.json"), "w") as f:
        json.dump(record, f, indent=1)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
