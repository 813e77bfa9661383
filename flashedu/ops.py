"""flashedu's kernels as PyTorch operators (``torch.library``).

A kernel that PyTorch sees as one operator, with a shape rule and a derivative, works with the
rest of PyTorch: ``torch.compile(fullgraph=True)`` puts it in the graph as one node (its fake
implementation gives the output shapes without running it), meta and fake tensors get shapes,
CUDA graphs capture forward and backward, and ``torch.func.vmap`` folds its batch into B.

    torch.ops.flashedu.triton_forward(q, k, v, is_causal, scale, blocks, block_r, block_c,
                                      dropout_p=0.0, rng=None) -> (out, lse)
                                        the Triton kernels (flashedu.triton)
    torch.ops.flashedu.triton_backward(q, k, v, out, lse, dout, is_causal, scale,
                                       blocks, block_r, block_c, dropout_p=0.0, rng=None)
                                        -> (dq, dk, dv)
    torch.ops.flashedu.numpy_forward / numpy_backward: the same, by flashedu.tiled (NumPy)

q: (B, H, Nq, d); k, v: (B, Hkv, Nk, d), H a multiple of Hkv. ``lse`` is what the backward
needs from the forward, (B, H, Nq), float32 (float64 for numpy's float64): the Triton kernels
keep it in base 2 (their exp2 softmax), NumPy in the natural log. Use it only to hand it back.

A :class:`flashedu.BlockMask` is not a tensor, so the operators take its tile grid ``blocks``
(bool (b, h, Tr, Tc), b and h 1 or B and H, or None without a mask) and its block size;
``is_causal`` already includes the mask's own flag. The operator rebuilds the mask from them
(cached: a training loop passes the same grid every step).

Dropout (the paper's Algorithms 2 and 4): ``dropout_p`` and ``rng``, an int64 tensor
[seed, offset] drawn by :func:`flashedu.dropout.draw_rng` from torch's generator of the inputs'
device, are operator arguments: torch.compile sees them, and a CUDA graph that captures a
call captures the draw too (a new mask at every replay, as torch's own dropout under graphs).
The forward saves ``rng`` for the backward, which regenerates the mask from it.

Mask mods, score mods and ``attn_mask`` (``flashedu.mods``) are Python objects or data the
operators do not take: a call that uses them, or asks for the logsumexp, runs the same
implementations under one ``autograd.Function`` (:class:`Mods`), a graph break under
``torch.compile``. On meta and fake tensors it gives outputs and gradients of the right shapes,
dtypes and layouts, as the operators' fake implementations do; torch.func transforms (vmap,
grad) do not reach it and are refused with a message.

The derivative is the kernels' backward. Its own derivative (a second backward, after
``create_graph=True``) is not implemented: asking for one raises a RuntimeError, never a
silently wrong zero. ``torch.func.grad`` is refused with a message too (the derivative is
registered for torch.autograd); ``torch.func.vmap`` works.

:func:`attention` is what the backends call. A plain eager call (real tensors, nothing
compiling, no transform or dispatch mode) runs the same implementations under one
``autograd.Function`` instead: the operator's trips through the dispatcher cost tens of
microseconds a call, forward and backward, which is the whole budget of a small attention.
"""

from __future__ import annotations

import collections
from typing import Optional

import torch
from torch import Tensor

# The backward of these kernels is not differentiable: the naive backend is (plain torch ops).
SECOND_ORDER_BACKENDS = ("naive",)


