"""Tile sizes and launch settings of the Triton kernels, per head dim and dtype.

One table, so that tuning is an edit here (``scripts/gpu_triton_tune.py`` measures candidates on
a GPU and prints the winners). Names follow the paper: a program of the forward owns one Q tile
of ``Br`` rows and streams K/V tiles of ``Bc`` rows past it.

Under the Triton interpreter (CPU) every tile is small: the tests then cross many tile
boundaries on small problems, and the interpreter's cost grows with the tile area.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MAX_HEAD_DIM = 256
MIN_TILE = 16  # tl.dot needs every dimension >= 16


@dataclass(frozen=True)
class Tiles:
    Br: int  # rows of Q per tile (BLOCK_M)
    Bc: int  # rows of K/V per tile (BLOCK_N)
    num_warps: int = 4
    num_stages: int = 2
    # forward only, Hopper and newer (the forward falls back where they do not build):
    tma: bool = False  # K/V tiles fetched by the copy engine through tensor descriptors
    warp_specialize: bool = False  # with tma: Triton's warp specialization of the unmasked loop

    def launch(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True)
class KernelConfig:
    forward: Tiles
    dkdv: Tiles  # backward, one program per K/V tile: Bc is its own tile, Br the Q tiles it visits
    dq: Tiles  # backward, one program per Q tile, like the forward
    preprocess_rows: int = 64  # rows of the D = rowsum(dO * O) kernel
    # dK/dV and dQ programs in one launch (FlexAttention's layout; they then share the dK/dV
    # tiles' warps and stages) or one launch each (each with its own warps and stages).
    # True: the d=128 entry measured fastest so (docs/bench/speed.md); the tables below say
    # False where the two launches measured faster or were not compared.
    fused_backward: bool = True
    # Where causal attention's backward measured faster with other settings: used instead.
    causal_backward: "KernelConfig | None" = None
    # Tiles of the block-sparse forward. None: the forward's, without TMA and warp
    # specialization (on the block-sparse loops TMA alone measured 3-9% slower, speed.md).
    sparse_forward: Tiles | None = None

    def forward_tiles(self, block_mask) -> Tiles:
        """The forward's tiles for a call with (or without) a block mask."""
        if block_mask is None:
            return self.forward
        return self.sparse_forward or replace(self.forward, tma=False, warp_specialize=False)


INTERPRETER = KernelConfig(Tiles(32, 16), Tiles(16, 32), Tiles(32, 16), 32)

# H100 (sm_90), 16-bit inputs, keyed by padded head dim: the fastest of scripts/gpu_triton_tune.py
# at N=8192, bf16 (docs/bench/triton.md), one config serving causal and not. d=128's backward:
# scripts/gpu_triton_speed.py (docs/bench/speed.md): one fused launch, 2 stages, 419 TFLOPs
# against 382-392 for the two launches with 3 stages; at d=64, and causal, it was not faster.
# Forwards of d=128 and d=256: scripts/gpu_triton_fwd.py (docs/bench/speed.md): TMA and warp
# specialization +4-8% at d=128; 128x64 tiles 1.3-1.6x at d=256. At d=64, TMA was within noise
# and slower for short causal sequences: left off.
_FORWARD_128 = Tiles(128, 128, 8, 3, tma=True, warp_specialize=True)
GPU_16BIT = {
    16: KernelConfig(Tiles(128, 64, 8, 3), Tiles(32, 128, 8, 3), Tiles(128, 64, 8, 3),
                     fused_backward=False),
    32: KernelConfig(Tiles(128, 64, 8, 3), Tiles(32, 128, 8, 3), Tiles(128, 64, 8, 3),
                     fused_backward=False),
    64: KernelConfig(Tiles(128, 64, 8, 3), Tiles(32, 128, 8, 3), Tiles(128, 64, 8, 3),
                     fused_backward=False),
    128: KernelConfig(_FORWARD_128, Tiles(64, 128, 8, 2), Tiles(128, 64, 8, 2),
                      fused_backward=True,
                      # causal: the fused launch was 4-12% slower (speed.md): the two launches
                      causal_backward=KernelConfig(_FORWARD_128, Tiles(64, 128, 8, 3),
                                                   Tiles(128, 64, 8, 3), fused_backward=False)),
    256: KernelConfig(Tiles(128, 64, 8, 2, tma=True), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2),
                      fused_backward=False),  # backward untuned
}

# fp32 tiles take twice the shared memory: halve them.
GPU_FP32 = {
    dim: KernelConfig(*tiles, fused_backward=False) for dim, tiles in {
        16: (Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
        32: (Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
        64: (Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
        128: (Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
        256: (Tiles(32, 32, 4, 1), Tiles(16, 32, 4, 1), Tiles(32, 16, 4, 1)),
    }.items()
}


def padded_head_dim(d: int) -> int:
    """The power of two >= d (and >= 16) that the kernels hold in registers; loads mask the rest."""
    return max(MIN_TILE, 1 << (d - 1).bit_length())


def kernel_config(d: int, is_fp32: bool, interpreted: bool) -> KernelConfig:
    if interpreted:
        return INTERPRETER
    table = GPU_FP32 if is_fp32 else GPU_16BIT
    return table[padded_head_dim(d)]
