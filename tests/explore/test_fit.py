"""fit: the budget arithmetic, the search (a few estimates), accumulation, the plan's ranking, the CLI."""
from __future__ import annotations

import json

import pytest
from explore_support import GiB, N, fake_estimator, fake_point

from memlens.cli.main import main
from memlens.core.errors import MemlensError
from memlens.explore.core import predict_step_time
from memlens.explore.fit import Budget, find_max_batch_size, fit, fit_batch_size, verify
from memlens.explore.plan import MODEL, make_plan
from memlens.explore.search import doubling_bisection, max_fitting_budget, verify_limit
from memlens.core.spec import TrainingSpec

SPEC = TrainingSpec(model="fake", batch_size=8, seq_len=512)
MiB = 2**20


def test_budget_arithmetic():
    b = Budget.make("16GiB", context_bytes=740 * MiB)
    assert b.margin_bytes == int(0.05 * (16 * GiB - 740 * MiB))
    assert b.usable_bytes == 16 * GiB - 740 * MiB - b.margin_bytes
    assert Budget.make("16GiB", context_bytes=0, margin="512MiB").usable_bytes == 16 * GiB - 512 * MiB
    assert Budget.make("1GiB", context_bytes=0).margin_bytes == 256 * MiB        # the floor
    assert Budget.make("10GiB", context_bytes=0, margin=0.1).margin_bytes == GiB


@pytest.mark.parametrize("budget", ["700MiB", "0", "-3GiB", "12XB", "lots"])
def test_budget_bad(budget):
    with pytest.raises(MemlensError):
        Budget.make(budget)


def test_max_batch_exact_and_few_estimates():
    # fp32 adamw: states 16 B/param = 4e9 B, 1 GiB per sample, reserved = allocated + 64 MiB
    est = fake_estimator()
    usable = 20 * GiB
    s = find_max_batch_size(SPEC, usable, estimator=est)
    want = max(b for b in range(1, 200) if 16 * N + b * GiB + 64 * MiB <= usable)
    assert s.limit == want == 16
    assert est.calls <= 5


def test_fit_result_keys_accumulation_and_margin():
    r = fit(SPEC, "24GiB", target_batch=64, estimator=fake_estimator(), plan=False)
    d = r.to_dict()
    usable = 24 * GiB - 740 * MiB - int(0.05 * (24 * GiB - 740 * MiB))
    want = max(b for b in range(1, 200) if 16 * N + b * GiB + 64 * MiB <= usable)
    assert d["max_batch_size"] == want == 18
    assert d["budget_bytes"] == 24 * GiB and d["usable_bytes"] == usable
    assert d["predicted_peak_bytes"] == 16 * N + want * GiB + 64 * MiB <= usable
    # 64 = micro x accum with the largest divisor of 64 that fits: 16 x 4
    assert (d["micro_batch_size"], d["grad_accum"], d["effective_batch_size"]) == (16, 4, 64)
    assert d["plan"] == [] and d["verb"] == "fit"


def test_fit_target_default_is_spec_effective_batch():
    d = fit(SPEC.replace(batch_size=6, grad_accum=5), "24GiB", estimator=fake_estimator(), plan=False).data
    assert d["target_batch"] == 30 and d["micro_batch_size"] * d["grad_accum"] == 30
    assert d["micro_batch_size"] == 15       # largest divisor of 30 that is <= 18


def test_fit_nothing_fits():
    d = fit(SPEC, "4GiB", estimator=fake_estimator(), plan=False, context_bytes=0).data
    assert d["max_batch_size"] == 0 and d["grad_accum"] is None
    assert d["batch1_peak_bytes"] == 16 * N + GiB + 64 * MiB


def test_plan_ranking_on_fixed_fake_estimator():
    est = fake_estimator()
    entries = make_plan(SPEC, est, 12 * GiB, 32, gpus=4, prune=False)
    names = [e.name for e in entries]
    fits = [e.fits for e in entries]
    # fitting entries first, then the rest
    assert fits == sorted(fits, reverse=True)
    fitting = [e for e in entries if e.fits]
    same = [e for e in fitting if e.kind != MODEL]
    # same-model entries before LoRA/QLoRA, each group by predicted GPU-seconds
    assert fitting[: len(same)] == same
    secs = [e.gpu_seconds for e in same]
    assert secs == sorted(secs)
    # fp32 alone at 12 GiB: 4e9 B states + b GiB: micro 8 fits (8 x 4 = 32)
    given = entries[names.index("as given")]
    assert (given.micro_batch, given.grad_accum) == (8, 4)
    ck = entries[names.index("checkpointing")]
    assert (ck.micro_batch, ck.grad_accum) == (32, 1)          # 4e9 + 32 x 256 MiB < 12 GiB
    assert ck.predicted_step_seconds / predict_step_time(SPEC.replace(batch_size=32), fake_point(SPEC)).seconds == pytest.approx(4 / 3)
    z = entries[names.index("ZeRO-2 over 4 GPUs")]
    assert z.gpus == 4 and z.micro_batch == 8
    # the whole order (ties in GPU-seconds broken by the smaller peak)
    assert names == [
        "bf16 weights", "AMP bf16", "bf16 + checkpointing + 8-bit AdamW", "AMP bf16 + checkpointing", "checkpointing",
        "Adafactor", "8-bit AdamW", "as given", "ZeRO-2 over 4 GPUs", "FSDP (ZeRO-3) over 4 GPUs",
        "CPU offload of the optimizer", "QLoRA r=16", "LoRA r=16",
    ]
    assert [e.rank for e in entries] == list(range(1, 14))


