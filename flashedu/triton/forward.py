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

Here are the kernel and what a launch passes it (``launch_args``); the host side of a call (its
outputs, the interpreter's float32 copies, the launch plan, smaller tiles after an
out-of-resources error) is ``launch.py``.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .dropout import dropped
from .mods import mod_scores, visible
from .tiles import element_origin, full_tile, kv_tiles, masked_tile, sequence

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
_LOG2E = tl.constexpr(LOG2E)


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
def _softmax_step(O_i, l_i, m_i, Q_i, K_j, V_j, start_n, rows, Nk, qk_scale, ctx, E, drop,
                  IS_CAUSAL: tl.constexpr, MASK: tl.constexpr, DOT_PREC: tl.constexpr,
                  SCORE_MOD: tl.constexpr = None, MASK_MOD: tl.constexpr = None):
    """One K_j, V_j tile: S_ij, the online-softmax update of (m_i, l_i), and O_i += P_ij V_j.

    qk_scale is scale * log2(e), so exp2(S_ij * qk_scale) = exp(scale * S_ij): the paper's exp,
    computed by the GPU's ex2 instruction. m_i is kept in that base-2 scale.
    MASK: the tile may hold keys the rule hides (``mods.visible``: past Nk, causal, the block
    mask's element mask E, the compiled mask mod); they get -inf, so P_ij = 0 there. rows:
    the queries' positions against the keys (their rows, moved by the diagonal of
    ``tiles.sequence`` for packed sequences).
    drop (the paper's Algorithm 2): P_ij times Z_ij after l_i took the undropped P_ij, before
    the product with V_j; Z_ij from (seed, offset, bh) and each entry's position. The
    rescale (``flashedu.dropout.keep_scale``) is the same for every entry: the kernel applies
    it once, to O_i at the end.
    SCORE_MOD, or a bias in ctx (mods.py): S_ij becomes score_mod(scale * S_ij) + attn_mask,
    and qk_scale is log2(e)."""
    cols = start_n + tl.arange(0, K_j.shape[0])  # the keys of this tile
    bias = ctx[4]  # SDPA's float attn_mask (mods.py), or None
    S_ij = tl.dot(Q_i, tl.trans(K_j), input_precision=DOT_PREC)  # unscaled scores, Br x Bc
    if SCORE_MOD is not None or bias is not None:
        S_ij, _ = mod_scores(S_ij, rows[:, None], cols[None, :], Nk, ctx, SCORE_MOD)
    if MASK:
        S_ij = tl.where(visible(rows[:, None], cols[None, :], Nk, E, ctx, IS_CAUSAL, MASK_MOD),
                        S_ij, float("-inf"))
    # qk_scale > 0, so scaling commutes with the max: one multiply per row, not per score
    m_new = tl.maximum(m_i, tl.max(S_ij, 1) * qk_scale)
    if MASK or bias is not None:  # a row that has seen no key yet keeps m = -inf: subtract 0
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    P_ij = tl.math.exp2(S_ij * qk_scale - m_use[:, None])  # one fused multiply-add, one ex2
    alpha = tl.math.exp2(m_i - m_use)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(P_ij, 1)
    P_ij = P_ij.to(V_j.dtype)  # the product's operand
    if drop is not None:  # selected in the operand's type: two entries a register in 16 bits
        P_ij = dropped(P_ij, drop, drop[5], start_n)
    # the rescaled O_i is the product's accumulator: the tensor cores add P_ij V_j into it
    O_i = tl.dot(P_ij, V_j, O_i * alpha[:, None], input_precision=DOT_PREC)
    return O_i, l_i, m_new


