"""Flags shared by every verb that takes a TrainingSpec, and output helpers."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..core.errors import NoDeviceError, SpecError
from ..core.gpus import DEFAULT_GPU
from ..core.parallel import sharding_names
from ..core.spec import (
    ATTENTION,
    CHECKPOINT_POLICIES,
    GRAD_SAMPLE_MODES,
    LOSSES,
    OPTIMIZERS,
    PACKINGS,
    PRECISIONS,
    TRAINERS,
    TrainingSpec,
)
from ..integrations.configs import read_config
from ..integrations.trainer_args import spec_fields_from_file, weights_of_model


def whole(lowest: int):
    """argparse type: a whole number >= ``lowest`` (negative numbers parse, then are refused in one line)."""
    def parse(text: str) -> int:
        v = int(text)   # ValueError -> argparse's "invalid int value: 'x'"
        if v < lowest:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {lowest}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def positive(text: str) -> float:
    """argparse type: a finite number > 0 (seconds, minutes)."""
    v = float(text)
    if not (0 < v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return v


positive.__name__ = "float"


def add_trainer_args(g) -> None:
    """--trainer and TRL's settings that change one step's memory (memlens.step.kinds.trl; docs/trl.md)."""
    g.add_argument("--trainer", choices=TRAINERS, help="the step as a trainer runs it: hf = transformers' Trainer "
                   "(= --hf-trainer); sft, dpo, grpo = TRL 1.16's SFTTrainer, DPOTrainer, GRPOTrainer (fused LM head, no logits)")
    g.add_argument("--packing", choices=PACKINGS, help="SFT: bfd = one padding-free row of batch x seq-len tokens with "
                   "position_ids (TRL's default strategy); wrapped = rows of seq-len tokens")
    g.add_argument("--padding-free", action="store_const", const=True, help="SFT: the rows concatenated into one, no attention mask")
    g.add_argument("--prompt-len", type=int, metavar="N", help="SFT (completion-only / assistant-only loss), DPO: tokens "
                   "of each row outside the loss (default 0)")
    g.add_argument("--precompute-ref-log-probs", action="store_const", const=True,
                   help="DPO: reference log-probs precomputed with the dataset (no reference model, no reference forward)")
    g.add_argument("--num-generations", type=int, metavar="N", help="GRPO: completions per prompt (default 8); --batch-size counts completions")
    g.add_argument("--max-completion-length", type=int, metavar="N", help="GRPO: completion tokens (default 512); --seq-len is the prompt's")
    g.add_argument("--beta", type=float, metavar="B", help="GRPO: KL coefficient; > 0 keeps a reference model (default 0.0)")
    g.add_argument("--steps-per-generation", type=int, metavar="N", help="GRPO: micro-batches one generation serves (default --grad-accum)")
    g.add_argument("--vllm-gpu-memory-utilization", type=float, metavar="F",
                   help="GRPO: completions from vLLM colocated, which reserves this share of the GPU outside torch (TRL's default 0.3)")


def add_spec_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    """The spec flags (exact names reused by every verb). Defaults are None so YAML values show through."""
    g = p.add_argument_group("training spec (flags override --config)")
    _add_model_args(g)
    _add_memory_args(g)
    _add_step_args(g)
    _add_lora_args(g)
    _add_batch_args(g)
    _add_dp_args(g)
    _add_gpus_args(g)


def _add_model_args(g) -> None:
    """Spec flags: the model and what one sample holds."""
    g.add_argument("--config", metavar="SPEC.yaml", help="YAML file with spec fields, an axolotl config or a TRL recipe "
                   "(docs/configs.md; flags given too win)")
    g.add_argument("--model", help="built-in name | Hugging Face id | directory or config.json | pkg.module:factory")
    g.add_argument("--batch-size", type=int, metavar="N", help="micro-batch per GPU (default 1)")
    g.add_argument("--seq-len", type=int, metavar="N", help="tokens per sample (default 512, capped at the model's limit)")
    g.add_argument("--image-size", type=int, metavar="PX", help="image side in pixels (vision models; default from config)")
    g.add_argument("--images-per-sample", type=int, metavar="N", help="images per sample (VLMs; default 1)")


def _add_memory_args(g) -> None:
    """Spec flags: precision, checkpointing and activation offload."""
    g.add_argument("--precision", choices=PRECISIONS, help="fp16/bf16: weights in that dtype; amp-*: fp32 weights under autocast (default fp32)")
    g.add_argument("--grad-checkpointing", action="store_const", const=True, help="recompute activations in backward")
    g.add_argument("--checkpoint-layers", metavar="all|N|I,J,...",
                   help="checkpoint only some blocks: the first N, or these block indices (0-based); all = --grad-checkpointing")
    g.add_argument("--checkpoint-policy", choices=CHECKPOINT_POLICIES,
                   help="how checkpointed blocks recompute: full = their whole forward (default); selective = keep matmul, "
                        "attention and conv outputs, recompute the rest (torch's selective activation checkpointing); torchtitan-op = "
                        "torchtitan's selective op AC: keep every other matmul's output (the 1st, 3rd, ... of a block), "
                        "flash / memory-efficient attention and reduce-scatter outputs")
    g.add_argument("--offload-activations", dest="offload_layers", metavar="all|N|I,J,...",
                   help="blocks whose saved activations go to pinned host memory in forward and come back in backward "
                        "(torch.autograd.graph.save_on_cpu): all, the first N, or these block indices")


def _add_step_args(g) -> None:
    """Spec flags: attention, optimizer and the step that runs (the Trainer's, TRL's, compiled, liger, outputs, EMA)."""
    g.add_argument("--attn", choices=ATTENTION, help="attention implementation (default sdpa)")
    g.add_argument("--optimizer", metavar="NAME", help=f"{' | '.join(OPTIMIZERS)} (default adamw = torch's foreach AdamW); "
                   "Trainer optim names (adamw_torch_fused, adafactor, adamw_bnb_8bit, ...) are accepted")
    g.add_argument("--max-grad-norm", type=float, metavar="X", help="clip gradients with clip_grad_norm_(X) before the step (0: off); with --dp: Opacus' per-sample clipping bound (default 1.0)")
    g.add_argument("--hf-trainer", action="store_const", const=True,
                   help="the step as transformers' Trainer runs it (fp32 outputs under AMP, decay/no-decay groups)")
    add_trainer_args(g)
    g.add_argument("--trainer-args", metavar="FILE", help="TrainingArguments as JSON (to_json_string) or YAML: sets batch, "
                   "accumulation, precision, checkpointing, optimizer, clipping and --hf-trainer as the Trainer would "
                   "(--precision then names the model's weights, default the config's dtype as from_pretrained loads it; "
                   "other flags override the file)")
    g.add_argument("--target-len", type=int, metavar="N", help="encoder-decoder models: decoder tokens per sample (default: the encoder's)")
    g.add_argument("--compile", action="store_const", const=True, help="the torch.compile'd step (see docs/trainers.md: --compile)")
    g.add_argument("--liger", action="store_const", const=True, help="liger-kernel's patched model, as apply_liger_kernel_to_llama() "
                   "(qwen2, qwen3, mistral) or TRL's use_liger_kernel: its RMSNorm, SwiGLU, RoPE and fused linear cross entropy "
                   "(no logits tensor) (docs/liger.md)")
    g.add_argument("--loss", choices=LOSSES, help="causal LMs: model = the model's own loss from labels (default); criterion = "
                   "your criterion on logits[:, :-1].reshape(-1, V) against labels[:, 1:]; criterion-fp32 = the same on .float() logits")
    ko = g.add_mutually_exclusive_group()   # a pair that says yes and no is refused, not "the last one wins"
    ko.add_argument("--keep-outputs", dest="keep_outputs", action="store_const", const=True,
                   help="your loop holds the model's outputs (logits = model(x).logits; outputs = model(**batch)) through "
                        "backward until the next forward returns (default with --dp, as Opacus loops do)")
    ko.add_argument("--drop-outputs", dest="keep_outputs", action="store_const", const=False,
                   help="your loop keeps only the loss (a function returns it; the Trainer; default without --dp)")
    g.add_argument("--ema", nargs="?", const=True, choices=("foreach",), metavar="foreach",
                   help="EMA weights as diffusers' EMAModel keeps them: a copy of the trainable parameters on the GPU, updated "
                        "after each optimizer step (foreach: its foreach update, one more parameter copy while it runs)")


def _add_lora_args(g) -> None:
    """Spec flags: LoRA / QLoRA, the KV cache and k-bit preparation."""
    g.add_argument("--lora-rank", type=int, metavar="R", help="train LoRA adapters of this rank (base frozen)")
    g.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA alpha (default 2 x rank)")
    g.add_argument("--lora-targets", metavar="M1,M2", help="module names to adapt, e.g. q_proj,v_proj")
    g.add_argument("--lora-dropout", type=float, metavar="P", help="peft's lora_dropout (0 <= P < 1, e.g. 0.05): a dropout "
                   "mask and a dropped copy of each adapted layer's input are saved for backward (needs --lora-rank; default 0)")
    g.add_argument("--qlora", action="store_const", const=True, help="4-bit NF4 base weights (needs --lora-rank)")
    uc = g.add_mutually_exclusive_group()
    uc.add_argument("--use-cache", dest="use_cache", action="store_const", const=True,
                   help="transformers builds its KV cache in the training forward (config.use_cache; the default of most configs)")
    uc.add_argument("--no-cache", dest="use_cache", action="store_const", const=False,
                   help="your loop sets model.config.use_cache = False (the Trainer does; fused-qkv models then keep their "
                        "qkv output for backward instead of the cache's K/V copies)")
    g.add_argument("--kbit-prep", action="store_const", const=True,
                   help="QLoRA: peft's prepare_model_for_kbit_training before LoRA: non-quantized parameters (norms, embeddings, "
                        "lm_head) in fp32, gradient checkpointing as peft enables it, input gradients (needs --qlora)")


def _add_batch_args(g) -> None:
    """Spec flags: padding, sample lengths, frozen parameters and accumulation."""
    g.add_argument("--pad-fraction", type=float, metavar="F", help="text models: share of padding tokens per sample "
                   "(0 <= F < 1; right padding): the batch gets an attention_mask and labels -100 there (default 0: no mask)")
    g.add_argument("--lengths", metavar="FILE", help="the samples' token counts (one per line, a JSON list or a JSON "
                   "{length: count}): the step that peaks, --seq-len being the truncation length (docs/lengths.md)")
    g.add_argument("--freeze", action="append", metavar="PATTERN", help="freeze parameters whose name matches (repeatable), e.g. vision_tower")
    g.add_argument("--grad-accum", type=int, metavar="N", help="micro-batches per optimizer step (default 1)")


def _add_dp_args(g) -> None:
    """Spec flags: DP-SGD with Opacus."""
    g.add_argument("--dp", action="store_const", const=True, help="DP-SGD with Opacus (per-sample gradients)")
    g.add_argument("--physical-batch-size", type=int, metavar="N",
                   help="DP-SGD: Opacus' BatchMemoryManager max_physical_batch_size (the --batch-size logical batch in parts)")
    g.add_argument("--grad-sample-mode", choices=GRAD_SAMPLE_MODES,
                   help="DP-SGD: Opacus' hooks (per-sample gradients) or ghost (ghost clipping, two backward passes) (default hooks)")
    g.add_argument("--noise-multiplier", type=float, metavar="S", help="DP-SGD: noise multiplier (default 1.0; no effect on memory)")


def _add_gpus_args(g) -> None:
    """Spec flags: several GPUs and the GPU the estimate is for."""
    g.add_argument("--world-size", type=int, metavar="N", help="GPUs, one rank each (default 1); --batch-size is per GPU")
    g.add_argument("--sharding", choices=sharding_names(),   # the registered ones too (memlens.core.parallel.register_sharding)
                   help="how --world-size GPUs train, as the PyTorch settings that realize it: ddp = DistributedDataParallel; "
                        "zero1 = DDP + ZeroRedundancyOptimizer (optimizer states split); zero2 = FSDP2 fully_shard with "
                        "reshard_after_forward=False (gradients and optimizer states split, parameters gathered from forward "
                        "to backward); zero3 = fsdp = FSDP2 fully_shard defaults (parameters split too, re-gathered in "
                        "backward). FSDP2 wraps each transformer block, then the root; amp-bf16 = "
                        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); hsdp = FSDP2 on a 2D mesh (replicate x "
                        "shard): sharded within --shard-size GPUs, replicated across the groups")
    g.add_argument("--reshard-after-forward", metavar="true|false|N",
                   help="FSDP2: free gathered parameters after forward (true, zero3/fsdp default), keep them (false, zero2), "
                        "or keep a shard over N GPUs")
    g.add_argument("--gradient-as-bucket-view", action="store_const", const=True,
                   help="DDP: gradients become views of the all-reduce buckets (saves one gradient copy)")
    g.add_argument("--bucket-cap-mb", type=float, metavar="MB", help="DDP: all-reduce bucket size (default 25)")
    g.add_argument("--shard-size", type=int, metavar="N", help="--sharding hsdp: the GPUs each parameter is sharded over "
                   "(e.g. one node's 8); the world / N groups are replicas")
    g.add_argument("--tp", type=int, metavar="N", help="tensor parallel GPUs (DTensor, torchtitan's Llama plan: colwise "
                   "q/k/v/gate/up, rowwise o/down, sequence-parallel norms) on the last mesh dim, FSDP2 on the others")
    g.add_argument("--loss-parallel", dest="loss_parallel", action="store_const", const=True,
                   help="--tp: torchtitan's loss parallel (its default with TP): lm_head's logits stay vocabulary-sharded "
                        "and the cross-entropy runs on the shards (torch's loss_parallel), no logits all-gather")
    g.add_argument("--cp", type=int, metavar="N", help="context parallel GPUs (torch's ring attention, torchtitan's "
                   "mesh): each holds 1/N of the sequence; FSDP2 shards over the data-parallel x context-parallel GPUs")
    g.add_argument("--pp", type=int, metavar="N", help="pipeline parallel ranks (torch.distributed.pipelining, torchtitan's "
                   "split: embedding on the first stage, norm + lm_head on the last), FSDP2 over each stage's GPUs")
    g.add_argument("--pp-schedule", dest="pp_schedule", metavar="NAME", help="--pp: torch's pipeline schedule, 1f1b "
                   "(default), gpipe or interleaved-1f1b; zero-bubble schedules are refused")
    g.add_argument("--pp-stage", dest="pp_stage", type=int, metavar="S", help="--pp: simulate only pipeline rank S "
                   "(default: every rank, the headline the one that peaks)")
    g.add_argument("--virtual-stages", dest="virtual_stages", type=int, metavar="V",
                   help="--pp-schedule interleaved-1f1b: stages per pipeline rank (2 or more)")
    g.add_argument("--pp-microbatches", dest="pp_microbatches", type=int, metavar="M",
                   help="--pp: micro-batches the local --batch-size is split into (default: --batch-size, micro-batches of 1)")
    g.add_argument("--deepspeed", metavar="DS_CONFIG.json", help="DeepSpeed ZeRO config: not modelled, refused "
                   "(memlens simulates PyTorch's own ZeRO: --sharding zero1/zero2/zero3)")
    g.add_argument("--offload-optimizer", action="store_const", const=True, help="optimizer states and step on the CPU")
    g.add_argument("--gpu", metavar="NAME", help="the GPU the estimate is for: its CUDA context, workspaces, attention kernels, "
                   "FLOP rates (default h100; `memlens estimate --list-gpus`)")


SPEC_FLAG_FIELDS = (
    "model", "batch_size", "seq_len", "image_size", "images_per_sample", "precision", "grad_checkpointing", "checkpoint_layers",
    "checkpoint_policy", "offload_layers",
    "attn", "optimizer", "lora_rank", "lora_alpha", "lora_targets", "qlora", "freeze", "grad_accum", "dp",
    "physical_batch_size", "grad_sample_mode", "max_grad_norm", "noise_multiplier", "world_size", "sharding",
    "offload_optimizer", "gpu", "hf_trainer", "target_len", "compile", "reshard_after_forward", "gradient_as_bucket_view",
    "bucket_cap_mb", "shard_size", "tp", "cp", "pp", "pp_schedule", "pp_stage", "virtual_stages", "pp_microbatches", "loss_parallel", "loss", "keep_outputs", "use_cache", "lora_dropout", "pad_fraction", "kbit_prep", "lengths", "ema", "liger",
    "trainer", "packing", "padding_free", "prompt_len", "precompute_ref_log_probs", "num_generations", "max_completion_length",
    "beta", "steps_per_generation", "vllm_gpu_memory_utilization",
)


def spec_from_args(args: argparse.Namespace) -> TrainingSpec:
    """Merge --config YAML and explicit flags into one validated TrainingSpec."""
    if getattr(args, "deepspeed", None):
        raise SpecError("DeepSpeed ZeRO configs (--deepspeed) are not modelled: memlens simulates PyTorch's own ZeRO "
                        "(ZeroRedundancyOptimizer, FSDP2)", hint="use --sharding zero1, zero2 or zero3 (see --help for their settings)")
    _check_flags(args)
    base: dict = {}
    if getattr(args, "config", None):   # a memlens spec, an axolotl config or a TRL recipe (integrations/configs.py)
        base, args.config_notes, _ = read_config(args.config, getattr(args, "trainer", None))
    skip = set()
    if getattr(args, "trainer_args", None):
        # with --trainer-args, --precision names the model's weights; the file's bf16/fp16 go over them

        model = getattr(args, "model", None) or base.get("model")
        weights = getattr(args, "precision", None) or base.get("precision") or (weights_of_model(model) if model else None)
        base.update(spec_fields_from_file(args.trainer_args, weights, getattr(args, "trainer", None) or base.get("trainer")))
        skip.add("precision")
    for name in SPEC_FLAG_FIELDS:
        v = getattr(args, name, None)
        if v is not None and name not in skip:
            base[name] = v
    if base.get("qlora") and getattr(args, "precision", None) is None and base.get("precision") == "fp32":
        base["precision"] = None   # a YAML spec's default fp32: QLoRA's default (bf16) instead
    if "model" not in base or not base["model"]:
        raise SpecError("no model given", hint="add --model gpt2 (or a YAML file with `model:` via --config)")
    return TrainingSpec.from_dict(base)


def _check_flags(args: argparse.Namespace) -> None:
    """Flags typed empty (``--gpu ""``: not the default in disguise) or that contradict each other: one line each."""
    for name in ("config", "trainer_args", *SPEC_FLAG_FIELDS):
        v = getattr(args, name, None)
        if (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and any(not str(x).strip() for x in v)):
            flag = "offload-activations" if name == "offload_layers" else name.replace("_", "-")
            raise SpecError(f"--{flag} is empty", hint=f"give --{flag} a value, or leave it out for its default")
    layers = getattr(args, "checkpoint_layers", None)
    if getattr(args, "grad_checkpointing", None) and layers is not None and str(layers).strip().lower() != "all":
        raise SpecError(f"--grad-checkpointing checkpoints every block and --checkpoint-layers {layers} only some",
                        hint=f"give one of them: --checkpoint-layers {layers} alone checkpoints those blocks")


def add_budget_args(g, budget_help: str) -> None:
    """--budget, --margin, --context: the one fit rule's inputs (memlens.core.fits), the same for every verb."""
    g.add_argument("--budget", metavar="SIZE", help=budget_help + "; per GPU, with a unit (16GiB, 24GB); default with --gpu: "
                   "that GPU's whole memory. Fits: peak reserved + CUDA context <= budget - margin (docs/budget.md)")
    g.add_argument("--margin", metavar="F|SIZE", help="safety margin off the budget: a fraction below 1 (0.05) or a size "
                   "(512MiB); default 5%%, at least 256 MiB")
    g.add_argument("--context", metavar="SIZE", help="CUDA context taken off the budget (default: the --gpu's, 740MiB; 0 "
                   "for an allocator-only limit)")


