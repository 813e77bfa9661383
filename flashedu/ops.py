"""The one autograd path from :func:`flashedu.attention` to a backend's kernels.

A backend whose forward and backward are kernels of its own (numpy and triton) describes them
as :class:`Kernels`: ``forward(q, k, v, call) -> (out, lse)`` with the lse as its kernels keep
it, ``backward(q, k, v, out, lse, dout, call, dlse, mask_grad) -> (dq, dk, dv[, dmask])``, how
its lse reads in the natural log, and the layout of its outputs. ``call`` (:class:`Call`) holds
the call's checked options. Everything above the kernels goes through two pieces here:

- :class:`Attention`, one ``autograd.Function``: it runs the forward, saves (q, k, v, out, lse)
  and runs the backward, for every backend and every feature (masks, score mods, dropout, the
  logsumexp and its gradient, a learned float attn_mask's gradient); a repeated call's
  shortest path (``flashedu.triton_backend.Repeat``) is one more :class:`Kernels` under it.
- the ``torch.library`` operators of each :class:`Kernels`, built from the same two
  functions, with a shape rule (fake implementation) and a vmap rule, for what an
  ``autograd.Function`` cannot serve: ``torch.compile(fullgraph=True)`` puts the operator in
  its graph as one node, meta and fake tensors get shapes, CUDA graphs capture forward and
  backward, ``torch.func.vmap`` folds its batch into B:

    torch.ops.flashedu.<name>_forward(q, k, v, is_causal, scale, blocks, block_r, block_c,
                                      dropout_p=0.0, rng=None) -> (out, lse)
    torch.ops.flashedu.<name>_backward(q, k, v, out, lse, dout, is_causal, scale,
                                       blocks, block_r, block_c, dropout_p=0.0, rng=None)
                                       -> (dq, dk, dv)

  registered when the backend's module is imported (``flashedu.backends.BACKENDS[name].load()``).

q: (B, H, Nq, d); k, v: (B, Hkv, Nk, d), H a multiple of Hkv. A :class:`flashedu.BlockMask` is
not a tensor, so the operators take its tile grid ``blocks`` (bool (b, h, Tr, Tc), b and h 1 or
B and H, or None) and its block size, and rebuild the mask (cached: a training loop passes the
same grid every step). Dropout's ``rng``, an int64 tensor [seed, offset] drawn by
:func:`flashedu.dropout.draw_rng`, is an operator argument: a CUDA graph that captures a call
captures the draw too (a new mask at every replay, as torch's own dropout under graphs).

Which way a call goes (:func:`attention`): a plain eager call (real tensors, nothing compiling,
no transform or dispatch mode) runs under :class:`Attention`, which skips the dispatcher's
trips (tens of microseconds a call, the whole budget of a small attention). A call with Python
objects the operators cannot carry (a score mod, an attn_mask, a block mask's mask mod) or that
asks for the lse runs under :class:`Attention` too, a graph break under ``torch.compile``;
torch.func transforms do not reach it and are refused with a message. Every other call (compile,
fake tensors, vmap) takes the operator.

The derivative is the kernels' backward. Its own derivative (a second backward, after
``create_graph=True``) is not implemented: asking for one raises a RuntimeError, never a
silently wrong zero. ``torch.func.grad`` is refused with a message too (the derivative is
registered for torch.autograd); ``torch.func.vmap`` works.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable, Optional

import torch
from torch import Tensor

# The backward of these kernels is not differentiable: the naive backend is (plain torch ops).
SECOND_ORDER_BACKENDS = ("naive",)


class Call:
    """One call's checked options, as a backend's kernels take them. ``mods``: a :class:`Mods`
    or None; ``rng``: dropout's [seed, offset] tensor, or None without dropout; ``sinks``:
    the (H,) sink logits, or None (the forward starts each row's softmax from its head's sink;
    the backward needs nothing more, since the lse includes it); ``seqs``: packed
    variable-length sequences in inputs of batch 1 (:class:`flashedu.varlen.Packing`), or
    None."""

    __slots__ = ("is_causal", "scale", "block_mask", "dropout_p", "rng", "mods", "sinks", "seqs")

    def __init__(self, is_causal, scale, block_mask=None, dropout_p=0.0, rng=None, mods=None,
                 sinks=None, seqs=None):
        self.is_causal, self.scale, self.block_mask = is_causal, scale, block_mask
        self.dropout_p, self.rng, self.mods, self.sinks = dropout_p, rng, mods, sinks
        self.seqs = seqs

    @property
    def attn_mask(self):
        return None if self.mods is None else self.mods.attn_mask


class Kernels:
    """A backend's forward and backward kernels, as the autograd path calls them, and their
    ``torch.library`` operators (``forward_op``, ``backward_op``), defined here.

    forward(q, k, v, call) -> (out, lse): lse as the kernels keep it, for their backward.
    backward(q, k, v, out, lse, dout, call, dlse=None, mask_grad=False, D=None) -> (dq, dk,
    dv), and the float attn_mask's gradient last when ``mask_grad``; ``dlse`` is the gradient
    reaching the natural-log lse; ``D`` the rows' rowsum(dO * O), when the caller has it.
    row_dot(out, dout) -> D = rowsum(dO * O), (B, H, Nq), in the lse's dtype.
    natural_lse(lse) -> the natural-log lse (B, H, Nq), -inf for a row that sees no key.
    empty_outputs(*tensors) -> empty tensors laid out as the kernels lay out the results of
    these inputs (out for q, dq, dk, dv for q, k, v): compiled code trusts the fake strides.
    lse_dtype(dtype) -> the lse's dtype for inputs of ``dtype``.
    prepare(q, k, v, attn_mask, block_mask, score_mod) -> (attn_mask, block_mask): what the
    backend does to a checked call before its kernels run (refuse inputs they do not take,
    turn one kind of mask into another), or None.
    sink_row_dot(out, dout, lse, sinks, dlse) -> (D, the sinks' gradient): both in one pass
    where the kernels can (None: row_dot, then :func:`sink_grad`).

    ``entry`` is the backend's entry point, :func:`attention` with these kernels: what
    :mod:`flashedu.backends` registers."""

    def __init__(self, name: str, forward: Callable, backward: Callable, row_dot: Callable,
                 natural_lse: Callable, empty_outputs: Callable, lse_dtype: Callable,
                 prepare: Callable | None = None, sink_row_dot: Callable | None = None):
        self.name = name
        self.forward, self.backward, self.row_dot = forward, backward, row_dot
        self.natural_lse, self.empty_outputs, self.lse_dtype = natural_lse, empty_outputs, lse_dtype
        self.prepare = prepare
        if sink_row_dot is not None:
            self.sink_row_dot = sink_row_dot
        self.forward_op, self.backward_op = _define_operators(self)
        self.entry = functools.partial(attention, self)

    def sink_row_dot(self, out, dout, lse, sinks, dlse=None):
        """(D, the sinks' gradient) from the kernels' D and the formula (:func:`sink_grad`)."""
        D = self.row_dot(out, dout)
        return D, sink_grad(sinks, self.natural_lse(lse), D, dlse)


def attention(kernels: Kernels, q, k, v, *, is_causal: bool, scale: float, block_mask,
              dropout_p: float = 0.0, attn_mask=None, score_mod=None, return_lse=False,
              sinks=None, seqs=None):
    """``out``, or ``(out, lse)`` with ``return_lse``: what the backends call, their inputs
    checked. ``dropout_p`` > 0 draws the call's RNG state (seed, offset) from torch's
    generator of q's device. ``seqs``: packed sequences (:class:`flashedu.varlen.Packing`),
    for the backends whose kernels read them (``Backend.has_packed``)."""
    if kernels.prepare is not None:
        attn_mask, block_mask = kernels.prepare(q, k, v, attn_mask, block_mask, score_mod)
    rng = None
    if dropout_p > 0:
        from .dropout import draw_rng

        rng = draw_rng(q.device)
    mods = Mods.of(attn_mask, score_mod, block_mask)
    call = Call(is_causal, scale, block_mask, dropout_p, rng, mods, sinks, seqs)
    if mods is None and not return_lse and sinks is None and seqs is None:
        if plain_eager(q, k, v):
            return Attention.apply(kernels, call, False, q, k, v, None, None)
        return _operator_call(kernels, q, k, v, call)
    # Python objects the operators cannot carry, or the lse or sinks with their gradients
    if torch.compiler.is_compiling():  # a graph break: torch.compile runs it as it is, eagerly
        return torch.compiler.disable(_modded)(kernels, call, return_lse, q, k, v)
    return _modded(kernels, call, return_lse, q, k, v)


def _modded(kernels, call, return_lse, q, k, v):
    attn_mask, sinks = call.attn_mask, call.sinks
    refuse_transforms(f"flashedu.attention(backend={kernels.name!r}) {MODDED_CALL} (SDPA's "
                      f"vmap does take an attn_mask)", q, k, v, attn_mask, sinks)
    if holds_no_values(q, k, v, attn_mask, sinks):  # meta or fake: shapes only
        kernels = _ShapesOnly(kernels)
    return Attention.apply(kernels, call, return_lse, q, k, v, attn_mask, sinks)


MODDED_CALL = ("with attn_mask, score_mod, return_lse, sinks, packed sequences or a block "
               "mask's mask mod")


class Attention(torch.autograd.Function):
    """out (and the natural-log lse, ``want_lse``) of ``kernels`` on one call; differentiable
    in q, k, v, the lse (d lse_i / d s_ij = P_ij: the kernels subtract dlse_i from the row's
    D_i = rowsum(dO_i * O_i)), a float ``attn_mask`` that requires grad (a learned bias:
    its gradient is dS_ij, summed to its shape) and the ``sinks`` (:func:`sink_grad`). The
    forward saves the kernels' own lse, so a call that does not return it never pays for its
    conversion."""

    @staticmethod
    def forward(ctx, kernels, call, want_lse, q, k, v, attn_mask, sinks):
        ctx.set_materialize_grads(False)  # an unused output gets None, not zeros
        out, lse = kernels.forward(q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernels, ctx.call = kernels, call
        if not want_lse:
            return out
        return out, kernels.natural_lse(lse)

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse = ctx.saved_tensors
        kernels, call = ctx.kernels, ctx.call
        if dout is None:
            dout = torch.zeros_like(out)
        attn_mask = call.attn_mask
        mask_grad = bool(attn_mask is not None and attn_mask.is_floating_point()
                         and ctx.needs_input_grad[6])
        # the sinks' gradient reads D = rowsum(dO * O), which the backward needs too: made once
        D = dsinks = None
        if ctx.needs_input_grad[7]:
            D, dsinks = kernels.sink_row_dot(out, dout, lse, call.sinks, dlse)
        grads = kernels.backward(q, k, v, out, lse, dout, call, dlse, mask_grad, D)
        dmask = grads[3] if mask_grad else None
        grads = refuse_second_order(kernels.name, (*grads[:3], dmask, dsinks), q, k, v, dout,
                                    dlse, attn_mask, call.sinks)
        return (None, None, None, *grads)


def sink_grad(sinks, L, D, dlse=None):
    """The sinks' gradient: the sink is one more column of dS = P * (dP - D) whose dP is 0 (it
    has no value), so d sink_h = -sum over the head's rows of P_i,sink (D_i - dlse_i), with
    P_i,sink = exp(sink_h - L_i) and D_i = rowsum(dO_i * O_i), the backward's own D. ``L``: the
    natural-log lse, which includes the sink."""
    acc = torch.float64 if D.dtype == torch.float64 else torch.float32
    D = D.to(acc)
    if dlse is not None:
        D = D - dlse.to(acc)
    P_sink = torch.exp(sinks.to(acc).view(-1, 1) - L.to(acc))
    return -(P_sink * D).sum(dim=(0, 2)).to(sinks.dtype)


class _ShapesOnly:
    """A backend's kernels on meta or fake tensors: outputs and gradients of the right shapes,
    dtypes and layouts, as the operators' fake implementations give, and no values."""

    def __init__(self, kernels):
        self.name, self._kernels = kernels.name, kernels

    def forward(self, q, k, v, call):
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        if get_proxy_mode() is not None:  # a tracer would record these empty tensors
            raise NotImplementedError(
                f"flashedu.attention(backend={self.name!r}) {MODDED_CALL} computes on the "
                f"host with the tensors' values, which a tracer (make_fx, torch.export) does "
                f"not have: trace backend='naive', or let torch.compile run the call eagerly "
                f"(a graph break)")
        out, = self._kernels.empty_outputs(q)
        return out, q.new_empty(q.shape[:3], dtype=self._kernels.lse_dtype(q.dtype))

    def row_dot(self, out, dout):
        return out.new_empty(out.shape[:3], dtype=self._kernels.lse_dtype(out.dtype))

    def sink_row_dot(self, out, dout, lse, sinks, dlse=None):
        return self.row_dot(out, dout), torch.empty_like(sinks)

    def backward(self, q, k, v, out, lse, dout, call, dlse=None, mask_grad=False, D=None):
        grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                      for t in (q, k, v))
        return (*grads, torch.empty_like(call.attn_mask)) if mask_grad else grads

    @staticmethod
    def natural_lse(lse):
        return lse


