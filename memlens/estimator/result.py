"""The estimate Result of a simulation: what every simulated Result says (one GPU, or the rank that peaks)."""
from __future__ import annotations

from ..core.components import by_component
from ..core.gpus import gpu_facts
from ..core.ledger import group_modules
from ..core.precision import precision_of
from ..core.result import Result

# measured on an H100 (bench/gpu_fp16_steps.py): torchvision's ResNet-50 from random weights skipped
# steps 1-3 (scale 65536, 32768, 16384) and first stepped at step 4
FP16_SKIPPED_STEPS = ("amp-fp16: GradScaler skips optimizer.step() while the scaled gradients overflow (initial scale "
                      "65536, halved at each skip), and a skipped step creates no optimizer state; this is the peak "
                      "once the optimizer steps")


def simulation_facts(sim, a) -> dict:
    """What every simulated Result says of its simulation (one GPU, or the rank that peaks)."""
    return {
        "applied": sim.applied,
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
    }


def simulation_result(sim, a) -> Result:
    """The estimate Result of a simulation (or of a replay at another size, :mod:`.scaling`) and its analysis."""
    spec = sim.spec
    gpu = gpu_facts(spec.gpu)
    ctx = gpu.cuda_context_bytes
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
            f"nvidia-smi shows about {ctx // 2**20} MiB more per process: the CUDA context (cuda_context_bytes).",
        ],
        data={
            "method": "simulate",
            "cuda_context_bytes": ctx,
            "nvidia_smi_estimate_bytes": a.peak_reserved_bytes + ctx,
            "gpu": gpu.to_dict(),
            **simulation_facts(sim, a),
            "by_component": by_component(a.by_module),
            "simulate_seconds": round(sim.seconds, 3),
            "later_steps": sim.later_steps,
            **({"later_micro_batches": sim.later_micro_batches} if sim.later_micro_batches else {}),
            **({"later_layers": sim.later_layers} if sim.later_layers else {}),
        },
    )
    r.notes.extend(sim.notes)
    if precision_of(spec).grad_scaler:
        r.notes.append(FP16_SKIPPED_STEPS)
    if spec.compile:
        from .compiled import MODEL

        r.data["compile_model"] = MODEL
        r.notes.append(f"--compile: {MODEL}.")
    return r
