"""Triton-specific checks (the shared suite tests/test_attention.py covers the common contract).

Runs through Triton's interpreter on a CPU: small shapes, a few seconds each.
"""

import dataclasses
import inspect
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashedu  # first: decides GPU or interpreter before triton loads
import triton
import triton.language as tl
from flashedu import ops, tolerance
from flashedu.reference import naive_attention_torch, reference_attention

pytestmark = pytest.mark.skipif(flashedu.available_backends()["triton"] is not None,
                                reason="triton backend unavailable")



def _device():
    """Where the triton backend's kernels run here: the GPU, or the CPU's interpreter."""
    return flashedu.runtime.kernel_device()


def _qkv(B, H, Hkv, Nq, Nk, d, dtype=torch.float32):
    dev = _device()
    q = torch.randn(B, H, Nq, d, dtype=dtype, device=dev, requires_grad=True)
    k = torch.randn(B, Hkv, Nk, d, dtype=dtype, device=dev, requires_grad=True)
    v = torch.randn(B, Hkv, Nk, d, dtype=dtype, device=dev, requires_grad=True)
    return q, k, v


_err = tolerance.max_error


def _check(q, k, v, **kw):
    """Forward and gradients within flash-attention's tolerance of the float64 reference."""
    kw.setdefault("enable_gqa", True)
    out = flashedu.attention(q, k, v, backend="triton", **kw)
    dout = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    ref = reference_attention(q, k, v, **kw)
    ref = (ref, *torch.autograd.grad(ref, (q, k, v), dout.double()))
    plain = naive_attention_torch(q, k, v, upcast=False, **kw)
    plain = (plain, *torch.autograd.grad(plain, (q, k, v), dout))
    _assert_within_tolerance(got, ref, plain, q.dtype)
    return got


def _assert_within_tolerance(got, ref, plain, dtype):
    """(out, dq, dk, dv) of the kernel against the float64 reference, each allowed what plain
    attention in ``dtype`` (``plain``) errs by, times flash-attention's factor."""
    for n, (g, r, p) in enumerate(zip(got, ref, plain)):
        factor = tolerance.FORWARD if n == 0 else tolerance.GRADIENT
        assert torch.isfinite(g).all()
        allowed = tolerance.allowed_error(dtype, _err(p, r), factor=factor, floor_scale=factor)
        assert _err(g, r) <= allowed, ("out dq dk dv".split()[n])


def _check_with_dropout_stream(q, k, v, **kw):
    """:func:`_check` for calls that may drop: the references are naive attention drawing the
    call's own dropout stream (the rng the call draws after the same torch.manual_seed).
    Returns the float64 reference (out, dq, dk, dv)."""
    from flashedu.dropout import draw_rng

    torch.manual_seed(3)
    rng = draw_rng(q.device)
    torch.manual_seed(3)
    out = flashedu.attention(q, k, v, backend="triton", **kw)
    dout = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    ref_kw = {**kw, "dropout_rng": rng} if kw.get("dropout_p") else kw
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive_attention_torch(*ins, **ref_kw)
    ref = (ref, *torch.autograd.grad(ref, ins, dout.double()))
    plain = naive_attention_torch(q, k, v, upcast=False, **ref_kw)
    plain = (plain, *torch.autograd.grad(plain, (q, k, v), dout))
    _assert_within_tolerance(got, ref, plain, q.dtype)
    return ref


@pytest.mark.parametrize("d", [40, 80, 96])
def test_padded_head_dims(d):
    """Head dims that are not powers of two are padded in registers (masked loads)."""
    _check(*_qkv(1, 2, 2, 37, 29, d), is_causal=True)


def test_fp16_and_gqa():
    _check(*_qkv(2, 4, 2, 40, 50, 32, torch.float16), is_causal=True)
    _check(*_qkv(1, 4, 1, 33, 20, 16, torch.float16))  # MQA


