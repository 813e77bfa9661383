"""See inside a learner's own GPU kernel: every load and store, program by program.

``trace_kernel(kernel, grid, *args, **constexprs)`` launches ``kernel`` as ``kernel[grid](*args,
**constexprs)`` would, on the CPU, and returns a :class:`KernelTrace`: for each program (Triton)
or thread block (numba) the loads and stores in order, each with the kernel's source line, the
(row, column) of every element it touched in the tensor it addresses, how many lanes its mask
switched off, and the lanes that fell outside that tensor (out of bounds).

- Triton: ``kernel`` is a ``@triton.jit`` function; it runs in Triton's interpreter
  (``TRITON_INTERPRET=1``, which ``import flashedu`` sets on a machine without a GPU). While it
  runs, the interpreter's four memory operations (``create_load``, ``create_masked_load``,
  ``create_store``, ``create_masked_store`` of ``InterpreterBuilder``) are wrapped: each sees
  the pointer block (addresses in bytes) and the mask, and the builder's ``grid_idx`` says
  which program runs (the interpreter runs them one after another). Addresses are mapped back
  to the torch tensors among the arguments, strides honoured; the tensors are named after the
  kernel's parameters.
- numba: ``kernel`` is a ``@cuda.jit`` kernel and ``grid`` is what goes between the brackets of
  ``kernel[grid, block]``, e.g. ``(4, 32)``. It runs in numba's CUDA simulator
  (``NUMBA_ENABLE_CUDASIM=1``), where every thread is a Python thread that carries its
  ``blockIdx``: each array argument is handed over as an ndarray subclass that notes every
  element read and write, and so is every ``cuda.shared.array`` (shared memory, a "tensor" of
  its own). A block's accesses between two ``cuda.syncthreads()`` at one source line are one
  record: the threads of a block run in no fixed order, so only that grouping is the same from
  run to run.

Out of bounds: a lane (mask on) whose address lies outside the tensor its access addresses is
flagged and never performed, neither by this module nor by the interpreter: it loads the load's
``other`` (0 without one) and its store is dropped. On a GPU such a lane reads or overwrites
whatever lies there, or faults; here the notebook stays alive and the record says where it
went. In numba's simulator an index out of range is recorded the same way and then left to the
simulator (NumPy raises IndexError for an index past the end, and wraps a negative one around,
where a GPU would read before the array).

An exception of the kernel is kept, not raised: ``trace.error`` says what and at which line of
the kernel, and the accesses before it are in the trace.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import math
import sys
import threading
from dataclasses import dataclass, field

import numpy as np

from .learner_trace import LearnerError, _learner_error, _ranges

KINDS = ("load", "store")


@dataclass(frozen=True)
class Operand:
    """A tensor the kernel reads or writes: an argument (global memory) or a shared array."""

    name: str
    shape: tuple
    space: str = "global"  # or "shared" (numba's cuda.shared.array, one per block)


@dataclass
class Access:
    """One load or store of a Triton program; for numba, a block's element reads (or writes) of
    one array at one source line between two cuda.syncthreads().

    ``elements`` are (row, column) in the tensor, in lane order (numba: thread by thread); a
    1-D tensor's element i is (i, 0), and a tensor of more dimensions is read as rows of its
    last dimension. ``outside`` and ``masked`` say where the out-of-bounds and the masked-off
    lanes point, as (row, column) as if the tensor's rows went on (row -1 is just before the
    first row); they are empty where that cannot be said."""

    program: tuple[int, int, int]
    kind: str  # "load" or "store"
    tensor: str | None  # the tensor it addresses; None when its addresses are near none
    line: int  # line of the kernel's source file (for a helper function: where it is called)
    elements: list[tuple[int, int]]
    masked_off: int = 0  # lanes whose mask was off (Triton)
    out_of_bounds: int = 0  # lanes outside ``tensor`` with their mask on: flagged, not done
    source: str = ""  # the text of ``line``
    outside: list[tuple[int, int]] = field(default_factory=list)
    masked: list[tuple[int, int]] = field(default_factory=list)
    into: tuple[str, ...] = ()  # other tensors that out-of-bounds lanes fall inside
    threads: int | None = None  # numba: how many threads of the block made these accesses


class KernelTrace:
    """What :func:`trace_kernel` recorded. ``programs`` lists every program id (Triton) or
    block index (numba) of the grid as (x, y, z), in the order they ran; ``tensors`` maps each
    traced tensor's name to its :class:`Operand`; ``error`` is the kernel's exception (None
    when the launch finished). Methods take a program as (x, y, z), (x,) or plain x."""

    def __init__(self, backend: str, kernel_name: str, grid: tuple, tensors: dict,
                 records: dict, block: tuple | None = None):
        self.backend = backend  # "triton" or "numba"
        self.kernel_name = kernel_name
        self.grid = grid  # programs (blocks) along x, y, z
        self.block = block  # numba: threads a block along x, y, z
        self.tensors: dict[str, Operand] = tensors
        self.programs: list[tuple[int, int, int]] = [tuple(int(i) for i in p)
                                                     for p in np.ndindex(*grid)]
        self._records: dict = records
        self.error: LearnerError | None = None
        self.exception: BaseException | None = None
        self.values: dict = {}  # tensor name -> the argument itself (its values after the launch)

    # ----- queries ---------------------------------------------------------------------------
    def program_id(self, program) -> tuple[int, int, int]:
        """``program`` as (x, y, z); ValueError when the grid has no such program."""
        p = (program,) if isinstance(program, (int, np.integer)) else tuple(program)
        p = tuple(int(i) for i in p) + (0,) * (3 - len(p))
        if len(p) != 3 or not all(0 <= i < n for i, n in zip(p, self.grid)):
            raise ValueError(f"program: {program!r} is not in the grid {self.grid_text()}")
        return p

    def accesses(self, program) -> list[Access]:
        """The loads and stores of ``program``, in order."""
        return list(self._records.get(self.program_id(program), ()))

    def all_accesses(self) -> list[Access]:
        return [a for p in self.programs for a in self._records.get(p, ())]

    def touched(self, program, tensor: str, kind: str | None = None) -> np.ndarray:
        """A boolean array of ``tensor``'s shape: the elements that ``program`` (every program
        when None) loaded (``kind="load"``), stored ("store") or either (None)."""
        if tensor not in self.tensors:
            raise ValueError(f"tensor: {tensor!r} is not traced here; the traced tensors are "
                             f"{', '.join(self.tensors)}")
        if kind not in KINDS + (None,):
            raise ValueError(f"kind: {kind!r}; expected 'load', 'store' or None (either)")
        shape = self.tensors[tensor].shape
        cols = shape[-1] if len(shape) >= 2 else 1
        out = np.zeros(math.prod(shape), dtype=bool)
        chosen = self.all_accesses() if program is None else self.accesses(program)
        for a in chosen:
            if a.tensor == tensor and kind in (None, a.kind) and a.elements:
                rc = np.asarray(a.elements)
                out[rc[:, 0] * cols + rc[:, 1]] = True
        return out.reshape(shape)

    def totals(self) -> dict[tuple[str, str], int]:
        """{(tensor, kind): elements loaded or stored over all programs} (an element touched
        twice counts twice; out-of-bounds lanes do not count)."""
        out: dict = {}
        for a in self.all_accesses():
            if a.tensor is not None:
                out[(a.tensor, a.kind)] = out.get((a.tensor, a.kind), 0) + len(a.elements)
        return out

    def compare(self, tensor: str, expected, tol: float = 1e-3) -> "StoreComparison":
        """Where ``tensor`` went wrong, element by element: its values after the launch
        against ``expected`` (same shape), and the first program, in the order they ran, whose
        stores wrote a wrong element (``|got - expected| > tol * (1 + |expected|)``, NaN
        wrong), with the access that stored it; elements no program stored are named apart.
        A kernel's output is right or wrong where a store put it: that store's program and
        line are where to look (``view()`` opens there)."""
        if tensor not in self.values:
            raise ValueError(f"tensor: {tensor!r} is not an argument of the traced launch; "
                             f"the traced tensors are {', '.join(self.values) or 'none'}")
        got = _as_float64(self.values[tensor])
        want = _as_float64(expected)
        if want.shape != got.shape:
            raise ValueError(f"expected: shape {tuple(want.shape)}, but {tensor} has shape "
                             f"{tuple(got.shape)}")
        if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol >= 0):
            raise ValueError(f"tol: {tol!r}; expected a number >= 0")
        with np.errstate(invalid="ignore"):
            gap = np.abs(got - want) / (1.0 + np.abs(want))
            same_inf = np.isinf(want) & (got == want)
        wrong = ~same_inf & ~(gap <= tol)  # NaN counts as wrong
        wrong2 = _as_rows(wrong)
        stored = _as_rows(self.touched(None, tensor, "store"))
        first = None
        for program in self.programs:
            for a in self.accesses(program):
                if a.kind != "store" or a.tensor != tensor or not a.elements:
                    continue
                rc = np.asarray(a.elements)
                bad = wrong2[rc[:, 0], rc[:, 1]]
                if bad.any():
                    first = (a, [tuple(int(x) for x in e) for e in rc[bad]])
                    break
            if first is not None:
                break
        never = np.argwhere(~stored & wrong2)
        finite = np.where(np.isfinite(gap) & wrong, gap, 0.0)
        return StoreComparison(self, tensor, int(wrong.sum()), wrong.size,
                               first[0] if first else None, first[1] if first else [],
                               [tuple(int(x) for x in e) for e in never],
                               float(finite.max()) if wrong.any() else 0.0,
                               bool(np.isnan(got[wrong]).any()), tol)

    def out_of_bounds(self) -> list[Access]:
        """The accesses with lanes out of bounds, in the order the programs ran."""
        return [a for a in self.all_accesses() if a.out_of_bounds]

    # ----- words -------------------------------------------------------------------------------
    def grid_text(self) -> str:
        used = [n for n in self.grid[:3]]
        while len(used) > 1 and used[-1] == 1:
            used.pop()
        return f"({', '.join(map(str, used))})" if len(used) > 1 else f"({used[0]},)"

    def program_name(self, program) -> str:
        """"program 2" (Triton) or "block 2" (numba); (x, y) or (x, y, z) for a grid of more
        dimensions."""
        p = self.program_id(program)
        dims = 3 if self.grid[2] > 1 else 2 if self.grid[1] > 1 else 1
        label = str(p[0]) if dims == 1 else f"({', '.join(map(str, p[:dims]))})"
        return f"{'block' if self.backend == 'numba' else 'program'} {label}"

    def describe(self, access: Access) -> str:
        """An access in plain words: which elements of which tensor, and where its
        out-of-bounds lanes went ("program 2 loaded 3 elements past the last row of K")."""
        loaded = {"load": "loaded", "store": "stored"}[access.kind]
        if self.backend == "numba":
            loaded = {"load": "read", "store": "wrote"}[access.kind]
        name = access.tensor or "no tensor"
        what = []
        if access.elements or not access.out_of_bounds:
            what.append(f"{_count(len(access.elements))} of {name}"
                        f"{_where_text(access.elements, self._shape(access.tensor))}")
        if access.out_of_bounds:
            what.append(self._outside_text(access))
        parts = [f"{self.program_name(access.program)} {loaded} " + " and ".join(what)]
        if access.masked_off:
            parts.append(f"{access.masked_off} lane{'s' if access.masked_off != 1 else ''} "
                         "masked off")
        if access.threads:
            parts.append(f"by {access.threads} thread{'s' if access.threads != 1 else ''}")
        text = "; ".join(parts)
        return f"{text} (line {access.line}: {access.source})" if access.source else text

    def notes(self) -> list[str]:
        """One sentence for each access with lanes out of bounds."""
        return [self.describe(a) for a in self.out_of_bounds()]

    def _shape(self, tensor):
        return self.tensors[tensor].shape if tensor in self.tensors else None

    def _outside_text(self, access: Access) -> str:
        """Where the out-of-bounds lanes of ``access`` went, e.g. "3 elements past the last
        row of K (rows 20..22 if K went on)"."""
        n, name = access.out_of_bounds, access.tensor
        if name is None:
            return f"{_count(n)} outside every tensor"
        shape = self._shape(name)
        rows = math.prod(shape[:-1]) if len(shape) >= 2 else (shape[0] if shape else 1)
        cols = shape[-1] if len(shape) >= 2 else 1
        unit = "row" if len(shape) >= 2 else "element"
        groups = {"before": [], "past": [], "between": []}
        for r, c in access.outside:
            key = "before" if r < 0 else "past" if r >= rows else "between"
            groups[key].append((r, c))
        if len(access.outside) < n:  # where they point is unknown (an unusual layout)
            return f"{_count(n)} outside {name}"
        # numba indexes by (row, column): a column out of range; Triton addresses memory: a
        # lane in a strided tensor's gap between two rows
        beside = "outside the columns" if self.backend == "numba" else "between the rows"
        words = {"before": f"before the first {unit} of {name}",
                 "past": (f"past the last row of {name}" if unit == "row"
                          else f"past the end of {name}"),
                 "between": f"{beside} of {name}"}
        texts = []
        for key, lanes in groups.items():
            if key == "between" and lanes:
                at = f" (columns {_ranges({c for _, c in lanes})}; {name} has {cols})"
            else:
                at = f" ({unit}s {_ranges({r for r, _ in lanes})} if {name} went on)"
            if lanes:
                texts.append(f"{_count(len(lanes))} {words[key]}{at}")
        into = (f"; these addresses lie inside {', '.join(access.into)}, which this access "
                "did not address" if access.into else "")
        return " and ".join(texts) + into

    @property
    def headline(self) -> str:
        """The kernel's exception first, else the out-of-bounds count, else a summary."""
        if self.error is not None:
            e = self.error
            source = f": {e.source}" if e.source else ""
            return f"your kernel raised {e.type}: {e.message} - at {e.where}{source}"
        bad = self.out_of_bounds()
        n = len(self.all_accesses())
        if bad:
            lanes = sum(a.out_of_bounds for a in bad)
            return (f"{_count(lanes)} out of bounds in {len(bad)} of {n} accesses; first: "
                    f"{self.describe(bad[0])}")
        unit = "blocks" if self.backend == "numba" else "programs"
        return f"{n} accesses in {len(self.programs)} {unit}, none out of bounds"

    def __repr__(self) -> str:
        how = "Triton interpreter" if self.backend == "triton" else "numba CUDA simulator"
        return f"<KernelTrace of {self.kernel_name} ({how}), grid {self.grid_text()}: " \
               f"{self.headline}>"

    __str__ = __repr__

    def view(self):
        """The trace as a widget: pick a program, step through its accesses."""
        from .kernel_view import KernelTraceView

        return KernelTraceView(self)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.view())


