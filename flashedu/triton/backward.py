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

Here are the kernels and what a launch passes them (``launch_args``); the host side of a call
(D's and the gradients' tensors, the launch plan, smaller tiles after an out-of-resources
error) is ``launch.py``.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .dropout import dropped, keep_rate
from .forward import (_LOG2E, dropout_args, dropout_state, element_args, exponent_scale,
                      load_tile, mods_args, row_strides, sequences_arg)
from .mods import mod_scores, visible
from .tiles import (element_origin, full_tile, kv_tiles, masked_tile, q_tiles, sequence,
                    starts_inside)


@triton.jit
def preprocess_kernel(O, dO, D, stride_ob, stride_oh, stride_on, stride_db, stride_dh,
                      stride_dn, H, Nq, d, sink, dlse, ROWS: tl.constexpr,
                      HEAD_DIM: tl.constexpr):
    """D_i = rowsum(dO_i * O_i) for ROWS rows of one head; with ``sink`` = (the sink logits,
    the base-2 L, a (B * H, programs) buffer), also this program's part of the sinks' gradient
    (:func:`_sink_part`), from the same D_i. None: not compiled."""
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
    D_i = tl.sum(O_i * dO_i, 1)
    tl.store(D + bh * Nq + rows, D_i, mask=rows < Nq)
    if sink is not None:
        _sink_part(sink, dlse, D_i, rows, bh, h, i, Nq)


@triton.jit
def _sink_part(sink, dlse, D_i, rows, bh, h, i, Nq):
    """The sink is one more column of dS = P (dP - D) whose dP is 0: its gradient is
    -sum_i P_i,sink (D_i - dlse_i), P_i,sink = exp(sink - L_i) = exp2(sink log2(e) - L2_i).
    This program's rows' sum goes to part[bh, i]; the host adds the parts up (no atomics: the
    same gradient every run). Rows past Nq read L2 = +inf, so P_i,sink = 0 there."""
    sinks, L2, part = sink
    ok = rows < Nq
    if dlse is not None:  # the lse's gradient, when the call returned the lse
        D_i = D_i - tl.load(dlse + bh * Nq + rows, mask=ok, other=0.0)
    L2_i = tl.load(L2 + bh * Nq + rows, mask=ok, other=float("inf"))
    P_sink = tl.math.exp2(tl.load(sinks + h) * _LOG2E - L2_i)
    tl.store(part + bh * tl.num_programs(0) + i, -tl.sum(P_sink * D_i, 0))


