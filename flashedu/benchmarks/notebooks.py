"""Execute course notebooks top to bottom, time each one, and keep the executed copies.

    flashedu bench notebooks --json nb_times.json --executed executed.tar.gz
    flashedu bench notebooks notebooks/06_triton_forward.ipynb   # a subset

Runs each notebook in its own kernel from the notebooks/ folder (as JupyterLab does), records
seconds, status and the first error per notebook, and prints a table. On a GPU machine this is
how the course's "runs on the GPU" record is made (see BENCHMARKS.md); on a CPU, CI runs the
same notebooks through nbval instead.
"""

from __future__ import annotations

import io
import pathlib
import sys
import tarfile
import time

from . import core

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the checkout: its notebooks/ by default


def run_one(path: pathlib.Path, timeout: int):
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    error = None
    try:
        client.execute()
    except Exception as exc:  # noqa: BLE001 - a failing notebook is a result, not a crash
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
    return nb, time.perf_counter() - start, error


def parse_args(argv):
    p = core.parser("notebooks", __doc__)
    p.add_argument("notebooks", nargs="*", type=pathlib.Path,
                   help="notebooks to run (default: every notebooks/*.ipynb)")
    p.add_argument("--timeout", type=core.positive_int, default=600, help="seconds per cell")
    p.add_argument("--json", type=core.output_file, help="write the record here")
    p.add_argument("--executed", type=core.output_file,
                   help="write the executed notebooks into this .tar.gz")
    args = p.parse_args(argv)
    args.paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    missing = [str(x) for x in args.paths if not x.is_file()]
    if missing:
        p.error(f"no such notebook: {', '.join(missing)}")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    paths = args.paths
    import nbformat

    env = core.environment(["notebooks", *argv])
    print(core.headline(env))
    rows, executed = [], {}
    for path in paths:
        nb, seconds, error = run_one(path.resolve(), args.timeout)
        rows.append({"notebook": path.name, "seconds": round(seconds, 1), "ok": error is None,
                     "error": error})
        executed[path.name] = nbformat.writes(nb)
        print(f"{path.name:45s} {seconds:7.1f} s  {'ok' if error is None else error}", flush=True)
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} ran top to bottom, "
          f"{sum(r['seconds'] for r in rows):.0f} s in all")
    if args.json:
        core.write_json(args.json, {"environment": env, "notebooks": rows})
    if args.executed:
        with tarfile.open(args.executed, "w:gz") as tar:
            for name, text in executed.items():
                data = text.encode()
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return 0 if all(r["ok"] for r in rows) else 1

