"""flashedu.io: the counted HBM bytes of a traced run equal the closed-form prediction."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashedu import io, tiled
from flashedu.trace import Trace


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(1, 60), st.integers(1, 12), st.integers(1, 25),
       st.integers(1, 25), st.booleans(), st.sampled_from(["q_outer", "kv_outer"]),
       st.booleans(), st.integers(0, 1000))
def test_counted_equals_predicted(Nq, Nk, d, Br, Bc, causal, order, sparse, seed):
    rng = np.random.default_rng(seed)
    Q, K, V = (rng.standard_normal((n, d)).astype(np.float32) for n in (Nq, Nk, Nk))
    blocks = rng.random((math.ceil(Nq / Br), math.ceil(Nk / Bc))) < 0.5 if sparse else None
    tr = Trace()
    O, L = tiled.flash_forward(Q, K, V, Br, Bc, causal, order=order, block_mask=blocks, trace=tr)
    assert io.counted_hbm_bytes(tr) == io.flash_forward_hbm_bytes(
        Nq, Nk, d, Br, Bc, order, causal, blocks, itemsize=4)
    tr = Trace()
    dO = rng.standard_normal((Nq, d)).astype(np.float32)
    tiled.flash_backward(Q, K, V, O, dO, L, Br, Bc, causal, block_mask=blocks, trace=tr)
    assert io.counted_hbm_bytes(tr) == io.flash_backward_hbm_bytes(
        Nq, Nk, d, Br, Bc, causal, blocks, itemsize=4)


def test_loop_orders_differ_in_output_traffic():
    """FA1 (K/V outer) rewrites O once per K/V tile; FA2 (Q outer) writes it once."""
    N, d, B = 256, 16, 32
    fa1 = io.flash_forward_hbm_bytes(N, N, d, B, B, "kv_outer")
    fa2 = io.flash_forward_hbm_bytes(N, N, d, B, B, "q_outer")
    assert fa1["written"] > (N // B) * N * d * 4 > fa2["written"]


def test_theorem2_scaling():
    """Exact FA traffic over N^2 d^2 / M tends to a constant; standard attention's is 4Nd + 4N^2."""
    d, M = 64, 48 * 1024
    Br, Bc = io.paper_block_sizes(M, d)
    ratios = [io.flash_forward_hbm_bytes(N, N, d, Br, Bc, "kv_outer", itemsize=1)["total"]
              / io.flash_hbm_elements_theta(N, d, M) for N in (2048, 8192, 32768)]
    assert abs(ratios[-1] - ratios[-2]) < 0.1 * ratios[-1]
    assert io.standard_attention_hbm_elements(1000, 10) == 4 * 1000 * 10 + 4 * 1000**2
    # larger SRAM, fewer bytes: the block-size effect of the paper's Fig. 2 (middle)
    small, big = (io.flash_forward_hbm_bytes(4096, 4096, d, *io.paper_block_sizes(m, d), "kv_outer")
                  ["total"] for m in (8 * 1024, 64 * 1024))
    assert big < small


def test_sram_footprint_and_largest_tile():
    fp = io.sram_footprint(128, 64, 64, "float16", stages=2)
    assert fp["Q_i"] == 128 * 64 * 2 and fp["K_j"] == 2 * 64 * 64 * 2 and fp["S_ij/P_ij"] == 128 * 64 * 4
    B = io.largest_square_tile("H100 SXM5", 64)
    cap = io.GPUS["H100 SXM5"].smem_per_sm_kib * 1024
    assert sum(io.sram_footprint(B, B, 64).values()) <= cap < sum(io.sram_footprint(B + 16, B + 16, 64).values())
    with pytest.raises(ValueError, match="Br"):
        io.sram_footprint(0, 64, 64)


def test_gpu_table_is_sourced():
    for gpu in io.GPUS.values():
        assert gpu.source and gpu.hbm_gb_s > 0 and gpu.smem_per_sm_kib > 0
    assert io.attainable_tflops("H100 SXM5", 1.0) < io.attainable_tflops("H100 SXM5", 1000.0)