@triton.jit
def _dkdv_step(dK_j, dV_j, K_j, V_j, Q_head, dO_head, L_head, D_head, stride_qn, stride_dn,
               start_m, start_n, diag, dims, Nq, Nk, d, qk_scale, ctx, E, drop,
               Br: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK: tl.constexpr,
               EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, SCORE_MOD: tl.constexpr = None,
               MASK_MOD: tl.constexpr = None):
    """One Q tile i against the program's K_j, V_j; computed transposed (Bc x Br) so that the
    products land directly in dK_j and dV_j. drop (the paper's Algorithm 4): the forward's
    Z_ij regenerated from (seed, offset, bh) and the tile's position; dV_j takes the dropped
    P_ij, dP_ij is dropped the same way, and the keep scale s waits for the program's end (D_i
    divided by it here). SCORE_MOD and the visibility rule as in
    the forward (the queries' positions: their rows + diag, ``tiles.sequence``); dS_ij also
    takes the score mod's derivative."""
    rows = start_m + tl.arange(0, Br)
    cols = start_n + tl.arange(0, K_j.shape[0])
    bias = ctx[4]  # SDPA's float attn_mask (mods.py), or None
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
    if drop is not None:  # dS = s P (Z dP - D / s): the keep scale s waits for dK_j's end
        D_i = D_i * keep_rate(drop)
    # With dropout a thread here draws a Philox call for each 4 of its entries (dropout.py).
    # Causal, on small K/V tiles, S_ij held upright (each call drawn once) measured 10-13%
    # faster on an H200, the transposed P_ij and dS_ij going through shared memory; not
    # causal 2-6% slower, and on 128 x 128 K/V tiles it spills (BENCHMARKS.md, "Dropout's
    # select in 16 bits").
    if drop is not None and IS_CAUSAL and K_j.shape[0] * K_j.shape[1] <= 64 * 64:
        return _dkdv_upright(dK_j, dV_j, K_j, V_j, Q_i, dO_i, L_i, D_i, rows, cols, diag, Nk,
                             qk_scale, ctx, E, drop, start_m, start_n, IS_CAUSAL, MASK,
                             DOT_PREC, SCORE_MOD, MASK_MOD)
    S_ijT = tl.dot(K_j, tl.trans(Q_i), input_precision=DOT_PREC)
    if SCORE_MOD is not None or bias is not None:
        S_ijT, dsT = mod_scores(S_ijT, rows[None, :], cols[:, None], Nk, ctx, SCORE_MOD)
    P_ijT = tl.math.exp2(S_ijT * qk_scale - L_i[None, :])
    if MASK:
        P_ijT = tl.where(visible(rows[None, :] + diag, cols[:, None], Nk, E, ctx, IS_CAUSAL,
                                 MASK_MOD), P_ijT, 0.0)
    ZP_ijT = P_ijT.to(dO_i.dtype)  # what the forward multiplied V_j by: P_ij, dropped
    if drop is not None:  # S_ij transposed: entry (col, row); dP_ij's drop below is this draw
        ZP_ijT = dropped(ZP_ijT, drop, start_m, start_n, TRANSPOSED=True)
    dV_j += tl.dot(ZP_ijT, dO_i, input_precision=DOT_PREC)
    dP_ijT = tl.dot(V_j, tl.trans(dO_i), input_precision=DOT_PREC)
    if drop is not None:
        dP_ijT = dropped(dP_ijT, drop, start_m, start_n, TRANSPOSED=True)
    dS_ijT = P_ijT * (dP_ijT - D_i[None, :])
    if SCORE_MOD is not None:
        dS_ijT = dS_ijT * dsT
    dK_j += tl.dot(dS_ijT.to(Q_i.dtype), Q_i, input_precision=DOT_PREC)
    return dK_j, dV_j


@triton.jit
def _dkdv_upright(dK_j, dV_j, K_j, V_j, Q_i, dO_i, L_i, D_i, rows, cols, diag, Nk, qk_scale,
                  ctx, E, drop, start_m, start_n, IS_CAUSAL: tl.constexpr, MASK: tl.constexpr,
                  DOT_PREC: tl.constexpr, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr):
    """``_dkdv_step``'s products with S_ij upright (Br x Bc), as the forward and the dQ
    program hold it: each Philox call drawn once for its 16 entries, and P_ij, dS_ij
    transposed into the products through shared memory (FlashAttention-2's backward). For
    dropout only: without it the transposed step needs no such round trip. D_i comes divided
    by the keep scale, as in ``_dkdv_step``."""
    S_ij = tl.dot(Q_i, tl.trans(K_j), input_precision=DOT_PREC)
    if SCORE_MOD is not None or ctx[4] is not None:
        S_ij, ds = mod_scores(S_ij, rows[:, None], cols[None, :], Nk, ctx, SCORE_MOD)
    P_ij = tl.math.exp2(S_ij * qk_scale - L_i[:, None])
    if MASK:
        P_ij = tl.where(visible(rows[:, None] + diag, cols[None, :], Nk, E, ctx, IS_CAUSAL,
                                MASK_MOD), P_ij, 0.0)
    ZP_ij = dropped(P_ij.to(dO_i.dtype), drop, start_m, start_n)
    dV_j += tl.dot(tl.trans(ZP_ij), dO_i, input_precision=DOT_PREC)
    dP_ij = tl.dot(dO_i, tl.trans(V_j), input_precision=DOT_PREC)
    dP_ij = dropped(dP_ij, drop, start_m, start_n)
    dS_ij = P_ij * (dP_ij - D_i[:, None])
    if SCORE_MOD is not None:
        dS_ij = dS_ij * ds
    dK_j += tl.dot(tl.trans(dS_ij.to(Q_i.dtype)), Q_i, input_precision=DOT_PREC)
    return dK_j, dV_j


