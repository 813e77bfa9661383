"""Mask mods, score mods, SDPA's attn_mask and return_lse on every backend that has them.

Each case is checked, forward and gradients, against a float64 attention written out here from
a dense mask and an explicit score formula (not through flashedu.mods), with odd lengths,
grouped-query heads and rows that see nothing. A backend whose flags in flashedu.backends say it
lacks a feature is skipped, saying which; the Triton backend runs in its interpreter on a CPU.
"""

import math
import pickle

import numpy as np
import pytest
import torch

import flashedu
from flashedu import BlockMask, mods
from flashedu.backends import BACKENDS

from backend_cases import unavailable

BACKEND_LIST = ["naive", "numpy", "triton"]
B, H, HKV, D = 2, 4, 2, 16
# Triton's interpreter takes seconds a call on a CPU: there it runs these cases (every kind of
# rule once); on a GPU it runs them all.
INTERPRETED_SUBSET = {"causal-br-45x21", "window5-bottom_right", "user-per-head", "softcap",
                      "NqNk", "grad-NqNk"}

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.filterwarnings("ignore:return_lse is deprecated")]


def subset(backend, name):
    if backend == "triton" and not torch.cuda.is_available() and name not in INTERPRETED_SUBSET:
        pytest.skip("Triton's interpreter is slow on a CPU: a subset of the cases runs here, "
                    "all of them on a GPU")


# ----- the float64 reference, from dense masks and explicit formulas ----------------------------

def reference(q, k, v, visible=None, score=None, bias=None):
    """(out, lse) of softmax(score(scale q k^T) + bias, masked by ``visible``) v in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    S = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if score is not None:
        S = score(S)
    if bias is not None:
        S = S + bias.double()
    if visible is not None:
        if not isinstance(visible, torch.Tensor):
            visible = torch.from_numpy(np.array(visible))
        S = S.masked_fill(~visible, float("-inf"))
    m = S.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    P = torch.exp(S - m)
    l = P.sum(-1, keepdim=True)
    out = (P / torch.where(l == 0, torch.ones_like(l), l)) @ v
    return out, (m + torch.log(l)).squeeze(-1)


def grid(Nq, Nk):
    return np.arange(Nq)[:, None], np.arange(Nk)[None, :]


# ----- running a backend ---------------------------------------------------------------------------

def needs(backend, *features):
    """Skip (saying why) unless ``backend`` has every feature and can run here."""
    spec = BACKENDS[backend]
    for f in features:
        if not getattr(spec, f"has_{f}"):
            pytest.skip(f"backend {backend!r} does not implement {f} (flashedu.backends flags)")
    why = unavailable(backend)
    if why:
        pytest.skip(f"backend {backend!r} unavailable: {why}")


def needs_kind(backend, feature, kind):
    """Skip unless ``backend`` takes this kind of score mod ("softcap", ...) or attn_mask
    ("bool", "float"): some compile only the library kinds."""
    spec = BACKENDS[backend]
    ok = {"score_mod": lambda: spec.has_score_mod or kind in spec.score_mod_kinds,
          "attn_mask": lambda: spec.has_attn_mask and kind in spec.attn_mask_kinds}[feature]()
    if not ok:
        pytest.skip(f"backend {backend!r} does not take a {kind} {feature} (flashedu.backends)")
    needs(backend)


def dtype_of(backend):
    return torch.float32 if backend == "triton" else torch.float64


def tol(backend):
    return (2e-4, 2e-3) if backend == "triton" else (1e-10, 1e-9)  # (forward, gradients)


def device_of(backend):
    """Where a backend's inputs live: the GPU for triton when there is one."""
    return flashedu.runtime.kernel_device() if backend == "triton" else "cpu"


def qkv(Nq, Nk, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device).requires_grad_()
            for shape in ((B, H, Nq, D), (B, HKV, Nk, D), (B, HKV, Nk, D))]


