"""Notebooks 08 and 08b: the tiles a mask skips, the document mask, mask mods and score mods.

Every expected answer is computed here, exactly (tile kinds and masks are integers and bools)
or in float64 (score mods), from the rule itself: the learner's code never sees it. Mask mods
cannot travel to the process that runs the learner's code (a case's inputs are arrays, numbers
and strings), so a case names its mod (``"window", [8]``) and :data:`MASK_MODS` builds it on
both sides.
"""

from __future__ import annotations

import dataclasses
import math
import types

import numpy as np

from ..engine import Exercise, run_seed
from ..sandbox import _filled, _names, call_limited
from ..steptools import as_arrays, case, function_step, kernel_step

F32, F64 = np.float32, np.float64
EMPTY, PARTIAL, FULL = 0, 1, 2  # notebook 08 calls the partial tiles of causal DIAGONAL
KIND_NAMES = {EMPTY: "EMPTY", PARTIAL: "PARTIAL (DIAGONAL)", FULL: "FULL"}


def _rng(k):
    """The generator of one case: the check's run seed (fresh per check) and the case's own."""
    return np.random.default_rng((run_seed(), k))


# ------------------------------------------------------------------------------------------
# The library's own answers are off for these steps
# ------------------------------------------------------------------------------------------

_LIBRARY = ("flashedu.mods", "flashedu.masks")


def _library_use(fn) -> str | None:
    """A message when ``fn`` (or a function it reaches) names flashedu's BlockMask or mods,
    which compute these steps' answers (tile kinds, masks, mods) themselves."""
    seen, todo = set(), [fn]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        inner = getattr(obj, "py_func", None) or getattr(obj, "fn", None) or obj
        code = getattr(inner, "__code__", None)
        if code is None:
            continue
        env = getattr(inner, "__globals__", {})
        names = _names(code)
        values = [(name, env.get(name)) for name in names]
        values += [(None, c.cell_contents) for c in (getattr(inner, "__closure__", None) or ())
                   if _filled(c)]
        values += [(None, v) for v in (getattr(inner, "__defaults__", None) or ())]
        for name, value in values:
            try:
                module = getattr(value, "__name__", "") if isinstance(value, types.ModuleType) \
                    else getattr(value, "__module__", "")
            except Exception:  # noqa: BLE001 - the learner's object may raise anything here
                continue
            module = module if isinstance(module, str) else ""
            top = isinstance(value, types.ModuleType) and module == "flashedu" and (
                "BlockMask" in names or "mods" in names)
            if module in _LIBRARY or top:
                if top:
                    what = "flashedu.BlockMask" if "BlockMask" in names else "flashedu.mods"
                elif isinstance(value, types.ModuleType):
                    what = module
                else:
                    what = f"{module}.{getattr(value, '__name__', type(value).__name__)}"
                return (f"your code uses {what}, which computes this step's answer itself. "
                        "Write it with NumPy / torch operations on the indices: that is the "
                        "step.")
            if isinstance(value, types.FunctionType) and value is not fn:
                todo.append(value)
    return None


def _no_library(ex: Exercise) -> Exercise:
    return dataclasses.replace(ex, inspect=_library_use)


# ------------------------------------------------------------------------------------------
# Tiles: shared by the causal and the mask-mod steps
# ------------------------------------------------------------------------------------------


def tile_bounds(i, j, Nq, Nk, Br, Bc):
    """(first query, last query, first key, last key) of tile (i, j), cut at Nq and Nk."""
    return i * Br, min((i + 1) * Br, Nq) - 1, j * Bc, min((j + 1) * Bc, Nk) - 1


def kinds_of(visible: np.ndarray, Br: int, Bc: int) -> np.ndarray:
    """(Tr, Tc) EMPTY / PARTIAL / FULL of an (Nq, Nk) bool element mask, judged on the pairs
    each tile really holds (the last tiles may be cut)."""
    Nq, Nk = visible.shape
    Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
    pad = ((0, Tr * Br - Nq), (0, Tc * Bc - Nk))
    any_ = np.pad(visible, pad, constant_values=False).reshape(Tr, Br, Tc, Bc).any(axis=(1, 3))
    all_ = np.pad(visible, pad, constant_values=True).reshape(Tr, Br, Tc, Bc).all(axis=(1, 3))
    return np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY))


def causal_kinds(Nq, Nk, Br, Bc) -> np.ndarray:
    """The kinds of a top-left causal mask, from the element mask (no tile arithmetic)."""
    return kinds_of(np.tri(Nq, Nk, dtype=bool), Br, Bc)


