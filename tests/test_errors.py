"""Bad input gets a clear ValueError / TypeError naming the argument, from every backend."""

import numpy as np
import pytest
import torch
from backend_cases import device

import flashedu


def _qkv(B=1, H=2, Hkv=2, Nq=8, Nk=8, d=16, dtype=torch.float32):
    return (torch.randn(B, H, Nq, d, dtype=dtype), torch.randn(B, Hkv, Nk, d, dtype=dtype),
            torch.randn(B, Hkv, Nk, d, dtype=dtype))


q, k, v = _qkv()
BAD = [
    (lambda: flashedu.attention(q[0], k, v), ValueError, "q must be 4-D"),
    (lambda: flashedu.attention(q, k.numpy(), v), TypeError, "k must be a torch.Tensor"),
    (lambda: flashedu.attention(q, k.double(), v), TypeError, "share one dtype"),
    (lambda: flashedu.attention(q.int(), k.int(), v.int()), TypeError, "floating dtype"),
    (lambda: flashedu.attention(q, k, v[:, :, :5]), ValueError, "k and v must have the same shape"),
    (lambda: flashedu.attention(q, k[..., :8], v[..., :8]), ValueError, "same head dim"),
    (lambda: flashedu.attention(q, k[:1], v[:1]) if False else flashedu.attention(
        torch.randn(2, 2, 8, 16), k, v), ValueError, "batch size"),
    (lambda: flashedu.attention(*_qkv(H=4, Hkv=2)), ValueError, "enable_gqa"),
    (lambda: flashedu.attention(*_qkv(H=3, Hkv=2), enable_gqa=True), ValueError, "multiple"),
    (lambda: flashedu.attention(q, k, v, scale=-1.0), ValueError, "scale"),
    (lambda: flashedu.attention(q, k, v, scale="big"), TypeError, "scale"),
    (lambda: flashedu.attention(q, k, v, dropout_p=1.5), ValueError, "dropout_p"),
    (lambda: flashedu.attention(q, k, v, is_causal=1), TypeError, "is_causal"),
    (lambda: flashedu.attention(q, k, v, backend="cuda"), ValueError, "backend must be one of"),
    (lambda: flashedu.attention(q, k, v, block_mask=np.ones((1, 1), bool)), TypeError, "block_mask"),
    (lambda: flashedu.attention(q, k, v, block_mask=flashedu.BlockMask.causal((16, 16), (8, 8))),
     ValueError, "block_mask was built for seq_lens"),
    (lambda: flashedu.attention(q, k, v, block_mask=flashedu.BlockMask.from_dense(
        np.ones((3, 1, 1, 1), bool), (8, 8), (8, 8))), ValueError, "block_mask has blocks"),
    (lambda: flashedu.attention(q, k, v, dropout_p=0.1, backend="numba"), NotImplementedError, "dropout"),
]


@pytest.mark.parametrize("call, exc, match", BAD, ids=[b[2] for b in BAD])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_naive_dropout_is_reproducible():
    torch.manual_seed(1)
    a = flashedu.attention(q, k, v, dropout_p=0.3, backend="naive")
    torch.manual_seed(1)
    b = flashedu.attention(q, k, v, dropout_p=0.3, backend="naive")
    assert torch.equal(a, b) and not torch.equal(a, flashedu.attention(q, k, v, backend="naive"))


def test_auto_is_numpy_without_gpu():
    from flashedu.backends import resolve_backend

    assert resolve_backend("auto") == ("triton" if torch.cuda.is_available() else "numpy")


# ----- no silent wrong answer: each of these once gave NaN, garbage, or a raw error ------------
SDPA = torch.nn.functional.scaled_dot_product_attention


def test_naive_fp16_large_logits_match_sdpa():
    """16-bit scores overflow (100 * 100 * 8 / sqrt(8) > 65504): computed in float32 instead."""
    x = torch.full((1, 1, 2, 8), 100.0, dtype=torch.float16)
    out = flashedu.attention(x, x, x, backend="naive")
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert torch.equal(out, SDPA(x, x, x))


