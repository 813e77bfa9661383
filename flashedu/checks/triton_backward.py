"""The Triton backward exercise (the paper's Algorithm 4): the learner's dK/dV kernel (K/V tiles
outside) and dQ kernel (Q tiles outside), each graded on its own outputs.
``launch_triton_backward`` runs the pair; ``launch_dkdv`` and ``launch_dq`` launch one each
(all three shown in the notebook). What the checks enforce: :mod:`.kernels`.
"""

from __future__ import annotations

import math

import numpy as np

from .. import reference, runtime
from . import compare
from .engine import Case, Exercise, allowance
from .kernel_common import (
    F32,
    H_LONG,
    H_TWICE,
    SENTINEL,
    STRIDES,
    _backward_bounds_probe,
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
    F64,
    H_EDGE,
    H_N1,
    H_NQNK,
    H_SCALE,
    _backward_in_dtype,
    _inputs,
    _memo,
    _normal,
)
from .sandbox import call_limited


def launch_triton_backward(dkdv_kernel, dq_kernel, Q, K, V, O, dO, L, causal=False, scale=None,
                           Br=16, Bc=16):
    """The backward of one head: Q (Nq, d), K, V (Nk, d), O, dO (Nq, d) float32 torch tensors,
    L (Nq,) the natural-log logsumexp of the forward. Returns (dQ, dK, dV).

    Delta_i = rowsum(dO_i * O_i) (the paper's D_i) is computed here, in torch; then two
    launches: ``dkdv_kernel`` (one program per K/V tile, see launch_dkdv) and ``dq_kernel``
    (one program per Q tile, see launch_dq). No program adds into another's output."""
    import torch

    d = Q.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    Delta = (dO * O).sum(dim=1)  # one float per query row
    dQ = torch.empty(Q.shape, dtype=torch.float32, device=Q.device)
    dK = torch.empty(K.shape, dtype=torch.float32, device=K.device)
    dV = torch.empty(V.shape, dtype=torch.float32, device=V.device)
    launch_dkdv(dkdv_kernel, Q, K, V, dO, L, Delta, dK, dV, causal, scale, Br, Bc)
    launch_dq(dq_kernel, Q, K, V, dO, L, Delta, dQ, causal, scale, Br, Bc)
    return dQ, dK, dV


def launch_dkdv(kernel, Q, K, V, dO, L, Delta, dK, dV, causal, scale, Br, Bc):
    """One program per K/V tile j of Bc keys: grid (ceil(Nk / Bc),). The kernel writes dK, dV.

    kernel(Q, K, V, dO, L, Delta, dK, dV, scale, Nq, Nk, stride_q, stride_k, stride_v,
    stride_do, stride_dk, stride_dv, D: tl.constexpr, Br: tl.constexpr, Bc: tl.constexpr,
    CAUSAL: tl.constexpr); stride_x is the distance between two rows of x, in elements."""
    import triton

    (Nq, d), Nk = Q.shape, K.shape[0]
    kernel[(triton.cdiv(Nk, Bc),)](Q, K, V, dO, L, Delta, dK, dV, float(scale), Nq, Nk,
                                   Q.stride(0), K.stride(0), V.stride(0), dO.stride(0),
                                   dK.stride(0), dV.stride(0), D=d, Br=Br, Bc=Bc,
                                   CAUSAL=bool(causal))


def launch_dq(kernel, Q, K, V, dO, L, Delta, dQ, causal, scale, Br, Bc):
    """One program per Q tile i of Br rows: grid (ceil(Nq / Br),). The kernel writes dQ.

    kernel(Q, K, V, dO, L, Delta, dQ, scale, Nq, Nk, stride_q, stride_k, stride_v, stride_do,
    stride_dq, D: tl.constexpr, Br: tl.constexpr, Bc: tl.constexpr, CAUSAL: tl.constexpr)."""
    import triton

    (Nq, d), Nk = Q.shape, K.shape[0]
    kernel[(triton.cdiv(Nq, Br),)](Q, K, V, dO, L, Delta, dQ, float(scale), Nq, Nk,
                                   Q.stride(0), K.stride(0), V.stride(0), dO.stride(0),
                                   dQ.stride(0), D=d, Br=Br, Bc=Bc, CAUSAL=bool(causal))