@pytest.mark.parametrize("block", [(16, 16), (32, 64), (48, 32), (128, 128)])
def test_block_mask_sizes(block):
    """The kernel's tile divides the mask's block: 16x16 up to FlexAttention's 128x128."""
    rng = np.random.default_rng(sum(block))
    Nq, Nk = 70, 64
    Tr, Tc = -(-Nq // block[0]), -(-Nk // block[1])
    blocks = rng.random((1, 2, Tr, Tc)) < 0.6
    blocks[0, 0, 0, 0] = True
    bm = flashedu.BlockMask.from_dense(blocks, block, (Nq, Nk))
    _check(*_qkv(1, 2, 2, Nq, Nk, 32), block_mask=bm)


def test_block_mask_even_sizes_and_causal():
    """Even sizes take the unmasked sparse path; a causal mask takes the masked one."""
    blocks = np.array([[1, 0], [1, 1]], bool)
    _check(*_qkv(1, 2, 2, 64, 64, 32), block_mask=flashedu.BlockMask.from_dense(blocks, 32))
    _check(*_qkv(1, 2, 2, 64, 64, 32), block_mask=flashedu.BlockMask.causal((64, 64), 32))


def test_fully_masked_rows_are_zero():
    """A Q tile with no K/V tile gives zeros in O and zero gradients, never NaN."""
    blocks = np.array([[0, 0], [1, 0], [0, 1]], bool)
    bm = flashedu.BlockMask.from_dense(blocks, (16, 32), (48, 64))
    q, k, v = _qkv(1, 2, 2, 48, 64, 16)
    out, dq, dk, dv = _check(q, k, v, block_mask=bm)
    assert out[:, :, :16].abs().max() == 0 and dq[:, :, :16].abs().max() == 0
    assert dk[:, :, 32:].abs().max() > 0  # the tile that is visited gets gradients


def test_lse_matches_numpy_loop():
    from flashedu import tiled
    from flashedu.triton_backend import forward_with_lse

    q, k, v = (t.detach() for t in _qkv(1, 1, 1, 45, 33, 24))
    O, L = (t[0, 0].cpu().numpy() for t in forward_with_lse(q, k, v, is_causal=True))
    O_np, L_np = tiled.flash_forward(*(t[0, 0].cpu().numpy() for t in (q, k, v)), 16, 16,
                                     causal=True)
    assert np.allclose(O, O_np, atol=1e-5)
    assert np.allclose(L, L_np, atol=1e-5)


def test_backward_is_deterministic():
    q, k, v = _qkv(1, 4, 2, 40, 40, 32)
    dout = torch.randn(1, 4, 40, 32, device=_device())
    runs = [torch.autograd.grad(flashedu.attention(q, k, v, backend="triton", enable_gqa=True),
                                (q, k, v), dout) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_errors():
    q, k, v = (t.detach() for t in _qkv(1, 1, 1, 8, 8, 16))
    big = torch.randn(1, 1, 8, 320)
    with pytest.raises(ValueError, match="head dim"):
        flashedu.attention(big, big, big, backend="triton")
    with pytest.raises(TypeError, match="triton backend takes"):
        flashedu.attention(q.double(), k.double(), v.double(), backend="triton")
    bm = flashedu.BlockMask.from_dense(np.ones((1, 1), bool), (8, 8), (8, 8))
    with pytest.raises(ValueError, match="block_mask.block_size"):
        flashedu.attention(q, k, v, block_mask=bm, backend="triton")



def test_block_mask_keeps_the_tuned_backward_settings(monkeypatch):
    """Fitting tiles to a mask's block changes tile sizes only, not the tuned launch layout."""
    from flashedu.triton import autograd, config

    tuned = config.GPU_16BIT[128]
    monkeypatch.setattr(autograd, "kernel_config", lambda d, is_fp32, interpreted: tuned)
    mask = flashedu.BlockMask.causal((256, 256), (64, 64))
    fitted = autograd.resolve_config(128, torch.bfloat16, mask)
    assert fitted.fused_backward == tuned.fused_backward
    assert (fitted.causal_backward is None) == (tuned.causal_backward is None)
    for c in (fitted, fitted.causal_backward or fitted):
        for t in (c.forward, c.dkdv, c.dq):
            assert 64 % t.Br == 0 and 64 % t.Bc == 0, t


def test_short_backwards_take_one_launch():
    """dK/dV and dQ share one launch below the config's split_from key length and take two
    from it on; a config without fused_backward always takes two. The tuned entries fuse the
    GPT's backward (N=512) at d=64 and d=128, causal or not."""
    import dataclasses

    from flashedu.triton import backward as bwd
    from flashedu.triton import config

    def launches(cfg, N):
        parts = bwd._launch_consts(N, N, 64, True, cfg, True)
        return [(p["DKDV"] is not None, p["DQ"] is not None) for p in parts]

    cfg = dataclasses.replace(config.INTERPRETER, fused_backward=True, split_from=256)
    assert launches(cfg, 255) == [(True, True)]
    assert launches(cfg, 256) == [(True, False), (False, True)]
    assert launches(dataclasses.replace(cfg, split_from=None), 10 ** 6) == [(True, True)]
    assert launches(dataclasses.replace(cfg, fused_backward=False), 16) == \
        [(True, False), (False, True)]
    gpt = 512
    assert bwd.fused(config.GPU_16BIT[64], gpt) and bwd.fused(config.GPU_16BIT[128], gpt)
    assert bwd.fused(config.GPU_16BIT[128].causal_backward, gpt)
    assert not bwd.fused(config.GPU_16BIT[64], 16384)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_block_mask_fits_the_dropout_tiles_too(monkeypatch, d):
    """A call with dropout and a block mask runs on dropout's own tiles (the H100's d=64
    dK/dV tiles of 64 x 64; d=256's backward: a 2-stage dQ): those are fitted to the
    mask's block too, or a 64-row block would be read as 128-row tiles."""
    from flashedu.triton import autograd, config

    tuned = config.GPU_16BIT[d]
    assert tuned.dropout_forward or tuned.dropout_backward
    monkeypatch.setattr(autograd, "kernel_config", lambda d, is_fp32, interpreted: tuned)
    mask = flashedu.BlockMask.causal((256, 256), (64, 32))
    fitted = autograd.resolve_config(d, torch.bfloat16, mask)
    tiles = [fitted.forward_tiles(mask, 256, dropout=True)]
    if fitted.dropout_backward is not None:
        tiles += [fitted.dropout_backward.dkdv, fitted.dropout_backward.dq]
    for t in tiles:
        assert 64 % t.Br == 0 and 32 % t.Bc == 0, t


@settings(max_examples=60, deadline=None)
@given(Nq=st.integers(1, 200), Nk=st.integers(1, 200), causal=st.booleans(),
       transpose=st.booleans(), seed=st.integers(0, 2**16))
def test_tile_lists_put_the_unmasked_tiles_first(Nq, Nk, causal, transpose, seed):
    """Per row, the first num_full listed tiles are exactly those whose whole Br x Bc box is
    visible (inside both sequences, and below the diagonal when causal): the kernels run them
    without element masks. The rest are the other tiles the mask lists."""
    from flashedu.triton import sparse

    block, Br, Bc = 32, 32, 16
    rng = np.random.default_rng(seed)
    blocks = rng.random((-(-Nq // block), -(-Nk // block))) < 0.6
    mask = flashedu.BlockMask(blocks, (block, block), (Nq, Nk))
    num, full, idx = (t.numpy() for t in sparse.tile_lists(mask, Br, Bc, transpose, "cpu",
                                                           is_causal=causal))
    listed = sparse.refine(mask, Br, Bc, causal)[0, 0]
    rows, cols = np.arange(listed.shape[0] * Br)[:, None], np.arange(listed.shape[1] * Bc)[None]
    visible = (rows < Nq) & (cols < Nk) & ((cols <= rows) | (not causal))
    whole = visible.reshape(listed.shape[0], Br, listed.shape[1], Bc).all(axis=(1, 3))
    if transpose:
        listed, whole = listed.T, whole.T
    for r in range(listed.shape[0]):
        n, f, row = num[0, 0, r], full[0, 0, r], idx[0, 0, r]
        assert sorted(row[:n]) == list(np.flatnonzero(listed[r]))
        assert set(row[:f]) == set(np.flatnonzero(listed[r] & whole[r]))


@pytest.mark.parametrize("causal", [False, True])
def test_tma_forward_matches_the_pointer_forward(monkeypatch, causal):
    """The copy-engine (TMA) loads, run by the interpreter: ragged Nk, a padded head dim (24 of
    32: the descriptor's zero fill), GQA. They must give what the pointer loads give."""
    from flashedu.triton import fast, launch
    from flashedu.triton.config import Tiles

    monkeypatch.setattr(fast, "tma_ok", lambda *t: True)  # the interpreter has no copy engine
    q, k, v = (x.detach() for x in _qkv(1, 4, 2, 70, 53, 24))
    call = ops.Call(causal, 0.2)
    plain, _ = launch.forward(q, k, v, call, tiles=Tiles(32, 16), interpreted=False)
    fast, _ = launch.forward(q, k, v, call, tiles=Tiles(32, 16, tma=True, warp_specialize=True),
                             interpreted=False)
    ref = reference_attention(q, k, v, is_causal=causal, scale=0.2, enable_gqa=True)
    assert _err(plain, ref) < 1e-5
    assert _err(fast, plain) < 1e-6


def test_fast_forward_falls_back_when_it_does_not_build(monkeypatch):
    """A Triton without TMA or warp specialization for this GPU: one warning, then the pointer
    version, and the right answer."""
    from flashedu.triton import fast, launch
    from flashedu.triton import forward as fw
    from flashedu.triton.config import Tiles

    real = fw.forward_kernel

    class Picky:
        def __getitem__(self, grid):
            def launch(*args, TMA, WARP_SPECIALIZE, **kw):
                if TMA or WARP_SPECIALIZE:
                    raise RuntimeError("PassManager::run failed")
                return real[grid](*args, TMA=TMA, WARP_SPECIALIZE=WARP_SPECIALIZE, **kw)
            return launch

    monkeypatch.setattr(fast, "tma_ok", lambda *t: True)
    monkeypatch.setattr(fw, "forward_kernel", Picky())
    monkeypatch.setattr(fast, "_NO_FAST", set())
    q, k, v = (x.detach() for x in _qkv(1, 2, 2, 40, 40, 16))
    kw = dict(interpreted=False, tiles=Tiles(32, 16, tma=True, warp_specialize=True))
    with pytest.warns(UserWarning, match="pointer version"):
        out, _ = launch.forward(q, k, v, ops.Call(False, 0.25), **kw)
    assert _err(out, reference_attention(q, k, v, scale=0.25)) < 1e-5
    assert len(fast._NO_FAST) == 1
    launch.forward(q, k, v, ops.Call(False, 0.25), **kw)  # remembered: no second warning


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ablation_variants_match_the_reference(causal, dtype):
    """The slower variants that notebook 10 times (flashedu/triton/ablations.py) compute
    attention and its gradients within the same tolerance as the production kernels: ragged
    sizes, a padded head dim (24 of 32), GQA."""
    from flashedu.triton import ablations
    from flashedu.triton.config import kernel_config
    from flashedu.triton.launch import backward, forward

    q, k, v = (x.detach() for x in _qkv(1, 4, 2, 45, 37, 24, dtype))
    do = torch.randn_like(q)
    cfg = kernel_config(24, dtype == torch.float32, flashedu.runtime.triton_interpreted())
    kw = dict(is_causal=causal, scale=24 ** -0.5, interpreted=True)
    ref = reference_attention(q, k, v, is_causal=causal, enable_gqa=True)
    plain = naive_attention_torch(q, k, v, is_causal=causal, enable_gqa=True, upcast=False)
    tol = tolerance.allowed_error(dtype, _err(plain, ref), floor_scale=tolerance.FORWARD)
    O, L = forward(q, k, v, ops.Call(causal, 24 ** -0.5), tiles=cfg.forward, interpreted=True)
    same, _ = ablations.forward(q, k, v, tiles=cfg.forward, **kw)
    assert torch.equal(same, O)  # both switches off: the production code
    for switch in ("natural_exp", "mask_every_tile"):
        O_v, L_v = ablations.forward(q, k, v, tiles=cfg.forward, **{switch: True}, **kw)
        assert O_v.dtype == dtype and _err(O_v, ref) <= tol, switch
        assert _err(L_v, L) < 1e-4, switch  # the same base-2 logsumexp for the backward

    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    grads_ref = torch.autograd.grad(reference_attention(qr, kr, vr, is_causal=causal,
                                                        enable_gqa=True), (qr, kr, vr), do.double())
    qp, kp, vp = (x.clone().requires_grad_() for x in (q, k, v))
    grads_plain = torch.autograd.grad(naive_attention_torch(qp, kp, vp, is_causal=causal,
                                                            enable_gqa=True, upcast=False), (qp, kp, vp), do)
    atomic = ablations.atomic_dq_backward(q, k, v, O, L, do, config=cfg, **kw)
    shipped = backward(q, k, v, O, L, do, ops.Call(causal, 24 ** -0.5), config=cfg,
                       interpreted=True)
    for name, a, s, r, p in zip("dq dk dv".split(), atomic, shipped, grads_ref, grads_plain):
        assert a.dtype == dtype
        assert _err(a, r) <= tolerance.allowed_error(dtype, _err(p, r), factor=tolerance.GRADIENT,
                                                     floor_scale=tolerance.GRADIENT), name
        if name != "dq":  # dK, dV: the same code in both designs
            assert torch.equal(a, s), name


# --- launching: cached compiled kernels, tile tables per GPU, retry with smaller tiles ------


def _grads(q, k, v, dout, **kw):
    """(out, dq, dk, dv) of one triton call."""
    out = flashedu.attention(q, k, v, backend="triton", enable_gqa=True, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), dout.to(out.device)))


def test_a_repeated_call_repeats_its_launch_plan(monkeypatch):
    """The second call laid out as the first adds no plan and starts the first call's launches
    with its own tensors: right for new values, and when the first call passed one tensor as
    q, k and v (each argument slot is filled by position, not by which tensor sat there)."""
    from flashedu.triton import fast

    monkeypatch.setattr(fast, "PLANS", {})
    x = torch.randn(1, 2, 45, 16, device=_device(), requires_grad=True)
    dout = torch.randn(1, 2, 45, 16, device=_device())
    _grads(x, x, x, dout, is_causal=True)  # self-attention on one tensor: the plans' first call
    plans = dict(fast.PLANS)
    assert len(plans) == 2  # forward and backward
    q, k, v = _qkv(1, 2, 2, 45, 45, 16)
    got = _grads(q, k, v, dout, is_causal=True)
    assert fast.PLANS == plans  # repeated, not rebuilt
    ref = reference_attention(q, k, v, is_causal=True)
    ref = (ref, *torch.autograd.grad(ref, (q, k, v), dout.double()))
    assert all(_err(g, r) < 1e-5 for g, r in zip(got, ref))


@pytest.mark.parametrize("change", ["strides", "alignment", "causal", "scale", "gqa",
                                    "block_mask", "dropout"])
def test_a_call_laid_out_differently_gets_its_own_plan(monkeypatch, change):
    """Anything a launch's arguments or Triton's specialization read gives a new plan, and
    both calls are right against the float64 reference."""
    from flashedu import BlockMask
    from flashedu.triton import fast

    monkeypatch.setattr(fast, "PLANS", {})
    base = dict(is_causal=False, scale=0.25)
    dout = torch.randn(1, 4, 40, 16, device=_device())
    q, k, v = _qkv(1, 4, 4, 40, 40, 16)
    _grads(q, k, v, dout, **base)
    before = len(fast.PLANS)
    kw = dict(base)
    if change == "strides":  # (B, N, H, d) memory seen as (B, H, N, d)
        q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                   for t in (q, k, v))
    elif change == "alignment":  # one float in: the base is 4-byte aligned, not 16-byte
        q = torch.randn(1 + 4 * 40 * 16, device=_device())[1:].reshape(1, 4, 40, 16)
        q.requires_grad_()
    elif change == "causal":
        kw["is_causal"] = True
    elif change == "scale":
        kw["scale"] = 0.3
    elif change == "gqa":
        k, v = (t.detach()[:, :2].clone().requires_grad_() for t in (k, v))
    elif change == "block_mask":
        kw["block_mask"] = BlockMask.from_dense(np.tril(np.ones((2, 2), dtype=bool)),
                                                block_size=(32, 32), seq_lens=(40, 40))
    elif change == "dropout":
        kw["dropout_p"] = 0.25
    if change == "dropout":
        _check_with_dropout_stream(q, k, v, enable_gqa=True, **kw)
    else:
        got = _grads(q, k, v, dout, **kw)
        ref = reference_attention(q, k, v, enable_gqa=True, **kw)
        ref = (ref, *torch.autograd.grad(ref, (q, k, v), dout.double()))
        assert all(_err(g, r) < 1e-5 for g, r in zip(got, ref))
    assert len(fast.PLANS) == before + 2


def test_a_repeated_dropout_call_draws_a_new_mask(monkeypatch):
    """The RNG state is one of the call's own tensors: a plan repeated with a new one drops
    other entries, and with the same one the same entries as a call that built its plan."""
    from flashedu.dropout import draw_rng
    from flashedu.triton import fast, launch
    from flashedu.triton.config import INTERPRETER

    monkeypatch.setattr(fast, "PLANS", {})
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 40, 40, 16))
    kw = dict(tiles=INTERPRETER.forward, interpreted=True)
    rng1, rng2 = draw_rng(q.device), draw_rng(q.device)
    call1, call2 = (ops.Call(False, 0.25, None, 0.3, rng) for rng in (rng1, rng2))
    first, _ = launch.forward(q, k, v, call1, **kw)
    second, _ = launch.forward(q, k, v, call2, **kw)  # repeated with a new state
    assert len(fast.PLANS) == 1 and not torch.equal(first, second)
    fast.PLANS.clear()
    assert torch.equal(launch.forward(q, k, v, call2, **kw)[0], second)


