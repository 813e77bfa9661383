"""Tile sizes and launch settings of the Triton kernels, per head dim and dtype.

One table, so that tuning is an edit here (``flashedu bench tune`` measures candidates on
a GPU and prints the winners). Names follow the paper: a program of the forward owns one Q tile
of ``Br`` rows and streams K/V tiles of ``Bc`` rows past it.

Under the Triton interpreter (CPU) every tile is small: the tests then cross many tile
boundaries on small problems, and the interpreter's cost grows with the tile area.
"""

from __future__ import annotations

import functools
import os
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
    # registers per thread the compiler may use (None: its choice). 128 keeps two programs of
    # 8 warps on one SM (65536 registers); one register more and only one fits.
    maxnreg: int | None = None

    def launch(self) -> dict:
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return opts


@dataclass(frozen=True)
class Schedule:
    """FlashAttention-3's forward (fa3.py): consumer warpgroups of 64 rows each, K_j/V_j
    stages in shared memory, registers per consumer thread, and the schedule's switches.
    ``persistent``: dense (not causal) calls run one program per SM that takes Q tiles in
    turn; causal calls too with ``causal_persistent`` (else one program per Q tile).
    ``causal_from``: causal calls take the schedule only from this many queries and keys (and
    from the entry's ``schedule_from``). ``tma_store``: O_i out through shared memory and the
    copy engine. ``q_buffers``: 2, a persistent program loads its next Q tile while it works
    on this one (where shared memory holds two: ``fa3.shared_bytes``). ``planned``: causal
    persistent programs take their Q tiles from the host's plan (``fa3.plan_causal``), not the
    snake deal."""
    consumers: int
    stages: int
    consumer_regs: int
    pingpong: bool = True
    overlap: bool = True
    longest_first: bool = True
    persistent: bool = False
    causal_from: int = 0
    tma_store: bool = True
    causal_persistent: bool = False
    q_buffers: int = 1
    planned: bool = True

    def settings(self, is_causal: bool) -> dict:
        """The keywords of ``fa3.forward`` for a dense or a causal call."""
        persistent = self.persistent and (not is_causal or self.causal_persistent)
        return dict(CONSUMERS=self.consumers, STAGES=self.stages,
                    CONSUMER_REGS=self.consumer_regs, PINGPONG=self.pingpong,
                    OVERLAP=self.overlap, LONGEST_FIRST=self.longest_first,
                    PERSISTENT=persistent, TMA_STORE=self.tma_store,
                    Q_BUFFERS=self.q_buffers if persistent else 1,
                    PLANNED=self.planned and persistent and is_causal)


