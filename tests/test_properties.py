"""Properties of the public API, checked on inputs that hypothesis draws.

``flashedu.attention`` on every backend against the float64 reference, with the project's
tolerance rule (:mod:`flashedu.checks.compare`: a few times what correct attention computed in
the same dtype misses by): shapes (N = 1, primes, Nq != Nk, odd d, GQA ratios), dtypes, layouts
(transposed, expanded, strided, negative and conjugate views), scales, masks, NaN and inf inputs
(the same rows non-finite as SDPA), subsets of inputs that require grad, ``no_grad`` and
``inference_mode``. Then ``BlockMask`` and the command line's argument parsing.

The Triton interpreter and the numba simulator run each example in Python, so they get few,
small examples. Profiles: "ci" (the default) is derandomized, so CI sees the same examples every
run; ``HYPOTHESIS_PROFILE=dev`` draws fresh ones (and more, with ``HYPOTHESIS_EXAMPLES_X=4``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashedu
from flashedu import BlockMask
from flashedu.checks import compare
from flashedu.reference import naive_attention_torch, reference_attention
from flashedu.tolerance import allowed_error

settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
X = int(os.environ.get("HYPOTHESIS_EXAMPLES_X", "1"))

GPU = torch.cuda.is_available()
LAYOUTS = ("contiguous", "transposed", "strided", "expanded", "neg", "conj", "neg_strided")


# ----- what each backend gets -------------------------------------------------------------------
class Caps:
    def __init__(self, dtypes, max_n, max_heads, block_sizes, d_values, examples, grad_examples,
                 backward=True, device="cpu"):
        self.dtypes, self.max_n, self.max_heads = dtypes, max_n, max_heads
        self.block_sizes, self.d_values, self.device = block_sizes, d_values, device
        self.examples, self.grad_examples, self.backward = examples, grad_examples, backward


ALL_D = (1, 2, 3, 5, 8, 16, 17, 31, 64)
SMALL_BLOCKS = (1, 2, 3, 4, 5, 8, 16)
CAPS = {
    "naive": Caps((torch.float64, torch.float32, torch.float16, torch.bfloat16), 70, 6,
                  SMALL_BLOCKS, ALL_D, 60, 30),
    "numpy": Caps((torch.float64, torch.float32, torch.float16, torch.bfloat16), 70, 6,
                  SMALL_BLOCKS, ALL_D, 40, 20),
    # triton's tiles are 16..128 rows: a block mask's sides are multiples of 16
    "triton": Caps((torch.float32, torch.float16, torch.bfloat16), 40, 4, (16, 32),
                   (1, 3, 8, 16, 17, 32), 12, 6, device="cuda" if GPU else "cpu"),
    # float64 is refused (the kernel computes in float32); each simulated thread is a Python thread
    "numba": Caps((torch.float32, torch.float16), 24, 2, (3, 4, 8, 16), (1, 3, 8, 16), 6, 0,
                  backward=False),
}


def available(name):
    reason = flashedu.available_backends()[name]
    if reason is not None:
        pytest.skip(f"backend {name} unavailable: {reason}")


def lengths(max_n):
    """Sequence lengths: 1, primes and powers of two first, then anything up to max_n."""
    special = [n for n in (1, 2, 3, 7, 13, 16, 17, 31, 32, 37, 61, 64) if n <= max_n]
    return st.one_of(st.sampled_from(special), st.integers(1, max_n))


@st.composite
def problems(draw, backend, masks=True):
    caps = CAPS[backend]
    Hkv = draw(st.integers(1, max(1, caps.max_heads // 2)))
    group = draw(st.integers(1, max(1, caps.max_heads // Hkv)))
    p = dict(B=draw(st.integers(1, 2)), H=Hkv * group, Hkv=Hkv,
             Nq=draw(lengths(caps.max_n)), Nk=draw(lengths(caps.max_n)),
             d=draw(st.sampled_from(caps.d_values)), dtype=draw(st.sampled_from(caps.dtypes)),
             layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(3)),
             magnitude=draw(st.sampled_from((0.5, 1.0, 3.0, 30.0))), seed=draw(st.integers(0, 2**16)))
    # self-attention on one tensor: q, k and v the same object (aliased memory)
    p["alias"] = masks and draw(st.sampled_from((False, False, False, True)))
    if p["alias"]:
        p.update(Hkv=p["H"], Nk=p["Nq"], layouts=(p["layouts"][0],) * 3)
    p["enable_gqa"] = p["H"] != p["Hkv"] or draw(st.booleans())
    p["scale"] = draw(st.one_of(st.none(), st.floats(0.01, 2.0),
                                st.floats(0.01, 2.0).map(np.float32)))
    p["is_causal"] = draw(st.booleans())
    p["block_mask"] = draw(block_masks(p, caps.block_sizes, backend)) if masks else None
    if p["block_mask"] is not None and draw(st.booleans()):
        p["is_causal"] = False  # the mask's own causal flag (or none) decides alone
    return p


@st.composite
def block_masks(draw, p, block_sizes, backend):
    # an exact sliding window is a mask mod: only backends that apply one get it
    window = ("window",) if flashedu.backends.BACKENDS[backend].has_mask_mod else ()
    kind = draw(st.sampled_from(("none", "none", "dense", "causal", *window)))
    if kind == "none":
        return None
    Br, Bc = draw(st.sampled_from(block_sizes)), draw(st.sampled_from(block_sizes))
    seq = (p["Nq"], p["Nk"])
    if kind == "causal":
        return BlockMask.causal(seq, (Br, Bc))
    if kind == "window":
        return BlockMask.sliding_window(seq, (Br, Bc), window=draw(st.integers(1, 40)),
                                        causal=draw(st.booleans()))
    Tr, Tc = -(-p["Nq"] // Br), -(-p["Nk"] // Bc)
    b = draw(st.sampled_from((1, p["B"])))
    h = draw(st.sampled_from((1, p["H"])))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    density = draw(st.sampled_from((0.0, 0.3, 0.7, 1.0)))
    return BlockMask.from_dense(rng.random((b, h, Tr, Tc)) < density, (Br, Bc), seq,
                                is_causal=draw(st.booleans()))


def make(shape, dtype, layout, g, magnitude, device):
    """A tensor with the logical values magnitude * randn, in the given memory layout."""
    B, H, N, d = shape
    if layout == "expanded":  # one batch and head broadcast to all: stride 0
        t = torch.randn(1, 1, N, d, generator=g, dtype=torch.float64)
        return (magnitude * t).to(dtype).expand(B, H, N, d).to(device)
    t = (magnitude * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    if layout == "neg":  # the negative bit: stored as -t, read as t
        t = torch._neg_view(-t)
    elif layout == "conj":  # a real tensor's conjugate view is itself, as SDPA takes it
        t = t.conj()
    elif layout == "transposed":  # (B, N, H, d) in memory, as a projection's output
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout in ("strided", "neg_strided"):  # every other row and column of a larger tensor
        big = torch.zeros(B, H, 2 * N, 2 * d, dtype=dtype)
        big[:, :, ::2, ::2] = -t if layout == "neg_strided" else t
        t = big[:, :, ::2, ::2]
        if layout == "neg_strided":
            t = torch._neg_view(t)
    return t.to(device)


def tensors(p, device, requires=(False, False, False)):
    g = torch.Generator().manual_seed(p["seed"])
    if p.get("alias"):
        t = make((p["B"], p["H"], p["Nq"], p["d"]), p["dtype"], p["layouts"][0], g,
                 p["magnitude"], device)
        return [t.requires_grad_() if any(requires) else t] * 3
    shapes = [(p["B"], p["H"], p["Nq"], p["d"])] + [(p["B"], p["Hkv"], p["Nk"], p["d"])] * 2
    out = []
    for shape, layout, req in zip(shapes, p["layouts"], requires):
        t = make(shape, p["dtype"], layout, g, p["magnitude"], device)
        out.append(t.requires_grad_() if req else t)
    return out


def kwargs(p):
    return dict(is_causal=p["is_causal"], scale=p["scale"], block_mask=p["block_mask"],
                enable_gqa=p["enable_gqa"])


def ref_kwargs(p):
    kw = kwargs(p)
    kw["scale"] = None if p["scale"] is None else float(p["scale"])
    kw["is_causal"] = p["is_causal"] or (p["block_mask"] is not None and p["block_mask"].is_causal)
    return kw


def logical(t):
    """The values a tensor stands for, in float64 on the CPU (negative bit resolved)."""
    return t.detach().resolve_neg().resolve_conj().cpu().to(torch.float64)


def assert_close(name, got, ref, correct_in_dtype, dtype, floor_scale=1.0):
    """compare's rule: error at most NAIVE_FACTOR x what correct attention in this dtype misses,
    and never below the dtype's own floor: a half-precision kernel rounds P to its dtype before
    P @ V (as FlashAttention does), so where plain attention happens to be exact (one key: P = 1)
    a correct kernel may still miss by a unit in the last place of the output."""
    got, ref = got.detach().cpu().double().numpy(), ref.detach().cpu().double().numpy()
    candidates = [c.detach().cpu().double().numpy() for c in correct_in_dtype]
    errors = [e for e in (compare.error(c, ref) for c in candidates) if math.isfinite(e)]
    tol = allowed_error(dtype, max(errors, default=0.0), factor=compare.NAIVE_FACTOR,
                        floor_scale=floor_scale, floor_is_minimum=True)
    err = compare.error(got, ref)
    assert err <= tol, f"{name}: error {err:.3g} > tolerance {tol:.3g}"


def visible_rows(p):
    """(B, H, Nq) bool: which query rows see at least one key."""
    B, H, Nq, Nk = p["B"], p["H"], p["Nq"], p["Nk"]
    seen = torch.ones(B, H, Nq, Nk, dtype=torch.bool)
    if p["block_mask"] is not None:
        seen &= torch.as_tensor(p["block_mask"].expand(B, H).element_mask())
    if p["is_causal"]:
        seen &= torch.ones(Nq, Nk, dtype=torch.bool).tril()
    return seen.any(-1)


# ----- flashedu.attention against the float64 reference -------------------------------------
def check_forward(backend, p, mode, requires):
    caps = CAPS[backend]
    q, k, v = tensors(p, caps.device, requires)
    before = [logical(t).clone() for t in (q, k, v)]
    ctx = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad,
           "inference_mode": torch.inference_mode}[mode]
    with ctx():
        out = flashedu.attention(q, k, v, backend=backend, **kwargs(p))
    assert out.shape == (p["B"], p["H"], p["Nq"], p["d"]) and out.dtype == q.dtype
    assert out.device == q.device
    assert out.requires_grad == (mode == "grad" and any(requires))
    assert out.is_inference() == (mode == "inference_mode")
    for t, b in zip((q, k, v), before):  # the inputs are left as they were
        assert torch.equal(logical(t), b)
    ref = reference_attention(*(logical(t) for t in (q, k, v)), **ref_kwargs(p))
    lp = [t.detach().resolve_neg().cpu() for t in (q, k, v)]
    plain = naive_attention_torch(*lp, upcast=False, **ref_kwargs(p))
    sdpa_math = naive_attention_torch(*lp, upcast=True, **ref_kwargs(p))
    assert_close("out", out, ref, [plain, sdpa_math], p["dtype"])
    assert (out.cpu()[~visible_rows(p)] == 0).all(), "a row that sees no key must give zeros"


def stored_o_grads(q, k, v, dout, p):
    """float64 gradients by Algorithm 4's recipe with O stored in the input dtype: a correct
    FlashAttention backward in float16/bfloat16 computes D_i = rowsum(dO_i * O_i) from that O."""
    from flashedu.reference import expand_kv_heads, visible_mask_torch

    kw = ref_kwargs(p)
    H, Hkv, d = p["H"], p["Hkv"], p["d"]
    scale = 1 / math.sqrt(d) if kw["scale"] is None else kw["scale"]
    ke, ve = expand_kv_heads(k, H), expand_kv_heads(v, H)
    S = scale * q @ ke.transpose(-1, -2)
    mask = visible_mask_torch(p["Nq"], p["Nk"], is_causal=kw["is_causal"],
                              block_mask=kw["block_mask"])
    if mask is not None:
        S = S.masked_fill(~mask, -math.inf)
    m = S.amax(-1, keepdim=True)
    P = torch.exp(S - torch.where(torch.isinf(m), 0, m))
    P = P / torch.where(P.sum(-1, keepdim=True) == 0, 1, P.sum(-1, keepdim=True))
    O = (P @ ve).to(p["dtype"]).double()
    dS = P * (dout @ ve.transpose(-1, -2) - (dout * O).sum(-1, keepdim=True))
    fold = lambda t: t.reshape(p["B"], Hkv, H // Hkv, *t.shape[2:]).sum(2)  # noqa: E731
    return scale * dS @ ke, fold(scale * dS.transpose(-1, -2) @ q), fold(P.transpose(-1, -2) @ dout)


def check_backward(backend, p, requires, strided_dout):
    caps = CAPS[backend]
    q, k, v = tensors(p, caps.device, requires)
    out = flashedu.attention(q, k, v, backend=backend, **kwargs(p))
    assert out.requires_grad
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(p["seed"] + 1),
                       dtype=torch.float64)
    leaves = [t for t, r in zip((q, k, v), requires) if r]
    d_out = dout.to(out.dtype).to(out.device)
    if strided_dout:  # a gradient that arrives as a strided view (e.g. from a transpose)
        d_out = torch.zeros(*out.shape[:-1], 2 * out.shape[-1], dtype=out.dtype,
                            device=out.device)[..., ::2].copy_(d_out)
    grads = torch.autograd.grad(out, leaves, d_out)

    r64 = [logical(t).requires_grad_(r) for t, r in zip((q, k, v), requires)]
    ref = reference_attention(*r64, **ref_kwargs(p))
    ref_grads = torch.autograd.grad(ref, [t for t in r64 if t.requires_grad], dout)
    correct = []
    for upcast in (False, True):
        lp = [t.detach().resolve_neg().cpu().requires_grad_(r) for t, r in zip((q, k, v), requires)]
        o = naive_attention_torch(*lp, upcast=upcast, **ref_kwargs(p))
        correct.append(torch.autograd.grad(o, [t for t in lp if t.requires_grad], dout.to(o.dtype)))
    if p["dtype"] in (torch.float16, torch.bfloat16):
        recipe = stored_o_grads(*(logical(t) for t in (q, k, v)), dout, p)
        correct.append([g for g, r in zip(recipe, requires) if r])
    names = [n for n, r in zip("dq dk dv".split(), requires) if r]
    scale = 1 / math.sqrt(p["d"]) if p["scale"] is None else float(p["scale"])
    for i, (name, g, rg) in enumerate(zip(names, grads, ref_grads)):
        assert g.shape == rg.shape and g.dtype == p["dtype"]
        # The backward's D_i = rowsum(dO_i * O_i) (Algorithm 4) comes from the stored O, so
        # dP_ij - D_i cancels only to rounding of |dO| |v|: where the exact gradient is 0 (a
        # single key, P = 1) the error is absolute, about eps * m^2 * scale * sqrt(d) for inputs
        # of magnitude m. Hence gradients are checked for m <= 3 (problems drawn with m = 30
        # run with m = 3), with the floor scaled by m^2 * scale * sqrt(d) (1 for unit inputs
        # at the default scale).
        assert_close(name, g, rg, [c[i] for c in correct], p["dtype"],
                     floor_scale=max(1.0, p["magnitude"] ** 2 * scale * math.sqrt(p["d"])))


def forward_test(backend):
    caps = CAPS[backend]

    @settings(max_examples=caps.examples * X)
    @given(p=problems(backend), mode=st.sampled_from(("grad", "no_grad", "inference_mode")),
           requires=st.tuples(st.booleans(), st.booleans(), st.booleans()))
    def test(p, mode, requires):
        available(backend)
        check_forward(backend, p, mode, requires)

    return test


def backward_test(backend):
    caps = CAPS[backend]

    @settings(max_examples=max(1, caps.grad_examples) * X)
    @given(p=problems(backend), requires=st.tuples(st.booleans(), st.booleans(), st.booleans()),
           strided_dout=st.booleans())
    def test(p, requires, strided_dout):
        available(backend)
        assume(any(requires))
        p["alias"] = False  # (aliased inputs: the forward tests)
        p["magnitude"] = min(p["magnitude"], 3.0)
        if not caps.backward:
            q, k, v = tensors(p, caps.device, requires)
            out = flashedu.attention(q, k, v, backend=backend, **kwargs(p))
            with pytest.raises(NotImplementedError, match="no backward"):
                out.sum().backward()
            return
        check_backward(backend, p, requires, strided_dout)

    return test


# The Triton interpreter warns when its backward's exp2 overflows on a score that the causal
# mask then discards (the gradients are right; on a GPU exp2 gives inf silently, also discarded).
TRITON_EXP2 = pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")

test_forward_naive = forward_test("naive")
test_forward_numpy = forward_test("numpy")
test_forward_triton = forward_test("triton")
test_forward_numba = forward_test("numba")
test_backward_naive = backward_test("naive")
test_backward_numpy = backward_test("numpy")
test_backward_triton = TRITON_EXP2(backward_test("triton"))
test_backward_numba = backward_test("numba")  # its backward says it has none


# ----- NaN and inf inputs: non-finite exactly where SDPA's result is ---------------------------
@st.composite
def poisoned(draw, backend):
    p = draw(problems(backend))
    # float32, logits of order 1: no exp underflows to an exact 0 that would meet an inf in v
    p.update(dtype=torch.float32, scale=None, magnitude=min(p["magnitude"], 1.0))
    where = draw(st.sampled_from(("q", "k", "v")))
    value = draw(st.sampled_from((math.nan, math.inf, -math.inf)))
    if where == "q" and math.isinf(value):
        value = math.nan  # inf * 0 and inf - inf make which rows turn NaN depend on rounding
    if where == "v" or math.isinf(value):
        # a masked-out NaN in v still meets a 0 in SDPA's P @ V (0 * NaN = NaN), while a tiled
        # kernel skips or zeroes that tile: compare only where every key is visible
        p["is_causal"], p["block_mask"] = False, None
    n = p["Nq"] if where == "q" else p["Nk"]
    heads = p["H"] if where == "q" else p["Hkv"]
    p["poison"] = (where, value, draw(st.integers(0, p["B"] - 1)), draw(st.integers(0, heads - 1)),
                   draw(st.integers(0, n - 1)), draw(st.integers(0, p["d"] - 1)))
    return p


def nonfinite_test(backend, examples):
    @settings(max_examples=examples * X)
    @given(p=poisoned(backend))
    def test(p):
        available(backend)
        where, value, b, h, i, c = p["poison"]
        q, k, v = (logical(t).float() for t in tensors(p, "cpu"))
        dict(q=q, k=k, v=v)[where][b, h, i, c] = value
        dev = CAPS[backend].device
        out = flashedu.attention(q.to(dev), k.to(dev), v.to(dev), backend=backend, **kwargs(p)).cpu()
        kw = ref_kwargs(p)
        ref = reference_attention(q, k, v, **kw)
        # the reference is SDPA's math: the same entries non-finite
        mask = None
        if kw["is_causal"] or kw["block_mask"] is not None:
            from flashedu.reference import visible_mask_torch
            mask = visible_mask_torch(p["Nq"], p["Nk"], is_causal=kw["is_causal"],
                                      block_mask=kw["block_mask"])
        group = p["H"] // p["Hkv"]
        # SDPA's math backend: its CPU flash kernel returns zeros for a NaN query row, as if
        # the row saw no key, which is a silent wrong answer we do not copy
        with sdpa_kernel(SDPBackend.MATH):
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                q.double(), k.double().repeat_interleave(group, 1),
                v.double().repeat_interleave(group, 1), attn_mask=mask, scale=kw["scale"])
        if mask is None:
            assert torch.equal(torch.isnan(ref), torch.isnan(sdpa))
        # With a mask, SDPA's math adds -inf to a masked NaN score (NaN) while its fused kernels
        # and FlexAttention overwrite it: we (and the reference) overwrite, a masked-out key
        # never reaches the result; rows that see the poison agree with SDPA.
        assert not (torch.isnan(ref) & ~torch.isnan(sdpa)).any()
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), "NaN where SDPA has none, or none where it has"
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        assert torch.equal(out[torch.isinf(out)], ref[torch.isinf(ref)].float())
        finite = torch.isfinite(ref)
        plain = naive_attention_torch(q, k, v, upcast=False, **kw)
        assert_close("out (finite part)", torch.where(finite, out.double(), 0), torch.where(finite, ref, 0),
                     [torch.where(finite, plain.double(), 0)], torch.float32)

    # the Triton interpreter's max reduction warns on a NaN row before giving NaN, as it should
    return pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")(
        pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")(test))


test_nonfinite_naive = nonfinite_test("naive", 25)
test_nonfinite_numpy = nonfinite_test("numpy", 20)
test_nonfinite_triton = nonfinite_test("triton", 6)
test_nonfinite_numba = nonfinite_test("numba", 4)


# ----- arguments: accepted exactly when SDPA would, refused with the argument's name ----------
ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True),
                     st.just(10**400),  # a Python int beyond float64
                     st.text(max_size=4), st.sampled_from((np.bool_(True), np.bool_(False),
                     np.float32(0.5), np.int64(1), torch.tensor(True), (True,), [1.0])))
Q, K, V = (torch.randn(1, 2, 5, 8) for _ in range(3))


@settings(max_examples=150 * X)
@given(value=ANYTHING, arg=st.sampled_from(("is_causal", "enable_gqa", "scale", "dropout_p")))
def test_arguments_are_checked(value, arg):
    is_flag = isinstance(value, (bool, np.bool_))
    is_real = isinstance(value, (int, float, np.floating, np.integer)) and not is_flag
    if isinstance(value, int) and abs(value) > 10**308:
        is_real = False  # a Python int beyond float64 is refused as a ValueError naming arg
    if arg in ("is_causal", "enable_gqa"):
        ok = is_flag
    elif arg == "scale":
        lo, hi = flashedu.arguments.SCALE_RANGE
        ok = value is None or (is_real and math.isfinite(value) and lo <= float(value) <= hi)
    else:
        # 1 drops everything (zeros, as SDPA); other rates are drawn in steps of 1/256, and one
        # that would round to no dropout or to dropping everything is refused
        ok = is_real and (value == 0 or value == 1 or 1 / 512 <= value < 1 - 1 / 512)
    if ok:
        out = flashedu.attention(Q, K, V, backend="naive", **{arg: value})
        assert out.shape == Q.shape
        return
    with pytest.raises((TypeError, ValueError), match=arg):
        flashedu.attention(Q, K, V, backend="naive", **{arg: value})


@settings(max_examples=60 * X)
@given(scale=st.floats(min_value=0, exclude_min=True, allow_infinity=False))
def test_scale_is_accepted_exactly_in_float32_normal_range(scale):
    lo, hi = flashedu.arguments.SCALE_RANGE
    if lo <= scale <= hi:
        assert flashedu.attention(Q, K, V, scale=scale, backend="naive").shape == Q.shape
    else:
        with pytest.raises(ValueError, match="scale"):
            flashedu.attention(Q, K, V, scale=scale)


@settings(max_examples=40 * X)
@given(backend=st.sampled_from([n for n, b in flashedu.backends.BACKENDS.items()
                                 if not b.has_dropout]), p=st.floats(0.01, 0.99))
def test_dropout_elsewhere_names_the_backends_that_have_it(backend, p):
    with pytest.raises(NotImplementedError, match="naive"):
        flashedu.attention(Q, K, V, dropout_p=p, backend=backend)


@settings(max_examples=20 * X)
@given(p=problems("naive", masks=False), dropout=st.floats(0.05, 0.9), seed=st.integers(0, 99))
def test_naive_dropout_is_seeded_and_finite(p, dropout, seed):
    q, k, v = tensors(p, "cpu")
    kw = dict(is_causal=p["is_causal"], enable_gqa=p["enable_gqa"], backend="naive")
    torch.manual_seed(seed)
    a = flashedu.attention(q, k, v, dropout_p=dropout, **kw)
    torch.manual_seed(seed)
    b = flashedu.attention(q, k, v, dropout_p=dropout, **kw)
    assert torch.equal(a, b) and a.dtype == q.dtype and torch.isfinite(a).all()


# ----- BlockMask --------------------------------------------------------------------------------
@st.composite
def dense_masks(draw):
    Br, Bc = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    Nq, Nk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    Tr, Tc = -(-Nq // Br), -(-Nk // Bc)
    b, h = draw(st.sampled_from(((1, 1), (2, 1), (1, 3), (2, 3))))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    blocks = rng.random((b, h, Tr, Tc)) < draw(st.sampled_from((0.0, 0.4, 1.0)))
    return BlockMask.from_dense(blocks, (Br, Bc), (Nq, Nk), is_causal=draw(st.booleans())), blocks


@settings(max_examples=80 * X)
@given(dense_masks())
def test_blockmask_is_a_value(made):
    m, blocks = made
    assert np.array_equal(m.to_dense(), blocks) and m.density == blocks.mean()
    for other in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m),
                  BlockMask.from_dense(blocks.copy(), m.block_size, m.seq_lens, m.is_causal)):
        assert other == m and hash(other) == hash(m) and not other.blocks.flags.writeable
    assert m.to_dense().flags.writeable  # to_dense is a copy the caller may change
    flipped = blocks.copy()
    flipped.flat[0] = not flipped.flat[0]
    assert BlockMask.from_dense(flipped, m.block_size, m.seq_lens, m.is_causal) != m


@settings(max_examples=80 * X)
@given(dense_masks())
def test_blockmask_lists_rebuild_the_tiles(made):
    m, blocks = made
    for (num, idx), grid in ((m.kv_indices(), blocks), (m.q_indices(), np.swapaxes(blocks, -1, -2))):
        assert (num == grid.sum(-1)).all()
        rebuilt = np.zeros_like(grid)
        for pos in np.ndindex(num.shape):
            rebuilt[pos][idx[pos][:num[pos]]] = True
            assert (np.diff(idx[pos][:num[pos]]) > 0).all()
        assert np.array_equal(rebuilt, grid)
    Br, Bc = m.block_size
    Nq, Nk = m.seq_lens
    elem = m.element_mask()
    assert elem.shape == blocks.shape[:2] + (Nq, Nk)
    want = blocks.repeat(Br, -2).repeat(Bc, -1)[..., :Nq, :Nk]
    assert np.array_equal(elem, want & np.tri(Nq, Nk, dtype=bool) if m.is_causal else want)


@settings(max_examples=80 * X)
@given(Nq=st.integers(1, 60), Nk=st.integers(1, 60), Br=st.integers(1, 17), Bc=st.integers(1, 17),
       window=st.integers(1, 70), causal=st.booleans())
def test_causal_and_window_masks_are_tight(Nq, Nk, Br, Bc, window, causal):
    i, j = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
    for m, need in ((BlockMask.causal((Nq, Nk), (Br, Bc)), j <= i),
                    (BlockMask.sliding_window((Nq, Nk), (Br, Bc), window=window, causal=causal),
                     (j >= i - window) & (j <= i + (0 if causal else window)))):
        elem = m.element_mask()[0, 0]
        assert not (need & ~elem).any(), "a pair that must be visible is masked"
        # every tile kept holds at least one pair that needs it
        Tr, Tc = m.shape
        for r, c in zip(*np.nonzero(m.blocks[0, 0])):
            assert need[r * Br:(r + 1) * Br, c * Bc:(c + 1) * Bc].any()
        assert m.blocks.shape == (1, 1, Tr, Tc)


@settings(max_examples=15 * X)
@given(dense_masks())
def test_flex_round_trip(made):
    pytest.importorskip("torch.nn.attention.flex_attention")
    m, _ = made
    assert BlockMask.from_flex(m.to_flex(), is_causal=m.is_causal) == m


@settings(max_examples=100 * X)
@given(value=ANYTHING)
def test_blockmask_arguments_are_checked(value):
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    is_flag = isinstance(value, (bool, np.bool_))
    calls = {
        "block_size": (lambda: BlockMask.causal((20, 20), value), is_int and 1 <= value < 2**31),
        "window": (lambda: BlockMask.sliding_window((20, 20), 4, window=value), is_int and value >= 1),
        "causal": (lambda: BlockMask.sliding_window((20, 20), 4, causal=value), is_flag),
        "is_causal": (lambda: BlockMask.from_dense(np.ones((2, 2), bool), 4, is_causal=value), is_flag),
    }
    for name, (call, ok) in calls.items():
        if ok:
            assert isinstance(call(), BlockMask)
        else:
            with pytest.raises((TypeError, ValueError), match=name):
                call()


# ----- the command line's argument parsing --------------------------------------------------------
WORDS = st.sampled_from(("doctor", "tour", "--json", "-h", "--version", "x.json", "/no/dir/x.json",
                         "--bogus", "", "tours", "check"))


@settings(max_examples=150 * X)
@given(argv=st.lists(st.one_of(WORDS, st.text(max_size=6)), max_size=4))
def test_cli_parsing_accepts_or_exits_2(argv):
    from flashedu.cli import build_parser

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:
            assert {"-h", "--help", "--version"} & set(argv) or any(
                a.startswith("--h") or a.startswith("--v") for a in argv)
        else:
            assert exc.code == 2
        return
    assert args.command in ("doctor", "tour", "bench", "exercises", "check")
    if args.command == "tour" and args.json is not None:
        assert os.path.isdir(os.path.dirname(os.path.abspath(args.json)))


@settings(max_examples=60 * X)
@given(names=st.lists(st.tuples(st.sampled_from(("real", "missing")),
                                st.sampled_from(("", "--json", "--timeout", "--jobs", "--kernel"))),
                      max_size=5))
def test_cli_check_reports_exactly_the_missing_notebooks(names, tmp_path_factory):
    from flashedu.cli import missing_notebooks

    folder = tmp_path_factory.mktemp("nb")
    argv, want = [], []
    for n, (kind, option) in enumerate(names):
        if option:  # every check option takes a value, which is not a notebook
            argv += [option, "3"]
        path = folder / f"{kind}{n}.ipynb"
        if kind == "real":
            path.write_text("{}")
        else:
            want.append(str(path))
        argv.append(str(path))
    assert missing_notebooks(argv) == want

