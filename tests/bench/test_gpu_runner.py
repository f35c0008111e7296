"""bench/gpu_runner.py on a CPU: a case that raises, one killed by a signal, one past its timeout, resume after a
partial JSONL, and the table; each case is a trivial function in a fresh interpreter (tests/bench/runner_cases.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.gpu_runner import Case, read_jsonl, run_cases, runner_args, table

CASES = str(Path(__file__).resolve().parent / "runner_cases.py")
FN = CASES + ":by_name"


def _run(tmp_path, names, **kw):
    cases = [Case(n, {"n": i + 2, "out": str(tmp_path)}) for i, n in enumerate(names)]
    return run_cases(cases, kw.pop("fn", FN), out=tmp_path, jsonl="t.jsonl", quiet=True, env_file=False, **kw)


def _ran(tmp_path) -> list[str]:
    p = tmp_path / "ran.txt"
    return p.read_text().split() if p.exists() else []


def test_a_raising_case_is_its_own_line_and_the_next_case_still_runs(tmp_path):
    recs = _run(tmp_path, ["boom", "ok"])
    boom, ok = read_jsonl(tmp_path / "t.jsonl")
    assert boom["name"] == "boom" and boom["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB"
    assert "raise RuntimeError" in boom["traceback"] and boom["returncode"] == 3 and boom["oom"] is True
    assert ok == recs[1] and ok["max_allocated"] == 9 and ok["estimated_peak_allocated"] == 10 and "error" not in ok
    assert ok["dry"] is False and ok["returncode"] == 0


def test_a_case_killed_by_a_signal_or_past_its_timeout_gets_a_line_with_its_output(tmp_path):
    _run(tmp_path, ["killed", "hangs", "ok"], timeout=1.0)
    killed, hangs, ok = read_jsonl(tmp_path / "t.jsonl")
    assert killed["error"] == "killed by SIGKILL" and killed["stderr_tail"] == ["about to be killed"]
    assert killed["returncode"] == -9
    assert hangs["error"] == "timeout after 1 s (killed)" and hangs["seconds"] < 5
    assert ok["max_allocated"] == 16
    assert (tmp_path / "logs" / "t" / "killed.log").read_text() == "about to be killed\n"


def test_resume_skips_cases_done_and_reruns_errors_and_the_missing(tmp_path):
    partial = [{"name": "a", "max_allocated": 111}, {"name": "boom-b", "error": "killed by SIGKILL"}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in partial) + '{"name": "c", "max_al')
    recs = _run(tmp_path, ["a", "boom-b", "c"], fn=CASES + ":square")
    assert _ran(tmp_path) == ["boom-b", "c"]          # a was done; boom-b's last line was an error; c's line was torn
    assert [r["name"] for r in recs] == ["boom-b", "c"]
    assert [r["name"] for r in read_jsonl(tmp_path / "t.jsonl")] == ["a", "boom-b", "boom-b", "c"]
    assert _run(tmp_path, ["a", "boom-b", "c"], fn=CASES + ":square") == []   # all done now
    _run(tmp_path, ["a"], fn=CASES + ":square", fresh=True)
    assert [r["name"] for r in read_jsonl(tmp_path / "t.jsonl")] == ["a"]


def test_filters_dry_run_and_the_table_of_last_records(tmp_path, capsys):
    cases = [Case(n, {"n": 3, "out": str(tmp_path)}) for n in ("q3b-448", "gemma", "boom-x")]
    run_cases(cases, FN, out=tmp_path, jsonl="t.jsonl", filters=["q3b", "boom"], dry=True, env_file=False)
    assert _ran(tmp_path) == ["q3b-448", "boom-x"]
    printed = capsys.readouterr().out
    assert printed.endswith(
        "| case | real allocated GiB | real reserved GiB | memlens allocated GiB | off | memlens reserved GiB |\n"
        "|---|---:|---:|---:|---:|---:|\n"
        "| q3b-448 | 0.000 | - | 0.000 | +11.11% | - |\n"
        "| boom-x | ERROR RuntimeError: CUDA out of memory. Tried to allocate 3 GiB | | | | |\n")
    assert read_jsonl(tmp_path / "t_dry.jsonl")[0]["dry"] is True and not (tmp_path / "t.jsonl").exists()


def test_a_launcher_job_gathers_one_record_a_rank(tmp_path):
    launcher = [sys.executable, str(Path(__file__).resolve().parent / "fake_launcher.py"), "2"]
    (rec,) = _run(tmp_path, ["job"], fn=CASES + ":rank_record", launcher=launcher, meta=lambda c: {"spec": c.payload["n"]})
    assert rec["spec"] == 2 and list(rec)[:3] == ["name", "spec", "ranks"]
    assert rec["ranks"] == [{"rank": 0, "world": 2, "n": 2}, {"rank": 1, "world": 2, "n": 2}] and "error" not in rec


def test_a_launcher_job_past_its_timeout_leaves_no_rank_behind(tmp_path):
    """torchrun's ranks run in sessions of their own: killing the launcher's group alone would leave them hanging (on a
    GPU: spinning in NCCL, slowing every later case)."""
    import os
    import time

    launcher = [sys.executable, str(Path(__file__).resolve().parent / "fake_launcher.py"), "2"]
    (rec,) = _run(tmp_path, ["hangs"], launcher=launcher, timeout=3.0)
    assert rec["error"].startswith("timeout after 3 s")
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    time.sleep(0.2)
    for pid in pids:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, FileNotFoundError):
            continue
        assert state == "Z", f"rank {pid} still runs"     # a zombie waits for its reaper: it runs nothing


def test_the_shared_flags_keep_a_positional_out_dir_where_scripts_had_one():
    a = runner_args("x", out_positional=True).parse_args(["OUT", "q3b", "--dry-run"])
    assert (a.out, a.filters, a.dry_run, a.fresh) == ("OUT", ["q3b"], True, False)
    b = runner_args("x").parse_args(["q3b", "--timeout", "9"])
    assert b.filters == ["q3b"] and b.timeout == 9.0
    assert table([{"name": "n", "max_allocated": 2**30}], [("real", lambda r: r["max_allocated"] >> 30)]) == \
        "| case | real |\n|---|---:|\n| n | 1 |"


def test_jobs_run_cases_side_by_side_each_in_its_own_process(tmp_path):
    cases = [Case(n, {"sleep": 0.5}) for n in ("a", "b")]
    recs = run_cases(cases, CASES + ":span", out=tmp_path, jsonl="t.jsonl", jobs=2, quiet=True, env_file=False)
    a, b = sorted(recs, key=lambda r: r["name"])
    assert a["start"] < b["end"] and b["start"] < a["end"]          # the two processes overlapped
    assert sorted(r["name"] for r in read_jsonl(tmp_path / "t.jsonl")) == ["a", "b"]


def test_a_runner_stopped_by_sigterm_stops_its_running_case(tmp_path):
    """`timeout 400 python bench/gpu_x.py` sends SIGTERM to the runner; its case runs in a session of its own (so a
    timeout can kill a launcher's ranks), which that signal does not reach: the runner kills it before leaving."""
    import signal
    import subprocess
    import time

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
            "from bench.gpu_runner import Case, run_cases\n"
            f"run_cases([Case('hangs', {{'n': 1, 'out': {str(tmp_path)!r}}})], {FN!r}, out={str(tmp_path)!r}, "
            "jsonl='t.jsonl', quiet=True, env_file=False)\n")
    runner = subprocess.Popen([sys.executable, "-c", code])
    for _ in range(100):          # the case has started when it wrote ran.txt
        if _ran(tmp_path):
            break
        time.sleep(0.05)
    child = int((tmp_path / "pid").read_text())
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=10) == 128 + signal.SIGTERM
    for _ in range(40):            # killed (SIGKILL to its group), and reaped by the runner before it left
        if not Path(f"/proc/{child}").exists():
            break
        time.sleep(0.05)
    assert _ran(tmp_path) == ["hangs"] and not Path(f"/proc/{child}").exists()