def check(backend, Nq, Nk, want_fn, return_lse=False, **kwargs):
    """flashedu.attention(backend, **kwargs) against ``want_fn(q, k, v)``, values and grads."""
    dtype, device = dtype_of(backend), device_of(backend)
    q, k, v = qkv(Nq, Nk, dtype, device=device)
    if kwargs.get("attn_mask") is not None:
        kwargs["attn_mask"] = kwargs["attn_mask"].to(device)
    got = flashedu.attention(q, k, v, enable_gqa=True, backend=backend, return_lse=return_lse,
                             **kwargs)
    got = tuple(t.cpu() for t in got) if return_lse else got.cpu()
    want = want_fn(*(t.detach().cpu().double().requires_grad_() for t in (q, k, v)))
    got_out, got_lse = got if return_lse else (got, None)
    want_out, want_lse = want
    f_tol, g_tol = tol(backend)
    assert got_out.shape == (B, H, Nq, D) and torch.isfinite(got_out).all()
    assert (got_out.double() - want_out).abs().max() <= f_tol

    w = torch.linspace(-1, 1, D, dtype=torch.float64)

    def loss(out, lse):
        total = (out.double() * w).sum()
        if lse is not None:  # the logsumexp's own gradient, where it is finite
            total = total + 0.5 * torch.where(torch.isinf(lse), 0.0, lse.double()).sum()
        return total

    g_got = [g.cpu() for g in torch.autograd.grad(loss(got_out, got_lse), (q, k, v))]
    qw, kw_, vw = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    out_w, lse_w = want_fn(qw, kw_, vw)
    g_want = torch.autograd.grad(loss(out_w, lse_w if return_lse else None), (qw, kw_, vw))
    for name, a, b in zip("qkv", g_got, g_want):
        assert (a.double() - b).abs().max() <= g_tol, f"d{name}"
    if return_lse:
        assert got_lse.shape == (B, H, Nq)
        assert torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse))
        finite = torch.isfinite(want_lse)
        assert (got_lse.double() - want_lse)[finite].abs().max() <= f_tol
    return want_out


# ----- mask mods -------------------------------------------------------------------------------------

def doc_ids(N):
    lengths = [[5, N - 12, 7], [N - 3, 3]]
    return mods.document.from_lengths(lengths), lengths


def _doc_dense(lengths, Nq, Nk):
    out = []
    for row in lengths:
        ids = np.repeat(np.arange(len(row)), row)
        out.append(ids[:Nq, None] == ids[None, :Nk])
    return np.stack(out)[:, None]  # (B, 1, Nq, Nk)


def mask_cases():
    """(id, Nq, Nk, mask_mod, dense (B|1, H|1, Nq, Nk) bool) from explicit formulas."""
    cases = []
    for Nq, Nk in ((37, 37), (21, 45), (45, 21)):
        i, j = grid(Nq, Nk)
        cases.append((f"causal-tl-{Nq}x{Nk}", Nq, Nk, mods.causal(), j <= i))
        cases.append((f"causal-br-{Nq}x{Nk}", Nq, Nk, mods.causal("bottom_right"),
                      j <= i + Nk - Nq))
    for Nq, Nk, align in ((39, 39, "top_left"), (17, 40, "bottom_right")):
        i, j = grid(Nq, Nk)
        off = Nk - Nq if align == "bottom_right" else 0
        cases.append((f"window5-{align}", Nq, Nk, mods.sliding_window(5, align),
                      (j > i + off - 5) & (j <= i + off)))
    i, j = grid(41, 41)
    cases.append(("window1", 41, 41, mods.sliding_window(1), j == i))
    doc, lengths = doc_ids(41)
    cases.append(("document", 41, 41, doc, _doc_dense(lengths, 41, 41)))
    cases.append(("document-causal", 41, 41, mods.and_masks(mods.causal(), doc),
                  _doc_dense(lengths, 41, 41) & (j <= i)))
    cases.append(("prefix_lm", 41, 41, mods.prefix_lm(9), (j < 9) | (j <= i)))
    per_batch = np.array([3, 30])[:, None, None, None]
    cases.append(("prefix_lm-per-batch", 41, 41, mods.prefix_lm(torch.tensor([3, 30])),
                  (j < per_batch) | (j <= i)))
    cases.append(("or_masks", 41, 41, mods.or_masks(mods.sliding_window(3), mods.prefix_lm(2)),
                  ((j > i - 3) & (j <= i)) | (j < 2) | (j <= i)))
    h = np.arange(H)[None, :, None, None]
    cases.append(("user-per-head", 33, 35, lambda b, h, q, kv: (q + kv + h) % 3 != 0,
                  (grid(33, 35)[0] + grid(33, 35)[1] + h) % 3 != 0))
    return cases


