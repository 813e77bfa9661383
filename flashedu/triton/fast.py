"""How the kernels are launched: compiled kernels started again without Triton's dispatch
(``run``, below) and, where Triton's launcher has the layout ``Opened`` knows, through its C
launch function directly; a call's launches kept as a plan for the next call laid out alike
(``PLANS``); and Hopper's fast paths for the forward kernel with the fallback when a Triton
cannot build them.

- TMA: tiles fetched by the copy engine through tensor descriptors that the kernels make
  (``tl.make_tensor_descriptor``). Needs compute capability >= 9, 16-byte aligned base and
  strides, and an allocator for the descriptors' scratch memory.
- warp specialization: ``tl.range(..., warp_specialize=True)``; some warps load, others compute.

A kernel is launched with its fast switches on where the tile table asks for them; if that
build fails (seen on Triton 3.6: warp specialization with 4 warps crashes an MLIR pass), the
launch warns once, remembers the settings, and runs the pointer version.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings

import torch
import triton
from torch import Tensor
from triton.runtime.jit import JITFunction

_NO_FAST: set = set()  # launch settings whose fast build failed
OFF = {"TMA": False, "WARP_SPECIALIZE": False}

try:  # raised when a kernel needs more shared memory or registers than the device has
    from triton.runtime.errors import OutOfResources as OUT_OF_RESOURCES
except ImportError:  # pragma: no cover - every Triton 3 has it
    class OUT_OF_RESOURCES(Exception):  # noqa: N801
        pass


def shrink(key, tiles, exc, remembered: dict):
    """After Triton's out-of-resources error: the next smaller tiles (config.smaller), kept in
    ``remembered[key]`` so that later calls of this configuration start from them. Raises the
    error again when no smaller tiles are left."""
    from .config import smaller

    new = smaller(tiles)
    if new is None:
        raise exc
    warnings.warn(f"flashedu: {exc}; retrying with smaller tiles {new}", stacklevel=3)
    remembered[key] = new
    return new


def tma_ok(*tensors) -> bool:
    """The copy engine (Hopper and newer) needs 16-byte aligned base addresses and strides."""
    t0 = tensors[0]
    if t0.device.type != "cuda" or _major(t0.device.index) < 9:
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
               for t in tensors)


@functools.lru_cache(maxsize=None)
def _major(index) -> int:
    return torch.cuda.get_device_capability(index)[0]


def switches(tiles, interpreted: bool, *tensors) -> dict:
    """The TMA / WARP_SPECIALIZE constexprs for a launch with these tiles and tensors."""
    if interpreted or not (tiles.tma or tiles.warp_specialize) or not tma_ok(*tensors):
        return dict(OFF)
    return {"TMA": bool(tiles.tma), "WARP_SPECIALIZE": bool(tiles.tma and tiles.warp_specialize)}


def launch(kernel, grid, args, consts: dict, fast: dict, slots: tuple = ()) -> Launch:
    """kernel[grid](*args, **consts, **fast), or the pointer version where fast does not build.
    Returns the launch made, to be repeated with the call's own tensors in ``slots``."""
    used = {**consts, **fast}
    if fast != OFF:  # the common case pays for no bookkeeping
        key = (kernel, tuple(consts.items()), args[0].dtype)
        if key in _NO_FAST:
            used = {**consts, **OFF}
        elif fast["TMA"]:
            ensure_allocator()
    try:
        run(kernel, grid, args, used)
    except OUT_OF_RESOURCES:
        raise  # the caller retries with smaller tiles
    except Exception as exc:  # noqa: BLE001 - only the TMA / warp-specialized build may fail
        if not (used["TMA"] or used["WARP_SPECIALIZE"]):
            raise
        warnings.warn(f"flashedu: the TMA / warp-specialized kernel did not build on this "
                      f"Triton ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                      f"using the pointer version for these settings", stacklevel=3)
        _NO_FAST.add(key)
        used = {**consts, **OFF}
        run(kernel, grid, args, used)
    return Launch(kernel, grid, args, used, slots)


def ensure_allocator():
    """Descriptors made inside a kernel live in scratch memory that Triton asks an allocator
    for: install one backed by torch, unless the user has set their own. Triton keeps the
    allocator in a context variable, one per thread, and autograd runs a backward on threads
    of its own: each thread asks (a lookup, where the allocator is set). A kernel's first
    launch asks where it is made; a plan's later starts where Triton's launcher runs them
    (``Launch.start``; its direct start brings its own scratch)."""
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # Triton's internals moved: once per thread
        if getattr(_THREAD, "allocator", False):
            return
    _THREAD.allocator = True
    triton.set_allocator(_scratch)


def _scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


_THREAD = threading.local()


# ------------------------------------------------------------------------------------------
# Launching a compiled kernel again without Triton's dispatch
# ------------------------------------------------------------------------------------------
#
# ``kernel[grid](*args)`` binds every argument, works out what Triton specializes on (the
# dtype and 16-byte alignment of each tensor, the width and divisibility by 16 of each int),
# hashes that into a cache key and looks the compiled kernel up: about 40 us of Python per
# launch on Triton 3.6 (measured on an H100 host), more than the kernel itself at small sizes.
# ``run`` keeps the CompiledKernel that the first call returned, under a key at least as fine
# as Triton's (each int by its value, each tensor by dtype and alignment: a finer key only
# means one more trip through Triton's own cache), and starts it directly the next time, as
# the end of Triton's ``JITFunction.run`` does. It falls back to the normal call under the
# interpreter, while a launch hook is installed (profilers), for arguments it cannot key, and
# for good if a direct start ever fails.

# The Triton versions whose launch path this module was tested against on a GPU: a test
# (tests/test_triton.py, test_the_direct_launch_knows_this_triton) fails there, naming the
# version, if the launcher is not laid out as ``Opened`` reads it. On any other version every
# launch goes through Triton's own dispatch.
TESTED_TRITON = ("3.6",)
TRITON = ".".join(triton.__version__.split(".")[:2])
FAST_LAUNCH = (os.environ.get("FLASHEDU_FAST_LAUNCH", "1") != "0"  # "0": always kernel[grid]
               and TRITON in TESTED_TRITON)
_COMPILED: dict = {}  # (kernel, device, consts, argument key) -> (CompiledKernel, trailing args)
_HOOKS: dict = {}  # id -> a @triton.jit hook some compiled kernel's key names
_MAX_COMPILED = 4096  # keys kept before the cache starts over (shapes that change every call)


def _arg_key(a):
    """A runtime argument's part of the key: what Triton specializes it on, or finer.
    (``_key`` inlines the common cases: an int, None, a plain tensor.)"""
    if type(a) is int or a is None:
        return a
    if type(a) is float:
        return "f"
    dtype = getattr(a, "dtype", None)
    if dtype is not None and hasattr(a, "data_ptr"):
        return (dtype, a.data_ptr() % 16 == 0)
    if type(a) is bool:
        return ("b", a)
    if type(a) is tuple:  # a group of arguments (strides, a hook's arguments)
        return tuple([_arg_key(x) for x in a])
    if isinstance(a, JITFunction):  # a hook compiled into the kernel: keyed by id (hashing
        _HOOKS[id(a)] = a  # one hashes its source), and kept, so that the id stays its own
        return id(a)
    raise _Unkeyable


def _key(args) -> tuple:
    """The arguments' part of the cache key. A kernel takes some 50-80 arguments, mostly ints
    (strides, sizes), so the common kinds are tested inline rather than by a call each (233 of
    the 695 Python calls of a forward+backward)."""
    return tuple([a if type(a) is int or a is None
                  else (a.dtype, a.data_ptr() % 16 == 0) if type(a) is Tensor
                  else _arg_key(a) for a in args])


class _Unkeyable(Exception):
    pass


def _hook_set(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))  # an empty HookChain: none