def holds_no_values(*tensors) -> bool:
    """Some of ``tensors`` (None skipped) are meta or fake tensors: shapes without data."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(t is not None and (isinstance(t, FakeTensor) or t.device.type == "meta")
               for t in tensors)


def plain_eager(*tensors) -> bool:
    """Real tensors (no subclass, no meta, no torch.func wrapper), nothing compiling, no
    dispatch mode: a call that needs no operator."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return all(type(t) is Tensor and t.device.type != "meta"
               and not torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def _operator_call(kernels, q, k, v, call):
    try:
        out, _ = kernels.forward_op(q, k, v, call.is_causal, call.scale,
                                    *mask_args(call.block_mask), call.dropout_p, call.rng)
    except RuntimeError:
        if any(torch._C._functorch.is_gradtrackingtensor(t) for t in (q, k, v)):
            raise RuntimeError(
                f"torch.func.grad (and jacrev, jvp, hessian) cannot differentiate "
                f"flashedu.attention(backend={kernels.name!r}): its derivative is registered "
                f"for torch.autograd only. Use torch.autograd.grad or .backward() "
                f"(torch.func.vmap alone works), or backend={SECOND_ORDER_BACKENDS[0]!r}, "
                f"plain torch ops that every torch.func transform differentiates.") from None
        raise
    return out


