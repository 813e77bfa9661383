"""How fast a K/V cache streams from memory in each layout, with no attention: the ceiling a
decoding kernel reads against.

Every program sums its share of K and V: `heads` K/V heads of one sequence, tiles of `rows`
rows (`rows / heads` keys, each key's heads side by side), over one chunk of the keys. Two
layouts of the same bytes:

- ``BHNd``: (B, Hkv, N, d), a head's keys one after another (the contiguous cache that SDPA's
  kernels read);
- ``BNHd``: (B, N, Hkv, d), a key's heads side by side (a paged pool's rows, its pages in
  order): a program of one head reads d * 2 bytes every Hkv * d * 2;
- ``pages``: a pool (pages, P, Hkv, d) of pages of P rows read through a block table, as the
  paged kernel reads it (``--page-sizes``), its pages in one of three orders (``--orders``):
  ``in order`` (sequence b's pages one after another: the indirection alone), ``local`` (each
  sequence's pages shuffled within its own stretch of the pool) and ``scattered`` (shuffled
  over the whole pool, as a pool serving many sequences ends up).

A program of ``heads`` heads splits the keys ``heads`` ways, so every variant runs B * Hkv
programs. Each variant is timed in a CUDA graph (``triton.testing.do_bench_cudagraph``).

    python scripts/gpu_kv_stream.py --json docs/bench/kv_stream_h200.json
    python scripts/gpu_kv_stream.py --batch 32 --keys 16384 --launches 2x3 4x3
    python scripts/gpu_kv_stream.py --layouts BNHd pages --page-sizes 16 256 --heads 1

Without a CUDA GPU it says so and exits.
"""

from __future__ import annotations

import argparse
import json
import sys

import flashedu  # noqa: F401  (before triton: it arranges the CPU's emulation)
import triton
import triton.language as tl