@dataclass(frozen=True)
class BackwardSchedule:
    """FlashAttention-3's backward (fa3_backward.py): stages of (Q_i, dO_i) in shared memory,
    buffers for dQ_i on its way to the writer, registers per consumer thread, whether the
    loop-invariant operands' descriptors are made each step (where they would spill),
    whether dropout's mask selects P_ij once in float32 (where its registers fit), and
    whether one program per SM takes the K/V tiles in turn (``persistent``: dense calls
    without dropout; causal ones too with ``causal_persistent``, by the host's plan) with
    ``kv_buffers`` for K_j, V_j (2: the next tile's copied during this one)."""
    stages: int = 2
    dq_buffers: int = 1
    consumer_regs: int = 240
    fresh_descriptors: bool = False
    select_once: bool = False
    persistent: bool = False
    causal_persistent: bool = False
    kv_buffers: int = 1

    def settings(self, is_causal: bool = False, dropout: bool = False) -> dict:
        """The keywords of ``fa3_backward.launch`` for a call, causal or not, with dropout
        or not (calls with dropout keep one program per K/V tile: persistent programs were
        measured without it)."""
        persistent = (self.persistent and not dropout
                      and (not is_causal or self.causal_persistent))
        return dict(STAGES=self.stages, DQ_BUFFERS=self.dq_buffers,
                    CONSUMER_REGS=self.consumer_regs, FRESH_DESCRIPTORS=self.fresh_descriptors,
                    SELECT_ONCE=self.select_once, PERSISTENT=persistent,
                    KV_BUFFERS=self.kv_buffers if persistent else 1)


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
    # The key length from which the two launches run even where fused_backward asks for one
    # (None: never). Below it one launch measured 1.0-1.17x faster at d=64 and d=128, causal
    # or not, and starts one kernel fewer; at 16384 (causal) and 8192 (d=64) the two launches
    # were 2-3% faster (BENCHMARKS.md, "One backward launch for short sequences").
    split_from: int | None = None
    # Where causal attention's backward measured faster with other settings: used instead.
    causal_backward: "KernelConfig | None" = None
    # Tiles of the block-sparse forward. None: the forward's, without TMA and warp
    # specialization (on the block-sparse loops TMA alone measured 3-9% slower, speed.md).
    sparse_forward: Tiles | None = None
    # Tiles of the forward with dropout, where the forward's do not fit it or dropout runs
    # faster on others: None, the forward's.
    dropout_forward: Tiles | None = None
    # The backward with dropout, where the backward's tiles do not fit it or dropout runs
    # faster on others: None, the backward's. A dropout call takes it, causal or not (it
    # replaces causal_backward too).
    dropout_backward: "KernelConfig | None" = None
    # The entry (forward and backward tiles) of a call without a block mask or dropout while
    # the key length is below short_until (None: this entry at every length). A short
    # sequence is few programs of little work each: small tiles give an SM several programs
    # to switch between, and the causal diagonal masks less of each tile.
    short: "KernelConfig | None" = None
    short_until: int = 0
    # FlashAttention-3's forward (fa3.py) for dense and causal calls on sm_90 from
    # ``schedule_from`` keys and queries on; None: the Triton kernel's forward.
    schedule: Schedule | None = None
    schedule_from: int = 0
    # the fa3 forward's schedule for calls with dropout, where another measured faster for
    # them (None: ``schedule``)
    dropout_schedule: Schedule | None = None
    # its backward (fa3_backward.py) for those calls; None: the Triton kernels' backward
    backward_schedule: BackwardSchedule | None = None

    def fa3_settings(self, Nq: int, Nk: int, is_causal: bool = False,
                     dropout: bool = False) -> dict | None:
        """The fa3 forward's settings for a call of Nq queries and Nk keys, or None."""
        schedule = (dropout and self.dropout_schedule) or self.schedule
        if schedule is None or min(Nq, Nk) < self.schedule_from:
            return None
        if is_causal and min(Nq, Nk) < schedule.causal_from:
            return None
        return schedule.settings(is_causal)

    def fa3_backward_settings(self, Nq: int, Nk: int, is_causal: bool = False,
                              dropout: bool = False) -> dict | None:
        """The fa3 backward's settings for a call of Nq queries and Nk keys, or None."""
        if self.backward_schedule is None or min(Nq, Nk) < self.schedule_from:
            return None
        return self.backward_schedule.settings(is_causal, dropout)

    def _short(self, block_mask, Nk: int, dropout: bool) -> "KernelConfig | None":
        if block_mask is None and not dropout and Nk < self.short_until:
            return self.short
        return None

    def forward_tiles(self, block_mask, Nk: int, dropout: bool = False) -> Tiles:
        """The forward's tiles for a call with (or without) a block mask, ``Nk`` keys, and
        dropout."""
        short = self._short(block_mask, Nk, dropout)
        if short is not None:
            return short.forward
        tiles = (dropout and self.dropout_forward) or self.forward
        if block_mask is None:
            return tiles
        return self.sparse_forward or replace(tiles, tma=False, warp_specialize=False)

    def backward_entry(self, is_causal: bool, dropout: bool, block_mask, Nk: int):
        """The entry whose dK/dV and dQ tiles (and launch layout) a backward takes."""
        if dropout and self.dropout_backward is not None:
            return self.dropout_backward  # causal or not
        short = self._short(block_mask, Nk, dropout)
        if short is not None:
            return short
        if is_causal and self.causal_backward is not None:
            return self.causal_backward
        return self


INTERPRETER = KernelConfig(Tiles(32, 16), Tiles(16, 32), Tiles(32, 16), 32)