@triton.jit
def _dkdv_program(j, b, h_kv, Q, K, V, dO, L, D, dK, dV, LISTS, ELEM, scale, stride_q, stride_k,
                  stride_v, stride_do, stride_dk, stride_dv, H, GROUP, Nq, Nk, d, RNG, dropout,
                  bias, score_args, mask_args, SEQS, Br: tl.constexpr, Bc: tl.constexpr,
                  HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                  EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, SCORE_MOD: tl.constexpr,
                  MASK_MOD: tl.constexpr, ACCUMULATE: tl.constexpr):
    """dK_j and dV_j of one K/V tile j: every Q tile i that sees it streams past."""
    rows_per_head = Nq
    q0, k0, base, Nq, Nk, diag = sequence(SEQS, b, H, Nq, Nk)  # tiles.py: packed sequences
    Q += q0 * stride_q[2]
    dO += q0 * stride_do[2]
    K += k0 * stride_k[2]
    V += k0 * stride_v[2]
    dK += k0 * stride_dk[2]
    dV += k0 * stride_dv[2]
    cols = j * Bc + tl.arange(0, Bc)
    dims = tl.arange(0, HEAD_DIM)
    col_ok = cols[:, None] < Nk
    dim_ok = dims[None, :] < d
    K_j = load_tile(K + b * stride_k[0] + h_kv * stride_k[1] + cols[:, None] * stride_k[2]
                    + dims[None, :], col_ok, dim_ok, True, not EVEN_D)
    V_j = load_tile(V + b * stride_v[0] + h_kv * stride_v[1] + cols[:, None] * stride_v[2]
                    + dims[None, :], col_ok, dim_ok, True, not EVEN_D)
    dK_j = tl.zeros([Bc, HEAD_DIM], dtype=tl.float32)
    dV_j = tl.zeros([Bc, HEAD_DIM], dtype=tl.float32)
    scale = tl.cast(scale, tl.float32)  # torch.compile may hand a float64 scalar
    qk_scale = exponent_scale(scale, bias, SCORE_MOD)
    for g in range(0, GROUP):  # the query heads that read this K/V head
        h = h_kv * GROUP + g
        Q_head = Q + b * stride_q[0] + h * stride_q[1]
        dO_head = dO + b * stride_do[0] + h * stride_do[1]
        L_head = L + base + h * rows_per_head
        D_head = D + base + h * rows_per_head
        ctx = (b, h, Nq, scale, bias, score_args, mask_args)  # what the mods read
        drop = None
        if RNG is not None:
            drop = dropout_state(RNG, b * H + h, dropout)
        # the Q tiles that see tile j (tiles.py): unmasked first, then the causal diagonal
        # and the ragged edge
        num, num_full, u0, a0, na, b0, idx_row, e0 = q_tiles(j, b, h, LISTS, ELEM, Nq, Nk,
                                                             diag, Br, Bc, IS_CAUSAL)
        for t in range(0, num_full):
            i = full_tile(t, u0, idx_row, LISTS)
            dK_j, dV_j = _dkdv_step(dK_j, dV_j, K_j, V_j, Q_head, dO_head, L_head, D_head,
                                    stride_q[2], stride_do[2], i * Br, j * Bc, diag, dims, Nq,
                                    Nk, d, qk_scale, ctx, None, drop, Br, IS_CAUSAL, False, EVEN_D,
                                    DOT_PREC, SCORE_MOD, MASK_MOD)
        if MASKED:
            for t in range(num_full, num):
                i = masked_tile(t, num_full, a0, na, b0, idx_row, LISTS)
                E = None
                if ELEM is not None:  # a mask mod's partial tile: its element mask
                    E = (element_origin(ELEM, e0, t, i * Br, j * Bc, Br, Bc), Bc)
                dK_j, dV_j = _dkdv_step(dK_j, dV_j, K_j, V_j, Q_head, dO_head, L_head, D_head,
                                        stride_q[2], stride_do[2], i * Br, j * Bc, diag, dims,
                                        Nq, Nk, d, qk_scale, ctx, E, drop, Br, IS_CAUSAL, True,
                                        EVEN_D, DOT_PREC, SCORE_MOD, MASK_MOD)
    dK_scale = scale
    if RNG is not None:  # the keep scale, left out of every step's dropped P_ij and dS_ij
        dK_scale = scale * dropout[1]
        dV_j = dV_j * dropout[1]
    out_ok = col_ok & dim_ok
    _put(dK + b * stride_dk[0] + h_kv * stride_dk[1] + cols[:, None] * stride_dk[2]
         + dims[None, :], dK_j * dK_scale, out_ok, ACCUMULATE)
    _put(dV + b * stride_dv[0] + h_kv * stride_dv[1] + cols[:, None] * stride_dv[2]
         + dims[None, :], dV_j, out_ok, ACCUMULATE)


