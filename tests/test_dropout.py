"""Attention dropout: one Philox stream (flashedu.dropout) drawn the same by NumPy, torch and
Triton; every backend with dropout agrees with a float64 reference that uses the same mask."""

import math

import numpy as np
import pytest
import torch
from backend_cases import device

import flashedu
from flashedu import dropout as D
from flashedu.backends import BACKENDS
from flashedu.reference import naive_attention_torch

DROPOUT_BACKENDS = [name for name, spec in BACKENDS.items() if spec.has_dropout]


def _triton_dropout():
    """The Triton form of the stream (skips where triton does not import)."""
    try:
        from flashedu.triton import dropout as TD
    except Exception as exc:  # noqa: BLE001 - any import failure
        pytest.skip(f"triton unavailable: {exc}")
    return TD


# ----------------------------------------------------------------------------------------
# The generator itself
# ----------------------------------------------------------------------------------------


def test_philox_known_answers():
    """Philox4x32-10 against the known-answer vectors of Random123 (Salmon et al. 2011)."""
    words = D.philox(0, 0, 0, 0, 0, n_rounds=10)
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    m = 0xFFFFFFFF
    words = D.philox((m << 32) | m, m, m, m, m, n_rounds=10)
    assert [int(w) for w in words] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_triton_philox_is_numpys():
    """tl.philox in a tiny kernel (Triton's interpreter here) gives the NumPy twin's words."""
    _triton_dropout()
    import triton
    import triton.language as tl

    @triton.jit
    def words_kernel(Out, seed, N_ROUNDS: tl.constexpr):
        c = tl.arange(0, 64)
        r0, r1, r2, r3 = tl.philox(seed, c, c * 3 + 7, c ^ 5, c * 11, N_ROUNDS)
        tl.store(Out + c, r0)
        tl.store(Out + 64 + c, r1)
        tl.store(Out + 128 + c, r2)
        tl.store(Out + 192 + c, r3)

    seed = 0x0123456789ABCDEF
    out = torch.zeros(256, dtype=torch.int32, device=device("triton"))
    words_kernel[(1,)](out, seed, D.N_ROUNDS)
    c = np.arange(64)
    expected = np.concatenate(D.philox(seed, c, c * 3 + 7, c ^ 5, c * 11))
    assert np.array_equal(out.cpu().numpy().view(np.uint32), expected)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("tiles", [(16, 16), (32, 4), (16, 64)])
def test_masks_bit_identical_numpy_torch_triton(p, tiles):
    """The keep-mask of the Triton jit function (any tiling), NumPy's and torch's are equal."""
    TD = _triton_dropout()
    rng = torch.tensor([0x7EDCBA9876543210, (1 << 40) + 12345], dtype=torch.int64)
    seed, offset = D.rng_values(rng)
    B, H, Nq, Nk = 2, 3, 37, 45
    Z = D.dropout_mask(seed, offset, B, H, Nq, Nk, p)
    triton_Z = TD.dropout_mask(rng.to(device("triton")), B, H, Nq, Nk, p, *tiles)
    assert np.array_equal(triton_Z.cpu().numpy(), Z)
    assert np.array_equal(D.keep_mask_torch(rng, B, H, Nq, Nk, p).numpy(), Z)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("R, C, start_m, start_n", [(32, 64, 48, 128), (16, 32, 0, 32),
                                                     (16, 16, 16, 48), (8, 32, 24, 0)])
@pytest.mark.parametrize("p, dtype", [(0.3, torch.float32), (0.7, torch.float32),
                                      (0.3, torch.bfloat16), (0.7, torch.float16)])
def test_the_kernels_drop_the_streams_entries(R, C, start_m, start_n, transposed, p, dtype):
    """``dropped``, as the kernels call it on a tile of P_ij (or its transpose in the dK/dV
    program), zeroes exactly the entries the NumPy stream drops: tiles drawn in the calls'
    shape (rows in 16s, columns in 32s) and tiles drawn entry by entry alike, float32 tiles
    and 16-bit ones (selected two entries at a time on a GPU), rates whose 256 - threshold
    has its top bit set (0.3) and clear (0.7): the two cases of the bytes' carry test."""
    TD = _triton_dropout()
    rng = torch.tensor([0x0BADC0FFEE, (3 << 32) + 17], dtype=torch.int64)
    seed, offset = D.rng_values(rng)
    kept = TD.kept_by_kernels(rng.to(device("triton")), 5, p, R, C, start_m, start_n, transposed,
                              dtype)
    want = D.keep_tile(seed, offset, 5, np.arange(start_m, start_m + R),
                       np.arange(start_n, start_n + C), p)
    assert np.array_equal(kept.cpu().numpy(), want)


