"""Step time, predicted vs measured (issue 36): calibrate this GPU, then for each case measure real steps and price
the same spec with memlens' per-op time model using the table just measured.

One command on the GPU machine, from the repo root (one H100: about 6 minutes):

    python bench/gpu_step_time.py                 # calibrate + the one-GPU cases
    python bench/gpu_step_time.py --gpus 2        # the DDP / FSDP2 cases (calibrate with NCCL first)
    python bench/gpu_step_time.py --dry-run       # CPU: estimates only, tiny sizes (checks the script)
    python bench/gpu_step_time.py --set new --table memlens/data/gpus/h200_timing.json --profile
                                                  # families the time model was never checked on (--set new2: more;
                                                  # its diffusion cases need diffusers: carry its wheel)
    python bench/gpu_step_time.py --only gpt2-fp32,llama1b-bf16 --budget-s 400 --table out/h100_timing.json
                                                  # (case-name substrings as positionals select too; --list names them)

What it does:
1. ``memlens calibrate --out $OUT/<gpu>_timing.json`` in a subprocess (with ``--gpus 2``, NCCL included);
2. the estimates of every case, on the CPU, in a pool of ``--workers`` spawned processes (2 threads each) with that
   table (MEMLENS_TIMING_TABLE): ``step_time`` of the Result (seconds and parts);
3. meanwhile, each case in its own GPU subprocess through bench/gpu_runner.py (an OOM or a crash loses one case; its
   record in $OUT/gpu_step_time_runs.jsonl, a case measured there is not run again unless --fresh): memlens' own step
   (memlens.step.prepare) on random weights, 2 warm-up steps, then 5 steps each CUDA-synchronized: the median step
   seconds (host wall clock, less the time before the step's first phase: DP-SGD's Poisson loader draws its batch
   there, which memlens does not price; ``data`` among the phases) and its phases (CUDA events at the loop's phase
   marks, memlens.measure.phase_time; recompute is inside backward); with ``--gpus 2`` under torchrun; with ``--rounds N`` every case N times, a round over
   all cases at a time, the record the median of its rounds (a shared host's speed drifts 2x over minutes:
   bench/results/host_probe.md; each case's host speed beside its steps is ``host_speed_ms``);
4. one JSON line per case appended to $OUT/gpu_step_time.jsonl (OUT: env var, default ./out) as it comes, and a
   markdown table ($OUT/gpu_step_time.md) printed last: measured vs predicted, error, and the overheads of
   checkpointing and accumulation (measured vs predicted, percentage points).

Skipped, and said so in the table: a case whose library the GPU machine lacks (``needs``: bitsandbytes for QLoRA,
opacus for DP-SGD, diffusers for Stable Diffusion and DiT - carry their wheels: ``python -m pip install --no-deps``).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_runner import Case, last_records, read_jsonl, run_cases, runner_args, select  # noqa: E402

WARMUP, STEPS = 2, 5
JSONL, MD = "gpu_step_time.jsonl", "gpu_step_time.md"
RUNS = "gpu_step_time_runs.jsonl"     # the runner's record of each GPU run (resume: a case measured is not run again)
CASE_TIMEOUT = 150
PROFILE_ENV = "MEMLENS_BENCH_PROFILE"   # --profile: each case's record holds one profiled step (bench/op_profile.py)
DISPATCH_ENV = "MEMLENS_BENCH_DISPATCH"  # --dispatch: each case's record holds the host's dispatch speed (dispatch_probe)
GPT2 = dict(model="gpt2", batch_size=8, seq_len=1024)
L1B = dict(model="llama-3.2-1b", batch_size=4, seq_len=1024, precision="bf16")
Q05 = dict(model="qwen2.5-0.5b", batch_size=8, seq_len=1024, precision="bf16")
L8B = dict(model="llama-3.1-8b", batch_size=2, seq_len=1024, precision="bf16", lora_rank=16)

# name -> spec fields; "base" names the case a technique is compared with (the overhead columns)
CASES: dict[str, dict] = {
    "gpt2-fp32": {**GPT2, "batch_size": 4, "seq_len": 512, "precision": "fp32"},
    "gpt2-amp-bf16": {**GPT2, "precision": "amp-bf16"},
    "gpt2-amp-fp16": {**GPT2, "seq_len": 512, "precision": "amp-fp16"},
    "gpt2-bf16-fused": {**GPT2, "batch_size": 16, "precision": "bf16", "optimizer": "adamw-fused"},
    "gpt2-amp-bf16-accum4": {**GPT2, "precision": "amp-bf16", "grad_accum": 4, "base": "gpt2-amp-bf16"},
    "gpt2-amp-bf16-ckpt": {**GPT2, "precision": "amp-bf16", "grad_checkpointing": True, "base": "gpt2-amp-bf16"},
    "llama1b-bf16": dict(L1B),
    "llama1b-bf16-b1-L512": {**L1B, "batch_size": 1, "seq_len": 512},
    "llama1b-bf16-fused": {**L1B, "optimizer": "adamw-fused"},
    "llama1b-ckpt-full": {**L1B, "grad_checkpointing": True, "base": "llama1b-bf16"},
    "llama1b-ckpt-partial8": {**L1B, "grad_checkpointing": True, "checkpoint_layers": 8, "base": "llama1b-bf16"},
    "llama1b-ckpt-selective": {**L1B, "grad_checkpointing": True, "checkpoint_policy": "selective", "base": "llama1b-bf16"},
    "llama1b-b2-accum2": {**L1B, "batch_size": 2, "grad_accum": 2, "base": "llama1b-bf16"},
    "llama1b-eager-attn": {**L1B, "attn": "eager"},
    "llama1b-lora-b8-L2048": {**L1B, "batch_size": 8, "seq_len": 2048, "lora_rank": 16},
    "llama1b-amp-bf16": {**L1B, "batch_size": 2, "precision": "amp-bf16"},
    "qwen0.5b-bf16": dict(Q05),
    "qwen0.5b-amp-bf16-b4": {**Q05, "batch_size": 4, "precision": "amp-bf16"},
    "qwen0.5b-ckpt": {**Q05, "grad_checkpointing": True, "base": "qwen0.5b-bf16"},
    "qwen3-0.6b-lora": {**Q05, "model": "qwen3-0.6b", "lora_rank": 16},
    "llama8b-lora": dict(L8B),
    "llama8b-lora-ckpt": {**L8B, "grad_checkpointing": True, "base": "llama8b-lora"},
    "vit-base-amp-bf16": dict(model="vit-base-patch16-224", batch_size=64, precision="amp-bf16"),
    "vit-large-bf16-ckpt": dict(model="vit-large-patch16-224", batch_size=32, precision="bf16", grad_checkpointing=True),
    "resnet50-amp-bf16": dict(model="resnet-50", batch_size=64, precision="amp-bf16"),
    "tv-resnet50-fp32": dict(model="torchvision:resnet50", batch_size=32, precision="fp32"),
    "llama1b-qlora": {**L1B, "lora_rank": 16, "qlora": True, "needs": "bitsandbytes"},
    "llama1b-dp-lora": {**L1B, "batch_size": 8, "seq_len": 512, "dp": True, "lora_rank": 16, "needs": "opacus"},
}
CASES_2GPU: dict[str, dict] = {
    "gpt2-ddp2": {**GPT2, "precision": "amp-bf16", "world_size": 2, "sharding": "ddp"},
    "llama1b-ddp2": {**L1B, "world_size": 2, "sharding": "ddp"},
    "llama1b-fsdp2": {**L1B, "world_size": 2, "sharding": "fsdp"},
    "llama1b-zero2": {**L1B, "world_size": 2, "sharding": "zero2"},
    "qwen0.5b-fsdp2-ckpt": {**Q05, "world_size": 2, "sharding": "fsdp", "grad_checkpointing": True},
}
# Families the time model was never checked on (--set new): encoder-decoders, encoders, a CNN and a ConvNeXt, Gemma, Phi,
# a mixture of experts, long context, speech; the specs of the memory generality set (bench/generality_cases.py)
CASES_NEW: dict[str, dict] = {
    "t5-base-amp-bf16": dict(model="t5-base", batch_size=16, seq_len=512, target_len=128, precision="amp-bf16"),
    "bart-base-fp32": dict(model="bart-base", batch_size=16, seq_len=512, target_len=256),
    "bert-large-amp-fp16": dict(model="bert-large-uncased", batch_size=32, seq_len=512, precision="amp-fp16"),
    "bert-large-amp-fp16-eager": dict(model="bert-large-uncased", batch_size=16, seq_len=512, precision="amp-fp16",
                                      attn="eager"),
    "gpt2-large-amp-bf16-clip": dict(model="gpt2-large", batch_size=4, seq_len=1024, precision="amp-bf16", max_grad_norm=1.0),
    "gemma2b-bf16": dict(model="gemma-2b", batch_size=2, seq_len=1024, precision="bf16"),
    "phi1.5-bf16-fused": dict(model="phi-1.5", batch_size=4, seq_len=1024, precision="bf16", optimizer="adamw-fused"),
    "olmoe-bf16-sgd": dict(model="olmoe-1b-7b", batch_size=2, seq_len=1024, precision="bf16", optimizer="sgd"),
    "llama1b-bf16-b1-L8192": dict(model="llama-3.2-1b", batch_size=1, seq_len=8192, precision="bf16"),
    "whisper-small-amp-bf16": dict(model="whisper-small", batch_size=16, precision="amp-bf16"),
    "convnext-tiny-amp-bf16": dict(model="convnext-tiny-224", batch_size=64, precision="amp-bf16"),
    "resnet50-fp32": dict(model="resnet-50", batch_size=64),
    "custom-cnn-fp32-clip": dict(model="bench.generality_models:cnn", batch_size=64, max_grad_norm=1.0),
}
# A second set, measured only after the mechanisms the first set showed were priced (--set new2): priced before measured
CASES_NEW2: dict[str, dict] = {
    "deberta-v3-base-amp-bf16": dict(model="deberta-v3-base", batch_size=16, seq_len=512, precision="amp-bf16"),
    "swin-tiny-amp-bf16": dict(model="swin-tiny-patch4-window7-224", batch_size=64, precision="amp-bf16"),
    "pythia-410m-bf16": dict(model="pythia-410m", batch_size=8, seq_len=1024, precision="bf16"),
    "bert-base-fp32": dict(model="bert-base-uncased", batch_size=32, seq_len=128),
    "llama3b-bf16-fused": dict(model="llama-3.2-3b", batch_size=2, seq_len=2048, precision="bf16", optimizer="adamw-fused"),
    "mistral7b-lora": dict(model="mistral-7b", batch_size=2, seq_len=1024, precision="bf16", lora_rank=16),
    "qwen7b-lora-ckpt-L2048": dict(model="qwen2.5-7b", batch_size=2, seq_len=2048, precision="bf16", lora_rank=16,
                                   grad_checkpointing=True),
    "gpt2xl-bf16-ckpt": dict(model="gpt2-xl", batch_size=4, seq_len=1024, precision="bf16", grad_checkpointing=True),
    "sd15-amp-bf16": dict(model="sd-1.5", batch_size=8, image_size=512, precision="amp-bf16", needs="diffusers"),
    "sd15-amp-bf16-ckpt": dict(model="sd-1.5", batch_size=8, image_size=512, precision="amp-bf16",
                               grad_checkpointing=True, needs="diffusers"),
    "dit-xl-bf16": dict(model="dit-xl-2-256", batch_size=32, image_size=256, precision="bf16", needs="diffusers"),
    "qwen2.5-vl-3b-bf16": dict(model="qwen2.5-vl-3b", batch_size=2, seq_len=1024, precision="bf16"),
}
META = ("base", "skip", "needs")


def _missing(fields: dict) -> str | None:
    """Why a case cannot run here: the library it needs is not installed (carry its wheel: .whl/)."""
    import importlib.util

    need = fields.get("needs")
    return f"{need} is not installed on this machine" if need and importlib.util.find_spec(need) is None else None


def spec_of(fields: dict, dry: bool = False, table: str | None = None):
    """The case's TrainingSpec; with ``table`` (a timing table file) for the GPU that table was measured on, where the
    case names none (the step is measured there: its Result says which GPU it prices, not the default H100)."""
    from memlens.core.spec import TrainingSpec

    f = {k: v for k, v in fields.items() if k not in META}
    if table and "gpu" not in f:
        with open(table) as fh:
            f["gpu"] = json.load(fh)["gpu"]
    if dry:   # tiny sizes: the script's paths, not its numbers
        f["batch_size"] = min(f.get("batch_size", 1), 2)
        if f.get("seq_len"):
            f["seq_len"] = 64
        if f.get("model") == "llama-3.1-8b":
            f["model"] = "llama-3.2-1b"
    return TrainingSpec(**f)


# ---------------------------------------------------------------- one case, measured (GPU subprocess)
def measure(name: str, fields: dict) -> dict:
    import torch

    from memlens.measure.host_phases import host_speed
    from memlens.measure.phase_time import PhaseTimer
    from memlens.step import prepare

    spec = spec_of(fields)
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if spec.world_size > 1:
        import torch.distributed as dist

        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    dev = torch.device("cuda", local)
    torch.manual_seed(0)
    step = prepare(spec, device=dev)
    timer = PhaseTimer(torch, dev)
    walls, phases, speeds = [], [], []
    for i in range(WARMUP + STEPS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        timer.start()
        step.run(timer.on_phase)
        torch.cuda.synchronize()
        if i >= WARMUP:
            phases.append(timer.finish())
            walls.append(time.perf_counter() - t - phases[-1].get("data", 0.0))   # the step, not its data loader
            speeds.append(host_speed())   # the host's speed beside each step (calibrate records its own: env)
    med = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
    disp = dispatch_probe(torch, dev) if os.environ.get(DISPATCH_ENV) else None
    prof = None
    if os.environ.get(PROFILE_ENV):   # one more step under torch.profiler: GPU time per op (bench/op_profile.py); every
        from bench.op_profile import profiled_step   # rank steps (its collectives need them all), rank 0's is kept

        prof = profiled_step(step, torch, dev)
        prof = prof if rank == 0 else None
    rec = {"profile": prof, "name": name, "rank": rank, "measured_seconds": statistics.median(walls), "measured_steps": walls,
           "measured_phases": med, "host_speed_ms": round(statistics.median(speeds) * 1e3, 2), "dispatch": disp,
           "max_allocated": torch.cuda.max_memory_allocated(dev),
           "device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    if spec.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return rec


def dispatch_probe(torch, dev) -> dict:
    """The host's eager dispatch speed right after a case's steps, as calibrate measures its host costs: calibrate's
    small Llama (memlens.measure.host_phases.CALIB_LLAMA, 1 x 16 tokens: the GPU idles) forward and backward, 3
    rounds of 3 steps, the ops of each counted. ``--reprice --host-speed`` scales a table's host costs by this over
    what the table's own costs give for the same ops: the host this case met, in the units the model prices."""
    from memlens.measure.host_phases import CALIB_LLAMA, calib_llama, host_rounds

    model = calib_llama(torch, dev)
    ids = torch.randint(0, CALIB_LLAMA["vocab_size"], (1, 16), device=dev)
    f, b, nf, nb = host_rounds(torch, {"calib": model}, ids, rounds=3, runs=3)["calib"]
    del model
    return {"forward_s": f, "backward_s": b, "forward_ops": nf, "backward_ops": nb}


