import warnings

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


# ----- constructors refuse what they cannot mean ---------------------------------------------
@pytest.mark.parametrize("make, exc, match", [
    (lambda: BlockMask.causal((16, 16), 0), ValueError, "block_size must be positive"),
    (lambda: BlockMask.causal((16, 16), (16, 0)), ValueError, "block_size must be positive"),
    (lambda: BlockMask.sliding_window((16, 16), 0), ValueError, "block_size must be positive"),
    (lambda: BlockMask.from_dense(np.ones((2, 2), bool), 0), ValueError, "block_size must be positive"),
    (lambda: BlockMask.causal((0, 16), 4), ValueError, "seq_lens must be positive"),
    (lambda: BlockMask.causal((16, 16), (4.0, 4)), TypeError, "block_size must be a pair of ints"),
    (lambda: BlockMask.causal((16, 16), True), TypeError, "block_size"),
    (lambda: BlockMask.from_flex("x"), TypeError, "flex_mask must be a torch.nn.attention"),
    (lambda: BlockMask.from_flex(np.ones((2, 2), bool)), TypeError, "from_dense"),
    (lambda: BlockMask.sliding_window((16, 16), 4, window=True), TypeError, "window must be a positive int"),
    (lambda: BlockMask.sliding_window((16, 16), 4, window=2.5), TypeError, "window"),
    (lambda: BlockMask.sliding_window((16, 16), 4, window=0), ValueError, "window"),
    (lambda: BlockMask.sliding_window((16, 16), 4, causal="yes"), TypeError, "causal must be a bool"),
    (lambda: BlockMask.from_dense(np.ones((2, 2), bool), 8, is_causal="no"), TypeError, "is_causal"),
    (lambda: BlockMask(np.ones((2, 2), bool), 8, (16, 16), is_causal=1), TypeError, "is_causal"),
    (lambda: BlockMask.from_dense(np.ones(3, bool), 8), ValueError, "shape"),
    (lambda: BlockMask.from_dense(np.array([["a"]]), 8), TypeError, "bool array"),
])
def test_bad_constructor_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_numpy_bools_and_ints_are_accepted():
    m = BlockMask.from_dense(np.ones((2, 2), bool), np.int64(8), is_causal=np.bool_(True))
    assert m.is_causal is True and m.block_size == (8, 8)
    assert BlockMask.sliding_window((16, 16), 4, window=np.int32(4), causal=np.bool_(False)).density > 0
    assert BlockMask.from_dense(torch.ones(2, 2, dtype=torch.bool), 8) == m.__class__(
        np.ones((2, 2), bool), (8, 8), (16, 16))


def test_from_flex_checks_is_causal():
    pytest.importorskip("torch.nn.attention.flex_attention")
    with pytest.raises(TypeError, match="is_causal"):
        BlockMask.from_flex(BlockMask.causal((64, 64), 32).to_flex(), is_causal="yes")


def test_pickle_and_copy_stay_read_only_and_equal():
    import copy
    import pickle

    m = BlockMask.sliding_window((100, 70), (32, 16), window=24)
    for back in (pickle.loads(pickle.dumps(m)), copy.copy(m), copy.deepcopy(m)):
        assert back == m and hash(back) == hash(m)
        assert not back.blocks.flags.writeable
        with pytest.raises(ValueError):
            back.blocks[0, 0, 0, 0] = False


def test_equal_masks_compare_and_hash_equal():
    a, b = BlockMask.causal((64, 48), 16), BlockMask.causal((64, 48), 16)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != BlockMask.causal((64, 48), 8)
    assert a != BlockMask.from_dense(a.blocks, 16, (64, 48), is_causal=False)
    assert a != a.expand(2, 1)  # same pattern, other (B, H) shape: a different mask
    assert a != "causal" and (a == object()) is False


@pytest.mark.parametrize("shape", [(2, 2), (1, 1, 2, 2), (2, 3, 2, 2)])
def test_the_callers_array_stays_writeable(shape):
    """A (B, H, Tr, Tc) grid used to be frozen in place: the mask must keep its own copy."""
    blocks = np.ones(shape, bool)
    m = BlockMask.from_dense(blocks, 8)
    BlockMask(blocks, (8, 8), (16, 16))
    assert blocks.flags.writeable
    blocks[..., 0, 0] = False
    assert m.blocks.all()


def test_huge_sizes_are_a_value_error_and_huge_windows_exact():
    with pytest.raises(ValueError, match="block_size must be at most"):
        BlockMask.causal((20, 20), 10**400)
    with pytest.raises(ValueError, match="seq_lens must be at most"):
        BlockMask.causal((2**40, 20), 16)
    wide = BlockMask.sliding_window((40, 30), 8, window=10**400, causal=False)
    assert wide == BlockMask.sliding_window((40, 30), 8, window=70, causal=False) and wide.density == 1


