"""Reproduce the FlashAttention paper's evidence on this GPU, with the GPU's own byte counters.

    flashedu bench paper --out DIR                 # full run (~5 min, H100)
    flashedu bench paper --out DIR --quick         # smaller sizes (~2 min)
    flashedu bench paper --out DIR --cpu-dry-run   # the pipeline on CPU, fake ncu

What it measures (each provider in its own try, so one failure is reported, not fatal):
  fig2    the paper's Fig. 2 (left) setting, GPT-2 medium attention: B=64, H=16, N=1024, d=64,
          fp16, forward + backward, no mask, no dropout. Per provider (naive torch, flashedu's
          Triton kernels, SDPA-flash): matmul GFLOPs (counted, see `matmul_count`), HBM bytes
          read + written (Nsight Compute dram__bytes_read.sum + dram__bytes_write.sum over every
          kernel of exactly one fwd+bwd), runtime (do_bench median), beside the paper's A100
          numbers and the IO model's prediction.
  sweep   Fig. 2 (middle): the Triton forward's HBM bytes (ncu) and runtime against Br (Bc fixed)
          and Bc (Br fixed), beside the model.
  memory  Fig. 3 (right): peak memory over the inputs against N (1K..64K), B=1, H=16, d=64,
          fp16, forward and forward + backward, until a provider runs out of memory.
  claims  popular claims, as a summary of the paper ("Flash Attention Mechanics: How Tiled
          Attention Fits in SRAM") states them: 33x / 129x less HBM traffic at 4K / 16K, 9x less
          memory at 4K, a 1.0 GB score matrix at 4K with 32 heads fp16; each given a verdict.
          (`seed` is accepted as the old name of this part, as in recorded commands.)

ncu runs this benchmark again as a child (``python -m flashedu.bench paper --ncu-child``) once per measured case: the child warms
up (compiles), then brackets one call with torch.cuda.profiler.start()/stop(), and ncu
(``--profile-from-start off``) profiles only the kernels inside. ncu's default cache control
flushes the caches before each kernel, so every kernel's DRAM bytes are counted from cold.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io as _io
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import flashedu  # noqa: F401  (first: it decides whether Triton is interpreted)
from flashedu import io

from . import core

# The checkout this package lives in: the ncu children import the same tree.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = [sys.executable, "-m", "flashedu.bench", "paper"]

PROVIDERS = ("naive", "flashedu", "sdpa-flash")
NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")

# The paper's Figure 2 (left), A100 40GB, GPT-2 medium attention, forward + backward.
PAPER_FIG2 = {
    "source": "Dao et al., FlashAttention (arXiv:2205.14135), Figure 2 left",
    "setting": "A100, GPT-2 medium: N=1024, d=64, 16 heads, batch 64, forward + backward",
    "standard": {"gflops": 66.6, "hbm_gb": 40.3, "ms": 41.7},
    "flash": {"gflops": 75.2, "hbm_gb": 4.4, "ms": 7.3},
}


@dataclass(frozen=True)
class Shape:
    B: int
    H: int
    N: int
    d: int
    dtype: str = "float16"

    @property
    def heads(self) -> int:
        return self.B * self.H

    @property
    def itemsize(self) -> int:
        return io.itemsize_of(self.dtype)


@dataclass(frozen=True)
class Plan:
    """Every size the run uses; `plan_for` makes the full, quick and CPU dry-run plans."""
    fig2: Shape
    sweep: Shape
    sweep_br: tuple  # Br values with Bc = sweep_fixed[1]
    sweep_bc: tuple  # Bc values with Br = sweep_fixed[0]
    sweep_fixed: tuple
    memory_ns: tuple
    memory: Shape  # N is replaced by each of memory_ns
    claims_ns: tuple
    claims_ncu: Shape  # N replaced; H small: the claimed ratios are per head
    claims_mem: Shape  # the claim's own setting: 32 heads, d=128, fp16, N=4096


def plan_for(quick: bool, dry: bool) -> Plan:
    if dry:  # tiny sizes: the Triton interpreter and CPU torch run them in seconds
        return Plan(Shape(1, 2, 32, 16), Shape(1, 1, 32, 16), (16, 32), (16, 32), (32, 16),
                    (32, 64), Shape(1, 1, 0, 16), (64, 128), Shape(1, 1, 0, 16),
                    Shape(1, 2, 64, 16))
    mem_ns = tuple(1024 * 2**i for i in range(5 if quick else 7))  # 1K .. 16K or 64K
    return Plan(
        fig2=Shape(16 if quick else 64, 16, 1024, 64),
        sweep=Shape(16 if quick else 64, 16, 1024, 64),
        sweep_br=(64, 128) if quick else (16, 32, 64, 128, 256),
        sweep_bc=(32, 64, 128) if quick else (16, 32, 64, 128, 256),
        sweep_fixed=(128, 64),
        memory_ns=mem_ns, memory=Shape(1, 16, 0, 64),
        claims_ns=(4096,) if quick else (4096, 16384),
        claims_ncu=Shape(1, 4, 0, 128), claims_mem=Shape(1, 32, 4096, 128))


def with_n(shape: Shape, N: int) -> Shape:
    return Shape(shape.B, shape.H, N, shape.d, shape.dtype)


# ----------------------------------------------------------------------------------------
# The model: counts of FLOPs and HBM bytes (pure arithmetic; the notebook imports these)
# ----------------------------------------------------------------------------------------

# Matrix products of N x N x d (2 N^2 d FLOPs each) that each implementation performs per head:
# standard forward QK^T, PV; standard backward dV=P^T dO, dP=dO V^T, dQ=dS K, dK=dS^T Q.
# FlashAttention-2 (SDPA-flash) recomputes S=QK^T in its single backward pass (5 products);
# flashedu's backward has two passes (dK/dV, then dQ) that each recompute S and dP (7).
MATMUL_COUNT = {"naive": (2, 4), "sdpa-flash": (2, 5), "flashedu": (2, 7)}


def matmul_gflops(provider: str, shape: Shape, backward: bool = True) -> float:
    fwd, bwd = MATMUL_COUNT[provider]
    products = fwd + (bwd if backward else 0)
    return products * 2 * shape.N * shape.N * shape.d * shape.heads / 1e9


def standard_bytes(shape: Shape, backward: bool = True) -> int:
    """The paper's Algorithm 0 (forward: 4 N^2 + 4 N d elements) plus Algorithm 3 (backward:
    read P, dO -> dV; dO, V -> dP; P, dP -> dS; dS, K -> dQ; dS, Q -> dK: 7 N^2 + 8 N d)."""
    N, d = shape.N, shape.d
    elements = io.standard_attention_hbm_elements(N, d)
    if backward:
        elements += 7 * N * N + 8 * N * d
    return elements * shape.itemsize * shape.heads


def minimum_bytes(shape: Shape, backward: bool = True) -> int:
    """Any exact attention: read Q, K, V, write O; backward read Q, K, V, O, dO, write dQ, dK, dV."""
    elements = io.flash_min_hbm_elements(shape.N, shape.d) + (8 * shape.N * shape.d if backward else 0)
    return elements * shape.itemsize * shape.heads


def triton_forward_bytes(shape: Shape, Br: int, Bc: int) -> int:
    """flashedu's Triton forward: io.flash_forward_hbm_bytes (Q outer: Q once, K_j and V_j once
    per Q tile, O once) with the logsumexp L stored in float32, as the kernel does."""
    c = io.flash_forward_hbm_bytes(shape.N, shape.N, shape.d, Br, Bc, order="q_outer",
                                   itemsize=shape.itemsize)
    return (c["total"] + shape.N * (4 - shape.itemsize)) * shape.heads


def triton_backward_bytes(shape: Shape, dkdv_Bc: int, dq_Br: int) -> int:
    """flashedu's three backward kernels (flashedu/triton/backward.py), non-causal:
    preprocess reads O, dO and writes D; dK/dV reads K_j, V_j once and, per K/V tile, all of
    Q, dO, L, D, then writes dK, dV; dQ reads Q, dO, L, D once and K, V once per Q tile."""
    N, d, isz = shape.N, shape.d, shape.itemsize
    Tc, Tr = math.ceil(N / dkdv_Bc), math.ceil(N / dq_Br)
    pre = 2 * N * d * isz + N * 4
    dkdv = 2 * N * d * isz + Tc * (2 * N * d * isz + 2 * N * 4) + 2 * N * d * isz
    dq = 2 * N * d * isz + 2 * N * 4 + Tr * 2 * N * d * isz + N * d * isz
    return (pre + dkdv + dq) * shape.heads


def triton_config(shape: Shape):
    from flashedu.triton.config import kernel_config

    return kernel_config(shape.d, shape.dtype == "float32", interpreted=False)


def flashedu_bytes(shape: Shape, backward: bool = True) -> int:
    cfg = triton_config(shape)
    tiles = cfg.forward_tiles(None, shape.N)
    total = triton_forward_bytes(shape, tiles.Br, tiles.Bc)
    if backward:
        total += triton_backward_bytes(shape, cfg.dkdv.Bc, cfg.dq.Br)
    return total


def flashedu_l2_bytes(shape: Shape, backward: bool = True) -> int:
    """flashedu's Triton kernels when L2 serves every re-read: each kernel reads each tensor it
    needs from DRAM once and writes each output once.

    The two-level model above (HBM and SRAM) charges a K/V tile to HBM each time a Q-tile
    program loads it. A GPU has a third level, L2 (50 MB on the H100), shared by all SMs: the
    programs of one head run at about the same time and re-read the same K_j, V_j (256 KB per
    head at N=1024, d=64, fp16), so after the first load they hit in L2. The prediction is then
    the compulsory traffic of each kernel:
      forward     read Q, K, V; write O (and L, fp32)
      preprocess  read O, dO; write D (fp32)
      dK/dV       read Q, K, V, dO, L, D; write dK, dV
      dQ          read Q, K, V, dO, L, D; write dQ
    It holds while the heads in flight keep their working sets in L2 together."""
    nd = shape.N * shape.d * shape.itemsize  # one (N, d) tensor of one head, in bytes
    row = shape.N * 4                        # one fp32 value per row (L or D)
    total = 4 * nd + row                     # forward
    if backward:
        total += (2 * nd + row) + (6 * nd + 2 * row) + (5 * nd + 2 * row)
    return total * shape.heads


def sram_elements(gpu: str, itemsize: int) -> int:
    """M of the paper: one SM's usable shared memory, in elements of the input dtype."""
    return io.GPUS[gpu].smem_per_sm_kib * 1024 // itemsize


