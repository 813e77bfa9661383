"""flashedu as an attention implementation of Hugging Face transformers
(flashedu.integrations.transformers): tiny random Llama (GQA), GPT-2 and Gemma 2 built from their
configs, on left-padded batches, against transformers' own "sdpa" ("eager" where SDPA lacks the
feature).

Each comparison is against the same model in float64, and flashedu may miss it by what
tolerance.py allows beside the error of transformers' own float32 run. Logits are compared on
real tokens only: a padding position's query sees no key, which flashedu answers with zeros and
SDPA's CPU path with the mean of v (README, "Where flashedu and SDPA part"); no real token reads
it."""

import copy
import sys

import pytest
import torch

import flashedu
from flashedu import tolerance

transformers = pytest.importorskip(
    "transformers", reason='Hugging Face transformers is not installed: pip install '
                           '"flashedu[transformers]"')

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from flashedu.integrations import transformers as hf  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; none is visible here")
VOCAB = 100
PADS = (5, 2, 0)  # left padding of each sequence of the batch; the last has none


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices gain nothing from threads, and lose a lot when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def registry():
    """transformers' two registries as they were before the test (register() writes into
    class-wide dicts)."""
    saved = [(cls, dict(cls._global_mapping))
             for cls in (AttentionInterface, AttentionMaskInterface)]
    yield
    for cls, mapping in saved:
        cls._global_mapping.clear()
        cls._global_mapping.update(mapping)


@pytest.fixture
def calls(registry, monkeypatch):
    """"edu" (numpy on the CPU) and "edu-triton" registered; each call's (Nq, Nk, mask shape or
    None) recorded."""
    seen = []
    forward = hf.attention_forward

    def recorded(module, query, key, value, attention_mask, **kwargs):
        mask = None if attention_mask is None else tuple(attention_mask.shape)
        seen.append((query.shape[2], key.shape[2], mask))
        return forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(hf, "attention_forward", recorded)
    hf.register()
    hf.register("edu-triton", backend="triton")
    return seen


def tiny_llama(**overrides):
    """Llama with grouped-query attention: 4 query heads share 2 K/V heads."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, **overrides)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_gpt2():
    """GPT-2 whose second layer scales its scores by 1 / (sqrt(d) * 2): ``scaling`` is not the
    default there."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
        scale_attn_by_inverse_layer_idx=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_gemma2(**overrides):
    """Gemma 2: a softcap of 1 on the scores (weights drawn 10x the default's width give scores
    of order 1, which tanh bends) and a sliding window of 4 on every other layer."""
    torch.manual_seed(0)
    fields = {"attn_logit_softcapping": 1.0, "sliding_window": 4, **overrides}
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        final_logit_softcapping=None, max_position_embeddings=64, pad_token_id=0,
        initializer_range=0.2, **fields)
    return transformers.Gemma2ForCausalLM(config).eval()


def batch(n=12, pads=PADS, device="cpu"):
    """Token ids (len(pads), n) and their attention mask, left-padded by ``pads``."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (len(pads), n), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids.to(device), mask.to(device)


def device_of(impl):
    """Where a test puts the model: compiled triton kernels take CUDA tensors, the interpreter
    and numpy CPU ones."""
    return flashedu.runtime.kernel_device() if impl == "edu-triton" else torch.device("cpu")


def use(model, impl):
    model.config._attn_implementation = impl
    return model


def logits(model, impl, ids, mask):
    with torch.no_grad():
        return use(model, impl)(input_ids=ids, attention_mask=mask).logits


def check_logits(model, impl, ids, mask, *, peer="sdpa", ref_model=None):
    """``impl``'s logits on the real tokens against the model in float64 (``ref_model``, else
    a float64 copy), allowed what the peer implementation's own error there allows
    (tolerance.py): (error, the peer's error, the allowance)."""
    real = mask.bool()
    ref_model = ref_model or copy.deepcopy(model).double()
    ref = logits(ref_model, peer, ids, mask)[real]
    plain = logits(model, peer, ids, mask)[real]
    got = logits(model, impl, ids, mask)[real]
    return tolerance.check(got, ref, plain, dtype=model.dtype, name=f"{impl} logits")


def gradients(model, impl, ids, mask):
    """Every parameter's gradient of the loss over the real tokens (a training step's)."""
    use(model, impl).train()
    model.zero_grad()
    labels = ids.masked_fill(mask == 0, -100)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def greedy(model, impl, ids, mask, **kwargs):
    with torch.no_grad():
        return use(model, impl).generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                         do_sample=False, pad_token_id=0, **kwargs)


