"""The one GPU case runner of bench/: every case in its own subprocess, one JSON line a case, resumable.

A GPU script names its cases and one case function; the runner does the rest:

    from bench.gpu_runner import Case, run_cases, runner_args

    CASES = [Case("q3b-lora-448", {"model": "qwen2.5-vl-3b", ...}), ...]

    def measure(name: str, payload, dry: bool) -> dict:   # runs in the case's own subprocess
        ...                                                  # (imports torch, builds, steps, estimates)
        return {"max_allocated": ..., "estimated_peak_allocated": ...}

    def main(argv=None):
        a = runner_args("gpu_vlm.py: ...").parse_args(argv)   # filters, --dry-run, --fresh, --timeout, --out
        run_cases(CASES, measure, out=a.out, jsonl="gpu_vlm.jsonl", filters=a.filters, dry=a.dry_run, ...)

What it guarantees:
- each case runs in a fresh interpreter (``python -m bench.gpu_runner --child REQUEST``; its own caching allocator and
  cuBLAS handles): an OOM, a crash, a segfault or a hang loses that case only. The case function's exception becomes
  the case's line (``error`` = "Type: message", ``traceback``); a child killed by a signal, that exits without a
  record, or that runs past ``timeout`` seconds (its whole process group is killed) also gets a line, with the last
  lines of its stderr. Each child's stdout and stderr are kept in OUT/logs/<jsonl stem>/<case>.log.
- lines are appended to OUT/<jsonl> as each case finishes (a later crash of the runner loses nothing);
- resume: a case that already has a line without ``error`` in the JSONL is skipped (``fresh=True`` starts the file
  over); a case whose last line is an error runs again, and the table reads each case's last line;
- ``launcher``: a command prefix instead of ``python`` (e.g. torchrun's ``-m torch.distributed.run --standalone
  --nproc-per-node 2``): each rank runs the case function and writes its own record; the case's line then holds
  ``ranks`` (sorted by RANK), and an ``error`` if a rank failed or is missing;
- ``--dry-run`` is handed to the case function (tiny sizes, estimates only) so the whole path runs on a CPU; its
  lines go to OUT/<jsonl stem>_dry.jsonl (a dry run never makes a real run skip a case);
- ``jobs=N``: N cases at once, each its own process (allocator statistics are per process, so small cases may share
  one GPU); ``meta(case)``: fields the runner adds to the case's line (e.g. its spec beside a launcher's ranks);
- a runner stopped by SIGTERM (``timeout``), SIGHUP or Ctrl-C kills the cases it is running before it leaves;
- before a real run the versions and the device go to OUT/<jsonl stem>_env.json (from a subprocess: the runner
  never creates a CUDA context); a markdown table of every case's last line is printed at the end (``columns``).

Record keys the runner writes: ``name``, ``seconds`` (wall time of the subprocess), ``returncode``, and on failure
``error`` (+ ``oom``: the exception was CUDA's out-of-memory; ``traceback`` / ``stderr_tail``). The case function's
dict is merged in (its own ``name`` is ignored).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:   # a torchrun rank runs this file by path
    sys.path.insert(0, str(ROOT))

DEFAULT_TIMEOUT = 300.0
TAIL_LINES = 6


@dataclass(frozen=True)
class Case:
    """One case: its name (the JSONL key, what filters match) and a JSON-serializable payload for the case function."""

    name: str
    payload: Any = None
    timeout: float | None = None    # overrides the run's per-case timeout
    env: dict = field(default_factory=dict)   # extra environment of this case's subprocess


def as_cases(items: Iterable) -> list[Case]:
    """Cases from Case objects, (name, payload) pairs or bare names."""
    out = []
    for it in items:
        if isinstance(it, Case):
            out.append(it)
        elif isinstance(it, str):
            out.append(Case(it))
        else:
            out.append(Case(it[0], it[1] if len(it) > 1 else None))
    return out


# ---- the parent: run, resume, record -----------------------------------------------------------------------------

def read_jsonl(path: Path | str) -> list[dict]:
    """The records of a JSONL file (a torn last line, from a runner killed mid-write, is skipped)."""
    p = Path(path)
    if not p.exists():
        return []
    recs = []
    for line in p.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return recs


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line that a killed runner left half-written (the next line would be appended onto it)."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[:data.rfind(b"\n") + 1])


def last_records(recs: Iterable[dict]) -> dict[str, dict]:
    """Each case's last record, in the order the cases first appeared."""
    out: dict[str, dict] = {}
    for r in recs:
        out[r.get("name", "?")] = r
    return out


def done_names(path: Path | str) -> set[str]:
    """Cases whose last line in the JSONL is not an error (what resume skips)."""
    return {n for n, r in last_records(read_jsonl(path)).items() if "error" not in r}


