"""Split-KV decoding (flashedu.triton.decode): on the CPU through Triton's interpreter, or on a GPU."""

import argparse

import numpy as np
import pytest
import torch

import flashedu
from flashedu import tolerance
from flashedu.reference import naive_attention
from flashedu.triton.decode import (
    DOUBLE_BUFFERED_LAUNCH,
    ONE_PER_SM_LAUNCH,
    SPLIT_LAUNCH,
    _plan,
    choose_num_splits,
    double_buffered,
    heads_per_program,
    split_kv_attention,
    split_plan,
    tiles_in_flight,
)

DEVICE = flashedu.runtime.kernel_device()  # the CPU under the interpreter, else the GPU


def randn(*shape):
    return torch.randn(*shape, device=DEVICE)


def bottom_right(Nq, Nk):
    """Decoding's causal mask: query n is position Nk - Nq + n and sees keys j <= that."""
    return np.tri(Nq, Nk, k=Nk - Nq, dtype=bool)


def reference(q, k, v, mask, dtype=torch.float64):
    """(O, L) per head by the NumPy naive attention, in ``dtype`` (float64: the ground truth)."""
    B, H, Nq, d = q.shape
    G = H // k.shape[1]
    np_dtype = {torch.float64: np.float64, torch.float32: np.float32}[dtype]
    O = np.zeros((B, H, Nq, d), np_dtype)
    L = np.zeros((B, H, Nq), np_dtype)
    for b in range(B):
        for h in range(H):
            Q, K, V = (t.cpu().to(dtype).numpy() for t in (q[b, h], k[b, h // G], v[b, h // G]))
            O[b, h], L[b, h] = naive_attention(Q, K, V, mask=mask)
    return torch.from_numpy(O), torch.from_numpy(L)


CASES = [  # B, H, Hkv, Nq, Nk, d, dtype, causal, num_splits
    (1, 4, 4, 1, 200, 64, torch.float32, False, None),
    (1, 8, 2, 1, 333, 32, torch.float32, True, 5),  # GQA: 4 query heads packed in one program
    (2, 4, 1, 3, 97, 40, torch.float32, True, None),  # MQA, padded head dim, ragged last tile
    (1, 2, 2, 16, 130, 16, torch.float32, True, 3),  # 16 queries: causal cuts inside a split
    (1, 6, 3, 7, 64, 24, torch.float32, False, 1000),  # more splits asked than K/V tiles
    (1, 4, 2, 2, 150, 64, torch.float16, True, 4),
    (1, 2, 1, 1, 120, 64, torch.bfloat16, False, 3),
    (2, 8, 2, 2, 90, 40, torch.float32, True, 1),  # one split: the split kernel writes O, L
    (1, 4, 2, 1, 100, 64, torch.bfloat16, False, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_matches_reference(case):
    B, H, Hkv, Nq, Nk, d, dtype, causal, num_splits = case
    q = randn(B, H, Nq, d).to(dtype)
    k, v = (randn(B, Hkv, Nk, d).to(dtype) for _ in range(2))
    out, lse = split_kv_attention(q, k, v, num_splits=num_splits, is_causal=causal,
                                  return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    mask = bottom_right(Nq, Nk) if causal else np.ones((Nq, Nk), bool)
    O_ref, L_ref = reference(q, k, v, mask)
    # the tolerance rule of the whole suite: at most 2x the error of plain attention in this
    # dtype (here: the naive attention computed from the same rounded inputs in float32)
    O_plain, _ = reference(q, k, v, mask, torch.float32)
    O_plain = O_plain.to(dtype).double()
    tol = tolerance.allowed_error(dtype, tolerance.max_error(O_plain, O_ref))
    assert (out.cpu().double() - O_ref).abs().max().item() <= tol
    torch.testing.assert_close(lse.cpu().double(), L_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("merge_tile", [1, 8192])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_merge_in_steps_of_any_size(monkeypatch, merge_tile, causal):
    """combine_kernel loads the partials MERGE_SPLITS splits a step (about MERGE_TILE values):
    one split a step (its loop runs once a split) and all of them at once give the float64
    answer and lse; 4 query heads of 3 queries, a ragged last tile, a padded head dim, 3
    splits (4 asked: rounding leaves 3)."""
    from flashedu.triton import decode, fast

    monkeypatch.setattr(decode, "MERGE_TILE", merge_tile)
    monkeypatch.setattr(fast, "PLANS", {})
    decode._launch_plan.cache_clear()  # its constexprs read MERGE_TILE
    B, H, Hkv, Nq, Nk, d = 2, 8, 2, 3, 75, 24
    q = randn(B, H, Nq, d)
    k, v = randn(B, Hkv, Nk, d), randn(B, Hkv, Nk, d)
    out, lse = split_kv_attention(q, k, v, num_splits=4, is_causal=causal, return_lse=True)
    decode._launch_plan.cache_clear()
    O_ref, L_ref = reference(q, k, v, bottom_right(Nq, Nk) if causal else np.ones((Nq, Nk), bool))
    torch.testing.assert_close(out.cpu().double(), O_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), L_ref, rtol=1e-5, atol=1e-4)


def test_every_split_count_gives_the_same_answer():
    q, k, v = randn(1, 2, 2, 32), randn(1, 2, 90, 32), randn(1, 2, 90, 32)
    outs = [split_kv_attention(q, k, v, num_splits=s, is_causal=True) for s in (1, 2, 3, 6)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-6)


def test_causal_is_bottom_right_and_equals_top_left_when_square():
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = randn(1, 2, 4, 16), randn(1, 2, 50, 16), randn(1, 2, 50, 16)
    out = split_kv_attention(q, k, v, is_causal=True, num_splits=3)
    # an independent reference: torch's own lower-right causal bias
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                            attn_mask=causal_lower_right(4, 50))
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)
    # Nq == Nk: the two alignments coincide, so it matches flashedu.attention's is_causal
    q = randn(1, 2, 40, 16)
    k, v = randn(1, 2, 40, 16), randn(1, 2, 40, 16)
    torch.testing.assert_close(split_kv_attention(q, k, v, is_causal=True),
                               flashedu.attention(q, k, v, is_causal=True, backend="naive"),
                               rtol=1e-5, atol=1e-5)


def test_queries_that_see_no_key_give_zeros():
    q, k, v = randn(1, 2, 5, 16), randn(1, 2, 3, 16), randn(1, 2, 3, 16)
    out, lse = split_kv_attention(q, k, v, is_causal=True, return_lse=True)
    assert torch.all(out[:, :, :2] == 0) and torch.all(torch.isneginf(lse[:, :, :2]))
    O_ref, _ = reference(q, k, v, bottom_right(5, 3))
    torch.testing.assert_close(out.cpu().double(), O_ref, rtol=1e-5, atol=1e-5)


def test_split_heuristics():
    assert heads_per_program(8, 1) == 8 and heads_per_program(8, 16) == 4
    assert heads_per_program(7, 16) == 1  # 7 heads x 16 rows do not fit: one head a program
    assert choose_num_splits(4, 131072, 64, 132) == 128  # four programs an SM, at most 128
    assert choose_num_splits(64, 4096, 64, 132) == 8  # 512 programs: one wave, four an SM
    assert choose_num_splits(256, 4096, 64, 132) == 2  # three would start a second wave
    assert choose_num_splits(4, 1024, 64, 132) == 16  # but chunks of at least a tile
    assert choose_num_splits(4, 100, 16, 132, 50) == 7  # never more splits than tiles
    assert choose_num_splits(264, 4096, 64, 132) == 2
    assert choose_num_splits(1024, 4096, 64, 132) == 1  # already many programs
    # 32 query heads on 8 K/V heads: 4 packed per program, 8 programs; 66 splits asked are
    # rounded up to whole K/V tiles of 64: 32 tiles = 2048 keys, 64 splits
    assert split_plan(1, 32, 8, 1, 131072, 128, torch.bfloat16, 132, num_splits=66) == (
        4, 64, 64, 2048)
    # unasked, in pages of 16: 33 splits of 63 tiles, two programs an SM (double_buffered)
    assert split_plan(1, 32, 8, 1, 131072, 128, torch.bfloat16, 132, page_size=16) == (
        4, 64, 33, 4032)
    assert split_plan(1, 4, 4, 1, 100, 64, torch.float32, 132, num_splits=3) == (1, 32, 2, 64)


def test_two_tiles_in_flight_where_the_splits_give_every_sm_two_programs_evenly():
    """The split count that gives every SM two programs, evenly, each keeping two K/V tiles
    in flight (double_buffered); where no count does, or splits are asked that do not, four
    programs an SM with one tile each (choose_num_splits). Pages of 16 rows: no 128-key tile
    lies in one page, so no plan of one program an SM (the next test)."""
    bf16 = torch.bfloat16

    def plan(B, Nk, num_splits=None):
        return _plan(B, 32, 8, 1, Nk, 128, bf16, 132, False, num_splits, 16)

    def split_plan16(B, Nk, num_splits=None):
        return split_plan(B, 32, 8, 1, Nk, 128, bf16, 132, num_splits=num_splits, page_size=16)

    # 32 sequences x 8 K/V heads: 256 groups on 132 SMs, no split
    assert double_buffered(256, 132, 128, bf16, False)
    assert split_plan16(32, 1024) == (4, 64, 1, 1024)
    assert plan(32, 1024)[4] is DOUBLE_BUFFERED_LAUNCH
    # 8 sequences: 64 groups, 4 splits (256 programs); one sequence: 8 groups, 32 splits
    assert split_plan16(8, 4096) == (4, 64, 4, 1024)
    assert split_plan16(1, 16384) == (4, 64, 32, 512)
    # 15 sequences: 120 groups, 2 splits; 17: 136 groups, where one split leaves 128 SMs one
    # program and two make 272 programs, more than two an SM: the split rule's 3, one tile
    assert split_plan16(15, 4096)[2] == 2
    assert plan(17, 4096)[4] is SPLIT_LAUNCH
    assert split_plan16(17, 4096)[2] == 3
    assert double_buffered(240, 132, 128, bf16, False)  # 108 SMs two, 24 one
    assert not double_buffered(236, 132, 128, bf16, False)  # 104 SMs two, 28 one
    assert not double_buffered(120, 132, 128, bf16, False)  # one an SM: too few loads
    assert not double_buffered(512, 132, 128, bf16, False)  # four an SM
    # a short cache cannot split enough: 1K keys are 16 tiles, 128 programs of one sequence
    assert split_plan16(1, 1024) == (4, 64, 16, 64)
    assert plan(1, 1024)[4] is SPLIT_LAUNCH
    assert tiles_in_flight(1, 32, 8, 1, 1024, 128, bf16, 132, page_size=16) == 1
    assert tiles_in_flight(32, 32, 8, 1, 1024, 128, bf16, 132, page_size=16) == 2
    # splits asked: the launch follows the programs they make
    assert split_plan16(32, 1024, num_splits=2) == (4, 64, 2, 512)
    assert plan(32, 1024, 2)[4] is SPLIT_LAUNCH
    assert plan(8, 4096, 4)[4] is DOUBLE_BUFFERED_LAUNCH
    # float32, d = 256, the interpreter: one tile in flight
    assert not double_buffered(256, 132, 128, torch.float32, False)
    assert not double_buffered(256, 132, 256, bf16, False)
    assert not double_buffered(256, 132, 128, bf16, True)
    assert _plan(32, 32, 8, 1, 1024, 128, bf16, 132, True, None, 16)[4] == {}


def test_one_program_an_sm_where_the_splits_give_every_sm_one_and_a_tile_lies_in_a_page():
    """Where the groups and a split count fill every SM once, evenly, and pages hold whole
    128-key tiles (or there are none): one program an SM, 128-key tiles two in flight."""
    bf16 = torch.bfloat16

    def plan(B, Nk, page_size, num_splits=None, d=128, dtype=bf16):
        return _plan(B, 32, 8, 1, Nk, d, dtype, 132, False, num_splits, page_size)

    # 16 sequences: 128 groups, no split; 8: 64 groups, 2 splits; one: 8 groups, 16 splits
    assert plan(16, 4096, 256) == (4, 128, 1, 4096, ONE_PER_SM_LAUNCH)
    assert plan(8, 65536, 256) == (4, 128, 2, 32768, ONE_PER_SM_LAUNCH)
    assert plan(1, 16384, 0) == (4, 128, 16, 1024, ONE_PER_SM_LAUNCH)  # a contiguous cache
    assert tiles_in_flight(8, 32, 8, 1, 4096, 128, bf16, 132, page_size=256) == 2
    # 15 sequences: 120 groups, 91% of the SMs; 14: 112, 85%, too few, and two splits fill
    # 85% of two rounds: four programs an SM, one tile in flight
    assert plan(15, 4096, 256)[4] is ONE_PER_SM_LAUNCH
    assert plan(14, 4096, 256)[4] is SPLIT_LAUNCH
    # 32 sequences fill the SMs twice: a program reads two K/V heads side by side, in tiles of
    # 64 keys (128 rows), 128 programs; in pages of 32 rows, two programs an SM
    assert plan(32, 4096, 256) == (8, 64, 1, 4096, ONE_PER_SM_LAUNCH)
    assert plan(33, 4096, 0) == (8, 64, 1, 4096, ONE_PER_SM_LAUNCH)  # 132 programs
    assert plan(32, 4096, 32)[4] is DOUBLE_BUFFERED_LAUNCH
    assert plan(32, 1024, 256)[4] is DOUBLE_BUFFERED_LAUNCH  # 1K keys a program: too short
    assert plan(34, 4096, 256)[4] is SPLIT_LAUNCH  # 136 programs: more than the SMs
    # two K/V heads need both heads' query rows in one program: 16 queries of 4 heads each
    # make 64 rows a K/V head, so one K/V head a program
    assert _plan(32, 32, 8, 16, 4096, 128, bf16, 132, False, None, 256)[0] == 4
    # not where 128-key tiles cross pages, splits are asked, float32, d = 256, interpreted
    assert plan(16, 4096, 16)[4] is DOUBLE_BUFFERED_LAUNCH
    # pages of 64 rows hold tiles of 64 keys of two K/V heads, but 16 sequences of 4K keys
    # would make 2 splits of 2K keys: two programs an SM (8K keys: one of two heads)
    assert plan(16, 4096, 64)[4] is DOUBLE_BUFFERED_LAUNCH
    assert plan(16, 8192, 64) == (8, 64, 2, 4096, ONE_PER_SM_LAUNCH)
    assert plan(16, 4096, 256, num_splits=1)[1:] == (64, 1, 4096, SPLIT_LAUNCH)
    assert plan(16, 4096, 256, dtype=torch.float32)[4] is SPLIT_LAUNCH
    assert plan(16, 4096, 256, d=256)[4] is SPLIT_LAUNCH
    assert _plan(16, 32, 8, 1, 4096, 128, bf16, 132, True, None, 256)[1] == 16
    # a short cache: 1K keys are 8 tiles of 128, 64 programs of one sequence: not even
    assert plan(1, 1024, 256)[4] is SPLIT_LAUNCH


@pytest.mark.parametrize("B, page_size, per_sm", [(32, 16, 2), (32, 256, 1), (16, 256, 1)])
def test_programs_of_two_tiles_fit_on_an_sm(B, page_size, per_sm):
    """The two-tile launches compiled for sm_90 here, as steps of B sequences of 4K keys plan
    them (32 in pages of 16: two programs an SM; 32 in pages of 256: one of two K/V heads side
    by side; 16: one of one): shared memory holds two K/V tiles a program (the pipeline's
    second buffer: were a tile's page loaded in its own step, the pipeline would keep one),
    and the programs an SM fit in shared memory and registers, as the rule assumes."""
    from flashedu.benchmarks import sass
    from flashedu.triton import decode as tdecode

    if not sass.can_compile():
        pytest.skip("this Triton has no NVIDIA backend tools: nothing can compile for a GPU")
    H, Hkv, d, Nk, bf16 = 32, 8, 128, 4096, torch.bfloat16
    tdecode._launch_plan.cache_clear()
    S, chunk, heads, consts, merge = tdecode._launch_plan(B, H, Hkv, 1, Nk, d, bf16, 132, False,
                                                          None, False, page_size, 9)
    tdecode._launch_plan.cache_clear()
    assert S == 1 and merge is None and consts["num_stages"] == 3 and consts["AHEAD"]
    assert consts["KV_HEADS"] == (2 if per_sm == 1 and B == 32 else 1)
    consts = {k: v for k, v in consts.items() if k not in ("PDL", "launch_pdl")}
    q = torch.empty(B, H, 1, d, dtype=bf16)
    pool = torch.empty(B * Nk // page_size, page_size, Hkv, d, dtype=bf16)
    table = torch.zeros(B, Nk // page_size, dtype=torch.int32)
    out, lse2 = torch.empty_like(q), torch.empty(B, H, 1)
    kv = (pool.stride(0), pool.stride(2), pool.stride(1))
    args = (q, pool, pool, out, lse2, table, torch.zeros(B, dtype=torch.int32), 0.1,
            *q.stride()[:3], *kv, *kv, H, H // Hkv, heads, 1, Nk, d, chunk, S, table.stride(0),
            *out.stride()[:3])
    got = sass.compile_kernel(tdecode.split_kernel, args, consts)
    two_tiles = 2 * 2 * consts["Bc"] * consts["KV_HEADS"] * d * 2  # K_j, V_j, two buffers, bf16
    assert tdecode.tiles_in_flight(B, H, Hkv, 1, Nk, d, bf16, 132, page_size=page_size) == 2
    assert two_tiles <= got["shared_bytes"] and per_sm * got["shared_bytes"] <= 227 * 1024
    assert per_sm * got["registers"] * 32 * consts["num_warps"] <= 65536
    assert got["spill_stores"] == 0


def test_bad_input_is_refused():
    q, k = randn(1, 2, 1, 16), randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="num_splits"):
        split_kv_attention(q, k, k, num_splits=0)
    with pytest.raises(ValueError, match="Nq"):
        split_kv_attention(randn(1, 2, 65, 16), k, k)
    with pytest.raises(TypeError, match="float64"):
        split_kv_attention(q.double(), k.double(), k.double())
    with pytest.raises(ValueError, match="multiple"):
        split_kv_attention(randn(1, 3, 1, 16), k, k)
    with pytest.raises(RuntimeError, match="forward-only"):
        split_kv_attention(q.requires_grad_(), k, k)


@pytest.mark.parametrize("return_lse", [False, True])
def test_one_split_writes_the_answer_in_the_outputs_layout(return_lse):
    """With one split there is no merge: the split kernel writes O in the output's dtype and
    strides (here those of a q that is a transposed view) and L. Same answer as two splits, and
    the launch plan kept for the repeat holds the split alone."""
    from flashedu.triton import decode, fast

    B, H, Hkv, Nq, Nk, d = 2, 4, 2, 3, 70, 24
    q = randn(B, Nq, H, d).transpose(1, 2)  # (B, H, Nq, d), rows H * d apart
    k, v = randn(B, Hkv, Nk, d), randn(B, Hkv, Nk, d)
    one = split_kv_attention(q, k, v, num_splits=1, is_causal=True, return_lse=return_lse)
    two = split_kv_attention(q, k, v, num_splits=2, is_causal=True, return_lse=return_lse)
    for a, b in zip(*((one, two) if return_lse else ((one,), (two,)))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    out = one[0] if return_lse else one
    assert out.stride() == q.stride()  # written in q's layout, as the merge writes it
    O_ref, _ = reference(q, k, v, bottom_right(Nq, Nk))
    torch.testing.assert_close(out.cpu().double(), O_ref, rtol=1e-5, atol=1e-5)
    plans = [p for p in fast.PLANS.values() if isinstance(p, tuple) and len(p) == 4
             and getattr(p[0], "kernel", None) is decode.split_kernel and p[0].grid[0] == 1]
    assert plans and all(p[1] is None for p in plans)
    again = split_kv_attention(q, k, v, num_splits=1, is_causal=True, return_lse=return_lse)
    for a, b in zip(*((one, again) if return_lse else ((one,), (again,)))):
        assert torch.equal(a, b)


def test_the_sweep_names_each_launch_and_its_split_counts():
    """``scripts/gpu_decode_sweep.py`` (run on a GPU) plans its variants here: "rule" the
    package's own plan, each launch asked (warps x stages, optionally x Bc) with the split
    rule's count and one split; the package's knobs are put back after each."""
    from script_loading import load_script

    from flashedu.triton import decode

    sweep = load_script("gpu_decode_sweep")
    knobs = ("SPLIT_LAUNCH", "KEY_TILE", "DOUBLE_BUFFERED_PER_SM", "ONE_PER_SM")
    before = [getattr(decode, k) for k in knobs]
    got = sweep.variants(32, 1024, ["2x2", "4x2x128"], 132)
    plain = {"num_warps": 2, "num_stages": 2, "AHEAD": False}
    wide = {"num_warps": 4, "num_stages": 2, "AHEAD": False}
    assert got == {"rule": (None, None, None),
                   "w2s2-S2": (plain, None, 2), "w2s2-S1": (plain, None, 1),
                   "w4s2b128-S2": (wide, 128, 2), "w4s2b128-S1": (wide, 128, 1)}
    assert sweep.parse_launch("2x3a") == ({"num_warps": 2, "num_stages": 3, "AHEAD": True},
                                          None)
    assert "w2s3b32a-S2" in sweep.variants(32, 1024, ["2x3x32a"], 132)
    assert [getattr(decode, k) for k in knobs] == before
    with pytest.raises(ValueError, match="warps x stages"):
        sweep.parse_launch("2x2x2x2")
    # --set: settings of the decode module the rule variant plans with
    assert sweep.rule_setting("SIDE_BY_SIDE_MIN_KEYS=8192") == ("SIDE_BY_SIDE_MIN_KEYS", 8192)
    assert sweep.rule_setting("EVEN_SHARE=0.8") == ("EVEN_SHARE", 0.8)
    for bad in ("NO_SUCH_SETTING=1", "math=1", "EVEN_SHARE", "EVEN_SHARE="):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
            sweep.rule_setting(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: a cache of "
                    "2^31 elements and more")
def test_a_cache_past_two_to_the_31_elements_is_read_where_it_lies():
    """Three sequences of 2^23 keys, one K/V head of 128: a sequence is 2^30 elements, so the
    third starts at element 2^31, past what a 32-bit offset holds. Its answer against the same
    keys attended to alone (one sequence: offsets from 0)."""
    if torch.cuda.mem_get_info()[0] < 10e9:
        pytest.skip("needs 10 GB of free GPU memory: the cache is 6.4 GB, its copy 2.1")
    B, Nk, d = 3, 2**23, 128
    kv = torch.empty(B, 1, Nk, d, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    for b in range(B):  # in parts: one sequence's float32 draw would be 4 GB
        kv[b].normal_(generator=g)
    q = torch.randn(B, 4, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    last = kv[2:].clone()
    with torch.no_grad():  # K and V one tensor: 6.4 GB, not 12.8; the same splits, the same sums
        out = split_kv_attention(q, kv, kv, num_splits=64)
        alone = split_kv_attention(q[2:], last, last, num_splits=64)
    assert torch.equal(out[2:], alone) and out.isfinite().all()


@pytest.mark.parametrize("layout, page, order", [
    ("BHNd", 0, ""), ("BNHd", 0, ""), ("pages", 4, "in order"), ("pages", 4, "local"),
    ("pages", 8, "scattered")])
@pytest.mark.parametrize("heads, rows", [(1, 4), (2, 8), (4, 8)])
def test_the_stream_script_reads_every_element_once(layout, page, order, heads, rows):
    """``scripts/gpu_kv_stream.py``'s kernel (run on a GPU to time a layout's stream): each
    program's column sums over its heads and keys add up to the cache's, in every layout and
    page order, and each sequence's keys are its own table's pages."""
    from script_loading import load_script

    stream = load_script("gpu_kv_stream")
    B, Hkv, N, d = 2, 4, 32, 16
    K, V, strides, table = stream.cache(layout, B, Hkv, N, d, DEVICE, torch.float32, page,
                                        order or "in order")
    out = stream.launch(K, V, strides, Hkv, N, heads, rows, table=table)
    assert out.shape == (B * Hkv // heads * heads, d)
    want = (K.double().sum(dim=(0, 1, 2)) + V.double().sum(dim=(0, 1, 2))).cpu()
    torch.testing.assert_close(out.double().sum(0).cpu(), want, rtol=1e-5, atol=1e-4)
    if table is not None:  # sequence 0's programs sum sequence 0's pages
        own = K[table[0].long()].double().sum(dim=(0, 1, 2)) + \
            V[table[0].long()].double().sum(dim=(0, 1, 2))
        torch.testing.assert_close(out[:Hkv].double().sum(0).cpu(), own.cpu(), rtol=1e-5,
                                   atol=1e-4)
        scattered = not torch.equal(table.cpu(), torch.arange(B * N // page).view(B, -1))
        assert scattered == (order != "in order")
    with pytest.raises(ValueError, match="whole tiles"):
        stream.launch(K, V, strides, Hkv, 24, 2, 16, table=table)
