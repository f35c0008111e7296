"""compare: technique specs, savings arithmetic, measured rows (CPU subprocesses), chart, CLI."""
from __future__ import annotations

import json

import pytest
from explore_support import GiB, N, fake_estimator

from memlens.cli.main import main
from memlens.core.errors import MemlensError
from memlens.explore.compare import DEFAULT_TECHNIQUES, compare, parse_techniques, technique_spec
from memlens.report.compare_plots import plot_compare
from memlens.core.spec import TrainingSpec

SPEC = TrainingSpec(model="fake", batch_size=8, seq_len=512)


def test_technique_specs_and_combinations():
    assert technique_spec(SPEC, "accumulation").batch_size == 2 and technique_spec(SPEC, "accumulation").grad_accum == 4
    s = technique_spec(SPEC, "amp-fp16+checkpointing+accumulation")
    assert (s.precision, s.grad_checkpointing, s.batch_size, s.grad_accum, s.effective_batch_size) == ("amp-fp16", True, 2, 4, 8)
    assert technique_spec(SPEC.replace(batch_size=6), "accumulation").batch_size == 3     # 6 = 3 x 2
    with pytest.raises(MemlensError, match="divisible"):
        technique_spec(SPEC.replace(batch_size=3), "accumulation")
    with pytest.raises(MemlensError, match="unknown technique") as e:
        parse_techniques("fp32,checkpointng")
    assert "did you mean 'checkpointing'" in e.value.hint
    with pytest.raises(MemlensError, match="no techniques"):
        parse_techniques(" , ")
    assert parse_techniques(None) == list(DEFAULT_TECHNIQUES)


