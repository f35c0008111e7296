"""--dp runs Opacus (make_private, BatchMemoryManager) on fake tensors (estimate) and real CPU tensors
(profile, trials). Bytes are computed by hand for one bias-free Linear(64 -> 32) layer
(tests.tiny_models:seq_linear: batch x T tokens x 64 inputs, one loss per sample)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("opacus")

from memlens.cli.main import main  # noqa: E402
from memlens.core.errors import MemlensError, SpecError  # noqa: E402
from memlens.core.events import ALLOC, FREE, PHASE, TAG  # noqa: E402
from memlens.core.spec import TrainingSpec  # noqa: E402
from memlens.estimator import estimate  # noqa: E402
from memlens.estimator.simulate import simulate  # noqa: E402
from memlens.step import prepare  # noqa: E402

SEQ = "tests.tiny_models:seq_linear"
LLAMA = str(Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama")
W = 32 * 64 * 4          # the weight's bytes (fp32)


def dp(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": SEQ, "optimizer": "sgd", "dp": True, "batch_size": 8, **kw})


def lifetimes(log):
    """{storage: [bytes, last category, phase allocated, phase freed]} over the whole log."""
    out, phase = {}, "setup"
    for ev in log.events:
        if ev[0] == PHASE:
            phase = ev[1]
        elif ev[0] == ALLOC:
            out[ev[1]] = [ev[2], ev[3], phase, None]
        elif ev[0] == TAG and ev[1] in out:
            out[ev[1]][1] = ev[2]
        elif ev[0] == FREE and ev[1] in out and out[ev[1]][3] is None:
            out[ev[1]][3] = phase
    return out


# ---------------------------------------------------------------- estimate: Opacus on fake tensors
def test_hooks_per_sample_gradients_by_hand():
    r = estimate(dp())
    # the grad sampler's einsum (8 x 32 x 64 fp32) and Opacus' zero-filled p.grad_sample it is copied into
    assert r.by_category["per_sample_gradients"] == 2 * 8 * W
    assert r.data["peak_phase"] == "backward"
    # per step (2 simulated): the einsum's output dies in backward; p.grad_sample lives until zero_grad
    # after the optimizer step
    per_sample = [v[2:] for v in lifetimes(simulate(dp()).log).values() if v[1] == "per_sample_gradients" and v[0] == 8 * W]
    assert per_sample == [["backward", "backward"], ["backward", "optimizer"]] * 2
    assert any("make_private per-sample gradients (hooks)" in a for a in r.data["applied"])


def test_batch_memory_manager_accumulates_clipped_gradients():
    log = simulate(dp(physical_batch_size=2)).log
    # only the physical batch of 2 ever has per-sample gradients (2 x 32 x 64 fp32), never all 8 samples
    life = lifetimes(log)
    assert {v[0] for v in life.values() if v[1] == "per_sample_gradients" and v[0] > 512} == {2 * W}
    phases = [(ev[1], ev[2]) for ev in log.events if ev[0] == PHASE]
    step1 = [p for p, s in phases if s == 1]
    # 4 physical batches: the first two and the last are simulated (the third repeats the second's memory)
    assert step1.count("forward") == 3 and step1.count("clip") == 3 and step1.count("optimizer") == 1
    # summed_grad is allocated in the first physical batch's clip and lives to the end of the logical step
    summed = [v for v in lifetimes(log).values() if v[1] == "gradients" and v[0] == W and v[2] == "clip"]
    assert summed and summed[0][3] == "optimizer"


def test_ghost_gram_matrices_by_hand():
    T = 256
    r = estimate(dp(grad_sample_mode="ghost", seq_len=T))
    # Opacus' Linear norm sampler: g g^T and a a^T, each 8 x T x T fp32, live together; plus two 512-byte
    # blocks of 8 values (the per-sample <ggT, aaT> and its clamp) before the square root
    assert r.by_category["gram_matrices"] == 2 * 8 * T * T * 4 + 2 * 512
    assert "per_sample_gradients" not in {k for k, v in r.by_category.items() if v > 512}
    hooks = estimate(dp(seq_len=T))
    assert r.peak_allocated_bytes > hooks.peak_allocated_bytes       # long sequence: ghost costs more
    short_ghost, short_hooks = estimate(dp(grad_sample_mode="ghost", seq_len=2)), estimate(dp(seq_len=2))
    assert short_ghost.peak_allocated_bytes < short_hooks.peak_allocated_bytes   # short: per-sample gradients cost more


def test_lora_llama_components_and_modes():
    base = dict(model=LLAMA, batch_size=4, seq_len=32, lora_rank=4, optimizer="sgd", dp=True)
    r = estimate(TrainingSpec(**base))
    comps = {c["component"]: c["bytes"] for c in r.data["by_component"]}
    assert {"attention", "mlp", "embedding", "norm", "lora"} <= set(comps)
    assert sum(comps.values()) == r.peak_allocated_bytes
    g = estimate(TrainingSpec(**base, grad_sample_mode="ghost"))
    assert g.by_category["per_sample_gradients"] > 0     # ghost: the per-sample norms


# ---------------------------------------------------------------- real steps (CPU)
def _update(spec: TrainingSpec) -> list[torch.Tensor]:
    step = prepare(spec, device="cpu", seed=0)
    before = [p.detach().clone() for p in step.model.parameters()]
    step.run()
    return [p.detach() - b for p, b in zip(step.model.parameters(), before)]


def test_physical_batches_and_ghost_give_the_same_update():
    """BatchMemoryManager only splits the work: without noise, the clipped sum is the same for any
    physical batch, and ghost clipping clips exactly as the per-sample gradients do."""
    base = dict(noise_multiplier=0.0, max_grad_norm=0.01)
    whole = _update(dp(**base))
    for other in (_update(dp(physical_batch_size=3, **base)), _update(dp(grad_sample_mode="ghost", physical_batch_size=2, **base))):
        for a, b in zip(whole, other):
            assert a.abs().max() > 0
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-4 * float(a.abs().max()))


def test_real_step_calls_the_wrapped_optimizer_once_per_logical_batch():
    step = prepare(dp(physical_batch_size=3), device="cpu", seed=0)
    calls, phases = [], []
    step.dp.original_optimizer.register_step_post_hook(lambda *a: calls.append(1))
    step.run(phases.append)
    assert step.dp.n_physical == 3 and len(calls) == 1
    assert phases == ["forward", "backward", "clip"] * 2 + ["forward", "backward", "clip", "optimizer", "end"]
    assert type(step.model).__name__ == "GradSampleModule" and type(step.optimizer).__name__ == "DPOptimizer"


def test_profile_dp_on_cpu_records_the_seed_phases(capsys):
    rc = main(["profile", "--model", SEQ, "--optimizer", "sgd", "--dp", "--batch-size", "8", "--physical-batch-size", "4",
               "--device", "cpu", "--steps", "1", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    labels = [s["label"] for s in r["snapshots"]]
    assert labels[:5] == ["model load", "data preparation", "optimizer setup", "privacy engine setup", "warmup (1 step)"]
    assert {"step 1 physical 1/2 forward", "step 1 physical 1/2 backward", "step 1 physical 1/2 clip",
            "step 1 physical 2/2 clip", "step 1 physical 2/2 optimizer", "step 1 end"} <= set(labels)
    assert r["by_category"]["per_sample_gradients"] == 2 * 4 * W
    assert r["dp"]["physical_batches"] == 2 and r["dp"]["grad_sample_mode"] == "hooks"
    assert r["peak_allocated_bytes"] == max(s["peak_allocated_bytes"] for s in r["snapshots"] if s["phase"] != "start")


# ---------------------------------------------------------------- refusals and bad input
@pytest.mark.parametrize("kw,words", [
    (dict(world_size=2, sharding="fsdp"), "ghost_fsdp"),
    (dict(grad_accum=2), "BatchMemoryManager"),
    (dict(precision="amp-fp16"), "GradScaler"),
    (dict(grad_checkpointing=True, model=LLAMA, lora_rank=4), "recomputation"),
])
def test_refused_with_one_line(kw, words):
    with pytest.raises(SpecError) as e:
        estimate(dp(**kw))
    assert words in e.value.message and "\n" not in e.value.message


def test_functorch_layers_are_refused_on_fake_tensors():
    with pytest.raises(SpecError, match="LlamaRMSNorm"):
        estimate(TrainingSpec(model=LLAMA, batch_size=2, seq_len=16, dp=True))


def test_ghost_needs_per_sample_losses():
    with pytest.raises(MemlensError, match="one loss per sample"):
        estimate(TrainingSpec(model="tests.tiny_models:linear", dp=True, grad_sample_mode="ghost", optimizer="sgd"))


def test_dp_settings_need_dp_and_valid_values():
    with pytest.raises(SpecError, match="grad-sample-mode is a DP-SGD setting"):
        TrainingSpec(model=SEQ, grad_sample_mode="ghost")
    with pytest.raises(SpecError, match="max-grad-norm must be > 0"):
        dp(max_grad_norm=0)
    with pytest.raises(SpecError, match="noise-multiplier must be >= 0"):
        dp(noise_multiplier=-1)
    with pytest.raises(SpecError, match="is not one of hooks, ghost"):
        dp(grad_sample_mode="functorch")
    with pytest.raises(SpecError, match="max_physical_batch_size 16 > batch_size 8"):
        dp(physical_batch_size=16)
    s = TrainingSpec.from_dict({"model": SEQ, "dp": "yes", "grad_sample_mode": "ghost", "max_grad_norm": "0.5"})
    assert (s.grad_sample_mode, s.max_grad_norm, s.noise_multiplier) == ("ghost", 0.5, 1.0)
    assert TrainingSpec.from_dict(s.to_dict()) == s and "dp-ghost" in s.describe()


def test_missing_opacus_is_one_line(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "opacus", None)
    rc = main(["estimate", "--model", SEQ, "--dp"])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install 'memlens[dp]'" in err and "Traceback" not in err


def test_cli_bad_grad_sample_mode(capsys):
    assert main(["estimate", "--model", SEQ, "--dp", "--grad-sample-mode", "ew"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'ew'" in err and err.count("\n") == 1


# ---------------------------------------------------------------- compare, fit
def test_compare_dp_hooks_ghost_non_private(capsys):
    rc = main(["compare", "--model", SEQ, "--optimizer", "sgd", "--dp", "--batch-size", "8", "--physical-batch-size", "4",
               "--seq-len", "64", "--json"])
    assert rc == 0
    rows = {r["technique"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert list(rows) == ["non-private", "dp-hooks", "dp-ghost"]
    assert rows["non-private"]["spec"]["dp"] is False and rows["non-private"]["spec"]["grad_accum"] == 2
    assert rows["dp-ghost"]["spec"]["grad_sample_mode"] == "ghost" and rows["dp-hooks"]["kind"] == "changes the privacy"
    assert rows["dp-hooks"]["estimated_peak_allocated_bytes"] > rows["non-private"]["estimated_peak_allocated_bytes"]


def test_fit_dp_answers_the_physical_batch():
    from memlens.explore.fit import fit

    # Linear(1024 -> 1024): each sample's gradient is 4 MiB, twice while Opacus copies it
    spec = TrainingSpec(model="tests.tiny_models:linear", optimizer="sgd", dp=True, batch_size=16)
    r = fit(spec, "2GiB", context_bytes=0, margin=0, plan=False)
    assert r.data["searched_field"] == "physical_batch_size" and r.data["max_batch_size"] == 16
    tight = fit(spec, r.data["predicted_need_bytes"] - 16 * 2**20, context_bytes=0, margin=0, plan=False)
    assert 1 <= tight.data["max_batch_size"] < 16 and tight.data["micro_batch_size"] == tight.data["max_batch_size"]


# ---------------------------------------------------------------- the Opacus profiler's sweep (seeds/004)
def test_seed_sweep_flags_files_and_token(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    out = tmp_path / "memory_results"
    rc = main(["sweep", "--model_name", SEQ, "--optimizer", "sgd", "--token", "hf_secret_token_1234",
               "--seq_lengths", "16", "64", "--batch_sizes", "2", "4", "--max_physical_batch_sizes", "1", "4",
               "--num_steps", "2", "--results_dir", str(out), "--detailed"])
    cap = capsys.readouterr()
    assert rc == 0
    assert "skipping 2 cell(s) with max_physical_batch_size > batch_size" in cap.err
    names = {p.name for p in out.iterdir()}
    assert {"memory_profile_results.json", "memory_profile_summary.csv", "memory_analysis_overview.png", "memory_heatmap.png",
            "detailed_memory_results.json", "detailed_memory_analysis.png", "operation_level_breakdown.png"} <= names
    assert {f"memory_timeline_config_{i}.png" for i in (1, 2, 3, 4, 6, 8)} <= names
    res = json.loads((out / "memory_profile_results.json").read_text())
    assert [r["max_physical_batch_size"] for r in res["results"]] == [1, 1, 1, 1, 4, 4, 4, 4]
    assert [r["status"] for r in res["results"]][4:] == ["skipped", "ok", "skipped", "ok"]
    det = json.loads((out / "detailed_memory_results.json").read_text())["results"][1]["detail"]
    assert det["source"] == "estimate" and "clip" in det["by_phase"] and det["by_category"]["per_sample_gradients"] > 0
    rows = (out / "memory_profile_summary.csv").read_text().splitlines()
    assert rows[0].startswith("config,seq_length,batch_size,max_physical_batch_size,lora_rank") and len(rows) == 9
    # the token is used, never written or printed
    assert os.environ["HF_TOKEN"] == "hf_secret_token_1234"
    assert "hf_secret_token_1234" not in cap.out + cap.err
    for p in out.rglob("*"):
        if p.is_file():
            assert b"hf_secret_token_1234" not in p.read_bytes(), p.name


def test_seed_sweep_all_physical_too_large_is_one_line(tmp_path, capsys):
    rc = main(["sweep", "--model_name", SEQ, "--batch_sizes", "2", "--max_physical_batch_sizes", "4", "--results_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "max_physical_batch_size 4 > batch_size 2" in err and "Traceback" not in err


@pytest.mark.slow
def test_seed_sweep_lora_ranks_measured_on_cpu(tmp_path, capsys, monkeypatch):
    """Real Opacus trials (CPU: time only), the detailed mode from a full profile. The trials run in this process
    (tests/trials.py: the subprocess each trial runs in is tested in tests/explore/test_sweep.py)."""
    import memlens.explore.sweep as sweep_module
    from tests import trials

    monkeypatch.setattr(sweep_module, "run_trial", trials.in_process)
    rc = main(["sweep", "--model_name", LLAMA, "--optimizer", "sgd", "--seq_lengths", "16", "--batch_sizes", "4",
               "--max_physical_batch_sizes", "2", "--lora_ranks", "4", "8", "--num_steps", "1", "--measure", "--device", "cpu",
               "--results_dir", str(tmp_path), "--detailed", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["lora_rank"], r["status"]) for r in rows] == [(4, "ok"), (8, "ok")]
    d = rows[1]["detail"]
    assert {c["component"] for c in d["by_component"]} >= {"lora", "attention"} and d["dp"]["physical_batches"] == 2
    assert any(pt["label"] == "privacy engine setup" for pt in rows[0]["timeline"])


def test_seed_names_that_disagree_are_one_line(tmp_path, capsys):
    assert main(["sweep", "--model", SEQ, "--model_name", "gpt2", "--batch_sizes", "2", "--results_dir", str(tmp_path)]) == 2
    assert "--model tests.tiny_models:seq_linear and --model_name gpt2 disagree" in capsys.readouterr().err
    assert main(["sweep", "--model", SEQ, "--batch_sizes", "2", "--out", str(tmp_path / "a"), "--results_dir", str(tmp_path / "b")]) == 2
    assert "disagree" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_repeated_physical_batches_are_simulated_once(monkeypatch, mode):
    """On fake tensors physical batches 3..k-1 of the same size are not re-run: the result equals running them all."""
    import memlens.step.kinds.opacus as mo

    spec = dp(batch_size=11, physical_batch_size=2, seq_len=32, grad_sample_mode=mode)   # 2, 2, (2, 2, 2), 1
    short = estimate(spec)

    def every(self, resume=None):
        assert resume is None           # unwatched, so step 2 is simulated too (memlens.estimator.periodic_dp)
        for i, idx in enumerate(self.loader.batch_sampler, 1):
            yield i, self.gather(idx)

    monkeypatch.setattr(mo.DPStep, "physical_batches", every)
    full = estimate(spec)
    assert (short.peak_allocated_bytes, short.peak_reserved_bytes) == (full.peak_allocated_bytes, full.peak_reserved_bytes)
    assert short.by_category == full.by_category
