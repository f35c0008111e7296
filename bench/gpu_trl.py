"""Real TRL 1.16 trainers (SFTTrainer, DPOTrainer, GRPOTrainer) on one GPU beside memlens' estimate of the same step.

Run on the GPU machine from the repo root (trl, datasets, dill, multiprocess and, for --liger, liger-kernel as
wheels in ./.whl/; no network needed):

    python -m pip install --no-deps .whl/*.whl
    python bench/gpu_trl.py [--out DIR] [--liger] [--model qwen2.5-0.5b] [--jobs N] [--cases a,b] [--probe] [case-substring ...]
    python bench/gpu_trl.py --jobs 5 --probe       # the 9 cases, 5 at once (each < 8 GiB of the 80): about 2 minutes
    python bench/gpu_trl.py --dry-run            # on a CPU: tiny model, the real trainers 2 steps, estimates

Each case runs in its own subprocess (bench/gpu_runner.py: an OOM or a crash loses one case; a case already run, in
OUT/gpu_trl_runs.jsonl and OUT/gpu_trl_estimates.jsonl, is skipped: --fresh runs it again). The model is memlens' built-in config with
random weights, saved to a temporary directory and given to the trainer by path, as a user does (so DPO and GRPO
build their reference model from it: ``create_model_from_path``); the tokenizer is a word-level one made here (the
tokenizers library, no download); the datasets are synthetic text of exact token counts, so every row is at its
length limit (memlens' worst case). The trainer runs 3 optimizer steps; a callback resets the peak counters after
step 1 (the warm-up: optimizer state created) and reads ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` after steps 2 and 3. memlens' estimate of the same spec is computed in the same process
(fake tensors on the CPU). One JSON line per case is appended to OUT/gpu_trl.jsonl as it comes; a markdown table
is printed last. Budget: about 5 minutes on an H100.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_runner import Case, last_records, read_jsonl, run_cases  # noqa: E402

CASE_TIMEOUT = 240
ESTIMATES_WITHIN = 420   # seconds: every estimate (all started at once, on the CPU) must be done by then
WORDS = [2000]        # the tokenizer's words (ids 0..WORDS-1), then <pad>, </s>, <unk> (fewer for a tiny vocabulary)

# name -> (trainer, memlens spec fields, TRL config fields); lengths in tokens
CASES = {
    "sft-full": ("sft", dict(batch_size=4, seq_len=1024), dict(packing=False)),
    "sft-full-bfd": ("sft", dict(batch_size=4, seq_len=1024, packing="bfd"), dict(packing=True)),
    "sft-lora": ("sft", dict(batch_size=4, seq_len=1024, lora_rank=16), dict(packing=False)),
    "sft-lora-bfd": ("sft", dict(batch_size=4, seq_len=1024, lora_rank=16, packing="bfd"), dict(packing=True)),
    "dpo-full": ("dpo", dict(batch_size=2, seq_len=513, prompt_len=256), dict()),
    "dpo-lora": ("dpo", dict(batch_size=2, seq_len=513, prompt_len=256, lora_rank=16), dict()),
    "grpo-full": ("grpo", dict(batch_size=8, seq_len=128, max_completion_length=256), dict()),
    "grpo-full-beta": ("grpo", dict(batch_size=8, seq_len=128, max_completion_length=256, beta=0.04), dict()),
    "grpo-lora-beta": ("grpo", dict(batch_size=8, seq_len=128, max_completion_length=256, beta=0.04, lora_rank=16), dict()),
}
TINY = {"sft": dict(batch_size=2, seq_len=32), "dpo": dict(batch_size=2, seq_len=33, prompt_len=16),
        "grpo": dict(batch_size=4, seq_len=8, max_completion_length=8, num_generations=4)}


def tokenizer():
    """A word-level tokenizer: "w17" -> 17, no special tokens added around a text (exact token counts)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n = WORDS[0]
    vocab = {f"w{i}": i for i in range(n)}
    vocab.update({"<pad>": n, "</s>": n + 1, "<unk>": n + 2})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def text(n: int, seed: int) -> str:
    import random

    r = random.Random(seed)
    return " ".join(f"w{r.randrange(WORDS[0])}" for _ in range(n))


