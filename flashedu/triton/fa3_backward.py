"""FlashAttention-3's backward on Hopper, in Gluon: one program per K/V tile (or, persistent, one
per SM taking K/V tiles in turn), five products a tile pair, dQ_i added by the copy engine.

The backward of ``backward.py`` runs two programs per tile pair's work (dK/dV holding K_j, V_j
and a dQ program holding Q_i), seven products in all: S_ij and dP_ij are computed twice. Here,
as in FlashAttention-2 and -3, the program that holds K_j and V_j also computes dQ_i's share
of its keys, dS_ij K_j, and adds it to a float32 dQ in global memory:

    S_ij^T  = K_j Q_i^T              P_ij^T  = exp2(S_ij^T * scale * log2(e) - L_i)
    dP_ij^T = V_j dO_i^T             dS_ij^T = P_ij^T * (dP_ij^T - D_i)
    dV_j   += P_ij^T dO_i            dK_j   += dS_ij^T Q_i          dQ_i += dS_ij K_j

Laid out as the forward of ``fa3.py``: a copy warp streams (Q_i, dO_i) by TMA, and L_i, D_i,
through a ring of shared-memory stages past K_j and V_j, which it loads once; two consumer
warpgroups own 64 of the program's 128 keys each. dS_ij^T goes through shared memory to be
read transposed as the left operand of dQ_i's product; each consumer computes half of dQ_i's
columns over all 128 keys and leaves it in a shared-memory buffer, from which a writer warp
adds it to dQ with one TMA reduction (the adds happen in L2, whole lines at a time: the
per-thread atomics they replace held the backward to 0.35-0.8x cuDNN's). They come in the
order the programs arrive, so dQ can differ in its last bits from run to run:
``launch.backward`` leaves calls under torch.use_deterministic_algorithms to the Triton
kernels. Grouped-query attention: a program visits the Q tiles of every query head of its K/V
head. q and dO must be laid out (B, H, N, d) contiguous (one descriptor walks all their rows).

Persistent programs (PERSISTENT): one program an SM fits (the stages take most of its shared
memory), and one program per K/V tile starts each with nothing in flight (descriptors, barriers,
K_j and V_j copied before the first product) and ends it with dK_j, dV_j stored after the last.
One program per SM instead takes its tiles in turn (causal: by the host's plan,
``plan_backward``, longest first), its counts running on across them; with KV_BUFFERS = 2 the
copy warp loads the next tile's K_j and V_j while the consumers finish this one.

Dropout (the paper's Algorithm 4): the forward's Z_ij is drawn again, upright (queries down,
as the forward holds S_ij, so that a thread draws each Philox call once for 16 entries; held
as S_ij^T it would hold 4 of each call), as one flag byte an entry, and moved into S_ij^T's
layout through shared memory (``_keep_transposed``): 32 bytes a thread, where moving P_ij and
dS_ij transposed, as FlashAttention-2's backward does, would be 128.

Compiled for sm_90 (Triton 3.6, ``scripts/compile_fa3_backward.py``): d = 64 without spills;
d = 128 with 216 (320 causal) bytes a thread of spills, 24 (64) with FRESH_DESCRIPTORS, which
the tile table sets there (1.17-1.20x faster on an H200; at d = 64, which does not
spill, 0.95-1.0x). Measured in BENCHMARKS.md, "FlashAttention-3's backward in Gluon".
"""

from __future__ import annotations

import functools

import torch
import triton

