"""`doctor log`: memory per step from training logs; leak verdict, growth, acceleration, projected OOM step."""
from __future__ import annotations

import json

import pytest
from doctor_support import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st

from memlens.cli.main import main
from memlens.doctor.log import analyze_memory, doctor_log, read_memory_log
from memlens.core.errors import MemlensError

GB, GIB, MIB = 10**9, 2**30, 2**20
SEED_LOG = (FIXTURES / "seed_exercise_9_8.log").read_text()


# ---------------------------------------------------------------- the seed's exercise 9.8

def test_seed_exercise_9_8_is_an_accelerating_leak_that_ooms_at_step_994():
    """The guide's exercise 9.8 log (tests/fixtures/doctor/seed_exercise_9_8.log, copied from seeds/003).

    Capacity the exercise implies: the run OOMs at step 1000 right after logging 24.2 GB at step 900,
    on the 24 GB card of the same chapter (exercise 9.2's message: "23.69 GiB total capacity", an
    RTX 3090/4090-class GPU). Read as memlens reads sizes, GB = 10**9 bytes, 24.2 GB = 22.54 GiB fits
    under 23.69 GiB (read as GiB, 24.2 could not have fitted on any 24 GB card).

    Expected step: the growth per 100 steps is 0.3, 0.4, 0.5, 0.7, 0.8, 0.9, 1.1, 1.3 GB (the guide's
    "3.0 ... 13.0 MB per step"): rising, so the least-squares parabola through the 9 readings is the
    trend: m(s) = 18.1119048e9 + 457792.208 s + 6958.874 s^2 bytes. It reaches 23.69 GiB
    (25436943811 bytes) at s = 993.61, so the first whole step at or above capacity is 994: between
    the last reading (900) and the OOM the log shows at step 1000. With 24 GiB it would be 1017.
    """
    r = doctor_log(SEED_LOG, capacity_bytes=25436943811)
    d = r.data
    assert d["verdict"] == "leak" and d["pattern"] == "accelerating" and d["accelerating"] is True
    assert d["projected_oom_step"] == 994 and d["steps_to_oom"] == 94
    assert d["oom_observed_at"] == 1000
    assert d["growth_bytes_per_step"] == 7416667  # straight line: 0.0074167 GB/step
    assert [round(g["bytes_per_step"]) for g in d["interval_growth"]] == [
        3_000_000, 4_000_000, 5_000_000, 7_000_000, 8_000_000, 9_000_000, 11_000_000, 13_000_000]
    c0, c1, c2 = d["trend_coefficients"]
    assert c0 == pytest.approx(18.1119048e9, rel=1e-7) and c1 == pytest.approx(457792.208, rel=1e-6)
    assert c2 == pytest.approx(6958.874459, rel=1e-6)
    assert d["current_growth_bytes_per_step"] == round(c1 + 2 * c2 * 900)
    assert d["first_bytes"] == 18_200_000_000 and d["last_bytes"] == 24_200_000_000
    assert "autograd graph" in d["causes"][0]
    assert doctor_log(SEED_LOG, capacity_bytes=24 * GIB).data["projected_oom_step"] == 1017


def test_flat_log_is_steady():
    flat = "\n".join(f"Step {s}: Loss={2.5 - s / 1000:.2f}, Memory={18.2 + (0.1 if s % 200 else 0):.1f}GB" for s in range(100, 1001, 100))
    d = doctor_log(flat, capacity_bytes=24 * GIB).data
    assert d["verdict"] == "steady" and d["pattern"] == "steady"
    assert d["projected_oom_step"] is None and d["accelerating"] is False


def test_linear_leak_projects_with_a_straight_line():
    log = "\n".join(f"iter {i} | mem {1000 + 5 * i} MiB" for i in range(50))
    d = doctor_log(log, capacity_bytes=2 * GIB).data
    # 1000 + 5 i MiB = 2048 MiB at i = 209.6 -> step 210
    assert (d["verdict"], d["pattern"], d["accelerating"]) == ("leak", "linear", False)
    assert d["growth_bytes_per_step"] == 5 * MIB and d["projected_oom_step"] == 210 and d["steps_to_oom"] == 161
    assert "losses.append(loss)" in d["causes"][0]


def test_warmup_jump_then_flat_is_steady():
    values = [2.0] + [9.0, 9.0, 9.01, 9.0, 9.0, 9.01, 9.0, 9.0, 9.0]
    log = "\n".join(f"step={i} allocated={v}GiB" for i, v in enumerate(values))
    r = doctor_log(log, capacity_bytes=10 * GIB)
    assert r.data["verdict"] == "steady" and r.data["warmup_readings_skipped"] == 1
    assert "skipped 1 warm-up reading(s) before step 1" in r.notes


