"""Decoding from a paged KV cache (flashedu.decode): triton (the interpreter on a CPU) and the
NumPy reference against float64 attention over each sequence's keys laid out contiguously."""

import numpy as np
import pytest
import torch

import flashedu
from flashedu import tolerance
from flashedu.decode import PagedKVCache, gather_pages, paged_attention
from flashedu.models import GPT, generate, tiny_config
from flashedu.reference import naive_attention
from flashedu.triton.decode import split_kv_attention

DEVICE = flashedu.runtime.kernel_device()  # the CPU under the interpreter, else the GPU


def random_pool(lengths, page_size, Hkv, d, dtype, seed, spare=3, width_extra=1):
    """A pool with each sequence's pages scattered at random, and the table padded past them."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages) + spare
    k = torch.randn(num_pages, page_size, Hkv, d, generator=g).to(dtype)
    v = torch.randn(num_pages, page_size, Hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(lengths), max(pages) + width_extra, dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[used:used + p]
        used += p
    return k, v, table, torch.tensor(lengths, dtype=torch.int32)


def contiguous(cache, table, n, page_size):
    """Sequence's n keys as (Hkv, n, d) in float64, read through its pages (only the rows read
    are widened: the pool of a filled GPU is gigabytes in float64)."""
    rows = gather_pages(cache, table.numpy(), page_size, 0, n)
    return rows.double().permute(1, 0, 2)


def reference(q, k, v, table, lengths, page_size, causal, dtype=torch.float64):
    """(O, L) by the naive formula per sequence and head, each sequence's keys gathered whole."""
    B, H, Nq, d = q.shape
    G = H // k.shape[2]
    O = torch.zeros(B, H, Nq, d, dtype=torch.float64)
    L = torch.full((B, H, Nq), -float("inf"), dtype=torch.float64)
    for b, n in enumerate(lengths.tolist()):
        if n == 0:
            continue
        K, V = (contiguous(c, table[b], n, page_size) for c in (k, v))
        mask = np.tri(Nq, n, k=n - Nq, dtype=bool) if causal else None
        for h in range(H):
            Qh = q[b, h].double()
            args = [t.to(dtype).numpy() for t in (Qh, K[h // G], V[h // G])]
            o, lse = naive_attention(*args, mask=mask)
            blind = ~np.isfinite(lse)
            O[b, h] = torch.from_numpy(np.where(blind[:, None], 0.0, o)).double()
            L[b, h] = torch.from_numpy(np.where(blind, -np.inf, lse)).double()
    return O, L


CASES = [  # lengths, H, Hkv, Nq, d, page_size, dtype, causal, num_splits
    ([37, 0, 100], 4, 2, 1, 32, 16, torch.float32, False, None),  # an empty sequence
    ([70, 5], 8, 2, 1, 64, 32, torch.float32, False, 3),  # GQA, splits not on page edges
    ([48, 33, 16], 2, 1, 4, 40, 16, torch.float32, True, 2),  # 4 queries, padded head dim
    ([2, 90], 4, 4, 3, 16, 16, torch.float32, True, None),  # fewer keys than queries
    ([81, 19], 4, 2, 1, 64, 64, torch.float16, False, 4),
    ([50], 2, 2, 1, 64, 16, torch.bfloat16, True, None),
    ([37, 12], 4, 2, 1, 32, 5, torch.float32, False, None),  # pages smaller than a tile
    ([60], 2, 1, 2, 16, 24, torch.float32, True, 3),  # tiles across page edges
    ([37, 0, 100], 4, 2, 2, 40, 16, torch.float32, True, 1),  # one split: no merge launched
    ([45, 70], 4, 2, 1, 32, 4, torch.float32, True, 2),  # a tile holds whole pages: one entry each
]


@pytest.mark.parametrize("backend", ["triton", "numpy"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[1:])).replace("torch.", ""))
def test_matches_contiguous_reference(case, backend):
    lengths, H, Hkv, Nq, d, P, dtype, causal, splits = case
    device = DEVICE if backend == "triton" else "cpu"
    k, v, table, seqlens = random_pool(lengths, P, Hkv, d, dtype, seed=len(lengths) * 7 + d)
    q = torch.randn(len(lengths), H, Nq, d, generator=torch.Generator().manual_seed(d)).to(dtype)
    out, lse = paged_attention(*(t.to(device) for t in (q, k, v, table, seqlens)),
                               is_causal=causal, num_splits=splits, return_lse=True,
                               backend=backend)
    assert out.dtype == dtype and out.shape == q.shape and out.device.type == torch.device(device).type
    O_ref, L_ref = reference(q, k, v, table, seqlens, P, causal)
    O_plain, _ = reference(q, k, v, table, seqlens, P, causal, torch.float32)
    tol = tolerance.allowed_error(dtype, tolerance.max_error(O_plain.to(dtype).double(), O_ref))
    assert (out.cpu().double() - O_ref).abs().max().item() <= tol
    seen = torch.isfinite(L_ref)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)  # -inf exactly where no key is seen
    torch.testing.assert_close(lse.cpu().double()[seen], L_ref[seen], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("page_size", [5, 8, 16, 48])
def test_pages_looked_up_ahead_or_in_their_own_step_give_the_same_bits(monkeypatch, page_size):
    """Each unmasked tile's page is looked up during the tile before (PAGES_AHEAD) so that the
    compiled pipeline keeps two K/V tiles in flight; looked up in the tile's own step instead,
    the arithmetic is the same: the same bits, pages smaller than a tile (a divisor of it or
    not), larger, not a multiple of it."""
    from flashedu.triton import decode as tdecode
    from flashedu.triton import fast

    k, v, table, seqlens = random_pool([150, 0, 61, 97], page_size, 2, 32, torch.float32,
                                       seed=page_size)
    q = torch.randn(4, 4, 2, 32, generator=torch.Generator().manual_seed(3))
    given = [t.to(DEVICE) for t in (q, k, v, table, seqlens)]
    outs = []
    for ahead in (True, False):
        monkeypatch.setattr(tdecode, "PAGES_AHEAD", ahead)
        monkeypatch.setattr(fast, "PLANS", {})
        tdecode._launch_plan.cache_clear()
        outs.append(paged_attention(*given, is_causal=True, num_splits=2, return_lse=True))
        (plan,) = fast.PLANS.values()
        assert plan[0].consts["AHEAD"] is ahead
    tdecode._launch_plan.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(*outs))


KV_HEADS_CASES = [  # lengths, H, Hkv, Nq, d, page_size (0: contiguous), causal, num_splits
    ([37, 0, 100], 8, 4, 1, 32, 16, False, 3),  # an empty sequence; tiles of 8 keys, 2 a page
    ([70, 5], 8, 2, 1, 64, 8, True, 2),  # a tile a page
    ([48, 33, 16], 4, 2, 3, 40, 32, True, 1),  # 3 queries, padded head dim, one split
    ([2, 90], 4, 4, 3, 16, 16, True, 4),  # fewer keys than queries
    ([61, 45], 8, 4, 2, 32, 0, True, 3),  # a contiguous cache
    ([100, 7, 55], 2, 2, 1, 32, 0, False, 2),  # no GQA: one query head a K/V head
]


@pytest.mark.parametrize("case", KV_HEADS_CASES,
                         ids=lambda c: "-".join(map(str, c[1:])))
def test_two_kv_heads_a_program_match_the_reference(monkeypatch, case):
    """A program that reads two K/V heads side by side (the one-an-SM plan where the groups fill
    the GPU twice: on a GPU only, so planned here by hand), each query row seeing its own
    head's rows: against float64, paged and contiguous, causal, ragged, empty, split or not."""
    from flashedu.triton import decode as tdecode
    from flashedu.triton import fast

    lengths, H, Hkv, Nq, d, P, causal, splits = case
    k, v, table, seqlens = random_pool(lengths, P or 16, Hkv, d, torch.float32, seed=sum(lengths))
    q = torch.randn(len(lengths), H, Nq, d, generator=torch.Generator().manual_seed(d))
    group, Bc = H // Hkv, 8
    capacity = table.shape[1] * (P or 16)

    def two_heads(B, H_, Hkv_, Nq_, Nk, d_, dtype, sms, interpreted, num_splits, page_size=0):
        S, chunk = tdecode.split_chunks(Nk, Bc, splits)
        return 2 * group, Bc, S, chunk, {}
    monkeypatch.setattr(tdecode, "_plan", two_heads)
    monkeypatch.setattr(fast, "PLANS", {})
    tdecode._launch_plan.cache_clear()
    try:
        with torch.no_grad():
            if P:
                out, lse = paged_attention(*(t.to(DEVICE) for t in (q, k, v, table, seqlens)),
                                           is_causal=causal, return_lse=True)
            else:  # the same keys, one contiguous block (every sequence the longest's length)
                K, V = (torch.stack([contiguous(c, table[b], capacity, 16).float()
                                     for b in range(len(lengths))]) for c in (k, v))
                seqlens = torch.full_like(seqlens, capacity)
                out, lse = split_kv_attention(q.to(DEVICE), K.to(DEVICE), V.to(DEVICE),
                                              is_causal=causal, return_lse=True)
        (plan,) = fast.PLANS.values()
    finally:
        tdecode._launch_plan.cache_clear()
    assert plan[0].consts["KV_HEADS"] == 2 and plan[0].grid[1] == len(lengths) * Hkv // 2
    O_ref, L_ref = reference(q, k, v, table, seqlens, P or 16, causal)
    assert tolerance.max_error(out.cpu(), O_ref) < 1e-4
    seen = torch.isfinite(L_ref)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    torch.testing.assert_close(lse.cpu().double()[seen], L_ref[seen], rtol=1e-5, atol=1e-4)


def test_paged_equals_split_kv_on_the_same_keys():
    """The page lookup is the only difference from the contiguous split-KV kernel (the tiles
    and split points may differ: the same answer up to float32 rounding)."""
    k, v, table, seqlens = random_pool([75], 16, 2, 32, torch.float32, seed=1)
    q = torch.randn(1, 4, 1, 32)
    K, V = (contiguous(c, table[0], 75, 16).float()[None] for c in (k, v))
    dev = [t.to(DEVICE) for t in (q, k, v, table, seqlens)]
    paged = paged_attention(*dev, num_splits=2)
    split = split_kv_attention(q.to(DEVICE), K.to(DEVICE), V.to(DEVICE), num_splits=2)
    torch.testing.assert_close(paged, split, rtol=1e-5, atol=1e-6)


def test_a_repeated_step_repeats_its_launch_plan(monkeypatch):
    """A decoding step laid out as the last one (same shapes, strides, dtypes, options) adds no
    plan and starts the last step's launches with its own tensors: right for new values, a new
    block table and new lengths (each is a slot, read by the kernel); another layout or
    return_lse gets its own plan, both right."""
    from flashedu.triton import fast

    monkeypatch.setattr(fast, "PLANS", {})
    first = random_pool([70, 33], 16, 2, 32, torch.float32, seed=3)
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(3))
    paged_attention(*(t.to(DEVICE) for t in (q, *first)), num_splits=2)
    plans = dict(fast.PLANS)
    assert len(plans) == 1
    k, v, table, seqlens = random_pool([20, 90], 16, 2, 32, torch.float32, seed=4,
                                       width_extra=0)  # same table width, other pages
    assert table.shape == first[2].shape and not torch.equal(table, first[2])
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(4))
    out = paged_attention(*(t.to(DEVICE) for t in (q, k, v, table, seqlens)), num_splits=2)
    assert fast.PLANS == plans  # repeated, not rebuilt
    O_ref, L_ref = reference(q, k, v, table, seqlens, 16, False)
    torch.testing.assert_close(out.cpu().double(), O_ref, rtol=1e-5, atol=1e-5)
    out, lse = paged_attention(*(t.to(DEVICE) for t in (q, k, v, table, seqlens)),
                               num_splits=2, return_lse=True)
    assert len(fast.PLANS) == 2
    torch.testing.assert_close(lse.cpu().double(), L_ref, rtol=1e-5, atol=1e-5)


