"""Notebook 10's steps: the arithmetic behind three of its optimizations, as plain functions.

- ``step_kv_tiles``: which K/V tiles a Q tile visits, and how many of them need no element mask
  (the split into an unmasked and a masked loop);
- ``step_smem``: the shared memory a forward program asks for (tile shapes and pipeline depth);
- ``step_programs_per_sm``: how many programs fit on one H100 SM at once (registers, shared
  memory, threads);
- ``step_ring_slot``: where K/V tile j lands in a ring of shared-memory stages, and which phase
  of each stage's mbarriers the copy warp and the consumers wait on (FlashAttention-3's loads);
- ``step_persistent_deal``: which tile a persistent program takes next when the causal Q tiles,
  longest first, are dealt in a snake (every program gets about the same work);
- ``step_own_tiles``: the K/V tiles one consumer's rows read in a causal call;
- ``step_finish_time``: when the last SM finishes, each SM taking the next program in the grid's
  order whenever it is free (the tail of one program per causal Q tile);
- ``step_plan_tiles``: which persistent program takes each causal Q tile, longest first, each to
  the program with the least work so far (``fa3.plan_causal``);
- ``step_exp2_cubic``: 2^x of the softmax's exponents without the special-function unit: the
  float's exponent bits for 2^floor(x), a cubic for the rest.

Every expected answer is computed here from the definition itself, not from the formula the
notebook's solution uses: tiles by looking at each key of each tile, programs per SM by
counting down what is left of the SM, the deal by sorting the tiles and dealing them out, the
finish by running a clock, the plan by looking at every program's load.
"""

from __future__ import annotations

import math

import numpy as np

from ..engine import run_seed
from ..sandbox import _names
from ..steptools import as_arrays, case, function_step, untouched

# An H100 (sm_90) SM, as the CUDA occupancy calculator counts it
REGISTERS_PER_SM = 65536
REGISTER_STEP = 8  # registers are handed out per thread in steps of 8 (256 per warp)
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED = 1024  # the system keeps 1 KiB of shared memory per program
THREADS_PER_SM = 2048  # (and at most 32 programs: with 2 warps or more, threads bind first)


def _rng(k):
    return np.random.default_rng((run_seed(), k))


# ------------------------------------------------------------------------------------------
# 10.kv_tiles: the K/V tiles of Q tile i, and the unmasked ones among them
# ------------------------------------------------------------------------------------------

H_TILES = ("Q tile i holds query rows i*Br .. i*Br + Br - 1. It visits the K/V tiles j (keys "
           "j*Bc .. j*Bc + Bc - 1) that hold a key it may see: all ceil(Nk / Bc) of them, or "
           "with causal only those with a key <= its last row. A tile needs no mask when all "
           "its keys are < Nk and, with causal, <= the tile's FIRST row.")
H_RAGGED = ("Nk is no multiple of Bc here: the last K/V tile holds keys past Nk, so it needs "
            "the mask: num = ceil(Nk / Bc) but num_full = Nk // Bc.")
H_DIAG = ("Causal: a tile is unmasked only if its last key j*Bc + Bc - 1 is <= the Q tile's "
          "first row i*Br (every row sees every key); the tiles that reach past it up to the "
          "last row i*Br + Br - 1 cross the diagonal and need the mask.")


def kv_tiles_by_keys(i, Br, Bc, Nk, causal):
    """(num, num_full) from the keys themselves: every tile is judged on each of its keys."""
    first, last = i * Br, i * Br + Br - 1
    visited, full = [], []
    for j in range(math.ceil(Nk / Bc)):
        keys = range(j * Bc, j * Bc + Bc)
        if causal and keys[0] > last:
            break  # no row of the tile sees this tile, nor any tile after it
        visited.append(j)
        full.append(all(k < Nk and (not causal or k <= first) for k in keys))
    num_full = 0
    while num_full < len(full) and full[num_full]:
        num_full += 1
    assert all(not f for f in full[num_full:]), "the unmasked tiles come first"
    return len(visited), num_full


