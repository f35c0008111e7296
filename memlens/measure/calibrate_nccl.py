"""What several GPUs of one machine add to the timing table (``memlens calibrate`` where more than one is visible),
measured by one process per GPU (torch.multiprocessing, an NCCL group over all of them):

- NCCL's bus bandwidth by message size for all-reduce, all-gather and reduce-scatter (nccl-tests' convention: the
  buffer's bytes x 2(n-1)/n, resp. (n-1)/n, over the seconds of one collective, back to back): ``table.nccl[world]``.
  The seconds are end to end (launch and latency included), so the rows carry ``latency_us`` 0;
- the overlap's cost (``table.nccl_overlap[world]``): collectives on NCCL's stream while the compute stream runs
  GEMMs (DDP's bucket all-reduces under backward, FSDP2's all-gathers under forward) or a memory-bound copy. NCCL's
  kernels take SMs and memory bandwidth from the compute kernels beside them: ``matmul`` / ``memory`` is the compute
  stream's extra seconds per second of collective running beside it; ``comm_beside_*`` how much longer the
  collectives took there than alone. Paced as DDP paces them: a layer's backward GEMMs (4,096 tokens x 2,048 x 8,192)
  with a 25 MiB all-reduce launched after every third (bench/gpu_overlap_pattern_probe.py: on 2 x H200 the GEMMs lose
  0.29 s per second of NCCL so, against 0.01 when 8192^3 GEMMs were queued first and held every SM);
- FSDP2's hooks on the host over every rank (:func:`memlens.measure.calibrate_fsdp.sharded_pair`: with several ranks
  each group's unshard issues a real all-gather and its wait, which the one-rank measurement does not):
  ``host_us["fsdp_forward_group_ranks"]`` / ``["fsdp_backward_group_ranks"]``.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

BUCKET_BYTES = 25 * 2**20       # DDP's bucket_cap_mb default: the collective the overlap is measured with
LAYER = (4096, 2048, 8192)      # the compute beside it: a layer's backward bf16 GEMMs, tokens x hidden x intermediate
LAYERS = 16                     # ... 8 GEMMs a layer (the MLP's three projections and attention's, inputs and weights)
EVERY = 3                       # a bucket's all-reduce every 3 GEMMs (Llama-3.2-1B: ~5 buckets of 25 MiB a layer)
COPY_BYTES = 2**27              # ... or copies of 128 MiB, as many


def _seconds(sync, fn, reps: int) -> float:
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def busbw(torch, dist, world: int, sizes, device: str = "cuda") -> dict:
    """op -> bus bandwidth GB/s at each of ``sizes`` (the full buffer's bytes, bf16) over the default group's
    ``world`` ranks, every rank calling it at once (``device`` "cpu": gloo, for tests)."""
    out: dict = {"all_reduce": [], "all_gather": [], "reduce_scatter": []}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # torch 2.13 names them *_single (the *_tensor names deprecated); torch 2.11 has only the *_tensor ones
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for nbytes in sizes:
        n = nbytes // 2
        buf = torch.empty(n, dtype=torch.bfloat16, device=device)
        full = torch.empty(n, dtype=torch.bfloat16, device=device)
        shard = torch.empty(n // world, dtype=torch.bfloat16, device=device)
        ops = (("all_reduce", lambda: dist.all_reduce(buf), 2 * (world - 1) / world),
               ("all_gather", lambda: gather(full, shard), (world - 1) / world),
               ("reduce_scatter", lambda: scatter(shard, buf), (world - 1) / world))
        for op, fn, factor in ops:
            sec = _seconds(sync, fn, 10 if nbytes >= 2**26 else 40)
            out[op].append(round(nbytes * factor / sec / 1e9, 2))
    return out


def _paced(torch, dist, ops: list, every: int, collective, stream, comm: bool, compute: bool = True) -> tuple[float, float]:
    """(compute stream's seconds for ``ops`` run in order, seconds from the first to the last collective): with
    ``comm``, one collective on ``stream`` after every ``every`` ops, as DDP's Reducer launches a bucket's all-reduce
    while the backward goes on; without ``compute``, the same collectives back to back. Every rank runs the same
    sequence."""
    Ev = torch.cuda.Event
    dist.barrier()
    torch.cuda.synchronize()
    s0, e0, s1, e1 = (Ev(enable_timing=True) for _ in range(4))
    works: list = []

    def launch():
        with torch.cuda.stream(stream):
            if not works:
                s1.record(stream)
            works.append(collective())

    s0.record()
    for i, op in enumerate(ops, 1):
        if compute:
            op()
        if comm and i % every == 0:
            launch()
    e0.record()
    if works:
        with torch.cuda.stream(stream):
            for w in works:
                w.wait()              # the stream waits on NCCL's: e1 marks the last collective's end
            e1.record(stream)
    torch.cuda.synchronize()
    return s0.elapsed_time(e0) / 1e3, (s1.elapsed_time(e1) / 1e3 if works else 0.0)


def layer_gemms(torch, tokens: int, hidden: int, inter: int) -> list:
    """A transformer layer's backward GEMM operands, bf16 on the GPU: the input and weight gradients of the MLP's up /
    gate (tokens x inter into hidden) and down projections and of attention's (tokens x hidden x hidden), as (a, b)."""
    t, h, i = tokens, hidden, inter
    shapes = [(t, i, h), (i, t, h), (t, h, i), (h, t, i), (t, h, i), (h, t, i), (t, h, h), (h, t, h)]
    return [(torch.randn(m, k, dtype=torch.bfloat16, device="cuda"), torch.randn(k, n, dtype=torch.bfloat16, device="cuda"))
            for m, k, n in shapes]


def overlap(torch, dist, world: int, repeats: int = 3) -> dict:
    """The overlap's cost (module docstring): the median of ``repeats`` measurements of each kind."""
    bf = torch.bfloat16
    mats = layer_gemms(torch, *LAYER)
    x = torch.empty(COPY_BYTES // 2, dtype=bf, device="cuda")
    y = torch.empty_like(x)
    bucket = torch.empty(BUCKET_BYTES // 2, dtype=bf, device="cuda")
    stream = torch.cuda.Stream()
    kinds = {"matmul": [lambda a=a, b=b: torch.mm(a, b) for a, b in mats] * LAYERS,
             "memory": [lambda: y.copy_(x)] * (len(mats) * LAYERS)}
    collective = lambda: dist.all_reduce(bucket, async_op=True)   # noqa: E731
    out: dict = {}
    for kind, ops in kinds.items():
        _paced(torch, dist, ops, EVERY, collective, stream, comm=False)          # warm
        extra, slow = [], []
        for _ in range(repeats):
            alone = _paced(torch, dist, ops, EVERY, collective, stream, comm=False)[0]
            comm = _paced(torch, dist, ops, EVERY, collective, stream, comm=True, compute=False)[1]
            both, comm_beside = _paced(torch, dist, ops, EVERY, collective, stream, comm=True)
            extra.append(max(0.0, both - alone) / max(min(comm_beside, both), 1e-9))
            slow.append(comm_beside / max(comm, 1e-9))
        out[kind] = round(statistics.median(extra), 3)
        out[f"comm_beside_{kind}"] = round(statistics.median(slow), 3)
    return out


def _say(rank: int, what: str) -> None:
    if rank == 0:   # progress on stderr as it goes (a hang shows where)
        print(f"[{time.strftime('%H:%M:%S')}] calibrate over ranks: {what}", file=sys.stderr, flush=True)


def _worker(rank: int, world: int, sizes: tuple, host: dict, path: str, fsdp: bool) -> None:
    import datetime

    import torch  # heavy: torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    # a collective that never completes (a rank died) raises after a minute instead of hanging calibrate
    dist.init_process_group("nccl", init_method=f"file://{path}.store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    _say(rank, "NCCL bus bandwidth by size")
    res: dict = {"busbw": busbw(torch, dist, world, sizes)}
    _say(rank, "a collective beside GEMMs and copies")
    res["overlap"] = overlap(torch, dist, world)
    if fsdp:
        _say(rank, "FSDP2's hooks over the ranks")
        from .calibrate_fsdp import per_group, sharded_pair

        try:
            plain, sharded = sharded_pair(torch, torch.device("cuda", rank))
            res["fsdp"] = per_group(plain, sharded, host, 17, suffix="_ranks")
        except (ImportError, RuntimeError, ValueError) as e:
            res["fsdp_error"] = str(e).splitlines()[0][:160]
    if rank == 0:
        with open(path, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def measure_ranks(torch, world: int, sizes, host: dict, log, fsdp: bool = True) -> dict:
    """{"nccl": {str(world): rows}, "overlap": {str(world): costs}, "host_us": FSDP2's per-group costs over the
    ranks}: one process per GPU (module docstring). ``host``: the table's host costs so far (per op, per view)."""
    import torch.multiprocessing as mp  # heavy: torch

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ranks.json")
        mp.spawn(_worker, args=(world, tuple(sizes), dict(host), path, fsdp), nprocs=world, join=True)
        with open(path) as f:
            res = json.load(f)
    rows = {op: {"bytes": list(sizes), "busbw_gbps": v, "latency_us": 0.0} for op, v in res["busbw"].items()}
    log(f"NCCL over {world} GPUs: all-reduce {max(res['busbw']['all_reduce']):.0f} GB/s bus bandwidth at best; "
        f"beside a collective the compute stream loses {res['overlap']['matmul']:.2f} s (GEMMs) / "
        f"{res['overlap']['memory']:.2f} s (copies) per second of it")
    out = {"nccl": {str(world): rows}, "overlap": {str(world): res["overlap"]}, "host_us": res.get("fsdp", {})}
    if "fsdp_error" in res:
        log(f"FSDP2 hook cost over {world} ranks not measured ({res['fsdp_error']})")
    elif out["host_us"]:
        log(f"FSDP2 hooks per parameter group over {world} ranks (us): {out['host_us']}")
    return out
