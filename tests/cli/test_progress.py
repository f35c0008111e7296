"""Progress: what long verbs report (memlens.core.progress) and the bar that shows it (memlens.cli.progress):
rich, on stderr, only on a terminal, never with --json, and only after two seconds."""
import io
import sys

import pytest
from rich.console import Console

import memlens.cli.progress as cli_progress
from memlens.cli.main import main
from memlens.cli.progress import ProgressBar
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate

LINEAR = "tests.tiny_models:linear"


def terminal():
    buf = io.StringIO()
    return buf, Console(file=buf, force_terminal=True, width=160)


def test_estimate_reports_model_build_steps_and_replay():
    buf, console = terminal()
    with ProgressBar("estimate", console=console, delay=0) as bar:
        estimate(TrainingSpec(model=LINEAR, optimizer="sgd"))
    label = "tests.tiny_models:linear b=1 fp32 sgd"
    assert bar.history == [f"{label}: building the model", f"{label}: step 1 forward", f"{label}: step 1 backward",
                           f"{label}: step 1 optimizer", f"{label}: step 2 forward and backward written from step 1",
                           f"{label}: step 2 optimizer", f"{label}: replaying the allocator"]
    out = buf.getvalue()
    assert "estimate" in out and "replaying the allocator" in out


def test_nothing_is_shown_before_the_delay_or_when_disabled():
    for kwargs in ({"delay": 30}, {"delay": 0, "enabled": False}):
        buf, console = terminal()
        with ProgressBar("estimate", console=console, **kwargs) as bar:
            estimate(TrainingSpec(model=LINEAR, optimizer="sgd"))
        assert buf.getvalue() == ""
        assert len(bar.history) == 7          # reported all the same


def test_compare_sweep_and_fit_advance_over_their_items(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLENS_WORKERS", "1")      # simulate in this process: its stages are reported
    from memlens.explore.compare import compare
    from memlens.explore.fit import fit
    from memlens.explore.sweep import Grid, sweep

    spec = TrainingSpec(model=LINEAR, optimizer="sgd")
    with ProgressBar("compare", console=terminal()[1], delay=0) as bar:
        compare(spec, ["fp32", "amp-bf16"])
    assert [h for h in bar.history if h.startswith("[")] == [   # all estimates first (side by side with workers), then the rows
        f"[0/2] estimating {LINEAR} b=1 fp32 sgd", f"[1/2] estimating {LINEAR} b=1 amp-bf16 sgd", "[0/2] fp32", "[1/2] amp-bf16"]
    with ProgressBar("sweep", console=terminal()[1], delay=0) as bar:
        sweep(spec, Grid(batch_sizes=[2, 3, 4, 5]), out=tmp_path / "sw")
    cells = [h for h in bar.history if h.startswith("[") and "tracing" not in h]
    assert cells == ["[0/4] b=2", "[1/4] b=3", "[2/4] b=4", "[3/4] b=5"]
    assert [h for h in bar.history if "tracing" in h] == [f"[0/4] tracing {i}/3: {LINEAR} b={b} fp32 sgd" for i, b in ((1, 2), (2, 5), (3, 4))]
    assert any("replaying the traces" in h for h in bar.history)     # b=3 was replayed
    with ProgressBar("fit", console=terminal()[1], delay=0) as bar:
        fit(spec, "2GiB", target_batch=4, plan=False)
    assert bar.history[0] == "largest micro-batch"
    assert any(h.startswith(f"{LINEAR} b=2 fp32 sgd: step 1") for h in bar.history)    # the probes (batch 2 first)


def test_fit_advances_over_its_plan():
    from memlens.explore.core import CachedEstimator, Point
    from memlens.explore.fit import fit

    def point(spec):       # peak = 1 GiB of states + 1 GiB per sample (no simulation: the plan's bookkeeping only)
        alloc = (1 + spec.batch_size) * 2**30
        return Point(alloc, alloc, {"parameters": 2**30}, {}, "backward", 1000, 1000, 512)

    with ProgressBar("fit", console=terminal()[1], delay=0) as bar:
        r = fit(TrainingSpec(model="gpt2", seq_len=512), "10GiB", target_batch=8, gpus=1, estimator=CachedEstimator(fn=point))
    plan = [h for h in bar.history if "plan: " in h]
    assert plan[0] == f"[0/{len(plan)}] plan: as given" and len(plan) == len(r.data["plan"]) > 3


def test_cli_shows_the_bar_on_a_terminal_only_and_never_with_json(capsys, monkeypatch):
    monkeypatch.setattr(cli_progress, "DELAY_S", 0)
    assert main(["estimate", "--model", LINEAR, "--optimizer", "sgd", "--json"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["estimate", "--model", LINEAR, "--optimizer", "sgd"]) == 0     # not a terminal: no bar
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["estimate", "--model", LINEAR, "--optimizer", "sgd"]) == 0
    err = capsys.readouterr().err
    assert "estimate" in err and "replaying the allocator" in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["estimate", "--model", LINEAR, "--optimizer", "sgd", "--json"]) == 0
    assert capsys.readouterr().err == ""