def dispatch_ratio(table: dict, disp: dict) -> float | None:
    """The probe's seconds (:func:`dispatch_probe`) over the table's raw host costs for the same ops (its
    ``model_forward`` / ``model_backward`` per kernel op and ``view`` per view, at the host calibrate met)."""
    h = table.get("host_us") or {}
    if not disp or not h.get("model_forward") or not h.get("model_backward"):
        return None
    nf, nb = disp["forward_ops"], disp["backward_ops"]
    expected = (h["model_forward"] * nf["kernel"] + h["model_backward"] * nb["kernel"]
                + h.get("view", 0.0) * (nf["view"] + nb["view"])) * 1e-6
    return (disp["forward_s"] + disp["backward_s"]) / expected if expected else None


# ---------------------------------------------------------------- one case, estimated (CPU worker)
def predict(name: str, fields: dict, dry: bool, table: str | None = None) -> dict:
    """memlens' step-time estimate of one case, on the CPU (a worker of main's pool: CUDA hidden, 2 threads, the table
    of MEMLENS_TIMING_TABLE, or ``table`` for this case); its failure is the case's ``predict_error``."""
    import torch

    torch.set_num_threads(2)
    own = os.path.abspath(table) if table else _WORKER_TABLE   # a case without its own table: the worker's, not the last case's
    if own:
        os.environ["MEMLENS_TIMING_TABLE"] = own
    from memlens.estimator import estimate

    t = time.perf_counter()
    try:
        r = estimate(spec_of(fields, dry, own))
    except Exception as e:  # noqa: BLE001 - one case's failure, reported in its line
        return {"predict_error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    st = r.data.get("step_time") or {}
    return {"predicted_seconds": st.get("seconds"), "predicted_parts": st.get("parts"),
            "predicted_table": st.get("table"), "calibrated": st.get("calibrated"), "mfu": st.get("mfu"),
            "tokens_per_s": st.get("tokens_per_s"), "param_count": r.data.get("param_count"),
            "predicted_peak_allocated": r.peak_allocated_bytes, "estimate_seconds": time.perf_counter() - t,
            "predicted_host_range": (st.get("host_range") or {}).get("seconds")}


_WORKER_TABLE: str | None = None     # the table a prediction worker was started with (_predict_worker)


def _predict_worker(table: str | None) -> None:
    """A prediction worker's environment, set before it imports torch (spawned: nothing of the parent's CUDA)."""
    global _WORKER_TABLE
    os.environ.update(OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="")
    if table:
        _WORKER_TABLE = os.environ["MEMLENS_TIMING_TABLE"] = os.path.abspath(table)


def case(name: str, fields: dict, dry: bool) -> dict:
    """One case in its own subprocess (bench/gpu_runner.py; with --gpus 2 one rank of its torchrun job); --dry-run:
    nothing on the device (the estimates run in main's pool)."""
    return {"dry_run": True} if dry else measure(name, fields)


def combined(rounds: list[dict]) -> dict:
    """One case's measured fields from its rounds (each :func:`_measured`'s): the first round's record (its profile)
    with the step seconds, the phases and the host's speed the median of the rounds that measured (``measured_rounds``:
    each round's seconds and host speed); a case no round measured keeps the first round's error."""
    ok = [m for m in rounds if m.get("measured_seconds")]
    if len(rounds) == 1 or not ok:
        return rounds[0]
    out = dict(ok[0])
    out["measured_seconds"] = statistics.median(m["measured_seconds"] for m in ok)
    phases = {k for m in ok for k in (m.get("measured_phases") or {})}
    out["measured_phases"] = {k: statistics.median((m.get("measured_phases") or {}).get(k, 0.0) for m in ok) for k in sorted(phases)}
    speeds = [m["host_speed_ms"] for m in ok if m.get("host_speed_ms")]
    out["host_speed_ms"] = round(statistics.median(speeds), 2) if speeds else None
    disp = [m["dispatch"] for m in ok if m.get("dispatch")]
    if disp:    # the round of the median dispatch speed stands for the case's host
        out["dispatch"] = sorted(disp, key=lambda d: d["forward_s"] + d["backward_s"])[len(disp) // 2]
    out["measured_rounds"] = [{"seconds": m.get("measured_seconds"), "host_speed_ms": m.get("host_speed_ms"),
                               "dispatch": m.get("dispatch"),
                               **({"measure_error": m["measure_error"]} if "measure_error" in m else {})} for m in rounds]
    return out


def _measured(rec: dict) -> dict:
    """The runner's record of a case as the row's measured fields: rank 0's record under torchrun; a failure is
    ``measure_error`` (the row's ``error`` is the relative error of the prediction)."""
    if "ranks" in rec and rec["ranks"]:
        rec = {**rec, **rec["ranks"][0]}
    got = {k: v for k, v in rec.items() if k not in ("name", "ranks", "error", "traceback", "stderr_tail", "dry_run")}
    if "error" in rec:
        got["measure_error"] = ("OOM: " if rec.get("oom") else "") + str(rec["error"])[:300]
    return got


# ---------------------------------------------------------------- the run
def main(argv: list[str] | None = None) -> int:
    ap = runner_args(__doc__.splitlines()[0], timeout=CASE_TIMEOUT)
    ap.add_argument("--gpus", type=int, default=1, choices=(1, 2), help="1: the one-GPU cases; 2: DDP / FSDP2 under torchrun")
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--table", help="an existing timing table (skips calibrate)")
    ap.add_argument("--workers", type=int, default=6, help="estimates side by side (default 6)")
    ap.add_argument("--profile", action="store_true", help="one more step per case under torch.profiler: GPU time per op")
    ap.add_argument("--dispatch", action="store_true", help="after each case's steps, the host's eager dispatch speed "
                    "(calibrate's small Llama, as calibrate times it): --reprice --host-speed scales by it")
    ap.add_argument("--reprice", metavar="JSONL", help="no GPU: the measured records of an earlier run priced again with "
                    "the current model and --table (or the shipped table), written to OUT as a new run's")
    ap.add_argument("--host-speed", action="store_true", help="with --reprice: each record priced with the table's host "
                    "costs scaled by the host's speed beside that case over the speed while calibrate measured them "
                    "(the dispatch speed of a --dispatch record, else host_speed_ms in the record and in the table's "
                    "env): the model's error without the host's drift")
    ap.add_argument("--rounds", type=int, default=1, help="measure every case this many times, a round over all cases "
                    "at a time (the host's speed drifts over minutes): a case's record is the median of its rounds "
                    "(measured_rounds lists them), its profile the first round's")
    ap.add_argument("--set", choices=("main", "new", "new2"), default="main", help="main: the cases above (default); "
                    "new, new2: families the time model was never checked on (one GPU)")
    ap.add_argument("--budget-s", type=float, default=440.0, help="skip the cases left after this many seconds (default 440)")
    args = ap.parse_args(argv)
    cases = CASES_2GPU if args.gpus == 2 else {"main": CASES, "new": CASES_NEW, "new2": CASES_NEW2}[args.set]
    if args.host_speed and not (args.reprice and args.table):
        ap.error("--host-speed scales a table's host costs: give --reprice FILE and --table TABLE (the one the records' "
                 "host speeds are compared with)")
    if args.reprice:   # records of both kinds of run (a 1-GPU and a 2-GPU file, comma-separated) are repriced alike
        cases = {**CASES, **CASES_2GPU, **CASES_NEW, **CASES_NEW2}
    names = [c.name for c in select([Case(n) for n in cases], args.filters)
             if not args.only or c.name in args.only.split(",")]
    if args.list:
        print("\n".join(names))
        return 0
    out = args.out
    os.makedirs(out, exist_ok=True)
    if args.reprice:
        return reprice(args.reprice, out, args.table, args.workers, names, args.host_speed)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    table = args.table or (None if args.dry_run else calibrate(out, args.gpus, env))
    runs = RUNS if not args.dry_run else f"{Path(RUNS).stem}_dry.jsonl"
    if args.fresh and os.path.exists(os.path.join(out, runs)):
        os.unlink(os.path.join(out, runs))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}"] \
        if args.gpus > 1 and not args.dry_run else None
    run_env = {"MEMLENS_TIMING_TABLE": os.path.abspath(table)} if table else {}
    if args.profile:
        run_env[PROFILE_ENV] = "1"
    if args.dispatch:
        run_env[DISPATCH_ENV] = "1"
    rows, preds, env_file = [], {}, "gpu_step_time_env.json"
    pool = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_predict_worker,
                               initargs=(table,))
    skips = {n: cases[n].get("skip") or (None if args.dry_run else _missing(cases[n])) for n in names}
    measured: dict = {n: [] for n in names}
    try:      # the estimates run on the CPU beside the GPU cases
        preds = {n: pool.submit(predict, n, cases[n], args.dry_run) for n in names if not skips[n]}
        for r in range(args.rounds):      # every case once a round: each round meets the host at another moment
            for n in names:
                if skips[n] or time.perf_counter() - t0 > args.budget_s:
                    continue
                key = n if args.rounds == 1 else f"{n}@{r + 1}"
                env_r = {k: v for k, v in run_env.items() if k != PROFILE_ENV or r == 0}   # one profile: the first round's
                run_cases([Case(key, cases[n])], case, out=out, jsonl=RUNS, dry=args.dry_run, timeout=args.timeout,
                          launcher=torchrun, env=env_r, env_file=env_file, quiet=True)
                env_file = False     # the versions and the device are written once, before the first run
                got = _measured(last_records(read_jsonl(os.path.join(out, runs))).get(key, {"error": "no record"}))
                measured[n].append(got)
                if args.rounds > 1:
                    print(f"{key}: measured {got.get('measured_seconds')} s (host {got.get('host_speed_ms')} ms)", flush=True)
        for n in names:
            rec = {"name": n, "spec": {k: v for k, v in cases[n].items() if k not in META}, "base": cases[n].get("base"),
                   "gpus": args.gpus, "table": table}
            if skips[n]:
                rec["skipped"] = skips[n]
            elif not measured[n]:
                rec["skipped"] = f"time budget ({args.budget_s:.0f} s) spent"
            else:
                rec.update(combined(measured[n]))
                rec.update(_prediction(preds[n]))
                _errors(rec)
            rows.append(rec)
            with open(os.path.join(out, JSONL), "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(_short(rec), flush=True)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    md = markdown(rows, time.perf_counter() - t0)
    with open(os.path.join(out, MD), "w") as f:
        f.write(md)
    print(md)
    return 0


def reprice(path: str, out: str, table: str | None, workers: int, names: list[str], host_speed: bool = False) -> int:
    """The measured records of ``path`` (a gpu_step_time.jsonl; several files comma-separated) with fresh predictions;
    ``host_speed``: each with its own table (:func:`host_scaled_table`)."""
    recs = [r for p in path.split(",") for r in read_jsonl(p) if r.get("measured_seconds")]
    recs = [r for r in recs if r["name"] in names]
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_predict_worker,
                               initargs=(table,))
    try:
        # by index: a case measured twice (two runs' files) is two records, each with its own host speed
        own = [host_scaled_table(table, r, out, i) if host_speed else None for i, r in enumerate(recs)]
        futs = [pool.submit(predict, r["name"], r["spec"], False, own[i]) for i, r in enumerate(recs)]
        rows = []
        for i, r in enumerate(recs):
            r = {k: v for k, v in r.items() if not k.startswith("predict") and k not in ("error", "mfu", "tokens_per_s", "calibrated")}
            r.update(_prediction(futs[i]))
            _errors(r)
            rows.append(r)
            print(_short(r), flush=True)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    with open(os.path.join(out, JSONL), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    md = markdown(rows, 0.0)
    with open(os.path.join(out, MD), "w") as f:
        f.write(md)
    print(md)
    return 0


def host_scaled_table(table: str | None, rec: dict, out: str, index: int = 0) -> str | None:
    """``table`` with every host cost (``host_us``) times the host's speed beside ``rec``'s steps over its speed while
    calibrate measured them: the dispatch speed where the record has one (:func:`dispatch_ratio`: --dispatch), else
    the fixed Python loop's (both ``host_speed_ms``: memlens.measure.host_phases.host_speed; the table's median),
    written to ``out``/tables/<index>-<case>.json. None where neither can be compared."""
    if not table:
        return None
    with open(table) as f:
        t = json.load(f)
    cal = (t.get("env") or {}).get("host_speed_ms")
    ratio, by = dispatch_ratio(t, rec.get("dispatch")), "dispatch speed"
    if ratio is None:
        if not cal or not rec.get("host_speed_ms"):
            return None
        ratio, by = rec["host_speed_ms"] / cal[1], "speed"
    t["host_us"] = {k: round(v * ratio, 3) for k, v in t["host_us"].items()}
    t["env"].pop("host_reference_ms", None)   # priced at this record's host, not the table's reference host
    t["source"] = f"{t.get('source', '')}; host costs x {ratio:.3f} (the host's {by} beside {rec['name']})"
    os.makedirs(os.path.join(out, "tables"), exist_ok=True)
    path = os.path.join(out, "tables", f"{index}-{rec['name']}.json")
    with open(path, "w") as f:
        json.dump(t, f)
    return path


def _prediction(fut) -> dict:
    try:
        return fut.result(timeout=600)
    except Exception as e:  # noqa: BLE001 - a worker that died or hung: the case's prediction is missing, said so
        return {"predict_error": f"{type(e).__name__}: {str(e)[:300]}"}


def calibrate(out: str, gpus: int, env: dict) -> str | None:
    import torch

    name = "gpu"
    if torch.cuda.is_available():
        from memlens.measure.calibrate import gpu_name_of

        name = gpu_name_of(torch.cuda.get_device_name(0))
    path = os.path.join(out, f"{name}_timing.json")
    cmd = [sys.executable, "-m", "memlens.cli.main", "calibrate", "--out", path] + ([] if gpus > 1 else ["--no-nccl"])
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    print(p.stdout + p.stderr[-2000:], flush=True)
    print(f"calibrate: {time.perf_counter() - t:.0f} s", flush=True)
    return path if p.returncode == 0 and os.path.exists(path) else None


def _errors(rec: dict) -> None:
    m, p = rec.get("measured_seconds"), rec.get("predicted_seconds")
    if m and p:
        rec["error"] = (p - m) / m


def _short(rec: dict) -> str:
    if rec.get("skipped"):
        return f"{rec['name']}: skipped ({rec['skipped']})"
    m, p = rec.get("measured_seconds"), rec.get("predicted_seconds")
    err = f"{rec['error'] * 100:+.1f}%" if rec.get("error") is not None else ""
    bad = rec.get("measure_error") or rec.get("predict_error") or ""
    return f"{rec['name']}: measured {m if m is None else f'{m:.4f}'} s, predicted {p if p is None else f'{p:.4f}'} s {err} {bad}"


def markdown(rows: list[dict], seconds: float) -> str:
    by = {r["name"]: r for r in rows}
    lines = ["| case | measured s | predicted s | error | fwd m/p | bwd(+recompute) m/p | optim m/p | overhead vs base m/p | host ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    errs = []
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['name']} | skipped: {r['skipped']} | | | | | | | |")
            continue
        m, p = r.get("measured_seconds"), r.get("predicted_seconds")
        mp, pp = r.get("measured_phases") or {}, r.get("predicted_parts") or {}
        if r.get("error") is not None:
            errs.append(abs(r["error"]))

        def pair(a, b):
            return f"{a:.4f}/{b:.4f}" if a is not None and b is not None else ""

        host = pp.get("host", 0.0)   # the GPU's waits on the host fall inside the phases it measures
        fwd_p = pp.get("forward", 0) + host * _share(pp, "forward")
        bwd_p = pp.get("backward", 0) + pp.get("recompute", 0) + host * _share(pp, "backward")
        over = ""
        base = by.get(r.get("base") or "")
        if base and base.get("measured_seconds") and base.get("predicted_seconds") and m and p:
            om, op_ = m / base["measured_seconds"] - 1, p / base["predicted_seconds"] - 1
            over = f"{om * 100:+.1f}% / {op_ * 100:+.1f}% ({(op_ - om) * 100:+.1f} pp)"
        err = f"{r['error'] * 100:+.1f}%" if r.get("error") is not None else (r.get("measure_error") or r.get("predict_error") or "")
        lines.append(f"| {r['name']} | {'' if m is None else f'{m:.4f}'} | {'' if p is None else f'{p:.4f}'} | {err} | "
                     f"{pair(mp.get('forward'), fwd_p)} | {pair(mp.get('backward'), bwd_p)} | "
                     f"{pair(mp.get('optimizer'), pp.get('optimizer'))} | {over} | {r.get('host_speed_ms') or ''} |")
    # host ms: memlens.measure.host_phases.host_speed beside the case's steps (a fixed Python loop; lower is faster)
    tab = next((r.get("predicted_table") for r in rows if r.get("predicted_table")), "")
    summary = (f"\n{len(errs)} cases measured and predicted; median |error| {statistics.median(errs) * 100:.1f}%, "
               f"max {max(errs) * 100:.1f}%" if errs else "\nno case both measured and predicted")
    return "\n".join(lines) + summary + f"; table: {tab}; run {seconds:.0f} s\n"


def _share(pp: dict, part: str) -> float:
    tot = pp.get("forward", 0) + pp.get("backward", 0) + pp.get("recompute", 0)
    if not tot:
        return 0.0
    return (pp.get(part, 0) + (pp.get("recompute", 0) if part == "backward" else 0)) / tot


if __name__ == "__main__":
    sys.exit(main())
