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
    Sharding("hsdp", "fsdp", True, True, True, "FSDP2 fully_shard on a 2D DeviceMesh (replicate x shard) per block + root: "
             "sharded within a group of --shard-size GPUs, replicated across the groups"),
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
    """Ranks that each take a different micro-batch: every rank of a DDP / ZeRO / FSDP2 / HSDP job, the world over
    the tensor- and context-parallel degrees (a TP group shares one micro-batch, a CP group one sequence); 1 on one GPU."""
    if not is_distributed(spec):
        return 1
    return spec.world_size // (max(1, getattr(spec, "tp", 1) or 1) * max(1, getattr(spec, "cp", 1) or 1)
                               * max(1, getattr(spec, "pp", 1) or 1))


def shard_degree(spec: Any) -> int:
    """Ranks over which FSDP2 shards each parameter (its shard mesh dim): --shard-size under HSDP, else every
    data-parallel rank times the context-parallel ones (torchtitan's dp_shard_cp: the world over --tp); 1 without
    sharding."""
    sh = SHARDINGS[spec.sharding]
    if not sh.shards_optimizer_state:
        return 1
    if sh.name == "hsdp":
        return spec.shard_size
    return data_parallel_ranks(spec) * max(1, getattr(spec, "cp", 1) or 1)