def test_a_plan_keeps_no_tensor_of_its_call(monkeypatch):
    """A plan holds what its launches need, never the call's tensors (they would stay alive,
    with their memory, as long as the plan)."""
    import gc
    import weakref

    from flashedu.triton import fast

    monkeypatch.setattr(fast, "PLANS", {})
    q, k, v = _qkv(1, 2, 2, 40, 40, 16)
    out = flashedu.attention(q, k, v, backend="triton")
    out.sum().backward()
    refs = [weakref.ref(t) for t in (q, k, v, out)]
    del q, k, v, out
    gc.collect()
    assert len(fast.PLANS) == 2 and all(r() is None for r in refs)


# --- a repeated plain call: from flashedu.attention straight to its repeat -----------------


def _repeats(monkeypatch):
    from flashedu import api

    repeats = {}
    monkeypatch.setattr(api, "REPEATS", repeats)
    return repeats


def _started_launches(monkeypatch):
    """The list of every ``fast.Launch`` started from now on (each still starts)."""
    from flashedu.triton import fast

    started = []
    monkeypatch.setattr(fast.Launch, "start", lambda self, *t, _s=fast.Launch.start, **kw:
                        started.append(self) or _s(self, *t, **kw))
    return started


def _reference_grads(q, k, v, dout, **kw):
    ref = reference_attention(q, k, v, **kw)
    return (ref, *torch.autograd.grad(ref, (q, k, v), dout.to(ref.device, torch.float64)))


def test_a_repeated_plain_call_goes_straight_to_its_repeat(monkeypatch):
    """The first plain call leaves a repeat for its signature; the second learns its launches
    from the general path; from the third on the repeat starts them itself. New values every
    call, each right against float64, and one repeat for all of them."""
    from flashedu import triton_backend as repeat

    repeats = _repeats(monkeypatch)
    started = _started_launches(monkeypatch)
    dout = torch.randn(1, 2, 45, 16)
    for step in range(4):
        q, k, v = _qkv(1, 2, 2, 45, 45, 16)
        got = _grads(q, k, v, dout, is_causal=True)
        want = _reference_grads(q, k, v, dout, is_causal=True)
        assert all(_err(g, r) < 1e-5 for g, r in zip(got, want)), step
        (r,) = repeats.values()
        assert isinstance(r, repeat.Repeat)
        assert (r.forward_plan is not None) == (step >= 1)
        assert (r.backward_plan is not None) == (step >= 1)
    launches = 1 + (r.backward_plan[0] is not None) + len(r.backward_plan[1])
    own = [s for s in started if s is r.forward_plan or s is r.backward_plan[0]
           or s in r.backward_plan[1]]
    assert len(own) >= 2 * launches  # steps 2 and 3 started the repeat's own launches


def test_a_repeated_call_with_sinks_takes_the_repeat_with_this_call_s_sinks(monkeypatch):
    """Sinks are data: a call with sinks of one layout repeats like a plain call, and each
    call's own sink values (new every step, as a trained parameter) reach the kernels, forward
    and backward (the sinks' gradient from the preprocess pass, its D reused)."""
    from flashedu import triton_backend as repeat

    repeats = _repeats(monkeypatch)
    dout = torch.randn(1, 4, 40, 16, device=_device())
    for step in range(4):
        q, k, v = _qkv(1, 4, 2, 40, 40, 16)
        sinks = torch.randn(4, device=_device(), requires_grad=True)
        out = flashedu.attention(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks,
                                 backend="triton")
        grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
        ref = reference_attention(q, k, v, is_causal=True, enable_gqa=True,
                                  sinks=sinks.double())
        want = torch.autograd.grad(ref, (q, k, v, sinks), dout.double())
        assert _err(out, ref) < 1e-5, step
        assert all(_err(g, w) < 1e-5 for g, w in zip(grads, want)), step
        (r,) = repeats.values()
        assert isinstance(r, repeat.Repeat)
        assert (r.forward_plan is not None) == (step >= 1)


def test_a_repeated_dropout_call_draws_its_own_state_as_the_general_path(monkeypatch):
    """Dropout takes the repeat too: each call draws its RNG state from torch's generator as
    the general path does, so after the same torch.manual_seed a repeated call drops the
    entries the first call dropped (output and gradients equal), and two calls in a row drop
    differently; the rate is in the signature."""
    from flashedu import triton_backend as repeat

    repeats = _repeats(monkeypatch)
    q, k, v = _qkv(1, 2, 2, 40, 40, 16)
    dout = torch.randn(1, 2, 40, 16, device=_device())
    runs = []
    for _ in range(3):
        torch.manual_seed(7)
        runs.append(_grads(q, k, v, dout, is_causal=True, dropout_p=0.25))
    (r,) = repeats.values()
    assert isinstance(r, repeat.Repeat) and r.dropout_p == 0.25 and r.forward_plan is not None
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    one, two = (_grads(q, k, v, dout, is_causal=True, dropout_p=0.25)[0] for _ in range(2))
    assert not torch.equal(one, two)
    _grads(q, k, v, dout, is_causal=True, dropout_p=0.5)
    assert len(repeats) == 2


@pytest.mark.parametrize("change", ["causal", "scale", "strides", "alignment", "gqa", "dtype"])
def test_a_repeat_is_kept_per_signature(monkeypatch, change):
    """A call that differs in anything the checks or the launches read gets its own repeat
    (or none), never another signature's: right against float64 either way."""
    repeats = _repeats(monkeypatch)
    base = dict(is_causal=False, scale=0.25)
    q, k, v = _qkv(1, 4, 4, 40, 40, 16)
    dout = torch.randn(1, 4, 40, 16, device=_device())
    _grads(q, k, v, dout, **base)
    kw = dict(base)
    if change == "causal":
        kw["is_causal"] = True
    elif change == "scale":
        kw["scale"] = 0.5
    elif change == "strides":  # (B, N, H, d) memory seen as (B, H, N, d)
        q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                   for t in (q, k, v))
    elif change == "alignment":  # one float in: 4-byte aligned, not 16-byte
        q = torch.randn(1 + 4 * 40 * 16, device=_device())[1:].reshape(1, 4, 40, 16)
        q.requires_grad_()
    elif change == "gqa":
        q, k, v = _qkv(1, 4, 2, 40, 40, 16)
    elif change == "dtype":
        q, k, v = _qkv(1, 4, 4, 40, 40, 16, dtype=torch.float64)
    for _ in range(3):
        q, k, v = (t.detach().normal_().requires_grad_() for t in (q, k, v))
        if change == "dtype":
            with pytest.raises(TypeError, match="triton backend takes"):
                _grads(q, k, v, dout.double(), **kw)
            continue
        got = _grads(q, k, v, dout, **kw)
        want = _reference_grads(q, k, v, dout, **kw)
        assert all(_err(g, r) < 1e-5 for g, r in zip(got, want))
    assert len(repeats) == (1 if change == "dtype" else 2)


def test_views_of_one_projection_reach_the_kernels_uncopied(monkeypatch):
    """q, k, v split out of one (B, N, 3, H, d) projection, as a transformer layer does (gaps
    between their rows): no copy of them, forward or backward; the output and the gradients
    laid out (B, N, H, d), so that the layer's reshape to (B, N, H * d) is a view; the calls
    repeat (the repeat starts its own launches); every value as from contiguous copies."""
    from flashedu import triton_backend as repeat

    repeats = _repeats(monkeypatch)
    started = _started_launches(monkeypatch)
    B, N, H, d = 2, 37, 3, 16
    copies = []
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, _c=torch.Tensor.contiguous,
                        **kw: (copies.append(t.shape) if not t.is_contiguous() else None)
                        or _c(t, *a, **kw))
    for step in range(3):
        qkv = torch.randn(B, N, 3, H, d, device=_device(), requires_grad=True)
        dout = torch.randn(B, N, H, d, device=_device()).transpose(1, 2)  # as the layer's
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        out = flashedu.attention(q, k, v, is_causal=True, backend="triton")
        (dqkv,) = torch.autograd.grad(out, qkv, dout)
        assert copies == [], step
        assert out.transpose(1, 2).is_contiguous()  # (B, N, H * d) is a view
        dense = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
        copies.clear()
        want = flashedu.attention(*dense, is_causal=True, backend="triton")
        assert torch.equal(out, want)
        grads = torch.autograd.grad(want, dense, dout)
        assert torch.equal(dqkv, torch.stack(grads).permute(1, 3, 0, 2, 4))
        copies.clear()
    r = repeats[next(iter(repeats))]
    assert isinstance(r, repeat.Repeat) and r.forward_plan is not None
    assert r.forward_plan in started and r.backward_plan is not None