@triton.jit
def _forward_step(O_i, l_i, m_i, Q_i, K_src, V_src, stride_kn, stride_vn, start_n, rows, dims,
                  Nk, d, qk_scale, ctx, E, drop, Bc: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  MASK: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
                  TMA: tl.constexpr = False, SCORE_MOD: tl.constexpr = None,
                  MASK_MOD: tl.constexpr = None):
    """Load K_j, V_j (rows start_n ..), then the softmax step.

    K_src, V_src: this head's K and V, as pointers, or (TMA) as tensor descriptors: the copy
    engine then fetches each tile with one instruction, no address arithmetic, and rows past
    Nk or dims past d arrive as zeros. Pointer loads are masked only where the tile may run
    past the tensor."""
    if TMA:
        K_j = K_src.load([start_n, 0])
        V_j = V_src.load([start_n, 0])
    else:
        cols = start_n + tl.arange(0, Bc)
        row_ok = cols[:, None] < Nk
        dim_ok = dims[None, :] < d
        K_j = load_tile(K_src + cols[:, None] * stride_kn + dims[None, :], row_ok, dim_ok,
                        MASK, not EVEN_D)
        V_j = load_tile(V_src + cols[:, None] * stride_vn + dims[None, :], row_ok, dim_ok,
                        MASK, not EVEN_D)
    return _softmax_step(O_i, l_i, m_i, Q_i, K_j, V_j, start_n, rows, Nk, qk_scale, ctx, E, drop,
                         IS_CAUSAL, MASK, DOT_PREC, SCORE_MOD, MASK_MOD)


@triton.jit
def exponent_scale(scale, bias, SCORE_MOD: tl.constexpr):
    """qk_scale, the scores' factor inside exp2: scale * log2(e), so that exp2(S_ij * qk_scale)
    = exp(scale * S_ij); log2(e) alone where a score mod or a bias works on scale * S_ij first,
    in natural units (mods.py)."""
    if SCORE_MOD is not None or bias is not None:
        return tl.cast(_LOG2E, tl.float32)
    else:
        return scale * _LOG2E


@triton.jit
def dropout_state(RNG, bh, dropout, start_m=0):
    """(seed, offset, bh, threshold, keep scale, start_m) of a program: the call's [seed,
    offset] tensor read on the device (``flashedu.dropout.draw_rng``), dropout = (threshold,
    keep scale), and the first query row of the program's Q tile (0 in the dK/dV program,
    whose Q tiles change)."""
    return (tl.load(RNG), tl.load(RNG + 1), bh, dropout[0], tl.cast(dropout[1], tl.float32),
            start_m)


