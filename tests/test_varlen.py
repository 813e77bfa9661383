"""Packed variable-length batches (``flashedu.varlen_attention``) on every backend with mask
mods, against each sequence's own attention in float64: output, lse and gradients, causal
(bottom-right within each sequence, as flash-attn's) or not, GQA, sequences of unequal query
and key lengths, an empty sequence, and queries that see no key."""

import numpy as np
import pytest
import torch
from backend_cases import CAPS, device

import flashedu
from flashedu import tolerance
from flashedu.backends import BACKENDS
from flashedu.reference import naive_attention_torch

LENGTHS_Q = [5, 0, 17, 9]  # an empty sequence; the last has more queries than keys
LENGTHS_K = [7, 3, 17, 4]


def _cu(lengths, dev):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=dev)


def _packed(backend, dtype, H=4, Hkv=2, d=16):
    dev = device(backend)
    q = torch.randn(sum(LENGTHS_Q), H, d, dtype=dtype).to(dev).requires_grad_()
    k, v = (torch.randn(sum(LENGTHS_K), Hkv, d, dtype=dtype).to(dev).requires_grad_()
            for _ in range(2))
    return q, k, v, _cu(LENGTHS_Q, dev), _cu(LENGTHS_K, dev)


def _by_sequence(q, k, v, cu_q, cu_k, causal, upcast=True):
    """Each sequence's attention on its own (naive), packed back: (out, lse)."""
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        a, b, c, e = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if a == b:
            continue
        qs, ks, vs = (t[lo:hi].transpose(0, 1)[None] for t, lo, hi in
                      ((q, a, b), (k, c, e), (v, c, e)))
        mask = None
        if causal:  # bottom-right: query n of Lq sees keys 0 .. n + Lk - Lq
            Lq, Lk = b - a, e - c
            mask = (torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + Lk - Lq).to(q.device)
        o, lse = naive_attention_torch(qs, ks, vs, enable_gqa=True, return_lse=True,
                                       attn_mask=mask, upcast=upcast)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _check_each_sequence(out, lse, q, k, v, cu_q, cu_k, causal, label=""):
    """out, lse and the gradients of q, k, v against each sequence attended to alone, in
    float64, within the suite's allowance (the error of the same attention in q's dtype);
    queries that see no key have an lse of -inf in both."""
    wrt, dtype = (q, k, v), q.dtype
    ref, ref_lse = _by_sequence(*(t.double() for t in wrt), cu_q, cu_k, causal)
    plain, plain_lse = _by_sequence(q, k, v, cu_q, cu_k, causal, upcast=False)
    tolerance.check(out, ref, plain, factor=tolerance.FORWARD, name=f"out{label}")
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), label
    tolerance.check(lse[seen], ref_lse[seen], plain_lse[seen], dtype=dtype,
                    factor=tolerance.FORWARD, name=f"lse{label}")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, wrt, dout)
    want = torch.autograd.grad(ref, wrt, dout.double())
    rough = torch.autograd.grad(plain, wrt, dout)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, want, rough):
        tolerance.check(g, r, p, dtype=dtype, factor=tolerance.GRADIENT,
                        floor_scale=tolerance.GRADIENT, name=f"{name}{label}")


def _mask_mods(backend):
    if not BACKENDS[backend].has_mask_mod:
        pytest.skip(f"{backend} applies no mask mod")


