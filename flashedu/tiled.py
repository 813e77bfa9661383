"""FlashAttention in NumPy, tile by tile, with the paper's names.

Q (Nq, d) is cut into Tr = ceil(Nq / Br) row tiles Q_i; K and V (Nk, d) into Tc = ceil(Nk / Bc)
tiles K_j, V_j. For each pair (i, j) the kernel forms the small score tile
S_ij = scale * Q_i K_j^T (Br x Bc, it lives in SRAM only), updates the running row maximum m_i
and row sum l_i of the online softmax, and accumulates the output tile O_i. Nothing of size
Nq x Nk is ever allocated: memory is O(N d + Br Bc).

Two loop orders compute the same result:
- ``order="kv_outer"``: the paper's Algorithm 1 (FlashAttention-1). K_j, V_j are loaded once;
  every Q_i, O_i, l_i, m_i is read and written back to HBM once per K/V tile.
- ``order="q_outer"``: FlashAttention-2. Q_i stays in SRAM while K_j, V_j stream past; O_i is
  written once, at the end, with the logsumexp L_i = m_i + log(l_i) for the backward pass.

``tr`` is a :class:`flashedu.trace.Trace` (or the do-nothing NO_TRACE): ``tr.load`` marks an HBM
read, ``tr.store`` an HBM write. :mod:`flashedu.io` counts bytes from it.
"""

from __future__ import annotations

import math

import numpy as np

from . import dropout as _dropout
from .trace import NO_TRACE

ORDERS = ("q_outer", "kv_outer")


# ----------------------------------------------------------------------------------------
# Small helpers: the -inf arithmetic of masked rows, tile bounds, masks.
# ----------------------------------------------------------------------------------------


def _exp_minus(x, m):
    """exp(x - m), with m = -inf (a row that has seen no key yet) treated as 0.

    Then every x in that row is -inf too and the result is 0 instead of exp(-inf + inf) = NaN.
    """
    return np.exp(x - np.where(np.isneginf(m), 0.0, m))


def _tile(index: int, size: int, n: int) -> slice:
    """Rows of tile ``index`` of ``size`` rows; the last tile is cut at ``n``."""
    return slice(index * size, min((index + 1) * size, n))


class TileMask:
    """Which tiles a kernel visits and which elements inside a tile are visible.

    causal: query row r sees key column c iff c <= r (top-left aligned, as SDPA).
    blocks: optional (Tr, Tc) bool array; a False tile is skipped entirely.
    mods: optional :class:`TileMods`, the score mod and mask mod of a FlexAttention-style call.
    """

    def __init__(self, Nq, Nk, Br, Bc, causal=False, blocks=None, mods=None):
        self.Nq, self.Nk, self.Br, self.Bc, self.causal = Nq, Nk, Br, Bc, causal
        self.blocks = None if blocks is None else np.asarray(blocks, dtype=bool)
        self.mods = mods

    def chain(self, i: int, j: int, dS_ij):
        """The score mod's derivative on tile (i, j) times dS_ij (dS_ij without a score mod)."""
        return dS_ij if self.mods is None else self.mods.chain(i, j, dS_ij)

    def skip(self, i: int, j: int) -> bool:
        """True when tile (i, j) has no visible element: the kernel does not touch it."""
        if self.blocks is not None and not self.blocks[i, j]:
            return True
        last_q = min((i + 1) * self.Br, self.Nq) - 1
        return self.causal and j * self.Bc > last_q

    def apply(self, i: int, j: int, S_ij):
        """Set invisible scores of tile (i, j) to -inf (only tiles cut by the diagonal), after
        the score mod and the mask mod of ``mods``, when there are any."""
        if self.mods is not None:
            S_ij = self.mods.apply(i, j, S_ij)
        first_q, last_k = i * self.Br, min((j + 1) * self.Bc, self.Nk) - 1
        if not self.causal or last_k <= first_q:  # whole tile below the diagonal
            return S_ij
        rows = np.arange(first_q, first_q + S_ij.shape[0])[:, None]
        cols = np.arange(j * self.Bc, j * self.Bc + S_ij.shape[1])[None, :]
        return np.where(cols <= rows, S_ij, -np.inf)