def _count(n: int) -> str:
    return f"{n} element{'s' if n != 1 else ''}"


def _as_float64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _as_rows(a: np.ndarray) -> np.ndarray:
    """As the trace counts elements: a 1-D tensor is one column, more dimensions are rows of
    the last."""
    if a.ndim == 0:
        return a.reshape(1, 1)
    return a.reshape(-1, 1) if a.ndim == 1 else a.reshape(-1, a.shape[-1])


@dataclass
class StoreComparison:
    """:meth:`KernelTrace.compare`'s answer. ``first`` is the first store (in the order the
    programs ran) that wrote a wrong element and ``elements`` its wrong (row, column)s;
    ``never_stored`` the wrong elements no program stored."""

    trace: KernelTrace
    tensor: str
    wrong: int  # wrong elements in all
    size: int
    first: Access | None
    elements: list[tuple[int, int]]
    never_stored: list[tuple[int, int]]
    largest_gap: float
    nan: bool
    tol: float

    @property
    def agrees(self) -> bool:
        return self.wrong == 0

    @property
    def verdict(self) -> str:
        t, name = self.trace, self.tensor
        if self.agrees:
            return f"{name} is right in all {self.size} elements (within {self.tol:g})."
        gap = "NaN among them" if self.nan else f"largest gap {self.largest_gap:.3g}"
        parts = [f"{name} is wrong in {self.wrong} of {self.size} elements ({gap})."]
        if t.error is not None:
            parts.insert(0, f"Your kernel raised {t.error.type}: {t.error.message} - at "
                         f"{t.error.where}.")
        if self.first is not None:
            a = self.first
            rows = _ranges({r for r, _ in self.elements})
            cols = _ranges({c for _, c in self.elements})
            parts.append(f"First: {t.program_name(a.program)} stored {len(self.elements)} wrong "
                         f"of the {len(a.elements)} it wrote there, rows {rows}, columns "
                         f"{cols} (line {a.line}: {a.source}).")
        if self.never_stored:
            rows = _ranges({r for r, _ in self.never_stored})
            parts.append(f"No program stored rows {rows} of {name}: they keep what the "
                         "tensor held before the launch.")
        return " ".join(parts)

    def __repr__(self) -> str:
        return f"<StoreComparison of {self.tensor}: {self.verdict}>"

    __str__ = __repr__

    def view(self):
        """The trace's view, opened at the program and the store that went wrong first, the
        wrong elements marked."""
        from .kernel_view import KernelTraceView

        return KernelTraceView(self.trace, program=self.first.program if self.first else None,
                               wrong={self.tensor: self.elements + self.never_stored},
                               at=self.first)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.view())


