"""HBM traffic and SRAM footprint: the paper's IO model, exact counts, and real GPUs.

Three ways to know how many bytes an attention kernel moves between HBM and SRAM:
- the paper's asymptotic formulas (Theorem 2): standard attention Θ(N d + N²),
  FlashAttention Θ(N² d² / M) for an SRAM of M elements;
- exact closed-form counts for a given tiling (:func:`flash_forward_hbm_bytes`,
  :func:`flash_backward_hbm_bytes`), which know about edge tiles, causal and block masks;
- the count of an actual run, read from its :class:`flashedu.trace.Trace`
  (:func:`counted_hbm_bytes`). Tests check that the last two agree exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .tiled import TileMask

# ----------------------------------------------------------------------------------------
# Real GPUs. Figures are per the vendor's documents named in `source`; "smem_per_sm_kib" is the
# largest shared memory one SM can give to thread blocks (the L1/shared pool is larger).
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    name: str
    sms: int
    smem_per_sm_kib: int  # usable shared memory (SRAM) per SM
    hbm_gb_s: float  # DRAM bandwidth, GB/s (10^9 bytes/s)
    hbm_gib: int  # DRAM capacity
    tensor_tflops: float  # dense fp16/bf16 tensor-core TFLOP/s with fp32 accumulation
    fp32_tflops: float  # dense fp32 (non-tensor-core) TFLOP/s
    source: str

    @property
    def sram_total_mib(self) -> float:
        return self.sms * self.smem_per_sm_kib / 1024

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which tensor-core work, not HBM, is the limit."""
        return self.tensor_tflops * 1e12 / (self.hbm_gb_s * 1e9)


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("V100 SXM2", 80, 96, 900, 32, 125, 15.7,
        "NVIDIA Tesla V100 GPU Architecture whitepaper (2017), Table 1 and the L1/shared section"),
    GPU("T4", 40, 64, 320, 16, 65, 8.1,
        "NVIDIA T4 datasheet (2019); NVIDIA Turing GPU Architecture whitepaper (64 KB shared/SM)"),
    GPU("A100 SXM4 40GB", 108, 164, 1555, 40, 312, 19.5,
        "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), Table 1; CUDA C++ Programming "
        "Guide, compute capability 8.0 (164 KB shared/SM)"),
    GPU("A100 SXM4 80GB", 108, 164, 2039, 80, 312, 19.5,
        "NVIDIA A100 80GB datasheet (2021); CUDA C++ Programming Guide, compute capability 8.0"),
    GPU("RTX 4090", 128, 100, 1008, 24, 165.2, 82.6,
        "NVIDIA Ada GPU Architecture whitepaper (2022), Table 2 (FP16 tensor with FP32 accumulate); "
        "CUDA C++ Programming Guide, compute capability 8.9 (100 KB shared/SM)"),
    GPU("H100 SXM5", 132, 228, 3350, 80, 989, 67,
        "NVIDIA H100 Tensor Core GPU datasheet (2023); NVIDIA H100 Architecture whitepaper "
        "(228 KB shared/SM)"),
    GPU("H200 SXM", 132, 228, 4800, 141, 989, 67,
        "NVIDIA H200 Tensor Core GPU datasheet (2024)"),
)}

# The paper's Figure 1 (left) memory hierarchy for the A100, in its own round numbers.
PAPER_A100 = {"sram_tb_s": 19, "sram_mb": 20, "hbm_tb_s": 1.5, "hbm_gb": 40,
              "cpu_dram_gb_s": 12.8, "cpu_dram_tb": 1}


# ----------------------------------------------------------------------------------------
# The paper's formulas (counts in elements; multiply by the element size for bytes).
# ----------------------------------------------------------------------------------------


def standard_attention_hbm_elements(N: int, d: int, Nk: int | None = None) -> int:
    """HBM accesses of standard attention (the paper's Algorithm 0), exactly:
    read Q, K; write S; read S, write P; read P, V; write O. That is 4 N d + 4 N² for Nk = N,
    the Θ(N d + N²) of Theorem 2."""
    Nk = N if Nk is None else Nk
    reads = N * d + Nk * d + N * Nk + N * Nk + Nk * d
    writes = N * Nk + N * Nk + N * d
    return reads + writes


def flash_hbm_elements_theta(N: int, d: int, M: int) -> float:
    """Theorem 2's FlashAttention term N² d² / M (constant factor 1), M = SRAM size in elements."""
    return N * N * d * d / M


def flash_min_hbm_elements(N: int, d: int, Nk: int | None = None) -> int:
    """The unavoidable minimum of any exact attention: read Q, K, V once, write O once."""
    Nk = N if Nk is None else Nk
    return 2 * N * d + 2 * Nk * d


def paper_block_sizes(M: int, d: int) -> tuple[int, int]:
    """Algorithm 1, line 1: Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d), M in elements."""
    Bc = math.ceil(M / (4 * d))
    return min(Bc, d), Bc


def standard_attention_memory_elements(N: int, d: int, heads: int = 1) -> int:
    """Memory standard attention holds: Q, K, V, O and the N x N score matrix (P overwrites S)."""
    return heads * (4 * N * d + N * N)


def flash_memory_elements(N: int, d: int, heads: int = 1) -> int:
    """Memory FlashAttention holds: Q, K, V, O and the logsumexp L (N per head)."""
    return heads * (4 * N * d + N)


# ----------------------------------------------------------------------------------------
# Exact counts for a tiling: what tiled.flash_forward / flash_backward move, in bytes.
# ----------------------------------------------------------------------------------------