def test_plan_unfitting_entries_last():
    entries = make_plan(SPEC, fake_estimator(), 4 * GiB + GiB // 2, 8, gpus=1)
    states_fp32 = 16 * N
    assert not entries[-1].fits
    given = next(e for e in entries if e.name == "as given")
    assert not given.fits and given.predicted_peak_bytes == states_fp32 + GiB + 64 * MiB
    assert entries[0].fits


def test_searches_agree_on_random_limits():
    import random

    rnd = random.Random(0)
    for _ in range(300):
        lim = rnd.randint(0, 500)
        fits = lambda b, lim=lim: b <= lim  # noqa: E731
        for seed in (lim, max(0, lim - 1)):
            v = verify_limit(fits, seed)
            assert v.limit == lim and len(v.trials) <= 2 + (seed == 0 and lim == 0)
        assert doubling_bisection(fits).limit == lim
        assert max_fitting_budget(lambda b: b * 10, lim * 10 + 5, cap=1000).limit == min(lim, 1000) or lim == 0


def test_fit_batch_size_user_loop_is_oom_safe():
    calls = []

    def step(b):
        calls.append(b)
        if b > 11:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    s = fit_batch_size(step, start=10)
    assert s.limit == 11 and calls == [11, 12]
    with pytest.raises(ValueError):
        fit_batch_size(lambda b: (_ for _ in ()).throw(ValueError("a real bug")), start=1)


def test_verify_with_fake_runner_takes_two_trials():
    seen = []

    def runner(spec, **kw):
        seen.append(spec.batch_size)
        return {"status": "ok" if spec.batch_size <= 17 else "oom"}

    s = verify(SPEC, 16, runner=runner)
    assert s.limit == 17 and seen == [17, 18]

    def broken(spec, **kw):
        return {"status": "crash", "error": "Segmentation fault"}

    with pytest.raises(MemlensError, match="crash"):
        verify(SPEC, 16, runner=broken)


# ---------------------------------------------------------------- CLI (real estimator, tiny factory model)
TINY = ["--model", "explore_models:tiny", "--seq-len", "64"]


def test_cli_fit_json(capsys):
    rc = main(["fit", *TINY, "--budget", "1GiB", "--context", "0", "--margin", "0", "--target-batch", "8", "--no-plan", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    d = json.loads(out)
    for k in ("max_batch_size", "budget_bytes", "predicted_peak_bytes", "grad_accum", "plan"):
        assert k in d
    assert d["max_batch_size"] >= 8 and d["grad_accum"] == 1 and d["predicted_need_bytes"] <= GiB


@pytest.mark.parametrize("argv,needle", [
    (["--budget", "12XB"], "cannot read size '12XB' (budget)"),
    (["--budget", "50MiB", "--context", "0", "--margin", "0"], "even batch 1"),
    (["--budget", "700MiB"], "leaves nothing"),
    (["--budget", "1GiB", "--target-batch", "0"], "argument --target-batch: must be a whole number >= 1, got 0"),
    (["--budget", "1GiB", "--gpus", "0"], "--gpus"),
    (["--budget", "1GiB", "--verify", "--device", "cpu"], "--verify"),
])
def test_cli_fit_bad_input(capsys, argv, needle):
    rc = main(["fit", *TINY, "--no-plan", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("ERROR:") and needle in err


@pytest.mark.slow
def test_plan_side_by_side_in_worker_processes_equals_one_at_a_time():
    """The plan's searches in threads over two forked workers give the entries of one process alone."""
    from memlens.explore.core import CachedEstimator

    spec = TrainingSpec(model="explore_models:tiny", seq_len=256)
    plans, stats = [], []
    for workers in (1, 2):
        est = CachedEstimator()
        est.scaler.workers = workers
        r = fit(spec, "72MiB", target_batch=16, context_bytes=0, margin=0, gpus=2, estimator=est)
        plans.append([{k: e[k] for k in ("name", "fits", "micro_batch", "grad_accum", "predicted_peak_bytes", "error")} for e in r.data["plan"]])
        stats.append((r.data["max_batch_size"], est.workers))
    assert plans[0] == plans[1] and stats[0][0] == stats[1][0]
    assert [s[1] for s in stats] == [1, 2]
    assert any(e["fits"] for e in plans[0]) and any(e["micro_batch"] not in (None, 16) for e in plans[0])