@pytest.mark.parametrize("is_causal", [False, True])
def test_varlen_matches_each_sequence_alone(backend, is_causal):
    _mask_mods(backend)
    dtype = CAPS[backend].dtypes[0]
    q, k, v, cu_q, cu_k = _packed(backend, dtype)
    out, lse = flashedu.varlen_attention(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K),
                                         is_causal=is_causal, return_lse=True, backend=backend,
                                         block_size=16)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    if is_causal:  # the last sequence's first Lq - Lk queries see nothing: zeros
        a = sum(LENGTHS_Q[:3])
        assert (out[a:a + LENGTHS_Q[3] - LENGTHS_K[3]] == 0).all()
    _check_each_sequence(out, lse, q, k, v, cu_q, cu_k, is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
def test_self_attention_packing_matches_each_sequence_alone(backend, is_causal):
    """The same cuts for queries and keys (a training batch), GQA, an empty sequence and
    sequences ending inside a tile: the triton kernels read these cuts themselves."""
    _mask_mods(backend)
    dtype = CAPS[backend].dtypes[0]
    dev = device(backend)
    lengths = [5, 0, 37, 9, 20]
    cu = _cu(lengths, dev)
    q = torch.randn(sum(lengths), 4, 16, dtype=dtype).to(dev).requires_grad_()
    k, v = (torch.randn(sum(lengths), 2, 16, dtype=dtype).to(dev).requires_grad_()
            for _ in range(2))
    out, lse = flashedu.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths),
                                         is_causal=is_causal, return_lse=True, backend=backend,
                                         block_size=16)
    assert torch.isfinite(lse).all()  # every query sees a key
    _check_each_sequence(out, lse, q, k, v, cu, cu, is_causal)


def test_bottom_right_causal_over_many_tiles_on_the_kernels_that_read_the_cuts():
    """The triton kernels' moved diagonal (row r sees keys up to r + Lk - Lq) across several
    tiles: sequences with more keys than queries, more queries than keys (the first rows see
    nothing), empty ones, on random packings (fixed seed), output, lse and gradients against
    each sequence alone in float64."""
    if flashedu.available_backends()["triton"] is not None:
        pytest.skip("triton is not available here")
    dev = device("triton")
    rng = np.random.default_rng(11)
    for _ in range(4):
        n = int(rng.integers(2, 5))
        lengths_q, lengths_k = rng.integers(0, 90, n), rng.integers(0, 90, n)
        lengths_q[0], lengths_k[0] = 70, 20  # at least one sequence with rows that see nothing
        cu_q, cu_k = _cu(lengths_q.tolist(), dev), _cu(lengths_k.tolist(), dev)
        q = torch.randn(int(cu_q[-1]), 2, 16, device=dev, requires_grad=True)
        k, v = (torch.randn(int(cu_k[-1]), 2, 16, device=dev, requires_grad=True)
                for _ in range(2))
        out, lse = flashedu.varlen_attention(q, k, v, cu_q, cu_k, int(lengths_q.max()),
                                             int(lengths_k.max()), is_causal=True,
                                             return_lse=True, backend="triton")
        case = (lengths_q.tolist(), lengths_k.tolist())
        _check_each_sequence(out, lse, q, k, v, cu_q, cu_k, True, label=f" {case}")


@pytest.mark.parametrize("lengths_k, is_causal, dropout_p, reads_cuts", [
    ("same", True, 0.0, True),  # a training batch
    ("same", False, 0.0, True),
    ([7, 3, 17, 4], False, 0.0, True),  # other key cuts, not causal
    ([7, 3, 17, 4], True, 0.0, True),  # bottom-right causal, rows that see nothing
    ("same", True, 0.25, False),  # dropout: drawn at positions of the packed row
])
def test_the_triton_kernels_read_the_cuts_where_they_can(monkeypatch, lengths_k, is_causal,
                                                         dropout_p, reads_cuts):
    """Where the triton kernels take the cuts themselves no block mask is built; elsewhere
    the packing's block mask is (and the result is the same, as the tests above check)."""
    if flashedu.available_backends()["triton"] is not None:
        pytest.skip("triton is not available here")
    built = []
    from_packed = flashedu.BlockMask.from_packed.__func__

    def counted(cls, *args, **kwargs):
        built.append(args)
        return from_packed(cls, *args, **kwargs)

    monkeypatch.setattr(flashedu.BlockMask, "from_packed", classmethod(counted))
    dev = device("triton")
    cu_q = _cu(LENGTHS_Q, dev)
    cu_k = cu_q if lengths_k == "same" else _cu(lengths_k, dev)
    total_k = int(cu_k[-1])
    q = torch.randn(sum(LENGTHS_Q), 4, 16, device=dev, requires_grad=True)
    k, v = (torch.randn(total_k, 2, 16, device=dev, requires_grad=True) for _ in range(2))
    out = flashedu.varlen_attention(q, k, v, cu_q, cu_k, 17, 17, is_causal=is_causal,
                                    dropout_p=dropout_p, backend="triton", block_size=16)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(k.grad).all()
    assert (len(built) == 0) == reads_cuts