def test_stepwise_growth():
    values = [10.0] * 5 + [11.0] * 5 + [12.0] * 5 + [13.0] * 5
    log = "\n".join(f"step {i * 10}: reserved {v} GiB" for i, v in enumerate(values))
    d = doctor_log(log).data
    assert d["verdict"] == "leak" and d["pattern"] == "stepwise"
    assert "larger shape" in d["causes"][0]


def test_already_at_capacity():
    log = "\n".join(f"step {i}: memory {10 + i} GiB" for i in range(5))
    r = doctor_log(log, capacity_bytes=12 * GIB)
    assert r.data["projected_oom_step"] == 4 and r.data["steps_to_oom"] == 0
    assert any("already at the capacity" in n for n in r.notes)


# ---------------------------------------------------------------- formats

def test_hugging_face_trainer_state_json():
    hist = [{"epoch": 0.1 * i, "loss": 2.0, "step": 10 * i, "memory_allocated_gb": 10 + 0.5 * i} for i in range(1, 9)]
    hist.append({"epoch": 1.0, "step": 90, "train_runtime": 100.0})
    s = read_memory_log(json.dumps({"best_metric": None, "log_history": hist}))
    assert s.source_format == "trainer_state" and s.key == "memory_allocated_gb"
    assert s.x == [10.0 * i for i in range(1, 9)] and s.bytes[0] == 10_500_000_000
    a = analyze_memory(s, capacity_bytes=20 * GB)
    assert a.verdict == "leak" and a.projected_oom_step == 200  # 10 GB + 0.05 GB/step reaches 20 GB at step 200


def test_hugging_face_dict_lines_without_steps():
    lines = "\n".join("{'loss': %.2f, 'grad_norm': 0.5, 'learning_rate': 1e-05, 'epoch': %.1f, 'gpu_mem_mib': %d}"
                      % (2 - i / 10, i / 10, 8000 + 100 * i) for i in range(6))
    s = read_memory_log("***** Running training *****\n" + lines)
    assert s.key == "gpu_mem_mib" and s.x == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert s.bytes[:2] == [8000 * MIB, 8100 * MIB]
    assert "no step numbers" in s.notes[0]


def test_jsonl():
    text = "\n".join(json.dumps({"global_step": i, "max_memory_allocated_bytes": 10**9 + i * 10**6}) for i in range(5))
    s = read_memory_log(text)
    assert s.source_format == "jsonl" and s.bytes == [10**9 + i * 10**6 for i in range(5)]


def test_lightning_metrics_csv_with_device_stats():
    rows = ["epoch,step,train_loss,DeviceStatsMonitor.on_train_batch_end/allocated_bytes.all.current"]
    for i in range(1, 7):
        rows.append(f"0,{i * 50},{2 - i / 10},")
        rows.append(f"0,{i * 50},,{4 * GIB + i * 64 * MIB}")
    s = read_memory_log("\n".join(rows))
    assert s.source_format == "csv" and s.x == [50.0 * i for i in range(1, 7)]
    assert s.bytes[-1] == 4 * GIB + 6 * 64 * MIB


def test_lightning_progress_bar_across_epochs():
    bar = "Epoch {e}:  {p}%|####      | {i}/100 [00:10<00:20,  5.38it/s, v_num=0, train_loss=1.98, gpu_mem={m}]"
    text = "\r".join(bar.format(e=e, p=i, i=i, m=10 + e + i / 100) for e in range(2) for i in (25, 50, 75, 100))
    s = read_memory_log(text, unit="GiB")
    assert s.x == [25.0, 50.0, 75.0, 100.0, 125.0, 150.0, 175.0, 200.0]
    assert s.bytes[0] == round(10.25 * GIB)


def test_memlens_watch_csv_reads_gpu_rows_only():
    rows = ["time_s,gpu,name,pid,process,memory_used_bytes,memory_total_bytes,memory_free_bytes"]
    for t in range(6):
        rows.append(f"{t}.0,0,H100,,,{10 * GIB + t * GIB},{80 * GIB},{70 * GIB - t * GIB}")
        rows.append(f"{t}.0,0,H100,123,python,{9 * GIB},{80 * GIB},")
        rows.append(f"{t}.0,1,H100,,,{GIB},{80 * GIB},{79 * GIB}")
    r = doctor_log("\n".join(rows), capacity_bytes=80 * GIB)
    d = r.data
    assert d["x_axis"] == "time_s" and d["memory_key"] == "memory_used_bytes"
    assert d["growth_bytes_per_step"] == GIB and d["projected_oom_step"] == 70  # 10 + t GiB = 80 GiB at t = 70 s
    assert "GPU 0 analysed" in r.notes
    assert doctor_log("\n".join(rows), gpu=1).data["verdict"] == "steady"


