"""The per-rank estimate of an N-GPU job, on this CPU: simulate the ranks that can differ.

Each simulated rank is the real training step of :mod:`memlens.estimator.simulate`, with the
rank's wrapper (DDP + the Reducer model, ZeRO-1, FSDP2) applied by :func:`memlens.step.prepare`
under a fake process group of ``world_size`` ranks. Which ranks differ is the wrapper's answer
(:meth:`~memlens.step.parallel.base.Wrapper.rank_groups`): every DDP rank holds the same
tensors; FSDP2's first ranks hold the largest shards and the last the smallest; ZeRO-1's ranks
differ by the parameter bytes their optimizer updates. Rank 0 is simulated first, then the other
representatives; ranks between two simulated ones are reported as bounded by them.

>>> from memlens.core.spec import TrainingSpec
>>> r = estimate_ranks(TrainingSpec(model="tests.tiny_models:mlp", world_size=2, sharding="ddp"))  # doctest: +SKIP
>>> [e["rank"] for e in r.data["ranks"]]                                                           # doctest: +SKIP
[0]
"""
from __future__ import annotations

import json
import time
from typing import Any

from ..core.enums import Category
from ..core.events import ALLOC, FREE, PHASE, TAG
from ..core.gpus import gpu_facts, nccl_bytes
from ..core.ledger import CachingAllocatorModel, analyze, group_modules
from ..core.parallel import communicators
from ..core.result import Result
from ..core.spec import TrainingSpec
from ..models.source import resolve
from ..step.parallel.ddp import HOLD_STALE_BUCKETS
from ..step.parallel.fakepg import fake_process_group
from ..step.parallel.fsdp import FSDPWrapper
from ..step.plan import StepPlan
from ..step.plan import resolve as resolve_plan
from .result import finish, simulation_facts

TOP_MODULES = 40


STALE_CAUSE = ("DDP's first buckets, dropped when the Reducer rebuilds them at step 2's forward, stay allocated "
               "until ProcessGroupNCCL's watchdog (every 100 ms) reaps step 1's all-reduce Works that stash them "
               "(memlens.step.parallel.ddp)")


def simulate_rank(spec: TrainingSpec, rank: int, source=None, steps: int = 2, stale_buckets: bool = True,
                  plan: StepPlan | None = None):
    """One rank of ``spec``'s job simulated in this process (a fake process group around it).
    ``stale_buckets`` False: DDP's old buckets are reaped before its rebuild (the expected case)."""
    from .simulate import simulate  # heavy: imports torch

    source = source or resolve(spec.model)
    plan = plan or resolve_plan(spec, fake=True, source=source)
    token = HOLD_STALE_BUCKETS.set(stale_buckets)
    try:
        with fake_process_group(rank, plan.world_size):
            return simulate(spec, source=source, steps=steps, plan=plan)
    finally:
        HOLD_STALE_BUCKETS.reset(token)


def _held_stale(sim) -> bool:
    """Did this simulation keep DDP's old buckets past the rebuild?"""
    red = getattr(sim.wrapper, "reducer", None)
    return bool(red is not None and red.hold_stale and red.rebuilt)


