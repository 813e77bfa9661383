"""Notebook 07's steps: the three Triton kernels of the backward (the paper's Algorithm 4).

- ``triton_step_delta``: the row sum D_i = rowsum(dO_i * O_i), one program per Br rows.
- ``triton_step_dkdv``: the dK/dV kernel, one program per K/V tile j.
- ``triton_step_dq``: the dQ kernel, one program per Q tile i.

The dK/dV and dQ steps run the non-causal cases of the graded exercises
``triton_backward_dkdv_kernel`` and ``triton_backward_dq_kernel`` (same launchers, NaN-padded
inputs, sentinel-padded outputs, strided views, diagnosis of the usual mistakes); causal masking
is left to exercise 07.
"""

from __future__ import annotations

import numpy as np

from ..engine import Case, Exercise
from ..kernel_common import (
    F32,
    SENTINEL,
    STRIDES,
    _backward_bounds_probe,
    _kernel_problem,
    _padded_rows,
    _still_skeleton,
    _triton_unavailable,
    _watch_loads,
)
from ..numpy_exercises import _normal
from ..sandbox import call_limited
from ..triton_backward import _backward_invoke, _backward_triton_cases, _diagnose_backward_kernel
from ... import runtime

# The exercises' cases beyond these sizes cost seconds each in Triton's interpreter; the
# notebook's step keeps the small ones (every edge the exercise tests is among them).
MAX_ROWS = 64


def _non_causal(which):
    def cases():
        return [c for c in _backward_triton_cases(which)
                if not c.args[6] and max(c.args[0].shape[0], c.args[1].shape[0]) <= MAX_ROWS]
    return cases


# ------------------------------------------------------------------------------------------
# D_i = rowsum(dO_i * O_i)
# ------------------------------------------------------------------------------------------


def launch_delta(kernel, O, dO, Delta, Br=16):
    """One program per Br rows: grid (ceil(Nq / Br),). The kernel writes Delta (Nq,).

    kernel(O, dO, Delta, Nq, stride_o, stride_do, D: tl.constexpr, Br: tl.constexpr)."""
    import triton

    Nq, d = O.shape
    kernel[(triton.cdiv(Nq, Br),)](O, dO, Delta, Nq, O.stride(0), dO.stride(0), D=d, Br=Br)


def _delta_invoke(fn, case, timeout, measure):
    """Launch the learner's kernel on NaN-padded O, dO (rows ``width`` apart in the strided
    case) and a sentinel-padded Delta, watching its loads, as the backward's checks do."""
    import torch

    o, do, Br, strided = case.args
    device = runtime.kernel_device()
    width = (lambda name: STRIDES.get(name)) if strided else (lambda name: None)
    ins = {name: _padded_rows(a, float("nan"), device, width(name))
           for name, a in (("O", o), ("dO", do))}
    before = {name: buf.clone() for name, (buf, _) in ins.items()}
    out_buf, out = _padded_rows(np.zeros(o.shape[0], dtype=F32), SENTINEL, device)
    seen = {}

    def run():
        with _watch_loads([view for _, view in ins.values()] + [out]) as counted:
            launch_delta(fn, ins["O"][1], ins["dO"][1], out, Br)
        seen.update(counted)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out.cpu().numpy().copy()

    call = call_limited(run, timeout=timeout, measure_memory=measure)
    call.reads = dict(seen)
    call.buffers = {"in": [(name, buf, before[name]) for name, (buf, _) in ins.items()],
                    "out": [("Delta", out_buf, (o.shape[0],))]}
    return call


H_DELTA = ("One program per Br rows: rows = pid * Br + tl.arange(0, Br), dims = tl.arange(0, "
           "D); load the (Br, D) tiles O_i and dO_i at X + rows[:, None] * stride_x + dims[None, "
           ":], multiply them element by element and sum each row (tl.sum(..., axis=1)); store "
           "one value per row at Delta + rows.")
H_DELTA_MASK = (" Rows past Nq: load with mask=rows[:, None] < Nq, other=0.0, and store with "
                "mask=rows < Nq. (Here the memory after O and dO holds NaN: an unmasked load "
                "brings it in.)")
H_DELTA_STRIDES = ("O's and dO's rows are further apart than D here (views into wider buffers, "
                   "each its own row stride, NaN in the gaps): address row r of O as O + r * "
                   "stride_o and of dO as dO + r * stride_do, never r * D.")


def _delta_cases():
    cases = []
    specs = (  # label, hint, Nq, D, Br, strided
        ("one tile, Nq=16, D=16", H_DELTA, 16, 16, 16, False),
        ("a partial last tile, Nq=37, D=16", H_DELTA + H_DELTA_MASK, 37, 16, 16, False),
        ("Nq=1", H_DELTA + H_DELTA_MASK, 1, 16, 16, False),
        ("Br=32, D=32, Nq=50", H_DELTA + H_DELTA_MASK, 50, 32, 32, False),
        ("row strides differ from D: Nq=21", H_DELTA_STRIDES, 21, 16, 16, True),
    )
    for seed, (label, hint, Nq, d, Br, strided) in enumerate(specs):
        o, do = (_normal(100 + 2 * seed + k, Nq, d).astype(F32) for k in (0, 1))
        expected = (o.astype(np.float64) * do).sum(axis=1)
        cases.append(Case(label, hint, (o, do, Br, strided), ("Delta",), (expected,),
                          ((o * do).sum(axis=1, dtype=F32),), inputs=("O", "dO"), dtype=F32,
                          probe=_backward_bounds_probe))
    return cases


def _diagnose_delta(case, wrong, outputs):
    got = outputs["Delta"]
    if np.isnan(got).any():
        if case.args[-1]:
            return ("NaN: here O and dO have their own row strides with NaN between the rows; "
                    "address row r as O + r * stride_o and dO + r * stride_do, never r * D.")
        return ("NaN: a load read past row Nq - 1, where the check keeps NaN: load O_i and dO_i "
                "with mask=rows[:, None] < Nq and other=0.0.")
    o, do = (a.astype(np.float64) for a in case.args[:2])
    mistakes = {
        "rowsum(O_i * O_i)": (o * o).sum(1),
        "rowsum(dO_i * dO_i)": (do * do).sum(1),
        "rowsum(O_i) * rowsum(dO_i)": o.sum(1) * do.sum(1),
    }
    for label, value in mistakes.items():
        if np.allclose(got, value, rtol=1e-4, atol=1e-4):
            return f"Your Delta is {label}: D_i = rowsum(dO_i * O_i), one product per element."
    return None


STEPS = [
    Exercise("triton_step_delta", 0, "delta_kernel", _delta_cases, invoke=_delta_invoke,
             diagnose=_diagnose_delta, timeout=120.0, requires=_triton_unavailable,
             unfilled=_still_skeleton, inspect=lambda k: _kernel_problem(k, "triton")),
    Exercise("triton_step_dkdv", 0, "dkdv_kernel", _non_causal("dkdv"),
             invoke=_backward_invoke("dkdv"), diagnose=_diagnose_backward_kernel,
             timeout=120.0, requires=_triton_unavailable, unfilled=_still_skeleton,
             inspect=lambda k: _kernel_problem(k, "dkdv")),
    Exercise("triton_step_dq", 0, "dq_kernel", _non_causal("dq"),
             invoke=_backward_invoke("dq"), diagnose=_diagnose_backward_kernel,
             timeout=120.0, requires=_triton_unavailable, unfilled=_still_skeleton,
             inspect=lambda k: _kernel_problem(k, "dq")),
]

__all__ = ["STEPS", "launch_delta"]
