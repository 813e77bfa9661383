"""FlashAttention-3's forward with K/V tiles of 128 + EXTRA keys, as FlashAttention-3 takes 176
keys a tile at d = 128 (dense): an experiment against the tile table's 128.

Triton's shapes are powers of two (``shape must have power-of-2 and non-zero dimensions; got 2,
192, 128``), so a tile of 192 or 160 keys is two boxes: 128 keys and EXTRA keys, each with its
own TMA descriptor, shared-memory ring and products (S_ij in two parts, one softmax over both,
O_i += P_a V_a + P_b V_b). The variant is derived from ``flashedu/triton/fa3.py``'s source at
run time (``variant_source``: each change is asserted to apply, so a change to fa3.py that
breaks one fails loudly here rather than timing something else); dense, no dropout.

    python scripts/fa3_wide_tiles.py --compile 64 32     # no GPU: ptxas's verdict on sm_90
    python scripts/fa3_wide_tiles.py --extra 32 64 --json docs/bench/fa3_wide_h200.json  # a GPU

``--compile`` needs Triton 3.6 (the Gluon API fa3.py is written against) with its NVIDIA
tools: registers, spills, the products and their waits, and whether ptxas serialized the
warpgroup products (advisory C7512: the accumulators did not fit in registers). On a GPU:
the variant's answers against SDPA in float32 at ragged lengths, then the forward at 4096,
8192 and 16384 keys, d = 128, bf16, ``flashedu bench``'s shapes, timed in turn with the
table's settings, the table's with two stages, and SDPA-cuDNN.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FA3 = os.path.join(ROOT, "flashedu", "triton", "fa3.py")
MAIN_BOX = 128  # fa3.forward's Bc: the first box of every tile
STAGES = 2  # three stages of 128 + 64 keys at d = 128 would take 320 KB of shared memory


def variant_source(extra: int) -> str:
    """fa3.py's source with tiles of MAIN_BOX + extra keys (two boxes a tile), dense only."""
    with open(FA3) as f:
        s = f.read()

    def swap(old, new):
        nonlocal s
        if s.count(old) != 1:
            raise RuntimeError(f"fa3.py changed: {old.strip()[:70]!r} is not there once")
        s = s.replace(old, new)

    swap("    _M = gl.constexpr(M)\n",
         f"    _M = gl.constexpr(M)\n    _X = gl.constexpr({extra})  # a tile's second box\n")
    # the copy warp: two boxes of K and of V a tile, on the tile's two barriers
    swap("""            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            _tma_load(k_desc, [j * Bc, 0], k_ready.index(s), k_smem.index(s))
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            _tma_load(v_desc, [j * Bc, 0], v_ready.index(s), v_smem.index(s))""",
         """            W: gl.constexpr = Bc + _X
            mbarrier.expect(k_ready.index(s), k_desc[0].block_type.nbytes
                            + k_desc[1].block_type.nbytes)
            _tma_load(k_desc[0], [j * W, 0], k_ready.index(s), k_smem[0].index(s))
            _tma_load(k_desc[1], [j * W + Bc, 0], k_ready.index(s), k_smem[1].index(s))
            mbarrier.expect(v_ready.index(s), v_desc[0].block_type.nbytes
                            + v_desc[1].block_type.nbytes)
            _tma_load(v_desc[0], [j * W, 0], v_ready.index(s), v_smem[0].index(s))
            _tma_load(v_desc[1], [j * W + Bc, 0], v_ready.index(s), v_smem[1].index(s))""")
    for indent in ("            ", "                "):  # a program per Q tile; persistent
        for name, t in (("k_desc", "K"), ("v_desc", "V")):
            s_ = t.lower()
            old = re.search(rf"^{indent}{name} = _descriptor\({t} \+ b \* stride_{s_}b \+ h_kv "
                            rf"\* stride_{s_}h, Nk, stride_{s_}n, Bc,\n\s+HEAD_DIM\)\n", s,
                            re.MULTILINE)
            if old is None:
                raise RuntimeError(f"fa3.py changed: no {name} descriptor at this indent")
            base = f"{t} + b * stride_{s_}b + h_kv * stride_{s_}h"
            swap(old.group(0),
                 f"{indent}{name} = (_descriptor({base}, Nk, stride_{s_}n, Bc, HEAD_DIM),\n"
                 f"{indent}          _descriptor({base}, Nk, stride_{s_}n, _X, HEAD_DIM))\n")
    # the counts of tiles: Bc + _X keys a tile
    swap("gl.cdiv(gl.minimum(Nk, first + _M), Bc)))",
         "gl.cdiv(gl.minimum(Nk, first + _M), Bc + _X)))")
    swap("        return gl.cdiv(seen, Bc)\n", "        return gl.cdiv(seen, Bc + _X)\n")
    swap("""        num_full = Nk // Bc
        if IS_CAUSAL:
            num_full = gl.minimum(num_full, (first + 1) // Bc)""",
         """        num_full = Nk // (Bc + _X)
        if IS_CAUSAL:
            num_full = gl.minimum(num_full, (first + 1) // (Bc + _X))""")
    # a box's scores: its columns start c0 keys into a tile of W keys
    swap("""    def _scores(S_ij, j, rows, Nk, masked, Bc: gl.constexpr, IS_CAUSAL: gl.constexpr,
                layout: gl.constexpr):""",
         """    def _scores(S_ij, j, rows, Nk, masked, Bc: gl.constexpr, IS_CAUSAL: gl.constexpr,
                layout: gl.constexpr, c0: gl.constexpr = 0, W: gl.constexpr = 0):""")
    swap("            cols = j * Bc + gl.arange(0, Bc, gl.SliceLayout(0, layout))\n"
         "            if IS_CAUSAL:",
         "            cols = j * W + c0 + gl.arange(0, Bc, gl.SliceLayout(0, layout))\n"
         "            if IS_CAUSAL:")
    swap("""        k_smem = gl.allocate_shared_memory(dtype, [STAGES, Bc, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, Bc, HEAD_DIM], kv_layout)""",
         """        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_X, HEAD_DIM], dtype)
        k_smem = (gl.allocate_shared_memory(dtype, [STAGES, Bc, HEAD_DIM], kv_layout),
                  gl.allocate_shared_memory(dtype, [STAGES, _X, HEAD_DIM], x_layout))
        v_smem = (gl.allocate_shared_memory(dtype, [STAGES, Bc, HEAD_DIM], kv_layout),
                  gl.allocate_shared_memory(dtype, [STAGES, _X, HEAD_DIM], x_layout))""")
    start = ("        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, q_empty"
             " = shared\n        O, L, stride_on, row0")
    end = "        # O_i / l_i and L_i = m_i + log2(l_i), base 2; every row saw key 0, so l_i > 0"
    if s.count(start) != 1 or s.count(end) != 1:
        raise RuntimeError("fa3.py changed: _consume_tile's body is not where it was")
    s = s[:s.index(start)] + CONSUMER_BODY + s[s.index(end):]
    swap("    return (Q_BUFFERS * CONSUMERS * M + STAGES * 2 * 128) * d * itemsize",
         f"    return (Q_BUFFERS * CONSUMERS * M + STAGES * 2 * (128 + {extra})) * d * itemsize")
    return s


