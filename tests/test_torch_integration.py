"""flashedu.attention inside PyTorch's machinery: torch.compile(fullgraph=True), meta and fake
tensors, double backward, torch.func.vmap, torch.library.opcheck of the operators, and (GPU
only) inductor training and CUDA-graph capture of forward and backward.

On a CPU the triton backend runs in Triton's interpreter, and torch.compile uses the
"aot_eager" and "eager" compilers: they capture the same graphs (forward and backward) as
inductor, without a C++ or GPU compiler.
"""

import ast
import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashedu
from flashedu import ops, runtime, tolerance

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU "
                         "runs these paths through the interpreter in the tests above)")
DEV = runtime.kernel_device()  # the GPU, or the CPU under Triton's interpreter
KERNEL_BACKENDS = ("numpy", "triton")  # backends with torch.library operators (flashedu.ops)
TOL = {dtype: tolerance.floor(dtype) for dtype in (torch.float64, torch.float32)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test compiles its own functions from a clean cache
    yield
    torch._dynamo.reset()


def _operator(backend, which):
    """torch.ops.flashedu.<backend>_<which>: registered when the backend's module loads."""
    flashedu.backends.BACKENDS[backend].load()
    return getattr(torch.ops.flashedu, f"{backend}_{which}")


def _qkv(B=1, H=4, Hkv=2, Nq=24, Nk=40, d=16, dtype=torch.float32, device=DEV, grad=True):
    def t(h, n):
        return torch.randn(B, h, n, d, dtype=dtype, device=device, requires_grad=grad)
    return t(H, Nq), t(Hkv, Nk), t(Hkv, Nk)


_err = tolerance.max_error


def _fwd_bwd(fn, q, k, v):
    out = fn(q, k, v)
    dout = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device)
    dout = dout.reshape(out.shape)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


