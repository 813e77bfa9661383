"""The host side of the kernels: outputs laid out dense in their inputs' order, the
interpreter's float32 copies, a call's launches kept as a plan and repeated (``fast.PLANS``),
smaller tiles after an out-of-resources error.

forward.py and backward.py hold the kernels and what a launch passes them (their
``launch_args``); the functions here allocate a call's outputs, start its launches and
remember them. The kernels and their arguments are looked up in their modules at each call
(``fwd.forward_kernel``), so that a kernel replaced there (a test's stand-in, or an earlier
commit's forward.py under ``flashedu bench forward --prev``) is the one launched.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from .. import runtime
from . import backward as bwd
from . import fa3, fa3_backward, fast
from . import forward as fwd
from .autograd import resolve_config
from .config import smaller


def interpreter_fp32(interpreted: bool, *tensors):
    """The tensors a launch should use: under Triton's interpreter, 16-bit inputs as float32
    (its 16-bit tl.dot gives wrong results), so the caller casts the outputs back; compiled
    on a GPU, the tensors themselves."""
    if not interpreted:
        return tensors
    return tuple(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
                 for t in tensors)


def kernel_layout(t):
    """The kernels index rows and heads by stride but need the last dim contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dout_layout(q, do):
    """dO as the backward's kernels take it: contiguous where q is and FlashAttention-3's
    kernels run on q's device (its backward walks q's and dO's rows with one descriptor each),
    else with its own strides (the Triton kernels take them apart from q's: no copy)."""
    if q.is_contiguous() and fa3.runs_on(q.device):
        return do.contiguous()
    return kernel_layout(do)


def dense_like(t):
    """An empty tensor of t's shape and dtype, dense, with t's order of dims in memory (and the
    last dim last): t's own strides when t is dense. The q, k, v views that a transformer
    splits out of one (B, N, 3, H, d) projection leave gaps between rows; their outputs are
    laid out (B, N, H, d), where the layer's next reshape to (B, N, H * d) is a view, as
    SDPA's are."""
    empty = torch.empty_like(t)  # t's strides if t is dense, else contiguous
    if empty.stride() == t.stride() or t.dim() < 2:
        return empty
    last = t.dim() - 1
    order = sorted(range(last), key=lambda i: -t.stride(i)) + [last]  # stable: ties keep order
    out = torch.empty([t.shape[i] for i in order], dtype=t.dtype, device=t.device)
    return out.permute(*sorted(range(t.dim()), key=order.__getitem__))


def outputs_like(*tensors):
    """(inputs, outputs) for kernels that write each output with its input's strides: the
    outputs dense (:func:`dense_like`), an input whose strides differ (memory with gaps or
    overlaps) copied into its output's layout first."""
    outs = [dense_like(t) for t in tensors]
    tensors = tuple(t if o.stride() == t.stride() else torch.empty_like(o).copy_(t)
                    for t, o in zip(tensors, outs))
    return tensors, outs


def _rng_of(call) -> tuple:
    """The call's dropout RNG state as the launches take it after their leading tensors:
    (rng,) with dropout, () without."""
    return (call.rng,) if call.dropout_p > 0 else ()


# ----- the forward ------------------------------------------------------------------------

_SHRUNK_FORWARD: dict = {}  # tiles whose launch ran out of resources -> the tiles that fit


