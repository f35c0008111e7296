"""Step seconds from the priced ops of one micro-batch and the step's facts.

One micro-batch's forward, backward and recompute run through a launch queue (the host dispatches op after op,
each kernel starts when both the host has launched it and the GPU is free): time the GPU spends waiting for the
host is the ``host`` part, the rest is each phase's kernel time. The step is its micro-batches, the optimizer
(bytes moved over parameters, gradients and states, as foreach or fused kernels launch), clipping, collectives
(NCCL ring bandwidth by message size; what PyTorch overlaps with backward or with the next block's compute
is exposed only past the compute it hides behind) and copies over PCIe (activation offload, an offloaded
optimizer).

>>> q = queue([("forward", 0, 1e-3, 1e-5, 0, "matmul"), ("forward", 0, 1e-6, 1e-5, 0, "memory")], [1.0, 1.0])
>>> {k: round(v * 1e6, 1) for k, v in q[0].items()}, {k: round(v * 1e6, 1) for k, v in q[1].items()}
({'forward': 1001.0}, {'forward': 10.0})
"""
from __future__ import annotations

import math
from collections import defaultdict

from ...core.gpus import HOST_CPU_ADAM_PARAMS_PER_S, gpu_facts
from ...core.parallel import data_parallel_ranks, is_distributed, shard_degree, sharding_of
from ...core.precision import precision_of
from .ops_kinds import ATTN_BWD, ATTN_FWD, COMM, GATHER
from .tables import TimingTable, table_for

PARTS = ("forward", "backward", "recompute", "optimizer", "collectives", "host", "offload")
_BUCKET_PART = {"forward": "forward", "reference": "forward", "generation": "forward", "backward": "backward",
                "recompute": "recompute", "clip": "optimizer"}

# Memory traffic of one optimizer step per trainable element, in passes over each tensor (p: parameter, g: gradient,
# s: one state-sized tensor), and the kernels it launches per group of tensors. torch.optim.adamw's _multi_tensor_adamw
# (foreach): mul_(p) [weight decay], lerp_(m, g), mul_(v), addcmul_(v, g, g), sqrt(v) -> t, div_(t), add_(t, eps),
# addcdiv_(p, m, t): p read+written twice (4), g read twice (2), m 3 and v 5 passes, t 6 passes (14 state-sized);
# _fused_adamw: one kernel reading p, g, m, v and writing p, m, v. SGD: add_(p, g); with momentum mul_(b), add_(b, g),
# add_(p, b). bitsandbytes' 8-bit AdamW: one kernel per tensor over p, g and two uint8 states.
OPTIMIZER_TRAFFIC = {   # name -> (p passes, g passes, state-sized passes, ops per group, per-tensor loop)
    "adamw": (4, 2, 14, 10, False), "adam": (4, 2, 14, 10, False),
    "adamw-fused": (2, 1, 4, 1, False), "adam-fused": (2, 1, 4, 1, False),
    "sgd": (2, 1, 0, 1, False), "sgd-momentum": (2, 1, 3, 3, False),
    "adafactor": (6, 2, 2, 12, True), "adafactor-hf": (6, 2, 2, 14, True),
    "adamw-8bit": (2, 1, 1, 1, True), "paged-adamw-8bit": (2, 1, 1, 1, True),
}
FOREACH_TENSORS_PER_LAUNCH = 48   # multi_tensor_apply's depth-3/4 lists (aten/src/ATen/native/cuda/MultiTensorApply.cuh)
PER_TENSOR_HOST_US = 0.5          # Python list handling per tensor in a foreach step (grouping by device and dtype)


def queue(rows: list, mult: list[float]) -> tuple[dict, float, float]:
    """Run ``rows`` (bucket, module, gpu s, host s, flops, kind) through the launch queue, each ``mult`` times in a
    row. Returns (GPU busy seconds per bucket, seconds the GPU waited on the host per bucket, host seconds in all).

    A ``gather`` row (FSDP2's all-gather) runs on a stream of its own from when the host issues it, after the one
    before it; the next kernel waits for it: what the compute stream waits beyond the host is under ``wait["gather"]``."""
    th = tg = side = barrier = 0.0
    busy: dict = defaultdict(float)
    wait: dict = defaultdict(float)
    host = 0.0
    for (bucket, _, g, h, _, kind), m in zip(rows, mult):
        if kind == GATHER:
            th += h * m
            side = barrier = max(side, th) + g * m
            host += h * m
            continue
        if m == 1.0:
            th += h
            start = max(tg, th)
            wait[bucket] += start - tg
            if barrier > start:
                wait["gather"] += barrier - start
                start = barrier
            tg = start + g
        else:   # m alike ops in a row: the queue's end, in closed form
            end = max(tg + m * g, th + h + m * g, th + m * h + g)
            wait[bucket] += end - tg - m * g
            th += m * h
            tg = end
        busy[bucket] += m * g
        host += m * h
    return dict(busy), dict(wait), host