class Layer(torch.nn.Module):
    """What transformers' attention modules hand the implementation besides the tensors."""

    def __init__(self, groups=1, is_causal=True):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, is_causal


# ----------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cuda", "", "Triton", 3, None])
def test_a_bad_backend_is_refused_before_anything_registers(backend, registry):
    before = dict(AttentionInterface._global_mapping)
    with pytest.raises(ValueError, match="backend must be one of"):
        hf.register(backend=backend)
    assert AttentionInterface._global_mapping == before


@pytest.mark.parametrize("name", ["flashedu", "my_Flash", "", 3])
def test_names_transformers_would_misread_are_refused(name, registry):
    """transformers 5 takes any name containing "flash" for Flash Attention (its
    is_flash_attention_requested tests ``"flash" in name``): from_pretrained would look for the
    flash-attn package, and models would take its code paths."""
    with pytest.raises(ValueError, match="flash|non-empty"):
        hf.register(name)


def test_transformers_own_names_are_refused_ours_replaced(registry):
    with pytest.raises(ValueError, match="transformers' own"):
        hf.register("sdpa")
    hf.register("mine", backend="naive")
    hf.register("mine", backend="numpy")
    assert AttentionInterface._global_mapping["mine"].flashedu_backend == "numpy"
    assert AttentionMaskInterface._global_mapping["mine"] is \
        AttentionMaskInterface._global_mapping["sdpa"]


def test_without_transformers_register_says_what_to_install(monkeypatch):
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    with pytest.raises(ImportError, match=r'pip install "flashedu\[transformers\]"'):
        hf.register()


# ----------------------------------------------------------------------------------------
# The attention call itself
# ----------------------------------------------------------------------------------------