def forward(q, k, v, call, *, tiles=None, interpreted=None, keep=None):
    """Launch the forward of one call. Returns (O, L2): L2 is the base-2 logsumexp (B, H, Nq),
    float32, of the base-2 scores scale*log2(e)*q.k; +inf for a row that sees no key.

    ``call`` (``flashedu.ops.Call``): the call's checked options. is_causal, scale and
    block_mask; dropout_p > 0 with rng = tensor([seed, offset]) on q's device (the RNG state of
    ``flashedu.dropout``; L2 is still that of the undropped scores); mods, a score mod compiled
    in (the library's, or one written in Triton; L2 is then that of the modded scores) and the
    block mask's mask mod on its partial tiles; sinks, the (H,) sink logits (L2 includes them);
    seqs, packed sequences (``flashedu.varlen.Packing``; q of batch 1 holds them all).
    ``tiles``: the forward's tiles (None: the tile table's for this call); ``interpreted``:
    whether Triton runs in its interpreter (None: as :mod:`flashedu.runtime` decided).
    ``keep``: a list; the call's launch plan (``fast.Launch``) is appended to it, if the call
    has one (a repeated call's shortest path keeps it: ``flashedu.triton_backend``)."""
    q, k, v = (kernel_layout(t) for t in (q, k, v))
    is_causal, scale, block_mask = call.is_causal, call.scale, call.block_mask
    dropout_p, rng, mods, sinks, seqs = call.dropout_p, call.rng, call.mods, call.sinks, call.seqs
    if interpreted is None:
        interpreted = runtime.triton_interpreted()
    if tiles is None:
        config = resolve_config(q.shape[-1], q.dtype, block_mask, q.device)
        settings = (None if interpreted else
                    config.fa3_settings(q.shape[2], k.shape[2], call.is_causal,
                                        dropout_p > 0))
        if settings is not None and fa3.usable(q, k, v, call):
            return _fa3_forward(q, k, v, call, settings, keep)
        # packed sequences: the tiles of the longest one's keys
        tiles = config.forward_tiles(block_mask, k.shape[2] if seqs is None else
                                     seqs.max_seqlen_k, dropout_p > 0)
    q32, k32, v32 = interpreter_fp32(interpreted, q, k, v)
    o = dense_like(q32)  # the kernel takes O's strides apart from Q's: no copy of q
    lse2 = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if sinks is not None:
        sinks = sinks.float().contiguous()
    # the call's own tensors: the first five, then dropout's RNG state and the sinks, if any
    fresh = _rng_of(call) + ((sinks,) if sinks is not None else ())
    live = (q32, k32, v32, o, lse2, *fresh)
    # a call laid out as an earlier one repeats its launch (fast.PLANS); a score mod or an
    # attn_mask is a Python object or data that the plan's key cannot hold (a mask mod is
    # part of the block mask, which the key holds). The kernel is keyed by id (hashing a
    # JITFunction costs a Python call); the plan holds it, so the id stays its own. Packed
    # sequences bring new cuts with each batch: no plan.
    plan_key = plan = None
    if (mods is None or mods.mask_mod_only) and seqs is None:
        plan_key = fast.signature((q32, k32, v32, *live[5:]), id(fwd.forward_kernel), is_causal,
                                  scale, block_mask, mods is not None, tiles, interpreted,
                                  dropout_p, sinks is not None)
        plan = fast.PLANS.get(plan_key)
    if plan is not None:
        plan.start(*live)
    else:
        # the tiles a launch shrank to are remembered per kernel variant (dropout and mods
        # need more shared memory than the plain kernel, whose tiles their shrinking must
        # leave alone)
        key = (tiles, q.shape[-1], q.dtype, dropout_p > 0, mods is not None)
        launch = _launch(q32, k32, v32, o, lse2, key, is_causal=is_causal, scale=scale,
                         block_mask=block_mask, tiles=tiles, interpreted=interpreted,
                         dropout_p=dropout_p, rng=rng, mods=mods, sinks=sinks, seqs=seqs)
        if plan_key is not None:
            fast.remember(plan_key, launch)
            plan = launch
    if keep is not None and plan is not None:
        keep.append(plan)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), lse2


