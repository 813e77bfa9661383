"""Ring attention (flashedu.distributed) on the CPU: 2 and 3 gloo processes vs one process.

Every worker builds the same full q, k, v (one seed), takes its contiguous shard, runs the ring
forward and backward, and compares its output and gradient shards with float64 attention over the
whole sequence. One spawn per world size runs all the cases (process start-up dominates).
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# B, H, Hkv, n (positions per rank), d, dtype, causal, local step
CASES = [
    (2, 2, 2, 8, 16, torch.float64, False, "torch"),
    (2, 2, 2, 8, 16, torch.float64, True, "torch"),
    (1, 4, 2, 5, 8, torch.float64, True, "torch"),  # GQA, odd shard length
    (1, 2, 1, 6, 16, torch.float32, False, "torch"),  # MQA in float32
    (1, 4, 2, 7, 16, torch.float32, True, "triton"),  # the GPU's local kernels, interpreted
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_problem(case, world, seed):
    B, H, Hkv, n, d = case[:5]
    g = torch.Generator().manual_seed(seed)  # the same on every rank
    N = n * world
    q = torch.randn(B, H, N, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, N, d, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(B, H, N, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def worker(rank, world, port):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import flashedu  # noqa: F401  (before anything imports triton)
    from flashedu.distributed import ring_attention
    from flashedu.reference import naive_attention_torch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for seed, case in enumerate(CASES):
            dtype, causal, local = case[5:]
            if local == "triton" and world > 2:
                continue  # the interpreter is slow: its one case runs with 2 processes
            q, k, v, dout = full_problem(case, world, seed)
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            out_ref = naive_attention_torch(*ref, is_causal=causal)
            grads_ref = torch.autograd.grad(out_ref, ref, dout)

            n = case[3]
            mine = slice(rank * n, (rank + 1) * n)  # this rank's contiguous shard
            shard = [t[:, :, mine].to(dtype).requires_grad_() for t in (q, k, v)]
            out = ring_attention(*shard, is_causal=causal, local=local)
            grads = torch.autograd.grad(out, shard, dout[:, :, mine].to(dtype))

            tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else \
                {"rtol": 1e-4, "atol": 1e-5}
            where = f"rank {rank} {case}"
            torch.testing.assert_close(out.double(), out_ref[:, :, mine].detach(), **tol,
                                       msg=lambda m, where=where: f"{where} out: {m}")
            for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
                torch.testing.assert_close(got.double(), want[:, :, mine], **tol,
                                           msg=lambda m, w=f"{where} {name}": f"{w}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ring_matches_single_process(world):
    mp.spawn(worker, args=(world, free_port()), nprocs=world, join=True)


def test_ring_needs_an_initialized_group():
    from flashedu.distributed import ring_attention

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)
    with pytest.raises(ValueError, match="same shard"):
        ring_attention(q, q[:, :, :2], q[:, :, :2])
    with pytest.raises(ValueError, match="local"):
        ring_attention(q, q, q, local="cuda")


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("is_causal", [False, True])
def test_thread_ring_runs_the_same_code(world, is_causal):
    """simulate_ring: ring_forward / ring_backward with thread ranks (what notebook 12 runs)."""
    from flashedu.distributed import simulate_ring
    from flashedu.reference import naive_attention_torch

    q, k, v, dout = full_problem((1, 4, 2, 3, 8, torch.float64, is_causal, "torch"), world, 7)
    out, dq, dk, dv = simulate_ring(q, k, v, world, is_causal=is_causal, dout=dout)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = naive_attention_torch(*ref, is_causal=is_causal)
    torch.testing.assert_close(out, out_ref.detach(), rtol=1e-10, atol=1e-10)
    for got, want in zip((dq, dk, dv), torch.autograd.grad(out_ref, ref, dout)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
