"""fit's fast search: every answer is what full simulations say (brute force over a grid on a tiny
GPT-2), the guided divisor search against brute force, the fallback when the peak is not monotone,
entries left out of the plan (and that the full search agrees they rank lower), sharded specs in
the worker processes (and the fallback when a worker dies)."""
from __future__ import annotations

import random
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest
from explore_support import GiB, fake_estimator

from memlens.core.errors import MemlensError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.explore.core import CachedEstimator, Point, predict_step_time
from memlens.explore.fit import fit
from memlens.core.fits import need_bytes
from memlens.explore.plan import Candidate, candidates, make_plan, plan_entry
from memlens.explore.search import max_fitting_among

TINY_GPT2 = str(Path(__file__).parent.parent / "fixtures" / "models" / "tiny-gpt2" / "config.json")
SPEC = TrainingSpec(model="fake", batch_size=8, seq_len=512)


# ---------------------------------------------------------------- the search alone
def test_guided_divisor_search_equals_brute_force():
    """Any monotone peak, any budget, with or without a (possibly wrong) slope and points known
    elsewhere: the largest value that fits, and the probes bracket it (it fits, the next does not)."""
    rnd = random.Random(7)
    for _ in range(2000):
        vals = sorted(rnd.sample(range(1, 200), rnd.randint(1, 12)))
        acc, table = rnd.randint(0, 100), {}
        for v in vals:
            acc += rnd.randint(0, 50)
            table[v] = acc
        budget = rnd.randint(0, acc + 20)
        want = max((v for v in vals if table[v] <= budget), default=0)
        known = {v: table[v] for v in rnd.sample(vals, rnd.randint(0, len(vals)))} if rnd.random() < 0.3 else {}
        for slope in (None, lambda: rnd.choice([None, -1.0, 0.5, 5.0, 50.0])):
            s = max_fitting_among(vals, table.__getitem__, budget, known=lambda: known, slope=slope)
            assert s.limit == want
            probed = {t["batch"] for t in s.trials} | set(known)
            nxt = [v for v in vals if v > want]
            assert (want == 0 or want in probed or any(k >= want and table[k] <= budget for k in probed))
            assert not nxt or nxt[0] in probed or any(k <= nxt[0] and table[k] > budget for k in probed)


def test_a_good_slope_saves_the_second_probe():
    line = lambda b: 1000 + 300 * b  # noqa: E731
    plain = max_fitting_among([1, 2, 4, 8, 16, 32], line, 4000)
    guided = max_fitting_among([1, 2, 4, 8, 16, 32], line, 4000, slope=lambda: 300)
    assert plain.limit == guided.limit == 8
    assert [t["batch"] for t in plain.trials] == [32, 2, 8, 16]
    assert [t["batch"] for t in guided.trials] == [32, 8, 16]
    # points another search estimated decide without probes of its own
    known = max_fitting_among([1, 2, 4, 8, 16, 32], line, 4000, known=lambda: {10: line(10), 11: line(11)})
    assert known.limit == 8 and known.trials == []


def test_an_entry_searches_the_accumulated_runs_and_answers_with_one_of_them():
    """The later micro-batches of an accumulated run hold every gradient (2 GiB more here): a
    micro-batch whose own step fits (4: 9 GiB, estimated by another search) can still not fit
    accumulated. The entry probes the accumulated runs themselves, and its peak is its answer's."""
    usable = 10 * GiB
    plain = {1: 2, 2: 4, 4: 9, 8: 12}

    def need(s: TrainingSpec) -> Point:
        v = (plain[s.batch_size] + (2 if s.grad_accum > 1 else 0)) * GiB
        return Point(v, v, param_count=1000, trainable_param_count=1000, seq_len=512)

    est = CachedEstimator(fn=need)
    est(SPEC.replace(batch_size=4, grad_accum=1))       # what another search left in the cache
    e = plan_entry(SPEC, Candidate("as given", {}, "same math", ""), est, usable, 8)
    assert (e.micro_batch, e.grad_accum, e.predicted_peak_bytes) == (2, 4, 6 * GiB) and e.fits
    assert SPEC.replace(batch_size=4, grad_accum=2) in est.cache      # probed itself, found not to fit
    # the first guess took the line of the spec as given through batch 2 and the whole target
    # (fit's own first probes): 8 -> 4, then 2; no accumulated run of batch 1
    assert SPEC.replace(batch_size=2, grad_accum=1) in est.cache and SPEC.replace(batch_size=1, grad_accum=8) not in est.cache