def _fa3_forward(q, k, v, call, settings, keep):
    """The forward by FlashAttention-3's schedule (fa3.py), through a launch plan as the
    Triton kernel's. Its O takes Q's strides: a q with gaps is copied first, and then the
    plan is not kept for a Repeat, which would start it with the caller's q."""
    given = q
    (q,), (o,) = outputs_like(q)
    lse2 = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    # the settings too (one function makes them, keys in one order): a call given another
    # table entry (``config``) launches its own
    key = fast.signature((q, k, v), id(fa3.fa3_forward_kernel), call.is_causal, call.scale,
                         call.dropout_p, *settings.values())
    plan = fast.PLANS.get(key)
    if plan is not None:
        plan.start(q, k, v, o, lse2, *_rng_of(call))
    else:
        plan = fa3.forward(q, k, v, o, lse2, is_causal=call.is_causal, scale=call.scale,
                           dropout_p=call.dropout_p, rng=call.rng, **settings)
        fast.remember(key, plan)
    if keep is not None and q is given:
        keep.append(plan)
    return o, lse2


def forward_into(q, k, v, o, lse2, *, is_causal, scale, tiles, interpreted):
    """Attention of q against k, v merged, in place, into (o, lse2), the result over keys seen
    before: the kernel starts its online softmax from that result (``prev``) instead of from
    nothing, so no merge pass and no per-call output exist (ring attention's micro-step).

    o: float32, q's shape and strides (a row slice of a larger tensor is fine); lse2: float32
    (B, H, Nq), the base-2 logsumexp, +inf for a row that has seen no key yet (then its o is 0).
    Start from o = 0 and lse2 = +inf; after the last call o is the normalized output."""
    if o.dtype != torch.float32 or lse2.dtype != torch.float32:
        raise TypeError(f"o and lse2 must be float32 running results, got {o.dtype} and "
                        f"{lse2.dtype}")
    if o.shape != q.shape or o.stride() != q.stride():
        raise ValueError(f"o must have q's shape and strides, got {tuple(o.shape)} "
                         f"{o.stride()} for q's {tuple(q.shape)} {q.stride()}")
    if lse2.shape != q.shape[:3] or not lse2.is_contiguous():
        raise ValueError(f"lse2 must be a contiguous (B, H, Nq) = {tuple(q.shape[:3])} tensor, "
                         f"got {tuple(lse2.shape)} with strides {lse2.stride()}")
    q32, k32, v32 = interpreter_fp32(interpreted, q, k, v)
    # the interpreter's float32 copy of a 16-bit row slice is contiguous: o must match it
    o32 = o if q32.stride() == o.stride() else o.contiguous()
    _launch(q32, k32, v32, o32, lse2, (tiles, q.shape[-1], q.dtype, "resume"),
            is_causal=is_causal, scale=scale, block_mask=None, tiles=tiles,
            interpreted=interpreted, prev=(o32, lse2))
    if o32 is not o:
        o.copy_(o32)


def _launch(q, k, v, o, lse2, key, *, tiles, **kwargs):
    """forward_kernel over (q, k, v) into (o, lse2), with smaller tiles after an
    out-of-resources error (remembered under ``key`` for later calls). Returns the launch
    (``fast.Launch``), to be repeated with the call's own tensors: q, k, v, o, lse2, then the
    dropout RNG state and the sinks, if any."""
    tiles = _SHRUNK_FORWARD.get(key, tiles)
    while True:
        grid, args, consts = fwd.launch_args(q, k, v, o, lse2, tiles=tiles, **kwargs)
        # q, k, v, o, lse2 lead forward_launch's arguments; the RNG state and sinks follow
        fresh = [kwargs["rng"]] if kwargs.get("dropout_p", 0) > 0 else []
        fresh += [kwargs["sinks"]] if kwargs.get("sinks") is not None else []
        own = fast.slots(args, 5, *fresh)
        try:
            return fast.launch(fwd.forward_kernel, grid, args, consts,
                               fast.switches(tiles, kwargs["interpreted"], k, v), own)
        except fast.OUT_OF_RESOURCES as exc:
            tiles = fast.shrink(key, tiles, exc, _SHRUNK_FORWARD)


# ----- the backward -----------------------------------------------------------------------