def paper_algorithm_bytes(shape: Shape, gpu: str) -> dict:
    """The paper's Algorithm 1 (forward) and Algorithm 4 (backward), K/V tiles outer, as the
    NumPy kernels implement them, with
    Br, Bc = io.paper_block_sizes(M, d) for M = the GPU's shared memory per SM."""
    M = sram_elements(gpu, shape.itemsize)
    Br, Bc = io.paper_block_sizes(M, shape.d)
    f = io.flash_forward_hbm_bytes(shape.N, shape.N, shape.d, Br, Bc, order="kv_outer",
                                   itemsize=shape.itemsize)["total"]
    b = io.flash_backward_hbm_bytes(shape.N, shape.N, shape.d, Br, Bc,
                                    itemsize=shape.itemsize)["total"]
    return {"gpu": gpu, "M_elements": M, "Br": Br, "Bc": Bc,
            "fwd_bytes": f * shape.heads, "fwdbwd_bytes": (f + b) * shape.heads,
            "theta_bytes": io.flash_hbm_elements_theta(shape.N, shape.d, M) * shape.itemsize
            * shape.heads}


def predicted_bytes(provider: str, shape: Shape, backward: bool = True):
    """The model's HBM bytes for what a provider runs; SDPA-flash only has the floor."""
    if provider == "naive":
        return standard_bytes(shape, backward)
    if provider == "flashedu":
        return flashedu_bytes(shape, backward)
    return None


