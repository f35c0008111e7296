"""A deep stack's layers written from 3- and 4-layer models (memlens.estimator.depth) give the log
of the whole model simulated, event for event; where that cannot be shown the model is
simulated whole and the result says why."""
import json
from pathlib import Path

import pytest
import torch

from memlens.estimator.reduce_scratch import ReduceScratch
from memlens.core.events import ALLOC, FREE, PHASE, EventLog, canonical
from memlens.core.spec import TrainingSpec
from memlens.estimator import depth, estimate
from memlens.estimator import simulate as simulate_module
from memlens.estimator.simulate import _simulate, simulate
from memlens.models.source import resolve
from memlens.step.plan import resolve as plan_of

MODELS = Path(__file__).parent.parent / "fixtures" / "models"
GPT2 = str(MODELS / "tiny-gpt2" / "config.json")
LLAMA = str(MODELS / "tiny-llama" / "config.json")
VIT = str(MODELS / "tiny-vit" / "config.json")


def deep(tmp_path, config: str, layers: int = 12, **changes) -> str:
    cfg = json.loads(open(config).read())
    cfg["n_layer" if cfg["model_type"] == "gpt2" else "num_hidden_layers"] = layers
    cfg.update(changes)
    path = tmp_path / f"deep-{cfg['model_type']}-{layers}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


# 6 layers (depth writes from 10 on; lowered by the fixture six_layers): layers 5 and 6 written from 3 and 4, as 5..12
# are for 12, the whole model's reference simulation half as long; test_the_estimate_says_how_the_layers_were_made
# keeps the 12 layers and the threshold as shipped
SIX = 6


@pytest.fixture
def six_layers(monkeypatch):
    monkeypatch.setattr(depth, "MIN_LAYERS", SIX)


def assert_written_equals_whole(spec: TrainingSpec):
    src = resolve(spec.model)
    fast = simulate(spec, src)
    whole = _simulate(spec, src, 2, True)
    assert fast.later_layers == "written from 3 and 4 layers", fast.later_layers
    assert canonical(fast.log) == canonical(whole.log)
    assert (fast.param_count, fast.trainable_count) == (whole.param_count, whole.trainable_count)
    return fast


@pytest.mark.parametrize("changes", [
    {},                                                     # fp32, dropout
    {"precision": "amp-fp16"},                              # autocast's cache cleared after forward
    {"precision": "amp-bf16", "grad_checkpointing": True},  # recomputation that stops early in backward
    {"precision": "bf16", "grad_accum": 3},                 # micro-batches written from the first
    {"lora_rank": 4},                                       # only adapters in the optimizer
    {"optimizer": "adafactor"},                             # a per-parameter loop with step counters
    {"max_grad_norm": 1.0, "attn": "eager"},                # clip_grad_norm_ stacks one norm per parameter
], ids=["fp32", "amp-fp16", "amp-bf16-ckpt", "bf16-accum3", "lora", "adafactor", "clip-eager"])
def test_tiny_gpt2_of_6_layers(tmp_path, six_layers, changes):
    assert_written_equals_whole(TrainingSpec(model=deep(tmp_path, GPT2, SIX), batch_size=2, seq_len=32, **changes))


def test_tiny_llama_and_vit_of_6_layers(tmp_path, six_layers):
    assert_written_equals_whole(TrainingSpec(model=deep(tmp_path, LLAMA, SIX), batch_size=2, seq_len=32, precision="bf16",
                                             optimizer="adamw-8bit"))
    assert_written_equals_whole(TrainingSpec(model=deep(tmp_path, VIT, SIX), batch_size=2, precision="amp-fp16"))


