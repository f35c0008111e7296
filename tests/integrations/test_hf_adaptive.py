"""Adaptive micro-batching inside a real transformers Trainer (CPU, a tiny GPT-2, a fake OOM source):
a run started with a per-device batch twice too large ends with the same losses and weights as a run
started at the right size with twice the accumulation (same effective batch), for both loss
normalizations the Trainer uses; an OOM in backward redoes the accumulation window; refusals."""
from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from memlens.core.errors import MemlensError  # noqa: E402
from memlens.integrations.hf import MemlensCallback  # noqa: E402
from memlens.integrations.hf_oom import refuse_distributed  # noqa: E402


class _DS(torch.utils.data.Dataset):
    """16 sequences of 12 tokens; rows have different amounts of padding (-100 labels), so a loss
    averaged per batch and one normalized over the window differ, and a wrong weight would show."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (12,), generator=g)
        labels = ids.clone()
        labels[12 - (i % 5) * 2:] = -100
        return {"input_ids": ids, "labels": labels}


class _Bomb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.rows = x.shape[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.rows > _State.limit:
            _State.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. (fake, backward)")
        return g


class _State:
    limit = 10**9
    raised = 0
    where = "forward"


def _model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)

    def too_big(module, args, kwargs):     # the fake device: more rows than _State.limit do not fit
        rows = kwargs["input_ids"].shape[0]
        if _State.where == "forward" and rows > _State.limit:
            _State.raised += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 MiB. (fake, {rows} rows)")

    model.register_forward_pre_hook(too_big, with_kwargs=True)
    if _State.where == "backward":
        model.transformer.h[1].register_forward_hook(lambda m, a, out: (_Bomb.apply(out[0]),) + tuple(out[1:])
                                                     if isinstance(out, tuple) else _Bomb.apply(out))
    return model


_REFERENCE: dict = {}


def _train(tmp_path, per_device, accum, *, adaptive=False, limit=10**9, where="forward", loss_kwargs=True, steps=3,
           trainer_cls=None, spec=None):
    key = (per_device, accum, where, loss_kwargs, steps)
    if not adaptive and limit == 10**9 and trainer_cls is None and key in _REFERENCE:
        return _REFERENCE[key]        # runs without memlens are deterministic: run each reference once
    _State.limit, _State.raised, _State.where = limit, 0, where
    model = _model()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"run{per_device}{adaptive}"), per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accum, max_steps=steps, learning_rate=1e-2, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, optim="adamw_torch", disable_tqdm=True, seed=0, max_grad_norm=1.0)
    cb = MemlensCallback(profile=False, adaptive=adaptive, trend=False, spec=spec)
    trainer = (trainer_cls or transformers.Trainer)(model=model, args=args, train_dataset=_DS(), callbacks=[cb])
    if not loss_kwargs:                    # the Trainer then averages each batch's loss and divides by accumulation
        trainer.model_accepts_loss_kwargs = False
    _State.trainer, _State.callback = trainer, cb
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = [p.detach().clone() for p in model.parameters()]
    if not adaptive and limit == 10**9 and trainer_cls is None:
        _REFERENCE[key] = (losses, weights, cb, trainer)
    return losses, weights, cb, trainer


@pytest.mark.slow
def test_started_twice_too_large_ends_like_the_right_size(tmp_path):
    """transformers normalizes GPT-2's loss over the window's label tokens (num_items_in_batch): a
    per-device batch of 4 x 2 accumulation split in micro-batches of 2 is the run at 2 x 4."""
    losses, weights, cb, trainer = _train(tmp_path, 4, 2, adaptive=True, limit=2)
    ref_losses, ref_weights, _, ref = _train(tmp_path, 2, 4)
    changes = cb.oom.policy.changes
    assert [(c.micro_batch_from, c.micro_batch_to, c.accumulation_to, c.reason, c.step) for c in changes] == [(4, 2, 2, "oom", 1)]
    assert trainer.args.gradient_accumulation_steps == 2 and trainer.args.per_device_train_batch_size == 4  # the Trainer's own
    assert trainer.state.global_step == ref.state.global_step == 3
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for p, q in zip(weights, ref_weights):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    assert "training_step" not in vars(trainer) and "compute_loss" not in vars(trainer)   # removed at the end


@pytest.mark.slow
def test_a_batch_averaged_loss_keeps_the_configured_objective(tmp_path):
    """When the Trainer averages each batch's loss (no num_items_in_batch), its objective depends on
    the per-device batch itself (rows of 4 averaged together, then over 2 batches): the split weighs
    each part by its label tokens, so the run is the one at 4 x 2 that had the memory, not 2 x 4."""
    losses, weights, cb, _ = _train(tmp_path, 4, 2, adaptive=True, limit=2, loss_kwargs=False)
    ref_losses, ref_weights, _, _ = _train(tmp_path, 4, 2, loss_kwargs=False)
    other, _, _, _ = _train(tmp_path, 2, 4, loss_kwargs=False)
    assert cb.oom.policy.micro_batch == 2
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # the weights agree to float rounding of the weighted sum, which AdamW (lr 1e-2) turns into up to
    # ~1e-5 on parameters whose gradient is near zero (its update is g / sqrt(v))
    for p, q in zip(weights, ref_weights):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=5e-5)
    assert losses != pytest.approx(other, rel=1e-4)      # padding differs per row: a rows-only weight would be wrong


def test_start_from_the_estimate_avoids_the_oom(tmp_path, monkeypatch):
    """With a spec, the callback starts from memlens.fit's largest micro-batch: no OOM at all."""
    from memlens.core.spec import TrainingSpec
    from memlens.explore import adaptive
    from memlens.core.result import Result

    asked = []

    def fake_fit(spec, budget):
        asked.append((spec.batch_size, spec.grad_accum, budget))
        return Result(verb="fit", data={"max_batch_size": 3, "micro_batch_size": 2})

    monkeypatch.setattr(adaptive, "_fit", fake_fit)
    losses, weights, cb, _ = _train(tmp_path, 4, 2, adaptive=True, limit=2, spec=TrainingSpec(model="gpt2", batch_size=4))
    raised = _State.raised
    ref_losses, _, _, _ = _train(tmp_path, 2, 4)
    assert asked == [(4, 1, None)] and raised == 0
    assert [(c.reason, c.micro_batch_to) for c in cb.oom.policy.changes] == [("start", 2)]
    assert cb.oom.result.data["start_fit"]["micro_batch_size"] == 2
    assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.slow
