"""How fast a K/V cache streams from memory in each layout, with no attention: the ceiling a
decoding kernel reads against.

Every program sums its share of K and V: `heads` K/V heads of one sequence, tiles of `rows`
rows (`rows / heads` keys, each key's heads side by side), over one chunk of the keys. Two
layouts of the same bytes:

- ``BHNd``: (B, Hkv, N, d), a head's keys one after another (the contiguous cache that SDPA's
  kernels read);
- ``BNHd``: (B, N, Hkv, d), a key's heads side by side (a paged pool's rows, its pages in
  order): a program of one head reads d * 2 bytes every Hkv * d * 2.

A program of ``heads`` heads splits the keys ``heads`` ways, so every variant runs B * Hkv
programs. Each variant is timed in a CUDA graph (``triton.testing.do_bench_cudagraph``).

    python scripts/gpu_kv_stream.py --json docs/bench/kv_stream_h200.json
    python scripts/gpu_kv_stream.py --batch 32 --keys 16384 --launches 2x3 4x3

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
def stream_kernel(K, V, Out, stride_b, stride_n, stride_h, chunk, S, Hkv,
                  ROWS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr):
    """Program (s, g): keys s * chunk .. of sequence g // (Hkv // HEADS), heads HEADS * (g %
    ...) onwards; row r of a tile is key r // HEADS, head r % HEADS. Writes its column sums."""
    s = tl.program_id(0)
    g = tl.program_id(1)
    b = g // (Hkv // HEADS)
    h0 = (g % (Hkv // HEADS)) * HEADS
    r = tl.arange(0, ROWS)
    key = r // HEADS
    head = h0 + r % HEADS
    dims = tl.arange(0, D)
    at = b.to(tl.int64) * stride_b + head[:, None] * stride_h + dims[None, :]
    total = tl.zeros([ROWS, D], tl.float32)
    for n in range(s * chunk, (s + 1) * chunk, ROWS // HEADS):
        tile = at + (n + key)[:, None].to(tl.int64) * stride_n
        total += tl.load(K + tile).to(tl.float32) + tl.load(V + tile).to(tl.float32)
    tl.store(Out + (g * S + s) * D + dims, tl.sum(total, 0))


def cache(layout: str, B: int, Hkv: int, N: int, d: int, device, dtype):
    """K and V in ``layout``, and their (batch, key, head) strides."""
    import torch

    shape = (B, Hkv, N, d) if layout == "BHNd" else (B, N, Hkv, d)
    K = torch.randn(shape, device=device, dtype=dtype)
    V = torch.randn(shape, device=device, dtype=dtype)
    if layout == "BHNd":
        return K, V, (K.stride(0), K.stride(2), K.stride(1))
    return K, V, (K.stride(0), K.stride(1), K.stride(2))


def launch(K, V, strides, Hkv, N, heads, rows, warps=None, stages=None):
    """One sweep over the cache: returns the (B * Hkv // heads * heads, d) column sums."""
    import torch

    B, d = K.shape[0], K.shape[-1]
    S = heads  # the keys split heads ways: B * Hkv programs whatever heads is
    if N % (S * (rows // heads)):
        raise ValueError(f"{N} keys do not split into {S} chunks of whole tiles of "
                         f"{rows // heads} keys")
    out = torch.empty(B * Hkv // heads * S, d, device=K.device, dtype=torch.float32)
    options = {} if warps is None else {"num_warps": warps, "num_stages": stages}
    stream_kernel[(S, B * Hkv // heads)](K, V, out, *strides, N // S, S, Hkv, ROWS=rows,
                                         HEADS=heads, D=d, **options)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--keys", type=int, default=16384)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="K/V heads a program reads side by side")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128], help="rows a tile")
    p.add_argument("--launches", nargs="+", default=["2x3", "4x3", "4x4"],
                   help="warps x stages")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU: nothing to time here", file=sys.stderr)
        return 0
    B, Hkv, N, d = args.batch, args.kv_heads, args.keys, args.d
    rows_out = []
    for layout in ("BHNd", "BNHd"):
        K, V, strides = cache(layout, B, Hkv, N, d, "cuda", torch.bfloat16)
        for heads in args.heads:
            for rows in args.rows:
                for text in args.launches:
                    warps, stages = (int(x) for x in text.split("x"))

                    def step():
                        launch(K, V, strides, Hkv, N, heads, rows, warps, stages)
                    step()
                    ms = triton.testing.do_bench_cudagraph(step, rep=200)
                    GBps = 2 * K.numel() * K.element_size() / ms / 1e6
                    rows_out.append(dict(layout=layout, heads=heads, rows=rows, warps=warps,
                                         stages=stages, us=ms * 1e3, GBps=GBps))
                    print(f"{layout} {heads} head(s) a program, tiles of {rows} rows, "
                          f"{text}: {ms * 1e3:.1f} us, {GBps:.0f} GB/s", flush=True)
        del K, V
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"B": B, "Hkv": Hkv, "N": N, "d": d, "device":
                       torch.cuda.get_device_name(), "cases": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
