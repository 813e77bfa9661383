"""The "triton" backend: its entry point, its kernels as the autograd path calls them, and the
repeat of a plain call.

The kernels and their launch are :mod:`flashedu.triton`; this module is what
:mod:`flashedu.backends` registers: :data:`KERNELS`, the launch's forward and backward as the one
autograd path (:mod:`flashedu.ops`) calls them (and, from them, the operators
``torch.ops.flashedu.triton_forward`` / ``triton_backward``), with :func:`prepare`, which checks
what only this backend refuses (dtypes, head dims, devices) and turns a bool ``attn_mask`` into
a block mask before the call reaches them.
The kernels keep the logsumexp in base 2 (their exp2 softmax); :func:`natural_lse` is the one
place that converts it. Importing the kernels fails where triton does: that is how the registry
tells that the backend is unavailable.

A repeated plain call is the backend's shortest path from ``flashedu.attention`` to the kernels.
A training step calls ``attention(q, k, v, is_causal=True)`` with tensors of one layout, step
after step: no attn_mask, no logsumexp asked for, dropout at one rate if any (each call draws
its own RNG state), and at most a block mask built once (with its mask mod, which the kernels
apply on its partial tiles). The first such call
takes the general path (the argument checks, the backend, the tile table, the block mask's tile
lists, the launch plans of ``fast.PLANS``). Since everything it decided follows from the call's
signature (options, block mask, and the inputs' shapes, strides, dtype, device and alignment),
``flashedu.attention`` keeps a :class:`Repeat` for that signature, and a later call with the
same signature goes straight to it: the one autograd path with the Repeat as its kernels,
which allocate the outputs and start the planned launches, forward and backward. The general
path's layers cost more host time than the kernels of a small attention take on the GPU
(BENCHMARKS.md, "A repeated call").

A Repeat learns its launches from the general path's own (the ``keep`` argument of
``launch.forward`` and ``launch.backward``) on its first forward and first backward, so the
launches it repeats are exactly the ones the general path made. Whatever it cannot repeat as
is (a gradient laid out differently, a transform or dispatch mode, the interpreter's float32
copies) it hands to the general path.
"""

from __future__ import annotations

import math

import torch

from . import ops, runtime
from .dropout import draw_rng
from .triton import fast
from .triton import forward as fwd
from .triton import launch
from .triton.autograd import resolve_config
from .triton.inputs import check


def prepare(q, k, v, attn_mask, block_mask, score_mod):
    """What this backend does to a checked call before its kernels run: refuse what they do not
    take (``triton.inputs.check``), and turn a bool ``attn_mask`` into a block mask whose mask
    mod reads it (only its partial tiles are read element-wise); a float one stays a bias the
    kernels read tile by tile. ``score_mod`` must be one the kernels compile: the library's
    softcap and ALiBi, or one written in Triton (``flashedu.mods.triton_score_mod``).
    Returns (attn_mask, block_mask)."""
    check(q, k, v)
    if (attn_mask is not None and not attn_mask.is_floating_point()
            and not ops.holds_no_values(q, attn_mask)):  # meta or fake: shapes only
        return None, bool_mask_as_block_mask(attn_mask, block_mask, q.shape[2], k.shape[2])
    return attn_mask, block_mask


def bool_mask_as_block_mask(attn_mask, block_mask, Nq: int, Nk: int):
    """The BlockMask of SDPA's bool ``attn_mask`` (True: the pair takes part), within
    ``block_mask`` if one is given: tiles with no True are skipped, tiles all True run
    unmasked, the rest read the mask element-wise. Built on every call (the mask is data)."""
    from .masks import BlockMask

    own = BlockMask.from_bool_mask(attn_mask, block_size=(128, 128), seq_lens=(Nq, Nk))
    if block_mask is None:
        return own
    B, H = own.blocks.shape[:2]
    inner = block_mask.expand(max(B, block_mask.blocks.shape[0]),
                              max(H, block_mask.blocks.shape[1]))

    def both(b, h, q_idx, kv_idx):  # own.mask_mod reads the attn_mask
        return own.mask_mod(b, h, q_idx, kv_idx) & inner.visible(b, h, q_idx, kv_idx)

    return BlockMask.from_mask_mod(both, *inner.blocks.shape[:2], Nq, Nk,
                                   block_size=block_mask.block_size, device=attn_mask.device)


