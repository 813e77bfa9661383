"""flashedu.runtime.git_commit: what benchmark records name as their commit."""

import shutil

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
