"""Every bench/gpu_*.py script that runs cases runs them through bench/gpu_runner.py (issue 35: no copied runner);
the scripts left out are single-case probes or drive memlens' own measured verbs, each named here with why."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
NOT_CASE_RUNNERS = {   # script: why it has no loop of cases for the runner
    "gpu_bert_eager_probe.py": "one case per command, in its own process",
    "gpu_fp16_steps.py": "one case per command, in its own process",
    "gpu_peak_probe.py": "one case per command, in its own process",
    "gpu_history_case.py": "one case per command, in its own process",
    "gpu_t5_sdpa_probe.py": "one case per command, in its own process",
    "gpu_tied_sum_probe.py": "one case per command, in its own process (an allocator trace of one step)",
    "gpu_sdpa_probe.py": "one process of microbenchmarks (kernel choice per dtype), no model step",
    "gpu_calibrate.py": "one process of microbenchmarks: the CUDA context and workspaces it reads need that one process",
    "gpu_compare.py": "memlens.compare(measure=True): the library's own trial runner (memlens.measure.trial)",
    "gpu_sweep.py": "memlens.sweep(measure=True): the library's own trial runner",
    "gpu_budget_rule.py": "memlens.sweep(measure=True): the library's own trial runner",
    "gpu_depthwise_probe.py": "one process of microbenchmarks (a depthwise convolution by layout) and one model's hooks",
    "gpu_softmax_rows.py": "one process of microbenchmarks (the softmax ops by row width), no model step",
    "gpu_host_probe.py": "times the host's seconds of a few loops on one GPU in one process (no cases, no subprocesses)",
    "gpu_overlap_pattern_probe.py": "one microbenchmark over every GPU (a process per GPU, one NCCL group), no model step",
    "gpu_ranks_calibrate.py": "one measurement over every GPU (memlens.measure.calibrate_nccl spawns a process per GPU), no cases",
    "gpu_qlora_calibrate.py": "one measurement of host costs on one GPU in one process, no cases",
    "gpu_unaligned_probe.py": "re-measures calibrate's unaligned GEMM grids and the GPT-2 head's rates in one process",
    "gpu_opacus_sweep.py": "kills and resumes `memlens sweep --measure` itself (the test is the sweep's own resume)",
    "gpu_ckpt_probe.py": "times tiny models' host work in interleaved rounds in one process (as calibrate does)",
    "gpu_ckpt_sync_probe.py": "one profiled forward per variant of gpu_ckpt_probe's models in one process, no cases",
    "gpu_ckpt_parts.py": "times tiny models' host work under checkpoint's variants in interleaved rounds in one process",
    "gpu_host_size_probe.py": "times real models' host work at several sizes in interleaved rounds in one process",
    "gpu_dp_probe.py": "runs calibrate's own host measurements in one process",
    "gpu_bandwidth_probe.py": "copy and memory-bound op microbenchmarks (warm and cold L2) in one process, no model step",
    "gpu_op_ratios.py": "runs calibrate's own op-ratio microbenchmarks in one process, no model step",
    "gpu_matmul_grid.py": "runs calibrate's own GEMM grid measurements in one process, no model step",
    "gpu_forward_gaps.py": "marks real steps of a few models in one process (CUDA events beside the host's clock)",
    "gpu_gemm_heat_probe.py": "GEMM microbenchmarks (inputs' scale, copies between) in one process, no model step",
    "gpu_gemm_probe.py": "GEMM microbenchmarks of a profile's shapes (layouts, warm and cold L2) in one process, no model step",
}


def test_every_gpu_script_with_cases_uses_the_one_runner():
    scripts = sorted(p.name for p in BENCH.glob("gpu_*.py") if p.name != "gpu_runner.py")
    assert set(NOT_CASE_RUNNERS) <= set(scripts), sorted(set(NOT_CASE_RUNNERS) - set(scripts))
    for name in scripts:
        text = (BENCH / name).read_text()
        uses = "from bench.gpu_runner import" in text
        copied = re.search(r"subprocess\.(run|Popen)\(\[sys\.executable, (os\.path\.abspath\()?__file__\)?, [^\]]*--child", text)
        if name in NOT_CASE_RUNNERS:
            assert not uses, f"{name} uses the runner now: take it out of NOT_CASE_RUNNERS"
        else:
            assert uses and not copied, f"{name}: run its cases through bench/gpu_runner.py"


def test_step_time_rounds_combine_to_the_median_of_the_rounds_that_measured():
    from bench.gpu_step_time import combined

    def rnd(s, fwd, host, **kw):
        return {"measured_seconds": s, "measured_phases": {"forward": fwd, "backward": 2 * fwd}, "host_speed_ms": host, **kw}

    first = rnd(0.0675, 0.018, 13.2, profile={"ops": []})
    got = combined([first, rnd(0.0998, 0.031, 21.3), {"measure_error": "OOM: x"}, rnd(0.0800, 0.024, 17.0)])
    assert got["measured_seconds"] == 0.0800 and got["host_speed_ms"] == 17.0
    assert got["measured_phases"] == {"backward": 0.048, "forward": 0.024}
    assert got["profile"] == {"ops": []}                     # the first round's profile
    assert [r["seconds"] for r in got["measured_rounds"]] == [0.0675, 0.0998, None, 0.0800]
    assert got["measured_rounds"][2]["measure_error"] == "OOM: x"
    assert combined([first]) is first                         # one round: as measured
    assert combined([{"measure_error": "a"}, {"measure_error": "b"}]) == {"measure_error": "a"}


def test_step_time_host_speed_scales_by_the_dispatch_probe_beside_a_record(tmp_path):
    import json

    from bench.gpu_step_time import combined, dispatch_ratio, host_scaled_table

    table = {"host_us": {"model_forward": 10.0, "model_backward": 20.0, "view": 1.0, "ckpt_layer_forward": 900.0},
             "env": {"host_speed_ms": [12.0, 20.0, 24.0], "host_reference_ms": 20.77}, "source": "t"}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    # 100 + 200 kernel ops at 10 / 20 us, 150 views at 1 us: 5.15 ms at the table's host; the probe took 10.3
    probe = {"forward_s": 0.0042, "backward_s": 0.0061, "forward_ops": {"kernel": 100, "view": 50},
             "backward_ops": {"kernel": 200, "view": 100}}
    assert dispatch_ratio(table, probe) == pytest.approx(2.0)
    scaled = json.loads(open(host_scaled_table(str(path), {"name": "c", "dispatch": probe, "host_speed_ms": 5.0},
                                               str(tmp_path), 0)).read())
    assert scaled["host_us"] == {"model_forward": 20.0, "model_backward": 40.0, "view": 2.0, "ckpt_layer_forward": 1800.0}
    assert "host_reference_ms" not in scaled["env"]           # priced at this record's host, not the reference
    # no probe: the fixed loop's speed over calibrate's median (5 / 20)
    loop = json.loads(open(host_scaled_table(str(path), {"name": "c", "host_speed_ms": 5.0}, str(tmp_path), 1)).read())
    assert loop["host_us"]["model_forward"] == 2.5
    assert dispatch_ratio({"host_us": {}}, probe) is None
    # rounds: the round of the median probe stands for the case
    slow, mid, fast = ({**probe, "forward_s": f} for f in (0.009, 0.005, 0.001))
    got = combined([{"measured_seconds": s, "dispatch": d} for s, d in ((0.1, slow), (0.2, fast), (0.3, mid))])
    assert got["dispatch"] is mid and [r["dispatch"] for r in got["measured_rounds"]] == [slow, fast, mid]


def test_overhead_pairs_measure_both_steps_in_one_process_and_price_the_ratio():
    """bench/gpu_overhead.py: the pairs are CASES' techniques beside their bases; a pair's two steps run in alternating
    rounds (on this CPU, tiny sizes); the predicted overhead is the ratio of the two step times, the table's difference
    in percentage points."""
    from bench.gpu_overhead import markdown, measure_pair, pairs, predicted_overhead

    p = pairs()
    assert p["llama1b-ckpt-full"]["base_name"] == "llama1b-bf16" and "llama1b-bf16" not in p
    assert all(not v["variant"].get("needs") for v in p.values())          # QLoRA / DP-SGD need wheels: not paired
    tiny = {"model": "tests/fixtures/models/tiny-gpt2", "batch_size": 1, "seq_len": 16}
    rec = measure_pair("x", {"base": tiny, "variant": {**tiny, "grad_accum": 2}, "rounds": 2, "steps": 1})
    assert [sorted(r) for r in rec["rounds"]] == [["base_s", "host_speed_ms", "overhead", "variant_s"]] * 2
    assert rec["measured_overhead"] == pytest.approx(rec["variant_seconds"] / rec["base_seconds"] - 1)
    assert predicted_overhead({"predicted_seconds": 0.1}, {"predicted_seconds": 0.125, "predicted_table": "t"}) == {
        "predicted_base_seconds": 0.1, "predicted_variant_seconds": 0.125, "predicted_overhead": pytest.approx(0.25),
        "predicted_table": "t"}
    assert predicted_overhead({"predict_error": "boom"}, {}) == {"predict_error": "boom"}
    row = {"name": "v", "base_name": "b", "base_seconds": 0.1, "variant_seconds": 0.13, "measured_overhead": 0.3,
           "predicted_overhead": 0.25, "rounds": [{"overhead": 0.28}, {"overhead": 0.32}]}
    md = markdown([row])
    assert "| v (vs b) | 0.1000 / 0.1300 | +30.0% (+28.0% .. +32.0%) | +25.0% | -5.0 pp |" in md
    assert "1 pairs; |difference| median 5.0 pp, max 5.0 pp, 0 within 3 pp" in md


def test_overhead_pairs_reprice_at_the_pairs_own_host(tmp_path):
    """bench/gpu_overhead.py --reprice --host-speed: a pair's table has every host cost times the median of its rounds'
    host speeds over the table's calibration speed (its env's median); a record without speeds keeps the table."""
    import json

    from bench.gpu_overhead import pair_table

    table = tmp_path / "t.json"
    table.write_text(json.dumps({"host_us": {"forward": 10.0, "ckpt_layer_forward": 900.0},
                                 "env": {"host_speed_ms": [15.0, 20.0, 25.0], "host_reference_ms": 20.77}, "source": "s"}))
    rec = {"name": "p", "rounds": [{"host_speed_ms": 12.0}, {"host_speed_ms": 10.0}, {"host_speed_ms": 30.0}]}
    t = json.loads(open(pair_table(str(table), rec, str(tmp_path), 3)).read())
    assert t["host_us"] == {"forward": 6.0, "ckpt_layer_forward": 540.0}       # x 12 / 20
    assert "host_reference_ms" not in t["env"] and t["source"].startswith("s; host costs x 0.600")
    assert pair_table(str(table), {"name": "p", "rounds": [{"overhead": 0.1}]}, str(tmp_path), 4) is None


def test_host_range_reads_each_measured_round_once_and_checks_steps_against_their_range(tmp_path):
    """bench/host_range.py: a round's host speed where a record keeps rounds, a record's own else, a calibrate
    table's median; a record met in two files once; repriced copies left out. --check: a step inside its predicted
    range, or how far outside."""
    import json

    from bench.host_range import coverage, samples

    a, b, c = tmp_path / "gpu_overhead.jsonl", tmp_path / "runs.jsonl", tmp_path / "gpu_step_time_repriced.jsonl"
    rec = {"name": "x", "device": "NVIDIA H100 80GB HBM3", "host_speed_ms": 14.0}
    a.write_text(json.dumps({"name": "p", "device": "NVIDIA H200", "rounds": [{"host_speed_ms": 12.0}, {"host_speed_ms": 20.0}]})
                 + "\n" + json.dumps(rec) + "\n")
    b.write_text(json.dumps(rec) + "\n" + json.dumps({"device": "NVIDIA H100", "host_speed_ms": [10.0, 18.0, 30.0]}) + "\n")
    c.write_text(json.dumps({**rec, "host_speed_ms": 99.0}) + "\n")
    got = samples([str(a), str(b), str(c)])
    assert sorted(x for x, _ in got["h200"]) == [12.0, 20.0] and sorted(x for x, _ in got["h100"]) == [14.0, 18.0]
    steps = tmp_path / "priced.jsonl"
    steps.write_text("\n".join(json.dumps(r) for r in [
        {"name": "in", "measured_seconds": 0.10, "predicted_seconds": 0.11, "predicted_host_range": [0.09, 0.12]},
        {"name": "out", "measured_seconds": 0.10, "predicted_seconds": 0.13, "predicted_host_range": [0.12, 0.14]},
        {"name": "unpriced", "measured_seconds": 0.10, "predicted_seconds": None}]) + "\n")
    rows, summary = coverage(str(steps))
    assert summary == {"steps": 2, "inside": 1, "within_10pct_of_range": 1, "median_outside_pct": 20.0}
    assert rows[1] == "| out | 0.1000 | 0.1300 (+30.0%) | 0.1200 - 0.1400 | 20.0% outside |"


def test_a_step_time_case_is_priced_for_the_gpu_its_table_was_measured_on(tmp_path):
    from bench.gpu_step_time import spec_of

    table = tmp_path / "t.json"
    table.write_text(json.dumps({"gpu": "h200"}))
    assert spec_of({"model": "gpt2", "batch_size": 2}, table=str(table)).gpu == "h200"
    assert spec_of({"model": "gpt2", "batch_size": 2, "gpu": "a100-80gb"}, table=str(table)).gpu == "a100-80gb"
    assert spec_of({"model": "gpt2", "batch_size": 2}).gpu == "h100"       # no table: the spec's default
