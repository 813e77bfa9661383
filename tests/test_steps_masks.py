"""The checks of notebooks 08 and 08b's steps (flashedu/checks/steps/masks.py): each solved step
passes, the learner's skeleton is "not implemented yet", typical wrong answers fail with a
message that names the mistake, and the checks' own answers agree with flashedu.BlockMask."""

from __future__ import annotations

import math

import numpy as np
import pytest
import step_loading

from flashedu.checks import check
from flashedu.course.build import strip_source
from flashedu.checks.result import NOT_IMPLEMENTED
from flashedu.course.notebooks import find, solution_code

torch = pytest.importorskip("torch", reason="the mask-mod steps call their mods with torch tensors")

from flashedu import BlockMask  # noqa: E402 - needs torch
from flashedu.checks.steps import masks  # noqa: E402

STEPS = {  # step id -> its check
    "08.tile_classes": "step_causal_tiles",
    "08.document_mask": "step_document_mask",
    "08.document_tiles": "step_document_tiles",
    "08b.window": "step_window_mask_mod",
    "08b.block_kinds": "step_mask_mod_tiles",
    "08b.softcap": "step_softcap",
    "08b.softcap_grad": "step_softcap_grad",
    "08b.my_mask": "step_own_mask_mod",
    "08b.softcap_hook": "triton_step_score_mod_hook",
}
HEADER = ("import math\nimport numpy as np\nimport torch\nimport flashedu\nfrom flashedu import mods\n"
          "import triton\nimport triton.language as tl\n\n")
load, mutant = step_loading.loaders(HEADER)


@pytest.mark.parametrize("step_id", list(STEPS))
def test_the_solved_step_passes_and_names_its_check(step_id, tmp_path):
    step = find(step_id, "step")
    assert step.exercise == STEPS[step_id]
    result = check(step.exercise, load(step_id, solution_code(step), tmp_path), seed=0)
    assert result.passed, result.message


@pytest.mark.parametrize("step_id", list(STEPS))
def test_the_skeleton_is_not_implemented_yet(step_id, tmp_path):
    step = find(step_id, "step")
    fn = load(step_id, strip_source(step.source), tmp_path)
    assert check(step.exercise, fn, seed=0).status == NOT_IMPLEMENTED


WRONG = [  # (step, replacements, words the message must hold)
    ("08.tile_classes", [("elif last_k <= first_q", "elif last_k < first_q")],
     ["Br = 3, Bc = 2", "FULL needs last key <= first query"]),
    ("08.tile_classes", [("min((i + 1) * Br, Nq) - 1", "(i + 1) * Br - 1")],
     ["cut by the end of the sequence", "queries stop at Nq - 1"]),
    ("08.tile_classes", [("Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)", "Tr, Tc = Nq // Br, Nk // Bc")],
     ["has shape"]),
    ("08.document_mask", [("doc = np.repeat(np.arange(len(doc_lengths)), doc_lengths)",
                           "doc = np.searchsorted(np.cumsum(doc_lengths), np.arange(sum(doc_lengths)))")],
     ["should be hidden", "boundary token"]),
    ("08.document_tiles", [("q_docs = [(doc[i * Br], doc[min((i + 1) * Br, N) - 1])",
                            "q_docs = [(doc[i * Br], doc[i * Br])"),
                           ("k_docs = [(doc[j * Bc], doc[min((j + 1) * Bc, N) - 1])",
                            "k_docs = [(doc[j * Bc], doc[j * Bc])")],
     ["boundaries inside tiles", "not only the documents of its first or last token"]),
    ("08b.window", [("(kv_idx > q_idx - W)", "(kv_idx >= q_idx - W)")], ["W + 1 keys"]),
    ("08b.window", [("(kv_idx <= q_idx) & (kv_idx > q_idx - W)",
                     "(kv_idx <= q_idx) and (kv_idx > q_idx - W)")], ["ambiguous", "not `and`"]),
    ("08b.window", [("return (kv_idx <= q_idx) & (kv_idx > q_idx - W)",
                     "return mods.sliding_window(W)(b, h, q_idx, kv_idx)")], ["flashedu.mods"]),
    ("08b.block_kinds", [("min((i + 1) * Br, Nq)", "(i + 1) * Br"), ("min((j + 1) * Bc, Nk)", "(j + 1) * Bc")],
     ["raised an error"]),
    ("08b.block_kinds", [("kind[i, j] = FULL if seen.all() else PARTIAL if seen.any() else EMPTY",
                          "kind[i, j] = PARTIAL if seen.any() else EMPTY")],
     ["so it is FULL; yours says PARTIAL"]),
    ("08b.block_kinds", [("    return kind", "    return flashedu.BlockMask.from_mask_mod(mask_mod, None, None, "
                          "Nq, Nk, (Br, Bc)).blocks[0, 0].astype(int)")],
     ["flashedu.BlockMask"]),
    ("08b.softcap_hook", [("return cap * t, 1.0 - t * t", "return cap * t, 1.0")],
     ["the forward is right", "1 - tanh(s / cap)^2"]),
    ("08b.softcap", [("cap * torch.tanh(score / cap)", "torch.clamp(score, -cap, cap)")],
     ["clipped"]),
    ("08b.softcap", [("cap * torch.tanh(score / cap)", "cap * torch.tanh(score / cap).double()")],
     ["keep the score's dtype"]),
    ("08b.softcap_grad", [("1 - torch.tanh(score / cap) ** 2", "cap * (1 - torch.tanh(score / cap) ** 2)")],
     ["cap times too large"]),
    ("08b.softcap_grad", [("torch.tanh(score / cap) ** 2", "torch.tanh(score) ** 2")],
     ["argument is S / cap"]),
    ("08b.my_mask", [("(kv_idx <= q_idx) & ((q_idx - kv_idx) % 4 == 0)",
                      "torch.ones(q_idx.shape[-2], kv_idx.shape[-1], dtype=torch.bool).tril()")],
     ["tile (i=0, j=1)", "not on their shapes"]),
    ("08b.my_mask", [("(kv_idx <= q_idx) & ((q_idx - kv_idx) % 4 == 0)", "kv_idx >= 0")],
     ["shows every pair"]),
    ("08b.my_mask", [("(kv_idx <= q_idx) & ((q_idx - kv_idx) % 4 == 0)", "(q_idx - kv_idx) % 4")],
     ["must return bool"]),
]


