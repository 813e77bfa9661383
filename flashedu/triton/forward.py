"""FlashAttention-2 forward in Triton: one program per (Q tile i, batch*head).

The program is the inner body of ``flashedu.tiled._forward_q_outer`` for one i: Q_i stays in
registers while the K_j, V_j tiles stream past, the online softmax keeps m_i and l_i, and O_i is
written once at the end with the logsumexp L_i for the backward.

Three changes from the NumPy loop, all for speed (notebook 10 measures each against the
variants of ``ablations.py``):
- exp2 instead of exp: the scores are multiplied by scale * log2(e) once, so that
  exp(scale * s - m) becomes exp2(s' - m') (the GPU's ex2 instruction, no extra multiply).
  m_i and L_i are kept in that base-2 scale; L_i is converted back for users.
- masks only where needed: tiles wholly inside the visible region run without any mask; only
  the causal diagonal tiles and the ragged edge tile (Nk not a multiple of Bc) pay for one.
  Dense, causal and block-sparse walk their tiles through one iterator (tiles.py) that hands
  out the unmasked tiles first, then the masked ones.
- on Hopper, where the tile table asks for it: K_j, V_j fetched by the copy engine (TMA)
  through tensor descriptors, and the dense loop warp-specialized (loaders and computers).
  Where Triton cannot build that, the pointer version runs instead.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .dropout import keep_tile, rng_state
from .mods import element_ptr, element_start, element_tile, head_mods, in_band, mod_scores
from .tiles import full_tile, kv_tiles, masked_tile

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))


@triton.jit
def load_tile(ptrs, row_ok, col_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A 2-D load, masked only along the axes that may run past the tensor (zeros there)."""
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptrs, mask=row_ok & col_ok, other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok, other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptrs, mask=col_ok, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _softmax_step(O_i, l_i, m_i, Q_i, K_j, V_j, cols, rows, Nk, qk_scale,
                  IS_CAUSAL: tl.constexpr, MASK: tl.constexpr, DOT_PREC: tl.constexpr,
                  DROPOUT: tl.constexpr = False, seed=0, offset=0, bh=0, start_n=0, drop_t=0,
                  E_tile=0, mod_scale=1.0, cap=1.0, slope=0.0, B_head=0,
                  stride_bq=0, stride_bk=0, Nq=0, ELEMENT: tl.constexpr = False,
                  SCORE_MOD: tl.constexpr = 0, BIAS: tl.constexpr = False, band_lo=0, band_hi=0,
                  BAND: tl.constexpr = False):
    """One K_j, V_j tile: S_ij, the online-softmax update of (m_i, l_i), and O_i += P_ij V_j.

    qk_scale is scale * log2(e), so exp2(S_ij * qk_scale) = exp(scale * S_ij): the paper's exp,
    computed by the GPU's ex2 instruction. m_i is kept in that base-2 scale.
    DROPOUT (the paper's Algorithm 2): P_ij times Z_ij after l_i took the undropped P_ij,
    before the product with V_j; Z_ij from (seed, offset, bh) and the tile's position. The
    1 / (1 - p) is the same for every entry: the kernel applies it once, to O_i at the end.
    SCORE_MOD, BIAS (mods.py): S_ij becomes score_mod(scale * S_ij) + attn_mask, and qk_scale
    is log2(e). ELEMENT: a masked tile also applies its element mask (a mask mod's partial
    tile); BAND: the sliding window's rule instead, compiled: band_lo < key - query <= band_hi
    (mods.py)."""
    S_ij = tl.dot(Q_i, tl.trans(K_j), input_precision=DOT_PREC)  # unscaled scores, Br x Bc
    if SCORE_MOD != 0 or BIAS:
        S_ij, _ = mod_scores(S_ij, rows[:, None], cols[None, :], Nq, Nk, mod_scale, cap, slope,
                             B_head, stride_bq, stride_bk, SCORE_MOD, BIAS)
    if MASK:  # keys past Nk, and (causal) keys after the query, get -inf: P_ij = 0 there
        visible = cols[None, :] < Nk
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        if ELEMENT:
            visible = visible & element_tile(E_tile, rows.shape[0], cols.shape[0], False)
        if BAND:
            visible = visible & in_band(rows[:, None], cols[None, :], band_lo, band_hi)
        S_ij = tl.where(visible, S_ij, float("-inf"))
    # qk_scale > 0, so scaling commutes with the max: one multiply per row, not per score
    m_new = tl.maximum(m_i, tl.max(S_ij, 1) * qk_scale)
    if MASK or BIAS:  # a row that has seen no key yet keeps m = -inf: subtract 0 (no NaN)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    P_ij = tl.math.exp2(S_ij * qk_scale - m_use[:, None])  # one fused multiply-add, one ex2
    alpha = tl.math.exp2(m_i - m_use)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(P_ij, 1)
    if DROPOUT:
        keep = keep_tile(seed, offset, bh, rows, start_n, drop_t, cols.shape[0])
        P_ij = tl.where(keep, P_ij, 0.0)
    # the rescaled O_i is the product's accumulator: the tensor cores add P_ij V_j into it
    O_i = tl.dot(P_ij.to(V_j.dtype), V_j, O_i * alpha[:, None], input_precision=DOT_PREC)
    return O_i, l_i, m_new