@triton.jit
def _initial_state(prev, sinks, b, h, bh, rows, dims, row_ok, dim_ok, Nq, stride_o,
                   Br: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(m_i, l_i, O_i) before the first K/V tile: nothing seen (-inf, 0, 0), or, given
    prev = (O, L), the result over earlier keys read back from them, so that the online
    softmax goes on from it. That result is O = sum e^(S - L) V with sum e^(S - L) = 1, which
    is the state m_i = L_i, l_i = 1, O_i = O: the kernel then writes the merge of old and new
    keys (the rule of ``flashedu.merge``) without a separate merge pass. L = +inf marks a row
    that has seen no key (its O is 0). ``sinks``, one logit per query head, are such a result
    too: a block that held only the sink, whose lse is the sink and whose output is 0."""
    if prev is not None:
        O, L = prev
        L_prev = tl.load(L + bh * Nq + rows, mask=rows < Nq, other=float("inf"))
        seen = L_prev != float("inf")
        m_i = tl.where(seen, L_prev, float("-inf"))
        l_i = tl.where(seen, 1.0, 0.0)
        O_i = tl.load(O + b * stride_o[0] + h * stride_o[1] + rows[:, None] * stride_o[2]
                      + dims[None, :], mask=row_ok & dim_ok, other=0.0).to(tl.float32)
    elif sinks is not None:  # base-2 units, as m_i
        m_i = tl.full([Br], 0.0, dtype=tl.float32) + tl.load(sinks + h) * _LOG2E
        l_i = tl.full([Br], 1.0, dtype=tl.float32)
        O_i = tl.zeros([Br, HEAD_DIM], dtype=tl.float32)
    else:
        m_i = tl.full([Br], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([Br], dtype=tl.float32)
        O_i = tl.zeros([Br, HEAD_DIM], dtype=tl.float32)
    return m_i, l_i, O_i


@triton.jit
def _store_output(O_i, l_i, m_i, O, L, b, h, row0, rows, dims, row_ok, dim_ok, Nq, stride_o):
    """O_i / l_i and L_i = m_i + log2(l_i), stored (L_i at L + row0 + rows). A row that saw no
    key (l_i = 0) gets O = 0 and L = +inf, so that the backward's P = exp2(S - L) is 0 there:
    zero gradients, no NaN. A row of NaN scores (l_i NaN) keeps NaN in both: it saw keys,
    whose values are unknown."""
    seen = l_i != 0
    O_i = O_i / tl.where(seen, l_i, 1.0)[:, None]
    L_i = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    tl.store(O + b * stride_o[0] + h * stride_o[1] + rows[:, None] * stride_o[2] + dims[None, :],
             O_i.to(O.dtype.element_ty), mask=row_ok & dim_ok)
    tl.store(L + row0 + rows, L_i, mask=rows < Nq)


@triton.jit
def forward_kernel(Q, K, V, O, L, scale, stride_q, stride_k, stride_v, stride_o, H, GROUP, Nq,
                   Nk, d,
                   LISTS, ELEM, RNG, dropout, mod_args, prev, sinks, SEQS,
                   Br: tl.constexpr, Bc: tl.constexpr, HEAD_DIM: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
                   TMA: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False,
                   SCORE_MOD: tl.constexpr = None, MASK_MOD: tl.constexpr = None):
    """One program per (Q tile i, batch * query head). Strides come as (batch, head, row)
    tuples; the options are None where a call has none, and then not compiled:
    LISTS a block mask's tile lists (tiles.py) and ELEM its partial tiles' element masks,
    RNG and dropout the dropout's state and (threshold, keep scale), mod_args = (bias,
    score_args, mask_args): SDPA's float attn_mask and what the SCORE_MOD and MASK_MOD hooks
    take (mods.py), each None where absent, prev = (O, L) a result to go on from, sinks the
    (H,) float32 sink logits, SEQS packed sequences (``tiles.sequence``: b is then the
    sequence, the grid sized by the longest)."""
    i = tl.program_id(0)  # which Q tile
    bh = tl.program_id(1)  # which (batch, query head)
    b = bh // H
    h = bh % H
    h_kv = h // GROUP  # grouped-query attention: heads h_kv*GROUP .. share one K/V head
    DOT_PREC: tl.constexpr = "ieee" if Q.dtype.element_ty == tl.float32 else "tf32"
    bias, score_args, mask_args = mod_args
    rows_per_head = Nq
    q0, k0, base, Nq, Nk, diag = sequence(SEQS, b, H, Nq, Nk)
    row0 = base + h * rows_per_head  # this head's first row in L
    if SEQS is not None:
        if i * Br >= Nq:  # a Q tile past this sequence's end (the grid fits the longest)
            return
    Q += q0 * stride_q[2]
    O += q0 * stride_o[2]
    K += k0 * stride_k[2]
    V += k0 * stride_v[2]
    rows = i * Br + tl.arange(0, Br)
    dims = tl.arange(0, HEAD_DIM)  # padded to a power of two; dims >= d are masked off
    row_ok = rows[:, None] < Nq
    dim_ok = dims[None, :] < d
    Q_i = load_tile(Q + b * stride_q[0] + h * stride_q[1] + rows[:, None] * stride_q[2]
                    + dims[None, :], row_ok, dim_ok, True, not EVEN_D)
    K_head = K + b * stride_k[0] + h_kv * stride_k[1]
    V_head = V + b * stride_v[0] + h_kv * stride_v[1]
    if TMA:  # descriptors of this head's K and V: Nk x d, fetched Bc x HEAD_DIM at a time
        K_src = tl.make_tensor_descriptor(K_head, [Nk, d], [stride_k[2], 1], [Bc, HEAD_DIM])
        V_src = tl.make_tensor_descriptor(V_head, [Nk, d], [stride_v[2], 1], [Bc, HEAD_DIM])
    else:
        K_src = K_head
        V_src = V_head
    scale = tl.cast(scale, tl.float32)  # torch.compile may hand a float64 scalar
    qk_scale = exponent_scale(scale, bias, SCORE_MOD)
    ctx = (b, h, Nq, scale, bias, score_args, mask_args)  # what the mods read
    drop = None
    if RNG is not None:
        drop = dropout_state(RNG, bh, dropout, i * Br)
    m_i, l_i, O_i = _initial_state(prev, sinks, b, h, bh, rows, dims, row_ok, dim_ok, Nq,
                                   stride_o, Br, HEAD_DIM)
    # The K/V tiles this Q tile visits (tiles.py): num_full without an element mask, then the
    # causal diagonal and the ragged edge, from a block mask's lists or from the geometry.
    num, num_full, u0, a0, na, b0, idx_row, e0 = kv_tiles(i, b, h, LISTS, ELEM, Nq, Nk, diag,
                                                          Br, Bc, IS_CAUSAL)
    pos = rows + diag  # each row's position against the keys: what the causal rule compares
    # Warp specialization (where Triton has it for this GPU): some warps only issue the
    # copies, the others only compute, so that loads and the softmax overlap.
    for t in tl.range(0, num_full, warp_specialize=WARP_SPECIALIZE):
        j = full_tile(t, u0, idx_row, LISTS)
        O_i, l_i, m_i = _forward_step(O_i, l_i, m_i, Q_i, K_src, V_src, stride_k[2],
                                      stride_v[2], j * Bc, pos, dims, Nk, d, qk_scale, ctx,
                                      None, drop, Bc, IS_CAUSAL, False, EVEN_D, DOT_PREC, TMA,
                                      SCORE_MOD, MASK_MOD)
    if MASKED:  # only where some tile can need a mask (an empty loop measured slower)
        for t in range(num_full, num):
            j = masked_tile(t, num_full, a0, na, b0, idx_row, LISTS)
            E = None
            if ELEM is not None:  # a mask mod's partial tile: its element mask
                E = (element_origin(ELEM, e0, t, i * Br, j * Bc, Br, Bc), Bc)
            O_i, l_i, m_i = _forward_step(O_i, l_i, m_i, Q_i, K_src, V_src, stride_k[2],
                                          stride_v[2], j * Bc, pos, dims, Nk, d, qk_scale, ctx,
                                          E, drop, Bc, IS_CAUSAL, True, EVEN_D, DOT_PREC, TMA,
                                          SCORE_MOD, MASK_MOD)
    if drop is not None:  # Algorithm 2's 1 / (1 - p), once per row instead of once per entry
        O_i = O_i * drop[4]
    _store_output(O_i, l_i, m_i, O, L, b, h, row0, rows, dims, row_ok, dim_ok, Nq, stride_o)


def dot_precision(dtype) -> str:
    """fp32 inputs: exact fp32 products (tf32 would miss the tolerance); 16-bit: the default."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=1024)
