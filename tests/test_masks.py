import numpy as np
import pytest
import torch

from flashedu import BlockMask


def test_causal_blocks_and_density():
    m = BlockMask.causal((256, 256), (64, 64))
    assert m.is_causal and m.shape == (4, 4) and m.density == 10 / 16
    assert (m.element_mask()[0, 0] == np.tri(256, dtype=bool)).all()


def test_sliding_window_is_banded():
    m = BlockMask.sliding_window((512, 512), (64, 64), window=128)
    dense = m.to_dense()[0, 0]
    assert dense[4, 4] and dense[4, 2] and not dense[4, 0] and not dense[4, 5]


def test_lists_and_transpose():
    blocks = np.array([[1, 0, 1], [0, 0, 0]], dtype=bool)
    m = BlockMask.from_dense(blocks, (16, 16), (20, 40))
    num, idx = m.kv_indices()
    assert num.tolist() == [[[2, 0]]] and idx[0, 0, 0, :2].tolist() == [0, 2]
    qnum, qidx = m.q_indices()
    assert qnum.tolist() == [[[1, 0, 1]]] and qidx[0, 0, 2, 0] == 0


def test_flex_round_trip():
    pytest.importorskip("torch.nn.attention.flex_attention")
    for m in (BlockMask.causal((300, 200), (128, 128)),
              BlockMask.from_dense(np.random.default_rng(0).random((2, 3, 4, 4)) < 0.5, (64, 64))):
        back = BlockMask.from_flex(m.to_flex(), is_causal=m.is_causal)
        assert (back.blocks == m.blocks).all() and back.seq_lens == m.seq_lens


@pytest.mark.parametrize("args, exc, match", [
    (dict(blocks=np.ones((2, 2)), block_size=(16, 16), seq_lens=(32, 32)), TypeError, "bool"),
    (dict(blocks=np.ones((2, 3), bool), block_size=(16, 16), seq_lens=(32, 32)), ValueError, "tiles"),
    (dict(blocks=np.ones((2, 2), bool), block_size=(0, 16), seq_lens=(32, 32)), ValueError, "block_size"),
    (dict(blocks=np.ones((2, 2), bool), block_size="x", seq_lens=(32, 32)), TypeError, "block_size"),
])
def test_bad_masks(args, exc, match):
    with pytest.raises(exc, match=match):
        BlockMask(**args)


def test_expand_checks_broadcast():
    m = BlockMask.from_dense(np.ones((2, 1, 2, 2), bool), (16, 16))
    assert m.expand(2, 5).blocks.shape == (2, 5, 2, 2)
    with pytest.raises(ValueError, match="broadcast"):
        m.expand(3, 5)
    assert torch.as_tensor(m.element_mask()).shape == (2, 1, 32, 32)


def test_flex_attention_sees_the_same_pairs():
    """Eager FlexAttention applies only the mask_mod: it must encode the tiles too."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    import flashedu

    rng = np.random.default_rng(0)
    for m in (BlockMask.sliding_window((96, 96), (32, 32), window=32),
              BlockMask.from_dense(rng.random((2, 3, 4, 3)) < 0.5, (32, 32), (100, 70)),
              BlockMask.causal((100, 70), (32, 32))):
        Nq, Nk = m.seq_lens
        q, k, v = torch.randn(2, 3, Nq, 16), torch.randn(2, 3, Nk, 16), torch.randn(2, 3, Nk, 16)
        ours = flashedu.attention(q, k, v, block_mask=m, backend="naive")
        theirs = flex.flex_attention(q, k, v, block_mask=m.to_flex())
        seen = torch.as_tensor(m.expand(2, 3).element_mask()).any(-1)
        assert (ours - theirs)[seen].abs().max() < 1e-5
