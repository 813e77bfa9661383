"""Attention sinks (``flashedu.attention(..., sinks=)``) on every backend that has them, against
the float64 reference: output, lse and the gradients of q, k, v and the sinks, on shapes that
are not multiples of a block, with GQA, causal and block masks and rows that see no key; the
sinks' gradient by finite differences too."""

import math

import numpy as np
import pytest
import torch
from backend_cases import CAPS, device

import flashedu
from flashedu import tolerance
from flashedu.backends import BACKENDS, backends_with
from flashedu.reference import naive_attention_torch, reference_attention

# (B, H, Hkv, Nq, Nk, d): ragged, GQA, Nq != Nk, one row
SHAPES = [(2, 4, 2, 45, 29, 16), (1, 2, 2, 37, 53, 16), (1, 2, 1, 1, 1, 16)]


def _with_sinks(backend):
    if not BACKENDS[backend].has_sinks:
        pytest.skip(f"{backend} has no sinks (test_a_backend_without_sinks_says_so)")


def _inputs(backend, shape, dtype):
    B, H, Hkv, Nq, Nk, d = shape
    dev = device(backend)
    q = torch.randn(B, H, Nq, d, dtype=dtype).to(dev)
    k = torch.randn(B, Hkv, Nk, d, dtype=dtype).to(dev)
    v = torch.randn(B, Hkv, Nk, d, dtype=dtype).to(dev)
    # sinks around the scores' size, one of them large: its head gives most weight to it
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0][:H], dtype=torch.float32).to(dev)
    return [t.requires_grad_() for t in (q, k, v, sinks)]


def _fits(backend, shape):
    if max(shape[3], shape[4]) > CAPS[backend].max_n:
        pytest.skip(f"{backend} runs emulated here: N > {CAPS[backend].max_n}")


def _check(backend, q, k, v, sinks, **kw):
    """Output, lse and the four gradients within the suite's tolerance of float64."""
    out, lse = flashedu.attention(q, k, v, sinks=sinks, enable_gqa=True, return_lse=True,
                                  backend=backend, **kw)
    ref, ref_lse = reference_attention(q, k, v, sinks=sinks.double(), enable_gqa=True,
                                       return_lse=True, **kw)
    plain, plain_lse = naive_attention_torch(q, k, v, sinks=sinks, enable_gqa=True,
                                             return_lse=True, upcast=False, **kw)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    tolerance.check(out, ref, plain, factor=tolerance.FORWARD, name="out")
    tolerance.check(lse, ref_lse, plain_lse, dtype=q.dtype, factor=tolerance.FORWARD,
                    name="lse")
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    wrt = (q, k, v, sinks)
    grads = torch.autograd.grad((out, lse), wrt, (dout, dlse))
    want = torch.autograd.grad((ref, ref_lse), wrt, (dout.double(), dlse.double()))
    rough = torch.autograd.grad((plain, plain_lse), wrt, (dout, dlse))
    for name, g, r, p in zip(("dq", "dk", "dv", "dsinks"), grads, want, rough):
        assert torch.isfinite(g).all(), name
        tolerance.check(g, r, p, dtype=q.dtype, factor=tolerance.GRADIENT,
                        floor_scale=tolerance.GRADIENT, name=name)
    return out, lse


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_sinks_forward_and_backward(backend, shape, is_causal):
    _with_sinks(backend)
    _fits(backend, shape)
    _check(backend, *_inputs(backend, shape, CAPS[backend].dtypes[0]), is_causal=is_causal)


def test_the_sinks_gradient_through_the_output_alone(backend):
    """Without the lse returned (no dlse), the sinks' gradient comes from D alone: on triton
    from the backward's own preprocess pass, ragged rows (Nq not a multiple of its rows)."""
    _with_sinks(backend)
    q, k, v, sinks = _inputs(backend, (1, 4, 2, 37, 45, 16), CAPS[backend].dtypes[0])
    out = flashedu.attention(q, k, v, sinks=sinks, enable_gqa=True, is_causal=True,
                             backend=backend)
    ref = reference_attention(q, k, v, sinks=sinks.double(), enable_gqa=True, is_causal=True)
    plain = naive_attention_torch(q, k, v, sinks=sinks, enable_gqa=True, is_causal=True,
                                  upcast=False)
    dout = torch.randn_like(out)
    got, = torch.autograd.grad(out, sinks, dout)
    want, = torch.autograd.grad(ref, sinks, dout.double())
    rough, = torch.autograd.grad(plain, sinks, dout)
    tolerance.check(got, want, rough, dtype=q.dtype, factor=tolerance.GRADIENT,
                    floor_scale=tolerance.GRADIENT, name="dsinks")


def test_rows_that_see_no_key_give_zeros_and_the_sink_as_lse(backend):
    """A row whose keys are all masked sees only its sink: O = 0, lse = sink (not -inf)."""
    _with_sinks(backend)
    Nq, Nk, block = 48, 32, 16
    q, k, v, sinks = _inputs(backend, (1, 2, 2, Nq, Nk, 16), CAPS[backend].dtypes[0])
    blocks = np.ones((3, 2), bool)
    blocks[1] = False  # query rows 16..31 see nothing
    mask = flashedu.BlockMask.from_dense(blocks, (block, block), (Nq, Nk))
    out, lse = _check(backend, q, k, v, sinks, block_mask=mask)
    assert (out[:, :, block:2 * block] == 0).all()
    want = sinks.detach().float().view(1, -1, 1).expand(1, 2, block)
    assert torch.allclose(lse[:, :, block:2 * block].float(), want)