class TileMods:
    """The element-level rules of one head (b, h), tile by tile (FlexAttention's mods).

    score_mod(score, b, h, q_idx, kv_idx): applied to every computed S_ij (already scaled).
    mask_mod(b, h, q_idx, kv_idx): evaluated only on partial tiles, those where ``full`` (a
    (Tr, Tc) bool array, or None: no tile is known full) is False; -inf where it says False.
    Both get torch tensors shaped as :mod:`flashedu.mods` describes: b, h (1, 1, 1, 1),
    q_idx (1, 1, rows, 1), kv_idx (1, 1, 1, cols), score (1, 1, rows, cols).

    In the backward (``keep_grad=True``) ``apply`` also keeps d score_mod / d S_ij of the tile,
    and ``chain`` multiplies dS_ij by it: the chain rule through the score mod (softcap's
    1 - tanh^2, ALiBi's 1, a user's mod differentiated by torch autograd on the tile).
    """

    def __init__(self, Nq, Nk, Br, Bc, *, b=0, h=0, mask_mod=None, full=None, score_mod=None):
        self.Nq, self.Nk, self.Br, self.Bc, self.b, self.h = Nq, Nk, Br, Bc, b, h
        self.mask_mod, self.full, self.score_mod = mask_mod, full, score_mod
        self.keep_grad = False
        self.dbias = None  # an (Nq, Nk) array: the backward adds dS_ij into it (attn_mask's grad)
        self._grad = {}

    def _indices(self, i, j, shape):
        import torch

        rows, cols = shape
        return (torch.tensor(self.b).view(1, 1, 1, 1), torch.tensor(self.h).view(1, 1, 1, 1),
                torch.arange(i * self.Br, i * self.Br + rows).view(1, 1, rows, 1),
                torch.arange(j * self.Bc, j * self.Bc + cols).view(1, 1, 1, cols))

    def apply(self, i: int, j: int, S_ij):
        import torch

        from . import mods

        idx = self._indices(i, j, S_ij.shape)
        if self.score_mod is not None:
            S = torch.from_numpy(np.ascontiguousarray(S_ij)).view(1, 1, *S_ij.shape)
            if self.keep_grad:
                S, grad = mods.score_mod_and_grad(self.score_mod, S, *idx)
                self._grad[i, j] = grad.reshape(S_ij.shape).numpy().astype(S_ij.dtype)
            else:
                S = mods.apply_score_mod(self.score_mod, S, *idx)
            S_ij = S.detach().reshape(S_ij.shape).numpy().astype(S_ij.dtype, copy=False)
        if self.mask_mod is not None and (self.full is None or not self.full[i, j]):
            visible = mods.evaluate_mask_mod(self.mask_mod, *idx, seq_lens=(self.Nq, self.Nk))
            S_ij = np.where(visible.reshape(S_ij.shape).numpy(), S_ij, -np.inf)
        return S_ij

    def chain(self, i: int, j: int, dS_ij):
        """dS_ij (gradient at the modified score) -> gradient at the raw score S_ij."""
        if self.dbias is not None:
            rows, cols = dS_ij.shape
            self.dbias[i * self.Br:i * self.Br + rows, j * self.Bc:j * self.Bc + cols] += dS_ij
        grad = self._grad.pop((i, j), None)
        if grad is None:
            return dS_ij
        return np.where(dS_ij == 0, dS_ij, dS_ij * grad)  # 0 where masked, even if grad is not finite


class TileDropout:
    """Dropout on P (the paper's Algorithm 2, line 11, and Algorithm 4, line 13), tile by tile.

    ``tile(i, j, shape)`` is Z_ij / (1 - p): 1 / (1 - p) where entry (row, col) is kept, 0
    where it is dropped (p the rate drawn, ``flashedu.dropout.drawn_rate``: steps of 1/256),
    from :mod:`flashedu.dropout`'s stream for head ``bh`` (the same on every backend, for any
    tiling). Never stored: the backward calls ``tile`` again. With p = 0
    it is the number 1 (nothing dropped, nothing rescaled).
    """

    def __init__(self, p=0.0, seed=0, offset=0, bh=0, Br=1, Bc=1):
        _dropout.threshold(p)  # a rate the stream can draw, or ValueError
        self.p, self.seed, self.offset, self.bh, self.Br, self.Bc = p, seed, offset, bh, Br, Bc

    def tile(self, i: int, j: int, shape, dtype=np.float64):
        if self.p == 0:
            return 1.0
        rows = np.arange(i * self.Br, i * self.Br + shape[0])
        cols = np.arange(j * self.Bc, j * self.Bc + shape[1])
        Z_ij = _dropout.keep_tile(self.seed, self.offset, self.bh, rows, cols, self.p)
        return np.where(Z_ij, dtype(_dropout.keep_scale(self.p)), dtype(0.0))