def test_layout_and_mask_as_sdpa_attention_forward():
    """(B, H, N, d) in, (B, N, H, d) and no weights out, GQA and a bool padding mask, as
    transformers' own adapter of SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q = torch.randn(2, 4, 9, 16, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 16, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    mask[0, :, :, :3] = False  # three padding keys; rows 0-2 of sequence 0 see nothing
    ref, none = sdpa_attention_forward(Layer(groups=2), q, k, v, mask, scaling=0.3)
    out, weights = hf.attention_forward(Layer(groups=2), q, k, v, mask, scaling=0.3)
    assert out.shape == ref.shape == (2, 9, 4, 16) and weights is None is none
    real = mask[:, 0].any(-1)  # (B, Nq): the rows that see a key
    assert torch.allclose(out[real], ref[real], rtol=0, atol=1e-12)
    assert (out[~real] == 0).all()


def test_a_position_bias_is_added_to_the_scores():
    """T5's relative positions (``position_bias``): added to every score, the mask's hidden
    pairs out, as SDPA given the sum as a float mask."""
    q, k, v = (torch.randn(2, 2, 7, 8, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, 2, 7, 7, dtype=torch.float64)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=bias.masked_fill(~causal, float("-inf")))
    for mask in (None, causal.expand(2, 1, 7, 7)):  # is_causal, or the mask
        out, _ = hf.attention_forward(Layer(), q, k, v, mask, position_bias=bias)
        assert torch.allclose(out.transpose(1, 2), ref, rtol=0, atol=1e-12)


def test_dropout_reaches_the_kernel():
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    out, _ = hf.attention_forward(Layer(), q, k, v, None, dropout=1.0)  # every weight dropped
    assert (out == 0).all()
    kept, _ = hf.attention_forward(Layer(), q, k, v, None, dropout=0.0)
    assert (kept != 0).any()


@pytest.mark.parametrize("kwargs, error, words", [
    ({"s_aux": torch.zeros(2)}, NotImplementedError, "attention sinks"),
    ({"sinks": torch.zeros(2)}, NotImplementedError, "attention sinks"),
    ({"head_mask": torch.ones(2)}, NotImplementedError, "head mask"),
    ({"output_attentions": True}, NotImplementedError, "output_attentions"),
    ({"sliding_window": 4}, ValueError, "the window would be ignored"),
    ({"softcap": 0.0}, ValueError, "cap must be a positive"),
])
def test_what_flashedu_cannot_honour_is_refused(kwargs, error, words):
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    with pytest.raises(error, match=words):
        hf.attention_forward(Layer(), q, k, v, None, **kwargs)


# ----------------------------------------------------------------------------------------
# Whole models
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["edu", "edu-triton"])
def test_llama_gqa_left_padded_logits(impl, calls):
    device = device_of(impl)
    check_logits(tiny_llama().to(device), impl, *batch(device=device))
    assert calls and all(mask is not None for _, _, mask in calls)  # padding: always a mask


def test_from_pretrained_with_attn_implementation(calls, tmp_path):
    """The README's path: a saved model loaded with attn_implementation="edu" (a folder here,
    a hub name there) runs its attention through flashedu."""
    tiny_llama().save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="edu")
    assert model.config._attn_implementation == "edu"
    check_logits(model, "edu", *batch())
    assert calls


def test_gpt2_left_padded_logits(calls):
    check_logits(tiny_gpt2(), "edu", *batch())


def test_gemma2_softcap_and_sliding_window_against_eager(calls):
    """SDPA has no softcap (transformers' adapter of it refuses one since 5.24, ignored it
    before), so the peer is "eager",
    here without padding: eager in float64 gives NaN on padding rows, whose 0 weights then
    carry the NaN into the real tokens (0 * NaN). Without the softcap, or without the window
    (12 tokens, a window of 4), the logits move far beyond the allowance: both are at work."""
    model, (ids, mask) = tiny_gemma2(), batch(pads=(0, 0))
    _, _, limit = check_logits(model, "edu", ids, mask, peer="eager")
    assert any(m is not None and nk == 12 for _, nk, m in calls)  # the window's mask
    for change in ({"attn_logit_softcapping": None}, {"sliding_window": 64}):
        moved = logits(tiny_gemma2(**change), "edu", ids, mask) - \
            logits(model, "edu", ids, mask)
        assert moved.abs().max() > 100 * limit, change


@pytest.mark.parametrize("impl", ["edu", "edu-triton"])
def test_training_step_gradients_match_sdpa(impl, calls):
    device = device_of(impl)
    model, (ids, mask) = tiny_llama().to(device), batch(device=device)
    ref = gradients(copy.deepcopy(model).double(), "sdpa", ids, mask)
    plain, got = gradients(model, "sdpa", ids, mask), gradients(model, impl, ids, mask)
    assert got.keys() == ref.keys() and len(got) == len(list(model.parameters()))
    for name in ref:
        tolerance.check(got[name], ref[name], plain[name], dtype=torch.float32,
                        factor=tolerance.GRADIENT, name=f"{impl} grad of {name}")


def test_attention_dropout_in_training_only(calls):
    """The module's dropout reaches flashedu in training (two steps draw different masks) and
    0 in eval (the same logits twice)."""
    model, (ids, mask) = use(tiny_llama(attention_dropout=0.5), "edu"), batch()
    real = mask.bool()
    model.train()
    a, b = (model(input_ids=ids, attention_mask=mask).logits[real] for _ in range(2))
    assert not torch.allclose(a, b)
    model.eval()
    assert torch.equal(logits(model, "edu", ids, mask), logits(model, "edu", ids, mask))


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_greedy_generation_with_the_kv_cache_matches_sdpa(make, calls):
    model, (ids, mask) = make(), batch()
    ref, got = greedy(model, "sdpa", ids, mask), greedy(model, "edu", ids, mask)
    assert torch.equal(got, ref)
    # after the prompt, one query a step against the cache and a mask for the padding
    decoding = [(nq, nk, m) for nq, nk, m in calls if nq == 1]
    assert decoding and all(nk > ids.shape[1] and m is not None for _, nk, m in decoding)


def test_static_cache_generation_matches_sdpa(calls):
    """A static cache's prompt: Nk > Nq keys, the slots past the prompt not written yet; in
    transformers 5 with no mask at all (see the next test)."""
    model = tiny_llama()
    ids = torch.randint(1, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    kw = {"cache_implementation": "static"}
    assert torch.equal(greedy(model, "edu", ids, mask, **kw),
                       greedy(model, "sdpa", ids, mask, **kw))


def test_no_mask_and_more_keys_than_queries_is_causal_top_left():
    """transformers leaves the mask out for Nq > 1 only where Nq == Nk or the cache is empty
    (a static cache's prompt): top-left causal there, SDPA's is_causal, never bottom-right,
    which would let the queries see the unwritten slots."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 14, 8, dtype=torch.float64) for _ in range(2))
    out, _ = hf.attention_forward(Layer(), q, k, v, None)
    ref, _ = sdpa_attention_forward(Layer(), q, k, v, None)
    top_left = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(10, 14, dtype=torch.bool).tril())
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    assert torch.allclose(out.transpose(1, 2), top_left, rtol=0, atol=1e-12)