# ----- element-level masks: the mask mod comes along ---------------------------------------------
def test_from_flex_keeps_the_mask_mod():
    """A document mask through from_flex used to lose its mask_mod (outputs off by up to 0.97)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    import flashedu

    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([20, 50, 30]))

    def same_doc(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    fm = flex.create_block_mask(same_doc, None, None, 100, 100, device="cpu", BLOCK_SIZE=32)
    m = BlockMask.from_flex(fm)
    assert m.mask_mod is same_doc and m.needs_mask_mod
    q, k, v = (torch.randn(1, 2, 100, 16, dtype=torch.float64) for _ in range(3))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        theirs = flex.flex_attention(q, k, v, block_mask=fm)
    for backend in ("naive", "numpy"):
        ours = flashedu.attention(q, k, v, block_mask=m, backend=backend)
        assert (ours - theirs).abs().max() < 1e-10


def test_sliding_window_sees_exactly_its_window():
    """window=1 used to show the whole causal triangle inside each diagonal tile."""
    m = BlockMask.sliding_window((8, 8), (4, 4), window=1)
    i, j = np.arange(8)[:, None], np.arange(8)[None, :]
    assert np.array_equal(m.element_mask()[0, 0], (j >= i - 1) & (j <= i))
    assert m.mask_mod.window == 2 and m.is_causal and m.needs_mask_mod


def test_from_mask_mod_in_chunks_equals_the_dense_rule():
    from flashedu import mods

    m = BlockMask.from_mask_mod(mods.sliding_window(100, "bottom_right"), None, None, 700, 2100,
                                block_size=(64, 32))
    i, j = np.arange(700)[:, None], np.arange(2100)[None, :]
    want = (j > i + 1400 - 100) & (j <= i + 1400)
    assert np.array_equal(m.element_mask()[0, 0], want)
    Br, Bc = m.block_size
    tiles = np.pad(want, ((0, 704 - 700), (0, 2112 - 2100))).reshape(11, Br, 66, Bc)
    assert np.array_equal(m.blocks[0, 0], tiles.any(axis=(1, 3)))
    assert m.density < 0.1


def test_to_flex_from_flex_keep_a_mod_and_refuse_what_cannot_broadcast():
    pytest.importorskip("torch.nn.attention.flex_attention")

    def scalar_only(b, h, q_idx, kv_idx):  # fine under FlexAttention's vmap, not on tensors
        return q_idx >= kv_idx if bool(q_idx % 2 == 0) else q_idx > kv_idx

    fm = BlockMask.causal((64, 64), (32, 32)).to_flex()
    fm.mask_mod = scalar_only
    with pytest.raises(TypeError, match="from_flex cannot carry this FlexAttention mask_mod"):
        BlockMask.from_flex(fm)


@pytest.mark.parametrize("shape, seq_lens", [
    ((70, 50), None),                 # ragged: neither length a multiple of the tile
    ((2, 3, 64, 96), None),           # per batch and head
    ((2, 1, 1, 77), (45, 77)),        # a key-padding mask, broadcast over queries
    ((1, 1, 45, 1), (45, 77)),        # broadcast over keys
])
def test_from_bool_mask_gives_the_tiles_of_its_mask_mod(shape, seq_lens):
    """The per-tile reductions give the tiles from_mask_mod finds for a mod reading the mask,
    and the mask's visible pairs are exactly the True entries."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(sum(shape))
    mask = torch.rand(shape, generator=g) < 0.6
    mask[..., :1, :] = False  # a row that sees nothing
    if mask.shape[-1] > 40:
        mask[..., :, 32:40] = False  # a tile column with no True
    Nq, Nk = seq_lens or shape[-2:]
    full = mask.reshape((1,) * (4 - mask.dim()) + shape).expand(-1, -1, Nq, Nk)
    B, H = full.shape[:2]
    fast = BlockMask.from_bool_mask(mask, block_size=(16, 32), seq_lens=seq_lens)

    def reads(b, h, q, kv):
        return full[b * (B > 1), h * (H > 1), q, kv]
    slow = BlockMask.from_mask_mod(reads, B, H, Nq, Nk, block_size=(16, 32))
    assert np.array_equal(fast.blocks, slow.blocks)
    assert np.array_equal(fast.full, slow.full)
    assert np.array_equal(fast.element_mask(), full.numpy())


def test_from_bool_mask_refuses_what_is_not_a_bool_mask():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="bool"):
        BlockMask.from_bool_mask(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="shape"):
        BlockMask.from_bool_mask(torch.zeros((), dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        BlockMask.from_bool_mask(torch.zeros(1, 1, 1, 4, 4, dtype=torch.bool))
    # a key mask (Nk,) broadcasts over the rows, as SDPA's attn_mask does
    keys = torch.tensor([True, False, True, False, False, False])
    bm = BlockMask.from_bool_mask(keys, block_size=(2, 2), seq_lens=(4, 6))
    assert bm.blocks[0, 0].tolist() == [[True, True, False]] * 2
    with pytest.raises(ValueError, match="broadcast"):
        BlockMask.from_bool_mask(torch.zeros(3, 4, dtype=torch.bool), seq_lens=(5, 4))


def test_bool_attn_mask_within_a_block_mask():
    """The triton backend's bool attn_mask together with a block mask: the pairs both show."""
    pytest.importorskip("triton")
    from flashedu.triton_backend import bool_mask_as_block_mask

    mask = torch.rand(2, 1, 70, 50, generator=torch.Generator().manual_seed(5)) < 0.6
    inner = BlockMask.causal((70, 50), (16, 16))
    both = bool_mask_as_block_mask(mask, inner, 70, 50)
    assert np.array_equal(both.element_mask(), mask.numpy() & inner.element_mask())
    alone = bool_mask_as_block_mask(mask, None, 70, 50)
    assert np.array_equal(alone.element_mask(), mask.numpy())