def attention(backend: str, q, k, v, *, is_causal: bool, scale: float, block_mask,
              dropout_p: float = 0.0, attn_mask=None, score_mod=None, return_lse=False):
    """The output of ``torch.ops.flashedu.<backend>_forward``: what the backends call.

    A plain eager call (real tensors, no compile, no transform, no dispatch mode) skips the
    operator's trips through the dispatcher (tens of microseconds a call, forward and
    backward) and runs the same implementation under :class:`_EagerAttention`, which gives
    the same values, gradients and errors. ``dropout_p`` > 0 draws the call's RNG state
    (seed, offset) from torch's generator of q's device."""
    rng = None
    if dropout_p > 0:
        from .dropout import draw_rng

        rng = draw_rng(q.device)
    mods = Mods.of(attn_mask, score_mod, block_mask)
    if mods is not None or return_lse:  # Python objects the operators cannot carry
        out, lse = _modded(backend, q, k, v, mods and mods.attn_mask, is_causal, scale,
                           block_mask, dropout_p, rng, mods, return_lse)
        return (out, lse) if return_lse else out
    if plain_eager(q, k, v):
        return _EagerAttention.apply(backend, q, k, v, is_causal, scale, block_mask, dropout_p,
                                     rng)
    try:
        out, _ = FORWARD_OPS[backend](q, k, v, is_causal, scale, *mask_args(block_mask),
                                      dropout_p, rng)
    except RuntimeError:
        if any(torch._C._functorch.is_gradtrackingtensor(t) for t in (q, k, v)):
            raise RuntimeError(
                f"torch.func.grad (and jacrev, jvp, hessian) cannot differentiate "
                f"flashedu.attention(backend={backend!r}): its derivative is registered for "
                f"torch.autograd only. Use torch.autograd.grad or .backward() (torch.func.vmap "
                f"alone works), or backend={SECOND_ORDER_BACKENDS[0]!r}, plain torch ops that "
                f"every torch.func transform differentiates.") from None
        raise
    return out


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
# The implementations: (out, lse) and (dq, dk, dv), given a BlockMask or None
# ---------------------------------------------------------------------------------------------

def _kernel_layout(t: Tensor) -> Tensor:
    """The Triton kernels index rows and heads by stride but need the last dim contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _dropout_kwargs(dropout_p, rng):
    """The launch code's dropout arguments: none without dropout (the kernels as before)."""
    return {} if dropout_p == 0 else {"dropout_p": dropout_p, "rng": rng}


def _mods_kwargs(mods, dlse=None, mask_grad=False):
    """The Triton launch code's arguments for masks, score mods, an lse gradient and the
    attn_mask's gradient: none when the call has none (the kernels as without them)."""
    kwargs = {} if mods is None else {"mods": mods}
    if dlse is not None:
        kwargs["dlse"] = dlse
    if mask_grad:
        kwargs["mask_grad"] = True
    return kwargs


def _numpy_mods_kwargs(mods, dlse=None, mask_grad=False):
    """The same for flashedu.numpy_backend (its keywords; the mask mod rides on the mask)."""
    kwargs = {}
    if mods is not None:
        kwargs.update(attn_mask=mods.attn_mask, score_mod=mods.score_mod)
    if dlse is not None:
        kwargs["d_lse"] = dlse
    if mask_grad:
        kwargs["mask_grad"] = True
    return kwargs


def triton_forward_impl(q, k, v, is_causal, scale, mask, dropout_p=0.0, rng=None, mods=None):
    """The Triton forward; lse is the base-2 logsumexp, +inf for an empty row."""
    from . import runtime
    from .triton.autograd import resolve_config
    from .triton.forward import forward

    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    config = resolve_config(q.shape[-1], q.dtype, mask, q.device)
    return forward(q, k, v, is_causal=is_causal, scale=scale, block_mask=mask,
                   tiles=config.forward_tiles(mask, k.shape[2], dropout_p > 0),
                   interpreted=runtime.triton_interpreted(),
                   **_dropout_kwargs(dropout_p, rng), **_mods_kwargs(mods))


def triton_backward_impl(q, k, v, out, lse, dout, is_causal, scale, mask, dropout_p=0.0,
                         rng=None, mods=None, dlse=None, mask_grad=False):
    """The Triton backward (Algorithm 4 of the paper, FlashAttention-2 order)."""
    from . import runtime
    from .triton.autograd import resolve_config
    from .triton.backward import backward

    q, k, v, out = (_kernel_layout(t) for t in (q, k, v, out))
    config = resolve_config(q.shape[-1], q.dtype, mask, q.device)
    return backward(q, k, v, out, lse, dout.contiguous(), is_causal=is_causal, scale=scale,
                    block_mask=mask, config=config, interpreted=runtime.triton_interpreted(),
                    **_dropout_kwargs(dropout_p, rng), **_mods_kwargs(mods, dlse, mask_grad))


