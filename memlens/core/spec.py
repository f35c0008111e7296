"""TrainingSpec: what is trained and how. Built from flags or YAML, validated, serializable.

>>> s = TrainingSpec(model="gpt2", batch_size=8, seq_len=1024, precision="amp-bf16")
>>> s.effective_batch_size
8
>>> TrainingSpec.from_dict(s.to_dict()) == s
True
"""
from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from .errors import SpecError
from .gpus import gpu_facts
from .optimizers import (  # noqa: F401 - OPTIMIZERS re-exported
    HF_OPTIM_ALIASES,
    OPTIMIZERS,
    canonical_optimizer,
    optimizer_names,
)
from .parallel import SHARDING_NAMES, check_fields, data_parallel_ranks, is_distributed, sharding_names
from .precision import PRECISION_NAMES
from .precision import PRECISIONS as _PRECISION_FACTS

PRECISIONS = PRECISION_NAMES
ATTENTION = ("sdpa", "eager")
SHARDING = SHARDING_NAMES
GRAD_SAMPLE_MODES = ("hooks", "ghost")
CHECKPOINT_POLICIES = ("full", "selective", "torchtitan-op")
# how the loss is computed (causal LMs): the model's own from labels, or the user's criterion on the shifted
# logits, logits[:, :-1].reshape(-1, V) against labels[:, 1:], in the logits' dtype or upcast with .float()
LOSSES = ("model", "criterion", "criterion-fp32")   # Opacus' own names (make_private's grad_sample_mode)
# the trainers a step can be run as (--trainer): transformers' Trainer, TRL 1.16's SFT, DPO and GRPO trainers
TRAINERS = ("hf", "sft", "dpo", "grpo")
TRL_TRAINERS = ("sft", "dpo", "grpo")
PACKINGS = ("bfd", "bfd_split", "wrapped")   # TRL SFTConfig.packing_strategy