def budget_of(args: argparse.Namespace, spec: TrainingSpec) -> str | None:
    """--budget as typed; without it, the whole memory of the GPU --gpu names ("total"); else None."""
    if args.budget is not None:
        return args.budget
    return "total" if getattr(args, "gpu", None) is not None or spec.gpu != DEFAULT_GPU else None


def given_fields(args: argparse.Namespace) -> set[str]:
    """The spec fields the user set with flags (compare's technique rows change none of them on the side)."""
    return {name for name in SPEC_FLAG_FIELDS if getattr(args, name, None) is not None}


def warn_budget(data: dict) -> None:
    """A budget taken as the GPU's total memory (given above it, within its nominal size): one line on stderr."""
    if data.get("budget_warning"):
        print(f"WARNING: {data['budget_warning']}", file=sys.stderr)


def add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the Result JSON on stdout")
    g.add_argument("--out", metavar="DIR", help="also write result.json (and plots) into DIR")


def emit_json(result) -> None:
    sys.stdout.write(result.to_json() + "\n")


def out_dir(args: argparse.Namespace) -> Path | None:
    if not getattr(args, "out", None):
        return None
    return writable_dir(args.out)


def writable_dir(path: str | Path) -> Path:
    """``path`` as a directory this process can write files in (made if missing), or SpecError."""
    d = Path(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecError(f"cannot create output directory {d}: {e.strerror}", hint="choose a writable --out DIR") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise SpecError(f"output directory {d} cannot be written", hint="choose a writable --out DIR")
    return d


def require_cuda(device: str) -> None:
    """One clear line when a measured run asks for CUDA on a machine without it."""
    if not device.startswith("cuda"):
        return
    try:
        import torch  # heavy: torch, loaded on first use

        ok = torch.cuda.is_available()
    except ImportError:
        ok = False
    if not ok:
        raise NoDeviceError("--measure needs a CUDA GPU and this machine has none",
                            hint="drop --measure for estimates, or --device cpu to time the steps only")