# H100 (sm_90), 16-bit inputs, keyed by padded head dim: the fastest of `flashedu bench tune`
# at N=8192, bf16 (docs/bench/triton.md), one config serving causal and not. d=128's backward:
# one launch with 3 stages, 1.05-1.15x one launch with 2 from N=4096 to 65536, and 1.02-1.09x
# two launches with 3 up to 32768 (equal at 65536); two launches from 65536 on (1.04x at
# 131072): docs/bench/long_dense_bwd_h100.json, BENCHMARKS.md "The dense d=128
# backward with three stages". At d=64 one launch was not faster at N=8192, but shorter
# sequences gain from it: ``split_from``.
# Forwards of d=128 and d=256: `flashedu bench forward` (docs/bench/speed.md): TMA and warp
# specialization +4-8% at d=128; 128x64 tiles 1.3-1.6x at d=256. At d=64, TMA was within noise
# and slower for short causal sequences: left off.
# Up to d=64, two programs of 8 warps share an SM only while each uses at most 128 registers
# per thread; left to itself the compiler took 130-158 for the causal forward and the backward,
# and those ran 0.83x (BENCHMARKS.md, "Registers"): maxnreg=128 holds them there.
_FORWARD_128 = Tiles(128, 128, 8, 3, tma=True, warp_specialize=True)
# d=256's backward, timed tile by tile (docs/bench/d256_backward_h100.json): the dK/dV program
# on 64 x 64 tiles spills 272 bytes a thread and still runs 1.8x the spill-free 16 x 64 (each
# K/V tile it holds meets 64 query rows a step, not 16); dQ on 128 x 32 with 8 warps and 3
# stages (224 KB of the H100's 227), 3-6% ahead of 2 stages
_D256 = KernelConfig(Tiles(128, 64, 8, 2, tma=True), Tiles(64, 64, 8, 2), Tiles(128, 32, 8, 3),
                     fused_backward=False)
_SMALL_D = KernelConfig(Tiles(128, 64, 8, 3, maxnreg=128), Tiles(32, 128, 8, 3, maxnreg=128),
                        Tiles(128, 64, 8, 3, maxnreg=128), fused_backward=True, split_from=8192)
# With dropout at d=64 (H200, N=1024-4096, p=0.1): a forward of 4 warps 0-3% faster, and
# dK/dV on 64 x 64 tiles with 4 warps 10-13% faster than on the 32 x 128 of 8 warps, where
# the registers the mask's draws take spill; dQ on 64 x 64 1-4% more (one launch: the dK/dV
# program's 4 warps; BENCHMARKS.md, "Dropout's select in 16 bits")
_SMALL_D = replace(_SMALL_D, dropout_forward=Tiles(128, 64, 4, 3),
                   dropout_backward=replace(_SMALL_D, dkdv=Tiles(64, 64, 4, 3),
                                            dq=Tiles(64, 64, 4, 3)))
# FlashAttention-3's forward on sm_90 (fa3.py), from 4096 keys (docs/bench/fa3_h200.json,
# BENCHMARKS.md "FlashAttention-3's schedule in Gluon"): at d=64 three consumers of 64 rows on
# three stages, 1.07-1.17x the Triton kernel and 0.99-1.13x cuDNN (causal at 4096 keys 0.97x
# and 0.87x); at d=128 two consumers, three stages, no ping-pong (it measured 0.96x there):
# 1.10-1.18x the Triton kernel, 0.94-1.09x cuDNN. At d=64 dense calls take persistent programs
# (one per SM, the next Q tile's Q and first K/V tiles copied while the last one finishes):
# 1.02-1.10x one program per Q tile on an H200; at d=128 too: never more than 0.2% slower
# and up to 3.4% faster in four runs (1.00-1.03x at 8192 keys; BENCHMARKS.md, "Persistent
# programs at d = 128"); causal calls were 1-4% slower persistent (BENCHMARKS.md, "A
# persistent forward"), until each program took its Q tiles by the host's plan
# (``fa3.plan_causal``). At d=64 with two Q buffers (the next tile's Q_i copied during this
# one, 144 KB of shared memory; d=128's three stages leave no room). With all heads in one
# order: 403 / 449 / 484 TFLOP/s at 4096 / 8192 / 16384 keys, against 386 / 423 / 461 with one
# program per Q tile and 401 / 444 / 464 dealt in the snake (one run; at d=128 one program per
# Q tile stayed ahead, 493 / 555 / 591 against 475 / 542 / 567 planned). With the heads in
# groups of 8 (``fa3.PLAN_HEADS_TOGETHER``): 447-449 at 4096 and 481-495 at 16384 against
# cuDNN's 420 and 441 (BENCHMARKS.md "Causal Q tiles dealt by a plan"); at d=128 the groups
# put the plan ahead too: 546 / 582 / 596 against 502 / 551 / 585 with one program per Q tile
# and cuDNN's 522 / 526 / 535 (one run; BENCHMARKS.md "d = 128's causal Q tiles by the
# plan"). Two Q buffers, dense: at 4096 keys 494 / 489 against 487 / 486 with one;
# 8192-16384 level (0.99-1.00x) (BENCHMARKS.md, "A persistent program's next Q tile during
# this one").
_FA3_64 = Schedule(consumers=3, stages=3, consumer_regs=160, persistent=True, causal_from=4096,
                   causal_persistent=True, q_buffers=2)