def later_waits(rows: list, mult: list[float], first: dict) -> dict:
    """The seconds the GPU waits on the host, per bucket, in a micro-batch that follows another with nothing between
    them that synchronizes (the training loop's accumulation: the host dispatches micro-batch i+1's forward while the
    GPU still runs micro-batch i's backward, so a GPU-bound micro-batch's start-up wait is paid once a step): the
    queue run over two micro-batches back to back, less the first's waits (``first``, :func:`queue`'s)."""
    _, two, _ = queue(rows + rows, mult + mult)
    return {b: two[b] - first.get(b, 0.0) for b in two}


def _host_waits(wait: dict, later: dict, k: int) -> float:
    """The step's ``host`` part from its launch queue: the first micro-batch's waits on the host and k - 1 later ones'
    (FSDP2's all-gathers waited on are collectives, not host)."""
    return sum(v for b, v in wait.items() if b != "gather") + (k - 1) * sum(v for b, v in later.items() if b != "gather")


def host_at(rows: list, mult: list[float], k: int, factor: float, opt: tuple[float, float]) -> float:
    """The ``host`` part of a step whose host runs ``factor`` times the priced costs (the queue's host column and the
    optimizer's host work scaled; the kernels as they are): a host-bound step's seconds move with the host's speed,
    a GPU-bound one's hardly. ``opt``: the optimizer's (GPU, host) seconds.

    >>> rows = [("forward", 0, 1e-3, 4e-4, 0, "matmul")] * 3        # 3 ms of kernels, 1.2 ms of host
    >>> [round(host_at(rows, [1.0] * 3, 1, f, (0.0, 0.0)) * 1e3, 2) for f in (1.0, 3.0)]   # the first launch; 1.2 ms per op
    [0.4, 1.6]
    """
    rs = rows if factor == 1.0 else [(b, m, g, h * factor, fl, kind) for b, m, g, h, fl, kind in rows]
    _, wait, _ = queue(rs, mult)
    later = later_waits(rs, mult, wait) if k > 1 else {}
    return _host_waits(wait, later, k) + max(0.0, opt[1] * factor - opt[0])


def host_range(tab: TimingTable, beyond_host: float, rows: list, mult: list[float], k: int, opt: tuple[float, float]) -> dict | None:
    """The step at the two ends of ``tab``'s host spread (:meth:`TimingTable.host_range`): ``host_ms`` (the host's
    speed there) and ``seconds`` (``beyond_host``, the step's seconds but its host part, plus :func:`host_at` there);
    None for a table that names no spread."""
    spread = tab.host_range()
    if not spread:
        return None
    ref = (tab.env or {})["host_reference_ms"]
    return {"host_ms": [round(ref * f, 2) for f in spread], "seconds": [beyond_host + host_at(rows, mult, k, f, opt) for f in spread]}


def micro_batches(spec) -> tuple[int, int]:
    """(micro-batches per optimizer step, samples in each)."""
    if spec.dp:
        mb = min(spec.physical_batch_size or spec.batch_size, spec.batch_size)
        return math.ceil(spec.batch_size / mb) * spec.grad_accum, mb
    return spec.grad_accum, spec.batch_size


def _dtype_bytes(name: str) -> int:
    return 4 if name == "float32" else 2


