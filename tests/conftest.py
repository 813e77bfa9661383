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


@pytest.fixture(params=["one-launch", "one-launch-steps-of-1", "two-launches"])
def merge_path(request, monkeypatch):
    """Split-KV decoding's merge (flashedu.triton.decode) each way: by the split kernel's last
    program of each group (one launch), the same with one split a merge step (MERGE_TILE 1:
    the merge loop then runs once per split), or by combine_kernel (two launches). Each test
    starts with no launch plans and no counters. Returns whether the merge is the split
    kernel's."""
    from flashedu.triton import decode, fast

    fused = request.param != "two-launches"
    monkeypatch.setattr(decode, "FUSED_COMBINE", fused)
    if request.param.endswith("steps-of-1"):
        monkeypatch.setattr(decode, "MERGE_TILE", 1)
    monkeypatch.setattr(decode, "_COUNTERS", {})
    monkeypatch.setattr(fast, "PLANS", {})
    decode._launch_plan.cache_clear()  # its constexprs read MERGE_TILE
    yield fused
    decode._launch_plan.cache_clear()
