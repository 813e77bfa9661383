import os
import sys

import pytest

# Import flashedu before anything can import triton or numba: it arranges CPU emulation.
import flashedu  # noqa: F401

sys.path.insert(0, os.path.dirname(__file__))

from backend_cases import CAPS, unavailable  # noqa: E402


@pytest.fixture(params=list(CAPS))
def backend(request):
    reason = unavailable(request.param)
    if reason is not None:
        pytest.skip(f"backend {request.param} unavailable: {reason}")
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