from .fa3 import GLUON, LOG2E, M

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                  tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin

    from .dropout import keep_rate
    from .fa3 import _descriptor, _dropout_state, _in_groups, _keep_bytes, _kept, _tma_load

    @builtin
    def _tma_reduce_add(desc, coord, src, _semantic=None):
        """desc[coord] += src by the copy engine (cp.reduce.async.bulk.tensor): Gluon on Triton
        3.6 builds the operation but exports no function for it."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle,
                                                  coord, src.handle)

    _KM = gl.constexpr(64)  # keys per consumer warpgroup: one wgmma's M

    @gluon.jit
    def _kv_tile_of(m, first, n_kv, heads, plan, PERSISTENT: gl.constexpr,
                    PLANNED: gl.constexpr):
        """The program's m-th work item as (t, K/V tile j, batch * K/V head); t >= n_kv * heads:
        none. One program per item: ``first``, its item, found once in the kernel's body.
        PERSISTENT: item m * programs + p, a head's K/V tiles one after another (as one
        program per tile starts them, one head at a time), or, PLANNED (causal), the host's
        plan (``plan_backward``), item t = j * heads + bh at [m, p]."""
        if PERSISTENT:
            t = m * gl.num_programs(0) + gl.program_id(0)
            if PLANNED:
                t = gl.load(plan + t)
                j = t // heads
                bh = t % heads
            else:
                j = t % n_kv
                bh = t // n_kv
        else:
            t, j, bh = first
        return t, j, bh

    @gluon.jit
    def _rounds(rounds, PERSISTENT: gl.constexpr):
        """The rounds of a program's loop over its items: a persistent program's ``rounds``;
        one program per item, 1, known when compiled (the loop then compiles away, and with
        it the registers its counts would hold)."""
        if PERSISTENT:
            return rounds
        else:
            return 1

    @gluon.jit
    def _first_q_tile(k0, Br: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """The first Q tile that sees keys k0 ..: causal, none before the tile's first key."""
        i0 = 0
        if IS_CAUSAL:
            i0 = k0 // Br
        return i0

    @gluon.jit
    def _load(kv, q_descs, shared, work, Br: gl.constexpr, STAGES: gl.constexpr,
              IS_CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, PLANNED: gl.constexpr):
        """The copy warp, for each work item: K_j and V_j once (both consumers' halves) into
        K/V buffer n % KV_BUFFERS once the consumers are done with the item it held, then
        (Q_i, dO_i, L_i, D_i) of every query head of the group, tile by tile, into stage
        t % STAGES once both consumers freed it (the stage count runs on across items). With
        two K/V buffers a persistent program's next K_j, V_j arrive while the consumers finish
        this tile. Q_i and dO_i come by TMA; L_i and D_i by plain loads, as a tile of them
        starts anywhere in a float32 row (the copy engine wants 16-byte aligned starts)."""
        K, V, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn = kv
        q_desc, do_desc = q_descs
        k_smem, v_smem, q_smem, do_smem, l_smem, d_smem, kv_ready, kv_free, ready, free = shared
        H, GROUP, Hkv, Nq, Nk, heads, L, Dl, total, rounds, plan, first = work
        HEAD_DIM: gl.constexpr = q_smem.shape[2]
        KV_BUFFERS: gl.constexpr = kv_ready.shape[0]
        n_kv = gl.cdiv(Nk, 2 * _KM)
        nq_tiles = gl.cdiv(Nq, Br)
        lanes = gl.arange(0, Br, gl.BlockedLayout([Br // 32], [32], [1], [0]))
        t = 0
        n = 0
        for m in range(_rounds(rounds, PERSISTENT)):
            item, j, bh = _kv_tile_of(m, first, n_kv, heads, plan, PERSISTENT, PLANNED)
            if item < n_kv * heads:
                batch = bh // Hkv
                h_kv = bh % Hkv
                k0 = j * 2 * _KM
                kb = n % KV_BUFFERS
                if n > 0:  # the last item's K/V copies landed: their descriptors may be rewritten
                    mbarrier.wait(kv_ready.index((n - 1) % KV_BUFFERS),
                                  ((n - 1) // KV_BUFFERS) & 1)
                k_desc = _descriptor(K + batch * stride_kb + h_kv * stride_kh + k0 * stride_kn,
                                     Nk - k0, stride_kn, _KM, HEAD_DIM)
                v_desc = _descriptor(V + batch * stride_vb + h_kv * stride_vh + k0 * stride_vn,
                                     Nk - k0, stride_vn, _KM, HEAD_DIM)
                mbarrier.wait(kv_free.index(kb), ((n // KV_BUFFERS) & 1) ^ 1)
                mbarrier.expect(kv_ready.index(kb), 4 * k_desc.block_type.nbytes)
                for w in gl.static_range(2):
                    _tma_load(k_desc, [w * _KM, 0], kv_ready.index(kb),
                              k_smem.index(kb).slice(w * _KM, _KM))
                    _tma_load(v_desc, [w * _KM, 0], kv_ready.index(kb),
                              v_smem.index(2 * kb + w))
                row_base = (batch * H + h_kv * GROUP) * Nq  # the group's first query row
                for g in range(GROUP):
                    for i in range(_first_q_tile(k0, Br, IS_CAUSAL), nq_tiles):
                        s = t % STAGES
                        mbarrier.wait(free.index(s), ((t // STAGES) & 1) ^ 1)
                        mbarrier.expect(ready.index(s), 2 * q_desc.block_type.nbytes)
                        row = row_base + g * Nq + i * Br  # the head's rows, one after another
                        _tma_load(q_desc, [row, 0], ready.index(s), q_smem.index(s))
                        _tma_load(do_desc, [row, 0], ready.index(s), do_smem.index(s))
                        ok = row + lanes < total
                        l_smem.index(s).store(gl.load(L + row + lanes, mask=ok, other=0.0))
                        d_smem.index(s).store(gl.load(Dl + row + lanes, mask=ok, other=0.0))
                        mbarrier.arrive(ready.index(s), count=1)  # the second: L_i, D_i
                        t += 1
                n += 1

    @gluon.jit
    def _write_dq(dq_desc, dq_shared, work, Br: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  PERSISTENT: gl.constexpr, PLANNED: gl.constexpr):
        """The dQ writer (one warp): each Q tile's dQ_i share, once both consumers stored their
        halves, added to the float32 dQ by the copy engine (a reduction in L2, 128-byte lines
        at a time; per-thread atomics measured 1.2-2.3x slower). Rows past a head's end add
        zeros (their dS_ij is zero), rows past the tensor's are clipped."""
        dq_smem, dq_ready, dq_free = dq_shared
        H, GROUP, Hkv, Nq, Nk, heads, L, Dl, total, rounds, plan, first = work
        NB: gl.constexpr = dq_smem.shape[0]
        n_kv = gl.cdiv(Nk, 2 * _KM)
        nq_tiles = gl.cdiv(Nq, Br)
        t = 0
        for m in range(_rounds(rounds, PERSISTENT)):
            item, j, bh = _kv_tile_of(m, first, n_kv, heads, plan, PERSISTENT, PLANNED)
            if item < n_kv * heads:
                row_base = (bh // Hkv * H + bh % Hkv * GROUP) * Nq
                for g in range(GROUP):
                    for i in range(_first_q_tile(j * 2 * _KM, Br, IS_CAUSAL), nq_tiles):
                        b = t % NB
                        mbarrier.wait(dq_ready.index(b), (t // NB) & 1)
                        _tma_reduce_add(dq_desc, [row_base + g * Nq + i * Br, 0],
                                        dq_smem.index(b))
                        tma.store_wait(0)  # the buffer read: the consumers may write it again
                        mbarrier.arrive(dq_free.index(b), count=1)
                        t += 1

    @gluon.jit
    def _keep_transposed(drop, row0, key0, Br: gl.constexpr, layout: gl.constexpr):
        """Z_ij^T as flag bytes (``fa3._keep_bytes``), uint8 (64 keys, Br queries) in
        ``layout`` (S_ij^T's): drawn upright, in the layout of a product's result with queries
        down, where a thread holds 16 entries of each Philox call it draws (held transposed
        it would hold 4 of each and draw 4 times the calls), then moved to S_ij^T's layout
        through shared memory."""
        upright: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, _KM, 16])
        rows = row0 + gl.arange(0, Br, gl.SliceLayout(1, upright))
        cols = key0 + gl.arange(0, _KM, gl.SliceLayout(0, upright))
        return gl.convert_layout(gl.permute(_keep_bytes(drop, rows, cols), [1, 0]), layout)

    @gluon.jit
    def _tile_pair(shared, ds_shared, dq_shared, t, kb, i, dK_j, dV_j, k0, Nq, qk_scale,
                   scale, drop, WG: gl.constexpr, Br: gl.constexpr, STAGES: gl.constexpr,
                   DIAGONAL: gl.constexpr, FRESH_DESCRIPTORS: gl.constexpr,
                   DROPOUT: gl.constexpr, SELECT_ONCE: gl.constexpr):
        """One consumer's step over (Q_i, K_j): the five products, dK_j and dV_j returned, dQ_i's
        share handed to the writer; K_j and V_j in K/V buffer kb. DIAGONAL: the tile crosses
        the causal diagonal (only those steps carry its mask: the others compile without the
        registers it takes).
        FRESH_DESCRIPTORS: K_j's, V_j's and dS's operand descriptors made each step.
        DROPOUT (the paper's Algorithm 4): the forward's Z_ij drawn again (drop: the state of
        ``fa3._dropout_state`` for the tile's query head); dV_j takes the dropped P_ij, dP_ij
        is dropped alike, and the keep scale s waits for the program's end, as in
        ``backward.py``: dS = s P (Z dP - D / s). Z_ij is drawn while the tensor cores make
        S_ij^T and dP_ij^T: drawn after them, the mask cost 1.16-1.30x of p = 0's time on an
        H200; while they run, 1.10-1.22x. SELECT_ONCE: Z_ij selects P_ij once, in float32."""
        k_smem, v_smem, q_smem, do_smem, l_smem, d_smem, kv_ready, kv_free, ready, free = shared
        ds_smem, ds_ready, ds_free = ds_shared
        dq_smem, dq_ready, dq_free = dq_shared
        NB: gl.constexpr = dq_smem.shape[0]
        HEAD_DIM: gl.constexpr = q_smem.shape[2]
        HALF: gl.constexpr = HEAD_DIM // 2
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, Br, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dK_j.type.layout,
                                                     k_width=2)
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                            warps_per_cta=[4, 1],
                                                            instr_shape=[16, HALF, 16])
        col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)  # along the Q tile's rows
        dtype: gl.constexpr = q_smem.dtype
        s = t % STAGES
        zero = 0
        if FRESH_DESCRIPTORS:
            # 0, which the compiler cannot know: the shared-memory descriptors of the operands
            # that do not change over the loop (K_j, V_j, the dS exchange buffer) are then made
            # in each step, a few integer instructions, instead of hoisted out of the loop,
            # where their 64-bit values took the registers dK_j and dV_j need (d = 128: 216
            # bytes of spills a thread, 320 causal; with this 24 and 64)
            zero = gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [t], dtype=gl.int32,
                                             is_pure=True, pack=1)
        K_all = k_smem.index(kb + zero)
        dS_all = ds_smem.index(zero)
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        Q_i = q_smem.index(s)
        dO_i = do_smem.index(s)
        # L_i and D_i of the tile's rows, from shared memory (the copy warp fetched them:
        # addresses a value for loads from global memory would spill)
        L_i = l_smem.index(s).load(col_layout)
        D_i = d_smem.index(s).load(col_layout)
        if DROPOUT:
            D_i = D_i * keep_rate(drop)  # D_i / s, exact
        zero_st = gl.zeros([_KM, Br], gl.float32, st_layout)
        S_t = warpgroup_mma(K_all.slice(WG * _KM, _KM), Q_i.permute((1, 0)), zero_st,
                            use_acc=False, is_async=True)
        dP_t = warpgroup_mma(v_smem.index(2 * kb + WG + zero), dO_i.permute((1, 0)), zero_st,
                             use_acc=False, is_async=True)
        if DROPOUT:  # drawn while the tensor cores make S_ij^T and dP_ij^T
            Z_t = _keep_transposed(drop, i * Br, k0 + WG * _KM, Br, st_layout)
        S_t, dP_t = warpgroup_mma_wait(0, deps=(S_t, dP_t))
        P_t = gl.exp2(S_t * qk_scale - L_i[None, :])
        if (i + 1) * Br > Nq:  # the last tile: its rows past Nq are the next head's
            cols = i * Br + gl.arange(0, Br, col_layout)
            P_t = gl.where(cols[None, :] < Nq, P_t, 0.0)
        if DIAGONAL:
            keys = k0 + WG * _KM + gl.arange(0, _KM, gl.SliceLayout(1, st_layout))
            cols = i * Br + gl.arange(0, Br, col_layout)
            P_t = gl.where(keys[:, None] <= cols[None, :], P_t, 0.0)
        if DROPOUT and SELECT_ONCE:
            # dS = P (Z dP - D) = (Z P) dP - P D: the mask selects P_ij once, in float32,
            # and dV_j's operand is that rounded to 16 bits
            ZP_f32 = _kept(P_t, Z_t)
            ZP_t = ZP_f32.to(dtype)
            dS_t = (ZP_f32 * dP_t - P_t * D_i[None, :]).to(dtype)
        else:
            ZP_t = P_t.to(dtype)  # what the forward multiplied V_j by: P_ij, dropped
            if DROPOUT:
                ZP_t = _kept(ZP_t, Z_t)
                dP_t = _kept(dP_t, Z_t)
            dS_t = (P_t * (dP_t - D_i[None, :])).to(dtype)  # 16-bit from here on
        dV_j = warpgroup_mma(gl.convert_layout(ZP_t, a_layout), dO_i, dV_j, is_async=True)
        dK_j = warpgroup_mma(gl.convert_layout(dS_t, a_layout), Q_i, dK_j, is_async=True)
        # dS_ij^T of both consumers' keys into shared memory (once the other has read the
        # last tile's), then each computes half of dQ_i's columns over all 128 keys: dS_ij
        # (read transposed) times K_j's columns
        mbarrier.wait(ds_free, (t & 1) ^ 1)
        dS_all.slice(WG * _KM, _KM).store(dS_t)
        fence_async_shared()
        mbarrier.arrive(ds_ready, count=1)
        dV_j, dK_j = warpgroup_mma_wait(0, deps=(dV_j, dK_j))
        mbarrier.arrive(free.index(s), count=1)  # Q_i and dO_i read
        mbarrier.wait(ds_ready, t & 1)
        zero_dq = gl.zeros([Br, HALF], gl.float32, dq_layout)
        dQ_i = warpgroup_mma(dS_all.permute((1, 0)), K_all.slice(WG * HALF, HALF, 1),
                             zero_dq, use_acc=False, is_async=True)
        dQ_i = warpgroup_mma_wait(0, deps=(dQ_i,))
        mbarrier.arrive(ds_free, count=1)
        # to the dQ writer through shared memory, in a buffer it has added to dQ
        b = t % NB
        mbarrier.wait(dq_free.index(b), ((t // NB) & 1) ^ 1)
        dq_smem.index(b).slice(WG * HALF, HALF, 1).store(dQ_i * scale)
        fence_async_shared()  # the copy engine reads it next
        mbarrier.arrive(dq_ready.index(b), count=1)
        return dK_j, dV_j

    @gluon.jit
    def _consume(shared, ds_shared, dq_shared, grads, work, qk_scale, scale, drop,
                 WG: gl.constexpr, Br: gl.constexpr, STAGES: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, FRESH_DESCRIPTORS: gl.constexpr,
                 DROPOUT: gl.constexpr, SELECT_ONCE: gl.constexpr, PERSISTENT: gl.constexpr,
                 PLANNED: gl.constexpr):
        """A consumer warpgroup, for each work item: keys k0 + WG * 64 .. + 64 of the item's
        K/V tile; dK_j and dV_j of those keys in registers, dQ_i's share handed to the writer
        after each Q tile, the K/V buffer released after the last, dK_j and dV_j stored.
        Causal: the Q tiles crossing the diagonal first (i0 and the next), then the rest.
        drop: the dropout state (``fa3._dropout_state``), its head set for each item's group.
        scale (dK_j's and dQ_i's factor) comes with the keep scale in it under DROPOUT."""
        dK, dV, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn = grads
        H, GROUP, Hkv, Nq, Nk, heads, L, Dl, total, rounds, plan, first = work
        kv_ready = shared[6]
        kv_free = shared[7]
        KV_BUFFERS: gl.constexpr = kv_ready.shape[0]
        HEAD_DIM: gl.constexpr = shared[2].shape[2]
        dtype: gl.constexpr = shared[2].dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                             warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        dims = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, acc_layout))
        out_keys = WG * _KM + gl.arange(0, _KM, gl.SliceLayout(1, acc_layout))
        n_kv = gl.cdiv(Nk, 2 * _KM)
        nq_tiles = gl.cdiv(Nq, Br)
        t = 0
        n = 0
        for m in range(_rounds(rounds, PERSISTENT)):
            item, j, bh = _kv_tile_of(m, first, n_kv, heads, plan, PERSISTENT, PLANNED)
            if item < n_kv * heads:
                batch = bh // Hkv
                h_kv = bh % Hkv
                k0 = j * 2 * _KM
                kb = n % KV_BUFFERS
                i0 = _first_q_tile(k0, Br, IS_CAUSAL)
                diagonal_end = i0
                if IS_CAUSAL:
                    diagonal_end = gl.minimum(i0 + (2 * _KM) // Br, nq_tiles)
                dK_j = gl.zeros([_KM, HEAD_DIM], gl.float32, acc_layout)
                dV_j = gl.zeros([_KM, HEAD_DIM], gl.float32, acc_layout)
                mbarrier.wait(kv_ready.index(kb), (n // KV_BUFFERS) & 1)
                for g in range(GROUP):
                    head = (drop[0], drop[1], batch * H + h_kv * GROUP + g, drop[3], drop[4])
                    for i in range(i0, diagonal_end):
                        dK_j, dV_j = _tile_pair(shared, ds_shared, dq_shared, t, kb, i, dK_j,
                                                dV_j, k0, Nq, qk_scale, scale, head, WG, Br,
                                                STAGES, True, FRESH_DESCRIPTORS, DROPOUT,
                                                SELECT_ONCE)
                        t += 1
                    for i in range(diagonal_end, nq_tiles):
                        dK_j, dV_j = _tile_pair(shared, ds_shared, dq_shared, t, kb, i, dK_j,
                                                dV_j, k0, Nq, qk_scale, scale, head, WG, Br,
                                                STAGES, False, FRESH_DESCRIPTORS, DROPOUT,
                                                SELECT_ONCE)
                        t += 1
                # every product that read K_j and V_j has been waited for: the copy warp may
                # load the next item's into this buffer
                mbarrier.arrive(kv_free.index(kb), count=1)
                ok = (k0 + out_keys)[:, None] < Nk
                keys = k0 + out_keys[:, None]
                dk_ptrs = dK + batch * stride_kb + h_kv * stride_kh + keys * stride_kn
                gl.store(dk_ptrs + dims[None, :], (dK_j * scale).to(dtype), mask=ok)
                if DROPOUT:  # the keep scale, left out of every step's dropped P_ij
                    dV_j = dV_j * drop[4]
                dv_ptrs = dV + batch * stride_vb + h_kv * stride_vh + keys * stride_vn
                gl.store(dv_ptrs + dims[None, :], dV_j.to(dtype), mask=ok)
                n += 1

    @gluon.jit
    def fa3_backward_kernel(Q, K, V, dO, L, Dl, dQ, dK, dV, RNG, PLAN, qk_scale, scale,
                            threshold, keep_scale,
                            stride_qn, stride_kb, stride_kh, stride_kn,
                            stride_vb, stride_vh, stride_vn, H, GROUP, Hkv, Nq, Nk, heads,
                            total, rounds, heads_together,
                            HEAD_DIM: gl.constexpr, Br: gl.constexpr, STAGES: gl.constexpr,
                            IS_CAUSAL: gl.constexpr, DQ_BUFFERS: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, FRESH_DESCRIPTORS: gl.constexpr,
                            DROPOUT: gl.constexpr, SELECT_ONCE: gl.constexpr,
                            PERSISTENT: gl.constexpr, PLANNED: gl.constexpr,
                            KV_BUFFERS: gl.constexpr):
        """One program per work item (a K/V tile of 128 keys, batch * K/V head), started in
        the order of ``fa3._in_groups`` (causal: K/V tile 0, which every Q tile sees, first);
        or, PERSISTENT, one program per SM that takes ``rounds`` items in turn (PLANNED, by
        the host's plan PLAN: ``plan_backward``), with KV_BUFFERS for K_j and V_j (2: the
        next item's arrive during this one). Q, dO: (B, H, Nq, d) with rows ``stride_qn``
        apart and heads Nq rows apart, ``total`` rows in all; L (base 2) and Dl = rowsum(dO *
        O): (B, H, Nq) float32; dQ: float32 (B, H, Nq, d) contiguous, zeroed, added to; dK, dV
        with K's and V's strides. DROPOUT: as the forward's (RNG, threshold, keep_scale);
        scale then includes the keep scale."""
        # Q, dO and dQ whole, for every item: a tile past its head's end reads the next head's
        # rows (masked, their dS_ij is zero) and past the tensor's zeros
        q_desc = _descriptor(Q, total, stride_qn, Br, HEAD_DIM)
        do_desc = _descriptor(dO, total, stride_qn, Br, HEAD_DIM)
        dq_desc = _descriptor(dQ, total, HEAD_DIM, Br, HEAD_DIM)  # float32, added to by TMA
        row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        dtype: gl.constexpr = Q.dtype.element_ty
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KM, HEAD_DIM], dtype)
        k_smem = gl.allocate_shared_memory(dtype, [KV_BUFFERS, 2 * _KM, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [2 * KV_BUFFERS, _KM, HEAD_DIM], kv_layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, Br, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, Br, HEAD_DIM], do_desc.layout)
        l_smem = gl.allocate_shared_memory(gl.float32, [STAGES, Br], row_layout)
        d_smem = gl.allocate_shared_memory(gl.float32, [STAGES, Br], row_layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KM, Br], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [1, 2 * _KM, Br], ds_layout)
        ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS, Br, HEAD_DIM],
                                            dq_desc.layout)
        dq_ready = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
        dq_free = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [KV_BUFFERS, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [KV_BUFFERS, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(ds_ready, count=2)  # both consumers' dS_ij^T stored
        mbarrier.init(ds_free, count=2)  # both consumers' dQ_i products done
        for n in gl.static_range(DQ_BUFFERS):
            mbarrier.init(dq_ready.index(n), count=2)  # both halves of dQ_i in dq_smem
            mbarrier.init(dq_free.index(n), count=1)  # the writer has added them
        for n in gl.static_range(KV_BUFFERS):
            mbarrier.init(kv_ready.index(n), count=1)
            mbarrier.init(kv_free.index(n), count=2)  # both consumers done with the item
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=2)  # the copies' bytes, then L_i and D_i
            mbarrier.init(free.index(s), count=2)  # both consumers free a stage
        fence_async_shared()

        shared = (k_smem, v_smem, q_smem, do_smem, l_smem, d_smem, kv_ready, kv_free, ready,
                  free)
        ds_shared = (ds_smem, ds_ready, ds_free)
        dq_shared = (dq_smem, dq_ready, dq_free)
        first = (0, 0, 0)  # a persistent program finds its items in its loops
        if not PERSISTENT:
            t = gl.program_id(0)
            j, bh = _in_groups(t, gl.cdiv(Nk, 2 * _KM), heads, heads_together)
            first = (t, j, bh)
        work = (H, GROUP, Hkv, Nq, Nk, heads, L, Dl, total, rounds, PLAN, first)
        kv = (K, V, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn)
        grads = (dK, dV, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn)
        drop = _dropout_state(RNG, 0, threshold, keep_scale, DROPOUT)  # the head: per item
        gl.warp_specialize([
            (_consume, (shared, ds_shared, dq_shared, grads, work, qk_scale, scale, drop, 0,
                        Br, STAGES, IS_CAUSAL, FRESH_DESCRIPTORS, DROPOUT, SELECT_ONCE,
                        PERSISTENT, PLANNED)),
            (_consume, (shared, ds_shared, dq_shared, grads, work, qk_scale, scale, drop, 1,
                        Br, STAGES, IS_CAUSAL, FRESH_DESCRIPTORS, DROPOUT, SELECT_ONCE,
                        PERSISTENT, PLANNED)),
            (_load, (kv, (q_desc, do_desc), shared, work, Br, STAGES, IS_CAUSAL, PERSISTENT,
                     PLANNED)),
            (_write_dq, (dq_desc, dq_shared, work, Br, IS_CAUSAL, PERSISTENT, PLANNED)),
        ], [4, 1, 1], [CONSUMER_REGS, 24, 24])
        # every partition is done: the mbarriers invalidated before the SM's next program
        # takes this shared memory, as PTX asks (and Triton's own kernels end)
        mbarrier.invalidate(ds_ready)
        mbarrier.invalidate(ds_free)
        for n in gl.static_range(DQ_BUFFERS):
            mbarrier.invalidate(dq_ready.index(n))
            mbarrier.invalidate(dq_free.index(n))
        for n in gl.static_range(KV_BUFFERS):
            mbarrier.invalidate(kv_ready.index(n))
            mbarrier.invalidate(kv_free.index(n))
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(free.index(s))


def usable(q, k, v, do, call) -> bool:
    """Whether a backward call can take this kernel: what the forward of fa3.py serves, with q
    and dO laid out (B, H, N, d) contiguous (one descriptor walks all their rows)."""
    from . import fa3

    return (fa3.usable(q, k, v, call) and q.is_contiguous() and do.is_contiguous()
            and do.dtype == q.dtype)


def shared_bytes(d: int, STAGES: int, DQ_BUFFERS: int, KV_BUFFERS: int,
                 itemsize: int = 2) -> int:
    """The kernel's shared memory (the barriers' few bytes aside): KV_BUFFERS K_j, V_j tiles
    of 128 keys, STAGES of (Q_i, dO_i, L_i, D_i) of 64 rows, dS_ij^T (128 x 64) and DQ_BUFFERS
    float32 dQ_i. d = 64, two stages, one dQ buffer: 97 KB with one K/V buffer, 129 KB with
    two; d = 128: 177 KB with one, so no second (241 KB)."""
    rows = M
    return (KV_BUFFERS * 2 * 128 * d * itemsize + STAGES * (2 * rows * d * itemsize + 2 * rows * 4)
            + 128 * rows * itemsize + DQ_BUFFERS * rows * d * 4)


def kv_tile_work(j: int, Nq: int) -> int:
    """What causal K/V tile j (128 keys) costs, in Q tiles of M rows: those it is seen by, and
    one more for what an item costs besides its products (K_j's and V_j's copy, dK_j's and
    dV_j's store)."""
    return 1 + max(0, -(-Nq // M) - j * 128 // M)


def plan_backward(Nq: int, Nk: int, heads: int, programs: int,
                  heads_together: int = 0) -> list[list[int]]:
    """The causal K/V tiles of ``heads`` (batch * K/V head) heads, item t = j * heads + bh,
    dealt to ``programs`` persistent programs as ``fa3.plan_causal`` deals the forward's Q
    tiles: longest first, each to the least loaded program, heads in groups of
    ``heads_together`` (their Q and dO stay in L2 while the group's tiles pass)."""
    from .fa3 import deal_longest_first

    work = [kv_tile_work(j, Nq) for j in range(-(-Nk // 128))]
    return deal_longest_first(work, heads, programs, True, heads_together)


@functools.lru_cache(maxsize=64)
def _plan_tensor(Nq: int, Nk: int, heads: int, programs: int, heads_together: int,
                 device: torch.device) -> tuple:
    """``plan_backward`` as the kernel reads it (``fa3.plan_table``), made once a shape."""
    from .fa3 import plan_table

    return plan_table(plan_backward(Nq, Nk, heads, programs, heads_together), programs, device)


def launch(q, k, v, do, lse2, D, dq, dk, dv, *, is_causal: bool, scale: float, STAGES: int,
           DQ_BUFFERS: int, CONSUMER_REGS: int, FRESH_DESCRIPTORS: bool,
           SELECT_ONCE: bool = False, PERSISTENT: bool = False, KV_BUFFERS: int = 1,
           dropout_p: float = 0.0, rng=None):
    """Launch the kernel. q, do: (B, H, Nq, d) contiguous; lse2: the forward's base-2 lse and
    D = rowsum(dO * O), float32 (B, H, Nq) contiguous; dq: float32, q's shape, contiguous and
    zeroed (added to); dk, dv: k's and v's shapes and strides (written). The settings (the
    tile table's backward schedule, config.py): STAGES of (Q_i, dO_i) in shared memory,
    DQ_BUFFERS for dQ_i on its way to the writer, CONSUMER_REGS registers a consumer thread,
    FRESH_DESCRIPTORS whether the loop-invariant operands' descriptors are made each step,
    SELECT_ONCE whether dropout's mask selects P_ij once in float32 (dS from it) instead of
    P_ij in 16 bits and dP_ij; PERSISTENT, one program per SM taking K/V tiles in turn
    (causal: by ``plan_backward``), with KV_BUFFERS of K_j, V_j (2: the next tile's copied
    during this one). dropout_p > 0: rng is the forward's [seed, offset] tensor. Returns the
    launch (``fast.Launch``), to be repeated with other tensors (and rng) laid out alike."""
    from .fa3 import H100_SMS, SHARED_MEMORY, _multiprocessors, dropout_arguments, heads_together
    from .fast import Launch, ensure_allocator, run

    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if KV_BUFFERS not in (1, 2):
        raise ValueError(f"KV_BUFFERS must be 1 or 2, got {KV_BUFFERS!r}")
    need = shared_bytes(d, STAGES, DQ_BUFFERS, KV_BUFFERS, q.element_size())
    if need > SHARED_MEMORY:
        raise ValueError(f"STAGES={STAGES}, DQ_BUFFERS={DQ_BUFFERS}, KV_BUFFERS={KV_BUFFERS} "
                         f"at d={d} need {need} bytes of shared memory, more than the "
                         f"{SHARED_MEMORY} a program may take")
    ensure_allocator()  # the kernel makes its TMA descriptors in scratch memory
    rng, threshold, keep_scale = dropout_arguments(dropout_p, rng)
    together = heads_together(2 * (H // Hkv) * Nq * d * q.element_size(), is_causal)
    items = triton.cdiv(Nk, 2 * M) * B * Hkv
    grid, rounds, plan = (items,), 1, None
    if PERSISTENT:  # one program per SM (one fits: the stages take most of shared memory)
        grid = (min(items, _multiprocessors(q.device.index) if q.is_cuda else H100_SMS),)
        rounds = triton.cdiv(items, grid[0])
        if is_causal:
            plan, rounds = _plan_tensor(Nq, Nk, B * Hkv, grid[0], together, q.device)
    args = (q, k, v, do, lse2, D, dq, dk, dv, rng, plan, float(scale) * LOG2E,
            float(scale) * keep_scale, threshold, keep_scale, q.stride(2), *k.stride()[:3],
            *v.stride()[:3], H, H // Hkv, Hkv, Nq, Nk, B * Hkv, B * H * Nq, rounds, together)
    consts = dict(HEAD_DIM=d, Br=M, STAGES=STAGES, IS_CAUSAL=bool(is_causal),
                  DQ_BUFFERS=DQ_BUFFERS, CONSUMER_REGS=CONSUMER_REGS,
                  FRESH_DESCRIPTORS=bool(FRESH_DESCRIPTORS), DROPOUT=rng is not None,
                  SELECT_ONCE=bool(SELECT_ONCE), PERSISTENT=bool(PERSISTENT),
                  PLANNED=plan is not None, KV_BUFFERS=KV_BUFFERS, num_warps=4)
    run(fa3_backward_kernel, grid, args, consts)
    return Launch(fa3_backward_kernel, grid, args, consts, tuple(range(9 + (rng is not None))))


class Step:
    """The kernel's launch as a step of a backward plan (``launch.backward`` keeps it, a
    ``triton_backend.Repeat`` starts it again): dQ is summed in a zeroed float32 buffer of its
    own and then cast into the call's dq (the Triton kernels write dq directly). A call with
    dropout passes its RNG state after dv."""

    __slots__ = ("launch",)

    def __init__(self, first):
        self.launch = first

    # what fast.stream_for checks of a launch
    hit = property(lambda self: self.launch.hit)
    device = property(lambda self: self.launch.device)

    @classmethod
    def made(cls, q, k, v, do, lse2, D, dq, dk, dv, rng=None, **settings) -> "Step":
        """The first launch: made, run and kept."""
        acc = torch.zeros(dq.shape, dtype=torch.float32, device=dq.device)
        step = cls(launch(q, k, v, do, lse2, D, acc, dk, dv, rng=rng, **settings))
        dq.copy_(acc)
        return step

    def start(self, q, k, v, do, lse2, D, dq, dk, dv, *rng, stream=None):
        acc = torch.zeros(dq.shape, dtype=torch.float32, device=dq.device)
        self.launch.start(q, k, v, do, lse2, D, acc, dk, dv, *rng, stream=stream)
        dq.copy_(acc)


def backward(q, k, v, o, lse2, do, *, is_causal: bool, scale: float, STAGES: int = 2,
             DQ_BUFFERS: int = 1, CONSUMER_REGS: int = 240, FRESH_DESCRIPTORS: bool = False,
             SELECT_ONCE: bool = False, PERSISTENT: bool = False, KV_BUFFERS: int = 1,
             dropout_p: float = 0.0, rng=None):
    """(dQ, dK, dV) in q's dtype from the forward's O and base-2 lse2 (``launch.forward``'s),
    D = rowsum(dO * O) made first: the kernel on its own, for tests and benchmarks
    (``launch.backward`` runs it through a launch plan). dropout_p, rng: the forward's."""
    from .launch import preprocess

    D = preprocess(o, do, 64)
    dq = torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    Step.made(q, k, v, do, lse2.contiguous(), D, dq, dk, dv, is_causal=is_causal, scale=scale,
              STAGES=STAGES, DQ_BUFFERS=DQ_BUFFERS, CONSUMER_REGS=CONSUMER_REGS,
              FRESH_DESCRIPTORS=FRESH_DESCRIPTORS, SELECT_ONCE=SELECT_ONCE,
              PERSISTENT=PERSISTENT, KV_BUFFERS=KV_BUFFERS, dropout_p=dropout_p, rng=rng)
    return dq, dk, dv
