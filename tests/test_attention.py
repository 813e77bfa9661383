"""One suite for every backend of flashedu.attention, against a float64 reference.

Tolerance (:mod:`flashedu.tolerance`) follows flash-attention's own tests: the backend's error
against float64 must be at most 2x (forward) or 3x (gradients) the error of plain PyTorch
attention computed in the same dtype, plus a small absolute floor for the dtype.
"""

import math

import numpy as np
import pytest
import torch
from backend_cases import CAPS, device

import flashedu
from flashedu import tolerance
from flashedu.reference import naive_attention_torch, reference_attention

# (B, H, Hkv, Nq, Nk, d): sizes that are not multiples of any block size, N = 1, Nq != Nk, GQA.
SHAPES = [
    (1, 2, 2, 37, 53, 16),
    (2, 4, 2, 45, 29, 24),  # GQA, Nq > Nk
    (1, 1, 1, 1, 1, 16),  # N = 1
    (1, 3, 1, 17, 70, 32),  # MQA, Nq < Nk
    (1, 2, 2, 130, 97, 16),  # several tiles each way (skipped by emulated backends)
]


def _inputs(backend, shape, dtype, requires_grad=False):
    B, H, Hkv, Nq, Nk, d = shape
    q = torch.randn(B, H, Nq, d, dtype=dtype).to(device(backend))
    k = torch.randn(B, Hkv, Nk, d, dtype=dtype).to(device(backend))
    v = torch.randn(B, Hkv, Nk, d, dtype=dtype).to(device(backend))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _skip_unless_fits(backend, shape):
    """Skip, saying why, when the CPU tests do not give this shape to this backend (emulated
    backends take small sizes only; some take no small head dims)."""
    caps = CAPS[backend]
    B, H, Hkv, Nq, Nk, d = shape
    if max(Nq, Nk) > caps.max_n:
        pytest.skip(f"{backend} runs emulated here: N = {max(Nq, Nk)} > {caps.max_n}, "
                    "its largest CPU test size")
    if d < caps.min_d:
        pytest.skip(f"{backend} takes head dims >= {caps.min_d}, not {d}")


_err = tolerance.max_error


def _check_forward(backend, q, k, v, **kw):
    out = flashedu.attention(q, k, v, backend=backend, enable_gqa=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "output has NaN/inf"
    ref = reference_attention(q, k, v, enable_gqa=True, **kw)
    plain = naive_attention_torch(q, k, v, enable_gqa=True, upcast=False, **kw)
    tolerance.check(out, ref, plain, factor=tolerance.FORWARD, name="forward")
    return out


def _check_backward(backend, q, k, v, **kw):
    dout = torch.randn_like(q)
    grads = torch.autograd.grad(
        flashedu.attention(q, k, v, backend=backend, enable_gqa=True, **kw), (q, k, v), dout)
    ref = torch.autograd.grad(reference_attention(q, k, v, enable_gqa=True, **kw), (q, k, v), dout)
    plain = torch.autograd.grad(naive_attention_torch(q, k, v, enable_gqa=True, upcast=False, **kw),
                                (q, k, v), dout)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref, plain):
        assert g.shape == r.shape and torch.isfinite(g).all(), f"{name} bad shape or NaN"
        tolerance.check(g, r, p, factor=tolerance.GRADIENT, floor_scale=tolerance.GRADIENT,
                        name=name)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_forward(backend, shape, is_causal):
    _skip_unless_fits(backend, shape)
    for dtype in CAPS[backend].dtypes:
        _check_forward(backend, *_inputs(backend, shape, dtype), is_causal=is_causal)


@pytest.mark.parametrize("shape", SHAPES[:4], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward(backend, shape, is_causal):
    if not CAPS[backend].backward:
        pytest.skip(f"{backend} has no backward")
    _skip_unless_fits(backend, shape)
    dtype = CAPS[backend].dtypes[0]
    q, k, v = _inputs(backend, shape, dtype, requires_grad=True)
    _check_backward(backend, q, k, v, is_causal=is_causal)


def test_explicit_scale(backend):
    shape = (1, 2, 2, 33, 40, 16)
    q, k, v = _inputs(backend, shape, CAPS[backend].dtypes[0])
    _check_forward(backend, q, k, v, scale=0.3)
    _check_forward(backend, q, k, v, scale=2.0, is_causal=True)


def test_large_logits_do_not_overflow(backend):
    """Scores in the hundreds: exp would overflow without the running max."""
    q, k, v = _inputs(backend, (1, 1, 1, 20, 30, 16), CAPS[backend].dtypes[0])
    out = _check_forward(backend, q * 30, k * 30, v)
    assert torch.isfinite(out).all()


def _random_block_mask(Nq, Nk, block, seed, empty_row=True):
    rng = np.random.default_rng(seed)
    blocks = rng.random((math.ceil(Nq / block), math.ceil(Nk / block))) < 0.5
    if empty_row:
        blocks[1] = False  # the second Q tile sees no key at all: its rows must give zeros
    blocks[0, 0] = True
    return flashedu.BlockMask.from_dense(blocks, (block, block), (Nq, Nk))


@pytest.mark.parametrize("is_causal", [False, True])
def test_block_mask_and_fully_masked_rows(backend, is_causal):
    if not CAPS[backend].block_mask:
        pytest.skip(f"{backend} takes no block mask")
    Nq, Nk, block = (64, 48, 16) if CAPS[backend].max_n < 100 else (150, 90, 32)
    dtype = CAPS[backend].dtypes[0]
    q, k, v = _inputs(backend, (1, 2, 2, Nq, Nk, 16), dtype,
                      requires_grad=CAPS[backend].backward)
    mask = _random_block_mask(Nq, Nk, block, seed=3)
    out = _check_forward(backend, q, k, v, block_mask=mask, is_causal=is_causal)
    assert (out[:, :, block:2 * block] == 0).all(), "fully masked rows must be exactly zero"
    if CAPS[backend].backward:
        _check_backward(backend, q, k, v, block_mask=mask, is_causal=is_causal)


def test_causal_block_mask_equals_is_causal(backend):
    if not CAPS[backend].block_mask:
        pytest.skip(f"{backend} takes no block mask")
    N = 48 if CAPS[backend].max_n < 100 else 100
    q, k, v = _inputs(backend, (1, 2, 2, N, N, 16), CAPS[backend].dtypes[0])
    mask = flashedu.BlockMask.causal((N, N), (16, 16))
    a = flashedu.attention(q, k, v, block_mask=mask, backend=backend)
    b = flashedu.attention(q, k, v, is_causal=True, backend=backend)
    assert _err(a, b) <= tolerance.floor(q.dtype)


def test_per_head_block_mask(backend):
    if not CAPS[backend].block_mask:
        pytest.skip(f"{backend} takes no block mask")
    rng = np.random.default_rng(7)
    blocks = rng.random((2, 3, 3, 2)) < 0.6
    mask = flashedu.BlockMask.from_dense(blocks, (16, 16), (40, 32))
    q, k, v = _inputs(backend, (2, 3, 3, 40, 32, 16), CAPS[backend].dtypes[0])
    _check_forward(backend, q, k, v, block_mask=mask)


def test_no_backward_says_which_backends_have_one(backend):
    if CAPS[backend].backward:
        pytest.skip(f"{backend} has a backward")
    q, k, v = _inputs(backend, (1, 1, 1, 16, 16, 16), torch.float32, requires_grad=True)
    out = flashedu.attention(q, k, v, backend=backend)
    with pytest.raises((NotImplementedError, RuntimeError), match="triton|numpy|naive"):
        out.sum().backward()