def _where_text(elements, shape) -> str:
    """" (rows 16..19, columns 0..15)" for a block of elements, else the rows only."""
    if not elements or shape is None:
        return ""
    rc = np.asarray(elements)
    rows, cols = set(rc[:, 0].tolist()), set(rc[:, 1].tolist())
    if len(shape) < 2:
        return f" (element{'s' if len(rows) > 1 else ''} {_ranges(rows)})"
    return (f" (row{'s' if len(rows) > 1 else ''} {_ranges(rows)}, "
            f"column{'s' if len(cols) > 1 else ''} {_ranges(cols)})")


# ----------------------------------------------------------------------------------------
# Where a tensor's elements lie in memory
# ----------------------------------------------------------------------------------------


class _Layout:
    """Byte offsets from a tensor's first element <-> its (row, column). Offsets divide out
    dimension by dimension, largest stride first, which is exact when no two elements share an
    address (then each stride exceeds the reach of the smaller ones)."""

    def __init__(self, name: str, shape, strides, itemsize: int):
        self.shape, self.itemsize = tuple(int(n) for n in shape), int(itemsize)
        self.strides = tuple(int(s) for s in strides)  # in elements
        self.cols = self.shape[-1] if len(self.shape) >= 2 else 1
        self.rows = math.prod(self.shape) // self.cols if self.cols else 0
        self._dims = sorted((k for k, n in enumerate(self.shape) if n > 1),
                            key=lambda k: -self.strides[k])
        reach = 0
        for k in reversed(self._dims):
            if self.strides[k] <= reach:
                raise ValueError(f"{name}: its elements overlap in memory (strides "
                                 f"{self.strides} for shape {self.shape}, e.g. from expand): "
                                 "pass a contiguous copy (.contiguous())")
            reach += (self.shape[k] - 1) * self.strides[k]
        self.extent = (reach + 1) * self.itemsize  # bytes from the first element to the last
        self._row_major = [math.prod(self.shape[k + 1:]) for k in range(len(self.shape))]
        self.row_stride, self.col_stride = self._rows_as_2d()

    def _rows_as_2d(self):
        """Strides of the (rows, cols) view in elements; row_stride None when the leading
        dimensions do not step through memory evenly (then no "as if it went on")."""
        cs = self.strides[-1] if len(self.shape) >= 2 and self.shape[-1] > 1 else 1
        lead = [k for k in range(len(self.shape) - (len(self.shape) >= 2)) if self.shape[k] > 1]
        if not lead:
            return max(self.cols * cs, 1), cs
        for a, b in zip(lead, lead[1:]):
            if self.strides[a] != self.strides[b] * self.shape[b]:
                return None, cs
        return self.strides[lead[-1]], cs

    def locate(self, offset: np.ndarray):
        """(inside, row, column) of each byte offset; row and column are meaningful inside."""
        e, rem = np.divmod(offset, self.itemsize)
        inside = rem == 0
        flat = np.zeros_like(e)
        for k in self._dims:
            i, e = np.divmod(e, self.strides[k])
            inside &= (i >= 0) & (i < self.shape[k])
            flat += i * self._row_major[k]
        inside &= e == 0
        return inside, flat // self.cols, flat % self.cols

    def virtual(self, offset: np.ndarray):
        """(row, column) of each byte offset as if the rows went on past the last (and before
        the first); None when the rows do not step evenly through memory, or when columns are
        the outer steps (column-major: there a row past the last is the next column's top)."""
        rs, cs = self.row_stride, self.col_stride
        if rs is None or cs <= 0 or rs < cs or (self.cols > 1 and rs < self.cols * cs):
            return None
        e = np.floor_divide(offset, self.itemsize)
        row = np.floor_divide(e, rs)
        return row, np.floor_divide(e - row * rs, cs)