def test_naive_bf16_large_logits_match_sdpa():
    g = torch.Generator().manual_seed(0)
    # logits near 280 that differ by a few units: bfloat16 scores there are 2 apart
    qb, kb = ((10 + 0.5 * torch.randn(1, 2, 16, 8, generator=g)).bfloat16() for _ in range(2))
    vb = torch.randn(1, 2, 16, 8, generator=g).bfloat16()
    ours = flashedu.attention(qb, kb, vb, backend="naive")
    ref = SDPA(qb.double(), kb.double(), vb.double())
    # only the final rounding to bfloat16 remains: half a bfloat16 ulp of |out| <= max |v|
    assert (ours.double() - ref).abs().max() <= 2 ** -8 * vb.double().abs().max()
    assert (ours.double() - ref).abs().max() <= 2 * (SDPA(qb, kb, vb).double() - ref).abs().max() + 1e-6


def test_naive_fp16_dropout_still_works():
    x = torch.randn(1, 2, 16, 8, dtype=torch.float16)
    torch.manual_seed(3)
    a = flashedu.attention(x, x, x, dropout_p=0.5, backend="naive")
    torch.manual_seed(3)
    b = flashedu.attention(x, x, x, dropout_p=0.5, backend="naive")
    assert a.dtype == torch.float16 and torch.equal(a, b)
    assert not torch.equal(a, flashedu.attention(x, x, x, backend="naive"))


def test_naive_upcast_false_is_the_plain_baseline():
    from flashedu.reference import naive_attention_torch

    x = torch.full((1, 1, 2, 8), 100.0, dtype=torch.float16)
    assert torch.isnan(naive_attention_torch(x, x, x, upcast=False)).all()


@pytest.mark.parametrize("scale", [1e-46, 1e-40, 1e39, 5e-324])
def test_scale_outside_float32_normal_range_is_refused(scale):
    with pytest.raises(ValueError, match="scale=.*float32's normal range"):
        flashedu.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [np.float32(0.125), np.float64(0.125), np.int64(1), 1])
def test_numpy_and_int_scales_are_accepted(scale):
    assert torch.equal(flashedu.attention(q, k, v, scale=scale, backend="naive"),
                       flashedu.attention(q, k, v, scale=float(scale), backend="naive"))


@pytest.mark.parametrize("kw, match", [
    (dict(is_causal="no"), "is_causal must be a bool"),
    (dict(is_causal=None), "is_causal must be a bool"),
    (dict(is_causal=np.int64(1)), "is_causal must be a bool"),
    (dict(enable_gqa="yes"), "enable_gqa must be a bool"),
    (dict(enable_gqa=1), "enable_gqa must be a bool"),
    (dict(scale=np.bool_(True)), "scale must be a float"),
    (dict(scale=torch.tensor(0.1)), "scale must be a float"),
    (dict(dropout_p=np.bool_(False)), "dropout_p"),
])
def test_bool_like_and_tensor_arguments_are_refused(kw, match):
    with pytest.raises(TypeError, match=match):
        flashedu.attention(q, k, v, backend="naive", **kw)


def test_numpy_bools_are_accepted():
    a = flashedu.attention(q, k, v, is_causal=np.bool_(True), enable_gqa=np.bool_(False))
    assert torch.equal(a, flashedu.attention(q, k, v, is_causal=True))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_sparse_and_nested_tensors_get_a_clear_message():
    with pytest.raises(TypeError, match="q must be a dense .strided. tensor, got layout torch.sparse_coo"):
        flashedu.attention(q.to_sparse(), k, v)
    nested = torch.nested.nested_tensor([q[0], q[0]])
    with pytest.raises(TypeError, match="q must be a dense tensor .* nested"):
        flashedu.attention(nested, k, v)


def test_complex_and_conjugate_inputs():
    """Complex (conjugated or not) is refused by dtype; a conj view of a real tensor is itself."""
    c = torch.randn(1, 2, 8, 16, dtype=torch.complex64)
    with pytest.raises(TypeError, match="q must have a floating dtype"):
        flashedu.attention(c.conj(), k, v)
    assert torch.equal(flashedu.attention(q.conj(), k.conj(), v.conj()), flashedu.attention(q, k, v))


def test_negative_views_are_resolved(backend):
    """torch._neg_view sets a bit instead of negating: numpy() refuses it, raw pointers ignore it."""
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(1, 2, 16, 16, generator=g).to(device(backend)) for _ in range(3))
    kw = dict(is_causal=True, backend=backend)
    got = flashedu.attention(torch._neg_view(a), torch._neg_view(b), torch._neg_view(c), **kw)
    want = flashedu.attention(-a, -b, -c, **kw)
    assert (got - want).abs().max() < 1e-5
    assert (want - SDPA(-a, -b, -c, is_causal=True)).abs().max() < 1e-4