def _check(Q, K, V, block_q, block_k, scale):
    """Validate the single-head inputs; return them as arrays of one float dtype, and scale."""
    arrays = []
    for name, a in (("Q", Q), ("K", K), ("V", V)):
        a = np.asarray(a)
        if a.ndim != 2:
            raise ValueError(f"{name} must be 2-D (N, d), got shape {a.shape}")
        arrays.append(a)
    Q, K, V = arrays
    if K.shape != V.shape:
        raise ValueError(f"K and V must have the same shape (Nk, d), got {K.shape} and {V.shape}")
    if Q.shape[1] != K.shape[1]:
        raise ValueError(f"Q and K must have the same head dim d, got {Q.shape[1]} and {K.shape[1]}")
    if 0 in Q.shape or 0 in K.shape:
        raise ValueError(f"Q, K, V must be non-empty, got {Q.shape}, {K.shape}")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    dtype = np.result_type(Q.dtype, K.dtype, V.dtype, np.float32)
    if scale is None:
        scale = 1.0 / math.sqrt(Q.shape[1])
    return Q.astype(dtype, copy=False), K.astype(dtype, copy=False), V.astype(dtype, copy=False), dtype.type(scale)


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------


def flash_forward(Q, K, V, block_q, block_k, causal=False, scale=None, *,
                  order="q_outer", block_mask=None, trace=None, dropout_p=0.0, seed=0,
                  offset=0, bh=0, mods=None, sink=None):
    """FlashAttention forward for one head. Returns (O (Nq, d), L (Nq,)).

    ``order`` is "q_outer" (FlashAttention-2) or "kv_outer" (the paper's Algorithm 1).
    ``block_mask`` is an optional (Tr, Tc) bool array of tiles to compute; ``trace`` an optional
    :class:`flashedu.trace.Trace` that records every HBM transfer.
    ``dropout_p`` > 0: the paper's Algorithm 2. Each P_ij is multiplied by Z_ij / (1 - p)
    before P_ij V_j (Z_ij from :mod:`flashedu.dropout`'s stream of (seed, offset, head bh));
    l_i and L still sum the undropped P_ij, so the backward can rebuild them.
    ``mods``: an optional :class:`TileMods` (score mod on every S_ij, mask mod on the partial
    tiles); L is then the logsumexp of the modified scores.
    ``sink``: the head's sink logit (a float), one more term of every row's sum with no value:
    the online softmax starts from it (m_i = sink, l_i = 1, O_i = 0) instead of from nothing,
    as a merge with a block that held only the sink would. L includes it; the backward needs
    nothing more (P_ij = exp(S_ij - L_i) is already the share that key j got).
    """
    Q, K, V, scale = _check(Q, K, V, block_q, block_k, scale)
    (Nq, d), Nk = Q.shape, K.shape[0]
    Tr, Tc = math.ceil(Nq / block_q), math.ceil(Nk / block_k)
    if block_mask is not None:
        block_mask = np.asarray(block_mask)
        if block_mask.dtype != np.bool_ or block_mask.shape != (Tr, Tc):
            raise ValueError(f"block_mask must be a bool array of shape (Tr, Tc) = {(Tr, Tc)}, "
                             f"got {block_mask.dtype} {block_mask.shape}")
    mask = TileMask(Nq, Nk, block_q, block_k, causal, block_mask, mods)
    tr = NO_TRACE if trace is None else trace
    if trace is not None:
        trace.info.update(kernel="forward", order=order, Nq=Nq, Nk=Nk, d=d, Br=block_q,
                          Bc=block_k, Tr=Tr, Tc=Tc, itemsize=Q.itemsize, causal=causal)
    drop = TileDropout(dropout_p, seed, offset, bh, block_q, block_k)
    if order == "q_outer":
        return _forward_q_outer(Q, K, V, block_q, block_k, scale, mask, tr, drop, sink)
    if order == "kv_outer":
        return _forward_kv_outer(Q, K, V, block_q, block_k, scale, mask, tr, drop, sink)
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def _forward_q_outer(Q, K, V, Br, Bc, scale, mask, tr, drop=TileDropout(), sink=None):
    """FlashAttention-2 order: one Q tile stays in SRAM while all K/V tiles stream past."""
    Nq, Nk = Q.shape[0], K.shape[0]
    O = np.empty_like(Q)
    L = np.empty(Nq, dtype=Q.dtype)
    for i in range(math.ceil(Nq / Br)):
        rows = _tile(i, Br, Nq)
        Q_i = tr.load("Q", i, Q[rows])
        O_i = np.zeros_like(Q_i)  # on chip: accumulated, unnormalized output
        l_i = np.zeros(Q_i.shape[0], dtype=Q.dtype)  # running sum of exp(S - m_i)
        m_i = np.full(Q_i.shape[0], -np.inf, dtype=Q.dtype)  # running row max
        if sink is not None:  # the sink: one term exp(sink - m_i) in l_i, nothing in O_i
            m_i, l_i = np.full_like(m_i, sink), np.ones_like(l_i)
        for j in range(math.ceil(Nk / Bc)):
            if mask.skip(i, j):
                tr.skip(i, j)
                continue
            cols = _tile(j, Bc, Nk)
            K_j = tr.load("K", j, K[cols])
            V_j = tr.load("V", j, V[cols])
            S_ij = mask.apply(i, j, scale * (Q_i @ K_j.T))
            m_new = np.maximum(m_i, S_ij.max(axis=1))
            P_ij = _exp_minus(S_ij, m_new[:, None])
            alpha = _exp_minus(m_i, m_new)  # rescales what was accumulated under the old max
            l_i = alpha * l_i + P_ij.sum(axis=1)
            Z_ij = drop.tile(i, j, P_ij.shape, Q.dtype.type)  # 1 without dropout
            O_i = alpha[:, None] * O_i + (Z_ij * P_ij) @ V_j
            m_i = m_new
            tr.compute(i, j, S_ij=S_ij, O_i=O_i, l_i=l_i, m_i=m_i)  # all on chip, never in HBM
        seen = l_i != 0  # False only for a row that sees no key (NaN scores stay NaN)
        O_i = O_i / np.where(seen, l_i, 1)[:, None]
        with np.errstate(divide="ignore"):
            L_i = np.where(seen, m_i + np.log(np.where(seen, l_i, 1)), -np.inf)
        O[rows] = O_i
        L[rows] = L_i
        tr.store("O", i, O_i)
        tr.store("L", i, L_i)
        tr.drop("Q", "K", "V", "O", "L")
    return O, L