def _hooks_set() -> bool:
    """A launch hook installed (a profiler's): launches need Triton's own path."""
    runtime = triton.knobs.runtime
    return _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)


def _direct_ok(kernel) -> bool:
    if not FAST_LAUNCH or not isinstance(kernel, JITFunction):
        return False
    if getattr(triton, "knobs", None) is None:
        return False  # an older Triton: keep to its own path
    return not _hooks_set()


def _cache_key(kernel, device, args, consts: dict) -> tuple:
    """The key of ``_COMPILED``; raises _Unkeyable for an argument it cannot key."""
    return kernel, device, tuple(consts.items()), _key(args)


def run(kernel, grid, args, consts: dict):
    """``kernel[grid](*args, **consts)``; repeated launches skip Triton's dispatch.
    Returns the CompiledKernel (None under the interpreter)."""
    if not _direct_ok(kernel):
        return kernel[grid](*args, **consts)
    device = torch.cuda.current_device()
    try:
        key = _cache_key(kernel, device, args, consts)
    except _Unkeyable:
        return kernel[grid](*args, **consts)
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **consts)
        names = kernel.arg_names[len(args):]  # the constexprs, given by keyword or defaulted
        defaults = {p.name: p.default for p in kernel.params}
        if len(_COMPILED) >= _MAX_COMPILED:
            _COMPILED.clear()
        _COMPILED[key] = (compiled, tuple(consts[n] if n in consts else defaults[n]
                                          for n in names), Opened.of(compiled))
        return compiled
    return _start(kernel, hit, grid, args, consts, device)