def optimizer_seconds(spec, trainable: int, tensors: int, tab: TimingTable, dtensor: bool = False) -> tuple[float, float]:
    """(GPU seconds, host seconds) of one optimizer step over ``trainable`` elements in ``tensors`` tensors.
    ``dtensor``: the parameters are DTensors (FSDP2): each op of the step goes through DTensor's dispatch for every
    tensor of its list, priced at calibrate's ``fsdp_optimizer_tensor_op`` (over several ranks where measured)."""
    pb = _dtype_bytes(precision_of(spec).weights)
    if spec.qlora or spec.lora_rank:
        pb = pb        # LoRA adapters take the weights' dtype (peft)
    p, g, s, ops, per_tensor = OPTIMIZER_TRAFFIC.get(spec.optimizer, OPTIMIZER_TRAFFIC["adamw"])
    nbytes = trainable * (p * pb + g * pb + s * pb)
    kernels = ops * (tensors if per_tensor else max(1, math.ceil(tensors / FOREACH_TENSORS_PER_LAUNCH)))
    per = nbytes / max(1, kernels)
    gpu = nbytes / (tab.bandwidth_gbps(per) * 1e9) + kernels * tab.min_kernel_us * 1e-6 if nbytes else 0.0
    host = (ops * (tensors if per_tensor else 1)) * tab.host_seconds("optimizer") + tensors * PER_TENSOR_HOST_US * 1e-6
    if dtensor:
        host += ops * tensors * (tab.host_seconds("fsdp_optimizer_tensor_op_ranks") or tab.host_seconds("fsdp_optimizer_tensor_op"))
    if spec.max_grad_norm and not spec.dp:   # clip_grad_norm_: _foreach_norm (read), stack, norm, _foreach_mul_ (r+w)
        gpu += 3 * trainable * pb / (tab.bandwidth_gbps(trainable * pb) * 1e9)
        host += 6 * tab.host_seconds("optimizer")
    if precision_of(spec).grad_scaler:        # GradScaler's unscale_: read + write every gradient
        gpu += 2 * trainable * pb / (tab.bandwidth_gbps(trainable * pb) * 1e9)
    return gpu, host


def collective_seconds(spec, params: int, trainable: int, blocks: int, backward: float, forward: float,
                       micro: int, tab: TimingTable, forward_queued: bool = False) -> float:
    """Exposed NCCL time of one step of a multi-GPU job.

    DDP (torch/nn/parallel/distributed.py, reducer.cpp): gradients all-reduced in buckets of ``bucket_cap_mb``
    (25 MiB) as backward produces them (once per step: accumulation under no_sync), overlapped with the backward of
    the last micro-batch: exposed is what exceeds it, and at least the last bucket. ZeRO-1 adds the parameters'
    all-gather after the step. FSDP2 (fully_shard per block): each micro-batch all-gathers every block's parameters in
    forward and (resharded after forward) again in backward, and reduce-scatters its gradients; the next block's
    gather is prefetched under the current block's compute, so exposed is what exceeds the phase's compute, plus
    the first block's gather. ``forward_queued``: forward's gathers ran in the launch queue (.queue: exposed where the
    host, not the GPU, is behind), only backward's are priced here. A collective beside compute is not free: where
    calibrate measured it over several GPUs (memlens.measure.calibrate_nccl), the compute loses the table's
    ``overlap_cost`` per second of NCCL running beside it, and the collective runs that much slower there."""
    if not is_distributed(spec):
        return 0.0
    pb = _dtype_bytes(precision_of(spec).weights)
    sh = sharding_of(spec)
    world = shard_degree(spec) if sh.family == "fsdp" else data_parallel_ranks(spec)   # the group each one runs over
    tp = max(1, getattr(spec, "tp", 1) or 1)
    params, trainable = params // tp, trainable // tp       # FSDP2 over TP-local shards (torchtitan's 2D)
    cost = tab.overlap_cost(world, "matmul")                  # the compute's loss per second of NCCL beside it
    slow = tab.overlap_cost(world, "comm_beside_matmul") or 1.0   # the collective's own slowdown there
    if sh.family == "ddp":
        grad = trainable * pb
        cap = int((spec.bucket_cap_mb or 25) * 2**20)
        full, last = divmod(grad, cap)
        comm = slow * (full * tab.collective_seconds("all_reduce", cap, world) + tab.collective_seconds("all_reduce", last, world))
        tail = tab.collective_seconds("all_reduce", last or cap, world)
        bwd = backward / max(1, micro)
        exposed = max(tail, comm - bwd) + cost * min(comm, bwd)
        # the Reducer's own kernels on the compute stream (reducer.cpp): each gradient copied, scaled by 1/world, into
        # its bucket as it becomes ready (mul_out), and back into .grad once its bucket is reduced unless the gradients
        # are the bucket's views (gradient_as_bucket_view); once per step (no_sync skips them)
        exposed += tab.op_seconds("mul", 2 * grad) + (0.0 if spec.gradient_as_bucket_view else tab.op_seconds("copy_", 2 * grad))
        if sh.shards_optimizer_state:
            exposed += tab.collective_seconds("all_gather", params * pb, world)
        return exposed
    blocks = max(1, blocks)
    per_block = params * pb / blocks
    gather = tab.collective_seconds("all_gather", per_block, world) * blocks
    scatter = tab.collective_seconds("reduce_scatter", trainable * pb / blocks, world) * blocks
    reshard = spec.reshard_after_forward if spec.reshard_after_forward is not None else sh.shards_parameters
    fwd_comm = gather * slow
    bwd_comm = ((gather if reshard else 0.0) + scatter) * slow
    first = gather / blocks
    fwd_exposed = 0.0 if forward_queued else first + max(0.0, fwd_comm - forward / micro)
    per_micro = fwd_exposed + max(0.0, bwd_comm - backward / micro)
    per_micro += cost * (min(fwd_comm, forward / micro) + min(bwd_comm, backward / micro))
    return per_micro * micro


