"""Measure the generality accuracy set (bench/generality_cases.py) on a CUDA GPU.

Run on the GPU machine from the repo root (each part ~4 minutes on an H100 80 GB):

    python bench/gpu_generality.py OUT_DIR --part 1     # eager steps of memlens' loop
    python bench/gpu_generality.py OUT_DIR --part 2     # the HF Trainer and torch.compile cases

Each case runs in a fresh subprocess (bench/gpu_runner.py; cases already there are skipped, --fresh starts over,
--dry-run estimates on the CPU) and appends one JSON line to OUT_DIR/gpu_generality.jsonl:
max_memory_allocated / max_memory_reserved over 3 optimizer steps, per-step peaks, what the
step ran. Trainer
cases run transformers.Trainer.train() for 3 steps on the model memlens builds and write their
TrainingArguments (to_json_string) to OUT_DIR/trainer_args_<case>.json. Cases whose model
library (timm, torchvision) the CPU machine lacks are also estimated here, on this machine's
CPU after the measurement ("estimate_here"), so bench/generality_accuracy.py can compare them.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_runner import list_or_run, runner_args  # noqa: E402

STEPS = 3
JSONL = "gpu_generality.jsonl"


def run_trainer_case(name: str, fields: dict, targs: dict, out: str) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments

    from memlens.core.spec import TrainingSpec
    from memlens.models.build import build, quiet
    from memlens.models.source import resolve

    spec = TrainingSpec(**fields)
    weights = spec.replace(precision="fp32", hf_trainer=False, optimizer="adamw", max_grad_norm=None)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with quiet():
        built = build(weights, resolve(spec.model), device=dev)
    model, L = built.model, built.seq_len
    del built   # its synthetic batch would stay on the GPU: the Trainer reads the dataset below
    vocab = model.config.vocab_size
    n = spec.batch_size * spec.grad_accum * STEPS
    data = [{"input_ids": torch.randint(0, vocab, (L,))} for _ in range(n)]

    def collate(samples):  # labels are the inputs (memlens' batch: one tensor under both keys)
        ids = torch.stack([s["input_ids"] for s in samples])
        return {"input_ids": ids, "labels": ids}

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, max_steps=STEPS, report_to="none", save_strategy="no", logging_strategy="no",
                                 remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True, seed=0, **targs)
        with open(os.path.join(out, f"trainer_args_{name}.json"), "w") as f:
            f.write(args.to_json_string())
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        torch.cuda.synchronize()
        rec = {"name": name, "kind": "trainer", "spec": spec.to_dict(), "trainer_args": targs,
               "start_allocated": torch.cuda.memory_allocated(), "use_cache": getattr(model.config, "use_cache", None)}
        t0 = time.perf_counter()
        with quiet():
            trainer.train()
        torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    rec.update(seconds=time.perf_counter() - t0, max_allocated=torch.cuda.max_memory_allocated(),
               max_reserved=stats["reserved_bytes.all.peak"], optimizer=type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer).__name__,
               fused=[g.get("fused") for g in trainer.optimizer.param_groups], n_param_groups=len(trainer.optimizer.param_groups))
    return rec


def run_spec_case(name: str, fields: dict) -> dict:
    import torch

    from bench.gpu_truth import run_case

    rec = run_case(name, fields)
    rec["kind"] = "spec"
    rec["cudnn_version"] = torch.backends.cudnn.version()
    if rec.get("max_allocated") and ":" not in str(fields["model"]):   # what this transformers builds (MoE experts kernel)
        from memlens.core.spec import TrainingSpec
        from memlens.models.build import build, quiet
        from memlens.models.source import resolve

        with torch.device("meta"), quiet():
            m = build(TrainingSpec(**fields), resolve(fields["model"])).model
        cfg = getattr(m, "config", None)
        rec["experts_implementation"] = getattr(cfg, "_experts_implementation", None)
        rec["attn_implementation"] = getattr(cfg, "_attn_implementation", None)
    return rec


def estimate_here(fields: dict) -> dict:
    """memlens' estimate on this machine's CPU (for models whose library the CPU machine lacks)."""
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    t = time.perf_counter()
    r = estimate(TrainingSpec(**fields))
    return {"estimated_peak_allocated": r.peak_allocated_bytes, "estimated_peak_reserved": r.peak_reserved_bytes,
            "estimate_seconds": time.perf_counter() - t}


def case(name: str, payload: dict, dry: bool) -> dict:
    """One case in its own subprocess (bench/gpu_runner.py); --dry-run: the estimate only (CPU)."""
    from bench.generality_cases import TRAINER_ARGS

    kind, fields, out = payload["kind"], payload["fields"], payload["out"]
    if dry:
        return {"kind": kind, **estimate_here(fields)}
    rec = run_trainer_case(name, fields, TRAINER_ARGS[name], out) if kind == "trainer" else run_spec_case(name, fields)
    if str(fields["model"]).startswith(("timm:", "torchvision:")):
        rec["estimate_here"] = estimate_here(fields)
    return rec


def main(argv: list[str] | None = None) -> None:
    from bench.generality_cases import CASES, PART2

    ap = runner_args(__doc__.splitlines()[0], out_positional=True, timeout=420)
    ap.add_argument("--part", choices=("1", "2", "all"), default="all", help="1: eager steps, 2: Trainer and compile")
    a = ap.parse_args(argv)
    out = os.path.abspath(a.out)
    cases = [(n, {"kind": k, "fields": f, "out": out}) for n, k, f in CASES
             if not (a.part == "1" and n in PART2) and not (a.part == "2" and n not in PART2)]
    list_or_run(a, cases, fn=case, jsonl=JSONL)


if __name__ == "__main__":
    main()
