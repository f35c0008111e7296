"""`fit`: the largest micro-batch whose step fits a memory budget, the accumulation that keeps the
effective batch, and a ranked plan of settings that make a target fit.

"Fits" is the one rule of :mod:`memlens.core.fits`: peak reserved + CUDA context <= budget - margin.
The margin covers estimator error (median 0.01% allocated, reserved ~3%) and run-to-run allocator
variation.

>>> from memlens import TrainingSpec                                       # doctest: +SKIP
>>> r = fit(TrainingSpec(model="gpt2", seq_len=1024), "16GiB", target_batch=64)  # doctest: +SKIP
>>> r.data["max_batch_size"], r.data["grad_accum"]                        # doctest: +SKIP
(11, 8)
"""
from __future__ import annotations

import contextvars
import inspect
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..core import progress as core_progress
from ..core.errors import MemlensError, NoDeviceError, sentences
from ..core.fits import RULE, Budget, need_bytes
from ..core.gpus import gpu_facts, nccl_bytes
from ..core.parallel import data_parallel_ranks
from ..core.result import Result
from ..core.spec import TrainingSpec
from ..core.units import fmt_bytes
from ..estimator.depth import depth_of
from ..measure.guard import free_cuda_cache, is_oom
from ..measure.trial import run_trial
from ..models.checkpoint import find_blocks
from ..models.source import resolve
from ..step.plan import StepPlan
from ..step.plan import resolve as resolve_step
from .core import (
    CachedEstimator,
    fit_with_accumulation,
    largest_divisor_at_most,
)
from .plan import make_plan
from .search import MAX_BATCH, MAX_TARGET_PER_GPU, Search, max_fitting_budget, verify_limit


def search_field(spec: TrainingSpec) -> str:
    """The field a batch search moves: what the step materializes at once (its kind's word: DP-SGD's
    ``physical_batch_size``, everything else ``batch_size``)."""
    return step_plan(spec).batch_field


def batch_unit(spec: TrainingSpec) -> int:
    """The step between micro-batches a spec can take (its kind's word: TRL's GRPO needs the generation batch to be a
    multiple of num_generations; others 1).

    >>> batch_unit(TrainingSpec(model="gpt2", trainer="grpo", batch_size=8)), batch_unit(TrainingSpec(model="gpt2"))
    (8, 1)
    """
    return step_plan(spec).batch_unit


def step_plan(spec: TrainingSpec) -> StepPlan:
    """The plan of ``spec``'s step, nothing refused (the estimates refuse what they cannot run, each in its row)."""
    return resolve_step(spec, refuse=False)


def first_probes(spec: TrainingSpec, cap: int = MAX_BATCH) -> list[TrainingSpec]:
    """The search's first two probes (batch 2, then the spec's own if 2 fits: max_fitting_budget),
    simulated side by side in the worker processes."""
    if batch_unit(spec) > 1:
        return []
    f = search_field(spec)
    if f == "physical_batch_size":
        cap = min(cap, spec.batch_size)
    if cap <= 1:
        return []
    return [spec.replace(**{f: b}) for b in dict.fromkeys((2, min(cap, max(2, getattr(spec, f) or 8))))]


