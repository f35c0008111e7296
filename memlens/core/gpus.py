"""Hardware facts, one entry per GPU: what the estimate assumes about the device it predicts for.

Everything the estimator and the planners know about a GPU lives here, so adding a GPU is one
entry: its memory, the CUDA context a process pays, the cuBLAS / cuBLASLt workspaces that go
through the caching allocator, which fused attention kernels it has, and the matmul rates the
step-time model uses. Each entry says where its figures come from: ``measured`` (on this
project's GPU machines, bench/results/raw/gpu_calibration.json) or ``documented`` (vendor data
sheets and PyTorch's dispatch rules, not measured here).

>>> gpu_facts("h100").cublas_workspace_bytes // 2**20, gpu_facts("a100-80gb").cublas_workspace_bytes
(32, 8519680)
>>> gpu_facts("H100").name, sorted(GPUS)[:3]
('h100', ['a100-40gb', 'a100-80gb', 'a10g'])
"""
from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass
from typing import Any

from .errors import SpecError

MiB = 2**20
GiB = 2**30

# cuBLAS workspace per (handle, stream), torch's default (aten/src/ATen/cuda/CublasHandlePool.cpp,
# CUBLAS_WORKSPACE_CONFIG unset): ":4096:8" = 32 MiB on Hopper (sm90), else ":4096:2:16:8" =
# 2 x 4 MiB + 8 x 16 KiB. Measured on an H100: 32 MiB at each thread's first GEMM.
_WS_HOPPER = 4096 * 1024 * 8
_WS_OTHER = 4096 * 1024 * 2 + 16 * 1024 * 8
# cuBLASLt's own workspace (torch's CUBLASLT_WORKSPACE_SIZE default 1024 KiB): measured 1 MiB at the first addmm with a bias
_LT_WS = 1 * MiB


@dataclass(frozen=True)
class GpuFacts:
    name: str                      # registry key, as --gpu takes it
    label: str                     # what torch.cuda.get_device_name() says
    arch: str                      # hopper | ampere | ada | turing | volta
    compute_capability: tuple[int, int]
    total_memory_bytes: int        # torch.cuda.get_device_properties().total_memory
    cuda_context_bytes: int        # what nvidia-smi shows beyond reserved once cuBLAS/cuDNN are loaded
    cublas_workspace_bytes: int
    cublaslt_workspace_bytes: int
    bf16: bool                     # native bf16 matmuls (sm80+)
    cudnn_attention: bool          # SDPA dispatches fp16/bf16 to cuDNN attention first (torch >= 2.5 on sm90)
    flash_attention: bool          # FlashAttention-2 kernels (sm80+)
    matmul_tflops_half: float      # effective dense fp16/bf16 matmul rate of a training step (step-time model)
    matmul_tflops_fp32: float
    source: str                    # measured | documented

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = list(self.compute_capability)
        return d


def _facts(name, label, arch, cc, mem_gib, ctx_mib, peak_half, peak_fp32, source="documented") -> GpuFacts:
    # Effective rates: the step-time model's H100 figures (120 / 40 TFLOP/s at typical utilisation of
    # 989 / 495 peak dense) scaled by each GPU's data-sheet peak.
    return GpuFacts(name, label, arch, cc, int(mem_gib * GiB), ctx_mib * MiB,
                    _WS_HOPPER if cc[0] == 9 else _WS_OTHER, _LT_WS, cc >= (8, 0), cc[0] == 9, cc >= (8, 0),
                    round(120.0 * peak_half / 989.0, 1), round(40.0 * peak_fp32 / 495.0, 1), source)


# CUDA context: 740 MiB measured on an H100 with torch 2.11 + CUDA 13 (612 MiB after the first kernel,
# ~740 once cuBLAS/cuDNN load). Other GPUs: the same driver stack, taken as the same (not measured).
GPUS: dict[str, GpuFacts] = {f.name: f for f in (
    _facts("h100", "NVIDIA H100 80GB HBM3", "hopper", (9, 0), 79.19, 740, 989, 495, "measured"),
    _facts("h200", "NVIDIA H200", "hopper", (9, 0), 139.8, 740, 989, 495),
    _facts("a100-80gb", "NVIDIA A100-SXM4-80GB", "ampere", (8, 0), 79.15, 740, 312, 156),
    _facts("a100-40gb", "NVIDIA A100-SXM4-40GB", "ampere", (8, 0), 39.39, 740, 312, 156),
    _facts("l40s", "NVIDIA L40S", "ada", (8, 9), 44.39, 740, 362, 183),
    _facts("l4", "NVIDIA L4", "ada", (8, 9), 22.03, 740, 121, 60),
    _facts("a10g", "NVIDIA A10G", "ampere", (8, 6), 22.07, 740, 125, 62),
    _facts("rtx-4090", "NVIDIA GeForce RTX 4090", "ada", (8, 9), 23.52, 740, 165, 83),
    _facts("rtx-3090", "NVIDIA GeForce RTX 3090", "ampere", (8, 6), 23.57, 740, 71, 36),
    _facts("t4", "Tesla T4", "turing", (7, 5), 14.58, 740, 65, 8),
    _facts("v100", "Tesla V100-SXM2-32GB", "volta", (7, 0), 31.74, 740, 125, 16),
)}
DEFAULT_GPU = "h100"


def gpu_facts(name: str | None = None) -> GpuFacts:
    """The facts of ``name`` (case-insensitive; None: the default, h100), or one clear error."""
    key = (name or DEFAULT_GPU).strip().lower()
    if key in GPUS:
        return GPUS[key]
    close = difflib.get_close_matches(key, GPUS, n=1)
    raise SpecError(f"unknown GPU {name!r}", hint=(f"did you mean {close[0]!r}? " if close else "") + f"known: {', '.join(GPUS)}")