# Both head dims write O_i through shared memory and the copy engine (``tma_store``), and d=128
# takes ping-pong with it: in one run 1.02-1.05x the earlier settings (no ping-pong, O_i from
# registers) at d=128; with ping-pong, the copy engine's store 1.00-1.08x registers in three
# runs (14 of 16 cells up); with that store, ping-pong on against off level (0.96-1.04x in
# four runs). At d=64 the store measured level (0.99-1.02x). BENCHMARKS.md, "O_i through the
# copy engine, and the causal forward's tail". Since the programs became persistent (and the
# causal ones planned), ping-pong off measured ahead at d=128 in four runs: dense 1.017-1.026x
# at 4096 keys, 0.99-1.02x at 8192-16384 (11 of 12 ahead), causal level (0.99-1.02x):
# off again (BENCHMARKS.md, "A persistent backward; ping-pong off again at d = 128").
_FA3_128 = Schedule(consumers=2, stages=3, consumer_regs=240, pingpong=False, persistent=True,
                    causal_persistent=True)
# With dropout (H200, N=4096, p=0.1, BENCHMARKS.md "Dropout in FlashAttention-3's schedule"):
# two consumers of 240 registers, persistent, no ping-pong, at both head dims: d=64 dense
# 1548 us against 1686 with the three consumers of 160 registers (which spill with the
# mask's registers) and 1605 for the Triton kernel; d=128 dense 1147 against 1222 one
# program per Q tile. Causal at d=64 still from 8192 (at 4096 the Triton kernel 892 us
# against 925-932).
_FA3_DROPOUT = Schedule(consumers=2, stages=3, consumer_regs=240, pingpong=False,
                        persistent=True, tma_store=False)  # as measured: O_i from registers
# Its backward (fa3_backward.py), from the same length: two stages of (Q_i, dO_i), one buffer
# for dQ_i (H200, N=8192: a second measured level at d=64 and 3-6% slower at d=128, a third
# stage level at d=64 and 4% slower at d=128 not causal). At d=128 the descriptors of K_j, V_j
# and dS made each step: 216 -> 24 bytes of spills a thread, 1.17-1.20x faster (at d=64,
# which does not spill, 0.95-1.0x). With dropout at d=64 the mask selects P_ij once, in
# float32, and dS_ij = (Z_ij P_ij) dP_ij - P_ij D_i: 1.5-3% faster than selecting P_ij in 16
# bits and dP_ij in float32; at d=128 it spills and runs 3-5% slower (H200, p=0.1, N=4096)
# Persistent programs (one per SM, K/V tiles in turn; H200, N = 4096-16384, the kernel alone,
# BENCHMARKS.md "A persistent backward"): at d=64 with two K/V buffers 0.95-0.97x the time
# of one program per tile dense and 0.94-0.98x causal (4096 keys causal: 1687 us against 1801
# and cuDNN's whole backward 1813); at d=128 with one (two do not fit) 0.96-0.99x dense, but
# causal 1.01x at 4096 keys and 1.03-1.05x at 8192-16384: one program per tile there.
_FA3_BACKWARD = BackwardSchedule(stages=2, dq_buffers=1, select_once=True, persistent=True,
                                 causal_persistent=True, kv_buffers=2)