def _kv_cases():
    specs = [  # (i, Br, Bc, Nk, causal, what, hint)
        (3, 64, 64, 512, False, "dense, Nk a multiple of Bc: no tile needs the mask", H_TILES),
        (0, 32, 32, 100, False, "dense, Nk = 100: a ragged last tile", H_RAGGED),
        (5, 64, 64, 8192, True, "causal, Br = Bc: one diagonal tile", H_DIAG),
        (2, 128, 64, 4096, True, "causal, Br = 2 Bc: two diagonal tiles", H_DIAG),
        (3, 32, 64, 4096, True, "causal, Br < Bc: the diagonal inside one K/V tile", H_DIAG),
        (0, 64, 64, 4096, True, "causal, the first Q tile: only its diagonal tile", H_DIAG),
        (4, 16, 16, 70, True, "causal, Q tile 4 reaches past Nk = 70", H_RAGGED),
        (0, 16, 16, 1, False, "Nk = 1", H_RAGGED),
    ]
    rng = _rng(0)
    for _ in range(3):
        Br, Bc = (int(b) for b in rng.choice([16, 32, 64, 128], 2))
        Nk = int(rng.integers(1, 600))
        i = int(rng.integers(0, max(1, math.ceil(Nk / Br))))
        specs.append((i, Br, Bc, Nk, bool(rng.integers(0, 2)), "random sizes", H_TILES))
    cases = []
    for i, Br, Bc, Nk, causal, what, hint in specs:
        num, num_full = kv_tiles_by_keys(i, Br, Bc, Nk, causal)
        cases.append(case(f"i={i}, Br={Br}, Bc={Bc}, Nk={Nk}, causal={causal} ({what})", hint,
                          (i, Br, Bc, Nk, causal), ("num", "num_full"), (num, num_full)))
    return cases


def _diagnose_kv(case_, wrong, outputs):
    i, Br, Bc, Nk, causal = case_.args
    num, num_full = (int(x) for x in case_.expected)
    got_num, got_full = outputs.get("num"), outputs.get("num_full")
    if got_num is None or got_full is None:
        return None
    got_num, got_full = float(got_num), float(got_full)
    first, last = i * Br, i * Br + Br - 1
    if got_num != num:
        if causal and got_num == math.ceil(Nk / Bc):
            return (f"with causal the program stops after the tile that holds its last row "
                    f"{last}: num = ceil(min(Nk, (i + 1) * Br) / Bc) = {num}, not all "
                    f"{int(got_num)} tiles of K.")
        if got_num == Nk // Bc and Nk % Bc:
            return f"the ragged last tile is visited too: num = ceil(Nk / Bc) = {num}."
        return f"num should be {num}, yours is {got_num:g}."
    if causal and got_full == min(last + 1, Nk) // Bc and got_full != num_full:
        return (f"a tile whose keys reach past the FIRST row {first} is not seen whole by that "
                f"row: num_full counts the tiles whose last key is <= {first}, here {num_full}.")
    if got_full == num and num_full != num:
        return (f"{num - num_full} of the {num} tiles need the mask (the causal diagonal or "
                "keys past Nk): num_full counts only those that need none.")
    return f"yours: (num, num_full) = ({got_num:g}, {got_full:g}); the right answer: ({num}, " \
           f"{num_full})."


# ------------------------------------------------------------------------------------------
# 10.smem: the shared memory of one forward program
# ------------------------------------------------------------------------------------------

H_SMEM = ("A program keeps Q_i (Br x d) once, and K_j and V_j (Bc x d each) num_stages deep: "
          "(Br * d + stages * 2 * Bc * d) * bytes_per_element bytes, divided by 1024 for KiB.")


def smem_by_parts(Br, Bc, d, stages, bytes_per_element):
    q = Br * d * bytes_per_element
    kv = sum(Bc * d * bytes_per_element for _ in range(stages) for _tensor in ("K", "V"))
    return (q + kv) / 1024