def step_time(sim) -> dict | None:
    """The step-time payload of a simulation (``Result.data["step_time"]``), or None without a priced trace."""
    tr = getattr(sim, "timing", None)
    if tr is None or not tr.rows:
        return None
    key = (id(tr), sim.spec, id(table_for(sim.spec.gpu)))
    memo = getattr(sim, "_step_time", None)
    if memo is not None and memo[0] == key:
        return memo[1]
    out = _step_time(sim, tr)
    try:
        sim._step_time = (key, out)       # simulation_result asks twice (the payload, activation_plan)
    except AttributeError:
        pass
    return out


def trainable_tensors(tr) -> tuple[int, float]:
    """(the full model's trainable tensors, what each clip row of the trace stands for). Opacus' step ("clip":
    clip_and_accumulate, add_noise, scale_grad) runs its ops per trainable tensor under the optimizer's module, not a
    layer's, so the trace of a shallow model (memlens.estimator.depth) holds them for its own tensors only: each
    repeats for the tensors of the layers it writes (Llama-3.2-1B LoRA r16 under Opacus on an H200: 915 top-level ops
    in the step's optimizer phase for 64 adapter tensors; the 3-layer trace held 235 clip rows for its 12)."""
    copies = written_layers(tr)
    tensors = tr.trainable_tensors + copies * tr.layer_tensors
    return tensors, (tensors / tr.trainable_tensors if copies and tr.trainable_tensors else 1.0)


def written_layers(tr) -> int:
    """The layers a shallow model's trace stands for beyond its own (memlens.estimator.depth), else 0."""
    return tr.layers - tr.stack.depth if tr.stack is not None and tr.layers else 0