MASK_CASES = mask_cases()


@pytest.mark.parametrize("backend", BACKEND_LIST)
@pytest.mark.parametrize("case", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_mask_mods(backend, case):
    name, Nq, Nk, mod, dense = case
    subset(backend, name)
    spec = BACKENDS[backend]
    bm = BlockMask.from_mask_mod(mod, B, H, Nq, Nk, block_size=(16, 16))
    assert bm.mask_mod is not None
    dense = np.broadcast_to(dense, (B, H, Nq, Nk))
    assert np.array_equal(bm.element_mask(), dense)
    if bm.needs_mask_mod and not (spec.has_mask_mod
                                  or getattr(mod, "kind", None) in spec.mask_mod_kinds):
        pytest.skip(f"backend {backend!r} does not apply this mask mod on partial tiles")
    needs(backend)
    check(backend, Nq, Nk, lambda q, k, v: reference(q, k, v, visible=dense), block_mask=bm,
          return_lse=spec.has_return_lse)


def test_rows_that_see_nothing_give_zeros_and_minus_inf():
    bm = BlockMask.from_mask_mod(mods.causal("bottom_right"), None, None, 45, 21, (16, 16))
    q, k, v = qkv(45, 21, torch.float64)
    for backend in ("naive", "numpy"):
        out, lse = flashedu.attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True,
                                      backend=backend)
        assert (out[:, :, :24] == 0).all() and torch.isneginf(lse[:, :, :24]).all()
        assert torch.isfinite(lse[:, :, 24:]).all()


# ----- score mods --------------------------------------------------------------------------------------

SLOPES = mods.alibi_slopes(H).double()


def score_cases():
    i = torch.arange(40).view(1, 1, 40, 1)
    j = torch.arange(40).view(1, 1, 1, 40)
    return [
        ("softcap", mods.softcap(1.5), lambda S: 1.5 * torch.tanh(S / 1.5)),
        ("alibi", mods.alibi(SLOPES), lambda S: S + SLOPES.view(1, H, 1, 1) * (j - i)),
        ("user-silu", lambda s, b, h, q, kv: s * torch.sigmoid(s), lambda S: S * torch.sigmoid(S)),
        ("user-per-head", lambda s, b, h, q, kv: s * (1 + h) / 4 - 0.1 * (q - kv).abs(),
         lambda S: S * (1 + torch.arange(H).view(1, H, 1, 1)) / 4 - 0.1 * (i - j).abs()),
    ]


SCORE_CASES = score_cases()


@pytest.mark.parametrize("backend", BACKEND_LIST)
@pytest.mark.parametrize("case", SCORE_CASES, ids=[c[0] for c in SCORE_CASES])
def test_score_mods(backend, case):
    name, mod, formula = case
    subset(backend, name)
    needs_kind(backend, "score_mod", getattr(mod, "kind", "user"))
    i, j = grid(40, 40)
    bm = BlockMask.from_mask_mod(mods.causal(), None, None, 40, 40, (16, 16))
    check(backend, 40, 40, lambda q, k, v: reference(q, k, v, visible=j <= i, score=formula),
          block_mask=bm, score_mod=mod, return_lse=BACKENDS[backend].has_return_lse)


@pytest.mark.parametrize("backend", BACKEND_LIST)
def test_score_mod_with_a_window_and_a_float_mask(backend):
    needs(backend, "mask_mod")
    needs_kind(backend, "score_mod", "softcap")
    needs_kind(backend, "attn_mask", "float")
    Nq = Nk = 40
    i, j = grid(Nq, Nk)
    bias = torch.randn(H, 1, Nk, dtype=dtype_of(backend))
    bm = BlockMask.from_mask_mod(mods.sliding_window(9), None, None, Nq, Nk, (16, 16))
    check(backend, Nq, Nk, lambda q, k, v: reference(
        q, k, v, visible=(j > i - 9) & (j <= i), score=lambda S: 2.0 * torch.tanh(S / 2.0),
        bias=bias), block_mask=bm, score_mod=mods.softcap(2.0), attn_mask=bias)


