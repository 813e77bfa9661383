"""What a block mask buys: the model's prediction, a CPU check, and a GPU measurement.

No widgets here (the GPU machine has no ipywidgets): :class:`flashedu.viz.BlockMaskEditor`
calls these, and so can a script.

- :func:`predict`: density, HBM bytes (:func:`flashedu.io.flash_forward_hbm_bytes`, the count a
  trace confirms) and a roofline time on a GPU of :data:`flashedu.io.GPUS`, sparse vs dense.
- :func:`cpu_check`: ``flashedu.attention`` with the mask on small CPU tensors (numpy backend,
  and Triton's interpreter when it imports) against the float64 reference.
- :func:`gpu_bench`: the block-sparse Triton kernel against the dense one, timed with
  ``triton.testing.do_bench``, the pattern scaled up to a size where timing means something.
"""

from __future__ import annotations

import time

from .. import io
from ..masks import BlockMask


def predict(mask: BlockMask, d: int = 64, gpu: str = "H100 SXM5", dtype: str = "float16") -> dict:
    """Model of one head's forward pass with ``mask`` against the dense pass."""
    (Nq, Nk), (Br, Bc) = mask.seq_lens, mask.block_size
    isz = io.itemsize_of(dtype)
    spec = io.GPUS[gpu]
    sparse_bytes = io.flash_forward_hbm_bytes(Nq, Nk, d, Br, Bc, causal=mask.is_causal,
                                              block_mask=mask.blocks[0, 0], itemsize=isz)["total"]
    dense_bytes = io.flash_forward_hbm_bytes(Nq, Nk, d, Br, Bc, itemsize=isz)["total"]
    dense_flops = io.attention_flops(Nq, Nk, d)
    sparse_flops = dense_flops * mask.density  # every kept tile is computed in full

    def roofline_s(flops, nbytes):
        return max(flops / (spec.tensor_tflops * 1e12), nbytes / (spec.hbm_gb_s * 1e9))

    t_sparse, t_dense = roofline_s(sparse_flops, sparse_bytes), roofline_s(dense_flops, dense_bytes)
    return {"density": mask.density, "sparse_bytes": sparse_bytes, "dense_bytes": dense_bytes,
            "sparse_s": t_sparse, "dense_s": t_dense,
            "speedup": t_dense / t_sparse if t_sparse > 0 else float("inf")}


def _qkv(N: int, d: int, heads: int, dtype, device, seed=0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(1, heads, N, d, generator=g).to(device=device, dtype=dtype)
            for _ in range(3)]


def cpu_check(mask: BlockMask, d: int = 32, backends=("numpy", "triton")) -> list[dict]:
    """Run ``flashedu.attention`` with ``mask`` on float32 CPU tensors for each backend; compare
    with the float64 reference. Each result: backend, ok, max_err, seconds, note."""
    import torch

    import flashedu

    from ..reference import reference_attention

    Nq, Nk = mask.seq_lens
    q, k, v = _qkv(max(Nq, Nk), d, 1, torch.float32, "cpu")
    q, k, v = q[:, :, :Nq], k[:, :, :Nk], v[:, :, :Nk]
    ref = reference_attention(q, k, v, block_mask=mask, is_causal=mask.is_causal)
    results = []
    for name in backends:
        start = time.perf_counter()
        try:
            out = flashedu.attention(q, k, v, block_mask=mask, backend=name)
        except Exception as exc:  # noqa: BLE001 - an unavailable backend is reported, not raised
            results.append({"backend": name, "ok": None, "max_err": None, "seconds": None,
                            "note": f"not run: {type(exc).__name__}: {exc}"})
            continue
        err = float((out.double() - ref).abs().max())
        results.append({"backend": name, "ok": err < 1e-4, "max_err": err,
                        "seconds": time.perf_counter() - start, "note": ""})
    return results


def scaled(mask: BlockMask, N: int) -> BlockMask:
    """The same tile pattern over N queries and keys (tiles grow, the pattern stays)."""
    Tr, Tc = mask.shape
    Br, Bc = N // Tr, N // Tc
    return BlockMask.from_dense(mask.blocks, (Br, Bc), (Br * Tr, Bc * Tc), is_causal=mask.is_causal)


def gpu_bench(mask: BlockMask, N: int = 8192, d: int = 64, heads: int = 16) -> dict:
    """Time the triton backend with ``mask`` (scaled to N) and without any, fp16, on the GPU."""
    import torch
    from triton.testing import do_bench

    import flashedu

    big = scaled(mask, N)
    q, k, v = _qkv(big.seq_lens[0], d, heads, torch.float16, "cuda")
    sparse = lambda: flashedu.attention(q, k, v, block_mask=big, backend="triton")
    dense = lambda: flashedu.attention(q, k, v, backend="triton")
    from ..reference import naive_attention_torch

    err = float((sparse().float() - naive_attention_torch(
        q.float(), k.float(), v.float(), block_mask=big, is_causal=big.is_causal)).abs().max())
    sparse_ms, dense_ms = do_bench(sparse), do_bench(dense)
    return {"N": big.seq_lens[0], "block_size": big.block_size, "heads": heads, "d": d,
            "sparse_ms": sparse_ms, "dense_ms": dense_ms, "speedup": dense_ms / sparse_ms,
            "max_err": err, "device": torch.cuda.get_device_name()}


if __name__ == "__main__":  # python -m flashedu.viz.block_sparse: the editor's numbers, no widgets
    from . import presets

    for name in presets.PRESETS:
        m = presets.make(name, (512, 512), (64, 64))
        line = {k: round(v, 4) if isinstance(v, float) else v for k, v in predict(m).items()}
        print(name, line)
        try:
            import torch

            if torch.cuda.is_available():
                print("   gpu:", gpu_bench(m))
            else:
                print("   cpu:", cpu_check(m))
        except Exception as exc:  # noqa: BLE001
            print("   failed:", type(exc).__name__, exc)