# ---------------------------------------------------------------------------------------------
# Masks and score mods: Python objects the operators cannot carry
# ---------------------------------------------------------------------------------------------

class Mods:
    """What a call adds to plain attention (``flashedu.mods``): SDPA's ``attn_mask``, a
    ``score_mod`` (bound to (Nq, Nk)), and the block mask's ``mask_mod`` when its partial tiles
    need it. None in :class:`Call` means none of them."""

    __slots__ = ("attn_mask", "score_mod", "mask_mod")

    def __init__(self, attn_mask=None, score_mod=None, mask_mod=None):
        self.attn_mask, self.score_mod, self.mask_mod = attn_mask, score_mod, mask_mod

    @property
    def mask_mod_only(self) -> bool:
        """Only the block mask's mask mod: everything the kernels read of it (its element
        masks, or a compiled window's bounds) follows from the block mask, a value that launch
        plans can key on."""
        return self.attn_mask is None and self.score_mod is None

    @classmethod
    def of(cls, attn_mask, score_mod, block_mask):
        mask_mod = (block_mask.mask_mod if block_mask is not None and block_mask.needs_mask_mod
                    else None)
        if attn_mask is None and score_mod is None and mask_mod is None:
            return None
        return cls(attn_mask, score_mod, mask_mod)


