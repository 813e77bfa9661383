"""How far a kernel's result may be from the float64 reference: one rule for the tests, the GPU
checks and the grader.

flash-attention's own tests set the rule: a correct kernel may add in another order (tiles of
any size, exp2 instead of exp, either loop order), so its error against a float64 reference may
be a few times the error of plain attention computed in the same dtype, plus a small floor for
the dtype (plain attention can be almost exact by luck on a small case):

    error(kernel) <= factor * error(plain attention in the same dtype) + floor(dtype)

with ``factor`` 2 for the output and 3 for the gradients (FORWARD, GRADIENT). The grader takes
the larger of the two terms instead of their sum (``floor_is_minimum=True``) and a factor of 4.
For the kernel exercises the grader's floor is not a constant of the dtype but the rounding a
correct kernel can make on the case's own inputs (:func:`attention_rounding`,
:func:`attention_backward_rounding`): plain attention can be almost exact on a draw where a
correct kernel that sums in another order is not.
"""

from __future__ import annotations

# Smallest error allowed, by dtype: about 100 units in the last place of an output near 1
# (float64: far above rounding, far below any bug).
FLOOR = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}
FORWARD = 2.0  # factor for the output O (and L)
GRADIENT = 3.0  # factor for dQ, dK, dV


def dtype_name(dtype) -> str:
    """'float32' for torch.float32, np.float32, np.dtype('float32') or 'float32'."""
    name = str(getattr(dtype, "name", None) or dtype)
    name = name.removeprefix("torch.")
    if name.startswith("<class 'numpy."):  # a NumPy scalar type: np.float32
        name = name[len("<class 'numpy."):-2]
    if name not in FLOOR:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(FLOOR)}")
    return name


def floor(dtype) -> float:
    """The smallest error allowed for results in ``dtype``."""
    return FLOOR[dtype_name(dtype)]


def allowed_error(dtype, baseline: float = 0.0, *, factor: float = FORWARD,
                  floor_scale: float = 1.0, floor_is_minimum: bool = False) -> float:
    """The largest error a correct kernel may have.

    ``baseline`` is the error of plain attention in the same dtype against the same reference
    (0 when there is none). The allowance is ``factor * baseline + floor_scale * floor(dtype)``,
    or with ``floor_is_minimum`` the larger of the two terms."""
    lowest = floor_scale * floor(dtype)
    if floor_is_minimum:
        return max(lowest, factor * baseline)
    return factor * baseline + lowest


def max_error(got, ref) -> float:
    """Largest absolute difference, computed in float64 (torch tensors or NumPy arrays)."""
    if hasattr(got, "detach"):
        return (got.detach().double() - ref.detach().double().to(got.device)).abs().max().item()
    import numpy as np

    return float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))))


def check(got, ref, plain, *, dtype=None, factor: float = FORWARD, floor_scale: float = 1.0,
          name: str = "output") -> tuple[float, float, float]:
    """(error, plain attention's error, allowed error) of ``got`` against the float64 ``ref``;
    raises AssertionError naming ``name`` when the error is over the allowance."""
    dtype = dtype if dtype is not None else got.dtype
    err, base = max_error(got, ref), max_error(plain, ref)
    limit = allowed_error(dtype, base, factor=factor, floor_scale=floor_scale)
    if not err <= limit:
        raise AssertionError(f"{name} error {err:.3g} > allowed {limit:.3g} "
                             f"(plain attention in {dtype_name(dtype)}: {base:.3g})")
    return err, base, limit


# ------------------------------------------------------------------------------------------
# The rounding a correct kernel can make on given inputs
# ------------------------------------------------------------------------------------------
#
# A correct kernel may sum in any order, tile as it likes, use exp2 with log2(e) folded in and
# rescale its running sums tile by tile or key by key: on given inputs its error is bounded by
# what rounding each step can contribute, and that depends on the inputs (logits in the
# hundreds make exp's argument, hence every probability, uncertain by |S| units in the last
# place). ``attention_rounding`` and ``attention_backward_rounding`` add those contributions up,
# elementwise and to first order, with sqrt(n) growth for a sum of n terms (rounding errors of a
# long sum mostly cancel; a worst-case n would allow a thousand times the error actually seen).
# The grader's allowance for one output is ROUNDING_FACTOR times the largest of them,
# normalized as the comparison is (|x - ref| / (1 + |ref|)).

UNIT = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
TF32_UNIT = 2.0**-11  # a float32 dot operand read as TF32 (10 mantissa bits), as tl.dot on a GPU
EXP_ULPS = 4.0  # exp / exp2 / log as a GPU computes them (approximate instructions): a few units
ROUNDING_FACTOR = 4.0


def unit(dtype) -> float:
    """Unit roundoff of ``dtype`` (half the distance from 1 to the next number)."""
    return UNIT[dtype_name(dtype)]