def fn_ref(fn: Callable | str) -> str:
    """'module:qualname' (or '/path/file.py:qualname' for a script run as __main__ outside the repo)."""
    if isinstance(fn, str):
        return fn
    mod = fn.__module__
    if mod == "__main__":
        path = Path(sys.modules["__main__"].__file__).resolve()
        try:
            rel = path.relative_to(ROOT).with_suffix("")
            mod = ".".join(rel.parts)
        except ValueError:
            mod = str(path)
    return f"{mod}:{fn.__qualname__}"


def _child_env(case: Case, extra: dict | None) -> dict:
    env = dict(os.environ, **(extra or {}), **case.env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in paths if p != str(ROOT)])
    return env


def _tail(log: Path) -> list[str]:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return []
    return lines[-TAIL_LINES:]


def _why(rc: int | None, timed_out: float | None) -> str:
    if timed_out is not None:
        return f"timeout after {timed_out:.0f} s (killed)"
    if rc is not None and rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit {rc} without a record"


def _gather(work: Path, rc: int | None, timed_out: float | None, log: Path, launcher: bool) -> dict:
    """The case's record from what its process(es) wrote, or an error saying why there is none."""
    files = sorted(work.glob("result*.json"), key=lambda f: int(f.stem[len("result"):] or 0))
    recs = [json.loads(f.read_text()) for f in files]
    if not launcher:
        rec = recs[0] if recs else {}
    else:
        rec = {"ranks": recs}
        bad = [r for r in recs if "error" in r]
        if bad:
            rec["error"] = f"rank {bad[0].get('rank', '?')}: {bad[0]['error']}"
    if timed_out is not None or not recs or (rc != 0 and "error" not in rec):
        rec["error"] = _why(rc, timed_out)
        rec["stderr_tail"] = _tail(log)
    return rec


def run_one(case: Case, fn: Callable | str, *, out: Path, logs: Path, dry: bool, timeout: float,
            launcher: Sequence[str] | None = None, env: dict | None = None) -> dict:
    """Run one case in its own subprocess (or launcher job) and return its record (never raises for the case)."""
    work = Path(tempfile.mkdtemp(prefix="memlens-case-"))
    req = work / "request.json"
    req.write_text(json.dumps({"fn": fn_ref(fn), "name": case.name, "payload": case.payload, "dry": dry,
                               "out": str(out), "result": str(work / "result.json")}))
    if launcher:
        cmd = [*launcher, str(Path(__file__).resolve()), "--child", str(req)]
    else:
        cmd = [sys.executable, "-m", "bench.gpu_runner", "--child", str(req)]
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{_safe(case.name)}.log"
    t0 = time.time()
    timed_out = None
    with open(log, "w") as lf:
        # its own session, so that a timeout kills the whole case (a launcher's ranks too); _RUNNING lets a runner
        # that is stopped (SIGTERM from `timeout`, Ctrl-C) stop its cases, which its signals no longer reach
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, cwd=ROOT, env=_child_env(case, env),
                                start_new_session=True)
        _RUNNING.add(proc)
        try:
            rc = proc.wait(timeout=case.timeout or timeout)
        except subprocess.TimeoutExpired:
            timed_out = case.timeout or timeout
            _kill_group(proc)
            rc = proc.wait()
        except BaseException:
            _kill_group(proc)
            proc.wait(timeout=10)     # reaped here: no zombie left for an init that may not reap
            raise
        finally:
            _RUNNING.discard(proc)
    rec = _gather(work, rc, timed_out, log, bool(launcher))
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    return {"name": case.name, **{k: v for k, v in rec.items() if k != "name"}, "returncode": rc,
            "seconds": round(time.time() - t0, 1)}


_RUNNING: set[subprocess.Popen] = set()


def _stop_all(signum, frame) -> None:
    """SIGTERM / SIGHUP / SIGINT of the runner: kill every running case's process group (cases side by side too), then
    leave as the signal would."""
    for proc in list(_RUNNING):
        _kill_group(proc)
    raise SystemExit(128 + signum)


def _on_stop() -> dict:
    """Install _stop_all (main thread only); the handlers it replaced, for _restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _stop_all) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}


def _restore(old: dict) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the case's process group and every process below it: torchrun starts each rank in a session of its own
    (torch.distributed.elastic's SubprocessHandler, ``start_new_session=True``), which the group's signal misses; a
    rank left behind hangs in NCCL with its kernels spinning on the GPU and slows every later case on that machine."""
    tree = _descendants(proc.pid)      # read before the kill: an orphan is reparented and lost from the tree
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    own = os.getpgid(0)
    for pid in tree:
        try:
            group = os.getpgid(pid)
            if group != own:
                os.killpg(group, signal.SIGKILL)    # the rank's own session: what it started goes with it
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:120]