def _start(kernel, hit, grid, args, consts: dict, device, stream=None):
    """Start ``hit`` = (CompiledKernel, its trailing constexpr values, its launcher opened up
    or None) directly, as the end of Triton's ``JITFunction.run`` does, on ``stream`` (None:
    the device's current stream)."""
    compiled, tail, opened = hit
    if stream is None:
        stream = torch._C._cuda_getCurrentRawStream(device)
    gx, gy, gz = _grid3(grid)
    try:
        if opened is not None:
            opened.bind(grid, (*args, *tail), device)(stream, ())
        else:
            compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata, None,
                         None, None, *args, *tail)
    except Exception as exc:  # noqa: BLE001 - a Triton whose launcher differs: its own path
        return _direct_failed(exc, kernel, grid, args, consts)
    return compiled


def _grid3(grid) -> tuple:
    return grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1


def _direct_failed(exc, kernel, grid, args, consts):
    """A direct start raised: Triton's own dispatch from now on, starting with this launch."""
    global FAST_LAUNCH
    warnings.warn(f"flashedu: launching a compiled kernel directly failed on this Triton "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); using "
                  f"Triton's dispatch from now on", stacklevel=4)
    FAST_LAUNCH = False
    _COMPILED.clear()
    ensure_allocator()  # Triton's launcher: scratch from this thread's allocator
    return kernel[grid](*args, **consts)