def _tile_diagnosis(got, ref, visible, Br, Bc, rule_note=None) -> str | None:
    """Where the learner's tile grid first differs, in words, and the likely cause."""
    if got.shape != ref.shape:
        return None
    Nq, Nk = visible.shape
    bad = np.argwhere(got != ref)
    if not len(bad):
        return None
    strange = sorted({v for v in np.unique(got).tolist() if v not in KIND_NAMES})
    if strange:
        return (f"your grid holds {strange}: use the constants EMPTY = 0, PARTIAL (or "
                "DIAGONAL) = 1, FULL = 2.")
    Tr, Tc = ref.shape
    if ((ref == EMPTY) == (got == FULL)).all() and ((ref == FULL) == (got == EMPTY)).all():
        return "EMPTY and FULL are swapped everywhere."
    i, j = (int(x) for x in bad[0])
    fq, lq, fk, lk = tile_bounds(i, j, Nq, Nk, Br, Bc)
    seen = int(visible[fq:lq + 1, fk:lk + 1].sum())
    pairs = (lq - fq + 1) * (lk - fk + 1)
    want, said = KIND_NAMES[int(ref[i, j])], KIND_NAMES.get(int(got[i, j]), str(got[i, j]))
    text = (f"{len(bad)} of {ref.size} tiles differ. The first: tile (i={i}, j={j}) holds "
            f"queries {fq}..{lq} and keys {fk}..{lk}; {seen} of its {pairs} pairs are "
            f"visible, so it is {want}; yours says {said}.")
    cut_row = (i + 1) * Br > Nq
    cut_col = (j + 1) * Bc > Nk
    if (cut_row or cut_col) and ref[i, j] != got[i, j]:
        ends = " and ".join(w for w, c in ((f"queries stop at Nq - 1 = {Nq - 1}", cut_row),
                                           (f"keys stop at Nk - 1 = {Nk - 1}", cut_col)) if c)
        text += (f" This tile is cut by the end of the sequence ({ends}): judge it on the pairs "
                 "it really holds, e.g. last query = min((i + 1) * Br, Nq) - 1; positions past "
                 "the end are neither visible nor hidden pairs.")
    elif rule_note:
        note = rule_note(fq, lq, fk, lk, int(ref[i, j]), int(got[i, j]))
        if note:
            text += " " + note
    return text


# ------------------------------------------------------------------------------------------
# 08.tile_classes: the kinds of tile under a causal mask
# ------------------------------------------------------------------------------------------

H_CAUSAL = ("Top-left causal: query i sees key j when j <= i. Tile (i, j) is EMPTY when its "
            "first key comes after its last query, FULL when its last key is at or before its "
            "first query, DIAGONAL otherwise. Tr = ceil(Nq / Br), Tc = ceil(Nk / Bc), and the "
            "last tiles are cut at Nq and Nk.")


def _causal_note(fq, lq, fk, lk, want, said):
    if want == FULL and lk == fq:
        return ("Its last key equals its first query, and key j = i is visible (j <= i): "
                "FULL needs last key <= first query, not <.")
    if want == PARTIAL and said == EMPTY and fk == lq:
        return ("Its first key equals its last query: that pair is visible (j <= i), so the "
                "tile is not EMPTY: EMPTY needs first key > last query, not >=.")
    return None


def _causal_cases():
    specs = [
        (512, 512, 128, 64, "tiles twice as tall as wide"),
        (200, 256, 32, 64, "Nq < Nk, the last Q tile cut"),
        (100, 200, 64, 16, "Nq < Nk, a cut Q tile next to empty K tiles"),
        (160, 100, 16, 64, "Nq > Nk, the last K tile cut"),
        (12, 12, 3, 2, "Br = 3, Bc = 2: a tile whose last key is its first query"),
        (7, 7, 1, 1, "1 x 1 tiles: every diagonal tile is one visible pair"),
        (1, 1, 4, 4, "N = 1"),
    ]
    rng = _rng(0)
    for _ in range(2):
        Nq, Nk = (int(n) for n in rng.integers(1, 300, 2))
        Br, Bc = (int(b) for b in rng.choice([1, 2, 3, 8, 16, 24, 32, 64], 2))
        specs.append((Nq, Nk, Br, Bc, "random sizes"))
    return [case(f"Nq={Nq}, Nk={Nk}, Br={Br}, Bc={Bc} ({what})", H_CAUSAL, (Nq, Nk, Br, Bc),
                 ("kind",), (causal_kinds(Nq, Nk, Br, Bc),))
            for Nq, Nk, Br, Bc, what in specs]


def _diagnose_causal(case_, wrong, outputs):
    Nq, Nk, Br, Bc = case_.args
    return _tile_diagnosis(outputs["kind"], case_.expected[0], np.tri(Nq, Nk, dtype=bool),
                           Br, Bc, _causal_note)


# ------------------------------------------------------------------------------------------
# 08.document_mask and 08.document_tiles: documents packed into one sequence
# ------------------------------------------------------------------------------------------


def document_ids(doc_lengths) -> np.ndarray:
    return np.repeat(np.arange(len(doc_lengths)), doc_lengths)


