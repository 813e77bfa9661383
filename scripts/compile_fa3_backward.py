"""Compile FlashAttention-3's backward (flashedu/triton/fa3_backward.py) for sm_90 on a machine
without a GPU and print what the compiler gave it: registers, bytes of spills a thread, shared
memory, and the count of the instructions that matter (the matrix products, the spills'
local loads and stores, exponentials, shared-memory stores, barriers, Philox's high products).

    python scripts/compile_fa3_backward.py --d 128 --causal --stages 2 --dq-buffers 1 \
        --fresh-descriptors --dropout
    python scripts/compile_fa3_backward.py --d 64 --causal --persistent --kv-buffers 2

Needs the Triton whose Gluon API the kernel is written against (3.6); the SASS is written to
/tmp/fa3_backward_<d>.sass for reading.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "dO": "*bf16", "dK": "*bf16",
            "dV": "*bf16", "L": "*fp32", "Dl": "*fp32", "dQ": "*fp32"}
FLOATS = {"qk_scale": "fp32", "scale": "fp32", "keep_scale": "fp32"}
COUNTED = ("HGMMA", "STL", "LDL", "MUFU", "STS", "BAR", "UTMAREDG")


def load_kernel():
    """fa3_backward_kernel, compiled rather than interpreted: without a GPU flashedu would set
    TRITON_INTERPRET=1, unless it is set already. The kernel needs no torch to compile: a
    Triton installed without it gets an empty module in its place."""
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.modules["torch"] = types.ModuleType("torch")
    sys.path.insert(0, ROOT)
    return importlib.import_module("flashedu.triton.fa3_backward").fa3_backward_kernel


def compile_for_sm90(kernel, consts: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = kernel.arg_names
    signature = {n: POINTERS.get(n) or FLOATS.get(n) or "i32" for n in names}
    signature["RNG"] = "*i64" if consts["DROPOUT"] else "constexpr"
    signature["PLAN"] = "*i32" if consts["PLANNED"] else "constexpr"
    signature.update({n: "constexpr" for n in consts})
    if not consts["DROPOUT"]:
        consts = {**consts, "RNG": None}
    if not consts["PLANNED"]:
        consts = {**consts, "PLAN": None}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in POINTERS}
    source = GluonASTSource(kernel, signature, {(names.index(n),): v for n, v in consts.items()},
                            aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def usage(compiled, sass_path: str) -> tuple[str, dict]:
    """cuobjdump's resource line and the counts of COUNTED in the SASS (written to sass_path)."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cubin = sass_path.replace(".sass", ".cubin")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    resources = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin],
                          capture_output=True, text=True, check=True).stdout
    with open(sass_path, "w") as f:
        f.write(sass)
    opcodes = collections.Counter(
        m.group(1).split(".")[0]
        for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    line = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+", resources).group(0)
    counts = {op: opcodes[op] for op in COUNTED if op in opcodes}
    counts["IMAD.HI"] = sass.count("IMAD.HI")  # with dropout: Philox's high product words
    counts["all"] = sum(opcodes.values())
    return line, counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, choices=(64, 128), default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--dq-buffers", type=int, default=1)
    p.add_argument("--regs", type=int, default=240, help="registers a consumer thread")
    p.add_argument("--fresh-descriptors", action="store_true",
                   help="make the loop-invariant operands' descriptors each step")
    p.add_argument("--dropout", action="store_true", help="with the dropout mask")
    p.add_argument("--select-once", action="store_true",
                   help="with dropout, the mask selects P_ij once, in float32")
    p.add_argument("--persistent", action="store_true",
                   help="one program per SM taking K/V tiles in turn (causal: by a plan)")
    p.add_argument("--kv-buffers", type=int, choices=(1, 2), default=1,
                   help="K/V buffers (2: a persistent program's next tile copied during this one)")
    args = p.parse_args(argv)
    consts = dict(HEAD_DIM=args.d, Br=64, STAGES=args.stages, IS_CAUSAL=args.causal,
                  DQ_BUFFERS=args.dq_buffers, CONSUMER_REGS=args.regs,
                  FRESH_DESCRIPTORS=args.fresh_descriptors, DROPOUT=args.dropout,
                  SELECT_ONCE=args.select_once, PERSISTENT=args.persistent,
                  PLANNED=args.persistent and args.causal, KV_BUFFERS=args.kv_buffers)
    compiled = compile_for_sm90(load_kernel(), consts)
    line, counts = usage(compiled, f"/tmp/fa3_backward_{args.d}.sass")
    # REG is the kernel's count before warp_specialize moves registers between partitions
    print(line, "| shared memory asked:", compiled.metadata.shared, "bytes")
    print(counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