def _backward_invoke(which):
    """Launch the learner's dK/dV kernel (which = "dkdv") or dQ kernel (which = "dq") alone,
    on NaN-padded inputs and sentinel-padded outputs."""

    def invoke(fn, case, timeout, measure):
        import torch

        q, k, v, o, do, l, causal, scale, Br, Bc, strided = case.args[:11]
        twice = bool(case.args[11]) if len(case.args) > 11 else False
        device = runtime.kernel_device()
        width = (lambda name: STRIDES.get(name)) if strided else (lambda name: None)
        ins = {name: _padded_rows(a, float("nan"), device, width(name))
               for name, a in (("Q", q), ("K", k), ("V", v), ("dO", do), ("L", l))}
        delta = (torch.from_numpy(do) * torch.from_numpy(o)).sum(dim=1).numpy()
        ins["Delta"] = _padded_rows(delta, float("nan"), device)
        before = {name: buf.clone() for name, (buf, _) in ins.items()}
        names = ("dK", "dV") if which == "dkdv" else ("dQ",)
        like = {"dQ": q, "dK": k, "dV": v}
        # the outputs start as NaN, as torch.empty may leave them: a tile never stored, or an
        # accumulator added to what the output held, shows
        outs = {name: _padded_rows(np.full_like(like[name], np.nan), SENTINEL, device,
                                   width(name))
                for name in names}
        s = 1.0 / math.sqrt(q.shape[1]) if scale is None else scale
        views = {name: view for name, (_, view) in ins.items()}

        seen, again = {}, []

        def launch():
            args = (fn, views["Q"], views["K"], views["V"], views["dO"], views["L"],
                    views["Delta"])
            if which == "dkdv":
                launch_dkdv(*args, outs["dK"][1], outs["dV"][1], causal, s, Br, Bc)
            else:
                launch_dq(*args, outs["dQ"][1], causal, s, Br, Bc)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return tuple(view.cpu().numpy().copy() for _, view in outs.values())

        def run():
            watched = list(views.values()) + [view for _, view in outs.values()]
            with _watch_loads(watched) as counted:
                got = launch()
                if twice:  # the same outputs, holding the first call's answer
                    again.extend(zip(names, launch()))
            seen.update(counted)
            return got if len(got) > 1 else got[0]

        call = call_limited(run, timeout=timeout, measure_memory=measure)
        call.reads = dict(seen)
        call.buffers = {"in": [(name, buf, before[name]) for name, (buf, _) in ins.items()],
                        "out": [(name, buf, like[name].shape) for name, (buf, _) in outs.items()],
                        "again": again}
        return call

    return invoke


H_DKDV = ("One program per K/V tile j: load K_j, V_j once, set dK_j = dV_j = 0, loop over the "
          "Q tiles i: S_ij = tl.dot(Q_i, tl.trans(K_j)) * scale, P_ij = exp(S_ij - L_i) (zero "
          "where masked), dV_j += tl.dot(tl.trans(P_ij), dO_i), dP_ij = tl.dot(dO_i, "
          "tl.trans(V_j)), dS_ij = P_ij * (dP_ij - Delta_i), dK_j += scale * "
          "tl.dot(tl.trans(dS_ij), Q_i); store dK_j and dV_j.")
H_DQ = ("One program per Q tile i: load Q_i, dO_i, L_i, Delta_i once, set dQ_i = 0, loop over "
        "the K/V tiles j: recompute S_ij, P_ij = exp(S_ij - L_i), dP_ij = tl.dot(dO_i, "
        "tl.trans(V_j)), dS_ij = P_ij * (dP_ij - Delta_i), dQ_i += scale * tl.dot(dS_ij, K_j); "
        "store dQ_i.")
