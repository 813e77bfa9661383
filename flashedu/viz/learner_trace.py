"""Trace a learner's own NumPy ``flash_forward`` and find the first step where it leaves the
reference (no widgets here; :mod:`flashedu.viz.compare_view` shows the result as a stepper).

``compare_trace(fn, Q, K, V, block_q, block_k, causal=False)`` runs ``fn`` once and records:

- its **steps**: each product S_ij = Q_i K_j^T of a Q tile with a K tile (which rows of Q and
  of K), and which rows of V the following P_ij V_j used;
- its **state after each step**: m_i, l_i and O_i of the step's rows, read from the function's
  own local variables (the paper's names: ``m_i``, ``l_i``, ``O_i``; in the K/V-outer order of
  Algorithm 1, the HBM arrays ``m``, ``l``, ``O``);
- what it returns, (O, L);
- the exception it raised, if any, with the line of the learner's own code that raised it: that
  comes first in the verdict, before any difference.

How: Q, K and V are handed over as an ndarray subclass that notes which rows each slice reads
and which tiles meet in a matrix product (``np.zeros_like(Q)`` stays traced, so the writes to O
are seen too), and a line tracer (``sys.settrace``) on the function's own frame copies the
statistics after every line. Code that calls this package's kernels without a trace (e.g.
:func:`flashedu.tiled.flash_forward` itself) reports its steps and values through the hook of
:mod:`flashedu.trace` instead.

The reference is the online softmax replayed in float64 over the same loop order (Q outer as
FlashAttention-2, or K/V outer as the paper's Algorithm 1, whichever the learner's steps follow),
with the tiles the reference kernel computes (under ``causal``, tiles wholly above the diagonal
are skipped; the last tiles are cut at Nq and Nk). Where the two differ, the same replay with one
known mistake (no 1/sqrt(d), 1/sqrt(d) twice, no rescale by alpha, the causal diagonal off by
one) names the mistake when the learner's values are exactly that replay's.

NumPy's floating-point warnings: the learner's arithmetic on the traced arrays runs inside this
module, so its warnings are re-issued at the learner's line; the comparison's own arithmetic
warns about nothing.
"""

from __future__ import annotations

import linecache
import math
import os
import sys
import sysconfig
import traceback
import warnings
from dataclasses import dataclass, field
from itertools import zip_longest

import numpy as np

from .. import trace as _trace
from ..tiled import TileMask
from .trace_states import Step, _close, _normalized, _ranges, _values, gap_text, row_differences

STATE_NAMES = ("m_i", "l_i", "O_i", "m", "l", "O", "acc", "m_new", "l_new")


@dataclass(frozen=True)
class LearnerError:
    """The exception the learner's function raised, at the line of their own code."""

    type: str  # e.g. "ValueError"
    message: str
    where: str  # "Cell In[5], line 12" in a notebook, else "path/to/file.py, line 12"
    source: str  # the text of that line ("" when it cannot be read)
    step: int  # the steps begun when it raised (0: before the first S_ij = Q_i K_j^T)

    def __str__(self) -> str:
        line = f": {self.source}" if self.source else ""
        return f"your function raised {self.type}: {self.message} - at {self.where}{line}"


@dataclass(frozen=True)
class Divergence:
    """Where the learner's trace first leaves the reference."""

    step: int  # 1-based index of the computed step (len(steps) + 1: at the end)
    what: str  # "tile", "V tile", "m_i", "l_i", "O_i", "O", "L", "error"
    rows: tuple[int, ...]  # query rows that differ (empty for a tile difference)
    message: str
    error: LearnerError | None = None  # set when what == "error"

    def __str__(self) -> str:
        return self.message


@dataclass
class TraceComparison:
    """The result of :func:`compare_trace`. ``first_divergence`` is None when the learner's
    trace agrees with the reference at every step and at the end. Displays as a stepper."""

    first_divergence: Divergence | None
    steps: list[Step]  # the learner's
    reference_steps: list[Step]
    order: str  # "q_outer" or "kv_outer": the loop order the learner's steps follow
    Q: np.ndarray
    K: np.ndarray
    V: np.ndarray
    block_q: int
    block_k: int
    causal: bool
    O: np.ndarray | None = None  # what the learner returned
    L: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)  # what was not compared, and why
    error: LearnerError | None = None  # the learner's exception, where it was raised
    exception: BaseException | None = None  # the exception itself (``raise c.exception``)
    # the learner's HBM reads and writes in the order made: ("load" | "store", tensor,
    # rows (r0, r1), steps begun so far, bytes); flashedu.viz.learner_run makes them a Trace
    transfers: list[tuple] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return self.first_divergence is None

    @property
    def headline(self) -> str:
        """The first line of the verdict: the learner's exception, else the first difference,
        else what agrees."""
        if self.first_divergence is not None:
            return str(self.first_divergence)
        n = len(self.reference_steps)
        if not self.steps:
            return "your final O and L agree with the reference"
        if all(s.state is None for s in self.steps):
            return f"your tiles at all {n} steps and your final O and L agree with the reference"
        return f"your trace agrees with the reference at all {n} steps and at the end"

    @property
    def verdict(self) -> str:
        """The headline, then what was not compared and why."""
        return ". ".join([self.headline] + self.notes)

    def __repr__(self) -> str:
        return (f"<TraceComparison: {self.verdict} ({len(self.steps)} steps of yours, "
                f"{len(self.reference_steps)} of the reference, {self.order})>")

    __str__ = __repr__

    def view(self):
        """The comparison as a widget (a stepper opened at the first divergence)."""
        from .compare_view import CompareView

        return CompareView(self)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.view())