# ---------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["naive", "numpy", "triton"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_compile_fullgraph_forward_and_backward_equal_eager(backend, is_causal):
    """One graph, no break, for GQA (4 query heads on 2 K/V heads) with Nq != Nk."""
    def fn(q, k, v):
        return flashedu.attention(q, k, v, is_causal=is_causal, enable_gqa=True, backend=backend)

    q, k, v = _qkv()
    want = _fwd_bwd(fn, q, k, v)
    got = _fwd_bwd(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert _err(a, b) <= TOL[torch.float32], name


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_compiled_graph_holds_the_operator_once(backend):
    """The kernel is one node of the captured graph: dynamo traced the Python around it."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(q, k, v):
        return flashedu.attention(q, k, v, is_causal=True, backend=backend) * 2

    q, k, v = _qkv(H=2, grad=False)
    out = torch.compile(fn, fullgraph=True, backend=record)(q, k, v)
    assert _err(out, fn(q, k, v)) <= TOL[torch.float32]
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum(f"flashedu.{backend}_forward" in t for t in targets) == 1, targets


@pytest.mark.parametrize("backend", ["naive", "numpy", "triton"])
def test_compile_with_a_block_mask(backend):
    band = np.tri(3, 3, dtype=bool) & ~np.tri(3, 3, -2, dtype=bool)  # a band of whole tiles
    mask = flashedu.BlockMask.from_dense(band, block_size=(16, 16), seq_lens=(48, 48))

    def fn(q, k, v):
        return flashedu.attention(q, k, v, block_mask=mask, backend=backend)

    q, k, v = _qkv(H=2, Hkv=2, Nq=48, Nk=48)
    want = _fwd_bwd(fn, q, k, v)
    got = _fwd_bwd(torch.compile(fn, fullgraph=True, backend="eager"), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert _err(a, b) <= TOL[torch.float32], name


@pytest.mark.parametrize("backend", ["naive", "numpy", "triton"])
def test_compile_with_a_mask_mod(backend):
    """A mask mod is a Python function the operators cannot take: the kernels' call is a graph
    break (ops.Mods), and the compiled function still computes the exact window."""
    mask = flashedu.BlockMask.from_mask_mod(flashedu.mods.sliding_window(5), 1, 1, 48, 48,
                                            block_size=(16, 16))

    def fn(q, k, v):
        return flashedu.attention(q, k, v, block_mask=mask, backend=backend)

    q, k, v = _qkv(H=2, Hkv=2, Nq=48, Nk=48)
    want = _fwd_bwd(fn, q, k, v)
    got = _fwd_bwd(torch.compile(fn, backend="eager"), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert _err(a, b) <= TOL[torch.float32], name


def test_compiled_module_trains_like_eager():
    """A few SGD steps of a tiny attention layer: compiled and eager losses agree."""
    def make():
        torch.manual_seed(1)
        return torch.nn.Linear(16, 48, device=DEV)

    def loss_fn(layer, x):
        q, k, v = layer(x).view(1, 12, 3, 2, 8).permute(2, 0, 3, 1, 4)  # strided (B, H, N, d)
        return flashedu.attention(q, k, v, is_causal=True, backend="triton").square().mean()

    x = torch.randn(1, 12, 16, device=DEV)
    losses = {}
    for name, wrap in (("eager", lambda f: f),
                       ("compiled", lambda f: torch.compile(f, fullgraph=True,
                                                            backend="aot_eager"))):
        layer, step = make(), wrap(loss_fn)
        opt = torch.optim.SGD(layer.parameters(), lr=0.5)
        losses[name] = []
        for _ in range(3):
            opt.zero_grad()
            loss = step(layer, x)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)
    assert losses["eager"][-1] < losses["eager"][0]


# ---------------------------------------------------------------------------------------------
# Meta and fake tensors: shapes without a kernel
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def no_kernels(monkeypatch):
    """Make every kernel launch of the numpy and triton operators fail loudly."""
    def boom(*args, **kwargs):
        raise AssertionError("a kernel ran on meta or fake tensors")

    import flashedu.numpy_backend
    import flashedu.triton_backend

    # the triton backend's Kernels hold the launch functions themselves (bound when the module
    # is first imported), so they are replaced there, where every call looks them up
    for owner, name in ((flashedu.triton_backend.KERNELS, "forward"),
                        (flashedu.triton_backend.KERNELS, "backward"),
                        (flashedu.numpy_backend, "forward"),
                        (flashedu.numpy_backend, "backward")):
        monkeypatch.setattr(owner, name, boom)


@pytest.mark.parametrize("backend", ["naive", "numpy", "triton", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_meta_tensors_give_the_output_shape(backend, dtype, no_kernels):
    if backend == "numpy" and dtype == torch.float16:
        dtype = torch.float64
    q, k, v = _qkv(B=2, Nq=24, Nk=40, dtype=dtype, device="meta")
    out = flashedu.attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend)
    assert out.device.type == "meta"
    assert (out.shape, out.dtype) == ((2, 4, 24, 16), dtype)
    (dq, dk, dv) = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert [g.shape for g in (dq, dk, dv)] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("interpreted", [True, False])
def test_the_triton_check_takes_fake_tensors_wherever_they_say_they_are(monkeypatch,
                                                                         interpreted):
    """A fake tensor stands for a device without being on it (FakeTensorMode makes CPU ones):
    the triton backend's device check lets it through, compiled or interpreted, and still
    refuses a real tensor on the wrong device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashedu.triton import inputs

    monkeypatch.setattr(inputs.runtime, "triton_interpreted", lambda: interpreted)
    with FakeTensorMode():
        fake = torch.randn(1, 2, 8, 16)
    inputs.check(fake, fake, fake)
    real = torch.randn(1, 2, 8, 16, device="cpu" if not interpreted else "meta")
    if interpreted:
        inputs.check(real, real, real)  # meta: shapes only, as fake
    else:
        with pytest.raises(ValueError, match="must be CUDA tensors"):
            inputs.check(real, real, real)


@pytest.mark.parametrize("backend", ["naive", "numpy", "triton"])
def test_fake_tensors_give_the_output_shape(backend, no_kernels):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        q, k, v = _qkv(B=2, Nq=24, Nk=40)
        mask = flashedu.BlockMask.causal((24, 40), (16, 16)) if backend != "naive" else None
        out = flashedu.attention(q, k, v, enable_gqa=True, block_mask=mask, backend=backend)
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert isinstance(out, FakeTensor) and out.shape == (2, 4, 24, 16)
    assert [g.shape for g in (dq, dk, dv)] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_operator_lse_shape_and_dtype(backend, no_kernels):
    """The forward operator's second output: the (B, H, Nq) logsumexp the backward reads."""
    q, k, v = _qkv(B=3, Nq=24, Nk=40, device="meta", grad=False)
    out, lse = _operator(backend, "forward")(q, k, v, False, 0.25, None, 0, 0)
    assert out.shape == q.shape and lse.shape == (3, 4, 24) and lse.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Double backward: right (naive) or a clear error, never a silent zero
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("path", ["eager", "operator"])
def test_double_backward_is_a_clear_error(backend, path):
    """Through flashedu.attention (eager) and through the operator (what compile records)."""
    def fn(q, k, v):
        if path == "eager":
            return flashedu.attention(q, k, v, is_causal=True, backend=backend)
        forward = _operator(backend, "forward")
        return forward(q, k, v, True, 0.25, None, 0, 0)[0]

    q, k, v = _qkv(H=2, Hkv=2, Nq=16, Nk=16)
    dq, = torch.autograd.grad(fn(q, k, v).square().sum(), q, create_graph=True)
    # create_graph alone is allowed: the first-order gradient is the usual one
    q2 = q.detach().requires_grad_()
    want, = torch.autograd.grad(fn(q2, k, v).square().sum(), q2)
    assert _err(dq, want) <= TOL[torch.float32]
    assert dq.requires_grad  # so that a second backward reaches the operator, which says no
    with pytest.raises(RuntimeError, match=f"backend='{backend}'\\) has no double backward.*"
                                           f"backend='naive'"):
        torch.autograd.grad(dq.sum(), (q, k, v))


def test_naive_double_backward_is_right():
    """The naive backend is plain torch ops: its second derivative equals SDPA's math path."""
    q, k, v = _qkv(H=2, Hkv=2, Nq=12, Nk=12, dtype=torch.float64)

    def second_order(fn):
        out = fn(q, k, v)
        dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        return torch.autograd.grad(dq.square().sum(), (q, k, v))

    got = second_order(lambda q, k, v: flashedu.attention(q, k, v, is_causal=True,
                                                          backend="naive"))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = second_order(lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                           is_causal=True))
    for a, b in zip(got, want):
        assert a.abs().max() > 0 and _err(a, b) <= 1e-10