_SHRUNK_BACKWARD: dict = {}  # configs whose launch ran out of resources -> the configs that fit


def preprocess(o, do, rows, sinks=None, lse2=None, dlse=None):
    """D = rowsum(dO * O), float32 (B, H, Nq); with ``sinks`` (and the base-2 ``lse2``, and
    ``dlse`` the natural lse's gradient if any) also the sinks' gradient, float32 (H,), from
    the same pass: returns (D, dsinks)."""
    B, H, Nq = o.shape[:3]
    D = torch.empty((B, H, Nq), dtype=torch.float32, device=o.device)
    sink = part = None
    if sinks is not None:
        part = torch.empty((B * H, -(-Nq // rows)), dtype=torch.float32, device=o.device)
        sink = (sinks.float().contiguous(), lse2.contiguous(), part)
        dlse = None if dlse is None else dlse.float().contiguous()
    fast.run(bwd.preprocess_kernel, *bwd._preprocess_launch(o, do, D, rows, sink, dlse))
    if sinks is None:
        return D
    return D, part.view(B, H, -1).sum(dim=(0, 2))


def backward(q, k, v, o, lse2, do, call, dlse=None, mask_grad=False, D=None, *, config=None,
             interpreted=None, keep=None, into=None):
    """Launch the kernels; returns (dQ, dK, dV) in the inputs' dtype. ``call`` as the
    forward's: with dropout, its rng is the forward's [seed, offset] and the kernels regenerate
    its mask. ``dlse``: the gradient of the natural-log lse, if the call returned it
    (d lse_i / d s_ij = P_ij, so it is subtracted from D_i). ``mask_grad``: also return the
    gradient of the float attn_mask in ``call.mods`` (dS_ij, summed to the mask's shape).
    ``D``: rowsum(dO * O), float32 (B, H, Nq) contiguous, when the caller has it already (ring
    attention computes it once for all its calls); otherwise the preprocess kernel computes it.
    ``config``: the tile table's entry (None: the one for these inputs); ``interpreted`` as the
    forward's.

    ``config.fused_backward``: the dK/dV and dQ programs share one launch (and the dK/dV
    tiles' warps and stages) for keys shorter than ``config.split_from``; otherwise two
    launches, each with its own.
    ``keep``: a list; the call's launch plan, (the preprocess's launch or None, [the kernel's
    launches]), is appended to it, if the call has one (as the forward's).
    ``into``: (dQ, dK, dV) buffers of q's, k's and v's shapes, any strides and dtypes: the
    kernels add this call's gradients to them (no tensors of the call's own; float32 buffers
    sum many calls with one rounding each). Returns ``into``."""
    q, k, v, o = (kernel_layout(t) for t in (q, k, v, o))
    do = dout_layout(q, do)
    is_causal, scale, block_mask = call.is_causal, call.scale, call.block_mask
    dropout_p, rng, mods, seqs = call.dropout_p, call.rng, call.mods, call.seqs
    if interpreted is None:
        interpreted = runtime.triton_interpreted()
    if config is None:
        config = resolve_config(q.shape[-1], q.dtype, block_mask, q.device)
    # FlashAttention-3's backward adds dQ in L2 in arrival order: bit-different run to run, so
    # not where torch.use_deterministic_algorithms asks (the Triton kernels' dQ pass adds none)
    plain = (FA3_BACKWARD and not interpreted and into is None and dlse is None
             and not mask_grad and not torch.are_deterministic_algorithms_enabled())
    settings = (config.fa3_backward_settings(q.shape[2], k.shape[2], is_causal, dropout_p > 0)
                if plain else None)
    if settings is not None and fa3_backward.usable(q, k, v, do, call):
        try:
            return _fa3_backward(q, k, v, o, lse2, do, call, D, settings, keep,
                                 config.preprocess_rows)
        except _Fa3LaunchFailed as exc:
            _fa3_backward_failed(exc.__cause__)
    dtype = q.dtype
    q, k, v, o, do = interpreter_fp32(interpreted, q, k, v, o, do)
    if into is None:  # the kernels take each gradient's strides: no copies of q, k, v
        dq, dk, dv = dense_like(q), dense_like(k), dense_like(v)
    else:
        dq, dk, dv = _check_into(into, q, k, v)
    config = config.backward_entry(is_causal, dropout_p > 0, block_mask,
                                   k.shape[2] if seqs is None else seqs.max_seqlen_k)
    B, H, Nq = q.shape[:3]
    Nk = k.shape[2]
    own_D = D is None
    if own_D:
        D = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    # the call's own tensors, in the order the kernel takes them first (rng after them)
    live = (q, k, v, do, lse2, D, dq, dk, dv) + _rng_of(call)
    # a call laid out as an earlier one repeats its launches (fast.PLANS); a score mod or an
    # attn_mask, an lse gradient and the mask's gradient take the general path (a mask mod
    # is part of the block mask, which the key holds)
    plan_key = None  # (packed sequences bring new cuts with each batch: no plan)
    if (mods is None or mods.mask_mod_only) and dlse is None and not mask_grad and seqs is None:
        given = live[6:9] if into is not None else ()  # outputs laid out by the caller
        plan_key = fast.signature((*live[:6], o, *live[9:], *given), id(bwd.backward_kernel),
                                  own_D, config, is_causal, scale, block_mask, mods is not None,
                                  interpreted, dropout_p, into is not None)
        plan = fast.PLANS.get(plan_key)
        if plan is not None:
            if keep is not None:
                keep.append(plan)
            first, launches = plan
            stream = fast.stream_for(first, *launches)
            if first is not None:
                first.start(o, do, D, stream=stream)
            for launch in launches:
                launch.start(*live, stream=stream)
            return _returned(into, (dq, dk, dv), dtype)
    key = (config, q.shape[-1], dtype, dropout_p > 0, mods is not None)  # per kernel variant
    if _SHRUNK_BACKWARD:
        config = _SHRUNK_BACKWARD.get(key, config)
    first = None  # the preprocess's launch, for the plan
    if own_D:
        first = _preprocess(o, do, D, config.preprocess_rows, planned=plan_key is not None)
    if dlse is not None:
        D = D - dlse.to(torch.float32).reshape(D.shape)
    dbias = None
    if mask_grad:
        dbias = torch.zeros((B, H, Nq, Nk), dtype=torch.float32, device=q.device)
    while True:
        args, kernel_launches = bwd.launch_args(
            q, k, v, do, lse2, D, dq, dk, dv, is_causal=is_causal, scale=scale,
            block_mask=block_mask, config=config, interpreted=interpreted, dropout_p=dropout_p,
            rng=rng, mods=mods, dbias=dbias, accumulate=into is not None, seqs=seqs)
        launches = []
        try:
            for grid, consts in kernel_launches:
                fast.run(bwd.backward_kernel, grid, args, consts)
                if plan_key is not None:  # live: the first nine arguments, then rng
                    own = fast.slots(args, 9, *live[9:])
                    launches.append(fast.Launch(bwd.backward_kernel, grid, args, consts, own))
            break
        except fast.OUT_OF_RESOURCES as exc:  # smaller tiles for both kinds of program
            t1, t2 = config.dkdv, config.dq
            new1, new2 = smaller(t1), smaller(t2)
            if new1 is None and new2 is None:
                raise
            config = dataclasses.replace(config, dkdv=new1 or t1, dq=new2 or t2,
                                         causal_backward=None)
            warnings.warn(f"flashedu: {exc}; retrying the backward with smaller tiles "
                          f"{config.dkdv}, {config.dq}", stacklevel=2)
            _SHRUNK_BACKWARD[key] = config
    if plan_key is not None:
        fast.remember(plan_key, (first, launches))
        if keep is not None:
            keep.append((first, launches))
    grads = _returned(into, (dq, dk, dv), dtype)
    if mask_grad:
        attn_mask = mods.attn_mask
        return (*grads, dbias.sum_to_size(attn_mask.shape).to(attn_mask.dtype))
    return grads


FA3_BACKWARD = True  # False once its first launch failed here: the Triton kernels from then on


class _Fa3LaunchFailed(Exception):
    """The fa3 backward's first launch in this process raised (before it computed anything)."""


def _fa3_backward_failed(exc):
    global FA3_BACKWARD
    FA3_BACKWARD = False
    warnings.warn(f"flashedu: FlashAttention-3's backward failed to launch "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); the Triton "
                  f"kernels' backward from now on", stacklevel=3)


def _fa3_backward(q, k, v, o, lse2, do, call, D, settings, keep, rows):
    """The backward by FlashAttention-3's schedule (fa3_backward.py), through a launch plan as
    the Triton kernels': the preprocess's D = rowsum(dO * O) (unless given; ``rows`` a program, the
    entry's), then the kernel."""
    given = (k, v)
    (k, v), (dk, dv) = outputs_like(k, v)  # dK, dV take K's and V's strides
    dq = torch.empty_like(q)
    lse2 = lse2.contiguous()
    own_D = D is None
    if own_D:
        D = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    live = (q, k, v, do, lse2, D, dq, dk, dv) + _rng_of(call)
    key = fast.signature((q, k, v, o, do, lse2), id(fa3_backward.fa3_backward_kernel), own_D,
                         call.is_causal, call.scale, call.dropout_p, rows,
                         *settings.values())
    plan = fast.PLANS.get(key)
    if plan is None:
        first = _preprocess(o, do, D, rows, planned=True) if own_D else None
        try:  # a launch that fails before computing anything leaves the call to the others
            step = fa3_backward.Step.made(*live, is_causal=call.is_causal, scale=call.scale,
                                          dropout_p=call.dropout_p, **settings)
        except RuntimeError as exc:
            raise _Fa3LaunchFailed from exc
        plan = (first, [step])
        fast.remember(key, plan)
    else:
        first, (step,) = plan
        stream = fast.stream_for(first, step)
        if first is not None:
            first.start(o, do, D, stream=stream)
        step.start(*live, stream=stream)
    copied = k is not given[0] or v is not given[1]
    if keep is not None and not copied:  # a Repeat would start it with the caller's k, v
        keep.append(plan)
    return dq, dk, dv


def _preprocess(o, do, D, rows, planned: bool):
    """D = rowsum(dO * O) into ``D`` by the preprocess kernel, ``rows`` rows a program; its
    launch (``fast.Launch``, O, dO and D its call's own) if a plan keeps it, else None."""
    grid, args, consts = bwd._preprocess_launch(o, do, D, rows)
    fast.run(bwd.preprocess_kernel, grid, args, consts)
    return fast.Launch(bwd.preprocess_kernel, grid, args, consts, (0, 1, 2)) if planned else None


def _returned(into, grads, dtype):
    """What a call returns: the caller's buffers it added to, or its gradients in the inputs'
    dtype (the interpreter computes 16-bit inputs in float32)."""
    if into is not None:
        return into
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in grads)


def _check_into(into, q, k, v):
    """The (dQ, dK, dV) buffers a call adds to: q's, k's and v's shapes, on their device."""
    if not isinstance(into, (tuple, list)) or len(into) != 3:
        raise TypeError(f"into must be a (dq, dk, dv) tuple of tensors, got {type(into).__name__}")
    for name, buf, x in zip(("dq", "dk", "dv"), into, (q, k, v)):
        if buf.shape != x.shape or buf.device != x.device:
            raise ValueError(f"into: {name} must have shape {tuple(x.shape)} on {x.device}, "
                             f"got {tuple(buf.shape)} on {buf.device}")
    return into
