"""Wrong answers and unclear errors at the edges of the API, and SDPA's semantics where a user
expects them.

The first tests pin cases where a plausible implementation answers wrong or fails with an
internal message: a finite mask that is a bias (a row of ``finfo.min``), gradients through the
lse of a fully masked row, the lse of NaN scores, double backward through every path, BlockMask
equality and the caches keyed on it, meta and fake tensors, three command-line arguments, and
token ids outside the vocabulary. Then the deliberate choices about SDPA's behaviour (README,
"Where flashedu and SDPA part"), and hypothesis properties over the same classes of input, with
few examples: the Triton interpreter runs every example in Python.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import flashedu
from backend_cases import device as backend_device
from flashedu import BlockMask, mods
from flashedu.reference import reference_attention

CUDA = torch.cuda.is_available()
LSE_BACKENDS = ("naive", "numpy", "triton")  # the backends with attn_mask and return_lse
# A few fixed examples in CI; HYPOTHESIS_EXAMPLES_X=N draws N times as many, fresh ones with
# HYPOTHESIS_PROFILE=dev (as tests/test_properties.py).
X = int(os.environ.get("HYPOTHESIS_EXAMPLES_X", "1"))
FRESH = os.environ.get("HYPOTHESIS_PROFILE") == "dev"
FEW = settings(max_examples=6 * X, deadline=None, derandomize=not FRESH, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _qkv(B=1, H=2, Nq=16, Nk=16, d=16, dtype=torch.float32, device="cpu", grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=g).to(device=device, dtype=dtype)
            .requires_grad_(grad) for N in (Nq, Nk, Nk)]


def _hf_mask(Nq, Nk, dtype, device, masked_rows=(3,), seed=0):
    """Hugging Face's additive mask: 0 where a pair takes part, finfo(dtype).min where not;
    ``masked_rows`` are masked entirely, a few other pairs at random."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.rand(Nq, Nk, generator=g) < 0.3
    hidden[list(masked_rows)] = True
    return torch.zeros(Nq, Nk, dtype=dtype).masked_fill(hidden, torch.finfo(dtype).min).to(device)


def _close(out, ref, dtype):
    atol = {torch.float32: 2e-5, torch.float64: 1e-9}.get(dtype, 2e-2)
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), atol=atol, rtol=atol)


