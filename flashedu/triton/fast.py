"""Hopper's fast paths for the forward kernel, and the fallback when a Triton cannot build them.

- TMA: tiles fetched by the copy engine through tensor descriptors that the kernels make
  (``tl.make_tensor_descriptor``). Needs compute capability >= 9, 16-byte aligned base and
  strides, and an allocator for the descriptors' scratch memory.
- warp specialization: ``tl.range(..., warp_specialize=True)``; some warps load, others compute.

A kernel is launched with its fast switches on where the tile table asks for them; if that
build fails (seen on Triton 3.6: warp specialization with 4 warps crashes an MLIR pass), the
launch warns once, remembers the settings, and runs the pointer version.
"""

from __future__ import annotations

import warnings

import triton

_NO_FAST: set = set()  # launch settings whose fast build failed
OFF = {"TMA": False, "WARP_SPECIALIZE": False}


def tma_ok(*tensors) -> bool:
    """The copy engine (Hopper and newer) needs 16-byte aligned base addresses and strides."""
    import torch

    t0 = tensors[0]
    if t0.device.type != "cuda" or torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
               for t in tensors)


def switches(tiles, interpreted: bool, *tensors) -> dict:
    """The TMA / WARP_SPECIALIZE constexprs for a launch with these tiles and tensors."""
    if interpreted or not (tiles.tma or tiles.warp_specialize) or not tma_ok(*tensors):
        return dict(OFF)
    return {"TMA": bool(tiles.tma), "WARP_SPECIALIZE": bool(tiles.tma and tiles.warp_specialize)}


def launch(kernel, grid, args, consts: dict, fast: dict):
    """kernel[grid](*args, **consts, **fast), or the pointer version where fast does not build."""
    if fast == OFF:  # the common case pays for no bookkeeping
        return kernel[grid](*args, **consts, **fast)
    key = (getattr(kernel, "__name__", str(kernel)), tuple(sorted(consts.items())),
           tuple(str(a.dtype) for a in args if hasattr(a, "dtype")))
    if key in _NO_FAST:
        return kernel[grid](*args, **consts, **OFF)
    if fast["TMA"]:
        ensure_allocator()
    try:
        return kernel[grid](*args, **consts, **fast)
    except Exception as exc:  # noqa: BLE001 - only the TMA / warp-specialized build may fail
        warnings.warn(f"flashedu: the TMA / warp-specialized kernel did not build on this "
                      f"Triton ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                      f"using the pointer version for these settings", stacklevel=3)
        _NO_FAST.add(key)
        return kernel[grid](*args, **consts, **OFF)


def ensure_allocator():
    """Descriptors made inside a kernel live in scratch memory that Triton asks an allocator
    for: install one backed by torch, unless the user has set their own."""
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # Triton's internals moved: install ours
        pass

    def alloc(size, alignment, stream):
        import torch

        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)