# ----------------------------------------------------------------------------------------
# Nsight Compute: command line and CSV parsing
# ----------------------------------------------------------------------------------------

UNIT_BYTES = {"byte": 1, "bytes": 1, "b": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9,
              "tbyte": 1e12, "kib": 1024, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6,
              "gb": 1e9}


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu",
                    "/usr/local/cuda-*/bin/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def ncu_command(ncu: str, child_args: list[str]) -> list[str]:
    return [ncu, "--metrics", ",".join(NCU_METRICS), "--csv", "--print-units", "base",
            "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
            *CHILD, *child_args]


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels of ncu's --csv details output: [{"id", "name", "read", "write"}] in bytes.

    ncu prints one row per (kernel, metric) between the application's own output; rows start
    with a quote, other lines (==PROF== notes, the app's prints) are skipped. Values may carry
    thousands separators and a unit (byte, Kbyte, Mbyte, ... when --print-units is not base)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(_io.StringIO("\n".join(lines))):
        metric = row.get("Metric Name")
        if metric not in NCU_METRICS:
            continue
        unit = (row.get("Metric Unit") or "byte").strip().lower()
        if unit not in UNIT_BYTES:
            raise ValueError(f"unknown ncu unit {unit!r} for {metric}")
        value = float(row["Metric Value"].replace(",", "")) * UNIT_BYTES[unit]
        k = kernels.setdefault(row["ID"], {"id": int(row["ID"]), "name": row["Kernel Name"],
                                           "read": 0.0, "write": 0.0})
        k["read" if metric == NCU_METRICS[0] else "write"] += value
    return sorted(kernels.values(), key=lambda k: k["id"])


def summarize_kernels(kernels: list[dict]) -> dict:
    read = sum(k["read"] for k in kernels)
    write = sum(k["write"] for k in kernels)
    return {"kernels": len(kernels), "read_bytes": read, "write_bytes": write,
            "hbm_bytes": read + write,
            "per_kernel": [{**k, "name": k["name"][:90]} for k in kernels]}


def fake_ncu_csv(kernels: list[tuple[str, float, float]]) -> str:
    """A CSV in ncu's details layout (for --cpu-dry-run and the tests), with the unit and
    thousands-separator variety real output has."""
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
            '"Metric Value"')
    rows = ["==PROF== Connected to process 1 (fake)", head]
    for i, (name, read, write) in enumerate(kernels):
        for metric, value in ((NCU_METRICS[0], read), (NCU_METRICS[1], write)):
            if i % 2:  # odd kernels in Kbyte, as ncu prints without --print-units base
                cell, unit = f"{value / 1e3:,.3f}", "Kbyte"
            else:
                cell, unit = f"{value:,.0f}", "byte"
            rows.append(f'"{i}","1","python","host","{name}","1","7","(128, 1, 1)",'
                        f'"(8, 4, 1)","0","9.0","Command line profiler metrics","{metric}",'
                        f'"{unit}","{cell}"')
    return "\n".join(rows) + "\n"


