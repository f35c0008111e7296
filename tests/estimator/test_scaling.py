"""One trace, many sizes (memlens.estimator.scaling): a replayed answer is the full simulation's
to the byte, and where the event sequence or a size does not follow the traces, the spec is
simulated and the Result says why."""
import json
from pathlib import Path

import pytest
import torch

from memlens.core.events import EventLog
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.estimator.scaling import ScalingEstimator, design, family_of
from memlens.estimator.simulate import Simulation
from memlens.models.source import ModelSource

MODELS = Path(__file__).parent.parent / "fixtures" / "models"


def comparable(r) -> dict:
    """A Result as JSON without what may differ between two exact answers: timings and how it was made."""
    d = json.loads(r.to_json())
    for k in ("created_at", "simulate_seconds", "scaling"):
        d.pop(k, None)
    return d


# ---------------------------------------------------------------- the fit, on hand-made logs
def synthetic(sizes, extra=None):
    """simulate_fn whose log allocates sizes(b, L) in forward (plus a 1 MiB storage where
    ``extra(b)``: a code path that appears at some sizes) and frees them in backward."""
    calls = []

    def sim(spec: TrainingSpec) -> Simulation:
        b, L = spec.batch_size, spec.seq_len
        calls.append((b, L))
        log = EventLog()
        log.alloc(0, 4096, "parameters", log.module_id("fc"), "setup", "model")
        for step in (1, 2):
            log.phase("forward", step)
            keys = []
            for i, f in enumerate(sizes):
                log.alloc((step, i), f(b, L), "activations", 0, "forward", "aten.mm")
                keys.append((step, i))
            if extra is not None and extra(b):
                log.alloc((step, "extra"), 1 << 20, "temporaries", 0, "forward", "aten.cat")
                keys.append((step, "extra"))
            log.phase("backward", step)
            for k in keys:
                log.free(k)
            log.phase("optimizer", step)
            log.phase("end", step)
        log.phase("done", 2)
        return Simulation(log, spec, ModelSource("synthetic", "factory", "causal-lm"), L, None, 1024, 1024)

    sim.calls = calls
    return sim


def spec(b, L=256):
    return TrainingSpec(model="tests.tiny_models:linear", batch_size=b, seq_len=L)


