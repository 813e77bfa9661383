"""``flashedu bench host``: the Python that one call of the triton backend runs around its
kernels, measured on any machine (no GPU needed).

At small sizes a call costs what its host code costs (``flashedu bench overhead`` measures that
on a GPU, beside SDPA). This benchmark isolates our part of it: the public ``attention`` and
its backward run on CPU tensors with every Triton launch replaced by a compiled kernel whose
start does nothing, so what is timed is the argument checks, allocations, autograd and the
launch code, without the GPU, the driver or the interpreter. It runs in a fresh process
(``TRITON_INTERPRET=0``: the kernels as the GPU path sees them).

Rows, per shape (B, H, N, d), causal, bf16 (with ``--density``: also a block mask, built once,
with that fraction of its 128 x 128 tiles, as a training loop passes one; with ``--window``: a
sliding window's block mask, whose partial tiles apply its mask mod element-wise; with
``--dropout``: calls with that dropout rate, each drawing its RNG state):
- ``repeat``: as the package runs: a call with an earlier call's signature goes from
  ``flashedu.attention`` straight to that call's repeat (``flashedu.triton_backend``);
- ``plans``: every call through the checks and the general path, which repeats the launches
  of a call laid out alike (``flashedu.triton.fast.PLANS``);
- ``no plans``: every call through the general path, working its launches out again;
- ``floor``: a ``torch.autograd.Function`` that only allocates its outputs, with the same
  ``torch.autograd.grad``: what any Python attention pays before its own code.

The shape ``decode`` is one step of paged decoding instead (``flashedu.decode.
paged_attention`` with ``check_indices=False``, as ``PagedKVCache`` calls it: one sequence, one
query, H = 32, Hkv = 8, d = 128, 1024 keys in pages of 256), mode ``step``: ``repeat`` is a
step laid out as the last one going straight to its launches, ``plans`` every step through
the checks (its launches still repeated), ``no plans`` working them out again, ``floor`` the
output's allocation alone.

Times are the best of ``--rounds`` rounds of ``--iters`` calls, in microseconds per call;
interleaved, so that a machine's slow spell hits every row alike.

    flashedu bench host                       # gpt shape, forward and forward + backward
    flashedu bench host --shapes tiny gpt --json host.json
    flashedu bench host --shapes n1024-d128 --density 0.25
    flashedu bench host --shapes gpt --window 128
    flashedu bench host --shapes gpt --dropout 0.1   # a dropout call's host code
    flashedu bench host --shapes decode              # a paged decoding step's host code
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from . import core
from .overhead import SHAPES

MODES = ("fwd", "fwd+bwd")
VARIANTS = ("repeat", "plans", "no plans", "floor")
DECODE = {"decode": (1, 32, 8, 128, 1024, 256)}  # B, H, Hkv, d, keys, page size


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    request = json.dumps({"shapes": args.shapes, "iters": args.iters, "rounds": args.rounds,
                          "density": args.density, "window": args.window,
                          "dropout": args.dropout})
    # No GPU in the worker, even where there is one: CPU tensors and the tuned table, as on a
    # machine without a GPU, so that every host times the same code.
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-P", "-m", __name__, "--worker", request], env=env,
                         capture_output=True, text=True)
    lines = [x for x in run.stdout.splitlines() if x.startswith("ROWS ")]
    if run.returncode != 0 or not lines:
        print(f"{run.stdout}{run.stderr}\nflashedu bench host: the worker failed (above)",
              file=sys.stderr)
        return 1
    rows = json.loads(lines[0][5:])
    record = core.environment(["host", *(sys.argv[1:] if argv is None else argv)], rows=rows)
    if args.json:
        core.write_json(args.json, record)
    print(core.headline(record))
    print(table(rows))
    return 0


def table(rows) -> str:
    headers = ["shape", "mode", *VARIANTS, "no plans / repeat"]
    body = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        first = next(r for r in rows if r["shape"] == shape)
        label = shape
        if first.get("density") is not None:
            label += f" sparse {first['density']:g}"
        if first.get("window") is not None:
            label += f" window {first['window']}"
        if first.get("dropout"):
            label += f" dropout {first['dropout']:g}"
        for mode in dict.fromkeys(r["mode"] for r in rows if r["shape"] == shape):
            us = {r["variant"]: r["us"] for r in rows if r["shape"] == shape and r["mode"] == mode}
            body.append([label, mode, *(f"{us[v]:.1f} us" for v in VARIANTS),
                         f"{us['no plans'] / us['repeat']:.2f}x"])
    return core.format_table(headers, body)


def _parser():
    p = core.parser("flashedu bench host", __doc__)
    p.add_argument("--shapes", nargs="+", default=["gpt"], choices=[*SHAPES, *DECODE])
    p.add_argument("--iters", type=core.positive_int, default=50, help="calls per round")
    p.add_argument("--rounds", type=core.positive_int, default=20, help="rounds, best kept")
    mask = p.add_mutually_exclusive_group()
    mask.add_argument("--density", type=core.density, default=None,
                      help="pass a block mask with this fraction of tiles (default: none)")
    mask.add_argument("--window", type=core.positive_int, default=None,
                      help="pass a sliding window of this many keys, a mask mod (default: none)")
    p.add_argument("--dropout", type=core.probability, default=0.0,
                   help="the calls' dropout rate (0: none)")
    p.add_argument("--json", type=core.output_file, default=None, help="write the results here")
    return p


# ----------------------------------------------------------------------------------------
# The worker: stub the launches, time the calls
# ----------------------------------------------------------------------------------------

class _Compiled:
    """What a launch returns: a compiled kernel whose start does nothing."""

    function = packed_metadata = None

    def run(self, *args):
        pass


def _stub_launches():
    """Every ``kernel[grid](...)`` returns a :class:`_Compiled`; the CUDA queries the launch
    code makes answer as on device 0; the backend takes CPU tensors as if compiled."""
    import torch
    from triton.runtime.jit import JITFunction

    import flashedu.triton_backend
    from flashedu import runtime
    from flashedu.triton import decode, inputs

    JITFunction.__getitem__ = lambda self, grid: lambda *args, **kwargs: _Compiled()
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_initialized = lambda: True
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    runtime.triton_interpreted = lambda: False
    flashedu.triton_backend.check = lambda q, k, v: None
    inputs.check = lambda q, k, v: None  # the decoding path's device check
    decode.sm_count = lambda device, interpreted: 132
    decode.major = lambda device, interpreted: 9


def _mask(N, density=None, window=None):
    """The block mask of a request: random tiles of ``density``, a sliding ``window``, or None."""
    from flashedu import BlockMask, mods
    from .peers import random_block_mask

    if density is not None:
        return random_block_mask(N, density)
    if window is not None:
        return BlockMask.from_mask_mod(mods.sliding_window(window), 1, 1, N, N)
    return None


def _steps(shape, mask=None, dropout=0.0):
    """{(variant, mode): a zero-argument call} for one shape (and block mask, dropout)."""
    import torch

    import flashedu

    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            flashedu.attention(q, k, v, is_causal=True, block_mask=mask, dropout_p=dropout,
                               backend="triton")

    def forward_backward():
        out = flashedu.attention(q, k, v, is_causal=True, block_mask=mask, dropout_p=dropout,
                                 backend="triton")
        torch.autograd.grad(out, (q, k, v), dout)

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return torch.empty_like(q)

        @staticmethod
        def backward(ctx, g):
            return torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)

    def floor_forward():
        with torch.no_grad():
            Floor.apply(q, k, v)

    def floor_backward():
        torch.autograd.grad(Floor.apply(q, k, v), (q, k, v), dout)

    return {"fwd": forward, "fwd+bwd": forward_backward}, {"fwd": floor_forward,
                                                         "fwd+bwd": floor_backward}


class _Forgetful(dict):
    """A dict that keeps nothing."""

    def __setitem__(self, key, value):
        pass


class _ForgetfulList(list):
    """A list that keeps nothing."""

    def append(self, value):
        pass


def _decode_steps(B, H, Hkv, d, keys, page):
    """{"step": a paged decoding step}, and the floor's: the output's allocation alone."""
    import torch

    from flashedu.decode import paged_attention

    pages = B * -(-keys // page)
    q = torch.randn(B, H, 1, d, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(pages, page, Hkv, d, dtype=torch.bfloat16) for _ in range(2))
    table = torch.arange(pages, dtype=torch.int32).view(B, -1)
    lengths = torch.full((B,), keys, dtype=torch.int32)

    def step():
        with torch.no_grad():
            paged_attention(q, k_cache, v_cache, table, lengths, check_indices=False)
    return {"step": step}, {"step": lambda: torch.empty_like(q)}


def _worker(request) -> list[dict]:
    from contextlib import ExitStack, nullcontext
    from unittest import mock

    _stub_launches()
    import flashedu.decode
    from flashedu import api
    from flashedu.triton import fast

    def no_repeat():  # none found, none kept: each call takes the general path
        stack = ExitStack()
        stack.enter_context(mock.patch.object(api, "REPEATS", _Forgetful()))
        stack.enter_context(mock.patch.object(flashedu.decode, "_REPEAT", _ForgetfulList()))
        return stack

    def no_plans():  # nor are launches kept: each call works them out again
        stack = ExitStack()
        stack.enter_context(no_repeat())
        stack.enter_context(mock.patch.object(fast, "PLANS", {}))
        stack.enter_context(mock.patch.object(fast, "remember", lambda key, plan: None))
        return stack

    rows, iters = [], request["iters"]
    for name in request["shapes"]:
        if name in DECODE:
            steps, floors = _decode_steps(*DECODE[name])
        else:
            mask = _mask(SHAPES[name][2], request.get("density"), request.get("window"))
            steps, floors = _steps(SHAPES[name], mask, request.get("dropout", 0.0))
        calls = []
        for mode in steps:
            calls.append(("repeat", mode, steps[mode], nullcontext))
            calls.append(("plans", mode, steps[mode], no_repeat))
            calls.append(("no plans", mode, steps[mode], no_plans))
            calls.append(("floor", mode, floors[mode], nullcontext))
        best = [float("inf")] * len(calls)
        for pass_ in range(request["rounds"] + 1):  # the first pass only warms up
            for n, (_, _, fn, context) in enumerate(calls):
                with context():
                    start = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    us = (time.perf_counter() - start) / iters * 1e6
                if pass_:
                    best[n] = min(best[n], us)
        rows += [{"shape": name, "density": request.get("density"),
                  "window": request.get("window"), "dropout": request.get("dropout", 0.0),
                  "variant": variant, "mode": mode,
                  "us": round(us, 2)}
                 for (variant, mode, _, _), us in zip(calls, best)]
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print("ROWS " + json.dumps(_worker(json.loads(sys.argv[2]))))
    else:
        sys.exit(main())