def _forward_kv_outer(Q, K, V, Br, Bc, scale, mask, tr, drop=TileDropout(), sink=None):
    """The paper's Algorithm 1: K_j, V_j loaded once; O_i, l_i, m_i updated in HBM each pass."""
    Nq, Nk = Q.shape[0], K.shape[0]
    O = np.zeros_like(Q)  # line 2: O, l, m initialized in HBM
    l = np.zeros(Nq, dtype=Q.dtype)
    m = np.full(Nq, -np.inf, dtype=Q.dtype)
    if sink is not None:  # the sink: one term exp(sink - m) in l, nothing in O
        m, l = np.full_like(m, sink), np.ones_like(l)
    Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
    for j in range(Tc):
        cols = _tile(j, Bc, Nk)
        K_j = V_j = None
        for i in range(Tr):
            if mask.skip(i, j):
                tr.skip(i, j)
                continue
            if K_j is None:  # a K/V tile every Q tile skips is never loaded
                K_j = tr.load("K", j, K[cols])
                V_j = tr.load("V", j, V[cols])
            rows = _tile(i, Br, Nq)
            Q_i = tr.load("Q", i, Q[rows])
            O_i = tr.load("O", i, O[rows])
            l_i = tr.load("l", i, l[rows])
            m_i = tr.load("m", i, m[rows])
            S_ij = mask.apply(i, j, scale * (Q_i @ K_j.T))
            m_ij = S_ij.max(axis=1)
            P_ij = _exp_minus(S_ij, m_ij[:, None])
            l_ij = P_ij.sum(axis=1)
            Z_ij = drop.tile(i, j, P_ij.shape, Q.dtype.type)  # 1 without dropout
            m_new = np.maximum(m_i, m_ij)
            l_new = _exp_minus(m_i, m_new) * l_i + _exp_minus(m_ij, m_new) * l_ij
            acc = (l_i * _exp_minus(m_i, m_new))[:, None] * O_i \
                + _exp_minus(m_ij, m_new)[:, None] * ((Z_ij * P_ij) @ V_j)
            O[rows] = acc / np.where(l_new > 0, l_new, 1)[:, None]
            l[rows], m[rows] = l_new, m_new
            tr.compute(i, j, S_ij=S_ij)
            tr.store("O", i, O[rows])
            tr.store("l", i, l[rows])
            tr.store("m", i, m[rows])
        tr.drop("K", "V", "Q", "O", "l", "m")
    # The backward pass needs only L = m + log(l): one more small pass over l and m.
    L = np.empty(Nq, dtype=Q.dtype)
    for i in range(Tr):
        rows = _tile(i, Br, Nq)
        l_i, m_i = tr.load("l", i, l[rows]), tr.load("m", i, m[rows])
        with np.errstate(divide="ignore"):
            seen = l_i != 0  # False only for a row that sees no key (NaN scores stay NaN)
            L[rows] = np.where(seen, m_i + np.log(np.where(seen, l_i, 1)), -np.inf)
        tr.store("L", i, L[rows])
    return O, L


