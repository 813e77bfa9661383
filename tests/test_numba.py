"""The numba.cuda kernel, run by numba's CUDA simulator on a CPU (tiny shapes: every simulated
thread is a Python thread). The GPU side is scripts/gpu_numba.py."""

import math

import numpy as np
import pytest
import torch

import flashedu
from flashedu import io
from flashedu import numba_kernels as nk
from flashedu.backends import backends_with_backward


def reference(q, k, v, is_causal=False, visible=None):
    """float64 softmax(q k^T / sqrt(d)) v and its logsumexp; a row with no visible key -> 0, -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    S = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    Nq, Nk = S.shape[-2:]
    if visible is None:
        visible = torch.ones(Nq, Nk, dtype=torch.bool)
    if is_causal:
        visible = visible & torch.ones(Nq, Nk, dtype=torch.bool).tril()
    S = S.masked_fill(~visible, -math.inf)
    return torch.softmax(S, -1).nan_to_num(0.0) @ v, torch.logsumexp(S, -1)


def randn(*shape):
    return torch.randn(*shape, dtype=torch.float32)


def assert_matches(out, L, ref, ref_L):
    assert not torch.isnan(out).any() and not torch.isnan(L).any(), "an output was never written"
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(L.double(), ref_L, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("B, H, Hkv, Nq, Nk, d, is_causal", [
    (1, 2, 2, 64, 64, 16, False),  # 4 x 4 tiles
    (1, 2, 1, 37, 50, 8, True),  # odd sizes, GQA, causal skips tiles right of the diagonal
    (2, 1, 1, 40, 24, 5, True),  # Nq > Nk, odd head dim
    (1, 1, 1, 1, 1, 3, False),  # one query, one key
])
def test_forward_matches_float64(B, H, Hkv, Nq, Nk, d, is_causal):
    q, k, v = randn(B, H, Nq, d), randn(B, Hkv, Nk, d), randn(B, Hkv, Nk, d)
    out, L = nk.forward(q, k, v, is_causal=is_causal, poison=True)
    assert_matches(out, L, *reference(q, k, v, is_causal))


def test_large_scores_and_explicit_scale():
    q, k, v = randn(1, 1, 20, 8) * 30, randn(1, 1, 30, 8) * 30, randn(1, 1, 30, 8)
    out, L = nk.forward(q, k, v, scale=0.9, poison=True)
    S = 0.9 * q.double() @ k.double().transpose(-1, -2)
    torch.testing.assert_close(out.double(), torch.softmax(S, -1) @ v.double(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(L.double(), torch.logsumexp(S, -1), atol=1e-4, rtol=1e-6)


def test_block_mask_not_aligned_to_tiles_and_fully_masked_rows():
    """Mask blocks of 7 x 11 cut the kernel's 16 x 16 tiles: tiles are partly visible, and the
    rows of the second block row see no key at all (O = 0, L = -inf)."""
    blocks = np.array([[1, 0, 1], [0, 0, 0], [1, 1, 0]], dtype=bool)
    mask = flashedu.BlockMask.from_dense(blocks, (7, 11), (20, 30))
    q, k, v = randn(1, 2, 20, 4), randn(1, 2, 30, 4), randn(1, 2, 30, 4)
    out, L = nk.forward(q, k, v, block_mask=mask, poison=True)
    visible = torch.from_numpy(mask.element_mask()[0, 0])
    assert_matches(out, L, *reference(q, k, v, visible=visible))
    assert (out[:, :, 7:14] == 0).all() and torch.isneginf(L[:, :, 7:14]).all()


def test_through_flashedu_attention_casts_back():
    """Half-precision inputs are computed in float32 and come back in their own dtype."""
    q, k, v = (randn(1, 2, 24, 8).to(torch.float16) for _ in range(3))
    out = flashedu.attention(q, k, v, is_causal=True, backend="numba")
    assert out.dtype == torch.float16
    want = reference(q.double(), k.double(), v.double(), True)[0]
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)


def test_float64_is_refused_rather_than_rounded():
    q = randn(1, 1, 8, 8).to(torch.float64)
    with pytest.raises(TypeError, match="float32"):
        flashedu.attention(q, q, q, backend="numba")


# threads that read shared memory before it is written may read anything, overflow included
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.skipif(not flashedu.runtime.numba_simulated(),
                    reason="a race shows in the simulator, whose threads interleave; on a GPU "
                           "the block's one warp runs in step and may hide it")
def test_without_barriers_the_result_is_wrong():
    """Drop cuda.syncthreads(): threads read tiles before other threads have written them."""
    q, k, v = randn(1, 1, 32, 8), randn(1, 1, 32, 8), randn(1, 1, 32, 8)
    ref, _ = reference(q, k, v)
    good, _ = nk.forward(q, k, v)
    bad, _ = nk.forward(q, k, v, barriers=False)
    assert (good.double() - ref).abs().max() < 1e-5
    assert not torch.allclose(bad.double(), ref, atol=1e-3)


def test_head_dim_too_large():
    q = randn(1, 1, 4, nk.MAX_HEAD_DIM + 1)
    with pytest.raises(ValueError, match="head dim d=129"):
        flashedu.attention(q, q, q, backend="numba")


def test_dropout_not_implemented():
    q = randn(1, 1, 4, 4)
    with pytest.raises(NotImplementedError, match="dropout"):
        flashedu.attention(q, q, q, dropout_p=0.1, backend="numba")


def test_gradient_error_names_backends_with_backward():
    q, k, v = (randn(1, 1, 8, 4).requires_grad_() for _ in range(3))
    out = flashedu.attention(q, k, v, backend="numba")
    assert out.grad_fn is not None
    with pytest.raises(NotImplementedError) as err:
        out.sum().backward()
    for name in backends_with_backward():
        assert repr(name) in str(err.value)


@pytest.mark.parametrize("d", [1, 16, 40, 64, 96, 128])
def test_gpu_tiles_fit_the_shared_memory_budget(d):
    tiles = nk.choose_tiles(d, simulated=False)
    assert sum(nk.sram_bytes(tiles, d).values()) <= nk.SMEM_BUDGET
    assert tiles.threads == 128 and tiles.TM * tiles.TN >= 4  # register tiles, not one per thread


def test_sram_bytes_agree_with_io_footprint():
    """Ours = the paper's footprint in float32, less O_i (kept in registers), plus the one-float
    row padding of Q_i, K_j, S_ij, V_j's widening to a multiple of TX, alpha, and the softmax
    threads' shares of each row's max and sum (one float each per thread)."""
    tiles, d = nk.choose_tiles(40, simulated=False), 40
    Br, Bc, TX = tiles.Br, tiles.Bc, tiles.TX
    paper = io.sram_footprint(Br, Bc, d, "float32")
    ours = nk.sram_bytes(tiles, d)
    padding = 4 * (Br + Bc + Br + Bc * (math.ceil(d / TX) * TX - d))
    assert ours["row_parts"] == 2 * 4 * tiles.threads
    assert sum(ours.values()) == (sum(paper.values()) - paper["O_i"] + padding + ours["alpha"]
                                  + ours["row_parts"])


def test_tiles_give_every_softmax_row_whole_threads():
    """The softmax gives each row of S_ij TX / TM threads: a tiling with more rows than
    threads would leave rows without one."""
    assert nk.Tiles(64, 32, 16, 8).threads // 64 == 2
    with pytest.raises(ValueError, match="TX=4 must be a multiple of TM"):
        nk.Tiles(64, 16, 8, 4)


def test_simulator_tiles_stay_small():
    tiles = nk.choose_tiles(64, simulated=True)
    assert tiles.threads == 32 and (tiles.Br, tiles.Bc) == (16, 16)


def test_gpu_script_check_runs_on_the_simulator(monkeypatch):
    """scripts/gpu_numba.py's correctness check (poisoned outputs, float64 reference, 2x the
    error of float32 PyTorch), run here on a tiny case so that the GPU script cannot rot."""
    from script_loading import load_script

    script = load_script("gpu_numba")
    monkeypatch.setattr(script, "DEV", "cpu")
    result = script.check_case(1, 2, 1, 21, 19, 6, is_causal=True, sample_rows=9)
    assert result["passed"], result


def test_a_mask_mod_is_refused_not_ignored():
    """The kernel reads a block mask's tile grid only: a mask mod inside partial tiles would be
    silently dropped, so it is refused, naming the backends that apply it."""
    mask = flashedu.BlockMask.sliding_window((64, 64), (16, 16), window=8)
    assert mask.needs_mask_mod
    q = randn(1, 1, 64, 8)
    flashedu.BACKENDS["numba"].load()  # the registry tells the kernel module the alternatives
    with pytest.raises(NotImplementedError, match="mask mod") as err:
        nk.forward(q, q, q, block_mask=mask)
    assert "'triton'" in str(err.value)