def test_float64_numpy_is_the_exact_reference():
    k, v, table, seqlens = random_pool([30, 64], 16, 1, 8, torch.float64, seed=2)
    q = torch.randn(2, 2, 2, 8, dtype=torch.float64)
    out = paged_attention(q, k, v, table, seqlens, is_causal=True, backend="numpy")
    O_ref, _ = reference(q, k, v, table, seqlens, 16, True)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, O_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change, match", [
    (dict(block_table=torch.tensor([[0, 9]], dtype=torch.int32)), r"block_table\[0, 1\] = 9"),
    (dict(block_table=torch.tensor([[0, -1]], dtype=torch.int32)), r"block_table\[0, 1\] = -1"),
    (dict(cache_seqlens=torch.tensor([33], dtype=torch.int32)), r"cache_seqlens\[0\] = 33"),
    (dict(cache_seqlens=torch.tensor([-1], dtype=torch.int32)), r"cache_seqlens\[0\] = -1"),
    (dict(cache_seqlens=torch.tensor([3, 3], dtype=torch.int32)), "cache_seqlens must be"),
    (dict(block_table=torch.tensor([0, 1], dtype=torch.int32)), "block_table must be"),
    (dict(block_table=torch.tensor([[0.0, 1.0]])), "block_table must be an int32"),
    (dict(k_cache=torch.zeros(0, 16, 2, 8), v_cache=torch.zeros(0, 16, 2, 8)), "at least one page"),
    (dict(k_cache=torch.zeros(4, 16, 3, 8), v_cache=torch.zeros(4, 16, 3, 8)), "multiple of"),
    (dict(k_cache=torch.zeros(4, 16, 2, 4), v_cache=torch.zeros(4, 16, 2, 4)), "head dim"),
    (dict(v_cache=torch.zeros(4, 16, 2, 8, dtype=torch.float64)), "share one floating dtype"),
    (dict(q=torch.zeros(4, 1, 8)), "q must be 4-D"),
    (dict(k_cache=[0]), "k_cache must be a torch.Tensor"),
    (dict(num_splits=0), "num_splits must be a positive int"),
])
def test_bad_arguments_are_named(change, match):
    """A page id outside the pool or a length past the table is an error, not a wild read."""
    args = dict(q=torch.zeros(1, 4, 1, 8), k_cache=torch.zeros(4, 16, 2, 8),
                v_cache=torch.zeros(4, 16, 2, 8), block_table=torch.tensor([[0, 1]], dtype=torch.int32),
                cache_seqlens=torch.tensor([20], dtype=torch.int32))
    args.update(change)
    options = {"num_splits": args.pop("num_splits")} if "num_splits" in args else {}
    with pytest.raises((ValueError, TypeError), match=match):
        paged_attention(**args, **options, backend="numpy")