def numpy_forward_impl(q, k, v, is_causal, scale, mask, dropout_p=0.0, rng=None, mods=None):
    """flashedu.tiled.flash_forward per head; lse natural-log, -inf for an empty row."""
    from .numpy_backend import forward

    return forward(q, k, v, is_causal=is_causal, scale=scale, block_mask=mask,
                   **_dropout_kwargs(dropout_p, rng), **_numpy_mods_kwargs(mods))


def numpy_backward_impl(q, k, v, out, lse, dout, is_causal, scale, mask, dropout_p=0.0,
                        rng=None, mods=None, dlse=None, mask_grad=False):
    """flashedu.tiled.flash_backward per head."""
    from .numpy_backend import backward

    return backward(q, k, v, out, lse, dout, is_causal=is_causal, scale=scale, block_mask=mask,
                    **_dropout_kwargs(dropout_p, rng), **_numpy_mods_kwargs(mods, dlse, mask_grad))


IMPLS = {"triton": (triton_forward_impl, triton_backward_impl),
         "numpy": (numpy_forward_impl, numpy_backward_impl)}


# ---------------------------------------------------------------------------------------------
# The operators: the implementations, with the mask as a tensor, and their shape rules
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("flashedu::triton_forward", mutates_args=())
def triton_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                   blocks: Optional[Tensor], block_r: int, block_c: int,
                   dropout_p: float = 0.0, rng: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    mask = rebuild_mask(blocks, block_r, block_c, q.shape[2], k.shape[2])
    return triton_forward_impl(q, k, v, is_causal, scale, mask, dropout_p, rng)


def _triton_outputs_like(*tensors):
    """Empty outputs laid out as the Triton launch code lays out its own (the same host
    functions decide): the fake implementations must give the real strides, which compiled
    code relies on."""
    from . import runtime
    from .triton.forward import interpreter_fp32, outputs_like

    dtype = tensors[0].dtype
    tensors = interpreter_fp32(runtime.triton_interpreted(), *map(_kernel_layout, tensors))
    _, outs = outputs_like(*tensors)
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in outs)


@triton_forward.register_fake
def _(q, k, v, is_causal, scale, blocks, block_r, block_c, dropout_p=0.0, rng=None):
    out, = _triton_outputs_like(q)
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashedu::triton_backward", mutates_args=())
def triton_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                    is_causal: bool, scale: float, blocks: Optional[Tensor], block_r: int,
                    block_c: int, dropout_p: float = 0.0,
                    rng: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    mask = rebuild_mask(blocks, block_r, block_c, q.shape[2], k.shape[2])
    return triton_backward_impl(q, k, v, out, lse, dout, is_causal, scale, mask, dropout_p, rng)


@triton_backward.register_fake
def _(q, k, v, out, lse, dout, is_causal, scale, blocks, block_r, block_c, dropout_p=0.0,
      rng=None):
    return _triton_outputs_like(q, k, v)


def _numpy_lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("flashedu::numpy_forward", mutates_args=())
def numpy_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                  blocks: Optional[Tensor], block_r: int, block_c: int,
                  dropout_p: float = 0.0, rng: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    mask = rebuild_mask(blocks, block_r, block_c, q.shape[2], k.shape[2])
    return numpy_forward_impl(q, k, v, is_causal, scale, mask, dropout_p, rng)


@numpy_forward.register_fake
def _(q, k, v, is_causal, scale, blocks, block_r, block_c, dropout_p=0.0, rng=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:3], dtype=_numpy_lse_dtype(q.dtype)))


@torch.library.custom_op("flashedu::numpy_backward", mutates_args=())
def numpy_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                   is_causal: bool, scale: float, blocks: Optional[Tensor], block_r: int,
                   block_c: int, dropout_p: float = 0.0,
                   rng: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    mask = rebuild_mask(blocks, block_r, block_c, q.shape[2], k.shape[2])
    return numpy_backward_impl(q, k, v, out, lse, dout, is_causal, scale, mask, dropout_p, rng)


@numpy_backward.register_fake
def _(q, k, v, out, lse, dout, is_causal, scale, blocks, block_r, block_c, dropout_p=0.0,
      rng=None):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


FORWARD_OPS = {"triton": triton_forward, "numpy": numpy_forward}
BACKWARD_OPS = {"triton": triton_backward, "numpy": numpy_backward}


# ---------------------------------------------------------------------------------------------
# Autograd: the forward saves (q, k, v, out, lse, rng); the backward operator consumes them
# ---------------------------------------------------------------------------------------------

