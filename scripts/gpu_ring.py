"""Ring attention on 2 GPUs (NCCL) against one GPU: sequence-length scaling and time.

For each total sequence length N, with B = 1, H heads, head dim d, bf16:
- one GPU: flashedu.attention(backend="triton") over all N positions (forward, forward+backward);
- the ring: each of the P GPUs holds N/P positions in the zigzag layout (chunks r and 2P-1-r),
  flashedu.distributed.ring_attention, once per --accumulate mode ("float32": dQ and the
  travelling dK, dV accumulators summed in float32; "input": in bf16, less memory);
- one micro-step alone: the transfer of one K/V tile to the next GPU vs the compute of one
  micro-step (forward and backward calls of this rank's rows against one tile): the ring hides
  the transfer when compute >= transfer;
- peak memory per GPU (torch.cuda.max_memory_allocated) vs one GPU, and the prediction of
  flashedu.distributed.ring_memory.
Efficiency = t(one GPU) / (P * t(ring)): 1.0 is perfect scaling.
The ring's output is checked against the one-GPU output (gathered) at the first N.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

    PYTHONPATH=$PWD python3 scripts/gpu_ring.py --json docs/bench/ring.json     # 2 GPUs (mp.spawn)
    PYTHONPATH=$PWD python3 scripts/gpu_ring.py --cpu                           # gloo, tiny
    PYTHONPATH=$PWD python3 scripts/gpu_ring.py --lockstep --n 131072 --tile 8192  # 1 GPU model

--lockstep: one GPU plays every rank. The ring's time is modelled from each rank's micro-steps
timed alone, and each rank's whole forward + backward runs once more with its transfers
replaced by local copies (:class:`EchoRing`): its peak memory is the ring's per GPU, to set
against ring_memory's formula and one GPU's.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (before NCCL is loaded)
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a failed rank aborts, no hang

import argparse
import datetime
import json
import platform
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# flashedu before anything imports triton, as it must be
from flashedu.distributed import Ring, _own_tile

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Timer:
    """Median milliseconds of fn() on this rank: CUDA events on a GPU, a wall clock on a CPU."""

    def __init__(self, cuda: bool, warmup: int, reps: int, barrier: bool):
        self.cuda, self.warmup, self.reps, self.barrier = cuda, warmup, reps, barrier

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(self.reps):
            if self.barrier:
                dist.barrier()  # every rank starts the ring together
            if self.cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return sorted(samples)[len(samples) // 2]


def inputs(N, args, device, dtype, rank=None, world=None, grad=False):
    """q, k, v, dout over all N positions, or rank's zigzag shard of them (made one at a time,
    so the whole sequence never sits on a GPU at once)."""
    from flashedu.distributed import zigzag_shard

    g = torch.Generator(device=device).manual_seed(N)
    shape = (1, args.heads, N, args.d)
    out = []
    for _ in range(4):
        t = torch.randn(shape, device=device, dtype=dtype, generator=g)
        out.append(t if rank is None else zigzag_shard(t, rank, world).contiguous())
        del t
    q, k, v, dout = out
    return [t.requires_grad_(grad) for t in (q, k, v)] + [dout]


def fwd_bwd(fn, q, k, v, dout):
    out = fn(q, k, v)
    torch.autograd.grad(out, (q, k, v), dout)


def single_gpu(N, causal, args, device, dtype, timer):
    """One device, the whole sequence: the plain kernel (flashedu.attention)."""
    import flashedu

    backend = "triton" if device != "cpu" else "naive"
    fn = lambda q, k, v: flashedu.attention(q, k, v, is_causal=causal, backend=backend)
    q, k, v, dout = inputs(N, args, device, dtype, grad=True)
    reset_peak(device)
    with torch.no_grad():
        fwd = timer(lambda: fn(q, k, v))
    both = timer(lambda: fwd_bwd(fn, q, k, v, dout))
    return {"fwd_ms": fwd, "fwd_bwd_ms": both, "peak_GB": peak_gb(device)}


RING_KEYS = ("fwd_ms", "fwd_bwd_ms", "peak_GB", "tile_transfer_ms", "step_fwd_ms",
             "step_bwd_ms", "micro_steps")


class MicroSteps:
    """One rank's compute at a micro-step, as ring_forward and ring_backward make it: the
    forward's calls merged into a running (O, L), the backward's calls adding into dQ and a
    tile's float32 dK, dV. Built on one shard's q, k, v, dout (the values do not change the
    time)."""

    def __init__(self, q, k, v, dout, scale):
        from flashedu.distributed import _resolve_local, _row_dot_triton, block_forward

        self.q, self.dout, self.scale = q.detach(), dout, scale
        self.local = _resolve_local("auto", self.q)
        with torch.no_grad():
            out, self.L = block_forward(self.q, k.detach(), v.detach(), causal=False,
                                        scale=scale, local=self.local)
        self.out = out.to(q.dtype)
        self.D = _row_dot_triton(self.out, dout) if self.local == "triton" else None
        self.O_run = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        self.L_run = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        self.dq = torch.zeros_like(self.q)

    def forward(self, calls, K_t, V_t):
        from flashedu.distributed import block_forward_into

        with torch.no_grad():
            for a, b, lo, hi, c in calls:
                block_forward_into(self.q[:, :, a:b], K_t[:, :, lo:hi], V_t[:, :, lo:hi],
                                   self.O_run[:, :, a:b], self.L_run[:, :, a:b], causal=c,
                                   scale=self.scale, local=self.local)

    def backward(self, calls, K_t, V_t):
        from flashedu.distributed import block_backward_into

        dK_p = torch.zeros(K_t.shape, dtype=torch.float32, device=K_t.device)
        dV_p = torch.zeros_like(dK_p)
        for a, b, lo, hi, c in calls:
            rows = slice(a, b)
            block_backward_into(self.q[:, :, rows], K_t[:, :, lo:hi], V_t[:, :, lo:hi],
                                self.out[:, :, rows], self.L[:, :, rows],
                                self.dout[:, :, rows],
                                (self.dq[:, :, rows], dK_p[:, :, lo:hi], dV_p[:, :, lo:hi]),
                                causal=c, scale=self.scale, local=self.local,
                                D=None if self.D is None else self.D[:, :, rows])


def ring(N, causal, args, device, dtype, timer, rank, world, accumulate):
    """This rank's shard; returns its timings (the caller takes the slowest rank)."""
    from flashedu.distributed import pass_plans, ring_attention, wait_all

    q, k, v, dout = inputs(N, args, device, dtype, rank, world, grad=True)
    opts = dict(is_causal=causal, tile=args.tile, forward_tile=args.forward_tile,
                call_rows=args.call_rows, accumulate=accumulate)
    fn = lambda q, k, v: ring_attention(q, k, v, **opts)
    reset_peak(device)
    with torch.no_grad():
        fwd = timer(lambda: fn(q, k, v))
    both = timer(lambda: fwd_bwd(fn, q, k, v, dout))
    peak = peak_gb(device)
    # one backward micro-step alone: a K/V tile's transfer, and the compute on one tile (all
    # this rank's rows against it, in calls of call_rows rows, as a full-attention micro-step
    # makes them)
    _, plan = pass_plans(q.shape[2], world, "zigzag", args.tile, args.forward_tile,
                         args.call_rows)
    r = Ring()
    K_t, V_t = _own_tile(k.detach(), plan, 0), _own_tile(v.detach(), plan, 0)
    xfer = timer(lambda: wait_all(r.start_exchange((K_t, V_t))[0]))
    steps, calls = MicroSteps(q, k, v, dout, args.d ** -0.5), plan.calls(0, 0, 0, False)
    step_f = timer(lambda: steps.forward(calls, K_t, V_t))
    step_b = timer(lambda: steps.backward(calls, K_t, V_t))
    return {"fwd_ms": fwd, "fwd_bwd_ms": both, "peak_GB": peak, "tile_transfer_ms": xfer,
            "step_fwd_ms": step_f, "step_bwd_ms": step_b, "micro_steps": plan.m * world}