# ----- a finite mask value is a bias: a row of finfo.min weighs its keys equally ----------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_of_finfo_min_gives_the_mean_of_v(backend, dtype):
    dev = backend_device(backend)
    q, k, v = _qkv(dtype=dtype, device=dev)
    mask = _hf_mask(16, 16, dtype, dev, masked_rows=(3, 9))
    if backend == "numba":  # no attn_mask there: a clear error, naming those that have it
        with pytest.raises(NotImplementedError, match="attn_mask.*naive"):
            flashedu.attention(q, k, v, attn_mask=mask, backend=backend)
        return
    out, lse = flashedu.attention(q, k, v, attn_mask=mask, return_lse=True, backend=backend)
    mean_v = v.double().mean(dim=2)
    for row in (3, 9):
        _close(out[:, :, row], mean_v, dtype)
        # finite and hugely negative: its exact value at that magnitude differs by backend
        assert torch.isfinite(lse[:, :, row]).all() and (lse[:, :, row] < -1e38).all()
    _close(out, reference_attention(q, k, v, attn_mask=mask), dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.cpu().float() for t in (q, k, v)),
                                                            attn_mask=mask.cpu().float())
    _close(out, sdpa, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the compiled kernel")
def test_a_row_of_finfo_min_on_the_gpu_kernel():
    q, k, v = _qkv(B=2, H=4, Nq=200, Nk=300, d=64, dtype=torch.bfloat16, device="cuda")
    mask = _hf_mask(200, 300, torch.bfloat16, "cuda", masked_rows=(0, 77, 199))
    out = flashedu.attention(q, k, v, attn_mask=mask, backend="triton")
    for row in (0, 77, 199):
        _close(out[:, :, row], v.double().mean(dim=2), torch.bfloat16)
    _close(out, reference_attention(q, k, v, attn_mask=mask), torch.bfloat16)


def test_a_row_of_finfo_min_has_sdpas_gradients():
    """Outside the row the gradients are the formula's. Through it they follow SDPA's kernels:
    numpy and triton recompute its weights from its lse, as SDPA's flash kernel does, where
    float32 cannot hold log(Nk) beside finfo.min; naive differentiates the formula, as SDPA's
    math backend does."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = _hf_mask(16, 16, torch.float32, "cpu", masked_rows=(3,))
    kept = torch.ones(16, 1)
    kept[3] = 0.0  # Hugging Face's loss ignores a padding query's output

    def grads(fn, weight, dev="cpu"):
        q, k, v = _qkv(grad=True, device=dev)
        (fn(q, k, v) * weight.to(dev)).square().sum().backward()
        return [t.grad.cpu() for t in (q, k, v)]

    def ours(backend):
        return lambda q, k, v: flashedu.attention(q, k, v, attn_mask=mask.to(q.device),
                                                  backend=backend)

    def sdpa(kind):  # SDPA's CPU kernels
        def fn(q, k, v):
            with sdpa_kernel(kind):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return fn

    everything = torch.ones(16, 1)
    for weight, want in ((kept, grads(ours("naive"), kept)),
                         (everything, grads(sdpa(SDPBackend.FLASH_ATTENTION), everything))):
        for backend in ("numpy", "triton"):
            for g, w in zip(grads(ours(backend), weight, backend_device(backend)), want):
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    for g, w in zip(grads(ours("naive"), everything), grads(sdpa(SDPBackend.MATH), everything)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


# ----- gradients through the lse of a row that a float mask hides entirely ----------------------
def test_gradients_through_the_lse_of_a_hidden_row_are_finite():
    mask = torch.zeros(16, 16)
    mask[2] = float("-inf")
    grads = {}
    for backend in LSE_BACKENDS:
        q, k, v = _qkv(grad=True, device=backend_device(backend))
        _, lse = flashedu.attention(q, k, v, attn_mask=mask.to(q.device), return_lse=True,
                                    backend=backend)
        assert torch.isneginf(lse[:, :, 2]).all()
        lse[torch.isfinite(lse)].sum().backward()
        grads[backend] = [q.grad.cpu(), k.grad.cpu()]  # v takes no part in the lse
        assert all(torch.isfinite(g).all() for g in grads[backend]), backend
    for backend in ("numpy", "triton"):
        for g, want in zip(grads[backend], grads["naive"]):
            torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)


# ----- NaN scores: the lse is NaN, not the -inf of a row that sees nothing ----------------------
def test_nan_scores_give_a_nan_lse(backend):
    if backend == "numba":
        pytest.skip("numba has no return_lse (test_errors checks that it says so)")
    q, k, v = _qkv(device=backend_device(backend))
    q[0, 1, 5, 0] = float("nan")
    out, lse = flashedu.attention(q, k, v, return_lse=True, backend=backend)
    assert torch.isnan(out[0, 1, 5]).all() and torch.isnan(lse[0, 1, 5])
    lse[0, 1, 5] = 0.0
    assert torch.isfinite(lse).all()


# ----- double backward: every path of numpy and triton refuses it -------------------------------
def _second_order_paths(N, dev):
    docs = BlockMask.from_mask_mod(mods.document.from_lengths([10, N - 10]), None, None, N, N,
                                   (16, 16))
    return {"plain": {}, "attn_mask": dict(attn_mask=torch.zeros(N, N, device=dev)),
            "bool attn_mask": dict(attn_mask=torch.ones(N, N, dtype=torch.bool,
                                                        device=dev).tril()),
            "return_lse": dict(return_lse=True), "score_mod": dict(score_mod=mods.softcap(4.0)),
            "mask mod": dict(block_mask=docs), "dropout": dict(dropout_p=0.3)}


@pytest.mark.parametrize("backend_name", ["numpy", "triton"])
def test_double_backward_is_refused_on_every_path(backend_name):
    N, dev = 16, backend_device(backend_name)
    for name, kw in _second_order_paths(N, dev).items():
        for call in range(2 if name == "mask mod" else 1):  # the second: triton's repeat
            q, k, v = _qkv(H=1, Nq=N, Nk=N, grad=True, seed=call, device=dev)
            out = flashedu.attention(q, k, v, backend=backend_name, **kw)
            out = out[0] if isinstance(out, tuple) else out
            dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
            assert dq.requires_grad, name  # as the operators' gradients: a node that says no
            with pytest.raises(RuntimeError, match="no double backward.*naive"):
                dq.sum().backward()


def test_naive_double_backward_keeps_the_second_order_term():
    q, k, v = (t[:, :1, :5, :4].detach().double().requires_grad_()
               for t in _qkv(dtype=torch.float64))
    mask = torch.randn(5, 5, dtype=torch.float64)
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: flashedu.attention(q, k, v, attn_mask=mask, backend="naive"), (q, k, v))


# ----- BlockMask: equality covers full tiles; contradicting full tiles are refused --------------
def test_blockmask_equality_and_the_kernels_caches_cover_full_blocks():
    N = 48
    docs = mods.document.from_lengths([20, 28])  # a boundary inside a tile: partial tiles
    A = BlockMask.from_mask_mod(docs, None, None, N, N, (16, 16))
    assert A.full_blocks.any() and A.partial.any()
    B = BlockMask(A.blocks, A.block_size, A.seq_lens, A.is_causal, A.mask_mod,
                  full_blocks=np.zeros_like(A.blocks))  # the same pairs, every tile masked
    assert A != B and hash(A) != hash(B)
    assert A == BlockMask.from_mask_mod(docs, None, None, N, N, (16, 16))
    q, k, v = _qkv(Nq=N, Nk=N, device=backend_device("triton"))
    ref = reference_attention(q, k, v, block_mask=A)
    for mask in (A, B, A):  # equal masks would share cached launches
        _close(flashedu.attention(q, k, v, block_mask=mask, backend="triton"), ref, q.dtype)
    with pytest.raises(ValueError, match=r"full_blocks marks tile .* mask mod hides"):
        BlockMask(A.blocks, A.block_size, A.seq_lens, A.is_causal, A.mask_mod,
                  full_blocks=A.blocks)
    with pytest.raises(ValueError, match="full_blocks marks tile .* blocks skips it"):
        BlockMask(np.eye(3, dtype=bool), (16, 16), (N, N), full_blocks=np.ones((3, 3), bool))
    with pytest.raises(ValueError, match="is_causal hides"):
        BlockMask(np.ones((3, 3), bool), (16, 16), (N, N), is_causal=True,
                  full_blocks=np.ones((3, 3), bool))


# ----- meta and fake tensors: shapes on every path ----------------------------------------------
def _feature_calls(N):
    window = BlockMask.from_mask_mod(mods.sliding_window(5), None, None, N, N, (16, 16))
    return {"plain": {}, "attn_mask": dict(attn_mask=torch.zeros(N, N)),
            "bool attn_mask": dict(attn_mask=torch.ones(N, N, dtype=torch.bool)),
            "score_mod": dict(score_mod=mods.softcap(5.0)), "return_lse": dict(return_lse=True),
            "mask mod": dict(block_mask=window), "dropout": dict(dropout_p=0.5)}


def _run_without_values(kind, backend, kw, N=16):
    """The call on meta or fake tensors (fake ones on the backend's device), backward included
    where the backend has one."""
    def call(q, k, v, kw):
        out = flashedu.attention(q, k, v, backend=backend, **kw)
        o = out[0] if isinstance(out, tuple) else out
        assert o.shape == q.shape and o.dtype == q.dtype
        if isinstance(out, tuple):
            assert out[1].shape == q.shape[:3] and out[1].dtype == torch.float32
        if backend != "numba":
            o.sum().backward()
            assert all(t.grad.shape == t.shape for t in (q, k, v))

    mask = kw.get("attn_mask")
    if kind == "meta":
        q, k, v = (torch.empty(1, 2, N, 16, device="meta", requires_grad=True) for _ in range(3))
        call(q, k, v, kw if mask is None else {**kw, "attn_mask": mask.to("meta")})
        return
    dev = backend_device(backend)
    mask = None if mask is None else mask.to(dev)  # a real tensor: moved outside the mode
    with FakeTensorMode() as mode:
        q, k, v = (torch.empty(1, 2, N, 16, device=dev, requires_grad=True) for _ in range(3))
        call(q, k, v, kw if mask is None else {**kw, "attn_mask": mode.from_tensor(mask)})


@pytest.mark.parametrize("kind", ["meta", "fake"])
def test_meta_and_fake_tensors_on_every_path(backend, kind):
    for name, kw in _feature_calls(16).items():
        if backend == "numba" and name != "plain":
            continue  # numba refuses the features (NotImplementedError, before any data)
        _run_without_values(kind, backend, kw)


# ----- the command line ---------------------------------------------------------------------
@pytest.fixture
def notebook(tmp_path, monkeypatch):
    """A notebook file, and a grader that records what it was asked to grade."""
    pytest.importorskip("nbclient", reason="the grader needs nbclient")
    from flashedu.checks import classroom

    graded = []
    monkeypatch.setattr(classroom, "grade_class", lambda paths, *a, **k: (graded.extend(paths)
                                                                         or [([], True)] * len(paths)))
    path = tmp_path / "a.ipynb"
    path.write_text("{}")
    return str(path), graded


def _cli(argv):
    from flashedu.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


@pytest.mark.parametrize("target", ["/nonexistent/g.json", "FOLDER"])
def test_cli_check_json_that_cannot_be_written_exits_2_before_grading(notebook, target, tmp_path):
    path, graded = notebook
    target = str(tmp_path) if target == "FOLDER" else target
    code, err = _cli(["check", path, "--json", target])
    assert code == 2 and "--json" in err and not graded


@pytest.mark.parametrize("option, value", [("--timeout", "-1"), ("--budget", "0"),
                                           ("--timeout", "0.5"), ("--budget", "nan"),
                                           ("--timeout", "inf"), ("--jobs", "0")])
def test_cli_check_refuses_time_limits_below_a_second(notebook, option, value):
    path, graded = notebook
    code, err = _cli(["check", path, option, value])
    assert code == 2 and option in err and not graded


def test_cli_check_good_arguments_still_grade(notebook, tmp_path):
    path, graded = notebook
    out = tmp_path / "g.json"
    assert _cli(["check", path, "--timeout", "30", "--budget", "60", "--jobs", "1",
                 "--json", str(out)])[0] == 0
    assert graded and json.loads(out.read_text()) == []


@pytest.mark.skipif(CUDA, reason="checks the run without a GPU; with one, bench times for real")
def test_bench_json_without_a_gpu_fails_saying_so(tmp_path):
    target = tmp_path / "none" / "x.json"
    code, err = _cli(["bench", "--json", str(target)])
    assert code == 1 and "--json" in err and "GPU" in err
    assert not target.exists() and not target.parent.exists()


# ----- the GPT and token ids outside its vocabulary ------------------------------------------
def test_gpt_names_ids_outside_the_vocabulary():
    from flashedu.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                          max_seq_len=16, attention_backend="naive", compile_model=False,
                          mixed_precision=False, device="cpu"))
    for bad in (50, 1000, -1):
        with pytest.raises(ValueError, match=rf"ids .*vocab_size=50\).* {bad}"):
            model(torch.tensor([[1, 2, bad]]))
    assert model(torch.tensor([[0, 49]])).shape == (1, 2, 50)


# ----- SDPA's behaviour, or a message that says where flashedu differs ----------------------------
@pytest.mark.parametrize("shapes", [((0, 2, 4, 16), (0, 2, 5, 16)), ((1, 0, 4, 16), (1, 0, 5, 16)),
                                    ((1, 2, 0, 16), (1, 2, 5, 16)), ((1, 2, 4, 16), (1, 2, 0, 16)),
                                    ((1, 4, 4, 16), (1, 2, 0, 16)), ((1, 2, 4, 0), (1, 2, 5, 0))])
def test_empty_inputs_give_sdpas_result(backend, shapes):
    (qs, ks), dev = shapes, backend_device(backend)
    q = torch.randn(qs, device=dev, requires_grad=True)
    k, v = (torch.randn(ks, device=dev, requires_grad=True) for _ in range(2))
    out = flashedu.attention(q, k, v, enable_gqa=True, backend=backend)
    # SDPA's result (torch 2.13; torch 2.11's CPU SDPA dies of a division by zero at H = 0):
    # zeros shaped like q, empty or a row that sees no key
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    out.sum().backward()
    assert all(t.grad.shape == t.shape and not t.grad.any() for t in (q, k, v))
    if backend != "numba":
        _, lse = flashedu.attention(q, k, v, enable_gqa=True, return_lse=True, backend=backend)
        assert lse.shape == qs[:3] and (ks[2] > 0 or torch.isneginf(lse).all())


def test_dropout_one_gives_zeros_and_the_undropped_lse(backend):
    q, k, v = _qkv(grad=True, device=backend_device(backend))
    if backend == "numba":
        with pytest.raises(NotImplementedError, match="dropout"):
            flashedu.attention(q, k, v, dropout_p=1.0, backend=backend)
        return
    out, lse = flashedu.attention(q, k, v, dropout_p=1.0, return_lse=True, backend=backend)
    assert not out.any() and out.shape == q.shape
    _close(lse, flashedu.attention(q, k, v, return_lse=True, backend="naive")[1], q.dtype)
    out.sum().backward()
    assert not q.grad.any() and not v.grad.any()
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        flashedu.attention(q, k, v, dropout_p=1.01, backend=backend)


def test_the_documented_refusals_say_how_sdpa_differs():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="attn_mask and is_causal.*SDPA documents"):
        flashedu.attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool),
                           is_causal=True)
    with pytest.raises(ValueError, match=r"4 slopes, but q has 2 heads.*alibi_slopes\(2\)"):
        flashedu.attention(q, k, v, score_mod=mods.alibi(mods.alibi_slopes(4)))
    for backend in ("numpy", "triton"):
        qd, kd, vd = (t.to(backend_device(backend)) for t in (q, k, v))
        mask = torch.zeros(16, 16, device=qd.device)
        with pytest.raises(NotImplementedError, match="vmap.*batch B.*naive"):
            torch.func.vmap(lambda q: flashedu.attention(q, kd, vd, attn_mask=mask,
                                                         backend=backend))(qd[None])
    with pytest.raises(NotImplementedError, match="vmap.*numba"):
        torch.func.vmap(lambda q: flashedu.attention(q, k, v, backend="numba"))(q[None])


def test_a_one_dimensional_mask_is_one_value_per_key(backend):
    if backend == "numba":
        pytest.skip("numba has no attn_mask")
    q, k, v = _qkv(device=backend_device(backend))
    keys = (torch.rand(16, generator=torch.Generator().manual_seed(1)) > 0.4).to(q.device)
    out = flashedu.attention(q, k, v, attn_mask=keys, backend=backend)
    _close(out, reference_attention(q, k, v, attn_mask=keys.expand(16, 16)), q.dtype)


def test_the_modules_are_attributes_of_the_package():
    assert flashedu.merge.merge is not None and flashedu.tiled.flash_forward is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        flashedu.nope  # noqa: B018


# ----- properties ---------------------------------------------------------------------------------
@FEW
@given(data=st.data(), backend=st.sampled_from(LSE_BACKENDS))
def test_property_hf_masks_agree_with_the_formula(data, backend):
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16] if backend == "triton"
                                      else [torch.float64, torch.float32, torch.bfloat16]))
    Nq, Nk = data.draw(st.integers(1, 20)), data.draw(st.integers(1, 20))
    seed = data.draw(st.integers(0, 2**16))
    rows = data.draw(st.lists(st.integers(0, Nq - 1), max_size=3, unique=True))
    q, k, v = _qkv(B=1, H=2, Nq=Nq, Nk=Nk, d=16, dtype=dtype, seed=seed,
                   device=backend_device(backend))
    mask = _hf_mask(Nq, Nk, dtype, q.device, rows, seed)
    out, lse = flashedu.attention(q, k, v, attn_mask=mask, return_lse=True, backend=backend)
    _close(out, reference_attention(q, k, v, attn_mask=mask), dtype)
    assert torch.isfinite(lse).all()
    for row in rows:
        _close(out[:, :, row], v.double().mean(dim=2), dtype)


@FEW
@given(data=st.data(), backend=st.sampled_from(LSE_BACKENDS))
def test_property_nan_inputs_with_lse(data, backend):
    N = data.draw(st.integers(2, 20))
    q, k, v = _qkv(Nq=N, Nk=N, seed=data.draw(st.integers(0, 2**16)),
                   device=backend_device(backend))
    rows = data.draw(st.lists(st.integers(0, N - 1), min_size=1, max_size=3, unique=True))
    q[0, 0, rows, 0] = float("nan")
    hidden = data.draw(st.booleans())  # one row that sees nothing besides
    mask = torch.ones(N, N, dtype=torch.bool, device=q.device)
    if hidden:
        mask[N - 1] = False
    out, lse = flashedu.attention(q, k, v, attn_mask=mask, return_lse=True, backend=backend)
    ref, ref_lse = reference_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert torch.equal(torch.isnan(out).cpu(), torch.isnan(ref).cpu())
    assert torch.equal(torch.isnan(lse).cpu(), torch.isnan(ref_lse).cpu())
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(ref_lse).cpu())


@settings(max_examples=40 * X, deadline=None, derandomize=not FRESH, database=None)
@given(data=st.data())
def test_property_blockmask_equality_follows_what_is_computed(data):
    Tr, Tc = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    grid = st.lists(st.booleans(), min_size=Tr * Tc, max_size=Tr * Tc).map(
        lambda x: np.array(x).reshape(Tr, Tc))
    blocks_a, blocks_b, sub_a, sub_b = (data.draw(grid) for _ in range(4))
    causal = data.draw(st.booleans())
    seq = (Tr * 8, Tc * 8)

    def make(blocks, sub):
        try:
            return BlockMask(blocks, (8, 8), seq, causal, full_blocks=blocks & sub)
        except ValueError as exc:  # a full tile the diagonal cuts: refused, saying so
            assert causal and "is_causal hides" in str(exc)
            return None

    a, b = make(blocks_a, sub_a), make(blocks_b, sub_b)
    assume(a is not None and b is not None)
    same = np.array_equal(a.blocks, b.blocks) and np.array_equal(a.full_blocks, b.full_blocks)
    assert (a == b) == same and (not same or hash(a) == hash(b))
    import pickle

    assert pickle.loads(pickle.dumps(a)) == a and hash(pickle.loads(pickle.dumps(a))) == hash(a)


@FEW
@given(data=st.data())
def test_property_meta_and_fake_tensors(data):
    backend = data.draw(st.sampled_from(["naive", "numpy", "triton", "numba"]))
    kind = data.draw(st.sampled_from(["meta", "fake"]))
    calls = _feature_calls(16)
    names = ["plain"] if backend == "numba" else sorted(calls)
    picked = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    kw = {}
    for name in picked:
        if "attn_mask" in kw and "attn_mask" in calls[name]:
            continue
        kw.update(calls[name])
    _run_without_values(kind, backend, kw)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(option=st.sampled_from(["--timeout", "--budget", "--jobs"]),
       value=st.one_of(st.integers(-5, 5).map(str), st.sampled_from(
           ["nan", "inf", "-inf", "0.5", "1", "1.5", "abc", "1e9"])))
def test_property_cli_check_values(notebook, option, value):
    path, graded = notebook
    graded.clear()
    code, _ = _cli(["check", path, option, value])
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    ok = (number >= 1 and math.isfinite(number) and
          (option != "--jobs" or value.lstrip("-").isdigit()))
    assert code == (0 if ok else 2) and bool(graded) == ok
