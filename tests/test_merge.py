"""flashedu.merge: partial results over disjoint key sets merge into the exact whole."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashedu.merge import merge, merge_many, merge_stacked
from flashedu.reference import naive_attention, naive_attention_torch

SETTINGS = settings(max_examples=40, deadline=None)


def part(Q, K, V, visible, keys):
    """(O, L) of attention restricted to the key indices ``keys``: a partial result."""
    if len(keys) == 0:  # a part with no keys at all: the convention, O = 0 and L = -inf
        return np.zeros((Q.shape[0], V.shape[1])), np.full(Q.shape[0], -np.inf)
    return naive_attention(Q, K[keys], V[keys], mask=visible[:, keys])


@st.composite
def split_problem(draw):
    """Q, K, V, a visibility mask (causal or random, rows may see nothing), keys split in parts."""
    Nq, Nk, d = draw(st.integers(1, 6)), draw(st.integers(1, 12)), draw(st.integers(1, 4))
    n_parts = draw(st.integers(1, 5))
    owner = np.array(draw(st.lists(st.integers(0, n_parts - 1), min_size=Nk, max_size=Nk)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    Q, K, V = rng.standard_normal((Nq, d)), rng.standard_normal((Nk, d)), rng.standard_normal((Nk, d))
    Q *= draw(st.sampled_from([1.0, 30.0]))  # 30: large scores, where a naive exp would overflow
    kind = draw(st.sampled_from(["all", "causal", "random"]))
    visible = {"all": np.ones((Nq, Nk), bool), "causal": np.tri(Nq, Nk, dtype=bool),
               "random": rng.random((Nq, Nk)) < 0.4}[kind]
    keys = [np.flatnonzero(owner == p) for p in range(n_parts)]
    return Q, K, V, visible, keys


@SETTINGS
@given(split_problem())
def test_merge_of_any_split_is_exact(problem):
    Q, K, V, visible, keys = problem
    O_ref, L_ref = naive_attention(Q, K, V, mask=visible)
    O, L = merge_many([part(Q, K, V, visible, k) for k in keys])
    np.testing.assert_allclose(O, O_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(L), np.isneginf(L_ref))  # the same empty rows
    np.testing.assert_allclose(L, L_ref, rtol=1e-12, atol=1e-12)
    assert np.all(O[np.isneginf(L)] == 0)  # a row that sees no key: zeros, not NaN


@SETTINGS
@given(split_problem(), st.randoms(use_true_random=False))
def test_merge_is_associative_and_commutative(problem, rnd):
    Q, K, V, visible, keys = problem
    parts = [part(Q, K, V, visible, k) for k in keys]
    O_all, L_all = merge_many(parts)
    # a fold in a random order and with random grouping gives the same result
    rnd.shuffle(parts)
    while len(parts) > 1:
        i = rnd.randrange(len(parts) - 1)
        parts[i:i + 2] = [merge(*parts[i], *parts[i + 1])]
    np.testing.assert_allclose(parts[0][0], O_all, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(parts[0][1], L_all, rtol=1e-12, atol=1e-12)


def test_merge_commutes_bitwise():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3))
    b = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3))
    for x, y in zip(merge(*a, *b), merge(*b, *a)):
        np.testing.assert_array_equal(x, y)


def test_empty_part_contributes_nothing():
    rng = np.random.default_rng(1)
    O_a, L_a = rng.standard_normal((5, 3)), rng.standard_normal(5)
    L_a[2] = -np.inf  # a row that part a did not see either
    O_a[2] = 0.0
    O, L = merge(O_a, L_a, np.zeros((5, 3)), np.full(5, -np.inf))
    np.testing.assert_array_equal(O, O_a)
    np.testing.assert_array_equal(L, L_a)


def test_all_parts_empty_gives_zeros_and_minus_inf():
    O, L = merge_many([(np.zeros((3, 2)), np.full(3, -np.inf))] * 3)
    assert np.all(O == 0) and np.all(np.isneginf(L))


def test_float32_stays_float32_and_overflow_safe():
    O_a = np.ones((2, 4), np.float32)
    L = np.array([1000.0, -1000.0], np.float32)  # e^1000 overflows; the merge never forms it
    O, L_out = merge(O_a, L, 3 * O_a, L)
    assert O.dtype == np.float32 and L_out.dtype == np.float32
    np.testing.assert_allclose(O, 2 * O_a)
    np.testing.assert_allclose(L_out, L + np.log(2), rtol=1e-6)


def test_merge_many_needs_a_part():
    with pytest.raises(ValueError, match="at least one"):
        merge_many([])


# --------------------------------------------------------------------------------------
# torch: the same numbers, and gradients that flow through the merge exactly.
# --------------------------------------------------------------------------------------


@SETTINGS
@given(split_problem())
def test_torch_matches_numpy(problem):
    Q, K, V, visible, keys = problem
    parts = [part(Q, K, V, visible, k) for k in keys]
    O_np, L_np = merge_many(parts)
    O_t, L_t = merge_many([(torch.from_numpy(o), torch.from_numpy(l)) for o, l in parts])
    np.testing.assert_allclose(O_t.numpy(), O_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(L_t.numpy(), L_np, rtol=1e-12, atol=1e-12)


def test_torch_gradcheck_with_empty_parts():
    torch.manual_seed(0)
    O = torch.randn(3, 2, 5, 4, dtype=torch.float64)
    L = torch.randn(3, 2, 5, dtype=torch.float64)
    L[0, :, 1] = -torch.inf  # part 0 saw nothing for row 1
    O[0, :, 1] = 0
    L[:, 1, 3] = -torch.inf  # no part saw anything for row 3 of head 1
    O[:, 1, 3] = 0
    O.requires_grad_(True)
    L.requires_grad_(True)

    def finite_merge(O, L):  # gradcheck's finite differences cannot handle an output of -inf
        out, lse = merge_stacked(O, L)
        return out, torch.where(torch.isinf(lse), 0, lse)

    assert torch.autograd.gradcheck(finite_merge, (O, L))
    out, lse = finite_merge(O, L)
    (out.sum() + lse.sum()).backward()
    assert torch.isfinite(O.grad).all() and torch.isfinite(L.grad).all()
    assert torch.all(O.grad[:, 1, 3] == 0)  # a row that sees nothing gets no gradient


@pytest.mark.parametrize("is_causal", [False, True])
def test_torch_gradients_through_split_attention(is_causal):
    """Attention over K split in two halves, merged, has the gradients of attention over K."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    full = naive_attention_torch(q, k, v, is_causal=is_causal)
    cut = 4
    mask = torch.ones(9, 9, dtype=torch.bool).tril() if is_causal else torch.ones(9, 9, dtype=torch.bool)

    def half(sl):
        # explicit masking, so that causal rows with no key in this half get (0, -inf)
        S = q @ k[..., sl, :].transpose(-1, -2) / 8 ** 0.5
        S = S.masked_fill(~mask[:, sl], float("-inf"))
        L = torch.logsumexp(S, dim=-1)
        P = torch.exp(S - torch.where(torch.isinf(L), 0, L)[..., None])
        return P @ v[..., sl, :], L

    out, _ = merge(*half(slice(0, cut)), *half(slice(cut, 9)))
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(full)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(full, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
