"""On a GPU, in one run: forward variants against the peers, the
forward before/after over N x d x causal x dtype, the causal backward's configs, a causal
BlockMask against is_causal, and torch.compile through the kernels. Prints tables, writes JSON.

    GIT_COMMIT=<sha> flashedu bench forward --prev .prev/forward_prev.py --json bench-out/fwd.json \\
        [--only sparse_tma ...]

``--prev`` is the forward.py of an earlier commit, to compare with (carried beside the tree:
the device copy has no git), loaded as a module so that both run in one process. Shapes as
``flashedu bench``: B * N = 16384, H * d = 2048; TFLOPs = 4 B H N^2 d / t (/2 causal).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import torch

import flashedu
from flashedu.benchmarks import peers as providers
from flashedu.ops import Call
from flashedu.triton import launch
from flashedu.triton.config import Tiles, kernel_config
from flashedu.triton.launch import backward, forward

from . import core
from .core import flops, rel_err
from .core import standard_inputs as inputs
from .core import tiles_name as name

STEPS = ("compile", "peers", "variants", "dims", "causal_bwd", "causal_mask", "regress",
         "sparse_tma", "sparse_variants", "sparse_ws")


def t(fn):
    """Median ms of do_bench over 80 ms of runs (the tables compare variants a few per cent
    apart), or inf for a variant that cannot run."""
    return core.try_time_ms(fn, warmup=20, rep=80)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def load_prev(path):
    """The host forward of an earlier forward.py: its own ``forward``, from before the host
    side moved to launch.py; else this launch.py's, with that file's kernel and arguments."""
    prev = _load(path, "flashedu.triton._prev_forward")
    if hasattr(prev, "forward"):
        return prev.forward
    host = _load(launch.__file__, "flashedu.triton._prev_launch")
    host.fwd = prev  # launch.py looks its kernel up in ``fwd`` at each call
    return host.forward


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "flashedu.triton"
    spec.loader.exec_module(mod)
    return mod


class Log:
    def __init__(self, argv):
        self.out = {**core.environment(["forward", *argv]), "rows": []}

    def rec(self, group, label, ms, fl, **extra):
        row = {"group": group, "label": label, "ms": ms, "tflops": fl / ms / 1e9, **extra}
        self.out["rows"].append(row)
        print(f"{group:<16}{label:<46}{ms:8.3f} ms {row['tflops']:7.1f} TF "
              + " ".join(f"{k}={v}" for k, v in extra.items()), flush=True)
        return row


def peers(log, n, d, causal, tag):
    q, k, v, _ = inputs(n, d)
    case = providers.Case(n, d, causal, "fwd", None, "bfloat16")
    for p in ("sdpa-cudnn", "flex"):
        log.rec("peer", f"{tag} {p} N={n} d={d} causal={causal}",
                t(providers.make_forward(p, case, q, k, v)), flops(n, d, causal))


def forward_variants(log, prev_forward):
    """N=8192, d=128, non-causal: the previous kernel, the new step, then TMA / warp spec."""
    n, d = 8192, 128
    q, k, v, _ = inputs(n, d)
    s = d ** -0.5
    fl = flops(n, d)
    base = Tiles(128, 128, 8, 3)

    def run(tiles, fwd=forward, causal=False):
        return lambda: fwd(q, k, v, is_causal=causal, scale=s, block_mask=None, tiles=tiles,
                           interpreted=False)

    ref = run(base, prev_forward)()[0]
    for rep in (1, 2):
        log.rec("fwd prev", f"{name(base)} run{rep}", t(run(base, prev_forward)), fl)
    variants = [base, base,
                dataclasses.replace(base, num_stages=4), dataclasses.replace(base, num_stages=2)]
    # (speed_h100_variants.json also has a host-made 4-D descriptor variant, "tma1", since
    # removed; its "tma2" labels are today's tma=True)
    variants += [dataclasses.replace(base, tma=True, num_stages=st) for st in (2, 3, 4)]
    variants += [dataclasses.replace(base, warp_specialize=True, num_warps=w, num_stages=st,
                                     tma=m) for m in (False, True)
                 for w, st in ((4, 2), (8, 2), (8, 3))]
    variants += [Tiles(128, 64, 8, 3), Tiles(128, 64, 4, 3), Tiles(128, 64, 4, 3, tma=True)]
    best, best_ms = base, float("inf")
    for x in variants:
        try:
            err = rel_err(run(x)()[0], ref)
        except Exception as exc:  # noqa: BLE001
            print("   failed:", name(x), type(exc).__name__, str(exc).splitlines()[0][:160],
                  flush=True)
            log.rec("fwd variant", name(x), float("inf"), fl, error=type(exc).__name__)
            continue
        ms = log.rec("fwd variant", name(x), t(run(x)), fl, rel_diff_vs_prev=f"{err:.1e}")["ms"]
        if err < 1e-2 and ms < best_ms:
            best, best_ms = x, ms
    log.out["best_fwd_d128"] = {"tiles": name(best), "ms": best_ms}
    print("best d=128 forward:", name(best), flush=True)
    log.rec("fwd best", f"{name(best)} again", t(run(best)), fl)
    for causal in (True,):
        f = flops(n, d, causal)
        log.rec("fwd causal", f"prev {name(base)}", t(run(base, prev_forward, causal)), f)
        log.rec("fwd causal", f"new {name(base)}", t(run(base, causal=causal)), f)
        log.rec("fwd causal", f"new {name(best)}", t(run(best, causal=causal)), f)
    return best


def head_dims(log, prev_forward):
    """d=64 and d=256 (untuned until now): previous kernel, new step, a few tiles each."""
    cands = {64: [Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 3, tma=True),
                  Tiles(128, 128, 8, 3), Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 2)],
             256: [Tiles(128, 32, 8, 2), Tiles(128, 64, 8, 2), Tiles(64, 64, 4, 2),
                   Tiles(64, 32, 4, 3), Tiles(128, 64, 8, 2, tma=True),
                   Tiles(64, 64, 4, 2, tma=True)]}
    best = {}
    for d, tiles in cands.items():
        q, k, v, _ = inputs(8192, d)
        s = d ** -0.5
        old = kernel_config(d, False, False).forward
        ref = prev_forward(q, k, v, is_causal=False, scale=s, block_mask=None, tiles=old,
                           interpreted=False)[0]
        log.rec(f"fwd d={d}", f"prev {name(old)}", t(lambda: prev_forward(
            q, k, v, is_causal=False, scale=s, block_mask=None, tiles=old, interpreted=False)),
            flops(8192, d))
        best[d] = (old, float("inf"))
        for x in tiles:
            fn = lambda x=x: forward(q, k, v, Call(False, s),  # noqa: E731
                                     tiles=x, interpreted=False)
            try:
                err = rel_err(fn()[0], ref)
            except Exception as exc:  # noqa: BLE001
                log.rec(f"fwd d={d}", name(x), float("inf"), flops(8192, d),
                        error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                continue
            ms = log.rec(f"fwd d={d}", name(x), t(fn), flops(8192, d),
                         rel_diff_vs_prev=f"{err:.1e}")["ms"]
            if err < 1e-2 and ms < best[d][1]:
                best[d] = (x, ms)
        print(f"best d={d} forward:", name(best[d][0]), flush=True)
    log.out["best_fwd"] = {d: name(b[0]) for d, b in best.items()}
    return {d: b[0] for d, b in best.items()}


def regress_forward(log, prev_forward, tiles_for):
    """Previous vs new forward kernel, same tiles (the shipped ones), every size and dtype."""
    for dname, dtype in DTYPES.items():
        for d in (64, 128, 256):
            for n in (1024, 4096, 16384):
                q, k, v, _ = inputs(n, d, dtype=dtype)
                s = d ** -0.5
                old = kernel_config(d, False, False).forward
                new = tiles_for.get(d, old)
                for causal in (False, True):
                    a = t(lambda: prev_forward(q, k, v, is_causal=causal, scale=s,
                                               block_mask=None, tiles=old, interpreted=False))
                    b = t(lambda: forward(q, k, v, Call(causal, s),
                                          tiles=new, interpreted=False))
                    log.rec("fwd regress", f"{dname} N={n} d={d} causal={causal}", b,
                            flops(n, d, causal), prev_ms=round(a, 4), speedup=round(a / b, 3))


def causal_backward(log):
    """d=128 causal backward (from saved O, L): the shipped two launches vs the fused one."""
    n, d = 8192, 128
    q, k, v, do = inputs(n, d)
    s = d ** -0.5
    shipped = kernel_config(d, False, False)
    o, L = forward(q, k, v, Call(True, s), tiles=shipped.forward,
                   interpreted=False)
    two = shipped.causal_backward
    cands = {"two launches s3 (shipped)": two,
             "two launches s2": dataclasses.replace(
                 two, dkdv=dataclasses.replace(two.dkdv, num_stages=2),
                 dq=dataclasses.replace(two.dq, num_stages=2)),
             "fused s2": dataclasses.replace(shipped, causal_backward=None),
             "two launches dkdv 128x128 w8 s2": dataclasses.replace(
                 two, dkdv=Tiles(128, 128, 8, 2)),
             "two launches dkdv 64x128 w8 s2, dq 64x64 w4 s3": dataclasses.replace(
                 two, dkdv=Tiles(64, 128, 8, 2), dq=Tiles(64, 64, 4, 3))}
    fl = 2.5 * flops(n, d, True)
    ref = None
    best, best_ms = None, float("inf")
    for label, cfg in cands.items():
        cfg = dataclasses.replace(cfg, causal_backward=None)

        def fn(cfg=cfg):
            return backward(q, k, v, o, L, do, Call(True, s),
                            config=cfg, interpreted=False)
        got = fn()
        ref = ref if ref is not None else got
        err = max(rel_err(a, b) for a, b in zip(got, ref))
        ms = log.rec("bwd causal", label, t(fn), fl, rel_diff=f"{err:.1e}")["ms"]
        if ms < best_ms:
            best, best_ms = label, ms
    log.out["best_causal_bwd_d128"] = best


def causal_block_mask(log):
    """BlockMask.causal through the sparse path vs is_causal through the dense one."""
    n, d = 8192, 128
    q, k, v, do = inputs(n, d)
    for x in (q, k, v):
        x.requires_grad_(True)
    mask = flashedu.BlockMask.causal((n, n), (128, 128))
    f = flops(n, d, True)
    for label, kw in (("is_causal (dense path)", {"is_causal": True}),
                      ("BlockMask.causal (sparse path)", {"block_mask": mask})):
        fwd = lambda kw=kw: flashedu.attention(q, k, v, backend="triton", **kw)  # noqa: E731
        out = fwd()
        out.backward(do, retain_graph=True)
        log.rec("causal mask", f"fwd {label}", t(fwd), f)
        log.rec("causal mask", f"bwd {label}", t(lambda out=out: out.backward(
            do, retain_graph=True)), 2.5 * f)


def sparse_tma(log):
    """Block-sparse forward: K/V tiles through pointers vs through TMA descriptors."""
    for d in (64, 128):
        q, k, v, _ = inputs(8192, d)
        shipped = kernel_config(d, False, False).forward
        for density in (0.1, 0.5):
            mask = providers.random_block_mask(8192, density)
            for tma in (False, True, False, True):
                tiles = dataclasses.replace(shipped, tma=tma, warp_specialize=False)
                log.rec("sparse fwd", f"d={d} density={density} {name(tiles)}", t(
                    lambda tiles=tiles: forward(q, k, v, Call(False, d ** -0.5, mask),
                                                tiles=tiles,
                                                interpreted=False)), flops(8192, d) * density)


def sparse_variants(log):
    """Block-sparse forward, d=128: tiles and stages other than the dense loop's (pointer loads;
    each twice, since the differences sought are a few per cent)."""
    d = 128
    q, k, v, _ = inputs(8192, d)
    cands = [Tiles(128, 128, 8, 3), Tiles(128, 128, 8, 2), Tiles(128, 64, 8, 3),
             Tiles(128, 64, 8, 4), Tiles(64, 128, 4, 3), Tiles(64, 128, 8, 3),
             Tiles(64, 64, 4, 3)]
    for density in (0.1, 0.5):
        mask = providers.random_block_mask(8192, density)
        for rep in (1, 2):
            for tiles in cands:
                log.rec("sparse tiles", f"density={density} {name(tiles)} run{rep}", t(
                    lambda tiles=tiles: forward(q, k, v, Call(False, d ** -0.5, mask),
                                                tiles=tiles,
                                                interpreted=False)), flops(8192, d) * density)


def sparse_ws(log):
    """Block-sparse forward, d=128: pointer loads (shipped) vs TMA + warp specialization."""
    d = 128
    q, k, v, _ = inputs(8192, d)
    shipped = kernel_config(d, False, False)
    for density in (0.1, 0.25, 0.5):
        mask = providers.random_block_mask(8192, density)
        plain = shipped.forward_tiles(mask, k.shape[2])
        ref = forward(q, k, v, Call(False, d ** -0.5, mask), tiles=plain,
                      interpreted=False)[0]
        for rep in (1, 2):
            for tiles in (plain, dataclasses.replace(plain, tma=True, warp_specialize=True)):
                fn = lambda tiles=tiles: forward(q, k, v, Call(False, d ** -0.5, mask),  # noqa: E731
                                                 tiles=tiles,
                                                 interpreted=False)
                log.rec("sparse ws", f"density={density} {name(tiles)} run{rep}", t(fn),
                        flops(8192, d) * density, rel_diff=f"{rel_err(fn()[0], ref):.1e}")


def compile_check(log):
    """torch.compile over flashedu.attention, forward and backward, against eager."""
    q, k, v, do = inputs(2048, 64)
    for x in (q, k, v):
        x.requires_grad_(True)

    def f(q, k, v):
        return flashedu.attention(q, k, v, is_causal=True, backend="triton")
    result = {}
    try:
        out = torch.compile(f)(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), do)
        ref = f(q, k, v)
        ref_grads = torch.autograd.grad(ref, (q, k, v), do)
        result = {"ok": True, "max_rel_diff": max(
            rel_err(a, b) for a, b in zip((out, *grads), (ref, *ref_grads)))}
    except Exception as exc:  # noqa: BLE001 - the finding is the error
        result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    log.out["torch_compile"] = result
    print("torch.compile:", result, flush=True)


def parse_args(argv):
    p = core.parser("forward", __doc__)
    p.add_argument("--prev", type=core.existing_file, required=True,
                   help="an earlier commit's flashedu/triton/forward.py")
    p.add_argument("--json", type=core.output_file)
    p.add_argument("--skip", nargs="*", default=[], choices=STEPS)
    p.add_argument("--only", nargs="*", choices=STEPS, help="run these steps only")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not core.gpu_available():
        return core.needs_gpu("flashedu bench forward")
    log = Log(argv)
    prev_forward = load_prev(args.prev)
    best128 = Tiles(128, 128, 8, 3)
    best = {}
    try:
        for step in args.only or STEPS:
            if step in args.skip:
                continue
            if step == "compile":
                compile_check(log)
            elif step == "peers":
                peers(log, 8192, 128, False, "start")
                peers(log, 8192, 128, True, "start")
                peers(log, 8192, 64, False, "start")
            elif step == "variants":
                best128 = forward_variants(log, prev_forward)
                peers(log, 8192, 128, False, "after variants")
            elif step == "dims":
                best = head_dims(log, prev_forward)
            elif step == "causal_bwd":
                causal_backward(log)
            elif step == "causal_mask":
                causal_block_mask(log)
            elif step == "sparse_ws":
                sparse_ws(log)
            elif step == "sparse_variants":
                sparse_variants(log)
            elif step == "sparse_tma":
                sparse_tma(log)
            elif step == "regress":
                regress_forward(log, prev_forward, {128: best128, **best})
    finally:
        if args.json:
            core.write_json(args.json, log.out)
    return 0
