"""FlashAttention backward in Triton: a preprocess and one backward kernel, no atomics, deterministic.

The same recomputation as ``flashedu.tiled.flash_backward``: P_ij is rebuilt from the saved
logsumexp L_i (P_ij = exp2(S_ij - L_i) in the forward's base-2 scale), never stored.

1. ``preprocess_kernel``: D_i = rowsum(dO_i * O_i), one float per query row.
2. ``backward_kernel`` holds two kinds of program (one launch for both, or one launch each):
   - dK/dV (``_dkdv_program``): one per K/V tile j (and batch, K/V head). dK_j and dV_j live
     in registers while every Q tile i that sees tile j streams past; with grouped-query
     attention the program also walks the query heads of its group, so each dK_j, dV_j has
     one writer.
   - dQ (``_dq_program``): one per Q tile i, streaming K/V tiles exactly like the forward.

Why dQ is a separate pass: in the K/V-outer loop every program would add into every dQ_i,
which needs atomic adds (nondeterministic order, so bit-different results run to run). Giving
dQ its own Q-outer pass recomputes S_ij and dP_ij once more (2 of the 5 matmuls), and in
exchange every output tile has exactly one program writing it. The atomic design is kept in
``ablations.py``, where notebook 10 times it against this one.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
import triton
import triton.language as tl

from . import fast
from .dropout import keep_tile, rng_state
from .forward import (LOG2E, NO_LISTS, dot_precision, dropout_args, element_args,
                      interpreter_fp32, load_tile, mods_args, outputs_like, register_cap)
from .mods import element_ptr, element_start, element_tile, head_mods, in_band, mod_scores
from .tiles import full_tile, kv_tiles, masked_tile, q_tiles


@triton.jit
def preprocess_kernel(O, dO, D, stride_ob, stride_oh, stride_on, stride_db, stride_dh,
                      stride_dn, H, Nq, d, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = i * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    ok = (rows[:, None] < Nq) & (dims[None, :] < d)
    O_i = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + dims[None, :],
                  mask=ok, other=0.0).to(tl.float32)
    dO_i = tl.load(dO + b * stride_db + h * stride_dh + rows[:, None] * stride_dn + dims[None, :],
                   mask=ok, other=0.0).to(tl.float32)
    tl.store(D + bh * Nq + rows, tl.sum(O_i * dO_i, 1), mask=rows < Nq)


@triton.jit
def _dkdv_step(dK_j, dV_j, K_j, V_j, Q_head, dO_head, L_head, D_head, stride_qn, stride_dn,
               start_m, cols, dims, Nq, d, qk_scale,
               Br: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK: tl.constexpr,
               EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, DROPOUT: tl.constexpr = False,
               seed=0, offset=0, bh=0, start_n=0, drop_t=0, drop_scale=1.0, E_tile=0,
               mod_scale=1.0, cap=1.0, slope=0.0, B_head=0, stride_bq=0, stride_bk=0, Nk=0,
               ELEMENT: tl.constexpr = False, SCORE_MOD: tl.constexpr = 0,
               BIAS: tl.constexpr = False, band_lo=0, band_hi=0, BAND: tl.constexpr = False):
    """One Q tile i against the program's K_j, V_j; computed transposed (Bc x Br) so that the
    products land directly in dK_j and dV_j. DROPOUT (the paper's Algorithm 4): the forward's
    Z_ij regenerated from (seed, offset, bh) and the tile's position; dV_j takes the dropped
    P_ij, dP_ij is dropped and rescaled the same way. SCORE_MOD, ELEMENT and BAND as in the
    forward; dS_ij also takes the score mod's derivative."""
    rows = start_m + tl.arange(0, Br)
    row_ok = rows[:, None] < Nq
    dim_ok = dims[None, :] < d
    Q_i = load_tile(Q_head + rows[:, None] * stride_qn + dims[None, :], row_ok, dim_ok,
                    MASK, not EVEN_D)
    dO_i = load_tile(dO_head + rows[:, None] * stride_dn + dims[None, :], row_ok, dim_ok,
                     MASK, not EVEN_D)
    if MASK:  # rows past Nq: L = +inf makes their P zero
        L_i = tl.load(L_head + rows, mask=rows < Nq, other=float("inf"))
        D_i = tl.load(D_head + rows, mask=rows < Nq, other=0.0)
    else:
        L_i = tl.load(L_head + rows)
        D_i = tl.load(D_head + rows)
    S_ijT = tl.dot(K_j, tl.trans(Q_i), input_precision=DOT_PREC)
    if SCORE_MOD != 0 or BIAS:
        S_ijT, dsT = mod_scores(S_ijT, rows[None, :], cols[:, None], Nq, Nk, mod_scale, cap,
                                slope, B_head, stride_bq, stride_bk, SCORE_MOD, BIAS)
    P_ijT = tl.math.exp2(S_ijT * qk_scale - L_i[None, :])
    if MASK:
        if IS_CAUSAL:
            P_ijT = tl.where(cols[:, None] <= rows[None, :], P_ijT, 0.0)
        if ELEMENT:
            P_ijT = tl.where(element_tile(E_tile, cols.shape[0], rows.shape[0], True), P_ijT,
                             0.0)
        if BAND:
            P_ijT = tl.where(in_band(rows[None, :], cols[:, None], band_lo, band_hi), P_ijT,
                             0.0)
    ZP_ijT = P_ijT  # what the forward multiplied V_j by: P_ij, dropped and rescaled
    if DROPOUT:
        keep = tl.trans(keep_tile(seed, offset, bh, rows, start_n, drop_t, cols.shape[0]))
        ZP_ijT = tl.where(keep, P_ijT * drop_scale, 0.0)
    dV_j += tl.dot(ZP_ijT.to(dO_i.dtype), dO_i, input_precision=DOT_PREC)
    dP_ijT = tl.dot(V_j, tl.trans(dO_i), input_precision=DOT_PREC)
    if DROPOUT:
        dP_ijT = tl.where(keep, dP_ijT * drop_scale, 0.0)
    dS_ijT = P_ijT * (dP_ijT - D_i[None, :])
    if SCORE_MOD != 0:
        dS_ijT = dS_ijT * dsT
    dK_j += tl.dot(dS_ijT.to(Q_i.dtype), Q_i, input_precision=DOT_PREC)
    return dK_j, dV_j


@triton.jit
def _dkdv_program(j, b, h_kv, Q, K, V, dO, L, D, dK, dV, Q_NUM, Q_FULL, Q_IDX, qk_scale,
                  scale,
                  stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dn,
                  stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                  stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxr,
                  H, GROUP, Nq, Nk, d,
                  Br: tl.constexpr, Bc: tl.constexpr, HEAD_DIM: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, SPARSE: tl.constexpr, MASKED: tl.constexpr,
                  EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, DROPOUT: tl.constexpr = False,
                  seed=0, offset=0, drop_t=0, drop_scale=1.0, ELEM=0, ELEM_BASE=0, SLOPES=0,
                  mod_scale=1.0, cap=1.0, BIAS_PTR=0, stride_bb=0, stride_bh=0, stride_bq=0,
                  stride_bk=0, ELEMENT: tl.constexpr = False, SCORE_MOD: tl.constexpr = 0,
                  BIAS: tl.constexpr = False, band_lo=0, band_hi=0, BAND: tl.constexpr = False,
                  ACCUMULATE: tl.constexpr = False):
    """dK_j and dV_j of one K/V tile j: every Q tile i that sees it streams past."""
    cols = j * Bc + tl.arange(0, Bc)
    dims = tl.arange(0, HEAD_DIM)
    col_ok = cols[:, None] < Nk
    dim_ok = dims[None, :] < d
    K_j = load_tile(K + b * stride_kb + h_kv * stride_kh + cols[:, None] * stride_kn
                    + dims[None, :], col_ok, dim_ok, True, not EVEN_D)
    V_j = load_tile(V + b * stride_vb + h_kv * stride_vh + cols[:, None] * stride_vn
                    + dims[None, :], col_ok, dim_ok, True, not EVEN_D)
    dK_j = tl.zeros([Bc, HEAD_DIM], dtype=tl.float32)
    dV_j = tl.zeros([Bc, HEAD_DIM], dtype=tl.float32)
    for g in range(0, GROUP):  # the query heads that read this K/V head
        h = h_kv * GROUP + g
        Q_head = Q + b * stride_qb + h * stride_qh
        dO_head = dO + b * stride_db + h * stride_dh
        L_head = L + (b * H + h) * Nq
        D_head = D + (b * H + h) * Nq
        # the Q tiles that see tile j (tiles.py): unmasked first, then the causal diagonal
        # and the ragged edge
        num, num_full, u0, a0, na, b0, idx_row = q_tiles(
            j, b, h, Q_NUM, Q_FULL, Q_IDX, stride_numb, stride_numh, stride_idxb, stride_idxh,
            stride_idxr, Nq, Nk, Br, Bc, IS_CAUSAL, SPARSE)
        slope, B_head = head_mods(SLOPES, BIAS_PTR, b, h, stride_bb, stride_bh, SCORE_MOD,
                                  BIAS)
        for t in range(0, num_full):
            i = full_tile(t, u0, idx_row, SPARSE)
            dK_j, dV_j = _dkdv_step(dK_j, dV_j, K_j, V_j, Q_head, dO_head, L_head, D_head,
                                    stride_qn, stride_dn, i * Br, cols, dims, Nq, d, qk_scale,
                                    Br, IS_CAUSAL, False, EVEN_D, DOT_PREC, DROPOUT, seed,
                                    offset, b * H + h, j * Bc, drop_t, drop_scale, 0,
                                    mod_scale, cap, slope, B_head, stride_bq, stride_bk, Nk,
                                    False, SCORE_MOD, BIAS)
        if MASKED:
            # a mask mod's partial tiles: their element masks, this list's from e0 + num_full on
            e0 = element_start(ELEM_BASE, b, h, j, stride_numb, stride_numh, num_full, ELEMENT)
            for t in range(num_full, num):
                i = masked_tile(t, num_full, a0, na, b0, idx_row, SPARSE)
                E_tile = element_ptr(ELEM, e0, t, Br * Bc, ELEMENT)
                dK_j, dV_j = _dkdv_step(dK_j, dV_j, K_j, V_j, Q_head, dO_head, L_head, D_head,
                                        stride_qn, stride_dn, i * Br, cols, dims, Nq, d,
                                        qk_scale, Br, IS_CAUSAL, True, EVEN_D, DOT_PREC,
                                        DROPOUT, seed, offset, b * H + h, j * Bc, drop_t,
                                        drop_scale, E_tile, mod_scale, cap, slope, B_head,
                                        stride_bq, stride_bk, Nk, ELEMENT, SCORE_MOD, BIAS,
                                        band_lo, band_hi, BAND)
    out_ok = col_ok & dim_ok
    _put(dK + b * stride_dkb + h_kv * stride_dkh + cols[:, None] * stride_dkn + dims[None, :],
         dK_j * scale, out_ok, ACCUMULATE)
    _put(dV + b * stride_dvb + h_kv * stride_dvh + cols[:, None] * stride_dvn + dims[None, :],
         dV_j, out_ok, ACCUMULATE)


@triton.jit
def _put(ptr, tile, ok, ACCUMULATE: tl.constexpr):
    """Store a finished float32 gradient tile, or (ACCUMULATE) add it to what is there: the
    caller sums several calls' gradients in one buffer, with no temporary per call."""
    if ACCUMULATE:
        tile += tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptr, tile.to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dq_step(dQ_i, Q_i, dO_i, L_i, D_i, K_head, V_head, stride_kn, stride_vn, start_n, rows,
             dims, Nk, d, qk_scale, Bc: tl.constexpr, IS_CAUSAL: tl.constexpr,
             MASK: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
             DROPOUT: tl.constexpr = False, seed=0, offset=0, bh=0, drop_t=0, drop_scale=1.0,
             E_tile=0, mod_scale=1.0, cap=1.0, slope=0.0, B_head=0, stride_bq=0, stride_bk=0,
             Nq=0, DB_head=0, ELEMENT: tl.constexpr = False, SCORE_MOD: tl.constexpr = 0,
             BIAS: tl.constexpr = False, BIAS_GRAD: tl.constexpr = False, band_lo=0, band_hi=0,
             BAND: tl.constexpr = False):
    """One K_j, V_j tile against the program's Q_i: dQ_i += dS_ij K_j (DROPOUT: dP_ij
    dropped and rescaled by the forward's Z_ij, regenerated; SCORE_MOD, ELEMENT, BAND as
    above)."""
    cols = start_n + tl.arange(0, Bc)
    col_ok = cols[:, None] < Nk
    dim_ok = dims[None, :] < d
    K_j = load_tile(K_head + cols[:, None] * stride_kn + dims[None, :], col_ok, dim_ok,
                    MASK, not EVEN_D)
    V_j = load_tile(V_head + cols[:, None] * stride_vn + dims[None, :], col_ok, dim_ok,
                    MASK, not EVEN_D)
    S_ij = tl.dot(Q_i, tl.trans(K_j), input_precision=DOT_PREC)
    if SCORE_MOD != 0 or BIAS:
        S_ij, ds = mod_scores(S_ij, rows[:, None], cols[None, :], Nq, Nk, mod_scale, cap, slope,
                              B_head, stride_bq, stride_bk, SCORE_MOD, BIAS)
    P_ij = tl.math.exp2(S_ij * qk_scale - L_i[:, None])
    if MASK:
        visible = cols[None, :] < Nk
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        if ELEMENT:
            visible = visible & element_tile(E_tile, rows.shape[0], cols.shape[0], False)
        if BAND:
            visible = visible & in_band(rows[:, None], cols[None, :], band_lo, band_hi)
        P_ij = tl.where(visible, P_ij, 0.0)
    dP_ij = tl.dot(dO_i, tl.trans(V_j), input_precision=DOT_PREC)
    if DROPOUT:
        keep = keep_tile(seed, offset, bh, rows, start_n, drop_t, Bc)
        dP_ij = tl.where(keep, dP_ij * drop_scale, 0.0)
    dS_ij = P_ij * (dP_ij - D_i[:, None])
    if BIAS_GRAD:  # a learned attn_mask: its gradient is dS_ij itself (the bias adds to s_ij)
        tl.store(DB_head + rows[:, None] * Nk + cols[None, :], dS_ij,
                 mask=(rows[:, None] < Nq) & (cols[None, :] < Nk))
    if SCORE_MOD != 0:
        dS_ij = dS_ij * ds
    dQ_i += tl.dot(dS_ij.to(K_j.dtype), K_j, input_precision=DOT_PREC)
    return dQ_i


@triton.jit
def _dq_program(i, b, h, Q, K, V, dO, L, D, dQ, KV_NUM, KV_FULL, KV_IDX, qk_scale, scale,
                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dn,
                stride_dqb, stride_dqh, stride_dqn,
                stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxr,
                H, GROUP, Nq, Nk, d,
                Br: tl.constexpr, Bc: tl.constexpr, HEAD_DIM: tl.constexpr,
                IS_CAUSAL: tl.constexpr, SPARSE: tl.constexpr, MASKED: tl.constexpr,
                EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, DROPOUT: tl.constexpr = False,
                seed=0, offset=0, drop_t=0, drop_scale=1.0, ELEM=0, ELEM_BASE=0, SLOPES=0,
                mod_scale=1.0, cap=1.0, BIAS_PTR=0, stride_bb=0, stride_bh=0, stride_bq=0,
                stride_bk=0, DBIAS=0, ELEMENT: tl.constexpr = False,
                SCORE_MOD: tl.constexpr = 0, BIAS: tl.constexpr = False,
                BIAS_GRAD: tl.constexpr = False, band_lo=0, band_hi=0,
                BAND: tl.constexpr = False, ACCUMULATE: tl.constexpr = False):
    """dQ_i of one Q tile i (query head h): the K/V tiles stream past as in the forward."""
    h_kv = h // GROUP
    rows = i * Br + tl.arange(0, Br)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows[:, None] < Nq
    dim_ok = dims[None, :] < d
    Q_i = load_tile(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + dims[None, :],
                    row_ok, dim_ok, True, not EVEN_D)
    dO_i = load_tile(dO + b * stride_db + h * stride_dh + rows[:, None] * stride_dn
                     + dims[None, :], row_ok, dim_ok, True, not EVEN_D)
    bh = b * H + h
    L_i = tl.load(L + bh * Nq + rows, mask=rows < Nq, other=float("inf"))
    D_i = tl.load(D + bh * Nq + rows, mask=rows < Nq, other=0.0)
    K_head = K + b * stride_kb + h_kv * stride_kh
    V_head = V + b * stride_vb + h_kv * stride_vh
    dQ_i = tl.zeros([Br, HEAD_DIM], dtype=tl.float32)
    # the K/V tiles this Q tile visits, exactly as in the forward
    num, num_full, u0, a0, na, b0, idx_row = kv_tiles(
        i, b, h, KV_NUM, KV_FULL, KV_IDX, stride_numb, stride_numh, stride_idxb, stride_idxh,
        stride_idxr, Nq, Nk, Br, Bc, IS_CAUSAL, SPARSE)
    slope, B_head = head_mods(SLOPES, BIAS_PTR, b, h, stride_bb, stride_bh, SCORE_MOD, BIAS)
    DB_head = 0
    if BIAS_GRAD:  # its gradient, (B, H, Nq, Nk) float32, zeros where no tile is visited
        DB_head = DBIAS + bh.to(tl.int64) * Nq * Nk
    for t in range(0, num_full):
        j = full_tile(t, u0, idx_row, SPARSE)
        dQ_i = _dq_step(dQ_i, Q_i, dO_i, L_i, D_i, K_head, V_head, stride_kn, stride_vn, j * Bc,
                        rows, dims, Nk, d, qk_scale, Bc, IS_CAUSAL, False, EVEN_D, DOT_PREC,
                        DROPOUT, seed, offset, bh, drop_t, drop_scale, 0, mod_scale, cap,
                        slope, B_head, stride_bq, stride_bk, Nq, DB_head, False, SCORE_MOD, BIAS,
                        BIAS_GRAD)
    if MASKED:
        # a mask mod's partial tiles: their element masks, this row's from e0 + num_full on
        e0 = element_start(ELEM_BASE, b, h, i, stride_numb, stride_numh, num_full, ELEMENT)
        for t in range(num_full, num):
            j = masked_tile(t, num_full, a0, na, b0, idx_row, SPARSE)
            E_tile = element_ptr(ELEM, e0, t, Br * Bc, ELEMENT)
            dQ_i = _dq_step(dQ_i, Q_i, dO_i, L_i, D_i, K_head, V_head, stride_kn, stride_vn,
                            j * Bc, rows, dims, Nk, d, qk_scale, Bc, IS_CAUSAL, True, EVEN_D,
                            DOT_PREC, DROPOUT, seed, offset, bh, drop_t, drop_scale, E_tile,
                            mod_scale, cap, slope, B_head, stride_bq, stride_bk, Nq, DB_head,
                            ELEMENT, SCORE_MOD, BIAS, BIAS_GRAD, band_lo, band_hi, BAND)
    _put(dQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqn + dims[None, :],
         dQ_i * scale, row_ok & dim_ok, ACCUMULATE)


@triton.jit
def backward_kernel(Q, K, V, dO, L, D, dQ, dK, dV, Q_NUM, Q_FULL, Q_IDX, KV_NUM, KV_FULL, KV_IDX,
                    qk_scale, scale,
                    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dn,
                    stride_dqb, stride_dqh, stride_dqn,
                    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                    stride_qnumb, stride_qnumh, stride_qidxb, stride_qidxh, stride_qidxr,
                    stride_kvnumb, stride_kvnumh, stride_kvidxb, stride_kvidxh, stride_kvidxr,
                    H, Hkv, GROUP, Nq, Nk, d, first_pid, Tc, Tr, RNG, drop_t, drop_scale,
                    ELEM1, ELEM_BASE1, ELEM2, ELEM_BASE2, SLOPES, mod_scale, cap,
                    BIAS_PTR, stride_bb, stride_bh, stride_bq, stride_bk, DBIAS, band_lo, band_hi,
                    Br1: tl.constexpr, Bc1: tl.constexpr, Br2: tl.constexpr, Bc2: tl.constexpr,
                    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, SPARSE: tl.constexpr,
                    MASKED1: tl.constexpr, MASKED2: tl.constexpr,
                    EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
                    DKDV: tl.constexpr, DQ: tl.constexpr, DROPOUT: tl.constexpr = False,
                    ELEMENT1: tl.constexpr = False, ELEMENT2: tl.constexpr = False,
                    SCORE_MOD: tl.constexpr = 0, BIAS: tl.constexpr = False,
                    BIAS_GRAD: tl.constexpr = False, BAND: tl.constexpr = False,
                    ACCUMULATE: tl.constexpr = False):
    """Programs [0, Tc) of each (batch, K/V head) compute dK_j, dV_j (tiles Br1 x Bc1);
    programs [Tc, Tc + GROUP * Tr) compute dQ_i for the group's query heads (tiles Br2 x Bc2).
    One launch can hold both kinds (DKDV and DQ), as FlexAttention's backward does, or each
    kind gets its own launch, tiles and warps (``first_pid`` then says where a launch starts).
    ACCUMULATE: dQ, dK, dV are added to what the output buffers hold."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile may hand float64 scalars
    scale = tl.cast(scale, tl.float32)
    pid = first_pid + tl.program_id(0)
    bh_kv = tl.program_id(1)
    b = bh_kv // Hkv
    h_kv = bh_kv % Hkv
    # the forward's RNG state: its mask is regenerated, never stored
    seed, offset, drop_scale = rng_state(RNG, drop_scale, DROPOUT)
    mod_scale = tl.cast(mod_scale, tl.float32)
    cap = tl.cast(cap, tl.float32)
    if DKDV:
        if pid < Tc:
            _dkdv_program(pid, b, h_kv, Q, K, V, dO, L, D, dK, dV, Q_NUM, Q_FULL, Q_IDX,
                          qk_scale, scale, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
                          stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh,
                          stride_dn,
                          stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                          stride_qnumb, stride_qnumh, stride_qidxb, stride_qidxh, stride_qidxr,
                          H, GROUP, Nq, Nk, d, Br1, Bc1, HEAD_DIM, IS_CAUSAL, SPARSE,
                          MASKED1, EVEN_D, DOT_PREC, DROPOUT, seed, offset, drop_t, drop_scale,
                          ELEM1, ELEM_BASE1, SLOPES, mod_scale, cap, BIAS_PTR, stride_bb,
                          stride_bh, stride_bq, stride_bk, ELEMENT1, SCORE_MOD, BIAS,
                          band_lo, band_hi, BAND, ACCUMULATE)
    if DQ:
        if pid >= Tc:
            q_pid = pid - Tc
            h = h_kv * GROUP + q_pid // Tr
            _dq_program(q_pid % Tr, b, h, Q, K, V, dO, L, D, dQ, KV_NUM, KV_FULL, KV_IDX,
                        qk_scale, scale,
                        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dn,
                        stride_dqb, stride_dqh, stride_dqn,
                        stride_kvnumb, stride_kvnumh, stride_kvidxb, stride_kvidxh,
                        stride_kvidxr, H, GROUP, Nq, Nk, d, Br2, Bc2, HEAD_DIM, IS_CAUSAL,
                        SPARSE, MASKED2, EVEN_D, DOT_PREC, DROPOUT, seed, offset, drop_t,
                        drop_scale, ELEM2, ELEM_BASE2, SLOPES, mod_scale, cap, BIAS_PTR,
                        stride_bb, stride_bh, stride_bq, stride_bk, DBIAS, ELEMENT2, SCORE_MOD,
                        BIAS, BIAS_GRAD, band_lo, band_hi, BAND, ACCUMULATE)


def _returned(into, grads, dtype):
    """What a call returns: the caller's buffers it added to, or its gradients in the inputs'
    dtype (the interpreter computes 16-bit inputs in float32)."""
    if into is not None:
        return into
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in grads)


def _check_into(into, q, k, v):
    """The (dQ, dK, dV) buffers a call adds to: q's, k's and v's shapes, on their device."""
    if not isinstance(into, (tuple, list)) or len(into) != 3:
        raise TypeError(f"into must be a (dq, dk, dv) tuple of tensors, got {type(into).__name__}")
    for name, buf, x in zip(("dq", "dk", "dv"), into, (q, k, v)):
        if buf.shape != x.shape or buf.device != x.device:
            raise ValueError(f"into: {name} must have shape {tuple(x.shape)} on {x.device}, "
                             f"got {tuple(buf.shape)} on {buf.device}")
    return into


def preprocess(o, do, rows):
    """D = rowsum(dO * O), float32 (B, H, Nq)."""
    D = torch.empty(o.shape[:3], dtype=torch.float32, device=o.device)
    fast.run(preprocess_kernel, *_preprocess_launch(o, do, D, rows))
    return D


def _preprocess_launch(o, do, D, rows):
    """(grid, args, consts) of preprocess_kernel: (o, do, D) lead the arguments."""
    B, H, Nq, d = o.shape
    so, sd = o.stride(), do.stride()
    return ((-(-Nq // rows), B * H),
            (o, do, D, so[0], so[1], so[2], sd[0], sd[1], sd[2], H, Nq, d),
            _preprocess_consts(rows, d))


@functools.lru_cache(maxsize=64)
def _preprocess_consts(rows, d):
    from .config import padded_head_dim

    return {"ROWS": rows, "HEAD_DIM": padded_head_dim(d)}


def fused(config, Nk: int) -> bool:
    """Whether the dK/dV and dQ programs of a backward with Nk keys share one launch."""
    return config.fused_backward and (config.split_from is None or Nk < config.split_from)


@functools.lru_cache(maxsize=1024)
def _launch_consts(Nq, Nk, d, dtype, is_causal, sparse_, config, interpreted):
    """Each launch of backward_kernel: its first program, its dK/dV programs and its
    constexprs and options, computed once per configuration."""
    from . import sparse
    from .config import padded_head_dim

    t1, t2 = config.dkdv, config.dq
    HEAD_DIM = padded_head_dim(d)
    common = dict(Br1=t1.Br, Bc1=t1.Bc, Br2=t2.Br, Bc2=t2.Bc, HEAD_DIM=HEAD_DIM,
                  IS_CAUSAL=is_causal, SPARSE=sparse_,
                  MASKED1=sparse.needs_mask(is_causal, Nq, Nk, t1.Br, t1.Bc),
                  MASKED2=sparse.needs_mask(is_causal, Nq, Nk, t2.Br, t2.Bc),
                  EVEN_D=HEAD_DIM == d, DOT_PREC=dot_precision(dtype))
    Tc, Tr = -(-Nk // t1.Bc), -(-Nq // t2.Br)

    def part(first_pid, programs, tiles, **which):
        return first_pid, programs, {**common, **which, **({} if interpreted else tiles.launch())}

    # (first program, programs per (batch, K/V head) before the dQ ones, constexprs): the
    # GROUP * Tr dQ programs are added at launch
    if fused(config, Nk):
        return (part(0, Tc, t1, DKDV=True, DQ=True),)
    return part(0, Tc, t1, DKDV=True, DQ=False), part(Tc, 0, t2, DKDV=False, DQ=True)


_SHRUNK: dict = {}  # backward configs whose launch ran out of resources -> configs that fit


def backward(q, k, v, o, lse2, do, *, is_causal, scale, block_mask, config, interpreted,
             dropout_p=0.0, rng=None, mods=None, dlse=None, mask_grad=False, D=None, keep=None,
             into=None):
    """Launch the kernels; returns (dQ, dK, dV) in the inputs' dtype. With ``dropout_p`` > 0,
    ``rng`` is the forward's [seed, offset]: the kernels regenerate its mask. ``mods`` as the
    forward's; ``dlse``: the gradient of the natural-log lse, if the call returned it
    (d lse_i / d s_ij = P_ij, so it is subtracted from D_i). ``mask_grad``: also return the
    gradient of the float attn_mask in ``mods`` (dS_ij, summed to the mask's shape).
    ``D``: rowsum(dO * O), float32 (B, H, Nq) contiguous, when the caller has it already (ring
    attention computes it once for all its calls); otherwise the preprocess kernel computes it.

    ``config.fused_backward``: the dK/dV and dQ programs share one launch (and the dK/dV
    tiles' warps and stages) for keys shorter than ``config.split_from``; otherwise two
    launches, each with its own.
    ``keep``: a list; the call's launch plan, (the preprocess's launch or None, [the kernel's
    launches]), is appended to it, if the call has one (as the forward's).
    ``into``: (dQ, dK, dV) buffers of q's, k's and v's shapes, any strides and dtypes: the
    kernels add this call's gradients to them (no tensors of the call's own; float32 buffers
    sum many calls with one rounding each). Returns ``into``."""
    dtype = q.dtype
    q, k, v, o, do = interpreter_fp32(interpreted, q, k, v, o, do)
    if into is None:
        (q, k, v), (dq, dk, dv) = outputs_like(q, k, v)
    else:
        dq, dk, dv = _check_into(into, q, k, v)
    config = config.backward_entry(is_causal, dropout_p > 0, block_mask, k.shape[2])
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    own_D = D is None
    if own_D:
        D = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    # the call's own tensors, in the order the kernel takes them first (rng after them)
    live = (q, k, v, do, lse2, D, dq, dk, dv) + ((rng,) if dropout_p > 0 else ())
    # a call laid out as an earlier one repeats its launches (fast.PLANS); a score mod or an
    # attn_mask, an lse gradient and the mask's gradient take the general path (a mask mod
    # is part of the block mask, which the key holds)
    plan_key = None
    if (mods is None or mods.mask_mod_only) and dlse is None and not mask_grad:
        given = live[6:9] if into is not None else ()  # outputs laid out by the caller
        plan_key = fast.signature((*live[:6], o, *live[9:], *given), id(backward_kernel),
                                  own_D, config, is_causal, scale, block_mask, mods is not None,
                                  interpreted, dropout_p, into is not None)
        plan = fast.PLANS.get(plan_key)
        if plan is not None:
            if keep is not None:
                keep.append(plan)
            first, launches = plan
            stream = fast.stream_for(first, *launches)
            if first is not None:
                first.start(o, do, D, stream=stream)
            for launch in launches:
                launch.start(*live, stream=stream)
            return _returned(into, (dq, dk, dv), dtype)
    key = (config, q.shape[-1], dtype, dropout_p > 0, mods is not None)  # per kernel variant
    if _SHRUNK:
        config = _SHRUNK.get(key, config)
    first = None  # the preprocess's launch, for the plan
    if own_D:
        pre_grid, pre_args, pre_consts = _preprocess_launch(o, do, D, config.preprocess_rows)
        fast.run(preprocess_kernel, pre_grid, pre_args, pre_consts)
        if plan_key is not None:
            first = fast.Launch(preprocess_kernel, pre_grid, pre_args, pre_consts, (0, 1, 2))
    if dlse is not None:
        D = D - dlse.to(torch.float32).reshape(D.shape)
    sq, sk, sv, sd = q.stride(), k.stride(), v.stride(), do.stride()
    dbias = None
    if mask_grad:
        dbias = torch.zeros((B, H, Nq, Nk), dtype=torch.float32, device=q.device)
    while True:
        t1, t2 = config.dkdv, config.dq
        if block_mask is None:
            q_lists = kv_lists = NO_LISTS
        else:
            from . import sparse

            q_lists = sparse.kernel_lists(block_mask, t1.Br, t1.Bc, True, q.device, is_causal)
            kv_lists = sparse.kernel_lists(block_mask, t2.Br, t2.Bc, False, q.device, is_causal)
        GROUP, Tc, Tr = H // Hkv, -(-Nk // t1.Bc), -(-Nq // t2.Br)
        (E1, E_base1, SLOPES, mod_scale, cap, *bias, band_lo, band_hi), c1 = mods_args(
            mods, block_mask, scale, t1.Br, t1.Bc, True, q, k, is_causal)
        # the dQ pass's lists have their own tiles; the rest is the dK/dV pass's
        E2, E_base2 = element_args(mods, block_mask, t2.Br, t2.Bc, False, q.device, is_causal,
                                   c1["BAND"])
        mod_consts = {"ELEMENT1": c1["ELEMENT"], "ELEMENT2": E2 is not None,
                      "SCORE_MOD": c1["SCORE_MOD"], "BIAS": c1["BIAS"],
                      "BIAS_GRAD": mask_grad, "BAND": c1["BAND"],
                      "ACCUMULATE": into is not None}
        natural = c1["SCORE_MOD"] or c1["BIAS"]  # the kernels add in natural units
        qk_scale = LOG2E if natural else scale * LOG2E
        args = (q, k, v, do, lse2, D, dq, dk, dv, *q_lists[:3], *kv_lists[:3], qk_scale,
                scale, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
                sd[0], sd[1], sd[2], *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
                *q_lists[3], *kv_lists[3], H, Hkv, GROUP, Nq, Nk, d)
        launches = []
        try:
            for first_pid, programs, consts in _launch_consts(
                    Nq, Nk, d, q.dtype, is_causal, block_mask is not None, config, interpreted):
                programs += GROUP * Tr if consts["DQ"] else 0
                grid = (programs, B * Hkv)
                args_i = (*args, first_pid, Tc, Tr, *dropout_args(dropout_p, rng), E1, E_base1,
                          E2, E_base2, SLOPES, mod_scale, cap, *bias, dbias, band_lo, band_hi)
                consts_i = register_cap({**consts, "DROPOUT": dropout_p > 0, **mod_consts,
                                         "MASKED1": consts["MASKED1"] or c1["ELEMENT"]
                                         or c1["BAND"],
                                         "MASKED2": consts["MASKED2"] or E2 is not None
                                         or c1["BAND"]})
                fast.run(backward_kernel, grid, args_i, consts_i)
                if plan_key is not None:  # live: the first nine arguments, then rng
                    own = fast.slots(args_i, 9, *live[9:])
                    launches.append(fast.Launch(backward_kernel, grid, args_i, consts_i, own))
            break
        except fast.OUT_OF_RESOURCES as exc:  # smaller tiles for both kinds of program
            from .config import smaller

            new1, new2 = smaller(t1), smaller(t2)
            if new1 is None and new2 is None:
                raise
            config = dataclasses.replace(config, dkdv=new1 or t1, dq=new2 or t2,
                                         causal_backward=None)
            warnings.warn(f"flashedu: {exc}; retrying the backward with smaller tiles "
                          f"{config.dkdv}, {config.dq}", stacklevel=2)
            _SHRUNK[key] = config
    if plan_key is not None:
        fast.remember(plan_key, (first, launches))
        if keep is not None:
            keep.append((first, launches))
    grads = _returned(into, (dq, dk, dv), dtype)
    if mask_grad:
        attn_mask = mods.attn_mask
        return (*grads, dbias.sum_to_size(attn_mask.shape).to(attn_mask.dtype))
    return grads
