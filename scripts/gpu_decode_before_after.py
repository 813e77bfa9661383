"""Paged decoding at an earlier commit's kernels against the current ones, and cuDNN, each step
timed in a CUDA graph (``flashedu bench paged``'s third measurement), in turn.

The earlier ``flashedu/triton/decode.py`` is read from git and loaded beside the current one
(its kernels are new Triton functions, so both compile and run in one process); what it
imports from the rest of the package is today's. The cells are ``flashedu bench paged``'s:
H = 32, Hkv = 8, d = 128, bf16, pages of 16 and 256 scattered over the pool.

    python scripts/gpu_decode_before_after.py --before 0afafbc --json before_after.json

Without a CUDA GPU it says so and exits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import types
from pathlib import Path

CELLS = ((1, 1024), (1, 4096), (1, 16384), (1, 65536), (8, 1024), (8, 4096), (8, 16384),
         (8, 65536), (32, 1024), (32, 4096), (32, 16384))


def decode_at(commit: str):
    """flashedu.triton.decode as it was at ``commit``, as a module of today's package."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{commit}:flashedu/triton/decode.py"], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    name = "flashedu.triton.decode_before"
    module = types.ModuleType(name)
    module.__package__ = "flashedu.triton"
    path = Path("/tmp") / f"decode_{commit}.py"  # Triton reads a kernel's source from its file
    path.write_text(source)
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def one_cell(before, B, Nk, page, rounds):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashedu.benchmarks.paged import graph_copies, graph_us_in_turn, step_inputs
    from flashedu.decode import paged_attention

    q, k, v, kc, vc, table, seqlens = step_inputs(B, Nk, page, 32, 8, 128, "cuda",
                                                  torch.bfloat16)
    copies = graph_copies(k, v, kc, vc, device="cuda")
    ways = {"before": [lambda c=c: before.paged_kv_attention(q, c[2], c[3], table, seqlens)
                       for c in copies],
            "now": [lambda c=c: paged_attention(q, c[2], c[3], table, seqlens,
                                                check_indices=False) for c in copies],
            "cudnn": [lambda c=c: F.scaled_dot_product_attention(q, c[0], c[1], enable_gqa=True)
                      for c in copies]}
    with torch.no_grad():
        times = graph_us_in_turn(ways, rounds,
                                 {"cudnn": lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)})
    return {"B": B, "Nk": Nk, "page_size": page,
            **{f"{name}_graph_us": statistics.median(t) for name, t in times.items()},
            "each": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the earlier commit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_decode_before_after.py: needs a CUDA GPU; none is visible here.",
              file=sys.stderr)
        return 1
    before = decode_at(args.before)
    rows = []
    for page in (16, 256):
        for B, Nk in CELLS:
            row = one_cell(before, B, Nk, page, args.rounds)
            rows.append(row)
            now = row["now_graph_us"]
            print(f"B={B} Nk={Nk} page={page}: before {row['before_graph_us']:.1f} us, now "
                  f"{now:.1f} ({now / row['before_graph_us']:.2f}x), cuDNN "
                  f"{row['cudnn_graph_us']:.1f} ({row['cudnn_graph_us'] / now:.2f}x of now)",
                  flush=True)
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