def estimate_ranks(spec: TrainingSpec, steps: int = 2, source=None, plan: StepPlan | None = None) -> Result:
    """Per-rank peaks (allocated and reserved), the rank that peaks, each simulated rank's breakdown
    by category, phase and module, the whole job's memory and NCCL's share (verb "estimate").
    ``plan``: the step's plan, if resolved already."""
    t0 = time.perf_counter()
    source = source or resolve(spec.model)
    plan = plan or resolve_plan(spec, fake=True, source=source)
    gpu = gpu_facts(spec.gpu)
    groups, sims, worst = _simulate_ranks(plan, source, steps)
    nccl, nccl_source = nccl_bytes(gpu.name, plan.world_size, communicators(spec))
    ctx = gpu.cuda_context_bytes
    entries, analyses = _entries(groups, sims, worst, ctx, nccl)
    by = getattr(sims[entries[0]["rank"]].wrapper, "headline_by", "peak_allocated_bytes")   # --pp: the largest reserved
    peak = max(entries, key=lambda e: (e[by], e["peak_allocated_bytes"], -e["rank"]))
    lo = min(entries, key=lambda e: e["peak_allocated_bytes"])
    sim_worst = [e["worst_case"] for e in entries if e.get("worst_case")]
    for g in groups:
        if g.rank < 0:
            entries.append({"rank": None, "ranks": list(g.ranks), "why": g.why, "simulated": False,
                            "peak_allocated_bytes_between": [lo["peak_allocated_bytes"], peak["peak_allocated_bytes"]],
                            "peak_reserved_bytes_between": [lo["peak_reserved_bytes"], peak["peak_reserved_bytes"]]})
            if sim_worst:     # DDP's stale buckets: these ranks' worst case is bounded by the simulated ranks' worst
                entries[-1]["worst_case"] = {k: max(w[k] for w in sim_worst) for k in ("peak_allocated_bytes", "peak_reserved_bytes")}
    a = analyses[peak["rank"]]
    sim = sims[peak["rank"]]
    notes = [
        f"{plan.sharding.name} over {plan.world_size} GPUs = {sim.wrapper.strategy}; each rank's micro-batch is --batch-size "
        f"{spec.batch_size} (effective batch {spec.effective_batch_size}).",
        "peak_allocated_bytes / peak_reserved_bytes: the rank that peaks (max_memory_allocated / max_memory_reserved on "
        f"its GPU); ranks: {', '.join(_describe_group(e) for e in entries)}.",
        "job: every rank's peak summed (ranks peak at different moments, so it bounds what the GPUs hold at once).",
        f"nvidia-smi per rank: reserved + CUDA context ({ctx // 2**20} MiB) + NCCL's own buffers "
        + (f"({nccl / 2**20:.0f} MiB, {nccl_source})." if nccl is not None else f"(unknown: {nccl_source})."),
    ]
    if by != "peak_allocated_bytes":
        notes.append(f"the headline is the simulated rank with the largest {by.removeprefix('peak_').removesuffix('_bytes')} "
                     f"peak: rank {peak['rank']}, {peak['why']}")
    worst_case = _worst_case(entries, notes) if worst else None
    passes = peak.get("passes") or []
    if passes:
        notes.append(passes_note(passes))
    data = {
        "method": "simulate",
        "world_size": plan.world_size,
        "sharding": plan.sharding.name,
        "strategy": sim.wrapper.strategy,
        "peak_rank": peak["rank"],
        "ranks": entries,
        "rank_imbalance_bytes": peak["peak_allocated_bytes"] - lo["peak_allocated_bytes"],
        "job": _job(entries, plan.world_size, ctx, nccl),
        "nccl": {"bytes_per_rank": nccl, "source": nccl_source},
        "cuda_context_bytes": ctx,
        "nvidia_smi_estimate_bytes": peak["nvidia_smi_estimate_bytes"],
        **({"worst_case": worst_case} if worst_case else {}),
        "gpu": gpu.to_dict(),
        "wrapper": _jsonable(sim.wrapper.facts),
        **simulation_facts(sim, a),
        **({"later_layers": sim.later_layers} if sim.later_layers else {}),
        "simulate_seconds": round(time.perf_counter() - t0, 3),
    }
    return finish(Result(verb="estimate", spec=spec.to_dict(), peak_allocated_bytes=a.peak_allocated_bytes,
                         peak_reserved_bytes=a.peak_reserved_bytes, by_category=dict(a.by_category), by_phase=a.by_phase,
                         by_module=a.by_module, timeline=a.timeline, notes=notes, data=data), spec)