def _launch_consts(Nq, Nk, d, is_causal, tiles, interpreted):
    """The constexprs and launch options of forward_kernel: computed once per configuration."""
    from . import sparse
    from .config import padded_head_dim

    HEAD_DIM = padded_head_dim(d)
    return dict(Br=tiles.Br, Bc=tiles.Bc, HEAD_DIM=HEAD_DIM, IS_CAUSAL=is_causal,
                MASKED=sparse.needs_mask(is_causal, Nq, Nk, tiles.Br, tiles.Bc),
                EVEN_D=HEAD_DIM == d, **({} if interpreted else tiles.launch()))


def forward_launch(q, k, v, o, lse2, *, is_causal, scale, block_mask, tiles, interpreted,
                   elements=False, seqs=None):
    """(grid, args, consts) of forward_kernel for these tensors, up to its ELEM: shared with
    the variants of ``ablations.py``, whose kernels take the same arguments. ``elements``:
    the lists carry the block mask's element masks. ``seqs``: packed sequences
    (``flashedu.varlen.Packing``) in tensors of batch 1."""
    from . import sparse

    B, H, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    lists = sparse.kernel_lists(block_mask, tiles.Br, tiles.Bc, False, q.device, is_causal)
    elem = element_args(elements, block_mask, tiles.Br, tiles.Bc, False, q.device, is_causal)
    args = (q, k, v, o, lse2, scale, *row_strides(seqs, q, k, v, o), H, H // Hkv, Nq, Nk, d,
            lists, elem)
    consts = dict(_launch_consts(Nq, Nk, d, is_causal, tiles, interpreted))
    if seqs is None:
        return (-(-Nq // tiles.Br), B * H), args, consts
    # packed sequences: a program per (Q tile of the longest, sequence * head); those past
    # their sequence's end return at once, and every sequence may end inside a tile
    consts["MASKED"] = True
    return (-(-seqs.max_seqlen_q // tiles.Br), (len(seqs.cu_seqlens_q) - 1) * H), args, consts


def row_strides(seqs, *tensors):
    """The (batch, head, row) strides of ``tensors`` as the kernels take them: with packed
    sequences (``seqs``), batch 1 holds them all and the batch stride is 0 (the kernels move
    to a sequence's rows through SEQS, ``tiles.sequence``)."""
    if seqs is None:
        return [t.stride()[:3] for t in tensors]
    return [(0, *t.stride()[1:3]) for t in tensors]


def sequences_arg(seqs):
    """The SEQS argument of the kernels (``tiles.sequence``), or None."""
    return None if seqs is None else tuple(seqs)


def dropout_args(dropout_p, rng):
    """(RNG, (threshold, keep scale)) of the kernels: the [seed, offset] tensor, the keep
    threshold round(256 p) and the rescale 256 / (256 - threshold) (``flashedu.dropout``);
    (None, None) without dropout (not compiled)."""
    if dropout_p == 0:
        return None, None
    from ..dropout import keep_scale, threshold

    return rng, (threshold(dropout_p), keep_scale(dropout_p))


def element_args(elements, block_mask, Br, Bc, transpose, device, is_causal):
    """The ELEM argument of the kernels: (E, E_base) of lists with Br x Bc tiles
    (``sparse.element_lists``) where the block mask's partial tiles need element masks, else
    None."""
    if not elements:
        return None
    from . import sparse

    return sparse.element_lists(block_mask, Br, Bc, transpose, device, is_causal)


def mods_args(mods, block_mask, q, k):
    """((bias, score_args, mask_args), {SCORE_MOD, MASK_MOD}, elements) of a launch: the
    float attn_mask, the hooks and their arguments (mods.py), and whether the block mask's
    partial tiles need their element masks (a mask mod no hook compiles); Nones without
    mods."""
    from .mods import bias_args, compiled_mask_mod, score_mod_args

    if mods is None:
        return (None, None, None), {}, False
    SCORE_MOD, score_args = score_mod_args(mods.score_mod, q.device)
    MASK_MOD, mask_args = compiled_mask_mod(mods, block_mask, q.device)
    bias = bias_args(mods.attn_mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    elements = mods.mask_mod is not None and MASK_MOD is None
    return ((bias, score_args, mask_args), {"SCORE_MOD": SCORE_MOD, "MASK_MOD": MASK_MOD},
            elements)


def launch_args(q, k, v, o, lse2, *, is_causal, scale, block_mask, tiles, interpreted,
                dropout_p=0.0, rng=None, mods=None, prev=None, sinks=None, seqs=None):
    """(grid, args, consts) of forward_kernel: ``forward_launch``'s, then the dropout, the
    mods, ``prev``, the ``sinks`` and the packed sequences ``seqs`` (None where the call has
    none: not compiled). ``scale`` is the softmax scale."""
    hook_args, hooks, elements = mods_args(mods, block_mask, q, k)
    grid, args, consts = forward_launch(q, k, v, o, lse2, is_causal=is_causal, scale=scale,
                                        block_mask=block_mask, tiles=tiles,
                                        interpreted=interpreted, elements=elements, seqs=seqs)
    args = (*args, *dropout_args(dropout_p, rng), hook_args, prev, sinks, sequences_arg(seqs))
    consts = {**consts, **hooks,
              "MASKED": consts["MASKED"] or elements or hooks.get("MASK_MOD") is not None}
    return grid, args, consts
