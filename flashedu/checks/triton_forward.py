"""The Triton forward exercise: the learner's FlashAttention forward kernel, one program per Q
tile. ``launch_triton_forward`` (shown in the notebook) launches it on views into padded
buffers. What the checks enforce: :mod:`.kernels`.
"""

from __future__ import annotations

import math

import numpy as np

from .. import reference, runtime, tiled
from .engine import Case, Exercise
from .kernel_common import (
    F32,
    H_LONG,
    H_TWICE,
    SENTINEL,
    STRIDES,
    _backward_bounds_probe,
    _diagnose_kernel,
    _forward_rounding,
    _gate,
    _kernel_problem,
    _padded_rows,
    _repeat_probe,
    _scores_tf32,
    _still_skeleton,
    _triton_unavailable,
    _watch_loads,
    tf32,
)
from .numpy_exercises import (
    H_CAUSAL,
    H_EDGE,
    H_N1,
    H_NQNK,
    H_SCALE,
    H_TILES,
    H_FUTURE,
    H_WIDE,
    normalized_key_by_key,
    _inputs,
    _memo,
)
from .sandbox import Call, call_limited


def launch_triton_forward(kernel, Q, K, V, causal=False, scale=None, Br=16, Bc=16, out=None):
    """Run the Triton kernel on torch tensors Q (Nq, d), K, V (Nk, d) of float32:
    one program per Q tile of Br rows, grid (ceil(Nq / Br),). Returns (O, L).

    The kernel's signature: kernel(Q, K, V, O, L, scale, Nq, Nk, stride_q, stride_k, stride_v,
    stride_o, D: tl.constexpr, Br: tl.constexpr, Bc: tl.constexpr, CAUSAL: tl.constexpr),
    with D = d a power of two >= 16. ``out`` = (O, L) writes into given tensors."""
    import torch
    import triton

    Nq, d = Q.shape
    Nk = K.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if out is None:
        out = (torch.empty_like(Q), torch.empty(Nq, dtype=torch.float32, device=Q.device))
    O, L = out
    kernel[(triton.cdiv(Nq, Br),)](Q, K, V, O, L, float(scale), Nq, Nk, Q.stride(0),
                                   K.stride(0), V.stride(0), O.stride(0), D=d, Br=Br, Bc=Bc,
                                   CAUSAL=bool(causal))
    return O, L


def _triton_invoke(fn, case, timeout, measure):
    import torch

    q, k, v, causal, scale, Br, Bc, strided = case.args[:8]
    twice = bool(case.args[8]) if len(case.args) > 8 else False
    device = runtime.kernel_device()
    width = (lambda name: STRIDES.get(name)) if strided else (lambda name: None)
    ins = [_padded_rows(a, float("nan"), device, width(n)) for n, a in zip("QKV", (q, k, v))]
    # O and L start as NaN, as torch.empty may leave them: a row never stored shows
    outs = [_padded_rows(np.full_like(a, np.nan), SENTINEL, device, width(n))
            for n, a in zip("OL", (q, q[:, 0]))]
    before = [buf.clone() for buf, _ in ins]
    again = []

    def launch():
        launch_triton_forward(fn, *(view for _, view in ins), causal, scale, Br, Bc,
                              out=tuple(view for _, view in outs))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return tuple(view.cpu().numpy().copy() for _, view in outs)

    def run():
        with _watch_loads([view for _, view in ins + outs]) as seen:
            first = launch()
            if twice:  # the same O and L, holding the first call's answer
                again.extend(zip("OL", launch()))
        call.reads = dict(seen)
        return first

    call = Call()
    done = call_limited(run, timeout=timeout, measure_memory=measure)
    done.reads = call.reads
    done.buffers = {"in": [(name, buf, old) for name, (buf, _), old in zip("QKV", ins, before)],
                    "out": [(name, buf, tuple(view.shape)) for name, (buf, view) in zip("OL", outs)],
                    "again": again}
    return done


H_TRITON = ("One program per Q tile: load Q_i (Br x D) once, loop over K_j, V_j tiles of Bc "
            "rows, S_ij = tl.dot(Q_i, tl.trans(K_j)) * scale, online softmax on m_i, l_i, "
            "O_i += tl.dot(P_ij, V_j) after rescaling; store O_i / l_i and L_i = m_i + log(l_i).")
H_TRITON_MASK = (" Rows past Nq and keys past Nk: load with mask=... and other=0.0, set the "
                 "scores of keys >= Nk to -inf, and store with a mask. (Here the memory after "
                 "the last row holds NaN: an unmasked load brings it in.)")


def _triton_case(label, hint, shape, tiles, causal, scale, kind, seed, strided=False,
                 twice=False):
    (Q, K, V), (q, k, v) = _inputs(shape, kind, F32, seed)
    on_gpu = not runtime.triton_interpreted()

    def compute():
        ref = reference.naive_attention(Q, K, V, causal=causal, scale=scale)
        naive = (_naive_tf32 if on_gpu else reference.naive_attention)(q, k, v, causal=causal,
                                                                       scale=scale)
        # correct kernels in float32 set the allowance too: O kept normalized key by key, and
        # FlashAttention's own loop at this case's tiles
        variants = (normalized_key_by_key(q, k, v, causal, scale),
                    tiled.flash_forward(q, k, v, *tiles, causal=causal, scale=scale))
        return ref, naive, variants, _forward_rounding(q, k, v, causal, scale, ref, on_gpu)

    (O, L), naive, variants, rounding = _memo(("triton forward", label), compute)
    case = Case(label, hint, (q, k, v, causal, scale) + tiles + (strided, twice), ("O", "L"),
                (O, L), naive, inputs=("Q", "K", "V"), dtype=F32, probe=_backward_bounds_probe,
                variants=variants, rounding=tuple(float(r) for r in rounding),
                floor_scale=100.0 if on_gpu else 0.0)  # TF32 dots: ~1e-3 relative
    if twice:
        case.probe = _repeat_probe(case, _backward_bounds_probe)
    return case


