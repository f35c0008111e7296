"""Adaptive micro-batching with a fake OOM source (CPU): halving, the same effective batch and the same
update as a run started at the right size, OOMs in forward and in backward, no endless loop, RNG and
gradients restored, the trend acting before an OOM, the start from memlens.fit, bad input."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from memlens.core.errors import MemlensError
from memlens.explore.adaptive import (AdaptiveBatch, MicroBatchPolicy, SplitRunner, TrendGuard, adaptive_batch,
                                      batch_rows, slice_batch)
from memlens.core.result import Result


def _model(dropout: float = 0.0):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(dropout), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _batches(n_steps=3, rows=16):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows, 4, generator=g), "y": torch.randint(0, 3, (rows,), generator=g)} for _ in range(n_steps)]


class FakeOom:
    """Raises a CUDA-style OOM when a micro-batch has more than ``limit`` rows (counts the attempts)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.raised = 0

    def check(self, rows: int):
        if rows > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {rows * 2}.00 MiB. (fake, {rows} rows)")


def _loss(model, oom: FakeOom | None = None):
    def fn(mb):
        torch.rand(3)                       # consume RNG before failing: the redo must restore it
        if oom is not None:
            oom.check(mb["x"].shape[0])
        return torch.nn.functional.cross_entropy(model(mb["x"]), mb["y"])
    return fn


def _run(micro, oom_limit=None, dropout=0.0, steps=3, **kw):
    model = _model(dropout)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oom = FakeOom(oom_limit) if oom_limit else None
    ab = adaptive_batch(opt, micro_batch=micro, trend=False, **kw)
    torch.manual_seed(123)
    losses = [ab.step(b, _loss(model, oom)).item() for b in _batches(steps)]
    return model, ab, losses, oom


def test_an_oom_halves_the_micro_batch_and_keeps_the_step(caplog):
    """Started at 16 rows where only 4 fit: 16 -> 8 -> 4 at the first step, then 4 throughout; the
    weights and losses are those of a run started at 4 (the same effective batch of 16)."""
    with caplog.at_level(logging.WARNING, logger="memlens.adaptive"):
        model, ab, losses, oom = _run(16, oom_limit=4)
    ref_model, ref, ref_losses, _ = _run(4)
    assert ab.micro_batch == 4 and oom.raised == 2
    assert [(c.micro_batch_from, c.micro_batch_to, c.accumulation_from, c.accumulation_to, c.reason, c.step)
            for c in ab.changes] == [(16, 8, 1, 2, "oom", 1), (8, 4, 2, 4, "oom", 1)]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert ab.result.data["effective_batch"] == 16 and ab.result.data["accumulation"] == 4
    assert ab.result.data["ooms_recovered"] == 2 and ab.result.data["windows_redone"] == 0
    assert "micro-batch 16 -> 8" in caplog.text and "OOM in a forward" in caplog.text
    # and those are the gradients of the whole batch's mean loss: one step at full size, no OOM
    full, _, full_losses, _ = _run(None)
    assert losses == pytest.approx(full_losses, rel=1e-5)


def test_the_rng_of_a_failed_attempt_is_rolled_back():
    """With dropout, the adaptive run equals the reference run at the right size bit for bit: the
    failed attempts' random numbers are given back."""
    model, ab, losses, _ = _run(16, oom_limit=8, dropout=0.3)
    ref_model, _, ref_losses, _ = _run(8, dropout=0.3)
    assert losses == ref_losses
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