def _pairs(rows, cols) -> list[tuple[int, int]]:
    return list(zip(np.asarray(rows).tolist(), np.asarray(cols).tolist()))


# ----------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------


class _TritonRecorder:
    """Maps each load's and store's addresses to the tensor arguments."""

    def __init__(self, fn, tensors: dict):
        self.code_name, self.filename = fn.__name__, fn.__code__.co_filename
        self.regions = [(name, t.data_ptr(), _Layout(name, t.shape, t.stride(),
                                                      t.element_size()))
                        for name, t in tensors.items()]
        self.records: dict = {}

    def _line(self):
        """The line of the kernel's own frame (the interpreter runs a rewritten copy of the
        kernel compiled under its file name, so the code object is matched by name and file)."""
        f = sys._getframe(2)
        while f is not None and not (f.f_code.co_name == self.code_name
                                     and f.f_code.co_filename == self.filename):
            f = f.f_back
        if f is None:
            return 0, ""
        return f.f_lineno, linecache.getline(self.filename, f.f_lineno, f.f_globals).strip()

    def _owner(self, addr: np.ndarray):
        """The tensor an access addresses: the one holding its lowest address (a tile that
        runs past the last row starts inside its tensor, whatever lies after it); else the
        nearest one that lowest address is past the end of, or just before."""
        low = int(addr.min())
        best = None
        for name, base, layout in self.regions:
            if layout.locate(np.array([low - base]))[0][0]:
                return name, base, layout
            gap = low - (base + layout.extent) if low >= base else base - low
            if gap <= max(layout.extent, 4096) and (best is None or gap < best[0]):
                best = (gap, (name, base, layout))
        return best[1] if best else (None, 0, None)

    def record(self, kind, builder, ptrs, mask):
        """Note one access; the mask to perform it with: out-of-bounds lanes switched off."""
        addr = np.asarray(ptrs.data).astype(np.int64)
        on = (np.ones(addr.shape, dtype=bool) if mask is None
              else np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape))
        flat_addr, flat_on = addr.ravel(), on.ravel()
        # the lanes that take part say where the access goes; all of them when none does
        lanes = flat_addr[flat_on] if flat_on.any() else flat_addr
        name, base, layout = self._owner(lanes) if lanes.size else (None, 0, None)
        line, source = self._line()
        program = tuple(int(i) for i in builder.grid_idx)
        if layout is None:
            inside = np.zeros(flat_addr.shape, dtype=bool)
            rows = cols = flat_addr
            virtual = None
        else:
            inside, rows, cols = layout.locate(flat_addr - base)
            virtual = layout.virtual(flat_addr - base)
        done, bad = flat_on & inside, flat_on & ~inside
        access = Access(program, kind, name, line, _pairs(rows[done], cols[done]),
                        masked_off=int((~flat_on).sum()), out_of_bounds=int(bad.sum()),
                        source=source)
        if virtual is not None:
            access.outside = _pairs(virtual[0][bad], virtual[1][bad])
            access.masked = _pairs(virtual[0][~flat_on], virtual[1][~flat_on])
        if bad.any():
            access.into = tuple(other for other, b, lay in self.regions if other != name
                                and lay.locate(flat_addr[bad] - b)[0].any())
        self.records.setdefault(program, []).append(access)
        return done.reshape(addr.shape)


