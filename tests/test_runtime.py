"""flashedu.runtime.git_commit: what benchmark records name as their commit."""

import shutil
import subprocess
import sys

import pytest

import flashedu
from flashedu import runtime


def test_git_commit_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    assert runtime.git_commit() == "abc1234"


def test_git_commit_outside_a_checkout_is_unknown(monkeypatch, tmp_path):
    """A copy of the tree without .git (the GPU machine's) must not record git's error output."""
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    copy = tmp_path / "flashedu"
    shutil.copytree(runtime.__file__.rsplit("/", 1)[0], copy)
    monkeypatch.setattr(runtime, "__file__", str(copy / "runtime.py"))
    assert runtime.git_commit() == "unknown"


def test_import_leaves_triton_and_numba_for_later():
    """Kernels import triton / numba on first use, after runtime.configure() has decided how
    they run (TRITON_INTERPRET, NUMBA_ENABLE_CUDASIM are read at their import)."""
    import subprocess
    import sys

    code = ("import sys, flashedu; "
            "print(sorted(m for m in ('triton', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_auto_backend_and_where_follow_the_device():
    gpu = runtime.configure()["gpu"]
    assert runtime.auto_backend() == ("triton" if gpu else "numpy")
    assert ("interpreter" in runtime.where("triton")) == runtime.triton_interpreted()
    assert runtime.where("naive") == "the input's device (torch ops)"


def test_auto_follows_the_inputs_device():
    """CPU tensors take numpy on any machine (a GPU machine too), CUDA tensors triton; torch ops
    for other devices."""
    import torch

    from flashedu.backends import resolve_backend

    assert resolve_backend("auto", torch.zeros(1)) == "numpy"
    assert resolve_backend("auto", torch.zeros(1, device="meta")) == "naive"
    assert resolve_backend("numba", torch.zeros(1)) == "numba"  # an explicit choice stays
    if torch.cuda.is_available() and runtime.configure()["gpu"]:
        assert resolve_backend("auto", torch.zeros(1, device="cuda")) == "triton"


def test_doctor_ends_with_the_sections_added_by_higher_layers(monkeypatch):
    import flashedu.backends  # noqa: F401  the layer above adds its section

    monkeypatch.setattr(runtime, "_REPORTS", list(runtime._REPORTS))
    runtime.add_report(lambda: ["extra: a section"])
    report = runtime.doctor(flashedu.__version__)
    assert report.splitlines()[-1] == "extra: a section"
    assert "backends:" in report and "  auto   -> " in report  # flashedu.backends' section


def test_import_flashedu_imports_no_torch_on_a_machine_without_a_gpu():
    """A NumPy notebook's first cell and the grader's command line start in well under a
    second: torch, triton and numba come with the first use of what needs them."""
    if runtime._driver_present():
        pytest.skip("NVIDIA's driver is here: import flashedu asks torch whether a GPU is")
    code = ("import sys, flashedu\nfrom flashedu.checks import check\n"
            "import flashedu.course, flashedu.cli\n"
            "print(sorted(m for m in ('torch', 'triton', 'numba') if m in sys.modules))\n"
            "flashedu.attention\n"  # the API's first use brings torch and the operators
            "print('torch' in sys.modules, hasattr(sys.modules['torch'].ops, 'flashedu'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1] == "True True"
