"""What TRL 1.16's SFT, DPO and GRPO steps share: their refusals, the Trainer's backward, the frozen reference
model, the accumulation loop (transformers Trainer.training_step: the loss divided by the accumulation steps,
``accelerator.backward``; then the optimizer step as the Trainer's, memlens.step.loop.optimizer_step)."""
from __future__ import annotations

from typing import Any, Callable

from ....core.errors import SpecError
from ....core.parallel import is_distributed
from ....core.spec import TrainingSpec


def refuse_trl(spec: TrainingSpec, task: str | None, other_kinds: tuple[tuple[str, bool], ...] = ()) -> None:
    """What none of the TRL steps is modelled with, one line each. ``other_kinds``: (flag, given) of the flags that
    select another step kind (--dp, --compile: memlens.step.kinds), refused first."""
    name = f"TRL's {spec.trainer.upper()} trainer"
    if task not in (None, "causal-lm"):
        raise SpecError(f"{name} is modelled for causal language models, not {task}",
                        hint="use a causal LM (--model qwen2.5-0.5b), or --trainer hf")
    for flag, given in (*other_kinds, ("--pad-fraction", spec.pad_fraction),
                        ("--loss", spec.loss != "model"), ("--keep-outputs", spec.keep_outputs), ("--qlora", spec.qlora),
                        ("--offload-optimizer", spec.offload_optimizer), ("--checkpoint-layers", spec.checkpoint_layers is not None),
                        ("--offload-activations", spec.offload_layers is not None),
                        ("--world-size", is_distributed(spec))):
        if given:
            raise SpecError(f"{flag} with {name} is not modelled", hint=f"drop {flag} (or use --trainer hf)")


def compute_dtype(step):
    """The fused head's compute dtype: autocast's under amp-*, else the hidden states' (ChunkedLogProbFunction)."""
    import torch  # heavy: torch, loaded on first use

    return getattr(torch, step.spec.autocast_dtype) if step.spec.autocast_dtype else None


def backward(step, loss) -> None:
    """accelerate's ``backward``: ``scaler.scale(loss).backward()`` under fp16, else ``loss.backward()``."""
    (step.scaler.scale(loss) if step.scaler is not None else loss).backward()


def accumulate(step, on_phase: Callable[[str], None], micro: Callable[[int], Any]) -> Any:
    """``grad_accum`` micro-batches: ``micro(i)`` returns the loss (its forward phases marked by itself); the
    Trainer divides it by the accumulation steps and backpropagates; then the optimizer phase. Returns the last
    loss, detached."""
    from ...loop import optimizer_step  # the Trainer's optimizer phase (clip, step, zero_grad)

    last = None
    k = step.spec.grad_accum
    for i in range(k):
        loss = micro(i)
        if k > 1:
            loss = loss / k
        on_phase("backward")
        backward(step, loss)
        kept = loss.detach()
        del loss
        last = kept
        del kept
    optimizer_step(step.optimizer, model=step.model, max_grad_norm=step.spec.max_grad_norm, scaler=step.scaler,
                   on_phase=on_phase)
    return last


def needs_reference(spec: TrainingSpec) -> bool:
    """A separate frozen copy of the model: DPO without precomputed log-probs, GRPO with beta > 0; under LoRA
    neither (the base with its adapters disabled is the reference: DPOTrainer / GRPOTrainer __init__)."""
    if spec.lora_rank:
        return False
    if spec.trainer == "dpo":
        return not spec.precompute_ref_log_probs
    return spec.trainer == "grpo" and bool(spec.beta)


def reference_spec(spec: TrainingSpec) -> TrainingSpec:
    """The reference model's build: ``create_model_from_path(..., dtype=policy.dtype, attn_implementation=...)``,
    no LoRA, no checkpointing (it runs under no_grad), its parameters frozen."""
    return spec.replace(lora_rank=None, lora_alpha=None, lora_targets=None, lora_dropout=0.0, grad_checkpointing=False,
                        checkpoint_policy="full", freeze=())


def describe(spec: TrainingSpec) -> str:
    """What the TRL step is given, for the prepared step's ``applied`` list."""
    B = spec.batch_size
    if spec.trainer == "grpo":
        k = spec.steps_per_generation or spec.grad_accum
        return (f"GRPO: {B * k} completions generated at once ({B * k // spec.num_generations} prompts x num_generations "
                f"{spec.num_generations}) of {spec.max_completion_length} tokens after {spec.seq_len or 512}-token prompts, "
                + (f"by vLLM colocated ({spec.vllm_gpu_memory_utilization:g} of the GPU)" if spec.vllm_gpu_memory_utilization
                   else "by HF generate") + f"; micro-batches of {B}; beta {spec.beta:g}")
    if spec.trainer == "dpo":
        return (f"DPO: {2 * B} rows (chosen + rejected)" + (f", {spec.prompt_len} prompt tokens" if spec.prompt_len else "")
                + ("; reference log-probs precomputed" if spec.precompute_ref_log_probs else ""))
    pf = spec.padding_free or spec.packing in ("bfd", "bfd_split")
    return ("SFT: " + (f"one padding-free row of {B} x {spec.seq_len or 512} tokens" if pf else f"{B} rows")
            + (f" ({spec.packing} packing)" if spec.packing else "")
            + (f", {spec.prompt_len} prompt tokens outside the loss" if spec.prompt_len else ""))


def add_reference(step) -> None:
    """Say what the TRL step is given; build the reference model beside the policy (fake tensors or the device),
    frozen, in eval-like no-grad use; it lives in ``step.frozen`` (the estimator accounts its parameters)."""
    import torch  # heavy: torch, loaded on first use

    step.applied.append(describe(step.spec))
    from ....models.build import build, quiet
    from ...fake import materialize_on_fake

    if not needs_reference(step.spec):
        return
    rspec = reference_spec(step.spec)
    if step.fake:
        with torch.device("meta"), quiet():
            ref = build(rspec, step.source).model
        ref = materialize_on_fake(ref, step.fake_mode)
    else:
        with quiet():
            ref = build(rspec, step.source, device=step.device).model
    ref.eval()     # from_pretrained's mode (the reference runs under no_grad; DPO also disables dropout)
    for p in ref.parameters():
        p.requires_grad_(False)
    holder = torch.nn.ModuleDict({"ref_model": ref})   # its modules labelled ref_model.* beside the policy's
    step.frozen.append(holder)
    step.applied.append("reference model: a frozen copy of the policy (" + f"{sum(p.numel() for p in ref.parameters()):,}"
                        + " parameters), run under no_grad")


def reference(step):
    """The reference model to call (the separate copy), or None (LoRA: the policy with its adapters disabled)."""
    return step.frozen[0]["ref_model"] if step.frozen else None


def no_adapters(model):
    """peft's ``disable_adapter()`` (TRL's ``use_adapter(model, adapter_name=None)``), or nothing for a plain model."""
    import contextlib

    return model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()


__all__ = ["refuse_trl", "accumulate", "add_reference", "reference", "needs_reference", "compute_dtype", "no_adapters"]