@pytest.mark.parametrize("step_id, replace, words", WRONG,
                         ids=[f"{s}-{k}" for k, (s, _, _) in enumerate(WRONG)])
def test_a_typical_mistake_fails_with_a_useful_message(step_id, replace, words, tmp_path):
    result = check(STEPS[step_id], mutant(step_id, replace, tmp_path), seed=0)
    assert not result.passed
    for word in words:
        assert word in result.message, (word, result.message)


# ---- the checks' answers against flashedu's own (the grader may trust either) ----------------


@pytest.mark.parametrize("Nq, Nk, Br, Bc", [(512, 512, 128, 64), (200, 256, 32, 64), (100, 200, 64, 16),
                                            (160, 100, 16, 64), (12, 12, 3, 2), (7, 7, 1, 1), (1, 1, 4, 4)])
def test_causal_kinds_agree_with_block_mask(Nq, Nk, Br, Bc):
    bm = BlockMask.causal((Nq, Nk), block_size=(Br, Bc))
    kind = masks.causal_kinds(Nq, Nk, Br, Bc)
    assert np.array_equal(kind != masks.EMPTY, bm.blocks[0, 0])
    assert np.array_equal(kind == masks.FULL, bm.full[0, 0])


def test_every_mask_mod_case_agrees_with_block_mask():
    from flashedu.checks.engine import set_seed

    set_seed(0)
    for case in masks._kinds_cases():
        name, params, Nq, Nk, Br, Bc = case.args
        bm = BlockMask.from_mask_mod(masks.MASK_MODS[name](*params), None, None, Nq, Nk, (Br, Bc))
        kind = bm.full[0, 0] * masks.FULL + bm.partial[0, 0] * masks.PARTIAL
        assert np.array_equal(kind, case.expected[0]), case.label
        # the mod the learner's function gets draws the mask the check's NumPy rule draws
        q, kv = torch.arange(Nq).view(-1, 1), torch.arange(Nk).view(1, -1)
        drawn = masks.MASK_MODS[name](*params)(0, 0, q, kv).expand(Nq, Nk).numpy()
        assert np.array_equal(drawn, masks.dense_mask(name, params, Nq, Nk)), case.label


def test_document_tiles_agree_with_the_document_mask_mod():
    from flashedu import mods

    for lengths, Br, Bc, _ in masks._DOC_SPECS:
        N = sum(lengths)
        bm = BlockMask.from_mask_mod(mods.document.from_lengths(lengths), None, None, N, N, (Br, Bc))
        want = masks.kinds_of(masks.same_document(lengths), Br, Bc) != masks.EMPTY
        assert np.array_equal(bm.blocks[0, 0], want), lengths
        assert math.ceil(N / Br) == want.shape[0]