def find_max_batch_size(spec: TrainingSpec, usable_bytes: int, *, estimator: CachedEstimator | None = None,
                        cap: int = MAX_BATCH) -> Search:
    """Largest micro-batch whose estimated reserved peak stays <= ``usable_bytes`` (a few estimates)."""
    est = estimator or CachedEstimator()
    f = search_field(spec)
    if f == "physical_batch_size":
        cap = min(cap, spec.batch_size)
    start = getattr(spec, f) or 8
    if getattr(est, "workers", 1) > 1:
        est.begin(first_probes(spec, cap))
    u = batch_unit(spec) if f == "batch_size" else 1
    if u > 1:   # GRPO: multiples of the unit only
        s = max_fitting_budget(lambda m: need_bytes(est(spec.replace(batch_size=m * u))), usable_bytes, cap=max(1, cap // u),
                               start=max(1, start // u))
        return Search(s.limit * u, [{**t, "batch": t["batch"] * u} for t in s.trials])
    return max_fitting_budget(lambda b: need_bytes(est(spec.replace(**{f: b}))), usable_bytes, cap=cap, start=start)


def fit(spec: TrainingSpec, budget: int | str | None = None, *, target_batch: int | None = None,
        margin: float | int | str | None = None, context_bytes: int | None = None, plan: bool = True, gpus: int = 8,
        estimator: CachedEstimator | None = None, method: str = "simulate", cap: int = MAX_BATCH,
        progress: Callable[[str], None] | None = None, full_plan: bool = False) -> Result:
    """The largest micro-batch of ``spec`` that fits ``budget``, its accumulation, and a ranked plan.

    ``target_batch``: the effective batch to keep (default: the spec's batch x accumulation).
    ``full_plan``: search every plan entry (by default an entry that only adds settings to another
    entry that fits, and cannot be faster, is listed as not searched: memlens.explore.plan).
    The result's data holds ``max_batch_size``, ``budget_bytes``, ``usable_bytes``,
    ``predicted_peak_bytes`` (reserved at max_batch_size), ``micro_batch_size`` and ``grad_accum``
    for the target, ``plan`` (ranked entries) and ``estimates`` (every probe).
    """
    sp = step_plan(spec)
    n = data_parallel_ranks(spec)      # the world over --tp: a tensor-parallel group shares one micro-batch
    _check_target(target_batch, n, sp.world_size)
    notes_gpus: list[str] = []
    if sp.world_size > 1 and context_bytes is None:
        context_bytes, note = _per_gpu_context(spec.gpu, sp.world_size)
        notes_gpus.append(note)
    b = Budget.make(budget, context_bytes=context_bytes, margin=margin, gpu=spec.gpu)
    t_start = time.perf_counter()
    est = estimator or CachedEstimator(method=method)
    f = sp.batch_field
    # the micro-batch is per GPU; the target is the effective batch of the whole job
    per_gpu = (target_batch // n) if target_batch else (spec.batch_size * spec.grad_accum if f == "batch_size" else spec.batch_size)
    target = per_gpu * n
    if progress:
        progress("max micro-batch")
    core_progress.advance(0, None, "largest micro-batch")
    base = spec.replace(grad_accum=1) if f == "batch_size" else spec
    fixed = sp.kind.search_base(spec) if sp.kind.search_base is not None else None
    if fixed is not None:   # its accumulation and plan left as given (GRPO: the generation batch kept)
        base, plan = fixed[0], False
    planned = _plan_beside(spec, base, est, b.usable_bytes, target, gpus, f, progress, full_plan, cap) if plan else None
    s = find_max_batch_size(base, b.usable_bytes, estimator=est, cap=cap)
    mbs = s.limit
    data: dict[str, Any] = {"max_batch_size": mbs, "searched_field": f, **b.to_dict(), "target_batch": target,
                            "estimates": s.trials, "method": est.method}
    notes = [
        f"fits: {RULE}: {b.describe()}",
        *([b.warning] if b.warning else []),
        "step times are predicted by the estimate's per-op time model (memlens.estimator.timing; a micro-batch not "
        "simulated itself: scaled by its tokens), not measured",
    ] + notes_gpus
    if n > 1:
        data.update(world_size=sp.world_size, per_gpu_target_batch=per_gpu, peak_rank=None)
    peak_alloc = peak_res = None
    if mbs:
        peak_alloc, peak_res = _micro_batch_for_target(spec, base, est, b, mbs, per_gpu, f, n, fixed, data, notes)
    else:
        p1 = est(base.replace(**{f: batch_unit(base)}))
        data.update(micro_batch_size=None, grad_accum=None, effective_batch_size=None, predicted_peak_bytes=None,
                    predicted_peak_allocated_bytes=None, batch1_peak_bytes=need_bytes(p1))
    data["plan"] = []
    if plan:
        entries = planned.result() if planned is not None else make_plan(spec, est, b.usable_bytes, target, gpus=gpus,
                                                                         field_name=f, progress=progress, prune=not full_plan)
        data.update(plan=[e.to_dict() for e in entries], gpus=gpus)
    data["estimate_calls"] = est.calls
    data["estimate_seconds"] = round(est.seconds, 2)     # summed over the threads that waited for estimates
    data["seconds"] = round(time.perf_counter() - t_start, 2)   # wall time of the search and the plan
    data["estimator"] = est.stats()
    return Result(verb="fit", spec=spec.to_dict(), peak_allocated_bytes=peak_alloc, peak_reserved_bytes=peak_res,
                  notes=notes, data=data)


def _check_target(target_batch: int | None, n: int, world: int) -> None:
    """One line for a target batch fit cannot search (not a whole number, not split over the ``n`` data-parallel ranks of
    ``world`` GPUs, too large)."""
    if target_batch is not None and (isinstance(target_batch, bool) or not isinstance(target_batch, int) or target_batch < 1):
        raise MemlensError(f"target batch must be a whole number >= 1, got {target_batch!r}", hint="e.g. --target-batch 64")
    if target_batch is not None and target_batch % n:
        over = f"--world-size {n} GPUs" if n == world else f"the {n} data-parallel ranks (--world-size / --tp)"
        raise MemlensError(f"the target batch {target_batch} does not split evenly over {over}",
                           hint=f"use a multiple of {n}, e.g. --target-batch {n * max(1, round(target_batch / n))}")
    if target_batch is not None and target_batch // n > MAX_TARGET_PER_GPU:
        raise MemlensError(f"target batch {target_batch:,} is {target_batch // n:,} samples per GPU, above the "
                           f"{MAX_TARGET_PER_GPU:,} fit searches (the largest micro-batch memlens simulates)",
                           hint="give the effective batch in samples per optimizer step, e.g. --target-batch 1024")


def _per_gpu_context(gpu: str | None, n: int) -> tuple[int, str]:
    """Per GPU of ``n``, what the budget loses outside the caching allocator: the CUDA context and NCCL's own buffers
    (bytes, and the note that says so)."""
    nccl, src = nccl_bytes(gpu_facts(gpu).name, n)
    return (gpu_facts(gpu).cuda_context_bytes + (nccl or 0),
            f"per GPU: budget - CUDA context - NCCL buffers ({'%.0f MiB' % (nccl / 2**20) if nccl else 'unknown'}: {src})")


def _plan_beside(spec, base, est, usable_bytes, target, gpus, f, progress, full_plan, cap):
    """The plan's searches started beside the micro-batch search (worker processes); None without workers (the plan
    is then made after it)."""
    if getattr(est, "workers", 1) <= 1:
        return None
    est.start(base)    # fork the workers before any thread exists (memlens.estimator.scaling.ScalingEstimator.start)
    firsts = first_probes(base, cap)
    est.begin(firsts)     # this search's first probes first in the workers' queue
    pool = ThreadPoolExecutor(max_workers=1)
    planned = pool.submit(contextvars.copy_context().run, make_plan, spec, est, usable_bytes, target, gpus=gpus,
                          field_name=f, progress=progress, prune=not full_plan, reference=firsts[0] if firsts else None)
    pool.shutdown(wait=False)
    return planned


def _micro_batch_for_target(spec, base, est, b, mbs, per_gpu, f, n, fixed, data, notes) -> tuple[int, int]:
    """The micro-batch and accumulation that keep the per-GPU target under the budget (``data`` and ``notes`` filled);
    returns the peak allocated and reserved bytes at the largest micro-batch ``mbs``."""
    p = est(base.replace(**{f: mbs}))
    if n > 1:
        data["peak_rank"] = p.peak_rank
    data["predicted_need_bytes"] = need_bytes(p)
    if fixed is not None:
        micro, accum = mbs, spec.grad_accum
        notes.append(fixed[1])
    elif f == "batch_size":
        micro = largest_divisor_at_most(per_gpu, mbs)
        if per_gpu // micro > 1:   # the accumulated run must fit too (fit_with_accumulation)
            fitting, acc, rejected = fit_with_accumulation(est, base, per_gpu, micro, b.usable_bytes)
            for r, rp in rejected:
                notes.append(f"micro-batch {r} x accumulation {per_gpu // r} does not fit: the micro-batches after the "
                             f"first run with every gradient held ({fmt_bytes(rp.peak_reserved_bytes)} reserved)")
            data["accumulated_peak_bytes"] = acc.peak_reserved_bytes
            if not fitting:
                data["target_fits"] = False
            micro = fitting or 1
        accum = per_gpu // micro
    else:
        micro, accum = min(mbs, per_gpu), 1
    data.update(micro_batch_size=micro, grad_accum=accum, effective_batch_size=micro * accum * n,
                predicted_peak_bytes=p.peak_reserved_bytes, predicted_peak_allocated_bytes=p.peak_allocated_bytes)
    if micro < mbs and f == "batch_size" and fixed is None:
        notes.append(f"micro-batch {micro} (not {mbs}) so that micro x accumulation{' x GPUs' if n > 1 else ''} = "
                     f"{per_gpu * n} exactly")
    return p.peak_allocated_bytes, p.peak_reserved_bytes


# ---------------------------------------------------------------- real trials
def require_verify_device(device: str) -> None:
    """One line, before any search, when ``--verify`` cannot run here."""
    if not str(device).startswith("cuda"):
        raise MemlensError("--verify needs a CUDA device (CPU steps never run out of GPU memory)", hint="drop --verify, or run on a GPU")
    try:
        import torch  # heavy: torch, loaded when a GPU is asked for
        ok = torch.cuda.is_available()
    except ImportError:
        ok = False
    if not ok:
        raise NoDeviceError("--verify needs a CUDA GPU and this machine has none", hint="drop --verify for the estimate alone")


def verify_fit(result: Result, spec: TrainingSpec, *, device: str = "cuda", timeout: float = 600, steps: int = 3,
               runner=None) -> dict[str, Any]:
    """Check ``fit``'s answer on this GPU with real steps (:func:`verify`), capped to the budget's share of
    the device; the findings are added to ``result.data["verify"]`` and returned."""
    import torch  # heavy: torch, loaded when a GPU is asked for

    require_verify_device(device)
    d = result.data
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    frac = min(1.0, (d["budget_bytes"] - d["context_bytes"]) / total)
    s = verify(spec, d["max_batch_size"], device=device, memory_fraction=frac, timeout=timeout, steps=steps, runner=runner)
    d["verify"] = {"max_batch_size": s.limit, "trials": s.trials, "memory_fraction": frac,
                   "estimate_within_one_below": 0 <= s.limit - d["max_batch_size"] <= 1}
    return d["verify"]


def verify(spec: TrainingSpec, seed: int, *, device: str = "cuda", memory_fraction: float | None = None,
           timeout: float = 600, steps: int = 3, cap: int = MAX_BATCH, runner=None) -> Search:
    """Confirm the largest batch with real steps, each in a fresh subprocess (``trial.run_trial``).

    Seeded by the estimate: seed+1 then seed (or seed+2): 2 trials when the estimate is exact or
    one below. ``memory_fraction`` caps the process (torch.cuda.set_per_process_memory_fraction).
    """
    sp = step_plan(spec)
    if sp.distributed:
        raise MemlensError(f"--verify runs one process; a {sp.world_size}-GPU job runs under torchrun",
                           hint=f"measure it with `memlens profile --world-size {sp.world_size}` (launches torchrun)")
    runner = runner or run_trial
    f = search_field(spec)
    base = spec.replace(grad_accum=1) if f == "batch_size" else spec
    outcomes: dict[int, dict] = {}

    def t(bs: int) -> bool:
        rec = runner(base.replace(**{f: bs}), device=device, steps=steps, timeout=timeout, memory_fraction=memory_fraction)
        outcomes[bs] = rec
        if rec["status"] not in ("ok", "oom"):
            raise MemlensError(f"trial at batch {bs} ended with {rec['status']}: {sentences(rec.get('error', ''))}",
                               hint="run `memlens profile` with that batch to see the error")
        return rec["status"] == "ok"

    s = verify_limit(t, seed, cap=cap)
    for tr in s.trials:
        rec = outcomes.get(tr["batch"], {})
        tr.update({k: rec.get(k) for k in ("status", "peak_allocated_bytes", "peak_reserved_bytes", "seconds")})
    return s


def fit_batch_size(train_step: Callable[[int], Any], *, spec: TrainingSpec | None = None, budget: int | str | None = None,
                   start: int | None = None, cap: int = MAX_BATCH, margin: float | int | str | None = None) -> Search:
    """The largest batch your own ``train_step(batch_size)`` runs without CUDA OOM, OOM-safe.

    Seeded by the estimate of ``spec`` under ``budget`` (default: free GPU memory) when given, else
    by ``start`` (default 1). Each OOM is caught, the cache emptied, and the search goes on: with a
    good seed it takes 2 calls, without one it steps up by doubling and bisects.

    >>> fit_batch_size(lambda b: None if b <= 5 else (_ for _ in ()).throw(RuntimeError("CUDA out of memory")), start=4).limit
    5
    """
    if spec is not None:
        b = Budget.make(budget, margin=margin, gpu=spec.gpu)
        seed = find_max_batch_size(spec, b.usable_bytes, cap=cap).limit
    else:
        seed = start if start is not None else 1

    def t(bs: int) -> bool:
        try:
            train_step(bs)
            return True
        except Exception as e:  # noqa: BLE001 - only OOMs are swallowed
            if not is_oom(e):
                raise
        free_cuda_cache()   # outside the except block: the traceback (and its tensors) is gone by now
        return False

    return verify_limit(t, seed, cap=cap)


# ---------------------------------------------------------------- the least recompute
POLICIES = ("full", "selective")   # checkpoint policies the search weighs (models/checkpoint.py)


def recompute_spec(spec: TrainingSpec, n: int, layers: int, all_flag: bool = True, policy: str = "full",
                   offload: int = 0) -> TrainingSpec:
    """``spec`` with its first ``n`` of ``layers`` blocks checkpointed under ``policy`` and the ``offload`` blocks after
    them run under save_on_cpu (0: none; all: --grad-checkpointing, whose deep stack is written from shallow models, or
    with ``all_flag`` False --checkpoint-layers L, memlens wrapping the blocks itself, as a factory's model needs; in
    between: simulated whole, memlens.estimator.depth)."""
    if n <= 0:
        s = spec.replace(checkpoint_layers=None, grad_checkpointing=False, checkpoint_policy="full")
    elif n >= layers and all_flag:
        s = spec.replace(checkpoint_layers=None, grad_checkpointing=True, checkpoint_policy=policy)
    else:
        s = spec.replace(checkpoint_layers=n, checkpoint_policy=policy)
    if offload > 0:
        s = s.replace(offload_layers=offload if n <= 0 else tuple(range(n, n + offload)))
    elif s.offload_layers is not None:
        s = s.replace(offload_layers=None)
    return s


def apply_plan_of(n: int, policy: str = "full", offload: int = 0) -> dict[str, Any]:
    """The memlens.apply plan of a least-recompute answer."""
    plan: dict[str, Any] = {"checkpoint_layers": n}
    if n and policy != "full":
        plan["checkpoint_policy"] = policy
    if offload:
        plan["offload_layers"] = offload if n == 0 else list(range(n, n + offload))
    return plan


def apply_line(n: int | dict, policy: str = "full", offload: int = 0) -> str:
    """The one line of code that applies a least-recompute answer."""
    plan = n if isinstance(n, dict) else apply_plan_of(n, policy, offload)
    return f"memlens.apply(model, {json.dumps(plan)})"


def _flags(key: tuple, layers: int, all_flag: bool) -> str:
    policy, n, m = key
    out = []
    if n:
        out.append("--grad-checkpointing" if n == layers and all_flag else f"--checkpoint-layers {n}")
        if policy != "full":
            out.append(f"--checkpoint-policy {policy}")
    if m:
        out.append(f"--offload-activations {m if n == 0 else ','.join(str(i) for i in range(n, n + m))}")
    return " ".join(out)


def _added_seconds(p) -> float:
    """What a point's checkpointing and offload add to one micro-batch (its activation_plan: recompute at the roofline,
    host copies both ways)."""
    ap = getattr(p, "activation_plan", None) or {}
    return float((ap.get("checkpoint") or {}).get("recompute_seconds", 0.0)) + float((ap.get("offload") or {}).get("transfer_seconds", 0.0))


def least_recompute(spec: TrainingSpec, budget: int | str | None = None, *, margin: float | int | str | None = None,
                    context_bytes: int | None = None, estimator: CachedEstimator | None = None, layers: int | None = None) -> Result:
    """The plan with the least added step time that fits ``budget``: how many blocks to checkpoint (the first N of the
    model's L), under which policy (full, or selective: matmul/attention outputs kept, the rest recomputed), and how
    many of the next blocks to offload to host memory (save_on_cpu).

    Each policy's peak falls about linearly in N (blocks are alike), its added time rises linearly. The ends are
    simulated first (none; all L blocks under each policy), giving each technique's bytes saved and seconds added per
    block (the simulation's own recompute FLOPs/bytes and host copies, memlens.estimator.result.activation_plan).
    Offload is weighed only where it can be cheaper per byte than recomputing: a block offloaded frees at most the
    bytes it sends to the host, each sent and fetched back, so its cost per byte freed is at least 2 / the PCIe rate;
    then all L blocks offloaded are simulated too. The cheapest mix by that line is then settled exactly for its
    policy: N is bisected between none (does not fit) and all (fits), starting at the pair where the line crosses the
    budget, then the bracket cut in thirds, until the fitting N and N - 1 that does not are both simulated (with the
    offloaded blocks, each answer checked by its own simulation). ``data["recompute_plan"]`` holds the answer, the
    rows (peaks, fit, seconds added per micro-batch), the probes and the line that applies it.
    """
    step_plan(spec).refuse_recompute_search()
    if spec.grad_accum > 1:
        spec = spec.replace(grad_accum=1)
    all_flag = layers is None      # the config's layers: transformers' own switch; else memlens wraps them all
    if layers is None:
        layers, all_flag = _blocks_of(spec)
    if not layers:
        raise MemlensError(f"--least-recompute needs the number of blocks of {spec.model} (num_hidden_layers in its config)",
                           hint="estimate a subset with --checkpoint-layers N instead")
    b = Budget.make(budget, context_bytes=context_bytes, margin=margin, gpu=spec.gpu)
    t0 = time.perf_counter()
    search = _RecomputeSearch(spec, layers, all_flag, b.usable_bytes, estimator or CachedEstimator(method="simulate"))
    search.weigh_ends()
    answer = search.settle()
    plan = search.plan(answer)
    gpu = search.gpu
    notes = [f"fits: {RULE}: {b.describe()}",
             "added seconds per micro-batch from the simulation's own ops (activation_plan): the recomputed ops priced by the "
             f"per-op time model for the {gpu.name} (memlens.estimator.timing), offloaded bytes both ways at its PCIe rate"]
    if not search.offload:
        notes.append("activation offload not weighed: a block offloaded frees at most the bytes it sends to the host, each "
                     f"sent and fetched back over PCIe ({gpu.pcie_bytes_per_s / 1e9:.0f} GB/s), which costs more per byte than "
                     "recomputing here")
    best = search.points[answer] if answer is not None else None
    data: dict[str, Any] = {"recompute_plan": plan, **b.to_dict(), "batch_size": spec.batch_size,
                            "estimate_calls": len(search.points), "seconds": round(time.perf_counter() - t0, 2),
                            "estimator": search.est.stats(), "method": "simulate"}
    return Result(verb="fit", spec=spec.to_dict(), peak_allocated_bytes=best.peak_allocated_bytes if best else None,
                  peak_reserved_bytes=best.peak_reserved_bytes if best else None, notes=notes, data=data)


def _blocks_of(spec: TrainingSpec) -> tuple[int | None, bool]:
    """(the model's number of blocks, whether --grad-checkpointing checkpoints them all): the config's layers; a VLM's
    language model's (the largest stack); a factory's block stack, built on the meta device (memlens wraps those)."""
    source = resolve(spec.model)
    layers = depth_of(source)
    text = getattr(getattr(source, "config", None), "text_config", None)
    if layers is None and text is not None and isinstance(getattr(text, "num_hidden_layers", None), int):
        return text.num_hidden_layers, False
    if layers is None and source.kind == "factory":
        return _factory_blocks(spec, source), False
    return layers, True


class _RecomputeSearch:
    """The probes of one least-recompute search: each key ``(policy, checkpointed blocks N, offloaded blocks M)``
    estimated once (``points``); per block, the bytes each technique saves and the seconds it adds (``saved``,
    ``cost``), from the simulated ends."""

    def __init__(self, spec: TrainingSpec, layers: int, all_flag: bool, usable_bytes: int, est) -> None:
        self.spec, self.layers, self.all_flag, self.usable, self.est = spec, layers, all_flag, usable_bytes, est
        self.points: dict[tuple, Any] = {}
        self.gpu = gpu_facts(spec.gpu)
        self.none = self.key("full", 0)
        self.ends = {p: self.key(p, layers) for p in POLICIES}
        self.saved: dict[str, float] = {}
        self.cost: dict[str, float] = {}
        self.offload = False

    @staticmethod
    def key(policy: str, n: int, m: int = 0) -> tuple:
        return ("full" if n == 0 else policy, n, m)

    def probe(self, keys) -> None:
        keys = [k for k in dict.fromkeys(keys) if k not in self.points]
        specs = [recompute_spec(self.spec, k[1], self.layers, self.all_flag, k[0], k[2]) for k in keys]
        if getattr(self.est, "workers", 1) > 1 and len(specs) > 1:
            self.est.prefetch(specs)                      # side by side in the worker processes
        for k, s in zip(keys, specs):
            self.points[k] = self.est(s)

    def fits(self, k: tuple) -> bool:
        return need_bytes(self.points[k]) <= self.usable

    def weigh_ends(self) -> None:
        """Simulate none and all blocks under each policy (and all offloaded, where offload can be cheaper per byte than
        recomputing: it frees at most what it sends, sent and fetched back over PCIe)."""
        none, layers = self.none, self.layers
        self.probe([none, *self.ends.values()])
        self.saved = {p: (need_bytes(self.points[none]) - need_bytes(self.points[k])) / layers for p, k in self.ends.items()}
        self.cost = {p: _added_seconds(self.points[k]) / layers for p, k in self.ends.items()}
        cheapest = min((self.cost[p] / self.saved[p] for p in POLICIES if self.saved[p] > 0), default=float("inf"))
        self.offload = 2 / self.gpu.pcie_bytes_per_s < cheapest
        if self.offload:
            k = self.key("full", 0, layers)
            self.probe([k])
            self.saved["offload"] = (need_bytes(self.points[none]) - need_bytes(self.points[k])) / layers
            self.cost["offload"] = _added_seconds(self.points[k]) / layers

    def _line_need(self, policy: str, n: int, m: int) -> float:
        return need_bytes(self.points[self.none]) - n * self.saved[policy] - m * self.saved.get("offload", 0.0)

    def _options(self) -> list[tuple[float, str, int, int]]:
        """(seconds added, policy, N, M) of every mix the line says fits, cheapest first."""
        options = []
        for p in POLICIES:
            if not self.fits(self.ends[p]) and not self.offload:
                continue
            for m in (range(self.layers + 1) if self.offload else (0,)):
                n = next((n for n in range(self.layers - m + 1) if self._line_need(p, n, m) <= self.usable), None)
                if n is not None and (n or m):
                    options.append((n * self.cost[p] + m * self.cost.get("offload", 0.0), p, n, m))
        return sorted(options)

    def settle(self) -> tuple | None:
        """The answer: none if it fits; else the cheapest mix by the line that fits at all, its N settled exactly."""
        if self.fits(self.none):
            return self.none
        for _, p, guess_n, m in self._options()[:3]:
            top = self.key(p, self.layers - m, m)
            self.probe([top])
            if self.fits(top):
                return self.key(p, self._bisect(p, m, guess_n), m)
        return None

    def _bisect(self, p: str, m: int, guess_n: int) -> int:
        """The fewest checkpointed blocks that fit under policy ``p`` with ``m`` offloaded (the top fits): bisected from
        the line's guess, then the bracket cut in thirds, until N fits and N - 1 does not (both simulated)."""
        lo, hi = -1, self.layers - m                  # lo does not fit (or is below 0), hi fits
        base = self.key(p, 0, m)
        self.probe([base])
        if self.fits(base):
            hi = 0
        else:
            lo = 0
        guesses = [guess_n - 1, guess_n]
        while hi - lo > 1:
            self.probe([self.key(p, n, m) for n in guesses if lo < n < hi])
            for k in sorted(self.points):
                if k[2] == m and (k[0] == p or k[1] == 0) and lo < k[1] < hi:
                    if self.fits(k):
                        hi = k[1]
                    else:
                        lo = k[1]
            span = hi - lo
            guesses = [lo + max(1, span // 3), lo + max(1, (2 * span) // 3)]
        return hi

    def _row(self, name: str, k: tuple) -> dict[str, Any]:
        p, layers = self.points[k], self.layers
        return {"name": name, "checkpoint_layers": k[1], "checkpoint_policy": k[0], "offload_layers": k[2], "layers": layers,
                "fits": self.fits(k), "need_bytes": need_bytes(p), "predicted_peak_bytes": p.peak_reserved_bytes,
                "predicted_peak_allocated_bytes": p.peak_allocated_bytes, "added_seconds": round(_added_seconds(p), 6),
                "activation_plan": p.activation_plan, "flags": _flags(k, layers, self.all_flag)}

    def _label(self, k: tuple) -> str:
        p, n, m = k
        what = [] if n == 0 else [f"{'all' if n == self.layers else f'first {n} of'} {self.layers}" + ("" if p == "full" else f" {p}")]
        if m:
            what.append(f"offload {m}")
        return ", ".join(what) or "none"

    def plan(self, answer: tuple | None) -> dict[str, Any]:
        """The recompute plan: the answer, the rows (none, each end, the answer), per block, the probes, how to apply it."""
        all_off = self.key("full", 0, self.layers)
        rows = [self._row("none", self.none)] + [self._row(self._label(k), k) for k in self.ends.values()]
        if self.offload:
            rows.append(self._row(self._label(all_off), all_off))
        if answer is not None and answer not in [self.none, *self.ends.values(), all_off]:
            rows.insert(1, self._row(self._label(answer), answer))
        plan: dict[str, Any] = {"layers": self.layers, "checkpoint_layers": None if answer is None else answer[1],
                                "checkpoint_policy": None if answer is None else answer[0],
                                "offload_layers": None if answer is None else answer[2], "fits": answer is not None,
                                "rows": rows, "offload_weighed": self.offload,
                                "per_block": {k: {"bytes_saved": int(self.saved[k]), "seconds_added": round(self.cost[k], 6)}
                                              for k in self.saved},
                                "probes": [{"checkpoint_layers": k[1], "checkpoint_policy": k[0], "offload_layers": k[2],
                                            "need_bytes": need_bytes(self.points[k]), "fits": self.fits(k)}
                                           for k in sorted(self.points)]}
        if answer is not None:
            ap = apply_plan_of(answer[1], answer[0], answer[2])
            plan.update(apply=ap, code=apply_line(ap), flags=_flags(answer, self.layers, self.all_flag),
                        added_step_seconds=round(_added_seconds(self.points[answer]), 6),
                        full_checkpointing_added_seconds=round(_added_seconds(self.points[self.ends["full"]]), 6))
        return plan


def _factory_blocks(spec: TrainingSpec, source) -> int | None:
    import torch  # heavy: loaded when a factory's model is built

    try:
        with torch.device("meta"):
            built = source.factory(spec) if _takes_spec(source.factory) else source.factory()
    except Exception:  # noqa: BLE001 - the user's factory: the caller says the blocks could not be counted
        return None
    model = built[0] if isinstance(built, tuple) else built
    return len(find_blocks(model)[1])


def _takes_spec(f) -> bool:
    try:
        return len(inspect.signature(f).parameters) >= 1
    except (TypeError, ValueError):
        return False