@triton.jit
def _put(ptr, tile, ok, ACCUMULATE: tl.constexpr):
    """Store a finished float32 gradient tile, or (ACCUMULATE) add it to what is there: the
    caller sums several calls' gradients in one buffer, with no temporary per call."""
    if ACCUMULATE:
        tile += tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptr, tile.to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dq_step(dQ_i, Q_i, dO_i, L_i, D_i, K_head, V_head, stride_kn, stride_vn, start_n, rows,
             dims, Nq, Nk, d, qk_scale, ctx, E, drop, DB_head, Bc: tl.constexpr,
             IS_CAUSAL: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr,
             DOT_PREC: tl.constexpr, SCORE_MOD: tl.constexpr = None,
             MASK_MOD: tl.constexpr = None):
    """One K_j, V_j tile against the program's Q_i: dQ_i += dS_ij K_j (drop: dP_ij dropped
    by the forward's Z_ij, regenerated, D_i divided by the keep scale, which dQ_i takes at the
    end; SCORE_MOD and the visibility rule as
    above, rows the queries' positions as the forward's; DB_head: where a learned attn_mask's
    gradient dS_ij goes, or None: only in calls whose positions are their rows)."""
    cols = start_n + tl.arange(0, Bc)
    col_ok = cols[:, None] < Nk
    dim_ok = dims[None, :] < d
    K_j = load_tile(K_head + cols[:, None] * stride_kn + dims[None, :], col_ok, dim_ok,
                    MASK, not EVEN_D)
    V_j = load_tile(V_head + cols[:, None] * stride_vn + dims[None, :], col_ok, dim_ok,
                    MASK, not EVEN_D)
    S_ij = tl.dot(Q_i, tl.trans(K_j), input_precision=DOT_PREC)
    bias = ctx[4]  # SDPA's float attn_mask (mods.py), or None
    if SCORE_MOD is not None or bias is not None:
        S_ij, ds = mod_scores(S_ij, rows[:, None], cols[None, :], Nk, ctx, SCORE_MOD)
    P_ij = tl.math.exp2(S_ij * qk_scale - L_i[:, None])
    if MASK:
        P_ij = tl.where(visible(rows[:, None], cols[None, :], Nk, E, ctx, IS_CAUSAL, MASK_MOD),
                        P_ij, 0.0)
    dP_ij = tl.dot(dO_i, tl.trans(V_j), input_precision=DOT_PREC)
    if drop is not None:  # D_i came divided by the keep scale s: dS_ij is short of its s
        dP_ij = dropped(dP_ij, drop, drop[5], start_n)
    dS_ij = P_ij * (dP_ij - D_i[:, None])
    if DB_head is not None:  # a learned attn_mask: its gradient is dS_ij (the bias adds to s_ij)
        dS_full = dS_ij if drop is None else dS_ij * drop[4]
        tl.store(DB_head + rows[:, None] * Nk + cols[None, :], dS_full,
                 mask=(rows[:, None] < Nq) & (cols[None, :] < Nk))
    if SCORE_MOD is not None:
        dS_ij = dS_ij * ds
    dQ_i += tl.dot(dS_ij.to(K_j.dtype), K_j, input_precision=DOT_PREC)
    return dQ_i