_FA3_BACKWARD_128 = BackwardSchedule(stages=2, dq_buffers=1, fresh_descriptors=True,
                                     persistent=True)
GPU_16BIT = {
    16: _SMALL_D,
    32: _SMALL_D,
    64: replace(_SMALL_D, schedule=_FA3_64, schedule_from=4096,
                dropout_schedule=replace(_FA3_DROPOUT, causal_from=8192),
                backward_schedule=_FA3_BACKWARD),
    128: KernelConfig(_FORWARD_128, Tiles(64, 128, 8, 3), Tiles(128, 64, 8, 3),
                      fused_backward=True, split_from=65536,
                      # causal: the same tiles; one launch is 1.0-1.15x faster up to N=8192,
                      # two launches 2-3% faster from 16384 on (speed.md)
                      causal_backward=KernelConfig(_FORWARD_128, Tiles(64, 128, 8, 3),
                                                   Tiles(128, 64, 8, 3), fused_backward=True,
                                                   split_from=16384),
                      # dropout's forward: 64 x 64 tiles of 4 warps, 2% (non-causal) and 6%
                      # (causal) faster than the forward's tiles with 2 stages (with 3 they
                      # need 240 KB of shared memory, more than the H100's 227)
                      dropout_forward=Tiles(64, 64, 4, 3),
                      # below 2048 keys 64 x 64 tiles with 4 warps, one backward launch:
                      # forward 1.06-1.35x, backward 1.06-1.13x the entries above, causal or
                      # not (BENCHMARKS.md, "Short sequences: small tiles")
                      short=KernelConfig(Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 2),
                                         Tiles(64, 64, 4, 2), fused_backward=True),
                      short_until=2048, schedule=_FA3_128, schedule_from=4096,
                      dropout_schedule=_FA3_DROPOUT, backward_schedule=_FA3_BACKWARD_128),
    # dropout's dQ program needs 228 KB with 3 stages (`flashedu bench sass`): 2 stages
    256: replace(_D256, dropout_backward=replace(_D256, dq=replace(_D256.dq, num_stages=2))),
}


def padded_head_dim(d: int) -> int:
    """The power of two >= d (and >= 16) that the kernels hold in registers; loads mask the rest."""
    return max(MIN_TILE, 1 << (d - 1).bit_length())


# ------------------------------------------------------------------------------------------
# Other GPUs: tiles that fit the device's shared memory
# ------------------------------------------------------------------------------------------
#
# The table above was tuned on an H100 (227 KB of shared memory per block). Another GPU gets a
# table built for its shared memory per block: for each head dim the largest candidate tiles
# whose estimated footprint fits. The estimate counts the tiles a program keeps in shared
# memory: its own tile (Q_i, or K_j and V_j), the streamed tiles times the pipeline stages,
# and the P_ij / dS_ij operand of the second product. Should Triton still need more than the
# device has, the launch retries with smaller tiles (``smaller``).
#
# Registers bound the tiles too: a program keeps its accumulators (float32) and its own tiles
# in registers, and past 255 per thread ptxas spills to local memory. Compiled for sm_80 and
# sm_86 (``flashedu bench sass``), programs needing up to 224 words per thread by the count
# of ``register_words`` compiled without spills; 256-288 spilled a little; the 4-warp dK/dV
# program of d=128 with Bc=128 (448 words) spilled 6 KB per thread. So each candidate takes
# the fewest warps (4 or 8) that bring it within REGISTER_WORDS, or is passed over.

SMEM_PER_BLOCK = {  # bytes a block may use, by compute capability (CUDA programming guide)
    "sm75": 64 * 1024, "sm80": 163 * 1024, "sm86": 99 * 1024, "sm89": 99 * 1024,
    "sm90": 227 * 1024,
}
TABLE_ENV = "FLASHEDU_TILE_TABLE"  # e.g. sm80: use that GPU's table on this one (testing)

# (Br, Bc, num_stages), largest first; warps: the fewest that fit the registers.
_FORWARD_CANDIDATES = [(128, 64, 3), (128, 64, 2), (64, 64, 2), (64, 32, 2), (32, 32, 2),
                       (32, 32, 1), (16, 32, 1), (16, 16, 1)]