def test_cuts_changed_in_place_are_checked_again():
    """The cuts' values are copied to the host once per tensor and reused while the tensor
    is unchanged; a change in place is seen (and checked) at the next call."""
    q, k, v = (torch.randn(31, 2, 8) for _ in range(3))
    cu = _cu(LENGTHS_Q, "cpu")
    first = flashedu.varlen_attention(q, k, v, cu, cu, 17, 17, backend="numpy")
    cu[1] = 40  # no longer non-decreasing
    with pytest.raises(ValueError, match="never decrease"):
        flashedu.varlen_attention(q, k, v, cu, cu, 40, 40, backend="numpy")
    cu[:] = _cu([9, 0, 13, 9], "cpu")  # other lengths, the same total
    other = flashedu.varlen_attention(q, k, v, cu, cu, 13, 13, backend="numpy")
    assert not torch.allclose(first, other)


def test_equal_cuts_and_causal_skip_the_tiles_above_the_diagonal():
    """Self-attention packing (the same cuts for queries and keys) with is_causal: the block
    mask is causal, so the kernels also skip every tile above the diagonal."""
    cu = torch.tensor([0, 40, 90, 100])
    mask_mod = flashedu.mods.packed(cu, cu, causal=True)
    mask = flashedu.BlockMask.from_mask_mod(mask_mod, None, None, 100, 100, block_size=(16, 16))
    assert mask.is_causal
    assert not mask.blocks[0, 0, 0, 3] and not mask.blocks[0, 0, 5, 1]  # other sequences


@pytest.mark.parametrize("change, error, words", [
    (dict(q=torch.zeros(1, 31, 4, 16)), ValueError, "q must be 3-D"),
    (dict(cu_seqlens_q=[0, 5, 31]), TypeError, "cu_seqlens_q must be an int tensor"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 31.0])), TypeError, "int tensor"),
    (dict(cu_seqlens_q=torch.tensor([1, 31])), ValueError, "start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 20, 10, 31])), ValueError, "never decrease"),
    (dict(cu_seqlens_q=torch.tensor([0, 30])), ValueError, "end at the total 31"),
    (dict(cu_seqlens_q=torch.tensor([0, 31]), max_seqlen_q=31), ValueError, "one batch"),
    (dict(max_seqlen_q=10), ValueError, "shorter than the longest sequence"),
    (dict(max_seqlen_k=17.0), TypeError, "max_seqlen_k must be an int"),
])
def test_bad_packing_is_refused_by_name(change, error, words):
    args = dict(q=torch.randn(31, 4, 16), k=torch.randn(31, 2, 16), v=torch.randn(31, 2, 16),
                cu_seqlens_q=_cu(LENGTHS_Q, "cpu"), cu_seqlens_k=_cu(LENGTHS_K, "cpu"),
                max_seqlen_q=17, max_seqlen_k=17)
    args.update(change)
    with pytest.raises(error, match=words):
        flashedu.varlen_attention(**args, backend="naive")


def test_no_tokens_at_all():
    q, k, v = torch.zeros(0, 2, 8), torch.zeros(0, 2, 8), torch.zeros(0, 2, 8)
    cu = torch.tensor([0, 0])
    out = flashedu.varlen_attention(q, k, v, cu, cu, 0, 0, backend="numpy")
    assert out.shape == (0, 2, 8)


