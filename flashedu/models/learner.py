"""Your Triton exercise kernels as the GPT's attention: a function fn(q, k, v, *, is_causal)
with autograd, for ``GPTConfig(attention_backend=...)``.

    from flashedu.models.learner import load_exercise_kernels, ExerciseAttention
    kernels = load_exercise_kernels()      # your cells of exercises 06 and 07 (or the solutions)
    attend = ExerciseAttention(kernels)    # forward: your forward kernel; backward: your two
    config = tiny_config(attention_backend=attend)

The exercise kernels work on one head of float32: Q (Nq, d), K, V (Nk, d), one row stride each.
A model's attention is (B, H, T, d), in float32 or (under autocast) bf16. So the adapter loops
over the B x H heads, hands each kernel a float32 (T, d) view, and casts the result back to the
input's dtype. On a GPU that is B x H small launches instead of one: correct, not fast
(flashedu's own Triton backend takes a head stride and launches once).

The launchers are the ones the exercises are graded with: ``launch_triton_forward``
(flashedu.checks.triton_forward) for exercise 06, ``launch_triton_backward``
(flashedu.checks.triton_backward) for exercise 07.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

# the exercise names (``check``'s first argument) of the three kernels
FORWARD = "triton_forward_kernel"  # exercise 06
BACKWARD_DKDV = "triton_backward_dkdv_kernel"  # exercise 07: dK_j, dV_j, one program per K/V tile
BACKWARD_DQ = "triton_backward_dq_kernel"  # exercise 07: dQ_i, one program per Q tile
NOTEBOOKS = ("06_triton_kernel", "07_triton_backward")
_SKELETON = re.compile(r"^\s*raise\s+NotImplementedError\b", re.MULTILINE)
_CHECK_CALL = re.compile(r"""check\(\s*["'](\w+)["']\s*,\s*(\w+)""")
_HEADER = '''"""Code cells of {notebook}, written out by flashedu.models.learner: Triton's @jit
reads a kernel's source from its file, so notebook cells must live in a real file to compile."""
import math

import numpy as np
import torch

import flashedu  # noqa: F401  (before triton: without a GPU it selects the interpreter)
import triton
import triton.language as tl

'''


# ----------------------------------------------------------------------------------------
# Loading the kernels out of the exercise notebooks
# ----------------------------------------------------------------------------------------


@dataclass
class ExerciseKernels:
    """Kernels by exercise name, where each came from, and what the loader had to say."""

    kernels: dict = field(default_factory=dict)  # exercise name -> kernel
    sources: dict = field(default_factory=dict)  # exercise name -> the notebook it came from
    notes: list = field(default_factory=list)  # one line per kernel: yours, or a solution and why

    def __getitem__(self, name):
        return self.kernels[name]

    def __contains__(self, name):
        return name in self.kernels

    def get(self, name, default=None):
        return self.kernels.get(name, default)

    def items(self):
        return self.kernels.items()

    @property
    def from_solutions(self) -> list:
        return [n for n, src in self.sources.items() if src.startswith("solutions")]

    def __repr__(self):
        return "\n".join(self.notes)


def course_root(root=None) -> Path:
    """The folder holding exercises/ and solutions/: ``root``, else the working directory or
    one of its parents (notebooks run from notebooks/), else the checkout of the package."""
    import flashedu

    here = Path.cwd()
    candidates = [Path(root)] if root is not None else [
        here, *here.parents, Path(flashedu.__file__).resolve().parents[1]]
    for path in candidates:
        if (path / "exercises").is_dir() or (path / "solutions").is_dir():
            return path
    raise FileNotFoundError(f"no exercises/ or solutions/ folder in {candidates[0]} or above it: "
                            "pass root= (the course folder)")


def load_exercise_kernels(notebooks=NOTEBOOKS, root=None, quiet=False) -> ExerciseKernels:
    """The kernels of your Triton exercises, by exercise name (``check``'s first argument).

    Each graded cell of exercises/<notebook>.ipynb that is finished is yours; one that still
    raises NotImplementedError (or a notebook that is missing) is replaced by the same cell of
    solutions/<notebook>.ipynb, and the notes printed say so. The cells are written to a module
    file in a cache folder and imported (Triton compiles a kernel from its source file)."""
    root = course_root(root)
    found = ExerciseKernels()
    for notebook in notebooks:
        _load_notebook(root, notebook, found)
    if not quiet:
        print("\n".join(found.notes))
    return found


def _load_notebook(root, notebook, found):
    mine = _read_cells(root / "exercises" / f"{notebook}.ipynb")
    solved = _read_cells(root / "solutions" / f"{notebook}.ipynb")
    if mine is None and solved is None:
        found.notes.append(f"{notebook}: neither exercises/{notebook}.ipynb nor "
                           f"solutions/{notebook}.ipynb is in {root}")
        return
    cells, origin = [], {}
    graded = [*(mine or {"graded": {}})["graded"], *(solved or {"graded": {}})["graded"]]
    for grade_id in dict.fromkeys(graded):  # each once, the learner's order first
        source = (mine or {"graded": {}})["graded"].get(grade_id)
        if source is not None and not _SKELETON.search(source):
            cells.append(source)
            origin[grade_id] = f"exercises/{notebook}.ipynb"
            continue
        why = (f"exercises/{notebook}.ipynb is missing" if mine is None
               else f"your cell in exercises/{notebook}.ipynb still raises NotImplementedError")
        fallback = (solved or {"graded": {}})["graded"].get(grade_id)
        if fallback is None:
            raise ValueError(f"{grade_id}: {why}, and solutions/{notebook}.ipynb has no such cell:"
                             " finish the exercise, then load again")
        cells.append(fallback)
        origin[grade_id] = f"solutions/{notebook}.ipynb ({why})"
    try:
        module = _import_cells(notebook, cells)
    except Exception as exc:
        raise RuntimeError(
            f"the graded cells of {notebook} ({', '.join(sorted(set(origin.values())))}) do "
            f"not run as a module: {type(exc).__name__}: {exc}. Run them in the exercise "
            "notebook and fix what fails there, then load again") from exc
    checks = {**(solved or {}).get("checks", {}), **(mine or {}).get("checks", {})}
    for name, fn_name in checks.items():
        grade_id = next((g for g, src in zip(origin, cells)
                         if re.search(rf"^def {fn_name}\b", src, re.MULTILINE)), None)
        if grade_id is None or not hasattr(module, fn_name):
            continue
        found.kernels[name] = getattr(module, fn_name)
        found.sources[name] = origin[grade_id]
        if origin[grade_id].startswith("exercises"):
            found.notes.append(f"{name}: your kernel {fn_name}, from {origin[grade_id]}")
        else:
            found.notes.append(f"{name}: USING THE SOLUTION from {origin[grade_id]}: finish the "
                               "exercise and load again to train with yours")


def _read_cells(path):
    """{"graded": grade_id -> source of the learner's code cells, "checks": exercise name ->
    the function its check cell grades}, or None if there is no such notebook."""
    if not path.exists():
        return None
    import nbformat

    nb = nbformat.read(path, as_version=4)
    graded, checks = {}, {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution"):
            # notebook-only lines (%magic, !shell) are not Python
            lines = [ln for ln in cell.source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
            graded[meta.get("grade_id", cell.get("id"))] = "\n".join(lines)
        checks.update(dict(_CHECK_CALL.findall(cell.source)))
    return {"graded": graded, "checks": checks}


def cache_folder() -> Path:
    """Where notebook cells are written as modules: ``FLASHEDU_CACHE``, else a folder in the
    temp directory (not named ``flashedu``: a script run from the temp directory would import
    that folder as the package)."""
    return Path(os.environ.get("FLASHEDU_CACHE", Path(tempfile.gettempdir()) / "flashedu-cache"))


def _import_cells(notebook, cells):
    """Write the cells to <cache>/<notebook>_<hash>.py and import it (a hash of the source
    names the file, so an edited cell gives a new module and the old one is never reused)."""
    source = _HEADER.format(notebook=notebook) + "\n\n".join(cells) + "\n"
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    name = "flashedu_exercise_" + re.sub(r"\W", "_", notebook) + "_" + digest
    if name in sys.modules:
        return sys.modules[name]
    folder = cache_folder()
    folder = folder / "exercise_kernels"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# ----------------------------------------------------------------------------------------
# The kernels as attention: fn(q, k, v, *, is_causal) with autograd
# ----------------------------------------------------------------------------------------


class ExerciseAttention:
    """``fn(q, k, v, *, is_causal=False, scale=None)`` for (B, H, T, d) tensors, computed by
    the exercise kernels one head at a time in float32.

    ``kernels``: what ``load_exercise_kernels`` returned, or a dict of kernels by exercise name:
    "triton_forward_kernel", and for the backward "triton_backward_dkdv_kernel" and
    "triton_backward_dq_kernel".
    Without backward kernels the backward is flashedu's NumPy Algorithm 4
    (flashedu.tiled.flash_backward), and ``describe()`` says so.
    Br, Bc: the tile sizes; default 16 in Triton's interpreter, 64 on a GPU."""

    def __init__(self, kernels, Br=None, Bc=None):
        self.forward_kernel = kernels.get(FORWARD)
        if self.forward_kernel is None:
            raise ValueError(f"no {FORWARD} among the kernels {[n for n, _ in kernels.items()]}")
        self.dkdv_kernel, self.dq_kernel = kernels.get(BACKWARD_DKDV), kernels.get(BACKWARD_DQ)
        self.sources = dict(kernels.sources) if isinstance(kernels, ExerciseKernels) else {}
        from .. import runtime

        default = 16 if runtime.triton_interpreted() else 64
        self.Br, self.Bc = Br or default, Bc or default

    @property
    def has_backward_kernels(self) -> bool:
        return self.dkdv_kernel is not None and self.dq_kernel is not None

    def describe(self) -> str:
        """Which kernels run, from where (yours, or a solution), and how."""
        def origin(name):
            return f" from {self.sources[name].split(' (')[0]}" if name in self.sources else ""

        backward = (f"the exercise's dK/dV and dQ kernels{origin(BACKWARD_DKDV)} (launch_triton_backward)"
                    if self.has_backward_kernels
                    else "flashedu's NumPy Algorithm 4 (no backward kernels given)")
        return (f"forward: the exercise kernel{origin(FORWARD)} (launch_triton_forward); "
                f"backward: {backward}; Br={self.Br}, Bc={self.Bc}, one launch per head, float32")

    @torch.compiler.disable  # interpreted or launched head by head: nothing for compile to trace
    def __call__(self, q, k, v, *, is_causal=False, scale=None):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a (B, H, T, d) tensor, got "
                                 f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
        if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: the "
                             "exercise kernels need the same B, H and d for all three (no GQA)")
        d = q.shape[-1]
        if d < 16 or d & (d - 1):
            raise ValueError(f"head dim d={d}: the exercise kernels need a power of two >= 16 "
                             "(tl.arange over D): choose d_model / n_heads accordingly")
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        return _ExerciseFunction.apply(q, k, v, self, bool(is_causal), scale)

    def fit_tiles(self, step, *args):
        """``step(*args)``; where the tiles need more shared memory than the GPU has (Triton's
        OutOfResources, raised at the first launch), halve Br and Bc (down to 16), say so, retry."""
        while True:
            try:
                return step(*args)
            except Exception as exc:
                if type(exc).__name__ != "OutOfResources" or max(self.Br, self.Bc) <= 16:
                    raise
                self.Br, self.Bc = max(16, self.Br // 2), max(16, self.Bc // 2)
                warnings.warn(f"the exercise kernels' tiles do not fit this GPU ({exc}): "
                              f"retrying with Br={self.Br}, Bc={self.Bc}", stacklevel=2)

    # one head at a time: the exercise kernels take a (T, d) tensor with one row stride
    def forward_heads(self, q, k, v, causal, scale):
        from ..checks.triton_forward import launch_triton_forward
        device = _kernel_device(q)
        Q, K, V = (_float32(t, device) for t in (q, k, v))
        B, H, Nq, _ = Q.shape
        O = torch.empty_like(Q)
        L = torch.empty(B, H, Nq, dtype=torch.float32, device=device)
        for b in range(B):
            for h in range(H):
                launch_triton_forward(self.forward_kernel, Q[b, h], K[b, h], V[b, h], causal,
                                      scale, self.Br, self.Bc, out=(O[b, h], L[b, h]))
        return O, L

    def backward_heads(self, q, k, v, O, dO, L, causal, scale):
        device = O.device
        Q, K, V, dO = (_float32(t, device) for t in (q, k, v, dO))
        dQ, dK, dV = torch.empty_like(Q), torch.empty_like(K), torch.empty_like(V)
        if self.has_backward_kernels:
            from ..checks.triton_backward import launch_triton_backward
        for b in range(Q.shape[0]):
            for h in range(Q.shape[1]):
                args = (Q[b, h], K[b, h], V[b, h], O[b, h], dO[b, h], L[b, h])
                if self.has_backward_kernels:
                    grads = launch_triton_backward(self.dkdv_kernel, self.dq_kernel, *args,
                                                   causal=causal, scale=scale, Br=self.Br,
                                                   Bc=self.Bc)
                else:
                    grads = _numpy_backward(*args, causal, scale, self.Br, self.Bc)
                for out, g in zip((dQ, dK, dV), grads):
                    out[b, h] = g
        return dQ, dK, dV


class _ExerciseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn, causal, scale):
        O, L = attn.fit_tiles(attn.forward_heads, q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, O, L)
        ctx.attn, ctx.causal, ctx.scale = attn, causal, scale
        return O.to(device=q.device, dtype=q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, O, L = ctx.saved_tensors
        grads = ctx.attn.fit_tiles(ctx.attn.backward_heads, q, k, v, O, dout, L, ctx.causal,
                                   ctx.scale)
        dq, dk, dv = (g.to(device=t.device, dtype=t.dtype) for g, t in zip(grads, (q, k, v)))
        return dq, dk, dv, None, None, None


def _kernel_device(t):
    """Where the Triton kernels run: the GPU, or the CPU under the interpreter."""
    from .. import runtime

    return runtime.kernel_device() if t.device.type == "cpu" else t.device


def _float32(t, device):
    return t.detach().to(device=device, dtype=torch.float32).contiguous()


def _numpy_backward(Q, K, V, O, dO, L, causal, scale, Br, Bc):
    from ..tiled import flash_backward

    arrays = [t.cpu().numpy() for t in (Q, K, V, O, dO, L)]
    grads = flash_backward(*arrays, Br, Bc, causal=causal, scale=scale)
    return [torch.from_numpy(g).to(Q.device) for g in grads]


def exercise_attention(root=None, Br=None, Bc=None, quiet=False) -> ExerciseAttention:
    """Load your kernels (``load_exercise_kernels``) and make them attention (``ExerciseAttention``)."""
    attn = ExerciseAttention(load_exercise_kernels(root=root, quiet=quiet), Br=Br, Bc=Bc)
    if not quiet:
        print(attn.describe())
    return attn