def test_the_estimate_says_how_the_layers_were_made(tmp_path):
    r = estimate(TrainingSpec(model=deep(tmp_path, GPT2), batch_size=2, seq_len=32))
    assert r.data["later_layers"] == "written from 3 and 4 layers"
    # 12 blocks (ln_1, c_attn, attn c_proj, ln_2, c_fc, mlp c_proj), token and position embeddings, ln_f
    assert r.data["param_count"] == 12 * (2 * 64 + 64 * 192 + 192 + 64 * 64 + 64 + 2 * 64 + 64 * 256 + 256 + 256 * 64 + 64) \
        + 1000 * 64 + 2048 * 64 + 2 * 64
    r = estimate(TrainingSpec(model=GPT2, batch_size=2, seq_len=32))
    assert r.data["later_layers"] == "simulated (2 layers (written from shallow models from 10 on))"


@pytest.mark.parametrize("spec_changes, config_changes, reason", [
    ({"freeze": ("h.0.",)}, {}, "a --freeze or --lora-targets pattern names layers by number"),
    ({"world_size": 2, "sharding": "ddp"}, {}, "several GPUs with DDP, ZeRO-1 or DP-SGD (FSDP2's ranks are written)"),
    ({"compile": True}, {}, "--compile"),
    ({}, {"layer_types": ["full_attention"] * 6 + ["sliding_attention"] * 6},
     "the config's layer_types differs from layer to layer"),
])
def test_specs_simulated_whole(tmp_path, spec_changes, config_changes, reason):
    model = deep(tmp_path, LLAMA, 12, **config_changes)
    assert depth.why_not(plan_of(TrainingSpec(model=model, **spec_changes), source=resolve(model)), resolve(model)) == reason


def test_a_written_log_that_differs_is_not_used(tmp_path, monkeypatch, six_layers):
    """The 4-layer log written from 3 layers is compared with its simulation: any difference and the
    whole model is simulated."""
    real = depth.write_layers

    def off_by_one(log, *a, **k):
        out = real(log, *a, **k)
        i = next(i for i, ev in enumerate(out.events) if ev[0] == ALLOC and ev[5] == "forward")
        out.events[i] = out.events[i]._replace(nbytes=out.events[i].nbytes + 512)
        return out

    monkeypatch.setattr(depth, "write_layers", off_by_one)
    spec = TrainingSpec(model=deep(tmp_path, GPT2, SIX), batch_size=2, seq_len=32)
    sim = simulate(spec)
    assert sim.later_layers == "simulated (the 4-layer log written from 3 layers differs from its simulation)"
    assert canonical(sim.log) == canonical(_simulate(spec, resolve(spec.model), 2, True).log)


def test_layers_built_differently_are_refused(monkeypatch):
    from memlens.models import build

    src = resolve(GPT2)
    src.config.num_hidden_layers = 12
    depth.check_layers_alike(src)                     # twelve blocks built alike: no error
    real = build._auto_class

    class OddSixth:
        @staticmethod
        def from_config(config):
            model = real("causal-lm").from_config(config)
            model.transformer.h[5].mlp.act = torch.nn.ReLU()
            return model

    monkeypatch.setattr(build, "_auto_class", lambda task: OddSixth)
    with pytest.raises(depth.NotPeriodic, match="layer 5 is not built like layer 0"):
        depth.check_layers_alike(src)


# ---------------------------------------------------------------- a log written by hand
def program(layers: int) -> EventLog:
    """A step of ``layers`` layers of 100-byte outputs, as a tracker logs it: forward (layer j
    frees layer j - 1's output after making its own), backward (each layer's gradient, the one from
    above freed), an optimizer allocating a state per layer in one list, freed in reverse."""
    log = EventLog()
    stack = [log.module_id(f"layers.{j}.fc") for j in range(layers)]
    head = log.module_id("head")
    key = iter(range(10**6))
    log.phase("forward", 1)
    x = next(key)
    log.alloc(x, 64, "inputs", head, "forward")
    for j in range(layers):
        y = next(key)
        log.alloc(y, 100, "activations", stack[j], "forward")
        if j:
            log.free(x)
        x = y
    log.phase("backward", 1)
    g = next(key)
    log.alloc(g, 100, "temporaries", head, "backward")
    for j in reversed(range(layers)):
        h = next(key)
        log.alloc(h, 100, "temporaries", stack[j], "backward")
        log.free(g)
        g = h
    log.free(g)
    log.phase("optimizer", 1)
    states = []
    for j in range(layers):
        states.append(next(key))
        log.alloc(states[-1], 8, "optimizer_state", head, "optimizer")
    for s in reversed(states):
        log.free(s)
    log.phase("done", 1)
    return log, {s: j for j, s in enumerate(states)}