# ----- SDPA's attn_mask ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKEND_LIST)
@pytest.mark.parametrize("shape", [(37, 29), (B, 1, 37, 29), (1, H, 1, 29), (29,)],
                         ids=["NqNk", "B1NqNk", "1H1Nk", "Nk"])
def test_bool_attn_mask(backend, shape):
    subset(backend, "NqNk" if len(shape) == 2 else str(shape))
    needs_kind(backend, "attn_mask", "bool")
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(shape, generator=g) < 0.6
    if len(shape) == 2:
        mask[3] = False  # a row that sees nothing
    full = mask.expand(B, H, 37, 29)
    want = check(backend, 37, 29, lambda q, k, v: reference(q, k, v, visible=full),
                 attn_mask=mask, return_lse=BACKENDS[backend].has_return_lse)
    if mask.dim() >= 2:  # SDPA itself refuses a 1-D mask, though it broadcasts
        q, k, v = (t.detach().double() for t in qkv(37, 29, dtype_of(backend)))
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                enable_gqa=True)
        seen = full.any(-1)
        assert (sdpa - want)[seen].abs().max() < 1e-10  # SDPA agrees where a row sees something


@pytest.mark.parametrize("backend", BACKEND_LIST)
@pytest.mark.parametrize("shape", [(37, 29), (B, H, 37, 29), (H, 1, 29)], ids=["NqNk", "BHNqNk", "H1Nk"])
def test_float_attn_mask(backend, shape):
    subset(backend, str(shape))  # on the interpreter: test_float_attn_mask_gets_its_gradient
    needs_kind(backend, "attn_mask", "float")
    dtype = dtype_of(backend)
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    bias = bias.masked_fill(torch.rand(shape, generator=torch.Generator().manual_seed(3)) < 0.2,
                            float("-inf"))
    check(backend, 37, 29, lambda q, k, v: reference(q, k, v, bias=bias.expand(B, H, 37, 29)),
          attn_mask=bias)
    q, k, v = (t.detach() for t in qkv(37, 29, dtype))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    on = device_of(backend)
    ours = flashedu.attention(q.to(on), k.to(on), v.to(on), attn_mask=bias.to(on), enable_gqa=True,
                              backend=backend).cpu()
    ok = ~torch.isnan(sdpa)  # SDPA gives NaN for a row of -inf; flashedu gives zeros
    assert (sdpa - ours)[ok].abs().max() <= tol(backend)[0] * 10


@pytest.mark.parametrize("backend", BACKEND_LIST)
def test_return_lse_without_masks(backend):
    needs(backend, "return_lse")
    out = check(backend, 23, 31, lambda q, k, v: reference(q, k, v), return_lse=True)
    assert out.shape == (B, H, 23, D)


def test_lse_matches_flex_attention():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = (t.detach() for t in qkv(40, 40, torch.float64))
    bm = BlockMask.from_mask_mod(mods.sliding_window(7), None, None, 40, 40, (16, 16))
    ours, lse = flashedu.attention(q, k, v, block_mask=bm, score_mod=mods.softcap(2.0),
                                   enable_gqa=True, return_lse=True, backend="numpy")
    theirs, their_lse = flex.flex_attention(q, k, v, block_mask=bm.to_flex(),
                                            score_mod=mods.softcap(2.0), enable_gqa=True,
                                            return_aux=flex.AuxRequest(lse=True)) \
        if hasattr(flex, "AuxRequest") else flex.flex_attention(
            q, k, v, block_mask=bm.to_flex(), score_mod=mods.softcap(2.0), enable_gqa=True,
            return_lse=True)
    their_lse = getattr(their_lse, "lse", their_lse)
    assert (ours - theirs).abs().max() < 1e-10 and (lse - their_lse).abs().max() < 1e-10


# ----- against FlexAttention on the CPU --------------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in MASK_CASES if not c[0].startswith("user")][1::3],
                         ids=lambda c: c[0])
