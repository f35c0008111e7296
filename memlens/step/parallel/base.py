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

A wrapper is chosen by :func:`wrapper_for` from an ordered registry, so a later kind of step (DP-SGD
over DDP, FSDP2 ghost clipping) registers its own ahead of these with :func:`register_wrapper`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from ...core.errors import SpecError
from ...core.optimizers import optimizer_facts
from ...core.parallel import is_distributed, sharding_of
from ...core.precision import precision_of
from ...core.spec import TrainingSpec
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
        return model

    def make_optimizer(self, spec: TrainingSpec, model, simulate: bool):
        return make_optimizer(spec, model, simulate=simulate)

    def simulation(self, tracker, step):
        """Context entered inside the storage tracker for a simulated run (setup events, hooks)."""
        return contextlib.nullcontext()

    def rank_groups(self) -> list[RankGroup]:
        return [RankGroup(0, tuple(range(self.world_size)), "every rank holds the same tensors")]

    def inner(self, model):
        """The user's module inside the wrapper (for module names)."""
        return model


def check(spec: TrainingSpec, *, fake: bool) -> None:
    """One line for every multi-GPU combination that cannot be simulated or run (never ignored)."""
    if not is_distributed(spec):
        return
    sh = sharding_of(spec)
    if sh.name == "none":
        raise SpecError(f"--world-size {spec.world_size} needs --sharding", hint="add --sharding ddp (or zero1, zero2, zero3, fsdp)")
    if spec.offload_optimizer:
        raise SpecError(f"--offload-optimizer with --sharding {spec.sharding} (FSDP2 CPUOffloadPolicy) is not modelled per rank",
                        hint="drop --offload-optimizer, or use --method formula")
    if spec.dp and (sh.name == "hsdp" or spec.tp > 1):
        raise SpecError(f"DP-SGD with --sharding {spec.sharding}" + (f" --tp {spec.tp}" if spec.tp > 1 else "")
                        + ": Opacus' ghost_fsdp wraps a 1D FSDP2 mesh", hint="use --sharding fsdp --grad-sample-mode ghost, or ddp")
    if spec.dp:
        check_dp_sharding(spec)        # DPDDP, or Opacus' ghost_fsdp under fsdp/zero3; one line for the rest
    if spec.qlora:
        raise SpecError(f"--qlora with --sharding {spec.sharding} is not simulated per rank",
                        hint="use --lora-rank with bf16 weights, or one GPU")
    if getattr(spec, "compile", False):
        raise SpecError(f"--compile with --sharding {spec.sharding} is not simulated per rank",
                        hint="drop --compile to estimate the eager step of each rank")
    if getattr(spec, "hf_trainer", False):
        raise SpecError(f"the Trainer's step (--hf-trainer) with --sharding {spec.sharding} is not simulated per rank",
                        hint="drop --hf-trainer: the plain step of each rank is simulated")
    if sh.family == "fsdp":
        if precision_of(spec).grad_scaler:
            raise SpecError(f"amp-fp16 with --sharding {spec.sharding} needs FSDP2 loss scaling, which memlens does not model",
                            hint="use --precision amp-bf16 (MixedPrecisionPolicy bf16) or bf16")
        if optimizer_facts(spec.optimizer).bitsandbytes:
            raise SpecError(f"--optimizer {spec.optimizer} with --sharding {spec.sharding} (bitsandbytes on DTensor shards) is not modelled",
                            hint="use --optimizer adamw, or --sharding ddp")
    if sh.name == "zero1" and optimizer_facts(spec.optimizer).bitsandbytes:
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


def check_dp_sharding(spec: TrainingSpec) -> None:
    """One line for a DP-SGD sharding Opacus does not run: it runs DPDDP (ddp) and FSDP2 ghost clipping
    (``ghost_fsdp``: Opacus' FSDP2Wrapper re-shards every layer after forward)."""
    sh = sharding_of(spec)
    if sh.name == "ddp":
        return
    if sh.family != "fsdp":
        raise SpecError(f"DP-SGD with --sharding {spec.sharding}: Opacus runs DPDDP (ddp) or FSDP2 ghost clipping "
                        "(ghost_fsdp), not a sharded optimizer", hint="use --sharding ddp, or --sharding fsdp --grad-sample-mode ghost")
    if (spec.grad_sample_mode or "hooks") != "ghost":
        raise SpecError(f"DP-SGD with --sharding {spec.sharding} needs --grad-sample-mode ghost: Opacus supports FSDP "
                        "only with ghost clipping (ghost_fsdp)", hint="add --grad-sample-mode ghost, or use --sharding ddp")
    if not sh.shards_parameters or spec.reshard_after_forward is False:
        raise SpecError(f"DP-SGD with --sharding {spec.sharding}: Opacus' FSDP2Wrapper takes no reshard_after_forward "
                        "(its layers re-shard after forward)", hint="use --sharding fsdp (or zero3)")
