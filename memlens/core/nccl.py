"""NCCL's own device memory per rank: what nvidia-smi shows beyond PyTorch's reserved memory and the
CUDA context once a communicator has run collectives.

NCCL allocates its buffers with cudaMalloc / cuMem directly (per peer and channel: the Simple,
LL and LL128 protocol buffers of NCCL_BUFFSIZE and friends, plus work queues and its kernels'
code), never through PyTorch's caching allocator: ``max_memory_allocated`` and
``max_memory_reserved`` do not see it; NVML's per-process used memory (nvidia-smi) does. Its size
depends on the NCCL version, the topology (NVLink, NVSwitch, PCIe), the number of peers and the
environment (NCCL_BUFFSIZE, NCCL_NVLS_ENABLE, ...), so it is not derived: it is measured.

``MEASURED`` holds what ``bench/gpu_distributed.py`` measures on the project's GPU machines: per
process, NVML used memory after the profiled steps minus ``max_memory_reserved`` minus the CUDA
context of the same process measured before the process group was created (field
``nccl_bytes`` of each rank's record). An entry is keyed by (GPU, world size). Without an entry
the figure is reported as unknown, never guessed.

>>> nccl_bytes("h200", 2)[0] // 2**20, nccl_bytes("h100", 2)[0]
(916, None)
"""
from __future__ import annotations

# (gpu, world size) -> (bytes per rank, where it was measured). Filled from bench/results/distributed_accuracy.json,
# measured by bench/gpu_distributed.py (the second item is shown to users: no internal paths there).
MEASURED: dict[tuple[str, int], tuple[int, str]] = {
    ("h200", 2): (960495616, "measured on 2 x NVIDIA H200 (NVLink), NCCL 2.28.9, torch 2.11.0+cu130: "
                             "median over 24 ranks of 12 cases (912-922 MiB)"),
}


def nccl_bytes(gpu: str, world_size: int) -> tuple[int | None, str]:
    """(bytes NCCL holds per rank outside the caching allocator, or None; where the figure comes from)."""
    hit = MEASURED.get((gpu, world_size))
    if hit is not None:
        return hit[0], hit[1]
    same_gpu = sorted((w, v) for (g, w), v in MEASURED.items() if g == gpu)
    if same_gpu:
        w, (b, src) = min(same_gpu, key=lambda wv: abs(wv[0] - world_size))
        return b, f"{src} (measured at world size {w}, not {world_size})"
    return None, (f"not measured for {gpu} at world size {world_size} (measured as NVML process memory - reserved - "
                  "CUDA context)")
