"""Bad input gets a clear ValueError / TypeError naming the argument, from every backend."""

import numpy as np
import pytest
import torch

import flashedu


def _qkv(B=1, H=2, Hkv=2, Nq=8, Nk=8, d=16, dtype=torch.float32):
    return (torch.randn(B, H, Nq, d, dtype=dtype), torch.randn(B, Hkv, Nk, d, dtype=dtype),
            torch.randn(B, Hkv, Nk, d, dtype=dtype))


q, k, v = _qkv()
BAD = [
    (lambda: flashedu.attention(q[0], k, v), ValueError, "q must be 4-D"),
    (lambda: flashedu.attention(q, k.numpy(), v), TypeError, "k must be a torch.Tensor"),
    (lambda: flashedu.attention(q, k.double(), v), TypeError, "share one dtype"),
    (lambda: flashedu.attention(q.int(), k.int(), v.int()), TypeError, "floating dtype"),
    (lambda: flashedu.attention(q, k, v[:, :, :5]), ValueError, "k and v must have the same shape"),
    (lambda: flashedu.attention(q, k[..., :8], v[..., :8]), ValueError, "same head dim"),
    (lambda: flashedu.attention(q, k[:1], v[:1]) if False else flashedu.attention(
        torch.randn(2, 2, 8, 16), k, v), ValueError, "batch size"),
    (lambda: flashedu.attention(*_qkv(H=4, Hkv=2)), ValueError, "enable_gqa"),
    (lambda: flashedu.attention(*_qkv(H=3, Hkv=2), enable_gqa=True), ValueError, "multiple"),
    (lambda: flashedu.attention(q, k, v, scale=-1.0), ValueError, "scale"),
    (lambda: flashedu.attention(q, k, v, scale="big"), TypeError, "scale"),
    (lambda: flashedu.attention(q, k, v, dropout_p=1.5), ValueError, "dropout_p"),
    (lambda: flashedu.attention(q, k, v, is_causal=1), TypeError, "is_causal"),
    (lambda: flashedu.attention(q, k, v, backend="cuda"), ValueError, "backend must be one of"),
    (lambda: flashedu.attention(q, k, v, block_mask=np.ones((1, 1), bool)), TypeError, "block_mask"),
    (lambda: flashedu.attention(q, k, v, block_mask=flashedu.BlockMask.causal((16, 16), (8, 8))),
     ValueError, "block_mask was built for seq_lens"),
    (lambda: flashedu.attention(q, k, v, block_mask=flashedu.BlockMask.from_dense(
        np.ones((3, 1, 1, 1), bool), (8, 8), (8, 8))), ValueError, "block_mask has blocks"),
    (lambda: flashedu.attention(q, k, v, dropout_p=0.1, backend="numpy"), NotImplementedError, "dropout"),
]


@pytest.mark.parametrize("call, exc, match", BAD, ids=[b[2] for b in BAD])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_naive_dropout_is_reproducible():
    torch.manual_seed(1)
    a = flashedu.attention(q, k, v, dropout_p=0.3, backend="naive")
    torch.manual_seed(1)
    b = flashedu.attention(q, k, v, dropout_p=0.3, backend="naive")
    assert torch.equal(a, b) and not torch.equal(a, flashedu.attention(q, k, v, backend="naive"))


def test_auto_is_numpy_without_gpu():
    from flashedu.backends import resolve_backend

    assert resolve_backend("auto") == ("triton" if torch.cuda.is_available() else "numpy")
