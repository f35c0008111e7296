"""DP-SGD over several GPUs: Opacus' DPDDP + DistributedDPOptimizer run as is on fake tensors under a
fake process group, one simulation per rank group (rank 0 adds the noise, the others do not)."""
from __future__ import annotations

import pytest

pytest.importorskip("opacus")

from memlens.core.errors import SpecError  # noqa: E402
from memlens.core.ledger import analyze  # noqa: E402
from memlens.core.spec import TrainingSpec  # noqa: E402
from memlens.estimator.ranks import estimate_ranks, simulate_rank  # noqa: E402

W = 32 * 64 * 4          # tests.tiny_models:seq_linear's one weight, fp32


def _spec(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "tests.tiny_models:seq_linear", "optimizer": "sgd", "dp": True, "batch_size": 8,
                           "world_size": 2, "sharding": "ddp", **kw})


def test_rank_0_holds_the_noised_gradient_the_others_a_view():
    a0, a1 = (analyze(simulate_rank(_spec(), r).log) for r in (0, 1))
    # DistributedDPOptimizer.add_noise: rank 0 makes p.grad = summed_grad + noise (a new tensor),
    # every other rank p.grad = summed_grad.view_as(p); all_reduce and /= N are in place
    assert a0.by_phase["optimizer"]["peak_allocated_bytes"] - a1.by_phase["optimizer"]["peak_allocated_bytes"] == W
    assert a0.by_phase["forward"] == a1.by_phase["forward"]          # no buckets, no broadcast copies


def test_estimate_names_the_two_rank_groups_and_opacus_wrapper():
    r = estimate_ranks(_spec(world_size=4))
    assert [e["ranks"] for e in r.data["ranks"]] == [[0], [1, 2, 3]]
    assert "DPDDP" in r.data["strategy"] and any("DifferentiallyPrivateDistributedDataParallel" in a for a in r.data["applied"])
    assert not any("buckets" in k for k in r.data["wrapper"])                    # no Reducer
    assert r.data["peak_rank"] == 0


@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_other_shardings_with_dp_are_one_line(sharding):
    with pytest.raises(SpecError) as e:
        estimate_ranks(_spec(sharding=sharding))
    assert "DP-SGD" in e.value.message and "\n" not in e.value.message and "ddp" in e.value.hint


@pytest.mark.slow
def test_cli_profile_dp_over_two_cpu_ranks(tmp_path, capsys, monkeypatch):
    """The same wrapper on real tensors: torchrun with gloo on the CPU, each rank profiles its own DP step (the CLI's
    main() in this process launches the two ranks, as the command does)."""
    import json
    import os

    from memlens.cli.main import main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(root)
    code = main(["profile", "--model", "tests.tiny_models:seq_linear", "--optimizer", "sgd", "--dp", "--batch-size", "8",
                 "--physical-batch-size", "4", "--world-size", "2", "--sharding", "ddp", "--device", "cpu", "--steps", "1",
                 "--out", str(tmp_path / "p")])
    assert code == 0, capsys.readouterr().err[-2000:]
    d = json.loads((tmp_path / "p" / "result.json").read_text())
    assert [r["rank"] for r in d["ranks"]] == [0, 1]
    assert any("DifferentiallyPrivateDistributedDataParallel" in a for a in d["applied"])
    # the seed profiler's setup phases, per rank: load, wrap, data, optimizer, privacy engine
    for r in d["ranks"]:
        labels = [t["label"] for t in r["timeline"]]
        assert labels[:5] == ["model load", "DDP wrap", "data preparation", "optimizer setup", "privacy engine setup"], labels
    assert d["by_category"]["per_sample_gradients"] == 2 * 4 * W            # 2 tensors of the physical batch of 4