def _simulate_ranks(plan: StepPlan, source, steps: int) -> tuple[list, dict, dict]:
    """(the wrapper's rank groups, rank -> its simulation for each representative, rank -> the analysis of its
    worst case: DDP's old buckets held past the rebuild, when a rank held them; else empty)."""
    spec = plan.spec
    steps = max(steps, getattr(plan.wrapper, "steady_step", 0))   # DDP: the step after its bucket rebuild
    pick = getattr(plan.wrapper, "first_rank", None)       # --pp-stage: the pipeline rank asked for, not rank 0
    r0 = pick(spec) if pick is not None else 0
    first = simulate_rank(spec, r0, source, steps, plan=plan)
    groups = first.wrapper.rank_groups()
    sims = {r0: first}
    for g in groups:
        if g.rank >= 0 and g.rank not in sims:
            sims[g.rank] = simulate_rank(spec, g.rank, source, steps, plan=plan)
    # DDP: the old buckets may outlive the rebuild (worst case, simulated above) or be reaped first (expected:
    # measured on 2 GPUs, Llama-1B bf16 tied, both ranks peaked without them); the headline is the expected one
    worst: dict[int, Any] = {}
    if any(_held_stale(x) for x in sims.values()):
        worst = {r: analyze(x.log) for r, x in sims.items()}
        sims = {r: simulate_rank(spec, r, source, steps, stale_buckets=False, plan=plan) for r in sims}
    return groups, sims, worst


def _entries(groups: list, sims: dict, worst: dict, ctx: int, nccl: int | None) -> tuple[list[dict[str, Any]], dict]:
    """Each simulated rank's entry (with its worst case, if any) and rank -> its analysis."""
    entries: list[dict[str, Any]] = []
    analyses = {}
    for g in groups:
        if g.rank < 0:
            continue
        sim = sims[g.rank]
        a = analyses[g.rank] = analyze(sim.log)
        entries.append(_rank_entry(g, sim, a, ctx, nccl, group_modules))
        if worst:
            w = worst[g.rank]
            entries[-1]["worst_case"] = {"peak_allocated_bytes": w.peak_allocated_bytes, "peak_reserved_bytes": w.peak_reserved_bytes,
                                         "nvidia_smi_estimate_bytes": w.peak_reserved_bytes + ctx + (nccl or 0),
                                         "peak_phase": w.peak_phase, "peak_step": w.peak_step, "cause": STALE_CAUSE}
    return entries, analyses


def _worst_case(entries: list[dict[str, Any]], notes: list[str]) -> dict[str, Any]:
    """The rank that peaks highest with DDP's stale buckets, and a note on it."""
    wpk = max((e for e in entries if e.get("worst_case") and e["rank"] is not None), key=lambda e: (e["worst_case"]["peak_allocated_bytes"], -e["rank"]))
    worst_case = {"rank": wpk["rank"], **wpk["worst_case"]}
    notes.append(f"peak (expected): without DDP's stale buckets; worst case {_gib(worst_case['peak_allocated_bytes'])} "
                 f"allocated, {_gib(worst_case['peak_reserved_bytes'])} reserved (rank {wpk['rank']}; worst_case): "
                 f"{STALE_CAUSE}. Whether a rank sees them depends on the watchdog's timing; on 2 GPUs both ranks of "
                 "a tied Llama-3.2-1B bf16 job peaked at the expected value.")
    return worst_case


