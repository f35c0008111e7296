"""The rank code (no runner of its own: bench/gpu_mesh.py runs it) of a pipeline-parallel x FSDP2 torchrun job, for
bench/gpu_mesh.py's `pp` cases (issue 37): torch's own PipelineStage and schedule (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B) over the stages memlens' estimate
simulates, so the measured peak of each rank is compared with the estimate of the same rank.

The stages are built by memlens' own PPWrapper on the device (torchtitan's split of the Llama, fully_shard per block +
stage on the (pp, dp_shard) mesh, reshard_after_forward=False), then handed to torch.distributed.pipelining as
torchtitan does (PipelineStage per stage on the pp group; the schedule with torchtitan's loss - cross-entropy on the
fp32 logits over M - and scale_grads=False); the rank steps with return_outputs=False (torchtitan's). Step 1 (torch's
shape inference runs in it: memlens' PPWrapper simulates it) is a warm-up: the allocated peak is that of steps 2-3; the
reserved peak after the reset starts at what step 1 left reserved (no empty_cache). Each record also keeps the caching
allocator's segments after the last step (``segments``: [bytes, stream] from torch.cuda.memory_snapshot()), to compare
with the segments memlens' allocator model creates for the same rank.
"""
from __future__ import annotations

import os
import time

STEPS = 3


def pp_rank_case(name: str, fields: dict, dry: bool) -> dict:
    """One rank's record (``max_allocated`` / ``max_reserved`` over steps 2-3); --dry-run: the spec checked on the CPU."""
    from memlens.core.spec import TrainingSpec

    spec = TrainingSpec(**fields)
    if dry:
        from memlens.step.plan import resolve as resolve_step

        resolve_step(spec, fake=True)
        return {"checked": True, "world_size": spec.world_size, "pp": spec.pp}
    import torch
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rec: dict = {"rank": rank}
    try:
        sched, stages, step_fn, opt, model = _build(spec, rank, dev)
        rec["stages"] = sorted(stages)
        for n in range(1, STEPS + 1):
            t = time.perf_counter()
            step_fn()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            rec.setdefault("steps", []).append({"step": n, "seconds": round(time.perf_counter() - t, 3),
                                                "allocated": torch.cuda.memory_allocated()})
            if n == 1:
                torch.cuda.reset_peak_memory_stats()
        stats = torch.cuda.memory_stats()
        rec.update(status="ok", max_allocated=torch.cuda.max_memory_allocated(), max_reserved=stats["reserved_bytes.all.peak"],
                   reserved_now=torch.cuda.memory_reserved(),
                   segments=[[seg["total_size"], seg["stream"]] for seg in torch.cuda.memory_snapshot()])
    except torch.cuda.OutOfMemoryError as e:
        rec.update(status="oom", error=str(e).splitlines()[0][:300])
    dist.barrier()
    dist.destroy_process_group()
    return rec


def _build(spec, rank: int, dev):
    """(the schedule, this rank's stage indices, one pipeline step, the optimizer, the rank's model)."""
    import torch
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from memlens.models.source import resolve
    from memlens.step.optim import make_optimizer
    from memlens.step.parallel.pp import PPWrapper
    from memlens.step.prepare import build_for_sharding, to_device

    w = PPWrapper(spec, fake=False, rank=rank, world_size=spec.world_size)
    built = build_for_sharding(spec, resolve(spec.model), w)
    model = w.wrap(built.model, device=dev)
    batch = to_device(built.batch, dev)
    total, M = w.pp * w.virtual, w.microbatches
    group = w.mesh["pp"].get_group()
    stages = [PipelineStage(w.chunks[s], s, total, dev, group=group) for s in w.stages]

    def loss_fn(logits, labels):      # torchtitan's cross-entropy, rescaled by the micro-batches (rescale_accumulated_loss)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1)) / M

    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved-1f1b": ScheduleInterleaved1F1B}[spec.pp_schedule]
    sched = cls(stages if w.virtual > 1 else stages[0], n_microbatches=M, loss_fn=loss_fn, scale_grads=False)
    first, last = 0 in w.stages, total - 1 in w.stages
    args = (batch["input_ids"],) if first else ()
    kw = {"target": batch["labels"], "losses": []} if last else {}

    def step_fn():
        try:
            sched.step(*args, **kw, return_outputs=False)
        except TypeError:        # a torch without return_outputs: the last stage keeps its outputs to the step's end
            sched.step(*args, **kw)
        kw.get("losses", []).clear()

    return sched, w.stages, step_fn, make_optimizer(spec, model, simulate=False), model