@triton.jit
def _forward_step(O_i, l_i, m_i, Q_i, K_src, V_src, stride_kn, stride_vn, start_n, rows, dims,
                  Nk, d, qk_scale, Bc: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK: tl.constexpr,
                  EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr = False,
                  DROPOUT: tl.constexpr = False, seed=0, offset=0, bh=0, drop_t=0,
                  E_tile=0, mod_scale=1.0, cap=1.0, slope=0.0, B_head=0,
                  stride_bq=0, stride_bk=0, Nq=0, ELEMENT: tl.constexpr = False,
                  SCORE_MOD: tl.constexpr = 0, BIAS: tl.constexpr = False, band_lo=0, band_hi=0,
                  BAND: tl.constexpr = False):
    """Load K_j, V_j (rows start_n ..), then the softmax step (with dropout if DROPOUT).

    K_src, V_src: this head's K and V, as pointers, or (TMA) as tensor descriptors: the copy
    engine then fetches each tile with one instruction, no address arithmetic, and rows past
    Nk or dims past d arrive as zeros. Pointer loads are masked only where the tile may run
    past the tensor."""
    cols = start_n + tl.arange(0, Bc)
    if TMA:
        K_j = K_src.load([start_n, 0])
        V_j = V_src.load([start_n, 0])
    else:
        row_ok = cols[:, None] < Nk
        dim_ok = dims[None, :] < d
        K_j = load_tile(K_src + cols[:, None] * stride_kn + dims[None, :], row_ok, dim_ok,
                        MASK, not EVEN_D)
        V_j = load_tile(V_src + cols[:, None] * stride_vn + dims[None, :], row_ok, dim_ok,
                        MASK, not EVEN_D)
    return _softmax_step(O_i, l_i, m_i, Q_i, K_j, V_j, cols, rows, Nk, qk_scale, IS_CAUSAL,
                         MASK, DOT_PREC, DROPOUT, seed, offset, bh, start_n, drop_t, E_tile,
                         mod_scale, cap, slope, B_head, stride_bq, stride_bk, Nq, ELEMENT,
                         SCORE_MOD, BIAS, band_lo, band_hi, BAND)