def _register_autograd(forward_op, backward_op, backend: str):
    def setup_context(ctx, inputs, output):
        q, k, v, is_causal, scale, blocks, block_r, block_c, dropout_p, rng = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)  # handed to the backward only, never differentiated
        # rng (two int64) is all the backward needs to regenerate the dropout mask
        ctx.save_for_backward(q, k, v, out, lse, blocks, rng)
        ctx.params = (is_causal, scale, block_r, block_c, dropout_p)

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, blocks, rng = ctx.saved_tensors
        is_causal, scale, block_r, block_c, dropout_p = ctx.params
        dq, dk, dv = backward_op(q, k, v, out, lse, dout, is_causal, scale, blocks, block_r,
                                 block_c, dropout_p, rng)
        return dq, dk, dv, None, None, None, None, None, None, None

    forward_op.register_autograd(backward, setup_context=setup_context)

    def no_second_order(ctx, *grads):
        raise second_order_error(backend)

    backward_op.register_autograd(no_second_order, setup_context=lambda ctx, inputs, output: None)


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


_register_autograd(triton_forward, triton_backward, "triton")
_register_autograd(numpy_forward, numpy_backward, "numpy")


# ---------------------------------------------------------------------------------------------
# vmap: the mapped dim folds into the batch dim B (the kernels already loop over it)
# ---------------------------------------------------------------------------------------------

def _fold(t, dim, size):
    """(size, B, ...) -> (size * B, ...), the mapped dim ``dim`` (None: broadcast) first."""
    t = t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)
    return t.reshape(size * t.shape[1], *t.shape[2:])


def _fold_blocks(blocks, size):
    if blocks is None or blocks.shape[0] == 1:  # shared by every batch entry
        return blocks
    return blocks.repeat(size, 1, 1, 1)


def _register_vmap(forward_op, backward_op, backend: str):
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


_register_vmap(triton_forward, triton_backward, "triton")
_register_vmap(numpy_forward, numpy_backward, "numpy")


# ---------------------------------------------------------------------------------------------
# Plain eager calls: the same implementations and derivative, without the dispatcher trips
# ---------------------------------------------------------------------------------------------

class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, q, k, v, is_causal, scale, block_mask, dropout_p, rng):
        out, lse = IMPLS[backend][0](q, k, v, is_causal, scale, block_mask, dropout_p, rng)
        ctx.save_for_backward(q, k, v, out, lse, rng)
        ctx.params = (backend, is_causal, scale, block_mask, dropout_p)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng = ctx.saved_tensors
        backend, is_causal, scale, block_mask, dropout_p = ctx.params
        if torch.is_grad_enabled():  # create_graph=True: the operator, whose derivative says no
            grads = BACKWARD_OPS[backend](q, k, v, out, lse, dout, is_causal, scale,
                                          *mask_args(block_mask), dropout_p, rng)
        else:
            grads = IMPLS[backend][1](q, k, v, out, lse, dout, is_causal, scale, block_mask,
                                      dropout_p, rng)
        return (None, *grads, None, None, None, None, None)


# ---------------------------------------------------------------------------------------------
# Masks and score mods: Python objects, so the calls that use them skip the operators
# ---------------------------------------------------------------------------------------------

class Mods:
    """What a call adds to plain attention (``flashedu.mods``): SDPA's ``attn_mask``, a
    ``score_mod`` (bound to (Nq, Nk)), and the block mask's ``mask_mod`` when its partial tiles
    need it. The implementations take it as ``mods=``; None means none of them.

    Such calls run under :class:`_ModdedAttention` (one ``autograd.Function``) instead of the
    operators, which take tensors only: under ``torch.compile`` they are a graph break."""

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


def _triton_lse_to_natural(lse2):
    import math

    return torch.where(torch.isinf(lse2), -torch.inf, lse2 * math.log(2.0))


# lse as the implementations keep it -> natural log, -inf for a row that sees no key
LSE_TO_NATURAL = {"triton": _triton_lse_to_natural, "numpy": lambda lse: lse}


MODDED_CALL = "with attn_mask, score_mod, return_lse or a block mask's mask mod"


