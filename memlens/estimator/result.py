"""The estimate Result of a simulation: what every simulated Result says (one GPU, or the rank that peaks)."""
from __future__ import annotations

from ..core.components import by_component
from ..core.fits import Budget, fits
from ..core.gpus import gpu_facts, nccl_bytes
from ..core.ledger import group_modules
from ..core.parallel import communicators, is_distributed
from ..core.payloads import UNSET, EstimatePayload
from ..core.precision import precision_of
from ..core.result import Result
from ..core.spec import checkpoint_layers_text
from ..core.units import fmt_bytes
from .timing.step import step_time

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
        # --pp: the per-op time model prices one rank's ops, not the pipeline's bubble or its P2P waits: no step time
        **_timed(step_time(sim) if getattr(sim.spec, "pp", 1) == 1 else None),
    }


def _timed(st: dict | None) -> dict:
    """The step-time fields (memlens.estimator.timing): ``step_seconds`` and ``step_time`` (parts, tokens/s, MFU)."""
    return {} if st is None else {"step_seconds": st["seconds"], "step_time": st}


def simulation_result(sim, a) -> Result:
    """The estimate Result of a simulation (or of a replay at another size, :mod:`.scaling`) and its analysis."""
    spec = sim.spec
    gpu = gpu_facts(spec.gpu)
    ctx = gpu.cuda_context_bytes
    data = EstimatePayload(
        method="simulate",
        cuda_context_bytes=ctx,
        nvidia_smi_estimate_bytes=a.peak_reserved_bytes + ctx,
        gpu=gpu.to_dict(),
        **simulation_facts(sim, a),
        by_component=by_component(a.by_module),
        simulate_seconds=round(sim.seconds, 3),
        later_steps=sim.later_steps,
        later_micro_batches=sim.later_micro_batches or UNSET,
        later_layers=sim.later_layers or UNSET,
    )
    r = Result(
        verb="estimate",
        spec=spec.to_dict(),
        peak_allocated_bytes=a.peak_allocated_bytes,
        peak_reserved_bytes=a.peak_reserved_bytes,
        by_category=dict(a.by_category),
        by_phase=a.by_phase,
        by_module=a.by_module,
        timeline=a.timeline,
        notes=[
            "peak_allocated_bytes is what torch.cuda.max_memory_allocated() reads after the steps; "
            "peak_reserved_bytes what max_memory_reserved() reads (caching allocator segments).",
            f"nvidia-smi shows about {ctx // 2**20} MiB more per process: the CUDA context (cuda_context_bytes).",
        ],
        data=data,
    )
    if spec.liger:
        from ..models.liger import liger_facts  # noqa: PLC0415 - only for --liger

        data.liger = liger_facts(spec, sim.source, sim.seq_len)
    plan = activation_plan(sim)
    if plan is not None:
        data.activation_plan = plan
        r.notes.append(plan["summary"])
    r.notes.extend(sim.notes)
    outside_allocator(r, spec)
    if precision_of(spec).grad_scaler:
        r.notes.append(FP16_SKIPPED_STEPS)
    if spec.compile:
        from .compiled import MODEL  # heavy: imports torch

        data.compile_model = MODEL
        r.notes.append(f"--compile: {MODEL}.")
    return finish(r, spec)


# Selective checkpointing in eager mode runs every op of a checkpointed block through torch's Python
# TorchDispatchModes (caching in forward, replaying in recompute), host work the GPU waits on: measured on an H100
# host (bench/results/recompute_plan_accuracy.md, all blocks selective on an 8B LoRA, a 1B, ViT-L and LLaVA-7B): 12-30
# us per recomputed op beyond the roofline, median 22. Under torch.compile this cost vanishes (compiled steps refuse
# the policy here).
SAC_HOST_SECONDS_PER_OP = 22e-6


