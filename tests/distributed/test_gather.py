"""Per-rank profiles gathered into one Result: the merge (no torchrun), and torchrun on the CPU (gloo)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from memlens.measure.gather import merge_profiles
from memlens.core.result import Result

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, peak: int, reserved: int, phase: str) -> Result:
    return Result(verb="profile", spec={"model": "m"}, peak_allocated_bytes=peak, peak_reserved_bytes=reserved,
                  by_category={"parameters": rank + 1}, by_phase={phase: {"peak_allocated_bytes": peak}},
                  timeline=[{"label": "start", "step": 1, "phase": "start", "allocated_bytes": 0, "reserved_bytes": 0,
                             "peak_allocated_bytes": 0}],
                  data={"rank": rank, "peak_phase": phase, "nvml": {"available": True, "process_used_bytes": 10 * peak}})


def test_merge_keeps_every_rank_and_puts_the_peak_rank_on_top():
    m = merge_profiles([_rank(1, 300, 400, "optimizer").to_dict(), _rank(0, 200, 500, "backward")])
    assert [r["rank"] for r in m.data["ranks"]] == [0, 1]
    assert (m.peak_allocated_bytes, m.peak_reserved_bytes, m.data["peak_rank"], m.data["peak_phase"]) == (300, 400, 1, "optimizer")
    assert m.by_category == {"parameters": 2}                          # the peak rank's breakdown
    assert m.data["rank_imbalance_bytes"] == 100 and m.data["world_size"] == 2
    assert m.data["job"] == {"gpus": 2, "peak_allocated_bytes_sum": 500, "peak_reserved_bytes_sum": 900,
                             "nvml_process_used_bytes_sum": 5000}
    assert "rank" not in m.data
    back = Result.from_dict(json.loads(m.to_json()))                    # survives JSON
    assert back.data["ranks"][1]["by_phase"] == {"optimizer": {"peak_allocated_bytes": 300}}


def test_report_has_a_lane_per_rank():
    from memlens.report.profile_report import report_html

    m = merge_profiles([_rank(0, 200, 500, "backward"), _rank(1, 300, 400, "optimizer")])
    html = report_html(m, pngs={})
    assert html.count("<polyline") == 2 and ">rank 0<" in html and ">rank 1<" in html and "Ranks (2" in html


USER_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    import memlens
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                                                          torch.nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64 * (rank + 1), 64)          # rank 1 has twice the batch
    with memlens.profile(model, opt, device="cpu") as prof:
        for _ in range(2):
            model(x).sum().backward(); opt.step(); opt.zero_grad()
    r = prof.result
    # one file per rank: the ranks' stdout lines can interleave in torchrun's pipe
    with open(sys.argv[1] + f"/rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "peak": r.peak_allocated_bytes, "data_rank": r.data.get("rank"),
                   "ranks": [[e["rank"], e["peak_allocated_bytes"]] for e in r.data.get("ranks", [])]}, f)
    dist.barrier()
    dist.destroy_process_group()
""")


def _torchrun_two_ranks(script, tmp_path):
    """torchrun with gloo on the CPU, each rank's output in its own log. One more launch only when a rank was killed by
    a signal with no Python error in its log (CI once saw rank 0 abort, SIGABRT, where 15 local runs passed): a Python
    error in the script fails at once."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for attempt in range(2):
        logs = tmp_path / f"logs{attempt}"
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            "--log-dir", str(logs), "--redirects", "3", str(script), str(tmp_path)],
                           capture_output=True, text=True, timeout=300, env=env)
        killed = any(f"({sig})" in p.stderr for sig in ("SIGABRT", "SIGSEGV", "SIGBUS"))
        if p.returncode == 0 or not killed or "Traceback" in _rank_logs(tmp_path):
            return p
    return p


def _rank_logs(tmp_path) -> str:
    """What the ranks wrote to stderr (torchrun's own summary names only the exit codes)."""
    return "\n".join(f"--- {f.relative_to(tmp_path)}\n{f.read_text()[-1500:]}"
                     for f in sorted(tmp_path.glob("logs*/**/stderr.log")) if f.read_text().strip())


@pytest.mark.slow
def test_memlens_profile_inside_a_users_torchrun_script_gathers_on_rank_0(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    p = _torchrun_two_ranks(script, tmp_path)
    assert p.returncode == 0, _rank_logs(tmp_path) or p.stderr[-2000:]
    out = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert out[1]["ranks"] == [] and out[1]["data_rank"] == 1          # the other ranks keep their own result
    peaks = dict(out[0]["ranks"])
    assert sorted(peaks) == [0, 1] and peaks[1] > peaks[0]               # rank 1's larger batch
    assert out[0]["peak"] == peaks[1] == out[1]["peak"]                  # rank 0's merged result: the rank that peaks


@pytest.mark.slow
def test_cli_profile_world_size_launches_torchrun_on_cpu(tmp_path, capsys, monkeypatch):
    """The CLI's main() in this process: it launches torchrun (two rank processes) as the command does."""
    from memlens.cli.main import main

    monkeypatch.setenv("PYTHONPATH", ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(ROOT)
    code = main(["profile", "--model", "tests.tiny_models:mlp", "--world-size", "2", "--sharding", "ddp", "--device", "cpu",
                 "--steps", "2", "--out", str(tmp_path / "p")])
    assert code == 0, capsys.readouterr().err[-2000:]
    d = json.loads((tmp_path / "p" / "result.json").read_text())
    assert [r["rank"] for r in d["ranks"]] == [0, 1] and d["world_size"] == 2
    assert d["peak_allocated_bytes"] == max(r["peak_allocated_bytes"] for r in d["ranks"])
    assert "DistributedDataParallel" in " ".join(d["applied"])
    assert (tmp_path / "p" / "report.html").read_text().count("<polyline") == 2