def test_write_layers_on_a_log_written_by_hand():
    log, live = program(4)
    out = depth.write_layers(log, depth.Stack("layers", 4), live, copies=3)
    want, _ = program(7)
    assert canonical(out) == canonical(want)
    assert out.modules == want.modules
    assert sum(ev[2] for ev in out.events if ev[0] == ALLOC) == 64 + 7 * 100 + 100 + 7 * 100 + 7 * 8
    assert sum(ev[0] == FREE for ev in out.events) == 6 + 8 + 7
    assert [ev[1] for ev in out.events if ev[0] == PHASE] == ["forward", "backward", "optimizer", "done"]


def test_later_sizes_of_a_checked_family_are_written_from_4_layers(tmp_path, six_layers):
    """Once a step was checked on 3 and 4 layers, the same step at other sizes or accumulation is
    written from its 4-layer simulation alone (layers 1 and 2 of it checked alike), and is still exact."""
    model = deep(tmp_path, GPT2, SIX)
    assert_written_equals_whole(TrainingSpec(model=model, batch_size=2, seq_len=32, precision="amp-bf16"))
    for b, L, k in ((1, 32, 1), (4, 64, 1), (2, 32, 3)):
        spec = TrainingSpec(model=model, batch_size=b, seq_len=L, grad_accum=k, precision="amp-bf16")
        fast, whole = simulate(spec), _simulate(spec, resolve(model), 2, True)
        assert fast.later_layers == "written from 4 layers (the rule checked on 3 and 4 layers at another size)"
        assert canonical(fast.log) == canonical(whole.log)
        assert (fast.param_count, fast.trainable_count) == (whole.param_count, whole.trainable_count)


def test_a_family_that_failed_is_simulated_whole_at_once(tmp_path, monkeypatch, six_layers):
    test_a_written_log_that_differs_is_not_used(tmp_path, monkeypatch, six_layers)
    depths = []
    real = simulate_module._simulate
    monkeypatch.setattr(simulate_module, "_simulate", lambda spec, source, *a, **k: depths.append(
        source.config.num_hidden_layers) or real(spec, source, *a, **k))
    sim = simulate(TrainingSpec(model=deep(tmp_path, GPT2, SIX), batch_size=4, seq_len=32))
    assert depths == [SIX]
    assert sim.later_layers == "simulated (the 4-layer log written from 3 layers differs from its simulation)"


def test_check_middle_on_a_log_written_by_hand():
    log, live = program(4)
    depth.check_middle(log, depth.Stack("layers", 4), live)     # layers 1 and 2 alike: no error
    i = next(i for i, ev in enumerate(log.events) if ev[0] == ALLOC and log.modules[ev[4]] == "layers.2.fc")
    assert log.events[i + 1][0] == FREE
    del log.events[i + 1]      # layer 2 no longer frees layer 1's output in the forward
    with pytest.raises(depth.NotPeriodic, match="layer 2's events at 5 are not layer 1's written one layer on"):
        depth.check_middle(log, depth.Stack("layers", 4), live)


@pytest.mark.slow
def test_workers_share_what_they_checked(tmp_path):
    """A worker process returns the families it checked, and is given those the others checked."""
    from memlens.estimator.scaling import _simulate_in_worker

    model = deep(tmp_path, GPT2)
    first = _simulate_in_worker(TrainingSpec(model=model, batch_size=2, seq_len=32))
    assert first.sim.later_layers == "written from 3 and 4 layers"
    (family, per_layer), = first.checked.items()
    assert per_layer == (49984, 49984, True)           # parameters of one tiny GPT-2 block, all trainable (no list over layers)
    depth.CHECKED.pop(family)                          # as in another worker that has not seen it
    second = _simulate_in_worker(TrainingSpec(model=model, batch_size=4, seq_len=32), first.checked)
    assert second.sim.later_layers == "written from 4 layers (the rule checked on 3 and 4 layers at another size)"
    assert second.checked == {}