@triton.jit
def _dq_program(i, b, h, Q, K, V, dO, L, D, dQ, LISTS, ELEM, scale, stride_q, stride_k, stride_v,
                stride_do, stride_dq, H, GROUP, Nq, Nk, d, RNG, dropout, bias, DBIAS,
                score_args, mask_args, SEQS, Br: tl.constexpr, Bc: tl.constexpr,
                HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, SCORE_MOD: tl.constexpr,
                MASK_MOD: tl.constexpr, ACCUMULATE: tl.constexpr):
    """dQ_i of one Q tile i (query head h): the K/V tiles stream past as in the forward."""
    rows_per_head = Nq
    q0, k0, base, Nq, Nk, diag = sequence(SEQS, b, H, Nq, Nk)  # tiles.py: packed sequences
    Q += q0 * stride_q[2]
    dO += q0 * stride_do[2]
    dQ += q0 * stride_dq[2]
    K += k0 * stride_k[2]
    V += k0 * stride_v[2]
    h_kv = h // GROUP
    rows = i * Br + tl.arange(0, Br)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows[:, None] < Nq
    dim_ok = dims[None, :] < d
    Q_i = load_tile(Q + b * stride_q[0] + h * stride_q[1] + rows[:, None] * stride_q[2]
                    + dims[None, :], row_ok, dim_ok, True, not EVEN_D)
    dO_i = load_tile(dO + b * stride_do[0] + h * stride_do[1] + rows[:, None] * stride_do[2]
                     + dims[None, :], row_ok, dim_ok, True, not EVEN_D)
    bh = b * H + h
    row0 = base + h * rows_per_head  # this head's first row in L and D
    L_i = tl.load(L + row0 + rows, mask=rows < Nq, other=float("inf"))
    D_i = tl.load(D + row0 + rows, mask=rows < Nq, other=0.0)
    K_head = K + b * stride_k[0] + h_kv * stride_k[1]
    V_head = V + b * stride_v[0] + h_kv * stride_v[1]
    dQ_i = tl.zeros([Br, HEAD_DIM], dtype=tl.float32)
    scale = tl.cast(scale, tl.float32)  # torch.compile may hand a float64 scalar
    qk_scale = exponent_scale(scale, bias, SCORE_MOD)
    ctx = (b, h, Nq, scale, bias, score_args, mask_args)  # what the mods read
    drop = None
    if RNG is not None:
        drop = dropout_state(RNG, bh, dropout, i * Br)
        D_i = D_i * keep_rate(drop)  # dS = s P (Z dP - D / s): s waits for dQ_i's end
    DB_head = None
    if DBIAS is not None:  # its gradient, (B, H, Nq, Nk) float32, zeros where no tile is visited
        DB_head = DBIAS + bh.to(tl.int64) * Nq * Nk
    # the K/V tiles this Q tile visits, exactly as in the forward
    num, num_full, u0, a0, na, b0, idx_row, e0 = kv_tiles(i, b, h, LISTS, ELEM, Nq, Nk, diag,
                                                          Br, Bc, IS_CAUSAL)
    pos = rows + diag  # the queries' positions against the keys, as in the forward
    for t in range(0, num_full):
        j = full_tile(t, u0, idx_row, LISTS)
        dQ_i = _dq_step(dQ_i, Q_i, dO_i, L_i, D_i, K_head, V_head, stride_k[2], stride_v[2],
                        j * Bc, pos, dims, Nq, Nk, d, qk_scale, ctx, None, drop, DB_head, Bc,
                        IS_CAUSAL, False, EVEN_D, DOT_PREC, SCORE_MOD, MASK_MOD)
    if MASKED:
        for t in range(num_full, num):
            j = masked_tile(t, num_full, a0, na, b0, idx_row, LISTS)
            E = None
            if ELEM is not None:  # a mask mod's partial tile: its element mask
                E = (element_origin(ELEM, e0, t, i * Br, j * Bc, Br, Bc), Bc)
            dQ_i = _dq_step(dQ_i, Q_i, dO_i, L_i, D_i, K_head, V_head, stride_k[2], stride_v[2],
                            j * Bc, pos, dims, Nq, Nk, d, qk_scale, ctx, E, drop, DB_head, Bc,
                            IS_CAUSAL, True, EVEN_D, DOT_PREC, SCORE_MOD, MASK_MOD)
    dQ_scale = scale if drop is None else scale * drop[4]  # the keep scale, left out above
    _put(dQ + b * stride_dq[0] + h * stride_dq[1] + rows[:, None] * stride_dq[2] + dims[None, :],
         dQ_i * dQ_scale, row_ok & dim_ok, ACCUMULATE)