def block_sparse_forward(Q, K, V, block_mask, block_q, block_k, scale=None, *,
                         order="q_outer", trace=None):
    """Block-sparse FlashAttention: tiles where ``block_mask`` (Tr, Tc) is False are skipped
    entirely (never loaded, never computed). Returns (O, L)."""
    if block_mask is None:
        raise ValueError("block_mask must be a (Tr, Tc) bool array, got None")
    return flash_forward(Q, K, V, block_q, block_k, causal=False, scale=scale, order=order,
                         block_mask=block_mask, trace=trace)


# ----------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------


def flash_backward(Q, K, V, O, dO, L, block_q, block_k, causal=False, scale=None, *,
                   block_mask=None, trace=None, dropout_p=0.0, seed=0, offset=0, bh=0,
                   mods=None, dL=None):
    """FlashAttention backward for one head: recompute P_ij from L, never store P.

    With D_i = rowsum(dO_i * O_i) (a preprocess), for each tile pair:
        P_ij  = exp(S_ij - L_i)
        dV_j += P_ij^T dO_i
        dP_ij = dO_i V_j^T
        dS_ij = P_ij * (dP_ij - D_i)
        dQ_i += scale * dS_ij K_j
        dK_j += scale * dS_ij^T Q_i
    K/V tiles are the outer loop, so dK_j, dV_j stay in SRAM; dQ_i is read and written back.
    Returns (dQ, dK, dV).

    With ``dropout_p`` > 0 (the paper's Algorithm 4, the same seed, offset and bh as the
    forward) the forward's mask is regenerated, Z_ij scaled by 1 / (1 - p):
        dV_j += (Z_ij * P_ij)^T dO_i,   dP_ij = Z_ij * (dO_i V_j^T)
    and D_i = rowsum(dO_i * O_i) still equals rowsum(P_ij * dP_ij) summed over j.

    ``mods`` (a :class:`TileMods`): S_ij is modified as in the forward, and dS_ij is carried
    back through the score mod (times its derivative) before dQ_i and dK_j. ``dL`` (Nq,): the
    gradient reaching the logsumexp L itself (when the caller used it); since dL_i / dS_ij =
    P_ij, it only changes D_i into D_i - dL_i.
    """
    Q, K, V, scale = _check(Q, K, V, block_q, block_k, scale)
    dtype = Q.dtype
    O, dO, L = (np.asarray(a).astype(dtype, copy=False) for a in (O, dO, L))
    if O.shape != Q.shape or dO.shape != Q.shape:
        raise ValueError(f"O and dO must have Q's shape {Q.shape}, got {O.shape} and {dO.shape}")
    if L.shape != (Q.shape[0],):
        raise ValueError(f"L must have shape (Nq,) = {(Q.shape[0],)}, got {L.shape}")
    (Nq, d), Nk = Q.shape, K.shape[0]
    Tr, Tc = math.ceil(Nq / block_q), math.ceil(Nk / block_k)
    if block_mask is not None:
        block_mask = np.asarray(block_mask, dtype=bool)
        if block_mask.shape != (Tr, Tc):
            raise ValueError(f"block_mask must have shape (Tr, Tc) = {(Tr, Tc)}, got {block_mask.shape}")
    if mods is not None:
        mods.keep_grad = True
    mask = TileMask(Nq, Nk, block_q, block_k, causal, block_mask, mods)
    drop = TileDropout(dropout_p, seed, offset, bh, block_q, block_k)
    tr = NO_TRACE if trace is None else trace
    if trace is not None:
        trace.info.update(kernel="backward", order="kv_outer", Nq=Nq, Nk=Nk, d=d, Br=block_q,
                          Bc=block_k, Tr=Tr, Tc=Tc, itemsize=Q.itemsize, causal=causal)

    # Preprocess: D_i = rowsum(dO_i * O_i), which equals rowsum(P_i * dP_i) (the softmax
    # Jacobian's correction term) without needing P.
    D = np.empty(Nq, dtype=dtype)
    for i in range(Tr):
        rows = _tile(i, block_q, Nq)
        dO_i, O_i = tr.load("dO", i, dO[rows]), tr.load("O", i, O[rows])
        D[rows] = (dO_i * O_i).sum(axis=1)
        tr.store("D", i, D[rows])
    tr.drop("dO", "O", "D")
    if dL is not None:  # the logsumexp's own gradient: dS_ij += P_ij * dL_i
        D = D - np.asarray(dL, dtype=dtype).reshape(Nq)

    dQ = np.zeros_like(Q)
    dK = np.empty_like(K)
    dV = np.empty_like(V)
    for j in range(Tc):
        cols = _tile(j, block_k, Nk)
        K_j, V_j = K[cols], V[cols]
        dK_j = np.zeros_like(K_j)
        dV_j = np.zeros_like(V_j)
        loaded = False
        for i in range(Tr):
            if mask.skip(i, j):
                tr.skip(i, j)
                continue
            if not loaded:
                K_j, V_j, loaded = tr.load("K", j, K_j), tr.load("V", j, V_j), True
            rows = _tile(i, block_q, Nq)
            Q_i = tr.load("Q", i, Q[rows])
            dO_i = tr.load("dO", i, dO[rows])
            L_i = tr.load("L", i, L[rows])
            D_i = tr.load("D", i, D[rows])
            dQ_i = tr.load("dQ", i, dQ[rows])
            S_ij = mask.apply(i, j, scale * (Q_i @ K_j.T))
            P_ij = _exp_minus(S_ij, L_i[:, None])  # recomputed, exactly normalized
            Z_ij = drop.tile(i, j, P_ij.shape, dtype.type)  # the forward's mask, regenerated
            dV_j += (Z_ij * P_ij).T @ dO_i
            dP_ij = Z_ij * (dO_i @ V_j.T)
            dS_ij = P_ij * (dP_ij - D_i[:, None])
            dS_ij = mask.chain(i, j, dS_ij)  # through the score mod (unchanged without one)
            dQ[rows] = dQ_i + scale * (dS_ij @ K_j)
            dK_j += scale * (dS_ij.T @ Q_i)
            tr.compute(i, j, S_ij=S_ij, dS_ij=dS_ij)
            tr.store("dQ", i, dQ[rows])
        dK[cols], dV[cols] = dK_j, dV_j
        tr.store("dK", j, dK_j)
        tr.store("dV", j, dV_j)
        tr.drop("K", "V", "Q", "dO", "L", "D", "dQ", "dK", "dV")
    return dQ, dK, dV