def _step_time(sim, tr) -> dict:
    spec = sim.spec
    tab = table_for(spec.gpu)
    ck = _checkpointed_layers(spec, tr.layers)
    scale, scaled_from = _replay_scale(tr, spec, sim)
    from .record import expanded, price  # heavy: the op facts import torch (a Result read back needs none)

    n_layers = tr.layers or depth_hint(tr)
    share = 0.0 if not spec.grad_checkpointing else (
        min(1.0, ck / n_layers) if ck is not None and n_layers else 1.0)   # the layers under checkpoint's hooks
    rows = expanded(price(tr, tab, share), tr)
    tensors, per_tensor = trainable_tensors(tr)
    mult = [per_tensor if r[0] == "clip" else 1.0 for r in rows]
    if scale != (1.0, 1.0):
        rows = [_scaled(r, scale, tab) for r in rows]
    busy, wait, host_total = queue(rows, mult)
    later = later_waits(rows, mult, wait)
    k, mb = micro_batches(spec)
    parts = dict.fromkeys(PARTS, 0.0)
    for bucket, sec in busy.items():
        parts[_BUCKET_PART.get(bucket, "forward")] += sec * k
    parts["host"] = _host_waits(wait, later, k)
    exposed_gather = wait.get("gather", 0.0) + (k - 1) * later.get("gather", 0.0)   # FSDP2's all-gathers waited on
    comm = 0.0   # DTensor's collectives (TP, CP) ran in the queue on the critical path: shown as collectives
    for r, m in zip(rows, mult):
        if r[5] == COMM:
            parts[_BUCKET_PART.get(r[0], "forward")] -= r[2] * m * k
            comm += r[2] * m * k
    ranks = data_parallel_ranks(spec)
    sh = sharding_of(spec)
    tp = max(1, getattr(spec, "tp", 1) or 1)
    # the optimizer's share on this rank: FSDP2 shards every tensor over its shard group, over TP-local tensors;
    # ZeroRedundancyOptimizer (zero1) hands whole tensors to each data-parallel rank
    fsdp = sh.family == "fsdp" and sh.shards_optimizer_state
    div = shard_degree(spec) * tp if fsdp else ranks if sh.shards_optimizer_state and ranks > 1 else 1
    trainable = sim.trainable_count // max(1, div)
    pb = _dtype_bytes(precision_of(spec).weights)
    _add_dequant(parts, tr, tab, k, ck, bool(busy.get("recompute")))
    if k > 1:   # micro-batches 2..k add each gradient into .grad (AccumulateGrad: read both, write one)
        parts["backward"] += (k - 1) * 3 * sim.trainable_count * pb / (tab.bandwidth_gbps(sim.trainable_count * pb) * 1e9)
    opt = (0.0, 0.0)
    if spec.offload_optimizer:   # gradients to the host, parameters back, the step on the CPU (ZeRO-Offload)
        parts["offload"] += tab.pcie_seconds(trainable * pb, "d2h") + tab.pcie_seconds(trainable * pb, "h2d")
        parts["optimizer"] += trainable / HOST_CPU_ADAM_PARAMS_PER_S
    else:
        og, oh = optimizer_seconds(spec, trainable, max(1, tensors // (1 if fsdp else div)), tab, dtensor=sh.family == "fsdp")
        og *= tab.optimizer_ratio.get(_optimizer_kind(spec), 1.0)
        parts["optimizer"] += og
        parts["host"] += max(0.0, oh - og)
        opt = (og, oh)
    off = (sim.costs or {}).get("offload_bytes", 0)
    if off:   # save_on_cpu: each saved tensor to pinned host memory in forward and back in backward, on the stream
        parts["offload"] += k * (tab.pcie_seconds(off, "d2h") + tab.pcie_seconds(off, "h2d"))
    blocks = _blocks(sim) if _blocks(sim) > 1 else (tr.layers or 1)
    queued = any(r[5] == GATHER for r in rows)
    parts["collectives"] = comm + exposed_gather + collective_seconds(
        spec, sim.param_count, sim.trainable_count, blocks, parts["backward"] + parts["recompute"], parts["forward"], k,
        tab, forward_queued=queued)
    seconds = sum(parts.values())
    flops = sum(r[4] * m for r, m in zip(rows, mult) if r[0] != "recompute") * k
    out = _payload(spec, sim, tr, tab, seconds, parts, flops, k, mb, ranks, host_total * k, scaled_from)
    out["gpu_busy_per_micro_batch"] = sum(busy.values())
    out["host_wait_per_micro_batch"] = sum(wait.values())       # the first micro-batch's
    out["host_wait_later_micro_batch"] = sum(later.values())    # each one after it (later_waits)
    hr = host_range(tab, seconds - parts["host"], rows, mult, k, opt)
    if hr:
        out["host_range"] = hr
    if busy.get("recompute"):
        # what checkpointing adds to one micro-batch, additive over blocks (fit --least-recompute weighs blocks one by
        # one): each recomputed op's kernel (its dispatch hides behind the GPU's work in a step that keeps the GPU busy),
        # plus the selective policy's Python dispatch modes, which the GPU waits on (SAC_HOST_SECONDS_PER_OP)
        from .record import SAC_HOST_SECONDS_PER_OP  # noqa: PLC0415 - as above

        sac = SAC_HOST_SECONDS_PER_OP if tr.selective else 0.0
        out["recompute_seconds_per_micro_batch"] = sum((r[2] + sac) * m for r, m in zip(rows, mult) if r[0] == "recompute")
    return out


def _payload(spec, sim, tr, tab, seconds, parts, flops, k, mb, ranks, host_total, scaled_from) -> dict:
    g = gpu_facts(spec.gpu)
    p = precision_of(spec)
    half = "float16" in (p.weights, p.autocast) or "bfloat16" in (p.weights, p.autocast) or spec.qlora
    peak = (g.peak_tflops_half if half else g.peak_tflops_fp32) * 1e12
    samples = mb * k * ranks
    out = {"seconds": seconds, "parts": {k2: v for k2, v in parts.items() if v or k2 in PARTS[:6]},
           "samples_per_s": samples / seconds if seconds else None,
           "mfu": flops / (seconds * peak) if seconds else None, "model_flops": int(flops * ranks),
           "micro_batches": k, "micro_batch_size": mb, "setting": setting_key(spec), "spec": spec.to_dict(), "seq_len": sim.seq_len, "host_seconds": host_total, "ops_priced": len(tr.rows),
           "gpu": spec.gpu, "table_gpu": tab.gpu, "calibrated": tab.calibrated, "table": tab.note,
           "table_unmeasured_ops": tab.unmeasured_ops(), "table_matmul_loop_timed": tab.matmul_loop_timed(),
           "table_borrowed": tab.borrowed(),
           "model": "per-op: matmuls/attention by shape, other ops by bytes, launch queue, optimizer bytes, NCCL, PCIe "
                    "(memlens.estimator.timing)"}
    L = sim.seq_len
    if L:
        out["tokens_per_s"] = samples * L / seconds if seconds else None
    if scaled_from:
        out["scaled_from"] = scaled_from
    return out


# what a priced step may be rescaled over (fit's micro-batch x accumulation search); any other field is another setting
RESCALABLE = ("batch_size", "grad_accum", "seq_len", "physical_batch_size")


def setting_key(spec) -> str:
    """The spec's fields other than :data:`RESCALABLE`, as one string: a priced step answers only its own setting."""
    d = spec.to_dict()
    return repr(sorted((k, repr(v)) for k, v in d.items() if k not in RESCALABLE))


def depth_hint(tr) -> int | None:
    return tr.stack.depth if tr.stack is not None else None


def _add_dequant(parts: dict, tr, tab: TimingTable, k: int, ck: int | None, recompute: bool) -> None:
    """QLoRA: bitsandbytes dequantizes each 4-bit weight to the compute dtype before its matmul, in forward, in
    backward and, for the checkpointed layers' share, in recompute: added to those parts of ``k`` micro-batches."""
    copies = written_layers(tr)
    quantized = (tr.quantized[0] + copies * tr.layer_quantized[0], tr.quantized[1] + copies * tr.layer_quantized[1])
    if not quantized[0]:
        return
    parts["forward"] += k * _dequant_seconds(quantized, 1.0, tab)
    parts["backward"] += k * _dequant_seconds(quantized, 1.0, tab)
    if recompute:
        n_layers = tr.layers or depth_hint(tr)
        share = ck / n_layers if ck is not None and n_layers else 1.0
        parts["recompute"] += k * _dequant_seconds(quantized, share, tab)


def _dequant_seconds(quantized: tuple, grow: float, tab: TimingTable) -> float:
    """One pass over the 4-bit weights (bitsandbytes' dequantize_4bit, in forward and again for backward's matmul):
    half a byte read and two written per weight (NF4 -> bf16/fp16), one kernel per linear layer."""
    weights, layers = quantized
    per = 2.5 * weights / max(1, layers)
    return grow * layers * tab.kernel_seconds(0, 0, per)


def _optimizer_kind(spec) -> str:
    """The optimizer's key in a table's ``optimizer_ratio`` (calibrate measures a foreach and a fused AdamW, SGD)."""
    name = spec.optimizer or "adamw"
    return "adamw" if name == "adam" else "adamw-fused" if name == "adam-fused" else name


def _checkpointed_layers(spec, layers: int | None) -> int | None:
    c = spec.checkpoint_layers
    if not spec.grad_checkpointing:
        return None
    if c is None:
        return layers
    return c if isinstance(c, int) else len(c)


def _blocks(sim) -> int:
    facts = getattr(getattr(sim, "wrapper", None), "facts", None) or {}
    return int(facts.get("blocks") or 1)


def _replay_scale(tr, spec, sim) -> tuple[tuple[float, float], str]:
    """A replay at another size (memlens.estimator.scaling) reuses its template's trace: its kernels are scaled by
    the tokens (and attention by the sequence length once more); the payload says so."""
    if not tr.size or tr.size == (spec.batch_size, spec.seq_len):
        return (1.0, 1.0), ""
    b0, l0 = tr.size
    rb = spec.batch_size / max(1, b0)
    rl = (spec.seq_len / l0) if (spec.seq_len and l0) else 1.0
    return (rb * rl, rl), f"b={b0}" + (f" L={l0}" if l0 else "") + " (kernels scaled by tokens)"


def _scaled(row, scale, tab: TimingTable):
    bucket, mod, g, h, fl, kind = row
    tokens, seq = scale
    f = 1.0 if kind == GATHER else tokens * (seq if kind in (ATTN_FWD, ATTN_BWD) else 1.0)   # a gather: the parameters
    floor = tab.min_kernel_us * 1e-6
    return (bucket, mod, max(floor, g * f) if g > 0 else 0.0, h, fl * f, kind)


def describe(st: dict) -> str:
    """One line: ``step 0.412 s (fwd 0.121, bwd 0.245, ...), 39.8k tokens/s, MFU 41% [calibrated on ...]``."""
    parts = ", ".join(f"{_SHORT.get(k, k)} {v:.3g}" for k, v in st["parts"].items() if v >= 0.0005 or k in ("forward", "backward"))
    rate = (f"{st['tokens_per_s'] / 1e3:.3g}k tokens/s" if st.get("tokens_per_s") else
            f"{st['samples_per_s']:.3g} samples/s" if st.get("samples_per_s") else "")
    mfu = f", MFU {st['mfu'] * 100:.0f}%" if st.get("mfu") is not None else ""
    sc = f"; {st['scaled_from']}" if st.get("scaled_from") else ""
    return f"step {st['seconds']:.3g} s ({parts}){host_bound(st)}, {rate}{mfu} [{st['table']}{sc}]"


HOST_BOUND_SPREAD = 0.05   # a step whose seconds move by this share or more across the host range is shown with it


def host_bound(st: dict) -> str:
    """``; host-bound: 0.213-0.278 s as the CPU's dispatch speed varies`` for a step whose seconds move with the
    host's speed (its range over the table's host spread, the quartiles measured beside steps on its GPU's machines,
    spans :data:`HOST_BOUND_SPREAD` of its seconds or more), else "".

    >>> host_bound({"seconds": 0.267, "host_range": {"host_ms": [14.25, 22.06], "seconds": [0.2133, 0.2782]}})
    "; host-bound: 0.213-0.278 s as the CPU's dispatch speed varies"
    >>> host_bound({"seconds": 0.0663, "host_range": {"host_ms": [14.22, 22.78], "seconds": [0.0659, 0.0674]}})
    ''
    """
    hr = st.get("host_range")
    if not hr or not st.get("seconds"):
        return ""
    lo, hi = hr["seconds"]
    if hi - lo < HOST_BOUND_SPREAD * st["seconds"]:
        return ""
    return f"; host-bound: {lo:.3g}-{hi:.3g} s as the CPU's dispatch speed varies"


_SHORT = {"forward": "fwd", "backward": "bwd", "recompute": "recompute", "optimizer": "optim", "collectives": "comm",
          "host": "host", "offload": "offload"}


def rescaled(st: dict, micro_batch: int, grad_accum: int, seq_len: int | None) -> tuple[float, dict]:
    """Step seconds and parts of a priced step at another micro-batch size, accumulation or sequence length (fit's
    candidates that were not simulated themselves): each micro-batch's kernels scale with its tokens (the matmul
    efficiency of the new shapes is not re-read: an approximation, said in the payload's ``scaled_from``), the host's
    dispatch per micro-batch stays (the same ops), the optimizer and collectives stay (the same parameters)."""
    k0, mb0, L0 = st["micro_batches"], st.get("micro_batch_size") or 1, st.get("seq_len") or 1
    r = (micro_batch * (seq_len or L0)) / (mb0 * L0)
    parts = dict(st["parts"])
    busy = st.get("gpu_busy_per_micro_batch", 0.0)
    wait = st.get("host_wait_per_micro_batch", 0.0)
    later = st.get("host_wait_later_micro_batch", wait)
    host_micro = st.get("host_seconds", 0.0) / max(1, k0)
    for name in ("forward", "backward", "recompute"):
        parts[name] = parts.get(name, 0.0) / k0 * r * grad_accum

    def exposed(w: float) -> float:   # a micro-batch's wall beyond its kernels, at the new size
        return max(0.0, max(busy * r, host_micro, busy * r + w - busy * (r - 1)) - busy * r)

    opt_host = parts.get("host", 0.0) - wait - (k0 - 1) * later    # the optimizer's share of the host part stays
    parts["host"] = exposed(wait) + (grad_accum - 1) * exposed(later) + max(0.0, opt_host)
    if parts.get("offload"):
        parts["offload"] = parts["offload"] / k0 * r * grad_accum
    return sum(parts.values()), parts