def test_same_as_flex_attention(case):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    name, Nq, Nk, mod, dense = case
    q, k, v = (t.detach() for t in qkv(Nq, Nk, torch.float64))
    bm = BlockMask.from_mask_mod(mod, B, H, Nq, Nk, (16, 16))
    ours = flashedu.attention(q, k, v, block_mask=bm, enable_gqa=True, backend="numpy")
    theirs = flex.flex_attention(q, k, v, block_mask=bm.to_flex(), enable_gqa=True)
    assert (ours - theirs).abs().max() < 1e-10
    # and FlexAttention's own block mask, through from_flex (its mask_mod comes along)
    their_mask = flex.create_block_mask(mods.bind(mod, (Nq, Nk)), B, H, Nq, Nk, device="cpu",
                                        BLOCK_SIZE=16)
    back = BlockMask.from_flex(their_mask)
    assert back.mask_mod is their_mask.mask_mod
    assert np.array_equal(back.element_mask(), np.broadcast_to(dense, (B, H, Nq, Nk)))
    assert (flashedu.attention(q, k, v, block_mask=back, enable_gqa=True, backend="numpy")
            - theirs).abs().max() < 1e-10


# ----- the tile classes and the evaluation function ---------------------------------------------------------

def test_empty_full_and_partial_tiles():
    bm = BlockMask.from_mask_mod(mods.sliding_window(16), None, None, 64, 64, (16, 16))
    # band of width 16 over 16x16 tiles: the diagonal tiles are partial (causal cut), the
    # tiles just left of them partial (window cut), every other tile empty
    assert bm.blocks[0, 0].sum() == 4 + 3 and bm.full.sum() == 0
    assert len(bm.partial_tiles()) == 7 and bm.is_causal and bm.needs_mask_mod
    doc = BlockMask.from_mask_mod(mods.document.from_lengths([16, 32, 16]), None, None, 64, 64,
                                  (16, 16))
    assert doc.full[0, 0].sum() == 1 + 4 + 1 and not doc.needs_mask_mod  # tile-aligned docs
    masks = bm.tile_masks()
    assert masks.shape == (7, 16, 16)
    dense = bm.element_mask()[0, 0]
    for (b, h, i, j), m in zip(bm.partial_tiles(), masks):
        assert np.array_equal(m.numpy(), dense[i * 16:(i + 1) * 16, j * 16:(j + 1) * 16])


def test_causal_mod_needs_no_element_mask_beyond_is_causal():
    bm = BlockMask.from_mask_mod(mods.causal(), None, None, 50, 50, (16, 16))
    assert bm.is_causal and not bm.needs_mask_mod and bm == BlockMask.causal((50, 50), (16, 16))


def test_evaluate_mask_mod_on_sub_ranges_and_padding():
    doc, lengths = doc_ids(41)
    whole = mods.evaluate_mask_mod(doc, range(B), range(1), range(41), range(41))
    part = mods.evaluate_mask_mod(doc, [1], 0, range(16, 32), range(32, 48), seq_lens=(41, 41))
    assert part.shape == (1, 1, 16, 16)
    assert torch.equal(part[0, 0, :, :9], whole[1, 0, 16:32, 32:41])
    assert not part[..., 9:].any()  # past Nk: False, never shown to the mod
    # a batch of tiles at once: (n, Br, Bc)
    t = torch.tensor([[0, 0], [1, 2]]).view(2, 2, 1, 1)
    got = mods.evaluate_mask_mod(doc, t[:, 0] * 0 + torch.tensor([0, 1]).view(2, 1, 1), 0,
                                 t[:, 0] * 16 + torch.arange(16).view(1, 16, 1),
                                 t[:, 1] * 16 + torch.arange(16).view(1, 1, 16), seq_lens=(41, 41))
    assert got.shape == (2, 16, 16) and torch.equal(got[0], whole[0, 0, :16, :16])