def test_unused_table_entries_are_not_checked():
    """Past a sequence's pages the table holds padding, which is never read."""
    args = (torch.zeros(1, 2, 1, 8), torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8),
            torch.tensor([[1, 999]], dtype=torch.int32), torch.tensor([16], dtype=torch.int32))
    assert paged_attention(*args, backend="numpy").abs().max() == 0


def test_cache_hands_out_and_takes_back_pages():
    cache = PagedKVCache(num_pages=4, page_size=16, num_kv_heads=1, head_dim=8)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.extend([a], 20)  # two pages
    cache.extend([b], 16)  # one page
    assert len(cache.pages[a]) == 2 and len(cache.pages[b]) == 1 and len(cache.free_pages) == 1
    with pytest.raises(RuntimeError, match="1 free pages, 2 are needed"):
        cache.extend([a, b], 13)  # a needs a third page, b a second
    assert cache.lengths == {a: 20, b: 16}  # a refused extend changes nothing
    cache.free(a)
    assert len(cache.free_pages) == 3 and a not in cache.pages
    c = cache.add_sequence()
    cache.extend([c], 32)
    assert cache.pages[c] == [0, 1]  # a's pages, handed out again
    with pytest.raises(KeyError, match="not in the cache"):
        cache.write(0, [a], torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8))
    with pytest.raises(ValueError, match="call extend first"):
        d = cache.add_sequence()
        cache.write(0, [d], torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8))


