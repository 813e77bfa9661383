"""The GPU-kernel exercises: a numba.cuda kernel and a Triton kernel of the FlashAttention forward,
and the two Triton kernels of its backward (the paper's Algorithm 4: a dK/dV pass, a dQ pass).

The learner writes the kernel itself; the launchers (shown in the notebooks) allocate the
outputs and launch it. On a laptop the kernels run in numba's CUDA simulator and in Triton's
interpreter (``import flashedu`` arranges both), so the cases stay small.

Each exercise is a module of its own, with its launcher, cases, hints and
:class:`~.engine.Exercise`: :mod:`.numba_forward`, :mod:`.triton_forward` and
:mod:`.triton_backward` (dK/dV and dQ); what two or more of them share is in
:mod:`.kernel_common`. This module puts them together in ``EXERCISES`` and hands the compile
gate (:mod:`.gate`) the launches their cases make.

What the checks enforce beyond the values:
- bounds: inputs are views into buffers padded with NaN, and outputs into buffers padded with a
  sentinel, so a kernel that reads past the last row (a missing load mask) returns NaN and one
  that writes past it is caught; in numba's simulator an unguarded index raises IndexError;
- outputs that start as garbage: the outputs start as NaN (``torch.empty`` may hold anything),
  so an output row never stored, or an accumulator that adds to what the output held, shows;
  one case per exercise calls the kernel twice into the same outputs (holding the first
  call's answer), so a kernel that accumulates across calls fails;
- every tile: one case per exercise has Nq = Nk = 300, more than a 256-row tile, so a kernel
  that loads all of Q or K as one tile fails;
- the allowance: each output may be off by 4x the error of correct float32 computations on
  the same draw (naive attention, FlashAttention's loop at the case's tiles, O kept normalized
  key by key; the backward's two ways to get Delta_i), or by the rounding a correct kernel can
  make on that draw (:func:`flashedu.tolerance.attention_rounding`), whichever is larger;
- compiling: once every case passed, the kernel is compiled for a GPU for every launch the
  cases made (:mod:`.gate`);
- strides (Triton backward): one case hands views whose rows are further apart than d, each
  tensor its own row stride, with NaN and the sentinel in the gaps, so a kernel that addresses
  row r as ``X + r * D`` instead of ``X + r * stride_x`` fails;
- shared memory (numba): in the simulator every read of K and V from global memory is counted.
  A block that stages K_j, V_j in shared memory reads each element once per block; a kernel
  where every thread reads K and V from global memory reads each element once per thread. On a
  GPU reads cannot be counted; there the compiled kernel (its PTX) must load from shared memory
  in at least two places, one for K_j and one for V_j.
"""

from __future__ import annotations

import math

from . import numba_forward, triton_backward, triton_forward
from .gate import parameters, use_launches
from .kernel_common import STRIDES
from .numba_forward import _numba_specs
from .triton_backward import _backward_specs
from .triton_forward import _triton_specs


def gate_launches(which: str) -> list[dict]:
    """The launches the cases of kernel ``which`` ("numba", "forward", "dkdv", "dq") make, as
    plain data for the compile gate (:mod:`.gate`): each with the label of the first case
    that makes it. Triton: every argument (pointers by dtype, the scale, the integers, the
    constexprs), as the launcher passes it. numba: the argument types."""
    if which == "numba":
        # Q, K, V, O: C-contiguous float32 rows; L a float32 vector; a float32 scale; a bool
        array2, array1 = "float32[:, ::1]", "float32[::1]"
        signature = f"({', '.join([array2] * 4)}, {array1}, float32, boolean)"
        return [{"label": _numba_specs()[0][0], "signature": signature,
                 "config": "float32 arrays, a float32 scale, a bool causal"}]
    specs = _triton_specs() if which == "forward" else _backward_specs(which)
    pointers = parameters(which)[: parameters(which).index("scale")]
    launches = []
    for label, _, (Nq, Nk, d), (Br, Bc), causal, scale, _, _, strided, _ in specs:
        stride = {name: (STRIDES[name] if strided else d) for name in STRIDES}
        ints = {"Nq": Nq, "Nk": Nk, **{f"stride_{n.lower()}": stride[n] for n in STRIDES}}
        constexprs = {"D": d, "Br": Br, "Bc": Bc, "CAUSAL": bool(causal)}
        args = []
        for name in parameters(which):
            if name in pointers:
                args.append([name, "ptr", "float32"])
            elif name == "scale":
                args.append([name, "float", 1.0 / math.sqrt(d) if scale is None else scale])
            elif name in constexprs:
                args.append([name, "constexpr", constexprs[name]])
            else:
                args.append([name, "int", ints[name]])
        config = ", ".join(f"{k}={v}" for k, v in constexprs.items())
        ones = [n for n in ("Nq", "Nk") if ints[n] == 1]
        config += "".join(f", {n}=1" for n in ones)
        launches.append({"label": label, "config": config, "args": args})
    return launches


EXERCISES = numba_forward.EXERCISES + triton_forward.EXERCISES + triton_backward.EXERCISES
use_launches(gate_launches)  # what the compile gate compiles: these cases' launches