# ----------------------------------------------------------------------------------------
# Providers: what each one runs
# ----------------------------------------------------------------------------------------


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(shape: Shape, grad: bool, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    return [torch.randn(shape.B, shape.H, shape.N, shape.d, device=device(), dtype=dtype,
                        requires_grad=grad) for _ in range(3)]


def attention_fn(provider: str):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashedu.reference import naive_attention_torch

    if provider == "naive":
        return lambda q, k, v: naive_attention_torch(q, k, v, upcast=False)
    if provider == "flashedu":
        return lambda q, k, v: flashedu.attention(q, k, v, backend="triton")
    if provider == "sdpa-flash":
        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # explicit: plain SDPA picks cuDNN
                return F.scaled_dot_product_attention(q, k, v)
        return sdpa
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def step_fn(provider: str, shape: Shape, backward: bool):
    """A zero-argument call doing one forward (and backward) on fresh inputs made here."""
    import torch

    fn = attention_fn(provider)
    q, k, v = make_inputs(shape, grad=backward)
    if not backward:
        def fwd():
            with torch.no_grad():
                fn(q, k, v)
        return fwd, (q, k, v)
    dout = torch.randn_like(q)

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(dout)
    return fwd_bwd, (q, k, v, dout)


def sweep_fn(shape: Shape, Br: int, Bc: int):
    """The Triton forward alone with the tile size (Br, Bc)."""
    from flashedu import runtime
    from flashedu.ops import Call
    from flashedu.triton.config import Tiles
    from flashedu.triton.launch import forward

    interpreted = runtime.triton_interpreted()
    q, k, v = make_inputs(shape, grad=False)
    tiles = Tiles(Br, Bc, 4, 1 if interpreted else 2)
    scale = 1.0 / math.sqrt(shape.d)
    return lambda: forward(q, k, v, Call(False, scale), tiles=tiles,
                           interpreted=interpreted)


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_ms(fn) -> float:
    """Median ms: do_bench on a GPU; perf_counter runs in the CPU dry run."""
    return core.time_ms(fn, cpu_repeats=1)


error_text = core.error_text


# ----------------------------------------------------------------------------------------
# The ncu child: one bracketed call
# ----------------------------------------------------------------------------------------


def child_main(spec: dict, fake: bool) -> int:
    """Run the spec's case once inside profiler.start()/stop(), after a warm-up."""
    import torch

    shape = Shape(**spec["shape"])
    if spec["task"] == "sweep":
        calls = [sweep_fn(shape, Br, Bc) for Br, Bc in spec["tiles"]]
    else:
        calls = [step_fn(spec["provider"], shape, spec["backward"])[0]]
    for call in calls:  # warm-up: compile, autotune, allocator growth all happen here
        for _ in range(1 if fake else 2):
            call()
    sync()
    if fake:  # --cpu-dry-run: print what ncu would, from the model
        print(fake_ncu_csv(fake_kernels(spec)))
        return 0
    torch.cuda.profiler.start()
    for call in calls:
        call()
        sync()
    torch.cuda.profiler.stop()
    return 0


def fake_kernels(spec: dict) -> list[tuple[str, float, float]]:
    """Model bytes split into 'kernels' (60% read, 40% written): the dry run's stand-in."""
    shape = Shape(**spec["shape"])
    if spec["task"] == "sweep":
        return [(f"forward_kernel_{Br}x{Bc}", 0.6 * b, 0.4 * b)
                for Br, Bc in spec["tiles"] for b in [triton_forward_bytes(shape, Br, Bc)]]
    total = predicted_bytes(spec["provider"], shape, spec["backward"])
    total = total or minimum_bytes(shape, spec["backward"])
    return [(f"{spec['provider']}_kernel_a", 0.3 * total, 0.2 * total),
            (f"{spec['provider']}_kernel_b", 0.3 * total, 0.2 * total)]


def ncu_measure(spec: dict, args) -> dict:
    """Run the child under ncu (or the fake in a dry run) and sum its kernels' DRAM bytes."""
    child = ["--ncu-child", json.dumps(spec)]
    if args.cpu_dry_run:
        cmd = [*CHILD, *child, "--fake-ncu"]
    else:
        ncu = find_ncu()
        if ncu is None:
            return {"error": "ncu not found (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute)"}
        cmd = ncu_command(ncu, child)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.ncu_timeout,
                              env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"ncu child timed out after {args.ncu_timeout} s"}
    kernels = parse_ncu_csv(proc.stdout)
    if proc.returncode != 0 or not kernels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"ncu child exit {proc.returncode}, {len(kernels)} kernels: "
                         + " | ".join(tail)[:400]}
    return {**summarize_kernels(kernels), "ncu_wall_s": round(time.perf_counter() - t0, 1),
            "fake": bool(args.cpu_dry_run)}


# ----------------------------------------------------------------------------------------
# Peak memory
# ----------------------------------------------------------------------------------------