@pytest.mark.parametrize("mod, match", [
    (lambda b, h, q, kv: q >= kv if q > kv else False, "broadcast"),
    (lambda b, h, q, kv: (q >= kv).int(), "bool tensor"),
    (lambda b, h, q, kv: torch.ones(3, 3, dtype=torch.bool), "does not broadcast"),
])
def test_a_mod_that_cannot_broadcast_is_refused_clearly(mod, match):
    with pytest.raises((TypeError, ValueError), match=match):
        BlockMask.from_mask_mod(mod, None, None, 40, 40, (16, 16))


def test_bottom_right_needs_lengths():
    with pytest.raises(ValueError, match="bind"):
        mods.causal("bottom_right")(0, 0, torch.tensor(1), torch.tensor(1))
    assert bool(mods.causal("bottom_right", seq_lens=(2, 5))(0, 0, torch.tensor(0), torch.tensor(3)))


def test_library_mods_carry_their_parameters():
    assert mods.sliding_window(128).kind == "sliding_window" and mods.sliding_window(128).window == 128
    assert mods.sliding_window(128).left == 127 and mods.sliding_window(128, "bottom_right").alignment == "bottom_right"
    assert mods.causal("bottom_right").kind == "causal"
    assert mods.softcap(30).cap == 30.0 and mods.alibi([0.5, 0.25]).slopes.tolist() == [0.5, 0.25]
    assert mods.document([0, 0, 1]).doc_ids.tolist() == [0, 0, 1]
    assert mods.prefix_lm(4).prefix_len == 4
    both = mods.and_masks(mods.causal(), mods.document([0, 1]))
    assert both.kind == "and_masks" and len(both.mods) == 2
    assert mods.sliding_window(8) == mods.sliding_window(8) != mods.sliding_window(9)
    assert mods.alibi_slopes(8)[0] == 0.5 and len(mods.alibi_slopes(12)) == 12


def test_the_mask_keeps_its_mod_through_transforms():
    doc = mods.and_masks(mods.causal(), mods.document.from_lengths([10, 30]))
    bm = BlockMask.from_mask_mod(doc, None, None, 40, 40, (16, 16))
    assert bm.expand(2, 3).mask_mod is doc and bm.expand(2, 3).needs_mask_mod
    back = pickle.loads(pickle.dumps(bm))
    assert back == bm and back.mask_mod == doc and back.needs_mask_mod
    assert BlockMask.from_flex(bm.to_flex()) is bm
    other = BlockMask.from_mask_mod(mods.and_masks(mods.causal(), mods.document.from_lengths([11, 29])),
                                    None, None, 40, 40, (16, 16))
    assert np.array_equal(other.blocks, bm.blocks) and other != bm  # same tiles, other mod


def test_sliding_window_is_exact_now():
    """window=1 used to show the whole causal triangle of each diagonal tile."""
    m = BlockMask.sliding_window((8, 8), (4, 4), window=1)
    i, j = grid(8, 8)
    assert np.array_equal(m.element_mask()[0, 0], (j >= i - 1) & (j <= i))
    two_sided = BlockMask.sliding_window((20, 13), (4, 4), window=3, causal=False)
    i, j = grid(20, 13)
    assert np.array_equal(two_sided.element_mask()[0, 0], np.abs(i - j) <= 3)


# ----- validation: errors name the argument --------------------------------------------------------------

def _small():
    return torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True), ValueError, "attn_mask and is_causal"),
    (dict(attn_mask=torch.ones(8, 7, dtype=torch.bool)), ValueError, "attn_mask must broadcast"),
    (dict(attn_mask=torch.ones(3, 2, 8, 8, dtype=torch.bool)), ValueError, "attn_mask must broadcast"),
    (dict(attn_mask=torch.ones(1, 1, 1, 8, 8, dtype=torch.bool)), ValueError, "attn_mask must broadcast"),
    (dict(attn_mask=torch.ones(8, 8, dtype=torch.int64)), TypeError, "attn_mask must be bool"),
    (dict(attn_mask=np.ones((8, 8), bool)), TypeError, "attn_mask must be a torch.Tensor"),
    (dict(score_mod="softcap"), TypeError, "score_mod must be callable"),
    (dict(return_lse=1), TypeError, "return_lse"),
    (dict(score_mod=mods.softcap(1.0), backend="numba"), NotImplementedError, "naive"),
    (dict(block_mask=BlockMask.from_mask_mod(mods.sliding_window(2), None, None, 8, 8, (4, 4)),
          backend="numba"), NotImplementedError, "mask mod"),
])
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        flashedu.attention(*_small(), **kwargs)


