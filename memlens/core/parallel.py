"""The sharding kinds a spec takes, what each shards, and the one rule for "is this job distributed".

Each ``--sharding`` is a :class:`Sharding`: its family (DDP or FSDP2), which of parameters, gradients and
optimizer states it splits over the ranks at rest, FSDP2's default ``reshard_after_forward``, and the
PyTorch settings that realize it. Everyone asks these facts (the closed form, fit's plan, the launcher);
how a rank is wrapped is :mod:`memlens.step.parallel`.

>>> SHARDINGS["zero2"].shards_gradients, SHARDINGS["zero2"].shards_parameters, SHARDINGS["fsdp"].family
(True, False, 'fsdp')
>>> from memlens.core.spec import TrainingSpec
>>> is_distributed(TrainingSpec(model="gpt2", world_size=2, sharding="ddp")), is_distributed(TrainingSpec(model="gpt2"))
(True, False)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import SpecError


@dataclass(frozen=True)
class Sharding:
    name: str
    family: str                     # "none" | "ddp" | "fsdp"
    shards_optimizer_state: bool    # each rank keeps the states of its share of the parameters
    shards_gradients: bool          # gradients reduce-scattered into shards
    shards_parameters: bool         # parameters sharded after forward (gathered again in backward)
    setting: str                    # the PyTorch settings that realize it (reports)

    @property
    def reshard_after_forward(self) -> bool | None:
        """FSDP2's default for this kind (None outside FSDP2)."""
        return self.shards_parameters if self.family == "fsdp" else None


SHARDINGS: dict[str, Sharding] = {s.name: s for s in (
    Sharding("none", "none", False, False, False, "one GPU"),
    Sharding("ddp", "ddp", False, False, False, "DistributedDataParallel"),
    Sharding("zero1", "ddp", True, False, False, "DistributedDataParallel + ZeroRedundancyOptimizer"),
    Sharding("zero2", "fsdp", True, True, False, "FSDP2 fully_shard(reshard_after_forward=False) per block + root"),
    Sharding("zero3", "fsdp", True, True, True, "FSDP2 fully_shard (reshard_after_forward=True) per block + root"),
    Sharding("fsdp", "fsdp", True, True, True, "FSDP2 fully_shard (reshard_after_forward=True) per block + root"),
)}
SHARDING_NAMES: tuple[str, ...] = tuple(SHARDINGS)   # the built-in ones; sharding_names() adds the registered


def register_sharding(entry: Sharding) -> Sharding:
    """Add a ``--sharding`` name (its name then validates in a TrainingSpec). How its ranks are wrapped is a
    wrapper registered beside it (:func:`memlens.step.parallel.register_wrapper`)."""
    if entry.family not in ("ddp", "fsdp"):
        raise SpecError(f"sharding {entry.name!r}: family {entry.family!r} is not ddp or fsdp",
                        hint="a parallelism either keeps whole parameters on each rank (ddp) or shards them (fsdp)")
    SHARDINGS[entry.name] = entry
    return entry


def sharding_names() -> tuple[str, ...]:
    return tuple(SHARDINGS)


def sharding_of(spec: Any) -> Sharding:
    return SHARDINGS[spec.sharding]


def is_distributed(spec: Any) -> bool:
    """The one rule: a job of several ranks (each rank simulated, or run under torchrun)."""
    return spec.world_size > 1


def data_parallel_ranks(spec: Any) -> int:
    """Ranks that each take a micro-batch (every rank of a DDP / ZeRO / FSDP2 job; 1 on one GPU)."""
    return spec.world_size if is_distributed(spec) else 1


# The largest job memlens models: one flat data-parallel group (DDP, ZeRO-1, FSDP2) of this many ranks. It
# models no HSDP, tensor or pipeline parallelism, which is what jobs beyond this size run (torchtitan's largest
# published runs: 128 GPUs of FSDP, 256 of FSDP x TP, DESIGN.md). The simulation also costs with the world
# size: torch's fully_shard chunks every parameter into world-size pieces on every rank
# (torch/distributed/fsdp/_fully_shard/_fsdp_common.py: _chunk_with_empty), about 26 s for gpt2 at 100,000.
MAX_WORLD_SIZE = 1024


def check_fields(spec: Any) -> None:
    """The spec fields of several GPUs that cannot go together (called by TrainingSpec's validation)."""
    sh = SHARDINGS[spec.sharding]
    if isinstance(spec.world_size, int) and spec.world_size > MAX_WORLD_SIZE:
        raise SpecError(f"--world-size {spec.world_size} is above the {MAX_WORLD_SIZE:,} ranks memlens models (one flat "
                        "data-parallel group: no HSDP, tensor or pipeline parallelism)",
                        hint=f"estimate one rank of a group of at most {MAX_WORLD_SIZE} (per-rank memory under FSDP stops "
                             "shrinking long before: the sharded states are already small)")
    if sh.name != "none" and not is_distributed(spec):
        raise SpecError(f"sharding {spec.sharding!r} needs --world-size > 1", hint="add --world-size 8")
    raf = spec.reshard_after_forward
    if raf is not None:
        if sh.family != "fsdp":
            raise SpecError("--reshard-after-forward is an FSDP2 setting", hint="use it with --sharding fsdp (or zero2, zero3)")
        if sh.name == "zero2" and raf is not False:
            raise SpecError("zero2 is FSDP2 with reshard_after_forward=False", hint="drop --reshard-after-forward, or use --sharding fsdp")
        if not isinstance(raf, bool):
            if not isinstance(raf, int) or raf < 2 or raf >= spec.world_size or spec.world_size % raf:
                raise SpecError(f"--reshard-after-forward {raf!r} must be true, false or a divisor of the world size between 2 and "
                                f"{spec.world_size - 1}", hint="e.g. --reshard-after-forward true")
    if spec.gradient_as_bucket_view and sh.family != "ddp":
        raise SpecError("--gradient-as-bucket-view is a DDP setting", hint="use it with --sharding ddp or zero1")
    if spec.bucket_cap_mb is not None:
        if sh.family != "ddp":
            raise SpecError("--bucket-cap-mb is a DDP setting", hint="use it with --sharding ddp or zero1")
        if isinstance(spec.bucket_cap_mb, bool) or not isinstance(spec.bucket_cap_mb, (int, float)) or not spec.bucket_cap_mb > 0:
            raise SpecError(f"--bucket-cap-mb must be a positive number, got {spec.bucket_cap_mb!r}", hint="e.g. --bucket-cap-mb 25")


__all__ = ["MAX_WORLD_SIZE", "Sharding", "SHARDINGS", "SHARDING_NAMES", "register_sharding", "sharding_names", "sharding_of", "is_distributed", "data_parallel_ranks", "check_fields"]