def same_document(doc_lengths) -> np.ndarray:
    doc = document_ids(doc_lengths)
    return doc[:, None] == doc[None, :]


H_DOC = ("Document d holds the tokens sum(doc_lengths[:d]) ... sum(doc_lengths[:d + 1]) - 1; "
         "query q sees key k exactly when both lie in the same document. Return the (N, N) "
         "bool mask, N = sum(doc_lengths).")
H_DOC_TILES = ("Tile (i, j) is needed when some query of Q tile i (queries i*Br ... "
               "min((i+1)*Br, N) - 1) and some key of K/V tile j share a document; a document "
               "boundary may fall inside a tile, and a short document inside a single tile. "
               "Return a (ceil(N / Br), ceil(N / Bc)) bool array.")

_DOC_SPECS = [
    ([96, 64, 96], 32, 32, "boundaries on tile edges"),
    ([100, 60, 96], 32, 32, "boundaries inside tiles"),
    ([5, 40, 3, 30, 3], 16, 8, "short documents inside one tile, Br != Bc, N = 81"),
    ([20, 30, 14], 16, 16, "notebook 08b's documents"),
    ([1], 4, 4, "one token"),
    ([1, 1, 1, 2], 2, 3, "documents of one token"),
]


def _random_lengths(k):
    rng = _rng(k)
    return [int(n) for n in rng.integers(1, 40, int(rng.integers(2, 7)))]


def _doc_mask_cases():
    specs = [(lengths, what) for lengths, _, _, what in _DOC_SPECS]
    specs.append((_random_lengths(1), "random lengths"))
    return [case(f"doc_lengths={lengths} ({what})", H_DOC, (lengths,), ("mask",),
                 (same_document(lengths),))
            for lengths, what in specs]


def _diagnose_doc_mask(case_, wrong, outputs):
    got, ref = outputs["mask"], case_.expected[0]
    if got.shape != ref.shape:
        return None
    bad = np.argwhere(got != ref)
    if not len(bad):
        return None
    q, k = (int(x) for x in bad[0])
    doc = document_ids(case_.args[0])
    starts = np.concatenate([[0], np.cumsum(case_.args[0])[:-1]]).tolist()
    return (f"{len(bad)} pairs differ. The first: query {q} (document {doc[q]}) and key {k} "
            f"(document {doc[k]}) should be {'visible' if ref[q, k] else 'hidden'}. The "
            f"documents start at tokens {starts}: check which document a boundary token joins.")


def _doc_tiles_cases():
    specs = list(_DOC_SPECS)
    rng = _rng(2)
    specs.append((_random_lengths(3), int(rng.integers(2, 20)), int(rng.integers(2, 20)),
                  "random lengths and tiles"))
    return [case(f"doc_lengths={lengths}, Br={Br}, Bc={Bc} ({what})", H_DOC_TILES,
                 (lengths, Br, Bc), ("tiles",), (kinds_of(same_document(lengths), Br, Bc) != EMPTY,))
            for lengths, Br, Bc, what in specs]


def _diagnose_doc_tiles(case_, wrong, outputs):
    lengths, Br, Bc = case_.args
    got, ref = outputs["tiles"], case_.expected[0]
    if got.shape != ref.shape:
        return None
    bad = np.argwhere(got != ref)
    if not len(bad):
        return None
    i, j = (int(x) for x in bad[0])
    N = sum(lengths)
    doc = document_ids(lengths)
    fq, lq, fk, lk = tile_bounds(i, j, N, N, Br, Bc)
    dq, dk = sorted(set(doc[fq:lq + 1].tolist())), sorted(set(doc[fk:lk + 1].tolist()))
    text = (f"{len(bad)} of {ref.size} tiles differ. The first: tile (i={i}, j={j}) holds "
            f"queries {fq}..{lq} (documents {dq}) and keys {fk}..{lk} (documents {dk}); it is "
            f"{'needed' if ref[i, j] else 'not needed'}, yours says "
            f"{'needed' if got[i, j] else 'not needed'}.")
    if ref[i, j] and (len(dq) > 1 or len(dk) > 1):
        text += (" A tile that holds several documents shares one with the other tile when "
                 "any of them matches, not only the documents of its first or last token.")
    return text


# ------------------------------------------------------------------------------------------
# Mask mods for the checks (built on both sides from a name and parameters)
# ------------------------------------------------------------------------------------------


def _ints(*xs):
    import torch

    return tuple(torch.as_tensor(x) for x in xs)


def _window(W):
    def mask_mod(b, h, q_idx, kv_idx):
        q, kv = _ints(q_idx, kv_idx)
        return (kv <= q) & (kv > q - W)
    return mask_mod


def _causal():
    def mask_mod(b, h, q_idx, kv_idx):
        q, kv = _ints(q_idx, kv_idx)
        return kv <= q
    return mask_mod


