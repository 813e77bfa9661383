"""The NumPy kernels of flashedu.tiled against the float64 naive reference, on any shape."""

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashedu import reference, tiled

shapes = st.tuples(
    st.integers(1, 70),  # Nq
    st.integers(1, 70),  # Nk
    st.integers(1, 20),  # d (odd ones too)
    st.integers(1, 40),  # block_q
    st.integers(1, 40),  # block_k
    st.booleans(),  # causal
    st.sampled_from(["q_outer", "kv_outer"]),
)


def _qkv(Nq, Nk, d, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, d)).astype(dtype) for n in (Nq, Nk, Nk)]


@settings(max_examples=150, deadline=None)
@given(shapes, st.integers(0, 2**31))
def test_forward_matches_reference(shape, seed):
    Nq, Nk, d, Br, Bc, causal, order = shape
    Q, K, V = _qkv(Nq, Nk, d, seed)
    O, L = tiled.flash_forward(Q, K, V, Br, Bc, causal, order=order)
    O_ref, L_ref = reference.naive_attention(Q, K, V, causal=causal)
    np.testing.assert_allclose(O, O_ref, atol=1e-12)
    np.testing.assert_allclose(L, L_ref, atol=1e-12)


@settings(max_examples=100, deadline=None)
@given(shapes, st.integers(0, 2**31))
def test_backward_matches_reference(shape, seed):
    Nq, Nk, d, Br, Bc, causal, _ = shape
    Q, K, V = _qkv(Nq, Nk, d, seed)
    dO = np.random.default_rng(seed + 1).standard_normal((Nq, d))
    O, L = tiled.flash_forward(Q, K, V, Br, Bc, causal)
    grads = tiled.flash_backward(Q, K, V, O, dO, L, Br, Bc, causal)
    for g, r in zip(grads, reference.naive_attention_backward(Q, K, V, dO, causal=causal)):
        np.testing.assert_allclose(g, r, atol=1e-10)


@settings(max_examples=80, deadline=None)
@given(shapes, st.integers(0, 2**31))
def test_block_sparse_matches_masked_reference(shape, seed):
    Nq, Nk, d, Br, Bc, _, order = shape
    Q, K, V = _qkv(Nq, Nk, d, seed)
    rng = np.random.default_rng(seed)
    blocks = rng.random((math.ceil(Nq / Br), math.ceil(Nk / Bc))) < 0.5
    O, L = tiled.block_sparse_forward(Q, K, V, blocks, Br, Bc, order=order)
    dense = blocks.repeat(Br, 0).repeat(Bc, 1)[:Nq, :Nk]
    O_ref, L_ref = reference.naive_attention(Q, K, V, mask=dense)
    np.testing.assert_allclose(O, O_ref, atol=1e-12)
    np.testing.assert_allclose(L, L_ref, atol=1e-12)
    empty = ~dense.any(axis=1)
    assert (O[empty] == 0).all() and np.isneginf(L[empty]).all()


def test_float32_in_float32_out():
    Q, K, V = _qkv(50, 60, 8, 0, np.float32)
    O, L = tiled.flash_forward(Q, K, V, 16, 16)
    assert O.dtype == np.float32 and L.dtype == np.float32
    O_ref, _ = reference.naive_attention(*(a.astype(np.float64) for a in (Q, K, V)))
    assert np.abs(O - O_ref).max() < 1e-5


def test_softmaxes_agree_and_survive_large_logits():
    x = (np.random.default_rng(0).standard_normal((5, 37)) * 300).astype(np.float32)  # hundreds
    with np.errstate(over="ignore", invalid="ignore"):
        assert not np.isfinite(reference.naive_softmax(x)).all()  # the textbook formula fails
    s = reference.safe_softmax(x)
    assert np.isfinite(s).all() and np.allclose(s.sum(-1), 1)
    for block in (1, 5, 37, 100):
        np.testing.assert_allclose(reference.online_softmax(x, block), s, atol=1e-6)
    row = np.full((1, 4), -np.inf)
    assert (reference.safe_softmax(row) == 0).all() and (reference.online_softmax(row, 2) == 0).all()


def test_no_quadratic_allocation():
    """The whole point: memory is O(N d + Br Bc), never O(Nq Nk)."""
    N, d, B = 2048, 32, 64
    Q, K, V = _qkv(N, N, d, 0, np.float32)
    tracemalloc.start()
    tiled.flash_forward(Q, K, V, B, B, causal=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < N * N * 4 / 16, f"peak {peak} bytes is close to an N x N float32 array"


@pytest.mark.parametrize("bad, match", [
    (dict(Q=np.zeros((3, 4, 5))), "Q must be 2-D"),
    (dict(K=np.zeros((5, 3)), V=np.zeros((5, 3))), "same head dim"),
    (dict(V=np.zeros((6, 4))), "K and V must have the same shape"),
    (dict(block_q=0), "block_q must be a positive int"),
    (dict(block_k=2.5), "block_k must be a positive int"),
])
def test_bad_input(bad, match):
    args = dict(Q=np.ones((4, 4)), K=np.ones((5, 4)), V=np.ones((5, 4)), block_q=2, block_k=2)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        tiled.flash_forward(**args)
    with pytest.raises(ValueError, match="order"):
        tiled.flash_forward(np.ones((4, 4)), np.ones((4, 4)), np.ones((4, 4)), 2, 2, order="sideways")