def test_cache_attention_equals_attention_over_the_written_keys():
    """Tokens written in several pieces, interleaved across sequences, then read back."""
    torch.manual_seed(3)
    cache = PagedKVCache(num_pages=10, page_size=16, num_kv_heads=2, head_dim=16, num_layers=2)
    seqs = [cache.add_sequence() for _ in range(2)]
    written = {s: [] for s in seqs}
    for n in (7, 20, 1, 9):
        cache.extend(seqs, n)
        k, v = torch.randn(2, 2, n, 16), torch.randn(2, 2, n, 16)
        cache.write(1, seqs, k, v)
        for i, s in enumerate(seqs):
            written[s].append((k[i], v[i]))
    q = torch.randn(2, 4, 1, 16)
    out = cache.attention(1, q, seqs, backend="numpy")
    for i, s in enumerate(seqs):
        K = torch.cat([k for k, _ in written[s]], 1)[None]
        V = torch.cat([v for _, v in written[s]], 1)[None]
        want = flashedu.attention(q[i:i + 1], K, V, enable_gqa=True, backend="naive")
        torch.testing.assert_close(out[i:i + 1], want, rtol=1e-5, atol=1e-6)


def test_gpt_generates_the_same_text_with_the_cache():
    """Greedy decoding from the paged cache equals greedy decoding that recomputes the whole
    sequence at every step, for prompts of different lengths decoded together."""
    torch.manual_seed(0)
    model = GPT(tiny_config())
    prompts = [torch.randint(0, 256, (n,)) for n in (5, 17, 40)]
    outs = generate(model, prompts, 10, backend="numpy")
    model.eval()
    for p, o in zip(prompts, outs):
        ids = p[None]
        for _ in range(10):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(ids[0], o)


