"""Ring attention (flashedu.distributed) on the CPU: 2, 3 and 4 gloo processes vs one process.

Every worker builds the same full q, k, v (one seed), takes its shard (zigzag or contiguous),
runs the ring forward and backward, and compares its output and gradient shards with float64
attention over the whole sequence. It also checks that the bytes the ring holds (a Ledger of
the real run) equal the closed form of ``ring_memory``. One spawn per world size runs all the
cases (process start-up dominates).
"""

import os
import socket
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# B, H, Hkv, c (positions per chunk: n = 2c a rank), d, dtype, causal, layout, tile, local,
# accumulate
CASES = [
    (2, 2, 2, 4, 16, torch.float64, False, "zigzag", None, "torch", "float32"),
    (2, 2, 2, 4, 16, torch.float64, True, "zigzag", 2, "torch", "float32"),
    (1, 4, 2, 5, 8, torch.float64, True, "zigzag", 2, "torch", "float32"),  # GQA, odd chunk
    (1, 4, 1, 3, 8, torch.float64, False, "zigzag", 6, "torch", "float32"),  # MQA, odd chunk
    (1, 2, 2, 3, 8, torch.float64, True, "contiguous", 2, "torch", "float32"),  # tiles of 2
    (1, 2, 1, 4, 16, torch.float32, True, "zigzag", 4, "torch", "float32"),  # MQA, pieces of 2
    (1, 2, 2, 8, 16, torch.bfloat16, True, "zigzag", 4, "torch", "input"),  # 16-bit transit
    (1, 4, 2, 4, 16, torch.float32, True, "zigzag", 2, "triton", "float32"),  # interpreted
]
TOLERANCE = {torch.float64: {"rtol": 1e-10, "atol": 1e-10},
             torch.float32: {"rtol": 1e-4, "atol": 1e-5},
             torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_problem(B, H, Hkv, N, d, seed):
    g = torch.Generator().manual_seed(seed)  # the same on every rank
    q = torch.randn(B, H, N, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, N, d, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(B, H, N, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def worker(rank, world, port):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import flashedu  # noqa: F401  (before anything imports triton)
    from flashedu import distributed as D
    from flashedu import runtime
    from flashedu.reference import naive_attention_torch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for seed, case in enumerate(CASES):
            B, H, Hkv, c, d, dtype, causal, layout, tile, local, accumulate = case
            if local == "triton" and (world > 2 or not runtime.triton_interpreted()):
                # the interpreter is slow: its one case runs with 2 processes; where the
                # kernels compile they take CUDA tensors, which test_ring_on_the_gpu_in_16_bits
                # gives them
                continue
            N = 2 * c * world
            q, k, v, dout = full_problem(B, H, Hkv, N, d, seed)
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            out_ref = naive_attention_torch(*ref, is_causal=causal, enable_gqa=True)
            grads_ref = torch.autograd.grad(out_ref, ref, dout)

            mine = [D.shard(t, rank, world, layout).to(dtype).requires_grad_()
                    for t in (q, k, v)]
            out = D.ring_attention(*mine, is_causal=causal, local=local, layout=layout,
                                   tile=tile, accumulate=accumulate)
            grads = torch.autograd.grad(out, mine, D.shard(dout, rank, world, layout).to(dtype))

            tol = TOLERANCE[dtype]
            where = f"rank {rank} of {world} {case}"
            want = D.shard(out_ref.detach(), rank, world, layout)
            torch.testing.assert_close(out.double(), want, **tol,
                                       msg=lambda m, where=where: f"{where} out: {m}")
            for name, got, full in zip(("dq", "dk", "dv"), grads, grads_ref):
                torch.testing.assert_close(got.double(), D.shard(full, rank, world, layout),
                                           **tol, msg=lambda m, w=f"{where} {name}": f"{w}: {m}")

            # the bytes the ring holds = the formula, on this rank
            ring = D.Ring()
            fplan, plan = D.pass_plans(2 * c, world, layout, tile)
            books = D.Ledger(), D.Ledger()
            x = [t.detach() for t in mine]
            o, L = D.ring_forward(ring, *x, causal, d ** -0.5, local, fplan, books[0])
            D.ring_backward(ring, *x, o, L, D.shard(dout, rank, world, layout).to(dtype),
                            causal, d ** -0.5, local, plan, books[1], accumulate)
            mem = D.ring_memory(N, world, H, d, dtype, B=B, Hkv=Hkv, is_causal=causal,
                                layout=layout, tile=tile, local=local, accumulate=accumulate,
                                rank=rank)
            assert (books[0].peak, books[1].peak) == (mem["forward"], mem["backward"]), \
                (where, books[0].peak_by_kind, books[1].peak_by_kind, mem)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
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
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="accumulate"):
        ring_attention(q, q, q, accumulate="bfloat16")


def test_each_pass_has_its_tile():
    """The forward's tile defaults to 4 of the backward's (within the shard); call_rows rounds up
    to a multiple of each pass's tile; a bad forward tile is named."""
    from flashedu.distributed import pass_plans

    fwd, bwd = pass_plans(64, 2)  # zigzag: chunks of 32; default backward tile n/8
    assert (bwd.tile, fwd.tile, bwd.call_rows, fwd.call_rows) == (8, 32, 32, 64)
    fwd, bwd = pass_plans(64, 2, tile=4, forward_tile=8, call_rows=12)
    assert (fwd.tile, fwd.call_rows, bwd.call_rows) == (8, 16, 12)
    assert pass_plans(12, 2, tile=2)[0].tile == 6  # 4 x 2 does not fit chunks of 6: the largest
    with pytest.raises(ValueError, match="forward_tile must be an even number"):
        pass_plans(64, 2, forward_tile=12)


def test_zigzag_shard_and_unshard():
    from flashedu import distributed as D

    x = torch.arange(24).view(1, 1, 24, 1)
    shards = [D.zigzag_shard(x, r, 3) for r in range(3)]
    assert shards[0].flatten().tolist() == [0, 1, 2, 3, 20, 21, 22, 23]  # chunks 0 and 5
    assert shards[2].flatten().tolist() == [8, 9, 10, 11, 12, 13, 14, 15]  # chunks 2 and 3
    assert torch.equal(D.zigzag_unshard(shards), x)
    assert D.shard_positions(24, 1, 3).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    # a length that is not a multiple of 2P is refused, naming the fix
    with pytest.raises(ValueError, match="pad_sequence"):
        D.zigzag_shard(torch.zeros(1, 1, 25, 1), 0, 3)
    with pytest.raises(ValueError, match="tile"):
        D.Plan(8, 2, "zigzag", tile=3)  # a zigzag tile is two equal pieces
    with pytest.raises(ValueError, match="half divides the chunk length 4"):
        D.Plan(8, 2, "zigzag", tile=6)


@pytest.mark.parametrize("world", [2, 3])
def test_odd_length_padded_is_exact_for_causal(world):
    """N = 2P*c + 3: padded at the end, the causal ring gives the unpadded answer on the real rows."""
    from flashedu import distributed as D
    from flashedu.reference import naive_attention_torch

    N = 2 * world * 2 + 3
    q, k, v, dout = full_problem(1, 2, 1, N, 8, 3)
    padded = [D.pad_sequence(t, 2 * world) for t in (q, k, v, dout)]
    assert padded[0].shape[2] % (2 * world) == 0
    out, dq, dk, dv = D.simulate_ring(*padded[:3], world, is_causal=True, dout=padded[3])
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = naive_attention_torch(*ref, is_causal=True, enable_gqa=True)
    for got, want in zip((out, dq, dk, dv), (out_ref, *torch.autograd.grad(out_ref, ref, dout))):
        torch.testing.assert_close(got[:, :, :N], want.detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_thread_ring_runs_the_same_code(world, layout, is_causal):
    """simulate_ring: ring_forward / ring_backward with thread ranks (what notebook 12 runs)."""
    from flashedu.distributed import ring_memory, simulate_ring
    from flashedu.reference import naive_attention_torch

    N = 2 * world * 3
    q, k, v, dout = full_problem(1, 4, 2, N, 8, 7)
    ledgers = []
    tile = 2 if layout == "zigzag" else 3  # zigzag: pieces of 1 from each chunk of 3
    out, dq, dk, dv = simulate_ring(q, k, v, world, is_causal=is_causal, dout=dout,
                                    layout=layout, tile=tile, ledgers=ledgers)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = naive_attention_torch(*ref, is_causal=is_causal, enable_gqa=True)
    torch.testing.assert_close(out, out_ref.detach(), rtol=1e-10, atol=1e-10)
    for got, want in zip((dq, dk, dv), torch.autograd.grad(out_ref, ref, dout)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    mem = ring_memory(N, world, 4, 8, torch.float64, Hkv=2, is_causal=is_causal, layout=layout,
                      tile=tile, local="torch")
    assert max(f.peak for f, _ in ledgers) == mem["forward"]
    assert max(b.peak for _, b in ledgers) == mem["backward"]


def test_each_micro_step_posts_one_group(monkeypatch):
    """Every micro-step's transfers (K/V tile on, accumulators on and in) leave in one group.
    NCCL runs separate groups of a pair of ranks one after the other: had each rank posted its
    finished accumulator in a group of its own ahead of the receive the other rank waits on,
    the two would stall once the tensors outgrow NCCL's buffers."""
    from flashedu import distributed as D

    posts = {}
    real = D.ThreadRing.post_tagged

    def counting(self, send=(), recv=()):
        posts[self.rank] = posts.get(self.rank, 0) + 1
        return real(self, send, recv)

    monkeypatch.setattr(D.ThreadRing, "post_tagged", counting)
    world, N, tile, forward_tile = 2, 12, 2, 6
    q, k, v, dout = full_problem(1, 2, 2, N, 8, 3)
    D.simulate_ring(q, k, v, world, dout=dout, tile=tile, forward_tile=forward_tile)
    m = N // world // tile  # the backward's tiles per shard; micro-steps: m * world
    # the K/V tile moves on at all but a tile's last micro-step
    forward = N // world // forward_tile * (world - 1)
    backward = m * world + 1  # one group a micro-step, and the last accumulator home
    assert posts == {r: forward + backward for r in range(world)}


def test_zigzag_balances_causal_work():
    """Causal tiles computed per rank: equal under zigzag, 1..P blocks under contiguous shards."""
    from flashedu.distributed import Plan

    for P in (2, 3, 4, 8):
        zig = [Plan(8, P, "zigzag", 2).work(r, True) for r in range(P)]
        con = [Plan(8, P, "contiguous", 2).work(r, True) for r in range(P)]
        assert len(set(zig)) == 1 and sum(zig) == sum(con)
        # in tile^2 units, a shard block is 16: contiguous rank r computes r full blocks and
        # one causal diagonal block (8); zigzag gives every rank the average, 8P
        assert con == [16 * r + 8 for r in range(P)] and zig == [8 * P] * P
        assert con[-1] / zig[0] == pytest.approx(2 - 1 / P)  # the slowest rank sets the time
        # the ranks wait for each other at every micro-step: zigzag tiles (a piece of each
        # chunk) give every rank the same work at every micro-step, not only in total
        assert Plan(8, P, "zigzag", 2).lockstep(True) == zig[0]
        assert Plan(8, P, "contiguous", 2).lockstep(True) == con[-1]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout,tile", [("zigzag", 2), ("zigzag", 4), ("contiguous", 2)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_calls_cover_each_visible_pair_once(world, layout, tile, is_causal):
    """Over the whole ring, a rank's calls meet every (query, key) pair its mask lets through
    exactly once, and no other: checked pair by pair in global positions."""
    from flashedu.distributed import Plan, shard_positions

    n = 8
    plan = Plan(n, world, layout, tile, call_rows=2 * tile)
    N = n * world
    for rank in range(world):
        seen = torch.zeros(N, N, dtype=torch.int64)  # [global query, global key]
        rows = shard_positions(N, rank, world, layout)
        for src in range(world):
            for p in range(plan.m):
                keys = torch.cat([shard_positions(N, src, world, layout)[a:b]
                                  for a, b in plan.tile_rows(p)])
                for a, b, lo, hi, causal in plan.calls(rank, src, p, is_causal):
                    assert b - a <= plan.call_rows
                    qg, kg = rows[a:b], keys[lo:hi]
                    hit = torch.ones(b - a, hi - lo, dtype=torch.int64)
                    if causal:
                        assert torch.equal(qg, kg)  # causal inside: the same positions
                        hit = hit.tril()
                    seen[qg[:, None], kg[None, :]] += hit
        want = torch.zeros(N, N, dtype=torch.int64)
        want[rows] = 1
        if is_causal:
            want = want.tril()
        assert torch.equal(seen, want), (rank, seen)


def test_memory_per_gpu_falls_with_p():
    """The closed form at the GPU benchmark's size: bf16, H=16, d=128, N=128K."""
    from flashedu.distributed import ring_memory

    per_gpu = {P: ring_memory(131072, P, 16, 128, torch.bfloat16, is_causal=True)
               for P in (1, 2, 4, 8)}
    one = per_gpu[1]["one_gpu"]
    fractions = [per_gpu[P]["per_gpu"] / one for P in (2, 4, 8)]
    assert fractions == sorted(fractions, reverse=True) and fractions[-1] < 0.25
    lean = ring_memory(131072, 2, 16, 128, torch.bfloat16, is_causal=True, accumulate="input")
    assert lean["per_gpu"] / one <= 0.6


@pytest.mark.parametrize("causal_first", [False, True])
def test_kernel_merge_equals_the_merge_rule(causal_first):
    """block_forward_into with the Triton kernel (interpreted) resumes its online softmax from
    the running (O, L) (from nothing seen, L = -inf, at the first call): a fold over key blocks
    equals torch's merge and attention over all keys, for ragged and causal blocks, GQA and a
    query row slice of a larger tensor."""
    import flashedu  # (before triton)
    from flashedu.distributed import block_forward_into

    dev = flashedu.runtime.kernel_device()  # compiled where there is a GPU
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 30, 16, generator=g).to(dev)
    k, v = (torch.randn(1, 2, 23, 16, generator=g).to(dev) for _ in range(2))
    rows = slice(4, 26)  # the calls take a row slice, as the ring's calls do
    state = {kind: (torch.zeros(q.shape, device=dev),
                    torch.full(q.shape[:-1], float("-inf"), device=dev))
             for kind in ("triton", "torch")}
    blocks = [(0, 9, causal_first), (9, 10, False), (10, 23, False)]
    for local, (O, L) in state.items():
        for a, b, causal in blocks:
            block_forward_into(q[:, :, rows], k[:, :, a:b], v[:, :, a:b], O[:, :, rows],
                               L[:, :, rows], causal=causal, scale=0.25, local=local)
    O_t, L_t = state["triton"]
    torch.testing.assert_close(O_t, state["torch"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(L_t, state["torch"][1], rtol=1e-5, atol=1e-6)
    if not causal_first:  # every row saw every key: the whole attention
        K, V = (x.repeat_interleave(2, 1).double() for x in (k, v))
        S = 0.25 * q[:, :, rows].double() @ K.transpose(-1, -2)
        torch.testing.assert_close(O_t[:, :, rows].double(), torch.softmax(S, -1) @ V,
                                   rtol=1e-5, atol=1e-6)
    assert (O_t[:, :, :4] == 0).all() and (O_t[:, :, 26:] == 0).all()  # rows outside: untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the compiled kernel's merge needs a CUDA GPU (the test above runs it "
                           "in the interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_merge_on_the_gpu(dtype):
    """The compiled forward_into (the H100's tiles, TMA at d=128) against torch's merge of the
    same blocks, on a row slice of a larger q, GQA, ragged and causal blocks."""
    from flashedu.distributed import block_forward_into

    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 4, 700, 128, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, 2, 900, 128, device="cuda", dtype=dtype, generator=g)
            for _ in range(2))
    rows = slice(100, 612)
    state = {kind: (torch.zeros(q.shape, device="cuda"),
                    torch.full(q.shape[:-1], float("-inf"), device="cuda"))
             for kind in ("triton", "torch")}
    for local, (O, L) in state.items():
        for a, b, causal in [(0, 512, True), (512, 700, False), (700, 900, False)]:
            block_forward_into(q[:, :, rows], k[:, :, a:b], v[:, :, a:b], O[:, :, rows],
                               L[:, :, rows], causal=causal, scale=0.088, local=local)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4,
                                                                          "atol": 1e-4}
    torch.testing.assert_close(state["triton"][0], state["torch"][0], **tol)
    torch.testing.assert_close(state["triton"][1], state["torch"][1], **tol)
    assert (state["triton"][0][:, :, :100] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the compiled kernels in bf16 need a CUDA GPU (the CPU tests run the "
                           "16-bit ring with torch math)")
@pytest.mark.parametrize("is_causal", [False, True])
def test_ring_on_the_gpu_in_16_bits(is_causal):
    """The thread ring with the compiled kernels in bf16 (GQA, 3 ranks), both accumulate modes,
    against float64 attention: "input" sends the dK, dV accumulators in bf16 and sums dQ in
    bf16, and stays within a small factor of float32's error."""
    from flashedu.distributed import simulate_ring
    from flashedu.reference import naive_attention_torch

    g = torch.Generator(device="cuda").manual_seed(11)
    N = 3 * 2 * 384
    q = torch.randn(1, 4, N, 128, device="cuda", generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, N, 128, device="cuda", generator=g, dtype=torch.float64)
            for _ in range(2))
    dout = torch.randn(q.shape, device="cuda", generator=g, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = naive_attention_torch(*ref, is_causal=is_causal, enable_gqa=True)
    want = (out_ref.detach(), *torch.autograd.grad(out_ref, ref, dout))
    errors = {}
    for mode in ("float32", "input"):
        got = simulate_ring(*(t.bfloat16() for t in (q, k, v)), 3, is_causal=is_causal,
                            dout=dout.bfloat16(), local="triton", tile=128, accumulate=mode)
        errors[mode] = [(a.double() - b).abs().max().item() / b.abs().max().item()
                        for a, b in zip(got, want)]
    for mode, errs in errors.items():
        assert max(errs) < 2e-2, (mode, errs)
    assert errors["input"][0] == errors["float32"][0]  # the forward does not change
    for e_in, e_32 in zip(errors["input"][1:], errors["float32"][1:]):
        assert e_in <= 4 * e_32 + 1e-3, errors


def test_kernel_merge_names_bad_running_results():
    import flashedu  # noqa: F401
    from flashedu.triton.autograd import resolve_config
    from flashedu.triton.launch import forward_into

    q = torch.randn(1, 2, 8, 16)
    tiles = resolve_config(16, q.dtype, None, q.device).forward_tiles(None, 8)
    kw = dict(is_causal=False, scale=0.25, tiles=tiles, interpreted=True)
    inf = torch.full((1, 2, 8), float("inf"))
    with pytest.raises(TypeError, match="float32"):
        forward_into(q, q, q, torch.zeros(q.shape, dtype=torch.float64), inf, **kw)
    with pytest.raises(ValueError, match="strides"):
        forward_into(q, q, q, torch.zeros(1, 8, 2, 16).transpose(1, 2), inf, **kw)
    with pytest.raises(ValueError, match="lse2"):
        forward_into(q, q, q, torch.zeros(q.shape), torch.full((1, 2, 9), 1.0)[..., :8], **kw)


def test_transfer_overlaps_compute():
    """A posted receive completes while this process computes: gloo moves the bytes in the
    background, so wait() after the compute costs (almost) nothing."""
    mp.spawn(overlap_worker, args=(2, free_port()), nprocs=2, join=True)


def overlap_worker(rank, world, port):
    torch.set_num_threads(1)
    from flashedu.distributed import Ring, wait_all

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        ring = Ring()
        x = torch.randn(4 << 20)  # 16 MB
        wait_all(ring.start_exchange([x])[0])  # warm the connection
        dist.barrier()
        t0 = time.perf_counter()
        wait_all(ring.start_exchange([x])[0])
        alone = time.perf_counter() - t0
        dist.barrier()
        handle, _ = ring.start_exchange([x])
        a = torch.randn(384, 384, dtype=torch.float64)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < max(0.05, 3 * alone):
            a = torch.tanh(a @ a)  # compute for longer than the transfer takes alone
        t1 = time.perf_counter()
        wait_all(handle)
        waited = time.perf_counter() - t1
        assert waited < 0.5 * alone + 0.005, (alone, waited)
    finally:
        dist.destroy_process_group()


def test_git_commit_is_the_projects_not_an_enclosing_repositorys(monkeypatch, tmp_path):
    """A copy of the package inside another git repository must not report that one's commit."""
    import shutil

    from flashedu import runtime

    monkeypatch.delenv("GIT_COMMIT", raising=False)
    outer = tmp_path / "outer"
    copy = outer / "project" / "flashedu"
    shutil.copytree(runtime.__file__.rsplit("/", 1)[0], copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "init", "-q", str(outer)], check=True, env=env)
    subprocess.run(["git", "-C", str(outer), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(outer), "commit", "-qm", "x"], check=True, env=env)
    monkeypatch.setattr(runtime, "__file__", str(copy / "runtime.py"))
    assert runtime.git_commit() == "unknown"
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    assert runtime.git_commit() == "abc1234"


def test_gpu_ring_script_runs_on_the_cpu(tmp_path):
    """scripts/gpu_ring.py with gloo and torch math (--cpu): the ring against one process, and
    the lockstep model, whose tile counts say the pieces never wait and the runs do."""
    import json
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_ring.py"
    env = {**os.environ, "PYTHONPATH": str(script.parents[1]), "OMP_NUM_THREADS": "1"}
    for extra, name in (([], "ring.json"), (["--lockstep"], "model.json")):
        subprocess.run([sys.executable, str(script), "--cpu", "--n", "128", "--tile", "16",
                        "--forward-tile", "32",
                        "--accumulate", "input", "--reps", "1", "--json",
                        str(tmp_path / name), *extra], check=True, env=env, timeout=300,
                       capture_output=True)
    ring = json.loads((tmp_path / "ring.json").read_text())
    assert [c["causal"] for c in ring["check"]] == [False, True]
    assert all(c["max_abs_err"] < 1e-5 for c in ring["check"])
    assert all(c["ring"]["fwd_bwd_ms"] > 0 for c in ring["cases"])
    model = json.loads((tmp_path / "model.json").read_text())
    causal = next(c["model"] for c in model["cases"] if c["causal"])
    assert causal["pieces"]["lockstep_units"] == causal["pieces"]["work_units"]
    assert causal["runs"]["lockstep_units"] == 1.25 * causal["runs"]["work_units"]
    # every rank's whole path ran once more on its own (the memory run)
    whole = model["cases"][0]["whole_rank"]["input"]
    assert [r["rank"] for r in whole["ranks"]] == [0, 1]
    assert all(r["fwd_bwd_ms"] > 0 for r in whole["ranks"]) and whole["predicted"]["per_gpu_GB"]
