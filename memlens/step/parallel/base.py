"""The multi-GPU strategies, as the PyTorch settings that realize them, and the pluggable wrapping
step that :func:`memlens.step.prepare` applies for one rank.

==========  =====================================================================================
sharding    what runs (torch 2.x)
==========  =====================================================================================
ddp         ``DistributedDataParallel(model, bucket_cap_mb, gradient_as_bucket_view)``
zero1       ``ddp`` + ``ZeroRedundancyOptimizer`` (each rank keeps the optimizer states of its
            share of the parameters, assigned greedily by size; updated parameters are broadcast)
zero2       FSDP2 ``fully_shard`` on every transformer block, then the root, with
            ``reshard_after_forward=False``: parameters, gradients and optimizer states sharded at
            rest, parameters gathered from a block's forward until its backward
zero3/fsdp  FSDP2 ``fully_shard`` defaults: blocks re-shard after forward and gather again in
            backward; the root stays gathered after forward (FSDP2's own rule)
==========  =====================================================================================

Precision under FSDP2: ``amp-bf16`` is ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)`` (fp32 sharded parameters and optimizer, bf16 compute, fp32 gradient
reduction; no autocast); ``fp32`` / ``bf16`` run without a policy. DDP keeps the single-GPU
precision (autocast for ``amp-*``).

A wrapper is chosen by :func:`memlens.step.parallel.wrapper_for` from an ordered registry that asks the step's plan,
so a later kind of step (DP-SGD over DDP, FSDP2 ghost clipping) or parallelism registers its own ahead of these
with :func:`memlens.step.parallel.register_wrapper`. The refusals of a multi-GPU plan are :func:`check`'s; the step
kind's own are its ``refuse_ranks`` (:mod:`memlens.step.kinds`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from ...core.errors import SpecError
from ...core.parallel import sharding_of
from ...core.spec import TrainingSpec
from ..fake import materialize_on_fake
from ..optim import make_optimizer


@dataclass(frozen=True)
class RankGroup:
    """Ranks whose memory is the same as their representative's (or bounded by two simulated ranks)."""

    rank: int                       # the rank simulated for the group
    ranks: tuple[int, ...]          # every rank it stands for
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "ranks": list(self.ranks), "why": self.why}


class Wrapper:
    """How one rank's step is wrapped (applied by :func:`memlens.step.prepare`).

    ``fake``: the step runs on fake CPU tensors under a fake process group (estimate); otherwise on
    a real device under a real process group (torchrun).
    """

    name = ""
    builds_on_meta = False          # prepare builds the model's parameters on the meta device
    autocast = True                 # amp-* runs under autocast (False: the wrapper casts parameters itself)

    def __init__(self, spec: TrainingSpec, *, fake: bool, rank: int, world_size: int):
        self.spec = spec
        self.fake = fake
        self.rank = rank
        self.world_size = world_size
        self.facts: dict[str, Any] = {}     # what the wrapping did, for reports (buckets, groups, streams)
        self.applied: list[str] = []

    @property
    def strategy(self) -> str:
        """What the wrapping is, in words (reports)."""
        return sharding_of(self.spec).setting

    def build_context(self):
        """Context for building the model on a real device (meta parameters for FSDP)."""
        return contextlib.nullcontext()

    def wrap(self, model, *, device, fake_mode=None):
        """The model as this rank runs it. By default as it is: on fake tensors, its meta parameters made fake
        (:func:`memlens.step.prepare` builds a rank's model on the meta device)."""
        return materialize_on_fake(model, fake_mode) if self.fake and fake_mode is not None else model

    def make_optimizer(self, spec: TrainingSpec, model, simulate: bool):
        return make_optimizer(spec, model, simulate=simulate)

    def shard_inputs(self, batch, seq_len):
        """The rank's micro-batch from the job's (context parallel keeps its share of the sequence)."""
        return batch

    def simulation(self, tracker, step):
        """Context entered inside the storage tracker for a simulated run (setup events, hooks)."""
        return contextlib.nullcontext()

    def rank_groups(self) -> list[RankGroup]:
        return [RankGroup(0, tuple(range(self.world_size)), "every rank holds the same tensors")]

    def inner(self, model):
        """The user's module inside the wrapper (for module names)."""
        return model