def test_generate_checks_its_arguments():
    model = GPT(tiny_config())
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        generate(model, [torch.zeros(60, dtype=torch.long)], 10)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [torch.zeros(3, dtype=torch.long)], 0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [torch.zeros(3, dtype=torch.long)], 2, temperature=-1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the compiled kernel")
def test_gpt_generates_on_the_gpu_kernel_as_without_the_cache():
    """The same as above through the compiled paged kernel, four prompts from one pool with
    pages of 16 tokens, so that sequences cross pages while they decode."""
    torch.manual_seed(0)
    model = GPT(tiny_config()).cuda()
    prompts = [torch.randint(0, 256, (n,), device="cuda") for n in (3, 15, 16, 33)]
    outs = generate(model, prompts, 20, backend="triton")
    model.eval()
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = p[None]
            for _ in range(20):
                ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
            assert torch.equal(ids[0], o)


def test_a_repeated_step_reuses_the_partial_results():
    """Steps of one layout take the split's partial results of the step before (two
    allocations fewer a step) and still compute each its own attention."""
    from flashedu.triton import decode as tdecode

    lengths, H, Hkv, d, P = [70, 5], 8, 2, 64, 32
    tdecode._PARTIALS.clear()
    outs = []
    for seed in (1, 2):
        k, v, table, seqlens = random_pool(lengths, P, Hkv, d, torch.float32, seed=seed)
        q = torch.randn(len(lengths), H, 1, d, generator=torch.Generator().manual_seed(seed))
        out, lse = paged_attention(*(t.to(DEVICE) for t in (q, k, v, table, seqlens)),
                                   num_splits=3, return_lse=True)
        ref_o, ref_l = reference(q, k, v, table, seqlens, P, causal=False)
        assert tolerance.max_error(out.cpu(), ref_o) < 1e-4
        assert tolerance.max_error(lse.cpu(), ref_l) < 1e-4
        outs.append(out)
    assert len(tdecode._PARTIALS) == 1  # one layout, one pair of buffers
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: dependent launches")
def test_steps_back_to_back_and_in_a_cuda_graph_give_the_eager_answers():
    """On Hopper the split and combine kernels are dependent launches (the combine set up
    while the split runs, each waiting on the GPU for the kernel before it). Steps launched
    back to back over three caches, without a sync between them, and the same steps captured
    in one CUDA graph and replayed give each step's answer alone, bit for bit."""
    from flashedu.triton import decode as tdecode

    if torch.cuda.get_device_capability()[0] >= 9 and tdecode.PDL:
        consts = tdecode._launch_plan(2, 8, 2, 1, 4096, 64, torch.bfloat16, 132, False, None,
                                      False, 16, 9)
        assert consts[3]["launch_pdl"] and consts[4]["launch_pdl"]
    caches = [random_pool([4000, 1500], 16, 2, 64, torch.bfloat16, seed=s) for s in (5, 6, 7)]
    caches = [[t.cuda() for t in c] for c in caches]
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        alone = []
        for c in caches:
            alone.append(paged_attention(q, *c))
            torch.cuda.synchronize()
        back_to_back = [paged_attention(q, *c) for c in caches]
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            paged_attention(q, *caches[0])
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            captured = [paged_attention(q, *c, check_indices=False) for c in caches]
        graph.replay()
        torch.cuda.synchronize()
    for a, b, c in zip(alone, back_to_back, captured):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the two-tile "
                    "launches are the compiled kernels' (the interpreter has no pipeline)")
