"""`estimate`: the peak memory of one training step, predicted on a CPU (no GPU, no weights).

>>> from memlens import TrainingSpec, estimate
>>> r = estimate(TrainingSpec(model="gpt2", batch_size=2, seq_len=128))   # doctest: +SKIP
>>> r.peak_allocated_bytes                                                  # doctest: +SKIP
"""
from __future__ import annotations

from ..report.result import Result
from ..core.spec import TrainingSpec

# What nvidia-smi shows beyond PyTorch's reserved memory: the CUDA context (driver, kernels of
# torch/cuBLAS/cuDNN loaded lazily). Measured on an H100 with torch 2.11 + CUDA 13
# (bench/results/raw/gpu_calibration.json): 612 MiB after the first kernel, ~740 MiB once
# cuBLAS/cuDNN are loaded by a training step.
CUDA_CONTEXT_BYTES = 740 * 1024 * 1024

__all__ = ["estimate", "CUDA_CONTEXT_BYTES"]


def estimate(spec: TrainingSpec, method: str = "simulate", steps: int = 2) -> Result:
    """Predict the peak memory of ``spec``'s training step.

    method "simulate" runs the step on fake tensors (exact, seconds); "formula" uses the closed
    form (instant, any size, each term explained).
    """
    if method == "formula":
        from .formula import formula_estimate

        return formula_estimate(spec)
    from ..core.ledger import analyze, group_modules
    from .simulate import simulate

    sim = simulate(spec, steps=steps)
    a = analyze(sim.log)
    r = Result(
        verb="estimate",
        spec=spec.to_dict(),
        peak_allocated_bytes=a.peak_allocated_bytes,
        peak_reserved_bytes=a.peak_reserved_bytes,
        by_category={k: v for k, v in a.by_category.items()},
        by_phase=a.by_phase,
        by_module=a.by_module,
        timeline=a.timeline,
        notes=[
            "peak_allocated_bytes is what torch.cuda.max_memory_allocated() reads after the steps; "
            "peak_reserved_bytes what max_memory_reserved() reads (caching allocator segments).",
            f"nvidia-smi shows about {CUDA_CONTEXT_BYTES // 2**20} MiB more per process: the CUDA context (cuda_context_bytes).",
        ],
        data={
            "method": "simulate",
            "cuda_context_bytes": CUDA_CONTEXT_BYTES,
            "nvidia_smi_estimate_bytes": a.peak_reserved_bytes + CUDA_CONTEXT_BYTES,
            "peak_phase": a.peak_phase,
            "peak_step": a.peak_step,
            "peak_requested_bytes": a.peak_requested_bytes,
            "steps": a.steps,
            "attention_backends": sim.attention,
            "by_module_group": group_modules(a.by_module),
            "param_count": sim.param_count,
            "trainable_param_count": sim.trainable_count,
            "seq_len": sim.seq_len,
            "image_size": sim.image_size,
            "model_source": sim.source.to_dict(),
            "simulate_seconds": round(sim.seconds, 3),
        },
    )
    return r