def test_shallow_models_that_fail_leave_the_whole_model_to_say(tmp_path, monkeypatch):
    """A failure only the cut models meet (or a full model the meta device cannot build) is no
    answer: the whole model is simulated, and its own simulation says whether it fails."""
    from memlens.core.errors import MemlensError

    real = simulate_module._simulate

    def shallow_fails(spec, source, *a, **k):
        if source.config.num_hidden_layers < 12:
            raise MemlensError("cut model failed")
        return real(spec, source, *a, **k)

    monkeypatch.setattr(simulate_module, "_simulate", shallow_fails)
    sim = simulate(TrainingSpec(model=deep(tmp_path, GPT2), batch_size=2, seq_len=32))
    assert sim.later_layers == "simulated (the shallow models failed: cut model failed)"
    assert sim.param_count == 795008


@pytest.mark.slow
def test_a_worker_sends_the_shallow_log_and_its_result(tmp_path):
    """A worker sends a log written from layers as the shallow log and how to write it, with the
    estimate made there; the parent writes the log only when a replay needs it, and every answer,
    replayed or simulated in a worker, is the estimate made here."""
    from memlens.estimator.scaling import ScalingEstimator, Trace, _simulate_in_worker
    from tests.estimator.test_scaling import comparable as answer

    def comparable(r):      # but how the layers were made (here, the family is checked already)
        d = answer(r)
        assert d.pop("later_layers").startswith("written from")
        return d

    spec = TrainingSpec(model=deep(tmp_path, GPT2), batch_size=2, seq_len=128, precision="bf16")
    sent = _simulate_in_worker(spec)
    shallow, stack, _, copies, _ = sent.sim.written
    assert sent.sim.log is None and (stack.depth, copies) == (4, 8)
    # ops by name (they pickle), a reduction's scratch by what sizes it
    assert all(isinstance(ev[6], (str, ReduceScratch)) for ev in shallow.events if ev[0] == ALLOC)
    here = simulate(spec)
    assert canonical(Trace.of(sent.sim, (2, 128)).log) == canonical(Trace.of(here, (2, 128)).log)
    assert comparable(sent.result) == comparable(estimate(spec))

    est = ScalingEstimator(workers=2)
    grid = [spec.replace(batch_size=b, seq_len=L) for b in (2, 3, 5) for L in (128, 256, 384)]
    est.prepare(grid)
    answers = {s: est.estimate(s) for s in grid}
    assert est.stats()["simulations"] == 5 and est.stats()["replays"] == 4
    for s, r in answers.items():
        if r.data["scaling"]["answer"] == "replayed" or s.batch_size == 5:
            assert comparable(r) == comparable(estimate(s)), s.describe()


def test_a_list_over_every_layer_grows_as_recorded_only_where_shown():
    """A tensor stacked from every layer's entries (per-sample norms, 16 bytes a layer): a later spec
    sizes it from its own list only where the 3- and 4-layer models grew by what was recorded."""
    from memlens.core.events import Alloc

    def log(nbytes: int) -> EventLog:
        return EventLog(events=[Alloc(ALLOC, 7, nbytes, "dp_per_sample", -1, "clip", "aten.stack.default")])

    a, b = log(3 * 16 + 8), log(4 * 16 + 8)       # 8 bytes from outside the stack
    assert depth.grows_as_recorded(a, {7: 16}, b, {7: 16})
    assert depth.recorded_sizes(b, {7: 16}, 28) == {7: 32 * 16 + 8}
    assert not depth.grows_as_recorded(a, {7: 12}, b, {7: 12})     # recorded 12, grew 16
    assert not depth.grows_as_recorded(a, {7: None}, b, {7: None})  # not a concatenation of its entries
