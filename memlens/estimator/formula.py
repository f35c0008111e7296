"""Closed-form estimate: instant for any size, every term explained.

Model states are exact (parameter counts come from the model built on the meta device, no
memory). Activations use bytes-per-token-per-layer constants for each architecture family,
measured with the simulator (bench/formula_constants.py regenerates them), in the spirit of
Korthikanti et al. 2022 (activations of a layer = s*b*h*(34 + 5*a*s/h) bytes with fp16 and
dropout). The logits chain of a language model (logits, their fp32 upcast, log-softmax, and
its gradient) is counted apart because it often decides the peak.

Peak = max(forward/backward peak, optimizer-step peak):
  forward/backward = params + grads (of all but the first layer reached) + optimizer states
                     + activations of all layers + logits chain + workspaces
  optimizer step   = params + grads + optimizer states + optimizer temporaries
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.enums import Category
from ..core.errors import MemlensError
from ..core.gpus import gpu_facts
from ..core.optimizers import optimizer_facts
from ..core.parallel import shard_degree, sharding_of
from ..core.precision import precision_of
from ..core.result import Result
from ..core.spec import TrainingSpec
from ..models.build import build, default_seq_len, quiet
from ..models.source import resolve
from ..step.kinds import kind_for
from ..step.parallel.fsdp import find_blocks
from ..step.plan import StepPlan
from .result import finish

MiB = 1024 * 1024

# Activation bytes kept per token, per layer, per unit of hidden size, in units of the
# activation element size (2 for fp16/bf16/amp, 4 for fp32), measured with the simulator at
# batch 2 x 512 tokens (bench/formula_constants.py). "ckpt": with gradient checkpointing
# (the layer input only, plus one layer recomputed at a time, accounted separately).
ACT_PER_TOKEN = {  # measured in bf16 at batch 2 x 512 tokens (ViT: 197 patches)
    "gpt2": 31.6,   # GELU-tanh in Python ops and three dropout masks per layer
    "llama": 26.5,  # SwiGLU MLP, RMSNorm in fp32, rotary embeddings
    "bert": 17.1,
    "vit": 16.1,
    "default": 28.0,
}
FAMILY = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "bert": "bert", "vit": "vit",
          "clip": "vit", "llava": "llama"}


@dataclass
class Term:
    name: str
    bytes: int
    why: str


def _plan_of(spec: TrainingSpec) -> StepPlan:
    """The spec's step plan without the simulation's refusals: the closed form refuses on its own terms (below)."""
    return StepPlan(spec=spec, sharding=sharding_of(spec), wrapper=None, kind=kind_for(spec),
                    optimizer=optimizer_facts(spec.optimizer), precision=precision_of(spec))


def _counts(plan: StepPlan):
    import torch  # heavy: torch, loaded on first use

    spec = plan.spec
    if plan.distributed and plan.sharding.name == "none":   # as the simulation says (memlens.step.parallel.base.check)
        raise MemlensError(f"--world-size {plan.world_size} needs --sharding", hint="add --sharding ddp (or zero1, zero2, zero3, fsdp)")
    if spec.reshard_after_forward is not None and not isinstance(spec.reshard_after_forward, bool):
        raise MemlensError(f"--method formula does not model FSDP2 resharding over {spec.reshard_after_forward} GPUs "
                           "(--reshard-after-forward N)", hint="drop --method formula: the simulation runs FSDP2 itself")
    if spec.tp > 1:
        raise MemlensError(f"--method formula does not model tensor parallel (--tp {spec.tp}: DTensor shards, sequence-parallel "
                           "activations)", hint="drop --method formula: the simulation runs torch's parallelize_module itself")
    if spec.cp > 1:
        raise MemlensError(f"--method formula does not model context parallel (--cp {spec.cp}: ring attention's K/V buffers)",
                           hint="drop --method formula: the simulation runs torch's ring attention itself")
    if spec.pp > 1:
        raise MemlensError(f"--method formula does not model pipeline parallel (--pp {spec.pp}: a stage's layers, the "
                           "schedule's micro-batches in flight)", hint="drop --method formula: the simulation runs the schedule itself")
    if plan.dp:
        raise MemlensError("--method formula does not model DP-SGD (Opacus' per-sample gradients, ghost clipping's "
                           "Gram matrices, BatchMemoryManager)", hint="drop --method formula: simulate runs Opacus itself")
    unmodelled = [flag for flag, on in (("--lora-dropout", spec.lora_dropout), ("--pad-fraction", spec.pad_fraction),
                                        ("--kbit-prep", spec.kbit_prep), (f"--loss {spec.loss}", spec.loss != "model"),
                                        ("--keep-outputs", spec.keep_outputs), ("--ema", spec.ema), ("--use-cache/--no-cache", spec.use_cache is not None), (f"--step-kind {spec.step_kind}", spec.step_kind),
                                        ("--liger", spec.liger))
                  if on]
    if unmodelled:
        raise MemlensError(f"--method formula has no terms for {', '.join(unmodelled)}",
                           hint="drop --method formula: the simulation runs them")
    source = resolve(spec.model)
    if source.kind == "factory":
        raise MemlensError(f"--method formula needs a transformers config (layers, hidden size, vocabulary); "
                           f"{spec.model} is a factory", hint="drop --method formula: simulate runs any factory")
    if spec.compile or spec.hf_trainer:
        raise MemlensError("--method formula has no terms for " + ("--compile" if spec.compile else "the Trainer's step (--hf-trainer)"),
                           hint="drop --method formula: the simulation runs it")
    if source.task not in ("causal-lm", "masked-lm", "vlm", "clip", "image-classification") or (
            source.task == "image-classification" and not hasattr(source.config, "patch_size")):
        raise MemlensError(f"--method formula has no activation terms for {source.name} ({source.task})",
                           hint="drop --method formula: the simulation runs it")
    with torch.device("meta"), quiet():
        built = build(spec.replace(batch_size=1, seq_len=min(spec.seq_len or 8, 8)) if source.task in ("causal-lm", "masked-lm") else spec.replace(batch_size=1), source)
    model = built.model
    seen, p_bytes, t_numel, t_bytes, buf = set(), 0, 0, 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        p_bytes += p.numel() * p.element_size()
        if p.requires_grad:
            t_numel += p.numel()
            t_bytes += p.numel() * p.element_size()
    for b in model.buffers():
        buf += b.numel() * b.element_size()
    block = 0
    if plan.sharding.shards_parameters:   # FSDP2 gathers one block's parameters whole (memlens.step.parallel.fsdp)

        block = max((sum(p.numel() * p.element_size() for p in b.parameters()) for b in find_blocks(model)), default=p_bytes)
    return source, p_bytes, t_numel, t_bytes, buf, block


def formula_terms(spec: TrainingSpec, plan: StepPlan | None = None) -> tuple[list[Term], list[Term], dict]:
    """(forward/backward terms, optimizer-step terms, facts) of the closed form (``plan``: the spec's, if made)."""
    if spec.lengths:
        raise MemlensError("--lengths is read by `memlens estimate` (simulated) only: one step has one shape",
                           hint="run memlens estimate --lengths FILE, then use the shape it names here")
    plan = plan or _plan_of(spec)
    source, p_bytes, t_numel, t_bytes, buf, block = _counts(plan)
    ws = 2 * gpu_facts(spec.gpu).cublas_workspace_bytes  # one per handle: forward thread and autograd thread
    cfg = source.config
    text = getattr(cfg, "text_config", None) or cfg
    H = getattr(text, "hidden_size", None) or getattr(text, "n_embd", 768)
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", 12)
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", 12)
    V = getattr(text, "vocab_size", 0)
    B = spec.batch_size
    if source.task == "image-classification":
        L = (spec.image_size or cfg.image_size) ** 2 // cfg.patch_size**2 + 1
    else:
        L = default_seq_len(spec, source)
    e = 2 if spec.precision != "fp32" else 4
    fam = FAMILY.get(cfg.model_type, "default")
    tokens = B * L
    act, act_why = _activations(spec, fam, layers, heads, B, L, H, e)
    logits = 0
    logits_why = ""
    if source.task in ("causal-lm", "vlm", "masked-lm") and V:
        # logits in the activation dtype, the fp32 upcast / log-softmax output, and its gradient
        logits = tokens * V * (e + 4 + 4)
        logits_why = f"B*L*V logits ({e} B) + fp32 log-softmax ({4} B) + its gradient ({4} B)"
    bpe = 2 if spec.param_dtype != "float32" else 4
    st = _states(plan, p_bytes, t_numel, t_bytes, buf, block)
    fb = [
        Term(Category.PARAMETERS, st.params + st.gathered, f"{p_bytes / 2**30:.2f} GiB of weights ({bpe} B each unless quantized) + buffers"
             + (f"; {st.shard_why}" if st.shard_why else "") + ("; + 2 blocks gathered whole (the one running, the one prefetched)" if st.gathered else "")),
        Term(Category.GRADIENTS, st.grads + st.bucket, "one gradient per trainable parameter, in its dtype"
             + ("; + DDP's all-reduce buckets (a copy of the gradients)" if st.bucket else "")),
        Term(Category.OPTIMIZER_STATE, st.opt_bytes, f"{spec.optimizer}: states per trainable parameter"),
        Term(Category.ACTIVATIONS, act, act_why),
        Term(Category.TEMPORARIES, logits, logits_why or "none counted"),
        Term(Category.WORKSPACE, ws, "cuBLAS workspaces (forward and autograd threads)"),
    ]
    opt = [
        Term(Category.PARAMETERS, st.params, "weights"),
        Term(Category.GRADIENTS, st.grads + st.bucket, "all gradients exist during the step" + ("; + DDP's buckets" if st.bucket else "")),
        Term(Category.OPTIMIZER_STATE, st.opt_bytes, "states"),
        Term(Category.TEMPORARIES, st.opt_tmp, f"{spec.optimizer} multi-tensor (foreach) temporaries, one parameter-sized list"),
        Term(Category.WORKSPACE, ws, "cuBLAS workspaces"),
    ]
    facts = {"hidden_size": H, "layers": layers, "heads": heads, "vocab_size": V, "tokens_per_micro_batch": tokens,
             "family": fam, "trainable_param_count": t_numel, "param_bytes": p_bytes}
    return fb, opt, facts


def _activations(spec: TrainingSpec, fam: str, layers: int, heads: int, B: int, L: int, H: int, e: int) -> tuple[int, str]:
    """(bytes, why) of the activations the layers keep: the family's constant per token, fewer under checkpointing,
    plus eager attention's score matrices."""
    c = ACT_PER_TOKEN[fam]
    tokens = B * L
    ck = layers if spec.checkpoint_layers is None else min(
        spec.checkpoint_layers if isinstance(spec.checkpoint_layers, int) else len(spec.checkpoint_layers), layers)
    if spec.grad_checkpointing and ck < layers:   # some layers: their inputs, the others' whole activations
        act = ck * tokens * H * e + int((layers - ck) * c * tokens * H * e)
        act_why = (f"checkpointing {ck} of {layers} layers: their inputs of B*L*H*{e} B + {layers - ck} layers x {c:g} x "
                   f"B*L*H x {e} B")
    elif spec.grad_checkpointing:
        act = layers * tokens * H * e + int(c * tokens * H * e)  # layer inputs + one layer recomputed
        act_why = f"checkpointing: {layers} layer inputs of B*L*H*{e} B + one layer recomputed ({c:g}*B*L*H*{e} B)"
    else:
        act = int(layers * c * tokens * H * e)
        act_why = f"{layers} layers x {c:g} x B*L*H x {e} B ({fam} family constant, Korthikanti-style)"
    if spec.attn == "eager":
        extra = layers * B * heads * L * L * (e + 4 + (1 if fam in ("gpt2", "bert") else 0))
        act += extra * (layers - ck) // layers if spec.grad_checkpointing else extra
        act_why += "; eager attention keeps B*heads*L*L scores, probabilities (fp32) and dropout masks per layer"
    return act, act_why


@dataclass
class _States:
    """The model states of one rank, in bytes, as the sharding splits them."""

    params: int
    grads: int
    opt_bytes: int
    opt_tmp: int
    gathered: int        # FSDP2: two blocks' parameters gathered whole
    bucket: int          # DDP's all-reduce buckets (a copy of the gradients)
    shard_why: str


def _states(plan: StepPlan, p_bytes: int, t_numel: int, t_bytes: int, buf: int, block: int) -> _States:
    spec, sh = plan.spec, plan.sharding
    opt_bytes = plan.optimizer.state_bytes(t_numel, t_bytes)   # state and step-temporary bytes (memlens.core.optimizers)
    opt_tmp = plan.optimizer.temporary_bytes(t_numel, t_bytes)
    if spec.offload_optimizer:
        opt_bytes, opt_tmp = 0, 0
    shard = shard_degree(spec)      # HSDP: its shard group; FSDP2 x TP: the data-parallel ranks
    grads = t_bytes
    params = p_bytes + buf
    if shard > 1:
        opt_bytes //= shard
        opt_tmp //= shard
        if sh.shards_gradients:
            grads //= shard
        if sh.shards_parameters:
            params //= shard
    gathered = 0
    shard_why = ""
    if shard > 1:
        split = ["optimizer states"] + (["gradients"] if sh.shards_gradients else []) + \
            (["parameters"] if sh.shards_parameters else [])
        shard_why = f"{sh.name} over {shard} ranks: {', '.join(split)} / {shard} per rank"
    if sh.shards_parameters and spec.reshard_after_forward is not False:
        # FSDP2 all-gathers a block's parameters whole before it runs and prefetches the next one: two blocks at a time
        gathered = 2 * block
    bucket = 0
    if sh.family == "ddp" and not spec.gradient_as_bucket_view:
        bucket = grads   # DDP's Reducer copies every gradient into its flat all-reduce buckets (no views)
    return _States(params, grads, opt_bytes, opt_tmp, gathered, bucket, shard_why)


def _sharding_note(plan: StepPlan) -> str:
    spec, sh = plan.spec, plan.sharding
    if not sh.shards_optimizer_state:
        return "every rank holds the whole model states" + ("" if spec.gradient_as_bucket_view else " plus DDP's gradient buckets")
    split = ", ".join(n for n, on in (("parameters", sh.shards_parameters), ("gradients", sh.shards_gradients)) if on)
    split = f"{split} and optimizer states" if split else "optimizer states"
    return f"{split} divided by {shard_degree(spec)}" + (
        "; two blocks' parameters gathered whole" if sh.shards_parameters and spec.reshard_after_forward is not False else "")


def formula_estimate(spec: TrainingSpec) -> Result:
    """The closed-form estimate as a Result (method "formula")."""
    gpu = gpu_facts(spec.gpu)
    plan = _plan_of(spec)
    fb, opt, facts = formula_terms(spec, plan)
    fb_total, opt_total = sum(t.bytes for t in fb), sum(t.bytes for t in opt)
    terms = fb if fb_total >= opt_total else opt
    peak = max(fb_total, opt_total)
    by_cat: dict[str, int] = {}
    for t in terms:
        by_cat[t.name] = by_cat.get(t.name, 0) + t.bytes
    reserved = int(peak * 1.05)
    return finish(Result(
        verb="estimate",
        spec=spec.to_dict(),
        peak_allocated_bytes=peak,
        peak_reserved_bytes=reserved,
        by_category=by_cat,
        by_phase={"forward/backward": {"peak_allocated_bytes": fb_total}, "optimizer": {"peak_allocated_bytes": opt_total}},
        notes=["closed form: model states exact, activations from per-family constants (approximate);",
               "peak_reserved_bytes assumes 5% allocator overhead; use --method simulate for exact figures."]
        + ([f"per rank of {plan.world_size} GPUs ({plan.sharding.name}): {_sharding_note(plan)}; NCCL's buffers and "
            "communication temporaries are not counted (--method simulate runs the wrapper)"] if plan.distributed else [])
        + (["--offload-optimizer: optimizer states and step on the CPU (no GPU bytes counted for them)"]
           if spec.offload_optimizer else []),
        data={"method": "formula", "peak_phase": "backward" if fb_total >= opt_total else "optimizer",
              "terms": [{"name": t.name, "bytes": t.bytes, "why": t.why} for t in terms],
              "forward_backward_terms": [{"name": t.name, "bytes": t.bytes, "why": t.why} for t in fb],
              "optimizer_terms": [{"name": t.name, "bytes": t.bytes, "why": t.why} for t in opt], "facts": facts,
              "cuda_context_bytes": gpu.cuda_context_bytes, "nvidia_smi_estimate_bytes": reserved + gpu.cuda_context_bytes,
              "gpu": gpu.to_dict()},
    ), spec)