def peak_extra_bytes(call, inputs) -> float:
    """Bytes allocated at the peak of one call, over what was allocated before it (q, k, v,
    and dO for a backward): torch's allocator statistics. CPU dry run: the model's count."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("peak memory needs CUDA")
    sync()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    sync()
    return float(torch.cuda.max_memory_allocated() - base)


def model_memory_bytes(provider: str, shape: Shape) -> float:
    """Extra memory in the paper's model: the N x N score matrix (standard) or L (flash),
    plus the output O."""
    per_head = shape.N * shape.N if provider == "naive" else shape.N
    return float((per_head + shape.N * shape.d) * shape.itemsize * shape.heads)


def measure_memory(provider: str, shape: Shape, backward: bool, dry: bool) -> dict:
    import torch

    try:
        call, inputs = step_fn(provider, shape, backward)
        inputs_bytes = sum(t.numel() * t.element_size() for t in inputs)
        t0 = time.perf_counter()
        if dry:
            call()
            peak, fake = model_memory_bytes(provider, shape), True
        else:
            peak, fake = peak_extra_bytes(call, inputs), False
        ms = (time.perf_counter() - t0) * 1e3
        return {"peak_extra_bytes": peak, "inputs_bytes": float(inputs_bytes),
                "one_call_ms": ms, "fake": fake}
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}
    except Exception as exc:  # noqa: BLE001 - reported, the run goes on
        return {"error": error_text(exc)}
    finally:
        call = inputs = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------
# The four parts
# ----------------------------------------------------------------------------------------


def run_fig2(plan: Plan, args) -> dict:
    shape = plan.fig2
    rows = {}
    for p in PROVIDERS:
        row = {"gflops_counted": matmul_gflops(p, shape), "matmuls": MATMUL_COUNT[p],
               "predicted_bytes": predicted_bytes(p, shape)}
        try:
            call, _ = step_fn(p, shape, backward=True)
            call()  # compile and check it runs before timing
            row["ms"] = bench_ms(call)
            row["tflops"] = row["gflops_counted"] / row["ms"]
        except Exception as exc:  # noqa: BLE001
            row["error"] = error_text(exc)
        finally:
            call = None
        spec = {"task": "attn", "provider": p, "shape": asdict(shape), "backward": True}
        row["ncu"] = ncu_measure(spec, args)
        rows[p] = row
        log(f"fig2 {p}: {short(row)}")
    paper_m = {g: paper_algorithm_bytes(shape, g) for g in ("A100 SXM4 40GB", "H100 SXM5")}
    return {"shape": asdict(shape), "mode": "forward + backward", "mask": "none",
            "dropout": 0.0, "rows": rows, "paper": PAPER_FIG2,
            "model": {"standard_bytes": standard_bytes(shape),
                      "minimum_bytes": minimum_bytes(shape),
                      "flashedu_bytes": flashedu_bytes(shape),
                      "flashedu_tiles": tiles_dict(triton_config(shape), shape.N),
                      "paper_algorithm": paper_m},
            "batch_note": ("" if shape.B == 64 else
                           f"measured at batch {shape.B}; bytes and time scale "
                           f"~linearly with batch: x{64 / shape.B:g} for the paper's 64")}


def tiles_dict(cfg, N: int) -> dict:
    """The tiles of a plain call with N keys (the forward's depend on N)."""
    return {"forward": asdict(cfg.forward_tiles(None, N)), "dkdv": asdict(cfg.dkdv),
            "dq": asdict(cfg.dq)}


def run_sweep(plan: Plan, args) -> dict:
    shape = plan.sweep
    Br0, Bc0 = plan.sweep_fixed
    configs = [(Br, Bc0) for Br in plan.sweep_br] + [(Br0, Bc) for Bc in plan.sweep_bc
                                                     if (Br0, Bc) not in
                                                     [(Br, Bc0) for Br in plan.sweep_br]]
    rows, ok = [], []
    for Br, Bc in configs:
        row = {"Br": Br, "Bc": Bc, "predicted_bytes": triton_forward_bytes(shape, Br, Bc),
               "gflops": 4 * shape.N * shape.N * shape.d * shape.heads / 1e9}
        try:
            call = sweep_fn(shape, Br, Bc)
            call()  # a tile that does not compile or fit fails here, alone
            row["ms"] = bench_ms(call)
            ok.append((Br, Bc))
        except Exception as exc:  # noqa: BLE001
            row["error"] = error_text(exc)
        rows.append(row)
    ncu = ncu_measure({"task": "sweep", "shape": asdict(shape), "tiles": ok}, args) if ok else \
        {"error": "no tile size ran"}
    # Each call also launches torch's small fill of the (unused) sparse-index buffer: keep the
    # attention kernels only, one per tile size, in launch order.
    kernels = [k for k in ncu.get("per_kernel", []) if "forward_kernel" in k["name"]]
    if "error" not in ncu and len(kernels) != len(ok):
        ncu = {"error": f"expected {len(ok)} forward kernels, ncu saw {len(kernels)}"}
        kernels = []
    for (Br, Bc), k in zip(ok, kernels):
        row = next(r for r in rows if (r["Br"], r["Bc"]) == (Br, Bc))
        row["ncu_bytes"] = k["read"] + k["write"]
        row["ncu_read"], row["ncu_write"] = k["read"], k["write"]
    for r in rows:
        log(f"sweep Br={r['Br']} Bc={r['Bc']}: {short(r)}")
    return {"shape": asdict(shape), "mode": "forward", "fixed": {"Br": Br0, "Bc": Bc0},
            "rows": rows, "minimum_bytes": minimum_bytes(shape, backward=False),
            "ncu_error": ncu.get("error"), "fake": ncu.get("fake", False)}


def run_memory(plan: Plan, args) -> dict:
    rows = []
    for backward in (False, True):
        for p in PROVIDERS:
            for N in plan.memory_ns:
                shape = with_n(plan.memory, N)
                r = measure_memory(p, shape, backward, args.cpu_dry_run)
                rows.append({"provider": p, "N": N, "backward": backward,
                             "model_extra_bytes": model_memory_bytes(p, shape), **r})
                log(f"memory {p} N={N} {'fwd+bwd' if backward else 'fwd'}: {short(r)}")
                if "error" in r:  # larger N will not fit either
                    break
    return {"shape": asdict(plan.memory), "rows": rows,
            "measure": "torch.cuda.max_memory_allocated during one call minus what was "
                       "allocated before it (q, k, v, and dO for fwd+bwd)"}


def run_claims(plan: Plan, args) -> dict:
    traffic = []
    for N in plan.claims_ns:
        shape = with_n(plan.claims_ncu, N)
        for p in PROVIDERS:
            spec = {"task": "attn", "provider": p, "shape": asdict(shape), "backward": False}
            r = ncu_measure(spec, args)
            traffic.append({"provider": p, "N": N, "shape": asdict(shape),
                            "predicted_bytes": predicted_bytes(p, shape, backward=False), **r})
            log(f"claims traffic {p} N={N}: {short(r)}")
    memory = {p: measure_memory(p, plan.claims_mem, False, args.cpu_dry_run) for p in PROVIDERS}
    for p, r in memory.items():
        log(f"claims memory {p}: {short(r)}")
    out = {"ns": list(plan.claims_ns), "traffic": traffic, "traffic_shape": asdict(plan.claims_ncu),
           "memory": memory, "memory_shape": asdict(plan.claims_mem)}
    out["claims"] = claims_verdicts(out)
    return out


# ----------------------------------------------------------------------------------------
# Popular claims and their verdicts
# ----------------------------------------------------------------------------------------


def verdict(claimed: float, measured: float | None, model: float, tol: float = 0.25,
            at_least: bool = False) -> str:
    """'holds' when the measurement lands within tol (relative) of the claimed number (or, for
    an at_least claim, reaches it); 'holds under stated assumptions' when only the model, under
    the claim's assumptions, does; 'does not hold' when neither does."""
    def close(x):
        if x is None:
            return False
        return x >= claimed * (1 - tol) if at_least else abs(x / claimed - 1) <= tol

    if close(measured):
        return "holds"
    if close(model):
        return "holds under stated assumptions"
    return "does not hold"


def claims_model(N: int, d: int = 128, heads: int = 32, itemsize: int = 2) -> dict:
    """The popular claims' numbers follow from the paper's model with d=128 (32 heads, fp16,
    batch 1): traffic ratio = Algorithm 0's 4N^2 + 4Nd over the minimum 4Nd = N/d + 1;
    memory ratio = (4Nd + N^2) / (4Nd + N); score matrix = heads N^2 itemsize bytes;
    standard IO = Algorithm 0's HBM accesses (flashedu.io) over all heads, in bytes."""
    return {"traffic_ratio": io.standard_attention_hbm_elements(N, d) / io.flash_min_hbm_elements(N, d),
            "memory_ratio": io.standard_attention_memory_elements(N, d) / io.flash_memory_elements(N, d),
            "score_matrix_bytes": heads * N * N * itemsize,
            "score_matrix_gib": heads * N * N * itemsize / 2**30,
            "standard_io_bytes": heads * io.standard_attention_hbm_elements(N, d) * itemsize}


def ratio(a, b):
    return a / b if a and b else None


def claims_verdicts(run: dict) -> list[dict]:
    def ncu_bytes(p, N):
        r = next((t for t in run["traffic"] if t["provider"] == p and t["N"] == N), {})
        return r.get("hbm_bytes")

    claims = []
    # The claimed N and the N measured for it: the same on a GPU; smaller in the CPU dry run.
    for (N, claimed), Nm in zip(((4096, 33.0), (16384, 129.0)), run["ns"]):
        claims.append({
            "claim": f"{claimed:g}x less HBM traffic at N={N}", "claimed": claimed,
            "measured_at_N": Nm, "measured": ratio(ncu_bytes("naive", Nm),
                                                   ncu_bytes("flashedu", Nm)),
            "measured_vs_sdpa": ratio(ncu_bytes("naive", Nm), ncu_bytes("sdpa-flash", Nm)),
            "model": claims_model(N)["traffic_ratio"],
            "assumptions": "forward only; standard = the paper's Algorithm 0 (4N^2 + 4Nd), "
                           "flash = the minimum 4Nd (Q, K, V read once, O written once); "
                           "d=128: the ratio is N/d + 1",
            "measured_how": "ncu DRAM bytes, naive torch / flashedu Triton, forward, "
                            f"B,H,d = {run['traffic_shape']['B']},{run['traffic_shape']['H']},"
                            f"{run['traffic_shape']['d']} (a per-head ratio)"})
    mem = run["memory"]

    def total(p):
        r = mem.get(p, {})
        return r["peak_extra_bytes"] + r["inputs_bytes"] if "peak_extra_bytes" in r else None

    ms = run["memory_shape"]
    claims.append({
        "claim": "9x less total attention memory at N=4096", "claimed": 9.0,
        "measured": ratio(total("naive"), total("flashedu")),
        "measured_vs_sdpa": ratio(total("naive"), total("sdpa-flash")),
        "model": claims_model(4096)["memory_ratio"],
        "assumptions": "standard holds Q, K, V, O and one N x N matrix (4Nd + N^2), flash "
                       "holds Q, K, V, O and L (4Nd + N); d=128",
        "measured_how": f"forward, B,H,N,d = {ms['B']},{ms['H']},{ms['N']},{ms['d']} fp16: "
                        "(inputs + peak extra) of naive torch / of flashedu"})
    naive_extra = mem.get("naive", {}).get("peak_extra_bytes")
    s_bytes = ms["H"] * ms["B"] * ms["N"] ** 2 * io.itemsize_of(ms["dtype"])
    claims.append({
        "claim": "standard attention stores a 1.0 GB fp16 matrix at N=4096 (32 heads)",
        "claimed": 1.0, "at_least": True,
        "measured": naive_extra / 2**30 if naive_extra is not None else None,
        "model": claims_model(4096)["score_matrix_gib"],
        "naive_peak_in_score_matrices": ratio(naive_extra, s_bytes),
        "assumptions": "1 GB read as 1 GiB (32 x 4096^2 x 2 bytes); batch 1, 32 heads, fp16",
        "measured_how": f"peak extra memory (GiB) of naive torch's forward at B,H,N,d = "
                        f"{ms['B']},{ms['H']},{ms['N']},{ms['d']}: it must hold at least one "
                        "score matrix"})
    for c in claims:
        c["verdict"] = verdict(c["claimed"], c["measured"], c["model"],
                               at_least=c.get("at_least", False))
    return claims


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def short(r: dict) -> str:
    keys = ("ms", "hbm_bytes", "ncu_bytes", "peak_extra_bytes", "error")
    out = []
    for k in keys:
        v = r.get(k, r.get("ncu", {}).get(k) if k == "hbm_bytes" else None)
        if v is not None:
            out.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    if isinstance(r.get("ncu"), dict) and "error" in r["ncu"]:
        out.append(f"ncu error={r['ncu']['error'][:120]}")
    return " ".join(out) or "-"


def fmt(x, scale=1.0, digits=2) -> str:
    return "-" if x is None else f"{x / scale:.{digits}f}"


table = core.format_table


def report(data: dict) -> str:
    out = []
    f = data.get("fig2")
    if f:
        s, paper = f["shape"], f["paper"]
        out.append(f"\nFig. 2 left: B={s['B']} H={s['H']} N={s['N']} d={s['d']} {s['dtype']}, "
                   f"fwd+bwd. {f['batch_note']}")
        rows = [[f"paper A100 standard", paper["standard"]["gflops"], paper["standard"]["hbm_gb"],
                 "", paper["standard"]["ms"]],
                [f"paper A100 FlashAttention", paper["flash"]["gflops"], paper["flash"]["hbm_gb"],
                 "", paper["flash"]["ms"]]]
        for p, r in f["rows"].items():
            ncu = r["ncu"]
            rows.append([p, fmt(r["gflops_counted"], 1, 1), fmt(ncu.get("hbm_bytes"), 1e9),
                         fmt(r["predicted_bytes"], 1e9), fmt(r.get("ms"), 1, 3)])
        out.append(table(["", "GFLOPs", "HBM GB (ncu)", "HBM GB (model)", "ms"], rows))
        for g, m in f["model"]["paper_algorithm"].items():
            out.append(f"model, paper's Algorithms 1 and 4 with M = {g} SRAM/SM = {m['M_elements']} "
                       f"fp16 elements: Br={m['Br']} Bc={m['Bc']}: {m['fwdbwd_bytes'] / 1e9:.2f} GB")
        out.append(f"model floor (read inputs once, write outputs once): "
                   f"{f['model']['minimum_bytes'] / 1e9:.2f} GB")
        for p, r in f["rows"].items():
            if "error" in r or "error" in r["ncu"]:
                out.append(f"  {p}: {r.get('error', '')} {r['ncu'].get('error', '')}")
    sw = data.get("sweep")
    if sw:
        s = sw["shape"]
        out.append(f"\nFig. 2 middle: Triton forward, B={s['B']} H={s['H']} N={s['N']} "
                   f"d={s['d']}; floor {sw['minimum_bytes'] / 1e9:.3f} GB")
        out.append(table(["Br", "Bc", "HBM GB (ncu)", "HBM GB (model)", "ms"],
                         [[r["Br"], r["Bc"], fmt(r.get("ncu_bytes"), 1e9, 3),
                           fmt(r["predicted_bytes"], 1e9, 3),
                           fmt(r.get("ms"), 1, 3) if "error" not in r else r["error"][:40]]
                          for r in sw["rows"]]))
        if sw.get("ncu_error"):
            out.append(f"  ncu: {sw['ncu_error']}")
    mem = data.get("memory")
    if mem:
        s = mem["shape"]
        out.append(f"\nFig. 3 right: peak memory over the inputs (MiB), B={s['B']} H={s['H']} "
                   f"d={s['d']} {s['dtype']}")
        Ns = sorted({r["N"] for r in mem["rows"]})
        rows = []
        for backward in (False, True):
            for p in PROVIDERS:
                by = {r["N"]: r for r in mem["rows"] if r["provider"] == p
                      and r["backward"] == backward}
                rows.append([f"{p} {'fwd+bwd' if backward else 'fwd'}"]
                            + [("OOM" if by[N].get("error") == "out of memory" else
                                "err" if "error" in by[N] else fmt(by[N]["peak_extra_bytes"], 2**20, 0))
                               if N in by else "" for N in Ns])
        out.append(table(["N"] + [str(N) for N in Ns], rows))
    claims = data.get("popular_claims")
    if claims:
        out.append("\nPopular claims (\"Flash Attention Mechanics: How Tiled Attention Fits in SRAM\")")
        out.append(table(["claim", "claimed", "model", "measured", "verdict"],
                         [[c["claim"], c["claimed"], fmt(c["model"]), fmt(c["measured"]),
                           c["verdict"]] for c in claims["claims"]]))
    if data.get("dry_run"):
        out.append("\nCPU DRY RUN: ncu bytes and peak memory are fake (model values); only the "
                   "pipeline is exercised.")
    return "\n".join(out)


def environment(argv: list[str], dry: bool) -> dict:
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, cwd=ROOT, check=False)
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    except OSError:
        dirty = None
    return core.environment(
        ["paper", *argv], dirty_tree=dirty, ncu=None if dry else find_ncu(),
        ncu_metrics=list(NCU_METRICS),
        ncu_flags="--csv --print-units base --clock-control none --profile-from-start off "
                  "(default cache control: caches flushed before each kernel)")


