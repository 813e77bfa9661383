"""``flashedu check`` on a class folder: honest students get full marks whatever their
classmates' notebooks do; saboteurs, plagiarists and a grader-killer get nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

pytest.importorskip("nbclient", reason="flashedu check needs nbclient")

from flashedu.checks import classroom, jail  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOLVED = ROOT / "solutions" / "01_softmax.ipynb"
BLANK = ROOT / "exercises" / "01_softmax.ipynb"  # what a student starts from
MARK = "flashedu-classroom-test-marker"  # names the processes a hostile notebook leaves
JAILED = pytest.mark.skipif(jail.unavailable() is not None,
                            reason=f"kernels run without a jail here: {jail.unavailable()}")


def _student(folder: Path, name: str, cells=(), solved=True) -> Path:
    nb = nbformat.read(SOLVED if solved else BLANK, as_version=4)
    nb.cells += [nbformat.v4.new_code_cell(c) for c in cells]
    path = folder / name / "01_softmax.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    return path


def _check(*args, timeout=400):
    return subprocess.run([sys.executable, "-m", "flashedu.checks.command", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def _leftovers() -> list[str]:
    run = subprocess.run(["pgrep", "-f", MARK], capture_output=True, text=True, check=False)
    return run.stdout.split()


@JAILED
def test_a_class_with_saboteurs_plagiarists_and_a_grader_killer(tmp_path):
    cls = tmp_path / "class"
    grades = tmp_path / "grades.json"
    alice = _student(cls, "alice")
    bob = _student(cls, "bob")
    # Takes alice's answers and ruins her file, the course's solutions and the grader; prints
    # 32 MiB; leaves a process that rewrites the grades after the grader has gone.
    mallory = _student(cls, "mallory", [
        "import glob, os, subprocess\n"
        f"stolen = [open(p).read() for p in glob.glob({str(cls)!r} + '/*/*.ipynb')]\n"
        f"stolen += [open(p).read() for p in glob.glob({str(ROOT / 'solutions')!r} + '/*.ipynb')]\n"
        "stolen += [open(p).read() for p in glob.glob('/tmp/flashedu-grade-*/*/home/*.ipynb')\n"
        "           if not p.startswith(os.getcwd())]  # its own copy is no use\n"
        "for nb in stolen:  # run the first answers found\n"
        "    for cell in __import__('json').loads(nb)['cells']:\n"
        "        if cell['cell_type'] == 'code':\n"
        "            try:\n                exec(''.join(cell['source']))\n"
        "            except Exception:\n                pass\n",
        "for target in glob.glob(" + repr(str(cls)) + " + '/*/*.ipynb') + "
        "glob.glob('/tmp/flashedu-grade-*/*/home/*.ipynb'):\n"
        "    try:\n        open(target, 'w').write('{}')\n    except OSError:\n        pass\n",
        f"subprocess.Popen(['sh', '-c', 'sleep 3; echo [] > {grades}; : {MARK}'],\n"
        "                 start_new_session=True)\n"
        f"subprocess.Popen(['sleep', '600', '{MARK}'])",
        "for _ in range(32):\n    print('x' * (1 << 20))",
    ], solved=False)
    # Kills every process it can signal, itself included.
    killer = _student(cls, "killer", ["import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                                      "os.kill(-1, signal.SIGKILL)"],
                      solved=False)
    (cls / "eve").mkdir()
    (cls / "eve" / "01_softmax.ipynb").symlink_to(SOLVED)
    (cls / "trent").mkdir()
    leaked = tmp_path / "leaked.ipynb"  # a solution that got out, under a second name
    leaked.write_bytes(SOLVED.read_bytes())
    os.link(leaked, cls / "trent" / "01_softmax.ipynb")
    start = time.perf_counter()
    run = _check(alice, bob, mallory, killer, cls / "eve" / "01_softmax.ipynb",
                 cls / "trent" / "01_softmax.ipynb", "--jobs", "2", "--json", grades)
    seconds = time.perf_counter() - start
    assert run.returncode == 1, run.stderr[-2000:]  # some could not be graded
    rows = json.loads(grades.read_text())
    by = {}
    for r in rows:
        by.setdefault(Path(r["notebook"]).parent.name, []).append(r)
    assert set(by) == {"alice", "bob", "mallory", "killer", "eve", "trent"}
    for honest in ("alice", "bob"):
        assert [r["points"] for r in by[honest]] == [1, 2], by[honest]
    assert all(r["points"] == 0 for who in ("mallory", "killer", "eve", "trent") for r in by[who])
    assert "symbolic link" in by["eve"][0]["message"]
    assert "hard link" in by["trent"][0]["message"]
    assert by["mallory"][0]["status"] == "not implemented yet", by["mallory"]
    assert by["killer"][0]["status"] == "not implemented yet", by["killer"]  # and it ran on
    assert alice.read_text() != "{}"  # the class folder is out of reach
    time.sleep(4)  # the detached writer's time has come and gone
    assert json.loads(grades.read_text()) == rows
    assert _leftovers() == []
    assert seconds < 240, seconds


def test_links_and_missing_files_are_refused_before_anything_runs(tmp_path):
    alice = _student(tmp_path, "alice")
    (tmp_path / "link.ipynb").symlink_to(alice)
    os.link(alice, tmp_path / "hard.ipynb")
    staged = classroom.stage([tmp_path / "link.ipynb", tmp_path / "hard.ipynb",
                              tmp_path / "none.ipynb", tmp_path], tmp_path / "stage")
    reasons = [s.refused for s in staged]
    assert "symbolic link" in reasons[0] and "hard link" in reasons[1]
    assert "no such file" in reasons[2] and "not a regular file" in reasons[3]
    assert not (tmp_path / "stage").exists()


def test_a_private_copy_is_what_gets_graded(tmp_path):
    alice = _student(tmp_path, "alice")
    (sub,) = classroom.stage([alice], tmp_path / "stage")
    alice.write_text("{}")  # changed after staging: the copy stands
    copy = sub.folder / "home" / "01_softmax.ipynb"
    assert nbformat.read(copy, as_version=4).cells
    assert sorted(p.name for p in sub.folder.iterdir()) == ["exchange", "home"]


def test_the_grades_file_is_replaced_in_one_step(tmp_path):
    target = tmp_path / "grades.json"
    target.write_text("old")
    classroom.write_json([{"points": 1}], target)
    assert json.loads(target.read_text()) == [{"points": 1}]
    assert [p.name for p in tmp_path.iterdir()] == ["grades.json"]  # no temporary file left


def test_rows_from_a_supervisor_name_the_instructors_file():
    blob = json.dumps({"rows": [{"notebook": "/tmp/x/home/a.ipynb", "points": 1}],
                       "graded": True}).encode()
    rows, graded = classroom._parse_rows(blob, "/class/alice/a.ipynb")
    assert graded and rows[0]["notebook"] == "/class/alice/a.ipynb"
    for bad in (b"", b"[]", b"{\"rows\": 3, \"graded\": true}", b"x" * (classroom.ROWS_LIMIT + 1)):
        assert classroom._parse_rows(bad, "a") is None


@JAILED
def test_the_jail_shows_a_read_only_system_and_only_its_own_folders(tmp_path):
    home, exchange = tmp_path / "s" / "home", tmp_path / "s" / "exchange"
    home.mkdir(parents=True)
    exchange.mkdir()
    secret = tmp_path / "class" / "bob.ipynb"
    secret.parent.mkdir()
    secret.write_text("bob's answers")
    cell = jail.Jail(home=home, exchange=exchange, hide=[secret.parent])
    probe = ("import os, pathlib\n"
             f"print(os.path.exists({str(secret)!r}))\n"
             "pathlib.Path('mine').write_text('ok')\n"
             "try:\n    open('/etc/flashedu-probe', 'w')\nexcept OSError as e:\n    print(e.errno)\n"
             "print(os.getuid(), len([p for p in os.listdir('/proc') if p.isdigit()]))")
    run = subprocess.run(jail.prefix(cell) + [sys.executable, "-c", probe], capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    exists, errno, ids = run.stdout.split("\n")[:3]
    assert exists == "False" and errno == "30"  # EROFS
    uid, processes = ids.split()
    assert int(uid) == jail.UID and int(processes) <= 3  # bubblewrap's init, python
    assert (home / "mine").read_text() == "ok"


DENSE = '''import numpy as np
import flashedu.checks.engine as engine

def flash_forward(Q, K, V, block_q, block_k, causal=False, scale=None):
    """Right answers from the whole Nq x Nk score matrix: not a tiled kernel."""
    scale = 1 / np.sqrt(Q.shape[1]) if scale is None else scale
    S = (Q @ K.T) * scale
    if causal:
        S = np.where(np.arange(len(K))[None, :] > np.arange(len(Q))[:, None], -np.inf, S)
    m = S.max(axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    P = np.exp(S - m)
    l = P.sum(axis=1)
    O = (P @ V) / np.where(l > 0, l, 1)[:, None]
    L = np.where(l > 0, m[:, 0] + np.log(np.where(l > 0, l, 1)), -np.inf)
    return O.astype(Q.dtype), L.astype(Q.dtype)

measured = engine.execute_case

def execute_case(*args, **kwargs):  # reports no memory at all
    call = measured(*args, **kwargs)
    call.peak_bytes = call.rss_bytes = 0
    return call

engine.execute_case = execute_case
'''


def test_memory_is_measured_outside_the_kernel(tmp_path):
    """A dense forward whose kernel reports using no memory still fails the memory cases: the
    supervisor reads the kernel's peak resident memory from /proc itself."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no /proc/PID/clear_refs here: peak memory cannot be measured from outside")
    nb = nbformat.read(ROOT / "exercises" / "02_flash_forward.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(DENSE))
    path = tmp_path / "02_flash_forward.ipynb"
    nbformat.write(nb, path)
    run = _check(path, "--json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(run.stdout)
    assert row["points"] == 0 and "memory" in row["message"] and "grew by" in row["message"], row


def test_cpu_time_is_measured_outside_the_kernel(tmp_path):
    """A block-sparse forward that computes every tile on plain copies of K and V (so no read
    is seen) and makes the kernel's clocks report no time still fails the work case: the
    supervisor reads the kernel's CPU time from /proc itself."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_grader_hostile import WRONG

    (replace,) = [w[2] for w in WRONG if w[0] == "block_sparse_forward" and "plain" in w[1]]
    nb = nbformat.read(ROOT / "solutions" / "04_block_sparse.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if "def block_sparse_forward" in c.source]
    for old, new in replace:
        cell.source = cell.source.replace(old, new)
    nb.cells.append(nbformat.v4.new_code_cell(
        "import time\ntime.process_time = lambda: 0.0  # the kernel's own clock says nothing"))
    path = tmp_path / "04_block_sparse.ipynb"
    nbformat.write(nb, path)
    run = _check(path, "--json", "-")
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(run.stdout)
    assert row["points"] == 0 and "CPU time" in row["message"], row


def test_a_timed_case_waits_for_the_other_threads_to_stop_spending_cpu():
    """others_idle returns once the process's other threads are idle: after a thread that
    spins for 0.3 s (as pool threads do after work), not before it stops; at once where none
    spins (within its first windows)."""
    import threading
    import time

    from flashedu.checks.engine import others_idle

    def spin(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    start = time.monotonic()
    others_idle()
    assert time.monotonic() - start < 0.5  # nothing spins here
    spinner = threading.Thread(target=spin, args=(0.3,))
    spinner.start()
    start = time.monotonic()
    others_idle(most=5.0)
    waited = time.monotonic() - start
    alive = spinner.is_alive()
    spinner.join()
    assert not alive and 0.2 < waited < 4.0, waited


def test_a_watch_counts_the_cpu_time_of_processes_below_it():
    from flashedu.checks.memory import Watch

    watch = Watch()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert 0.25 <= watch.cpu() < 5