@pytest.mark.parametrize("option", ["gqa", "causal", "dropout", "sinks", "lse", "block_mask"])
def test_views_of_one_projection_give_the_bits_of_contiguous_copies(option):
    """q (H heads) and k, v (Hkv heads) split out of one (B, N, H + 2 Hkv, d) projection, with
    each option of a call: output, lse and gradients bit for bit those of contiguous copies
    (same kernels, same tiles; only the strides differ)."""
    g = torch.Generator().manual_seed(0)
    B, H, N, d = 2, 4, 45, 16
    Hkv = 2 if option == "gqa" else H
    x = torch.randn(B, N, H + 2 * Hkv, d, generator=g).to(_device())
    views = (x[:, :, :H], x[:, :, H:H + Hkv], x[:, :, H + Hkv:])
    kw = {"gqa": dict(enable_gqa=True), "causal": dict(is_causal=True),
          "dropout": dict(dropout_p=0.25), "lse": dict(return_lse=True),
          "sinks": dict(sinks=torch.randn(H, generator=g).to(_device())),
          "block_mask": dict(block_mask=flashedu.BlockMask.from_mask_mod(
              lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < 20, 1, 1, N, N,
              block_size=(16, 16), device=_device()))}[option]
    dout = torch.randn(B, H, N, d, generator=g).to(_device())
    results = []
    for layout in (lambda t: t.transpose(1, 2), lambda t: t.transpose(1, 2).contiguous()):
        q, k, v = (layout(t).detach().requires_grad_() for t in views)
        torch.manual_seed(3)  # the same dropout mask for both
        out = flashedu.attention(q, k, v, backend="triton", **kw)
        o, lse = out if option == "lse" else (out, None)
        loss = (o * dout).sum() + (lse.sum() if lse is not None else 0)
        results.append((o, *(() if lse is None else (lse,)), *torch.autograd.grad(loss, (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_repeat_is_not_taken_where_the_general_path_differs(monkeypatch):
    """Negative and conjugate views, options of other types, masks, lse, a dropout rate of
    another type or off the stream's steps, and inputs the general path copies (a last dim
    with a stride) all take the general path, and are right."""
    from flashedu import triton_backend as repeat

    repeats = _repeats(monkeypatch)
    q, k, v = _qkv(1, 2, 2, 33, 33, 16)
    dout = torch.randn(1, 2, 33, 16, device=_device())
    for _ in range(2):
        _grads(q, k, v, dout)
    assert len(repeats) == 1
    before = dict(repeats)
    neg = torch._neg_view(q.detach())
    want = reference_attention(-q.detach(), k.detach(), v.detach())
    assert _err(flashedu.attention(neg, k, v, backend="triton"), want) < 1e-5
    flashedu.attention(q, k, v, backend="triton", is_causal=np.bool_(False))
    flashedu.attention(q, k, v, backend="triton", scale=np.float32(0.25))
    flashedu.attention(q, k, v, backend="triton", return_lse=True)
    flashedu.attention(q, k, v, backend="triton", dropout_p=np.float64(0.1))
    flashedu.attention(q, k, v, backend="triton", dropout_p=1)
    with pytest.raises(ValueError, match="1/256"):
        flashedu.attention(q, k, v, backend="triton", dropout_p=1e-4)
    assert repeats == before
    strided = torch.randn(1, 2, 33, 32, device=_device())[..., ::2].requires_grad_()
    for _ in range(2):
        got = _grads(strided, k, v, dout)
        want = _reference_grads(strided, k, v, dout)
        assert all(_err(g, r) < 1e-5 for g, r in zip(got, want))
    assert sum(r is None for r in repeats.values()) == 1  # checked, but no repeat
    made = []
    monkeypatch.setattr(repeat, "make_repeat", lambda *a: made.append(a))
    _grads(strided, k, v, dout)
    _grads(q, k, v, dout)
    assert made == []  # each signature was asked once, not at every call


def _tile_mask(seed, Nq, Nk, block=(16, 32), is_causal=False, mask_mod=None):
    """A random block mask over whole tiles, with an empty row of tiles (zeros expected)."""
    from flashedu import BlockMask

    Tr, Tc = -(-Nq // block[0]), -(-Nk // block[1])
    tiles = np.random.default_rng(seed).random((Tr, Tc)) < 0.5
    tiles[1] = False
    return BlockMask(tiles, block, (Nq, Nk), is_causal=is_causal, mask_mod=mask_mod)


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_repeated_block_mask_call_goes_straight_to_its_repeat(monkeypatch, is_causal):
    """A block mask built once and passed every step (whose tiles need no mask mod) is part of
    the signature: from the third call on its repeat starts the launches with the mask's tile
    lists, GQA and ragged lengths included; right against float64 every step."""
    from flashedu import triton_backend as repeat

    repeats = _repeats(monkeypatch)
    started = _started_launches(monkeypatch)
    mask = _tile_mask(0, 45, 70, is_causal=is_causal)
    dout = torch.randn(1, 4, 45, 16)
    for step in range(4):
        q, k, v = _qkv(1, 4, 2, 45, 70, 16)
        got = _grads(q, k, v, dout, block_mask=mask)
        want = _reference_grads(q, k, v, dout, block_mask=mask, enable_gqa=True)
        assert all(_err(g, r) < 1e-5 for g, r in zip(got, want)), step
        assert got[0][:, :, 16:32].abs().max() == 0  # the empty row of tiles
        (r,) = repeats.values()
        assert isinstance(r, repeat.Repeat) and r.block_mask is mask
        assert r.is_causal == is_causal and (r.forward_plan is not None) == (step >= 1)
    assert started.count(r.forward_plan) >= 2


def test_a_block_mask_s_repeat_is_kept_per_mask(monkeypatch):
    """An equal mask built again shares the repeat (masks are values); another tile pattern,
    or the same tiles with a mask mod, gets its own."""
    from flashedu import mods

    repeats = _repeats(monkeypatch)
    q, k, v = _qkv(1, 2, 2, 40, 64, 16)
    dout = torch.randn(1, 2, 40, 16)
    band = _tile_mask(0, 40, 64, mask_mod=mods.sliding_window(9))
    assert band.needs_mask_mod
    for seed, mod in ((0, None), (0, None), (1, None), (1, None), (0, band.mask_mod)):
        mask = _tile_mask(seed, 40, 64, mask_mod=mod)  # a new object each call
        got = _grads(q, k, v, dout, block_mask=mask)
        want = _reference_grads(q, k, v, dout, block_mask=mask)
        assert all(_err(g, r) < 1e-5 for g, r in zip(got, want)), seed
    assert len(repeats) == 3


@pytest.mark.parametrize("mod", [flashedu.mods.sliding_window(9),
                                 flashedu.mods.document.from_lengths([20, 25])],
                         ids=["window (compiled)", "documents (element masks)"])
def test_a_mask_mod_s_repeat_applies_its_rule(monkeypatch, mod):
    """A block mask whose partial tiles need its mask mod repeats too: its launches, planned
    with the mask's rule (compiled, or its element masks), start from the third call on;
    right against float64 each call, and create_graph behaves as on the general path
    (first-order gradients right, a second backward refused)."""
    from flashedu import BlockMask

    repeats = _repeats(monkeypatch)
    started = _started_launches(monkeypatch)
    window = BlockMask.from_mask_mod(mod, 1, 1, 45, 45, block_size=(16, 16))
    assert window.needs_mask_mod
    dout = torch.randn(1, 4, 45, 16)
    for step in range(4):
        q, k, v = _qkv(1, 4, 2, 45, 45, 16)
        got = _grads(q, k, v, dout, block_mask=window)
        want = _reference_grads(q, k, v, dout, block_mask=window, enable_gqa=True)
        assert all(_err(g, r) < 1e-5 for g, r in zip(got, want)), step
        (r,) = repeats.values()
        assert r.call.mods.mask_mod is window.mask_mod and (r.forward_plan is not None) == (step >= 1)
    assert started.count(r.forward_plan) >= 2 and started.count(r.backward_plan[1][0]) >= 2
    out = flashedu.attention(q, k, v, block_mask=window, enable_gqa=True, backend="triton")
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    want, = torch.autograd.grad(reference_attention(q, k, v, block_mask=window,
                                                    enable_gqa=True).square().sum(), q)
    assert _err(dq, want) < 1e-5 and dq.requires_grad
    with pytest.raises(RuntimeError, match="no double backward"):
        dq.sum().backward()


def test_a_repeat_keeps_no_tensor_and_refuses_double_backward(monkeypatch):
    """A repeat holds launches, never tensors; create_graph through it gives the first-order
    gradient, and a second backward the operator's clear error."""
    import gc
    import weakref

    _repeats(monkeypatch)
    for _ in range(3):
        q, k, v = _qkv(1, 2, 2, 24, 24, 16)
        out = flashedu.attention(q, k, v, backend="triton", is_causal=True)
        dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    want, = torch.autograd.grad(reference_attention(q, k, v, is_causal=True).square().sum(), q)
    assert _err(dq, want) < 1e-5 and dq.requires_grad
    with pytest.raises(RuntimeError, match="has no double backward"):
        torch.autograd.grad(dq.sum(), (q, k, v))
    refs = [weakref.ref(t) for t in (q, k, v, out, dq)]
    del q, k, v, out, dq
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="compiled kernels started directly from a plan need a CUDA GPU")
@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(dropout_p=0.2), dict(block_mask=1)])
def test_plans_start_compiled_kernels_directly(monkeypatch, kw):
    """On a GPU a repeated call starts the compiled kernels that its plan kept, with the new
    call's tensors: forward and backward right against the float64 reference each time."""
    from flashedu import BlockMask
    from flashedu.triton import fast

    monkeypatch.setattr(fast, "PLANS", {})
    if "block_mask" in kw:
        tiles = np.random.default_rng(0).random((8, 8)) < 0.5
        np.fill_diagonal(tiles, True)  # block-level only: a mask mod's call takes no plan
        kw = dict(block_mask=BlockMask.from_dense(tiles, block_size=(128, 128),
                                                  seq_lens=(1000, 1000)))
    for step in range(3):
        q, k, v = (torch.randn(2, 4, 1000, 64, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        if "dropout_p" in kw:
            _check_with_dropout_stream(q, k, v, **kw)
        else:
            _check(q, k, v, **kw)
        assert len(fast.PLANS) == 2
    assert all(launch.hit is not None for plan in fast.PLANS.values()
               for launch in ((plan,) if isinstance(plan, fast.Launch) else
                              (plan[0], *plan[1])))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="a repeat starts compiled kernels directly only on a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_repeat_starts_compiled_kernels_directly(monkeypatch, dtype):
    """The course GPT's call on a GPU, four steps: from the third on its repeat starts the
    compiled kernels itself; forward and backward right against float64 every step."""
    repeats = _repeats(monkeypatch)
    for _ in range(4):
        q, k, v = (torch.randn(2, 4, 500, 64, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        _check(q, k, v, is_causal=True)
    (r,) = repeats.values()
    first, launches = r.backward_plan
    assert all(launch.hit is not None for launch in (r.forward_plan, first, *launches))


def test_launch_key_holds_what_triton_specializes_on():
    """Two calls share a compiled kernel only if Triton would give them the same one: the key
    holds each int's value (finer than Triton's width and divisibility by 16), and each
    tensor's dtype and 16-byte alignment."""
    from flashedu.triton.fast import _arg_key

    assert _arg_key(32) != _arg_key(33) and _arg_key(1) != _arg_key(17)
    assert _arg_key(2 ** 31) != _arg_key(2 ** 31 - 16) and _arg_key(None) is None
    assert _arg_key(0.5) == _arg_key(2.0) != _arg_key(2)
    x = torch.zeros(64)
    assert _arg_key(x) == _arg_key(torch.ones(64)) != _arg_key(x[1:])
    assert _arg_key(x) != _arg_key(x.half())


def test_inlined_launch_key_equals_the_per_argument_one():
    """``_key`` tests ints, None and plain tensors inline; every argument still gets exactly
    what ``_arg_key`` gives it (a Parameter, a float, a bool through the general path)."""
    from flashedu.triton.fast import _arg_key, _key

    x = torch.zeros(64)
    args = (x, x[1:], x.half(), torch.nn.Parameter(torch.ones(8)), 7, 2 ** 40, None, 0.5, True)
    assert _key(args) == tuple(_arg_key(a) for a in args)
    assert _key((x, 16)) != _key((x[1:], 16)) and _key((x, 16)) != _key((x, 17))


def test_launch_hooks_send_launches_through_triton(monkeypatch):
    """A profiler's launch hook (a non-empty HookChain) needs Triton's own launch path."""
    import triton

    from flashedu.triton import fast
    from flashedu.triton import forward as fw

    knobs = getattr(triton, "knobs", None)
    if knobs is None or flashedu.runtime.triton_interpreted():
        pytest.skip("compiled Triton with knobs needed (the interpreter never launches directly)")
    assert fast._direct_ok(fw.forward_kernel)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert not fast._direct_ok(fw.forward_kernel)


def test_a_call_checks_its_direct_starts_once(monkeypatch):
    """``stream_for`` makes the checks of a direct start once for a call's launches (a compiled
    kernel for each, no launch hook, their device current); ``start(stream=)`` then starts each
    compiled kernel on that stream with the call's own tensors in its slots."""
    import triton

    from flashedu.triton import fast
    from flashedu.triton import forward as fw

    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        pytest.skip("a Triton with knobs needed (an older one never launches directly)")

    class Compiled:  # a compiled kernel that records its starts
        function = packed_metadata = None

        def __init__(self):
            self.starts = []

        def run(self, *args):
            self.starts.append(args)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device,
                        raising=False)  # a CPU build of torch has none
    monkeypatch.setattr(fast, "FAST_LAUNCH", True)
    launches = [fast.Launch(fw.forward_kernel, (3, 2), ("q", "k", 7, 8), {}, (0, 1))
                for _ in range(2)]
    for launch in launches:
        launch.hit, launch.device = (Compiled(), ("tail",), None), 0
    stream = fast.stream_for(*launches)
    assert stream == 1000
    launches[0].start("Q", "K", stream=stream)
    (args,) = launches[0].hit[0].starts
    assert args[:4] == (3, 2, 1, 1000) and args[-5:] == ("Q", "K", 7, 8, "tail")
    assert launches[0].args == [None, None, 7, 8]  # the launch keeps no tensor
    with monkeypatch.context() as m:  # a profiler's hook: Triton's own path for every launch
        m.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
        assert fast.stream_for(*launches) is None
    with monkeypatch.context() as m:  # another device current
        m.setattr(torch.cuda, "current_device", lambda: 1)
        assert fast.stream_for(*launches) is None
    launches[1].hit = None  # a launch with no compiled kernel kept
    assert fast.stream_for(*launches) is None
    assert fast.stream_for(launches[0], None) == 1000  # None: a launch the call does not make
    monkeypatch.setattr(fast, "FAST_LAUNCH", False)  # direct starts failed on this Triton
    assert fast.stream_for(launches[0], None) is None


def _fake_launcher(monkeypatch, scratch=128):
    """Triton's CudaLauncher as far as ``fast.Opened`` reads it, on the launcher layout it
    knows; returns (the list its C launch function appends its arguments to, a compiled
    kernel whose launcher it is)."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    from flashedu.triton import fast

    calls = []

    class Launcher:
        global_scratch_size, num_ctas, profile_scratch_size = scratch, 1, 0
        launch_cooperative_grid, launch_pdl = False, False

        def launch(self, *args):
            calls.append(args)

    class Compiled:
        function, packed_metadata, run = 77, (4, 1, 1024), Launcher()

    monkeypatch.setattr(driver, "CudaLauncher", Launcher)
    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", "iiiKKpp" + "O" * 6, raising=False)
    monkeypatch.setattr(fast.Opened, "_buffers", {})
    monkeypatch.setattr(fast, "FAST_LAUNCH", True)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False,
                        raising=False)
    return calls, Compiled()


def test_a_plan_starts_the_opened_launcher_with_addresses(monkeypatch):
    """On Triton's known launcher layout a plan's launch calls the C launch function itself,
    argument for argument as Triton's ``CudaLauncher`` does, bound once to everything but the
    call's own tensors, which go in as their addresses."""
    from flashedu.triton import fast
    from flashedu.triton import forward as fw

    calls, compiled = _fake_launcher(monkeypatch, scratch=0)
    opened = fast.Opened.of(compiled)
    launch = fast.Launch(fw.forward_kernel, (3, 2), ("q", 7), {}, (0,))
    launch.hit, launch.device = (compiled, ("tail",), opened), "cpu"
    launch.go = launch.bound()
    q = torch.zeros(4)
    launch.start(q, stream=1000)
    (args,) = calls
    assert args == (3, 2, 1, 1000, 77, False, False, None, None, (4, 1, 1024), None, None, None,
                    q.data_ptr(), 7, "tail")
    assert launch.args == [None, 7]  # the launch keeps no tensor
    odd = fast.Launch(fw.forward_kernel, (3,), (7, "q"), {}, (1,))  # its tensor not leading
    odd.hit = (compiled, (), opened)
    assert odd.bound() is None  # (dropout's RNG state): the launch goes through _start


def test_a_failed_direct_start_falls_back_to_tritons_dispatch(monkeypatch):
    """A launcher that rejects the call: a warning, then Triton's own dispatch with the
    call's tensors, for this launch and every later one."""
    from flashedu.triton import fast

    calls, compiled = _fake_launcher(monkeypatch)

    class Kernel:  # Triton's own dispatch
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append(("dispatch", grid, a))

    def broken(stream, lead):
        raise TypeError("a launcher laid out otherwise")

    launch = fast.Launch(Kernel(), (3, 2), ("q", 7), {}, (0,))
    launch.hit, launch.device, launch.go = (compiled, (), fast.Opened.of(compiled)), "cpu", broken
    monkeypatch.setattr(fast, "_COMPILED", {})
    q = torch.zeros(4)
    with pytest.warns(UserWarning, match="directly failed"):
        launch.start(q, stream=1000)
    assert calls == [("dispatch", (3, 2), (q, 7))] and not fast.FAST_LAUNCH


def test_the_opened_launcher_keeps_one_scratch_buffer_per_stream(monkeypatch):
    """A kernel that makes tensor descriptors gets one scratch buffer per stream (grown when a
    grid needs more) instead of a fresh allocation per launch; under CUDA-graph capture a
    fresh one, as Triton's launcher does: the graph keeps the address it captured."""
    from flashedu.triton import fast

    calls, compiled = _fake_launcher(monkeypatch)
    opened = fast.Opened.of(compiled)
    opened.bind((3, 2), (), "cpu")(1000, ["q"])
    buf = fast.Opened._buffers["cpu", 1000]
    assert calls[-1][7] == buf.data_ptr() and buf.numel() == 3 * 2 * 128
    opened.bind((2,), (), "cpu")(1000, ["q"])  # a smaller grid: the same buffer
    assert calls[-1][7] == buf.data_ptr()
    opened.bind((2,), (), "cpu")(2000, ["q"])  # another stream: its own buffer
    assert fast.Opened._buffers["cpu", 2000].data_ptr() == calls[-1][7] != buf.data_ptr()
    opened.bind((9, 2), (), "cpu")(1000, ["q"])  # a larger grid: the buffer grows
    assert fast.Opened._buffers["cpu", 1000].numel() == 9 * 2 * 128
    kept = dict(fast.Opened._buffers)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True,
                        raising=False)
    opened.bind((2,), (), "cpu")(1000, ["q"])
    assert fast.Opened._buffers == kept
    assert calls[-1][7] not in {b.data_ptr() for b in kept.values()}


def test_only_the_known_launcher_layout_is_opened(monkeypatch):
    """A profiler's scratch or another launcher layout keeps Triton's own launcher."""
    from triton.backends.nvidia import driver

    from flashedu.triton import fast

    _, compiled = _fake_launcher(monkeypatch)
    assert fast.Opened.of(compiled) is not None
    type(compiled.run).profile_scratch_size = 64
    assert fast.Opened.of(compiled) is None
    type(compiled.run).profile_scratch_size = 0
    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", "iiiKKppOOOO", raising=False)
    assert fast.Opened.of(compiled) is None


@pytest.mark.skipif(not flashedu.runtime.triton_interpreted(),
                    reason="the kernels are compiled here, not interpreted")
def test_launch_falls_back_under_the_interpreter():
    """The interpreter has no compiled kernel to keep: every launch is Triton's own call."""
    from flashedu.triton import fast

    q, k, v = (x.detach() for x in _qkv(1, 2, 2, 40, 40, 16))
    before = len(fast._COMPILED)
    out = flashedu.attention(q, k, v, backend="triton")
    assert len(fast._COMPILED) == before
    assert _err(out, reference_attention(q, k, v)) < 1e-5


def test_dense_launch_takes_no_placeholder_tensors():
    """A dense launch passes None for the block-sparse lists (nothing allocated per call) and
    shares its constexprs across calls of one configuration."""
    from flashedu.triton import forward as fw
    from flashedu.triton.config import Tiles

    q, k, v = (x.detach() for x in _qkv(1, 2, 2, 40, 40, 16))
    o, lse2 = torch.empty_like(q), torch.empty(1, 2, 40)
    kw = dict(is_causal=True, scale=0.3, block_mask=None, tiles=Tiles(32, 16),
              interpreted=True)
    grid, args, consts = fw.forward_launch(q, k, v, o, lse2, **kw)
    assert args[-1] is None and grid == (2, 2)  # LISTS: none
    assert fw.forward_launch(q, k, v, o, lse2, **kw)[2] == consts


@pytest.mark.parametrize("name", ["sm80", "sm86", "sm89"])
def test_safe_tables_fit_their_shared_memory(name):
    """Every entry of a table fitted to another GPU (16-bit inputs; the FMA tables of Turing
    and of fp32 are checked compiled, below) fits that GPU's shared memory per block by the
    estimate, with no Hopper-only switch."""
    from flashedu.triton import config

    budget, elem = config.SMEM_PER_BLOCK[name], 2
    for D, entry in config.table(name, False).items():
        for kind, t in (("forward", entry.forward), ("dkdv", entry.dkdv), ("dq", entry.dq)):
            fits = config.smem_estimate(kind, t.Br, t.Bc, t.num_stages, D, elem) <= budget
            assert fits or config.smaller(t) is None, (D, kind, t)
            assert not (t.tma or t.warp_specialize) and min(t.Br, t.Bc) >= config.MIN_TILE


@pytest.mark.parametrize("name", ["sm80", "sm86", "sm89"])
def test_fitted_tables_fit_the_registers(name):
    """Each entry of a fitted table (16-bit inputs) keeps within REGISTER_WORDS per thread by
    the count of register_words (above that, ptxas spilled: the next test compiles them)."""
    from flashedu.triton import config

    elem = 2
    for D, entry in config.table(name, False).items():
        for kind, t in (("forward", entry.forward), ("dkdv", entry.dkdv), ("dq", entry.dq)):
            words = config.register_words(kind, t.Br, t.Bc, D, elem)
            assert words <= config.REGISTER_WORDS * 32 * t.num_warps or config.smaller(t) is None


# (table, dtype, head dims): each compiled for its own GPU by `flashedu bench sass`
COMPILED_TABLES = [("sm75", "fp16", [64, 128, 256]), ("sm80", "bf16", [128, 256]),
                   ("sm86", "fp32", [128, 256]), ("sm90", "fp32", [128]), ("sm90", "bf16", [256])]


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype,dims", COMPILED_TABLES)
def test_tables_compile_for_their_gpu_within_its_shared_memory(name, dtype, dims, tmp_path):
    """The forward and backward launches of a GPU's table, compiled for that GPU (no GPU
    needed): their shared memory fits its per-block limit, which running another GPU's table on
    an H100 cannot show, and they do not spill more than a word or two. Two measured
    exceptions: sm75 at d=256, the backward's few hundred bytes, the least of the tiles tried
    (config.FMA_TABLE); sm90 at d=256, the dK/dV program's 272 bytes, whose 64 x 64 tiles ran
    1.8x the spill-free 16 x 64 on the H100 (config.GPU_16BIT)."""
    import json

    from flashedu import cli
    from flashedu.benchmarks import sass
    from flashedu.triton import config

    if not sass.can_compile():
        pytest.skip("this Triton has no NVIDIA backend tools: nothing can compile for a GPU")
    out = tmp_path / "sass.json"
    argv = ["bench", "sass", "--table", name, "--dtype", dtype, "--variants", "plain",
            "--d", *map(str, dims), "--json", str(out)]
    assert cli.main(argv) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["kernel"] != "preprocess_kernel"]
    assert len(rows) == 3 * len(dims)
    for r in rows:
        where = (name, dtype, r["d"], r["kernel"], r["tiles"])
        assert r["shared_bytes"] <= config.SMEM_PER_BLOCK[name], where
        spilling = {("sm75", 256, "backward_kernel"), ("sm90", 256, "backward_kernel")}
        allowed = 512 if (name, r["d"], r["kernel"]) in spilling else 8
        assert r["stack_bytes"] <= allowed, (where, r["stack_bytes"])


@pytest.mark.slow
def test_dropout_kernels_compile_within_the_h100_shared_memory(tmp_path):
    """Dropout takes shared memory too (the keep mask moves from the random numbers' layout to
    P_ij's through it): the forward and backward launches with dropout, compiled for sm_90 at
    the head dims whose tables have dropout entries, fit 227 KB (the dQ program of d=256 with
    3 stages needed 228 KB and had to be retried on the H100)."""
    import json

    from flashedu import cli
    from flashedu.benchmarks import sass
    from flashedu.triton import config

    if not sass.can_compile():
        pytest.skip("this Triton has no NVIDIA backend tools: nothing can compile for a GPU")
    out = tmp_path / "sass.json"
    argv = ["bench", "sass", "--table", "sm90", "--dtype", "bf16", "--variants", "dropout",
            "--d", "128", "256", "--json", str(out)]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["d"] for r in rows} == {128, 256}
    for r in rows:
        assert r["shared_bytes"] <= config.SMEM_PER_BLOCK["sm90"], (r["d"], r["kernel"], r["tiles"])


def test_register_cap_of_the_small_head_dims():
    """sm_90, d <= 64: every kernel capped at 128 registers (two 8-warp programs per SM), with
    dropout too (its Philox calls, drawn 16 entries a call, fit under the cap)."""
    from flashedu.triton import config
    from flashedu.triton.forward import launch_args

    for D in (16, 32, 64):
        entry = config.GPU_16BIT[D]
        for t in (entry.forward, entry.dkdv, entry.dq):
            assert t.num_warps == 8 and t.launch()["maxnreg"] == 128
    assert "maxnreg" not in config.GPU_16BIT[128].forward.launch()
    q = torch.zeros(1, 2, 256, 64)
    tiles = config.GPU_16BIT[64].forward
    for p in (0.0, 0.1):
        _, _, consts = launch_args(q, q, q, q, q[..., 0], is_causal=True, scale=0.125,
                                   block_mask=None, tiles=tiles, interpreted=False,
                                   dropout_p=p, rng=torch.tensor([1, 2]))
        assert consts["maxnreg"] == 128


def test_tile_table_by_name_and_environment(monkeypatch):
    from flashedu.triton import config

    assert config.table("sm90", False) is config.GPU_16BIT
    assert config.table("sm89", True) == config.table("sm86", True)  # both 99 KB a block
    if not torch.cuda.is_available():  # reading the tables without a GPU
        assert config.kernel_config(100, False, False) is config.GPU_16BIT[128]
        monkeypatch.setenv(config.TABLE_ENV, "sm75")
        assert config.kernel_config(64, True, False) == config.table("sm75", True)[64]
    with pytest.raises(ValueError, match="sm80"):
        config.table("sm99", False)
    t = config.Tiles(64, 32, 4, 3)
    seen = []
    while t is not None:
        seen.append(t)
        t = config.smaller(t)
    assert seen[-1] == config.Tiles(16, 16, 4, 1) and len(seen) == len(set(seen))


@pytest.mark.parametrize("causal", [False, True])
def test_backward_adds_into_given_buffers(causal):
    """``into``: the kernels add a call's gradients to the caller's buffers (float32 views of
    larger tensors, as ring attention's accumulators), and return them; a repeated call adds
    again through its launch plan. GQA, ragged sizes, a padded head dim."""
    from flashedu.triton import launch
    from flashedu.triton.config import INTERPRETER

    q, k, v = (x.detach() for x in _qkv(1, 4, 2, 45, 37, 24))
    do = torch.randn_like(q)
    call = ops.Call(causal, 0.2)
    o, lse2 = launch.forward(q, k, v, call, tiles=INTERPRETER.forward)
    fresh = launch.backward(q, k, v, o, lse2, do, call, config=INTERPRETER)
    # views with strides of their own: rows 3.. of taller float32 tensors
    big = [torch.randn(x.shape[0], x.shape[1], x.shape[2] + 3, x.shape[3], device=x.device)
           for x in (q, k, v)]
    into = tuple(b[:, :, 3:] for b in big)
    before = [t.clone() for t in into]
    outside = [b[:, :, :3].clone() for b in big]
    assert launch.backward(q, k, v, o, lse2, do, call, config=INTERPRETER, into=into) is into
    for got, start, g in zip(into, before, fresh):
        torch.testing.assert_close(got, start + g.float(), rtol=1e-5, atol=1e-5)
    launch.backward(q, k, v, o, lse2, do, call, config=INTERPRETER, into=into)  # once more
    for got, start, g in zip(into, before, fresh):
        torch.testing.assert_close(got, start + 2 * g.float(), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(b[:, :, :3], b0) for b, b0 in zip(big, outside))  # untouched
    with pytest.raises(ValueError, match="into: dk must have shape"):
        launch.backward(q, k, v, o, lse2, do, call, config=INTERPRETER,
                        into=(into[0], into[0], into[2]))


def test_out_of_resources_retries_with_smaller_tiles(monkeypatch):
    """Triton's out-of-resources error: the launch retries with smaller tiles, once per
    configuration; later calls start from the tiles that fit."""
    from flashedu.triton import backward as bw
    from flashedu.triton import fast, launch
    from flashedu.triton import forward as fw
    from flashedu.triton.config import INTERPRETER, Tiles

    q, k, v, do = (x.detach() for x in _qkv(1, 2, 2, 50, 45, 16) + (torch.randn(1, 2, 50, 16),))
    do = do.to(q.device)
    call = ops.Call(True, 0.25)
    o_ref, lse2_ref = launch.forward(q, k, v, call, tiles=INTERPRETER.forward)
    ref = launch.backward(q, k, v, o_ref, lse2_ref, do, call, config=INTERPRETER)
    real_launch, real_run = fast.launch, fast.run
    tried = []

    def picky_launch(kernel, grid, args, consts, switches, slots):
        tried.append((consts["Br"], consts["Bc"]))
        if consts["Br"] * consts["Bc"] > 16 * 16:
            raise fast.OUT_OF_RESOURCES(300000, 232448, "shared memory")
        return real_launch(kernel, grid, args, consts, switches, slots)

    def picky_run(kernel, grid, args, consts):
        if kernel is bw.backward_kernel and consts["DKDV"][0] * consts["DKDV"][1] > 16 * 16:
            raise fast.OUT_OF_RESOURCES(300000, 232448, "shared memory")
        return real_run(kernel, grid, args, consts)

    monkeypatch.setattr(fast, "launch", picky_launch)
    monkeypatch.setattr(fast, "run", picky_run)
    monkeypatch.setattr(launch, "_SHRUNK_FORWARD", {})
    monkeypatch.setattr(launch, "_SHRUNK_BACKWARD", {})
    monkeypatch.setattr(fast, "PLANS", {})
    with pytest.warns(UserWarning, match="smaller tiles"):
        o, lse2 = launch.forward(q, k, v, call, tiles=Tiles(32, 16, 4, 2))
    assert tried == [(32, 16), (32, 16), (16, 16)]  # one stage fewer, then Br halved
    assert _err(o, reference_attention(q, k, v, is_causal=True, scale=0.25)) < 1e-5
    tried.clear()
    launch.forward(q, k, v, call, tiles=Tiles(32, 16, 4, 2))
    assert tried == []  # the same call again: its plan repeats the launch that fitted
    fast.PLANS.clear()
    launch.forward(q, k, v, call, tiles=Tiles(32, 16, 4, 2))
    assert tried == [(16, 16)]  # remembered for the configuration too
    config = dataclasses.replace(INTERPRETER, dkdv=Tiles(16, 32, 4, 1))
    with pytest.warns(UserWarning, match="smaller tiles"):
        grads = launch.backward(q, k, v, o, lse2, do, call, config=config)
    assert all(_err(a, b) < 1e-5 for a, b in zip(grads, ref))
    assert list(launch._SHRUNK_BACKWARD.values())[0].dkdv == Tiles(16, 16, 4, 1)

    # a variant that shrank (here dropout, which needs more shared memory) keeps its smaller
    # tiles to itself: the plain kernel of the same configuration keeps its own
    monkeypatch.setattr(launch, "_SHRUNK_FORWARD", {})
    RNG = list(inspect.signature(fw.forward_kernel.fn).parameters).index("RNG")
    monkeypatch.setattr(fast, "launch", lambda kernel, grid, args, consts, switches, slots: (
        picky_launch(kernel, grid, args, consts, switches, slots) if args[RNG] is not None
        else real_launch(kernel, grid, args, consts, switches, slots)))
    rng = torch.tensor([1, 2], device=q.device)
    fast.PLANS.clear()
    with pytest.warns(UserWarning, match="smaller tiles"):
        launch.forward(q, k, v, ops.Call(True, 0.25, None, 0.1, rng), tiles=Tiles(32, 16, 4, 2))
    tried.clear()
    launch.forward(q, k, v, call, tiles=Tiles(32, 16, 4, 2))
    assert tried == [] and len(launch._SHRUNK_FORWARD) == 1  # the plain launch was not shrunk


def test_short_sequences_take_the_short_entry_s_tiles():
    """sm_90, d=128: below short_until keys a call without a block mask or dropout takes the
    small tiles measured faster there, forward and backward (one launch); a block mask or
    dropout keeps its own tiles, and from short_until on the long entries run."""
    from flashedu.triton import backward as bwd
    from flashedu.triton import config

    entry = config.GPU_16BIT[128]
    short, until = entry.short, entry.short_until
    assert (short.forward.Br, short.forward.Bc) < (entry.forward.Br, entry.forward.Bc)
    assert entry.forward_tiles(None, 512) == entry.forward_tiles(None, until - 1) == short.forward
    assert entry.forward_tiles(None, until) == entry.forward
    assert entry.forward_tiles(None, 512, True) == entry.dropout_forward
    mask = flashedu.BlockMask.causal(512)
    assert entry.forward_tiles(mask, 512) == dataclasses.replace(
        entry.forward, tma=False, warp_specialize=False)
    for causal in (False, True):
        assert entry.backward_entry(causal, False, None, until - 1) is short
        assert bwd.fused(short, until - 1)
        long = entry.causal_backward if causal else entry
        assert entry.backward_entry(causal, False, None, until) is long
        assert entry.backward_entry(causal, False, mask, 512) is long
        assert entry.backward_entry(causal, True, None, 512) is long  # no dropout entry at 128
    d256 = config.GPU_16BIT[256]
    assert d256.forward_tiles(None, 512) == d256.forward
    assert d256.backward_entry(True, True, None, 512) is d256.dropout_backward


@pytest.mark.parametrize("d", [64, 128])
def test_dropout_takes_its_own_tiles_and_they_fit(d):
    """sm_90: a call with dropout takes dropout's forward tiles (and at d=64 its backward
    entry), a call without takes the forward's; a block-sparse dropout call the same tiles
    without TMA; and dropout's tiles fit the H100's 227 KB of shared memory by the table's
    own estimate (the GPU test below launches them)."""
    from flashedu.triton import config

    entry = config.GPU_16BIT[d]
    tiles = entry.dropout_forward
    assert tiles is not None and tiles != entry.forward
    assert entry.forward_tiles(None, 8192, True) == tiles
    assert entry.forward_tiles(None, 8192) == entry.forward
    mask = flashedu.BlockMask.causal(256)
    assert entry.forward_tiles(mask, 256, True) == dataclasses.replace(
        tiles, tma=False, warp_specialize=False)
    backward = entry.backward_entry(False, True, None, 8192)
    assert backward is (entry.dropout_backward or entry)
    assert config.smem_estimate("forward", tiles.Br, tiles.Bc, tiles.num_stages, d, 2) <= 227 << 10
    for kind in ("dkdv", "dq"):
        t = getattr(backward, kind)
        assert config.smem_estimate(kind, t.Br, t.Bc, t.num_stages, d, 2) <= 227 << 10, kind


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches on a CUDA GPU")
@pytest.mark.parametrize("d, causal", [(64, True), (64, False), (128, True)])
def test_dropout_both_orientations_of_the_dkdv_step(d, causal):
    """With dropout the dK/dV step holds S_ij upright where the mask is causal and the K/V
    tiles small (d=64's 64 x 64), else transposed: both, on the tuned tiles with their
    16-bit selects, give the float64 reference's values and gradients with the same dropout
    stream; GQA, and lengths that are not multiples of the tiles."""
    torch.manual_seed(d + causal)
    q, k, v = _qkv(2, 4, 2, 333, 333, d, torch.bfloat16)
    ref = _check_with_dropout_stream(q, k, v, is_causal=causal, dropout_p=0.1,
                                     enable_gqa=True)
    assert ref[0].abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches on a CUDA GPU")
@pytest.mark.parametrize("d", [128, 256])
def test_dropout_with_a_block_mask_on_the_tuned_tiles(d):
    """Dropout and a block mask of 64-row blocks at the head dims whose tables have tiles of
    their own for dropout (larger than 64): the same values and gradients as the float64
    reference with the same dropout stream."""
    torch.manual_seed(d)
    q, k, v = _qkv(1, 2, 2, 256, 256, d, torch.bfloat16)
    blocks = torch.rand(1, 2, 4, 4) < 0.6
    blocks[..., 0, 0] = True
    mask = flashedu.BlockMask.from_dense(blocks.numpy(), block_size=(64, 64), seq_lens=(256, 256))
    ref = _check_with_dropout_stream(q, k, v, block_mask=mask, dropout_p=0.2)
    assert ref[0].abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches on a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dropout_launches_fit_without_a_retry(d, recwarn):
    """Forward and backward with dropout launch on their table's tiles, without the retry with
    smaller tiles (which warns): the table fits dropout's shared memory."""
    q, k, v = (torch.randn(2, 4, 512, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    flashedu.attention(q, k, v, dropout_p=0.1, backend="triton").sum().backward()
    assert not [w for w in recwarn if "smaller tiles" in str(w.message)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="forcing another GPU's tile table on this one needs a CUDA GPU")
@pytest.mark.parametrize("table", ["sm75", "sm80", "sm86", "sm90"])  # sm89: sm86's
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_forced_tile_table(table, d, dtype, monkeypatch):
    """Another GPU's tiles (FLASHEDU_TILE_TABLE), run on this one: forward and backward,
    causal and not, GQA and ragged sizes, within the tolerance of the float64 reference."""
    from flashedu.triton import config

    monkeypatch.setenv(config.TABLE_ENV, table)
    config.device_table_name.cache_clear()
    config._device_config.cache_clear()
    try:
        assert config.kernel_config(d, dtype == torch.float32, False) == \
            config.table(table, dtype == torch.float32)[config.padded_head_dim(d)]
        for causal in (False, True):
            _check(*_qkv(2, 4, 2, 300, 200 if causal else 333, d, dtype), is_causal=causal)
    finally:
        config.device_table_name.cache_clear()
        config._device_config.cache_clear()


@pytest.mark.parametrize("mod, Nq, Nk, band", [
    (flashedu.mods.sliding_window(9), 45, 45, (-9, 0)),
    (flashedu.mods.sliding_window(13, alignment="bottom_right"), 40, 70, (17, 30)),
    (flashedu.mods.sliding_window(7, lookahead=5), 50, 50, (-7, 5)),
    (flashedu.mods.document.from_lengths([20, 25]), 45, 45, None),
])
def test_the_sliding_window_is_compiled_not_read(monkeypatch, mod, Nq, Nk, band):
    """The library's sliding window reaches the kernels as a compiled mask mod (the
    sliding_window hook: band_lo < key - query <= band_hi), with no element masks, not even
    built; another mask mod keeps its element masks. Right
    against float64 either way, forward and backward, GQA, bottom-right aligned or looking
    ahead."""
    from flashedu import ops
    from flashedu.triton import fast, forward, mods, sparse

    built = []  # element masks built, for any lists (none cached from an equal mask)
    monkeypatch.setattr(sparse, "_CACHE", weakref.WeakKeyDictionary())
    monkeypatch.setattr(flashedu.api, "REPEATS", {})  # an equal call's repeat or launch plan
    monkeypatch.setattr(fast, "PLANS", {})  # (an equal mask's, from an earlier test): none
    monkeypatch.setattr(sparse, "_element_masks", lambda *a, _b=sparse._element_masks, **kw:
                        built.append(a[2:4]) or _b(*a, **kw))
    bm = flashedu.BlockMask.from_mask_mod(mod, 1, 1, Nq, Nk, block_size=(16, 16))
    m = ops.Mods.of(None, None, bm)
    assert mods.band_args(m, bm) == band
    q, k = _qkv(1, 4, 2, Nq, Nk, 16)[:2]
    hook_args, hooks, elements = forward.mods_args(m, bm, q, k)
    assert elements == (band is None) and hook_args[2] == band
    launched = []
    monkeypatch.setattr(fast, "run", lambda kernel, grid, args, c, _r=fast.run, **kw:
                        launched.append((args, c)) or _r(kernel, grid, args, c, **kw))
    _check(*_qkv(1, 4, 2, Nq, Nk, 16), block_mask=bm)
    (fwd_args, fwd), (bwd_args, bwd) = launched[0], launched[-1]
    assert (fwd["MASK_MOD"] is mods.sliding_window) == (bwd["MASK_MOD"] is mods.sliding_window) \
        == (band is not None)
    # the element masks (ELEM) go with the lists of the forward and of both backward passes
    at = list(inspect.signature(forward.forward_kernel.fn).parameters).index("ELEM")
    for elem in (fwd_args[at], bwd_args[24], bwd_args[25]):
        assert (elem is not None) == (band is None)
    assert bool(built) == (band is None)  # a compiled window's element masks are never built


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("mod, causal", [
    (flashedu.mods.sliding_window(7), False),
    (flashedu.mods.sliding_window(9, alignment="bottom_right"), False),
    (flashedu.mods.prefix_lm(10), True),
    (lambda b, h, q, kv: ((q + kv + h) % 3 != 0) | (kv == 0), False),
])
def test_mask_mod_lists_rebuild_the_element_rule(mod, causal, transpose):
    """The kernels see a mask mod only through the tile lists and the partial tiles' element
    masks: rebuilt into a dense (B, H, Nq, Nk) mask, they give exactly the mask's own rule
    (no visible pair dropped, no hidden pair shown), and no listed tile is empty."""
    from flashedu.triton import sparse

    H, Nq, Nk, Br, Bc = 2, 45, 70, 16, 16
    bm = flashedu.BlockMask.from_mask_mod(mod, 1, H, Nq, Nk, block_size=(32, 32))
    want = bm.element_mask()
    if causal:
        want = want & np.tri(Nq, Nk, dtype=bool)
    num, full, idx = (t.numpy() for t in sparse.tile_lists(bm, Br, Bc, transpose, "cpu", causal))
    E, E_base = sparse.element_lists(bm, Br, Bc, transpose, "cpu", causal)
    got = np.zeros((1, H, -(-Nq // Br) * Br, -(-Nk // Bc) * Bc), bool)
    for h in range(H):
        for row in range(num.shape[-1]):
            for t in range(num[0, h, row]):
                i, j = (idx[0, h, row, t], row) if transpose else (row, idx[0, h, row, t])
                if t < full[0, h, row]:
                    tile = np.ones((Br, Bc), bool)
                else:
                    tile = E[E_base[0, h, row] + t - full[0, h, row]].numpy().astype(bool)
                    assert tile.any(), (h, i, j)  # an empty tile would be skipped, not listed
                got[0, h, i * Br:(i + 1) * Br, j * Bc:(j + 1) * Bc] = tile
    assert (got[..., :Nq, :Nk] == want).all()


# --- the H100's tuned tiles, run in the interpreter ------------------------------------------

TUNED_CASES = {  # (kwargs of flashedu.attention, B, H, Hkv, Nq, Nk)
    "causal ragged gqa": (dict(is_causal=True, enable_gqa=True), 1, 4, 2, 150, 130),
    "block mask": (dict(block_mask="64"), 1, 2, 2, 256, 256),
    "dropout": (dict(dropout_p=0.2, is_causal=True), 1, 2, 2, 136, 136),
    "dropout block mask": (dict(dropout_p=0.2, block_mask="64"), 1, 2, 2, 256, 256),
}


@pytest.mark.slow
@pytest.mark.skipif(not flashedu.runtime.triton_interpreted(),
                    reason="on a GPU the tuned tiles run compiled (test_forced_tile_table)")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", list(TUNED_CASES))
def test_tuned_gpu_tiles_in_the_interpreter(monkeypatch, d, case):
    """The H100's table (large tiles, their causal, dropout and sparse entries, fitted to a
    block mask) runs in the interpreter here: every entry's bookkeeping is checked on any
    machine, not only where a GPU runs it. Output and gradients against float64, with the
    same dropout stream where the call drops."""
    from flashedu.triton import autograd, config

    monkeypatch.setattr(autograd, "kernel_config",
                        lambda d, is_fp32, interpreted, device=None:
                        config.GPU_16BIT[config.padded_head_dim(d)])
    kw, B, H, Hkv, Nq, Nk = TUNED_CASES[case]
    kw = dict(kw)
    torch.manual_seed(d)
    q, k, v = _qkv(B, H, Hkv, Nq, Nk, d, torch.bfloat16)
    if kw.get("block_mask"):
        blocks = np.random.default_rng(d).random((B, H, Nq // 64, Nk // 64)) < 0.6
        blocks[..., 0] = True
        kw["block_mask"] = flashedu.BlockMask.from_dense(blocks, block_size=(64, 64),
                                                         seq_lens=(Nq, Nk))
    _check_with_dropout_stream(q, k, v, **kw)


# A score mod written by its user in Triton: a per-head softcap, compiled into the forward and
# the backward through the kernels' score-mod hook (no torch.compile).


@triton.jit
def _head_softcap(s, b, h, q_idx, kv_idx, args):
    cap = tl.load(args[0] + h)
    t = 2.0 * tl.sigmoid(2.0 * s / cap) - 1.0  # tanh(s / cap)
    return cap * t + args[1] * (kv_idx - q_idx).to(tl.float32), 1.0 - t * t


def _head_softcap_torch(caps, slope):
    def mod(score, b, h, q_idx, kv_idx):
        cap = caps.to(score)[h]
        return cap * torch.tanh(score / cap) + slope * (kv_idx - q_idx).to(score.dtype)
    return mod


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_score_mod_written_in_triton_runs_forward_and_backward(is_causal):
    """flashedu.mods.triton_score_mod: the user's @triton.jit hook (a per-head softcap plus a
    distance term, with its derivative) against its torch reference in float64, forward and
    gradients, GQA, ragged tiles; the call takes the hook's own arguments (a tensor, a float)."""
    torch.manual_seed(0)
    caps = torch.tensor([1.5, 3.0, 5.0, 0.7])
    q, k, v = _qkv(1, 4, 2, 37, 45, 16)
    mod = flashedu.mods.triton_score_mod(
        _head_softcap, reference=_head_softcap_torch(caps, 0.05),
        args=(caps.to(q.device), 0.05))
    got = _check(q, k, v, score_mod=mod, is_causal=is_causal)
    # the hook changed the result: it is not the plain attention
    plain = flashedu.attention(q, k, v, backend="triton", is_causal=is_causal, enable_gqa=True)
    assert _err(got[0], plain) > 1e-3


def test_a_triton_score_mod_is_checked_where_it_is_made():
    with pytest.raises(TypeError, match="hook must be a @triton.jit"):
        flashedu.mods.triton_score_mod(lambda s, b, h, q, kv, a: (s, 1.0))
    with pytest.raises(TypeError, match="args must be a tuple"):
        flashedu.mods.triton_score_mod(_head_softcap, args=[1.0])
    mod = flashedu.mods.triton_score_mod(_head_softcap, args=(torch.ones(2), 0.0))
    q, k, v = _qkv(1, 2, 2, 8, 8, 16)
    with pytest.raises(NotImplementedError, match="no reference"):
        flashedu.attention(q, k, v, score_mod=mod, backend="naive")


def test_the_launched_kernels_take_few_parameters():
    """The forward and backward kernels take at most 40 parameters, at most 10 of them
    constexpr: the options arrive as tuples or None, the features as hooks."""
    from flashedu.triton.backward import backward_kernel
    from flashedu.triton.forward import forward_kernel

    for kernel in (forward_kernel, backward_kernel):
        params = inspect.signature(kernel.fn).parameters.values()
        constexpr = [p for p in params if "constexpr" in str(p.annotation)]
        assert len(params) <= 40, (kernel.fn.__name__, len(params))
        assert len(constexpr) <= 10, (kernel.fn.__name__, len(constexpr))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="compiling the hook into the kernels needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_a_score_mod_written_in_triton_compiles_into_the_kernels(dtype):
    """The same user hook compiled for the GPU, at a size with full and masked tiles."""
    torch.manual_seed(0)
    q, k, v = _qkv(2, 4, 2, 700, 900, 64, dtype)
    caps = torch.tensor([1.5, 3.0, 5.0, 0.7], device=q.device)
    mod = flashedu.mods.triton_score_mod(
        _head_softcap, reference=_head_softcap_torch(caps, 0.01), args=(caps, 0.01))
    _check(q, k, v, score_mod=mod, is_causal=True)


def test_the_direct_launch_knows_this_triton():
    """The direct launch (``fast.run``, ``fast.Opened``) calls a compiled kernel and Triton's
    C launcher as the Triton versions in ``fast.TESTED_TRITON`` lay them out. On one of them
    that layout must be there: a Triton that moved it fails here, naming itself. On any other
    version the direct launch is off and Triton's own dispatch runs every launch."""
    import triton

    from flashedu.triton import fast

    if fast.TRITON not in fast.TESTED_TRITON:
        assert not fast.FAST_LAUNCH, f"Triton {triton.__version__} is untested: no direct launch"
        return
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    layout = getattr(driver, "_BASE_ARGS_FORMAT", None)
    assert layout == fast.Opened.LAYOUT, (
        f"Triton {triton.__version__} lays its launcher's arguments out as {layout!r}, not as "
        f"fast.Opened reads them ({fast.Opened.LAYOUT!r}): update Opened or TESTED_TRITON")
    source = inspect.getsource(driver.CudaLauncher)
    for name in ("self.launch", "global_scratch_size", "launch_cooperative_grid", "launch_pdl",
                 "profile_scratch_size", "num_ctas"):
        assert name in source, f"Triton {triton.__version__}'s CudaLauncher has no {name}"
    from triton.compiler.compiler import CompiledKernel

    assert "packed_metadata" in inspect.getsource(CompiledKernel), triton.__version__