def runs_plan(plan):
    """``plan`` with tiles of consecutive rows (each inside one chunk) instead of a piece of
    each chunk: the cut the lockstep model compares against."""
    from flashedu.distributed import Plan

    tile = plan.tile
    runs = Plan(plan.n, plan.world, "zigzag", tile, plan.call_rows)
    if runs.chunk % tile:
        raise ValueError(f"runs: tile {tile} must divide the chunk {runs.chunk}")
    runs.pieces, runs.piece = 1, tile
    runs.tile_rows = lambda p: [(p * tile, (p + 1) * tile)]
    return runs


def lockstep_time(plan, world, causal, timer, k, v, step):
    """(ring ms, mean rank ms) of one pass: the sum over micro-steps of the slowest rank's
    ``step(calls, K_t, V_t)``, and of the ranks' mean."""
    K_t, V_t = _own_tile(k.detach(), plan, 0), _own_tile(v.detach(), plan, 0)
    ring = busy = 0.0
    for p in range(plan.m):
        for t in range(world):
            calls = [plan.calls(r, (r - t) % world, p, causal) for r in range(world)]
            ms = [timer(lambda c=c: step(c, K_t, V_t)) for c in calls]
            ring, busy = ring + max(ms), busy + sum(ms) / world
    return ring, busy