def test_the_tiles_from_the_cuts_agree_with_the_rule():
    """BlockMask.from_packed, worked out from the cuts alone, visits every tile the rule shows
    a pair in, and marks full only tiles whose every pair the rule shows (evaluated pair by
    pair by from_mask_mod), on random packings: equal and unequal cuts, empty sequences,
    causal or not, tiles of 8 and 16."""
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 6))
        lengths_q = rng.integers(0, 40, n)
        lengths_k = lengths_q.copy() if rng.random() < 0.5 else rng.integers(0, 40, n)
        if lengths_q.sum() == 0 or lengths_k.sum() == 0:
            continue
        cu_q, cu_k = (torch.tensor([0, *np.cumsum(x).tolist()]) for x in (lengths_q, lengths_k))
        causal = bool(rng.random() < 0.5)
        block = (int(rng.choice([8, 16])), int(rng.choice([8, 16])))
        fast = flashedu.BlockMask.from_packed(cu_q, cu_k, causal, block)
        exact = flashedu.BlockMask.from_mask_mod(flashedu.mods.packed(cu_q, cu_k, causal), None,
                                                 None, int(cu_q[-1]), int(cu_k[-1]),
                                                 block_size=block)
        case = (lengths_q.tolist(), lengths_k.tolist(), causal, block)
        assert not (exact.blocks & ~fast.blocks).any(), case
        assert not (fast.full_blocks & ~exact.full_blocks).any(), case
        assert fast.is_causal == exact.is_causal, case


def test_the_triton_backend_compiles_the_rule(monkeypatch):
    """No element mask is built for a packed batch: the kernels read each position's sequence
    and offset instead."""
    if flashedu.available_backends()["triton"] is not None:
        pytest.skip("triton is not available here")
    from flashedu.triton import sparse

    def refuse(*args, **kwargs):
        raise AssertionError("an element mask was built for a packed batch")

    monkeypatch.setattr(sparse, "element_lists", refuse)
    q, k, v, cu_q, cu_k = _packed("triton", torch.float32)
    out = flashedu.varlen_attention(q, k, v, cu_q, cu_k, 17, 17, is_causal=True,
                                    backend="triton", block_size=16)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()


def test_the_kernel_tiles_of_a_packing_come_from_its_cuts():
    """At the kernels' tile size the lists of a packed batch come from its cuts, not from
    evaluating the rule pair by pair on the border tiles: every tile with a visible pair is
    visited and a tile runs unmasked only where every pair is visible (against the pair-by-pair
    refinement), on random packings, causal or not, tiles of the mask or smaller."""
    from flashedu.triton import sparse

    rng = np.random.default_rng(3)
    for _ in range(40):
        n = int(rng.integers(1, 6))
        lengths_q = rng.integers(0, 50, n)
        lengths_k = lengths_q.copy() if rng.random() < 0.5 else rng.integers(0, 50, n)
        if lengths_q.sum() == 0 or lengths_k.sum() == 0:
            continue
        cu_q, cu_k = (torch.tensor([0, *np.cumsum(x).tolist()]) for x in (lengths_q, lengths_k))
        causal = bool(rng.random() < 0.5)
        mask = flashedu.BlockMask.from_packed(cu_q, cu_k, causal, (32, 32))
        Br, Bc = int(rng.choice([8, 16, 32])), int(rng.choice([8, 16, 32]))
        is_causal = mask.is_causal
        fine = sparse.refine(mask, Br, Bc, is_causal)
        full = fine & sparse.unmasked(fine.shape[-2:], Br, Bc, mask.seq_lens, is_causal)
        cut_fine, cut_full, _ = sparse._packed_tiles(mask, fine, full, Br, Bc, is_causal)
        pair_fine, pair_full, _ = sparse._with_mask_mod(mask, fine, full, Br, Bc, is_causal)
        case = (lengths_q.tolist(), lengths_k.tolist(), causal, (Br, Bc))
        assert not (pair_fine & ~cut_fine).any(), case
        assert not (cut_full & ~pair_full).any(), case