def dataset(trainer: str, f: dict, rows: int):
    """Rows at the length limit: SFT texts of seq_len tokens (the EOS SFT appends is truncated away); DPO prompts of
    prompt_len tokens and completions that fill seq_len with the EOS DPO appends; GRPO prompts of seq_len tokens."""
    from datasets import Dataset

    L, p = f["seq_len"], f.get("prompt_len", 0)
    if trainer == "sft":
        return Dataset.from_dict({"text": [text(L + 1, i) for i in range(rows)]})   # truncated to max_length
    if trainer == "dpo":
        c = L - p - 1
        return Dataset.from_dict({"prompt": [text(p, i) + " " for i in range(rows)], "chosen": [text(c, 10_000 + i) for i in range(rows)],
                                  "rejected": [text(c, 20_000 + i) for i in range(rows)]})
    return Dataset.from_dict({"prompt": [text(L, i) for i in range(rows)]})


def spec_of(trainer: str, f: dict, model: str, liger: bool, device: str):
    from memlens.core.spec import TrainingSpec

    extra = {"liger": True} if liger else {}
    return TrainingSpec(model=model, trainer=trainer, precision="bf16-amp" if device == "cuda" else "fp32",
                        grad_checkpointing=True, optimizer="adamw-fused" if device == "cuda" else "adamw",
                        max_grad_norm=1.0, **f, **extra)


def trl_config(trainer: str, f: dict, extra: dict, out: str, steps: int, liger: bool, device: str):
    import trl

    common = dict(output_dir=out, per_device_train_batch_size=f["batch_size"], max_steps=steps, logging_steps=1000,
                  save_strategy="no", report_to=[], use_liger_kernel=liger, use_cpu=device == "cpu",
                  bf16=device == "cuda", model_init_kwargs={"dtype": "bfloat16" if device == "cuda" else "float32",
                                                            "attn_implementation": "sdpa"},
                  dataloader_num_workers=0, seed=0)
    if device == "cpu":
        common["optim"] = "adamw_torch"
    if trainer == "sft":
        return trl.SFTConfig(**common, max_length=f["seq_len"], dataset_text_field="text", **extra)
    if trainer == "dpo":
        return trl.DPOConfig(**common, max_length=f["seq_len"], **extra)
    return trl.GRPOConfig(**common, max_completion_length=f["max_completion_length"], beta=f.get("beta", 0.0),
                          num_generations=f.get("num_generations", 8), **extra)


