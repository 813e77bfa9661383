"""Ring attention: one sequence spread over several processes (GPUs), exact, with autograd.

Each of the P ranks of a ``torch.distributed`` group holds a contiguous shard of the sequence:
rank r has queries, keys and values of positions [r*n, (r+1)*n), shapes (B, H, n, d). Its output
rows need every key, so the K/V shards travel around the ring: at step t rank r holds the shard
of rank (r - t) mod P, computes a partial (O, L) of its queries against it, and merges that into
its running result with the merge rule (``flashedu.merge``). Meanwhile the next shard is already
on its way (isend to r+1, irecv from r-1), so the transfer hides behind the compute.
After P steps every query has met every key; no rank ever holds more than two K/V shards.

Backward: the saved logsumexp L and output O of the *whole* row make each K/V shard's gradient
independent of the others (P_ij = exp(S_ij - L_i), D_i = rowsum(dO_i * O_i), as in the
FlashAttention backward). So the K/V shards go around the ring once more, each with its dK, dV
accumulators: every rank adds its queries' contribution, passes them on, and after P steps the
accumulators are back home, complete.

Causal: rank r's queries never see keys of ranks > r, so those steps compute nothing (they still
pass the shard along: the ring stays simple). The step with its own shard is causal inside.
Rank P-1 does the most work (P steps); zigzag sharding would balance that, but the shards here
are contiguous as the caller gives them.

The local step (one shard of queries against one shard of keys) is two functions,
:func:`block_forward` and :func:`block_backward`: torch math (the naive attention, recomputed
from L) anywhere, or the package's Triton kernels on a CUDA GPU.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .merge import merge
from .reference import expand_kv_heads, naive_attention_torch

LOCAL_KINDS = ("auto", "torch", "triton")


def ring_attention(q, k, v, is_causal=False, group=None, scale=None, local="auto"):
    """This rank's output shard of attention over the whole (sharded) sequence.

    q: (B, H, n, d), k, v: (B, Hkv, n, d), every rank the same shapes (rank r holds positions
    [r*n, (r+1)*n)). H may be a multiple of Hkv (grouped-query attention). ``is_causal``: top-left
    over the whole sequence (global query i sees global keys j <= i). ``group``: the process
    group (default: the world). ``local``: the per-step kernel, "torch", "triton" (CUDA only),
    or "auto" (triton on a CUDA GPU, else torch). Differentiable with respect to q, k, v.
    """
    _check(q, k, v, is_causal, scale, local)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed: call "
                           "torch.distributed.init_process_group first (gloo on CPU, nccl on GPU)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    local = _resolve_local(local, q)
    return RingAttention.apply(q, k, v, is_causal, scale, group, local)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, group, local):
        ring = Ring(group)
        out, L = ring_forward(ring, q, k, v, is_causal, scale, local)
        ctx.save_for_backward(q, k, v, out, L)
        ctx.params = (ring, is_causal, scale, local)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, L = ctx.saved_tensors
        ring, is_causal, scale, local = ctx.params
        dq, dk, dv = ring_backward(ring, q, k, v, out, L, dout.contiguous(), is_causal, scale,
                                   local)
        return dq, dk, dv, None, None, None, None


# ----------------------------------------------------------------------------------------
# The ring: who sends to whom, and the overlapped exchange.
# ----------------------------------------------------------------------------------------


class Ring:
    """Rank r of P sends to r+1 and receives from r-1 (mod P), within ``group``."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # P2POp takes global ranks
        glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = glob((self.rank + 1) % self.size)
        self.prev = glob((self.rank - 1) % self.size)

    def source(self, t: int) -> int:
        """Whose K/V shard this rank holds at step t."""
        return (self.rank - t) % self.size

    def start_exchange(self, tensors, tag: int = 0):
        """Send ``tensors`` to the next rank and receive the same shapes from the previous one.
        Returns (requests, received): wait on the requests before reading ``received``."""
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for i, (t, r) in enumerate(zip(tensors, received)):
            ops.append(dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + i))
        # keep the ops (and so the buffers being sent) alive until the requests are waited on
        return (dist.batch_isend_irecv(ops), ops), received


def wait_all(requests):
    works, _ops = requests
    for work in works:
        work.wait()


def visible(is_causal: bool, src: int, rank: int) -> tuple[bool, bool]:
    """(does rank's shard of queries see any key of shard src, is that block causal inside)."""
    if not is_causal:
        return True, False
    return src <= rank, src == rank


# ----------------------------------------------------------------------------------------
# Forward and backward around the ring.
# ----------------------------------------------------------------------------------------


