"""sweep: grid cells, resume (a torn results file, and a real kill -9 midway), OOM/crash/timeout cells, outputs, CLI."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from explore_support import GiB, N, fake_estimator

from memlens.cli.main import main
from memlens.core.errors import MemlensError
from memlens.explore.sweep import RESULTS, Grid, grid_cells, read_results, sweep
from memlens.report.sweep_text import write_csv
from memlens.report.sweep_plots import plot_sweep
from memlens.core.spec import TrainingSpec

SPEC = TrainingSpec(model="fake", seq_len=512)
ROOT = Path(__file__).resolve().parents[2]


def test_grid_cells_order_and_invalid_combinations():
    g = Grid(batch_sizes=[2, 8], physical_batch_sizes=[1, 4])
    cells = grid_cells(SPEC, g)
    assert [c.key for c in cells] == ["pb=1,b=2", "pb=1,b=8", "pb=4,b=2", "pb=4,b=8"]
    bad = cells[2]
    assert bad.spec is None and "max_physical_batch_size 4 > batch_size 2" in bad.skip
    assert cells[3].spec.dp and cells[3].spec.physical_batch_size == 4
    assert grid_cells(SPEC, Grid(lora_ranks=[8], techniques=["amp-bf16"]))[0].spec.lora_rank == 8


def test_estimated_sweep_values_budget_and_outputs(tmp_path):
    g = Grid(batch_sizes=[1, 4, 16], seq_lens=[512], techniques=["fp32", "checkpointing"])
    r = sweep(SPEC, g, out=tmp_path, budget_bytes=10 * GiB, estimator=fake_estimator())
    rows = {x["key"]: x for x in r.data["rows"]}
    assert rows["t=fp32,b=4,L=512"]["estimated_peak_allocated_bytes"] == 16 * N + 4 * GiB
    assert rows["t=fp32,b=16,L=512"]["status"] == "oom-estimated"
    assert rows["t=checkpointing,b=16,L=512"]["status"] == "ok"        # 4e9 + 16 x 256 MiB < 10 GiB
    assert len((tmp_path / RESULTS).read_text().splitlines()) == 6
    write_csv(r, tmp_path / "s.csv")
    lines = (tmp_path / "s.csv").read_text().splitlines()
    assert len(lines) == 7 and lines[0].startswith("key,technique,batch_size")
    names = {p.name for p in plot_sweep(r, tmp_path)}
    assert {"heatmap_technique=fp32.png", "heatmap_technique=checkpointing.png", "memory_vs_batch.png"} <= names


def test_resume_after_torn_write_redoes_nothing(tmp_path):
    g = Grid(batch_sizes=[1, 2, 3, 4])
    est = fake_estimator()
    sweep(SPEC, Grid(batch_sizes=[1, 2]), out=tmp_path, estimator=est)
    before = (tmp_path / RESULTS).read_text()
    with open(tmp_path / RESULTS, "a") as f:
        f.write('{"key": "b=3", "status": "o')          # killed mid-write
    with pytest.raises(MemlensError, match="already holds 2 finished cells") as e:
        sweep(SPEC, g, out=tmp_path, estimator=est)
    assert "--resume" in e.value.hint
    r = sweep(SPEC, g, out=tmp_path, resume=True, estimator=fake_estimator())
    assert [x["key"] for x in r.data["rows"]] == ["b=1", "b=2", "b=3", "b=4"]
    text = (tmp_path / RESULTS).read_text()
    assert text.startswith(before)                       # finished cells kept byte for byte
    assert [json.loads(ln)["key"] for ln in text.splitlines()] == ["b=1", "b=2", "b=3", "b=4"]
    # the same out dir with another grid is refused
    with pytest.raises(MemlensError, match="another grid"):
        sweep(SPEC, Grid(batch_sizes=[7]), out=tmp_path, resume=True, estimator=est)


def test_measured_cells_oom_crash_timeout_and_go_on(tmp_path):
    def runner(spec, **kw):
        b = spec.batch_size
        if b == 2:
            return {"status": "crash", "error": "Segmentation fault"}
        if b == 3:
            return {"status": "timeout", "error": "no result after 5 s"}
        if b >= 4:
            return {"status": "oom", "error": "CUDA out of memory"}
        return {"status": "ok", "peak_allocated_bytes": GiB, "seconds": 0.1, "timeline": [{"t": 0.0, "phase": "forward", "allocated_bytes": 1}]}

    r = sweep(SPEC, Grid(batch_sizes=[1, 2, 3, 4, 8]), out=tmp_path, measure=True, estimator=fake_estimator(), runner=runner)
    assert [x["status"] for x in r.data["rows"]] == ["ok", "crash", "timeout", "oom", "oom"]
    assert r.data["status_counts"] == {"ok": 1, "crash": 1, "timeout": 1, "oom": 2}


@pytest.mark.slow
def test_real_cpu_subprocess_cells_oom_marked(tmp_path):
    spec = TrainingSpec(model="explore_models:oom_over_4", seq_len=16)
    r = sweep(spec, Grid(batch_sizes=[4, 8]), out=tmp_path, measure=True, device="cpu", steps=1, timeout=120)
    assert [x["status"] for x in r.data["rows"]] == ["ok", "oom"]
    row = r.data["rows"][0]
    assert row["step_seconds"] > 0 and row["memory_measured"] is True   # the CPU ledger's tensor storages
    assert row["peak_allocated_bytes"] > 0 and row["timeline"]


@pytest.mark.slow
def test_kill_9_midway_then_resume_loses_nothing(tmp_path, capsys, monkeypatch):
    """A CPU sweep of 3 measured cells (fresh subprocess each) is killed with SIGKILL after its first
    cell; --resume finishes it, keeps the finished cells byte for byte and does not run them again. The killed sweep
    is a process of its own; the resume is `main(argv)` here (its cells still in subprocesses)."""
    out = tmp_path / "sw"
    argv = [sys.executable, "-m", "memlens.cli.main", "sweep", "--model", "explore_models:tiny", "--seq-len", "16",
            "--batch-sizes", "1,2,3", "--measure", "--device", "cpu", "--steps", "1", "--out", str(out)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(Path(__file__).parent)])
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    res = out / RESULTS
    t0 = time.time()
    while time.time() - t0 < 120:
        if res.exists() and len(res.read_text().splitlines()) >= 1:
            break
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)        # the sweep and its running trial
    p.wait()
    kept = res.read_text()
    n_kept = len([ln for ln in kept.splitlines() if ln.strip()])
    assert 1 <= n_kept < 3
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    capsys.readouterr()
    code = main(argv[3:] + ["--resume", "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr[-500:]
    final = res.read_text()
    assert final.startswith(kept)
    keys = [json.loads(ln)["key"] for ln in final.splitlines() if ln.strip()]
    assert sorted(keys) == ["b=1", "b=2", "b=3"] and len(keys) == 3      # nothing lost, nothing redone
    d = json.loads(stdout)
    assert [x["status"] for x in d["rows"]] == ["ok"] * 3
    assert (out / "sweep.csv").exists() and len((out / "sweep.csv").read_text().splitlines()) == 4


@pytest.mark.parametrize("argv,needle", [
    (["--batch-sizes", "1,x"], "not a whole number"),
    (["--batch-sizes", "0"], "not a whole number"),
    (["--seq-lens", ","], "no values"),
    ([], "grid is empty"),
    (["--batch-sizes", "2", "--physical-batch-sizes", "4"], "no valid cell"),
    (["--batch-sizes", "2", "--techniques", "warp"], "unknown technique"),
    (["--batch-sizes", "2", "--budget", "many"], "cannot read size 'many' (budget)"),
    (["--batch-sizes", "2", "--measure"], "CUDA"),
])
def test_cli_sweep_bad_input(tmp_path, capsys, argv, needle):
    rc = main(["sweep", "--model", "explore_models:tiny", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().count("\n") == 0 and needle in err, err


def test_cli_sweep_estimated_json(tmp_path, capsys):
    rc = main(["sweep", "--model", "explore_models:tiny", "--batch-sizes", "1", "4", "--seq-lens", "16,32", "--out", str(tmp_path), "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert [x["key"] for x in d["rows"]] == ["b=1,L=16", "b=4,L=16", "b=1,L=32", "b=4,L=32"]
    assert all(x["status"] == "ok" and x["estimated_peak_allocated_bytes"] > 0 for x in d["rows"])
    assert (tmp_path / "sweep.csv").exists() and (tmp_path / "memory_vs_batch.png").exists()
