"""FlashAttention forward as a numba.cuda kernel: every tile placed in shared memory by hand.

This is :func:`flashedu.tiled.flash_forward` (the FlashAttention-2 loop order) moved onto a GPU:

- one thread block per (Q tile i, batch-head): the grid is (Tr, B*H);
- the block copies Q_i, then each K_j, V_j, from HBM into shared memory (``cuda.shared.array``),
  computes the score tile S_ij = scale * Q_i K_j^T into shared memory, updates the running row
  maximum m_i and row sum l_i, and accumulates O_i; nothing of size Nq x Nk ever exists;
- ``cuda.syncthreads()`` separates the steps: every thread reads what other threads wrote;
- register tiling: thread (ty, tx) of the TY x TX thread grid computes a TM x TN piece of S_ij
  and a TM x DN piece of O_i in its registers (``cuda.local.array`` of compile-time size), so
  each number read from shared memory feeds several multiply-adds;
- the online softmax runs on every thread: RT = threads / Br neighbouring threads share a row,
  each over a stretch of its columns, and pool their row maximum and row sum through shared
  memory;
- scores are kept in base 2 (``scale * log2(e)`` folded into the scale), as the Triton kernel
  does: ``exp2`` is one instruction of the GPU's special-function unit, ``exp`` needs a
  multiplication and range handling before it. L leaves the kernel as a natural log.

Shared memory is budgeted: :data:`SMEM_BUDGET` bytes per block, :func:`sram_bytes` says what
each buffer takes, and :func:`choose_tiles` picks the largest tiles that fit.

This module imports numba; it is itself imported only when the "numba" backend is first used,
and always after ``flashedu/__init__`` has let :mod:`flashedu.runtime` decide whether numba runs
on the GPU or in the CPU simulator (``NUMBA_ENABLE_CUDASIM=1``, read at numba's import).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

# Importing this module ran flashedu/__init__ first, so runtime.configure() has already decided
# simulator or GPU. `cuda` must be a module global: the simulator swaps it in a kernel's globals.
from numba import cuda, float32

from . import ops, runtime

# Static shared memory one block may declare with cuda.shared.array: 48 KiB on every CUDA GPU
# (more needs dynamic shared memory and an opt-in). An H100 SM holds 228 KiB, so up to four of
# these blocks share one SM, which hides one block's barriers behind another's arithmetic.
SMEM_BUDGET = 48 * 1024
MAX_HEAD_DIM = 128  # the output piece o (TM x d/TX floats) must stay in registers
FLOAT32_BYTES = 4

# Threads of a block, as a TY x TX grid. On a GPU: 128 threads (4 warps). In the simulator
# every thread is a Python thread, so blocks stay small: 32 threads.
GPU_THREADS = (16, 8)
SIM_THREADS = (4, 8)
# Register sub-tile (TM rows x TN columns of S_ij per thread), tried largest first. (At 4 x 8
# the compiler no longer unrolls every loop over s and moves it to local memory: 4 x 4 at most.)
SUBTILES = ((4, 4), (2, 4), (2, 2), (1, 2), (1, 1))
SIM_SUBTILE = (4, 2)  # Br = Bc = 16 in the simulator: several tiles even at N = 64

SKIP, FULL, PARTIAL = 0, 1, 2  # what a tile is under the block mask


@dataclass(frozen=True)
class Tiles:
    """A tiling: Br x Bc score tiles, computed by a TY x TX grid of threads."""

    Br: int
    Bc: int
    TY: int
    TX: int

    def __post_init__(self):
        if self.Br % self.TY or self.Bc % self.TX:
            raise ValueError(f"Br={self.Br} must be a multiple of TY={self.TY} and "
                             f"Bc={self.Bc} of TX={self.TX}")
        if self.TX > 32 or 32 % self.TX:
            raise ValueError(f"TX={self.TX} must divide the warp size 32")
        if self.TX % self.TM:  # the softmax gives each row TX / TM threads
            raise ValueError(f"TX={self.TX} must be a multiple of TM = Br / TY = {self.TM}")

    @property
    def TM(self) -> int:  # rows of S_ij (and of O_i) per thread
        return self.Br // self.TY

    @property
    def TN(self) -> int:  # columns of S_ij per thread
        return self.Bc // self.TX

    @property
    def threads(self) -> int:
        return self.TY * self.TX

    @property
    def RT(self) -> int:  # threads per row of S_ij in the softmax (Br * RT = threads)
        return self.TX // self.TM


def sram_bytes(tiles: Tiles, d: int) -> dict[str, int]:
    """Bytes of each shared-memory buffer of one thread block (float32), exactly as declared.

    Rows of Q_i, K_j and S_ij get one float of padding: threads of a warp that read one column
    then hit 32 different banks instead of one. V_j is widened to a multiple of TX so that every
    thread owns the same number of output columns. O_i is not here: it lives in registers, each
    thread holding its TM x ceil(d/TX) piece. This agrees with
    ``flashedu.io.sram_footprint(Br, Bc, d, "float32")`` less O_i, plus the padding, alpha and
    the softmax's partial results (``row_parts``).
    """
    Br, Bc = tiles.Br, tiles.Bc
    dv = _cdiv(d, tiles.TX) * tiles.TX
    f = FLOAT32_BYTES
    return {
        "Q_i": Br * (d + 1) * f,
        "K_j": Bc * (d + 1) * f,
        "V_j": Bc * dv * f,
        "S_ij": Br * (Bc + 1) * f,  # P_ij overwrites it
        "m_i": Br * f,
        "l_i": Br * f,
        "alpha": Br * f,  # exp(m_old - m_new): rescales O_i when the row max grows
        "row_parts": 2 * Br * tiles.RT * f,  # each softmax thread's share of its row's max and sum
    }


def choose_tiles(d: int, simulated: bool | None = None, budget: int = SMEM_BUDGET) -> Tiles:
    """The largest tiles whose shared memory fits ``budget`` for head dim ``d``."""
    if simulated is None:
        simulated = runtime.numba_simulated()
    TY, TX = SIM_THREADS if simulated else GPU_THREADS
    for TM, TN in (SIM_SUBTILE,) if simulated else SUBTILES:
        tiles = Tiles(TY * TM, TX * TN, TY, TX)
        if sum(sram_bytes(tiles, d).values()) <= budget:
            return tiles
    raise ValueError(f"no tiling fits {budget} bytes of shared memory for head dim d={d}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------
# The kernel. Built per (tiling, d): numba treats the closure's variables as compile-time
# constants, so shared and local arrays get fixed sizes and the loops over a thread's
# registers unroll (a register array indexed by a run-time value would spill to local memory).
# ----------------------------------------------------------------------------------------


@cache
def build_kernel(tiles: Tiles, d: int, barriers: bool = True):
    """Compile-ready kernel for one tiling and head dim. ``barriers=False`` leaves out every
    ``cuda.syncthreads()`` of the tile loop: a deliberately broken kernel, to show the race."""
    Br, Bc, TX, TM, TN = tiles.Br, tiles.Bc, tiles.TX, tiles.TM, tiles.TN
    NT = tiles.threads
    D = d
    DN = _cdiv(d, TX)  # output columns per thread
    DV = DN * TX  # V_j row length, zero-padded
    DP = D + 1  # padded row lengths of Q_i, K_j and S_ij: see sram_bytes
    BcP = Bc + 1  # (a shape must be built from closure constants, not computed in the kernel)
    RT = tiles.RT  # threads per row in the softmax
    CW = Bc // RT  # the columns of S_ij each of them takes
    NEG_INF = np.float32(-np.inf)
    ZERO = np.float32(0.0)
    LOG2E = np.float32(math.log2(math.e))
    LN2 = np.float32(math.log(2.0))

    @cuda.jit(device=True)
    def load_tile(dst, src, head, row0, n_rows, width, tid):
        """dst[r, c] = src[head, row0 + r, c]; zero outside src. Consecutive threads read
        consecutive elements of a row: the HBM reads of a warp coalesce."""
        rows = dst.shape[0]
        for idx in range(tid, rows * width, NT):
            r = idx // width
            c = idx - r * width
            if row0 + r < n_rows and c < D:
                dst[r, c] = src[head, row0 + r, c]
            else:
                dst[r, c] = ZERO

    @cuda.jit(device=True)
    def tile_kind(blocks, mb, first_q, last_q, first_k, last_k, mBr, mBc):
        """SKIP if the block mask hides every element of the tile, FULL if it shows all of them,
        else PARTIAL. (Without a mask there is one block covering everything: always FULL.)"""
        seen = 0
        total = 0
        for br in range(first_q // mBr, last_q // mBr + 1):
            for bc in range(first_k // mBc, last_k // mBc + 1):
                seen += blocks[mb, br, bc]
                total += 1
        if seen == 0:
            return SKIP
        return FULL if seen == total else PARTIAL

    @cuda.jit
    def flash_forward_kernel(Q, K, V, O, L, scale, causal, group, blocks, mBr, mBc):
        # Q, O: (B*H, Nq, d); K, V: (B*Hkv, Nk, d); L: (B*H, Nq). One block per (i, bh).
        i = cuda.blockIdx.x
        bh = cuda.blockIdx.y
        kv = bh // group  # grouped-query attention: `group` query heads share a K/V head
        mb = bh % blocks.shape[0]  # the block mask may be one for all heads
        tid = cuda.threadIdx.x
        ty = tid // TX  # this thread owns rows ty*TM .. ty*TM+TM-1 of the tile
        tx = tid % TX  # and columns tx, tx+TX, tx+2TX, ... (neighbours read neighbouring banks)
        Nq = Q.shape[1]
        Nk = K.shape[1]
        first_q = i * Br
        last_q = min(first_q + Br, Nq) - 1
        scale2 = scale * LOG2E  # scores in base 2: exp(x) = exp2(x * log2(e))

        # SRAM: the block's tiles. Sizes are compile-time constants (see sram_bytes).
        Q_i = cuda.shared.array((Br, DP), float32)
        K_j = cuda.shared.array((Bc, DP), float32)
        V_j = cuda.shared.array((Bc, DV), float32)
        S_ij = cuda.shared.array((Br, BcP), float32)
        m_i = cuda.shared.array(Br, float32)
        l_i = cuda.shared.array(Br, float32)
        alpha = cuda.shared.array(Br, float32)
        part_m = cuda.shared.array((Br, RT), float32)  # each softmax thread's share of a row
        part_l = cuda.shared.array((Br, RT), float32)
        # Registers: this thread's piece of S_ij and of O_i, and the operands of one step.
        s = cuda.local.array((TM, TN), float32)
        o = cuda.local.array((TM, DN), float32)
        pv = cuda.local.array((TM, DN), float32)  # this tile's P_ij V_j
        q = cuda.local.array(TM, float32)
        k = cuda.local.array(TN, float32)
        v = cuda.local.array(DN, float32)

        load_tile(Q_i, Q, bh, first_q, Nq, D, tid)
        if tid < Br:
            m_i[tid] = NEG_INF
            l_i[tid] = ZERO
        for a in range(TM):
            for e in range(DN):
                o[a, e] = ZERO
        cuda.syncthreads()  # Q_i, m_i, l_i are written before anyone reads them

        Tc = (Nk + Bc - 1) // Bc
        if causal:  # tiles right of the diagonal hold no visible key: never visit them
            Tc = min(Tc, last_q // Bc + 1)
        for j in range(Tc):
            first_k = j * Bc
            kind = tile_kind(blocks, mb, first_q, last_q, first_k, min(first_k + Bc, Nk) - 1,
                             mBr, mBc)
            if kind == SKIP:  # the same answer in every thread: the barriers below stay uniform
                continue
            load_tile(K_j, K, kv, first_k, Nk, D, tid)
            load_tile(V_j, V, kv, first_k, Nk, DV, tid)
            if barriers:
                cuda.syncthreads()  # (1) K_j, V_j fully loaded before S_ij reads them

            # S_ij = scale * Q_i K_j^T: TM + TN shared loads feed TM * TN multiply-adds.
            for a in range(TM):
                for b in range(TN):
                    s[a, b] = ZERO
            for c in range(D):
                for a in range(TM):
                    q[a] = Q_i[ty * TM + a, c]
                for b in range(TN):
                    k[b] = K_j[tx + b * TX, c]
                for a in range(TM):
                    for b in range(TN):
                        s[a, b] += q[a] * k[b]
            # Only a tile that crosses the end of the keys, the causal diagonal or a partial
            # mask block needs the test per element (the NumPy version's TileMask, FULL or not)
            masked = (first_k + Bc > Nk or (causal and first_k + Bc - 1 > first_q)
                      or kind == PARTIAL)
            if masked:
                for a in range(TM):
                    row = first_q + ty * TM + a
                    for b in range(TN):
                        col = first_k + tx + b * TX
                        hidden = col >= Nk or (causal and col > row) or (
                            kind == PARTIAL and row < Nq
                            and blocks[mb, row // mBr, col // mBc] == 0)
                        S_ij[ty * TM + a, tx + b * TX] = NEG_INF if hidden else s[a, b] * scale2
            else:
                for a in range(TM):
                    for b in range(TN):
                        S_ij[ty * TM + a, tx + b * TX] = s[a, b] * scale2
            if barriers:
                cuda.syncthreads()  # (2) S_ij complete before rows are reduced

            # Online softmax on every thread: the RT threads of row r (neighbours in a warp)
            # each take CW columns, from c0; their maxima and sums meet in part_m and part_l.
            r = tid // RT
            h = tid % RT
            c0 = h * CW
            m_old = m_i[r]
            m_part = m_old
            for c in range(c0, c0 + CW):
                m_part = max(m_part, S_ij[r, c])
            part_m[r, h] = m_part
            if barriers:
                cuda.syncthreads()  # (3a) every share of the row maximum is written
            m_new = m_old
            for t in range(RT):
                m_new = max(m_new, part_m[r, t])
            # A row that has seen no visible key keeps m = -inf; subtract 0 instead, so that
            # exp(-inf - (-inf)) = NaN never happens (its P and alpha are then 0).
            m_use = ZERO if m_new == NEG_INF else m_new
            row_sum = ZERO
            for c in range(c0, c0 + CW):
                p = math.exp2(S_ij[r, c] - m_use)
                S_ij[r, c] = p
                row_sum += p
            part_l[r, h] = row_sum
            if h == 0:
                alpha[r] = math.exp2(m_old - m_use)
                m_i[r] = m_new
            if barriers:
                cuda.syncthreads()  # (3) P_ij, alpha and the row sums ready
            if h == 0:  # l_i is read again only after the next tile's barriers
                row_sum = ZERO
                for t in range(RT):
                    row_sum += part_l[r, t]
                l_i[r] = alpha[r] * l_i[r] + row_sum

            # O_i = alpha * O_i + P_ij V_j: TM + DN shared loads feed TM * DN multiply-adds.
            # P_ij V_j is summed on its own first: a sum of Bc terms added once per tile rounds
            # far less than adding all Nk terms one by one into O_i (error ~ Bc + Tc, not Nk).
            for a in range(TM):
                for e in range(DN):
                    pv[a, e] = ZERO
            for c in range(Bc):
                for a in range(TM):
                    q[a] = S_ij[ty * TM + a, c]  # reuse q's registers for P_ij's column
                for e in range(DN):
                    v[e] = V_j[c, tx + e * TX]
                for a in range(TM):
                    for e in range(DN):
                        pv[a, e] += q[a] * v[e]
            for a in range(TM):
                for e in range(DN):
                    o[a, e] = alpha[ty * TM + a] * o[a, e] + pv[a, e]
            if barriers:
                cuda.syncthreads()  # (4) everyone is done with K_j, V_j, S_ij: next tile may load

        # Epilogue: O_i / l_i and L_i = m_i + log(l_i) to HBM, L back in natural log (m_i
        # is in base 2); a row with no visible key (l_i = 0) gets O = 0 and L = -inf.
        for a in range(TM):
            r = ty * TM + a
            row = first_q + r
            if row < Nq:
                l = l_i[r]
                inv_l = ZERO if l == ZERO else np.float32(1.0) / l
                for e in range(DN):
                    col = tx + e * TX
                    if col < D:
                        O[bh, row, col] = o[a, e] * inv_l
                if tx == 0:
                    L[bh, row] = NEG_INF if l == ZERO else (m_i[r] + math.log2(l)) * LN2

    return flash_forward_kernel


# ----------------------------------------------------------------------------------------
# Host side: torch tensors in and out.
# ----------------------------------------------------------------------------------------


def forward(q, k, v, *, is_causal=False, scale=None, block_mask=None, tiles=None, barriers=True,
            poison=False):
    """Run the kernel. q: (B, H, Nq, d); k, v: (B, Hkv, Nk, d). Returns (out, L): out like q
    (computed in float32, cast back), L (B, H, Nq) float32 natural-log logsumexp.

    ``is_causal`` is or-ed with the block mask's own causal flag, as flashedu.attention does.
    ``tiles`` overrides :func:`choose_tiles`; ``barriers=False`` runs the broken kernel;
    ``poison=True`` fills O and L with NaN before the launch, so that any element the kernel
    fails to write shows up in a check."""
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if d > MAX_HEAD_DIM:
        raise ValueError(f"q, k, v: head dim d={d} is larger than the numba kernel's maximum "
                         f"{MAX_HEAD_DIM} (its output piece is held in registers)")
    if block_mask is not None and block_mask.needs_mask_mod:
        raise NotImplementedError(
            f"block_mask: the numba kernel skips the tiles a block mask hides but does not apply "
            f"its mask mod inside partial tiles ({block_mask.mask_mod!r}); use "
            f"flashedu.attention with {_alternatives('mask_mod')}")
    tiles = choose_tiles(d) if tiles is None else tiles
    is_causal = bool(is_causal or (block_mask is not None and block_mask.is_causal))
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    # the simulator works on NumPy views of CPU tensors; compiled, the kernel needs CUDA tensors
    device = torch.device("cpu") if runtime.numba_simulated() else torch.device("cuda")

    def prep(t, heads, n):
        return t.detach().to(device=device, dtype=torch.float32).reshape(B * heads, n, d).contiguous()

    Q, K, V = prep(q, H, Nq), prep(k, Hkv, Nk), prep(v, Hkv, Nk)
    O = torch.empty_like(Q)
    L = torch.empty(B * H, Nq, dtype=torch.float32, device=device)
    if poison:
        O.fill_(math.nan)
        L.fill_(math.nan)
    blocks, (mBr, mBc) = _mask_blocks(block_mask, B, H, Nq, Nk, device)
    kernel = build_kernel(tiles, d, barriers)
    grid = (_cdiv(Nq, tiles.Br), B * H)
    args = (Q, K, V, O, L, np.float32(scale), bool(is_causal), H // Hkv, blocks, mBr, mBc)
    _launch(kernel, grid, tiles.threads, args)
    out = O.reshape(B, H, Nq, d).to(device=q.device, dtype=q.dtype)
    return out, L.reshape(B, H, Nq).to(q.device)


def _mask_blocks(block_mask, B, H, Nq, Nk, device):
    """The block mask as a (B*H or 1, Tr, Tc) uint8 tensor and its block size. Without one:
    a single block covering all of S, marked visible."""
    if block_mask is None:
        return torch.ones(1, 1, 1, dtype=torch.uint8, device=device), (Nq, Nk)
    blocks = block_mask.blocks
    if blocks.shape[:2] != (1, 1):
        blocks = block_mask.expand(B, H).blocks
    blocks = np.ascontiguousarray(blocks.reshape(-1, *blocks.shape[-2:]), dtype=np.uint8)
    return torch.from_numpy(blocks).to(device), block_mask.block_size


def _launch(kernel, grid, threads, args):
    """Launch on torch's current CUDA stream (so torch work before and after is ordered with
    it), or in the simulator, which takes NumPy views of the CPU tensors and writes into them."""
    if runtime.numba_simulated():
        args = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
        kernel[grid, threads](*args)
        return
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    args = [cuda.as_cuda_array(a) if isinstance(a, torch.Tensor) else a for a in args]
    kernel[grid, threads, stream](*args)


# The backends that have what this kernel lacks, named in its errors: flashedu.backends fills it
# when it loads this backend (this module imports no layer above it).
ALTERNATIVES: dict[str, tuple] = {"backward": (), "mask_mod": ()}


def _alternatives(feature: str) -> str:
    names = ALTERNATIVES.get(feature, ())
    if names:
        return f"one of the backends {list(names)}"
    call = "backends_with_backward()" if feature == "backward" else f"backends_with({feature!r})"
    return f"a backend that has it (flashedu.backends.{call} lists them)"


class _NumbaAttention(torch.autograd.Function):
    """Forward through the kernel; there is no backward kernel in this stage of the course."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, block_mask):
        if ops.holds_no_values(q, k, v):  # meta or fake tensors: the output's shape only
            return torch.empty_like(q, memory_format=torch.contiguous_format)
        return forward(q, k, v, is_causal=is_causal, scale=scale, block_mask=block_mask)[0]

    @staticmethod
    def backward(ctx, d_out):
        raise NotImplementedError(
            "the numba backend computes the forward pass only and has no backward; for "
            f"gradients use {_alternatives('backward')}, e.g. "
            "flashedu.attention(..., backend='numpy')")