def lockstep(N, causal, args, device, dtype, timer, world):
    """One GPU plays every rank. Each rank's compute at each micro-step is timed alone; the
    ranks wait for each other at every micro-step, so the ring takes the sum over micro-steps
    of the slowest rank (the transfers hide behind the compute). Both cuts of zigzag tiles."""
    from flashedu.distributed import pass_plans

    n = N // world
    q, k, v, dout = inputs(n, args, device, dtype)  # one shard's size
    steps = MicroSteps(q, k, v, dout, args.d ** -0.5)
    fplan, bplan = pass_plans(n, world, "zigzag", args.tile, args.forward_tile, args.call_rows)
    result = {}
    cuts = [("pieces", lambda plan: plan)]
    if all(plan.chunk % plan.tile == 0 for plan in (fplan, bplan)):  # runs fit in a chunk
        cuts.append(("runs", runs_plan))
    for name, cut in cuts:
        ring_f, busy_f = lockstep_time(cut(fplan), world, causal, timer, k, v, steps.forward)
        ring_b, busy_b = lockstep_time(cut(bplan), world, causal, timer, k, v, steps.backward)
        result[name] = {"ring_fwd_ms": ring_f, "ring_fwd_bwd_ms": ring_f + ring_b,
                        "mean_rank_fwd_ms": busy_f, "mean_rank_fwd_bwd_ms": busy_f + busy_b,
                        "lockstep_units": cut(bplan).lockstep(causal),
                        "work_units": cut(bplan).work(0, causal), "tile": bplan.tile,
                        "forward_tile": fplan.tile, "micro_steps": bplan.m * world}
    return result