# ---------------------------------------------------------------- entries left out
def test_entries_that_add_settings_to_a_faster_fitting_entry_are_not_searched():
    full = {e.name: e for e in make_plan(SPEC, fake_estimator(), 12 * GiB, 32, gpus=4, prune=False)}
    est = fake_estimator()
    pruned = make_plan(SPEC, est, 12 * GiB, 32, gpus=4)
    left = {e.name: e for e in pruned if e.not_searched}
    assert set(left) == {"AMP bf16 + checkpointing", "bf16 + checkpointing + 8-bit AdamW", "ZeRO-2 over 4 GPUs",
                         "FSDP (ZeRO-3) over 4 GPUs", "CPU offload of the optimizer"}
    # every searched entry is what the full plan says, in the same order
    keys = ("fits", "micro_batch", "grad_accum", "predicted_peak_bytes", "predicted_step_seconds", "error", "rank")
    searched = [e for e in pruned if not e.not_searched]
    assert [(e.name, *(getattr(e, k) for k in keys[:-1])) for e in searched] == \
        [(e.name, *(getattr(e, k) for k in keys[:-1])) for e in sorted(full.values(), key=lambda e: e.rank) if e.name not in left]
    assert [e.rank for e in pruned] == list(range(1, len(pruned) + 1))
    assert all(e.fits for e in pruned[: len([e for e in searched if e.fits])])       # fitting first, then not searched
    for name, e in left.items():
        dominator = next(o for o in pruned if e.not_searched.startswith(f"not searched: {o.name} fits"))
        assert e.fits is None and e.micro_batch is None and e.predicted_peak_bytes is None
        # the claim holds: searched in full, the entry needs more GPU-seconds than the one that decided it
        assert full[name].gpu_seconds >= e.extra["best_gpu_seconds"] > dominator.gpu_seconds
        assert e.extra["best_gpu_seconds"] == pytest.approx(float(e.not_searched.split("below ~")[1].split()[0]), rel=1e-2)
    # fewer estimates than the full plan
    assert est.calls < fake_estimator_calls_full()


def fake_estimator_calls_full() -> int:
    est = fake_estimator()
    make_plan(SPEC, est, 12 * GiB, 32, gpus=4, prune=False)
    return est.calls


def test_lora_entries_are_always_searched():
    """LoRA/QLoRA change the parameters: no bound from another entry's counts, so never left out."""
    est = fake_estimator()
    entries = make_plan(SPEC, est, 40 * GiB, 32, gpus=4)
    assert [e.name for e in entries if e.kind == "changes the model" and e.not_searched] == []
    assert {c.name for c in candidates(SPEC, gpus=4) if c.kind == "changes the model"} <= {e.name for e in entries if e.fits}


# ---------------------------------------------------------------- the real thing: full simulations
def _truth():
    """need/peak of a spec by a full simulation here (memlens.estimate, no replay), each spec once."""
    cache: dict[TrainingSpec, Point] = {}

    def point(s: TrainingSpec) -> Point:
        if s not in cache:
            cache[s] = Point.from_result(estimate(s))
        return cache[s]

    return point