H_BWD_MASK = (" Rows past Nq and keys past Nk: load Q_i, dO_i, L_i, Delta_i, K_j, V_j with "
              "mask=... and other=0.0, give masked pairs P_ij = 0, and store with a mask. (Here "
              "the memory after each input holds NaN: an unmasked load brings it in.)")
H_STRIDES = ("Each tensor's rows are further apart than D here (views into wider buffers, "
             "each with its own row stride): address row r of Q as Q + r * stride_q, of dO as "
             "dO + r * stride_do, and so on; never r * D, and never one tensor's stride for "
             "another.")
H_BWD_CAUSAL = {
    "dkdv": ("causal: key j is visible to query i when j <= i (the diagonal too), and masked "
             "pairs get P_ij = 0. The program of K/V tile j may skip only the Q rows before "
             "its first key j * Bc (they see none of the tile): start its Q loop at "
             "(j * Bc // Br) * Br, as Br and Bc may differ."),
    "dq": ("causal: key j is visible to query i when j <= i (the diagonal too), and masked "
           "pairs get P_ij = 0. The program of Q tile i may skip only the keys past its last "
           "row (i + 1) * Br - 1: end its K/V loop at min(Nk, (i + 1) * Br), as Br and Bc "
           "may differ."),
}
H_BWD_WIDE = ("Logits differ by hundreds: P_ij = exp(S_ij - L_i) with the saved L_i is already "
              "normalized and never overflows for a visible pair; keep masked pairs out of the "
              "exp (tl.where before it), or they can overflow to inf, and inf * 0 is NaN.")


def _backward_triton_case(label, hint, shape, tiles, causal, scale, kind, seed, outputs,
                          strided=False, twice=False):
    (Q, K, V), (q, k, v) = _inputs(shape, kind, F32, seed)
    on_gpu = not runtime.triton_interpreted()

    def compute():
        O, L = reference.naive_attention(Q, K, V, causal=causal, scale=scale)
        dO = _normal(seed + 1000, *O.shape)
        o, l, do = (np.asarray(a, dtype=F32) for a in (O, L, dO))
        grads = reference.naive_attention_backward(Q, K, V, do.astype(F64), causal=causal,
                                                   scale=scale)
        naive = (_naive_backward_tf32 if on_gpu else _backward_in_dtype)(q, k, v, o, do, l,
                                                                         causal, scale)
        other = _backward_in_dtype(q, k, v, o, do, l, causal, scale, delta="P dP")
        return (o, l, do), grads, naive, other, _backward_rounding(q, k, v, o, do, l, causal,
                                                                   scale, grads, on_gpu)

    (o, l, do), grads, naive, other, rounding = _memo(("triton backward", label), compute)
    pick = {"dQ": 0, "dK": 1, "dV": 2}
    case = Case(label, hint, (q, k, v, o.copy(), do.copy(), l.copy(), causal, scale) + tiles
                + (strided, twice), outputs, tuple(grads[pick[n]] for n in outputs),
                tuple(naive[pick[n]] for n in outputs), inputs=("Q", "K", "V", "O", "dO", "L"),
                dtype=F32, probe=_backward_bounds_probe,
                variants=(tuple(other[pick[n]] for n in outputs),),
                rounding=tuple(float(rounding[pick[n]]) for n in outputs),
                # TF32 dots on a GPU: the gradients chain two of them (dP, then dS^T Q), and
                # Triton's TF32 rounding is not cuBLAS's; measured on an H100, a correct kernel
                # reached 4.4x the naive TF32 error (2.7e-3) where the forward stays under 4x.
                # A wrong kernel misses by 1e-1 or more.
                floor_scale=250.0 if on_gpu else 0.0)
    case.float64_inputs = (Q, K, V, do.astype(F64), l.astype(F64), o.astype(F64))
    if twice:
        case.probe = _repeat_probe(case, _backward_bounds_probe)
    return case


