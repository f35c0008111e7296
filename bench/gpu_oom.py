"""Issue 14 on a real GPU: OOM messages with a hidden PID, the guard's report at a planted OOM and its
overhead, adaptive micro-batching of a plain loop and of a Hugging Face Trainer (one H100, ~6 min).

    python bench/gpu_oom.py OUT [part ...]       # parts: see PARTS; default all

Every part runs in a fresh subprocess (bench/gpu_runner.py: its own allocator; a part already run, in
OUT/gpu_oom_parts.jsonl, is skipped, --fresh runs it again) and appends JSON lines to OUT/gpu_oom.jsonl
as it goes; a table is printed at the end; `python bench/oom_results.py OUT` writes
bench/results/oom_gpu.{json,md}. OUT/fixtures/* go to tests/fixtures/doctor/ (the tests read them
when present).

Parts
- messages: real OOM messages + the truth at the failure (OUT/fixtures/gpu_oom_<case>.txt/.json):
  hidden_fragmentation, hidden_other_process, hidden_fraction, hidden_capacity (the OOM in a child
  whose PID the message cannot match: `unshare --pid --fork` as root, else `unshare --user
  --map-root-user --pid --fork`, else an LD_PRELOAD'ed getpid() built with cc; the method and whether
  the message hid the PID are recorded), non_pytorch (30 GiB taken with cuMemAlloc outside PyTorch).
- guard_planted: GPT-2 small training under memlens.guard(); a step with 4x the batch under a memory
  fraction (and one at a batch too big for the GPU) OOMs; checks the report's categories against
  memory_allocated() read by an independent OOM observer, the parameter and optimizer-state bytes,
  and that the snapshot opens with torch.cuda._memory_viz (segsum, trace, trace_plot, segment_plot).
- guard_overhead: median step time without and with the guard (default; history off; module_depth 0)
  in interleaved rounds, GPT-2 small b8 L512 amp-bf16 and Llama-3.2-1B b4 L2048 bf16.
- adaptive_plain / adaptive_hf: calibrate the peaks of micro-batches m and 2m (fresh processes),
  cap the process between them (set_per_process_memory_fraction), then run the reference at m and an
  adaptive run started at 2m (same effective batch); their per-step losses are compared.
- adaptive_trend: a loop that leaks 512 MiB per step on a GPU filled but for ~6 GiB: the trend halves
  the micro-batch before the first OOM.
"""
from __future__ import annotations

import ctypes
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from bench.gpu_runner import list_or_run, runner_args  # noqa: E402

MIB, GIB = 2**20, 2**30
SEED = 0


# ---------------------------------------------------------------- plumbing
def emit(out: Path, rec: dict) -> None:
    with open(out / "gpu_oom.jsonl", "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")


