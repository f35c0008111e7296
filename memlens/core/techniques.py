"""The one table of memory-saving techniques: what each changes in a spec, what kind of change it
is, and what it is expected to cost. ``compare`` shows them side by side, ``fit``'s plan ranks
them, ``doctor`` advises them.

Kinds: ``same math`` (training computes the same thing: checkpointing, accumulation, offload,
sharding), ``numerics`` (the same model in other number formats or another optimizer), ``changes
the model`` (what is trained changes: LoRA, QLoRA), ``changes the privacy`` (DP-SGD with Opacus'
hooks or ghost clipping, or without it).

>>> from memlens.core.spec import TrainingSpec
>>> s = TrainingSpec(model="gpt2", batch_size=8)
>>> apply(s, "amp-fp16+checkpointing").describe()
'gpt2 b=8 amp-fp16 ckpt adamw'
>>> TECHNIQUES["checkpointing"].kind, TECHNIQUES["lora"].kind
('same math', 'changes the model')
>>> dp = TrainingSpec(model="gpt2", batch_size=16, dp=True, physical_batch_size=4)
>>> [apply(dp, t).describe() for t in ("dp-ghost", "non-private")]
['gpt2 b=16 fp32 adamw dp-ghost pb=4', 'gpt2 b=4 fp32 adamw accum=4']
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable

from .errors import MemlensError
from .parallel import is_distributed
from .spec import TrainingSpec

EXACT, NUMERICS, MODEL, PRIVACY = "same math", "numerics", "changes the model", "changes the privacy"

Changes = dict[str, Any] | Callable[[TrainingSpec, "Context"], dict[str, Any]]


@dataclass(frozen=True)
class Context:
    """Parameters some techniques take: the GPUs a sharded plan spreads over, the LoRA rank."""

    gpus: int = 8
    lora_rank: int = 16


@dataclass(frozen=True)
class Technique:
    name: str                  # the name compare / sweep take (`--techniques amp-bf16,checkpointing`)
    title: str                 # how a plan or advice names it
    changes: Changes           # spec fields it sets (a dict, or a function of the spec)
    kind: str                  # EXACT | NUMERICS | MODEL | PRIVACY
    cost: str                  # what it is expected to cost, in words
    applies: Callable[[TrainingSpec], bool] = lambda s: True   # does it change anything for this spec?
    side: tuple[str, ...] = ()  # fields it changes beyond what its name says (QLoRA: fp32 -> bf16 compute); a caller's
                                # ``keep`` (the fields a user gave) holds against them (:func:`apply`)

    def spec_changes(self, spec: TrainingSpec, ctx: Context | None = None) -> dict[str, Any]:
        return self.changes(spec, ctx or Context()) if callable(self.changes) else dict(self.changes)

    def label(self, ctx: Context | None = None) -> str:
        ctx = ctx or Context()
        return self.title.format(gpus=ctx.gpus, rank=ctx.lora_rank)


def _accumulation(spec: TrainingSpec, ctx: Context) -> dict[str, Any]:
    """The seeds' accumulation: the same effective batch in 4 (or 2) micro-batches."""
    k = next((k for k in (4, 2) if spec.batch_size % k == 0 and spec.batch_size >= k), None)
    if k is None:
        raise MemlensError(f"accumulation needs a batch divisible by 2 (batch is {spec.batch_size})", hint="use --batch-size 8")
    return {"batch_size": spec.batch_size // k, "grad_accum": spec.grad_accum * k}


def _halve(spec: TrainingSpec, ctx: Context) -> dict[str, Any]:
    if spec.batch_size < 2:
        raise MemlensError("the micro-batch is 1 already", hint="use checkpointing or a smaller --seq-len")
    return {"batch_size": spec.batch_size // 2, "grad_accum": spec.grad_accum * 2}


def _qlora(spec: TrainingSpec, ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {"lora_rank": spec.lora_rank or ctx.lora_rank, "qlora": True}
    if spec.precision == "fp32":
        out["precision"] = "bf16"
    return out


def _non_private(spec: TrainingSpec, ctx: Context) -> dict[str, Any]:
    """The same logical batch without DP-SGD: physical-size micro-batches with plain accumulation."""
    out: dict[str, Any] = {"dp": False, "physical_batch_size": None, "grad_sample_mode": None, "max_grad_norm": None,
                           "noise_multiplier": None}
    pb = spec.physical_batch_size
    if pb and pb < spec.batch_size and spec.batch_size % pb == 0:
        out.update(batch_size=pb, grad_accum=spec.grad_accum * (spec.batch_size // pb))
    return out


def _full_ft_8bit(spec: TrainingSpec, ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {"optimizer": "adamw-8bit"}
    if spec.precision not in ("fp16", "bf16"):
        out["precision"] = "bf16"
    if not spec.grad_checkpointing:
        out["grad_checkpointing"] = True
    return out


_fp32 = lambda s: s.precision == "fp32"   # noqa: E731
_no_dp = lambda s: not s.dp               # noqa: E731 - Opacus refuses it (memlens.step.kinds.opacus.check_spec)
ADAM = ("adamw", "adam", "adamw-fused", "adam-fused")   # full-precision Adam states a switch of optimizer saves
_full = lambda s: not s.uses_lora          # noqa: E731
_one_gpu = lambda s: not is_distributed(s)   # noqa: E731 - which of these a step runs is its kind's word (StepKind.offers)

TECHNIQUES: dict[str, Technique] = {t.name: t for t in (
    Technique("fp32", "fp32", {"precision": "fp32"}, NUMERICS, "fp32 everything: the baseline of mixed precision"),
    Technique("amp-fp16", "AMP fp16", {"precision": "amp-fp16"}, NUMERICS,
              "fp16 autocast + GradScaler: activations in half, fp32 master weights; loss scaling",
              lambda s: _fp32(s) and _no_dp(s)),
    Technique("amp-bf16", "AMP bf16", {"precision": "amp-bf16"}, NUMERICS,
              "bf16 autocast: activations in half, fp32 master weights; faster matmuls", _fp32),
    Technique("bf16", "bf16 weights", {"precision": "bf16"}, NUMERICS,
              "pure bf16 training: half the model states; watch for precision loss in the update",
              lambda s: s.precision not in ("fp16", "bf16") and not s.qlora),
    Technique("fp16", "fp16 weights", {"precision": "fp16"}, NUMERICS, "pure fp16 training: overflow-prone without loss scaling",
              lambda s: s.precision not in ("fp16", "bf16") and not s.qlora),
    Technique("checkpointing", "checkpointing", {"grad_checkpointing": True}, EXACT,
              "recomputes the forward in backward (~+33% compute)", lambda s: not s.grad_checkpointing and _no_dp(s)),
    Technique("accumulation", "accumulation x4", _accumulation, EXACT,
              "the same effective batch in 4 micro-batches: a quarter of the activations, more steps", _no_dp),
    Technique("halve-batch", "halve micro-batch, double accumulation", _halve, EXACT,
              "the same effective batch, about half the activations", lambda s: s.batch_size > 1 and _no_dp(s)),
    # the rank a spec already has stays (compare --lora-rank 8: the LoRA rows are r=8, never the default 16)
    Technique("lora", "LoRA r={rank}", lambda s, c: {"lora_rank": s.lora_rank or c.lora_rank}, MODEL,
              "trains low-rank adapters only; base frozen", _full),
    Technique("qlora", "QLoRA r={rank}", _qlora, MODEL, "4-bit NF4 frozen base + LoRA adapters (bitsandbytes)",
              lambda s: not s.qlora, side=("precision",)),
    Technique("adamw-8bit", "8-bit AdamW", {"optimizer": "adamw-8bit"}, NUMERICS,
              "bitsandbytes AdamW8bit: states in 8 bits, 2 B/param instead of 8",
              lambda s: s.optimizer in ADAM and not s.uses_lora),
    Technique("adafactor", "Adafactor", {"optimizer": "adafactor"}, NUMERICS,
              "factored second moment, no first moment: tiny states", lambda s: s.optimizer in ADAM and not s.uses_lora),
    Technique("sgd", "SGD", {"optimizer": "sgd"}, NUMERICS, "no optimizer state; needs another learning-rate schedule",
              lambda s: s.optimizer != "sgd"),
    Technique("full-8bit", "bf16 + checkpointing + 8-bit AdamW", _full_ft_8bit, NUMERICS,
              "everything that keeps full fine-tuning",
              lambda s: s.optimizer in ADAM and not s.uses_lora and not (s.precision in ("fp16", "bf16") and s.grad_checkpointing)),
    Technique("offload", "CPU offload of the optimizer", {"offload_optimizer": True}, EXACT,
              "ZeRO-Offload: optimizer states and step on the CPU; PCIe transfers each step",
              lambda s: not s.offload_optimizer and not s.uses_lora),
    Technique("ddp", "DDP over {gpus} GPUs", lambda s, c: {"world_size": c.gpus, "sharding": "ddp"}, EXACT,
              "the batch split over GPUs, each holding the whole model; gradients all-reduced in buckets", _one_gpu),
    Technique("zero2", "ZeRO-2 over {gpus} GPUs", lambda s, c: {"world_size": c.gpus, "sharding": "zero2"}, EXACT,
              "optimizer states and gradients sharded; batch split over GPUs", _one_gpu),
    Technique("fsdp", "FSDP (ZeRO-3) over {gpus} GPUs", lambda s, c: {"world_size": c.gpus, "sharding": "fsdp"}, EXACT,
              "parameters sharded too; all-gathers each layer, 1.5x the communication of DDP", _one_gpu),
    Technique("liger", "liger-kernel", {"liger": True}, EXACT,
              "Triton RMSNorm, SwiGLU, RoPE and a fused linear cross entropy that never materializes the logits "
              "(llama, mistral, qwen2, qwen3; needs liger-kernel on the GPU)",
              lambda s: not s.liger and not s.dp and not s.compile and s.checkpoint_policy != "selective"),
    # DP-SGD (Opacus): memlens.step.kinds.opacus runs them
    Technique("dp-hooks", "DP-SGD (Opacus hooks)", {"dp": True, "grad_sample_mode": "hooks"}, PRIVACY,
              "per-sample gradients: trainable parameters x physical batch, kept into the optimizer step",
              lambda s: s.dp and s.grad_sample_mode != "hooks"),
    Technique("dp-ghost", "DP-SGD (Opacus ghost clipping)", {"dp": True, "grad_sample_mode": "ghost"}, PRIVACY,
              "two backward passes (graph kept through both); B x T x T Gram matrices per Linear layer",
              lambda s: s.dp and s.grad_sample_mode != "ghost"),
    Technique("non-private", "non-private (no DP-SGD)", _non_private, PRIVACY,
              "no privacy guarantee; the same logical batch with plain accumulation", lambda s: s.dp),
)}

# the seeds' six configurations and the single techniques the issue names
COMPARE_DEFAULT = ("fp32", "amp-fp16", "amp-bf16", "bf16", "checkpointing", "accumulation", "lora", "adamw-8bit",
                   "adafactor", "amp-fp16+checkpointing", "amp-fp16+checkpointing+accumulation", "amp-bf16+checkpointing+lora")
# hooks vs ghost vs non-private side by side (compare's default for a --dp spec; the first is the baseline)
COMPARE_DP = ("non-private", "dp-hooks", "dp-ghost")
# what a plan tries for a target, in this order (ranking comes after); dp-* apply to --dp specs only
PLAN = ("amp-bf16", "bf16", "checkpointing", "amp-bf16+checkpointing", "adamw-8bit", "adafactor", "full-8bit",
        "offload", "lora", "qlora", "zero2", "fsdp", "dp-hooks", "dp-ghost")
# a DP-SGD spec's plan: Opacus runs DPDDP and FSDP2 ghost clipping over GPUs, no sharded optimizer (ZeRO-2)
PLAN_DP = tuple("ddp" if n == "zero2" else n for n in PLAN)
# the techniques that spread the job over GPUs (a plan for one GPU leaves them out)
OVER_GPUS = ("ddp", "zero2", "fsdp")
# what doctor tries against an OOM, in the order people try them (then combined)
DOCTOR = ("halve-batch", "checkpointing", "amp-bf16", "adamw-8bit", "lora")


def lookup(name: str) -> Technique:
    if name not in TECHNIQUES:
        close = difflib.get_close_matches(name, TECHNIQUES, n=1)
        raise MemlensError(f"unknown technique {name!r}",
                           hint=(f"did you mean {close[0]!r}? " if close else "") + f"known: {', '.join(TECHNIQUES)}")
    return TECHNIQUES[name]


def parts(name: str) -> list[Technique]:
    """'a+b' -> the techniques a and b (validated)."""
    return [lookup(p.strip()) for p in name.split("+")]


def applies(spec: TrainingSpec, name: str) -> bool:
    """Does every part of ``name`` change something for ``spec``?"""
    s = spec
    for t in parts(name):
        if not t.applies(s):
            return False
        try:
            s = s.replace(**t.spec_changes(s))
        except MemlensError:
            return False
    return True


def apply(spec: TrainingSpec, name: str, ctx: Context | None = None, keep: frozenset[str] | set[str] = frozenset()) -> TrainingSpec:
    """``spec`` with technique ``name`` (``a+b`` applies a then b) applied. ``keep``: fields the user gave, which a
    technique's side changes leave as they are (QLoRA under a given ``--precision fp32`` is then refused by the spec's
    own check, as estimate refuses it, instead of running in bf16).

    >>> s = TrainingSpec(model="gpt2")
    >>> apply(s, "qlora").precision
    'bf16'
    >>> apply(s, "qlora", keep={"precision"})
    Traceback (most recent call last):
    memlens.core.errors.SpecError: --qlora with fp32 is not modelled: the 4-bit layers compute in bf16 or fp16 (bitsandbytes' compute dtype)
    """
    s = spec
    for t in parts(name):
        s = s.replace(**{k: v for k, v in t.spec_changes(s, ctx).items() if not (k in t.side and k in keep)})
    return s


def side_changes(spec: TrainingSpec, name: str, ctx: Context | None = None) -> dict[str, Any]:
    """The fields ``name`` changes beyond what its name says, with their new values (a row's label says them)."""
    out: dict[str, Any] = {}
    s = spec
    for t in parts(name):
        ch = t.spec_changes(s, ctx)
        out.update({k: v for k, v in ch.items() if k in t.side and getattr(s, k) != v})
        s = s.replace(**ch)
    return out


def changes(spec: TrainingSpec, name: str, ctx: Context | None = None) -> dict[str, Any]:
    """The spec fields ``name`` sets (those that differ from ``spec``)."""
    new = apply(spec, name, ctx).to_dict()
    old = spec.to_dict()
    return {k: v for k, v in new.items() if old.get(k) != v}


def title(name: str, ctx: Context | None = None) -> str:
    return " + ".join(t.label(ctx) for t in parts(name))


def kind(name: str) -> str:
    """The strongest kind among the parts (changes the model > numerics > same math)."""
    order = {EXACT: 0, NUMERICS: 1, MODEL: 2, PRIVACY: 3}
    return max((t.kind for t in parts(name)), key=order.__getitem__)


def cost(name: str) -> str:
    return "; ".join(t.cost for t in parts(name))