@pytest.mark.parametrize("launch, kv_heads, page_size, Nq, causal, fills", [
    ("DOUBLE_BUFFERED_LAUNCH", 1, 16, 1, False, True),
    ("DOUBLE_BUFFERED_LAUNCH", 1, 32, 1, True, True),
    ("DOUBLE_BUFFERED_LAUNCH", 1, 16, 3, True, True),
    ("DOUBLE_BUFFERED_LAUNCH", 1, 32, 2, False, True),
    ("DOUBLE_BUFFERED_LAUNCH", 1, 16, 1, True, False),
    ("DOUBLE_BUFFERED_LAUNCH", 1, 64, 1, False, False),
    ("ONE_PER_SM_LAUNCH", 1, 256, 1, False, True), ("ONE_PER_SM_LAUNCH", 1, 256, 2, True, False),
    ("ONE_PER_SM_LAUNCH", 1, 512, 1, True, True), ("ONE_PER_SM_LAUNCH", 1, 128, 3, False, False),
    ("ONE_PER_SM_LAUNCH", 2, 256, 1, True, True), ("ONE_PER_SM_LAUNCH", 2, 64, 2, False, True)])
def test_two_tiles_in_flight_read_the_cache_right(launch, kv_heads, page_size, Nq, causal,
                                                  fills):
    """Programs that keep two K/V tiles in flight, each tile's page looked up during the tile
    before (the plan says so): two programs of 64-key tiles an SM, or one of 128-key tiles, or
    one of two K/V heads side by side in 64-key tiles; enough sequences to fill the SMs with
    one program a group (no merge), or a few sequences split to fill them; over ragged lengths
    (an empty one, tiles cut by the sequence's end, pages smaller than a tile) against
    float64, paged and contiguous."""
    from flashedu.triton import decode as tdecode
    from flashedu.triton import fast

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    H, Hkv, d = 32, 8, 128
    longest = 700 if fills else 3000
    if kv_heads > 1:  # two heads a program where each reads this many keys or more
        longest = tdecode.SIDE_BY_SIDE_MIN_KEYS + 500
    capacity = (-(-longest // page_size) + 1) * page_size  # random_pool's table: a page spare

    def planned(B):  # the launch, in one split exactly where the batch fills the GPU
        plan = tdecode._plan(B, H, Hkv, Nq, capacity, d, torch.bfloat16, sms, False, None,
                             page_size)
        return (plan[4] is getattr(tdecode, launch) and (plan[2] == 1) == fills
                and plan[0] == kv_heads * H // Hkv)
    B = next(B for B in range(1, 4 * sms) if planned(B))  # the fewest sequences
    g = torch.Generator().manual_seed(page_size + Nq)
    lengths = torch.randint(1, longest, (B,), generator=g).tolist()
    if B > 2:
        lengths[1] = 64 * 3 + 1
    lengths[0], lengths[-1] = 0, longest
    k, v, table, seqlens = random_pool(lengths, page_size, Hkv, d, torch.bfloat16,
                                       seed=page_size)
    q = torch.randn(B, H, Nq, d, generator=g).to(torch.bfloat16)
    fast.PLANS.clear()
    with torch.no_grad():
        out, lse = paged_attention(*(t.cuda() for t in (q, k, v, table, seqlens)),
                                   is_causal=causal, return_lse=True)
    (plan,) = fast.PLANS.values()
    tdecode._launch_plan.cache_clear()
    assert (plan[1] is None) == fills  # one split: no merge
    assert plan[0].consts["num_warps"] == getattr(tdecode, launch)["num_warps"]
    assert plan[0].consts["KV_HEADS"] == kv_heads
    assert plan[0].consts["num_stages"] == getattr(tdecode, launch)["num_stages"]
    assert plan[0].consts["AHEAD"]
    O_ref, L_ref = reference(q, k, v, table, seqlens, page_size, causal)
    O_plain, _ = reference(q, k, v, table, seqlens, page_size, causal, torch.float32)
    tol = tolerance.allowed_error(torch.bfloat16,
                                  tolerance.max_error(O_plain.to(torch.bfloat16).double(), O_ref))
    assert (out.cpu().double() - O_ref).abs().max().item() <= tol
    seen = torch.isfinite(L_ref)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    torch.testing.assert_close(lse.cpu().double()[seen], L_ref[seen], rtol=1e-5, atol=1e-4)
    # a contiguous cache (B, Hkv, n, d), every sequence n keys: split_kv_attention; its
    # reference reads it as a pool of B pages of n rows, sequence b on page b
    n = 640
    K, V = (torch.randn(B, Hkv, n, d, generator=g).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        dense = split_kv_attention(q.cuda(), K.cuda(), V.cuda(), is_causal=causal)
    pool = [c.permute(0, 2, 1, 3) for c in (K, V)]
    one_page = torch.arange(B, dtype=torch.int32)[:, None]
    full = torch.full((B,), n, dtype=torch.int32)
    O_full, _ = reference(q, *pool, one_page, full, n, causal)
    O_full32, _ = reference(q, *pool, one_page, full, n, causal, torch.float32)
    tol = tolerance.allowed_error(torch.bfloat16, tolerance.max_error(
        O_full32.to(torch.bfloat16).double(), O_full))
    assert (dense.cpu().double() - O_full).abs().max().item() <= tol


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_repeated_step_of_one_split_writes_its_answer_without_a_merge(monkeypatch,
                                                                         return_lse):
    """One split: the split kernel writes O (and L) itself, the plan has no merge, and the
    decoding loop's repeated step (repeat_paged_step) gives the same bits with new lengths."""
    from flashedu.triton import decode as tdecode
    from flashedu.triton import fast

    monkeypatch.setattr(fast, "PLANS", {})
    k, v, table, seqlens = (t.to(DEVICE) for t in random_pool([40, 9], 16, 2, 32,
                                                                torch.float32, seed=6))
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)

    def step(lengths):
        return paged_attention(q, k, v, table, lengths, num_splits=1, check_indices=False,
                               return_lse=return_lse)
    first = step(seqlens)
    (plan,) = fast.PLANS.values()
    assert plan[0].kernel is tdecode.split_kernel and plan[1] is None
    shorter = seqlens - 1
    again = step(shorter)  # the plan, repeated
    fast.PLANS.clear()
    fresh = step(shorter)  # the full path's answer for the same step
    for a, b in zip(*((again, fresh) if return_lse else ((again,), (fresh,)))):
        assert torch.equal(a, b)
    O_ref, L_ref = reference(q.cpu(), k.cpu(), v.cpu(), table.cpu(), shorter.cpu(), 16, False)
    out = again[0] if return_lse else again
    torch.testing.assert_close(out.cpu().double(), O_ref, rtol=1e-5, atol=1e-5)
    if return_lse:
        torch.testing.assert_close(again[1].cpu().double(), L_ref, rtol=1e-5, atol=1e-4)
    assert not torch.equal(out, first[0] if return_lse else first)  # the new lengths were read


def test_a_step_laid_out_as_before_skips_the_checks_and_nothing_else(monkeypatch):
    """A decoding step laid out as an earlier one goes straight to that step's launches
    (repeat_paged_step: a decoding loop's host time is most of a short step's); whatever the
    checks look at and the plan's key does not (the other tensors' devices, requires_grad,
    an option of another type) takes the full path and its errors."""
    import flashedu.decode as fdecode
    from flashedu.triton import fast

    monkeypatch.setattr(fast, "PLANS", {})
    k, v, table, seqlens = (t.to(DEVICE) for t in random_pool([40, 9], 16, 2, 32,
                                                                torch.float32, seed=5))
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    first = paged_attention(q, k, v, table, seqlens, check_indices=False)
    checks = []
    real_check = fdecode._check
    monkeypatch.setattr(fdecode, "_check", lambda *a: (checks.append(1), real_check(*a)))
    again = paged_attention(q, k, v, table, seqlens, check_indices=False)
    assert checks == [] and torch.equal(first, again)  # the plan, without the checks
    O_ref, _ = reference(q.cpu(), k.cpu(), v.cpu(), table.cpu(), seqlens.cpu(), 16, False)
    torch.testing.assert_close(again.cpu().double(), O_ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="is_causal"):
        paged_attention(q, k, v, table, seqlens, check_indices=False, is_causal=1)
    with pytest.raises(ValueError, match="k_cache must be on q's device"):
        paged_attention(q, k.to("meta"), v, table, seqlens, check_indices=False)
    with pytest.raises(RuntimeError, match="forward-only"):
        paged_attention(q.clone().requires_grad_(), k, v, table, seqlens, check_indices=False)
    assert len(checks) == 3  # each of those went through the checks