def forward_with_lse(q, k, v, *, is_causal=False, scale=None, block_mask=None):
    """(O, L): the output and the natural-log logsumexp (B, H, Nq) of the scaled scores, as
    ``flashedu.tiled.flash_forward`` returns per head (-inf for a row that sees no key)."""
    check(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o, lse2 = KERNELS.forward_op(q, k, v, is_causal, scale, *ops.mask_args(block_mask))
    return o, natural_lse(lse2)


# ----- the kernel API for code that runs its own loop (ring attention) ---------------------
# Natural-log L in and out, as flashedu.merge has it: the base-2 convention stays in here.


def forward_into(q, k, v, O, L, *, is_causal, scale, scratch=None):
    """q's attention over (k, v) merged, in place, into the running (O, L) over the keys seen
    before: the kernel starts its online softmax from them (``launch.forward_into``), so no
    output of the call's own and no merge pass exist. O: float32 with q's shape and strides;
    L: the natural-log logsumexp (B, H, Nq), -inf for a row that has seen no key yet (O = 0
    there). ``scratch(t)`` is told of each temporary the call allocates."""
    check(q, k, v)
    lse2 = _told(scratch, kernel_lse(L))
    config = resolve_config(q.shape[-1], q.dtype, None, q.device)
    launch.forward_into(q, k, v, O, lse2, is_causal=is_causal, scale=scale,
                        tiles=config.forward_tiles(None, k.shape[2]),
                        interpreted=runtime.triton_interpreted())
    L.copy_(natural_lse(lse2))


def backward_into(q, k, v, out, L, dout, *, is_causal, scale, D=None, into=None):
    """(dQ, dK, dV) of one block of keys, given the softmax's natural-log L over all of them
    (so P = exp(S - L) is the block's slice of the whole softmax). ``D``: rowsum(dO * O),
    float32 (B, H, Nq), when the caller has it (:func:`row_dot`). ``into``: (dQ, dK, dV)
    buffers the kernels add this call's gradients to (returned)."""
    return launch.backward(q, k, v, out, kernel_lse(L), dout, ops.Call(is_causal, scale),
                           D=None if D is None else D.contiguous(), into=into)


def row_dot(out, dout, sinks=None, lse2=None, dlse=None):
    """D = rowsum(dO * O), float32 (B, H, Nq), by the backward's preprocess kernel; with
    ``sinks`` (and the base-2 lse2, dlse if any) (D, the sinks' gradient) from the same pass."""
    config = resolve_config(out.shape[-1], out.dtype, None, out.device)
    out, dout = launch.interpreter_fp32(runtime.triton_interpreted(), out, dout)
    return launch.preprocess(out, dout, config.preprocess_rows, sinks, lse2, dlse)


def kernel_lse(L):
    """The natural-log L as the kernels keep it: base 2, +inf for a row that sees no key (-inf
    in L), float32, contiguous (L may be a row slice)."""
    return torch.where(torch.isneginf(L), float("inf"), L.float() * fwd.LOG2E).contiguous()


def _told(scratch, t):
    if scratch is not None:
        scratch(t)
    return t


# ----- the kernels, as the autograd path calls them ----------------------------------------
# launch.forward(q, k, v, call) and launch.backward(q, k, v, out, lse2, dout, call, ...)
# themselves: the path from flashedu.attention to a launch is api -> ops -> launch.


def natural_lse(lse2):
    """The kernels' base-2 logsumexp (+inf for a row that sees nothing, so that their backward's
    exp2(s - L) is 0 there) in the natural log, -inf for such a row."""
    return torch.where(torch.isinf(lse2), -torch.inf, lse2 * math.log(2.0))


def empty_outputs(*tensors):
    """Empty results laid out as the launch code lays out its own (the same host functions
    decide): the operators' fake implementations must give the real strides."""
    dtype = tensors[0].dtype
    tensors = launch.interpreter_fp32(runtime.triton_interpreted(),
                                      *map(launch.kernel_layout, tensors))
    return tuple(launch.dense_like(t).to(dtype) for t in tensors)


def _row_dot(out, dout):
    """D as the backward computes it, from the tensors laid out as it lays them out."""
    return row_dot(launch.kernel_layout(out), launch.kernel_layout(dout))


def _sink_row_dot(out, dout, lse2, sinks, dlse=None):
    """(D, the sinks' gradient): both from the backward's preprocess pass (one launch)."""
    D, dsinks = row_dot(launch.kernel_layout(out), launch.kernel_layout(dout), sinks, lse2, dlse)
    return D, dsinks.to(sinks.dtype)


KERNELS = ops.Kernels("triton", launch.forward, launch.backward, _row_dot, natural_lse,
                      empty_outputs, lambda dtype: torch.float32, prepare=prepare,
                      sink_row_dot=_sink_row_dot)


# ----- the repeat of a plain call ---------------------------------------------------------


def make_repeat(q, k, v, is_causal: bool, scale: float, block_mask=None, dropout_p=0.0):
    """The Repeat of a checked plain call, or None where the call's inputs are copied by the
    general path (its launches then take other tensors than the caller's). ``is_causal`` has
    the block mask's causal flag folded in, as the general path's; ``dropout_p`` < 1, checked."""
    interpreted = runtime.triton_interpreted()
    if interpreted and q.dtype != torch.float32:  # the interpreter runs float32 copies
        return None
    for t in (q, k, v):  # the general path copies these (q, k, v views of one projection
        # with gaps between their rows are taken as they are)
        if t.stride(-1) != 1:
            return None
    config = resolve_config(q.shape[-1], q.dtype, block_mask, q.device)
    return Repeat(is_causal, scale, block_mask, config, interpreted, dropout_p)


class Repeat:
    """What a plain call's signature decided: its tile table entry and, once the general path
    has run them, its launches. Calling it runs the call (None: the general path must); it is
    the call's kernels under the one autograd path (``ops.Attention``)."""

    name = "triton"
    natural_lse = staticmethod(natural_lse)
    sink_row_dot = staticmethod(_sink_row_dot)
    __slots__ = ("is_causal", "scale", "block_mask", "dropout_p", "call", "config",
                 "interpreted", "forward_plan", "backward_plan", "dout_layout")

    def __init__(self, is_causal, scale, block_mask, config, interpreted, dropout_p=0.0):
        self.is_causal, self.scale, self.block_mask = is_causal, scale, block_mask
        self.dropout_p = dropout_p
        # its mask mod, where tiles need it
        self.call = ops.Call(is_causal, scale, block_mask,
                             mods=ops.Mods.of(None, None, block_mask))
        self.config, self.interpreted = config, interpreted
        self.forward_plan = self.backward_plan = self.dout_layout = None

    def __call__(self, q, k, v, sinks=None):
        if not ops.plain_eager(q, k, v, *(() if sinks is None else (sinks,))):
            return None
        call = self.call
        if sinks is not None or self.dropout_p > 0:  # this call's data: its sinks, its RNG state
            rng = draw_rng(q.device) if self.dropout_p > 0 else None  # as the general path draws
            call = ops.Call(self.is_causal, self.scale, self.block_mask, self.dropout_p, rng,
                            self.call.mods, sinks)
        return ops.Attention.apply(self, call, False, q, k, v, None, sinks)

    def forward(self, q, k, v, call):
        """(O, L2) as ``launch.forward`` returns them."""
        if self.forward_plan is None:
            kept = []  # the table's tiles, or FlashAttention-3's schedule where it asks
            out = launch.forward(q, k, v, call, interpreted=self.interpreted, keep=kept)
            self.forward_plan = kept[0] if kept else None
            return out
        o = launch.dense_like(q)  # as the general path lays it out
        lse2 = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        # the call's own tensors after the five it leads with: the RNG state, the sinks
        fresh = () if call.rng is None else (call.rng,)
        fresh += () if call.sinks is None else (call.sinks.float().contiguous(),)
        self.forward_plan.start(q, k, v, o, lse2, *fresh)  # (one launch: start checks it)
        return o, lse2

    def backward(self, q, k, v, o, lse2, do, call, dlse=None, mask_grad=False, D=None):
        """(dQ, dK, dV) as ``launch.backward`` returns them (a plain call has no lse or
        attn_mask to differentiate)."""
        do = launch.dout_layout(q, do)  # as the general path hands it to the kernels
        # a D given (the sinks' pass made it) means a plan without the preprocess
        layout = (do.stride(), do.dtype, do.data_ptr() % 16 == 0, D is None)
        if self.backward_plan is None or layout != self.dout_layout:
            kept = []
            grads = launch.backward(q, k, v, o, lse2, do, call, D=D, config=self.config,
                                    interpreted=self.interpreted, keep=kept)
            if self.backward_plan is None and kept:
                self.backward_plan, self.dout_layout = kept[0], layout
            return grads
        first, launches = self.backward_plan
        dq, dk, dv = launch.dense_like(q), launch.dense_like(k), launch.dense_like(v)
        if D is None:
            D = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        stream = fast.stream_for(first, *launches)  # the checks, once for all launches
        if first is not None:  # the preprocess: D = rowsum(dO * O)
            first.start(o, do, D, stream=stream)
        rng = () if call.rng is None else (call.rng,)
        for planned in launches:
            planned.start(q, k, v, do, lse2, D, dq, dk, dv, *rng, stream=stream)
        return dq, dk, dv