def attention(q, k, v, *, is_causal, scale, block_mask, dropout_p):
    """Backend entry point of ``flashedu.attention(..., backend="numba")`` (inputs checked).

    The kernel computes in float32 (its shared-memory tiles are float32): float16 and bfloat16
    inputs gain precision and are cast back, but float64 inputs would silently lose it, so they
    are refused with a TypeError (call ``.float()`` first, or use backend "numpy" or "naive",
    which compute float64 in float64). :func:`forward` itself, the teaching entry point, takes
    any float dtype and says in its docstring that it computes in float32."""
    if q.dtype == torch.float64:
        raise TypeError(
            "the numba backend computes in float32 and would round float64 q, k, v to float32 "
            "without saying so: pass q.float(), k.float(), v.float() (the output is then "
            "float32), or use backend='numpy' or 'naive', which compute float64 in float64")
    if dropout_p > 0:
        raise NotImplementedError("the numba backend has no dropout; use dropout_p=0.0")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"q, k, v: head dim d={q.shape[-1]} is larger than the numba kernel's "
                         f"maximum {MAX_HEAD_DIM}")
    ops.refuse_transforms("flashedu.attention(backend='numba') (a kernel launch, no operator)",
                          q, k, v)
    return _NumbaAttention.apply(q, k, v, is_causal, scale, block_mask)
