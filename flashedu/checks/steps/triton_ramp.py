"""Notebook 06's ramp to the FlashAttention forward, one Triton idea a step."""

from __future__ import annotations

import numpy as np

from ... import runtime
from ..steptools import case, kernel_step

F32 = np.float32


def _launch_add(kernel, x, y, BLOCK):
    import torch
    import triton

    device = runtime.kernel_device()
    xt, yt = (torch.from_numpy(a).to(device) for a in (x, y))
    # the output padded with NaN past n: a store past the end shows up as a changed pad
    buf = torch.full((len(x) + 64,), float("nan"), device=device)
    out = buf[: len(x)]
    kernel[(triton.cdiv(len(x), BLOCK),)](xt, yt, out, len(x), BLOCK=BLOCK)
    tail = buf[len(x):].cpu().numpy()
    if not np.isnan(tail).all():
        raise IndexError(f"the kernel wrote {int((~np.isnan(tail)).sum())} element(s) past "
                         f"out[{len(x) - 1}]: mask the store with offs < n")
    return out.cpu().numpy()


def _add_cases():
    rng = np.random.default_rng()
    hint = ("Each program owns BLOCK elements starting at pid * BLOCK: offs = pid * BLOCK + "
            "tl.arange(0, BLOCK); load x and y there, store x + y; mask = offs < n keeps the "
            "last program inside the arrays.")
    cases = []
    for n, block in ((16, 16), (13, 8), (100, 32), (1, 4)):
        x, y = rng.standard_normal(n).astype(F32), rng.standard_normal(n).astype(F32)
        label = f"n={n}, BLOCK={block}" + (" (a partial last block)" if n % block else "")
        cases.append(case(label, hint, (x, y, block), ("out",), (x.astype(np.float64) + y,),
                          naive=((x + y),), dtype=F32, inputs=("x", "y")))
    return cases


STEPS = [kernel_step("triton_step_add", "add_kernel", _add_cases, _launch_add)]
