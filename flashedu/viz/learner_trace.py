"""Trace a learner's own NumPy ``flash_forward`` and find the first step where it leaves the
reference (no widgets here; :mod:`flashedu.viz.compare_view` shows the result as a stepper).

``compare_trace(fn, Q, K, V, block_q, block_k, causal=False)`` runs ``fn`` once and records:

- its **steps**: each product S_ij = Q_i K_j^T of a Q tile with a K tile (which rows of Q and
  of K), and which rows of V the following P_ij V_j used;
- its **state after each step**: m_i, l_i and O_i of the step's rows, read from the function's
  own local variables (the paper's names: ``m_i``, ``l_i``, ``O_i``; in the K/V-outer order of
  Algorithm 1, the HBM arrays ``m``, ``l``, ``O``);
- what it returns, (O, L).

How: Q, K and V are handed over as an ndarray subclass that notes which rows each slice reads
and which tiles meet in a matrix product (``np.zeros_like(Q)`` stays traced, so the writes to O
are seen too), and a line tracer (``sys.settrace``) on the function's own frame copies the
statistics after every line. Code that calls this package's kernels without a trace (e.g.
:func:`flashedu.tiled.flash_forward` itself) reports its steps and values through the hook of
:mod:`flashedu.trace` instead.

The reference is the online softmax replayed in float64 over the same loop order (Q outer as
FlashAttention-2, or K/V outer as the paper's Algorithm 1, whichever the learner's steps follow),
with the tiles the reference kernel computes (under ``causal``, tiles wholly above the diagonal
are skipped; the last tiles are cut at Nq and Nk).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from itertools import zip_longest

import numpy as np

from .. import trace as _trace
from ..tiled import TileMask

STATE_NAMES = ("m_i", "l_i", "O_i", "m", "l", "O", "acc", "m_new", "l_new")


@dataclass
class Step:
    """One S_ij = Q_i K_j^T: rows [q0, q1) of Q against rows [k0, k1) of K."""

    q: tuple[int, int]
    k: tuple[int, int]
    v: tuple[int, int] | None = None  # rows of V in the P_ij V_j that followed
    state: dict | None = None  # "m", "l" (rows,), "O" (rows, d), "O_normalized": bool

    def pair(self, Br: int, Bc: int) -> tuple[int, int]:
        return self.q[0] // Br, self.k[0] // Bc


@dataclass(frozen=True)
class Divergence:
    """Where the learner's trace first leaves the reference."""

    step: int  # 1-based index of the computed step (len(steps) + 1: at the end)
    what: str  # "tile", "V tile", "m_i", "l_i", "O_i", "O", "L", "error"
    rows: tuple[int, ...]  # query rows that differ (empty for a tile difference)
    message: str

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
    notes: list[str] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return self.first_divergence is None

    def __repr__(self) -> str:
        verdict = ("the traces agree at every step and at the end" if self.agrees
                   else str(self.first_divergence))
        return (f"<TraceComparison: {len(self.steps)} steps of yours, "
                f"{len(self.reference_steps)} of the reference ({self.order}): {verdict}>")

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
        self.loads: list[tuple] = []
        self.stores: list[tuple] = []
        self.snapshots: list[tuple[int, dict]] = []  # (steps started so far, locals)
        self.via_hook = False

    # --- the flashedu.trace hook (package kernels called without a trace) ---------------
    def _rows(self, name, tile):
        size, n = (self.Br, self.Nq) if name not in ("K", "V") else (self.Bc, self.Nk)
        return tile * size, min((tile + 1) * size, n)

    def load(self, name, tile, array):
        self.via_hook = True
        self.loads.append((name, self._rows(name, tile), len(self.steps)))

    def store(self, name, tile, array):
        self.via_hook = True
        rows = self._rows(name, tile)
        self.stores.append((name, rows, len(self.steps)))
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
    views, e.g. ``K_j.T``); ("new", None) for an array made ``*_like`` a traced one (the
    learner's O)."""

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
                _ACTIVE.loads.append((tag[1], rows, len(_ACTIVE.steps)))
            out._fe = ("tile", tag[1], rows) if rows is not None else None
        elif tag[0] == "new":
            out._fe = None
        return out

    def __setitem__(self, key, value):
        tag = self._fe
        if tag is not None and tag[0] == "new" and _ACTIVE is not None:
            rows = _row_range(key, self.shape[0])
            if rows is not None:
                name = "O" if self.ndim == 2 else "L"
                _ACTIVE.stores.append((name, rows, len(_ACTIVE.steps)))
        super().__setitem__(key, _plain(value))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        tags = [_tag(x) for x in inputs]
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_plain(o) for o in out)
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
        return np.dot(self.view(np.ndarray), _plain(b), out=_plain(out))

    def __array_function__(self, func, types, args, kwargs):
        plain_args, plain_kwargs = _plain(args), {k: _plain(v) for k, v in kwargs.items()}
        if func in (np.dot, np.inner, np.tensordot, np.einsum, np.matmul) and _ACTIVE is not None:
            _ACTIVE.matmul([_tag(a) for a in args])
        result = func(*plain_args, **plain_kwargs)
        if func in (np.zeros_like, np.empty_like, np.ones_like, np.full_like, np.copy) \
                and isinstance(result, np.ndarray):
            result = result.view(_Traced)
            result._fe = ("new", None)
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