@triton.jit
def _initial_state(O, L, b, h, bh, rows, dims, row_ok, dim_ok, Nq, stride_ob, stride_oh,
                   stride_on, Br: tl.constexpr, HEAD_DIM: tl.constexpr, RESUME: tl.constexpr):
    """(m_i, l_i, O_i) before the first K/V tile: nothing seen (-inf, 0, 0), or, RESUME, the
    result over earlier keys read back from O and L, so that the online softmax goes on from
    it. That result is O = sum e^(S - L) V with sum e^(S - L) = 1, which is the state
    m_i = L_i, l_i = 1, O_i = O: the kernel then writes the merge of old and new keys (the
    rule of ``flashedu.merge``) without a separate merge pass. L = +inf marks a row that has
    seen no key (its O is 0)."""
    if RESUME:
        L_prev = tl.load(L + bh * Nq + rows, mask=rows < Nq, other=float("inf"))
        seen = L_prev != float("inf")
        m_i = tl.where(seen, L_prev, float("-inf"))
        l_i = tl.where(seen, 1.0, 0.0)
        O_i = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on
                      + dims[None, :], mask=row_ok & dim_ok, other=0.0).to(tl.float32)
    else:
        m_i = tl.full([Br], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([Br], dtype=tl.float32)
        O_i = tl.zeros([Br, HEAD_DIM], dtype=tl.float32)
    return m_i, l_i, O_i


@triton.jit
def _store_output(O_i, l_i, m_i, O, L, b, h, bh, rows, dims, row_ok, dim_ok, Nq,
                  stride_ob, stride_oh, stride_on):
    """O_i / l_i and L_i = m_i + log2(l_i), stored. A row that saw no key (l_i = 0) gets O = 0
    and L = +inf, so that the backward's P = exp2(S - L) is 0 there: zero gradients, no NaN.
    A row of NaN scores (l_i NaN) keeps NaN in both: it saw keys, whose values are unknown."""
    seen = l_i != 0
    O_i = O_i / tl.where(seen, l_i, 1.0)[:, None]
    L_i = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    tl.store(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + dims[None, :],
             O_i.to(O.dtype.element_ty), mask=row_ok & dim_ok)
    tl.store(L + bh * Nq + rows, L_i, mask=rows < Nq)


@triton.jit
def forward_kernel(Q, K, V, O, L, KV_NUM, KV_FULL, KV_IDX, qk_scale,
                   stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn,
                   stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxr,
                   H, GROUP, Nq, Nk, d, RNG, drop_t, drop_scale,
                   ELEM, ELEM_BASE, SLOPES, mod_scale, cap,
                   BIAS_PTR, stride_bb, stride_bh, stride_bq, stride_bk, band_lo, band_hi,
                   Br: tl.constexpr, Bc: tl.constexpr, HEAD_DIM: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, SPARSE: tl.constexpr, MASKED: tl.constexpr,
                   EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
                   TMA: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False,
                   DROPOUT: tl.constexpr = False, ELEMENT: tl.constexpr = False,
                   SCORE_MOD: tl.constexpr = 0, BIAS: tl.constexpr = False,
                   RESUME: tl.constexpr = False, BAND: tl.constexpr = False):
    qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile may hand a float64 scalar
    i = tl.program_id(0)  # which Q tile
    bh = tl.program_id(1)  # which (batch, query head)
    b = bh // H
    h = bh % H
    h_kv = h // GROUP  # grouped-query attention: heads h_kv*GROUP .. share one K/V head
    rows = i * Br + tl.arange(0, Br)
    dims = tl.arange(0, HEAD_DIM)  # padded to a power of two; dims >= d are masked off
    row_ok = rows[:, None] < Nq
    dim_ok = dims[None, :] < d
    Q_i = load_tile(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + dims[None, :],
                    row_ok, dim_ok, True, not EVEN_D)
    K_head = K + b * stride_kb + h_kv * stride_kh
    V_head = V + b * stride_vb + h_kv * stride_vh
    if TMA:  # descriptors of this head's K and V: Nk x d, fetched Bc x HEAD_DIM at a time
        K_src = tl.make_tensor_descriptor(K_head, [Nk, d], [stride_kn, 1], [Bc, HEAD_DIM])
        V_src = tl.make_tensor_descriptor(V_head, [Nk, d], [stride_vn, 1], [Bc, HEAD_DIM])
    else:
        K_src = K_head
        V_src = V_head

    seed, offset, drop_scale = rng_state(RNG, drop_scale, DROPOUT)
    mod_scale = tl.cast(mod_scale, tl.float32)
    cap = tl.cast(cap, tl.float32)
    slope, B_head = head_mods(SLOPES, BIAS_PTR, b, h, stride_bb, stride_bh, SCORE_MOD, BIAS)
    # O has Q's strides (forward_launch)
    m_i, l_i, O_i = _initial_state(O, L, b, h, bh, rows, dims, row_ok, dim_ok, Nq, stride_qb,
                                   stride_qh, stride_qn, Br, HEAD_DIM, RESUME)
    # The K/V tiles this Q tile visits (tiles.py): num_full without an element mask, then the
    # causal diagonal and the ragged edge, from a block mask's lists or from the geometry.
    num, num_full, u0, a0, na, b0, idx_row = kv_tiles(
        i, b, h, KV_NUM, KV_FULL, KV_IDX, stride_numb, stride_numh, stride_idxb, stride_idxh,
        stride_idxr, Nq, Nk, Br, Bc, IS_CAUSAL, SPARSE)
    # Warp specialization (where Triton has it for this GPU): some warps only issue the
    # copies, the others only compute, so that loads and the softmax overlap.
    for t in tl.range(0, num_full, warp_specialize=WARP_SPECIALIZE):
        j = full_tile(t, u0, idx_row, SPARSE)
        O_i, l_i, m_i = _forward_step(O_i, l_i, m_i, Q_i, K_src, V_src, stride_kn, stride_vn,
                                      j * Bc, rows, dims, Nk, d, qk_scale, Bc, IS_CAUSAL, False,
                                      EVEN_D, DOT_PREC, TMA, DROPOUT, seed, offset, bh, drop_t,
                                      0, mod_scale, cap, slope, B_head, stride_bq, stride_bk, Nq,
                                      False, SCORE_MOD, BIAS)
    if MASKED:  # only where some tile can need a mask (an empty loop measured slower)
        # a mask mod's partial tiles: their element masks, this row's from e0 + num_full on
        e0 = element_start(ELEM_BASE, b, h, i, stride_numb, stride_numh, num_full, ELEMENT)
        for t in range(num_full, num):
            j = masked_tile(t, num_full, a0, na, b0, idx_row, SPARSE)
            E_tile = element_ptr(ELEM, e0, t, Br * Bc, ELEMENT)
            O_i, l_i, m_i = _forward_step(O_i, l_i, m_i, Q_i, K_src, V_src, stride_kn,
                                          stride_vn, j * Bc, rows, dims, Nk, d, qk_scale, Bc,
                                          IS_CAUSAL, True, EVEN_D, DOT_PREC, TMA, DROPOUT, seed,
                                          offset, bh, drop_t, E_tile, mod_scale, cap, slope,
                                          B_head, stride_bq, stride_bk, Nq, ELEMENT, SCORE_MOD,
                                          BIAS, band_lo, band_hi, BAND)
    if DROPOUT:  # Algorithm 2's 1 / (1 - p), once per row instead of once per entry of P_ij
        O_i = O_i * drop_scale
    _store_output(O_i, l_i, m_i, O, L, b, h, bh, rows, dims, row_ok, dim_ok, Nq,
                  stride_qb, stride_qh, stride_qn)


def dot_precision(dtype) -> str:
    """fp32 inputs: exact fp32 products (tf32 would miss the tolerance); 16-bit: the default."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


def interpreter_fp32(interpreted: bool, *tensors):
    """The tensors a launch should use: under Triton's interpreter, 16-bit inputs as float32
    (its 16-bit tl.dot gives wrong results), so the caller casts the outputs back; compiled
    on a GPU, the tensors themselves."""
    import torch

    if not interpreted:
        return tensors
    return tuple(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
                 for t in tensors)


# The block-sparse lists and their strides of a dense launch: None, which Triton compiles as
# a constant (the SPARSE branches that would read them are not compiled at all).
NO_LISTS = (None, None, None, (None,) * 5)


@functools.lru_cache(maxsize=1024)
def _launch_consts(Nq, Nk, d, dtype, is_causal, sparse_, tiles, interpreted):
    """The constexprs and launch options of forward_kernel: computed once per configuration."""
    from . import sparse
    from .config import padded_head_dim

    HEAD_DIM = padded_head_dim(d)
    return dict(Br=tiles.Br, Bc=tiles.Bc, HEAD_DIM=HEAD_DIM, IS_CAUSAL=is_causal,
                SPARSE=sparse_,
                MASKED=sparse.needs_mask(is_causal, Nq, Nk, tiles.Br, tiles.Bc),
                EVEN_D=HEAD_DIM == d, DOT_PREC=dot_precision(dtype),
                **({} if interpreted else tiles.launch()))


def forward_launch(q, k, v, o, lse2, *, is_causal, qk_scale, block_mask, tiles, interpreted):
    """(grid, args, consts) of forward_kernel for these tensors: shared with the variants of
    ``ablations.py``, whose kernels take the same arguments. ``o`` must have q's strides."""
    from . import sparse

    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if block_mask is None:
        num, full, idx, idx_strides = NO_LISTS
    else:
        num, full, idx, idx_strides = sparse.kernel_lists(block_mask, tiles.Br, tiles.Bc, False,
                                                           q.device, is_causal)
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    args = (q, k, v, o, lse2, num, full, idx, qk_scale, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2],
            sv[0], sv[1], sv[2], *idx_strides, H, H // Hkv, Nq, Nk, d)
    consts = dict(_launch_consts(Nq, Nk, d, q.dtype, is_causal, block_mask is not None, tiles,
                                 interpreted))
    return (-(-Nq // tiles.Br), B * H), args, consts


def outputs_like(*tensors):
    """Empty tensors with the strides of ``tensors`` (the kernels write each output with its
    input's strides); inputs whose memory overlaps or has gaps are copied to contiguous first."""
    import torch

    outs = [torch.empty_like(t) for t in tensors]
    if all(o.stride() == t.stride() for o, t in zip(outs, tensors)):
        return tensors, outs
    tensors = tuple(t.contiguous() for t in tensors)
    return tensors, [torch.empty_like(t) for t in tensors]


_SHRUNK: dict = {}  # tiles whose launch ran out of resources -> the tiles that fit


def dropout_args(dropout_p, rng):
    """(RNG, drop_t, drop_scale) of the kernels: the [seed, offset] tensor, the keep threshold
    round(p * 2**31) and 1 / (1 - p); (None, 0, 1.0) without dropout (DROPOUT=False: unused)."""
    if dropout_p == 0:
        return None, 0, 1.0
    from ..dropout import threshold

    return rng, threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def element_args(mods, block_mask, Br, Bc, transpose, device, is_causal, compiled):
    """(ELEM, ELEM_BASE): the partial tiles' element masks of lists with Br x Bc tiles, or
    (None, None) when no mask mod needs them (none, or one the kernels compile: ``compiled``,
    the launch's BAND, from ``mods.band_args``)."""
    from . import sparse

    if mods is None or mods.mask_mod is None or compiled:
        return None, None
    return sparse.element_lists(block_mask, Br, Bc, transpose, device, is_causal)


def mods_args(mods, block_mask, scale, Br, Bc, transpose, q, k, is_causal):
    """((ELEM, ELEM_BASE, SLOPES, mod_scale, cap, BIAS_PTR, 4 bias strides, band_lo, band_hi),
    {ELEMENT, SCORE_MOD, BIAS, BAND}) of a launch whose tiles are Br x Bc (``transpose``: the
    dK/dV pass's lists); unused ones without mods."""
    from .mods import band_args, bias_args, score_mod_args

    SCORE_MOD, mod_scale, cap, SLOPES = score_mod_args(mods and mods.score_mod, scale, q.device)
    band = band_args(mods, block_mask)
    E, E_base = element_args(mods, block_mask, Br, Bc, transpose, q.device, is_causal,
                             band is not None)
    attn_mask = mods and mods.attn_mask
    bias = bias_args(attn_mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return ((E, E_base, SLOPES, mod_scale, cap, *bias, *(band or (0, 0))),
            {"ELEMENT": E is not None, "SCORE_MOD": SCORE_MOD, "BIAS": attn_mask is not None,
             "BAND": band is not None})


def launch_args(q, k, v, o, lse2, *, is_causal, scale, block_mask, tiles, interpreted,
                dropout_p=0.0, rng=None, mods=None):
    """(grid, args, consts) of forward_kernel: ``forward_launch``'s, then the dropout and mods
    arguments (unused ones, compiled out, for a plain call). ``scale`` is the softmax scale;
    the kernel's qk_scale follows from it (log2(e) alone where a score mod or bias works in
    natural units)."""
    mod_args, mod_consts = mods_args(mods, block_mask, scale, tiles.Br, tiles.Bc, False, q, k,
                                     is_causal)
    natural = mod_consts["SCORE_MOD"] or mod_consts["BIAS"]
    grid, args, consts = forward_launch(q, k, v, o, lse2, is_causal=is_causal,
                                        qk_scale=LOG2E if natural else scale * LOG2E,
                                        block_mask=block_mask, tiles=tiles,
                                        interpreted=interpreted)
    args = (*args, *dropout_args(dropout_p, rng), *mod_args)
    consts = {**consts, "DROPOUT": dropout_p > 0, **mod_consts,
              "MASKED": consts["MASKED"] or mod_consts["ELEMENT"] or mod_consts["BAND"]}
    return grid, args, register_cap(consts)


def register_cap(consts: dict) -> dict:
    """The launch's constants without the tile table's register cap where dropout is on: the
    cap (maxnreg) was measured on the plain kernels, and dropout's Philox states need more
    (213 registers at d=64 uncapped), which the cap would turn into spills."""
    if consts.get("DROPOUT") and "maxnreg" in consts:
        consts = {n: c for n, c in consts.items() if n != "maxnreg"}
    return consts


def forward(q, k, v, *, is_causal, scale, block_mask, tiles, interpreted, dropout_p=0.0,
            rng=None, mods=None, keep=None):
    """Launch the forward. Returns (O, L2): L2 is the base-2 logsumexp (B, H, Nq), float32,
    of the base-2 scores scale*log2(e)*q.k; +inf for a row that sees no key.
    ``dropout_p`` > 0: dropout with rng = tensor([seed, offset]) on q's device (RNG state of
    ``flashedu.dropout``); L2 is still that of the undropped scores.
    ``mods`` (``flashedu.ops.Mods``): a library score mod, compiled in (L2 is then that of the
    modded scores), and the block mask's mask mod on its partial tiles.
    ``keep``: a list; the call's launch plan (``fast.Launch``) is appended to it, if the call
    has one (a repeated call's shortest path keeps it: ``flashedu.triton_backend``)."""
    import torch

    from . import fast

    q32, k32, v32 = interpreter_fp32(interpreted, q, k, v)
    (q32,), (o,) = outputs_like(q32)
    lse2 = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    live = (q32, k32, v32, o, lse2) if dropout_p == 0 else (q32, k32, v32, o, lse2, rng)
    # a call laid out as an earlier one repeats its launch (fast.PLANS); a score mod or an
    # attn_mask is a Python object or data that the plan's key cannot hold (a mask mod is
    # part of the block mask, which the key holds). The kernel is keyed by id (hashing a
    # JITFunction costs a Python call); the plan holds it, so the id stays its own.
    plan_key = plan = None
    if mods is None or mods.mask_mod_only:
        plan_key = fast.signature((q32, k32, v32, *live[5:]), id(forward_kernel), is_causal,
                                  scale, block_mask, mods is not None, tiles, interpreted,
                                  dropout_p)
        plan = fast.PLANS.get(plan_key)
    if plan is not None:
        plan.start(*live)
    else:
        # the tiles a launch shrank to are remembered per kernel variant (dropout and mods
        # need more shared memory than the plain kernel, whose tiles their shrinking must
        # leave alone)
        key = (tiles, q.shape[-1], q.dtype, dropout_p > 0, mods is not None)
        launch = _launch(q32, k32, v32, o, lse2, key, {}, is_causal=is_causal, scale=scale,
                         block_mask=block_mask, tiles=tiles, interpreted=interpreted,
                         dropout_p=dropout_p, rng=rng, mods=mods)
        if plan_key is not None:
            fast.remember(plan_key, launch)
            plan = launch
    if keep is not None and plan is not None:
        keep.append(plan)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), lse2


def forward_into(q, k, v, o, lse2, *, is_causal, scale, tiles, interpreted):
    """Attention of q against k, v merged, in place, into (o, lse2), the result over keys seen
    before: the kernel starts its online softmax from that result (RESUME) instead of from
    nothing, so no merge pass and no per-call output exist (ring attention's micro-step).

    o: float32, q's shape and strides (a row slice of a larger tensor is fine); lse2: float32
    (B, H, Nq), the base-2 logsumexp, +inf for a row that has seen no key yet (then its o is 0).
    Start from o = 0 and lse2 = +inf; after the last call o is the normalized output."""
    import torch

    if o.dtype != torch.float32 or lse2.dtype != torch.float32:
        raise TypeError(f"o and lse2 must be float32 running results, got {o.dtype} and "
                        f"{lse2.dtype}")
    if o.shape != q.shape or o.stride() != q.stride():
        raise ValueError(f"o must have q's shape and strides, got {tuple(o.shape)} "
                         f"{o.stride()} for q's {tuple(q.shape)} {q.stride()}")
    if lse2.shape != q.shape[:3] or not lse2.is_contiguous():
        raise ValueError(f"lse2 must be a contiguous (B, H, Nq) = {tuple(q.shape[:3])} tensor, "
                         f"got {tuple(lse2.shape)} with strides {lse2.stride()}")
    q32, k32, v32 = interpreter_fp32(interpreted, q, k, v)
    # the interpreter's float32 copy of a 16-bit row slice is contiguous: o must match it
    o32 = o if q32.stride() == o.stride() else o.contiguous()
    _launch(q32, k32, v32, o32, lse2, (tiles, q.shape[-1], q.dtype, "resume"), {"RESUME": True},
            is_causal=is_causal, scale=scale, block_mask=None, tiles=tiles,
            interpreted=interpreted)
    if o32 is not o:
        o.copy_(o32)


def _launch(q, k, v, o, lse2, key, extra: dict, *, tiles, **kwargs):
    """forward_kernel over (q, k, v) into (o, lse2), with smaller tiles after an
    out-of-resources error (remembered under ``key`` for later calls). Returns the launch
    (``fast.Launch``), to be repeated with the call's own tensors: q, k, v, o, lse2 and the
    dropout RNG state, if any."""
    from . import fast

    tiles = _SHRUNK.get(key, tiles)
    while True:
        grid, args, consts = launch_args(q, k, v, o, lse2, tiles=tiles, **kwargs)
        # q, k, v, o, lse2 lead forward_launch's arguments; the dropout RNG state follows
        own = fast.slots(args, 5, *([kwargs["rng"]] if kwargs.get("dropout_p", 0) > 0 else []))
        try:
            return fast.launch(forward_kernel, grid, args, {**consts, **extra},
                               fast.switches(tiles, kwargs["interpreted"], k, v), own)
        except fast.OUT_OF_RESOURCES as exc:
            tiles = fast.shrink(key, tiles, exc, _SHRUNK)