# ----------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------


class _Recorder:
    def __init__(self, Nq, Nk, Br, Bc):
        self.Nq, self.Nk, self.Br, self.Bc = Nq, Nk, Br, Bc
        self.steps: list[Step] = []
        # ("load" | "store", tensor, rows (r0, r1), steps begun so far, bytes), in order made
        self.transfers: list[tuple[str, str, tuple[int, int], int, int]] = []
        self.snapshots: list[tuple[int, dict]] = []  # (steps started so far, locals)
        self.arrays: set[str] = set()  # names of the function's own float arrays
        self.via_hook = False

    # --- the flashedu.trace hook (package kernels called without a trace) ---------------
    def _rows(self, name, tile):
        size, n = (self.Br, self.Nq) if name not in ("K", "V") else (self.Bc, self.Nk)
        return tile * size, min((tile + 1) * size, n)

    def load(self, name, tile, array):
        self.via_hook = True
        self.transfers.append(("load", name, self._rows(name, tile), len(self.steps),
                               int(np.asarray(array).nbytes)))

    def store(self, name, tile, array):
        self.via_hook = True
        rows = self._rows(name, tile)
        self.transfers.append(("store", name, rows, len(self.steps),
                               int(np.asarray(array).nbytes)))
        step = self.steps[-1] if self.steps else None
        if step is not None and step.q == rows and name in ("O", "l", "m"):
            if step.state is None or step.state.get("from") == "stores":
                state = step.state or {"from": "stores", "O_normalized": True}
                state[name.lower() if name != "O" else "O"] = np.array(array, np.float64)
                step.state = state

    def compute(self, i, j, **scratch):
        self.via_hook = True
        step = Step(self._rows("Q", i), self._rows("K", j), self._rows("V", j))
        if "m_i" in scratch and "l_i" in scratch and "O_i" in scratch:
            step.state = {"m": np.array(scratch["m_i"], np.float64),
                          "l": np.array(scratch["l_i"], np.float64),
                          "O": np.array(scratch["O_i"], np.float64), "O_normalized": False}
        self.steps.append(step)

    def skip(self, i, j):
        self.via_hook = True

    # --- the traced arrays ------------------------------------------------------------------
    def matmul(self, tags):
        names = {t[1]: t[2] for t in tags if t is not None and t[0] == "tile"}
        if "Q" in names and "K" in names:
            self.steps.append(Step(names["Q"], names["K"]))
        elif "V" in names and self.steps and self.steps[-1].v is None:
            self.steps[-1].v = names["V"]


_ACTIVE: _Recorder | None = None

# Frames in these folders are not the learner's: this package, NumPy, the standard library and
# installed packages. A learner's exception or warning is reported at the innermost other frame.
_LIBRARY_DIRS = tuple(sorted({
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(np.__file__)) + os.sep,
    *(os.path.abspath(p) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
      if (p := sysconfig.get_paths().get(key)))}))


def _is_library(filename: str) -> bool:
    return filename.startswith("<frozen") or (os.path.isabs(filename) and os.path.abspath(
        filename).startswith(_LIBRARY_DIRS))


def _learner_frame(frame):
    """The innermost frame from ``frame`` outwards that runs the learner's code (else ``frame``)."""
    f = frame
    while f is not None and _is_library(f.f_code.co_filename):
        f = f.f_back
    return f or frame


class _as_learners:
    """``with _as_learners(name):`` runs one NumPy operation the learner wrote on a traced array
    (it executes in this module's methods) and issues its floating-point warnings at the
    learner's line, as NumPy would have without the trace. Errors set to ignore or raise by
    ``np.errstate`` stay so."""

    def __init__(self, name: str):
        self.name, self.kinds, self.state = name, [], None

    def _call(self, kind, flag):
        self.kinds.append(kind)

    def __enter__(self):
        modes = np.geterr()
        if "warn" in modes.values() and "call" not in modes.values():  # keep a learner's call
            self.state = np.errstate(call=self._call, **{k: "call" if v == "warn" else v
                                                         for k, v in modes.items()})
            self.state.__enter__()
        return self

    def __exit__(self, *exc):
        if self.state is None:
            return False
        self.state.__exit__(*exc)
        if self.kinds and exc[0] is None:
            frame = _learner_frame(sys._getframe(1))
            g = frame.f_globals
            for kind in dict.fromkeys(self.kinds):
                warnings.warn_explicit(f"{kind} encountered in {self.name}", RuntimeWarning,
                                       frame.f_code.co_filename, frame.f_lineno,
                                       module=g.get("__name__", "__main__"),
                                       registry=g.setdefault("__warningregistry__", {}),
                                       module_globals=g)
        return False