def _snapshot(frame) -> dict:
    snap = {}
    for name in STATE_NAMES:
        v = frame.f_locals.get(name)
        if isinstance(v, np.ndarray) and v.dtype.kind == "f":
            snap[name] = np.array(v, np.float64)
    return snap


def _record(fn, Q, K, V, block_q, block_k, causal):
    global _ACTIVE
    Nq, Nk = Q.shape[0], K.shape[0]
    rec = _Recorder(Nq, Nk, block_q, block_k)
    code = _function_code(fn)

    def local(frame, event, arg):
        if event in ("line", "return"):
            rec.snapshots.append((len(rec.steps), _snapshot(frame)))
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
    return rec, out, error


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
# The reference
# ----------------------------------------------------------------------------------------


def reference_steps(Q, K, V, Br, Bc, causal, order, scale) -> list[Step]:
    """The steps the reference kernel computes in ``order``, each with its exact state."""
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
        S = mask.apply(i, j, scale * (Q64[q[0]:q[1]] @ K64[k[0]:k[1]].T))
        m_old = m[q[0]:q[1]]
        m_new = np.maximum(m_old, S.max(axis=1))
        safe = np.where(np.isneginf(m_new), 0.0, m_new)
        P = np.exp(S - safe[:, None])
        alpha = np.exp(np.where(np.isneginf(m_old), -np.inf, m_old - safe))
        l[q[0]:q[1]] = alpha * l[q[0]:q[1]] + P.sum(axis=1)
        O[q[0]:q[1]] = alpha[:, None] * O[q[0]:q[1]] + P @ V64[k[0]:k[1]]
        m[q[0]:q[1]] = m_new
        steps.append(Step(q, k, k, {"m": m[q[0]:q[1]].copy(), "l": l[q[0]:q[1]].copy(),
                                     "O": O[q[0]:q[1]].copy(), "O_normalized": False}))
    return steps


# ----------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------