def check(plan, *, fake: bool) -> None:
    """One line for every multi-GPU combination of the plan (:class:`memlens.step.plan.StepPlan`) that cannot be
    simulated or run (never ignored): the sharding's own, then the step kind's (``StepKind.refuse_ranks``).
    ``memlens.step.plan.resolve`` calls it; a caller that holds only a spec resolves it."""
    if not plan.distributed:
        return
    spec, sh = plan.spec, plan.sharding
    if sh.name == "none":
        raise SpecError(f"--world-size {plan.world_size} needs --sharding", hint="add --sharding ddp (or zero1, zero2, zero3, fsdp)")
    if spec.offload_optimizer:
        raise SpecError(f"--offload-optimizer with --sharding {sh.name} (FSDP2 CPUOffloadPolicy) is not modelled per rank",
                        hint="drop --offload-optimizer, or use --method formula")
    if spec.qlora:
        raise SpecError(f"--qlora with --sharding {sh.name} is not simulated per rank",
                        hint="use --lora-rank with bf16 weights, or one GPU")
    if spec.pp > 1 and not fake:   # memlens.step.parallel.pp: a pipeline rank runs its stage without P2P sends
        raise SpecError(f"--pp {spec.pp} is estimated, not run on a device: memlens' pipeline rank runs its stage "
                        "without torch's P2P sends", hint="use `memlens estimate`; bench/gpu_mesh.py pp runs "
                        "torch's own schedule on GPUs")
    if plan.kind.refuse_ranks is not None:
        plan.kind.refuse_ranks(plan)   # DP-SGD: DPDDP or ghost_fsdp; --compile: not per rank
    if plan.hf_trainer:
        raise SpecError(f"the Trainer's step (--hf-trainer) with --sharding {sh.name} is not simulated per rank",
                        hint="drop --hf-trainer: the plain step of each rank is simulated")
    if sh.family == "fsdp":
        if plan.precision.grad_scaler:
            raise SpecError(f"amp-fp16 with --sharding {sh.name} needs FSDP2 loss scaling, which memlens does not model",
                            hint="use --precision amp-bf16 (MixedPrecisionPolicy bf16) or bf16")
        if plan.optimizer.bitsandbytes:
            raise SpecError(f"--optimizer {spec.optimizer} with --sharding {sh.name} (bitsandbytes on DTensor shards) is not modelled",
                            hint="use --optimizer adamw, or --sharding ddp")
    if sh.name == "zero1" and plan.optimizer.bitsandbytes:
        raise SpecError(f"--optimizer {spec.optimizer} with --sharding zero1 is not modelled",
                        hint="use --optimizer adamw, or --sharding ddp")


@dataclass
class Streams:
    """CUDA stream ids for a simulated rank: 0 is the default stream; the others are numbered as
    they first allocate, and named from the wrapper's own stream attributes."""

    ids: dict[int, int] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=lambda: {0: "default"})
    namer: Any = None                 # stream object -> name (None: "stream <id>")

    def current(self) -> int:
        import torch  # heavy: torch, loaded on first use

        s = torch.cpu.current_stream()
        i = self.ids.get(id(s))
        if i is None:
            if s is _default_stream():
                i = 0
            else:
                i = len([k for k in self.ids.values() if k]) + 1
                self.names[i] = (self.namer(s) if self.namer else None) or f"stream {i}"
            self.ids[id(s)] = i
        return i


def _default_stream():
    import torch  # heavy: torch, loaded on first use

    return torch.cpu._default_cpu_stream


def check_dp_sharding(plan) -> None:
    """One line for a DP-SGD sharding Opacus does not run (the DP-SGD step kind's ``refuse_ranks``): it runs DPDDP
    (ddp) and FSDP2 ghost clipping (``ghost_fsdp``: Opacus' FSDP2Wrapper re-shards every layer after forward)."""
    spec, sh = plan.spec, plan.sharding
    if sh.name == "ddp":
        return
    if sh.family != "fsdp":
        raise SpecError(f"DP-SGD with --sharding {sh.name}: Opacus runs DPDDP (ddp) or FSDP2 ghost clipping "
                        "(ghost_fsdp), not a sharded optimizer", hint="use --sharding ddp, or --sharding fsdp --grad-sample-mode ghost")
    if (spec.grad_sample_mode or "hooks") != "ghost":
        raise SpecError(f"DP-SGD with --sharding {sh.name} needs --grad-sample-mode ghost: Opacus supports FSDP "
                        "only with ghost clipping (ghost_fsdp)", hint="add --grad-sample-mode ghost, or use --sharding ddp")
    if not sh.shards_parameters or spec.reshard_after_forward is False:
        raise SpecError(f"DP-SGD with --sharding {sh.name}: Opacus' FSDP2Wrapper takes no reshard_after_forward "
                        "(its layers re-shard after forward)", hint="use --sharding fsdp (or zero3)")