@pytest.mark.parametrize("feature, kwargs", [
    ("attn_mask", dict(attn_mask=torch.zeros(8, 8))),
    ("score_mod", dict(score_mod=lambda s, b, h, q, kv: s * 2)),
    ("return_lse", dict(return_lse=True)),
])
def test_a_backend_without_a_feature_names_those_with_it(feature, kwargs):
    lacking = [n for n, s in BACKENDS.items() if not getattr(s, f"has_{feature}")
               or (feature == "attn_mask" and "float" not in s.attn_mask_kinds)]
    if not lacking:
        pytest.skip(f"every backend implements {feature}")
    for name in lacking:
        with pytest.raises(NotImplementedError, match=r"'naive', 'numpy'"):
            flashedu.attention(*_small(), backend=name, **kwargs)


@pytest.mark.parametrize("backend", BACKEND_LIST)
@pytest.mark.parametrize("shape", [(37, 29), (H, 1, 29)], ids=["NqNk", "H1Nk"])
def test_float_attn_mask_gets_its_gradient(backend, shape):
    """SDPA differentiates a float attn_mask (a learned bias): so does every backend that
    takes one, summed to the mask's own (broadcast) shape."""
    subset(backend, "grad-NqNk" if len(shape) == 2 else str(shape))
    needs_kind(backend, "attn_mask", "float")
    dtype, on = dtype_of(backend), device_of(backend)
    q, k, v = qkv(37, 29, dtype, device=on)
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
    bias[..., 0] = float("-inf")
    bias = bias.to(on).requires_grad_()
    out = flashedu.attention(q, k, v, attn_mask=bias, enable_gqa=True, backend=backend)
    got = torch.autograd.grad(out.double().square().sum(), bias)[0].cpu()
    b64 = bias.detach().cpu().double().requires_grad_()
    want_out, _ = reference(*(t.detach().cpu().double() for t in (q, k, v)), bias=b64.expand(B, H, 37, 29))
    want = torch.autograd.grad(want_out.square().sum(), b64)[0]
    assert got.shape == bias.shape and (got.double() - want).abs().max() <= tol(backend)[1]


def test_numpy_refuses_a_score_mod_with_a_learned_tensor():
    slopes = torch.ones(H, requires_grad=True)

    def learned(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    q, k, v = qkv(16, 16, torch.float64)
    with pytest.raises(NotImplementedError, match="naive"):
        flashedu.attention(q, k, v, score_mod=learned, enable_gqa=True, backend="numpy")
    out = flashedu.attention(q, k, v, score_mod=learned, enable_gqa=True, backend="naive")
    assert torch.autograd.grad(out.sum(), slopes)[0].abs().sum() > 0  # naive's autograd reaches it


@pytest.mark.parametrize("backend", ["numpy", "triton"])
def test_dropout_with_mods_is_naives_dropout(backend):
    """Dropout draws one stream for every backend: with a window, a softcap and a float mask
    too, the same seed drops the same entries as the naive backend."""
    subset(backend, "dropout")
    spec = BACKENDS[backend]
    if not spec.has_dropout:
        pytest.skip(f"backend {backend!r} has no dropout")
    needs_kind(backend, "score_mod", "softcap")
    needs_kind(backend, "attn_mask", "float")
    dtype, on = dtype_of(backend), device_of(backend)
    bm = BlockMask.from_mask_mod(mods.sliding_window(9), None, None, 37, 37, (16, 16))
    bias = torch.randn(37, 37, generator=torch.Generator().manual_seed(5), dtype=dtype).to(on)
    q, k, v = qkv(37, 37, dtype, device=on)
    results = []
    for name in ("naive", backend):
        torch.manual_seed(3)
        out = flashedu.attention(q, k, v, block_mask=bm, score_mod=mods.softcap(2.0),
                                 attn_mask=bias, dropout_p=0.3, enable_gqa=True, backend=name)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(*results):
        assert (a - b).abs().max() <= 10 * tol(backend)[1]