class _BackwardBomb(torch.autograd.Function):
    """Identity whose backward raises an OOM when the micro-batch is too big: by then the layers after
    it have already accumulated their gradients (a partly touched .grad, as in a real backward OOM)."""

    limit = 4

    @staticmethod
    def forward(ctx, x):
        ctx.rows = x.shape[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.rows > _BackwardBomb.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB. (fake, in backward)")
        return g


def _bomb_run(micro, accumulate_batches=2, steps=2):
    """An accumulation window of 2 batches per optimizer step, through SplitRunner directly."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = MicroBatchPolicy(micro)
    runner = None

    def fb(mb, factor):
        h = _BackwardBomb.apply(model[0](mb["x"]))
        loss = torch.nn.functional.cross_entropy(model[3](model[2](model[1](h))), mb["y"]) * factor / accumulate_batches
        runner.backward_starts()
        loss.backward()
        return loss.detach()

    runner = SplitRunner(policy, fb, lambda: opt.zero_grad(set_to_none=True))
    torch.manual_seed(5)
    out = []
    batches = _batches(steps * accumulate_batches)
    for s in range(steps):
        runner.new_window()
        out.append(sum(runner.run(b).item() for b in batches[s * accumulate_batches:(s + 1) * accumulate_batches]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, policy, runner, out


def test_an_oom_in_backward_drops_the_gradients_and_redoes_the_window():
    """The second batch of the window fails in backward after the last layer accumulated part of it:
    the gradients are dropped and both batches redone at the halved size."""
    model, policy, runner, losses = _bomb_run(16)
    ref, _, _, ref_losses = _bomb_run(4)
    assert [c.micro_batch_to for c in policy.changes] == [8, 4] and runner.replays == 2
    assert all("OOM in a backward" in c.detail for c in policy.changes)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_no_endless_loop_an_oom_at_the_smallest_micro_batch_goes_on():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    oom = FakeOom(limit=0)                      # nothing fits
    ab = adaptive_batch(opt, micro_batch=8, min_micro_batch=2, trend=False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(torch.OutOfMemoryError, match="fake, 2 rows"):
        ab.step(_batches(1)[0], _loss(model, oom))
    assert oom.raised == 3 and [c.micro_batch_to for c in ab.changes] == [4, 2]   # 8, 4, 2 tried; then it gives up
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))        # no step was taken
    assert all(p.grad is None for p in model.parameters())


def test_other_errors_and_optimizer_ooms_are_not_swallowed():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ab = adaptive_batch(opt, micro_batch=4, trend=False)
    with pytest.raises(KeyError):
        ab.step(_batches(1)[0], lambda mb: mb["missing"])
    assert ab.changes == []

    def bad_step(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. (fake, optimizer)")

    opt.step = bad_step
    with pytest.raises(torch.OutOfMemoryError, match="optimizer"):
        ab.step(_batches(1)[0], _loss(model))
    assert ab.changes == []                    # a smaller micro-batch would not shrink the optimizer step


def test_weight_fn_weighs_micro_batches_by_tokens():
    """A loss averaged over the non-padding tokens: weighing the parts by their tokens gives the
    whole batch's gradients exactly, where weighing by rows would not."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 5, 4, generator=g)
    mask = torch.ones(8, 5)
    mask[:4, 2:] = 0                               # the first half of the batch is mostly padding
    batch = {"x": x, "mask": mask}

    def run(micro, weight_fn):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(lin.parameters(), lr=1.0)
        ab = AdaptiveBatch(opt, micro_batch=micro, trend=False)

        def loss_fn(mb):
            per_tok = lin(mb["x"]).squeeze(-1) ** 2
            return (per_tok * mb["mask"]).sum() / mb["mask"].sum()

        ab.step(batch, loss_fn, weight_fn=weight_fn)
        return lin.weight.detach().clone()

    whole = run(None, None)
    by_tokens = run(2, lambda mb: mb["mask"].sum().item())
    by_rows = run(2, None)
    torch.testing.assert_close(by_tokens, whole, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(by_rows, whole, rtol=1e-3)


class _Probe:
    """A fake device: memory left after each step grows by ``leak`` bytes; the step's transient peak is fixed."""

    def __init__(self, leak, transient, capacity):
        self.end, self.leak, self.transient, self.capacity = 1000, leak, transient, capacity
        self.max = 0

    def __call__(self):
        self.end += self.leak
        self.max = max(self.max, self.end + self.transient)
        return self.end, self.max, self.end + self.transient, self.capacity


def test_the_trend_halves_before_the_oom_and_only_once():
    probe = _Probe(leak=2**20, transient=100 * 2**20, capacity=1 * 2**30)   # +1 MiB/step toward 1 GiB
    tg = TrendGuard(lookahead=50, window=5, probe=probe)
    reasons = [tg.after_step(s) for s in range(1, 8)]
    assert reasons[:2] == [None, None] and all(r is None for r in reasons)      # far from the limit: 50 steps is not enough
    probe.end = 850 * 2**20                                                     # now close to 1 GiB
    got = [tg.after_step(s) for s in range(8, 12)]
    assert any(r and "in 50 steps the peak would be" in r for r in got)

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    near = _Probe(leak=4 * 2**20, transient=100 * 2**20, capacity=1 * 2**30)
    near.end = 800 * 2**20
    ab = AdaptiveBatch(opt, micro_batch=16, lookahead=30, trend_window=4, probe=near)
    for b in _batches(6):
        ab.step(b, _loss(model))
    trend = [c for c in ab.changes if c.reason == "trend"]
    assert len(trend) >= 1 and trend[0].micro_batch_to == 8 and "memory grows 4.00 MiB/step" in trend[0].detail
    # after a change the window restarts: the next decision needs fresh steps
    assert trend[0].step >= 3


def test_a_stale_running_peak_predicts_nothing():
    tg = TrendGuard(lookahead=10, window=4, probe=lambda: (10, 5000, 5000, 5000))  # peak not rising
    assert all(tg.after_step(s) is None for s in range(1, 8))


def test_start_from_memlens_fit():
    from memlens.core.spec import TrainingSpec

    calls = []

    def fake_fit(spec, budget):
        calls.append((spec.batch_size, spec.grad_accum, budget))
        return Result(verb="fit", data={"max_batch_size": 6, "micro_batch_size": 4, "grad_accum": 8, "usable_bytes": 123})

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ab = AdaptiveBatch(opt, spec=TrainingSpec(model="gpt2", batch_size=32), budget="16GiB", fit_fn=fake_fit, trend=False)
    assert calls == [(32, 1, "16GiB")] and ab.micro_batch == 4
    assert ab.changes[0].reason == "start" and ab.changes[0].micro_batch_to == 4
    assert ab.result.data["start_fit"]["micro_batch_size"] == 4

    def nothing_fits(spec, budget):
        return Result(verb="fit", data={"max_batch_size": 0, "micro_batch_size": None})

    with pytest.raises(MemlensError, match="finds no micro-batch"):
        AdaptiveBatch(opt, spec=TrainingSpec(model="gpt2", batch_size=32), budget="1GiB", fit_fn=nothing_fits)


def test_batches_of_many_shapes_are_split_along_their_first_dimension():
    b = {"ids": torch.arange(12).view(6, 2), "meta": ["a"] * 6, "w": torch.tensor(1.0), "pair": (torch.zeros(6), torch.ones(3))}
    assert batch_rows(b) == 6
    part = slice_batch(b, 2, 5, 6)
    assert part["ids"].tolist() == [[4, 5], [6, 7], [8, 9]] and part["pair"][0].shape == (3,)
    assert part["pair"][1].shape == (3,) and part["w"].item() == 1.0 and part["meta"] == ["a"] * 6
    assert slice_batch(b, 0, 6, 6) is b
    assert batch_rows(torch.zeros(5, 2)) == 5 and slice_batch(torch.arange(5), 1, 3, 5).tolist() == [1, 2]


@pytest.mark.parametrize("kwargs,words", [
    (dict(micro_batch=0), "micro_batch must be a whole number >= 1"),
    (dict(micro_batch=2, min_micro_batch=4), "below min_micro_batch"),
    (dict(min_micro_batch=True), "min_micro_batch must be"),
    (dict(lookahead=0), "lookahead must be"),
])
def test_bad_arguments_are_one_clear_error(kwargs, words):
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(MemlensError, match=words):
        adaptive_batch(opt, **kwargs)


def test_a_batch_without_tensors_is_refused():
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    ab = adaptive_batch(opt, trend=False)
    with pytest.raises(MemlensError, match="no tensor with a batch dimension"):
        ab.step({"text": ["a", "b"]}, lambda mb: torch.tensor(0.0, requires_grad=True))


def test_copying_a_policy_keeps_its_log():
    p = MicroBatchPolicy(8)
    p.halve(1, "oom", "x", rows=32)
    q = copy.deepcopy(p)
    assert q.changes == p.changes and q.micro_batch == 4