# ---------------------------------------------------------------------------------------------
# torch.func.vmap: the mapped dim folds into the batch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["naive", "numpy", "triton"])
def test_vmap_equals_a_loop(backend):
    torch.manual_seed(2)
    q = torch.randn(3, 2, 4, 20, 16, device=DEV, requires_grad=True)  # vmapped over dim 0
    k = torch.randn(2, 2, 28, 16, device=DEV, requires_grad=True)  # shared by every entry
    v = torch.randn(2, 2, 28, 16, device=DEV, requires_grad=True)

    def fn(q, k, v):
        return flashedu.attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend)

    got = torch.func.vmap(fn, in_dims=(0, None, None))(q, k, v)
    want = torch.stack([fn(q[i], k, v) for i in range(3)])
    assert _err(got, want) <= TOL[torch.float32]
    dout = torch.randn_like(got)
    g_got = torch.autograd.grad(got, (q, k, v), dout)  # autograd through the folded call
    g_want = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(g_got, g_want):
        assert _err(a, b) <= TOL[torch.float32]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_func_grad_is_a_clear_error(backend):
    q, k, v = _qkv(H=2, Hkv=2, Nq=16, Nk=16, grad=False)

    def loss(q):
        return flashedu.attention(q, k, v, backend=backend).sum()

    with pytest.raises(RuntimeError, match=f"torch.func.grad.*backend='{backend}'.*"
                                           "torch.autograd.grad"):
        torch.func.grad(loss)(q)


# ---------------------------------------------------------------------------------------------
# The operators themselves
# ---------------------------------------------------------------------------------------------

def _layout(layout, dtype, B=1, H=2, N=20, d=16):
    """q, k, v (B, H, N, d) in a memory layout a model gives them."""
    if layout == "packed":  # one projection (B, N, 3, H, d), permuted: views with gaps
        x = torch.randn(B, N, 3, H, d, dtype=dtype, device=DEV)
        return [t.requires_grad_() for t in x.permute(2, 0, 3, 1, 4).unbind(0)]
    if layout == "transposed":  # (B, N, H, d) memory, seen as (B, H, N, d): dense, permuted
        return [torch.randn(B, N, H, d, dtype=dtype, device=DEV).transpose(1, 2).requires_grad_()
                for _ in range(3)]
    return [t.detach().requires_grad_() for t in _qkv(B, H, H, N, N, d, dtype)]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("layout, masked, dtype", [("contiguous", False, torch.float32),
                                                   ("transposed", True, torch.float32),
                                                   ("packed", False, torch.float16)])
