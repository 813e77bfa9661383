"""Execute course notebooks top to bottom, time each one, and keep the executed copies.

    python scripts/run_notebooks.py --json nb_times.json --executed executed.tar.gz
    python scripts/run_notebooks.py notebooks/06_triton_forward.ipynb   # a subset

Runs each notebook in its own kernel from the notebooks/ folder (as JupyterLab does), records
seconds, status and the first error per notebook, and prints a table. On a GPU machine this is
how the course's "runs on the GPU" record is made (see BENCHMARKS.md); on a CPU, CI runs the
same notebooks through nbval instead.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import pathlib
import platform
import sys
import tarfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


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


def environment() -> dict:
    sys.path.insert(0, str(ROOT))
    from flashedu.runtime import git_commit

    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        torch_version = torch.__version__
    except ImportError:
        device, torch_version = "unknown", "not installed"
    return {"device": device, "torch": torch_version, "python": platform.python_version(),
            "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python scripts/run_notebooks.py " + " ".join(sys.argv[1:])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*", type=pathlib.Path,
                   help="notebooks to run (default: every notebooks/*.ipynb)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    p.add_argument("--json", type=pathlib.Path, help="write the record here")
    p.add_argument("--executed", type=pathlib.Path,
                   help="write the executed notebooks into this .tar.gz")
    args = p.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    missing = [str(x) for x in paths if not x.is_file()]
    if missing:
        p.error(f"no such notebook: {', '.join(missing)}")

    import nbformat

    env = environment()
    print(f"{env['device']}, torch {env['torch']}, commit {env['commit']}")
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
        args.json.write_text(json.dumps({"environment": env, "notebooks": rows}, indent=1) + "\n")
    if args.executed:
        with tarfile.open(args.executed, "w:gz") as tar:
            for name, text in executed.items():
                data = text.encode()
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