class Opened:
    """A compiled kernel's launcher opened up: Triton's C launch function called as Triton's
    Python ``CudaLauncher.__call__`` calls it, less that wrapper's own Python, and with the
    descriptor scratch memory kept per stream instead of allocated on every launch.

    A kernel that makes tensor descriptors (``tl.make_tensor_descriptor``) needs
    ``global_scratch_size`` bytes of global memory per program for them; Triton asks its
    allocator for a fresh tensor on every launch, which costs a torch allocation of host time.
    Launches on one stream run one after another, so one buffer per stream serves them all.
    During CUDA-graph capture a launch takes a fresh buffer, as Triton's does: the graph keeps
    its address and may replay beside eager launches.

    Only for Triton's launcher layout that this was written against (``_BASE_ARGS_FORMAT``
    "iiiKKppOOOOOO": grid, stream, function, cooperative, PDL, then the two scratch buffers,
    the kernel's metadata, the launch metadata and the two hooks); anything else keeps
    ``CompiledKernel.run``."""

    __slots__ = ("launch", "function", "metadata", "cooperative", "pdl", "scratch")
    LAYOUT = "iiiKKppOOOOOO"
    _buffers: dict = {}  # (device, stream) -> the scratch buffer of launches on that stream

    def __init__(self, launch, function, metadata, cooperative, pdl, scratch):
        self.launch, self.function, self.metadata = launch, function, metadata
        self.cooperative, self.pdl, self.scratch = cooperative, pdl, scratch

    @classmethod
    def of(cls, compiled):
        """The opened launcher of ``compiled``, or None where its layout is not the known one."""
        try:
            from triton.backends.nvidia import driver

            run = compiled.run
            if (getattr(driver, "_BASE_ARGS_FORMAT", None) != cls.LAYOUT
                    or type(run) is not driver.CudaLauncher or run.profile_scratch_size > 0):
                return None
            return cls(run.launch, compiled.function, compiled.packed_metadata,
                       run.launch_cooperative_grid, run.launch_pdl,
                       run.global_scratch_size * run.num_ctas)
        except (ImportError, AttributeError):
            return None

    def bind(self, grid, fixed: tuple, device):
        """``go(stream, lead)``: this kernel launched on ``grid`` with the arguments ``lead``
        then ``fixed`` (the rest, then the trailing constexprs) on ``stream``, a raw stream
        handle. An argument given as an int address rather than a tensor spares the launcher a
        ``data_ptr`` call and a driver query (``cuPointerGetAttribute``) per pointer."""
        launch, function, metadata = self.launch, self.function, self.metadata
        cooperative, pdl = self.cooperative, self.pdl
        gx, gy, gz = _grid3(grid)
        if not self.scratch:
            def go(stream, lead):
                launch(gx, gy, gz, stream, function, cooperative, pdl, None, None, metadata,
                       None, None, None, *lead, *fixed)
            return go
        nbytes, buffer = gx * gy * gz * self.scratch, self.buffer

        def go_with_scratch(stream, lead):
            buf = buffer(device, stream, nbytes)  # held until the launch is made
            launch(gx, gy, gz, stream, function, cooperative, pdl, buf.data_ptr(), None,
                   metadata, None, None, None, *lead, *fixed)
        return go_with_scratch

    @classmethod
    def buffer(cls, device, stream, nbytes: int):
        """``nbytes`` of scratch memory for a launch on ``stream`` (a raw stream handle)."""
        if torch._C._cuda_isCurrentStreamCapturing():
            return torch.empty(nbytes, dtype=torch.int8, device=device)
        buf = cls._buffers.get((device, stream))
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.int8, device=device)
            cls._buffers[(device, stream)] = buf
        return buf


# ------------------------------------------------------------------------------------------
# Launch plans: a call's launches, worked out once per call signature
# ------------------------------------------------------------------------------------------
#
# A training loop calls attention with tensors of one layout step after step. Everything its
# launches need besides the tensors themselves (the tile table entry, the grid, the strides
# and sizes, the constexprs, a block mask's tile lists, the compiled kernel) follows from the
# tensors' shapes, strides, dtype, device and alignment and from the call's options. The
# first call with a signature keeps its launches (``Launch``); later ones allocate their
# outputs and start them again with their own tensors. `flashedu bench host` times it: the
# host code of the course GPT's forward+backward went from about 240 to about 140 us on a
# 2-core CPU (BENCHMARKS.md, "Launch plans").

PLANS: dict = {}  # call signature -> what the call launched (each launch code's own shape)
_MAX_PLANS = 1024  # signatures kept before the plans start over (shapes that change every call)