def live_at_peak(trace: list) -> tuple[int, list]:
    """Replay one device's allocator trace (torch.cuda.memory._snapshot()["device_traces"]): the highest sum of live
    blocks, and the blocks alive at that moment."""
    live: dict = {}
    total = best = at = 0
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev["size"]
            total += ev["size"]
            if total > best:
                best, at = total, i
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])
    live = {}
    for ev in trace[:at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    return best, sorted(live.values(), key=lambda ev: -ev["size"])


def write_probe(req: dict, snap: dict, max_allocated: int) -> None:
    """--probe: the blocks allocated in step 2 and alive at its peak, their sizes and innermost Python frames, as
    OUT/probe_<case>.json. It decides whether the tied embedding's two [V, H] gradients are summed in place at the
    embedding's backward (autograd's InputBuffer: two [V, H] blocks live there) or into a third block."""
    import torch
    import transformers

    trace = max(snap.get("device_traces") or [[]], key=len)
    peak, blocks = live_at_peak(trace)
    def frames(ev):
        return [f"{Path(fr['filename']).name}:{fr['line']} {fr['name']}" for fr in ev.get("frames", [])
                if fr.get("filename", "").endswith(".py")][:4]
    out = {"case": req["name"], "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__, "max_allocated_last_step": max_allocated,
           "peak_of_step_2_allocations": peak,   # blocks from before step 2 (weights, Adam state) are not in the trace
           "blocks": [{"size": b["size"], "frames": frames(b)} for b in blocks[:200]]}
    Path(req["out"]).mkdir(parents=True, exist_ok=True)
    (Path(req["out"]) / f"probe_{req['name']}.json").write_text(json.dumps(out, indent=1))


def case_main(req: dict) -> dict:
    """One case in this process: the real trainer's peaks, then memlens' estimate."""
    import torch
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback

    from memlens.estimator import estimate
    from memlens.models.source import resolve

    trainer, f, extra = req["trainer"], req["fields"], req["extra"]
    device, steps = req["device"], req["steps"]
    rec: dict = {"case": req["name"], "trainer": trainer, "fields": f, "model": req["model"], "liger": req["liger"]}
    t0 = time.perf_counter()
    if req["part"] == "estimate":
        spec = spec_of(trainer, f, req["model"], req["liger"], device)
        est = estimate(spec)
        rec.update(estimate_peak_allocated_bytes=est.peak_allocated_bytes, estimate_peak_reserved_bytes=est.peak_reserved_bytes,
                   estimate_by_phase={k: v["peak_allocated_bytes"] for k, v in est.by_phase.items()},
                   estimate_seconds=round(time.perf_counter() - t0, 1), spec=spec.to_dict())
        return rec
    with tempfile.TemporaryDirectory() as tmp:
        cfg = resolve(req["model"]).config
        WORDS[0] = min(WORDS[0], cfg.vocab_size - 3)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        model.save_pretrained(f"{tmp}/model")
        del model
        peaks: list = []

        class Peaks(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                if device != "cuda":
                    return
                torch.cuda.synchronize()
                if state.global_step == 1:
                    torch.cuda.reset_peak_memory_stats()
                    if req.get("probe"):
                        torch.cuda.memory._record_memory_history(max_entries=500000)
                else:
                    peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
                    if req.get("probe") and state.global_step == 2:
                        snap = torch.cuda.memory._snapshot()
                        torch.cuda.memory._record_memory_history(enabled=None)
                        write_probe(req, snap, peaks[-1][0])

        peft = None
        if f.get("lora_rank"):
            from peft import LoraConfig

            peft = LoraConfig(r=f["lora_rank"], lora_alpha=2 * f["lora_rank"], task_type="CAUSAL_LM")
        args = trl_config(trainer, f, extra, f"{tmp}/out", steps, req["liger"], device)
        kw = dict(model=f"{tmp}/model", args=args, processing_class=tokenizer(), peft_config=peft,
                  train_dataset=dataset(trainer, f, f["batch_size"] * steps * 2))
        if trainer == "grpo":
            kw["reward_funcs"] = lambda completions, **_: [0.0] * len(completions)
        cls = {"sft": trl.SFTTrainer, "dpo": trl.DPOTrainer, "grpo": trl.GRPOTrainer}[trainer]
        t1 = time.perf_counter()
        tr = cls(**kw, callbacks=[Peaks()])
        seen: list = []
        base = tr.model.get_base_model() if hasattr(tr.model, "get_base_model") else tr.model

        def look(mod, args, kwargs):   # what the backbone is given (memlens.models.trl_batch's assumptions)
            ids = kwargs.get("input_ids", args[0] if args else None)
            key = [list(ids.shape) if ids is not None else None, sorted(k for k, v in kwargs.items() if v is not None and k in
                   ("attention_mask", "position_ids", "past_key_values"))]
            if key not in seen:
                seen.append(key)

        hook = base.base_model.register_forward_pre_hook(look, with_kwargs=True)
        tr.train()
        hook.remove()
        rec["backbone_inputs"] = seen
        rec["train_seconds"] = round(time.perf_counter() - t1, 1)
    if peaks:
        rec["real_peak_allocated_bytes"] = max(a for a, _ in peaks)
        rec["real_peak_reserved_bytes"] = max(r for _, r in peaks)
    return rec


def request(name: str, a, part: str) -> dict:
    """The case's request: what case_main runs (the real trainer and the estimate, or the estimate alone)."""
    trainer, f, extra = CASES[name]
    f = dict(f)
    if a.dry_run:
        f = {**{k: v for k, v in f.items() if k in ("lora_rank", "packing", "beta")}, **TINY[trainer]}
    return {"name": name, "trainer": trainer, "fields": f, "extra": extra, "model": a.model, "liger": a.liger,
            "device": "cpu" if a.dry_run else "cuda", "steps": 2 if a.dry_run else 3, "part": part,
            "probe": a.probe and part == "train", "out": str(Path(a.out).resolve())}


def case(name: str, req: dict, dry: bool) -> dict:
    """One case (its estimate, or its real run) in its own subprocess (bench/gpu_runner.py)."""
    return case_main(req)


def table(rows: list[dict]) -> str:
    gib = 2 ** 30
    out = ["| case | estimate alloc | real alloc | error | estimate reserved | real reserved | error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            err = r["error"] if isinstance(r["error"], str) else " ".join(r["error"])
            out.append(f"| {r['case']} | failed: {err[:120]} | | | | | |")
            continue
        real = r.get("real_peak_allocated_bytes")
        out.append(f"| {r['case']}{' +liger' if r.get('liger') else ''} | {r['estimate_peak_allocated_bytes'] / gib:.3f} GiB | "
                   + (f"{real / gib:.3f} GiB | {r['allocated_error']:+.2%} | {r['estimate_peak_reserved_bytes'] / gib:.3f} GiB | "
                      f"{r['real_peak_reserved_bytes'] / gib:.3f} GiB | {r['reserved_error']:+.2%} |" if real else "(dry run) | | | | |"))
    return "\n".join(out)


def both(names: list[str], a, out: Path) -> list[dict]:
    """The estimates (CPU, all at once) in a thread beside the real runs (the GPU, ``a.jobs`` at a time: each its own
    process, max_memory_allocated is per process, each case well under 8 GiB of the 80); one row a case, joined."""
    run = dict(out=out, dry=a.dry_run, fresh=a.fresh, env_file=False, quiet=True)
    est = threading.Thread(target=run_cases, args=([Case(n, request(n, a, "estimate"), env={"OMP_NUM_THREADS": "2"})
                                                    for n in names], case),
                           kwargs=dict(run, jsonl="gpu_trl_estimates.jsonl", jobs=max(1, len(names)), timeout=ESTIMATES_WITHIN))
    est.start()
    run_cases([Case(n, request(n, a, "train")) for n in names], case, jsonl="gpu_trl_runs.jsonl", jobs=a.jobs,
              timeout=CASE_TIMEOUT, **{**run, "quiet": False, "columns": [("backbone inputs", lambda r: r.get("backbone_inputs"))]})
    est.join()
    suffix = "_dry.jsonl" if a.dry_run else ".jsonl"
    reals = last_records(read_jsonl(out / f"gpu_trl_runs{suffix}"))
    ests = last_records(read_jsonl(out / f"gpu_trl_estimates{suffix}"))
    rows = []
    for n in names:
        r, e = reals.get(n, {"case": n, "error": "no record"}), ests.get(n, {"case": n, "error": "no record"})
        r = {**e, **r} if "error" not in e else {**r, "estimate_error": e["error"]}
        r["case"] = n
        if r.get("real_peak_allocated_bytes") and r.get("estimate_peak_allocated_bytes"):
            r["allocated_error"] = round(r["estimate_peak_allocated_bytes"] / r["real_peak_allocated_bytes"] - 1, 4)
            r["reserved_error"] = round(r["estimate_peak_reserved_bytes"] / r["real_peak_reserved_bytes"] - 1, 4)
        r["case_seconds"] = r.get("seconds")
        with open(out / "gpu_trl.jsonl", "a") as fh:
            fh.write(json.dumps(r) + "\n")
        rows.append(r)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("filters", nargs="*", help="run the cases whose name contains one of these")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--model", default=None, help="a memlens model (default qwen2.5-0.5b; the tiny Llama with --dry-run)")
    ap.add_argument("--liger", action="store_true", help="use_liger_kernel=True (needs liger-kernel, and memlens' --liger)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny sizes, the real trainers for 2 steps, estimates only")
    ap.add_argument("--cases", type=lambda v: [c for c in v.split(",") if c], default=None,
                    help="the cases to run, by exact name, comma-separated (with filters: both must match)")
    ap.add_argument("--jobs", type=int, default=1, help="real runs at once on the one GPU (each its own process)")
    ap.add_argument("--probe", action="store_true", help="record step 2's allocations (torch.cuda.memory."
                    "_record_memory_history) and write the blocks alive at its peak to OUT/probe_<case>.json")
    ap.add_argument("--fresh", action="store_true", help="run every case again (default: cases done are skipped)")
    a = ap.parse_args()
    if a.jobs < 1:
        ap.error("--jobs must be at least 1")
    a.model = a.model or (os.path.join(ROOT, "tests/fixtures/models/tiny-llama/config.json") if a.dry_run else "qwen2.5-0.5b")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in CASES if (not a.filters or any(s in n for s in a.filters)) and (not a.cases or n in a.cases)]
    unknown = sorted(set(a.cases or ()) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; the cases: {', '.join(CASES)}")
    rows = both(names, a, out)
    print(table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
