"""Rules the test-suite keeps about itself: a test that needs a CUDA GPU says so with the `gpu`
marker (so that `pytest -m gpu` on a GPU machine selects it), and no test passes without
checking anything when it cannot run here (it skips, saying why)."""

import ast
import pathlib
import re

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
# A skip condition that holds when no CUDA GPU is visible.
NO_CUDA = re.compile(r"not\s*\(?\s*(torch\.)?cuda\.is_available\(\)")


def _expanded(text, names):
    """``text`` with module-level names replaced by what they were assigned (twice over, for
    GPU = pytest.mark.skipif(not CUDA, ...) with CUDA = torch.cuda.is_available())."""
    for _ in range(2):
        text = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: f"({names[m[0]]})" if m[0] in names
                      else m[0], text)
    return text


def _module_names(tree):
    names = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            names[node.targets[0].id] = ast.unparse(node.value)
    return names


def _needs_cuda(fn, names) -> bool:
    """Whether the test skips when no CUDA GPU is visible: a skipif decorator, or a
    pytest.skip(...) under an `if` whose condition is the lack of CUDA."""
    for dec in fn.decorator_list:
        text = _expanded(ast.unparse(dec), names)
        if "skipif" in text and NO_CUDA.search(text):
            return True
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and NO_CUDA.search(_expanded(ast.unparse(node.test), names)):
            if any(isinstance(c, ast.Call) and ast.unparse(c.func) == "pytest.skip"
                   for stmt in node.body for c in ast.walk(stmt)):
                return True
    return False


def _own_nodes(fn):
    """The nodes of a test function's own body (not of functions defined inside it)."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    stack = [n for n in fn.body if not isinstance(n, nested)]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, nested))


def _gpu_marked(fn, module_marks) -> bool:
    return "pytest.mark.gpu" in module_marks or any(
        ast.unparse(d).startswith("pytest.mark.gpu") for d in fn.decorator_list)


def _tests():
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = _module_names(tree)
        module_marks = _expanded(names.get("pytestmark", ""), names)
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
                yield path, fn, names, module_marks


def test_tests_that_skip_without_cuda_carry_the_gpu_marker():
    missing = [f"{path.name}::{fn.name}" for path, fn, names, marks in _tests()
               if _needs_cuda(fn, names) and not _gpu_marked(fn, marks)]
    assert not missing, "skip without CUDA but lack @pytest.mark.gpu: " + ", ".join(missing)


def test_the_rule_sees_gpu_tests():
    """The check above finds something: the GPU tests of the benchmarks and of torch.compile."""
    found = {f"{path.name}::{fn.name}" for path, fn, names, _ in _tests()
             if _needs_cuda(fn, names)}
    assert "test_bench.py::test_gpu_subcommand_runs_small" in found
    assert any(name.startswith("test_torch_integration.py::") for name in found)


def test_no_test_returns_early_without_skipping():
    """`if not fits: return` passes a test that checked nothing; such a test must skip."""
    early = []
    for path, fn, _, _ in _tests():
        for node in _own_nodes(fn):
            if isinstance(node, ast.If) and any(isinstance(s, ast.Return) for s in node.body):
                before = node.body[:[isinstance(s, ast.Return) for s in node.body].index(True)]
                checks = any(isinstance(c, (ast.Assert, ast.Raise)) or (
                    isinstance(c, ast.Call) and re.search(r"assert|raises|check|skip|fail",
                                                          ast.unparse(c.func)))
                    for s in before for c in ast.walk(s))
                if not checks:
                    early.append(f"{path.name}::{fn.name} line {node.lineno}")
    assert not early, "returns before checking anything (skip instead): " + ", ".join(early)


@pytest.mark.parametrize("marker", ["gpu", "slow"])
def test_markers_are_declared(marker):
    text = (TESTS.parent / "pyproject.toml").read_text()
    assert re.search(rf'"{marker}: ', text), f"marker {marker} is not declared in pyproject.toml"


def test_ci_and_readme_select_every_marker():
    """The README's test command (and CI's) deselects nothing: slow and gpu tests stay in CI
    (the gpu ones skip there, saying why)."""
    for name in ("README.md", ".ci/run"):
        lines = [ln for ln in (TESTS.parent / name).read_text().splitlines()
                 if "-m pytest" in ln]
        assert lines, f"no pytest command in {name}"
        assert not any(re.search(r"\s-m\s+['\"]?(not\s+)?(slow|gpu)", ln) for ln in lines), lines