# _consume_tile's body for two boxes a tile: fa3.py's loop with every product, score and
# softmax sum taken over both boxes (the rows' layouts of the two products are converted)
CONSUMER_BODY = """\
        q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, turns, q_empty = shared
        O, L, stride_on, row0, lse_row0, Nq, Nk, qk_scale, num_tiles, o_desc, b, h = out
        gl.static_assert(not DROPOUT)
        W: gl.constexpr = Bc + _X
        k_a, k_b = k_smem
        v_a, v_b = v_smem
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, Bc, 16])
        x_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _X, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        xrow_layout: gl.constexpr = gl.SliceLayout(1, x_layout)
        dtype: gl.constexpr = q_smem.dtype
        first = row0 + WG * _M
        rows = first + gl.arange(0, _M, row_layout)
        rows_x = first + gl.arange(0, _M, xrow_layout)
        Q_i = q_smem.index(qb * CONSUMERS + WG)
        own = _own_tiles(first, num_tiles, Nq, Nk, Bc, IS_CAUSAL)
        num_full = _unmasked(first, Nk, Bc, IS_CAUSAL)
        zero = gl.zeros([_M, Bc], gl.float32, s_layout)
        zero_x = gl.zeros([_M, _X], gl.float32, x_layout)
        O_i = gl.zeros([_M, HEAD_DIM], gl.float32, o_layout)

        s0 = kv0 % STAGES
        mbarrier.wait(k_ready.index(s0), (kv0 // STAGES) & 1)
        _turn(turns, WG, turn0, PINGPONG)
        S_a = warpgroup_mma(Q_i, k_a.index(s0).permute((1, 0)), zero, use_acc=False,
                            is_async=True)
        S_b = warpgroup_mma(Q_i, k_b.index(s0).permute((1, 0)), zero_x, use_acc=False,
                            is_async=True)
        _pass(turns, WG, CONSUMERS, PINGPONG)
        S_a, S_b = warpgroup_mma_wait(0, deps=(S_a, S_b))
        S_a = _scores(S_a, 0, rows, Nk, num_full == 0, Bc, IS_CAUSAL, s_layout, 0, W)
        S_b = _scores(S_b, 0, rows_x, Nk, num_full == 0, _X, IS_CAUSAL, x_layout, Bc, W)
        m_i = gl.maximum(gl.max(S_a, axis=1),
                         gl.convert_layout(gl.max(S_b, axis=1), row_layout)) * qk_scale
        P_a = gl.exp2(S_a * qk_scale - m_i[:, None])
        P_b = gl.exp2(S_b * qk_scale - gl.convert_layout(m_i, xrow_layout)[:, None])
        l_i = gl.sum(P_a, axis=1) + gl.convert_layout(gl.sum(P_b, axis=1), row_layout)
        P_a = gl.convert_layout(P_a.to(dtype), p_layout)
        P_b = gl.convert_layout(P_b.to(dtype), p_layout)

        for j in range(1, own):
            s = (kv0 + j) % STAGES
            phase = ((kv0 + j) // STAGES) & 1
            prev = (kv0 + j - 1) % STAGES
            prev_phase = ((kv0 + j - 1) // STAGES) & 1
            mbarrier.wait(k_ready.index(s), phase)
            mbarrier.wait(v_ready.index(prev), prev_phase)
            _turn(turns, WG, turn0 + j, PINGPONG)
            S_a = warpgroup_mma(Q_i, k_a.index(s).permute((1, 0)), zero, use_acc=False,
                                is_async=True)
            S_b = warpgroup_mma(Q_i, k_b.index(s).permute((1, 0)), zero_x, use_acc=False,
                                is_async=True)
            O_i = warpgroup_mma(P_a, v_a.index(prev), O_i, is_async=True)
            O_i = warpgroup_mma(P_b, v_b.index(prev), O_i, is_async=True)
            _pass(turns, WG, CONSUMERS, PINGPONG)
            if OVERLAP:  # both parts of S_ij (issued first); the two P V products run on
                S_a, S_b = warpgroup_mma_wait(2, deps=(S_a, S_b))
            else:
                S_a, S_b, O_i = warpgroup_mma_wait(0, deps=(S_a, S_b, O_i))
            S_a = _scores(S_a, j, rows, Nk, j >= num_full, Bc, IS_CAUSAL, s_layout, 0, W)
            S_b = _scores(S_b, j, rows_x, Nk, j >= num_full, _X, IS_CAUSAL, x_layout, Bc, W)
            m_new = gl.maximum(m_i, gl.maximum(
                gl.max(S_a, axis=1), gl.convert_layout(gl.max(S_b, axis=1), row_layout))
                * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            P_a = gl.exp2(S_a * qk_scale - m_new[:, None])
            P_b = gl.exp2(S_b * qk_scale - gl.convert_layout(m_new, xrow_layout)[:, None])
            l_i = l_i * alpha + gl.sum(P_a, axis=1) + gl.convert_layout(gl.sum(P_b, axis=1),
                                                                         row_layout)
            m_i = m_new
            if OVERLAP:
                O_i = warpgroup_mma_wait(0, deps=(O_i,))
            mbarrier.arrive(kv_empty.index(prev), count=1)
            O_i = O_i * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            P_a = gl.convert_layout(P_a.to(dtype), p_layout)
            P_b = gl.convert_layout(P_b.to(dtype), p_layout)

        if PERSISTENT and not TMA_STORE:
            mbarrier.arrive(q_empty.index(qb), count=1)
        last = (kv0 + own - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((kv0 + own - 1) // STAGES) & 1)
        _turn(turns, WG, turn0 + own, PINGPONG)
        O_i = warpgroup_mma(P_a, v_a.index(last), O_i, is_async=True)
        O_i = warpgroup_mma(P_b, v_b.index(last), O_i, is_async=True)
        _pass(turns, WG, CONSUMERS, PINGPONG)
        O_i = warpgroup_mma_wait(0, deps=(O_i,))
        mbarrier.arrive(kv_empty.index(last), count=1)
        _release(shared, kv0, turn0, own, num_tiles, WG, CONSUMERS, STAGES, PINGPONG)

"""