def select(cases: Sequence[Case], filters: Sequence[str] | None) -> list[Case]:
    """The cases whose name contains one of the filters (all without filters)."""
    return [c for c in cases if not filters or any(f in c.name for f in filters)]


def run_cases(cases: Iterable, fn: Callable | str, *, out: str | Path, jsonl: str, filters: Sequence[str] | None = None,
              dry: bool = False, fresh: bool = False, timeout: float = DEFAULT_TIMEOUT, launcher: Sequence[str] | None = None,
              env: dict | None = None, columns: Sequence | None = None, env_file: str | bool = True,
              meta: Callable[[Case], dict] | None = None, jobs: int = 1, quiet: bool = False) -> list[dict]:
    """Run the (filtered) cases not already done in OUT/jsonl, one subprocess each; print a line per case as it ends and
    a markdown table of every case's last record; return the records of this run. ``meta(case)``: fields the parent
    adds to the case's record (e.g. its spec beside a launcher job's ranks). ``jobs``: cases at once (each its own
    process; allocator statistics are per process, so cases may share one GPU). ``env_file``: the versions and
    device are written to OUT/<jsonl stem>_env.json (or this name; False: not at all) before a real run."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if dry:   # a dry run's lines never make a real run skip its cases
        jsonl = f"{Path(jsonl).stem}_dry{Path(jsonl).suffix}"
    path = out / jsonl
    if fresh and path.exists():
        path.unlink()
    _drop_torn_tail(path)
    todo = select(as_cases(cases), filters)
    done = done_names(path)
    logs = out / "logs" / Path(jsonl).stem
    if env_file and not dry and any(c.name not in done for c in todo):
        write_env(out / (env_file if isinstance(env_file, str) else f"{Path(jsonl).stem}_env.json"))
    lock = threading.Lock()
    recs = []

    def one(case: Case) -> None:
        rec = run_one(case, fn, out=out, logs=logs, dry=dry, timeout=timeout, launcher=launcher, env=env)
        if meta is not None:
            rec = {"name": rec["name"], **meta(case), **{k: v for k, v in rec.items() if k != "name"}}
        with lock:
            with open(path, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
            recs.append(rec)
            if not quiet:
                print(f"{case.name:45s} {rec['seconds']:6.1f}s {'ERROR ' + rec['error'][:100] if 'error' in rec else 'ok'}",
                      flush=True)

    for case in todo:
        if case.name in done and not quiet:
            print(f"{case.name:45s} done (in {path.name}), skipped", flush=True)
    pending = [c for c in todo if c.name not in done]
    old = _on_stop()
    try:
        if jobs > 1:
            with ThreadPoolExecutor(jobs) as pool:
                list(pool.map(one, pending))
        else:
            for case in pending:
                one(case)
    finally:
        _restore(old)
    if not quiet:
        names = {c.name for c in todo}
        print("\n" + table([r for n, r in last_records(read_jsonl(path)).items() if n in names], columns), flush=True)
    return recs


# ---- the table ----------------------------------------------------------------------------------------------------

def gib(b) -> str:
    return f"{b / 2**30:.3f}" if isinstance(b, (int, float)) and b else "-"


def off(est, real) -> str:
    return f"{(est - real) / real:+.2%}" if isinstance(est, (int, float)) and isinstance(real, (int, float)) and real \
        else "-"


DEFAULT_COLUMNS = (
    ("real allocated GiB", lambda r: gib(r.get("max_allocated"))),
    ("real reserved GiB", lambda r: gib(r.get("max_reserved"))),
    ("memlens allocated GiB", lambda r: gib(r.get("estimated_peak_allocated"))),
    ("off", lambda r: off(r.get("estimated_peak_allocated"), r.get("max_allocated"))),
    ("memlens reserved GiB", lambda r: gib(r.get("estimated_peak_reserved"))),
)


def table(recs: Sequence[dict], columns: Sequence | None = None) -> str:
    """A markdown table: one row a record, the case's name first; an errored case shows its error in one cell."""
    cols = list(columns or DEFAULT_COLUMNS)
    rows = ["| case | " + " | ".join(h for h, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
    for r in recs:
        if "error" in r:
            err = str(r["error"]).replace("|", "/").replace("\n", " ")[:100]
            rows.append(f"| {r.get('name')} | ERROR {err} |" + " |" * (len(cols) - 1))
            continue
        rows.append(f"| {r.get('name')} | " + " | ".join(_cell(f, r) for _, f in cols) + " |")
    return "\n".join(rows)


def _cell(f: Callable, r: dict) -> str:
    try:
        v = f(r)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return "-"
    return "-" if v is None else str(v)


# ---- the command line every script shares -------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """Filters may come after flags (``OUT --dry-run q3b``): positionals are parsed intermixed."""

    def parse_args(self, args=None, namespace=None):  # noqa: D102
        return self.parse_intermixed_args(args, namespace)


def runner_args(description: str, *, out_positional: bool = False, timeout: float = DEFAULT_TIMEOUT) -> argparse.ArgumentParser:
    """The flags every GPU script takes: filters (case-name substrings), --dry-run, --fresh, --timeout, --list and the
    output folder (OUT env or ./out; a first positional OUT_DIR where the script was documented that way)."""
    ap = _Parser(description=description)
    if out_positional:
        ap.add_argument("out", help="output folder (the JSONL and the logs go there)")
    else:
        ap.add_argument("--out", default=os.environ.get("OUT", "./out"), help="output folder (default: $OUT or ./out)")
    ap.add_argument("filters", nargs="*", help="run only the cases whose name contains one of these")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny sizes, estimates only")
    ap.add_argument("--fresh", action="store_true", help="start the JSONL over (default: resume, skip cases done)")
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds a case may run before it is killed")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    return ap


def list_or_run(a: argparse.Namespace, cases: Iterable, **kw) -> list[dict]:
    """--list prints the selected names; otherwise run_cases with the parsed flags."""
    cases = as_cases(cases)
    if a.list:
        print("\n".join(c.name for c in select(cases, a.filters)))
        return []
    return run_cases(cases, out=a.out, filters=a.filters, dry=a.dry_run, fresh=a.fresh, timeout=a.timeout, **kw)


def write_env(path: Path) -> None:
    """torch / transformers / device versions, from a subprocess (this process never creates a CUDA context)."""
    code = ("import importlib, json, os, torch, transformers\n"
            "d = {'torch': torch.__version__, 'transformers': transformers.__version__, 'gpus': torch.cuda.device_count()}\n"
            "for lib in ('accelerate', 'peft', 'timm', 'torchvision', 'opacus', 'trl', 'diffusers', 'liger_kernel'):\n"
            "    try:\n"
            "        d[lib] = importlib.import_module(lib).__version__\n"
            "    except Exception:\n"
            "        d[lib] = None\n"
            "if torch.cuda.is_available():\n"
            "    p = torch.cuda.get_device_properties(0)\n"
            "    d.update(device=p.name, total_memory=p.total_memory, cudnn=torch.backends.cudnn.version(),\n"
            "             nccl='.'.join(map(str, torch.cuda.nccl.version())),\n"
            "             nccl_env={k: v for k, v in os.environ.items() if k.startswith('NCCL_')})\n"
            "print(json.dumps(d))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    if r.returncode == 0:
        path.write_text(r.stdout.strip().splitlines()[-1] + "\n")


def estimate_spec(fields: dict) -> dict:
    """memlens' estimate of a spec on this machine's CPU (fake tensors): what a case's dry run (or its comparison)
    records beside the real peak."""
    from memlens.core.spec import TrainingSpec  # heavy: memlens and torch, in the case's process only
    from memlens.estimator import estimate  # heavy: as above

    t = time.perf_counter()
    r = estimate(TrainingSpec(**fields))
    return {"estimated_peak_allocated": r.peak_allocated_bytes, "estimated_peak_reserved": r.peak_reserved_bytes,
            "estimate_seconds": round(time.perf_counter() - t, 1), "estimate_notes": list(r.notes)}


# ---- the child ----------------------------------------------------------------------------------------------------

def load_fn(ref: str) -> Callable:
    mod, _, qual = ref.rpartition(":")
    if mod.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_gpu_case_script", mod)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
    else:
        m = importlib.import_module(mod)
    obj: Any = m
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def child(req_path: str) -> None:
    """Run one case function and write its record (a rank of a launcher job writes result<RANK>.json)."""
    req = json.loads(Path(req_path).read_text())
    rank = os.environ.get("RANK")
    result = Path(req["result"])
    if rank is not None:
        result = result.with_name(f"result{int(rank)}.json")
    rec: dict = {} if rank is None else {"rank": int(rank)}
    try:
        got = load_fn(req["fn"])(req["name"], req["payload"], req["dry"])
        rec.update(got or {})
    except BaseException as e:  # noqa: BLE001 - the case's failure is its record; the runner goes on
        rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        rec["oom"] = type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()
        rec["traceback"] = traceback.format_exc()[-3000:]
    result.write_text(json.dumps(rec, default=str))
    sys.stdout.flush()
    if "error" in rec:
        os._exit(3)   # no atexit work (a torchrun rank's process group may hang at exit)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        sys.exit("bench/gpu_runner.py runs cases for the bench/gpu_*.py scripts; it is not a command of its own")