def _row_range(key, n):
    """The rows [r0, r1) of axis 0 that ``key`` selects, or None when it is not a row range."""
    k = key[0] if isinstance(key, tuple) and key else key
    if isinstance(k, slice):
        r0, r1, step = k.indices(n)
        return (r0, max(r0, r1)) if step == 1 else None
    if isinstance(k, (int, np.integer)):
        r = int(k) % n if n else 0
        return r, r + 1
    return None


def _plain(x):
    if isinstance(x, _Traced):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(y) for y in x)
    return x


def _tag(x):
    return x._fe if isinstance(x, _Traced) else None


class _Traced(np.ndarray):
    """An ndarray that tells the active recorder which tiles are read, multiplied and stored.

    Tags: ("root", name) for Q, K, V; ("tile", name, (r0, r1)) for a row slice of one (and its
    views, e.g. ``K_j.T``); ("new", None) for an array made ``*_like`` Q, K or V (the learner's
    O, or L: its row slices read and written are HBM traffic)."""

    _fe = None

    def __array_finalize__(self, obj):
        self._fe = getattr(obj, "_fe", None)

    def __getitem__(self, key):
        out = super().__getitem__(key)
        tag = self._fe
        if not isinstance(out, np.ndarray) or tag is None:
            return out
        if tag[0] == "root":
            rows = _row_range(key, self.shape[0])
            if rows is not None and _ACTIVE is not None:
                _ACTIVE.transfers.append(("load", tag[1], rows, len(_ACTIVE.steps),
                                          out.nbytes))
            out._fe = ("tile", tag[1], rows) if rows is not None else None
        elif tag[0] == "new":  # a read of the learner's O (or L) in HBM: Algorithm 1 does
            rows = _row_range(key, self.shape[0])
            if rows is not None and _ACTIVE is not None:
                _ACTIVE.transfers.append(("load", "O" if self.ndim == 2 else "L", rows,
                                          len(_ACTIVE.steps), out.nbytes))
            out._fe = None
        return out

    def __setitem__(self, key, value):
        tag = self._fe
        if tag is not None and tag[0] == "new" and _ACTIVE is not None:
            rows = _row_range(key, self.shape[0])
            if rows is not None:
                name = "O" if self.ndim == 2 else "L"
                nbytes = np.asarray(self.view(np.ndarray)[key]).nbytes  # what it writes
                _ACTIVE.transfers.append(("store", name, rows, len(_ACTIVE.steps), nbytes))
        with _as_learners("cast"):
            self.view(np.ndarray)[key] = _plain(value)  # not via __getitem__: no read

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        tags = [_tag(x) for x in inputs]
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_plain(o) for o in out)
        with _as_learners(ufunc.__name__):
            result = getattr(ufunc, method)(*(_plain(x) for x in inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        if ufunc is np.matmul and method == "__call__":
            if _ACTIVE is not None:
                _ACTIVE.matmul(tags)
            return result
        tile_tags = [(t, x) for t, x in zip(tags, inputs)
                     if t is not None and t[0] == "tile"]
        if (method == "__call__" and len(tile_tags) == 1 and isinstance(result, np.ndarray)
                and result.shape == np.shape(tile_tags[0][1])):
            result = result.view(_Traced)  # e.g. scale * Q_i is still the tile Q_i
            result._fe = tile_tags[0][0]
        return result

    def dot(self, b, out=None):  # the method does not dispatch through __array_function__
        if _ACTIVE is not None:
            _ACTIVE.matmul([self._fe, _tag(b)])
        with _as_learners("dot"):
            return np.dot(self.view(np.ndarray), _plain(b), out=_plain(out))

    def __array_function__(self, func, types, args, kwargs):
        plain_args, plain_kwargs = _plain(args), {k: _plain(v) for k, v in kwargs.items()}
        if func in (np.dot, np.inner, np.tensordot, np.einsum, np.matmul) and _ACTIVE is not None:
            _ACTIVE.matmul([_tag(a) for a in args])
        with _as_learners(func.__name__):
            result = func(*plain_args, **plain_kwargs)
        if func in (np.zeros_like, np.empty_like, np.ones_like, np.full_like, np.copy) \
                and isinstance(result, np.ndarray):
            result = result.view(_Traced)
            # made like Q, K or V itself: an output in HBM; made like a tile: on chip, untraced
            src = _tag(args[0]) if args else None
            result._fe = ("new", None) if src is not None and src[0] == "root" else None
        return result


def _traced(a: np.ndarray, name: str) -> _Traced:
    t = np.array(a).view(_Traced)
    t._fe = ("root", name)
    return t


def _function_code(fn):
    import functools

    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__wrapped__", fn)
    return getattr(fn, "__code__", None)


def _snapshot(frame, arrays: set) -> dict:
    """Copies of the statistics among the frame's locals; adds the names of its own float
    arrays (not Q, K, V or their tiles) to ``arrays``."""
    snap = {}
    for name, v in frame.f_locals.items():
        if not isinstance(v, np.ndarray) or v.dtype.kind != "f":
            continue
        tag = v._fe if isinstance(v, _Traced) else None
        if tag is None or tag[0] == "new":
            arrays.add(name)
        if name in STATE_NAMES:
            snap[name] = np.array(v, np.float64)
    return snap


def _where(filename: str, lineno: int) -> str:
    """"Cell In[5], line 12" for a notebook cell (as IPython's tracebacks say), else the file."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    try:
        label = shell.compile.format_code_name(filename) if shell is not None else None
    except Exception:  # noqa: BLE001 - a label is a nicety
        label = None
    return f"{label[0]} {label[1]}, line {lineno}" if label else f"{filename}, line {lineno}"


def _learner_error(exc: BaseException, code, steps: int) -> LearnerError:
    """``exc`` at the innermost line of the learner's own code (not NumPy's, not this
    package's); at the function's ``def`` line when it never ran (e.g. a wrong signature)."""
    frames = list(traceback.walk_tb(exc.__traceback__))
    mine = [(f, n) for f, n in frames if not _is_library(f.f_code.co_filename)]
    if mine:
        frame, lineno = mine[-1]
        filename, g = frame.f_code.co_filename, frame.f_globals
    elif code is not None:
        filename, lineno, g = code.co_filename, code.co_firstlineno, None
    else:
        frame, lineno = frames[-1]
        filename, g = frame.f_code.co_filename, frame.f_globals
    source = linecache.getline(filename, lineno, g).strip()
    message = str(exc) or "(no message)"
    return LearnerError(type(exc).__name__, message, _where(filename, lineno), source, steps)


def _record(fn, Q, K, V, block_q, block_k, causal):
    global _ACTIVE
    Nq, Nk = Q.shape[0], K.shape[0]
    rec = _Recorder(Nq, Nk, block_q, block_k)
    code = _function_code(fn)

    def local(frame, event, arg):
        if event in ("line", "return"):
            rec.snapshots.append((len(rec.steps), _snapshot(frame, rec.arrays)))
        return local

    def global_(frame, event, arg):
        return local if frame.f_code is code else None

    previous = sys.gettrace()
    _ACTIVE = rec
    error = None
    out = None
    try:
        with _trace.listen(rec):
            if code is not None:
                sys.settrace(global_)
            try:
                args = (_traced(Q, "Q"), _traced(K, "K"), _traced(V, "V"), block_q, block_k)
                # a kernel written without the causal argument can still be compared unmasked
                out = fn(*args, causal=True) if causal else fn(*args)
            finally:
                sys.settrace(previous)
    except Exception as exc:  # noqa: BLE001 - the learner's error is the finding
        error = exc
    finally:
        _ACTIVE = None
    return rec, out, error, code


# ----------------------------------------------------------------------------------------
# The learner's state after each step
# ----------------------------------------------------------------------------------------


def _state_from(snap: dict, rows, Nq, order):
    r0, r1 = rows
    n = r1 - r0
    full = {k: snap[k][r0:r1] for k in ("m", "l", "O") if k in snap and snap[k].shape[:1] == (Nq,)}
    tile = {}
    for key, names in (("m", ("m_i",)), ("l", ("l_i",)), ("O", ("O_i", "acc"))):
        for name in names:
            if name in snap and snap[name].shape[:1] == (n,):
                tile[key] = snap[name]
                break
    if order == "kv_outer" and {"m", "l"} <= set(full):
        state = dict(full, O_normalized=True)
        if "O" not in state and "O" in tile:
            state["O"], state["O_normalized"] = tile["O"], False
        return state
    if {"m", "l"} <= set(tile):
        return dict(tile, O_normalized=False)
    if {"m", "l"} <= set(full):
        return dict(full, O_normalized=True)
    return None


def _is_reset(state) -> bool:
    """True for statistics (re)initialized for a Q tile, or half way through that: after any
    computed step some row has a finite m_i and a positive l_i."""
    return state is None or bool(np.all(np.isneginf(state["m"])) or np.all(state["l"] == 0)
                                 or ("O" in state and not np.any(state["O"])))


def _attach_states(rec: _Recorder, Nq: int, order: str) -> None:
    """State after step k: the last snapshot taken after step k began and before step k + 1
    did, skipping those where the statistics were already reset for the next Q tile."""
    by_step: dict[int, list[dict]] = {}
    for n, snap in rec.snapshots:
        by_step.setdefault(n, []).append(snap)
    for k, step in enumerate(rec.steps, start=1):
        chosen = None
        for snap in reversed(by_step.get(k, [])):
            state = _state_from(snap, step.q, Nq, order)
            if state is None:
                continue
            if chosen is None:
                chosen = state
            if not _is_reset(state):
                chosen = state
                break
        step.state = chosen


# ----------------------------------------------------------------------------------------
# The reference, and the reference with one known mistake
# ----------------------------------------------------------------------------------------


def reference_steps(Q, K, V, Br, Bc, causal, order, scale, *, rescale_l=True, rescale_O=True,
                    diagonal=0) -> list[Step]:
    """The steps the reference kernel computes in ``order``, each with its exact state.

    The keywords replay one known mistake instead: ``rescale_l`` / ``rescale_O`` False leave
    l_i / O_i unscaled by alpha = exp(m_i - m_new); ``diagonal=k`` lets query r see the keys
    c <= r + k (on the tiles the reference computes)."""
    Nq, Nk = Q.shape[0], K.shape[0]
    Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
    mask = TileMask(Nq, Nk, Br, Bc, causal)
    Q64, K64, V64 = (np.asarray(a, np.float64) for a in (Q, K, V))
    m = np.full(Nq, -np.inf)
    l = np.zeros(Nq)
    O = np.zeros((Nq, Q.shape[1]))
    pairs = ([(i, j) for i in range(Tr) for j in range(Tc)] if order == "q_outer"
             else [(i, j) for j in range(Tc) for i in range(Tr)])
    steps = []
    for i, j in pairs:
        if mask.skip(i, j):
            continue
        q, k = (i * Br, min((i + 1) * Br, Nq)), (j * Bc, min((j + 1) * Bc, Nk))
        S = scale * (Q64[q[0]:q[1]] @ K64[k[0]:k[1]].T)
        if causal:
            S = np.where(np.arange(*k)[None, :] <= np.arange(*q)[:, None] + diagonal, S, -np.inf)
        m_old = m[q[0]:q[1]]
        m_new = np.maximum(m_old, S.max(axis=1))
        safe = np.where(np.isneginf(m_new), 0.0, m_new)
        P = np.exp(S - safe[:, None])
        alpha = np.exp(np.where(np.isneginf(m_old), -np.inf, m_old - safe))
        l[q[0]:q[1]] = (alpha * l[q[0]:q[1]] if rescale_l else l[q[0]:q[1]]) + P.sum(axis=1)
        O[q[0]:q[1]] = ((alpha[:, None] * O[q[0]:q[1]] if rescale_O else O[q[0]:q[1]])
                        + P @ V64[k[0]:k[1]])
        m[q[0]:q[1]] = m_new
        steps.append(Step(q, k, k, {"m": m[q[0]:q[1]].copy(), "l": l[q[0]:q[1]].copy(),
                                     "O": O[q[0]:q[1]].copy(), "O_normalized": False}))
    return steps


# name: (replay settings, the hint in the paper's names). In a hint, {ratio} becomes ", yours /
# the reference is 2.828 = sqrt(d) for d = 8" where m_i shows that ratio on every row.
_MISTAKES = {
    "no scale": ({"scale": lambda d: 1.0},
                 " (S_ij is not scaled by 1/sqrt(d){ratio}; S_ij = Q_i K_j^T / sqrt(d))"),
    "scale twice": ({"scale": lambda d: 1.0 / d},
                    " (1/sqrt(d) is applied twice{ratio}; S_ij = Q_i K_j^T / sqrt(d), scaled "
                    "once)"),
    "no rescale of l_i and O_i": ({"rescale_l": False, "rescale_O": False},
                                  " (no rescale of l_i and O_i by alpha = exp(m_i - m_new): "
                                  "l_i = alpha * l_i + rowsum(P_ij), O_i = alpha * O_i + "
                                  "P_ij V_j)"),
    "no rescale of l_i": ({"rescale_l": False},
                          " (no rescale of l_i by alpha = exp(m_i - m_new): "
                          "l_i = alpha * l_i + rowsum(P_ij))"),
    "no rescale of O_i": ({"rescale_O": False},
                          " (no rescale of O_i by alpha = exp(m_i - m_new): "
                          "O_i = alpha * O_i + P_ij V_j)"),
    "diagonal c < r": ({"diagonal": -1},
                       " (the causal mask is off by one: query r sees the keys c <= r, its "
                       "own key c = r included; yours hides c = r too, as c < r does)"),
    "diagonal c <= r + 1": ({"diagonal": 1},
                            " (the causal mask is off by one: query r sees the keys c <= r; "
                            "yours also shows it key c = r + 1)"),
}
_RATIOS = {"no scale": "sqrt(d)", "scale twice": "1/sqrt(d)"}  # yours / the reference of m_i


class _Mistakes:
    """The reference replayed with each known mistake, in the learner's loop order (computed
    when first needed: only a comparison that finds a difference asks)."""

    def __init__(self, cmp: TraceComparison):
        self.cmp, self._traces = cmp, None

    def traces(self) -> dict[str, list[Step]]:
        if self._traces is None:
            c = self.cmp
            d = c.Q.shape[1]
            self._traces = {}
            for name, (settings, _) in _MISTAKES.items():
                if "diagonal" in settings and not c.causal:
                    continue
                kw = {"scale": 1.0 / math.sqrt(d)} | {
                    k: (v(d) if callable(v) else v) for k, v in settings.items()}
                self._traces[name] = reference_steps(c.Q, c.K, c.V, c.block_q, c.block_k,
                                                     c.causal, c.order, **kw)
        return self._traces

    def at_step(self, k: int, mine: Step, what: str) -> str | None:
        """The mistake whose replay gives the learner's ``what`` at step ``k`` on every row of
        the tile (of several, the one that also gives most of the other statistics)."""
        best = None
        for name, steps in self.traces().items():
            if k > len(steps) or (steps[k - 1].q, steps[k - 1].k) != (mine.q, mine.k):
                continue
            differ = row_differences(mine.state, steps[k - 1].state)
            if what not in differ or differ[what].any():
                continue
            score = sum(not v.any() for v in differ.values())
            if best is None or score > best[0]:
                best = (score, name)
        return best and best[1]

    def at_end(self, O) -> str | None:
        """The mistake whose replay ends with the learner's O."""
        for name, steps in self.traces().items():
            O_alt, _ = _final(self.cmp, steps)
            if O_alt.shape == O.shape and _close(O, O_alt).all():
                return name
        return None

    def hint(self, name: str, mine=None, ref=None) -> str:
        """The mistake's hint; with m_i (``mine``, ``ref``) the ratio that shows a scale."""
        ratio = _ratio(mine, ref) if mine is not None and name in _RATIOS else None
        text = (f", yours / the reference is {ratio:.4g} = {_RATIOS[name]} for d = "
                f"{self.cmp.Q.shape[1]}" if ratio is not None else "")
        return _MISTAKES[name][1].format(ratio=text)


def _ratio(mine, ref) -> float | None:
    """yours / the reference, when it is one number for every row where both are finite."""
    mine, ref = np.asarray(mine, np.float64), np.asarray(ref, np.float64)
    ok = np.isfinite(mine) & np.isfinite(ref) & (np.abs(ref) > 1e-6)
    if not ok.any():
        return None
    r = mine[ok] / ref[ok]
    return float(np.median(r)) if np.allclose(r, np.median(r), rtol=1e-3) else None


# ----------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------


def _tile_text(step: Step, Br, Bc) -> str:
    i, j = step.pair(Br, Bc)
    return (f"tile pair (i={i}, j={j}): Q rows {step.q[0]}..{step.q[1] - 1}, "
            f"K/V rows {step.k[0]}..{step.k[1] - 1}")


def _compare_steps(mine, ref, cmp: TraceComparison, mistakes: _Mistakes,
                   states_until: int | None = None) -> Divergence | None:
    """The first step where ``mine`` leaves ``ref``: its tile, then m_i, l_i, O_i. Values are
    compared up to step ``states_until`` (all when None)."""
    Br, Bc = cmp.block_q, cmp.block_k
    for k, (a, b) in enumerate(zip_longest(mine, ref), start=1):
        if a is None:
            return Divergence(k, "tile", (), f"step {k}: your kernel computes no more tiles; "
                              f"the reference computes {_tile_text(b, Br, Bc)}"
                              f"{_missing_hint(b, mine, cmp)}")
        if b is None:
            hint = (" (it lies wholly above the causal diagonal: skip it)" if cmp.causal
                    and a.k[0] > a.q[1] - 1 else "")
            return Divergence(k, "tile", (), f"step {k}: your kernel computes "
                              f"{_tile_text(a, Br, Bc)}, which the reference never does{hint}")
        if (a.q, a.k) != (b.q, b.k):
            if cmp.causal and a.k[0] > a.q[1] - 1:
                hint = " (yours lies wholly above the causal diagonal: skip it)"
            else:
                hint = _missing_hint(b, mine, cmp)
            return Divergence(k, "tile", (), f"step {k}: the reference computes "
                              f"{_tile_text(b, Br, Bc)}; yours computes "
                              f"{_tile_text(a, Br, Bc)}{hint}")
        if a.v is not None and a.v != a.k:
            return Divergence(k, "V tile", (), f"step {k}: P_ij @ V_j used V rows "
                              f"{a.v[0]}..{a.v[1] - 1}, but S_ij used K rows "
                              f"{a.k[0]}..{a.k[1] - 1}: K_j and V_j must be the same tile")
        if a.state is None or (states_until is not None and k > states_until):
            continue
        for what, bad in row_differences(a.state, b.state).items():
            if bad.any():
                return _value_divergence(k, what, a, b, bad, cmp, ref, mistakes)
    return None


def _value_divergence(k, what, a: Step, b: Step, bad, cmp, ref, mistakes) -> Divergence:
    rows = np.arange(*a.q)[bad]
    gap = gap_text(_values(a.state, what), _values(b.state, what), bad, a.q[0])
    name = mistakes.at_step(k, a, what)
    if name is not None:
        hint = mistakes.hint(name, a.state["m"], b.state["m"]) if what == "m_i" \
            else mistakes.hint(name)
    else:
        hint = _generic_hint(k, what, a, b, bad, cmp, ref)
    return Divergence(k, what, tuple(int(r) for r in rows),
                      f"step {k}: {what} of rows {_ranges(rows)} differ ({gap}){hint}")


def _generic_hint(k, what, a, b, bad, cmp, ref) -> str:
    """The formula to check, when no known mistake gives the learner's values."""
    if what == "m_i":
        if cmp.causal and a.k[1] - 1 > a.q[0]:
            return " (the causal mask: query r sees key c only when c <= r)"
        return " (m_new = max(m_i, rowmax(S_ij)), S_ij = Q_i K_j^T / sqrt(d))"
    m_prev = _previous_m(ref, k - 1, b.q)
    moved = m_prev is not None and bool(np.any(
        (~np.isclose(m_prev, b.state["m"]) & np.isfinite(m_prev))[bad]))
    if what == "l_i":
        return (" (no rescale of l_i by alpha = exp(m_i - m_new)? l_i = alpha * l_i + "
                "rowsum(P_ij))" if moved else " (l_i = alpha * l_i + rowsum(P_ij), "
                "alpha = exp(m_i - m_new))")
    return (" (no rescale of O_i by alpha = exp(m_i - m_new)?)" if moved
            else " (O_i = alpha * O_i + P_ij @ V_j)")


def _missing_hint(b: Step, mine: list[Step], cmp) -> str:
    """Why the learner may lack the reference's tile ``b``."""
    Br, Bc, Nq, Nk = cmp.block_q, cmp.block_k, cmp.Q.shape[0], cmp.K.shape[0]
    if any((s.q, s.k) == (b.q, b.k) for s in mine):
        return " (your kernel computes it later: another loop order?)"
    if b.k[1] == Nk and Nk % Bc and not any(s.k == b.k for s in mine):
        return " (the last, ragged K/V tile, cut at Nk: loop over ceil(Nk / Bc) tiles)"
    if b.q[1] == Nq and Nq % Br and not any(s.q == b.q for s in mine):
        return " (the last, ragged Q tile, cut at Nq: loop over ceil(Nq / Br) tiles)"
    if cmp.causal and b.k[1] - 1 > b.q[0]:
        return (" (it is cut by the causal diagonal: some of its rows see some of its keys, so"
                " it is computed with a mask, not skipped)")
    return " (your kernel never computes it)"


def _previous_m(ref, upto, q):
    """m of Q rows ``q`` before reference step ``upto`` (0-based), None before any."""
    for s in reversed(ref[:upto]):
        if s.q == q:
            return s.state["m"]
    return None


def _compare_end(cmp: TraceComparison, ref, mistakes: _Mistakes) -> Divergence | None:
    k = len(ref) + 1
    O_ref, L_ref = _final(cmp, ref)
    try:
        O, L = (np.asarray(x, np.float64) for x in (cmp.O, cmp.L))
    except Exception:  # noqa: BLE001
        return Divergence(k, "O", (), f"at the end: your function returned {type(cmp.O)!r} "
                          "and not (O, L)")
    if O.shape != O_ref.shape or L.shape != L_ref.shape:
        return Divergence(k, "O", (), f"at the end: your O, L have shapes {O.shape}, "
                          f"{L.shape}; the reference's {O_ref.shape}, {L_ref.shape}")
    bad = ~_close(O, O_ref)
    if bad.any():
        rows = np.flatnonzero(bad)
        name = mistakes.at_end(O)
        hint = mistakes.hint(name) if name else " (O_i = O_i / l_i after the last tile)"
        return Divergence(k, "O", tuple(int(r) for r in rows),
                          f"at the end (after step {k - 1}): O of rows {_ranges(rows)} "
                          f"differ ({gap_text(O, O_ref, bad)}){hint}")
    bad = ~_close(L, L_ref)
    if bad.any():
        rows = np.flatnonzero(bad)
        return Divergence(k, "L", tuple(int(r) for r in rows),
                          f"at the end (after step {k - 1}): L of rows {_ranges(rows)} "
                          f"differ ({gap_text(L, L_ref, bad)}) (L_i = m_i + log(l_i), the "
                          "natural log)")
    return None


def _final(cmp, ref):
    Nq, d = cmp.Q.shape
    O, L = np.zeros((Nq, d)), np.full(Nq, -np.inf)
    for s in ref:  # the last state of each Q tile is its final one
        q0, q1 = s.q
        O[q0:q1] = _normalized(s.state)
        with np.errstate(divide="ignore"):
            L[q0:q1] = s.state["m"] + np.log(s.state["l"])
    return O, L


def _common_prefix(a: list[Step], b: list[Step]) -> int:
    n = 0
    for x, y in zip(a, b):
        if (x.q, x.k) != (y.q, y.k):
            break
        n += 1
    return n


# the names the comparison reads the statistics from (see _state_from)
_WANTED = ("m_i", "l_i", "O_i", "acc", "m", "l", "O")


def _coverage_notes(rec: _Recorder, steps: list[Step]) -> list[str]:
    """What was not compared, and why, in plain words (empty when everything was)."""
    if not steps:
        return ["No tile product Q_i @ K_j.T was seen: were Q, K, V converted to plain arrays "
                "(np.asarray)? Only the result is compared"]
    if rec.via_hook:
        return []
    found = [n for n in _WANTED if n in rec.arrays]
    yours = ", ".join(sorted(rec.arrays, key=str.lower)) or "none"
    if all(s.state is None for s in steps):
        return [f"Only the tiles and the final O, L were compared, not m_i, l_i, O_i step by "
                f"step: the comparison reads them from your local variables named m_i, l_i, O_i "
                f"(Q outer) or m, l, O (Algorithm 1, K/V outer) and found "
                f"{'only ' + ', '.join(found) if found else 'none of these names'} (your "
                f"arrays: {yours})"]
    if not any("O" in s.state for s in steps if s.state is not None):
        return ["O_i was compared only at the end: step by step the comparison reads it from a "
                f"local variable named O_i (or acc; O in Algorithm 1) and found none (your "
                f"arrays: {yours})"]
    return []


def compare_trace(fn, Q, K, V, block_q, block_k, causal=False) -> TraceComparison:
    """Run ``fn(Q, K, V, block_q, block_k[, causal=True]) -> (O, L)`` traced, replay it beside
    the reference, and return a :class:`TraceComparison`: ``.first_divergence`` is None when
    they agree, else the exception ``fn`` raised (with the line of ``fn``'s code) or the first
    step where they differ and what differs there; ``.verdict`` says it in words, with what was
    not compared."""
    Q, K, V = (np.asarray(a) for a in (Q, K, V))
    rec, out, error, code = _record(fn, Q, K, V, block_q, block_k, causal)
    steps = rec.steps
    # the comparison's own arithmetic meets the learner's -inf and NaN: findings, not warnings
    with np.errstate(all="ignore"):
        scale = 1.0 / math.sqrt(Q.shape[1])
        refs = {o: reference_steps(Q, K, V, block_q, block_k, causal, o, scale)
                for o in ("q_outer", "kv_outer")}
        order = max(refs, key=lambda o: (_common_prefix(steps, refs[o]), o == "q_outer"))
        ref = refs[order]
        if not rec.via_hook:
            _attach_states(rec, Q.shape[0], order)
        cmp = TraceComparison(None, steps, ref, order, Q, K, V, block_q, block_k, causal,
                              transfers=rec.transfers)
        mistakes = _Mistakes(cmp)
        if error is not None:
            k = len(steps)
            cmp.error, cmp.exception = _learner_error(error, code, k), error
            # the state of the step that raised is half made: its values are not compared
            before = _compare_steps(steps, ref[:k], cmp, mistakes, states_until=k - 1)
            where = (f"during step {k}, {_tile_text(steps[-1], block_q, block_k)}" if k
                     else "before its first tile product S_ij = Q_i K_j^T")
            also = f"; also {before}" if before is not None else ""
            cmp.first_divergence = Divergence(max(k, 1), "error", (),
                                              f"{cmp.error} ({where}){also}", cmp.error)
            return cmp
        cmp.notes.extend(_coverage_notes(rec, steps))
        cmp.O, cmp.L = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
        cmp.first_divergence = (_compare_steps(steps, ref, cmp, mistakes) if steps else None) \
            or _compare_end(cmp, ref, mistakes)
    return cmp


def divergence_hint(fn, Q, K, V, block_q, block_k, causal=False) -> str | None:
    """One line for a grader's failure message: where ``fn`` first leaves the reference and
    how to open the stepper there; None when the traces agree (or ``fn`` cannot be traced)."""
    try:
        div = compare_trace(fn, Q, K, V, block_q, block_k, causal=causal).first_divergence
    except Exception:  # noqa: BLE001 - a hint must never hide the grader's own message
        return None
    if div is None:
        return None
    Nq, Nk, d = np.shape(Q)[0], np.shape(K)[0], np.shape(Q)[1]
    return (f"{div} - open the stepper at step {div.step}: compare_trace(flash_forward, Q, K, "
            f"V, {block_q}, {block_k}{', causal=True' if causal else ''}) with Q: ({Nq}, {d}), "
            f"K, V: ({Nk}, {d}) (from flashedu.viz import compare_trace)")