def _smem_cases():
    specs = [(128, 128, 128, 3, 2, "the d=128 forward, bf16"),
             (128, 128, 128, 4, 2, "one stage more"),
             (64, 64, 64, 3, 4, "float32 (4 bytes), the exercise's kernel"),
             (128, 64, 256, 2, 2, "Br != Bc, d=256"),
             (16, 32, 16, 1, 2, "one stage: no loads ahead")]
    rng = _rng(1)
    Br, Bc = (int(b) for b in rng.choice([16, 32, 64, 128], 2))
    specs.append((Br, Bc, int(rng.choice([32, 64, 128])), int(rng.integers(1, 5)),
                  int(rng.choice([2, 4])), "random tiles"))
    return [case(f"Br={Br}, Bc={Bc}, d={d}, stages={s}, {b} bytes ({what})", H_SMEM,
                 (Br, Bc, d, s, b), ("KiB",), (smem_by_parts(Br, Bc, d, s, b),))
            for Br, Bc, d, s, b, what in specs]


def _diagnose_smem(case_, wrong, outputs):
    Br, Bc, d, s, b = case_.args
    got = outputs.get("KiB")
    if got is None:
        return None
    got = float(got)
    want = smem_by_parts(Br, Bc, d, s, b)
    tries = {
        "bytes, not KiB: divide by 1024": want * 1024,
        "K_j only: V_j is loaded num_stages deep too (2 * Bc * d per stage)":
            (Br * d + s * Bc * d) * b / 1024,
        "Q_i counted once per stage: it is loaded once and stays": (s * (Br + 2 * Bc) * d) * b
        / 1024,
        "without bytes_per_element: multiply the element count by it": (Br * d + s * 2 * Bc * d)
        / 1024,
        "Q_i left out: it sits in shared memory too (Br x d, once)": s * 2 * Bc * d * b / 1024,
    }
    for text, value in tries.items():
        if math.isclose(got, value, rel_tol=1e-9) and not math.isclose(value, want):
            return f"yours is {got:g} KiB, the right value {want:g}: {text}."
    return f"yours is {got:g} KiB, the right value {want:g}."


# ------------------------------------------------------------------------------------------
# 10.programs_per_sm: registers, shared memory and threads of one SM
# ------------------------------------------------------------------------------------------

H_PROGRAMS = ("Three limits, take the smallest: registers (65536 per SM; a thread's count "
              "rounded up to a multiple of 8, times 32 threads per warp, times num_warps), "
              "shared memory (228 KiB = 233472 bytes per SM, each program asks shared_bytes + "
              "1024), threads (2048 per SM, 32 per warp).")
H_ROUND = ("Registers are handed out in steps of 8 per thread: 129 registers cost as much as "
           "136. Round up before you divide.")
H_SHARED = ("Shared memory is the limit here: 233472 bytes per SM, and each program takes its "
            "shared_bytes plus 1024 that the system keeps for it.")
H_THREADS = ("Few registers and little shared memory: the 2048 threads of an SM (64 warps) are "
             "the limit here.")