def test_opcheck(backend, layout, masked, dtype):
    """torch.library.opcheck: schema, fake tensors (shapes and strides), autograd registration,
    AOT dispatch; in the layouts a model hands over (compiled code trusts the fake strides)."""
    if backend == "numpy" and dtype == torch.float16:
        dtype = torch.float64
    forward = _operator(backend, "forward")
    backward = _operator(backend, "backward")
    q, k, v = _layout(layout, dtype)
    if masked:
        blocks = torch.from_numpy(np.random.default_rng(0).random((1, 1, 2, 2)) < 0.7)
        margs = (False, 0.3, blocks, 16, 16)
    else:
        margs = (True, 0.3, None, 0, 0)
    torch.library.opcheck(forward, (q, k, v, *margs))
    out, lse = forward(q, k, v, *margs)
    dout = torch.randn_like(out)
    torch.library.opcheck(backward, (*(t.detach() for t in (q, k, v, out)), lse, dout, *margs))


def test_the_same_block_grid_rebuilds_one_mask():
    """The kernels cache their tile lists per mask object: a training loop must hit it."""
    mask = flashedu.BlockMask.causal((64, 64), (16, 16))
    a = ops.rebuild_mask(*ops.mask_args(mask), 64, 64)
    b = ops.rebuild_mask(*ops.mask_args(mask), 64, 64)
    assert a is b and (a.blocks == mask.blocks).all() and a.block_size == mask.block_size
    assert ops.rebuild_mask(None, 0, 0, 64, 64) is None


# ---------------------------------------------------------------------------------------------
# Module layout
# ---------------------------------------------------------------------------------------------

def test_backends_is_the_registry_module_and_names_are_a_tuple():
    import flashedu.backends as registry

    assert flashedu.backends is registry
    assert flashedu.BACKEND_NAMES == tuple(registry.BACKENDS) == ("naive", "numpy", "numba",
                                                                  "triton")


def test_runtime_imports_no_backend_module():
    """runtime is the lowest layer: backends import it, never the other way round."""
    tree = ast.parse(pathlib.Path(runtime.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not imported & {"backends", "flashedu.backends", "api", "ops", "triton", "numba"}
    import flashedu.backends  # noqa: F401  the layer above adds its section

    report = runtime.doctor(flashedu.__version__)
    assert all(f"  {name}" in report for name in flashedu.BACKEND_NAMES)


# ---------------------------------------------------------------------------------------------
# GPU: inductor and CUDA graphs
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])  # the second: inductor's CUDA graphs
def test_gpu_inductor_trains_a_module(dtype, mode):
    """torch.compile (inductor, fullgraph) of a small attention model: same losses as eager."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(128, 3 * 128)
            self.proj = torch.nn.Linear(128, 128)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, 2, 64).permute(2, 0, 3, 1, 4)
            y = flashedu.attention(q, k, v, is_causal=True, backend="triton")
            return self.proj(y.transpose(1, 2).reshape(B, T, C))

    x = torch.randn(4, 256, 128, device="cuda", dtype=dtype)
    losses = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        model = Block().cuda().to(dtype)
        step = torch.compile(model, fullgraph=True, mode=mode) if name == "compiled" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[name] = []
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            torch.compiler.cudagraph_mark_step_begin()
            loss = step(x).float().square().mean()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    rel = 1e-4 if dtype == torch.float32 else 3e-2
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=rel)
    assert losses["compiled"][-1] < losses["compiled"][0]


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gpu_cuda_graph_captures_forward_and_backward(dtype, is_causal):
    """torch.cuda.CUDAGraph of forward + backward: a replay on new inputs equals eager."""
    q, k, v = _qkv(B=2, H=8, Hkv=2, Nq=300, Nk=300, d=64, dtype=dtype, device="cuda")
    dout = torch.randn_like(q)

    def step():
        out = flashedu.attention(q, k, v, is_causal=is_causal, enable_gqa=True, backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compile the kernels, fill the caches
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()

    with torch.no_grad():
        for t in (q, k, v, dout):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    want = step()
    for name, a, b in zip(("out", "dq", "dk", "dv"), static, want):
        assert _err(a, b) <= 1e-6 * b.abs().max().item(), name  # the same kernels, replayed


@pytest.mark.gpu
@GPU
def test_gpu_opcheck_bf16_in_a_model_layout():
    """On the GPU the kernels take 16-bit tensors as they are: fake strides must still match."""
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
               for t in _qkv(B=2, H=4, Hkv=2, Nq=200, Nk=136, d=64, dtype=torch.bfloat16,
                             device="cuda"))
    margs = (True, 0.125, None, 0, 0)
    torch.library.opcheck(_operator("triton", "forward"), (q, k, v, *margs))
    out, lse = _operator("triton", "forward")(q, k, v, *margs)
    torch.library.opcheck(_operator("triton", "backward"),
                          (*(t.detach() for t in (q, k, v, out)), lse, torch.randn_like(out),
                           *margs))