_DKDV_CANDIDATES = [(32, 128, 2), (32, 64, 2), (16, 64, 2), (16, 32, 2), (16, 32, 1),
                    (16, 16, 1)]
_DQ_CANDIDATES = [(128, 64, 2), (64, 64, 2), (64, 32, 2), (32, 32, 2), (32, 32, 1),
                  (16, 32, 1), (16, 16, 1)]


def smem_estimate(kind: str, Br: int, Bc: int, stages: int, D: int, elem: int) -> int:
    """Estimated bytes of shared memory of one program: ``kind`` is "forward", "dkdv" or "dq"."""
    stages = max(stages, 1)
    if kind == "forward":  # Q_i; K_j, V_j per stage; P_ij
        return (Br * D + stages * 2 * Bc * D + Br * Bc) * elem
    if kind == "dkdv":  # K_j, V_j; Q_i, dO_i per stage; P_ij^T and dS_ij^T
        return (2 * Bc * D + stages * 2 * Br * D + 2 * Br * Bc) * elem
    if kind == "dq":  # Q_i, dO_i; K_j, V_j per stage; dS_ij
        return (2 * Br * D + stages * 2 * Bc * D + Br * Bc) * elem
    raise ValueError(f"kind must be forward, dkdv or dq, got {kind!r}")


REGISTER_WORDS = 224  # per thread, see above


def register_words(kind: str, Br: int, Bc: int, D: int, elem: int) -> int:
    """32-bit words one program keeps in registers: its float32 accumulators and score tiles,
    and the tiles it loads once (``elem`` bytes each): "forward" O_i, S_ij and Q_i; "dkdv"
    dK_j, dV_j, S_ij^T and dS_ij^T, K_j and V_j; "dq" dQ_i, S_ij and dS_ij, Q_i and dO_i."""
    if kind == "forward":
        return Br * D + Br * Bc + Br * D * elem // 4
    if kind == "dkdv":
        return 2 * Bc * D + 2 * Br * Bc + 2 * Bc * D * elem // 4
    if kind == "dq":
        return Br * D + 2 * Br * Bc + 2 * Br * D * elem // 4
    raise ValueError(f"kind must be forward, dkdv or dq, got {kind!r}")


def _fit(kind, candidates, D, elem, budget) -> Tiles:
    """The first candidate whose shared memory fits ``budget`` and whose registers fit
    REGISTER_WORDS per thread with 4 or 8 warps (the fewer)."""
    for Br, Bc, stages in candidates:
        if smem_estimate(kind, Br, Bc, stages, D, elem) > budget:
            continue
        for warps in (4, 8):
            if register_words(kind, Br, Bc, D, elem) <= REGISTER_WORDS * 32 * warps:
                return Tiles(Br, Bc, warps, stages)
    Br, Bc, stages = candidates[-1]
    return Tiles(Br, Bc, 4, stages)


def safe_table(smem_bytes: int, elem: int) -> dict:
    """{padded head dim: KernelConfig} whose estimated footprints fit ``smem_bytes`` (with a
    tenth kept back for what the estimate misses), for inputs of ``elem`` bytes."""
    budget = int(smem_bytes * 0.9)
    return {D: KernelConfig(_fit("forward", _FORWARD_CANDIDATES, D, elem, budget),
                            _fit("dkdv", _DKDV_CANDIDATES, D, elem, budget),
                            _fit("dq", _DQ_CANDIDATES, D, elem, budget), fused_backward=False)
            for D in (16, 32, 64, 128, 256)}