def test_estimated_savings_on_fake_estimator():
    r = compare(SPEC, ["fp32", "checkpointing", "bf16", "lora", "accumulation"], estimator=fake_estimator())
    rows = {x["technique"]: x for x in r.data["rows"]}
    base = 16 * N + 8 * GiB
    assert rows["fp32"]["estimated_peak_allocated_bytes"] == base and rows["fp32"]["saving"] == 0
    # checkpointing keeps a quarter of the activations: saves 6 GiB of 8
    assert rows["checkpointing"]["saving"] == pytest.approx(6 * GiB / base)
    assert rows["checkpointing"]["predicted_time_overhead"] == pytest.approx(1 / 3)
    # bf16 weights: weights and gradients 2 B/param each (the fake keeps 8 B of AdamW state), activations halved
    assert rows["bf16"]["estimated_peak_allocated_bytes"] == 12 * N + 4 * GiB
    # accumulation x4: activations of 2 samples
    assert rows["accumulation"]["estimated_peak_allocated_bytes"] == 16 * N + 2 * GiB
    assert rows["lora"]["estimated_peak_allocated_bytes"] == 4 * N + 12 * (N // 100) + 8 * GiB
    assert r.data["baseline"] == "fp32" and not r.data["measured"]


def test_rows_build_on_the_baselines_settings():
    # the spec as given is fp32; the baseline row is bf16: LoRA and 8-bit AdamW are bf16 too, each row says what it changes
    r = compare(SPEC, ["bf16", "lora", "adamw-8bit", "fp32"], estimator=fake_estimator(), budget="64GiB")
    rows = {x["technique"]: x for x in r.data["rows"]}
    assert {n: x["spec"]["precision"] for n, x in rows.items()} == {"bf16": "bf16", "lora": "bf16", "adamw-8bit": "bf16", "fp32": "fp32"}
    assert rows["bf16"]["changes"] == {} and rows["lora"]["changes"] == {"lora_rank": 16}
    assert rows["adamw-8bit"]["changes"] == {"optimizer": "adamw-8bit"} and rows["fp32"]["changes"] == {"precision": "fp32"}
    assert rows["lora"]["saving"] > 0          # bf16 LoRA saves against bf16 (fp32 LoRA did not: "+41% vs bf16")
    assert all(x["need_bytes"] == x["estimated_peak_reserved_bytes"] for x in rows.values())   # the fit rule: reserved
    assert any("on top of the baseline (bf16: " in n for n in r.notes)


def test_invalid_technique_row_does_not_stop_the_rest():
    r = compare(SPEC.replace(batch_size=3), ["fp32", "accumulation", "bf16"], estimator=fake_estimator())
    st = [x["status"] for x in r.data["rows"]]
    assert st == ["ok", "invalid", "ok"]


def test_measured_with_fake_runner_overheads_and_errors():
    def runner(spec, **kw):
        if spec.optimizer == "adamw-8bit":
            return {"status": "crash", "error": "SpecError: --optimizer adamw-8bit needs bitsandbytes on a GPU"}
        ck = spec.grad_checkpointing
        return {"status": "ok", "peak_allocated_bytes": (2 if ck else 4) * GiB, "peak_reserved_bytes": 5 * GiB,
                "seconds": 0.13 if ck else 0.1, "losses": [10.5, 10.1], "memory_measured": True}

    r = compare(SPEC, ["fp32", "checkpointing", "adamw-8bit"], measure=True, estimator=fake_estimator(), runner=runner)
    a, b, c = r.data["rows"]
    assert b["saving"] == pytest.approx(0.5) and b["time_overhead"] == pytest.approx(0.3)
    assert b["loss_delta_first_step"] == 0
    assert a["estimate_error"] == pytest.approx((16 * N + 8 * GiB) / (4 * GiB) - 1)
    assert c["status"] == "crash" and "bitsandbytes" in c["error"]


@pytest.mark.slow
def test_measured_on_cpu_subprocesses_checkpointing_keeps_the_loss(tmp_path):
    spec = TrainingSpec(model="explore_models:tiny", batch_size=4, seq_len=16)
    r = compare(spec, ["fp32", "checkpointing"], measure=True, device="cpu", steps=2, timeout=120)
    a, b = r.data["rows"]
    assert a["status"] == b["status"] == "ok"
    # the CPU ledger measures the storages (this tiny model peaks in the optimizer step: checkpointing saves none of it)
    assert a["memory_measured"] is True and 0 < b["measured_peak_allocated_bytes"] <= a["measured_peak_allocated_bytes"]
    assert "estimate_error" not in a   # CPU storages are not what a GPU estimate predicts
    assert a["step_seconds"] > 0 and b["step_seconds"] > 0
    # the same seeded weights and batch: checkpointing recomputes, it does not change the math
    assert b["losses"] == pytest.approx(a["losses"], rel=1e-6)
    plot_compare(r, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 5000


def test_cli_compare_json_and_chart(tmp_path, capsys):
    rc = main(["compare", "--model", "explore_models:tiny", "--batch-size", "4", "--seq-len", "32", "--techniques", "fp32,accumulation,fp32+accumulation",
               "--json", "--out", str(tmp_path)])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert [x["technique"] for x in d["rows"]] == ["fp32", "accumulation", "fp32+accumulation"]
    assert d["rows"][1]["estimated_peak_allocated_bytes"] < d["rows"][0]["estimated_peak_allocated_bytes"]
    assert (tmp_path / "compare.png").exists() and (tmp_path / "result.json").exists()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("argv,needle", [
    (["--techniques", "fp32,turbo"], "unknown technique"),
    (["--techniques", ","], "no techniques"),
    pytest.param(["--measure"], "CUDA", marks=pytest.mark.skipif(_has_cuda(), reason="this machine has a GPU: --measure runs")),
    (["--steps", "0"], "--steps"),
])
def test_cli_compare_bad_input(capsys, argv, needle):
    rc = main(["compare", "--model", "explore_models:tiny", "--batch-size", "4", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and needle in err


def test_predicted_overheads_carry_their_range_over_the_hosts_spread(capsys):
    """Each estimated row's step at the fast and the slow end of its timing table's host spread (the Result's
    step_time.host_range), and the overhead's range: the technique over the baseline, both at the same end."""
    from memlens.explore.compare import compare
    from memlens.report.compare_text import render_compare

    spec = TrainingSpec(model="tests/fixtures/tiny-llama", batch_size=2, seq_len=64, gpu="h100")
    r = compare(spec, ["fp32", "checkpointing"])
    base, ck = r.data["rows"]
    for row in (base, ck):
        lo, hi = row["predicted_step_seconds_range"]
        assert lo < row["predicted_step_seconds"] < hi          # a tiny model's step is host-bound: it moves with the host
    assert ck["predicted_time_overhead_range"] == pytest.approx(
        [ck["predicted_step_seconds_range"][i] / base["predicted_step_seconds_range"][i] - 1 for i in (0, 1)])
    # both steps host-bound at either end: the host's speed moves both alike and the overhead hardly (no span shown;
    # an 8B LoRA step, GPU-bound without checkpointing and host-bound with it, shows +64.4% (+39..+69%): docs/speed.md)
    lo, hi = sorted(ck["predicted_time_overhead_range"])
    assert hi - lo < 0.03
    render_compare(r)
    out = capsys.readouterr().out
    assert f"{ck['predicted_time_overhead'] * 100:+.1f}%" in out and ".." not in out