def _tiling(Nq, Nk, Br, Bc, causal, block_mask):
    """(visited (Tr, Tc) bool, rows of each Q tile, rows of each K/V tile), as the kernels see
    them: the mask decides which pairs they visit; the last tile of each axis may be short."""
    Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
    mask = TileMask(Nq, Nk, Br, Bc, causal, block_mask)
    visited = np.array([[not mask.skip(i, j) for j in range(Tc)] for i in range(Tr)], dtype=bool)
    rows = np.minimum(np.arange(1, Tr + 1) * Br, Nq) - np.arange(Tr) * Br
    cols = np.minimum(np.arange(1, Tc + 1) * Bc, Nk) - np.arange(Tc) * Bc
    return visited, rows, cols


def _bytes(read: int, written: int, itemsize: int) -> dict[str, int]:
    return {"read": read * itemsize, "written": written * itemsize,
            "total": (read + written) * itemsize}


def flash_forward_hbm_bytes(Nq, Nk, d, Br, Bc, order="q_outer", causal=False,
                            block_mask=None, itemsize=4) -> dict[str, int]:
    """Bytes read and written by :func:`flashedu.tiled.flash_forward` with this tiling.

    Returns {"read": ..., "written": ..., "total": ...}; equals the run's trace exactly."""
    visited, rows, cols = _tiling(Nq, Nk, Br, Bc, causal, block_mask)
    pairs_rows = int((visited * rows[:, None]).sum())  # sum over visited (i, j) of rows_i
    if order == "q_outer":
        read = Nq * d + 2 * d * int((visited * cols[None, :]).sum())  # Q once; K_j, V_j per visit
        written = Nq * d + Nq  # O and L, once
    elif order == "kv_outer":
        kv_loaded = visited.any(axis=0)
        read = 2 * d * int(cols[kv_loaded].sum()) + pairs_rows * (2 * d + 2) + 2 * Nq
        written = pairs_rows * (d + 2) + Nq
    else:
        raise ValueError(f"order must be 'q_outer' or 'kv_outer', got {order!r}")
    return _bytes(read, written, itemsize)


def flash_backward_hbm_bytes(Nq, Nk, d, Br, Bc, causal=False, block_mask=None,
                             itemsize=4) -> dict[str, int]:
    """Bytes read and written by :func:`flashedu.tiled.flash_backward` with this tiling."""
    visited, rows, cols = _tiling(Nq, Nk, Br, Bc, causal, block_mask)
    pairs_rows = int((visited * rows[:, None]).sum())
    kv_loaded = visited.any(axis=0)
    read = (2 * Nq * d  # preprocess: dO, O
            + 2 * d * int(cols[kv_loaded].sum())  # K_j, V_j
            + pairs_rows * (3 * d + 2))  # Q_i, dO_i, dQ_i, L_i, D_i per visited pair
    written = Nq + pairs_rows * d + 2 * Nk * d  # D; dQ_i per visited pair; dK, dV
    return _bytes(read, written, itemsize)


def counted_hbm_bytes(trace) -> dict[str, int]:
    """Bytes read and written in a recorded run."""
    return {"read": trace.bytes_read, "written": trace.bytes_written, "total": trace.hbm_bytes}


# ----------------------------------------------------------------------------------------
# SRAM footprint of a tile choice.
# ----------------------------------------------------------------------------------------

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "float8": 1}


def itemsize_of(dtype) -> int:
    """Bytes per element of a dtype name, numpy dtype or torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name in DTYPE_BYTES:
        return DTYPE_BYTES[name]
    return np.dtype(name).itemsize


def sram_footprint(Br: int, Bc: int, d: int, dtype="float16", stages: int = 1) -> dict[str, int]:
    """Bytes each buffer of one thread block's forward pass occupies, in the paper's model
    where everything the inner loop touches sits in SRAM.

    Q_i, K_j, V_j are in the input dtype; K_j and V_j are held ``stages`` deep when the loads
    of the next tiles are pipelined behind the compute of this one. The score tile S_ij (P_ij
    overwrites it), the output accumulator O_i and the statistics m_i, l_i are float32. (A tuned
    GPU kernel keeps S_ij, O_i, m_i and l_i in registers instead: same bytes, another memory.)
    """
    for name, value in (("Br", Br), ("Bc", Bc), ("d", d), ("stages", stages)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    isz = itemsize_of(dtype)
    return {
        "Q_i": Br * d * isz,
        "K_j": stages * Bc * d * isz,
        "V_j": stages * Bc * d * isz,
        "S_ij/P_ij": Br * Bc * 4,
        "O_i": Br * d * 4,
        "m_i": Br * 4,
        "l_i": Br * 4,
    }


def largest_square_tile(gpu: GPU | str, d: int, dtype="float16", stages: int = 1,
                        multiple: int = 16) -> int:
    """The largest B (a multiple of ``multiple``) with Br = Bc = B fitting one SM's SRAM."""
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    capacity = gpu.smem_per_sm_kib * 1024
    best, B = 0, multiple
    while sum(sram_footprint(B, B, d, dtype, stages).values()) <= capacity:
        best, B = B, B + multiple
    return best


# ----------------------------------------------------------------------------------------
# Roofline.
# ----------------------------------------------------------------------------------------


def attention_flops(Nq: int, Nk: int, d: int, causal: bool = False, backward: bool = False) -> float:
    """Matmul FLOPs of attention (2 matmuls of 2 Nq Nk d each); x0.5 causal, x2.5 backward."""
    flops = 4 * Nq * Nk * d
    if causal:
        flops /= 2
    return flops * 2.5 if backward else flops


def attainable_tflops(gpu: GPU | str, flops_per_byte: float) -> float:
    """The roofline: min(peak compute, bandwidth x arithmetic intensity), in TFLOP/s."""
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    return min(gpu.tensor_tflops, gpu.hbm_gb_s * 1e9 * flops_per_byte / 1e12)