def programs_by_filling(registers, num_warps, shared_bytes):
    """Put programs on an empty SM one at a time until the next one does not fit."""
    regs_each = -(-registers // REGISTER_STEP) * REGISTER_STEP * 32 * num_warps
    regs, shared, threads, n = REGISTERS_PER_SM, SHARED_PER_SM, THREADS_PER_SM, 0
    while (regs >= regs_each and shared >= shared_bytes + SHARED_RESERVED
           and threads >= 32 * num_warps):
        regs -= regs_each
        shared -= shared_bytes + SHARED_RESERVED
        threads -= 32 * num_warps
        n += 1
    return n


def _programs_cases():
    specs = [(128, 8, 65536, "8 warps at 128 registers", H_PROGRAMS),
             (129, 8, 65536, "129 registers: rounded up to 136", H_ROUND),
             (169, 4, 32768, "169 registers, handed out as 176", H_ROUND),
             (168, 4, 114688, "4 warps, 112 KiB of shared memory", H_SHARED),
             (255, 8, 16384, "255 registers, 8 warps", H_PROGRAMS),
             (32, 4, 0, "32 registers, no shared memory", H_THREADS),
             (96, 4, 229376, "224 KiB of shared memory", H_SHARED)]
    rng = _rng(2)
    specs.append((int(rng.integers(16, 256)), int(rng.choice([2, 4, 8])),
                  int(rng.integers(0, 200)) * 1024, "random", H_PROGRAMS))
    return [case(f"registers={r}, num_warps={w}, shared_bytes={s} ({what})", hint, (r, w, s),
                 ("programs",), (programs_by_filling(r, w, s),))
            for r, w, s, what, hint in specs]


def _diagnose_programs(case_, wrong, outputs):
    r, w, s = case_.args
    got = outputs.get("programs")
    if got is None:
        return None
    got = float(got)
    want = programs_by_filling(r, w, s)
    by_regs_unrounded = REGISTERS_PER_SM // (r * 32 * w)
    by_shared_no_reserve = SHARED_PER_SM // s if s else math.inf
    if got == min(by_regs_unrounded, by_shared_no_reserve if s else math.inf,
                  THREADS_PER_SM // (32 * w)) and got != want:
        return (f"yours {got:g}, the right value {want}: registers are rounded up to a multiple "
                "of 8 per thread, and each program's shared memory counts 1024 bytes more.")
    if got == REGISTERS_PER_SM // (-(-r // 8) * 8 * 32 * w) and got != want:
        return (f"yours {got:g} counts the registers only; here shared memory or threads allow "
                f"fewer: {want}.")
    return f"yours is {got:g} programs, the right value {want}."


# ------------------------------------------------------------------------------------------
# 10.ring: the stage of tile j and the mbarrier phases waited on
# ------------------------------------------------------------------------------------------

H_RING = ("The copy warp fills the stages in turn, 0, 1, .., STAGES - 1, 0, ..: tile j goes to "
          "stage j % STAGES, and it is that stage's (j // STAGES)-th fill (counting from 0). "
          "An mbarrier's phases complete one after another and a wait names the parity (0 or "
          "1) of the phase it waits for: the consumers wait for the fill's own completion of "
          "the ready barrier, parity (j // STAGES) % 2.")
H_FREE = ("Before the fill the copy warp waits until the consumers released the stage's "
          "previous tile (the fill before, one completion of the free barrier earlier): the "
          "opposite parity. A fresh barrier counts as if the phase before its first had "
          "completed, so the first fill of each stage waits on parity 1 and passes at once.")


def ring_by_running(j, stages):
    """(stage, ready parity, free parity) of tile j: the ring run tile by tile, each barrier's
    completions counted."""
    fills = [0] * stages  # how often each stage was filled before
    stage = 0
    for _ in range(j):
        fills[stage] += 1
        stage = stage + 1 if stage + 1 < stages else 0
    waited = fills[stage]  # this fill's completion of the ready barrier, counted from 0
    ready = waited % 2
    free = (waited - 1) % 2  # the release of the fill before; -1: a fresh barrier's
    return stage, ready, free


def _ring_cases():
    specs = [(0, 2, "the first tile", H_FREE), (1, 2, "the second stage's first fill", H_FREE),
             (2, 2, "two stages, stage 0 again", H_RING), (5, 3, "three stages", H_RING),
             (3, 3, "three stages, stage 0's second fill", H_RING),
             (7, 1, "one stage: every tile in stage 0", H_RING),
             (12, 4, "four stages", H_RING)]
    rng = _rng(3)
    for _ in range(3):
        specs.append((int(rng.integers(0, 200)), int(rng.integers(1, 6)), "random", H_RING))
    return [case(f"j={j}, STAGES={st} ({what})", hint, (j, st),
                 ("stage", "ready_phase", "free_phase"), ring_by_running(j, st))
            for j, st, what, hint in specs]


def _diagnose_ring(case_, wrong, outputs):
    j, stages = case_.args
    want = ring_by_running(j, stages)
    got = tuple(outputs.get(n) for n in ("stage", "ready_phase", "free_phase"))
    if any(g is None for g in got):
        return None
    got = tuple(float(g) for g in got)
    if got[0] != want[0]:
        return f"tile {j} goes to stage j % STAGES = {want[0]}, yours {got[0]:g}."
    if got[1] == j % 2 and got[1] != want[1]:
        return (f"the parity counts the fills of stage {want[0]}, not the tiles: the "
                f"{j // stages}-th fill waits for parity (j // STAGES) % 2 = {want[1]}.")
    if got[1] != want[1]:
        return f"ready_phase should be {want[1]}, yours {got[1]:g}."
    if got[2] == got[1]:
        return ("free_phase equals ready_phase: the copy warp would wait for a release that "
                "comes only after this very fill, and the kernel would hang. It waits for the "
                "previous fill's release: the opposite parity.")
    return f"free_phase should be {want[2]}, yours {got[2]:g}."


# ------------------------------------------------------------------------------------------
# 10.deal: the tile a persistent program takes next, dealt in a snake
# ------------------------------------------------------------------------------------------

H_DEAL = ("Deal m hands out the tiles m*P .. m*P + P - 1 of the order, one to each program: the "
          "program's m-th tile comes from deal m.")
H_SNAKE = ("Dealt in a snake: deal m goes to programs 0, 1, .., P - 1 when m is even and to "
           "programs P - 1, .., 0 when m is odd, so the program that got the longest tile of "
           "one deal gets the shortest of the next.")


def deal_by_dealing(m, p, P):
    """Program p's m-th tile, as a position in the tiles' order: the positions 0, 1, 2, ..
    dealt out deal by deal, forward and back in turn."""
    hands = [[] for _ in range(P)]
    position = 0
    for deal in range(m + 1):
        for program in (range(P) if deal % 2 == 0 else range(P - 1, -1, -1)):
            hands[program].append(position)
            position += 1
    return hands[p][m]


def _deal_cases():
    specs = [(0, 0, 4, "the first tile of program 0", H_DEAL),
             (0, 3, 4, "the first deal's last program", H_DEAL),
             (1, 0, 4, "program 0's second tile: the snake turns", H_SNAKE),
             (1, 3, 4, "program 3's second tile", H_SNAKE),
             (2, 1, 4, "the third deal runs forward again", H_SNAKE),
             (3, 131, 132, "132 programs, the fourth deal", H_SNAKE),
             (5, 0, 1, "one program takes every tile", H_DEAL)]
    rng = _rng(4)
    for _ in range(3):
        P = int(rng.integers(1, 200))
        specs.append((int(rng.integers(0, 40)), int(rng.integers(0, P)), P, "random", H_SNAKE))
    return [case(f"m={m}, p={p}, P={P} ({what})", hint, (m, p, P), ("t",),
                 (deal_by_dealing(m, p, P),))
            for m, p, P, what, hint in specs]


def _diagnose_deal(case_, wrong, outputs):
    m, p, P = case_.args
    got = outputs.get("t")
    if got is None:
        return None
    got = int(float(got))
    want = deal_by_dealing(m, p, P)
    if got == m * P + p and got != want:
        return ("yours deals every deal in the same order: program 0 then gets the longest "
                "tile of every deal and program P - 1 the shortest. Turn every second deal "
                "around (program P - 1 first).")
    if got == p * P + m or got == m + p:
        return "deal m hands out the positions m*P .. m*P + P - 1: one to each program."
    return f"program {p}'s tile {m} is position {want} of the order, yours {got}."


# ------------------------------------------------------------------------------------------
# 10.own: the K/V tiles one consumer's rows read in a causal call
# ------------------------------------------------------------------------------------------

H_OWN = ("Row r of a causal call (top-left) sees keys 0 .. r: the consumer's last row, first + "
         "M - 1, decides, and a tile is read if it holds any key the rows see. A tile of Bc "
         "keys that starts at or before that row counts: ceil((first + M) / Bc) of them.")
H_OWN_KEYS = ("There are only Nk keys: rows past the last key see them all, and no tile starts "
              "at or past Nk.")


def own_by_counting(first, M, Nk, Bc):
    """The K/V tiles rows first .. first + M - 1 read in a causal call: each tile that holds a
    key one of the rows sees, counted tile by tile; at least one."""
    last_row = first + M - 1
    tiles, start = 0, 0
    while start < Nk and start <= last_row:
        tiles += 1
        start += Bc
    return max(1, tiles)


def _own_cases():
    specs = [(0, 64, 4096, 128, "the first consumer: one tile", H_OWN),
             (128, 64, 4096, 128, "rows 128 .. 191: a second tile", H_OWN),
             (64, 64, 4096, 128, "rows 64 .. 127: still one tile", H_OWN),
             (4032, 64, 4096, 128, "the last rows: every tile", H_OWN),
             (320, 64, 300, 64, "rows past the last key (more queries than keys)", H_OWN_KEYS),
             (190, 64, 4096, 64, "rows that do not start on a tile", H_OWN)]
    rng = _rng(5)
    for _ in range(4):
        Bc = int(rng.choice([16, 32, 64, 128]))
        M = int(rng.choice([16, 64]))
        Nk = int(rng.integers(1, 3000))
        specs.append((int(rng.integers(0, 3000)), M, Nk, Bc, "random", H_OWN_KEYS))
    return [case(f"first={f}, M={M}, Nk={Nk}, Bc={Bc} ({what})", hint, (f, M, Nk, Bc),
                 ("tiles",), (own_by_counting(f, M, Nk, Bc),))
            for f, M, Nk, Bc, what, hint in specs]


def _diagnose_own(case_, wrong, outputs):
    first, M, Nk, Bc = case_.args
    got = outputs.get("tiles")
    if got is None:
        return None
    got = int(float(got))
    want = own_by_counting(first, M, Nk, Bc)
    if got == max(1, -(-(first + M) // Bc)) and Nk < first + M and got != want:
        return f"yours reads tiles past the last key: there are {-(-Nk // Bc)} tiles of keys."
    if got == max(1, -(-(first + 1) // Bc)) and got != want:
        return ("yours stops at the consumer's first row: its other rows see further, up to "
                "key first + M - 1.")
    if got == max(1, (first + M) // Bc) and got != want:
        return ("a tile that holds only part of the keys the rows see is still read (and "
                "masked): round up.")
    return f"rows {first} .. {first + M - 1} read {want} tiles, yours {got}."


# ------------------------------------------------------------------------------------------
# 10.finish: when the last SM finishes, each taking the next program whenever it is free
# ------------------------------------------------------------------------------------------

H_FINISH = ("The GPU starts programs in the grid's order: whenever an SM is free it takes the next "
            "program, which keeps it busy for its work. The answer is when the last SM finishes.")
H_TAIL = ("A long program started late runs on alone while the other SMs have nothing left: "
          "the finish is the latest start + work, not the work spread evenly.")


def finish_by_clock(works, sms):
    """When the last SM finishes, by running a clock one unit at a time (works are whole
    units): at each tick every free SM, in turn, takes the next program."""
    busy_until = [0] * sms
    nxt, tick = 0, 0
    while nxt < len(works):
        for s in range(sms):
            if busy_until[s] <= tick and nxt < len(works):
                busy_until[s] = tick + works[nxt]
                nxt += 1
        tick += 1
    return max(busy_until)


def _random_works(rng, hint):
    """Three random cases of the scheduling steps: 20-39 works of 1-29 units each, on 1-9
    SMs (or programs)."""
    specs = []
    for _ in range(3):
        works = [int(w) for w in rng.integers(1, 30, size=int(rng.integers(20, 40)))]
        specs.append((works, int(rng.integers(1, 10)), "random", hint))
    return specs


def _finish_cases():
    specs = [([4], 3, "one program", H_FINISH),
             ([2, 2, 2, 2], 2, "even work", H_FINISH),
             ([5, 1, 1, 1, 1, 1], 2, "the long program first", H_FINISH),
             ([1, 1, 1, 1, 1, 5], 2, "the long program last", H_TAIL),
             ([3, 1, 2, 2, 1], 2, "an SM free before the other", H_FINISH),
             ([1, 2, 3], 5, "more SMs than programs", H_FINISH)]
    specs += _random_works(_rng(6), H_TAIL)
    return [case(f"{len(w)} programs {f'{w} ' if len(w) < 8 else ''}on {sms} SMs ({what})", hint,
                 (w, sms), ("finish",), (finish_by_clock(w, sms),))
            for w, sms, what, hint in specs]


def _diagnose_finish(case_, wrong, outputs):
    works, sms = case_.args
    got = outputs.get("finish")
    if got is None:
        return None
    got = float(got)
    want = finish_by_clock(works, sms)
    if got == want:
        return None
    if math.isclose(got, sum(works) / sms):
        return ("yours spreads the work evenly, as if a program could be cut up: each program "
                "runs whole on the SM that takes it.")
    if got == max(sum(works[k::sms]) for k in range(sms)):
        return ("yours hands the programs out in turn (program k to SM k % sms): an SM takes "
                "the next program when it is free, and a short program frees it early.")
    if got == sum(works):
        return "the SMs run at the same time: each takes the next program when it is free."
    return f"the last SM finishes at {want}, yours {got:g}."


# ------------------------------------------------------------------------------------------
# 10.plan: the causal Q tiles planned for the persistent programs, longest first
# ------------------------------------------------------------------------------------------

H_PLAN = ("Take the items longest first (of equal work, the lower index first) and give each to "
          "the program with the least work so far (of equal, the lowest-numbered): "
          "heapq.heappop on (work so far, program) pairs gives it.")
H_LONGEST = ("The items in the order given leave a long one for the end, when every program is "
             "already loaded: sort them longest first.")


def plan_by_scanning(works, programs, order=None):
    """Each item's program: the items longest first (or in ``order``), each to the
    least-loaded program, found by looking at every program's load."""
    loads = [0] * programs
    owner = [0] * len(works)
    if order is None:
        order = sorted(range(len(works)), key=lambda k: (-works[k], k))
    for k in order:
        p = loads.index(min(loads))
        owner[k] = p
        loads[p] += works[k]
    return owner


def _plan_cases():
    specs = [([4], 3, "one item", H_PLAN),
             ([1, 1, 1, 1], 2, "equal items", H_PLAN),
             ([1, 1, 1, 1, 1, 5], 2, "the long item last in the list", H_LONGEST),
             ([3, 1, 2, 2, 1], 2, "ties", H_PLAN),
             ([1, 2, 3], 5, "more programs than items", H_PLAN),
             ([2, 7, 7, 3, 1, 9, 4], 3, "a mix", H_LONGEST)]
    specs += _random_works(_rng(7), H_LONGEST)
    return [case(f"{len(w)} items {f'{w} ' if len(w) < 8 else ''}on {n} programs ({what})", hint,
                 (w, n), ("owner",), (plan_by_scanning(w, n),))
            for w, n, what, hint in specs]


def _owner_list(value):
    """``adapt`` for the plan: its list of programs is one output, not one output each."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, np.integer)) for v in value):
        return np.asarray(value, dtype=np.float64)
    return as_arrays(value)


def _diagnose_plan(case_, wrong, outputs):
    works, programs = case_.args
    got = outputs.get("owner")
    if got is None:
        return None
    got = [int(x) for x in np.ravel(np.asarray(got, dtype=np.float64))]
    if len(got) != len(works):
        return f"owner has one program for each item: {len(works)}, yours {len(got)}."
    order = sorted(range(len(works)), key=lambda k: (-works[k], k))
    if got == [order.index(k) % programs for k in range(len(works))]:
        return ("yours hands the items out in turn: the next goes to the program with the "
                "least work so far, which after a short item is not the next in turn.")
    if got == plan_by_scanning(works, programs, order=range(len(works))):
        return H_LONGEST
    return None


# ------------------------------------------------------------------------------------------
# 10.exp2_cubic: 2^x as 2^n (the exponent's bits) times 2^f (a cubic), x <= 0
# ------------------------------------------------------------------------------------------

# What a cubic fitted to 2^f on [0, 1) misses by (8.6e-5 of the value for the notebook's one),
# with float32's rounding; a quadratic misses by 1.7e-3 and fails
CUBIC_ALLOWANCE = 1e-4
H_CUBIC = ("x = n + f with n = floor(x), f = x - n in [0, 1); 2^f = 1 + f * (c1 + f * (c2 + f * "
           "c3)); then 2^x = 2^n * 2^f: add n << 23 to the bits of 2^f (p.view(np.int32)), "
           "which adds n to its exponent, and view the result as float32 again.")
H_MASKED = ("A masked score is -inf: floor(-inf) is -inf and f = x - n is NaN. Clamp x at -126 "
            "first (np.maximum(x, -126)): 2^-126, about 1e-38, is as good as 0 beside the "
            "row's largest entry, 1, and the exponent bits stay those of a normal float.")


# what computes an exponential itself: the step builds 2^x without one
EXPONENTIALS = {"exp", "exp2", "expm1", "power", "float_power", "pow"}


def _no_exponential(fn):
    """A message when ``fn`` (or a function it defines inside) names an exponential."""
    code = getattr(fn, "__code__", None)
    used = sorted(_names(code) & EXPONENTIALS) if code else []
    if used:
        return (f"yours calls {', '.join(used)}: that is the exponential this step replaces. "
                "Build 2^x from floor(x), the cubic and the exponent's bits.")
    return None


def _exp2_cases():
    rng = _rng(7)
    specs = [(np.array([0, -1, -2, -10, -126], np.float32), "whole numbers: f = 0", H_CUBIC),
             (np.linspace(-8, 0, 257, dtype=np.float32), "between the whole numbers", H_CUBIC),
             (np.array([-0.25, -0.5, -0.75, -1.5, -0.001], np.float32), "just below 0",
              H_CUBIC),
             (np.array([-np.inf, -300, -127.5, 0], np.float32), "masked and tiny scores",
              H_MASKED),
             (rng.uniform(-40, 0, size=1000).astype(np.float32), "random", H_CUBIC)]
    return [case(f"{len(x)} entries ({what})", hint, (x,), ("P",),
                 (np.exp2(x.astype(np.float64)),), inputs=("x",), dtype=np.float32,
                 rounding=(CUBIC_ALLOWANCE,))
            for x, what, hint in specs]


def _diagnose_exp2(case_, wrong, outputs):
    (x,) = case_.args
    got = np.asarray(outputs.get("P"), dtype=np.float64)
    if got.shape != x.shape:
        return f"P has the shape of x, {x.shape}: one 2^x an entry; yours {got.shape}."
    if np.isnan(got[np.isinf(x)]).any() or np.isnan(got[x < -126]).any():
        return H_MASKED
    finite = x > -126
    off = np.abs(got[finite] / np.exp2(x[finite].astype(np.float64)) - 1)
    upper = (x - np.floor(x))[finite] >= 0.5  # where round(x) may go up and leave f < 0
    if upper.any() and off[upper].max() > CUBIC_ALLOWANCE >= off[~upper].max(initial=0):
        return ("right where x - floor(x) < 0.5, off above: n = floor(x), not round(x); the "
                "cubic was fitted on [0, 1), and round leaves f in [-0.5, 0.5).")
    return None


STEPS = [
    function_step("step_ring_slot", "ring_slot", _ring_cases, diagnose=_diagnose_ring),
    function_step("step_kv_tiles", "kv_tile_counts", _kv_cases, diagnose=_diagnose_kv),
    function_step("step_smem", "smem_kib", _smem_cases, diagnose=_diagnose_smem),
    function_step("step_programs_per_sm", "programs_per_sm", _programs_cases,
                  diagnose=_diagnose_programs),
    function_step("step_persistent_deal", "deal_position", _deal_cases,
                  diagnose=_diagnose_deal),
    function_step("step_own_tiles", "own_tiles", _own_cases, diagnose=_diagnose_own),
    function_step("step_finish_time", "finish_time", _finish_cases, diagnose=_diagnose_finish),
    function_step("step_plan_tiles", "plan_owners", _plan_cases, adapt=_owner_list,
                  diagnose=_diagnose_plan),
    function_step("step_exp2_cubic", "exp2_cubic", _exp2_cases, adapt=untouched,
                  diagnose=_diagnose_exp2, inspect=_no_exponential),
]