def signature(tensors, *options) -> tuple:
    """A plan's key: the options, the device, then each input's shape, strides, dtype and
    16-byte alignment (what the launches' arguments and Triton's specialization read). A
    call's outputs are not in it: they are fresh allocations laid out as the inputs say, and
    allocators align them to far more than 16 bytes."""
    return (*options, tensors[0].device,
            *[(t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in tensors])


def slots(args, leading: int, *fresh) -> tuple:
    """The positions of a call's own tensors among a launch's arguments: the first
    ``leading``, then each of ``fresh`` (tensors made for this call alone, such as the dropout
    RNG state, found by identity)."""
    return (*range(leading), *(next(i for i, a in enumerate(args) if a is t) for t in fresh))


def remember(key, plan):
    """Keep ``plan`` under ``key`` (None: a launch that cannot be repeated; nothing kept)."""
    if plan is None:
        return
    if len(PLANS) >= _MAX_PLANS:
        PLANS.clear()
    PLANS[key] = plan


class Launch:
    """A launch made once, to be made again with other tensors of the same layout.

    ``slots`` are the positions of the call's own tensors among the arguments; ``start``
    puts new ones there (in that order) and starts the kernel again: the compiled kernel
    directly where ``run`` would, else ``run`` itself (the interpreter, a launch hook). The
    launch keeps no reference to the tensors it was made with."""

    __slots__ = ("kernel", "grid", "args", "consts", "slots", "hit", "device", "go")

    def __init__(self, kernel, grid, args, consts: dict, slots: tuple):
        self.kernel, self.grid, self.consts, self.slots = kernel, grid, consts, slots
        self.args = list(args)
        for i in slots:
            self.args[i] = None
        self.hit, self.device = None, None
        # no kernel was started directly in a process that never initialized CUDA (the
        # interpreter, or compiling for another GPU without one: ``bench sass``)
        if torch.cuda.is_initialized() and _direct_ok(kernel):
            try:
                self.device = torch.cuda.current_device()
                self.hit = _COMPILED.get(_cache_key(kernel, self.device, args, consts))
            except _Unkeyable:
                pass
        self.go = self.bound()

    def bound(self):
        """The opened launcher bound to everything but the call's tensors, or None: no opened
        launcher, or the call's tensors are not the leading arguments (dropout's RNG state
        comes after the others)."""
        n = len(self.slots)
        if self.hit is None or self.hit[2] is None or self.slots != tuple(range(n)):
            return None
        return self.hit[2].bind(self.grid, (*self.args[n:], *self.hit[1]), self.device)

    def start(self, *tensors, stream=None):
        """Start the launch again with ``tensors`` in its slots. ``stream``: what
        :func:`stream_for` returned for the call's launches, which made the checks of a direct
        start once for all of them; None: they are made here."""
        if stream is None or not FAST_LAUNCH:  # (a direct start may have failed since)
            stream = stream_for(self)
            if stream is None:  # no compiled kernel, a launch hook, another device current
                ensure_allocator()  # Triton's launcher: scratch from this thread's allocator
                return run(self.kernel, self.grid, self._args(tensors), self.consts)
        if self.go is not None:  # the tensors go in as addresses (see Opened.bind)
            try:
                return self.go(stream, [t.data_ptr() for t in tensors])
            except Exception as exc:  # noqa: BLE001 - a Triton whose launcher differs
                return _direct_failed(exc, self.kernel, self.grid, self._args(tensors),
                                      self.consts)
        ensure_allocator()  # (go brings its own scratch: Opened.buffer)
        return _start(self.kernel, self.hit, self.grid, self._args(tensors), self.consts,
                      self.device, stream)

    def _args(self, values) -> list:
        """The launch's arguments with ``values`` in its slots."""
        args = self.args.copy()
        for i, t in zip(self.slots, values):
            args[i] = t
        return args


def stream_for(*launches):
    """The raw CUDA stream on which every one of a call's ``launches`` (None: a launch the call
    does not make) may start its compiled kernel directly, or None where one must go through
    ``run`` (no kernel compiled for it, a launch hook installed, another device current). A
    call with several launches makes these checks once rather than once per launch
    (``Launch.start(..., stream=)``)."""
    made = [launch for launch in launches if launch is not None]
    # a launch has a hit only on a Triton with knobs
    if not FAST_LAUNCH or any(launch.hit is None for launch in made) or _hooks_set():
        return None
    device = torch.cuda.current_device()
    if any(launch.device != device for launch in made):
        return None
    return torch._C._cuda_getCurrentRawStream(device)


def compiled_kernels():
    """[(kernel name, constexprs and launch options, CompiledKernel)] launched so far: their
    ``metadata.shared`` (bytes of shared memory), ``n_regs`` and ``n_spills``."""
    return [(getattr(k[0], "__name__", str(k[0])), dict(k[2]), v[0]) for k, v in _COMPILED.items()]