LINEAR = [
    lambda b, L: 8 * b * L + 100,                      # token ids and friends
    lambda b, L: 4 * b * 16 * ((L + 31) // 32 * 32),   # efficient attention's logsumexp (L padded to 32)
    lambda b, L: 3_000_000,                            # a workspace
]
QUADRATIC = [
    lambda b, L: 2 * b * 12 * L * L,                   # an eager attention matrix
    lambda b, L: 4 * b * b * 77,                       # a contrastive b x b matrix
]


def direct(sizes, x):
    """The answer of a simulation of exactly that size (a fresh estimator simulates its first spec)."""
    return ScalingEstimator(simulate_fn=synthetic(sizes)).estimate(spec(*x))


@pytest.mark.parametrize("sizes,traces", [(LINEAR, 5), (LINEAR + QUADRATIC, 10)], ids=["degree-1", "degree-2"])
def test_replays_equal_direct_answers_over_a_grid(sizes, traces):
    fn = synthetic(sizes)
    est = ScalingEstimator(simulate_fn=fn)
    grid = [spec(b, L) for b in (2, 3, 5, 8, 13) for L in (128, 256, 384, 640, 1024)]
    est.prepare(grid)
    assert len(fn.calls) <= traces    # level 1 (corners + check), or level 2 (3 x 3 + check; some replay already)
    n = len(fn.calls)
    answers = {(s.batch_size, s.seq_len): est.estimate(s) for s in grid}
    assert len(fn.calls) == n                          # nothing else was simulated
    for x, r in answers.items():
        assert r.data["scaling"]["answer"] == ("simulated" if x in fn.calls else "replayed")
        assert comparable(r) == comparable(direct(sizes, x)), x
        assert r.data["seq_len"] == x[1]


def test_sequence_lengths_of_another_residue_are_another_family():
    # kernels pad L (to 32, 128): the sizes are polynomials on each residue class modulo 128
    assert family_of(spec(2, 256))[0] == family_of(spec(9, 384))[0]
    assert family_of(spec(2, 256))[0] != family_of(spec(2, 100))[0]


def test_the_first_traces_are_simulated_and_say_why():
    sizes = LINEAR + QUADRATIC
    est = ScalingEstimator(simulate_fn=synthetic(sizes))
    r1 = est.estimate(spec(2))
    assert r1.data["scaling"] == {"answer": "simulated", "reason": "first trace of this spec", "traces": ["b=2 L=256"]}
    r2 = est.estimate(spec(8))
    assert "outside the traced range (batch 2..2, seq len 256..256)" in r2.data["scaling"]["reason"]
    r3 = est.estimate(spec(5))     # inside the range, but two traces check nothing
    assert r3.data["scaling"]["answer"] == "simulated"
    assert "do not check a size of degree (1, 0)" in r3.data["scaling"]["reason"]
    r4 = est.estimate(spec(4))     # the b x b matrix needs a fourth point
    assert r4.data["scaling"]["answer"] == "simulated" and "degree (2, 0)" in r4.data["scaling"]["reason"]
    r5 = est.estimate(spec(3))
    assert r5.data["scaling"] == {"answer": "replayed", "traces": ["b=2 L=256", "b=8 L=256", "b=5 L=256", "b=4 L=256"]}
    assert comparable(r5) == comparable(direct(sizes, (3, 256)))
    assert est.estimate(spec(3)) is r5                                      # asked twice: answered once
    assert est.estimate(spec(9)).data["scaling"]["answer"] == "simulated"   # never extrapolated


def test_a_size_that_is_no_polynomial_is_simulated():
    est = ScalingEstimator(simulate_fn=synthetic([lambda b, L: 512 * 2 ** b]))
    for b in (2, 6, 3, 4, 5):
        r = est.estimate(spec(b))
        assert r.data["scaling"]["answer"] == "simulated"
    assert "fits no polynomial of degree <= 2" in r.data["scaling"]["reason"]


def test_a_code_path_that_appears_at_a_size_splits_the_traces():
    est = ScalingEstimator(simulate_fn=synthetic(LINEAR, extra=lambda b: b >= 6))
    for b in (2, 3, 5, 8, 9, 12):
        est.estimate(spec(b))
    assert len(next(iter(est.families.values())).regimes) == 2
    between = est.estimate(spec(7))
    assert between.data["scaling"]["answer"] == "simulated"
    assert "outside the traced range" in between.data["scaling"]["reason"]
    small, big = est.estimate(spec(4)), est.estimate(spec(10))   # inside one regime each: replayed, each on its path
    assert small.data["scaling"]["answer"] == big.data["scaling"]["answer"] == "replayed"
    assert small.by_category["temporaries"] == 0 and big.by_category["temporaries"] == 1 << 20
    fn = lambda b: b >= 6  # noqa: E731
    assert comparable(big) == comparable(ScalingEstimator(simulate_fn=synthetic(LINEAR, extra=fn)).estimate(spec(10)))


def test_a_sequence_change_inside_the_traced_range_is_not_replayed():
    """A path taken at b = 6 only (not a threshold): the other traces' range holds that trace."""
    est = ScalingEstimator(simulate_fn=synthetic(LINEAR, extra=lambda b: b == 6))
    for b in (2, 4, 6, 8, 10):
        est.estimate(spec(b))
    r = est.estimate(spec(5))
    assert r.data["scaling"]["answer"] == "simulated"
    assert r.data["scaling"]["reason"].startswith("the event sequence changes with size inside the traced range (at b=6 L=256)")


def test_design_keeps_batch_one_apart_and_picks_corners_and_a_check():
    pts = [(b, L) for b in (1, 2, 4, 8, 16) for L in (128, 256, 512, 1024)]
    d = design(pts)
    assert set(d) >= {(2, 128), (2, 1024), (16, 128), (16, 1024), (1, 128), (1, 1024)}
    assert len([p for p in d if p[0] not in (1, 2, 16) and p[1] not in (128, 1024)]) == 1
    assert design([(2, 128), (4, 128)]) == [(2, 128), (4, 128)]     # nothing to save


# ---------------------------------------------------------------- real models, tiny configs
def grid_check(model, batches, seq_lens, workers=None, check_simulated=False, **changes):
    est = ScalingEstimator(workers=workers)
    grid = [TrainingSpec(model=model, batch_size=b, seq_len=L, **changes) for b in batches for L in seq_lens]
    est.prepare(grid)
    replayed = 0
    for s in grid:
        r = est.estimate(s)
        if r.data["scaling"]["answer"] == "replayed":
            replayed += 1
        if r.data["scaling"]["answer"] == "replayed" or check_simulated:
            assert comparable(r) == comparable(estimate(s)), s.describe()
    assert replayed > 0
    return est


@pytest.mark.slow
def test_tiny_gpt2_grid_replays_exactly():
    # in two worker processes: what they simulate equals a simulation here too
    est = grid_check(str(MODELS / "tiny-gpt2" / "config.json"), (2, 3, 5), (128, 256, 384), workers=2, check_simulated=True)
    assert est.stats()["workers"] == 2 and est.stats()["simulations"] == 5


@pytest.mark.slow
def test_tiny_llama_bf16_grid_replays_exactly():
    grid_check(str(MODELS / "tiny-llama" / "config.json"), (2, 3, 5), (128, 256, 384), precision="bf16")


@pytest.mark.slow
def test_tiny_llama_lora_grid_replays_exactly():
    grid_check(str(MODELS / "tiny-llama" / "config.json"), (2, 4, 6), (128, 384, 640), lora_rank=4, precision="amp-bf16")


@pytest.mark.slow
def test_tiny_vit_batches_replay_exactly():
    grid_check(str(MODELS / "tiny-vit" / "config.json"), (2, 3, 4, 6, 7), (None,))


class Branchy(torch.nn.Module):
    """Doubles its output at batch >= 6 through an extra concatenation: the event sequence changes with size."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        y = self.fc(x)
        if x.shape[0] >= 6:
            y = torch.cat([y, y])
        return y


def branchy(spec):
    return Branchy(), torch.randn(spec.batch_size, 64), lambda out, batch: out.sum()


def test_a_real_step_whose_ops_change_with_batch_falls_back():
    est = ScalingEstimator()
    mk = lambda b: TrainingSpec(model="tests.estimator.test_scaling:branchy", batch_size=b, optimizer="sgd")  # noqa: E731
    est.prepare([mk(b) for b in (2, 3, 4, 5, 8, 9, 10)])
    fam = next(iter(est.families.values()))
    assert len(fam.regimes) == 2
    r = est.estimate(mk(7))
    assert r.data["scaling"]["answer"] == "simulated" and "outside the traced range" in r.data["scaling"]["reason"]
    for b in (3, 7, 9):
        assert comparable(est.estimate(mk(b))) == comparable(estimate(mk(b)))


@pytest.mark.parametrize("wrapped", [False, True])
def test_workers_whose_autograd_cannot_run_in_a_fork_hand_over_to_this_process(monkeypatch, wrapped):
    """A CUDA build of torch that has run a backward refuses autograd in a forked child (measured on
    the GPU machine: every simulation in a worker failed); the estimator then simulates here."""
    import os

    from memlens.core.errors import MemlensError
    from memlens.estimator import simulate as sim_mod
    from memlens.estimator.scaling import FORKED_AUTOGRAD

    parent, real = os.getpid(), sim_mod.simulate

    def simulate(spec, *a, **k):
        if os.getpid() != parent:
            why = FORKED_AUTOGRAD + ". See https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork"
            if wrapped:   # as simulate reports a model's failure (seen on the GPU machine)
                raise MemlensError(f"simulating {spec.model} failed: RuntimeError: {why}")
            raise RuntimeError(why)
        return real(spec, *a, **k)

    monkeypatch.setattr(sim_mod, "simulate", simulate)
    est = ScalingEstimator(workers=2)
    spec = TrainingSpec(model="tests.tiny_models:linear", batch_size=2)
    r = est.estimate(spec)
    assert r.peak_allocated_bytes == estimate(spec).peak_allocated_bytes
    assert est.stats()["workers"] == 1
