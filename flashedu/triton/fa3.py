"""FlashAttention-3's forward schedule on Hopper, written in Gluon.

The same loop as ``forward.py`` (Q_i held, K_j and V_j streamed past, the online softmax of
m_i and l_i, O_i written once with L_i), laid out as FlashAttention-3 (Shah et al., 2024)
lays it out on an H100, with every hardware step written down instead of left to Triton:

- warp specialization: one warp only issues the copies (TMA) of Q_i, K_j and V_j into a ring
  of shared-memory stages; two or three warpgroups of 4 warps (the consumers) only compute.
  Each consumer owns 64 of the program's Br = 64 * CONSUMERS rows. Ready and free mbarriers
  pass the stages between them.
- ping-pong (PINGPONG): the consumers take turns, in order, at issuing their matrix products,
  so that one's softmax runs while the tensor cores serve another (the paper's
  inter-warpgroup overlap). The turn passes through one mbarrier per consumer.
- the softmax of tile j under the products of tile j+1 (OVERLAP): S_ij+1 = Q_i K_j+1^T and
  O_i += P_ij V_j are issued together and asynchronously (wgmma); the consumer waits for S
  only, computes its softmax while P V still runs, then waits for that one (the paper's
  intra-warpgroup overlap).
- registers moved from the copy warp to the consumers (``warp_specialize``'s register counts:
  setmaxnreg).
- persistent programs (PERSISTENT): one program per SM takes Q tiles in turn; the K/V ring
  and the ping-pong turns run on across them, so the next tile's Q_i and first K_j, V_j are
  copied while the consumers finish the last one (a program per Q tile starts with an empty
  ring and ends with idle tensor cores). Causal Q tiles follow a plan made on the host
  (PLANNED, ``plan_causal``): a few heads at a time, so that their K and V stay in L2, each
  tile, longest first, to the program with the least work so far, so that every program gets
  about the same work (without a plan they are dealt longest first, in a snake).
- O_i out through shared memory (TMA_STORE): a consumer done with a Q tile writes O_i into
  Q_i's buffer (dead once its last S_ij is made), and one thread hands it to the copy engine;
  the consumer waits only until the copy has read the buffer, the global writes finish under
  the next program's (or, persistent, the next tile's) work.

Only what a training step's dense attention needs: 16-bit inputs, head dim 64 or 128, causal
(top-left, as SDPA's is_causal) or not, GQA, dropout, the base-2 logsumexp L_i for the
backward. Dropout's keep-mask is the stream of ``dropout.py`` (the same helpers, called from
Gluon): drawn in the layout of S_ij's product, where a thread holds all 16 entries of each
Philox call it draws, and passed on as one flag byte an entry (``_keep_bytes``). Other calls,
GPUs and Tritons take the readable kernel of ``forward.py``; ``usable`` says which, and
``FLASHEDU_FA3=0`` sends every call there (``SWITCH_ENV``). Every mbarrier is invalidated
before the program ends (``_invalidate``): the next program on the SM may reuse its shared
memory, and without it the kernels faulted whenever the GPU switched to another process.
Written against Triton 3.6's Gluon API, the one run on a GPU (TESTED_TRITON); it also compiles
on Triton 3.9 (``flashedu bench sass --variants fa3``), where one function was renamed.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from .. import runtime

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                  tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .dropout import keep_flags, keep_rate, random_byte
    from .forward import dropout_state
    GLUON = True
except ImportError:  # a Triton without Gluon's Hopper API: the readable kernel everywhere
    GLUON = False

TESTED_TRITON = ("3.6",)  # the Gluon API changes between releases
# On unless FLASHEDU_FA3=0, which leaves every call to the readable kernels (to compare them,
# or to rule these out)
SWITCH_ENV = runtime.FA3_SWITCH_ENV
M = 64  # rows of Q per consumer warpgroup: one wgmma's M
H100_SMS = 132  # the grid of a persistent launch compiled without a GPU (bench sass)
LOG2E = 1.4426950408889634


def usable(q, k, v, call) -> bool:
    """Whether a forward call can take this kernel: Hopper (compute capability 9.0), this
    Triton, 16-bit q/k/v alike, head dim 64 or 128, rows the copy engine can read (16-byte
    aligned), and nothing but causal or dense attention asked for (with dropout or not)."""
    from .fast import tma_ok

    if not runs_on(q.device):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or not (q.dtype == k.dtype == v.dtype):
        return False
    if q.shape[-1] not in (64, 128) or k.shape[-1] != q.shape[-1]:
        return False
    if q.shape[2] == 0 or k.shape[2] == 0:  # no key: the consumers would wait for K_0 forever
        return False
    if (call.block_mask is not None or call.mods is not None or call.sinks is not None
            or call.seqs is not None):
        return False
    return tma_ok(q, k, v)


def runs_on(device) -> bool:
    """Whether these kernels run on this device at all: switched on, Triton's Gluon as tested,
    a Hopper GPU (compute capability 9.0)."""
    from .fast import TRITON

    if not GLUON or TRITON not in TESTED_TRITON or not switched_on():
        return False
    return device.type == "cuda" and _capability(device.index) == (9, 0)


def status() -> str:
    """Whether this machine runs the kernel, and if not why (``flashedu doctor``)."""
    from .fast import TRITON

    if not switched_on():
        return f"off: {SWITCH_ENV}=0 turns them off (unset it to turn them on)"
    if not GLUON or TRITON not in TESTED_TRITON:
        return (f"off: written against Triton {' or '.join(TESTED_TRITON)}'s Gluon, this is "
                f"Triton {triton.__version__}")
    if not torch.cuda.is_available():
        return "off: no CUDA GPU"
    major, minor = _capability(torch.cuda.current_device())
    if (major, minor) != (9, 0):
        return f"off: needs compute capability 9.0 (Hopper), this GPU has {major}.{minor}"
    return ("on for dense and causal 16-bit calls of d = 64 or 128, dropout included, where "
            "the tile table asks")


def switched_on() -> bool:
    """Whether the environment leaves these kernels on: anything but FLASHEDU_FA3=0 (read at
    each call: a test or a notebook may set it while running)."""
    return os.environ.get(SWITCH_ENV, "").strip() != "0"


@functools.lru_cache(maxsize=None)
def _capability(index):
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _multiprocessors(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


if GLUON:
    _M = gl.constexpr(M)
    # a TMA load into shared memory: ``async_copy_global_to_shared`` in Triton 3.6, renamed
    # ``async_load`` later
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    @gluon.jit
    def _descriptor(base, rows, stride, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr):
        """A head's (rows x HEAD_DIM) matrix for the copy engine, fetched BLOCK rows at a
        time; rows past the end read as zeros."""
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM],
                                                                    base.dtype.element_ty)
        return tma.make_tensor_descriptor(base, [rows, HEAD_DIM], [stride, 1],
                                          [BLOCK, HEAD_DIM], layout)

    @gluon.jit
    def _out_descriptor(O, heads, H, Nq, stride_ob, stride_oh, stride_on,
                        HEAD_DIM: gl.constexpr, TMA_STORE: gl.constexpr):
        """With TMA_STORE, all of O (B, H, Nq, HEAD_DIM) for the copy engine, written 64 rows
        of one head at a time (rows past Nq are not written: a Q tile's tail stays in its
        head); made once a program, as every consumer of every Q tile writes through it.
        Without, nothing (O is stored from registers)."""
        if TMA_STORE:
            layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
                [1, 1, _M, HEAD_DIM], O.dtype.element_ty)
            return tma.make_tensor_descriptor(O, [heads // H, H, Nq, HEAD_DIM],
                                              [stride_ob, stride_oh, stride_on, 1],
                                              [1, 1, _M, HEAD_DIM], layout)
        else:
            return 0

    @gluon.jit
    def _load(descs, shared, row0, num_tiles, CONSUMERS: gl.constexpr,
              Bc: gl.constexpr, STAGES: gl.constexpr):
        """The copy warp: every consumer's Q rows once, then the K/V tiles into the ring."""
        q_desc, k_desc, v_desc = descs
        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, q_empty = shared
        mbarrier.expect(q_ready.index(0), CONSUMERS * q_desc.block_type.nbytes)
        for c in gl.static_range(CONSUMERS):
            _tma_load(q_desc, [row0 + c * _M, 0], q_ready.index(0), q_smem.index(c))
        _load_kv(k_desc, v_desc, shared, 0, num_tiles, Bc, STAGES)

    @gluon.jit
    def _load_kv(k_desc, v_desc, shared, kv0, num_tiles, Bc: gl.constexpr,
                 STAGES: gl.constexpr):
        """K_j and V_j of one Q tile's visit: tile j into stage (kv0 + j) % STAGES as soon as
        every consumer has released what that stage held (K_j and V_j arrive on barriers of
        their own: S_ij can start before V_j is in). kv0: the K/V tiles the ring took before
        (a persistent program's earlier Q tiles; 0 otherwise)."""
        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, q_empty = shared
        for j in range(num_tiles):
            s = (kv0 + j) % STAGES
            free = (((kv0 + j) // STAGES) & 1) ^ 1  # a fresh barrier counts as released once
            mbarrier.wait(kv_empty.index(s), free)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            _tma_load(k_desc, [j * Bc, 0], k_ready.index(s), k_smem.index(s))
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            _tma_load(v_desc, [j * Bc, 0], v_ready.index(s), v_smem.index(s))

    @gluon.jit
    def _scores(S_ij, j, rows, Nk, masked, Bc: gl.constexpr, IS_CAUSAL: gl.constexpr,
                layout: gl.constexpr):
        """S_ij (unscaled), -inf where ``masked`` (the ragged last tile, the causal diagonal)
        and a key is past Nk or (causal) after the row."""
        if masked:
            cols = j * Bc + gl.arange(0, Bc, gl.SliceLayout(0, layout))
            if IS_CAUSAL:
                # one compare an entry, with the row's last visible key: "col < Nk and col <=
                # row" took five (the two conditions combined as integers)
                last = gl.minimum(rows, Nk - 1)
                S_ij = gl.where(cols[None, :] <= last[:, None], S_ij, float("-inf"))
            else:
                S_ij = gl.where(cols[None, :] < Nk, S_ij, float("-inf"))
        return S_ij

    # Dropout's keep flags (``dropout.keep_flags``: bit 7 of a byte) as one byte an entry. In
    # a product's result layout a thread's registers hold, for each 8 columns, entries (r, c),
    # (r, c + 1), (r + 8, c), (r + 8, c + 1): bytes 0-3 of one Philox word's flags, in that
    # order (``flashedu.dropout``), so four uint8 entries are that word itself.
    _WORD_AS_BYTES = gl.constexpr("mov.b32 $0, $1;")
    # x where its entry's flag byte has bit 7 set, else 0: prmt's sign mode spreads byte b's
    # bit 7 over a mask (selector nibble 8 + b), then an AND; four float32 entries ...
    _KEPT_4X32 = gl.constexpr(
        "{ .reg .b32 %m; prmt.b32 %m, $8, 0, 0x8888; and.b32 $0, $4, %m; "
        "prmt.b32 %m, $8, 0, 0x9999; and.b32 $1, $5, %m; prmt.b32 %m, $8, 0, 0xAAAA; "
        "and.b32 $2, $6, %m; prmt.b32 %m, $8, 0, 0xBBBB; and.b32 $3, $7, %m; }")
    # ... or four 16-bit entries, two a register
    _KEPT_4X16 = gl.constexpr(
        "{ .reg .b32 %m; prmt.b32 %m, $4, 0, 0x9988; and.b32 $0, $2, %m; "
        "prmt.b32 %m, $4, 0, 0xBBAA; and.b32 $1, $3, %m; }")

    @gluon.jit
    def _keep_bytes(drop, rows, cols):
        """Z_ij of the tile (rows, cols) as flag bytes, uint8, in the layout of a product's
        result (rows and cols sliced from it): the stream of ``dropout.py`` with each
        entry's counter computed on its own, which the compiler finds equal for a thread's
        16 entries of a call and draws once (4 Philox calls for 64 entries)."""
        word, b = random_byte(drop[0], drop[1], drop[2], rows, cols)
        return gl.inline_asm_elementwise(_WORD_AS_BYTES, "=r,r,r,r,r",
                                         [keep_flags(word, drop[3])], dtype=gl.uint8,
                                         is_pure=True, pack=4)

    @gluon.jit
    def _kept(x, Z):
        """x where Z (``_keep_bytes``, in x's layout) keeps the entry, else 0."""
        if x.dtype.primitive_bitwidth == 16:
            return gl.inline_asm_elementwise(_KEPT_4X16, "=r,=r,r,r,r", [x, Z], dtype=x.dtype,
                                             is_pure=True, pack=4)
        else:
            return gl.inline_asm_elementwise(_KEPT_4X32, "=r,=r,=r,=r,r,r,r,r,r", [x, Z],
                                             dtype=x.dtype, is_pure=True, pack=4)

    @gluon.jit
    def _operand(P_ij, drop, rows, j, Bc: gl.constexpr, layout: gl.constexpr,
                 DROPOUT: gl.constexpr):
        """P_ij as P V takes it: with DROPOUT, its dropped entries zeroed."""
        if DROPOUT:
            cols = j * Bc + gl.arange(0, Bc, gl.SliceLayout(0, layout))
            P_ij = _kept(P_ij, _keep_bytes(drop, rows, cols))
        return P_ij

    @gluon.jit
    def _turn(turns, mine: gl.constexpr, n, PINGPONG: gl.constexpr):
        """Wait for this consumer's n-th turn at the tensor cores."""
        if PINGPONG:
            mbarrier.wait(turns.index(mine), n & 1)

    @gluon.jit
    def _pass(turns, mine: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
        """Hand the turn to the next consumer (this one's products are issued, not
        finished)."""
        if PINGPONG:
            mbarrier.arrive(turns.index((mine + 1) % CONSUMERS), count=1)

    @gluon.jit
    def _consume(shared, out, drop, WG: gl.constexpr, CONSUMERS: gl.constexpr,
                 HEAD_DIM: gl.constexpr, Bc: gl.constexpr, STAGES: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, OVERLAP: gl.constexpr,
                 DROPOUT: gl.constexpr, TMA_STORE: gl.constexpr):
        """A consumer warpgroup of a program that owns one Q tile."""
        mbarrier.wait(shared[3].index(0), 0)  # Q_i
        _consume_tile(shared, out, drop, 0, 0, 0, WG, CONSUMERS, HEAD_DIM, Bc, STAGES,
                      IS_CAUSAL, PINGPONG, OVERLAP, False, DROPOUT, TMA_STORE)

    @gluon.jit
    def _consume_tile(shared, out, drop, kv0, turn0, qb, WG: gl.constexpr,
                      CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, Bc: gl.constexpr,
                      STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                      OVERLAP: gl.constexpr, PERSISTENT: gl.constexpr, DROPOUT: gl.constexpr,
                      TMA_STORE: gl.constexpr):
        """A consumer warpgroup over one Q tile (Q_i in shared memory already): rows
        row0 + WG*M .. + M. kv0, turn0: the K/V tiles and turns this consumer went through
        before this Q tile (a persistent program's earlier tiles; 0 otherwise); qb: the Q
        buffer that holds this tile's Q_i (a persistent program's alternate). DROPOUT: P_ij
        times the keep-mask Z_ij before its product with V_j (after l_i took it whole), drop
        = the Triton kernels' state (``_dropout_state``).

        Iteration j issues S_ij = Q_i K_j^T together with O_i += P_i,j-1 V_j-1 (P of the
        tile before), then the softmax of S_ij; the first iteration has no P V, the loop's
        end one P V alone. Causal, a consumer stops at its own rows' diagonal (``_own_tiles``)
        and releases the program's later K/V tiles unread (``_release``). TMA_STORE: O_i goes
        out through shared memory, Q_i's buffer (dead once the last S_ij is made), and the copy
        engine, instead of from registers (``_write``)."""
        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, q_empty = shared
        O, L, stride_on, row0, lse_row0, Nq, Nk, qk_scale, num_tiles, o_desc, b, h = out
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, Bc, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        dtype: gl.constexpr = q_smem.dtype
        first = row0 + WG * _M
        rows = first + gl.arange(0, _M, row_layout)
        Q_i = q_smem.index(qb * CONSUMERS + WG)
        own = _own_tiles(first, num_tiles, Nq, Nk, Bc, IS_CAUSAL)
        num_full = _unmasked(first, Nk, Bc, IS_CAUSAL)

        zero = gl.zeros([_M, Bc], gl.float32, s_layout)
        l_i = gl.zeros([_M], gl.float32, row_layout)
        O_i = gl.zeros([_M, HEAD_DIM], gl.float32, o_layout)

        # j = 0: S_i0 alone. m_i is kept in the base-2 scale, as forward.py keeps it:
        # exp2(S_ij * qk_scale - m_i) is one fused multiply-add and one ex2 an entry.
        s0 = kv0 % STAGES
        mbarrier.wait(k_ready.index(s0), (kv0 // STAGES) & 1)
        _turn(turns, WG, turn0, PINGPONG)
        S_ij = warpgroup_mma(Q_i, k_smem.index(s0).permute((1, 0)), zero, use_acc=False,
                             is_async=True)
        _pass(turns, WG, CONSUMERS, PINGPONG)
        S_ij = warpgroup_mma_wait(0, deps=(S_ij,))
        S_ij = _scores(S_ij, 0, rows, Nk, num_full == 0, Bc, IS_CAUSAL, s_layout)
        m_i = gl.max(S_ij, axis=1) * qk_scale
        P_ij = gl.exp2(S_ij * qk_scale - m_i[:, None])
        l_i = gl.sum(P_ij, axis=1)
        P_ij = gl.convert_layout(_operand(P_ij.to(dtype), drop, rows, 0, Bc, s_layout,
                                          DROPOUT), p_layout)  # 16-bit A operand registers

        for j in range(1, own):
            s = (kv0 + j) % STAGES
            phase = ((kv0 + j) // STAGES) & 1
            prev = (kv0 + j - 1) % STAGES
            prev_phase = ((kv0 + j - 1) // STAGES) & 1
            mbarrier.wait(k_ready.index(s), phase)
            mbarrier.wait(v_ready.index(prev), prev_phase)
            _turn(turns, WG, turn0 + j, PINGPONG)
            S_ij = warpgroup_mma(Q_i, k_smem.index(s).permute((1, 0)), zero, use_acc=False,
                                 is_async=True)
            O_i = warpgroup_mma(P_ij, v_smem.index(prev), O_i, is_async=True)  # P_i,j-1 V_j-1
            _pass(turns, WG, CONSUMERS, PINGPONG)
            if OVERLAP:  # S_ij only (issued first, done first); P V runs on
                S_ij = warpgroup_mma_wait(1, deps=(S_ij,))
            else:
                S_ij, O_i = warpgroup_mma_wait(0, deps=(S_ij, O_i))
            S_ij = _scores(S_ij, j, rows, Nk, j >= num_full, Bc, IS_CAUSAL, s_layout)
            m_new = gl.maximum(m_i, gl.max(S_ij, axis=1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            P_next = gl.exp2(S_ij * qk_scale - m_new[:, None])
            l_i = l_i * alpha + gl.sum(P_next, axis=1)
            m_i = m_new
            if OVERLAP:
                O_i = warpgroup_mma_wait(0, deps=(O_i,))
            mbarrier.arrive(kv_empty.index(prev), count=1)  # K_j-1 and V_j-1 read
            O_i = O_i * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            P_ij = gl.convert_layout(_operand(P_next.to(dtype), drop, rows, j, Bc, s_layout,
                                              DROPOUT), p_layout)

        if PERSISTENT and not TMA_STORE:  # every S_ij made: a later tile's Q may come
            mbarrier.arrive(q_empty.index(qb), count=1)
        # the last tile's P V
        last = (kv0 + own - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((kv0 + own - 1) // STAGES) & 1)
        _turn(turns, WG, turn0 + own, PINGPONG)
        O_i = warpgroup_mma(P_ij, v_smem.index(last), O_i, is_async=True)
        _pass(turns, WG, CONSUMERS, PINGPONG)
        O_i = warpgroup_mma_wait(0, deps=(O_i,))
        mbarrier.arrive(kv_empty.index(last), count=1)
        _release(shared, kv0, turn0, own, num_tiles, WG, CONSUMERS, STAGES, PINGPONG)

        # O_i / l_i and L_i = m_i + log2(l_i), base 2; every row saw key 0, so l_i > 0
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        if DROPOUT:  # the keep scale, once for every entry
            l_o = l_o * keep_rate(drop)  # l_i / s, exact
        out = (O_i / l_o[:, None]).to(dtype)
        if TMA_STORE:
            _write(out, Q_i, o_desc, [b, h, first, 0])
            if PERSISTENT:  # Q_i's buffer read out: a later tile's Q may come
                mbarrier.arrive(q_empty.index(qb), count=1)
        else:
            o_rows = first + gl.arange(0, _M, gl.SliceLayout(1, o_layout))
            dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
            gl.store(O + o_rows[:, None] * stride_on + dims[None, :], out,
                     mask=o_rows[:, None] < Nq)
        gl.store(L + lse_row0 + rows, m_i + gl.log2(l_i), mask=rows < Nq)

    @gluon.jit
    def _write(out, o_smem, o_desc, coords):
        """O_i (registers) to global memory by the copy engine: into shared memory, then one
        bulk copy; waits only until the copy has read the buffer (the global writes finish
        on their own, under the next tile's or program's work)."""
        o_smem.store(out)
        fence_async_shared()  # the warpgroup's writes, visible to the copy engine
        _tma_store(o_desc, coords, o_smem.reshape(o_desc.block_type.shape))
        tma.store_wait(0)

    @gluon.jit
    def _own_tiles(first, num_tiles, Nq, Nk, Bc: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """The K/V tiles a consumer's rows first .. first + M - 1 read: causal, up to their
        own diagonal, not the program's last row's (three consumers of 64 rows, tiles of 128
        keys: the first reads one tile fewer than its program in every Q tile, the second in
        every other); at least one, which every row has (it holds key 0). A consumer whose
        rows all lie past the last query (the tail of the last Q tile: at 4096 queries and
        Br = 192, two of the last tile's three) writes nothing and reads that one tile only,
        causal or not."""
        own = num_tiles
        if IS_CAUSAL:
            own = gl.maximum(1, gl.minimum(num_tiles, gl.cdiv(gl.minimum(Nk, first + _M), Bc)))
        if first >= Nq:
            own = 1
        return own

    @gluon.jit
    def _release(shared, kv0, turn0, own, num_tiles, WG: gl.constexpr,
                 CONSUMERS: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
        """The program's K/V tiles past this consumer's own (``_own_tiles``), released as
        the copy warp and the other consumers expect: each once it has landed (its stage's
        previous round is then complete, so the arrival counts in this one), with this
        consumer's turns passed on."""
        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, q_empty = shared
        for j in range(own, num_tiles):
            s = (kv0 + j) % STAGES
            mbarrier.wait(k_ready.index(s), ((kv0 + j) // STAGES) & 1)
            _turn(turns, WG, turn0 + j + 1, PINGPONG)
            _pass(turns, WG, CONSUMERS, PINGPONG)
            mbarrier.arrive(kv_empty.index(s), count=1)

    @gluon.jit
    def _in_groups(t, n_tiles, heads, heads_together):
        """Program t's (rank of its tile, batch * head), in the order the GPU starts programs:
        the heads in groups of at most ``heads_together``, as even as can be, each group's
        tiles rank by rank across its heads (tile 0 of every head of the group, then tile 1,
        ...). One head at a time (heads_together = 1) is a grid of (tiles, heads). Causal
        tiles differ in length, and ranked longest first one head at a time, the last heads'
        longest tiles start last and run on alone: a group of heads takes its longest tiles
        first together, while its heads' K and V still fit in L2 together
        (``heads_together``, host side). Counted for the shapes of ``flashedu bench fa3``
        (a greedy schedule of 132 SMs, a tile's work its K/V tiles): one head at a time takes
        1-7% longer than all work spread evenly, these groups 0.4-1.2%; groups of a fixed size
        leave a small last group, which at 16384 keys and d = 128 counted worse than one head
        at a time. Written in plain operators: Python runs it too (the tests)."""
        groups = (heads + heads_together - 1) // heads_together
        size = heads // groups  # the last groups' size; the first `extra` have one more
        extra = heads - size * groups
        in_big = extra * (size + 1) * n_tiles  # the programs of the larger groups
        g0 = extra * (size + 1) + (t - in_big) // (size * n_tiles) * size  # its first head
        if t < in_big:
            size = size + 1
            g0 = t // (size * n_tiles) * size
        r = t - g0 * n_tiles  # its place in the group
        return r // size, g0 + r % size

    @gluon.jit
    def _tile_of(n, n_q, total, plan, IS_CAUSAL: gl.constexpr, LONGEST_FIRST: gl.constexpr,
                 PLANNED: gl.constexpr):
        """A persistent program's n-th work item t (t >= total: none) as (Q tile, batch *
        head). Not causal, the order a grid of one program per Q tile starts them (a head's Q
        tiles together: its K and V stay in L2 while they pass), dealt round-robin. Causal and
        PLANNED, the host's plan (``plan_causal``: each tile, longest first, to the program
        with the least work so far), read from ``plan``. Causal otherwise, the Q tiles of
        equal length together, longest first, dealt in a snake (program 0 takes the first tile
        of the first deal and the last of the second): every program's tiles add up to about
        the same work, as long as the deals line up with the lengths (dealt round-robin in a
        head's order instead, the first programs got the long tiles of every deal: d = 128 at
        16384 keys ran at 0.74x cuDNN, against 1.02x with a program per Q tile)."""
        P = gl.num_programs(0)
        p = gl.program_id(0)
        heads = total // n_q
        if PLANNED:
            t = gl.load(plan + n * P + p)
            i = t // heads
            bh = t % heads
        elif IS_CAUSAL:
            t = n * P + p
            if n % 2 == 1:
                t = n * P + P - 1 - p
            i = t // heads
            if LONGEST_FIRST:
                i = n_q - 1 - i
            bh = t % heads
        else:
            t = n * P + p
            i = t % n_q
            bh = t // n_q
        return t, i, bh

    @gluon.jit
    def _visited(row0, Nk, Br: gl.constexpr, Bc: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """The K/V tiles the Q tile of rows row0 .. + Br visits."""
        seen = Nk
        if IS_CAUSAL:
            seen = gl.minimum(Nk, row0 + Br)
        return gl.cdiv(seen, Bc)

    @gluon.jit
    def _unmasked(first, Nk, Bc: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """How many of its K/V tiles a consumer of rows first .. first + M - 1 reads without a
        mask: those of whole keys before its first row's diagonal (causal: its own rows, not
        its program's first, so a consumer of 64 rows masks one tile of 128 keys, not two)."""
        num_full = Nk // Bc
        if IS_CAUSAL:
            num_full = gl.minimum(num_full, (first + 1) // Bc)
        return num_full

    @gluon.jit
    def _load_persistent(tensors, shared, work, HEAD_DIM: gl.constexpr,
                         CONSUMERS: gl.constexpr, Bc: gl.constexpr, STAGES: gl.constexpr,
                         IS_CAUSAL: gl.constexpr, LONGEST_FIRST: gl.constexpr,
                         Q_BUFFERS: gl.constexpr, PLANNED: gl.constexpr):
        """The copy warp of a persistent program: for each of its Q tiles, the head's
        descriptors, Q_i into buffer n % Q_BUFFERS once the consumers are done with the tile
        that buffer held, and K_j, V_j into the ring, whose count runs on across tiles (the
        next tile's first K/V tiles arrive while the consumers finish this one). With two
        buffers the next tile's Q_i arrives during this one too, where with one it waits for
        this tile's end."""
        (Q, K, V, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
         stride_vb, stride_vh, stride_vn) = tensors
        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, q_empty = shared
        H, GROUP, Nq, Nk, n_q, total, rounds, plan = work
        Br: gl.constexpr = CONSUMERS * _M
        kv = 0
        kv_last = 0
        n = 0
        for m in range(rounds):
            t, i, bh = _tile_of(m, n_q, total, plan, IS_CAUSAL, LONGEST_FIRST, PLANNED)
            if t < total:
                b = bh // H
                h = bh % H
                h_kv = h // GROUP
                row0 = i * Br
                num_tiles = _visited(row0, Nk, Br, Bc, IS_CAUSAL)
                if n > 0:  # the last tile's copies landed: their descriptors may be rewritten
                    mbarrier.wait(q_ready.index((n - 1) % Q_BUFFERS),
                                  ((n - 1) // Q_BUFFERS) & 1)
                    for r in range(gl.maximum(kv - STAGES, kv_last), kv):
                        mbarrier.wait(k_ready.index(r % STAGES), (r // STAGES) & 1)
                        mbarrier.wait(v_ready.index(r % STAGES), (r // STAGES) & 1)
                q_desc = _descriptor(Q + b * stride_qb + h * stride_qh, Nq, stride_qn, _M,
                                     HEAD_DIM)
                k_desc = _descriptor(K + b * stride_kb + h_kv * stride_kh, Nk, stride_kn, Bc,
                                     HEAD_DIM)
                v_desc = _descriptor(V + b * stride_vb + h_kv * stride_vh, Nk, stride_vn, Bc,
                                     HEAD_DIM)
                qb = n % Q_BUFFERS
                mbarrier.wait(q_empty.index(qb), ((n // Q_BUFFERS) & 1) ^ 1)
                mbarrier.expect(q_ready.index(qb), CONSUMERS * q_desc.block_type.nbytes)
                for c in gl.static_range(CONSUMERS):
                    _tma_load(q_desc, [row0 + c * _M, 0], q_ready.index(qb),
                              q_smem.index(qb * CONSUMERS + c))
                _load_kv(k_desc, v_desc, shared, kv, num_tiles, Bc, STAGES)
                kv_last = kv
                kv += num_tiles
                n += 1

    @gluon.jit
    def _consume_persistent(shared, outs, work, drop, WG: gl.constexpr,
                            CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, Bc: gl.constexpr,
                            STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                            PINGPONG: gl.constexpr, OVERLAP: gl.constexpr,
                            LONGEST_FIRST: gl.constexpr, DROPOUT: gl.constexpr,
                            TMA_STORE: gl.constexpr, Q_BUFFERS: gl.constexpr,
                            PLANNED: gl.constexpr):
        """A consumer warpgroup of a persistent program: its rows of each Q tile in turn, the
        n-th tile's Q_i in buffer n % Q_BUFFERS; the K/V ring's count and the ping-pong turns
        run on across tiles (a tile takes one turn more than it has K/V tiles)."""
        O, L, stride_qb, stride_qh, stride_qn, qk_scale, o_desc = outs
        H, GROUP, Nq, Nk, n_q, total, rounds, plan = work
        Br: gl.constexpr = CONSUMERS * _M
        kv = 0
        n = 0
        for m in range(rounds):
            t, i, bh = _tile_of(m, n_q, total, plan, IS_CAUSAL, LONGEST_FIRST, PLANNED)
            if t < total:
                row0 = i * Br
                num_tiles = _visited(row0, Nk, Br, Bc, IS_CAUSAL)
                b = bh // H
                h = bh % H
                out = (O + b * stride_qb + h * stride_qh, L, stride_qn, row0, bh * Nq, Nq, Nk,
                       qk_scale, num_tiles, o_desc, b, h)
                qb = n % Q_BUFFERS
                mbarrier.wait(shared[3].index(qb), (n // Q_BUFFERS) & 1)  # this tile's Q_i
                _consume_tile(shared, out, (drop[0], drop[1], bh, drop[3], drop[4]), kv,
                              kv + n, qb, WG, CONSUMERS, HEAD_DIM, Bc, STAGES, IS_CAUSAL,
                              PINGPONG, OVERLAP, True, DROPOUT, TMA_STORE)
                kv += num_tiles
                n += 1

    @gluon.jit
    def _invalidate(shared, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
                    Q_BUFFERS: gl.constexpr):
        """Every mbarrier of the program invalidated, once all its partitions are done: PTX
        asks that an mbarrier's shared memory not be used again (here: by the next program on
        the SM) before ``mbarrier.inval``, which Triton's own kernels end with. Without it the
        kernels faulted whenever another process's work shared the GPU (BENCHMARKS.md,
        "FlashAttention-3's kernels: the mbarriers invalidated, a shared GPU survived")."""
        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, q_empty = shared
        for qb in gl.static_range(Q_BUFFERS):
            mbarrier.invalidate(q_ready.index(qb))
            mbarrier.invalidate(q_empty.index(qb))
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(s))
            mbarrier.invalidate(v_ready.index(s))
            mbarrier.invalidate(kv_empty.index(s))
        for c in gl.static_range(CONSUMERS):
            mbarrier.invalidate(turns.index(c))

    @gluon.jit
    def _dropout_state(RNG, bh, threshold, keep_scale, DROPOUT: gl.constexpr):
        """The Triton kernels' dropout state (``forward.dropout_state``: seed, offset, bh,
        threshold, keep scale, first row) with DROPOUT; without it placeholders of the same
        shape, as the partitions take it either way."""
        if DROPOUT:
            return dropout_state(RNG, bh, (threshold, keep_scale))
        else:
            return 0, 0, 0, 0, 1.0, 0

    @gluon.jit
    def fa3_forward_kernel(Q, K, V, O, L, RNG, PLAN, qk_scale, threshold, keep_scale,
                           stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                           stride_vb, stride_vh, stride_vn, H, GROUP, Nq, Nk, total, rounds,
                           heads_together,
                           HEAD_DIM: gl.constexpr, Bc: gl.constexpr, STAGES: gl.constexpr,
                           CONSUMERS: gl.constexpr, IS_CAUSAL: gl.constexpr,
                           PINGPONG: gl.constexpr, OVERLAP: gl.constexpr,
                           LONGEST_FIRST: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           PERSISTENT: gl.constexpr, DROPOUT: gl.constexpr,
                           TMA_STORE: gl.constexpr, Q_BUFFERS: gl.constexpr = 1,
                           PLANNED: gl.constexpr = False):
        """One program per (Q tile of Br = CONSUMERS * 64 rows, batch * query head), as
        forward_kernel, started in the order of ``_in_groups``; or, PERSISTENT, one program
        per SM that takes the ``total`` Q tiles in turn. O has Q's strides; L is (B, H, Nq)
        contiguous, base-2. DROPOUT: RNG is the call's [seed, offset] tensor, threshold and
        keep_scale as ``forward.dropout_args`` gives them. TMA_STORE: O written through shared
        memory by the copy engine. Q_BUFFERS: 2, a persistent program's next Q tile loads
        while it works on this one (1 where shared memory holds one)."""
        Br: gl.constexpr = CONSUMERS * _M
        dtype: gl.constexpr = Q.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_M, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Bc, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS * CONSUMERS, _M, HEAD_DIM],
                                           q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, Bc, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, Bc, HEAD_DIM], kv_layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        for qb in gl.static_range(Q_BUFFERS):
            mbarrier.init(q_ready.index(qb), count=1)
            mbarrier.init(q_empty.index(qb), count=CONSUMERS)  # every consumer is done with it
        for s in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(kv_empty.index(s), count=CONSUMERS)  # every consumer releases it
        for c in gl.static_range(CONSUMERS):
            mbarrier.init(turns.index(c), count=1)
        mbarrier.arrive(turns.index(0), count=1)  # consumer 0 starts
        fence_async_shared()
        shared = (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, q_empty)
        n_q = gl.cdiv(Nq, Br)  # Q tiles a head; total: of all heads
        o_desc = _out_descriptor(O, total // n_q, H, Nq, stride_qb, stride_qh, stride_qn,
                                 HEAD_DIM, TMA_STORE)

        if PERSISTENT:
            tensors = (Q, K, V, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
                       stride_kn, stride_vb, stride_vh, stride_vn)
            work = (H, GROUP, Nq, Nk, n_q, total, rounds, PLAN)
            outs = (O, L, stride_qb, stride_qh, stride_qn, qk_scale, o_desc)
            drop = _dropout_state(RNG, 0, threshold, keep_scale, DROPOUT)  # bh: per tile
            if CONSUMERS == 2:
                gl.warp_specialize([
                    (_consume_persistent, (shared, outs, work, drop, 0, CONSUMERS, HEAD_DIM,
                                           Bc, STAGES, IS_CAUSAL, PINGPONG, OVERLAP,
                                           LONGEST_FIRST, DROPOUT, TMA_STORE, Q_BUFFERS,
                                           PLANNED)),
                    (_consume_persistent, (shared, outs, work, drop, 1, CONSUMERS, HEAD_DIM,
                                           Bc, STAGES, IS_CAUSAL, PINGPONG, OVERLAP,
                                           LONGEST_FIRST, DROPOUT, TMA_STORE, Q_BUFFERS,
                                           PLANNED)),
                    (_load_persistent, (tensors, shared, work, HEAD_DIM, CONSUMERS, Bc, STAGES,
                                        IS_CAUSAL, LONGEST_FIRST, Q_BUFFERS, PLANNED))],
                    [4, 1], [CONSUMER_REGS, 24])
            else:
                gl.warp_specialize([
                    (_consume_persistent, (shared, outs, work, drop, 0, CONSUMERS, HEAD_DIM,
                                           Bc, STAGES, IS_CAUSAL, PINGPONG, OVERLAP,
                                           LONGEST_FIRST, DROPOUT, TMA_STORE, Q_BUFFERS,
                                           PLANNED)),
                    (_consume_persistent, (shared, outs, work, drop, 1, CONSUMERS, HEAD_DIM,
                                           Bc, STAGES, IS_CAUSAL, PINGPONG, OVERLAP,
                                           LONGEST_FIRST, DROPOUT, TMA_STORE, Q_BUFFERS,
                                           PLANNED)),
                    (_consume_persistent, (shared, outs, work, drop, 2, CONSUMERS, HEAD_DIM,
                                           Bc, STAGES, IS_CAUSAL, PINGPONG, OVERLAP,
                                           LONGEST_FIRST, DROPOUT, TMA_STORE, Q_BUFFERS,
                                           PLANNED)),
                    (_load_persistent, (tensors, shared, work, HEAD_DIM, CONSUMERS, Bc, STAGES,
                                        IS_CAUSAL, LONGEST_FIRST, Q_BUFFERS, PLANNED))],
                    [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
        else:
            i, bh = _in_groups(gl.program_id(0), n_q, total // n_q, heads_together)
            if IS_CAUSAL and LONGEST_FIRST:  # the last Q tiles see the most keys: first
                i = n_q - 1 - i
            b = bh // H
            h = bh % H
            h_kv = h // GROUP  # grouped-query attention
            row0 = i * Br
            q_off = b * stride_qb + h * stride_qh
            q_desc = _descriptor(Q + q_off, Nq, stride_qn, _M, HEAD_DIM)
            k_desc = _descriptor(K + b * stride_kb + h_kv * stride_kh, Nk, stride_kn, Bc,
                                 HEAD_DIM)
            v_desc = _descriptor(V + b * stride_vb + h_kv * stride_vh, Nk, stride_vn, Bc,
                                 HEAD_DIM)
            num_tiles = _visited(row0, Nk, Br, Bc, IS_CAUSAL)
            out = (O + q_off, L, stride_qn, row0, bh * Nq, Nq, Nk, qk_scale, num_tiles, o_desc,
                   b, h)
            descs = (q_desc, k_desc, v_desc)
            drop = _dropout_state(RNG, bh, threshold, keep_scale, DROPOUT)
            if CONSUMERS == 2:
                gl.warp_specialize([(_consume, (shared, out, drop, 0, CONSUMERS, HEAD_DIM, Bc,
                                                 STAGES, IS_CAUSAL, PINGPONG, OVERLAP,
                                                 DROPOUT, TMA_STORE)),
                                    (_consume, (shared, out, drop, 1, CONSUMERS, HEAD_DIM, Bc,
                                                 STAGES, IS_CAUSAL, PINGPONG, OVERLAP,
                                                 DROPOUT, TMA_STORE)),
                                    (_load, (descs, shared, row0, num_tiles, CONSUMERS, Bc,
                                             STAGES))],
                                   [4, 1], [CONSUMER_REGS, 24])
            else:
                gl.warp_specialize([(_consume, (shared, out, drop, 0, CONSUMERS, HEAD_DIM, Bc,
                                                 STAGES, IS_CAUSAL, PINGPONG, OVERLAP,
                                                 DROPOUT, TMA_STORE)),
                                    (_consume, (shared, out, drop, 1, CONSUMERS, HEAD_DIM, Bc,
                                                 STAGES, IS_CAUSAL, PINGPONG, OVERLAP,
                                                 DROPOUT, TMA_STORE)),
                                    (_consume, (shared, out, drop, 2, CONSUMERS, HEAD_DIM, Bc,
                                                 STAGES, IS_CAUSAL, PINGPONG, OVERLAP,
                                                 DROPOUT, TMA_STORE)),
                                    (_load, (descs, shared, row0, num_tiles, CONSUMERS, Bc,
                                             STAGES))],
                                   [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
        # after the partitions: the barriers' memory is the SM's next program's
        _invalidate(shared, CONSUMERS, STAGES, Q_BUFFERS)


SHARED_MEMORY = 227 << 10  # bytes of shared memory a program may take on sm_90


def shared_bytes(d: int, CONSUMERS: int, STAGES: int, Q_BUFFERS: int = 1,
                 itemsize: int = 2) -> int:
    """The forward's shared memory: Q_BUFFERS x CONSUMERS Q tiles of 64 rows and STAGES
    K_j, V_j tiles of 128 keys (the barriers' few bytes aside). d = 64, three consumers, three
    stages: 120 KB with one Q buffer, 144 KB with two; d = 128, two consumers: 224 KB with
    one, so no second."""
    return (Q_BUFFERS * CONSUMERS * M + STAGES * 2 * 128) * d * itemsize


L2_SHARE = 24 << 20  # bytes a group of heads may stream through L2 at once (H100, H200: 50 MB)


def heads_together(streamed_bytes: int, grouped: bool) -> int:
    """How many heads take their tiles together (``_in_groups``): 1 unless ``grouped``; else
    as many as keep what each head's programs stream (``streamed_bytes`` a head: the
    forward's K and V, the backward's Q and dO) within L2_SHARE, at most 16."""
    if not grouped:
        return 1
    return max(1, min(16, L2_SHARE // streamed_bytes))


# The heads a causal plan takes together (``plan_causal``). d = 64 on an H200, TFLOP/s at 4096
# / 16384 keys: all heads in one order 409-419 / 471-481 (cuDNN 410-422 / 436-449), groups
# of 16 438-444 / 475-485, of 8 447-449 / 481-495 (BENCHMARKS.md, "Causal Q tiles dealt by a
# plan"): 132 programs on 8 heads' tiles share their K and V in L2, where across 128 heads
# each read its own; the plan's balance costs about 1% (counted).
PLAN_HEADS_TOGETHER = 8


def q_tile_work(i: int, Nq: int, Nk: int, CONSUMERS: int, Bc: int = 128) -> int:
    """What causal Q tile i of a program of CONSUMERS consumers costs, in K/V tiles: each
    consumer's own (``_own_tiles``, counted on the host: up to its last row's diagonal, one
    for a consumer past the last query), and one more for what a tile costs besides its
    products (Q_i's copy, O_i's store, the ring's refill)."""
    work = 1
    for c in range(CONSUMERS):
        first = (i * CONSUMERS + c) * M
        work += 1 if first >= Nq else max(1, -(-min(Nk, first + M) // Bc))
    return work


def plan_causal(Nq: int, Nk: int, heads: int, programs: int, CONSUMERS: int,
                longest_first: bool = True, heads_together: int = 0) -> list[list[int]]:
    """The causal Q tiles of ``heads`` heads (work item t = i * heads + bh) dealt to
    ``programs`` persistent programs by ``deal_longest_first``, a tile's work its
    ``q_tile_work``. The snake deal (``_tile_of``) balances only when a deal lines up with
    the tiles of one length: at d = 64 and 4096 keys, 128 heads of 22 Q tiles on 132
    programs, the snake's longest program counts 5% over the mean and this plan's 0.2%."""
    n_q = -(-Nq // (CONSUMERS * M))
    work = [q_tile_work(i, Nq, Nk, CONSUMERS) for i in range(n_q)]
    return deal_longest_first(work, heads, programs, longest_first, heads_together)


def deal_longest_first(work: list[int], heads: int, programs: int, longest_first: bool = True,
                       heads_together: int = 0) -> list[list[int]]:
    """Tiles i of ``work[i]`` each, in every one of ``heads`` heads (work item t = i * heads +
    bh), dealt to ``programs`` persistent programs, longest processing time first: in order of
    their work (of equal work the lower i first, so a tile's heads together), each to the
    program with the least work so far (of equal, the lowest-numbered). Each program's list
    runs longest first (or shortest first). heads_together > 0: the heads in groups of at
    most that many, group after group, each group's tiles longest first into the same loads
    (what the group's tiles share stays in L2 while they pass)."""
    import heapq

    order = sorted(range(len(work)), key=lambda i: -work[i])  # of equal work, the lower i
    loads = [(0, p) for p in range(programs)]  # a heap: the least loaded program on top
    plan = [[] for _ in range(programs)]
    size = heads_together or heads
    for g0 in range(0, heads, size):
        for i in order:
            for bh in range(g0, min(heads, g0 + size)):
                load, p = heapq.heappop(loads)
                plan[p].append(i * heads + bh)
                heapq.heappush(loads, (load + work[i], p))
    return plan if longest_first else [tiles[::-1] for tiles in plan]


def plan_table(plan: list[list[int]], programs: int, device) -> tuple:
    """A plan as a kernel reads it: ((rounds, programs) int32 tensor, rounds), program p's
    m-th item at [m, p], the count of all items where it has none."""
    rounds = max(len(tiles) for tiles in plan)
    total = sum(len(tiles) for tiles in plan)  # every work item once
    table = torch.full((rounds, programs), total, dtype=torch.int32)
    for p, tiles in enumerate(plan):
        table[:len(tiles), p] = torch.tensor(tiles, dtype=torch.int32)
    return table.to(device), rounds


@functools.lru_cache(maxsize=64)
def _plan_tensor(Nq: int, Nk: int, heads: int, programs: int, CONSUMERS: int,
                 longest_first: bool, heads_together: int, device: torch.device) -> tuple:
    """``plan_causal`` as the kernel reads it (``plan_table``); made once for a shape and
    kept (a repeated call makes no new table)."""
    plan = plan_causal(Nq, Nk, heads, programs, CONSUMERS, longest_first, heads_together)
    return plan_table(plan, programs, device)


def dropout_arguments(dropout_p: float, rng):
    """(RNG, threshold, keep scale) of the Gluon kernels: ``forward.dropout_args``'s, with
    (None, 0, 1.0) without dropout (RNG None: DROPOUT is off, nothing is drawn)."""
    from .forward import dropout_args

    rng, dropout = dropout_args(dropout_p, rng)
    return (rng, *(dropout or (0, 1.0)))


def forward(q, k, v, o, lse2, *, is_causal: bool, scale: float, CONSUMERS: int, STAGES: int,
            CONSUMER_REGS: int, PINGPONG: bool = True, OVERLAP: bool = True,
            LONGEST_FIRST: bool = True, PERSISTENT: bool = False, TMA_STORE: bool = False,
            Q_BUFFERS: int = 1, PLANNED: bool = False, HEADS_TOGETHER: int | None = None,
            dropout_p: float = 0.0, rng=None):
    """Launch the kernel: o (q's shape and strides) and lse2 ((B, H, Nq) float32, base 2)
    written in place. The settings (the tile table's ``schedule``, config.py): CONSUMERS
    warpgroups of 64 rows each, STAGES of K_j/V_j in shared memory, CONSUMER_REGS registers a
    consumer thread, and the schedule's switches (TMA_STORE: O through shared memory and
    the copy engine; its descriptor needs o 16-byte aligned, as q's are; Q_BUFFERS: 2, a
    persistent program loads its next Q tile during this one; PLANNED: causal persistent
    programs take their Q tiles from ``plan_causal``, not the snake deal). HEADS_TOGETHER:
    causal longest first, the most heads a group of ``_in_groups`` holds (None:
    ``heads_together``), or of the plan's (None: PLAN_HEADS_TOGETHER). dropout_p > 0: rng
    is the call's [seed, offset] tensor (``flashedu.dropout.draw_rng``). Returns the launch
    (``fast.Launch``), to be repeated with other q, k, v, o, lse2 (and rng) laid out
    alike."""
    from .fast import Launch, ensure_allocator, run

    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if Q_BUFFERS not in (1, 2):
        raise ValueError(f"Q_BUFFERS must be 1 or 2, got {Q_BUFFERS!r}")
    ensure_allocator()  # the kernel makes its TMA descriptors in scratch memory
    rng, threshold, keep_scale = dropout_arguments(dropout_p, rng)
    consts = dict(HEAD_DIM=d, Bc=128, STAGES=STAGES, CONSUMERS=CONSUMERS,
                  IS_CAUSAL=bool(is_causal), PINGPONG=PINGPONG, OVERLAP=OVERLAP,
                  LONGEST_FIRST=LONGEST_FIRST, CONSUMER_REGS=CONSUMER_REGS,
                  PERSISTENT=bool(PERSISTENT), DROPOUT=rng is not None,
                  TMA_STORE=bool(TMA_STORE), Q_BUFFERS=Q_BUFFERS if PERSISTENT else 1,
                  PLANNED=bool(PERSISTENT and is_causal and PLANNED), num_warps=4)
    total = triton.cdiv(Nq, CONSUMERS * M) * B * H
    grid, rounds, plan = (total,), 1, None
    if PERSISTENT:  # one program per SM (one fits: the stages take most of shared memory)
        grid = (min(total, _multiprocessors(q.device.index) if q.is_cuda else H100_SMS),)
        rounds = triton.cdiv(total, grid[0])
    if consts["PLANNED"]:
        plan, rounds = _plan_tensor(Nq, Nk, B * H, grid[0], CONSUMERS, bool(LONGEST_FIRST),
                                    HEADS_TOGETHER or PLAN_HEADS_TOGETHER, q.device)
    args = (q, k, v, o, lse2, rng, plan, float(scale) * LOG2E, threshold, keep_scale,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], H, H // Hkv, Nq, Nk, total,
            rounds,
            HEADS_TOGETHER or heads_together(2 * Nk * d * k.element_size(),
                                             is_causal and LONGEST_FIRST))
    run(fa3_forward_kernel, grid, args, consts)
    return Launch(fa3_forward_kernel, grid, args, consts, tuple(range(5 + (rng is not None))))