def parse_args(argv):
    p = core.parser("paper", __doc__)
    p.add_argument("--out", type=core.output_dir, help="directory for paper_repro.json")
    p.add_argument("--quick", action="store_true", help="smaller batch, fewer sizes (~2 min)")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="tiny sizes on CPU, fake ncu CSV and memory: tests the pipeline")
    # The sweep goes last: an odd tile size is the likeliest to break the CUDA context.
    p.add_argument("--parts", nargs="+", default=["fig2", "claims", "memory", "sweep"],
                   choices=["fig2", "claims", "memory", "sweep", "seed"])
    p.add_argument("--ncu-timeout", type=core.positive_int, default=300,
                   help="seconds per ncu child")
    p.add_argument("--ncu-child", help=argparse.SUPPRESS)
    p.add_argument("--fake-ncu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ncu_child is None and not args.out:
        p.error("--out DIR is required")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.ncu_child is not None:
        return child_main(json.loads(args.ncu_child), args.fake_ncu)
    if not core.gpu_available() and not args.cpu_dry_run:
        return core.needs_gpu("flashedu bench paper (--cpu-dry-run tests the pipeline here)")
    plan = plan_for(args.quick, args.cpu_dry_run)
    t0 = time.perf_counter()
    data = {**environment(argv, args.cpu_dry_run), "dry_run": args.cpu_dry_run,
            "quick": args.quick, "plan": asdict(plan)}
    parts = {"fig2": ("fig2", run_fig2), "sweep": ("sweep", run_sweep),
             "memory": ("memory", run_memory), "claims": ("popular_claims", run_claims),
             "seed": ("popular_claims", run_claims)}  # "seed": the part's old name
    for name in args.parts:
        key, run = parts[name]
        try:
            data[key] = run(plan, args)
        except Exception as exc:  # noqa: BLE001 - a broken part must not lose the others
            data[key] = None
            data.setdefault("errors", []).append(f"{name}: {error_text(exc)}")
            log(f"{name} FAILED: {error_text(exc)}")
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "paper_repro.json")
    core.write_json(path, data)
    print(report(data))
    print(f"\nwrote {path} in {data['wall_s']} s")
    return 0

