"""`memlens fit --least-recompute`: the fewest checkpointed blocks that fit, against brute force (every N simulated)."""
from __future__ import annotations

import json

import pytest

from memlens.cli.main import main
from memlens.core.errors import MemlensError
from memlens.core.fits import need_bytes
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.explore.fit import least_recompute, recompute_spec

# 4 blocks (tests/tiny_models.py); at batch 8192 each block not checkpointed keeps 2 x 8192 x 256 x 4 B = 16 MiB more
SPEC = TrainingSpec(model="tests.tiny_models:blocks", batch_size=8192)


@pytest.fixture(scope="module")
def needs():
    return [need_bytes(estimate(recompute_spec(SPEC, n, 4, all_flag=False))) for n in range(5)]


@pytest.fixture(scope="module")
def selective():
    """(need, added seconds) of the first n blocks under the selective policy, every n simulated."""
    out = []
    for n in range(5):
        r = estimate(recompute_spec(SPEC, n, 4, all_flag=False, policy="selective"))
        out.append((need_bytes(r), (r.data.get("activation_plan") or {}).get("checkpoint", {}).get("recompute_seconds", 0.0)))
    return out


def test_needs_fall_with_n(needs):
    # the last block's activations are recomputed at once in backward, where the step peaks: no saving there
    assert needs[0] > needs[1] > needs[2] > needs[3] == needs[4]


@pytest.mark.parametrize("n", range(4))
def test_answer_is_brute_force(needs, selective, n):
    budget = needs[n] + (needs[n - 1] - needs[n]) // 2 if n else needs[0] + 1    # between N and N - 1
    r = least_recompute(SPEC, budget, context_bytes=0, margin=0, layers=4)
    rp = r.data["recompute_plan"]
    # every (policy, N) simulated: the answer is the one that fits with the least added time
    options = [(0.0, "full", 0)] if needs[0] <= budget else []
    full_cost = rp["per_block"]["full"]["seconds_added"]
    options += [(k * full_cost, "full", k) for k in range(1, 5) if needs[k] <= budget]
    options += [(selective[k][1], "selective", k) for k in range(1, 5) if selective[k][0] <= budget]
    best = min(options, key=lambda o: (round(o[0], 9), o[2]))
    assert (rp["checkpoint_policy"], rp["checkpoint_layers"]) == best[1:]
    if best[1] == "full":
        assert rp["checkpoint_layers"] == min(k for k in range(5) if needs[k] <= budget) == n
        assert rp["code"] == f'memlens.apply(model, {{"checkpoint_layers": {n}}})'
    assert rp["rows"][0]["name"] == "none" and {"all 4", "all 4 selective"} <= {row["name"] for row in rp["rows"]}
    for p in rp["probes"]:                                 # every answer a full simulation
        want = needs if p["checkpoint_policy"] == "full" else [x[0] for x in selective]
        assert p["need_bytes"] == want[p["checkpoint_layers"]]
    assert not rp["offload_weighed"]          # offload costs more per byte freed than recomputing on an H100


def test_nothing_fits(needs):
    rp = least_recompute(SPEC, needs[4] - 1, context_bytes=0, margin=0, layers=4).data["recompute_plan"]
    assert rp["checkpoint_layers"] is None and not rp["fits"] and "code" not in rp


def test_refusals():
    with pytest.raises(MemlensError, match="--least-recompute is for one GPU"):
        least_recompute(SPEC.replace(compile=True), "1GiB", layers=4)
    with pytest.raises(MemlensError, match="no block stack found"):
        least_recompute(TrainingSpec(model="tests.tiny_models:mlp"), "1GiB")


def test_cli_json(capsys):
    rc = main(["fit", "--model", "tests.tiny_models:blocks", "--budget", "1GiB", "--context", "0", "--least-recompute", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["recompute_plan"]["checkpoint_layers"] == 0       # 4 blocks counted on the meta device
    assert d["recompute_plan"]["layers"] == 4


def test_apply_takes_the_result(needs):
    import memlens
    from tests.tiny_models import blocks

    r = least_recompute(SPEC, needs[2] + 1, context_bytes=0, margin=0, layers=4)
    model = blocks()[0]
    assert memlens.apply(model, r) == ["blocks.0", "blocks.1"]


def test_apply_takes_the_saved_result(needs, tmp_path):
    import memlens
    from tests.tiny_models import blocks

    r = least_recompute(SPEC, needs[2] + 1, context_bytes=0, margin=0, layers=4)
    path = r.save(tmp_path / "result.json")                  # what `fit --least-recompute --out DIR` writes
    model = blocks()[0]
    want = r.data["recompute_plan"]["apply"]["checkpoint_layers"]
    assert list(memlens.apply(model, str(path))) == [f"blocks.{i}" for i in range(want)]