def _brute_entry(spec, changes, usable, target, point):
    s = spec.replace(grad_accum=1, **changes)
    divisors = [d for d in range(1, target + 1) if target % d == 0]
    # a plan entry's run is the accumulated one (micro-batch d x target // d): that is the run that has to fit
    m = max((d for d in divisors if need_bytes(point(s.replace(batch_size=d, grad_accum=target // d))) <= usable), default=0)
    micro = m or 1
    run = s.replace(batch_size=micro, grad_accum=target // micro)
    p = point(run)
    return m, p.peak_reserved_bytes, predict_step_time(run, p, micro_batch=micro, grad_accum=target // micro).seconds


@pytest.mark.slow
def test_fast_fit_equals_full_simulations_on_a_grid():
    """fit (worker processes, replays, guided searches, entries left out) against brute force with
    full simulations: the largest micro-batch (every batch up to the cap simulated), its peak, and
    for every plan entry its micro-batch (every divisor simulated), accumulation and peak; an entry
    left out is, searched in full, no faster than the one that decided it."""
    point = _truth()
    spec = TrainingSpec(model=TINY_GPT2, seq_len=256, batch_size=8)
    cap = 12
    given = [need_bytes(point(spec.replace(batch_size=b))) for b in range(1, cap + 1)]
    est = CachedEstimator()      # one estimator for both budgets (a library user's fits share one so): the second fit
    est.scaler.workers = 2       # answers from the points the first simulated and simulates only the others
    for b in (3, 6):
        usable = given[b - 1]                    # batch b fits exactly at this budget
        d = fit(spec, usable, context_bytes=0, margin=0, gpus=1, estimator=est, cap=cap).data
        assert d["usable_bytes"] == usable
        want = max(x for x in range(1, cap + 1) if given[x - 1] <= usable)
        assert d["max_batch_size"] == want
        assert d["predicted_peak_bytes"] == point(spec.replace(batch_size=want)).peak_reserved_bytes
        assert est.stats()["replays"] > 0
        by_name = {e["name"]: e for e in d["plan"]}
        for e in d["plan"]:
            if e["error"]:
                continue
            try:
                m, peak, secs = _brute_entry(spec, e["changes"], usable, 8, point)
            except MemlensError:
                assert e["not_searched"], e["name"]      # refused (offload): searched, it is an error entry, ranked last
                continue
            if e["not_searched"]:
                dom = next(o for o in d["plan"] if e["not_searched"].startswith(f"not searched: {o['name']} fits"))
                assert m == 0 or secs * 1 > dom["predicted_gpu_seconds"], (b, e["name"])
                continue
            assert (e["micro_batch"] or 0) == m, (b, e["name"])
            assert e["fits"] == (m > 0)
            assert e["predicted_peak_bytes"] == peak, (b, e["name"])
            assert e["predicted_step_seconds"] == pytest.approx(secs)
        assert by_name["as given"]["micro_batch"] == max(x for x in (1, 2, 4, 8) if x <= want)


# ---------------------------------------------------------------- sharded specs in the workers
def test_a_sharded_spec_is_estimated_in_a_worker_and_equals_this_process():
    spec = TrainingSpec(model="explore_models:tiny", seq_len=64, batch_size=4, world_size=2, sharding="zero2")
    here = Point.from_result(estimate(spec))
    est = CachedEstimator()
    est.scaler.workers = 2
    p = est(spec)
    assert est.scaler._pool is not None                     # it went to the worker processes
    assert (p.peak_allocated_bytes, p.peak_reserved_bytes, p.peak_rank, p.by_category) == \
        (here.peak_allocated_bytes, here.peak_reserved_bytes, here.peak_rank, here.by_category)


def test_a_sharded_spec_falls_back_to_this_process_when_a_worker_died(monkeypatch):
    spec = TrainingSpec(model="explore_models:tiny", seq_len=64, batch_size=4, world_size=2, sharding="zero2")
    est = CachedEstimator()
    est.scaler.workers = 2

    def broken(fn, s):
        f: Future = Future()
        f.set_exception(BrokenProcessPool("a worker died"))
        return f

    monkeypatch.setattr(est.scaler, "submit", broken)
    p = est(spec)
    assert p.peak_allocated_bytes == estimate(spec).peak_allocated_bytes
    assert est.workers == 1                                   # and simulates here from now on


def test_a_sharded_spec_falls_back_where_autograd_cannot_run_in_a_fork(monkeypatch):
    """The worker answers that this process' autograd cannot run in a fork (a CUDA build of torch that
    has run a backward): estimated here, and the workers are given up, as for simulations."""
    import memlens.estimator as estimator_pkg
    from memlens.estimator.scaling import FORKED_AUTOGRAD
    from memlens.explore.core import _simulated_point

    spec = TrainingSpec(model="explore_models:tiny", seq_len=64, batch_size=4, world_size=2, sharding="zero2")

    def refused(s, method="simulate"):
        raise RuntimeError(FORKED_AUTOGRAD + " (fake)")

    with monkeypatch.context() as m:      # what the worker would answer
        m.setattr(estimator_pkg, "estimate", refused)
        answer = _simulated_point(spec)
    est = CachedEstimator()
    est.scaler.workers = 2

    def in_worker(fn, s):
        f: Future = Future()
        f.set_result(answer)
        return f

    monkeypatch.setattr(est.scaler, "submit", in_worker)
    assert est(spec).peak_allocated_bytes == estimate(spec).peak_allocated_bytes
    assert est.workers == 1


def test_start_forks_every_worker_before_threads_ask():
    est = CachedEstimator()
    est.scaler.workers = 2
    assert est.scaler._pool is None
    est.start(TrainingSpec(model="explore_models:tiny", seq_len=64))
    assert len(est.scaler._pool._processes) == 2         # forked now, from this thread


# ---------------------------------------------------------------- the CLI
TINY = ["fit", "--model", "explore_models:tiny", "--seq-len", "64", "--budget", "1GiB", "--context", "0",
        "--target-batch", "8", "--gpus", "2"]


@pytest.mark.slow
def test_cli_lists_entries_not_searched_and_full_plan_searches_them(capsys, monkeypatch):
    import json

    from memlens.cli.main import main

    monkeypatch.setenv("MEMLENS_WORKERS", "1")
    assert main([*TINY, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert main([*TINY, "--json", "--full-plan"]) == 0
    full = {e["name"]: e for e in json.loads(capsys.readouterr().out)["plan"]}
    left = [e for e in plan if e["not_searched"]]
    assert left and not any(e["not_searched"] for e in full.values())
    for e in plan:
        if e["not_searched"]:
            f = full[e["name"]]
            assert e["fits"] is None
            # the bound and the decision are the FLOP model's (explore/plan.py), the entries' own seconds per-op
            assert f["error"] or not f["fits"] or e["best_flop_gpu_seconds"] <= f["flop_gpu_seconds"] * (1 + 1e-12)
            dom = full[e["not_searched_for"]]
            assert dom["flop_gpu_seconds"] < e["best_flop_gpu_seconds"]
            # shown in the per-op seconds of the searched entries: scaled as the deciding entry's two figures are
            assert e["best_gpu_seconds"] == pytest.approx(
                e["best_flop_gpu_seconds"] * dom["predicted_step_seconds"] * dom["gpus"] / dom["flop_gpu_seconds"])
            assert dom["predicted_step_seconds"] * dom["gpus"] < e["best_gpu_seconds"]
        else:
            assert {k: e[k] for k in ("fits", "micro_batch", "grad_accum", "predicted_peak_bytes")} == \
                {k: full[e["name"]][k] for k in ("fits", "micro_batch", "grad_accum", "predicted_peak_bytes")}
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert out.count("not searched:") == len(left) and f"not searched: {left[0]['not_searched_for']} fits and is faster" in out


def _accumulating_point(spec: TrainingSpec) -> Point:
    """(10 + b) GiB, and 2 GiB more when micro-batches accumulate (their gradients stay)."""
    alloc = (10 + spec.batch_size) * GiB + (2 * GiB if spec.grad_accum > 1 else 0)
    return Point(alloc, alloc + 64 * 2**20, {"activations": spec.batch_size * GiB}, {}, "backward", 1000, 1000, spec.seq_len)


def test_the_accumulated_run_must_fit_too():
    """A micro-batch whose step fits can still not fit with accumulation (the later micro-batches
    run with every gradient held): the plan entry and fit's target both step down to one whose
    accumulated run fits."""
    usable = 18 * GiB + 64 * 2**20 + GiB // 2          # plain 8 fits (18 GiB); 8 x 2 accumulated (20 GiB) does not
    spec = TrainingSpec(model="fake", batch_size=16, seq_len=512)
    e = plan_entry(spec, Candidate("as given", {}, "same math", ""), CachedEstimator(fn=_accumulating_point), usable, 16)
    assert (e.fits, e.micro_batch, e.grad_accum) == (True, 4, 4)
    assert e.predicted_peak_bytes == 16 * GiB + 64 * 2**20
    r = fit(spec, usable + 740 * 2**20, target_batch=16, margin=0, context_bytes=740 * 2**20, plan=False,
            estimator=CachedEstimator(fn=_accumulating_point))
    d = r.data
    assert (d["max_batch_size"], d["micro_batch_size"], d["grad_accum"]) == (8, 4, 4)
    assert any("8 x accumulation 2 does not fit" in n for n in r.notes)


# ---------------------------------------------------------------- DP-SGD over GPUs: what its step kind runs
def test_a_dp_sgd_plan_offers_the_gpus_opacus_runs():
    """Opacus runs DPDDP (ddp) and, with ghost clipping, FSDP2 (ghost_fsdp); never a sharded optimizer (zero2)."""
    hooks = TrainingSpec(model=TINY_GPT2, batch_size=8, seq_len=32, dp=True, physical_batch_size=4)
    over = lambda s: {c.technique: c.changes for c in candidates(s, gpus=2) if "world_size" in c.changes}  # noqa: E731
    assert over(hooks) == {"ddp": {"world_size": 2, "sharding": "ddp"}}
    assert list(over(hooks.replace(grad_sample_mode="ghost"))) == ["ddp", "fsdp"]
    assert list(over(TrainingSpec(model=TINY_GPT2, batch_size=8, seq_len=32))) == ["zero2", "fsdp"]   # the plain step's plan
    assert over(hooks) and not over(hooks.replace(world_size=2, sharding="ddp"))     # already over GPUs: nothing more
    # the DDP entry is searched like the others: its physical batch, per GPU, of the logical batch split over 2 GPUs
    est = CachedEstimator(fn=lambda s: Point(s.physical_batch_size * GiB, s.physical_batch_size * GiB))
    ddp = next(c for c in candidates(hooks, gpus=2) if c.technique == "ddp")
    e = plan_entry(hooks, ddp, est, 3 * GiB, target_batch=8, field_name="physical_batch_size")
    assert (e.error, e.gpus, e.micro_batch, e.effective_batch) == (None, 2, 2, 8)