def test_unitless_values_are_guessed_and_noted():
    s = read_memory_log("step 1 mem 18.2\nstep 2 mem 18.4\nstep 3 mem 18.6")
    assert s.bytes[0] == round(18.2 * GIB) and "read as GiB" in s.notes[0]
    assert read_memory_log("step 1 mem 18.2\nstep 2 mem 18.4\nstep 3 mem 18.6", unit="GB").bytes[0] == 18_200_000_000


# ---------------------------------------------------------------- CLI and bad input

def test_cli_json_and_plot(tmp_path, capsys):
    f = tmp_path / "train.log"
    f.write_text(SEED_LOG)
    assert main(["doctor", "log", str(f), "--capacity", "23.69GiB", "--json", "--out", str(tmp_path / "o")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verb"] == "doctor.log" and d["verdict"] == "leak" and d["projected_oom_step"] == 994
    assert (tmp_path / "o" / "log.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "o" / "result.json").read_text())["accelerating"] is True


def test_cli_table(tmp_path, capsys):
    f = tmp_path / "train.log"
    f.write_text(SEED_LOG)
    assert main(["doctor", "log", str(f), "--capacity", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "LEAK (accelerating)" in out and "1017" in out and "Likely causes" in out


@pytest.mark.parametrize("content,argv_extra,message", [
    ("", [], "ERROR: the log is empty"),
    ("epoch 1 loss 2.3\nepoch 2 loss 2.1\n", [], "ERROR: found 0 memory reading(s) in the log; at least 3 are needed"),
    ("step 1 mem 1GB\nstep 2 mem 2GB\n", [], "ERROR: found 2 memory reading(s)"),
    ("step 1 mem 1GB\nstep 2 mem 2GB\nstep 3 mem 3GB\n", ["--capacity", "lots"], "ERROR: cannot read size 'lots'"),
    ("step 1 mem 1GB\nstep 2 mem 2GB\nstep 3 mem 3GB\n", ["--unit", "furlongs"], "ERROR: unknown unit 'furlongs'"),
    ("step 1 mem 1GB\nstep 2 mem 2GB\nstep 3 mem 3GB\n", ["--capacity", "0"], "ERROR: --capacity is 0"),
])
def test_bad_logs_one_line_exit_2(tmp_path, capsys, content, argv_extra, message):
    f = tmp_path / "x.log"
    f.write_text(content)
    assert main(["doctor", "log", str(f), *argv_extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "HINT:" in err and err.count("\n") == 1


def test_missing_and_directory(tmp_path, capsys):
    assert main(["doctor", "log", str(tmp_path / "nope.log")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["doctor", "log", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_binary_file(tmp_path, capsys):
    f = tmp_path / "x.bin"
    f.write_bytes(bytes(range(256)) * 10)
    assert main(["doctor", "log", str(f)]) == 2
    assert capsys.readouterr().err.startswith("ERROR: found 0 memory reading(s)")


# ---------------------------------------------------------------- fuzzing

def _only_memlens_errors(text, capacity=None):
    try:
        r = doctor_log(text, capacity_bytes=capacity)
    except MemlensError as e:
        assert e.message and e.hint
        return
    assert r.data["verdict"] in ("leak", "falling", "steady")
    json.dumps(r.to_dict())


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_fuzz_any_text(text):
    _only_memlens_errors(text)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.integers(-5, 10**7), min_size=0, max_size=40),
       values=st.lists(st.floats(), min_size=0, max_size=40),
       unit=st.sampled_from(["GB", "GiB", "MiB", "bytes", "", "KB", "TB"]), capacity=st.one_of(st.none(), st.integers(1, 2**50)))
def test_fuzz_numeric_series(steps, values, unit, capacity):
    text = "\n".join(f"Step {s}: Loss=1.0, Memory={v}{unit}" for s, v in zip(steps, values))
    _only_memlens_errors(text, capacity)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([
    "{", "}", "[", "]", '"log_history"', ":", ",", '"step"', '"memory"', "1", "2.5", "null", '"x"', "step,memory", "\n",
    "time_s,memory_used_bytes", "-1", "1e999", "NaN", "gpu", "pid",
]), max_size=60))
def test_fuzz_structured_fragments(pieces):
    _only_memlens_errors("".join(pieces))