@dataclass(frozen=True)
class TrainingSpec:
    """One training configuration. Every field has the name of its CLI flag (``--batch-size`` ...)."""

    model: str
    batch_size: int = 1
    seq_len: int | None = None          # tokens per sample (text); None: 512 or the model's limit
    image_size: int | None = None       # pixels per side (vision); None: the model's config
    images_per_sample: int = 1          # VLMs: images per sample
    precision: str = None               # type: ignore[assignment]  # fp16/bf16: weights in that dtype; amp-*: fp32
                                        # weights + autocast; None: fp32, or bf16 with qlora (its compute dtype, as fit/compare use)
    grad_checkpointing: bool = False
    checkpoint_layers: int | tuple[int, ...] | None = None  # which blocks are checkpointed: the first N, or these
                                        # indices (0-based); None: all with grad_checkpointing ("all" and 0 normalize to that)
    checkpoint_policy: str = "full"     # CHECKPOINT_POLICIES: "full" recomputes a checkpointed block's whole forward; "selective"
                                        # keeps its matmul/attention/conv outputs and recomputes the rest; "torchtitan-op"
                                        # torchtitan's op-level SAC (every second mm recomputed) (models/checkpoint.py)
    offload_layers: int | tuple[int, ...] | str | None = None  # blocks whose saved tensors go to pinned host memory
                                        # (save_on_cpu): "all", the first N or these indices; None/0: none
    attn: str = "sdpa"
    optimizer: str = "adamw"
    lora_rank: int | None = None
    lora_alpha: float | None = None     # None: 2 x rank
    lora_targets: tuple[str, ...] | None = None  # None: q_proj,v_proj style defaults per architecture
    lora_dropout: float = 0.0           # peft LoraConfig.lora_dropout: nn.Dropout on each adapted layer's input before lora_A
    qlora: bool = False                 # 4-bit (NF4) frozen base weights, LoRA on top
    freeze: tuple[str, ...] = ()        # module-name patterns whose parameters get no gradient
    grad_accum: int = 1
    dp: bool = False                    # DP-SGD (Opacus): per-sample gradients
    physical_batch_size: int | None = None  # DP: micro-batch that is materialized at once
    grad_sample_mode: str | None = None  # DP: Opacus' "hooks" (per-sample gradients) or "ghost" (ghost clipping); None: hooks
    max_grad_norm: float | None = None   # clip gradients to this norm: clip_grad_norm_ before the optimizer step
                                         # (None/0: no clipping); under DP the per-sample clipping bound (None: 1.0)
    noise_multiplier: float | None = None  # DP: noise std / max_grad_norm (None: 1.0; memory does not depend on it)
    world_size: int = 1
    sharding: str = "none"
    offload_optimizer: bool = False     # optimizer states and step on the CPU (ZeRO-Offload style)
    gpu: str = "h100"                   # the GPU the estimate is for (memlens.core.gpus; `--gpu`)
    # several GPUs (memlens.step.parallel): FSDP2's reshard_after_forward (None: by --sharding);
    # DDP's gradient_as_bucket_view and bucket_cap_mb (None: DDP's default, 25)
    reshard_after_forward: bool | int | None = None
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float | None = None
    # meshes beyond one flat group (memlens.step.parallel.hsdp / .tp): HSDP's shard group (--sharding hsdp: FSDP2 on a
    # replicate x shard mesh), tensor parallel ranks (DTensor TP on the last mesh dim, composed with FSDP2 on the others);
    # context parallel (torch's ring attention, composed with FSDP2 over dp_shard x cp), pipeline stages (refused)
    shard_size: int | None = None
    tp: int = 1
    cp: int = 1
    pp: int = 1
    # --pp: torch.distributed.pipelining's schedule (memlens.step.parallel.pp), the stage simulated (None: every stage),
    # the virtual stages per rank of an interleaved schedule and the micro-batches the local batch is split into (None:
    # --batch-size, torchtitan's micro-batch of 1)
    pp_schedule: str = "1f1b"
    pp_stage: int | None = None
    virtual_stages: int = 1
    pp_microbatches: int | None = None
    loss_parallel: bool = False         # --tp: torchtitan's loss parallel (lm_head output vocab-sharded, loss on the shards)
    hf_trainer: bool = False            # run the step as transformers' Trainer does (step/loop.py)
    target_len: int | None = None       # seq2seq: decoder tokens per sample (None: the encoder's seq_len)
    compile: bool = False               # torch.compile'd model (estimator/compiled.py)
    liger: bool = False                 # liger-kernel's patched model (apply_liger_kernel_to_*: RMSNorm, SwiGLU, RoPE, fused
                                        # linear cross entropy; memlens.models.liger)
    step_kind: str | None = None        # a registered step kind by name (memlens.step.kinds); None: from dp/hf_trainer/compile
    loss: str = "model"                 # LOSSES: the model's loss from labels, or a criterion on the logits
    pad_fraction: float = 0.0           # text: share of padding tokens per sample (right padding: attention_mask 0, labels -100)
    kbit_prep: bool = False             # QLoRA: peft's prepare_model_for_kbit_training before LoRA (fp32 non-quantized
                                        # parameters, gradient checkpointing as peft enables it, input gradients)
    use_cache: bool | None = None       # transformers' KV cache during the training forward (config.use_cache): None: the
                                        # model config's (what a plain loop gets), False with --hf-trainer (the Trainer's)
    ema: bool | str = False             # EMA weights (diffusers' EMAModel, step/ema.py): True = its per-parameter loop, "foreach"
    keep_outputs: bool | None = None    # the loop holds the model's outputs (logits) through backward until its next
                                        # forward returns; None: the step kind's habit (DP-SGD loops keep them)
    lengths: str | None = None          # a file of the samples' token counts (memlens.core.lengths): the estimate is of the
                                        # step that peaks; seq_len is then the truncation length (TRL's max_length)
    # ---- the trainer (TRAINERS; memlens.step.kinds.trl): "hf" is hf_trainer=True; sft/dpo/grpo are TRL 1.16's, Trainers too
    trainer: str | None = None
    packing: str | None = None          # SFT: "bfd" (one padding-free row of batch x seq_len tokens, position_ids) | "wrapped"
    padding_free: bool = False          # SFT: the rows concatenated into one, position_ids instead of an attention mask
    prompt_len: int | None = None       # SFT (completion-only loss) / DPO: tokens of each row outside the loss (None: 0)
    precompute_ref_log_probs: bool = False  # DPO: reference log-probs precomputed with the dataset: no reference forward
    num_generations: int | None = None  # GRPO: completions per prompt (None: 8); --batch-size counts completions
    max_completion_length: int | None = None  # GRPO: completion tokens (None: 512); --seq-len is the prompt's tokens
    beta: float | None = None           # GRPO: KL coefficient; > 0 runs a reference model (None: 0.0, TRL 1.16's default)
    steps_per_generation: int | None = None   # GRPO: micro-batches one generation serves (None: grad_accum)
    vllm_gpu_memory_utilization: float | None = None  # GRPO: vLLM colocated, reserving this share of the GPU (None: HF generate)

    # ---------- validation ----------
    def __post_init__(self):
        _check_int(self, "batch_size", 1)
        _check_checkpoint_layers(self)
        _check_activation_plan(self)
        _check_int(self, "images_per_sample", 1)
        _check_int(self, "grad_accum", 1)
        _check_int(self, "world_size", 1)
        for name in ("seq_len", "image_size", "lora_rank", "physical_batch_size", "target_len"):
            if getattr(self, name) is not None:
                _check_int(self, name, 1)
        if self.precision is None:
            object.__setattr__(self, "precision", "bf16" if self.qlora else "fp32")
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("attn", self.attn, ATTENTION)
        _check_choice("loss", self.loss, LOSSES)
        if not (isinstance(self.ema, bool) or self.ema == "foreach"):
            raise SpecError(f"ema must be true, false or foreach, got {self.ema!r}", hint="--ema (or --ema foreach)")
        if self.use_cache is not None and not isinstance(self.use_cache, bool):
            raise SpecError(f"use-cache must be true or false, got {self.use_cache!r}", hint="--use-cache or --no-cache")
        _check_trainer(self)
        if self.use_cache and self.hf_trainer:
            raise SpecError("--use-cache with --hf-trainer: the Trainer sets config.use_cache = False (TrainingArguments.use_cache)",
                            hint="drop --use-cache")
        if self.lengths is not None and (not isinstance(self.lengths, str) or not self.lengths.strip()):
            raise SpecError(f"lengths must be a file path, got {self.lengths!r}", hint="e.g. --lengths lengths.txt (token counts, one per line)")
        if self.keep_outputs is not None and not isinstance(self.keep_outputs, bool):
            raise SpecError(f"keep-outputs must be true or false, got {self.keep_outputs!r}", hint="--keep-outputs or --drop-outputs")
        object.__setattr__(self, "optimizer", canonical_optimizer(self.optimizer))
        if self.optimizer not in optimizer_names():
            close = difflib.get_close_matches(str(self.optimizer), optimizer_names() + tuple(HF_OPTIM_ALIASES), n=1)
            raise SpecError(f"optimizer {self.optimizer!r} is not one memlens models ({', '.join(optimizer_names())}; "
                            f"Trainer names: {', '.join(HF_OPTIM_ALIASES)})",
                            hint=(f"did you mean {close[0]!r}? " if close else "") + "use --optimizer adamw-fused")
        if self.max_grad_norm is not None:
            if isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, (int, float)) or not 0 <= self.max_grad_norm < float("inf"):
                raise SpecError(f"max-grad-norm must be a number >= 0, got {self.max_grad_norm!r}", hint="e.g. --max-grad-norm 1.0 (0: no clipping)")
            if not self.dp:   # 0 = off, as in the Trainer; under DP-SGD clipping is the point (checked below)
                object.__setattr__(self, "max_grad_norm", float(self.max_grad_norm) or None)
        _check_choice("sharding", self.sharding, sharding_names())

        object.__setattr__(self, "gpu", gpu_facts(None if self.gpu is None else str(self.gpu)).name)
        if not isinstance(self.model, str) or not self.model.strip():
            raise SpecError("model is empty", hint="give --model gpt2 (see `memlens estimate --list-models`)")
        if self.seq_len is not None and self.seq_len > 1_048_576:
            raise SpecError(f"seq_len {self.seq_len} is impossibly long", hint="use at most 1048576 tokens")
        if self.target_len is not None and self.target_len > 1_048_576:
            raise SpecError(f"target_len {self.target_len} is impossibly long", hint="use at most 1048576 decoder tokens")
        if self.batch_size > 1_000_000:
            raise SpecError(f"batch_size {self.batch_size} is impossibly large", hint="use a micro-batch under 1000000")
        if self.qlora and self.lora_rank is None:
            raise SpecError("--qlora needs --lora-rank", hint="add --lora-rank 16 (QLoRA trains LoRA adapters on 4-bit weights)")
        if self.qlora and self.precision == "fp32":
            raise SpecError("--qlora with fp32 is not modelled: the 4-bit layers compute in bf16 or fp16 (bitsandbytes' "
                            "compute dtype)", hint="drop --precision (QLoRA defaults to bf16), or use bf16, amp-bf16 or fp16")
        if self.lora_alpha is not None and (isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float))
                                            or not self.lora_alpha > 0 or self.lora_alpha == float("inf")):
            raise SpecError(f"lora-alpha must be a positive number, got {self.lora_alpha!r}", hint="e.g. --lora-alpha 32 (default 2 x rank)")
        if self.lora_alpha is not None and self.lora_rank is None:
            raise SpecError("--lora-alpha needs --lora-rank", hint="add --lora-rank 16")
        if self.lora_targets is not None and not self.lora_targets:   # "" or []: not the default in disguise
            raise SpecError("--lora-targets is empty", hint="name modules, e.g. q_proj,v_proj, or leave it out for the defaults")
        if self.lora_targets is not None and self.lora_rank is None:
            raise SpecError("--lora-targets needs --lora-rank", hint="add --lora-rank 16")
        _check_fraction(self, "lora_dropout", "e.g. --lora-dropout 0.05")
        if self.lora_dropout and self.lora_rank is None:
            raise SpecError("--lora-dropout needs --lora-rank", hint="add --lora-rank 16 (the dropout is on the LoRA adapters' input)")
        _check_fraction(self, "pad_fraction", "e.g. --pad-fraction 0.25 (a quarter of each sample's tokens are padding)")
        if not isinstance(self.kbit_prep, bool):
            raise SpecError(f"kbit-prep must be true or false, got {self.kbit_prep!r}", hint="--kbit-prep")
        if self.kbit_prep and not self.qlora:
            raise SpecError("--kbit-prep needs --qlora: peft's prepare_model_for_kbit_training prepares a model with quantized base weights",
                            hint="add --qlora (with --lora-rank), or drop --kbit-prep")
        self._check_dp()
        _check_liger(self)
        if self.physical_batch_size is not None and not self.dp:
            raise SpecError("--physical-batch-size is a DP-SGD setting", hint="add --dp, or use --grad-accum for plain accumulation")
        if self.physical_batch_size is not None and self.physical_batch_size > self.batch_size:
            raise SpecError(
                f"max_physical_batch_size {self.physical_batch_size} > batch_size {self.batch_size}",
                hint="the physical batch is a part of the logical --batch-size (Opacus' BatchMemoryManager): keep it <= the batch",
            )
        check_fields(self)
        if self.step_kind is not None and (not isinstance(self.step_kind, str) or not self.step_kind.strip()):
            raise SpecError(f"step-kind must be a name, got {self.step_kind!r}", hint="omit it: the step kind follows --dp, --hf-trainer, --compile")

    def _check_dp(self) -> None:
        """DP-SGD settings need --dp; under --dp they get Opacus' defaults (hooks, max_grad_norm 1, noise 1)."""
        dp_only = {"grad_sample_mode": self.grad_sample_mode, "noise_multiplier": self.noise_multiplier}
        if not self.dp:
            for name, v in dp_only.items():
                if v is not None:
                    raise SpecError(f"--{name.replace('_', '-')} is a DP-SGD setting", hint="add --dp (Opacus)")
            return
        if self.grad_sample_mode is None:
            object.__setattr__(self, "grad_sample_mode", "hooks")
        _check_choice("grad_sample_mode", self.grad_sample_mode, GRAD_SAMPLE_MODES)
        for name, default, lowest in (("max_grad_norm", 1.0, None), ("noise_multiplier", 1.0, 0.0)):
            v = getattr(self, name)
            v = default if v is None else v
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise SpecError(f"{name.replace('_', '-')} must be a number, got {v!r}", hint=f"e.g. --{name.replace('_', '-')} 1.0")
            if (lowest is None and v <= 0) or (lowest is not None and v < lowest):
                raise SpecError(f"{name.replace('_', '-')} must be {'> 0' if lowest is None else '>= 0'}, got {v}",
                                hint=f"e.g. --{name.replace('_', '-')} 1.0")
            object.__setattr__(self, name, float(v))

    # ---------- derived ----------
    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step over all ranks: micro-batch x accumulation x data-parallel ranks."""
        return self.batch_size * self.grad_accum * data_parallel_ranks(self)

    @property
    def autocast_dtype(self) -> str | None:
        return _PRECISION_FACTS[self.precision].autocast

    @property
    def param_dtype(self) -> str:
        return _PRECISION_FACTS[self.precision].weights

    @property
    def uses_lora(self) -> bool:
        return self.lora_rank is not None

    # ---------- (de)serialization ----------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["trainer"] == "hf":       # hf_trainer says it
            d["trainer"] = None
        for name, default in (("trainer", None), ("packing", None), ("padding_free", False), ("prompt_len", None),
                              ("precompute_ref_log_probs", False), ("num_generations", None), ("max_completion_length", None),
                              ("beta", None), ("steps_per_generation", None), ("vllm_gpu_memory_utilization", None),
                              ("step_kind", None), ("loss", "model"), ("ema", False), ("keep_outputs", None), ("use_cache", None),
                              ("lengths", None), ("lora_dropout", 0.0), ("pad_fraction", 0.0), ("kbit_prep", False), ("liger", False),
                              ("checkpoint_layers", None), ("checkpoint_policy", "full"), ("offload_layers", None),
                              ("shard_size", None), ("tp", 1), ("cp", 1), ("pp", 1), ("loss_parallel", False),
                              ("pp_schedule", "1f1b"), ("pp_stage", None), ("virtual_stages", 1), ("pp_microbatches", None)):
            if d[name] == default:     # absent unless set
                del d[name]
        for k in ("checkpoint_layers", "offload_layers"):
            if isinstance(d.get(k), tuple):
                d[k] = list(d[k])
        for k in ("lora_targets", "freeze"):
            if d[k] is not None:
                d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainingSpec":
        if not isinstance(d, dict):
            raise SpecError("the spec must be a mapping of field: value", hint="see `memlens estimate --help` for the fields")
        known = {f.name for f in fields(cls)}
        clean: dict[str, Any] = {}
        for key, value in d.items():
            name = str(key).replace("-", "_")
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                raise SpecError(f"unknown spec field {key!r}", hint=f"did you mean {close[0]!r}?" if close else f"fields: {', '.join(sorted(known))}")
            clean[name] = _coerce(name, value)
        if "model" not in clean:
            raise SpecError("the spec has no model", hint="add `model: gpt2`")
        return cls(**clean)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "TrainingSpec":
        data = load_yaml(path)
        if isinstance(data, dict) and isinstance(data.get("spec"), dict):
            data = data["spec"]  # a memlens result.json / YAML with a spec section
        return cls.from_dict(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes: Any) -> "TrainingSpec":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def describe(self) -> str:
        """A short one-line description for tables."""
        parts = [self.model, f"b={self.batch_size}"]
        if self.seq_len:
            parts.append(f"L={self.seq_len}")
        if self.image_size:
            parts.append(f"img={self.image_size}")
        parts.append(self.precision)
        if self.grad_checkpointing:
            parts.append("ckpt" + ("" if self.checkpoint_layers is None else f"={checkpoint_layers_text(self.checkpoint_layers)}")
                         + ({"selective": "-selective", "torchtitan-op": "-titan-op"}.get(self.checkpoint_policy, "")))
        if self.offload_layers is not None:
            parts.append(f"offload={checkpoint_layers_text(self.offload_layers)}")
        if self.attn != "sdpa":
            parts.append(self.attn)
        parts.append(self.optimizer)
        if self.lora_rank:
            parts.append(("qlora" if self.qlora else "lora") + f"-r{self.lora_rank}")
        if self.lora_dropout:
            parts.append(f"lora-dropout={self.lora_dropout:g}")
        if self.kbit_prep:
            parts.append("kbit-prep")
        if self.pad_fraction:
            parts.append(f"pad={self.pad_fraction:g}")
        if self.lengths:
            parts.append(f"lengths={Path(self.lengths).name}")
        if self.grad_accum > 1:
            parts.append(f"accum={self.grad_accum}")
        if self.max_grad_norm and not self.dp:   # under DP it is Opacus' per-sample bound
            parts.append(f"clip={self.max_grad_norm:g}")
        if self.target_len:
            parts.append(f"T={self.target_len}")
        if self.compile:
            parts.append("compile")
        if self.liger:
            parts.append("liger")
        if self.hf_trainer:
            parts.append(trl_describe(self) if self.trainer in TRL_TRAINERS else "trainer")
        if self.step_kind:
            parts.append(f"kind={self.step_kind}")
        if self.loss != "model":
            parts.append(f"loss={self.loss}")
        if self.ema:
            parts.append("ema" if self.ema is True else "ema-foreach")
        if self.keep_outputs is not None:
            parts.append("keep-outputs" if self.keep_outputs else "drop-outputs")
        if self.use_cache is not None:
            parts.append("use-cache" if self.use_cache else "no-cache")
        if self.dp:
            parts.append(f"dp-{self.grad_sample_mode}" + (f" pb={self.physical_batch_size}" if self.physical_batch_size else ""))
        if is_distributed(self):
            parts.append(f"{self.sharding}x{self.world_size}")
        if self.shard_size is not None:
            parts.append(f"shard={self.shard_size}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.pp > 1:
            parts.append(f"pp={self.pp} {self.pp_schedule}" + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
                         + f" mb={self.pp_microbatches or self.batch_size}" + (f" stage={self.pp_stage}" if self.pp_stage is not None else ""))
        if self.loss_parallel:
            parts.append("loss-parallel")
        if self.reshard_after_forward is not None:
            parts.append(f"reshard={str(self.reshard_after_forward).lower()}")
        if self.gradient_as_bucket_view:
            parts.append("bucket-view")
        if self.bucket_cap_mb is not None:
            parts.append(f"bucket={self.bucket_cap_mb:g}MB")
        return " ".join(parts)


def load_yaml(path: str | Path) -> Any:
    """A --config file's YAML (a memlens spec, an axolotl config, a TRL recipe), or one line saying what is wrong."""
    p = Path(path)
    if not p.exists():
        raise SpecError(f"config file {p} does not exist", hint="check the path given to --config")
    if p.is_dir():
        raise SpecError(f"config {p} is a directory, not a YAML file", hint="give --config the path of a spec.yaml")
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise SpecError(f"cannot read config {p}: {e.strerror or e}", hint="check the path given to --config") from None
    except UnicodeDecodeError:
        raise SpecError(f"{p} is not valid YAML (not UTF-8 text)", hint="give --config a YAML text file (key: value per line)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(f"{p} is not valid YAML{where}", hint="fix the YAML syntax (key: value per line)") from None
    if data is None:
        raise SpecError(f"{p} is empty", hint="write at least `model: gpt2`")
    return data


def _check_liger(spec: TrainingSpec) -> None:
    """--liger: a bool, and not with the settings whose step memlens cannot run with liger's kernels."""
    if not isinstance(spec.liger, bool):
        raise SpecError(f"liger must be true or false, got {spec.liger!r}", hint="--liger")
    clash = (("--dp", spec.dp, "Opacus computes per-sample gradients from hooks on nn.Linear, which the fused linear "
              "cross entropy bypasses (the lm_head is never called)"),
             ("--compile", spec.compile, "the compiled step with liger's Triton kernels is not simulated"),
             (f"--checkpoint-policy {spec.checkpoint_policy}", spec.checkpoint_policy in ("selective", "torchtitan-op"),
              "selective checkpointing's cache of matmul outputs would hold the q/k projections liger's RoPE rotates in place"))
    for flag, on, why in clash:
        if spec.liger and on:
            raise SpecError(f"--liger with {flag} is not modelled: {why}", hint=f"drop {flag} or --liger")


def _check_int(spec: TrainingSpec, name: str, minimum: int) -> None:
    v = getattr(spec, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(f"{name.replace('_', '-')} must be a whole number, got {v!r}", hint=f"e.g. --{name.replace('_', '-')} 8")
    if v < minimum:
        raise SpecError(f"{name.replace('_', '-')} must be >= {minimum}, got {v}", hint=f"e.g. --{name.replace('_', '-')} 8")


def _check_fraction(spec: TrainingSpec, name: str, hint: str) -> None:
    """A number in [0, 1), stored as a float."""
    v = getattr(spec, name)
    flag = name.replace("_", "-")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        raise SpecError(f"{flag} must be a number >= 0 and < 1, got {v!r}", hint=hint)
    object.__setattr__(spec, name, float(v))


def parse_checkpoint_layers(value: Any) -> int | tuple[int, ...] | None:
    """``checkpoint_layers`` from a flag or YAML: "all" (None: every block, as --grad-checkpointing), a whole
    number N (the first N blocks) or a list of block indices ("0,2,5" or [0, 2, 5]); 0 or [] is none.

    >>> parse_checkpoint_layers("all"), parse_checkpoint_layers("8"), parse_checkpoint_layers("5,0,2"), parse_checkpoint_layers([3])
    (None, 8, (0, 2, 5), (3,))
    """
    bad = SpecError(f"checkpoint-layers must be all, a number of blocks or a list of block indices, got {value!r}",
                    hint="e.g. --checkpoint-layers 8 (the first 8 blocks) or --checkpoint-layers 0,2,4")
    if value is None or (isinstance(value, str) and value.strip().lower() == "all"):
        return None
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        if value < 0:
            raise bad
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return int(text)
        value = [v.strip() for v in text.strip("[]").split(",") if v.strip()]
        if not all(v.isdigit() for v in value):
            raise bad
        value = [int(v) for v in value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise bad
    return tuple(sorted(set(value)))


def checkpoint_layers_text(value: int | tuple[int, ...] | str) -> str:
    """How a spec names its checkpointed (or offloaded) blocks: "8" (the first 8), "[0,2,5]" or "all"."""
    return value if isinstance(value, str) else str(value) if isinstance(value, int) else "[" + ",".join(map(str, value)) + "]"


def parse_offload_layers(value: Any) -> int | tuple[int, ...] | str | None:
    """``offload_layers`` from a flag or YAML, parsed as ``checkpoint_layers``: "all", the first N, or indices;
    None, 0 or [] is none.

    >>> parse_offload_layers("all"), parse_offload_layers("2"), parse_offload_layers("3,1"), parse_offload_layers(0)
    ('all', 2, (1, 3), None)
    """
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "all":
        return "all"
    try:
        v = parse_checkpoint_layers(value)
    except SpecError:
        raise SpecError(f"offload-activations must be all, a number of blocks or a list of block indices, got {value!r}",
                        hint="e.g. --offload-activations 4 (the first 4 blocks) or --offload-activations 0,2") from None
    return None if v == 0 or v == () else v


def _check_activation_plan(spec: TrainingSpec) -> None:
    """``checkpoint_policy`` and ``offload_layers``: valid, and consistent with checkpointing."""
    _check_choice("checkpoint-policy", spec.checkpoint_policy, CHECKPOINT_POLICIES)
    if spec.checkpoint_policy != "full" and not spec.grad_checkpointing:
        raise SpecError(f"--checkpoint-policy {spec.checkpoint_policy} without checkpointing: it says how checkpointed blocks "
                        "recompute", hint="add --grad-checkpointing or --checkpoint-layers N")
    v = parse_offload_layers(spec.offload_layers)
    object.__setattr__(spec, "offload_layers", v)
    if v is None or not spec.grad_checkpointing:
        return
    ck = spec.checkpoint_layers
    both = (v == "all" or ck is None or (isinstance(v, int) and isinstance(ck, int) and min(v, ck) > 0)
            or set(range(v) if isinstance(v, int) else v) & set(range(ck) if isinstance(ck, int) else ck))
    if both:
        raise SpecError("a block both checkpointed and offloaded: checkpoint keeps only the block's inputs, held by its own "
                        "frame, not through saved_tensors_hooks, so save_on_cpu would offload nothing",
                        hint="offload blocks that are not checkpointed, e.g. --checkpoint-layers 0,1 --offload-activations 2,3")


def _check_checkpoint_layers(spec: TrainingSpec) -> None:
    """Normalize ``checkpoint_layers``: "all" -> None with grad_checkpointing on; 0 / [] -> none (checkpointing
    off); a subset switches grad_checkpointing on (it is checkpointing, of some blocks)."""
    v = parse_checkpoint_layers(spec.checkpoint_layers) if spec.checkpoint_layers is not None else None
    if spec.checkpoint_layers is not None and v is None:          # "all"
        object.__setattr__(spec, "grad_checkpointing", True)
    elif v == 0 or v == ():
        object.__setattr__(spec, "grad_checkpointing", False)
        v = None
    elif v is not None:
        object.__setattr__(spec, "grad_checkpointing", True)
    object.__setattr__(spec, "checkpoint_layers", v)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SpecError(f"{name} {value!r} is not one of {', '.join(choices)}", hint=hint + f"use --{name} {choices[0]}")


def _check_trainer(spec: TrainingSpec) -> None:
    """``trainer`` and the TRL fields: "hf" <-> hf_trainer; TRL's trainers are Trainers (hf_trainer too); each TRL
    field only with its trainer; GRPO's defaults (TRL 1.16 GRPOConfig) and its batch check."""
    t = spec.trainer
    if t is not None:
        _check_choice("trainer", t, TRAINERS)
        object.__setattr__(spec, "hf_trainer", True)
    elif spec.hf_trainer:
        object.__setattr__(spec, "trainer", "hf")
    own = {"packing": ("sft", spec.packing is not None), "padding_free": ("sft", spec.padding_free),
           "prompt_len": ("sft/dpo", spec.prompt_len is not None), "precompute_ref_log_probs": ("dpo", spec.precompute_ref_log_probs),
           **{n: ("grpo", getattr(spec, n) is not None) for n in ("num_generations", "max_completion_length", "beta",
                                                                 "steps_per_generation", "vllm_gpu_memory_utilization")}}
    for name, (whose, given) in own.items():
        if given and (t or "none") not in whose.split("/"):
            raise SpecError(f"--{name.replace('_', '-')} is a setting of TRL's {whose.upper()} trainer",
                            hint=f"add --trainer {whose.split('/')[0]}, or drop --{name.replace('_', '-')}")
    if spec.packing is not None:
        _check_choice("packing", spec.packing, PACKINGS)
    for name in ("prompt_len", "num_generations", "max_completion_length", "steps_per_generation"):
        if getattr(spec, name) is not None:
            _check_int(spec, name, 0 if name == "prompt_len" else 1)
    if spec.prompt_len is not None and spec.prompt_len >= (spec.seq_len or 512):
        raise SpecError(f"prompt-len {spec.prompt_len} leaves no token of the {spec.seq_len or 512}-token rows in the loss",
                        hint="give --prompt-len below --seq-len")
    if t != "grpo":
        return
    for name, default in (("num_generations", 8), ("max_completion_length", 512), ("beta", 0.0)):
        if getattr(spec, name) is None:
            object.__setattr__(spec, name, default)
    if isinstance(spec.beta, bool) or not isinstance(spec.beta, (int, float)) or not 0 <= spec.beta < float("inf"):
        raise SpecError(f"beta must be a number >= 0, got {spec.beta!r}", hint="e.g. --beta 0.04 (0: no reference model)")
    object.__setattr__(spec, "beta", float(spec.beta))
    u = spec.vllm_gpu_memory_utilization
    if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u < 1):
        raise SpecError(f"vllm-gpu-memory-utilization must be a number > 0 and < 1, got {u!r}", hint="e.g. 0.3 (TRL's default)")
    if spec.num_generations < 2:   # GRPOConfig.__post_init__
        raise SpecError(f"num-generations must be at least 2 (GRPO normalizes rewards within each group), got {spec.num_generations}",
                        hint="--num-generations 2 or more")
    gen = spec.batch_size * spec.world_size * (spec.steps_per_generation or spec.grad_accum)
    if gen % spec.num_generations:   # GRPOConfig.__post_init__: generation_batch_size % num_generations
        raise SpecError(f"the generation batch ({gen} completions: batch x GPUs x steps per generation) is not divisible by "
                        f"num_generations {spec.num_generations}, as TRL's GRPOConfig requires",
                        hint=f"use a --batch-size (or --grad-accum) that makes it a multiple of {spec.num_generations}")


def trl_describe(spec: TrainingSpec) -> str:
    """The TRL trainer's part of :meth:`TrainingSpec.describe`: "sft-bfd", "dpo-precomputed", "grpo-g8-c512-beta0.04-vllm0.3"."""
    words = [spec.trainer]
    if spec.trainer == "sft":
        words += [spec.packing] if spec.packing else []
        words += ["padding-free"] if spec.padding_free else []
    if spec.prompt_len:
        words.append(f"prompt{spec.prompt_len}")
    if spec.precompute_ref_log_probs:
        words.append("precomputed-ref")
    if spec.trainer == "grpo":
        words += [f"g{spec.num_generations}", f"c{spec.max_completion_length}"]
        words += [f"beta{spec.beta:g}"] if spec.beta else []
        words += [f"spg{spec.steps_per_generation}"] if spec.steps_per_generation else []
        words += [f"vllm{spec.vllm_gpu_memory_utilization:g}"] if spec.vllm_gpu_memory_utilization else []
    return "-".join(words)


_BOOLS = {"grad_checkpointing", "qlora", "kbit_prep", "dp", "offload_optimizer", "hf_trainer", "compile", "gradient_as_bucket_view",
          "keep_outputs", "use_cache", "liger", "padding_free", "precompute_ref_log_probs", "loss_parallel"}
_INTS = {"batch_size", "seq_len", "image_size", "images_per_sample", "lora_rank", "grad_accum", "physical_batch_size", "world_size",
         "shard_size", "tp", "cp", "pp", "pp_stage", "virtual_stages", "pp_microbatches", "target_len", "prompt_len", "num_generations", "max_completion_length", "steps_per_generation"}


def _coerce(name: str, value: Any) -> Any:
    """YAML-friendly coercion: '8' -> 8 for ints, 'q_proj,v_proj' -> tuple, yes/no -> bool."""
    if value is None:
        return None
    if name in _INTS and isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if name in _INTS and isinstance(value, float) and value.is_integer():
        return int(value)
    if name in _BOOLS:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise SpecError(f"{name.replace('_', '-')} must be true or false, got {value!r}", hint="write true or false")
    if name in ("lora_targets", "freeze"):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise SpecError(f"{name.replace('_', '-')} must be a list of names", hint="e.g. [q_proj, v_proj]")
        if not value and name == "lora_targets":   # not the default (None): refused, never read as "use the defaults"
            raise SpecError("--lora-targets is empty", hint="name modules (e.g. q_proj,v_proj, or all-linear), or drop the flag")
        return tuple(value)
    if name == "ema":   # true / false (as the other switches) or "foreach"; anything else: __post_init__ says what it takes
        text = str(value).strip().lower()
        bools = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
        return value if isinstance(value, bool) else "foreach" if text == "foreach" else bools.get(text, value)
    if name == "reshard_after_forward":
        return parse_reshard(value)
    if name == "bucket_cap_mb":
        try:
            return float(value) if not isinstance(value, bool) else value
        except (TypeError, ValueError):
            raise SpecError(f"bucket-cap-mb must be a number, got {value!r}", hint="e.g. --bucket-cap-mb 25") from None
    if name in ("lora_alpha", "max_grad_norm", "noise_multiplier", "lora_dropout", "pad_fraction", "beta", "vllm_gpu_memory_utilization"):
        try:
            return float(value)
        except (TypeError, ValueError):
            flag = name.replace("_", "-")
            raise SpecError(f"{flag} must be a number, got {value!r}", hint=f"e.g. --{flag} 1.0") from None
    return value


def parse_reshard(value: Any) -> bool | int:
    """FSDP2's reshard_after_forward from a flag or YAML: true/false, or a whole number.

    >>> parse_reshard("false"), parse_reshard("True"), parse_reshard("2"), parse_reshard(4)
    (False, True, 2, 4)
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "on"):
        return True
    if text in ("false", "no", "off"):
        return False
    if text.isdigit():
        return int(text)
    raise SpecError(f"reshard-after-forward must be true, false or a whole number, got {value!r}",
                    hint="e.g. --reshard-after-forward false")
