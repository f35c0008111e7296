"""Hardware facts, one entry per GPU: what the estimate assumes about the device it predicts for.

Everything the estimator and the planners know about the hardware lives here, so adding a GPU is
one entry: its memory, the CUDA context a process pays, the cuBLAS / cuBLASLt workspaces that go
through the caching allocator, which fused attention kernels it has, its data-sheet matmul peak,
DRAM bandwidth and PCIe link (every registered GPU has each of them, cited beside the entry), the
effective rates the step-time model derives from them, and NCCL's own buffers where measured.
Host facts (the CPU Adam rate of an offloaded optimizer) sit beside them. Each entry says where its
figures come from: ``measured`` (on this project's GPU machines,
bench/results/raw/gpu_calibration.json) or ``documented`` (vendor data sheets and PyTorch's
dispatch rules, not measured here).

>>> gpu_facts("h100").cublas_workspace_bytes // 2**20, gpu_facts("a100-80gb").cublas_workspace_bytes
(32, 8519680)
>>> gpu_facts("H100").name, sorted(GPUS)[:3]
('h100', ['a100-40gb', 'a100-80gb', 'a10g'])
>>> gpu_facts("t4").dram_gbps, gpu_facts("t4").pcie_gbps, gpu_facts("t4").pcie_bytes_per_s / 1e9
(320.0, 16.0, 5.0)
>>> nccl_bytes("h200", 2)[0] // 2**20, nccl_bytes("h100", 2)[0] // 2**20, nccl_bytes("l4", 2)[0]
(916, 922, None)
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
    bf16: bool                     # bf16 tensor cores (sm80+): the A100 datasheet is the first to list BF16; the
                                   # T4 (Turing) and V100 (Volta) datasheets list FP16/INT8 tensor cores only
    cudnn_attention: bool          # SDPA dispatches fp16/bf16 to cuDNN attention first (torch >= 2.5 on sm90)
    flash_attention: bool          # FlashAttention-2 kernels (sm80+)
    peak_tflops_half: float        # data sheet: dense fp16/bf16 tensor-core TFLOP/s (no sparsity)
    peak_tflops_fp32: float        # data sheet: dense TF32 tensor-core TFLOP/s (fp32 on GPUs without TF32)
    dram_gbps: float               # data sheet: GPU memory bandwidth, GB/s
    pcie_gbps: float               # data sheet: the x16 host link, GB/s each direction (half the bidirectional figure)
    matmul_tflops_half: float      # effective dense fp16/bf16 matmul rate of a training step (step-time model)
    matmul_tflops_fp32: float
    pcie_bytes_per_s: float        # effective host <-> GPU copy rate of the step-time model (offload)
    source: str                    # measured | documented
    nominal_gb: float = 0.0        # data sheet: the memory the GPU is sold with ("80GB"): a --budget up to it (read as
                                   # GiB, as people type it) is the whole GPU, above it a mistake (memlens.core.fits)
    sm_count: int = 0              # streaming multiprocessors (torch.cuda.get_device_properties().multi_processor_count):
                                   # kernels that size scratch per SM (liger's RMSNorm backward, memlens.models.liger)

    @property
    def max_threads_per_sm(self) -> int:
        """Resident threads per SM (``maxThreadsPerMultiProcessor``; CUDA C++ Programming Guide, compute capabilities
        table): 2048 on sm70/sm80/sm90, 1536 on sm86/sm89, 1024 on sm75. CUDA reductions size their grids by it."""
        return {(7, 5): 1024, (8, 6): 1536, (8, 7): 1536, (8, 9): 1536}.get(tuple(self.compute_capability), 2048)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = list(self.compute_capability)
        return d


# The step-time model's effective rates, set on the H100 and scaled to every other GPU by its data
# sheet: matmuls at 120 / 40 TFLOP/s (typical utilisation of its 989.5 / 495 dense peaks), host
# copies at 20 GB/s (of its PCIe Gen5 x16's 64 GB/s each way).
_H100_PEAK_HALF, _H100_PEAK_FP32, _H100_PCIE = 989.5, 495.0, 64.0
_EFF_HALF, _EFF_FP32, _EFF_PCIE = 120.0, 40.0, 20e9


def _facts(name, label, arch, cc, mem_gib, ctx_mib, peak_half, peak_fp32, dram_gbps, pcie_gbps,
           source="documented", *, nominal) -> GpuFacts:
    return GpuFacts(name, label, arch, cc, int(mem_gib * GiB), ctx_mib * MiB,
                    _WS_HOPPER if cc[0] == 9 else _WS_OTHER, _LT_WS, cc >= (8, 0), cc[0] == 9, cc >= (8, 0),
                    float(peak_half), float(peak_fp32), float(dram_gbps), float(pcie_gbps),
                    round(_EFF_HALF * peak_half / _H100_PEAK_HALF, 1), round(_EFF_FP32 * peak_fp32 / _H100_PEAK_FP32, 1),
                    _EFF_PCIE * pcie_gbps / _H100_PCIE, source, float(nominal), _SM_COUNT[name])


# SMs per GPU, from the same data sheets / whitepapers as the entries below (H100 SXM5 and H200: 132; A100: 108;
# L40S: 142; L4: 58; A10G: 80; RTX 4090: 128; RTX 3090: 82; T4: 40; V100: 80)
_SM_COUNT = {"h100": 132, "h200": 132, "a100-80gb": 108, "a100-40gb": 108, "l40s": 142, "l4": 58, "a10g": 80,
             "rtx-4090": 128, "rtx-3090": 82, "t4": 40, "v100": 80}


# CUDA context: 740 MiB measured on an H100 with torch 2.11 + CUDA 13 (612 MiB after the first kernel,
# ~740 once cuBLAS/cuDNN load). Other GPUs: the same driver stack, taken as the same (not measured).
# Columns after the context: peak fp16/bf16 TFLOP/s, peak TF32 (or fp32) TFLOP/s, DRAM GB/s, PCIe GB/s
# each way; sources beside each entry (dense figures: the data sheets' sparsity figures halved).
GPUS: dict[str, GpuFacts] = {f.name: f for f in (
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 1979 / 989 TFLOPS sparse, 3.35 TB/s, PCIe Gen5 128 GB/s
    _facts("h100", "NVIDIA H100 80GB HBM3", "hopper", (9, 0), 79.19, 740, 989.5, 495, 3350, 64, "measured", nominal=80),
    # NVIDIA H200 datasheet (SXM): 1979 / 989 TFLOPS sparse, 4.8 TB/s, PCIe Gen5 128 GB/s
    _facts("h200", "NVIDIA H200", "hopper", (9, 0), 139.8, 740, 989.5, 495, 4800, 64, nominal=141),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): 312 / 156 TFLOPS, 2039 GB/s, PCIe Gen4 64 GB/s
    _facts("a100-80gb", "NVIDIA A100-SXM4-80GB", "ampere", (8, 0), 79.15, 740, 312.5, 156, 2039, 32, nominal=80),
    # NVIDIA A100 Tensor Core GPU datasheet (40GB): 312 / 156 TFLOPS, 1555 GB/s, PCIe Gen4 64 GB/s
    _facts("a100-40gb", "NVIDIA A100-SXM4-40GB", "ampere", (8, 0), 39.39, 740, 312.5, 156, 1555, 32, nominal=40),
    # NVIDIA L40S datasheet: 733 / 366 TFLOPS sparse (362 / 183 dense), 864 GB/s, PCIe Gen4 x16 64 GB/s
    _facts("l40s", "NVIDIA L40S", "ada", (8, 9), 44.39, 740, 362, 183, 864, 32, nominal=48),
    # NVIDIA L4 datasheet: 242 / 120 TFLOPS sparse, 300 GB/s, PCIe Gen4 x16 64 GB/s
    _facts("l4", "NVIDIA L4", "ada", (8, 9), 22.03, 740, 121, 60, 300, 32, nominal=24),
    # NVIDIA A10 datasheet (AWS's A10G: the same GA102 part): 125 / 62.5 TFLOPS, 600 GB/s, PCIe Gen4 64 GB/s
    _facts("a10g", "NVIDIA A10G", "ampere", (8, 6), 22.07, 740, 125, 62, 600, 32, nominal=24),
    # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): 165.2 FP16 w/ FP32 acc. / 82.6 TF32, 1008 GB/s, PCIe Gen4 x16
    _facts("rtx-4090", "NVIDIA GeForce RTX 4090", "ada", (8, 9), 23.52, 740, 165, 83, 1008, 32, nominal=24),
    # NVIDIA Ampere GA102 whitepaper (RTX 3090): 71 FP16 w/ FP32 acc. / 35.6 TF32, 936 GB/s, PCIe Gen4 x16
    _facts("rtx-3090", "NVIDIA GeForce RTX 3090", "ampere", (8, 6), 23.57, 740, 71, 36, 936, 32, nominal=24),
    # NVIDIA T4 datasheet: 65 TFLOPS mixed precision, 8.1 TFLOPS fp32, 320 GB/s, PCIe Gen3 x16 32 GB/s
    _facts("t4", "Tesla T4", "turing", (7, 5), 14.58, 740, 65, 8, 320, 16, nominal=16),
    # NVIDIA V100 Tensor Core GPU datasheet (SXM2): 125 TFLOPS tensor, 15.7 fp32, 900 GB/s, PCIe 32 GB/s
    _facts("v100", "Tesla V100-SXM2-32GB", "volta", (7, 0), 31.74, 740, 125, 16, 900, 16, nominal=32),
)}
DEFAULT_GPU = "h100"
LARGEST_GPU = max(GPUS.values(), key=lambda g: g.nominal_gb).name   # no GPU memlens knows has more memory


def gpu_facts(name: str | None = None) -> GpuFacts:
    """The facts of ``name`` (case-insensitive; None: the default, h100), or one clear error."""
    if name is not None and not str(name).strip():   # --gpu "": not the default in disguise
        raise SpecError("--gpu is empty", hint=f"name a GPU ({', '.join(GPUS)}), or leave --gpu out for {DEFAULT_GPU}")
    key = (name or DEFAULT_GPU).strip().lower()
    if key in GPUS:
        return GPUS[key]
    close = difflib.get_close_matches(key, GPUS, n=1)
    raise SpecError(f"unknown GPU {name!r}", hint=(f"did you mean {close[0]!r}? " if close else "") + f"known: {', '.join(GPUS)}")



# ---------------------------------------------------------------- host facts
# Adam steps on the CPU (ZeRO-Offload's optimizer step), parameters per second: an assumption of the
# step-time model, not measured here (the order of DeepSpeed's vectorised CPU-Adam, Ren et al. 2021,
# "ZeRO-Offload"); one figure for every host.
HOST_CPU_ADAM_PARAMS_PER_S = 1e9
# GPU-to-GPU collectives of the step-time model, bytes per second per GPU: an assumption, not a data
# sheet (NVLink, NVSwitch and PCIe-only hosts differ by an order of magnitude); one figure for every GPU.
INTERCONNECT_BYTES_PER_S = 100e9


# ---------------------------------------------------------------- NCCL
# NCCL's own device memory per rank: what nvidia-smi shows beyond PyTorch's reserved memory and the
# CUDA context once a communicator has run collectives. NCCL allocates its buffers with cudaMalloc /
# cuMem directly (per peer and channel: the Simple, LL and LL128 protocol buffers of NCCL_BUFFSIZE and
# friends, plus work queues and its kernels' code), never through PyTorch's caching allocator:
# max_memory_allocated and max_memory_reserved do not see it; NVML's per-process used memory does. Its
# size depends on the NCCL version, the topology, the number of peers and the environment
# (NCCL_BUFFSIZE, NCCL_NVLS_ENABLE, ...), so it is not derived: it is measured, by
# bench/gpu_distributed.py: per process, NVML used memory after the profiled steps minus
# max_memory_reserved minus the CUDA context of the same process measured before the process group
# was created (field nccl_bytes of each rank's record). Without an entry the figure is unknown.
#
# (gpu, world size) -> (bytes per rank, where it was measured). Filled from bench/results/distributed_accuracy.json
# (the second item is shown to users: no internal paths there).
NCCL_MEASURED: dict[tuple[str, int], tuple[int, str]] = {
    ("h100", 2): (966787072, "measured on 2 x NVIDIA H100 80GB HBM3, NCCL 2.28.9, torch 2.11.0+cu130: "
                             "median over 40 ranks of 20 cases (916-928 MiB), bench/results/distributed_accuracy.md"),
    ("h200", 2): (960495616, "measured on 2 x NVIDIA H200 (NVLink), NCCL 2.28.9, torch 2.11.0+cu130: "
                             "median over 24 ranks of 12 cases (912-922 MiB)"),
    ("h200", 4): (964689920, "measured on 4 x NVIDIA H200 (NVLink), NCCL 2.28.9, torch 2.11.0+cu130: "
                             "median over 28 ranks of 7 DDP / ZeRO cases (912-922 MiB)"),
}


def nccl_bytes(gpu: str, world_size: int, communicators: int = 1) -> tuple[int | None, str]:
    """(bytes NCCL holds per rank outside the caching allocator, or None; where the figure comes from). The figures
    are measured with one communicator per rank (DDP, ZeRO, FSDP2); a rank of a 2D mesh holds one per mesh dimension
    (measured on 4 x H200: 916-922 MiB with one, 1,886 MiB under HSDP 2 x 2 and TP 2 x FSDP2 2, 2,044 under CP 2 x
    FSDP2 2)."""
    hit = NCCL_MEASURED.get((gpu, world_size))
    if hit is not None:
        b, src = hit
    else:
        same_gpu = sorted((w, v) for (g, w), v in NCCL_MEASURED.items() if g == gpu)
        if not same_gpu:
            return None, (f"not measured for {gpu} at world size {world_size} (measured as NVML process memory - reserved - "
                          "CUDA context)")
        w, (b, src) = min(same_gpu, key=lambda wv: abs(wv[0] - world_size))
        src = f"{src} (measured at world size {w}, not {world_size})"
    if communicators > 1:
        return b * communicators, f"{src}; x {communicators} communicators (one per mesh dimension)"
    return b, src