def _document(*lengths):
    import torch

    ids = torch.as_tensor(document_ids(lengths))

    def mask_mod(b, h, q_idx, kv_idx):  # indexes ids: an index past the end raises
        q, kv = _ints(q_idx, kv_idx)
        return ids[q] == ids[kv]
    return mask_mod


def _prefix(n):
    def mask_mod(b, h, q_idx, kv_idx):
        q, kv = _ints(q_idx, kv_idx)
        return (kv < n) | (kv <= q)
    return mask_mod


def _dilated(step):
    def mask_mod(b, h, q_idx, kv_idx):
        q, kv = _ints(q_idx, kv_idx)
        return (kv <= q) & ((q - kv) % step == 0)
    return mask_mod


def _everything():
    def mask_mod(b, h, q_idx, kv_idx):
        q, kv = _ints(q_idx, kv_idx)
        return (kv >= 0) & (q >= 0)
    return mask_mod


MASK_MODS = {"window": _window, "causal": _causal, "document": _document, "prefix": _prefix,
             "dilated": _dilated, "everything": _everything}


def dense_mask(name, params, Nq, Nk) -> np.ndarray:
    """The (Nq, Nk) bool mask of a named mod, with NumPy (the trusted reference)."""
    q, kv = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
    if name == "window":
        return (kv <= q) & (kv > q - params[0])
    if name == "causal":
        return np.broadcast_to(kv <= q, (Nq, Nk))
    if name == "document":
        ids = document_ids(params)
        return ids[:Nq, None] == ids[None, :Nk]
    if name == "prefix":
        return (kv < params[0]) | (kv <= q)
    if name == "dilated":
        return (kv <= q) & ((q - kv) % params[0] == 0)
    if name == "everything":
        return np.ones((Nq, Nk), bool)
    raise ValueError(name)


def _to_mask(out, shape) -> np.ndarray:
    """What a learner's mask mod returned, as a float64 array of the indices' shape; a
    TypeError that says how to write a mod when it is not a bool tensor."""
    import torch

    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the mask mod returned a {type(out).__name__}; it must return a bool "
                        "tensor: compare the index tensors and combine with &, |, ~ (Python's "
                        "and / or / if work on one number, not on a tensor of them).")
    if out.dtype != torch.bool:
        raise TypeError(f"the mask mod returned a {out.dtype} tensor; it must return bool "
                        "(True: the key is visible): compare, do not compute numbers.")
    try:
        out = torch.broadcast_to(out, shape)
    except RuntimeError:
        raise ValueError(f"the mask mod returned shape {tuple(out.shape)}, which does not "
                         f"broadcast to the indices' shape {tuple(shape)}: work elementwise on "
                         "q_idx and kv_idx, without reshaping them.") from None
    return out.numpy().astype(F64)


# ------------------------------------------------------------------------------------------
# 08b.window: a mask mod, written as a factory sliding_window(W) -> mask_mod
# ------------------------------------------------------------------------------------------

H_WINDOW = ("Query q_idx sees the W keys q_idx - W + 1 ... q_idx (itself included): "
            "(kv_idx <= q_idx) & (kv_idx > q_idx - W) elementwise. The indices arrive as "
            "tensors shaped to broadcast, so combine comparisons with &, not `and`.")


def _invoke_window(fn, view, timeout, measure):
    W, b, h, q, kv = view.args

    def run():
        import torch

        mod = fn(W)
        if not callable(mod):
            raise TypeError(f"sliding_window(W) returned a {type(mod).__name__}: return the "
                            "mask mod itself (the inner function), not its result.")
        idx = tuple(torch.as_tensor(np.asarray(x, dtype=np.int64)) for x in (b, h, q, kv))
        shape = np.broadcast_shapes(*(tuple(t.shape) for t in idx))  # torch's: seconds at first
        return _to_mask(mod(*idx), shape)

    return call_limited(run, (), timeout=timeout, measure_memory=measure)