def test_without_its_mask_function_padding_is_ignored(calls):
    """What register() prevents: an attention function registered alone gets
    attention_mask=None from transformers (it builds masks only for the names its mask
    registry knows), so the padded sequences' real tokens attend to the padding and their
    logits move far beyond the allowance; the unpadded sequence is unchanged."""
    AttentionInterface.register("alone", AttentionInterface._global_mapping["edu"])
    model, (ids, mask) = tiny_llama(), batch()
    err, _, limit = check_logits(model, "edu", ids, mask)
    calls.clear()
    alone, ref = logits(model, "alone", ids, mask), logits(model, "sdpa", ids, mask)
    assert calls and all(m is None for _, _, m in calls)
    real = mask.bool()
    padded = torch.tensor([p > 0 for p in PADS])
    assert (alone - ref)[real & padded[:, None]].abs().max() > 100 * limit
    assert (alone - ref)[~padded].abs().max() <= limit


# ----------------------------------------------------------------------------------------
# On a GPU (pytest -m gpu): half precision and the compiled triton kernels
# ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_and_gradients_on_cuda(dtype, calls):
    model, (ids, mask) = tiny_llama().cuda(), batch(device="cuda")
    ref_model = copy.deepcopy(model).double()
    model = model.to(dtype)
    check_logits(model, "edu-triton", ids, mask, ref_model=ref_model)
    ref = gradients(ref_model, "sdpa", ids, mask)
    plain = gradients(model, "sdpa", ids, mask)
    got = gradients(model, "edu-triton", ids, mask)
    for name in ref:
        tolerance.check(got[name], ref[name], plain[name], dtype=dtype,
                        factor=tolerance.GRADIENT, name=f"grad of {name}")


@pytest.mark.gpu
@needs_cuda
def test_greedy_generation_compiled_triton_on_cuda(calls):
    """bfloat16 rounding may break a near tie either way, so each token the compiled kernels
    choose must be the float64 model's best to within the error bfloat16 SDPA has there."""
    model, (ids, mask) = tiny_llama().cuda(), batch(device="cuda")
    ref_model, model = copy.deepcopy(model).double(), model.to(torch.bfloat16)
    out = greedy(model, "edu-triton", ids, mask)
    new = out[:, ids.shape[1]:]
    full = torch.cat([mask, torch.ones_like(new)], dim=1)
    steps = slice(ids.shape[1] - 1, -1)  # the logits that chose each new token
    ref = logits(ref_model, "sdpa", out, full)[:, steps]
    plain = logits(model, "sdpa", out, full)[:, steps]
    limit = tolerance.allowed_error(torch.bfloat16, tolerance.max_error(plain, ref))
    chosen = ref.gather(-1, new[..., None])[..., 0]
    assert (ref.max(-1).values - chosen).max() <= limit
