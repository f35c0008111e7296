"""What a CUDA GPU does with OLMoE's experts (transformers' default ``grouped_mm`` experts implementation)
in fp32 and bf16, with and without LoRA on them, against memlens' estimate.

Run on the GPU machine from the repo root (about 2 minutes on an H100):

    python bench/gpu_moe_probe.py            # OUT (env, default ./out)/gpu_moe_probe.jsonl, a markdown table last
    python bench/gpu_moe_probe.py --dry-run  # CPU: estimates only (the same small OLMoE)

The model: an OLMoE-shaped config (16 experts, top-4, H 1024, I 512, 4 layers, vocab 8192; written to
OUT/olmoe-probe.json). Each case in its own subprocess (bench/gpu_runner.py; resumed, --fresh starts over): does the step run, which experts implementation
transformers chose, which CUDA kernels the grouped matmuls ran (torch.profiler over one step: the
CUTLASS bf16 grouped GEMM, or the fallback's per-expert GEMMs), whether ``torch._grouped_mm`` was
called; real peak = torch.cuda.max_memory_allocated / max_memory_reserved over steps 2-3 of memlens'
prepared step (the code estimate simulates); then memlens' estimate of the same spec in the same
subprocess. memlens models fp32/fp16 ``torch._grouped_mm`` as CUDA's fallback loop
(estimator/cuda_rules.py LoopedGroupedMM) and LoRA on the experts as peft's ParamWrapper runs it.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_runner import estimate_spec, list_or_run, off, runner_args  # noqa: E402

JSONL = "gpu_moe_probe.jsonl"
CONFIG = {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "hidden_size": 1024, "intermediate_size": 512,
          "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 16,
          "num_experts_per_tok": 4, "vocab_size": 8192, "max_position_embeddings": 4096, "tie_word_embeddings": False,
          "norm_topk_prob": False, "pad_token_id": 1, "eos_token_id": 2, "bos_token_id": None}
BASE = {"batch_size": 4, "seq_len": 512}
CASES = [
    ("fp32-full", {**BASE}),
    ("bf16-full", {**BASE, "precision": "bf16"}),
    ("amp-bf16-lora-attn", {**BASE, "precision": "amp-bf16", "lora_rank": 16}),
    ("fp32-lora-attn", {**BASE, "lora_rank": 16}),
    ("bf16-lora-attn", {**BASE, "precision": "bf16", "lora_rank": 16}),
    ("fp32-lora-experts", {**BASE, "lora_rank": 16, "lora_targets": ["experts.gate_up_proj", "experts.down_proj"]}),
    ("bf16-lora-experts", {**BASE, "precision": "bf16", "lora_rank": 16, "lora_targets": ["experts.gate_up_proj", "experts.down_proj"]}),
    ("bf16-lora-all-linear", {**BASE, "precision": "bf16", "lora_rank": 16, "lora_targets": ["all-linear"]}),
]


def kernels(step) -> dict:
    """CUDA kernels and aten grouped-mm calls of one more step, from the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step.run(lambda ph: None)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    gemm = sorted({n for n in names if any(w in n.lower() for w in ("grouped", "cutlass", "gemm", "sm90"))})[:12]
    return {"grouped_mm_calls": sum(e.count for e in prof.key_averages() if e.key == "aten::_grouped_mm"),
            "mm_calls": sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::mm_out")),
            "gemm_kernels": gemm}


def case(name: str, fields: dict, dry: bool) -> dict:
    """One case, in its own subprocess (bench/gpu_runner.py); an error is the answer (does it run?)."""
    rec: dict = {"fields": fields}
    if not dry:
        import torch

        from bench.gpu_truth import run_case
        from memlens.core.spec import TrainingSpec
        from memlens.step import prepare

        r = run_case(name, fields)
        rec.update({k: r[k] for k in ("max_reserved", "param_bytes", "start_allocated")},
                   max_allocated=max(s["peak_allocated"] for s in r["steps"]),
                   max_allocated_after_warmup=max(s["peak_allocated"] for s in r["steps"][1:]))
        step = prepare(TrainingSpec(**fields), device=torch.device("cuda"))
        cfg = step.model.config
        rec["experts_implementation"] = getattr(cfg, "_experts_implementation", None)
        rec["expert_dtype"] = str(next(p.dtype for n, p in step.model.named_parameters() if "experts" in n))
        step.run(lambda ph: None)
        rec.update(kernels(step))
    est = estimate_spec(fields)
    rec.update({k: est[k] for k in ("estimated_peak_allocated", "estimated_peak_reserved", "estimate_seconds")})
    return rec


def mib(b) -> str:
    return f"{b / 2**20:.1f} MiB" if b else "-"


COLUMNS = [("experts impl", lambda r: r.get("experts_implementation", "-")),
           ("grouped_mm calls", lambda r: r.get("grouped_mm_calls", "-")),
           ("kernels", lambda r: ", ".join(k[:40] for k in r.get("gemm_kernels", [])[:3])),
           ("real alloc (2-3)", lambda r: mib(r.get("max_allocated_after_warmup"))),
           ("memlens alloc", lambda r: mib(r.get("estimated_peak_allocated"))),
           ("off", lambda r: off(r.get("estimated_peak_allocated"), r.get("max_allocated_after_warmup")))]


def main(argv: list[str] | None = None) -> None:
    a = runner_args(__doc__.splitlines()[0]).parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    model = os.path.abspath(os.path.join(a.out, "olmoe-probe.json"))
    with open(model, "w") as f:
        json.dump(CONFIG, f)
    list_or_run(a, [(n, {**f, "model": model}) for n, f in CASES], fn=case, jsonl=JSONL, columns=COLUMNS)


if __name__ == "__main__":
    main()