def refuse_transforms(call: str, *tensors) -> None:
    """torch.func's vmap and grad wrap tensors that an ``autograd.Function`` without
    ``setup_context`` cannot take: say what works instead of torch's internal message."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if any(t is not None and wrapped(t) for t in tensors):
        raise NotImplementedError(
            f"torch.func transforms (vmap, grad, jacrev, ...) do not reach {call}: give the "
            f"mapped dimension to the batch B instead of vmap, or use backend="
            f"{SECOND_ORDER_BACKENDS[0]!r}, plain torch ops that every transform handles")


# ---------------------------------------------------------------------------------------------
# No second order
# ---------------------------------------------------------------------------------------------

def second_order_error(backend: str) -> RuntimeError:
    return RuntimeError(
        f"flashedu.attention(backend={backend!r}) has no double backward: its gradients "
        f"come from a backward kernel that is not itself differentiable, so a gradient of "
        f"a gradient (create_graph=True, then backward again) cannot be computed. Use "
        f"backend={SECOND_ORDER_BACKENDS[0]!r}: its plain torch ops are differentiated "
        f"twice by autograd.")


class _NoSecondOrder(torch.autograd.Function):
    """The gradients a backward kernel computed, as a node whose own derivative raises
    :func:`second_order_error`: under ``create_graph=True`` they require grad as the operators'
    do, so a second backward through them is refused instead of silently missing its term."""

    @staticmethod
    def forward(ctx, backend, grads, *inputs):
        ctx.backend = backend
        return tuple(grads)

    @staticmethod
    def backward(ctx, *_):
        raise second_order_error(ctx.backend)


def refuse_second_order(backend: str, grads, *inputs):
    """``grads`` as they are, or, when the backward records a graph (``create_graph=True``),
    linked to ``inputs`` (what the gradients depend on) through :class:`_NoSecondOrder`."""
    if not torch.is_grad_enabled() or not any(
            t is not None and t.requires_grad for t in inputs):
        return grads
    present = [g for g in grads if g is not None]
    linked = iter(_NoSecondOrder.apply(backend, present, *(t for t in inputs if t is not None)))
    return tuple(None if g is None else next(linked) for g in grads)


# ---------------------------------------------------------------------------------------------
# The block mask across the operator boundary
# ---------------------------------------------------------------------------------------------

def mask_args(block_mask) -> tuple[Optional[Tensor], int, int]:
    """(blocks, block_r, block_c) of a BlockMask (or None) for the operators."""
    if block_mask is None:
        return None, 0, 0
    Br, Bc = block_mask.block_size
    return torch.from_numpy(block_mask.blocks.copy()), Br, Bc


_MASKS: collections.OrderedDict = collections.OrderedDict()
_MAX_MASKS = 16


def rebuild_mask(blocks: Optional[Tensor], block_r: int, block_c: int, Nq: int, Nk: int):
    """The BlockMask for these operator arguments: the same object for the same grid, so that
    the kernels' per-mask caches (the tile lists of ``flashedu.triton.sparse``) stay warm."""
    if blocks is None:
        return None
    from .masks import BlockMask

    grid = blocks.detach().cpu().numpy().astype(bool, copy=False)
    key = (grid.tobytes(), grid.shape, block_r, block_c, Nq, Nk)
    mask = _MASKS.get(key)
    if mask is None:
        mask = BlockMask(grid.copy(), (block_r, block_c), (Nq, Nk))
        _MASKS[key] = mask
        if len(_MASKS) > _MAX_MASKS:
            _MASKS.popitem(last=False)
    else:
        _MASKS.move_to_end(key)
    return mask