def _backward_rounding(q, k, v, o, do, l, causal, scale, grads, gpu):
    """(dQ, dK, dV)'s allowances from rounding on this draw (flashedu.tolerance), with Delta as
    the launcher computes it (float32)."""
    from .. import tolerance

    delta = (do * o).sum(axis=1, dtype=F32)
    bounds = tolerance.attention_backward_rounding(
        q, k, v, do, l, delta, causal=causal, scale=scale, dtype="float32",
        dot_unit=tolerance.TF32_UNIT if gpu else None)
    return tolerance.allowances(bounds, grads)


def _naive_backward_tf32(q, k, v, o, do, l, causal, scale):
    """The backward's formulas in float32 with every dot's operands read as TF32, as the
    kernels' tl.dot reads them on a GPU: its error sets the tolerance there (as _naive_tf32
    does for the forward)."""
    S, scale = _scores_tf32(q, k, causal, scale)
    with np.errstate(all="ignore"):
        P = np.exp(S - l[:, None])
        dS = P * (tf32(do) @ tf32(v).T - (do * o).sum(axis=1, keepdims=True))
    scale = F32(scale)
    return (scale * (tf32(dS) @ tf32(k)), scale * (tf32(dS).T @ tf32(q)), tf32(P).T @ tf32(do))


def _backward_triton_cases(which):
    outputs = {"dkdv": ("dK", "dV"), "dq": ("dQ",)}[which]
    return [_backward_triton_case(*spec[:8], outputs, *spec[8:])
            for spec in _backward_specs(which)]


# A case: (label, hint, (Nq, Nk, d), (Br, Bc), causal, scale, kind of inputs, seed, strided,
# called twice).
def _backward_specs(which):
    hint = {"dkdv": H_DKDV, "dq": H_DQ}[which]
    d, t16, M = 16, (16, 16), H_BWD_MASK

    def t(label, h, shape, tiles, causal, scale, kind, seed, strided=False, twice=False):
        return (label, h, shape, tiles, causal, scale, kind, seed, strided, twice)

    C = H_BWD_CAUSAL[which]
    out = {"dkdv": "dK and dV", "dq": "dQ"}[which]
    return [
        t("one tile, Nq=Nk=16", hint, (16, 16, d), t16, False, None, "normal", 1),
        t("several tiles, Nq=Nk=64", hint, (64, 64, d), t16, False, None, "normal", 2),
        t("edge tiles, Nq=37, Nk=53", H_EDGE + M, (37, 53, d), t16, False, None, "normal", 3),
        t("N=1", H_N1 + M, (1, 1, d), t16, False, None, "normal", 4),
        t("Nq=10 < Nk=45", H_NQNK + M, (10, 45, d), t16, False, None, "normal", 5),
        t("Nq=45 > Nk=10", H_NQNK + M, (45, 10, d), t16, False, None, "normal", 6),
        t("Br=32, Bc=16", "Br and Bc differ: Q tiles have Br rows, K/V tiles Bc.", (40, 40, d),
          (32, 16), False, None, "normal", 7),
        t("Br=16, Bc=32", "Br and Bc differ: Q tiles have Br rows, K/V tiles Bc.", (40, 40, d),
          (16, 32), False, None, "normal", 8),
        t("explicit scale=0.3", H_SCALE, (20, 30, d), t16, False, 0.3, "normal", 9),
        t("row strides differ from d: Nq=21, Nk=27", H_STRIDES, (21, 27, d), t16, False, None,
          "normal", 10, strided=True),
        t("logits in the hundreds", H_BWD_WIDE, (24, 40, d), t16, False, None, "wide", 11),
        t("causal, Nq=Nk=64", C, (64, 64, d), t16, True, None, "normal", 12),
        t("causal, Nq=Nk=37", C + M, (37, 37, d), t16, True, None, "normal", 13),
        t("causal, Nq=20 < Nk=53", C, (20, 53, d), t16, True, None, "normal", 14),
        t("causal, Nq=53 > Nk=20", C, (53, 20, d), t16, True, None, "normal", 15),
        t("causal, Br=32, Bc=16", C, (40, 40, d), (32, 16), True, None, "normal", 16),
        t("causal, Br=16, Bc=32", C, (40, 40, d), (16, 32), True, None, "normal", 17),
        t("causal, N=1", C, (1, 1, d), t16, True, None, "normal", 18),
        t("causal, scale=2.0, row strides differ from d", C + " " + H_STRIDES, (33, 29, d),
          t16, True, 2.0, "normal", 19, strided=True),
        t("causal, logits in the hundreds", H_BWD_WIDE, (24, 40, d), t16, True, None, "wide",
          20),
        t("causal, a future key dominates", C + " " + H_BWD_WIDE, (40, 40, d), t16, True, None,
          "future", 21),
        t("Nq=Nk=300, Br=64, Bc=32", H_LONG + " " + hint + M, (300, 300, d), (64, 32), False,
          None, "normal", 22),
        t(f"called twice into the same {out}, causal, Nq=37, Nk=45", H_TWICE, (37, 45, d), t16,
          True, None, "normal", 23, twice=True),
    ]