# Where Triton computes tl.dot with float32 FMAs instead of tensor cores (checked in the
# compiled PTX of Triton 3.9): on Turing (sm_75: a T4, an RTX 20xx) for every dtype, and on
# every GPU for float32 inputs (the exact "ieee" product). An FMA product holds both operands
# in registers, so the shared-memory fit above leaves tiles that spill 0.4-6 KB per thread
# (and the halved 16-bit tiles that fp32 had on the H100 spilled up to 13 KB at d=128).
# These tiles are per head dim the largest that compiled for sm_75 without spills, fp16 and
# fp32 (`flashedu bench sass --table sm75 --dtype fp16`), 8 warps where that made the
# difference; at d=256 the 16-bit backward still spills 0.2-0.3 KB, the least of the tiles
# tried, and the fp32 dK/dV program needs 65 KB, more than Turing's 64 (its launch fails with
# Triton's out-of-resources error). Compiled, not timed: no Turing GPU was at hand.
FMA_TABLE = {D: KernelConfig(Tiles(*f), Tiles(*kv), Tiles(*q), fused_backward=False)
             for D, (f, kv, q) in {
                 16: ((64, 32, 4, 2), (16, 64, 4, 2), (64, 32, 4, 2)),
                 32: ((64, 32, 4, 2), (16, 32, 4, 2), (64, 32, 4, 2)),
                 64: ((32, 32, 4, 2), (16, 32, 4, 2), (32, 16, 4, 2)),
                 128: ((32, 32, 8, 2), (16, 16, 8, 2), (16, 16, 8, 2)),
                 256: ((16, 32, 8, 2), (16, 16, 8, 1), (16, 16, 8, 1)),
             }.items()}
# Turing's 64 KB: the fp32 forward of d=256 on 16 x 16 tiles (48 KB; 16 x 32 needs 80)
FMA_TABLE_SM75_FP32 = {**FMA_TABLE, 256: replace(FMA_TABLE[256],
                                                 forward=Tiles(16, 16, 8, 1))}


def table(name: str, is_fp32: bool) -> dict:
    """The tile table of a GPU named by its compute capability ("sm90", "sm80", ...)."""
    if name not in SMEM_PER_BLOCK:
        raise ValueError(f"{TABLE_ENV}: tables exist for {sorted(SMEM_PER_BLOCK)}, got {name!r}")
    if name == "sm90":
        return FMA_TABLE if is_fp32 else GPU_16BIT
    if name == "sm75" and is_fp32:
        return FMA_TABLE_SM75_FP32
    if name == "sm75" or is_fp32:
        return FMA_TABLE
    return safe_table(SMEM_PER_BLOCK[name], 2)


@functools.lru_cache(maxsize=None)
def device_table_name(index: int) -> str:
    """The table a CUDA device gets: its own compute capability's where flashedu has one (sm_90
    and newer: the tuned table), else a table fitted to its shared memory per block."""
    import torch

    forced = os.environ.get(TABLE_ENV)
    if forced:
        table(forced, False)  # an unknown name is an error now, not at the first launch
        return forced
    major, minor = torch.cuda.get_device_capability(index)
    if major >= 9:
        return "sm90"
    name = f"sm{major}{minor}"
    if name in SMEM_PER_BLOCK:
        return name
    smem = torch.cuda.get_device_properties(index).shared_memory_per_block_optin
    SMEM_PER_BLOCK[name] = smem
    return name


@functools.lru_cache(maxsize=None)
def _device_config(index: int, D: int, is_fp32: bool) -> KernelConfig:
    return table(device_table_name(index), is_fp32)[D]


def kernel_config(d: int, is_fp32: bool, interpreted: bool, device=None) -> KernelConfig:
    """The tile table entry for head dim d: small tiles under the interpreter; on a GPU the
    table of ``device`` (None: the current CUDA device); without a CUDA GPU (reading the
    tables) the H100's, or the one FLASHEDU_TILE_TABLE names."""
    if interpreted:
        return INTERPRETER
    import torch

    if not torch.cuda.is_available():  # reading the tables without a GPU: the tuned one
        return table(os.environ.get(TABLE_ENV) or "sm90", bool(is_fp32))[padded_head_dim(d)]
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    return _device_config(index, padded_head_dim(d), bool(is_fp32))


def smaller(tiles: Tiles) -> Tiles | None:
    """The next tiles to try after Triton reported too little shared memory or registers:
    one pipeline stage fewer, then the larger tile side halved (not below 16); None when
    nothing is left to shrink."""
    if tiles.num_stages > 1:
        return replace(tiles, num_stages=tiles.num_stages - 1)
    if max(tiles.Br, tiles.Bc) > MIN_TILE:
        if tiles.Br >= tiles.Bc:
            return replace(tiles, Br=tiles.Br // 2)
        return replace(tiles, Bc=tiles.Bc // 2)
    return None