# ---------------------------------------------------------------------------------------------
# The operators of a Kernels: its forward and backward with the mask as a tensor, their shape
# rules, their derivative and their vmap rule
# ---------------------------------------------------------------------------------------------

def _define_operators(kernels: Kernels):
    name = kernels.name

    def call_of(q, k, is_causal, scale, blocks, block_r, block_c, dropout_p, rng):
        mask = rebuild_mask(blocks, block_r, block_c, q.shape[2], k.shape[2])
        return Call(is_causal, scale, mask, dropout_p, rng)

    @torch.library.custom_op(f"flashedu::{name}_forward", mutates_args=())
    def forward_op(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                   blocks: Optional[Tensor], block_r: int, block_c: int,
                   dropout_p: float = 0.0, rng: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        call = call_of(q, k, is_causal, scale, blocks, block_r, block_c, dropout_p, rng)
        return kernels.forward(q, k, v, call)

    @forward_op.register_fake
    def _(q, k, v, is_causal, scale, blocks, block_r, block_c, dropout_p=0.0, rng=None):
        out, = kernels.empty_outputs(q)
        return out, q.new_empty(q.shape[:3], dtype=kernels.lse_dtype(q.dtype))

    @torch.library.custom_op(f"flashedu::{name}_backward", mutates_args=())
    def backward_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                    is_causal: bool, scale: float, blocks: Optional[Tensor], block_r: int,
                    block_c: int, dropout_p: float = 0.0,
                    rng: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        call = call_of(q, k, is_causal, scale, blocks, block_r, block_c, dropout_p, rng)
        return tuple(kernels.backward(q, k, v, out, lse, dout, call))

    @backward_op.register_fake
    def _(q, k, v, out, lse, dout, is_causal, scale, blocks, block_r, block_c, dropout_p=0.0,
          rng=None):
        return kernels.empty_outputs(q, k, v)

    def setup_context(ctx, inputs, output):
        q, k, v, is_causal, scale, blocks, block_r, block_c, dropout_p, rng = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)  # handed to the backward only, never differentiated
        # rng (two int64) is all the backward needs to regenerate the dropout mask
        ctx.save_for_backward(q, k, v, out, lse, blocks, rng)
        ctx.params = (is_causal, scale, block_r, block_c, dropout_p)

    def derivative(ctx, dout, _dlse):
        q, k, v, out, lse, blocks, rng = ctx.saved_tensors
        is_causal, scale, block_r, block_c, dropout_p = ctx.params
        dq, dk, dv = backward_op(q, k, v, out, lse, dout, is_causal, scale, blocks, block_r,
                                 block_c, dropout_p, rng)
        return dq, dk, dv, None, None, None, None, None, None, None

    def no_second_order(ctx, *grads):
        raise second_order_error(name)

    forward_op.register_autograd(derivative, setup_context=setup_context)
    backward_op.register_autograd(no_second_order, setup_context=lambda ctx, inputs, output: None)
    _register_vmap(forward_op, backward_op, name)
    return forward_op, backward_op