def _modded(*args):
    backend, q, k, v, attn_mask = args[:5]
    refuse_transforms(f"flashedu.attention(backend={backend!r}) {MODDED_CALL} (SDPA's vmap "
                      f"does take an attn_mask)", q, k, v, attn_mask)
    if torch.compiler.is_compiling():  # a graph break: torch.compile runs it as it is, eagerly
        return torch.compiler.disable(_ModdedAttention.apply)(*args)
    return _ModdedAttention.apply(*args)


def refuse_transforms(call: str, *tensors) -> None:
    """torch.func's vmap and grad wrap tensors that an ``autograd.Function`` without
    ``setup_context`` cannot take: say what works instead of torch's internal message."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if any(t is not None and wrapped(t) for t in tensors):
        raise NotImplementedError(
            f"torch.func transforms (vmap, grad, jacrev, ...) do not reach {call}: give the "
            f"mapped dimension to the batch B instead of vmap, or use backend="
            f"{SECOND_ORDER_BACKENDS[0]!r}, plain torch ops that every transform handles")


def _outputs_without_values(backend, q):
    """(out, lse) of meta or fake inputs, laid out as the implementations lay out theirs (the
    operators' fake implementations decide the same way)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if get_proxy_mode() is not None:  # a tracer would record these empty tensors as the result
        raise NotImplementedError(
            f"flashedu.attention(backend={backend!r}) {MODDED_CALL} computes on the host "
            f"with the tensors' values, which a tracer (make_fx, torch.export) does not have: "
            f"trace backend='naive', or let torch.compile run the call eagerly (a graph break)")
    if backend == "triton":
        out, = _triton_outputs_like(q)
        return out, q.new_empty(q.shape[:3], dtype=torch.float32)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:3], dtype=_numpy_lse_dtype(q.dtype)))


class _ModdedAttention(torch.autograd.Function):
    """(out, lse) of a call with mods, lse in the natural log; differentiable in both:
    d lse_i / d s_ij = P_ij, so the backward subtracts dlse_i from the row's
    D_i = rowsum(dO_i * O_i) (the implementations take ``dlse`` and do it). Where the caller
    did not ask for the lse (``want_lse`` False), the second output is the implementation's
    own, not converted: nobody reads it, and the conversion would cost three kernels."""

    @staticmethod
    def forward(ctx, backend, q, k, v, attn_mask, is_causal, scale, block_mask, dropout_p, rng,
                mods, want_lse=True):
        ctx.set_materialize_grads(False)  # an unused lse (or out) gets None, not zeros
        if holds_no_values(q, k, v, attn_mask):
            out, lse = _outputs_without_values(backend, q)
        else:
            out, lse = IMPLS[backend][0](q, k, v, is_causal, scale, block_mask, dropout_p, rng,
                                         mods=mods)
        ctx.save_for_backward(q, k, v, out, lse, rng)
        ctx.params = (backend, is_causal, scale, block_mask, dropout_p, mods)
        if not want_lse:
            ctx.mark_non_differentiable(lse)
            return out, lse
        return out, LSE_TO_NATURAL[backend](lse)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, rng = ctx.saved_tensors
        backend, is_causal, scale, block_mask, dropout_p, mods = ctx.params
        if dout is None:
            dout = torch.zeros_like(out)
        # a float attn_mask that requires grad (a learned bias) gets dS_ij, summed to its shape
        mask_grad = bool(mods is not None and mods.attn_mask is not None
                         and mods.attn_mask.is_floating_point() and ctx.needs_input_grad[4])
        if holds_no_values(q, k, v, dout):  # shapes only, as the operators' fake backward
            grads = [torch.empty_like(t, memory_format=torch.contiguous_format)
                     for t in (q, k, v)]
            dmask = torch.empty_like(mods.attn_mask) if mask_grad else None
            return (None, *grads, dmask, None, None, None, None, None, None, None)
        grads = IMPLS[backend][1](q, k, v, out, lse, dout, is_causal, scale, block_mask,
                                  dropout_p, rng, mods=mods, dlse=dlse, mask_grad=mask_grad)
        grads = refuse_second_order(backend, grads, q, k, v, dout, dlse,
                                    mods and mods.attn_mask)
        dmask = grads[3] if mask_grad else None
        return (None, *grads[:3], dmask, None, None, None, None, None, None, None)
