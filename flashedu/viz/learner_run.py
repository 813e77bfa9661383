"""A learner's own NumPy ``flash_forward`` run as a :class:`flashedu.trace.Trace` (no widgets
here), so that :class:`flashedu.viz.TileLoopStepper` steps through the learner's loop with the
same picture, counters and charts it draws for the package's kernel.

:func:`flashedu.viz.compare_trace` records, in the order the learner's code made them, every row
slice of Q, K and V it read (an HBM load, in the model the course counts, of the bytes the slice
holds), every row slice it read from or wrote into an O or L made like Q (``np.zeros_like(Q)``:
in HBM), and each tile product S_ij = Q_i K_j^T (a step). Laid out as a Trace: a transfer
carries the number of steps begun before it, as the package's kernels record theirs; a step's
SRAM contents are the last tile of each tensor read or written before it, and its S_ij. A tile a
learner reads twice is counted twice: that is the traffic their loop makes, which the stepper
sets beside flashedu.io's count for the paper's.
"""

from __future__ import annotations

import math

from ..trace import Event, Step, Trace
from .learner_trace import TraceComparison

ROW_TENSORS = ("Q", "O", "L", "l", "m")  # tiled by Br; K and V by Bc


def as_trace(cmp: TraceComparison) -> Trace:
    """The learner's run of ``cmp`` as a Trace of its transfers and steps."""
    (Nq, d), Nk = cmp.Q.shape, cmp.K.shape[0]
    Br, Bc, itemsize = cmp.block_q, cmp.block_k, cmp.Q.itemsize
    tr = Trace()
    tr.info.update(kernel="forward", order=cmp.order, Nq=Nq, Nk=Nk, d=d, Br=Br, Bc=Bc,
                   Tr=math.ceil(Nq / Br), Tc=math.ceil(Nk / Bc), itemsize=itemsize,
                   causal=cmp.causal, learner=True)
    live: dict = {}
    transfers = iter(cmp.transfers)
    pending = next(transfers, None)
    for k, step in enumerate(cmp.steps):
        while pending is not None and pending[3] <= k:  # what was read or written before it
            _add(tr, live, pending, Br, Bc)
            pending = next(transfers, None)
        i, j = step.pair(Br, Bc)
        S = (step.q[1] - step.q[0]) * (step.k[1] - step.k[0]) * 4  # float32 scores on chip
        tr.steps.append(Step(i, j, True, {**live, "S_ij": (None, S)}))
    while pending is not None:  # the writes after the last step
        _add(tr, live, pending, Br, Bc)
        pending = next(transfers, None)
    return tr


def _add(tr: Trace, live: dict, transfer, Br: int, Bc: int) -> None:
    op, name, (r0, r1), begun, nbytes = transfer
    tile = r0 // (Br if name in ROW_TENSORS else Bc)
    tr.events.append(Event(op, name, tile, nbytes, begun))
    live[name] = (tile, nbytes)


# ----- a learner's Triton (or numba) kernel, traced by trace_kernel ------------------------
KERNEL_TENSORS = ("Q", "K", "V", "O")  # the argument names the layout needs (L is optional)


def kernel_as_trace(kt, Br: int, Bc: int, causal: bool) -> Trace:
    """A :class:`flashedu.viz.KernelTrace` of a FlashAttention forward kernel (one program or block
    per Q tile, arguments named Q, K, V, O and L, one head) as a Trace. Each program's load
    of a K tile starts a step (i, j), i the Q tile the program loaded, j the K tile; the V
    tile loaded after it feeds the same step; a store ends the program's last step. Bytes
    are the elements an access touched (masked-off and out-of-bounds lanes move nothing)."""
    missing = [n for n in KERNEL_TENSORS if n not in kt.tensors]
    if missing:
        raise ValueError(f"kernel: the traced launch has no argument named {', '.join(missing)} "
                         f"(its tensors: {', '.join(kt.tensors) or 'none'}); name the kernel's "
                         "arguments Q, K, V, O (and L) as the course's kernel does")
    shapes = {n: kt.tensors[n].shape for n in ("Q", "K")}
    if any(math.prod(shape[:-2]) != 1 for shape in shapes.values()):
        raise ValueError(f"kernel: Q has shape {shapes['Q']}: trace one head (a batch and "
                         "head count of 1), whose rows are the sequence")
    (Nq, d), Nk = shapes["Q"][-2:], shapes["K"][-2]
    tr = Trace()
    tr.info.update(kernel="forward", order="q_outer", Nq=Nq, Nk=Nk, d=d, Br=Br, Bc=Bc,
                   Tr=math.ceil(Nq / Br), Tc=math.ceil(Nk / Bc), itemsize=_itemsize(kt, "Q"),
                   causal=causal, learner=True)
    live: dict = {}
    for program in kt.programs:
        i, q_rows, pending = program[0], Br, None
        for a in kt.accesses(program):
            if a.tensor not in ("Q", "K", "V", "O", "L") or not a.elements:
                continue
            if a.kind == "store" or (a.tensor == "K" and pending is not None):
                pending = _flush(tr, live, pending)
            rows = {r for r, _ in a.elements}
            size = Bc if a.tensor in ("K", "V") else Br
            tile = min(rows) // size
            if a.tensor in ("Q", "K") and max(rows) >= (tile + 1) * size:
                raise ValueError(f"kernel: {kt.program_name(program)} loads rows {min(rows)}.."
                                 f"{max(rows)} of {a.tensor} as one tile, but the stepper's "
                                 f"{'Bc' if a.tensor == 'K' else 'Br'} is {size}: set it to "
                                 "your kernel's tile")
            if a.tensor == "Q":
                i, q_rows = tile, len(rows)
            nbytes = len(a.elements) * _itemsize(kt, a.tensor)
            tr.events.append(Event(a.kind, a.tensor, tile, nbytes, len(tr.steps)))
            live[a.tensor] = (tile, nbytes)
            if a.tensor == "K" and a.kind == "load":
                pending = (i, tile, q_rows * len(rows) * 4)  # S_ij in float32 on chip
        _flush(tr, live, pending)
        live.clear()  # the next program starts with nothing on chip
    return tr


def _flush(tr: Trace, live: dict, pending):
    if pending is not None:
        i, j, S = pending
        tr.steps.append(Step(i, j, True, {**live, "S_ij": (None, S)}))
    return None


def _itemsize(kt, name: str) -> int:
    v = kt.values.get(name)
    size = getattr(v, "element_size", None)
    return int(size()) if callable(size) else int(getattr(v, "itemsize", 4))