def sub(args: list[str], timeout: float, env: dict | None = None, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.run([*(prefix or []), sys.executable, str(HERE), *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=REPO)


def env_info() -> dict:
    import torch

    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(0), "total_memory": torch.cuda.get_device_properties(0).total_memory}


def _oom(nbytes: int) -> str:
    import torch

    try:
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        return str(e)
    raise RuntimeError(f"allocating {nbytes} bytes did not fail")


def _mib2(x: float) -> int:
    return int(x) // (2 * MIB) * (2 * MIB)


def _truth(out: Path, name: str, msg: str, requested: int, **extra) -> None:
    import torch

    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    fx = out / "fixtures"
    fx.mkdir(exist_ok=True)
    (fx / f"gpu_oom_{name}.txt").write_text(msg + "\n")
    (fx / f"gpu_oom_{name}.json").write_text(json.dumps({
        "requested_bytes": requested, "allocated_bytes": stats["allocated_bytes.all.current"],
        "reserved_bytes": stats["reserved_bytes.all.current"], "free_bytes_after": free, "total_bytes": total,
        "pid": os.getpid(), "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
        "this_process_line": "this process has" in msg, "process_lines": msg.count("Process "), **extra}, indent=2) + "\n")


# ---------------------------------------------------------------- messages (run inside the child)
def child_fragmentation(out: Path, extra: dict) -> None:
    """gpu_doctor's fragmentation: 1 GiB segments split into 64 MiB tensors, every other one freed."""
    import torch

    piece, seg = 64 * MIB, GIB
    kept, whole = [], []
    while True:
        try:
            torch.empty(seg, dtype=torch.uint8, device="cuda")
            kept.append([torch.empty(piece, dtype=torch.uint8, device="cuda") for _ in range(seg // piece)])
        except torch.OutOfMemoryError:
            break
    torch.cuda.empty_cache()
    while True:
        try:
            whole.append(torch.empty(2 * MIB, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            break
    for group in kept:
        for i in range(0, len(group), 2):
            group[i] = None
    req = 2 * piece
    _truth(out, "hidden_fragmentation", _oom(req), req, expected_diagnosis="fragmentation", **extra)


def child_other_process(out: Path, extra: dict) -> None:
    import torch

    torch.empty(1, device="cuda")
    free = torch.cuda.mem_get_info()[0]
    req = _mib2(free + 10 * GIB)      # more than is free, less than free + the holder's 20 GiB
    _truth(out, "hidden_other_process", _oom(req), req, expected_diagnosis="other_processes", **extra)


def child_fraction(out: Path, extra: dict) -> None:
    import torch

    torch.cuda.set_per_process_memory_fraction(0.5)
    total = torch.cuda.mem_get_info()[1]
    held = torch.empty(_mib2(0.3 * total), dtype=torch.uint8, device="cuda")  # noqa: F841
    req = _mib2(0.3 * total)
    _truth(out, "hidden_fraction", _oom(req), req, fraction=0.5, expected_diagnosis="memory_fraction_limit", **extra)


def child_capacity(out: Path, extra: dict) -> None:
    import torch

    total = torch.cuda.mem_get_info()[1]
    held = torch.empty(_mib2(0.6 * total), dtype=torch.uint8, device="cuda")  # noqa: F841
    req = _mib2(0.6 * total)
    _truth(out, "hidden_capacity", _oom(req), req, expected_diagnosis="capacity", **extra)


CHILDREN = {"hidden_fragmentation": child_fragmentation, "hidden_other_process": child_other_process,
            "hidden_fraction": child_fraction, "hidden_capacity": child_capacity}


def _fakepid_lib(out: Path) -> Path | None:
    """An LD_PRELOAD library whose getpid() lies (so PyTorch's "this process" match fails), built with cc."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    src, lib = out / "fakepid.c", out / "libfakepid.so"
    src.write_text("#include <sys/types.h>\npid_t getpid(void) { return 4194000; }\n")
    r = subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True)
    return lib if r.returncode == 0 and lib.exists() else None


def hidden_methods(out: Path) -> list[tuple[str, list[str], dict]]:
    m = []
    unshare = shutil.which("unshare")
    if unshare:
        m.append(("unshare --pid (root)", [unshare, "--pid", "--fork", "--mount-proc"], {}))
        m.append(("unshare --user --pid", [unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"], {}))
    lib = _fakepid_lib(out)
    if lib is not None:
        m.append(("LD_PRELOAD getpid", [], {"LD_PRELOAD": str(lib)}))
    m.append(("none (no way to hide the PID worked)", [], {}))    # still capture the message
    return m


def part_messages(out: Path) -> None:
    holder = None
    try:
        for case in CHILDREN:
            tries = []
            extra: dict = {}
            if case == "hidden_other_process":
                ready = out / ".holder_ready"
                ready.unlink(missing_ok=True)
                holder = subprocess.Popen([sys.executable, str(HERE), "--hold", "20", str(ready)])
                for _ in range(600):
                    if ready.exists() or holder.poll() is not None:
                        break
                    time.sleep(0.1)
                extra = {"other_pid": holder.pid, "other_gib": 20}
            msg_file = out / "fixtures" / f"gpu_oom_{case}.txt"
            for name, prefix, env in hidden_methods(out):
                msg_file.unlink(missing_ok=True)
                r = sub(["--child", case, str(out), json.dumps({**extra, "hidden_method": name})], 120, env=env, prefix=prefix)
                hidden = r.returncode == 0 and msg_file.exists() and "this process has" not in msg_file.read_text()
                tries.append({"method": name, "rc": r.returncode, "hidden": hidden, "stderr": r.stderr.strip()[-600:]})
                if hidden:
                    break
            emit(out, {"part": "messages", "case": case, "tries": tries,
                       "hidden": any(t["hidden"] for t in tries), "files": msg_file.exists()})
            if holder is not None:
                holder.kill()
                holder.wait()
                holder = None
        r = sub(["--child", "non_pytorch", str(out), "{}"], 120)
        emit(out, {"part": "messages", "case": "non_pytorch", "rc": r.returncode, "stderr": r.stderr.strip()[-600:]})
    finally:
        if holder is not None:
            holder.kill()


def child_non_pytorch(out: Path, extra: dict) -> None:
    """30 GiB taken with the CUDA driver API (cuMemAlloc) in this process, outside PyTorch's allocator."""
    import torch

    torch.empty(1, device="cuda")
    cuda = ctypes.CDLL("libcuda.so.1")
    ptr = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(30 * GIB))
    if rc != 0:
        raise RuntimeError(f"cuMemAlloc_v2 returned {rc}")
    held = torch.empty(20 * GIB, dtype=torch.uint8, device="cuda")  # noqa: F841
    free = torch.cuda.mem_get_info()[0]
    req = _mib2(free + 6 * GIB)
    _truth(out, "non_pytorch", _oom(req), req, outside_pytorch_bytes=30 * GIB, expected_diagnosis="non_pytorch_memory", **extra)
    cuda.cuMemFree_v2(ptr)


def hold(gib: str, ready: str) -> None:
    import torch

    x = torch.empty(int(float(gib) * GIB), dtype=torch.uint8, device="cuda")  # noqa: F841
    torch.cuda.synchronize()
    Path(ready).write_text(str(os.getpid()))
    time.sleep(300)


# ---------------------------------------------------------------- guard
def _gpt2(n_layer=12, seed=SEED, dropout=0.0):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=n_layer, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(cfg).cuda()


def _lm_batch(b: int, L: int, seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, 50257, (b, L), device="cuda", generator=g)
    return {"input_ids": ids, "labels": ids}


def part_guard_planted(out: Path, case: str) -> None:
    import torch
    from torch.cuda import _memory_viz

    import memlens

    seen: list[dict] = []

    def independent(device, alloc, total_or_allowed, free):   # a second observer: memory_allocated() at the failure
        seen.append({"requested": alloc, "allocated": torch.cuda.memory_allocated(device), "free": free})

    torch._C._cuda_attach_out_of_memory_observer(independent)
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gdir = out / f"guard_{case}"
    rec: dict = {"part": "guard_planted", "case": case, "env": env_info()}
    t0 = time.time()
    g = memlens.guard(model, opt, out_dir=gdir)
    try:
        with g:
            for step in range(2):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**_lm_batch(8, 512, step)).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if case == "fraction":
                total = torch.cuda.get_device_properties(0).total_memory
                torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + GIB) / total)
                b = 32
            else:
                b = 512
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**_lm_batch(b, 512, 99)).loss
            loss.backward()
        rec["error"] = "no OOM happened"
    except torch.OutOfMemoryError as e:
        rec["oom_message"] = str(e).split("\n")[0][:400]
        rec["notes"] = getattr(e, "__notes__", [])
    rec["seconds"] = round(time.time() - t0, 2)
    rec["guard_errors"] = g.errors
    rec["observer_calls"] = len(seen)
    rec["independent"] = seen[-1] if seen else None
    rep = gdir / "oom_report.json"
    if rep.exists():
        d = json.loads(rep.read_text())
        rec["report"] = {k: d.get(k) for k in ("diagnosis", "certain", "allocated_bytes", "categories_sum_bytes",
                                                "categories_error", "requested_bytes", "by_category", "earlier_steps_bytes",
                                                "by_allocation_phase", "step", "evidence")}
        rec["report"]["by_module_top"] = d["by_module"][:8]
        rec["report"]["account"] = d.get("account")
        ind = rec["independent"]["allocated"] if rec["independent"] else None
        rec["categories_vs_independent"] = (d["categories_sum_bytes"] - ind) / ind if ind else None
        rec["param_bytes_expected"] = sum(-(-p.numel() * p.element_size() // 512) * 512 for p in model.parameters())
        rec["optimizer_state_bytes_expected"] = sum(-(-t.numel() * t.element_size() // 512) * 512
                                                    for st in opt.state.values() for t in st.values() if t.is_cuda)
        rec["files"] = sorted(p.name for p in gdir.iterdir())
        with open(gdir / "oom_snapshot.pickle", "rb") as f:
            snap = pickle.load(f)
        viz = {}
        for fn in ("segsum", "trace", "trace_plot", "segment_plot"):
            try:
                viz[fn] = len(getattr(_memory_viz, fn)(snap))
            except Exception as e:  # noqa: BLE001
                viz[fn] = f"{type(e).__name__}: {e}"
        rec["memory_viz"] = viz
        rec["snapshot_bytes"] = (gdir / "oom_snapshot.pickle").stat().st_size
    emit(out, rec)


def part_guard_overhead(out: Path, case: str) -> None:
    import torch

    import memlens
    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    fields = {"gpt2": dict(model="gpt2", batch_size=8, seq_len=512, precision="amp-bf16"),
              "llama1b": dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, precision="bf16")}[case]
    prepared = prepare(TrainingSpec(**fields), device=torch.device("cuda:0"))
    model, opt = prepared.model, prepared.optimizer
    variants = {"none": None, "guard": {}, "guard history=False": {"history": False}, "guard module_depth=0": {"module_depth": 0}}
    times: dict[str, list[float]] = {k: [] for k in variants}
    steps, rounds = 8, 3
    for _ in range(3):
        prepared.run()
    for _ in range(rounds):
        for name, kw in variants.items():
            g = memlens.guard(model, opt, out_dir=out / "unused", **kw) if kw is not None else None
            if g is not None:
                g.start()
            for _ in range(steps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                prepared.run()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t)
            if g is not None:
                g.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    emit(out, {"part": "guard_overhead", "case": case, "spec": fields, "env": env_info(), "steps": steps * rounds,
               "median_step_s": med, "overhead": {k: med[k] / med["none"] - 1 for k in med if k != "none"},
               "overhead_ms": {k: 1000 * (med[k] - med["none"]) for k in med if k != "none"}})


# ---------------------------------------------------------------- adaptive
EFFECTIVE, MICRO, L = 16, 4, 512


def _plain_run(micro: int, steps: int, fraction: float | None, adaptive: bool, leak_mib: int = 0,
               lookahead: int = 20, n_layer: int = 12, ballast: int = 0) -> dict:
    import torch

    import memlens

    if fraction:
        torch.cuda.set_per_process_memory_fraction(fraction)
    ballast_t = torch.empty(ballast, dtype=torch.uint8, device="cuda") if ballast else None  # noqa: F841 - fills the GPU
    model = _gpt2(n_layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, kept = [], []
    rec: dict = {"micro": micro, "adaptive": adaptive, "fraction": fraction}
    ab = memlens.adaptive_batch(opt, micro_batch=micro, trend=bool(leak_mib), lookahead=lookahead) if adaptive else None
    ooms_at_change = []
    try:
        for step in range(steps):
            batch = _lm_batch(EFFECTIVE, L, 1000 + step)
            if ab is not None:
                n_changes = len(ab.changes)
                loss = ab.step(batch, lambda mb: model(**mb).loss).item()
                ooms_at_change += [(c.reason, ab.runner.ooms) for c in ab.changes[n_changes:]]
            else:
                total = 0.0
                for i in range(0, EFFECTIVE, micro):
                    mb = {k: v[i:i + micro] for k, v in batch.items()}
                    part = model(**mb).loss * (micro / EFFECTIVE)
                    part.backward()
                    total += part.item()
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss = total
            losses.append(loss)
            if leak_mib:
                kept.append(torch.empty(leak_mib * MIB, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as e:
        rec["oom_at_step"] = len(losses) + 1
        rec["oom"] = str(e).split("\n")[0][:300]
    rec.update(losses=losses, peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
               total_memory=torch.cuda.get_device_properties(0).total_memory)
    if ab is not None:
        r = ab.result.data
        rec.update(changes=r["changes"], final_micro=r["micro_batch"], ooms_recovered=r["ooms_recovered"],
                   windows_redone=r["windows_redone"], ooms_before_each_change=ooms_at_change)
    return rec


def _hf_run(per_device: int, steps: int, fraction: float | None, adaptive: bool, out: Path) -> dict:
    import torch
    import transformers

    from memlens.integrations.hf import MemlensCallback

    if fraction:
        torch.cuda.set_per_process_memory_fraction(fraction)

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return EFFECTIVE * steps

        def __getitem__(self, i):
            ids = torch.randint(0, 50257, (L,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(SEED)
    cfg = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(
        output_dir=str(out / f"hf_{per_device}_{adaptive}"), per_device_train_batch_size=per_device,
        gradient_accumulation_steps=EFFECTIVE // per_device, max_steps=steps, learning_rate=1e-4, logging_steps=1,
        save_strategy="no", report_to=[], seed=SEED, disable_tqdm=True, dataloader_num_workers=0)
    cb = MemlensCallback(profile=False, adaptive=adaptive, trend=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=DS(), callbacks=[cb])
    rec: dict = {"per_device": per_device, "gradient_accumulation_steps": EFFECTIVE // per_device, "adaptive": adaptive,
                 "fraction": fraction}
    try:
        trainer.train()
    except torch.OutOfMemoryError as e:
        rec["oom"] = str(e).split("\n")[0][:300]
    rec["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rec["global_step"] = trainer.state.global_step
    rec.update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
               total_memory=torch.cuda.get_device_properties(0).total_memory)
    if cb.oom is not None:
        d = cb.oom.result.data
        rec.update(changes=d["changes"], final_micro=d["micro_batch"], ooms_recovered=d["ooms_recovered"],
                   windows_redone=d["windows_redone"])
    return rec


def _cap(m: dict, m2: dict) -> float | None:
    """A memory fraction between micro-batch m's need (the fit rule's allocated x 1.10, or its reserved)
    and 2m's peak allocated: m fits, 2m cannot. (The parent never touches CUDA: a context of its own
    would be one more process on the GPU.)"""
    total = m["total_memory"]
    lo = min(m["peak_reserved"], int(m["peak_allocated"] * 1.10)) + 512 * MIB
    hi = m2["peak_allocated"] - 512 * MIB
    if hi <= lo:
        return None
    return (lo + hi) / 2 / total


def part_adaptive(out: Path, kind: str) -> None:
    rec: dict = {"part": f"adaptive_{kind}", "effective_batch": EFFECTIVE, "micro_batch": MICRO, "seq_len": L}
    steps = 4
    runs = {}
    for name, micro in (("calib_m", MICRO), ("calib_2m", 2 * MICRO)):
        r = sub(["--run", kind, str(out), json.dumps({"micro": micro, "steps": 2, "fraction": None, "adaptive": False})], 240)
        runs[name] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-1500:]}
    rec["calibration"] = runs
    if "error" in runs["calib_m"] or "error" in runs["calib_2m"]:
        emit(out, rec)
        return
    frac = _cap(runs["calib_m"], runs["calib_2m"])
    rec["fraction"] = frac
    if frac is None:
        rec["error"] = "micro-batch 2m does not need more than m can use: no cap between them"
        emit(out, rec)
        return
    for name, micro, adaptive in (("reference", MICRO, False), ("adaptive", 2 * MICRO, True), ("no_adaptive", 2 * MICRO, False)):
        r = sub(["--run", kind, str(out), json.dumps({"micro": micro, "steps": steps, "fraction": frac, "adaptive": adaptive})], 300)
        rec[name] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-1500:]}
    ref, ad = rec["reference"].get("losses"), rec["adaptive"].get("losses")
    if ref and ad and len(ref) == len(ad):
        rec["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(ad, ref))
    emit(out, rec)


def part_adaptive_trend(out: Path) -> None:
    """A 512 MiB/step leak on a GPU filled but for ~6 GiB (a ballast tensor: nothing that depends on
    torch's memory-fraction API): the trend halves the micro-batch before the first OOM."""
    r = sub(["--run", "plain", str(out), json.dumps({"micro": 8, "steps": 2, "fraction": None, "adaptive": False, "n_layer": 6})], 240)
    calib = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-1500:]}
    rec: dict = {"part": "adaptive_trend", "calibration": calib, "leak_mib_per_step": 512}
    if "error" not in calib:
        # leave ~6 GiB over the step's reserved peak (and 1 GiB for the context): ~12 steps of leak
        ballast = _mib2(calib["total_memory"] - calib["peak_reserved"] - 7 * GIB)
        rec["ballast_bytes"] = ballast
        for name, adaptive in (("without_adaptive", False), ("adaptive", True)):
            r = sub(["--run", "plain", str(out), json.dumps({"micro": 8, "steps": 20, "fraction": None, "adaptive": adaptive,
                                                              "leak_mib": 512, "lookahead": 4, "n_layer": 6,
                                                              "ballast": ballast})], 300)
            rec[name] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-1500:]}
    emit(out, rec)


def sub_part(out: Path, name: str, case: str) -> None:
    r = sub(["--part", name, str(out), case], 420)
    if r.returncode:
        emit(out, {"part": name, "case": case, "error": r.stderr.strip()[-2000:]})


# every part runs its GPU work in subprocesses: this process never creates a CUDA context
PARTS = {
    "messages": part_messages,
    "guard_planted": lambda out: (sub_part(out, "guard_planted", "fraction"), sub_part(out, "guard_planted", "capacity")),
    "guard_overhead": lambda out: (sub_part(out, "guard_overhead", "gpt2"), sub_part(out, "guard_overhead", "llama1b")),
    "adaptive_plain": lambda out: part_adaptive(out, "plain"),
    "adaptive_hf": lambda out: part_adaptive(out, "hf"),
    "adaptive_trend": lambda out: part_adaptive_trend(out),
}


def run_part(name: str, out: str, dry: bool) -> dict:
    """One part in its own subprocess (bench/gpu_runner.py); its measurements go to OUT/gpu_oom.jsonl as before."""
    if dry:
        return {"dry_run": "GPU only: nothing to estimate"}
    path = Path(out) / "gpu_oom.jsonl"
    before = sum(1 for _ in open(path)) if path.exists() else 0
    PARTS[name](Path(out))
    return {"lines": (sum(1 for _ in open(path)) if path.exists() else 0) - before}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--hold"]:
        hold(argv[1], argv[2])
        return 0
    if argv[:1] == ["--child"]:
        case, out, extra = argv[1], Path(argv[2]), json.loads(argv[3])
        (CHILDREN.get(case) or {"non_pytorch": child_non_pytorch}[case])(out, extra)
        return 0
    if argv[:1] == ["--run"]:
        kind, out, kw = argv[1], Path(argv[2]), json.loads(argv[3])
        if kind == "plain":
            rec = _plain_run(kw["micro"], kw["steps"], kw["fraction"], kw["adaptive"], kw.get("leak_mib", 0),
                             kw.get("lookahead", 20), kw.get("n_layer", 12), kw.get("ballast", 0))
        else:
            rec = _hf_run(kw["micro"], kw["steps"], kw["fraction"], kw["adaptive"], out)
        print(json.dumps(rec, default=str))
        return 0
    if argv[:1] == ["--part"]:
        name, out, case = argv[1], Path(argv[2]), argv[3]
        {"guard_planted": lambda: part_guard_planted(out, case), "guard_overhead": lambda: part_guard_overhead(out, case)}[name]()
        return 0
    if not argv:
        print(__doc__)
        return 2
    a = runner_args(__doc__.splitlines()[0], out_positional=True, timeout=1200).parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    unknown = [w for w in a.filters if w not in PARTS]
    if unknown:
        sys.exit(f"unknown part(s) {', '.join(unknown)}; the parts: {', '.join(PARTS)}")
    wanted, a.filters = a.filters or list(PARTS), None
    t0 = time.time()
    # each part's orchestration in its own process (bench/gpu_runner.py): a part that fails leaves the others; its
    # GPU work runs in further subprocesses (sub), so no runner process creates a CUDA context
    list_or_run(a, [(name, str(out)) for name in wanted], fn=run_part, jsonl="gpu_oom_parts.jsonl", env_file=False,
                columns=[("lines", lambda r: r.get("lines"))])
    if a.dry_run or a.list:
        return 0
    print(f"total {time.time() - t0:.0f}s; results in {out / 'gpu_oom.jsonl'}")
    from bench.oom_results import summarize

    print(summarize(out)["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
