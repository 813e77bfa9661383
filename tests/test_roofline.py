import math

import numpy as np
import pytest

from flashedu import io, roofline


def test_attainable_is_min_of_roof_and_slope():
    peak, bw = 100e9, 10e9  # ridge at 10 FLOP/byte
    assert roofline.ridge_point(peak, bw) == 10
    np.testing.assert_allclose(roofline.attainable_flops(peak, bw, [1, 10, 1000]),
                               [10e9, 100e9, 100e9])


def test_steps_without_mask_and_dropout_are_algorithm_0():
    N, d, isz = 512, 64, 2
    steps = roofline.naive_attention_steps(N, d, itemsize=isz, mask=False, dropout=False)
    assert [s.name for s in steps] == ["S = QK^T", "softmax", "O = PV"]
    assert sum(s.bytes for s in steps) == io.standard_attention_hbm_elements(N, d) * isz
    matmul = sum(s.flops for s in steps if "QK" in s.name or "PV" in s.name)
    assert matmul == io.attention_flops(N, N, d)


def test_elementwise_steps_have_constant_intensity_matmuls_grow_with_d():
    small = {s.name: s.intensity for s in roofline.naive_attention_steps(4096, 64)}
    large = {s.name: s.intensity for s in roofline.naive_attention_steps(4096, 256)}
    for name in ("mask", "softmax", "dropout"):
        assert small[name] == large[name] <= 2
    assert large["S = QK^T"] > 3 * small["S = QK^T"]
    assert small["S = QK^T"] > 20 * small["softmax"]


def test_roofline_time_is_the_larger_of_compute_and_memory():
    step = roofline.KernelStep("x", flops=1e9, bytes=1e9)
    assert roofline.roofline_time(step, peak_flops=1e12, bandwidth=1e10) == pytest.approx(0.1)
    assert roofline.roofline_time(step, peak_flops=1e9, bandwidth=1e12) == pytest.approx(1.0)


def test_cpu_measurements_are_positive_and_plausible():
    m = roofline.measure_cpu(copy_bytes=8 * 2**20, matmul_n=256)
    assert 1e8 < m.bandwidth < 1e13  # 0.1 GB/s .. 10 TB/s
    assert 1e7 < m.flops < 1e14
    assert math.isclose(m.ridge, m.flops / m.bandwidth)


def test_torch_cpu_measurements_run():
    assert roofline.torch_copy_bandwidth("cpu", nbytes=4 * 2**20, repeats=2) > 0
    assert roofline.torch_matmul_flops("cpu", n=128, repeats=2) > 0


def test_plot_roofline_draws():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    roofline.plot_roofline(ax, 1e12, 1e11, "m", points=[("a", 1.0, None), ("b", 100.0, 5e11)])
    assert len(ax.lines) >= 3
    plt.close(fig)