@triton.jit
def backward_kernel(Q, K, V, dO, L, D, dQ, dK, dV, scale, stride_q, stride_k, stride_v,
                    stride_do, stride_dq, stride_dk, stride_dv, H, GROUP, Nq, Nk, d,
                    Q_LISTS, KV_LISTS, Q_ELEM, KV_ELEM, RNG, dropout, mod_args, DBIAS, SEQS,
                    DKDV: tl.constexpr, DQ: tl.constexpr, HEAD_DIM: tl.constexpr,
                    IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
                    SCORE_MOD: tl.constexpr = None, MASK_MOD: tl.constexpr = None,
                    ACCUMULATE: tl.constexpr = False):
    """The dK/dV programs and the dQ programs of each (batch, K/V head), in one launch, as
    FlexAttention's backward does, or each kind in its own launch with its own tiles and
    warps. DKDV, DQ: (Br, Bc, MASKED) of that kind's programs (its tiles, and whether some of
    them need a mask), or None where the launch has none. Programs [0, Tc) compute dK_j,
    dV_j; the GROUP * Tr after them dQ_i for the group's query heads. Strides, options and
    hooks as the forward's; DBIAS: where a learned attn_mask's gradient goes; SEQS: packed
    sequences (``tiles.sequence``; the program counts are the longest one's). ACCUMULATE: dQ,
    dK, dV are added to what the output buffers hold."""
    pid = tl.program_id(0)
    bh_kv = tl.program_id(1)
    Hkv = H // GROUP  # GROUP query heads share each K/V head (1: Triton compiles the 1 in)
    b = bh_kv // Hkv
    h_kv = bh_kv % Hkv
    DOT_PREC: tl.constexpr = "ieee" if Q.dtype.element_ty == tl.float32 else "tf32"
    bias, score_args, mask_args = mod_args  # as the forward's
    longest_q, longest_k = Nq, Nk
    if SEQS is not None:
        longest_q, longest_k = SEQS[2], SEQS[3]
    if DKDV is not None:
        Tc = tl.cdiv(longest_k, DKDV[1])
        # (a packed sequence's programs past its end do nothing: the grid fits the longest)
        if pid < Tc:
            if starts_inside(SEQS, b, pid * DKDV[1], 1):
                _dkdv_program(pid, b, h_kv, Q, K, V, dO, L, D, dK, dV, Q_LISTS, Q_ELEM, scale,
                              stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv, H,
                              GROUP, Nq, Nk, d, RNG, dropout, bias, score_args, mask_args, SEQS,
                              DKDV[0], DKDV[1], HEAD_DIM, IS_CAUSAL, DKDV[2], EVEN_D, DOT_PREC,
                              SCORE_MOD, MASK_MOD, ACCUMULATE)
        q_pid = pid - Tc
    else:
        q_pid = pid
    if DQ is not None:
        Tr = tl.cdiv(longest_q, DQ[0])
        if q_pid >= 0:
            if starts_inside(SEQS, b, (q_pid % Tr) * DQ[0], 0):
                _dq_program(q_pid % Tr, b, h_kv * GROUP + q_pid // Tr, Q, K, V, dO, L, D, dQ,
                            KV_LISTS, KV_ELEM, scale, stride_q, stride_k, stride_v, stride_do,
                            stride_dq, H, GROUP, Nq, Nk, d, RNG, dropout, bias, DBIAS,
                            score_args, mask_args, SEQS, DQ[0], DQ[1], HEAD_DIM, IS_CAUSAL,
                            DQ[2], EVEN_D, DOT_PREC, SCORE_MOD, MASK_MOD, ACCUMULATE)


