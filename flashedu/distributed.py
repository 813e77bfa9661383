"""Ring attention: one sequence spread over several processes (GPUs), exact, with autograd.

Each of the P ranks of a ``torch.distributed`` group holds a shard of n = N/P positions of the
sequence: its queries, keys and values, shapes (B, H, n, d). Its output rows need every key, so
the keys and values travel around the ring (isend to r+1, irecv from r-1) and every rank merges
the partial (O, L) of its queries against each visiting block into its running result with the
merge rule of ``flashedu.merge``. The next block is posted before the current one is computed,
so the transfer hides behind the compute. With the Triton kernels the merge is done by the kernel
itself: it starts its online softmax from the running (O, L) (:func:`block_forward_into`).

Layouts (``layout=``, the same for causal and full attention):

- ``"zigzag"`` (default): the sequence is cut into 2P chunks of c = N/(2P) positions and rank r
  holds chunks r and 2P-1-r (one early, one late). With a causal mask every rank then computes
  the same number of tiles (each key chunk is seen by as many early as late queries); with
  contiguous shards rank P-1 computes P blocks and rank 0 one. :func:`zigzag_shard` and
  :func:`zigzag_unshard` move a whole sequence in and out of this order.
- ``"contiguous"``: rank r holds positions [r*n, (r+1)*n) (balanced only without a mask).
For full (non-causal) attention the layout changes nothing in the arithmetic: every query sees
every key, whatever the order.

Memory. What travels is not a rank's whole K/V shard but **tiles** of ``tile`` positions: the
ring runs P*m micro-steps (m = n/tile), tile p of every shard going once around before tile p+1
starts. A rank holds at most two K/V tiles (the one it computes on and sends on, and the one
arriving), so the ring's own buffers shrink with the tile, not with the shard. A zigzag tile is
two pieces, the same rows of both of the shard's chunks: the ranks wait for each other at every
micro-step, so each micro-step, not only each rank's total, must carry the same causal work
(:meth:`Plan.lockstep`). The forward keeps one float32 (O, L) accumulator for its own rows and
saves only its own O and L for the backward. The backward sends each K/V tile around once more
with its dK, dV accumulator (tile-sized): every rank adds its queries' share and passes it on;
after P hops the accumulator is home, complete. dQ is accumulated in place; the Triton kernels
add their gradients straight into these buffers (:func:`block_backward_into`). The backward's
tile sets the memory (three pairs of tile-sized accumulators besides the K/V tiles); the
forward holds only K/V tiles, so it takes larger ones (``forward_tile``), whose longer kernel
calls run faster. :func:`ring_memory` gives the bytes in a closed form, and the tests check it
against what the ring really holds.

Backward: the saved logsumexp L and output O of the *whole* row make each K/V tile's gradient
independent of the others (P_ij = exp(S_ij - L_i), D_i = rowsum(dO_i * O_i), as in the
FlashAttention backward), which is why the tiles may travel in any order.

The local step (some query rows against one K/V tile) is two functions, :func:`block_forward`
and :func:`block_backward`: torch math anywhere, or the package's Triton kernels on a CUDA GPU.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist

from .merge import merge_into
from .reference import expand_kv_heads, naive_attention_torch

LOCAL_KINDS = ("auto", "torch", "triton")
LAYOUTS = ("zigzag", "contiguous")
ACCUMULATE = ("float32", "input")
DEFAULT_TILES = 8  # tiles per shard by default: the ring's buffers a fixed share of the shard's
FORWARD_TILE = 4  # the forward's default tile, in backward tiles (it holds no gradients)


def ring_attention(q, k, v, is_causal=False, group=None, scale=None, local="auto", *,
                   layout="zigzag", tile=None, forward_tile=None, call_rows=None,
                   accumulate="float32"):
    """This rank's output shard of attention over the whole (sharded) sequence.

    q: (B, H, n, d), k, v: (B, Hkv, n, d), every rank the same shapes, holding the positions that
    ``layout`` gives it (``zigzag_shard(x, rank, P)`` for "zigzag", the default; positions
    [r*n, (r+1)*n) for "contiguous"). H may be a multiple of Hkv (grouped-query attention).
    ``is_causal``: top-left over the whole sequence (global query i sees global keys j <= i).
    ``group``: the process group (default: the world); P is its size. ``local``: the per-step
    kernel, "torch", "triton" (CUDA only) or "auto" (triton on a CUDA GPU, else torch).
    ``tile``: positions per travelling K/V tile in the backward: for zigzag an even number whose
    half (a piece of each chunk) divides the chunk length n/2, for contiguous a divisor of n;
    default: the largest such number <= n/8. It sets the ring's memory (:func:`ring_memory`).
    ``forward_tile``: the same for the forward; default: the largest valid tile <= 4 x ``tile``
    (the forward holds no gradient accumulators, so larger tiles, which run faster, cost it less).
    ``call_rows``: query rows per kernel call (default 4 tiles; rounded up to a multiple of each
    pass's tile): bounds the per-call temporaries.
    ``accumulate``: where the sums over ranks live. "float32" (default): dQ's P*m contributions
    and each tile's dK, dV accumulator on its way around the ring in float32. "input": dQ summed
    in place in q's dtype (no float32 copy of dQ) and the accumulators sent in k's dtype, each
    rank adding its float32 share to the one it receives and rounding once before sending it
    on: less memory and half the accumulator bytes on the wire, more rounding in 16 bits.
    Differentiable with respect to q, k, v.
    """
    _check(q, k, v, is_causal, scale, local, layout, accumulate)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed: call "
                           "torch.distributed.init_process_group first (gloo on CPU, nccl on GPU)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    local = _resolve_local(local, q)
    ring = Ring(group)
    plans = pass_plans(q.shape[2], ring.size, layout, tile, forward_tile, call_rows)
    return RingAttention.apply(q, k, v, is_causal, scale, ring, local, plans, accumulate)


def pass_plans(n, world, layout="zigzag", tile=None, forward_tile=None, call_rows=None):
    """(forward plan, backward plan) for :func:`ring_attention`'s arguments."""
    backward = Plan(n, world, layout, tile, call_rows)
    if forward_tile is None:
        forward_tile = backward.largest_tile(FORWARD_TILE * backward.tile)
    rows = call_rows
    if rows is not None and isinstance(forward_tile, int) and forward_tile > 0:
        rows = -(-rows // forward_tile) * forward_tile  # up to a multiple of the forward tile
    return Plan(n, world, layout, forward_tile, rows, name="forward_tile"), backward


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, ring, local, plans, accumulate):
        out, L = ring_forward(ring, q, k, v, is_causal, scale, local, plans[0])
        ctx.save_for_backward(q, k, v, out, L)  # this rank's rows only: O and L of n positions
        ctx.params = (ring, is_causal, scale, local, plans[1], accumulate)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, L = ctx.saved_tensors
        ring, is_causal, scale, local, plan, accumulate = ctx.params
        dq, dk, dv = ring_backward(ring, q, k, v, out, L, dout.contiguous(), is_causal, scale,
                                   local, plan, accumulate=accumulate)
        return dq, dk, dv, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------
# Layouts: which global positions a rank holds.
# ----------------------------------------------------------------------------------------


def zigzag_chunks(rank: int, world: int) -> tuple[int, int]:
    """The two chunks (of 2*world) that rank holds in the zigzag layout: one early, one late."""
    return rank, 2 * world - 1 - rank


def _check_divisible(N, world, dim):
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if N % (2 * world):
        raise ValueError(
            f"x: the zigzag layout cuts the sequence (dim {dim}, length {N}) into 2*world = "
            f"{2 * world} equal chunks; {N} is not a multiple of {2 * world}. Pad it first with "
            f"pad_sequence(x, {2 * world}, dim={dim}): with is_causal=True padding at the end is "
            f"exact (no real query sees a later position; drop the padded rows afterwards). "
            f"Without a mask padded keys would be attended to, so pad only causal attention.")


def zigzag_shard(x, rank: int, world: int, dim: int = 2):
    """Rank's shard of a whole sequence in the zigzag order: chunks ``rank`` and
    ``2*world-1-rank`` of ``x`` (cut into 2*world equal chunks along ``dim``), concatenated.
    Raises ValueError when the length is not a multiple of 2*world (see :func:`pad_sequence`)."""
    N = x.shape[dim]
    _check_divisible(N, world, dim)
    c = N // (2 * world)
    a, b = zigzag_chunks(rank, world)
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim=dim)