@triton.jit
def stream_kernel(K, V, Out, table, stride_b, stride_n, stride_h, chunk, S, Hkv, width,
                  ROWS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                  PAGE: tl.constexpr = 0):
    """Program (s, g): keys s * chunk .. of sequence g // (Hkv // HEADS), heads HEADS * (g %
    ...) onwards; row r of a tile is key r // HEADS, head r % HEADS. Writes its column sums.
    PAGE > 0: key j of sequence b lies in row j % PAGE of page ``table[b, j // PAGE]`` (rows
    ``width`` entries apart), and stride_b is a page's stride."""
    s = tl.program_id(0)
    g = tl.program_id(1)
    b = g // (Hkv // HEADS)
    h0 = (g % (Hkv // HEADS)) * HEADS
    r = tl.arange(0, ROWS)
    key = r // HEADS
    head = h0 + r % HEADS
    dims = tl.arange(0, D)
    at = head[:, None] * stride_h + dims[None, :]
    if PAGE == 0:
        at += b.to(tl.int64) * stride_b
    total = tl.zeros([ROWS, D], tl.float32)
    for n in range(s * chunk, (s + 1) * chunk, ROWS // HEADS):
        j = n + key
        if PAGE == 0:
            tile = at + j[:, None].to(tl.int64) * stride_n
        else:
            page = tl.load(table + b * width + j // PAGE).to(tl.int64)
            tile = at + (page * stride_b + (j % PAGE) * stride_n)[:, None]
        total += tl.load(K + tile).to(tl.float32) + tl.load(V + tile).to(tl.float32)
    tl.store(Out + (g * S + s) * D + dims, tl.sum(total, 0))


ORDERS = ("in order", "local", "scattered")


def cache(layout: str, B: int, Hkv: int, N: int, d: int, device, dtype, page=0,
          order="in order", seed=0):
    """K and V in ``layout``, their (batch or page, key, head) strides, and the block table
    (None but for ``pages``: pages of ``page`` rows in ``order``, one of ORDERS)."""
    import torch

    if layout == "pages":
        if page <= 0 or N % page:
            raise ValueError(f"page={page}: {N} keys need whole pages of a positive size")
        if order not in ORDERS:
            raise ValueError(f"order={order!r}: one of {ORDERS}")
        shape = (B * N // page, page, Hkv, d)
    else:
        shape = (B, Hkv, N, d) if layout == "BHNd" else (B, N, Hkv, d)
    K = torch.randn(shape, device=device, dtype=dtype)
    V = torch.randn(shape, device=device, dtype=dtype)
    if layout == "BHNd":
        return K, V, (K.stride(0), K.stride(2), K.stride(1)), None
    strides = (K.stride(0), K.stride(1), K.stride(2))
    if layout != "pages":
        return K, V, strides, None
    width = N // page
    g = torch.Generator().manual_seed(seed)
    table = torch.arange(B * width).view(B, width)
    if order == "local":
        table = torch.stack([row[torch.randperm(width, generator=g)] for row in table])
    elif order == "scattered":
        table = torch.randperm(B * width, generator=g).view(B, width)
    return K, V, strides, table.to(device=device, dtype=torch.int32)


def launch(K, V, strides, Hkv, N, heads, rows, warps=None, stages=None, table=None):
    """One sweep over the cache: returns the (B * Hkv // heads * heads, d) column sums."""
    import torch

    d = K.shape[-1]
    B = K.shape[0] if table is None else table.shape[0]
    page = 0 if table is None else K.shape[1]
    S = heads  # the keys split heads ways: B * Hkv programs whatever heads is
    if N % (S * (rows // heads)):
        raise ValueError(f"{N} keys do not split into {S} chunks of whole tiles of "
                         f"{rows // heads} keys")
    out = torch.empty(B * Hkv // heads * S, d, device=K.device, dtype=torch.float32)
    options = {} if warps is None else {"num_warps": warps, "num_stages": stages}
    width = 0 if table is None else table.stride(0)
    stream_kernel[(S, B * Hkv // heads)](K, V, out, table, *strides, N // S, S, Hkv, width,
                                         ROWS=rows, HEADS=heads, D=d, PAGE=page, **options)
    return out


def variants(layouts, page_sizes, orders):
    """(layout, page size, order) of each cache the run streams."""
    for layout in layouts:
        if layout != "pages":
            yield layout, 0, ""
            continue
        for page in page_sizes:
            for order in orders:
                yield layout, page, order


def name(layout: str, page: int, order: str) -> str:
    return f"pages of {page} {order}" if layout == "pages" else layout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--keys", type=int, default=16384)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layouts", nargs="+", default=["BHNd", "BNHd"],
                   choices=["BHNd", "BNHd", "pages"])
    p.add_argument("--page-sizes", type=int, nargs="+", default=[16, 256])
    p.add_argument("--orders", nargs="+", default=list(ORDERS), choices=ORDERS)
    p.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="K/V heads a program reads side by side")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128], help="rows a tile")
    p.add_argument("--launches", nargs="+", default=["2x3", "4x3", "4x4"],
                   help="warps x stages")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every case this many times in turn; the median is kept")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    import statistics

    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU: nothing to time here", file=sys.stderr)
        return 0
    B, Hkv, N, d = args.batch, args.kv_heads, args.keys, args.d
    times = {}
    for _ in range(args.rounds):  # every case once a round, so drift falls on all alike
        for layout, page, order in variants(args.layouts, args.page_sizes, args.orders):
            K, V, strides, table = cache(layout, B, Hkv, N, d, "cuda", torch.bfloat16, page,
                                         order or "in order")
            for heads in args.heads:
                for rows in args.rows:
                    for text in args.launches:
                        warps, stages = (int(x) for x in text.split("x"))

                        def step():
                            launch(K, V, strides, Hkv, N, heads, rows, warps, stages, table)
                        step()
                        ms = triton.testing.do_bench_cudagraph(step, rep=200)
                        key = (layout, page, order, heads, rows, warps, stages)
                        times.setdefault(key, []).append(ms)
            del K, V
    rows_out = []
    for (layout, page, order, heads, rows, warps, stages), ms in times.items():
        us = statistics.median(ms) * 1e3
        GBps = 2 * B * N * Hkv * d * 2 / us / 1e3
        rows_out.append(dict(layout=layout, page_size=page, order=order, heads=heads,
                             rows=rows, warps=warps, stages=stages, us=us, GBps=GBps))
        print(f"{name(layout, page, order)}: {heads} head(s) a program, tiles of {rows} rows, "
              f"{warps}x{stages}: {us:.1f} us, {GBps:.0f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"B": B, "Hkv": Hkv, "N": N, "d": d, "rounds": args.rounds, "device":
                       torch.cuda.get_device_name(), "cases": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