def _window_cases():
    def grid(Nq, Nk, q0=0, k0=0, B=1, H=1):
        b = np.arange(B).reshape(B, 1, 1, 1) if B > 1 else np.asarray(0)
        h = np.arange(H).reshape(1, H, 1, 1) if H > 1 else np.asarray(0)
        shape_q = (1, 1, Nq, 1) if B > 1 or H > 1 else (Nq, 1)
        shape_k = (1, 1, 1, Nk) if B > 1 or H > 1 else (1, Nk)
        return (b, h, (q0 + np.arange(Nq)).reshape(shape_q), (k0 + np.arange(Nk)).reshape(shape_k))

    rng = _rng(4)
    specs = [
        (8, grid(64, 64), "the notebook's window, N = 64"),
        (3, grid(20, 50), "Nq != Nk"),
        (1, grid(10, 10), "W = 1: each query sees itself only"),
        (100, grid(40, 40), "W larger than N: plain causal"),
        (5, grid(16, 16, q0=16, k0=8), "one tile's indices only: queries 16..31, keys 8..23"),
        (4, grid(12, 12, B=2, H=3), "b and h in front: indices of shape (B, H, Nq, Nk)"),
        (6, (np.asarray(0), np.asarray(0), np.asarray(9), np.asarray(4)),
         "scalar indices: query 9, key 4"),
        (int(rng.integers(2, 20)), grid(int(rng.integers(1, 60)), int(rng.integers(1, 60))),
         "random W and sizes"),
    ]
    out = []
    for W, (b, h, q, kv), what in specs:
        want = np.broadcast_to((kv <= q) & (kv > q - W),
                               np.broadcast_shapes(*(np.shape(x) for x in (b, h, q, kv))))
        out.append(case(f"W={W}, {what}", H_WINDOW, (W, b, h, q, kv), ("mask",), (want,)))
    return out


def _diagnose_window(case_, wrong, outputs):
    W, b, h, q, kv = case_.args
    got, ref = outputs["mask"], case_.expected[0]
    shape = ref.shape
    qq = np.broadcast_to(q, shape)
    kk = np.broadcast_to(kv, shape)
    bad = np.argwhere(got != ref)
    if not len(bad):
        return None
    where = tuple(bad[0])
    qi, ki = int(qq[where]), int(kk[where])
    text = (f"query {qi}, key {ki} (key - query = {ki - qi}) should be "
            f"{'visible' if ref[where] else 'hidden'}.")
    d = kk - qq
    for name, rule, note in (
            ("W + 1 keys", (d <= 0) & (d >= -W), "your window holds W + 1 keys: key q_idx - W is "
             "already outside (kv_idx > q_idx - W)."),
            ("itself hidden", (d < 0) & (d > -W), "a query sees its own key (kv_idx <= q_idx)."),
            ("W - 1 keys", (d <= 0) & (d > -W + 1), "your window holds W - 1 keys: keys q_idx - W"
             " + 1 ... q_idx are W keys."),
            ("future shown", np.abs(d) < W, "keys after the query (kv_idx > q_idx) stay hidden."),
    ):
        if np.array_equal(got.astype(bool), rule):
            return f"{text} {note}"
    return text


# ------------------------------------------------------------------------------------------
# 08b.block_kinds: the empty / full / partial tiles a mask mod implies
# ------------------------------------------------------------------------------------------

H_KINDS = ("Evaluate mask_mod(0, 0, q_idx, kv_idx) on each tile's own indices (q_idx a column "
           "of the tile's queries, kv_idx a row of its keys, both cut at Nq and Nk): no pair "
           "visible is EMPTY, every pair visible is FULL, some is PARTIAL.")


def _invoke_kinds(fn, view, timeout, measure):
    name, params, Nq, Nk, Br, Bc = view.args
    mod = MASK_MODS[name](*params)
    return call_limited(lambda: as_arrays(fn(mod, Nq, Nk, Br, Bc)), (), timeout=timeout,
                        measure_memory=measure)


def _kinds_cases():
    rng = _rng(5)
    name = ["window", "causal", "prefix", "dilated"][int(rng.integers(4))]
    param = {"window": [int(rng.integers(2, 40))], "causal": [],
             "prefix": [int(rng.integers(1, 40))], "dilated": [int(rng.integers(2, 6))]}[name]
    specs = [
        ("window", [8], 64, 64, 16, 16, "the notebook's window W = 8"),
        ("causal", [], 40, 72, 16, 32, "causal, Nq != Nk, both ends cut"),
        ("document", [10, 25, 15], 50, 50, 16, 8, "documents, the last Q tile cut"),
        ("prefix", [10], 48, 48, 16, 16, "a prefix of 10 keys every query sees"),
        ("everything", [], 50, 70, 16, 32, "every pair visible: each tile FULL, cut ones too"),
        ("dilated", [4], 32, 32, 8, 8, "every 4th key behind the query"),
        ("window", [2], 6, 6, 1, 1, "1 x 1 tiles: only EMPTY and FULL"),
        ("causal", [], 1, 1, 16, 16, "N = 1"),
        (name, param, int(rng.integers(1, 90)), int(rng.integers(1, 90)),
         int(rng.integers(1, 24)), int(rng.integers(1, 24)), f"random sizes, {name} mod"),
    ]
    out = []
    for name, params, Nq, Nk, Br, Bc, what in specs:
        label = f"{name}{tuple(params) if params else ''}, Nq={Nq}, Nk={Nk}, Br={Br}, Bc={Bc} ({what})"
        out.append(case(label, H_KINDS, (name, params, Nq, Nk, Br, Bc), ("kind",),
                        (kinds_of(dense_mask(name, params, Nq, Nk), Br, Bc),)))
    return out


