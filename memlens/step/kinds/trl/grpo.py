"""TRL 1.16's GRPOTrainer step (trl/trainer/grpo_trainer.py), its two phases.

Generation (``_prepare_inputs`` at the first of ``steps_per_generation`` micro-batches; ``_generate_and_score_completions``,
``_generate_single_turn``'s HF generate path): ``unwrapped_model.generate(prompt_ids, attention_mask, max_new_tokens=
max_completion_length, do_sample=True)`` over the whole generation batch (``batch x steps_per_generation`` rows),
under no_grad, through accelerate's autocast wrapper (``unwrap_model`` keeps it, so the logits come back in fp32).
transformers' ``_sample`` loop: the prefill (``logits_to_keep=1``) fills a ``DynamicCache``; each next step runs one
token, ``DynamicLayer.update`` grows every layer's keys and values by ``torch.cat`` (the new tensor is made before the
old one is freed), ``logits[:, -1].to(copy=True, dtype=float32)``, softmax, ``multinomial``, ``torch.cat`` of the ids
and the attention mask. Every decode step allocates what the last one does with a shorter cache, so the last step
is the generation's peak: memlens runs the prefill and the last step, the cache between them written at its
length before that step (every completion at ``max_completion_length``: the worst case). Then, under no_grad,
the reference's per-token log-probs when ``beta > 0`` (``_get_per_token_logps_and_entropies`` in chunks of
``per_device_train_batch_size`` rows; under LoRA the policy with its adapters disabled), the buffered inputs
shuffled (``shuffle_sequence_dict``: indexed copies) and split into ``steps_per_generation`` micro-batches.

With vLLM colocated (``use_vllm``, ``vllm_mode="colocate"``) the completions come from vLLM, which reserves
``vllm_gpu_memory_utilization`` of the GPU outside torch's allocator: not simulated, reported beside the peak
(estimator/result.py); the policy's own log-probs are then computed under no_grad for importance sampling
(``vllm_importance_sampling_correction``, on by default).

A generation serves ``steps_per_generation`` micro-batches (default: the accumulation steps, one per optimizer
step); each step here starts with one (the step that generates is the one that peaks). When the accumulation is not
a multiple of it, a generation outlives an optimizer step and the policy's log-probs are taken too.

Training (``_compute_loss``): ``input_ids = cat(prompt_ids, completion_ids)``, the fused head over the completion
positions with ``outputs=("log_probs", "entropy")`` under autocast, the clipped ratio loss ("dapo", TRL 1.16's
default) on ``[B, C]`` tensors, the KL term when ``beta > 0``. Phases: "generation", then "forward" / "backward"
per micro-batch, "optimizer".
"""
from __future__ import annotations

import contextlib
import math

from ....core.parallel import data_parallel_ranks
from .common import accumulate, compute_dtype, no_adapters, reference
from .fused_head import backbone_of, fused_forward



def batch_unit(spec) -> int:
    """The step between micro-batches GRPO can take: the generation batch (micro-batch x steps_per_generation x
    GPUs) must be a multiple of num_generations (GRPOConfig.__post_init__).

    >>> from memlens.core.spec import TrainingSpec
    >>> batch_unit(TrainingSpec(model="gpt2", trainer="grpo", batch_size=8))
    8
    """
    spg = (spec.steps_per_generation or spec.grad_accum) * data_parallel_ranks(spec)
    return spec.num_generations // math.gcd(spec.num_generations, spg)


def search_base(spec):
    """(the spec whose micro-batch fit searches, the note that says so): the generation batch kept, so
    steps_per_generation does not follow an accumulation searched away; accumulation and the plan left as given."""
    base = spec.replace(grad_accum=1, steps_per_generation=spec.steps_per_generation or spec.grad_accum)
    return base, (f"GRPO: micro-batches in multiples of {batch_unit(base)} (num_generations {spec.num_generations} must "
                  "divide the generation batch); accumulation and the plan are left as given")


OUTPUTS = ("log_probs", "entropy")      # GRPOTrainer.__init__: add_fused_lm_head(outputs=...)
EPSILON = 0.2                            # GRPOConfig.epsilon