def communicators(spec: Any) -> int:
    """NCCL communicators a rank creates and uses: one per mesh dimension over more than one rank (torch's DeviceMesh
    gives each its process group; NCCL makes a communicator at a group's first collective). DDP / ZeRO / FSDP2: the
    world; HSDP: replicate and shard; TP: tp and the data-parallel dims; CP: cp and FSDP2's dp_shard x cp; PP: pp (its
    sends and receives) and the data-parallel dims. 0 on one GPU.

    >>> from types import SimpleNamespace as S
    >>> communicators(S(world_size=8, sharding="hsdp", shard_size=4, tp=1, cp=1, pp=1))
    2
    >>> communicators(S(world_size=8, sharding="fsdp", shard_size=None, tp=2, cp=1, pp=1))
    2
    >>> communicators(S(world_size=2, sharding="fsdp", shard_size=None, tp=2, cp=1, pp=1))     # TP only: the world
    1
    """
    if not is_distributed(spec):
        return 0
    tp, cp, pp = (max(1, getattr(spec, k, 1) or 1) for k in ("tp", "cp", "pp"))
    dp = data_parallel_ranks(spec)
    if getattr(spec, "sharding", None) == "hsdp":
        dims = [dp // spec.shard_size, spec.shard_size]
    else:
        dims = [dp * cp] if cp > 1 else [dp]          # CP: FSDP2 over dp_shard x cp (flattened: one group)
    dims += [tp, cp, pp]
    return sum(d > 1 for d in dims)


# The largest job memlens models: DDP, ZeRO-1, FSDP2, HSDP or FSDP2 x TP over this many ranks (torchtitan's
# largest published runs: 128 GPUs of FSDP, 256 of FSDP x TP, DESIGN.md); no pipeline parallelism.
# The fake process group builds every sub-group of the mesh on the simulated rank. The simulation also costs with the world
# size: torch's fully_shard chunks every parameter into world-size pieces on every rank
# (torch/distributed/fsdp/_fully_shard/_fsdp_common.py: _chunk_with_empty), about 26 s for gpt2 at 100,000.
MAX_WORLD_SIZE = 1024


def check_fields(spec: Any) -> None:
    """The spec fields of several GPUs that cannot go together (called by TrainingSpec's validation)."""
    sh = SHARDINGS[spec.sharding]
    if isinstance(spec.world_size, int) and spec.world_size > MAX_WORLD_SIZE:
        raise SpecError(f"--world-size {spec.world_size} is above the {MAX_WORLD_SIZE:,} ranks memlens models (DDP, "
                        "ZeRO, FSDP2, HSDP, FSDP2 x TP)",
                        hint=f"estimate one rank of a group of at most {MAX_WORLD_SIZE} (per-rank memory under FSDP stops "
                             "shrinking long before: the sharded states are already small)")
    if sh.name != "none" and not is_distributed(spec):
        raise SpecError(f"sharding {spec.sharding!r} needs --world-size > 1", hint="add --world-size 8")
    check_mesh(spec)
    raf = spec.reshard_after_forward
    if raf is not None:
        if sh.family != "fsdp":
            raise SpecError("--reshard-after-forward is an FSDP2 setting", hint="use it with --sharding fsdp (or zero2, zero3)")
        if sh.name == "zero2" and raf is not False:
            raise SpecError("zero2 is FSDP2 with reshard_after_forward=False", hint="drop --reshard-after-forward, or use --sharding fsdp")
        if not isinstance(raf, bool):
            n = shard_degree(spec)
            if not isinstance(raf, int) or raf < 2 or raf >= n or n % raf:
                raise SpecError(f"--reshard-after-forward {raf!r} must be true, false or a divisor of the {n} ranks a parameter "
                                f"is sharded over, between 2 and {n - 1}", hint="e.g. --reshard-after-forward true")
    if spec.gradient_as_bucket_view and sh.family != "ddp":
        raise SpecError("--gradient-as-bucket-view is a DDP setting", hint="use it with --sharding ddp or zero1")
    if spec.bucket_cap_mb is not None:
        if sh.family != "ddp":
            raise SpecError("--bucket-cap-mb is a DDP setting", hint="use it with --sharding ddp or zero1")
        if isinstance(spec.bucket_cap_mb, bool) or not isinstance(spec.bucket_cap_mb, (int, float)) or not spec.bucket_cap_mb > 0:
            raise SpecError(f"--bucket-cap-mb must be a positive number, got {spec.bucket_cap_mb!r}", hint="e.g. --bucket-cap-mb 25")


MODELLED_MESHES = ("ddp / zero1 / FSDP2 (zero2, zero3, fsdp) over --world-size, HSDP (--sharding hsdp --shard-size N), "
                   "tensor parallel (--tp N), context parallel (--cp N) and pipeline parallel (--pp N) with an FSDP2 sharding")

PP_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")       # torch.distributed.pipelining's, as memlens.step.parallel.pp runs them
PP_ZERO_BUBBLE = ("zbv", "zbvzerobubble", "interleaved-zb", "interleavedzerobubble", "dualpipev", "zero-bubble",
                  "looped-bfs", "loopedbfs")


def _pp_fields_alone(spec: Any) -> None:
    """The schedule's fields without --pp."""
    for name, flag, default in (("pp_schedule", "--pp-schedule", "1f1b"), ("pp_stage", "--pp-stage", None),
                                ("virtual_stages", "--virtual-stages", 1), ("pp_microbatches", "--pp-microbatches", None)):
        if getattr(spec, name, default) != default:
            raise SpecError(f"{flag} is pipeline parallel's", hint="use it with --pp N")


def _check_pp(spec: Any, sh: Sharding, tp: int, cp: int) -> None:
    """--pp N: torchtitan's PP x FSDP2 mesh and torch's schedules, in one line per field that cannot go with it."""
    pp = _positive_int(spec, "pp", "--pp", "e.g. --pp 4") or 1
    if pp == 1:
        return _pp_fields_alone(spec)
    sched = getattr(spec, "pp_schedule", "1f1b")
    if sched in PP_ZERO_BUBBLE:
        raise SpecError(f"--pp-schedule {sched}: zero-bubble schedules split each backward into an input and a weight "
                        "pass, which memlens does not model", hint="use --pp-schedule 1f1b, gpipe or interleaved-1f1b")
    if sched not in PP_SCHEDULES:
        raise SpecError(f"--pp-schedule {sched!r} is not one of {', '.join(PP_SCHEDULES)}", hint="e.g. --pp-schedule 1f1b")
    if not is_distributed(spec) or spec.world_size % pp or sh.name == "none":
        raise SpecError(f"--pp {pp} must divide --world-size {spec.world_size} (pipeline stages x data-parallel GPUs) with an "
                        "FSDP2 sharding", hint=f"e.g. --world-size {2 * pp} --sharding fsdp --pp {pp}")
    if sh.family != "fsdp" or sh.name == "hsdp":
        raise SpecError(f"--pp {pp} composes with FSDP2 over each stage's data-parallel GPUs (torchtitan's PP x FSDP), "
                        f"not with --sharding {spec.sharding}", hint="use --sharding fsdp (or zero2, zero3)")
    if tp > 1 or cp > 1:
        raise SpecError(f"--pp {pp} with --{'tp' if tp > 1 else 'cp'}: pipeline stages are modelled with FSDP2 alone",
                        hint="drop --tp / --cp, or --pp")
    v = _positive_int(spec, "virtual_stages", "--virtual-stages", "e.g. --virtual-stages 2") or 1
    if (sched == "interleaved-1f1b") != (v > 1):
        raise SpecError(f"--pp-schedule {sched} with --virtual-stages {v}: the interleaved schedule runs 2 or more stages "
                        "per rank, the others one", hint="use --pp-schedule interleaved-1f1b --virtual-stages 2, or drop "
                                                         "--virtual-stages")
    m = _positive_int(spec, "pp_microbatches", "--pp-microbatches", "e.g. --pp-microbatches 8") or spec.batch_size
    if spec.batch_size % m:
        raise SpecError(f"--pp-microbatches {m} must divide the local batch of {spec.batch_size} (--batch-size: each "
                        "data-parallel rank's batch, split into micro-batches)", hint=f"e.g. --batch-size {2 * m}")
    if sched == "1f1b" and m < pp:
        raise SpecError(f"--pp {pp} 1f1b with {m} micro-batches: torch's Schedule1F1B needs at least one per stage",
                        hint=f"use --pp-microbatches {pp} (and a --batch-size it divides), or --pp-schedule gpipe")
    rounds = max(1, m // pp)
    if sched == "interleaved-1f1b" and m % rounds:
        raise SpecError(f"--pp {pp} interleaved-1f1b with {m} micro-batches: torch's ScheduleInterleaved1F1B needs them in "
                        f"whole rounds of {pp}", hint=f"use --pp-microbatches {pp * rounds}")
    stage = getattr(spec, "pp_stage", None)
    if stage is not None and (isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp):
        raise SpecError(f"--pp-stage {stage!r} must be a pipeline rank between 0 and {pp - 1}", hint="e.g. --pp-stage 0")
    for bad, why in ((spec.grad_accum > 1, "--grad-accum: the schedule's micro-batches are the accumulation (use "
                      "--pp-microbatches)"), (getattr(spec, "dp", False), "DP-SGD"),
                     (spec.lora_rank is not None, "--lora-rank (peft's wrapper around the stage's layers)"),
                     (getattr(spec, "loss", "model") != "model", f"--loss {getattr(spec, 'loss', '')} (the last stage "
                      "runs torchtitan's cross-entropy)"), (bool(getattr(spec, "keep_outputs", None)), "--keep-outputs"),
                     (bool(getattr(spec, "liger", False)), "--liger"), (bool(getattr(spec, "compile", False)), "--compile"),
                     (bool(getattr(spec, "pad_fraction", 0)), "--pad-fraction (the stages run without an attention mask)")):
        if bad:
            raise SpecError(f"--pp {pp} with {why} is not modelled", hint="drop it, or --pp")


def _check_cp(spec: Any, sh: Sharding, cp: int, tp: int) -> None:
    """--cp N: torchtitan's FSDP2 x CP (x TP) mesh, in one line per field that cannot go with it."""
    if not is_distributed(spec):
        raise SpecError(f"--cp {cp}: context parallel splits each sequence over --cp GPUs of a job of several",
                        hint=f"add --world-size {2 * cp} --sharding fsdp")
    if sh.family != "fsdp":
        raise SpecError(f"--cp {cp} composes with FSDP2 over dp_shard x cp (torchtitan's mesh), not with --sharding "
                        f"{spec.sharding}", hint="use --sharding fsdp (or zero2, zero3, hsdp)")
    if sh.name == "hsdp" and spec.shard_size and spec.shard_size % cp:
        raise SpecError(f"--shard-size {spec.shard_size} with --cp {cp}: HSDP shards each parameter over dp_shard x cp GPUs, "
                        f"so --shard-size must be a multiple of {cp}", hint=f"e.g. --shard-size {2 * cp}")
    if spec.world_size % (cp * tp):
        raise SpecError(f"--cp {cp}" + (f" x --tp {tp}" if tp > 1 else "") + f" must divide --world-size {spec.world_size}",
                        hint=f"e.g. --world-size {2 * cp * tp} --cp {cp}" + (f" --tp {tp}" if tp > 1 else ""))
    if spec.seq_len and spec.seq_len % (2 * cp):
        raise SpecError(f"--cp {cp}: the sequence of {spec.seq_len} tokens does not split into 2 x {cp} equal chunks "
                        "(torch's head-tail load balancing of causal attention)", hint=f"use a --seq-len that divides by {2 * cp}")
    if getattr(spec, "dp", False):
        raise SpecError(f"DP-SGD with --cp {cp}: per-sample gradients of a sequence split over ranks are not modelled",
                        hint="drop --cp")
    if getattr(spec, "attn", "sdpa") not in (None, "sdpa"):
        raise SpecError(f"--cp {cp} with --attn {spec.attn}: torch's ring attention replaces SDPA only",
                        hint="use --attn sdpa")
    if getattr(spec, "pad_fraction", None):
        raise SpecError(f"--cp {cp} with --pad-fraction: the ring takes causal attention without a padding mask",
                        hint="drop --pad-fraction (context parallel runs packed or unpadded sequences)")


def _positive_int(spec: Any, name: str, flag: str, eg: str) -> Any:
    v = getattr(spec, name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise SpecError(f"{flag} must be a whole number >= 1, got {v!r}", hint=eg)
    return v


def check_mesh(spec: Any) -> None:
    """The mesh fields (--shard-size, --tp, --cp, --pp and its schedule): what they go with, in one line each."""
    shard = _positive_int(spec, "shard_size", "--shard-size", "e.g. --shard-size 8 (the GPUs of one node)")
    tp = _positive_int(spec, "tp", "--tp", "e.g. --tp 8") or 1
    cp = _positive_int(spec, "cp", "--cp", "e.g. --cp 2") or 1
    sh = SHARDINGS[spec.sharding]
    _check_pp(spec, sh, tp, cp)
    if sh.name == "hsdp":
        if shard is None:
            raise SpecError("--sharding hsdp needs --shard-size N: the GPUs each parameter is sharded over (replicated across "
                            "the world / N groups)", hint="e.g. --shard-size 8 (one node of 8 GPUs)")
        dp = spec.world_size // tp
        if not 1 < shard < dp or dp % shard:
            raise SpecError(f"--shard-size {shard} must divide the {dp} data-parallel GPUs and lie between 2 and {dp // 2}",
                            hint="--shard-size N = --world-size gives --sharding fsdp; 1 gives replication (--sharding ddp)")
    elif shard is not None:
        raise SpecError("--shard-size is HSDP's shard group", hint="use it with --sharding hsdp")
    if cp > 1:
        _check_cp(spec, sh, cp, tp)
    if getattr(spec, "dp", False) and (sh.name == "hsdp" or tp > 1):
        raise SpecError(f"DP-SGD with --sharding {spec.sharding}" + (f" --tp {tp}" if tp > 1 else "")
                        + ": Opacus' ghost_fsdp wraps a 1D FSDP2 mesh", hint="use --sharding fsdp --grad-sample-mode ghost, or ddp")
    if getattr(spec, "loss_parallel", False):
        if tp < 2:
            raise SpecError("--loss-parallel is tensor parallel's vocabulary-sharded loss", hint="use it with --tp N")
        if getattr(spec, "loss", "model") != "model":
            raise SpecError(f"--loss-parallel with --loss {spec.loss}: the model's own loss runs on the vocabulary shards",
                            hint="drop --loss")
    if tp > 1:
        if getattr(spec, "lora_rank", None) is not None:
            raise SpecError(f"--tp {tp} with --lora-rank: torchtitan's TP plan shards nn.Linear layers, and peft's LoRA layers "
                            "wrap them (q_proj.base_layer) - not modelled", hint="drop --lora-rank (or --tp: LoRA under FSDP2 is modelled)")
        if sh.family != "fsdp":
            raise SpecError(f"--tp {tp} composes with FSDP2 (torchtitan's 2D: TP within a group, FSDP2 across), not with "
                            f"--sharding {spec.sharding}", hint="use --sharding fsdp (or zero2, zero3, hsdp)")
        if spec.world_size % tp or spec.world_size // tp < 2:
            raise SpecError(f"--tp {tp} must divide --world-size {spec.world_size} and leave at least 2 data-parallel ranks",
                            hint=f"e.g. --world-size {2 * tp} --tp {tp}")


__all__ = ["MAX_WORLD_SIZE", "MODELLED_MESHES", "PP_SCHEDULES", "check_mesh", "shard_degree", "Sharding", "SHARDINGS", "SHARDING_NAMES", "register_sharding", "sharding_names", "sharding_of", "is_distributed", "data_parallel_ranks", "check_fields"]