def _diagnose_kinds(case_, wrong, outputs):
    name, params, Nq, Nk, Br, Bc = case_.args
    return _tile_diagnosis(outputs["kind"], case_.expected[0], dense_mask(name, params, Nq, Nk),
                           Br, Bc)


# ------------------------------------------------------------------------------------------
# 08b.softcap and 08b.softcap_grad: a score mod and its derivative
# ------------------------------------------------------------------------------------------

H_SOFTCAP = ("Softcapping maps each score S_ij to cap * tanh(S_ij / cap): about S_ij near 0, "
             "never beyond +-cap. Return a tensor of the score's shape and dtype.")
H_SOFTCAP_GRAD = ("d/dS [cap * tanh(S / cap)] = cap * (1 / cap) * (1 - tanh(S / cap)^2) = "
                  "1 - tanh(S / cap)^2, elementwise; a tensor of the score's dtype.")


def _to_scores(out, like) -> np.ndarray:
    import torch

    if not isinstance(out, torch.Tensor):
        raise TypeError(f"it returned a {type(out).__name__}; return a torch tensor (use "
                        "torch.tanh on the score tensor).")
    if out.dtype != like.dtype:
        raise TypeError(f"it returned {out.dtype} for a {like.dtype} score: keep the score's "
                        "dtype.")
    try:
        out = torch.broadcast_to(out, like.shape)
    except RuntimeError:
        raise ValueError(f"it returned shape {tuple(out.shape)} for a score of shape "
                         f"{tuple(like.shape)}: work elementwise.") from None
    return out.detach().numpy().copy()


def _invoke_softcap(fn, view, timeout, measure):
    cap, score, b, h, q, kv = view.args

    def run():
        import torch

        mod = fn(cap)
        if not callable(mod):
            raise TypeError(f"softcapping(cap) returned a {type(mod).__name__}: return the "
                            "score mod itself (the inner function).")
        s = torch.from_numpy(score)
        idx = tuple(torch.as_tensor(np.asarray(x, dtype=np.int64)) for x in (b, h, q, kv))
        return _to_scores(mod(s, *idx), s)

    return call_limited(run, (), timeout=timeout, measure_memory=measure)


def _invoke_softcap_grad(fn, view, timeout, measure):
    score, cap = view.args

    def run():
        import torch

        s = torch.from_numpy(score)
        return _to_scores(fn(s, cap), s)

    return call_limited(run, (), timeout=timeout, measure_memory=measure)


def _score_specs(k):
    rng = _rng(k)
    B, H, N = 1, 2, 16

    def scores(spread, dtype):
        return (rng.standard_normal((B, H, N, N)) * spread).astype(dtype)

    return [
        (2.0, scores(3.0, F64), F64, "cap = 2, scores around +-3"),
        (50.0, scores(100.0, F32), F32, "Gemma 2's cap = 50, scores up to a few hundred, float32"),
        (0.5, scores(1.0, F64), F64, "cap = 0.5"),
        (float(rng.uniform(1, 20)), scores(10.0, F64), F64, "a random cap"),
    ]


def _softcap_cases():
    B, H, N = 1, 2, 16
    idx = (np.arange(B).reshape(B, 1, 1, 1), np.arange(H).reshape(1, H, 1, 1),
           np.arange(N).reshape(1, 1, N, 1), np.arange(N).reshape(1, 1, 1, N))
    out = []
    for cap, s, dtype, what in _score_specs(6):
        want = cap * np.tanh(s.astype(F64) / cap)
        naive = (dtype(cap) * np.tanh(s / dtype(cap))).astype(dtype)
        out.append(case(what, H_SOFTCAP, (cap, s, *idx), ("score",), (want,), naive=(naive,),
                        dtype=dtype, inputs=("score",)))
    return out


def _softcap_grad_cases():
    out = []
    for cap, s, dtype, what in _score_specs(7):
        t = np.tanh(s.astype(F64) / cap)
        naive = (1 - np.tanh(s / dtype(cap)) ** 2).astype(dtype)
        out.append(case(what, H_SOFTCAP_GRAD, (s, cap), ("dscore",), (1 - t ** 2,),
                        naive=(naive,), dtype=dtype, inputs=("score",)))
    return out


def _close(a, b) -> bool:
    return np.allclose(a, b, rtol=1e-4, atol=1e-5)


def _diagnose_softcap(case_, wrong, outputs):
    cap, s = case_.args[0], case_.args[1].astype(F64)
    got = outputs["score"].astype(F64)
    for other, note in ((np.clip(s, -cap, cap), "your scores are clipped at +-cap: softcapping "
                         "is smooth, cap * tanh(S / cap)."),
                        (np.tanh(s / cap), "your scores stay within +-1: multiply tanh by cap."),
                        (cap * np.tanh(s), "the tanh's argument is S / cap, not S."),
                        (np.tanh(s), "it is cap * tanh(S / cap): both the cap inside and the cap "
                         "outside are missing.")):
        if _close(got, other):
            return note
    return None