def _variants(case):
    """Gradients (dQ, dK, dV) of the usual mistakes, in float64, for the diagnosis."""
    Q, K, V, dO, L, O = case.float64_inputs
    causal, scale = case.args[6], case.args[7]
    s = 1.0 / math.sqrt(Q.shape[1]) if scale is None else scale
    S = s * (Q @ K.T)

    def grads(P, delta=True, of=O):
        dS = P * (dO @ V.T - ((dO * of).sum(1, keepdims=True) if delta else 0.0))
        return s * dS @ K, s * dS.T @ Q, P.T @ dO

    visible = reference.causal_mask(*S.shape) if causal else np.ones(S.shape, dtype=bool)
    P = np.where(visible, np.exp(np.where(visible, S, 0.0) - L[:, None]), 0.0)
    right = grads(P)
    out = {
        "without Delta_i (dS_ij = P_ij * dP_ij)": grads(P, delta=False),
        "with Delta_i = rowsum(dO_i * Q_i)": grads(P, of=Q),
        "without the factor scale": (right[0] / s, right[1] / s, right[2]),
        "with the factor scale twice": (right[0] * s, right[1] * s, right[2]),
    }
    if causal:
        strict = np.tri(*S.shape, k=-1, dtype=bool)
        Ps = np.where(strict, np.exp(np.where(strict, S, 0.0) - L[:, None]), 0.0)
        out["with the causal mask j < i instead of j <= i"] = grads(Ps)
    return out


H_VARIANT = {
    "without Delta_i (dS_ij = P_ij * dP_ij)": (
        "dS_ij = P_ij * (dP_ij - Delta_i): subtract Delta_i (loaded with the rows of the Q "
        "tile, one per row) before multiplying by P_ij."),
    "with Delta_i = rowsum(dO_i * Q_i)": (
        "Delta_i = rowsum(dO_i * O_i), with O the forward's output, not Q_i (the launcher "
        "computes it from O: load it from Delta, one value per row)."),
    "without the factor scale": (
        "S_ij = scale * Q_i K_j^T, so the chain rule brings scale into dQ and dK: "
        "dQ_i += scale * dS_ij K_j, dK_j += scale * dS_ij^T Q_i."),
    "with the factor scale twice": (
        "scale enters dQ and dK once: either inside the loop or at the store, not both."),
    "with the causal mask j < i instead of j <= i": (
        "query i sees key j when j <= i: the diagonal is visible."),
}