def _fold(t, dim, size):
    """(size, B, ...) -> (size * B, ...), the mapped dim ``dim`` (None: broadcast) first."""
    t = t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)
    return t.reshape(size * t.shape[1], *t.shape[2:])


def _fold_blocks(blocks, size):
    if blocks is None or blocks.shape[0] == 1:  # shared by every batch entry
        return blocks
    return blocks.repeat(size, 1, 1, 1)


def _register_vmap(forward_op, backward_op, backend: str):
    """vmap: the mapped dim folds into the batch dim B (the kernels already loop over it)."""

    def check(in_dims, tensor_args):
        if in_dims[tensor_args] is not None:
            raise RuntimeError(f"torch.func.vmap over a block mask is not supported by "
                               f"flashedu.attention(backend={backend!r}): map q, k, v only")
        if len(in_dims) > tensor_args + 4 and in_dims[tensor_args + 4] is not None:
            raise RuntimeError(f"torch.func.vmap over the dropout RNG state is not supported "
                               f"by flashedu.attention(backend={backend!r}): map q, k, v only")

    def forward_vmap(info, in_dims, q, k, v, is_causal, scale, blocks, block_r, block_c,
                     dropout_p=0.0, rng=None):
        check(in_dims, 5)
        n = info.batch_size
        q, k, v = (_fold(t, d, n) for t, d in zip((q, k, v), in_dims[:3]))
        out, lse = forward_op(q, k, v, is_causal, scale, _fold_blocks(blocks, n), block_r,
                              block_c, dropout_p, rng)
        return (out.unflatten(0, (n, -1)), lse.unflatten(0, (n, -1))), (0, 0)

    def backward_vmap(info, in_dims, q, k, v, out, lse, dout, is_causal, scale, blocks,
                      block_r, block_c, dropout_p=0.0, rng=None):
        check(in_dims, 8)
        n = info.batch_size
        q, k, v, out, lse, dout = (_fold(t, d, n) for t, d in
                                   zip((q, k, v, out, lse, dout), in_dims[:6]))
        grads = backward_op(q, k, v, out, lse, dout, is_causal, scale, _fold_blocks(blocks, n),
                            block_r, block_c, dropout_p, rng)
        return tuple(g.unflatten(0, (n, -1)) for g in grads), (0, 0, 0)

    forward_op.register_vmap(forward_vmap)
    backward_op.register_vmap(backward_vmap)