def _rank_entry(g, sim, a, ctx: int, nccl: int | None, group_modules) -> dict[str, Any]:
    terms, maxima = peak_terms(sim.log, a.peak_event, sim.wrapper)
    step = max(1, len(a.timeline) // 120)
    extra = {}
    marks = getattr(sim.wrapper, "pass_marks", None)
    if marks:
        extra["passes"] = pass_peaks(sim.log, marks, sim.wrapper)
    return {
        "rank": g.rank, "ranks": list(g.ranks), "why": g.why, "simulated": True,
        "peak_allocated_bytes": a.peak_allocated_bytes, "peak_reserved_bytes": a.peak_reserved_bytes,
        "peak_phase": a.peak_phase, "peak_step": a.peak_step,
        "nvidia_smi_estimate_bytes": a.peak_reserved_bytes + ctx + (nccl or 0),
        "by_category": dict(a.by_category), "by_phase": a.by_phase,
        "by_module_group": group_modules(a.by_module)[:TOP_MODULES],
        "terms": terms,
        "term_maxima": maxima,
        "steps": a.steps,
        "end_reserved_bytes": a.end_reserved_bytes,
        "timeline": a.timeline[::step],
        "simulate_seconds": round(sim.seconds, 3),
        **extra,
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _describe_group(e: dict[str, Any]) -> str:
    ranks = e["ranks"]
    span = f"{ranks[0]}" if len(ranks) == 1 else (f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ",".join(map(str, ranks)))
    if not e.get("simulated"):
        return f"ranks {span} between the simulated ones"
    return f"rank {e['rank']} simulated for rank{'s' if len(ranks) > 1 else ''} {span}"


def _job(entries: list[dict[str, Any]], world: int, ctx: int, nccl: int | None) -> dict[str, Any]:
    """The whole job: each rank's peak, every rank counted once (ranks between two simulated ranks at the higher)."""
    alloc = res = 0
    hi = max((e for e in entries if e.get("simulated")), key=lambda e: e["peak_allocated_bytes"])
    counted = 0
    for e in entries:
        src = e if e.get("simulated") else hi
        n = len(e["ranks"])
        counted += n
        alloc += n * src["peak_allocated_bytes"]
        res += n * src["peak_reserved_bytes"]
    return {"gpus": world, "ranks_counted": counted, "peak_allocated_bytes_sum": alloc, "peak_reserved_bytes_sum": res,
            "cuda_context_bytes_sum": world * ctx, "nccl_bytes_sum": None if nccl is None else world * nccl,
            "nvidia_smi_bytes_sum": None if nccl is None else res + world * (ctx + nccl)}


def peak_terms(log, index: int, wrapper) -> tuple[dict[str, int], dict[str, int]]:
    """The memory of a rank split into the terms that shrink as 1/N under sharding and those that do
    not: sharded parameters / gradients / optimizer states, gathered (unsharded) parameters and
    gradients, collective buffers, activations, temporaries. Returns (bytes of each term live at
    the peak, event ``index``; the most bytes of each term live at any moment), in allocator blocks."""
    terms = _TermReplay(log.events, wrapper)
    now = terms.now
    most: dict[str, int] = {}
    at_peak: dict[str, int] = {}
    for i, ev in enumerate(log.events):
        if ev.kind == PHASE and ev.name == "done":
            break
        t = terms.apply(ev)
        if t is not None and now[t] > most.get(t, 0):
            most[t] = now[t]
        if i == index:
            at_peak = {t: v for t, v in now.items() if v}
    order = lambda d: dict(sorted(d.items(), key=lambda kv: -kv[1]))  # noqa: E731
    return order(at_peak), order(most)


class _TermReplay:
    """The bytes of each term (:func:`peak_terms`) live as a rank's events are replayed through the allocator model."""

    def __init__(self, events: list, wrapper):
        self.final = {ev.key: ev.category for ev in events if ev.kind == TAG}   # each storage's last tag
        self.term = _term_of(wrapper)
        self.allocator = CachingAllocatorModel()
        self.live: dict[Any, tuple[int, str]] = {}    # key -> (block bytes, term)
        self.now: dict[str, int] = {}                 # term -> bytes live

    def apply(self, ev) -> str | None:
        """Apply one event: the term whose bytes it changed, or None (a tag, a mark, a storage not live)."""
        a, kind = self.allocator, ev.kind
        if kind == ALLOC and not a.is_live(ev.key):
            t = self.term(ev.key, self.final.get(ev.key, ev.category))
            size = a.malloc(ev.key, ev.nbytes, ev.stream)
            self.live[ev.key] = (size, t)
            self.now[t] = self.now.get(t, 0) + size
            return t
        if kind == FREE and a.is_live(ev.key):
            a.free(ev.key)
            size, t = self.live.pop(ev.key)
            self.now[t] -= size
            return t
        return None


def _term_of(wrapper):
    """key, category -> the term it counts in (see :func:`peak_terms`)."""
    gathered = getattr(wrapper, "unsharded_keys", set())
    gathered_grads = getattr(wrapper, "unsharded_grad_keys", set())
    sharded = isinstance(wrapper, FSDPWrapper)       # and Opacus' FSDP2Wrapper (ghost_fsdp)
    opt_sharded = sharded or type(wrapper).__name__ == "Zero1Wrapper"

    def term(key, cat: str) -> str:
        if key in gathered:
            return "gathered parameters"
        if key in gathered_grads:
            return "gathered gradients"
        if cat in (Category.PARAMETERS, Category.GRADIENTS):
            return f"{'sharded ' if sharded else ''}{cat}"
        if cat == Category.OPTIMIZER_STATE:
            return "optimizer states" + (" (sharded)" if opt_sharded else "")
        return cat

    return term


PASS_WHAT = {
    "forward": "forward (Opacus' hooks keep each trainable layer's input)",
    "backward 1": "backward 1: loss.mean() with retain_graph=True; the norm samplers compute per-sample gradient norms",
    "backward 2": "backward 2: the loss re-weighted by the clipping coefficients, hooks off; the retained graph is freed",
    "clip": "clip: the DP optimizer accumulates (and on the last physical batch adds noise and steps)",
}


def pass_peaks(log, marks, wrapper) -> list[dict[str, Any]]:
    """The passes of step 1 (DP-SGD ghost clipping: forward, backward 1, backward 2, clip of each
    physical batch) from the step's marks ``(run, physical batch, pass, event index)``: each one's
    peak (allocator blocks) and the terms live at it, the bytes live as it starts, and the FSDP2
    collectives the wrapper counted in it (first physical batch)."""
    later = [m[3] for m in marks if m[0] > 1]
    marks = [m for m in marks if m[0] == 1]
    if not marks:
        return []
    events = log.events
    end = min(later) if later else next((i for i, ev in enumerate(events) if ev.kind == PHASE and ev.name == "done"), len(events))
    terms = _TermReplay(events, wrapper)
    now = terms.now
    counts = {p["pass"]: p for p in getattr(wrapper, "facts", {}).get("passes", ())}
    out: list[dict[str, Any]] = []
    w, cur = 0, None
    for i in range(end):
        while w < len(marks) and i >= marks[w][3]:
            _, physical, name, _ = marks[w]
            total = sum(now.values())
            cur = {"physical_batch": physical, "pass": name, "what": PASS_WHAT.get(name, name),
                   "start_allocated_bytes": total, "terms_at_start": {t: v for t, v in now.items() if v},
                   "peak_allocated_bytes": total, "terms_at_peak": {t: v for t, v in now.items() if v}}
            c = counts.get(name)
            if c is not None and physical == 1:
                cur["all_gathers"], cur["reduce_scatters"] = c["all_gathers"], c["reduce_scatters"]
            out.append(cur)
            w += 1
        if terms.apply(events[i]) is None:
            continue
        total = sum(now.values())
        if cur is not None and total > cur["peak_allocated_bytes"]:
            cur["peak_allocated_bytes"] = total
            cur["terms_at_peak"] = {t: v for t, v in now.items() if v}
    for c in out:
        for k in ("terms_at_start", "terms_at_peak"):
            c[k] = dict(sorted(c[k].items(), key=lambda kv: -kv[1]))
    return out


def passes_note(passes: list[dict[str, Any]]) -> str:
    """One line on ghost clipping's two backward passes of the first physical batch."""
    def one(p):
        comm = (f", {p['all_gathers']} FSDP all-gathers and {p['reduce_scatters']} reduce-scatters"
                if "all_gathers" in p else "")
        return (f"{p['pass']} peaks at {p['peak_allocated_bytes'] / 2**20:.1f} MiB "
                f"(activations {p['terms_at_start'].get('activations', 0) / 2**20:.1f} MiB live as it starts){comm}")
    first = [p for p in passes if p["physical_batch"] == 1 and p["pass"].startswith("backward")]
    return ("ghost clipping runs two backward passes per physical batch: backward 1 (loss.mean(), retain_graph=True: "
            "per-sample norms; the saved activations stay) and backward 2 (loss re-weighted by the clipping "
            "coefficients, hooks off); in the first: " + "; ".join(one(p) for p in first) + " (data.ranks[i].passes).")


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))