def zigzag_unshard(shards, dim: int = 2):
    """The whole sequence from every rank's zigzag shard (rank order): the inverse of
    :func:`zigzag_shard`."""
    world = len(shards)
    n = shards[0].shape[dim]
    if n % 2 or any(s.shape[dim] != n for s in shards):
        raise ValueError(f"shards: every zigzag shard holds two chunks of equal length along dim "
                         f"{dim}; got lengths {[s.shape[dim] for s in shards]}")
    c = n // 2
    chunks = [None] * (2 * world)
    for r, s in enumerate(shards):
        a, b = zigzag_chunks(r, world)
        chunks[a], chunks[b] = s.narrow(dim, 0, c), s.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)


def shard(x, rank: int, world: int, layout: str = "zigzag", dim: int = 2):
    """Rank's shard of the whole sequence ``x`` in ``layout`` ("zigzag" or "contiguous")."""
    if layout == "zigzag":
        return zigzag_shard(x, rank, world, dim)
    N = x.shape[dim]
    if N % world:
        raise ValueError(f"x: length {N} along dim {dim} is not a multiple of world={world}")
    return x.narrow(dim, rank * (N // world), N // world)


def unshard(shards, layout: str = "zigzag", dim: int = 2):
    """The whole sequence from every rank's shard: the inverse of :func:`shard`."""
    return zigzag_unshard(shards, dim) if layout == "zigzag" else torch.cat(list(shards), dim)


def pad_sequence(x, multiple: int, dim: int = 2):
    """``x`` with zeros appended along ``dim`` up to a multiple of ``multiple`` (e.g. 2*world for
    the zigzag layout). Exact for causal attention only: a padded key sits after every real
    query, so no real query sees it; the padded query rows are garbage-free (they see real keys)
    but are not part of the answer: drop them after unsharding."""
    N = x.shape[dim]
    extra = -N % multiple
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def shard_positions(N: int, rank: int, world: int, layout: str = "zigzag"):
    """The global positions (LongTensor of n) that rank's rows hold, in local order."""
    return shard(torch.arange(N), rank, world, layout, dim=0)


class Plan:
    """How a rank's n rows are cut: the tiles that travel, and the kernel calls against them.

    A tile is ``tile`` positions of K/V that travel together. In the contiguous layout it is a
    run of consecutive rows. In the zigzag layout it is two **pieces** of tile/2 rows, one from
    each of the shard's chunks (the same rows of each): then every micro-step, not only the
    whole ring, gives every rank the same causal work. The ranks wait for each other at every
    micro-step (the next tile arrives from the previous rank), so the ring takes the sum over
    micro-steps of the busiest rank's work (:meth:`lockstep`); with tiles cut from one chunk
    that sum is 1.25x the average at P=2 although each rank's total is the same.

    Every rank has the same local structure; only the global positions differ. A rank's local
    order is the global order, so the query rows that see a piece whole are a suffix.
    """

    def __init__(self, n: int, world: int, layout: str = "zigzag", tile=None, call_rows=None,
                 name: str = "tile"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.n, self.world, self.layout = n, world, layout
        if layout == "zigzag" and n % 2:
            raise ValueError(f"q: a zigzag shard holds two chunks of equal length, so its length "
                             f"n must be even, got n={n} (shard the sequence with zigzag_shard)")
        self.chunk = n // 2 if layout == "zigzag" else n
        self.pieces = 2 if layout == "zigzag" else 1  # pieces per tile: one per chunk
        if tile is None:
            tile = self.largest_tile(n // DEFAULT_TILES)
        if not isinstance(tile, int) or tile < 1 or tile % self.pieces \
                or self.chunk % (tile // self.pieces):
            what = ("an even number whose half divides the chunk length" if self.pieces == 2
                    else "a positive divisor of the shard length")
            raise ValueError(f"{name} must be {what} {self.chunk} (n={n}, layout={layout!r}: a "
                             f"tile holds {self.pieces} piece(s), one per chunk), got {tile!r}")
        self.tile = tile
        self.piece = tile // self.pieces  # rows of one piece, and of one query segment
        self.m = n // tile  # tiles per shard
        call_rows = 4 * tile if call_rows is None else call_rows
        if not isinstance(call_rows, int) or call_rows < tile or call_rows % tile:
            raise ValueError(f"call_rows must be a positive multiple of {name}={tile}, "
                             f"got {call_rows!r}")
        self.call_rows = min(call_rows, n)

    def largest_tile(self, limit: int) -> int:
        """The largest valid tile of at most ``limit`` positions (at least one row per piece)."""
        piece = max(t for t in range(1, max(1, min(self.chunk, limit // self.pieces)) + 1)
                    if self.chunk % t == 0)
        return piece * self.pieces

    def tile_rows(self, p: int) -> list[tuple[int, int]]:
        """The local rows [start, end) of tile p's pieces, in the order the tile holds them."""
        return [(c * self.chunk + p * self.piece, c * self.chunk + (p + 1) * self.piece)
                for c in range(self.pieces)]

    def global_row(self, rank: int, a: int) -> int:
        """Global position of local row a of rank's shard."""
        if self.layout == "contiguous":
            return rank * self.n + a
        chunk = zigzag_chunks(rank, self.world)[a // self.chunk]
        return chunk * self.chunk + a % self.chunk

    def calls(self, rank: int, src: int, p: int, is_causal: bool):
        """The kernel calls of rank's queries against tile p of shard ``src``:
        [(first row, end row, first key, end key, causal inside)]; rows are local rows of
        rank's shard, keys rows of the tile; at most ``call_rows`` rows each."""
        segments = range(self.n // self.piece)  # query rows, a piece's length at a time
        if not is_causal:
            return [(a, b, 0, self.tile, False) for a, b in self._grouped(list(segments))]
        starts = [self.global_row(src, a) for a, _ in self.tile_rows(p)]  # increasing
        out, seeing = [], {}  # seeing: f -> the segments that see the tile's first f pieces whole
        for i in segments:
            g = self.global_row(rank, i * self.piece)
            for c, k0 in enumerate(starts):
                if k0 == g:  # the same positions: causal inside
                    out.append((i * self.piece, (i + 1) * self.piece, c * self.piece,
                                (c + 1) * self.piece, True))
            whole = sum(k0 < g for k0 in starts)
            if whole:
                seeing.setdefault(whole, []).append(i)
        for whole, group in seeing.items():  # each group is consecutive rows
            out += [(a, b, 0, whole * self.piece, False) for a, b in self._grouped(group)]
        return out

    def _grouped(self, segments):
        """Consecutive query segments as [start, end) row runs of at most call_rows rows."""
        per_call = self.call_rows // self.piece
        runs = [segments[j:j + per_call] for j in range(0, len(segments), per_call)]
        return [(run[0] * self.piece, (run[-1] + 1) * self.piece) for run in runs]

    def step_work(self, rank: int, src: int, p: int, is_causal: bool) -> float:
        """Query-key pairs of rank's calls against tile p of shard src, in units of tile^2 (a
        causal piece counts half its rows x keys)."""
        return sum((b - a) * (hi - lo) * (0.5 if causal else 1.0)
                   for a, b, lo, hi, causal in self.calls(rank, src, p, is_causal)) / self.tile**2

    def work(self, rank: int, is_causal: bool) -> float:
        """rank's pairs over the whole ring (:meth:`step_work` summed): the load-balance measure."""
        return sum(self.step_work(rank, src, p, is_causal)
                   for p in range(self.m) for src in range(self.world))

    def lockstep(self, is_causal: bool) -> float:
        """The ring's time in units of tile^2 pairs, the ranks waiting for each other at every
        micro-step: the sum over micro-steps (p, t) of the busiest rank's work."""
        return sum(max(self.step_work(r, (r - t) % self.world, p, is_causal)
                       for r in range(self.world))
                   for p in range(self.m) for t in range(self.world))


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
        """Whose K/V this rank holds at ring step t."""
        return (self.rank - t) % self.size

    def post(self, send=(), recv=(), tag: int = 0):
        """Start sending the tensors ``send`` to the next rank and receiving into the buffers
        ``recv`` from the previous one; the i-th tensor of each travels with tag ``tag + i``.
        Returns a handle: :func:`wait_all` on it before reading ``recv`` or reusing ``send``."""
        return self.post_tagged([(t, tag + i) for i, t in enumerate(send)],
                                [(t, tag + i) for i, t in enumerate(recv)])

    def post_tagged(self, send=(), recv=()):
        """:meth:`post` with a tag for each tensor: ``send`` and ``recv`` are [(tensor, tag)].

        One call is one group of NCCL operations, whose sends and receives progress together.
        Every rank posts the same pattern in the same order (NCCL matches a pair's operations
        by order, gloo by tag). Transfers that must overlap belong in one call: separate calls
        run one after the other on the NCCL stream of a pair of ranks, and two ranks that each
        send a large tensor ahead of the receive the other is waiting for both stall once the
        tensors outgrow NCCL's buffers."""
        ops = [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t, tag in recv]
        ops += [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t, tag in send]
        # keep the ops (and so the tensors) alive until the requests are waited on
        return (dist.batch_isend_irecv(ops) if ops else [], ops)

    def start_exchange(self, tensors, tag: int = 0):
        """Send ``tensors`` to the next rank and receive the same shapes from the previous one.
        Returns (handle, received)."""
        received = [torch.empty_like(t) for t in tensors]
        return self.post([t.contiguous() for t in tensors], received, tag), received


def wait_all(requests):
    works, _ops = requests
    for work in works:
        work.wait()


def visible(is_causal: bool, src: int, rank: int) -> tuple[bool, bool]:
    """Contiguous layout, whole shards: (does rank's shard of queries see any key of shard src,
    is that block causal inside)."""
    if not is_causal:
        return True, False
    return src <= rank, src == rank


KV_TAG, ACC_TAG = 0, 2  # tags of the K/V tiles (0, 1) and of their dK, dV accumulators (2, 3)


class Ledger:
    """Bytes of the tensors the ring holds, live and at their peak (for the memory formula).

    ``take(kind, t)`` counts t until the tensor object dies (a weak reference sees it go), so
    holding a buffer longer than needed shows up in the peak."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.peak_by_kind: dict = {}
        self._by_kind: dict = {}

    def take(self, kind: str, t):
        nbytes = t.numel() * t.element_size()
        self.live += nbytes
        self._by_kind[kind] = self._by_kind.get(kind, 0) + nbytes
        if self.live > self.peak:
            self.peak = self.live
            self.peak_by_kind = dict(self._by_kind)
        weakref.finalize(t, self._release, kind, nbytes)
        return t

    def _release(self, kind, nbytes):
        self.live -= nbytes
        self._by_kind[kind] -= nbytes


class _NoLedger:
    @staticmethod
    def take(kind, t):
        return t


# ----------------------------------------------------------------------------------------
# Forward and backward around the ring, tile by tile.
# ----------------------------------------------------------------------------------------


def _schedule(plan, ring):
    """The micro-steps in order: (tile p, ring step t). Tile p of every shard goes once around
    (t = 0..P-1: rank r holds tile p of shard r - t) before tile p+1 starts."""
    return [(p, t) for p in range(plan.m) for t in range(ring.size)]


def _own_tile(x, plan, p, ledger=_NoLedger):
    """Tile p of this rank's K or V, its pieces side by side (a copy: it travels)."""
    return ledger.take("kv", torch.cat([x[:, :, a:b] for a, b in plan.tile_rows(p)], dim=2))


def _home(dst, plan, p, tile):
    """A finished tile's gradient into its pieces' rows of this rank's dK or dV."""
    for c, (a, b) in enumerate(plan.tile_rows(p)):
        dst[:, :, a:b] = tile[:, :, c * plan.piece:(c + 1) * plan.piece]


def ring_forward(ring, q, k, v, is_causal, scale, local, plan=None, ledger=None):
    """(out, L): this rank's output shard (q's dtype) and its logsumexp (float32 or float64)."""
    plan = plan or Plan(q.shape[2], ring.size, "contiguous", q.shape[2])
    ledger = ledger or _NoLedger
    acc = accumulate_dtype(q.dtype)
    q = q.contiguous()  # O's strides, which the Triton kernel writes O with
    O = ledger.take("acc", torch.zeros(q.shape, dtype=acc, device=q.device))
    L = ledger.take("acc", torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device))
    steps = _schedule(plan, ring)
    K_j = V_j = None
    for i, (p, t) in enumerate(steps):
        if t == 0:  # a new tile starts its round at home
            K_j, V_j = _own_tile(k, plan, p, ledger), _own_tile(v, plan, p, ledger)
        passing = t < ring.size - 1  # the next rank needs this tile at its next micro-step
        if passing:  # start moving the tile we hold; compute on it meanwhile
            K_next = ledger.take("kv", torch.empty_like(K_j))
            V_next = ledger.take("kv", torch.empty_like(V_j))
            requests = ring.post((K_j, V_j), (K_next, V_next), tag=KV_TAG)
        for a, b, lo, hi, causal in plan.calls(ring.rank, ring.source(t), p, is_causal):
            block_forward_into(q[:, :, a:b], K_j[:, :, lo:hi], V_j[:, :, lo:hi], O[:, :, a:b],
                               L[:, :, a:b], causal=causal, scale=scale, local=local,
                               ledger=ledger)
        if passing:
            wait_all(requests)
            del requests
            K_j, V_j = K_next, V_next
            del K_next, V_next
        else:
            K_j = V_j = None
    out = O.to(q.dtype)
    return out, L


def ring_backward(ring, q, k, v, out, L, dout, is_causal, scale, local, plan=None, ledger=None,
                  accumulate="float32"):
    """(dq, dk, dv) of this rank's shards.

    At micro-step (p, t) rank r holds K/V tile p of shard s = r - t. It computes its queries'
    share of that tile's dK, dV into a float32 ``partial`` (and adds its dQ share in place),
    then takes the tile's accumulator from the previous rank (sent while it computed), adds the
    partial and sends it on. After P hops the accumulator reaches s again, complete. Every
    micro-step therefore receives the accumulator its predecessor finished one micro-step
    earlier: the one of the tile it now holds, or (after a tile's last hop) its own finished one.
    ``accumulate="input"`` sends the accumulators in k's dtype (the share stays float32 until
    it is added) and sums dQ in q's dtype.
    """
    plan = plan or Plan(q.shape[2], ring.size, "contiguous", q.shape[2])
    ledger = ledger or _NoLedger
    acc = accumulate_dtype(q.dtype)
    dq_dtype = acc if accumulate == "float32" else q.dtype
    travel = acc if accumulate == "float32" else k.dtype  # the accumulators' dtype in transit
    dq = torch.zeros(q.shape, dtype=dq_dtype, device=q.device)
    if dq_dtype != q.dtype:
        ledger.take("acc", dq)
    dk, dv = torch.empty_like(k), torch.empty_like(v)  # filled tile by tile as they come home
    D = None  # D_i = rowsum(dO_i O_i) is the same at every micro-step: the kernels' once
    if local == "triton":
        D = ledger.take("acc", _row_dot_triton(out, dout))
    steps = _schedule(plan, ring)
    T = plan.tile
    tile_shape = (k.shape[0], k.shape[1], T, k.shape[3])
    K_j = V_j = None
    pending = ()  # the accumulator (dK, dV) finished at the previous micro-step, not yet sent
    for i, (p, t) in enumerate(steps):
        if t == 0:
            K_j, V_j = _own_tile(k, plan, p, ledger), _own_tile(v, plan, p, ledger)
        passing = t < ring.size - 1
        receiving = i > 0 and ring.size > 1
        send, recv = [], []
        if passing:  # the K/V tile on to the next rank, the next one from the previous rank
            K_next = ledger.take("kv", torch.empty_like(K_j))
            V_next = ledger.take("kv", torch.empty_like(V_j))
            send += [(K_j, KV_TAG), (V_j, KV_TAG + 1)]
            recv += [(K_next, KV_TAG), (V_next, KV_TAG + 1)]
        if receiving:  # our last accumulator on; the one the previous rank finished, in
            dK_in = ledger.take("grad", torch.empty(tile_shape, dtype=travel, device=k.device))
            dV_in = ledger.take("grad", torch.empty(tile_shape, dtype=travel, device=k.device))
            send += [(pending[0], ACC_TAG), (pending[1], ACC_TAG + 1)]
            recv += [(dK_in, ACC_TAG), (dV_in, ACC_TAG + 1)]
        # all of a micro-step's transfers in one group, in the same order on every rank
        requests = ring.post_tagged(send, recv)
        del send, recv
        # this rank's share of the tile's gradients
        dK_p = ledger.take("grad", torch.zeros(tile_shape, dtype=acc, device=k.device))
        dV_p = ledger.take("grad", torch.zeros(tile_shape, dtype=acc, device=k.device))
        for a, b, lo, hi, causal in plan.calls(ring.rank, ring.source(t), p, is_causal):
            block_backward_into(q[:, :, a:b], K_j[:, :, lo:hi], V_j[:, :, lo:hi],
                                out[:, :, a:b], L[:, :, a:b], dout[:, :, a:b],
                                (dq[:, :, a:b], dK_p[:, :, lo:hi], dV_p[:, :, lo:hi]),
                                causal=causal, scale=scale, local=local,
                                D=None if D is None else D[:, :, a:b], ledger=ledger)
        wait_all(requests)  # the next K/V tile and the accumulator are in, ours has left
        del requests
        pending = ()
        if receiving:
            p_prev, t_prev = steps[i - 1]
            if t_prev == ring.size - 1:  # our own tile p_prev, home after its last hop
                _home(dk, plan, p_prev, dK_in)
                _home(dv, plan, p_prev, dV_in)
            else:  # the accumulator of the tile we hold: add our share
                dK_p += dK_in
                dV_p += dV_in
            del dK_in, dV_in
        if ring.size == 1:  # a ring of one: the tile is home already
            _home(dk, plan, p, dK_p)
            _home(dv, plan, p, dV_p)
        else:  # on to the next rank with the next micro-step's transfers (home after P hops)
            pending = tuple(g if g.dtype == travel else ledger.take("grad", g.to(travel))
                            for g in (dK_p, dV_p))
        del dK_p, dV_p
        if passing:
            K_j, V_j = K_next, V_next
            del K_next, V_next
        else:
            K_j = V_j = None
    if ring.size == 1:
        return dq.to(q.dtype), dk, dv
    # our last accumulator on, and our own last tile's home from the previous rank
    dK_in = ledger.take("grad", torch.empty(tile_shape, dtype=travel, device=k.device))
    dV_in = ledger.take("grad", torch.empty(tile_shape, dtype=travel, device=k.device))
    wait_all(ring.post_tagged([(pending[0], ACC_TAG), (pending[1], ACC_TAG + 1)],
                              [(dK_in, ACC_TAG), (dV_in, ACC_TAG + 1)]))
    del pending
    _home(dk, plan, plan.m - 1, dK_in)
    _home(dv, plan, plan.m - 1, dV_in)
    return dq.to(q.dtype), dk, dv


# ----------------------------------------------------------------------------------------
# The memory formula: bytes the ring holds, per rank, from N, P, H, d and the dtype.
# ----------------------------------------------------------------------------------------


def ring_memory(N, P, H, d, dtype=torch.bfloat16, *, B=1, Hkv=None, is_causal=False,
                layout="zigzag", tile=None, forward_tile=None, call_rows=None, local="triton",
                accumulate="float32", rank=None):
    """Peak bytes per rank, in closed form per micro-step (the tests check it against a
    :class:`Ledger` of a real run). With n = N/P, T = the pass's tile, C = the rows of its
    largest call, e = bytes of dtype, a = bytes of the accumulator (4, or 8 for float64), t =
    bytes of an accumulator in transit (a, or e with accumulate="input"):

    - forward ring:  B H n (d+1) a                  (float32 O and L of this rank's rows)
                   + 2 or 4 K/V tiles of B Hkv T d e (the one held, and the one arriving)
                   + one call's O_t, L_t: B H C (d a + a) for torch; for triton only its
                     base-2 L, B H C 4 (the kernel merges into O itself)
    - backward ring: 2 or 4 K/V tiles + this rank's share of a tile's dK, dV (B Hkv T d a each)
                     + the accumulators arriving and leaving (B Hkv T d t each; the share's
                     copy in k's dtype when it leaves in it) + for torch one call's dQ_t
                     (B H C d a), dK_t, dV_t (B Hkv K d a, K the call's keys: a piece or the
                     whole tile; the largest call's sum; the Triton kernels add into the ring's
                     buffers and hold none) + dQ's float32 copy (B H n d a) when
                     accumulate="float32" and e < a + (triton) the rows' D_i, B H n 4.
    - caller: q, dout, out, dq (B H n d e each), k, v, dk, dv (B Hkv n d e each), L (B H n a);
      during the forward only q, k, v and dout (made before it, as a benchmark makes them).
    - scratch (triton, not held by the ring): a backward call's row statistics D, lse (B H C 8).
    ``per_gpu`` = the largest of: the forward's caller + its ring; its end (O, L and the output
    beside them); the caller (less dQ while a float32 copy accumulates it) + scratch + the
    backward ring; the backward's end (dQ's float32 copy beside its output). What
    torch.cuda.max_memory_allocated should show around a forward + backward (besides what the
    communication library allocates).
    Returns a dict of bytes: forward, backward, caller, scratch, per_gpu, and one_gpu (the same
    caller tensors for all N positions, as one GPU running the whole sequence holds them).
    ``rank``: one rank's numbers, or None for the largest over the ranks (a causal mask gives
    ranks different calls).
    """
    Hkv = H if Hkv is None else Hkv
    if N % P:
        raise ValueError(f"N={N} is not a multiple of P={P}")
    n = N // P
    fplan, plan = pass_plans(n, P, layout, tile, forward_tile, call_rows)
    e = torch.empty((), dtype=dtype).element_size()
    a = 8 if dtype == torch.float64 else 4
    t_b = e if accumulate == "input" else a  # an accumulator's bytes in transit
    ranks = range(P) if rank is None else [rank]
    share = 2 * B * Hkv * plan.tile * d * a  # a dK, dV pair of one backward tile
    transit = 2 * B * Hkv * plan.tile * d * t_b
    fwd = bwd = 0
    for r in ranks:
        for p, t in _schedule(fplan, _RankOnly(r, P)):
            calls = fplan.calls(r, (r - t) % P, p, is_causal)
            call_f = max((B * H * (b - a_) * (4 if local == "triton" else d * a + a)
                          for a_, b, _, _, _ in calls), default=0)
            kv = (2 + 2 * (t < P - 1)) * B * Hkv * fplan.tile * d * e
            fwd = max(fwd, B * H * n * (d + 1) * a + kv + call_f)
        for i, (p, t) in enumerate(_schedule(plan, _RankOnly(r, P))):
            calls = plan.calls(r, (r - t) % P, p, is_causal)
            kv = (2 + 2 * (t < P - 1)) * B * Hkv * plan.tile * d * e
            receiving = i > 0 and P > 1
            call_b = 0 if local == "triton" else max(  # triton adds in place: no temporaries
                (B * H * (b - a_) * d * a + 2 * B * Hkv * (k1 - k0) * d * a
                 for a_, b, k0, k1, _ in calls), default=0)
            # while computing: the share, the accumulators arriving and leaving; after: the
            # share beside its copy in the transit dtype
            leaving = transit if (P > 1 and t_b != a) else 0
            bwd = max(bwd, kv + share + 2 * transit * receiving + call_b, kv + share + leaving)
    dq_copy = B * H * n * d * a if (accumulate == "float32" and e < a) else 0
    bwd += dq_copy + (B * H * n * 4 if local == "triton" else 0)
    q_like, kv_like = B * H * n * d * e, B * Hkv * n * d * e
    caller = 4 * q_like + 4 * kv_like + B * H * n * a
    fwd_caller = 2 * q_like + 2 * kv_like  # q, dout, k, v
    fwd_end = fwd_caller + B * H * n * (d + 1) * a + q_like  # O, L and the output
    # the triton backward's per-call row statistics: base-2 L and a contiguous D
    scratch = max((B * H * (b - a_) * 8 for r in range(P) for p in range(plan.m)
                   for t in range(P)
                   for a_, b, _, _, _ in plan.calls(r, (r - t) % P, p, is_causal)),
                  default=0) if local == "triton" else 0
    # dQ in q's dtype exists during the backward only when it is the accumulator itself
    bwd_caller = caller - (q_like if dq_copy else 0)
    end = caller + dq_copy  # the last moment: dQ's float32 copy beside the dQ it becomes
    per_gpu = max(fwd_caller + fwd, fwd_end, bwd_caller + scratch + bwd, end)
    one = (4 * B * H * N * d + 4 * B * Hkv * N * d) * e + B * H * N * 4
    return {"forward": fwd, "backward": bwd, "caller": caller, "scratch": scratch,
            "per_gpu": per_gpu, "one_gpu": one, "tile": plan.tile, "forward_tile": fplan.tile,
            "call_rows": plan.call_rows, "tiles_per_shard": plan.m}


class _RankOnly:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


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

    post = Ring.post

    def post_tagged(self, send=(), recv=()):
        for t, tag in send:
            self.mailboxes[(self.rank + 1) % self.size][tag].put(t.clone())
        # the handle keeps the sent tensors, as a real send's buffer is busy until waited on
        return ([_MailboxReceive(self.mailboxes[self.rank][tag], buf) for buf, tag in recv],
                [t for t, _ in send])

    def start_exchange(self, tensors, tag: int = 0):
        received = [torch.empty_like(t) for t in tensors]
        return self.post(tensors, received, tag), received


class _MailboxReceive:
    def __init__(self, box, buf):
        self.box, self.buf = box, buf

    def wait(self):
        self.buf.copy_(self.box.get(timeout=60))


def simulate_ring(q, k, v, world, is_causal=False, scale=None, dout=None, local="torch", *,
                  layout="zigzag", tile=None, forward_tile=None, call_rows=None,
                  accumulate="float32", ledgers=None):
    """Ring attention over the full (B, H, N, d) q, k, v with ``world`` thread-ranks.

    Shards the sequence in ``layout``, runs ring_forward (and ring_backward when ``dout`` is
    given) on every rank, and puts the shards back in order: returns out, or (out, dq, dk, dv).
    The keywords are :func:`ring_attention`'s. ``ledgers``: a list that receives each rank's
    (forward, backward) :class:`Ledger`.
    """
    import queue
    import threading

    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    parts = [[shard(t, r, world, layout).contiguous() for r in range(world)]
             for t in (q, k, v) + (() if dout is None else (dout,))]
    fplan, plan = pass_plans(parts[0][0].shape[2], world, layout, tile, forward_tile, call_rows)
    mailboxes = [{tag: queue.Queue() for tag in range(4)} for _ in range(world)]
    results, errors = [None] * world, []
    books = [(Ledger(), Ledger()) for _ in range(world)]

    def rank_main(r):
        try:
            ring = ThreadRing(r, world, mailboxes)
            q_r, k_r, v_r = (p[r] for p in parts[:3])
            out, L = ring_forward(ring, q_r, k_r, v_r, is_causal, scale, local, fplan,
                                  books[r][0])
            grads = () if dout is None else ring_backward(
                ring, q_r, k_r, v_r, out, L, parts[3][r], is_causal, scale, local, plan,
                books[r][1], accumulate)
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
    if ledgers is not None:
        ledgers.extend(books)
    joined = [unshard(list(ps), layout) for ps in zip(*results)]
    return joined[0] if dout is None else tuple(joined)


# ----------------------------------------------------------------------------------------
# The local step: some query rows against one K/V tile. Swap in a faster kernel here.
# ----------------------------------------------------------------------------------------


def block_forward(q, k, v, *, causal, scale, local="torch"):
    """(O, L) of q against this K/V block alone: O normalized, L the natural-log logsumexp
    (-inf for a row that sees no key of the block, O = 0 there), as flashedu.merge expects."""
    if local == "triton":
        from .triton_backend import forward_with_lse

        return forward_with_lse(q, k, v, is_causal=causal, scale=scale)
    acc = accumulate_dtype(q.dtype)
    return naive_attention_torch(q.to(acc), k.to(acc), v.to(acc), is_causal=causal, scale=scale,
                                 return_lse=True)


def block_forward_into(q, k, v, O, L, *, causal, scale, local="torch", ledger=None):
    """q's attention over this K/V block merged, in place, into the running (O, L) over the
    blocks before: O in the accumulator dtype with q's strides, L the natural-log logsumexp
    (-inf for a row that has seen no key yet, O = 0 there).

    torch computes the block's (O, L) and merges it by flashedu.merge's rule. The Triton kernel
    starts its online softmax from (O, L) itself (``forward_into``): the merged result comes
    out of the kernel, with no block output and no merge pass over O. ``ledger`` counts the
    temporaries of the call."""
    take = (ledger or _NoLedger).take
    if local == "triton":
        from . import triton_backend

        triton_backend.forward_into(q, k, v, O, L, is_causal=causal, scale=scale,
                                    scratch=lambda t: take("call", t))
        return
    O_t, L_t = block_forward(q, k, v, causal=causal, scale=scale, local=local)
    take("call", O_t), take("call", L_t)
    merge_into(O, L, O_t, L_t)


def block_backward(q, k, v, out, L, dout, *, causal, scale, local="torch", D=None):
    """This K/V block's share of the gradients, recomputed from the whole row's O and L.

    P_ij = exp(S_ij - L_i) is the block's slice of the *global* softmax, so the paper's backward
    applies block by block: dV_j = P^T dO, dP = dO V_j^T, dS = P * (dP - D), D_i = rowsum(dO_i O_i),
    dQ = scale dS K_j, dK_j = scale dS^T Q. Returns (dq, dk, dv); dk, dv summed over GQA groups.
    ``D`` (float32, (B, H, rows)): the rows' D_i when the caller has it, else computed here.
    """
    if local == "triton":
        return _block_backward_triton(q, k, v, out, L, dout, causal, scale, D)
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
    D = (dout * out).sum(-1, keepdim=True) if D is None else D.to(acc).unsqueeze(-1)
    dV = P.transpose(-1, -2) @ dout
    dS = P * (dout @ V.transpose(-1, -2) - D)
    dQ = scale * dS @ K
    dK = scale * dS.transpose(-1, -2) @ q
    if Hkv != H:  # each K/V head served H // Hkv query heads: add up their gradients
        dK = dK.unflatten(1, (Hkv, H // Hkv)).sum(2)
        dV = dV.unflatten(1, (Hkv, H // Hkv)).sum(2)
    return dQ, dK, dV


def block_backward_into(q, k, v, out, L, dout, into, *, causal, scale, local="torch", D=None,
                        ledger=None):
    """:func:`block_backward`'s gradients added to ``into`` = (dq, dk, dv), in place (views of
    the ring's dQ rows and of a tile's dK, dV accumulators). The Triton kernels add them as
    they store (no gradient tensors of the call's own); torch computes them, then adds.
    ``ledger`` counts the call's temporaries."""
    if local == "triton":
        _block_backward_triton(q, k, v, out, L, dout, causal, scale, D, into)
        return
    take = (ledger or _NoLedger).take
    for buf, g in zip(into, block_backward(q, k, v, out, L, dout, causal=causal, scale=scale,
                                           local=local, D=D)):
        buf += take("call", g)


def _block_backward_triton(q, k, v, out, L, dout, causal, scale, D=None, into=None):
    from .triton_backend import backward_into

    # q, out and dout may be row slices of this rank's tensors (the kernels take strides)
    return backward_into(q, k, v, out, L, dout, is_causal=causal, scale=scale, D=D, into=into)


def _row_dot_triton(out, dout):
    """D = rowsum(dO * O), float32 (B, H, n), by the backward's preprocess kernel."""
    from .triton_backend import row_dot

    return row_dot(out, dout)


def accumulate_dtype(dtype):
    """Running results in float32 for 16-bit inputs (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _resolve_local(local, q):
    if local == "auto":
        from . import runtime

        return "triton" if q.is_cuda and not runtime.triton_interpreted() \
            and q.dtype != torch.float64 else "torch"
    return local


def _check(q, k, v, is_causal, scale, local, layout, accumulate):
    from .arguments import check_scale, check_tensors

    check_tensors(q, k, v, enable_gqa=True)
    check_scale(scale, q.shape[-1])
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must hold the same shard of the sequence (n positions each), "
                         f"got n={q.shape[2]} for q and {k.shape[2]} for k")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if local not in LOCAL_KINDS:
        raise ValueError(f"local must be one of {LOCAL_KINDS}, got {local!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