@contextlib.contextmanager
def _triton_hooks(rec: _TritonRecorder):
    """Wrap the interpreter's loads and stores for the duration of one launch. The plain
    load/store go straight to the masked ones with an all-on mask, so each access is noted
    once whichever way the interpreter routes it."""
    import triton.language as tl
    from triton.runtime import interpreter

    B = interpreter.InterpreterBuilder
    names = ("create_load", "create_masked_load", "create_store", "create_masked_store")
    saved = {n: B.__dict__[n] for n in names}
    masked_load, masked_store = saved["create_masked_load"], saved["create_masked_store"]

    def handle(mask):
        return interpreter.TensorHandle(mask, tl.int1)

    def load(self, ptr, *rest, **kw):
        return masked_load(self, ptr, handle(rec.record("load", self, ptr, None)), None,
                           *rest, **kw)

    def load_masked(self, ptrs, mask, other, *rest, **kw):
        return masked_load(self, ptrs, handle(rec.record("load", self, ptrs, mask)), other,
                           *rest, **kw)

    def store(self, ptr, value, *rest, **kw):
        return masked_store(self, ptr, value, handle(rec.record("store", self, ptr, None)),
                            *rest, **kw)

    def store_masked(self, ptrs, value, mask, *rest, **kw):
        return masked_store(self, ptrs, value, handle(rec.record("store", self, ptrs, mask)),
                            *rest, **kw)

    for n, f in zip(names, (load, load_masked, store, store_masked)):
        setattr(B, n, f)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(B, n, f)