def _diagnose_softcap_grad(case_, wrong, outputs):
    s, cap = case_.args[0].astype(F64), case_.args[1]
    got = outputs["dscore"].astype(F64)
    t = np.tanh(s / cap)
    for other, note in ((cap * (1 - t ** 2), "yours is cap times too large: the outer cap and the "
                         "inner 1 / cap of the chain rule cancel."),
                        ((1 - t ** 2) / cap, "yours is cap times too small: the outer cap and the "
                         "inner 1 / cap of the chain rule cancel."),
                        (1 - np.tanh(s) ** 2, "the tanh's argument is S / cap, not S."),
                        (1 - t, "the derivative of tanh(x) is 1 - tanh(x)^2: square the tanh."),
                        (t, "that is tanh(S / cap) itself; its derivative is 1 - tanh(S / cap)^2.")):
        if _close(got, other):
            return note
    return None


# ------------------------------------------------------------------------------------------
# 08b.softcap_hook: softcapping written in Triton, compiled into the package's kernels
# ------------------------------------------------------------------------------------------

H_HOOK = ("The kernels call your hook on a whole tile: s = scale * S_ij (a Br x Bc block of "
          "float32), and take back two tiles, the new score cap * tanh(s / cap) and its "
          "derivative 1 - tanh(s / cap)^2, which the backward multiplies dS_ij by. cap is "
          "args[0]. Triton has no tl.tanh everywhere: tanh(x) = 2 * tl.sigmoid(2 * x) - 1.")


def _launch_hook(hook, q, k, v, dout, cap, causal):
    """O, dQ, dK, dV of flashedu.attention on the triton backend with the learner's hook as
    the score mod, as float32 arrays (the inputs' dtype)."""
    import torch

    import flashedu
    from flashedu import runtime

    dev = runtime.kernel_device()
    mod = flashedu.mods.triton_score_mod(hook, args=(float(cap),))
    q, k, v = (torch.from_numpy(x).to(dev).requires_grad_() for x in (q, k, v))
    out = flashedu.attention(q, k, v, score_mod=mod, is_causal=causal, backend="triton",
                             enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.from_numpy(dout).to(dev))
    return tuple(t.detach().cpu().numpy() for t in (out, *grads))


def _hook_reference(q, k, v, dout, cap, causal, dtype):
    """(O, dQ, dK, dV) of attention with softcapping, computed in ``dtype`` by the formula."""
    import torch

    from flashedu import mods
    from flashedu.reference import naive_attention_torch

    q, k, v = (torch.from_numpy(x).to(dtype).requires_grad_() for x in (q, k, v))
    out = naive_attention_torch(q, k, v, upcast=False, is_causal=causal,
                                score_mod=mods.softcap(cap), enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.from_numpy(dout).to(dtype))
    return tuple(t.detach().double().numpy() for t in (out, *grads))


def _hook_cases():
    import torch

    rng = _rng(8)
    out = []
    for (H, Hkv, Nq, Nk, d, cap, causal, what) in (
            (2, 2, 37, 45, 16, 2.0, False, "Nq = 37, Nk = 45 (ragged tiles), cap = 2"),
            (2, 1, 40, 40, 16, 0.5, True, "causal, two query heads on one K/V head, cap = 0.5"),
            (1, 1, 24, 33, 16, 30.0, False, "cap = 30: scores far inside it")):
        q = (rng.standard_normal((1, H, Nq, d)) * 2).astype(F32)
        k, v = ((rng.standard_normal((1, Hkv, Nk, d)) * 2).astype(F32) for _ in range(2))
        dout = rng.standard_normal((1, H, Nq, d)).astype(F32)
        args = (q, k, v, dout, cap, causal)
        out.append(case(what, H_HOOK, args, ("O", "dQ", "dK", "dV"),
                        _hook_reference(*args, dtype=torch.float64),
                        naive=_hook_reference(*args, dtype=torch.float32), dtype=F32))
    return out


def _diagnose_hook(case_, wrong, outputs):
    if "O" not in wrong:
        return ("the forward is right, the gradients are not: the backward multiplies dS_ij by "
                "your second return value, the derivative d(cap * tanh(s / cap)) / ds = "
                "1 - tanh(s / cap)^2.")
    return None


# ------------------------------------------------------------------------------------------
# 08b.my_mask: a mask mod of the learner's own
# ------------------------------------------------------------------------------------------

H_OWN = ("Any rule works, if it is a mask mod: called on broadcast index tensors it returns a "
         "bool tensor; on a tile's indices it gives that tile of the whole grid (it depends on "
         "the index values only, not on the tensors' shapes); called on single indices it gives "
         "the same; and it hides some pairs and shows others.")


