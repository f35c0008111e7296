"""`memlens profile` end to end on CPU with a tiny factory model, and its bad-input paths."""
from __future__ import annotations

import json

import pytest

from memlens.cli.main import main

TINY = "tests.measure.profile_models:tiny_mlp"
PARAM_BYTES = 58 * 4


def test_cli_json(capsys):
    assert main(["profile", "--model", TINY, "--device", "cpu", "--steps", "2", "--warmup", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verb"] == "profile" and d["mode"] == "full" and d["device"] == "cpu"
    assert d["by_category"]["parameters"] == PARAM_BYTES
    assert d["by_category"]["gradients"] == PARAM_BYTES
    assert d["by_category"]["optimizer_state"] == 2 * PARAM_BYTES + 16     # AdamW (default) after the warmup step
    assert d["profiled_steps"] == 2 and d["warmup_steps"] == 1 and len(d["steps"]) == 2
    assert d["model_load"]["theoretical_param_bytes"] == PARAM_BYTES
    assert d["model_load"]["batch_bytes"] == 48
    assert d["spec"]["model"] == TINY


def test_cli_out_dir_and_summary(tmp_path, capsys):
    out = tmp_path / "prof"
    assert main(["profile", "--model", TINY, "--device", "cpu", "--steps", "1", "--optimizer", "sgd",
                 "--torch-profiler", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "peak allocated" in text and "at the peak, by category" in text and "written to" in text
    for name in ("result.json", "timeline.csv", "snapshots.png", "timeline.png", "categories.png", "modules.png",
                 "report.html", "trace.json"):
        assert (out / name).is_file(), name
    d = json.loads((out / "result.json").read_text())
    assert d["by_category"]["optimizer_state"] == 0
    tp = d["torch_profiler"]
    assert tp["chrome_trace"] == "trace.json" and tp["by_time"] and tp["by_memory"]
    assert {r["name"] for r in tp["regions"]} >= {"memlens/forward", "memlens/backward", "memlens/optimizer"}
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert "torch.profiler: top operators" in (out / "report.html").read_text()


def test_cli_compare_estimate(capsys):
    assert main(["profile", "--model", TINY, "--device", "cpu", "--steps", "1", "--compare-estimate", "--json"]) == 0
    ce = json.loads(capsys.readouterr().out)["compare_estimate"]
    assert ce["available"]
    names = [r["name"] for r in ce["rows"] + ce["by_phase"] + ce["by_category"]]
    assert "peak allocated" in names and "parameters" in names and "backward peak" in names
    assert "not like for like" in ce["note"]


@pytest.mark.parametrize("argv, needle", [
    (["--model", "gtp2", "--device", "cpu"], "unknown model"),
    (["--model", TINY, "--device", "cpu", "--steps", "0"], "--steps"),
    (["--model", TINY, "--device", "cpu", "--warmup", "-1"], "--warmup"),
    (["--model", TINY, "--device", "tpu"], "--device"),
    (["--model", TINY, "--device", "cpu", "--snapshot"], "--out"),
    (["--model", TINY, "--device", "cpu", "--snapshot", "--out", "OUTDIR"], "CUDA"),
    (["--model", TINY, "--device", "cuda:0"], "cuda"),
    (["--model", "/no/such/dir"], "unknown model"),
    (["--model", "no_such_module_xyz:fn", "--device", "cpu"], "cannot import"),
    (["--model", TINY, "--device", "cpu", "--config", "/no/such.yaml"], "does not exist"),
    (["--device", "cpu"], "no model"),
    (["--model", TINY, "--device", "cpu", "--mode", "fast"], "invalid choice"),
])
def test_bad_input_one_line_exit_2(argv, needle, capsys, tmp_path):
    argv = [str(tmp_path / "o") if a == "OUTDIR" else a for a in argv]
    import torch

    if "cuda:0" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ERROR:") and "HINT:" in err
    assert needle.lower() in err.lower()


def test_bad_out_dir(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["profile", "--model", TINY, "--device", "cpu", "--out", str(f / "sub")]) == 2
    assert "cannot create output directory" in capsys.readouterr().err


def test_out_without_matplotlib_writes_json_csv_and_html(tmp_path, monkeypatch, capsys):
    """`pip install memlens` has no matplotlib: --out still writes result.json, CSV and report.html,
    and the result says the PNGs were skipped."""
    import memlens.report.plots as plots

    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    out = tmp_path / "prof"
    assert main(["profile", "--model", TINY, "--device", "cpu", "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["report.html", "result.json", "timeline.csv"]
    d = json.loads((out / "result.json").read_text())
    assert "matplotlib is not installed" in d["plots_skipped"]
    assert "<h1>memlens profile" in (out / "report.html").read_text()


def test_predicted_step_seconds_against_the_measured_by_part_and_host_range():
    """profile --compare-estimate's seconds: the host and recompute parts folded into forward/backward (as the GPU's
    phases hold them), each part's error, and where the step's measured seconds fall in its predicted host range."""
    from memlens.measure.runner import time_rows

    predicted = {"seconds": 0.30, "parts": {"forward": 0.08, "backward": 0.12, "recompute": 0.04, "host": 0.04,
                                            "optimizer": 0.02}, "host_range": {"host_ms": [14.2, 22.8], "seconds": [0.25, 0.32]}}
    measured = {"seconds": 0.26, "parts": {"forward": 0.09, "backward": 0.15, "optimizer": 0.02}}
    rows = {r["name"]: r for r in time_rows(predicted, measured)}
    # forward 0.08 + 0.04 x 0.08 / 0.24 host; backward 0.12 + 0.04 recompute + 0.04 x 0.16 / 0.24
    assert rows["forward"]["predicted_seconds"] == pytest.approx(0.08 + 0.04 / 3)
    assert rows["backward"]["predicted_seconds"] == pytest.approx(0.16 + 0.04 * 2 / 3)
    assert rows["step"]["error"] == pytest.approx(0.04 / 0.26, abs=1e-6)
    assert rows["step"]["predicted_range"] == [0.25, 0.32] and rows["step"]["inside_range"] is True
    assert time_rows({**predicted, "host_range": {"seconds": [0.27, 0.32]}}, measured)[0]["inside_range"] is False
    assert "predicted_range" not in time_rows({k: v for k, v in predicted.items() if k != "host_range"}, measured)[0]


def test_the_estimate_beside_a_profile_is_for_the_gpu_it_ran_on(monkeypatch):
    """profile --compare-estimate on an H200 prices the estimate with the H200's table (not the spec's default h100);
    on a GPU memlens does not know, the spec's GPU, said in the note."""
    from memlens.core.result import Result
    from memlens.core.spec import TrainingSpec
    from memlens.measure import runner

    seen = []

    def estimate(s):   # the GPU the estimate is asked for, then no estimate (the comparison is not what is tested)
        seen.append(s.gpu)
        raise runner.MemlensError("stop here")

    monkeypatch.setattr(runner, "estimate", estimate)
    spec = TrainingSpec(model=TINY, batch_size=2, seq_len=16)
    measured = Result(verb="profile", environment={"device_name": "NVIDIA H200"})
    assert runner._on_the_measured_gpu(spec, measured) == (spec.replace(gpu="h200"), "")
    assert runner.compare_with_estimate(spec, measured) == {"available": False, "reason": "stop here"} and seen == ["h200"]
    odd = Result(verb="profile", environment={"device_name": "Some Accelerator 9000"})
    s2, note = runner._on_the_measured_gpu(spec, odd)
    assert s2 is spec and note == ("The estimate is for the h100 (its memory rules and timing table): Some Accelerator 9000 "
                                   "is not among memlens' GPUs.")
    assert runner._on_the_measured_gpu(spec, Result(verb="profile")) == (spec, "")    # the CPU: no device name