def _trace_triton(kernel, grid, args, constexprs) -> KernelTrace:
    fn = _python_function(kernel)
    bound = _bind(fn, args, constexprs)
    tensors = {name: _tensor_of(v) for name, v in bound.items() if _tensor_of(v) is not None}
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"{name}: a tensor on {t.device}; Triton's interpreter runs on the "
                             f"CPU, so trace_kernel takes CPU tensors ({name}.cpu())")
    rec = _TritonRecorder(fn, tensors)
    trace = KernelTrace("triton", fn.__name__, grid,
                        {n: Operand(n, tuple(t.shape)) for n, t in tensors.items()},
                        rec.records)
    trace.values = dict(tensors)
    with _triton_hooks(rec):
        try:
            kernel[grid](*args, **constexprs)
        except Exception as exc:  # noqa: BLE001 - the learner's error belongs in the trace
            _keep_error(trace, exc, fn)
    return trace


def _tensor_of(v):
    """The torch tensor an argument addresses: itself, or a host-side tensor descriptor's
    (triton.tools.tensor_descriptor) base; None for anything else."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(v, torch.Tensor):
        return v
    base = getattr(v, "base", None)
    return base if isinstance(base, torch.Tensor) else None


# ----------------------------------------------------------------------------------------
# numba
# ----------------------------------------------------------------------------------------


class _Watched(np.ndarray):
    """An array of the simulator that notes each element read and write. The simulator copies
    an argument to its "device" as a view of the same class, so what a watch needs lives on a
    class made for each array of each launch: its recorder, name and layout, and the address
    of the device copy (set when that copy is viewed as this class)."""

    _rec = None
    _name = ""
    _layout = None
    _strides = ()
    _origin = 0

    def __array_finalize__(self, obj):
        if obj is not None and not isinstance(obj, _Watched):  # a fresh buffer: the origin
            type(self)._origin = self.__array_interface__["data"][0]

    def __getitem__(self, idx):
        self._note(idx, "load")
        return super().__getitem__(idx)

    def __setitem__(self, idx, value):
        self._note(idx, "store")
        super().__setitem__(idx, value)

    def _note(self, idx, kind):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) == self.ndim and all(isinstance(i, (int, np.integer)) for i in idx):
            self._rec.note(self, tuple(int(i) for i in idx), kind)


class _NumbaRecorder:
    """Element accesses of the simulator's threads: (block, thread, epoch, sequence, kind,
    name, line, position, out of bounds). The epoch counts a thread's cuda.syncthreads()."""

    def __init__(self, fn):
        self.code = fn.__code__
        self.events: list = []
        self.operands: dict[str, Operand] = {}
        self.lock = threading.Lock()

    def watch(self, array: np.ndarray, name: str, space: str) -> np.ndarray:
        layout = _Layout(name, array.shape, [s // array.itemsize for s in array.strides],
                         array.itemsize)
        cls = type(f"{name}_watched", (_Watched,), {"_rec": self, "_name": name,
                                                     "_layout": layout,
                                                     "_strides": array.strides})
        self.operands[name] = Operand(name, tuple(array.shape), space)
        return array.view(cls)

    def note(self, array: _Watched, idx: tuple, kind: str) -> None:
        thread = threading.current_thread()
        block = getattr(thread, "blockIdx", None)
        if block is None:  # not a simulated thread (e.g. the copy back to the host)
            return
        f = sys._getframe(3)
        while f is not None and f.f_code is not self.code:
            f = f.f_back
        if f is None:
            return
        layout = array._layout
        oob = not all(0 <= i < n for i, n in zip(idx, array.shape))
        start = array.__array_interface__["data"][0] - array._origin
        if start == 0 and array.shape == layout.shape and array.strides == array._strides:
            pos = _raw_position(idx, layout)  # the whole array (the usual case): its indices
        else:  # a view made inside the kernel (e.g. a row Q[i]): by address
            offset = np.array([start + sum(i * s for i, s in zip(idx, array.strides))])
            if not oob:
                _, r, c = layout.locate(offset)
                pos = (int(r[0]), int(c[0]))
            else:
                v = layout.virtual(offset)
                pos = (int(v[0][0]), int(v[1][0])) if v is not None else None
        seq = getattr(thread, "_fe_seq", 0)
        thread._fe_seq = seq + 1
        self.events.append(((block.x, block.y, block.z), thread.thread_id,
                            getattr(thread, "_fe_epoch", 0), seq, kind, array._name,
                            f.f_lineno, pos, oob))

    def records(self) -> dict:
        """The events grouped into :class:`Access` records, per block: by epoch, then by the
        earliest point of a thread's own sequence where the group began (each thread's
        sequence is the same from run to run, their interleaving is not)."""
        groups: dict = {}
        for ev in list(self.events):  # threads of a block that raised may still be running
            block, tid, epoch, seq, kind, name, line, pos, oob = ev
            groups.setdefault((block, epoch, line, kind, name), []).append(ev)
        out: dict = {}
        for key in sorted(groups, key=lambda k: (k[0], k[1], min(e[3] for e in groups[k]),
                                                 k[2], k[3], k[4])):
            block, epoch, line, kind, name = key
            evs = sorted(groups[key], key=lambda e: (e[1], e[3]))
            inside = [e[7] for e in evs if not e[8]]
            outside = [e[7] for e in evs if e[8]]
            source = linecache.getline(self.code.co_filename, line).strip()
            out.setdefault(block, []).append(Access(
                block, kind, name, line, inside, out_of_bounds=len(outside), source=source,
                outside=[p for p in outside if p is not None] if None not in outside else [],
                threads=len({e[1] for e in evs})))
        return out


def _raw_position(idx: tuple, layout: _Layout) -> tuple[int, int]:
    """(row, column) of an index tuple of the whole array, out of range or not."""
    if len(idx) < 2:
        return (idx[0] if idx else 0), 0
    row = sum(i * math.prod(layout.shape[k + 1:-1]) for k, i in enumerate(idx[:-1]))
    return row, idx[-1]


@contextlib.contextmanager
def _numba_hooks(rec: _NumbaRecorder):
    """Every cuda.shared.array of the launch watched, and each thread's cuda.syncthreads()
    counted. The simulator keys a shared array by the line that asks for it: so do we."""
    import traceback

    from numba.cuda.simulator import kernel as sim_kernel, kernelapi

    shared, sync = kernelapi.FakeCUDAShared.array, sim_kernel.BlockThread.syncthreads

    def array(self, shape, dtype, *rest, **kw):
        if shape == 0 or rest or kw:  # dynamic shared memory: one buffer for all, not watched
            return shared(self, shape, dtype, *rest, **kw)
        caller = traceback.extract_stack(sys._getframe(1), limit=1)[-1]
        key = (caller.filename, caller.lineno)
        with rec.lock:  # the block's threads all ask at once: one array for all of them
            res = self._allocations.get(key)
            if res is None:
                plain = shared(kernelapi.FakeCUDAShared(0), shape, dtype)  # its dtype rules
                line = (caller.line or "").split("=")[0].strip()
                name = line if line.isidentifier() else f"shared@{caller.lineno}"
                name = name if name not in rec.operands else f"{name} (shared)"
                res = self._allocations[key] = rec.watch(plain, name, "shared")
        return res

    def syncthreads(self):
        sync(self)
        self._fe_epoch = getattr(self, "_fe_epoch", 0) + 1

    kernelapi.FakeCUDAShared.array, sim_kernel.BlockThread.syncthreads = array, syncthreads
    try:
        yield
    finally:
        kernelapi.FakeCUDAShared.array, sim_kernel.BlockThread.syncthreads = shared, sync


def _numba_config(grid):
    """(blocks, threads) as 3-tuples from ``grid``, what goes between kernel[...]'s brackets."""
    if not isinstance(grid, (tuple, list)) or not 2 <= len(grid) <= 4:
        raise TypeError(f"grid: {grid!r}; for a numba kernel, grid is what goes between the "
                        "brackets of kernel[blocks, threads]: a pair such as (4, 32) or "
                        "((2, 2), (8, 8))")
    return _dims(grid[0], "grid's blocks"), _dims(grid[1], "grid's threads")


def _trace_numba(kernel, grid, args, constexprs) -> KernelTrace:
    if constexprs:
        raise TypeError(f"{', '.join(constexprs)}: a numba kernel takes its arguments by "
                        "position only")
    fn = kernel.py_func
    blocks, threads = _numba_config(grid)
    names = list(inspect.signature(fn).parameters)
    if len(args) != len(names):
        raise TypeError(f"args: {fn.__name__} takes {len(names)} arguments "
                        f"({', '.join(names)}), got {len(args)}")
    rec = _NumbaRecorder(fn)
    launch_args = [_watched_arg(rec, name, a) for name, a in zip(names, args)]
    trace = KernelTrace("numba", fn.__name__, blocks, rec.operands, {}, block=threads)
    trace.values = {name: getattr(a, "_ary", a) for name, a in zip(names, args)
                    if isinstance(getattr(a, "_ary", a), np.ndarray)}
    error = None
    with _numba_hooks(rec):
        try:
            kernel[tuple(grid)](*launch_args)
        except Exception as exc:  # noqa: BLE001 - the learner's error belongs in the trace
            error = exc
    trace._records = rec.records()
    if error is not None:
        _keep_error(trace, error, fn)
    return trace


def _watched_arg(rec: _NumbaRecorder, name: str, a):
    """An array argument as a watched view of the same memory (a host array, or a simulated
    device array); anything else as it is."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    if isinstance(a, FakeCUDAArray):
        return FakeCUDAArray(rec.watch(a._ary, name, "global"))
    if isinstance(a, np.ndarray) and a.ndim > 0:
        return rec.watch(a, name, "global")
    return a


# ----------------------------------------------------------------------------------------
# The entry point
# ----------------------------------------------------------------------------------------


def trace_kernel(kernel, grid, *args, **constexprs) -> KernelTrace:
    """Launch ``kernel`` on the CPU as ``kernel[grid](*args, **constexprs)`` and record every
    load and store of every program (Triton) or block (numba).

    Triton: ``kernel`` a ``@triton.jit`` function, ``grid`` an int or a tuple of 1 to 3 ints,
    tensors on the CPU; needs ``TRITON_INTERPRET=1`` before triton is imported. numba:
    ``kernel`` a ``@cuda.jit`` kernel, ``grid`` the pair (blocks, threads) of
    ``kernel[blocks, threads]``, arguments by position; needs ``NUMBA_ENABLE_CUDASIM=1`` before
    numba is imported. ``import flashedu`` first sets both on a machine without a GPU.

    The launch has its effect (outputs written), except that lanes out of bounds are not
    performed (see the module's notes). Returns a :class:`KernelTrace`."""
    backend = _backend(kernel)
    if backend == "triton":
        return _trace_triton(kernel, _triton_grid(grid), args, constexprs)
    return _trace_numba(kernel, grid, args, constexprs)


def _backend(kernel) -> str:
    """"triton" or "numba" for a kernel that runs interpreted or simulated here; else a
    TypeError (not a kernel) or ValueError (compiled for a GPU) saying what to do."""
    cls, module = type(kernel).__name__, type(kernel).__module__ or ""
    if module.startswith("triton"):
        if cls == "InterpretedFunction" or _wraps_interpreted(kernel):
            return "triton"
        raise ValueError(
            "kernel: a Triton kernel compiled for a GPU; tracing runs it in Triton's "
            "interpreter, which must be switched on before triton is imported: start Python "
            "with TRITON_INTERPRET=1 (e.g. `TRITON_INTERPRET=1 jupyter lab`, or "
            "os.environ['TRITON_INTERPRET'] = '1' in the first cell, before any import)")
    if module.startswith("numba"):
        if cls == "FakeCUDAKernel":
            if getattr(kernel, "_device", False):
                raise TypeError("kernel: a numba device function (cuda.jit(device=True)); "
                                "trace the kernel that calls it")
            return "numba"
        raise ValueError(
            "kernel: a numba.cuda kernel compiled for a GPU; tracing runs it in numba's CUDA "
            "simulator, which must be switched on before numba is imported: start Python with "
            "NUMBA_ENABLE_CUDASIM=1 (or os.environ['NUMBA_ENABLE_CUDASIM'] = '1' in the first "
            "cell, before any import)")
    what = getattr(kernel, "__name__", type(kernel).__name__)
    raise TypeError(f"kernel: {what!r} is not a @triton.jit or @cuda.jit kernel; decorate the "
                    "function with one of them and pass the decorated kernel itself "
                    "(not kernel[grid])")


def _wraps_interpreted(kernel) -> bool:
    """An autotuner or heuristics wrapper around an interpreted kernel."""
    inner = getattr(kernel, "fn", None)
    return inner is not None and inner is not kernel and \
        type(inner).__module__.startswith("triton") and \
        (type(inner).__name__ == "InterpretedFunction" or _wraps_interpreted(inner))


def _python_function(kernel):
    fn = kernel
    while not inspect.isfunction(fn):
        fn = fn.fn
    return fn


def _dims(g, what: str) -> tuple[int, int, int]:
    g = (g,) if isinstance(g, (int, np.integer)) and not isinstance(g, bool) else g
    if not isinstance(g, (tuple, list)) or not 1 <= len(g) <= 3 or \
            not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in g):
        raise TypeError(f"{what}: {g!r}; expected an int or a tuple of 1 to 3 ints, as in "
                        "kernel[grid]")
    if any(n < 0 for n in g):
        raise ValueError(f"{what}: {tuple(g)} has a negative size")
    return tuple(int(n) for n in g) + (1,) * (3 - len(g))


def _triton_grid(grid) -> tuple[int, int, int]:
    if callable(grid):
        raise TypeError("grid: a function; trace_kernel takes the grid itself, e.g. "
                        "(triton.cdiv(N, BLOCK),)")
    return _dims(grid, "grid")


def _bind(fn, args, constexprs) -> dict:
    """The arguments by the kernel's parameter names."""
    sig = inspect.signature(fn)
    try:
        bound = sig.bind(*args, **constexprs)
    except TypeError as exc:
        raise TypeError(f"args: they do not fit {fn.__name__}({', '.join(sig.parameters)}): "
                        f"{exc}") from None
    return dict(bound.arguments)


def _keep_error(trace: KernelTrace, exc: BaseException, fn) -> None:
    """The kernel's exception on the trace, at the line of the kernel that raised it (the
    interpreter wraps the kernel's own exception: its cause)."""
    inner = exc.__cause__ if type(exc).__name__ == "InterpreterError" and exc.__cause__ \
        else exc
    trace.exception = inner
    trace.error = _learner_error(inner, fn.__code__, sum(len(v) for v in
                                                         trace._records.values()))