def test_sixteen_entries_a_call():
    """One Philox call gives 16 bytes, one to each entry of rows {r, r + 8} and columns
    {c, c + 1, c + 8, c + 9, ..., c + 25}: the entries one thread holds after a tensor-core
    multiply. Every entry of a 32 x 64 block is named by exactly one (call, byte)."""
    rows, cols = np.arange(32)[:, None], np.arange(64)[None, :]
    c0, c1 = D.counters(rows, cols)
    word, shift = D.word_and_shift(rows, cols)
    call = np.broadcast_to(c1 * 1000 + c0, (32, 64))
    slot = np.broadcast_to(word * 4 + shift // 8, (32, 64))
    assert len(np.unique(call)) == 32 * 64 // D.ENTRIES
    assert len({(a, b) for a, b in zip(call.ravel(), slot.ravel())}) == 32 * 64
    first = call == call[0, 0]
    assert {(int(r), int(c)) for r, c in zip(*np.nonzero(first))} == {
        (r, c) for r in (0, 8) for c in (0, 1, 8, 9, 16, 17, 24, 25)}


def test_random_bytes_are_the_words_bytes():
    """Entry (row, col)'s byte is byte 2 (row bit 3) + (col bit 0) of word (col bits 3-4) of its
    call's Philox words: the stream written out once more, by hand."""
    seed, offset, bh = 0x0123456789ABCDEF, (7 << 32) + 5, 3
    got = D.random_bytes(seed, offset, bh, np.arange(40), np.arange(70))
    for row, col in [(0, 0), (8, 1), (9, 25), (17, 38), (39, 69)]:
        words = D.philox(seed, col & ~0b11001, row & ~0b1000, bh, offset & 0xFFFFFFFF)
        word = int(words[(col >> 3) & 3])
        assert got[row, col] == (word >> (16 * ((row >> 3) & 1) + 8 * (col & 1))) & 0xFF


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_statistical_bounds(p):
    """Entries are kept at the rate drawn, 1 - threshold / 256, overall and in each of the 16
    byte positions of a call."""
    Z = D.dropout_mask(11, 22, 2, 4, 64, 64, p)
    q = 1 - D.drawn_rate(p)
    assert abs(Z.mean() - q) < 5 * math.sqrt(q * (1 - q) / Z.size)
    rows, cols = np.arange(64)[:, None], np.arange(64)[None, :]
    word, shift = D.word_and_shift(rows, cols)
    slot = np.broadcast_to(word * 4 + shift // 8, (64, 64))
    for s in range(D.ENTRIES):
        part = Z[..., slot == s]
        assert abs(part.mean() - q) < 5 * math.sqrt(q * (1 - q) / part.size)


def _agreement_ok(a, b, q):
    """Two independent masks of keep rate q agree on a fraction q^2 + (1-q)^2 of entries."""
    expected = q ** 2 + (1 - q) ** 2
    sigma = math.sqrt(expected * (1 - expected) / a.size)
    return abs((a == b).mean() - expected) < 5 * sigma


def test_independence_across_heads_batches_calls_and_neighbours():
    p = 0.5
    Z = D.dropout_mask(5, 6, 2, 2, 64, 64, p)
    assert _agreement_ok(Z[0, 0], Z[0, 1], p)  # heads
    assert _agreement_ok(Z[0, 0], Z[1, 0], p)  # batches
    assert _agreement_ok(Z[0, 0], D.dropout_mask(5, 7, 1, 1, 64, 64, p)[0, 0], p)  # offsets
    assert _agreement_ok(Z[0, 0], D.dropout_mask(8, 6, 1, 1, 64, 64, p)[0, 0], p)  # seeds
    assert _agreement_ok(Z[..., :-1], Z[..., 1:], p)  # neighbouring columns (one Philox call)
    assert _agreement_ok(Z[..., :-1, :], Z[..., 1:, :], p)  # neighbouring rows
    assert _agreement_ok(Z[..., :-8, :], Z[..., 8:, :], p)  # rows 8 apart (one call)
    assert _agreement_ok(Z[..., :-8], Z[..., 8:], p)  # columns 8 apart (one call)
    torch.manual_seed(0)
    r1, r2 = D.draw_rng("cpu"), D.draw_rng("cpu")  # two calls draw two states
    assert not torch.equal(r1, r2)


def test_threshold_and_the_rate_drawn():
    """p is drawn in steps of 1/256 and kept entries are scaled by the inverse of the keep rate
    drawn; a rate that would round to no dropout, or to dropping everything, is refused."""
    assert D.threshold(0.0) == 0 and D.keep_scale(0.0) == 1.0
    assert D.threshold(0.5) == 128 and D.keep_scale(0.5) == 2.0
    assert D.threshold(0.1) == 26 and D.drawn_rate(0.1) == 26 / 256
    assert D.keep_scale(0.1) == 256 / 230
    assert D.threshold(1 / 512) == 1 and D.threshold(1 - 1 / 256) == 255
    for p in (1e-3, 1 - 1 / 512, 1.0, -0.1):
        with pytest.raises(ValueError, match="dropout_p"):
            D.threshold(p)
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="1/256"):
        flashedu.attention(q, k, v, dropout_p=1e-3, backend="numpy")


# ----------------------------------------------------------------------------------------
# The backends
# ----------------------------------------------------------------------------------------


def _inputs(B=1, H=2, Hkv=None, Nq=40, Nk=40, d=16, dtype=torch.float32, seed=0,
            backend="numpy"):
    g = torch.Generator().manual_seed(seed)
    Hkv = Hkv or H
    q = torch.randn(B, H, Nq, d, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, Nk, d, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, Nk, d, generator=g, dtype=dtype)
    return [t.to(device(backend)).requires_grad_() for t in (q, k, v)]


def _run(backend, q, k, v, torch_seed, **kw):
    """out, grads and the call's rng (the first draw after torch.manual_seed, from the
    generator of the inputs' device)."""
    torch.manual_seed(torch_seed)
    rng = D.draw_rng(q.device)
    torch.manual_seed(torch_seed)
    out = flashedu.attention(q, k, v, backend=backend, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                       dtype=out.dtype).to(out.device)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, grads, rng, dout


CASES = {
    "dense": dict(),
    "causal": dict(is_causal=True),
    "ragged": dict(Nq=37, Nk=29),
    "gqa": dict(H=4, Hkv=2),
    "block_mask": dict(block_mask=True),
}


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_match_float64_with_the_same_mask(backend, case):
    spec = dict(CASES[case])
    kw = {"dropout_p": 0.3, "is_causal": spec.pop("is_causal", False)}
    if spec.pop("block_mask", False):
        blocks = np.array([[True, False, True], [False, True, True], [True, True, False]])
        kw["block_mask"] = flashedu.BlockMask.from_dense(blocks, block_size=(16, 16),
                                                         seq_lens=(40, 40))
    if "Hkv" in spec:
        kw["enable_gqa"] = True
    q, k, v = _inputs(**spec, backend=backend)
    out, grads, rng, dout = _run(backend, q, k, v, 123, **kw)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive_attention_torch(*ref_in, dropout_rng=rng, **kw)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    tol = 1e-4
    assert (out.double() - ref).abs().max() < tol
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max() < tol
    # the mask really drops: without dropout the output differs
    plain = flashedu.attention(q, k, v, backend=backend,
                               **{**kw, "dropout_p": 0.0}).detach()
    assert (plain - out.detach()).abs().max() > 1e-2


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_reproducible_under_manual_seed_and_calls_differ(backend):
    q, k, v = _inputs(Nq=24, Nk=24, backend=backend)
    torch.manual_seed(7)
    a = flashedu.attention(q, k, v, dropout_p=0.5, backend=backend)
    b = flashedu.attention(q, k, v, dropout_p=0.5, backend=backend)
    torch.manual_seed(7)
    c = flashedu.attention(q, k, v, dropout_p=0.5, backend=backend)
    assert torch.equal(a, c)
    assert not torch.equal(a, b)


def test_backends_drop_the_same_entries():
    """After the same torch.manual_seed, every backend with dropout gives the same output (each
    draws from its device's generator: the backends compared are those of the CPU)."""
    on_cpu = [b for b in DROPOUT_BACKENDS if device(b).type == "cpu"]
    assert len(on_cpu) >= 2, on_cpu  # naive and numpy at least (triton too without a GPU)
    q, k, v = _inputs(Nq=33, Nk=20)
    outs = {}
    for backend in on_cpu:
        torch.manual_seed(3)
        outs[backend] = flashedu.attention(q, k, v, dropout_p=0.4, is_causal=True,
                                           backend=backend).detach()
    first = outs[on_cpu[0]]
    for name, out in outs.items():
        assert (out - first).abs().max() < 1e-5, name


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_applies_under_no_grad_as_sdpa(backend):
    """SDPA drops whenever dropout_p > 0, also under torch.no_grad(): so does flashedu."""
    q, k, v = (t.detach() for t in _inputs(Nq=16, Nk=16, backend=backend))
    with torch.no_grad():
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        ours = flashedu.attention(q, k, v, dropout_p=0.5, backend=backend)
    assert (sdpa - plain).abs().max() > 1e-2
    assert (ours - plain).abs().max() > 1e-2


def test_scaling_keeps_the_expectation():
    """Kept entries are scaled by 1/(1-p): with V = 1 every output is sum_j Z_ij P_ij / (1-p),
    whose mean over many entries is 1."""
    B, H, N, d, p = 2, 4, 64, 4, 0.3
    q = torch.randn(B, H, N, d, dtype=torch.float64)
    v = torch.ones(B, H, N, d, dtype=torch.float64)
    out = naive_attention_torch(q, q, v, dropout_p=p)[..., 0]
    assert abs(out.mean().item() - 1.0) < 0.05