def ring_forward(ring: Ring, q, k, v, is_causal, scale, local):
    """(out, L): this rank's output shard (q's dtype) and its logsumexp (float32 or float64)."""
    acc = accumulate_dtype(q.dtype)
    O = torch.zeros(q.shape, dtype=acc, device=q.device)
    L = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    K_j, V_j = k.contiguous(), v.contiguous()
    for t in range(ring.size):
        last = t == ring.size - 1
        if not last:  # start moving the shard we hold now; compute on it meanwhile
            requests, (K_next, V_next) = ring.start_exchange((K_j, V_j), tag=0)
        sees, diagonal = visible(is_causal, ring.source(t), ring.rank)
        if sees:
            O_t, L_t = block_forward(q, K_j, V_j, causal=diagonal, scale=scale, local=local)
            O, L = merge(O, L, O_t.to(acc), L_t.to(acc))
        if not last:
            wait_all(requests)
            K_j, V_j = K_next, V_next
    return O.to(q.dtype), L


def ring_backward(ring: Ring, q, k, v, out, L, dout, is_causal, scale, local):
    """(dq, dk, dv) of this rank's shards. The dK, dV accumulators ride along with K/V."""
    acc = accumulate_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    K_j, V_j = k.contiguous(), v.contiguous()
    grad_requests = grads = None  # the dK, dV exchange in flight (none before step 0)
    for t in range(ring.size):
        last = t == ring.size - 1
        if not last:
            kv_requests, (K_next, V_next) = ring.start_exchange((K_j, V_j), tag=0)
        sees, diagonal = visible(is_causal, ring.source(t), ring.rank)
        if sees:
            dq_t, dk_t, dv_t = block_backward(q, K_j, V_j, out, L, dout, causal=diagonal,
                                              scale=scale, local=local)
            dq += dq_t.to(acc)
        # the accumulators of the shard we hold: from the previous rank (or fresh at step 0)
        if grad_requests is None:
            dK_j = torch.zeros(k.shape, dtype=acc, device=k.device)
            dV_j = torch.zeros(v.shape, dtype=acc, device=v.device)
        else:
            wait_all(grad_requests)
            dK_j, dV_j = grads
        if sees:
            dK_j += dk_t.to(acc)
            dV_j += dv_t.to(acc)
        # pass them on: rank r+1 holds this shard next; after the last step r+1 is its owner
        grad_requests, grads = ring.start_exchange((dK_j, dV_j), tag=2)
        if not last:
            wait_all(kv_requests)
            K_j, V_j = K_next, V_next
    wait_all(grad_requests)
    dK, dV = grads  # our own shard's gradients, home after a full turn
    return dq.to(q.dtype), dK.to(k.dtype), dV.to(v.dtype)


# ----------------------------------------------------------------------------------------
# The same ring in one process: P ranks as P threads (for the notebook and quick tests).
# ----------------------------------------------------------------------------------------


class ThreadRing:
    """A stand-in for :class:`Ring` whose ranks are threads and whose wires are queues.

    ring_forward and ring_backward run on it unchanged: only the transport differs from
    torch.distributed's (a send puts a copy in the next rank's mailbox, wait() takes it out).
    """

    def __init__(self, rank: int, size: int, mailboxes):
        self.rank, self.size, self.mailboxes = rank, size, mailboxes

    source = Ring.source

    def start_exchange(self, tensors, tag: int = 0):
        self.mailboxes[(self.rank + 1) % self.size][tag].put([t.clone() for t in tensors])
        received = [torch.empty_like(t) for t in tensors]
        return ([_MailboxReceive(self.mailboxes[self.rank][tag], received)], None), received


class _MailboxReceive:
    def __init__(self, box, received):
        self.box, self.received = box, received

    def wait(self):
        for buf, t in zip(self.received, self.box.get(timeout=60)):
            buf.copy_(t)