def activation_plan(sim) -> dict | None:
    """What checkpointing and activation offload cost one micro-batch, as the simulation counted it
    (:attr:`memlens.estimator.simulate.SimulationTracker.costs`): the ops a checkpointed block runs again in backward
    (torch's non-reentrant checkpoint stops once the tensors backward needs are back, so a block's last ops are not
    rerun; under the selective policy the matmul/attention/conv outputs come from its cache), their FLOPs
    at the GPU's dense peak (data sheet) plus their output bytes written and as many read at its memory bandwidth; and the
    bytes save_on_cpu copies to host memory in forward and back in backward, each way at the GPU's PCIe rate."""
    spec = sim.spec
    if not spec.grad_checkpointing and spec.offload_layers is None:
        return None
    c = {k: int(v) for k, v in (sim.costs or {}).items()}
    gpu = gpu_facts(spec.gpu)
    # a roofline figure: recomputed matmuls at the data sheet's dense peak, their outputs written and read at its DRAM
    # bandwidth (a lower bound: kernels reach part of either); host copies at the registry's effective PCIe rate
    rate = 1e12 * (gpu.peak_tflops_fp32 if spec.precision == "fp32" else gpu.peak_tflops_half)
    plan: dict = {"per": "micro-batch"}
    words = []
    if spec.grad_checkpointing:
        blocks = "all" if spec.checkpoint_layers is None else checkpoint_layers_text(spec.checkpoint_layers)
        sec = c.get("recompute_flops", 0) / rate + 2 * c.get("recompute_bytes", 0) / (gpu.dram_gbps * 1e9)
        if spec.checkpoint_policy in ("selective", "torchtitan-op"):     # eager SAC: every op through torch's Python dispatch modes
            sec += c.get("recompute_ops", 0) * SAC_HOST_SECONDS_PER_OP
        st = step_time(sim) or {}         # the per-op time model's figure where the simulation priced its ops
        sec = st.get("recompute_seconds_per_micro_batch", sec)
        plan["checkpoint"] = {"blocks": blocks, "policy": spec.checkpoint_policy, "recomputed_ops": c.get("recompute_ops", 0),
                              "recompute_flops": c.get("recompute_flops", 0), "recompute_bytes": c.get("recompute_bytes", 0),
                              "recompute_seconds": round(sec, 6)}
        words.append(f"{spec.checkpoint_policy} checkpointing of blocks {blocks} recomputes {c.get('recompute_ops', 0)} ops "
                      f"({c.get('recompute_flops', 0) / 1e9:.3g} GFLOP, {fmt_bytes(c.get('recompute_bytes', 0))} written) per "
                      f"micro-batch, about {sec * 1e3:.3g} ms on the {gpu.name}")
    if spec.offload_layers is not None:
        nbytes = c.get("offload_bytes", 0)
        each = nbytes / gpu.pcie_bytes_per_s
        plan["offload"] = {"blocks": checkpoint_layers_text(spec.offload_layers), "tensors": c.get("offload_tensors", 0),
                           "host_bytes": nbytes, "parameter_copy_bytes": c.get("offload_parameter_bytes", 0),
                           "transfer_seconds_each_way": round(each, 6), "transfer_seconds": round(2 * each, 6)}
        words.append(f"offloading blocks {checkpoint_layers_text(spec.offload_layers)} moves {fmt_bytes(nbytes)} of saved "
                     f"tensors to pinned host memory per micro-batch ({fmt_bytes(c.get('offload_parameter_bytes', 0))} of it copies "
                     f"of weights, which stay on the GPU too) and back in backward: {each * 1e3:.3g} ms each way over PCIe")
    plan["summary"] = "; ".join(words) + " (activation_plan)."
    return plan


def outside_allocator(r: Result, spec) -> None:
    """GRPO with vLLM colocated (TRL's ``use_vllm``, ``vllm_mode="colocate"``): vLLM takes
    ``vllm_gpu_memory_utilization`` of the GPU's total memory for itself (its weights and KV cache), outside torch's
    caching allocator: not simulated, not in the peaks; ``outside_allocator_bytes`` (which the fit rule adds to the
    need, core/fits.py need_bytes) and nvidia-smi's figure count it."""
    u = getattr(spec, "vllm_gpu_memory_utilization", None)
    if not u:
        return
    g = gpu_facts(spec.gpu)
    b = int(u * g.total_memory_bytes)
    r.data.outside_allocator_bytes = b
    r.data.nvidia_smi_estimate_bytes = (r.data.nvidia_smi_estimate_bytes or 0) + b
    r.notes.append(f"vLLM colocated (vllm_gpu_memory_utilization {u:g}) reserves {fmt_bytes(b)} of the {g.name} outside "
                   "torch's caching allocator (not simulated, not in the peaks); the fit verdict adds it (outside_allocator_bytes)")


def finish(result: Result, spec) -> Result:
    """What every estimate Result says last, however it was made (a simulation here or in a worker, a replay,
    every rank, the closed form): what the GPU cannot do natively, and whether it fits that GPU."""
    result.notes.extend(hardware_notes(spec))
    gpu_verdict(result, spec)
    return result


def gpu_verdict(result: Result, spec) -> None:
    """The fit rule (:mod:`memlens.core.fits`) against the whole of ``spec.gpu`` (the named GPU, or the
    default h100): its total memory as PyTorch reports it, less the CUDA context (and, per rank,
    NCCL's measured buffers) and the rule's margin. Always given, so an estimate never leaves out
    whether it fits the GPU it was made for; ``fit`` and ``fit_verdict`` in the payload."""
    g = gpu_facts(spec.gpu)
    ctx = g.cuda_context_bytes
    if is_distributed(spec):
        ctx += nccl_bytes(g.name, spec.world_size, communicators(spec))[0] or 0
    b = Budget.make("total", context_bytes=ctx, gpu=g.name)
    v = fits(result, b)
    words = v.describe(f"the {g.name}" + (" (per rank)" if is_distributed(spec) else ""))
    result.data.fit = {**b.to_dict(), **v.to_dict(), "gpu": g.name}
    result.data.fit_verdict = words


def hardware_notes(spec) -> list[str]:
    """What the GPU cannot do natively that the spec asks of it (the memory is the same; the speed is not).

    >>> from memlens.core.spec import TrainingSpec
    >>> hardware_notes(TrainingSpec(model="gpt2", gpu="t4", precision="bf16"))[0][:59]
    't4 (turing, sm75) has no bf16 tensor cores: bf16 runs emula'
    """
    gpu = gpu_facts(spec.gpu)
    p = precision_of(spec)
    uses_bf16 = "bfloat16" in (p.weights, p.autocast) or (spec.qlora and p.weights != "float16" and p.autocast != "float16")
    if uses_bf16 and not gpu.bf16:
        cc = "".join(map(str, gpu.compute_capability))
        return [f"{gpu.name} ({gpu.arch}, sm{cc}) has no bf16 tensor cores: bf16 runs emulated, much slower; "
                "memory is as estimated (use fp16 or amp-fp16 for speed on it)"]
    return []