def _scores(Q, K, causal, scale, u, w):
    """Scores, a visibility mask, and each score's rounding (dot products of d terms, the scale,
    log2(e) folded in)."""
    import numpy as np

    d = Q.shape[1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    S = scale * (Q @ K.T)
    A = abs(scale) * (np.abs(Q) @ np.abs(K).T)
    visible = np.ones(S.shape, dtype=bool)
    if causal:
        visible = np.tri(*S.shape, dtype=bool)
    dS = (2 * w + (np.sqrt(d) + 1) * u) * A + 2 * u * np.abs(S)
    return scale, S, visible, dS


def attention_rounding(Q, K, V, *, causal=False, scale=None, dtype="float32", dot_unit=None):
    """(rounding of O, rounding of L): elementwise, the error that rounding in ``dtype`` can give
    a correct kernel on these inputs (``Q``, ``K``, ``V`` the inputs as the kernel gets them,
    in any float dtype). ``dot_unit``: the rounding of each dot operand (TF32 on a GPU), else
    none: the operands are already in ``dtype``."""
    import numpy as np

    Q, K, V = (np.asarray(a, dtype=np.float64) for a in (Q, K, V))
    u = unit(dtype)
    w = dot_unit or 0.0
    _, S, visible, dS = _scores(Q, K, causal, None if scale is None else scale, u, w)
    S = np.where(visible, S, -np.inf)
    m = S.max(axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(all="ignore"):
        P = np.where(visible, np.exp(S - m), 0.0)
    arg = np.where(visible, np.abs(S - m), 0.0)
    eps = dS + 2 * u * arg + EXP_ULPS * u  # relative rounding of each p_ij
    n = visible.sum(axis=1, keepdims=True).clip(min=1)
    grow = np.sqrt(n) * u
    l = P.sum(axis=1, keepdims=True)
    l = np.where(l > 0, l, 1.0)
    O = P @ V / l
    dl = (P * eps).sum(axis=1, keepdims=True) / l + grow  # relative rounding of l_i
    dO = ((P * eps) @ np.abs(V) + (2 * w + grow) * (P @ np.abs(V))) / l + \
        np.abs(O) * (dl + 2 * grow + u)
    spread = np.where(visible, S, np.inf).min(axis=1, keepdims=True)
    spread = np.where(np.isfinite(spread), m - spread, 0.0)  # how far the running max moves
    L = m + np.log(l)
    dL = dl + 2 * u * spread + EXP_ULPS * grow + u * np.abs(L)
    return dO, dL[:, 0]


def attention_backward_rounding(Q, K, V, dO, L, Delta, *, causal=False, scale=None,
                                dtype="float32", dot_unit=None, delta_from_p=False):
    """(rounding of dQ, of dK, of dV), elementwise, for a correct kernel of the backward that
    is given Q, K, V, dO, the forward's L and Delta_i = rowsum(dO_i * O_i) in ``dtype``.

    ``delta_from_p``: the kernel may compute Delta_i itself as rowsum(P_ij * dP_ij), equal in
    exact arithmetic. Then Delta_i carries every P_ij's rounding, and dS_ij = P_ij (dP_ij -
    Delta_i) keeps it where dP_ij - Delta_i cancels (logits in the hundreds: P almost one-hot,
    where a tiled rowsum misses by several times an untiled one)."""
    import numpy as np

    Q, K, V, dO = (np.asarray(a, dtype=np.float64) for a in (Q, K, V, dO))
    L = np.asarray(L, dtype=np.float64)[:, None]
    Delta = np.asarray(Delta, dtype=np.float64)[:, None]
    u = unit(dtype)
    w = dot_unit or 0.0
    scale, S, visible, dS_rounding = _scores(Q, K, causal, scale, u, w)
    d = Q.shape[1]
    with np.errstate(all="ignore"):
        P = np.where(visible, np.exp(np.where(visible, S - L, 0.0)), 0.0)
    eps = np.where(visible, dS_rounding + 2 * u * np.abs(S - L) + EXP_ULPS * u, 0.0)
    dP = dO @ V.T
    B = np.abs(dO) @ np.abs(V).T
    G = dP - Delta
    dG = (2 * w + np.sqrt(d) * u) * B + u * np.abs(G)
    dS = P * G
    ddS = P * (np.abs(G) * eps + dG) + u * np.abs(dS)
    rows = np.sqrt(visible.sum(axis=0, keepdims=True).clip(min=1)) * u  # sums over i
    cols = np.sqrt(visible.sum(axis=1, keepdims=True).clip(min=1)) * u  # sums over j
    dV = (P * eps).T @ np.abs(dO) + ((2 * w + rows) * P).T @ np.abs(dO)
    dK = abs(scale) * ((ddS + (2 * w + rows) * np.abs(dS)).T @ np.abs(Q))
    dQ = abs(scale) * ((ddS + (2 * w + cols) * np.abs(dS)) @ np.abs(K))
    dK += u * np.abs(scale * dS.T @ Q)
    dQ += u * np.abs(scale * dS @ K)
    if delta_from_p:
        # Delta_i's rounding, times P_ij: one error shared by row i of dS, so it adds up
        # linearly into dQ_i; rows round independently, so into dK_j as a sqrt.
        dDelta = (P * (eps * np.abs(dP) + (2 * w + np.sqrt(d) * u) * B + cols * np.abs(dP))
                  ).sum(axis=1, keepdims=True)
        E = P * dDelta
        dQ += abs(scale) * (E @ np.abs(K))
        dK += abs(scale) * np.sqrt((E * E).T @ (Q * Q))
    return dQ, dK, dV


def allowances(bounds, refs) -> tuple:
    """The grader's allowance for each output: ROUNDING_FACTOR x its rounding ``bounds``
    (attention_rounding, attention_backward_rounding), normalized against its reference."""
    return tuple(ROUNDING_FACTOR * normalized(b, r) for b, r in zip(bounds, refs))


def normalized(rounding, ref) -> float:
    """The largest of ``rounding`` / (1 + |ref|): an allowance on the comparison's scale."""
    import numpy as np

    ref = np.asarray(ref, dtype=np.float64)
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0
    return float(np.max(np.asarray(rounding)[finite] / (1.0 + np.abs(ref[finite]))))