class EchoRing(Ring):
    """flashedu.distributed.Ring on one device, without a process group: rank ``rank`` of
    ``size``, whose receive buffers get a copy of what it sends under the same tag. The values
    are not another rank's, but the shapes, the calls and the buffers' lifetimes are the rank's
    own: its peak memory is what that rank holds in a real ring."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def post_tagged(self, send=(), recv=()):
        sent = {tag: t for t, tag in send}
        for buf, tag in recv:
            buf.copy_(sent[tag])
        return [], [t for t, _ in send]


def whole_rank(N, causal, args, device, dtype, timer, world, accumulate):
    """Each rank's whole forward + backward on one device (:class:`EchoRing`): its time with
    the transfers replaced by local copies, and its peak memory."""
    from flashedu.distributed import RingAttention, _resolve_local, pass_plans

    n = N // world
    plans = pass_plans(n, world, "zigzag", args.tile, args.forward_tile, args.call_rows)

    def one_rank(rank):  # its tensors go when it returns: the next rank's peak starts clean
        q, k, v, dout = inputs(n, args, device, dtype, grad=True)
        local = _resolve_local("auto", q)

        def fn(q, k, v):
            return RingAttention.apply(q, k, v, causal, args.d ** -0.5, EchoRing(rank, world),
                                       local, plans, accumulate)

        fwd_bwd(fn, q, k, v, dout)  # compiles the kernels before the peak is taken
        reset_peak(device)
        fwd_bwd(fn, q, k, v, dout)
        peak = peak_gb(device)
        with torch.no_grad():
            fwd = timer(lambda: fn(q, k, v))
        both = timer(lambda: fwd_bwd(fn, q, k, v, dout))
        return {"rank": rank, "fwd_ms": fwd, "fwd_bwd_ms": both, "peak_GB": peak}

    return [one_rank(rank) for rank in range(world)]


def lockstep_main(args):
    """--lockstep: the model on one device; prints a table and returns the record."""
    device = "cpu" if args.cpu else "cuda:0"
    dtype = DTYPES[args.dtype]
    timer = Timer(not args.cpu, args.warmup, args.reps, barrier=False)
    rows = []
    print(f"{'N':>7} {'causal':>6} {'cut':>6} {'1gpu f+b':>9} {'ring f+b':>9} {'x f+b':>6} "
          f"{'x fwd':>6} {'wait':>5}\n  (ms, one device playing {args.world} ranks; ring = sum "
          f"over micro-steps of the slowest rank's compute; wait = ring / the mean rank)")
    for N in args.n:
        for causal in args.causal:
            single = single_gpu(N, causal, args, device, dtype, timer)
            model = lockstep(N, causal, args, device, dtype, timer, args.world)
            row = {"N": N, "causal": causal, "world": args.world, "H": args.heads, "d": args.d,
                   "dtype": args.dtype, "one_gpu": single, "model": model, "whole_rank": {}}
            for cut, m in model.items():
                print(f"{N:>7} {causal!s:>6} {cut:>6} {single['fwd_bwd_ms']:>9.1f} "
                      f"{m['ring_fwd_bwd_ms']:>9.1f} "
                      f"{single['fwd_bwd_ms'] / m['ring_fwd_bwd_ms']:>6.2f} "
                      f"{single['fwd_ms'] / m['ring_fwd_ms']:>6.2f} "
                      f"{m['ring_fwd_bwd_ms'] / m['mean_rank_fwd_bwd_ms']:>5.2f}", flush=True)
            for mode in args.accumulate:
                ranks = whole_rank(N, causal, args, device, dtype, timer, args.world, mode)
                pred = predicted(N, causal, args, args.world, mode)
                row["whole_rank"][mode] = {"ranks": ranks, "predicted": pred}
                for r in ranks:
                    peak = (f", peak {r['peak_GB']:.3f} GB = {r['peak_GB'] / single['peak_GB']:.3f}"
                            f" of one GPU (formula {pred['per_gpu_GB']:.3f} GB)"
                            if r["peak_GB"] else "")
                    print(f"  rank {r['rank']} whole ({mode}, transfers as local copies): "
                          f"f+b {r['fwd_bwd_ms']:.1f} ms{peak}", flush=True)
            rows.append(row)
    return {"cases": rows}


def check_ring(N, causal, args, device, dtype, rank, world):
    """Max |ring - one device| over the whole output (gathered on every rank)."""
    import flashedu
    from flashedu.distributed import ring_attention, zigzag_shard, zigzag_unshard

    q, k, v, _ = inputs(N, args, device, dtype)
    backend = "triton" if device != "cpu" else "naive"
    with torch.no_grad():
        out = ring_attention(*(zigzag_shard(t, rank, world).contiguous() for t in (q, k, v)),
                             is_causal=causal, tile=args.tile, forward_tile=args.forward_tile,
                             call_rows=args.call_rows)
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out.contiguous())
        ref = flashedu.attention(q, k, v, is_causal=causal, backend=backend)
        return (zigzag_unshard(parts).float() - ref.float()).abs().max().item()


def reset_peak(device):
    if device != "cpu":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device):
    return torch.cuda.max_memory_allocated() / 1e9 if device != "cpu" else None


def slowest(value, device):
    """The largest value over the ranks: a ring step is as slow as its slowest member."""
    t = torch.tensor([value if value is not None else -1.0], dtype=torch.float64,
                     device=device if device != "cpu" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def agree(ok: bool, device) -> bool:
    """True only if every rank succeeded (so no rank enters a ring the others skip)."""
    t = torch.tensor([1.0 if ok else 0.0], device=device if device != "cpu" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def worker(rank, world, port, args, results):
    import datetime as dt

    cpu = args.cpu
    device = "cpu" if cpu else f"cuda:{rank}"
    if not cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=dt.timedelta(seconds=300))
    dtype = DTYPES[args.dtype]
    rows, checks = [], []
    if rank == 0:
        print(HEADER, flush=True)
    try:
        if args.check:
            for causal in args.causal:
                err = check_ring(args.n[0], causal, args, device, dtype, rank, world)
                if rank == 0:
                    checks.append({"N": args.n[0], "causal": causal, "max_abs_err": err})
                    print(f"check N={args.n[0]} causal={causal}: max |ring - one GPU| = {err:.3g}",
                          flush=True)
        for N in args.n:
            for causal in args.causal:
                row = {"N": N, "causal": causal, "world": world, "H": args.heads, "d": args.d,
                       "dtype": args.dtype}
                one_timer = Timer(not cpu, args.warmup, args.reps, barrier=False)
                ring_timer = Timer(not cpu, args.warmup, args.reps, barrier=True)
                # one GPU: rank 0 alone runs the whole sequence while the others wait
                single, ok = {}, True
                if rank == 0:
                    single, ok = run_guarded(single_gpu, N, causal, args, device, dtype, one_timer)
                dist.barrier()
                for mode in args.accumulate:
                    row_m = dict(row, accumulate=mode)
                    sharded, ok = {"error": "a shard does not fit"}, False
                    if agree(fits(N // world, args, device), device):  # all enter, or none
                        sharded, ok = run_guarded(ring, N, causal, args, device, dtype,
                                                  ring_timer, rank, world, mode)
                    if not agree(ok, device):
                        sharded.setdefault("error", "another rank failed")
                    # the same collectives on every rank, whatever happened: fixed keys
                    ring_row = {k: slowest(sharded.get(k), device) for k in RING_KEYS}
                    ring_row = {k: v for k, v in ring_row.items() if v >= 0}
                    if rank == 0:
                        row_m["one_gpu"] = single
                        row_m["ring"] = ring_row | ({"error": sharded["error"]}
                                                    if "error" in sharded else {})
                        row_m["predicted"] = predicted(N, causal, args, world, mode)
                        if ok and "fwd_ms" in single and "fwd_ms" in ring_row:
                            for m in ("fwd_ms", "fwd_bwd_ms"):
                                row_m[f"speedup_{m[:-3]}"] = single[m] / ring_row[m]
                                row_m[f"efficiency_{m[:-3]}"] = single[m] / (world * ring_row[m])
                            if single.get("peak_GB") and ring_row.get("peak_GB"):
                                row_m["peak_ratio"] = ring_row["peak_GB"] / single["peak_GB"]
                        rows.append(row_m)
                        print_row(row_m)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.put({"check": checks, "cases": rows})


def run_guarded(fn, *a):
    """fn(*a), with out-of-memory turned into a recorded error (the rank stays usable)."""
    try:
        return fn(*a), True
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"error": f"out of memory: {str(e).splitlines()[0]}"}, False


def fits(n, args, device) -> bool:
    """A cautious guess that a shard's tensors and the ring's buffers fit: about 16 shard-sized
    tensors (q, k, v, grads, accumulators, two K/V in flight)."""
    if device == "cpu":
        return True
    need = 12 * n * args.heads * args.d * 2
    return need < torch.cuda.mem_get_info()[0]


def predicted(N, causal, args, world, mode):
    """The closed form of flashedu.distributed.ring_memory for this case, in GB."""
    from flashedu.distributed import ring_memory

    m = ring_memory(N, world, args.heads, args.d, DTYPES[args.dtype], is_causal=causal,
                    tile=args.tile, forward_tile=args.forward_tile, call_rows=args.call_rows,
                    accumulate=mode, local="torch" if args.cpu else "triton")
    return {"per_gpu_GB": m["per_gpu"] / 1e9, "one_gpu_GB": m["one_gpu"] / 1e9,
            "tile": m["tile"], "forward_tile": m["forward_tile"], "call_rows": m["call_rows"]}


def print_row(row):
    one, r, pred = row["one_gpu"], row["ring"], row["predicted"]

    def f(d, k, w=8, p=2):
        return f"{d[k]:>{w}.{p}f}" if isinstance(d.get(k), (int, float)) and d[k] >= 0 \
            else f"{'-':>{w}}"

    print(f"{row['N']:>7} {row['causal']!s:>6} {row['accumulate']:>7} "
          f"{f(one, 'fwd_bwd_ms', 9, 1)} {f(r, 'fwd_bwd_ms', 9, 1)} {f(row, 'speedup_fwd_bwd')} "
          f"{f(row, 'speedup_fwd')} {f(one, 'peak_GB')} {f(r, 'peak_GB')} "
          f"{f(pred, 'per_gpu_GB')} {f(row, 'peak_ratio')} {f(r, 'tile_transfer_ms', 8, 3)} "
          f"{f(r, 'step_fwd_ms', 8, 3)} {f(r, 'step_bwd_ms', 8, 3)} "
          f"{one.get('error', '')} {r.get('error', '')}", flush=True)


HEADER = (f"{'N':>7} {'causal':>6} {'acc':>7} {'1gpu f+b':>9} {'ring f+b':>9} {'x f+b':>8} "
          f"{'x fwd':>8} {'1gpu GB':>8} {'ring GB':>8} {'pred GB':>8} {'GB ratio':>8} "
          f"{'xfer ms':>8} {'step fwd':>8} {'step bwd':>8}\n"
          f"  (ms; x = speedup over one GPU; GB = peak per GPU, pred = ring_memory's formula; "
          f"xfer = one K/V tile to the next GPU alone, step = one micro-step's compute alone: "
          f"the transfer hides when step >= xfer)")


def environment(args, world):
    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "world": world,
           "backend": "none" if args.lockstep else "gloo" if args.cpu else "nccl",
           "command": " ".join(sys.argv),
           "NCCL_NVLS_ENABLE": os.environ["NCCL_NVLS_ENABLE"],
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"]}
    env["device"] = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    from flashedu.runtime import git_commit

    env["commit"] = git_commit(short=False)
    return env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[32768, 131072],
                    help="total sequence lengths (divisible by the world size)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--causal", type=lambda s: s == "true", nargs="+", default=[False, True],
                    help="true / false, one or both")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tile", type=int, default=None, help="the backward's K/V tile "
                    "(positions, half from each chunk); default: ring_attention's")
    ap.add_argument("--forward-tile", type=int, default=None, help="the forward's K/V tile; "
                    "default: ring_attention's")
    ap.add_argument("--call-rows", type=int, default=None, help="query rows per kernel call")
    ap.add_argument("--accumulate", nargs="+", default=["float32", "input"],
                    choices=["float32", "input"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU with tiny sizes: checks "
                    "this script (torch math for the local step)")
    ap.add_argument("--lockstep", action="store_true", help="one device plays every rank: each "
                    "rank's micro-steps timed alone, the ring's time modelled as the sum over "
                    "micro-steps of the slowest rank, for zigzag tiles cut as pieces of both "
                    "chunks and as runs of consecutive rows")
    args = ap.parse_args(argv)
    if args.cpu:
        args.n = [n for n in args.n if n <= 512] or [128, 256]
        args.tile = args.tile or 8
        args.heads, args.d, args.dtype = 2, 16, "fp32"
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_ring.py needs CUDA GPUs (or --cpu for a gloo check of the script)")
        if torch.cuda.device_count() < args.world and not args.lockstep:
            sys.exit(f"gpu_ring.py needs {args.world} GPUs, this machine has "
                     f"{torch.cuda.device_count()}")
    bad = [n for n in args.n if n % (2 * args.world)]
    if bad:
        sys.exit(f"--n values must be multiples of 2 x the world size {2 * args.world} (the "
                 f"zigzag layout's chunks): {bad}")
    out = {"environment": environment(args, args.world)}
    print(json.dumps(out["environment"]), flush=True)
    if args.lockstep:
        out.update(lockstep_main(args))
    else:
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        mp.spawn(worker, args=(args.world, free_port(), args, results), nprocs=args.world,
                 join=True)
        out.update(results.get())
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    errors = [c for c in out["cases"] if "error" in c.get("ring", {}) or "error" in c.get("one_gpu", {})]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
