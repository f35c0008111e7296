"""Real TRL 1.16 trainers (SFTTrainer, DPOTrainer, GRPOTrainer) on one GPU beside memlens' estimate of the same step.

Run on the GPU machine from the repo root (trl, datasets, dill, multiprocess and, for --liger, liger-kernel as
wheels in ./.whl/; no network needed):

    python -m pip install --no-deps .whl/*.whl
    python bench/gpu_trl.py [--out DIR] [--liger] [--model qwen2.5-0.5b] [case-substring ...]
    python bench/gpu_trl.py --dry-run            # on a CPU: tiny model, the real trainers 2 steps, estimates

Each case runs in its own subprocess (an OOM or a crash loses one case). The model is memlens' built-in config with
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

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
                else:
                    peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))

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


def request(name: str, a, part: str) -> str:
    trainer, f, extra = CASES[name]
    f = dict(f)
    if a.dry_run:
        f = {**{k: v for k, v in f.items() if k in ("lora_rank", "packing", "beta")}, **TINY[trainer]}
    req = {"name": name, "trainer": trainer, "fields": f, "extra": extra, "model": a.model, "liger": a.liger,
           "device": "cpu" if a.dry_run else "cuda", "steps": 2 if a.dry_run else 3, "part": part}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(req, fh)
    return fh.name


def start(name: str, a, part: str) -> tuple[subprocess.Popen, str]:
    """The case's estimate (CPU, several at once) or its real run (the GPU, one at a time) in a subprocess."""
    path = request(name, a, part)
    env = {**os.environ, "OMP_NUM_THREADS": "2"} if part == "estimate" else None
    return subprocess.Popen([sys.executable, __file__, "--case", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env), path


def finish(name: str, proc: subprocess.Popen, path: str, timeout: float) -> dict:
    try:
        out, err = proc.communicate(timeout=max(1, timeout))
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if proc.returncode == 0 and lines:
            return json.loads(lines[-1])
        return {"case": name, "error": (err or out).strip().splitlines()[-3:] or [f"exit {proc.returncode}"]}
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"case": name, "error": [f"timeout after {CASE_TIMEOUT} s"]}
    finally:
        os.unlink(path)


def table(rows: list[dict]) -> str:
    gib = 2 ** 30
    out = ["| case | estimate alloc | real alloc | error | estimate reserved | real reserved | error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['case']} | failed: {' '.join(r['error'])[:120]} | | | | | |")
            continue
        real = r.get("real_peak_allocated_bytes")
        out.append(f"| {r['case']}{' +liger' if r.get('liger') else ''} | {r['estimate_peak_allocated_bytes'] / gib:.3f} GiB | "
                   + (f"{real / gib:.3f} GiB | {r['allocated_error']:+.2%} | {r['estimate_peak_reserved_bytes'] / gib:.3f} GiB | "
                      f"{r['real_peak_reserved_bytes'] / gib:.3f} GiB | {r['reserved_error']:+.2%} |" if real else "(dry run) | | | | |"))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("filters", nargs="*", help="run the cases whose name contains one of these")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--model", default=None, help="a memlens model (default qwen2.5-0.5b; the tiny Llama with --dry-run)")
    ap.add_argument("--liger", action="store_true", help="use_liger_kernel=True (needs liger-kernel, and memlens' --liger)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny sizes, the real trainers for 2 steps, estimates only")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        print(json.dumps(case_main(json.loads(Path(a.case).read_text()))))
        return 0
    a.model = a.model or (os.path.join(ROOT, "tests/fixtures/models/tiny-llama/config.json") if a.dry_run else "qwen2.5-0.5b")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in CASES if not a.filters or any(s in n for s in a.filters)]
    t_all = time.perf_counter()
    estimates = {n: start(n, a, "estimate") for n in names}     # the CPU estimates beside the GPU runs
    rows = []
    for n in names:
        t = time.perf_counter()
        proc, path = start(n, a, "train")
        r = finish(n, proc, path, CASE_TIMEOUT)
        e = finish(n, *estimates[n], t_all + ESTIMATES_WITHIN - time.perf_counter())
        r = {**e, **r} if "error" not in e else {**r, "estimate_error": e["error"]}
        if r.get("real_peak_allocated_bytes") and r.get("estimate_peak_allocated_bytes"):
            r["allocated_error"] = round(r["estimate_peak_allocated_bytes"] / r["real_peak_allocated_bytes"] - 1, 4)
            r["reserved_error"] = round(r["estimate_peak_reserved_bytes"] / r["real_peak_reserved_bytes"] - 1, 4)
        r["case_seconds"] = round(time.perf_counter() - t, 1)
        rows.append(r)
        with open(out / "gpu_trl.jsonl", "a") as fh:
            fh.write(json.dumps(r) + "\n")
        print(f"{n}: {'failed' if 'error' in r else 'ok'} ({r['case_seconds']} s) backbone inputs {r.get('backbone_inputs')}",
              file=sys.stderr, flush=True)
    print(table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
