"""Slower variants of the production kernels, kept only to be measured against them.

Notebook 10 times each one beside the kernel that ``flashedu.attention`` runs; nothing else
uses them. Each variant changes one thing, and what it does not change is the production code
itself (``load_tile``, ``_forward_step``, ``_store_output``, ``forward_launch``,
``preprocess``):

- ``natural_exp``: ``tl.exp`` of the scores times ``scale``, instead of ``exp2`` with
  ``scale * log2(e)`` folded in (forward.py's ``_softmax_step``).
- ``mask_every_tile``: one masked loop over every K/V tile, instead of an unmasked loop over
  the wholly visible tiles and a masked one over the rest.
- ``atomic_dq_backward``: dQ added into memory with atomics by the dK/dV programs, instead of
  its own Q-outer pass (backward.py's ``_dq_program``).

Dense and causal attention only (no block masks), pointer loads (no TMA).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .config import padded_head_dim
from .forward import _LOG2E, LOG2E, _forward_step, _store_output, forward_launch, load_tile
from .launch import dense_like, interpreter_fp32, preprocess
from .tiles import full_tile, kv_tiles, masked_tile

# --- forward: natural exp, and one masked loop ---------------------------------------------


@triton.jit
def _softmax_step_exp(O_i, l_i, m_i, Q_i, K_j, V_j, cols, rows, Nk, scale,
                      IS_CAUSAL: tl.constexpr, MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    """forward.py's ``_softmax_step`` with tl.exp and natural-log m_i (``scale``, not
    ``scale * log2(e)``). The GPU has no exp instruction: tl.exp becomes ex2(x * log2(e)),
    one more multiply per score."""
    S_ij = tl.dot(Q_i, tl.trans(K_j), input_precision=DOT_PREC)
    if MASK:
        visible = cols[None, :] < Nk
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        S_ij = tl.where(visible, S_ij, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(S_ij, 1) * scale)
    if MASK:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    P_ij = tl.exp(S_ij * scale - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(P_ij, 1)
    O_i = tl.dot(P_ij.to(V_j.dtype), V_j, O_i * alpha[:, None], input_precision=DOT_PREC)
    return O_i, l_i, m_new


@triton.jit
def _step(O_i, l_i, m_i, Q_i, K_head, V_head, stride_kn, stride_vn, start_n, rows, dims, Nk, d,
          qk_scale, ctx, Bc: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK: tl.constexpr,
          EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, NATURAL_EXP: tl.constexpr):
    """The production ``_forward_step``, or its loads followed by the natural-exp softmax."""
    if NATURAL_EXP:
        cols = start_n + tl.arange(0, Bc)
        row_ok = cols[:, None] < Nk
        dim_ok = dims[None, :] < d
        K_j = load_tile(K_head + cols[:, None] * stride_kn + dims[None, :], row_ok, dim_ok,
                        MASK, not EVEN_D)
        V_j = load_tile(V_head + cols[:, None] * stride_vn + dims[None, :], row_ok, dim_ok,
                        MASK, not EVEN_D)
        O_i, l_i, m_i = _softmax_step_exp(O_i, l_i, m_i, Q_i, K_j, V_j, cols, rows, Nk,
                                          qk_scale, IS_CAUSAL, MASK, DOT_PREC)
    else:
        O_i, l_i, m_i = _forward_step(O_i, l_i, m_i, Q_i, K_head, V_head, stride_kn, stride_vn,
                                      start_n, rows, dims, Nk, d, qk_scale, ctx, None, None, Bc,
                                      IS_CAUSAL, MASK, EVEN_D, DOT_PREC)
    return O_i, l_i, m_i


@triton.jit
def forward_variant_kernel(Q, K, V, O, L, scale, stride_q, stride_k, stride_v, stride_o, H,
                           GROUP, Nq, Nk, d, LISTS, ELEM, Br: tl.constexpr, Bc: tl.constexpr,
                           HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
                           MASKED: tl.constexpr, EVEN_D: tl.constexpr,
                           NATURAL_EXP: tl.constexpr, MASK_EVERY_TILE: tl.constexpr):
    """forward_kernel's dense path (its arguments up to ELEM) with the two switches. Both
    False: the production kernel's code, step for step."""
    tl.static_assert(LISTS is None, "the variants run dense and causal attention only")
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    DOT_PREC: tl.constexpr = "ieee" if Q.dtype.element_ty == tl.float32 else "tf32"
    rows = i * Br + tl.arange(0, Br)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows[:, None] < Nq
    dim_ok = dims[None, :] < d
    Q_i = load_tile(Q + b * stride_q[0] + h * stride_q[1] + rows[:, None] * stride_q[2]
                    + dims[None, :], row_ok, dim_ok, True, not EVEN_D)
    K_head = K + b * stride_k[0] + (h // GROUP) * stride_k[1]
    V_head = V + b * stride_v[0] + (h // GROUP) * stride_v[1]
    scale = tl.cast(scale, tl.float32)
    if NATURAL_EXP:  # the scale itself: the scores stay in natural units
        qk_scale = scale
    else:
        qk_scale = scale * _LOG2E
    ctx = (b, h, Nq, scale, None, None, None)  # no mods here
    m_i = tl.full([Br], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([Br], dtype=tl.float32)
    O_i = tl.zeros([Br, HEAD_DIM], dtype=tl.float32)
    num, num_full, u0, a0, na, b0, idx_row, e0 = kv_tiles(i, b, h, LISTS, ELEM, Nq, Nk, 0, Br,
                                                          Bc, IS_CAUSAL)
    if MASK_EVERY_TILE:  # no unmasked run: every tile pays for the mask
        num_full = 0
        a0 = 0
        na = num
    for t in range(0, num_full):
        j = full_tile(t, u0, idx_row, LISTS)
        O_i, l_i, m_i = _step(O_i, l_i, m_i, Q_i, K_head, V_head, stride_k[2], stride_v[2],
                              j * Bc, rows, dims, Nk, d, qk_scale, ctx, Bc, IS_CAUSAL, False,
                              EVEN_D, DOT_PREC, NATURAL_EXP)
    if MASKED or MASK_EVERY_TILE:
        for t in range(num_full, num):
            j = masked_tile(t, num_full, a0, na, b0, idx_row, LISTS)
            O_i, l_i, m_i = _step(O_i, l_i, m_i, Q_i, K_head, V_head, stride_k[2], stride_v[2],
                                  j * Bc, rows, dims, Nk, d, qk_scale, ctx, Bc, IS_CAUSAL, True,
                                  EVEN_D, DOT_PREC, NATURAL_EXP)
    if NATURAL_EXP:  # m_i in natural-log units: L_i = m_i + ln(l_i), stored in base 2
        m_i = m_i * 1.4426950408889634
    _store_output(O_i, l_i, m_i, O, L, b, h, bh * Nq, rows, dims, row_ok, dim_ok, Nq,
                  stride_o)


def forward(q, k, v, *, is_causal, scale, tiles, interpreted, natural_exp=False,
            mask_every_tile=False):
    """(O, L2) as ``launch.forward`` returns them, computed by a variant (both switches False:
    the production code). Launched by the production launch code; TMA is not used."""
    q32, k32, v32 = interpreter_fp32(interpreted, q, k, v)
    o = dense_like(q32)
    lse2 = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    grid, args, consts = forward_launch(q32, k32, v32, o, lse2, is_causal=is_causal,
                                        scale=scale, block_mask=None, tiles=tiles,
                                        interpreted=interpreted)
    forward_variant_kernel[grid](*args, **consts, NATURAL_EXP=natural_exp,
                                 MASK_EVERY_TILE=mask_every_tile)
    return o.to(q.dtype), lse2


# --- backward: dQ by atomics ----------------------------------------------------------------


@triton.jit
def _dkdv_atomic_step(dK_j, dV_j, K_j, V_j, Q_head, dO_head, L_head, D_head, dQ_head, start_m,
                      cols, dims, Nq, d, qk_scale, scale, stride_qn, stride_dn, stride_dqn,
                      Br: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK: tl.constexpr,
                      EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """backward.py's ``_dkdv_step``, line for line, plus the last two: dS_ij K_j into dQ_i."""
    rows = start_m + tl.arange(0, Br)
    row_ok = rows[:, None] < Nq
    dim_ok = dims[None, :] < d
    Q_i = load_tile(Q_head + rows[:, None] * stride_qn + dims[None, :], row_ok, dim_ok,
                    MASK, not EVEN_D)
    dO_i = load_tile(dO_head + rows[:, None] * stride_dn + dims[None, :], row_ok, dim_ok,
                     MASK, not EVEN_D)
    if MASK:
        L_i = tl.load(L_head + rows, mask=rows < Nq, other=float("inf"))
        D_i = tl.load(D_head + rows, mask=rows < Nq, other=0.0)
    else:
        L_i = tl.load(L_head + rows)
        D_i = tl.load(D_head + rows)
    S_ijT = tl.dot(K_j, tl.trans(Q_i), input_precision=DOT_PREC) * qk_scale
    P_ijT = tl.math.exp2(S_ijT - L_i[None, :])
    if MASK:
        if IS_CAUSAL:
            P_ijT = tl.where(cols[:, None] <= rows[None, :], P_ijT, 0.0)
    dV_j += tl.dot(P_ijT.to(dO_i.dtype), dO_i, input_precision=DOT_PREC)
    dP_ijT = tl.dot(V_j, tl.trans(dO_i), input_precision=DOT_PREC)
    dS_ijT = P_ijT * (dP_ijT - D_i[None, :])
    dK_j += tl.dot(dS_ijT.to(Q_i.dtype), Q_i, input_precision=DOT_PREC)
    dQ_part = tl.dot(tl.trans(dS_ijT).to(K_j.dtype), K_j, input_precision=DOT_PREC)
    tl.atomic_add(dQ_head + rows[:, None] * stride_dqn + dims[None, :], dQ_part * scale,
                  mask=row_ok & dim_ok)  # many programs add into the same dQ_i
    return dK_j, dV_j


@triton.jit
def dkdv_atomic_kernel(Q, K, V, dO, L, D, dQ, dK, dV, qk_scale, scale,
                       stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                       stride_db, stride_dh, stride_dn, stride_dqb, stride_dqh, stride_dqn,
                       H, GROUP, Nq, Nk, d,
                       Br: tl.constexpr, Bc: tl.constexpr, HEAD_DIM: tl.constexpr,
                       IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """_dkdv_program's dense loops (K, V, dK, dV share strides here), with the atomic step."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    j = tl.program_id(0)
    b = tl.program_id(1) // (H // GROUP)
    h_kv = tl.program_id(1) % (H // GROUP)
    cols = j * Bc + tl.arange(0, Bc)
    dims = tl.arange(0, HEAD_DIM)
    kv = b * stride_kb + h_kv * stride_kh + cols[:, None] * stride_kn + dims[None, :]
    col_ok = cols[:, None] < Nk
    dim_ok = dims[None, :] < d
    K_j = load_tile(K + kv, col_ok, dim_ok, True, not EVEN_D)
    V_j = load_tile(V + kv, col_ok, dim_ok, True, not EVEN_D)
    dK_j = tl.zeros([Bc, HEAD_DIM], dtype=tl.float32)
    dV_j = tl.zeros([Bc, HEAD_DIM], dtype=tl.float32)
    full_end = Nq // Br * Br  # as _dkdv_program: diagonal (masked), full, ragged (masked)
    if IS_CAUSAL:
        lo = (j * Bc) // Br * Br
        diag_end = tl.minimum(tl.cdiv(j * Bc + Bc - 1, Br) * Br, tl.cdiv(Nq, Br) * Br)
    else:
        lo = 0
        diag_end = 0
    for g in range(0, GROUP):
        h = h_kv * GROUP + g
        Q_head = Q + b * stride_qb + h * stride_qh
        dO_head = dO + b * stride_db + h * stride_dh
        dQ_head = dQ + b * stride_dqb + h * stride_dqh
        L_head = L + (b * H + h) * Nq
        D_head = D + (b * H + h) * Nq
        for start_m in range(lo, diag_end, Br):
            dK_j, dV_j = _dkdv_atomic_step(dK_j, dV_j, K_j, V_j, Q_head, dO_head, L_head, D_head,
                                           dQ_head, start_m, cols, dims, Nq, d, qk_scale, scale,
                                           stride_qn, stride_dn, stride_dqn, Br, IS_CAUSAL,
                                           True, EVEN_D, DOT_PREC)
        for start_m in range(diag_end, full_end, Br):
            dK_j, dV_j = _dkdv_atomic_step(dK_j, dV_j, K_j, V_j, Q_head, dO_head, L_head, D_head,
                                           dQ_head, start_m, cols, dims, Nq, d, qk_scale, scale,
                                           stride_qn, stride_dn, stride_dqn, Br, IS_CAUSAL,
                                           False, EVEN_D, DOT_PREC)
        for start_m in range(tl.maximum(diag_end, full_end), Nq, Br):
            dK_j, dV_j = _dkdv_atomic_step(dK_j, dV_j, K_j, V_j, Q_head, dO_head, L_head, D_head,
                                           dQ_head, start_m, cols, dims, Nq, d, qk_scale, scale,
                                           stride_qn, stride_dn, stride_dqn, Br, IS_CAUSAL,
                                           True, EVEN_D, DOT_PREC)
    tl.store(dK + kv, (dK_j * scale).to(dK.dtype.element_ty), mask=col_ok & dim_ok)
    tl.store(dV + kv, dV_j.to(dV.dtype.element_ty), mask=col_ok & dim_ok)


def atomic_dq_backward(q, k, v, o, lse2, do, *, is_causal, scale, config, interpreted):
    """(dQ, dK, dV) as ``launch.backward`` returns them, with no dQ pass: the dK/dV programs
    (the config's ``dkdv`` tiles) add into a float32 dQ with atomics. The summation order
    changes from run to run, so dQ may differ in its last bits between two runs."""
    tiles = config.backward_entry(is_causal, False, None, k.shape[2]).dkdv
    dtype = q.dtype
    q, k, v, o, do = interpreter_fp32(interpreted, q, k, v, o, do)
    k, v = k.contiguous(), v.contiguous()  # dK, dV are written with K's strides
    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    HEAD_DIM = padded_head_dim(d)
    D = preprocess(o, do, config.preprocess_rows)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dkdv_atomic_kernel[(math.ceil(Nk / tiles.Bc), B * Hkv)](
        q, k, v, do, lse2, D, dq, dk, dv, scale * LOG2E, scale, *q.stride()[:3],
        *k.stride()[:3], *do.stride()[:3], *dq.stride()[:3], H, H // Hkv, Nq, Nk, d,
        Br=tiles.Br, Bc=tiles.Bc, HEAD_DIM=HEAD_DIM, IS_CAUSAL=is_causal, EVEN_D=HEAD_DIM == d,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        **({} if interpreted else tiles.launch()))
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)