def _naive_tf32(q, k, v, causal, scale):
    """Plain attention in float32 with every dot's operands read as TF32, as a Triton kernel's
    tl.dot reads them on a GPU. Its error sets the tolerance there: with logits in the
    hundreds, TF32 scores are off by ~|S| / 1000, so a correct kernel misses the float64 answer
    by far more than float32 arithmetic would. (cuBLAS with TF32 allowed is no model: it keeps
    small problems in full float32.)"""
    S, _ = _scores_tf32(q, k, causal, scale)
    m = S.max(axis=1, keepdims=True)
    P = np.exp(S - m)
    l = P.sum(axis=1, keepdims=True)
    return (tf32(P) @ tf32(v)) / l, (m + np.log(l))[:, 0]


def _triton_cases():
    return [_triton_case(*spec) for spec in _triton_specs()]


# A case: (label, hint, (Nq, Nk, d), (Br, Bc), causal, scale, kind of inputs, seed, strided,
# called twice).
def _triton_specs():
    d, t16 = 16, (16, 16)
    M = H_TRITON_MASK

    def t(label, hint, shape, tiles, causal, scale, kind, seed, strided=False, twice=False):
        return (label, hint, shape, tiles, causal, scale, kind, seed, strided, twice)

    return [
        t("one tile, Nq=Nk=16", H_TRITON, (16, 16, d), t16, False, None, "normal", 1),
        t("several tiles, Nq=Nk=64", H_TILES, (64, 64, d), t16, False, None, "normal", 2),
        t("edge tiles, Nq=37, Nk=53", H_EDGE + M, (37, 53, d), t16, False, None, "normal", 3),
        t("N=1", H_N1 + M, (1, 1, d), t16, False, None, "normal", 4),
        t("Nq=10 < Nk=45", H_NQNK + M, (10, 45, d), t16, False, None, "normal", 5),
        t("Nq=45 > Nk=10", H_NQNK + M, (45, 10, d), t16, False, None, "normal", 6),
        t("Br=32, Bc=16", "Br and Bc differ: use each where it belongs.", (40, 40, d), (32, 16),
          False, None, "normal", 7),
        t("explicit scale=0.3", H_SCALE, (20, 30, d), t16, False, 0.3, "normal", 8),
        t("logits in the hundreds", H_WIDE, (24, 40, d), t16, False, None, "wide", 9),
        t("causal, Nq=Nk=64", H_CAUSAL, (64, 64, d), t16, True, None, "normal", 10),
        t("causal, Nq=Nk=37", H_CAUSAL + M, (37, 37, d), t16, True, None, "normal", 11),
        t("causal, Nq=20 < Nk=53", H_CAUSAL, (20, 53, d), t16, True, None, "normal", 12),
        t("causal, Nq=53 > Nk=20", H_CAUSAL, (53, 20, d), t16, True, None, "normal", 13),
        t("causal, Br=32, Bc=16", H_CAUSAL, (40, 40, d), (32, 16), True, None, "normal", 14),
        t("causal, Br=16, Bc=32", H_CAUSAL, (40, 40, d), (16, 32), True, None, "normal", 15),
        t("causal, N=1", H_CAUSAL, (1, 1, d), t16, True, None, "normal", 16),
        t("causal, logits in the hundreds", H_WIDE, (24, 40, d), t16, True, None, "wide", 17),
        t("causal, a future key dominates", H_FUTURE, (40, 40, d), t16, True, None, "future",
          18),
        t("row strides differ from d: Nq=21, Nk=27", H_STRIDES_FWD, (21, 27, d), t16, False,
          None, "normal", 19, strided=True),
        t("causal, Br=16, Bc=32, row strides differ from d", H_CAUSAL + " " + H_STRIDES_FWD,
          (45, 45, d), (16, 32), True, None, "normal", 20, strided=True),
        t("Nq=Nk=300, Br=64, Bc=32", H_LONG + M, (300, 300, d), (64, 32), False, None,
          "normal", 21),
        t("called twice into the same O and L, causal, Nq=37, Nk=45", H_TWICE, (37, 45, d), t16,
          True, None, "normal", 22, twice=True),
    ]


H_STRIDES_FWD = ("Each tensor's rows are further apart than D here (views into wider buffers, "
                 "each with its own row stride, NaN in the gaps): address row r of Q as Q + r * "
                 "stride_q, of K as K + r * stride_k, of O as O + r * stride_o; never r * D.")


EXERCISES = [
    Exercise("triton_forward_kernel", 4, "flash_forward_kernel", _triton_cases,
             invoke=_triton_invoke, diagnose=_diagnose_kernel, timeout=120.0,
             requires=_triton_unavailable, unfilled=_still_skeleton,
             inspect=lambda k: _kernel_problem(k, "forward"), gate=_gate("forward")),
]