def _diagnose_backward_kernel(case, wrong, outputs):
    notes = []
    if any(np.isnan(outputs[name]).any() for name in wrong):
        names = " and ".join(case.outputs)
        notes.append("NaN:")
        if case.args[10]:  # the strided case
            notes.append("here each tensor has its own row stride, with NaN between the rows: "
                         "a kernel that addresses row r as X + r * D, or with another tensor's "
                         "stride, reads it, and a store addressed that way leaves rows of "
                         f"{names} never stored (address row r of {case.outputs[0]} as "
                         f"{case.outputs[0]} + r * stride_{case.outputs[0].lower()}). Or")
        notes.append(f"rows of {names} never stored (the check starts them as NaN, as "
                     "torch.empty may leave them: each program stores all of its tile), an "
                     "accumulator added to what the output held instead of starting at zero, a "
                     "load that read past the end of its tensor (the check keeps NaN after "
                     "each input: mask the loads of Q_i, dO_i, L_i, Delta_i with rows < Nq and "
                     "of K_j, V_j with cols < Nk, other=0.0), or exp that overflowed for a "
                     "masked pair (apply the mask before the exp) so that inf * 0 became NaN.")
        return " ".join(notes)
    pick = {"dQ": 0, "dK": 1, "dV": 2}
    ref = {name: case.expected[case.outputs.index(name)] for name in wrong}
    tol = {name: allowance(case, case.outputs.index(name)) for name in wrong}
    with np.errstate(all="ignore"):  # a mistake's gradients may overflow: they only compare
        variants = _variants(case)
    for label, grads in variants.items():
        mistake = {name: grads[pick[name]] for name in wrong}
        if all(compare.error(outputs[n], mistake[n]) <= tol[n] for n in wrong) and \
                all(compare.error(mistake[n], ref[n]) > tol[n] for n in wrong):
            return (f"Your {' and '.join(sorted(wrong))} {'is' if len(wrong) == 1 else 'are'} "
                    f"what one gets {label}: "
                    f"{H_VARIANT[label]}")
    if case.outputs == ("dK", "dV"):
        if wrong.keys() == {"dV"}:
            return ("dV is wrong but dK is right: check dV_j += P_ij^T dO_i (P_ij transposed: "
                    "tl.dot(tl.trans(P_ij), dO_i)), accumulated over every Q tile i.")
        if wrong.keys() == {"dK"}:
            return ("dV is right, so P_ij is; dK is not: check dP_ij = dO_i V_j^T, dS_ij = "
                    "P_ij * (dP_ij - Delta_i) and dK_j += scale * dS_ij^T Q_i, accumulated over "
                    "every Q tile i.")
        return ("dK and dV are both wrong, so P_ij is (dV needs nothing else): P_ij = "
                "exp(scale * Q_i K_j^T - L_i) with the forward's natural-log L_i, zero for "
                "masked pairs, and every Q tile that sees tile j visited.")
    return ("dQ_i = scale * sum over the K/V tiles j of dS_ij K_j, with P_ij = exp(scale * "
            "Q_i K_j^T - L_i) and dS_ij = P_ij * (dO_i V_j^T - Delta_i); every K/V tile that "
            "tile i sees must be visited.")


EXERCISES = [
    Exercise("triton_backward_dkdv_kernel", 4, "dkdv_kernel",
             lambda: _backward_triton_cases("dkdv"),
             invoke=_backward_invoke("dkdv"), diagnose=_diagnose_backward_kernel,
             timeout=120.0, requires=_triton_unavailable, unfilled=_still_skeleton,
             inspect=lambda k: _kernel_problem(k, "dkdv"), gate=_gate("dkdv")),
    Exercise("triton_backward_dq_kernel", 3, "dq_kernel",
             lambda: _backward_triton_cases("dq"),
             invoke=_backward_invoke("dq"), diagnose=_diagnose_backward_kernel,
             timeout=120.0, requires=_triton_unavailable, unfilled=_still_skeleton,
             inspect=lambda k: _kernel_problem(k, "dq"), gate=_gate("dq")),
]