def _ranges(rows) -> str:
    rows = sorted(rows)
    parts, start = [], None
    for a, b in zip(rows, rows[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}..{a}")
            start = None
    return ", ".join(parts)


def _close(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return np.zeros(b.shape[:1], bool)
    ok = np.isclose(a, b, rtol=2e-4, atol=2e-5) | (np.isneginf(a) & np.isneginf(b))
    return ok.reshape(ok.shape[0], -1).all(axis=1) if ok.ndim > 1 else ok


def _normalized(state):
    O, l = state["O"], state["l"]
    if state["O_normalized"]:
        return O
    with np.errstate(divide="ignore", invalid="ignore"):
        return O / np.where(l > 0, l, 1)[:, None]


def _tile_text(step: Step, Br, Bc) -> str:
    i, j = step.pair(Br, Bc)
    return (f"tile pair (i={i}, j={j}): Q rows {step.q[0]}..{step.q[1] - 1}, "
            f"K/V rows {step.k[0]}..{step.k[1] - 1}")


def _compare_steps(mine, ref, cmp: TraceComparison) -> Divergence | None:
    Br, Bc, Nq, Nk = cmp.block_q, cmp.block_k, cmp.Q.shape[0], cmp.K.shape[0]
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
        if a.state is None:
            continue
        rows = np.arange(*a.q)
        on_diagonal = cmp.causal and a.k[1] - 1 > a.q[0]
        m_prev = _previous_m(ref, k - 1, b.q)
        checks = [("m_i", a.state["m"], b.state["m"],
                   " (the causal mask: query r sees key c only when c <= r)" if on_diagonal
                   else " (m_new = max(m_i, rowmax(S_ij)))"),
                  ("l_i", a.state["l"], b.state["l"],
                   " (l_i = alpha * l_i + rowsum(P_ij), alpha = exp(m_i - m_new): is l_i "
                   "rescaled?)")]
        for what, mine_v, ref_v, hint in checks:
            bad = ~_close(mine_v, ref_v)
            if bad.any():
                return _value_divergence(k, what, rows[bad], mine_v, ref_v, hint)
        if "O" in a.state:
            ref_O = _normalized(b.state)
            ok = _close(_normalized(a.state), ref_O) | _close(a.state["O"], ref_O)
            if not ok.all():
                moved = m_prev is not None and np.any(
                    ~np.isclose(m_prev, b.state["m"])[~ok] & np.isfinite(m_prev)[~ok])
                hint = (" (no rescale of O_i by alpha = exp(m_i - m_new)?)" if moved
                        else " (O_i = alpha * O_i + P_ij @ V_j)")
                return Divergence(k, "O_i", tuple(int(r) for r in rows[~ok]),
                                  f"step {k}: O_i of rows {_ranges(list(rows[~ok]))} differ"
                                  f"{hint}")
    return None


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


def _value_divergence(k, what, bad_rows, mine_v, ref_v, hint) -> Divergence:
    first = int(bad_rows[0])
    idx = list(np.flatnonzero(~_close(mine_v, ref_v)))[0]
    return Divergence(k, what, tuple(int(r) for r in bad_rows),
                      f"step {k}: {what} of rows {_ranges([int(r) for r in bad_rows])} differ "
                      f"(row {first}: yours {float(mine_v[idx]):.5g}, the reference "
                      f"{float(ref_v[idx]):.5g}){hint}")


def _compare_end(cmp: TraceComparison, ref) -> Divergence | None:
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
        return Divergence(k, "O", tuple(int(r) for r in rows),
                          f"at the end (after step {k - 1}): O of rows {_ranges(list(rows))} "
                          "differ (O_i = O_i / l_i after the last tile)")
    bad = ~_close(L, L_ref)
    if bad.any():
        rows = np.flatnonzero(bad)
        return Divergence(k, "L", tuple(int(r) for r in rows),
                          f"at the end (after step {k - 1}): L of rows {_ranges(list(rows))} "
                          "differ (L_i = m_i + log(l_i), the natural log)")
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


def compare_trace(fn, Q, K, V, block_q, block_k, causal=False) -> TraceComparison:
    """Run ``fn(Q, K, V, block_q, block_k[, causal=True]) -> (O, L)`` traced, replay it beside
    the reference, and return a :class:`TraceComparison`: ``.first_divergence`` is None when
    they agree, else the first step where they differ and what differs there."""
    Q, K, V = (np.asarray(a) for a in (Q, K, V))
    rec, out, error = _record(fn, Q, K, V, block_q, block_k, causal)
    steps = rec.steps
    scale = 1.0 / math.sqrt(Q.shape[1])
    refs = {o: reference_steps(Q, K, V, block_q, block_k, causal, o, scale)
            for o in ("q_outer", "kv_outer")}
    order = max(refs, key=lambda o: (_common_prefix(steps, refs[o]), o == "q_outer"))
    ref = refs[order]
    if not rec.via_hook:
        _attach_states(rec, Q.shape[0], order)
    cmp = TraceComparison(None, steps, ref, order, Q, K, V, block_q, block_k, causal)
    if not steps and error is None:
        cmp.notes.append("no tile product Q_i @ K_j.T was seen: were Q, K, V converted to "
                         "plain arrays (np.asarray)? Only the result is compared")
    elif steps and all(s.state is None for s in steps):
        cmp.notes.append("m_i, l_i, O_i were not found among the function's local variables "
                         "(the paper's names): the steps' tiles and the result are compared")
    if error is not None:
        k = len(steps)
        div = _compare_steps(steps, ref[:k], cmp) if k else None
        cmp.first_divergence = div or Divergence(
            max(k, 1), "error", (), f"step {max(k, 1)}: your function raised "
            f"{type(error).__name__}: {error}")
        return cmp
    cmp.O, cmp.L = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    cmp.first_divergence = (_compare_steps(steps, ref, cmp) if steps else None) \
        or _compare_end(cmp, ref)
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