def test_an_oom_in_backward_redoes_the_accumulation_window(tmp_path):
    losses, weights, cb, _ = _train(tmp_path, 4, 2, adaptive=True, limit=2, where="backward")
    ref_losses, ref_weights, _, _ = _train(tmp_path, 2, 4, where="backward")
    assert cb.oom.runner.replays == 1 and cb.oom.policy.changes[0].micro_batch_to == 2
    assert "OOM in a backward" in cb.oom.policy.changes[0].detail
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for p, q in zip(weights, ref_weights):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_without_adaptive_the_oom_ends_training(tmp_path):
    with pytest.raises(torch.OutOfMemoryError):
        _train(tmp_path, 4, 2, adaptive=False, limit=2)


@pytest.mark.slow
def test_at_the_smallest_micro_batch_the_oom_goes_on(tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match="1 rows"):
        _train(tmp_path, 4, 2, adaptive=True, limit=0)
    assert [c.micro_batch_to for c in _State.callback.oom.policy.changes] == [2, 1]
    assert "training_step" not in vars(_State.trainer)      # cleaned up although on_train_end never came
    assert _State.callback.oom.result.data["changes"][-1]["micro_batch_to"] == 1


def test_a_training_step_that_skips_compute_loss_is_refused(tmp_path):
    class Custom(transformers.Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = model(**inputs).loss / self.args.gradient_accumulation_steps
            loss.backward()
            return loss.detach()

    with pytest.raises(MemlensError, match="does not call compute_loss"):
        _train(tmp_path, 4, 2, adaptive=True, limit=2, loss_kwargs=False, trainer_cls=Custom)


@pytest.mark.parametrize("args,extra,words", [
    (dict(world_size=2, n_gpu=1), {}, "2 processes"),
    (dict(world_size=1, n_gpu=4), {}, "DataParallel over 4 GPUs"),
    (dict(world_size=1, n_gpu=1), {"is_deepspeed_enabled": True}, "DeepSpeed"),
    (dict(world_size=1, n_gpu=1), {"is_fsdp_enabled": True}, "FSDP"),
])
def test_several_processes_are_refused(args, extra, words):
    t = types.SimpleNamespace(args=types.SimpleNamespace(**args), **extra)
    with pytest.raises(MemlensError, match=words):
        refuse_distributed(t)
    refuse_distributed(types.SimpleNamespace(args=types.SimpleNamespace(world_size=1, n_gpu=1)))   # one GPU: fine