def _sample(step, out):
    """transformers ``_sample``: the last position's logits copied to fp32, softmax, one draw per row."""
    import torch  # heavy: torch, loaded on first use

    scores = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1).squeeze(1)


def _forward_cached(step, base, ids, cache, **kw):
    from ...loop import outputs_to_fp32

    with step.autocast():
        out = base(input_ids=ids, past_key_values=cache, use_cache=True, **kw)
    return outputs_to_fp32(out) if step.spec.autocast_dtype else out


@contextlib.contextmanager
def checkpointing_off(model):
    """TRL's ``unwrap_model_for_generation`` (trl/models/utils.py): ``gradient_checkpointing_disable()`` around
    ``generate``, enabled again after. It matters: transformers <= 5.17's ``GradientCheckpointingLayer.__call__``
    drops ``use_cache`` and the cache of a checkpointed layer in training mode even under no_grad (5.24 checks
    ``torch.is_grad_enabled()``), so with checkpointing on, generate would run without a KV cache. Each module's
    ``gradient_checkpointing`` switch is put back as it was (memlens may checkpoint only some blocks)."""
    was = [(m, m.gradient_checkpointing) for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m, _ in was:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m, on in was:
            m.gradient_checkpointing = on


def generate(step, prompt_ids, prompt_mask):
    """HF generate of ``max_completion_length`` tokens for every prompt row (see the module docstring): returns
    ``prompt_completion_ids``. The all-ones attention mask is grown as generate grows it, not passed to the model
    (transformers skips an all-ones mask on the GPU)."""
    import torch  # heavy: torch, loaded on first use
    from transformers import DynamicCache  # heavy: transformers, loaded on first use

    C = step.spec.max_completion_length
    base, _ = backbone_of(step.model)
    G = prompt_ids.shape[0]
    with torch.no_grad(), checkpointing_off(step.model):
        cache = DynamicCache(config=base.config)
        out = _forward_cached(step, base, prompt_ids, cache, logits_to_keep=1)    # the prefill
        nxt = _sample(step, out)
        del out
        ids = torch.cat([prompt_ids, nxt[:, None]], dim=-1)
        mask = torch.cat([prompt_mask, prompt_mask.new_ones((G, 1))], dim=-1)
        if C > 1:
            n = ids.shape[1] - 1 + (C - 2)   # the cache's tokens before the last step
            # steps 2 .. C-1 written: each layer's keys and values at that length (zeros: real devices need values
            # a forward can take; the same bytes as what the steps would have grown)
            for layer in cache.layers:
                layer.keys = layer.keys.new_zeros(layer.keys.shape[:-2] + (n, layer.keys.shape[-1]))
                layer.values = layer.values.new_zeros(layer.values.shape[:-2] + (n, layer.values.shape[-1]))
            ids = ids.new_zeros((G, n + 1))
            mask = mask.new_ones((G, n + 1))
            out = _forward_cached(step, base, ids[:, -1:], cache)
            nxt = _sample(step, out)
            del out
            ids = torch.cat([ids, nxt[:, None]], dim=-1)
            mask = torch.cat([mask, mask.new_ones((G, 1))], dim=-1)
        del cache, mask
    return ids


def _logps(step, model_or_none, input_ids, C, cd, rows, cols, chunk):
    """``_get_per_token_logps_and_entropies`` under no_grad (the reference, or the policy for importance
    sampling): chunks of ``chunk`` rows, labels -100 but on the completion, log-probs of the last C positions."""
    import torch  # heavy: torch, loaded on first use

    parts = []
    for s in range(0, input_ids.shape[0], chunk):
        ids = input_ids[s:s + chunk]
        labels = ids.clone()
        labels[:, :-C] = -100
        with (no_adapters(step.model) if model_or_none is None else _null()), step.autocast():
            out = fused_forward(step.model if model_or_none is None else model_or_none, {"input_ids": ids}, labels,
                                rows, cols, compute_dtype=cd)
        parts.append(out["log_probs"][:, -C:])
        del out, labels
    return torch.cat(parts, dim=0)


def _null():
    import contextlib

    return contextlib.nullcontext()


def generation_phase(step, on_phase):
    """The generation batch: completions, the reference's (and under vLLM the policy's) log-probs, shuffled and
    split into the micro-batches' inputs."""
    import torch  # heavy: torch, loaded on first use

    spec, batch, cd = step.spec, step.batch, compute_dtype(step)
    on_phase("generation")
    P, C, B = batch["prompt_ids"].shape[1], spec.max_completion_length, spec.batch_size
    G = batch["prompt_ids"].shape[0]
    if spec.vllm_gpu_memory_utilization:    # vLLM made the completions outside torch's allocator
        pc = torch.cat([batch["prompt_ids"], batch["prompt_ids"].new_zeros((G, C))], dim=1)
    else:
        pc = generate(step, batch["prompt_ids"], batch["prompt_mask"])
    completion_ids = pc[:, P:].clone()      # re-padded from the token lists (new tensors on the device)
    completion_mask = torch.ones_like(completion_ids)
    del pc
    prompt_completion_ids = torch.cat([batch["prompt_ids"], completion_ids], dim=1)
    rows, cols = step.batch["valid_rows"], step.batch["valid_cols"]
    buf = {"prompt_ids": batch["prompt_ids"], "prompt_mask": batch["prompt_mask"], "completion_ids": completion_ids,
           "completion_mask": completion_mask, "advantages": torch.zeros(G, device=completion_ids.device)}
    k = spec.steps_per_generation or spec.grad_accum
    with torch.no_grad():
        # the policy's own log-probs: when a generation outlives an optimizer step (gradient_accumulation_steps not a
        # multiple of steps_per_generation), and with vLLM (vllm_importance_sampling_correction)
        if spec.vllm_gpu_memory_utilization or spec.grad_accum % k:
            buf["old_per_token_logps"] = _logps(step, step.model, prompt_completion_ids, C, cd, rows, cols, B)
        if spec.vllm_gpu_memory_utilization:
            buf["importance_sampling_ratio"] = torch.ones(G, 1, device=completion_ids.device)
        if spec.beta:
            buf["ref_per_token_logps"] = _logps(step, reference(step), prompt_completion_ids, C, cd, rows, cols, B)
    del prompt_completion_ids
    perm = torch.randperm(G, device=completion_ids.device)             # shuffle_sequence_dict: indexed copies
    buf = {name: v[perm] for name, v in buf.items()}
    return [{name: v[i * B:(i + 1) * B] for name, v in buf.items()} for i in range(k)]   # split_tensor_dict: views


def run(step, on_phase):
    import torch  # heavy: torch, loaded on first use

    spec, cd = step.spec, compute_dtype(step)
    micro_batches: list = []
    rows, cols = step.batch["valid_rows"], step.batch["valid_cols"]
    C = spec.max_completion_length
    k = spec.steps_per_generation or spec.grad_accum

    def micro(i):
        if i % k == 0:     # _prepare_inputs: a new generation every steps_per_generation micro-batches
            micro_batches[:] = []
            micro_batches[:] = generation_phase(step, on_phase)
        on_phase("forward")
        inputs = micro_batches[i % k]
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-C] = -100
        with step.autocast():
            out = fused_forward(step.model, {"input_ids": input_ids}, labels, rows, cols, outputs=OUTPUTS, compute_dtype=cd)
        logps = torch.cat([out["log_probs"][:, -C:]], dim=0)
        entropies = torch.cat([out["entropy"][:, -C:]], dim=0)
        del out, labels, attention_mask, input_ids
        mask = inputs["completion_mask"]
        adv = inputs["advantages"].unsqueeze(1)
        old = inputs["old_per_token_logps"] if "old_per_token_logps" in inputs else logps.detach()
        coef_1 = torch.exp(logps - old)
        coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
        if "importance_sampling_ratio" in inputs:
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        if spec.beta:
            ref = inputs["ref_per_token_logps"]
            kl = (torch.exp(ref - logps) - (ref - logps) - 1) * coef_1      # use_bias_correction_kl
            per_token_loss = per_token_loss + spec.beta * kl
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)   # "dapo"
        metrics = ((entropies * mask).sum() / mask.sum().clamp(min=1.0)).detach()
        del metrics, entropies
        return loss

    try:
        return accumulate(step, on_phase, micro)
    finally:
        micro_batches.clear()