def _own_mask_problem(fn, B, H, N, Br):
    """None when ``fn`` behaves as a mask mod on a (B, H, N, N) grid, else what is wrong."""
    import torch

    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q, kv = torch.arange(N).view(1, 1, N, 1), torch.arange(N).view(1, 1, 1, N)
    whole = torch.as_tensor(_to_mask(fn(b, h, q, kv), (B, H, N, N)) > 0)
    if bool(whole.all()) or not bool(whole.any()):
        return (f"your rule {'shows every pair' if whole.all() else 'hides every pair'} on a "
                f"{N} x {N} grid: a mask hides some keys and shows others.")
    T = math.ceil(N / Br)
    for i in range(T):
        for j in range(T):
            rows, cols = q[..., i * Br:(i + 1) * Br, :], kv[..., j * Br:(j + 1) * Br]
            part = torch.as_tensor(_to_mask(fn(b, h, rows, cols),
                                            (B, H, rows.shape[2], cols.shape[3])) > 0)
            if not torch.equal(part, whole[:, :, i * Br:(i + 1) * Br, j * Br:(j + 1) * Br]):
                return (f"on the indices of tile (i={i}, j={j}) alone (queries "
                        f"{i * Br}..{min((i + 1) * Br, N) - 1}, keys {j * Br}.."
                        f"{min((j + 1) * Br, N) - 1}) your rule gives another answer than on the "
                        "whole grid: it must depend on the values of q_idx and kv_idx, not on "
                        "their shapes or positions (a kernel calls it one tile at a time).")
    rng = np.random.default_rng(N)
    for _ in range(6):
        bi, hi, qi, ki = (int(rng.integers(n)) for n in (B, H, N, N))
        one = fn(*(torch.tensor(x) for x in (bi, hi, qi, ki)))
        if isinstance(one, (bool, np.bool_)):
            one = torch.tensor(bool(one))
        if not isinstance(one, torch.Tensor) or one.numel() != 1 \
                or bool(one.reshape(())) != bool(whole[bi, hi, qi, ki]):
            return (f"called on single indices (b={bi}, h={hi}, q_idx={qi}, kv_idx={ki}, 0-d "
                    f"tensors, as FlexAttention calls it) your rule does not give the grid's "
                    f"{bool(whole[bi, hi, qi, ki])}.")
    return None


def _invoke_own(fn, view, timeout, measure):
    B, H, N, Br = view.args

    def run():
        problem = _own_mask_problem(fn, B, H, N, Br)
        return problem if problem else np.asarray(1.0)

    call = call_limited(run, (), timeout=timeout, measure_memory=measure)
    if call.error is None and isinstance(call.value, str):
        call.finding, call.value = call.value, None
    return call


def _own_cases():
    return [case(f"B={B}, H={H}, N={N}, tiles of {Br} x {Br}", H_OWN, (B, H, N, Br), ("ok",),
                 (1.0,))
            for B, H, N, Br in ((1, 2, 40, 16), (2, 2, 32, 8))]


# ------------------------------------------------------------------------------------------

STEPS = [
    _no_library(function_step("step_causal_tiles", "tile_classes", _causal_cases,
                              diagnose=_diagnose_causal)),
    _no_library(function_step("step_document_mask", "document_mask", _doc_mask_cases,
                              diagnose=_diagnose_doc_mask)),
    _no_library(function_step("step_document_tiles", "document_tiles", _doc_tiles_cases,
                              diagnose=_diagnose_doc_tiles)),
    Exercise("step_window_mask_mod", 0, "sliding_window", _window_cases, invoke=_invoke_window,
             diagnose=_diagnose_window, timeout=30.0, inspect=_library_use),
    Exercise("step_mask_mod_tiles", 0, "block_kinds", _kinds_cases, invoke=_invoke_kinds,
             diagnose=_diagnose_kinds, timeout=30.0, inspect=_library_use),
    Exercise("step_softcap", 0, "softcapping", _softcap_cases, invoke=_invoke_softcap,
             diagnose=_diagnose_softcap, timeout=30.0, inspect=_library_use),
    Exercise("step_softcap_grad", 0, "softcap_grad", _softcap_grad_cases,
             invoke=_invoke_softcap_grad, diagnose=_diagnose_softcap_grad, timeout=30.0,
             inspect=_library_use),
    Exercise("step_own_mask_mod", 0, "my_mask", _own_cases, invoke=_invoke_own, timeout=30.0),
    # the package's attention is the machinery here (the hook is the learner's): not blocked;
    # a @triton.jit hook cannot call Python, and the gate reads what it calls
    dataclasses.replace(kernel_step("triton_step_score_mod_hook", "softcap_hook", _hook_cases,
                                    _launch_hook, diagnose=_diagnose_hook), blocked=False),
]