def test_a_large_sink_takes_the_weight(backend):
    """exp(sink) far above every exp(S_ij): the keys get almost nothing, the output is ~0."""
    _with_sinks(backend)
    q, k, v, _ = _inputs(backend, (1, 2, 2, 20, 24, 16), CAPS[backend].dtypes[0])
    sinks = torch.full((2,), 60.0, device=q.device)
    out = flashedu.attention(q, k, v, sinks=sinks, backend=backend)
    assert out.abs().max() < 1e-6


@pytest.mark.parametrize("backend_name", ["naive", "numpy"])
def test_the_sinks_gradient_by_finite_differences(backend_name):
    """gradcheck in float64: q, k, v and the sinks, through out and the lse, causal, GQA."""
    torch.manual_seed(1)
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 11, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    weights = torch.linspace(-1, 1, 8, dtype=torch.float64)

    def loss(q, k, v, sinks):
        out, lse = flashedu.attention(q, k, v, sinks=sinks, is_causal=True, enable_gqa=True,
                                      return_lse=True, backend=backend_name)
        return (out * weights).sum() + 0.3 * lse.sum()

    assert torch.autograd.gradcheck(loss, (q, k, v, sinks))


def test_sinks_with_dropout_drop_the_same_entries(backend):
    """Dropout with sinks: the same mask on every backend (the keys' weights dropped, the
    sink's share kept out of the output either way)."""
    _with_sinks(backend)
    if not BACKENDS[backend].has_dropout:
        pytest.skip(f"{backend} has no dropout")
    q, k, v, sinks = _inputs(backend, (1, 2, 2, 33, 40, 16), torch.float32)
    torch.manual_seed(7)
    out = flashedu.attention(q, k, v, sinks=sinks, dropout_p=0.3, backend=backend)
    torch.manual_seed(7)
    want = naive_attention_torch(q.double(), k.double(), v.double(), sinks=sinks.double(),
                                 dropout_p=0.3, dropout_rng=None)
    assert tolerance.max_error(out, want) < 1e-4


def test_no_key_at_all_with_sinks():
    """Nk = 0: every row sees only its sink (zeros, lse = sink, the sinks' gradient dlse)."""
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    k = v = torch.randn(1, 2, 0, 8)
    sinks = torch.tensor([1.0, -2.0], requires_grad=True)
    out, lse = flashedu.attention(q, k, v, sinks=sinks, return_lse=True, backend="numpy")
    assert (out == 0).all() and torch.equal(lse, sinks.detach().view(1, 2, 1).expand(1, 2, 5))
    dsinks, = torch.autograd.grad(lse.sum(), sinks)
    assert torch.equal(dsinks, torch.full((2,), 5.0))


@pytest.mark.parametrize("sinks, error, words", [
    ([0.0, 1.0], TypeError, "sinks must be a"),
    (torch.zeros(2, dtype=torch.int64), TypeError, "floating-point"),
    (torch.zeros(3), ValueError, r"shape \(H,\) = \(2,\)"),
    (torch.zeros(1, 2), ValueError, r"shape \(H,\)"),
    (torch.zeros(2, device="meta"), ValueError, "q's device"),
])
def test_bad_sinks_are_refused_by_name(sinks, error, words):
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(error, match=words):
        flashedu.attention(q, k, v, sinks=sinks, backend="naive")


def test_a_backend_without_sinks_says_so():
    without = [n for n, b in BACKENDS.items() if not b.has_sinks]
    if not without:
        pytest.skip("every backend has sinks")
    q = k = v = torch.randn(1, 2, 4, 16)
    with pytest.raises(NotImplementedError, match=f"{without[0]!r} does not implement sinks.*"
                                                  f"{backends_with('sinks')[0]}"):
        flashedu.attention(q, k, v, sinks=torch.zeros(2), backend=without[0])


def test_sinks_are_a_merge_with_a_block_that_holds_only_the_sink():
    """The course's merge rule: attention with a sink equals attention without it merged with
    a 'block' whose lse is the sink and whose output is 0."""
    from flashedu.merge import merge

    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.3, -0.7], dtype=torch.float64)
    out, lse = flashedu.attention(q, k, v, return_lse=True, backend="naive")
    sink_lse = sinks.view(1, 2, 1).expand(1, 2, 6)
    merged, merged_lse = merge(out, lse, torch.zeros_like(out), sink_lse)
    got, got_lse = flashedu.attention(q, k, v, sinks=sinks, return_lse=True, backend="numpy")
    assert tolerance.max_error(got, merged) < 1e-12
    assert tolerance.max_error(got_lse, merged_lse) < 1e-12
    assert math.isfinite(float(got_lse.min()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the compiled kernels at a real size need a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gpu_sinks_at_a_real_size(dtype, is_causal):
    """16-bit inputs, full and ragged tiles, GQA: the compiled kernels within the suite's
    tolerance of float64, the sinks' gradient included."""
    q, k, v, sinks = _inputs("triton", (2, 4, 2, 700, 900, 64), dtype)
    _check("triton", q, k, v, sinks, is_causal=is_causal)