def simulate_ring(q, k, v, world, is_causal=False, scale=None, dout=None, local="torch"):
    """Ring attention over the full (B, H, N, d) q, k, v with ``world`` thread-ranks.

    Shards the sequence, runs ring_forward (and ring_backward when ``dout`` is given) on every
    rank, and concatenates the shards: returns out, or (out, dq, dk, dv).
    """
    import queue
    import threading

    N = q.shape[2]
    if N % world:
        raise ValueError(f"q: the sequence length N={N} must be a multiple of world={world}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    n = N // world
    mailboxes = [{tag: queue.Queue() for tag in (0, 1, 2, 3)} for _ in range(world)]
    results, errors = [None] * world, []

    def rank_main(r):
        try:
            ring = ThreadRing(r, world, mailboxes)
            q_r, k_r, v_r = (t[:, :, r * n:(r + 1) * n].contiguous() for t in (q, k, v))
            out, L = ring_forward(ring, q_r, k_r, v_r, is_causal, scale, local)
            grads = () if dout is None else ring_backward(
                ring, q_r, k_r, v_r, out, L, dout[:, :, r * n:(r + 1) * n].contiguous(),
                is_causal, scale, local)
            results[r] = (out, *grads)
        except Exception as e:  # noqa: BLE001  (re-raised below, in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    joined = [torch.cat(parts, dim=2) for parts in zip(*results)]
    return joined[0] if dout is None else tuple(joined)


# ----------------------------------------------------------------------------------------
# The local step: one shard of queries against one shard of keys. Swap in a faster kernel here.
# ----------------------------------------------------------------------------------------


def block_forward(q, k, v, *, causal, scale, local="torch"):
    """(O, L) of q against this K/V block alone: O normalized, L the natural-log logsumexp
    (-inf for a row that sees no key of the block, O = 0 there), as flashedu.merge expects."""
    if local == "triton":
        from .triton import forward_with_lse

        return forward_with_lse(q, k, v, is_causal=causal, scale=scale)
    acc = accumulate_dtype(q.dtype)
    return naive_attention_torch(q.to(acc), k.to(acc), v.to(acc), is_causal=causal, scale=scale,
                                 return_lse=True)


def block_backward(q, k, v, out, L, dout, *, causal, scale, local="torch"):
    """This K/V block's share of the gradients, recomputed from the whole row's O and L.

    P_ij = exp(S_ij - L_i) is the block's slice of the *global* softmax, so the paper's backward
    applies block by block: dV_j = P^T dO, dP = dO V_j^T, dS = P * (dP - D), D_i = rowsum(dO_i O_i),
    dQ = scale dS K_j, dK_j = scale dS^T Q. Returns (dq, dk, dv); dk, dv summed over GQA groups.
    """
    if local == "triton":
        return _block_backward_triton(q, k, v, out, L, dout, causal, scale)
    acc = accumulate_dtype(q.dtype)
    q, k, v, out, dout, L = (t.to(acc) for t in (q, k, v, out, dout, L))
    H, Hkv = q.shape[1], k.shape[1]
    K, V = expand_kv_heads(k, H), expand_kv_heads(v, H)
    S = scale * (q @ K.transpose(-1, -2))
    if causal:
        n_q, n_k = S.shape[-2:]
        S = S.masked_fill(~torch.ones(n_q, n_k, dtype=torch.bool, device=S.device).tril(),
                          float("-inf"))
    # a row that sees no key anywhere has L = -inf; L = +inf there makes its P zero, not NaN
    P = torch.exp(S - torch.where(torch.isneginf(L), float("inf"), L).unsqueeze(-1))
    D = (dout * out).sum(-1, keepdim=True)
    dV = P.transpose(-1, -2) @ dout
    dS = P * (dout @ V.transpose(-1, -2) - D)
    dQ = scale * dS @ K
    dK = scale * dS.transpose(-1, -2) @ q
    if Hkv != H:  # each K/V head served H // Hkv query heads: add up their gradients
        dK = dK.unflatten(1, (Hkv, H // Hkv)).sum(2)
        dV = dV.unflatten(1, (Hkv, H // Hkv)).sum(2)
    return dQ, dK, dV


def _block_backward_triton(q, k, v, out, L, dout, causal, scale):
    from . import runtime
    from .triton.autograd import resolve_config
    from .triton.backward import backward
    from .triton.forward import LOG2E

    # the Triton backward takes the base-2 logsumexp, +inf for a row that sees no key
    lse2 = torch.where(torch.isneginf(L), float("inf"), L.float() * LOG2E).contiguous()
    config = resolve_config(q.shape[-1], q.dtype, None)
    return backward(q.contiguous(), k, v, out.contiguous(), lse2, dout, is_causal=causal,
                    scale=scale, block_mask=None, config=config,
                    interpreted=runtime.triton_interpreted())


def accumulate_dtype(dtype):
    """Running results in float32 for 16-bit inputs (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _resolve_local(local, q):
    if local == "auto":
        from . import runtime

        return "triton" if q.is_cuda and not runtime.triton_interpreted() \
            and q.dtype != torch.float64 else "torch"
    return local


def _check(q, k, v, is_causal, scale, local):
    from .api import _check_scale, _check_tensors

    _check_tensors(q, k, v, enable_gqa=True)
    _check_scale(scale, q.shape[-1])
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must hold the same shard of the sequence (n positions each), "
                         f"got n={q.shape[2]} for q and {k.shape[2]} for k")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if local not in LOCAL_KINDS:
        raise ValueError(f"local must be one of {LOCAL_KINDS}, got {local!r}")