def load_variant(extra: int):
    """The variant as the module ``flashedu.triton.fa3_wide<extra>`` (a file: Triton reads its
    kernels' source), importing what fa3.py imports relative to flashedu.triton."""
    import flashedu.triton  # noqa: F401  (the package its relative imports resolve in)

    folder = tempfile.mkdtemp(prefix="fa3_wide")
    name = f"fa3_wide{extra}"
    path = os.path.join(folder, f"{name}.py")
    with open(path, "w") as f:
        f.write(variant_source(extra))
    spec = importlib.util.spec_from_file_location(f"flashedu.triton.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compile_report(extra: int, regs: int) -> dict:
    """The variant compiled for sm_90 here (dense, persistent, ping-pong, O_i by the copy
    engine, as the d = 128 table runs): resources, the products and their waits, and
    ptxas's advisories (``compile_fa3_backward``'s tools)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ["TRITON_INTERPRET"] = "0"  # compiled, not emulated, with or without a GPU
    import flashedu  # noqa: F401  (before triton, as everywhere)
    import triton
    from compile_fa3_backward import compile_for_sm90, usage

    kernel = load_variant(extra).fa3_forward_kernel
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "L": "*fp32"}
    floats = {"qk_scale": "fp32", "keep_scale": "fp32"}
    consts = dict(HEAD_DIM=128, Bc=MAIN_BOX, STAGES=STAGES, CONSUMERS=2, IS_CAUSAL=False,
                  PINGPONG=True, OVERLAP=True, LONGEST_FIRST=True, CONSUMER_REGS=regs,
                  PERSISTENT=True, DROPOUT=False, TMA_STORE=True, Q_BUFFERS=1)
    compiled = compile_for_sm90(kernel, consts, pointers, floats)
    line, counts = usage(compiled, f"/tmp/fa3_wide_{extra}.sass")
    with open(f"/tmp/fa3_wide_{extra}.sass") as f:
        sass = f.read()
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    ptxas = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", f.name, "-o",
                            os.devnull], capture_output=True, text=True)
    return {"extra": extra, "regs": regs, "resources": line, "counts": counts,
            "products": sorted(set(re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass))),
            "waits": len(re.findall(r"WARPGROUP\.DEPBAR", sass)),
            "advisories": [l.split("info    : ")[-1] for l in ptxas.stderr.splitlines()
                           + ptxas.stdout.splitlines() if "C7512" in l]}


def gpu_run(extras: list, regs: int, rounds: int) -> dict:
    """Each variant's answers against SDPA, then the forwards timed in turn
    (``interleaved_ms``)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashedu.benchmarks import core
    from flashedu.triton import fa3
    from flashedu.triton.autograd import resolve_config

    os.environ[fa3.SWITCH_ENV] = "1"
    variants = {extra: load_variant(extra) for extra in extras}
    d = 128
    config = resolve_config(d, torch.bfloat16, None, torch.device("cuda"))
    out = {"extras": extras, "regs": regs, "stages": STAGES,
           "device": torch.cuda.get_device_name(), "rows": []}

    def forward(module, q, k, v, settings):
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        module.forward(q, k, v, o, lse, is_causal=False, scale=d ** -0.5, **settings)
        return o

    torch.manual_seed(0)
    table = config.fa3_settings(16384, 16384)
    for N, H, persistent in ((1000, 4, True), (4096 + 77, 2, True), (777, 3, False),
                             (16384, 2, True)):
        q, k, v = (torch.randn(1, H, N, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        settings = {**table, "STAGES": STAGES, "CONSUMER_REGS": regs, "PERSISTENT": persistent}
        for extra, module in variants.items():
            err = (forward(module, q, k, v, settings).float() - want).abs().max().item()
            print(f"128+{extra}, N={N} H={H} persistent={persistent}: max error {err:.1e}",
                  flush=True)
            out["rows"].append({"check": True, "extra": extra, "N": N, "H": H,
                                "persistent": persistent, "err": err})
            if err > 2e-2:
                raise SystemExit(f"128+{extra}: the answer is wrong at N={N}: {err}")
    for N in (4096, 8192, 16384):
        B, H = core.batch_heads(N, d)
        g = torch.Generator(device="cuda").manual_seed(N)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        table = config.fa3_settings(N, N)
        o = torch.empty_like(q)
        lse = torch.empty(B, H, N, dtype=torch.float32, device="cuda")

        def run(module, settings):
            return lambda: module.forward(q, k, v, o, lse, is_causal=False, scale=d ** -0.5,
                                          **settings)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)
        timed = {"fa3": (run(fa3, table), {})}
        for extra, module in variants.items():
            timed[f"128+{extra}"] = (run(module, {**table, "STAGES": STAGES,
                                                  "CONSUMER_REGS": regs}), {})
        timed.update({"fa3 2 stages": (run(fa3, {**table, "STAGES": 2}), {}),
                      "sdpa-cudnn": (cudnn, {})})
        ms, samples = core.interleaved_ms(timed, rounds)
        flops = core.attention_flops(B, H, N, N, d)
        tflops = {name: core.tflops(flops, t) for name, t in ms.items()}
        print(f"N={N}: " + ", ".join(f"{n} {t:.0f}" for n, t in tflops.items()) + " TFLOP/s",
              flush=True)
        out["rows"].append({"N": N, "B": B, "H": H, "ms": ms, "samples": samples,
                            "tflops": tflops})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile", type=int, nargs="+", metavar="EXTRA",
                   help="compile for sm_90 here with these second boxes (no GPU needed)")
    p.add_argument("--extra", type=int, nargs="+", default=[32], choices=(16, 32, 64),
                   help="keys of a tile's second box, a variant each (on a GPU)")
    p.add_argument("--regs", type=int, default=240, help="registers a consumer thread")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.compile:
        out = [compile_report(extra, args.regs) for extra in args.compile]
        for r in out:
            print(json.dumps(r))
    else:
        import torch

        if not torch.cuda.is_available():
            print("fa3_wide_tiles.py: needs a CUDA GPU (or --compile)", file=sys.stderr)
            return 1
        out = gpu_run(args.extra, args.regs, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