def test_numba_refuses_float64():
    if flashedu.available_backends()["numba"] is not None:
        pytest.skip("numba backend unavailable")
    with pytest.raises(TypeError, match="numba backend computes in float32"):
        flashedu.attention(q.double(), k.double(), v.double(), backend="numba")


# ----- the command line --------------------------------------------------------------------
def test_cli_version(capsys):
    from flashedu.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"flashedu {flashedu.__version__}"


def test_cli_check_missing_notebook_fails(capsys, tmp_path):
    from flashedu.cli import main

    assert main(["check", str(tmp_path / "nope.ipynb")]) == 2
    assert "no such notebook" in capsys.readouterr().err
    assert main(["check", "--timeout", "5", str(tmp_path / "a.ipynb")]) == 2


def test_cli_tour_json_bad_path_fails_before_the_tour(monkeypatch, capsys, tmp_path):
    import flashedu.tour
    from flashedu.cli import main

    def boom(**_):
        raise AssertionError("the tour ran")

    monkeypatch.setattr(flashedu.tour, "run_tour", boom)
    for bad in ("/no/such/dir/x.json", str(tmp_path)):
        with pytest.raises(SystemExit) as exc:
            main(["tour", "--json", bad])
        assert exc.value.code == 2 and "--json" in capsys.readouterr().err


def test_tour_json_stores_numbers(monkeypatch, tmp_path):
    import json

    import flashedu.tour

    monkeypatch.setattr(flashedu.tour, "available_backends",
                        lambda: {"naive": None, "numpy": None, "numba": "ImportError: not here"})
    monkeypatch.setattr(flashedu.tour, "CPU_PROBLEM", dict(B=1, H=2, Hkv=1, N=8, d=8))
    path = tmp_path / "tour.json"
    assert flashedu.tour.run_tour(json_path=str(path)) == 0
    rows = {r["backend"]: r for r in json.loads(path.read_text())["rows"]}
    for name in ("naive", "numpy"):
        assert isinstance(rows[name]["max_err"], float) and isinstance(rows[name]["seconds"], float)
        assert rows[name]["ok"] is True
    assert rows["numba"]["max_err"] is None and rows["numba"]["ok"] is None


@pytest.mark.parametrize("kw", [dict(scale=10**400), dict(dropout_p=10**400), dict(scale=-10**400)])
def test_huge_python_ints_are_a_value_error(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        flashedu.attention(q, k, v, **kw)


# ----- attn_mask, score_mod, return_lse, mask mods ------------------------------------------------
BAD_MODS = [
    (lambda: flashedu.attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True),
     ValueError, "attn_mask and is_causal"),
    (lambda: flashedu.attention(q, k, v, attn_mask=torch.ones(2, 8, 5)), ValueError,
     r"attn_mask must broadcast to \(B, H, Nq, Nk\)"),
    (lambda: flashedu.attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.float16)), TypeError,
     "attn_mask must be bool, or float"),
    (lambda: flashedu.attention(q, k, v, attn_mask=[[True]]), TypeError, "attn_mask must be a torch.Tensor"),
    (lambda: flashedu.attention(q, k, v, score_mod=3.0), TypeError, "score_mod must be callable"),
    (lambda: flashedu.attention(q, k, v, return_lse="yes"), TypeError, "return_lse must be a bool"),
    (lambda: flashedu.attention(q, k, v, block_mask=flashedu.BlockMask.from_mask_mod(
        lambda b, h, qi, ki: qi >= ki if qi > ki else False, None, None, 8, 8, (4, 4))),
     TypeError, "broadcast"),
    (lambda: flashedu.mods.sliding_window(0), ValueError, "window must be a positive int"),
    (lambda: flashedu.mods.causal("bottom"), ValueError, "alignment must be one of"),
    (lambda: flashedu.mods.softcap(-1.0), ValueError, "cap must be a positive"),
    (lambda: flashedu.mods.document([0.5, 1.0]), TypeError, "doc_ids must hold ints"),
    (lambda: flashedu.mods.document.from_lengths([[2, 3], [4]]), ValueError, "add up to one N"),
    (lambda: flashedu.BlockMask.from_mask_mod(flashedu.mods.causal(), 0, None, 8, 8), ValueError,
     "B must be a positive int or None"),
]


@pytest.mark.parametrize("call, exc, match", BAD_MODS, ids=[b[2] for b in BAD_MODS])
def test_bad_mods_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