def _preprocess_launch(o, do, D, rows, sink=None, dlse=None):
    """(grid, args, consts) of preprocess_kernel: (o, do, D) lead the arguments."""
    B, H, Nq, d = o.shape
    so, sd = o.stride(), do.stride()
    return ((-(-Nq // rows), B * H),
            (o, do, D, so[0], so[1], so[2], sd[0], sd[1], sd[2], H, Nq, d, sink, dlse),
            _preprocess_consts(rows, d))


@functools.lru_cache(maxsize=64)
def _preprocess_consts(rows, d):
    from .config import padded_head_dim

    return {"ROWS": rows, "HEAD_DIM": padded_head_dim(d)}


def fused(config, Nk: int) -> bool:
    """Whether the dK/dV and dQ programs of a backward with Nk keys share one launch."""
    return config.fused_backward and (config.split_from is None or Nk < config.split_from)


@functools.lru_cache(maxsize=1024)
def _launch_consts(Nq, Nk, d, is_causal, config, interpreted):
    """Each launch of backward_kernel: its constexprs and options, computed once per
    configuration: one launch with both kinds of program, or one launch each."""
    from . import sparse
    from .config import padded_head_dim

    t1, t2 = config.dkdv, config.dq
    HEAD_DIM = padded_head_dim(d)
    common = dict(HEAD_DIM=HEAD_DIM, IS_CAUSAL=is_causal, EVEN_D=HEAD_DIM == d)
    dkdv = (t1.Br, t1.Bc, sparse.needs_mask(is_causal, Nq, Nk, t1.Br, t1.Bc))
    dq = (t2.Br, t2.Bc, sparse.needs_mask(is_causal, Nq, Nk, t2.Br, t2.Bc))

    def part(tiles, DKDV, DQ):
        return {**common, "DKDV": DKDV, "DQ": DQ, **({} if interpreted else tiles.launch())}

    if fused(config, Nk):
        return (part(t1, dkdv, dq),)
    return part(t1, dkdv, None), part(t2, None, dq)


def _masked(kind, masked: bool):
    """A launch's (Br, Bc, MASKED) with MASKED also set where the mods need a masked loop."""
    return None if kind is None else (kind[0], kind[1], kind[2] or masked)


def _grid(consts, B, Hkv, Nq, Nk, GROUP):
    """(programs, B * Hkv): Tc dK/dV programs and GROUP * Tr dQ programs per K/V head."""
    programs = 0
    if consts["DKDV"] is not None:
        programs += -(-Nk // consts["DKDV"][1])
    if consts["DQ"] is not None:
        programs += GROUP * -(-Nq // consts["DQ"][0])
    return programs, B * Hkv


def launch_args(q, k, v, do, lse2, D, dq, dk, dv, *, is_causal, scale, block_mask, config,
                interpreted, dropout_p=0.0, rng=None, mods=None, dbias=None, accumulate=False,
                seqs=None):
    """(args, [(grid, consts)]) of backward_kernel: its arguments, led by (q, k, v, do, lse2,
    D, dq, dk, dv) and shared by its launches (one with both kinds of program, or one each:
    ``_launch_consts``), then each launch's grid and constants. The dropout, ``mods`` and
    packed sequences ``seqs`` as the forward's ``launch_args``; ``dbias``: where a learned
    attn_mask's gradient goes, or None; ``accumulate``: the kernels add to what dq, dk, dv
    hold."""
    from . import sparse

    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    hook_args, hooks, elements = mods_args(mods, block_mask, q, k)
    # the mods need the masked loops, and so do packed sequences (each may end inside a tile)
    masked = elements or hooks.get("MASK_MOD") is not None or seqs is not None
    t1, t2 = config.dkdv, config.dq
    q_lists = sparse.kernel_lists(block_mask, t1.Br, t1.Bc, True, q.device, is_causal)
    kv_lists = sparse.kernel_lists(block_mask, t2.Br, t2.Bc, False, q.device, is_causal)
    q_elem = element_args(elements, block_mask, t1.Br, t1.Bc, True, q.device, is_causal)
    kv_elem = element_args(elements, block_mask, t2.Br, t2.Bc, False, q.device, is_causal)
    args = (q, k, v, do, lse2, D, dq, dk, dv, scale,
            *row_strides(seqs, q, k, v, do, dq, dk, dv), H, H // Hkv, Nq, Nk, d, q_lists,
            kv_lists, q_elem, kv_elem, *dropout_args(dropout_p, rng), hook_args, dbias,
            sequences_arg(seqs))
    # programs per (batch, K/V head), as the lengths need them: for packed sequences, per
    # (sequence, K/V head), as the longest sequence needs them
    B, Nq, Nk = (B, Nq, Nk) if seqs is None else (len(seqs.cu_seqlens_q) - 1, seqs.max_seqlen_q,
                                                  seqs.max_seqlen_k)
    launches = []
    for consts in _launch_consts(Nq, Nk, d, is_causal, config, interpreted):
        consts = {**consts, **hooks, "ACCUMULATE": accumulate,
                  "DKDV": _masked(consts["DKDV"], masked), "DQ": _masked(consts["DQ"], masked)}
        launches.append((_grid(consts, B, Hkv, Nq, Nk, H // Hkv), consts))
    return args, launches
