"""A fixed fake estimator: peak = model states + batch x activations, per technique (exact arithmetic)."""
from __future__ import annotations

from memlens.explore.core import CachedEstimator, Point
from memlens.core.spec import TrainingSpec

GiB = 2**30
N = 250_000_000            # parameters


def fake_point(spec: TrainingSpec) -> Point:
    half = spec.param_dtype != "float32"
    pbytes = N * (2 if half else 4)
    if spec.qlora:
        pbytes = N // 2
    trainable = N // 100 if spec.uses_lora else N
    gbytes = trainable * (2 if half else 4)
    obytes = {"adamw": 8, "adam": 8, "adamw-8bit": 2, "sgd": 0, "sgd-momentum": 4, "adafactor": 1}[spec.optimizer] * trainable
    act = GiB if spec.precision == "fp32" else GiB // 2       # per sample
    if spec.grad_checkpointing:
        act //= 4
    b = spec.physical_batch_size if spec.dp and spec.physical_batch_size else spec.batch_size
    n = spec.world_size       # sharded states per rank (exact arithmetic of this fake, not the simulation's)
    if spec.sharding in ("zero3", "fsdp"):
        pbytes //= n
    if spec.sharding in ("zero2", "zero3", "fsdp"):
        gbytes //= n
    if spec.sharding in ("zero1", "zero2", "zero3", "fsdp"):
        obytes //= n
    if spec.sharding in ("ddp", "zero1"):
        gbytes *= 2           # DDP's buckets: one more copy of the gradients
    alloc = pbytes + gbytes + obytes + b * act
    cats = {"parameters": pbytes, "gradients": gbytes, "optimizer_state": obytes, "activations": b * act, "temporaries": 0}
    return Point(alloc, alloc + 64 * 2**20, cats,
                 {"forward": {"peak_allocated_bytes": alloc - gbytes}, "backward": {"peak_allocated_bytes": alloc},
                  "optimizer": {"peak_allocated_bytes": pbytes + gbytes + obytes}},
                 "backward", N, trainable, spec.seq_len or 512)


def fake_estimator() -> CachedEstimator:
    return CachedEstimator(fn=fake_point)
