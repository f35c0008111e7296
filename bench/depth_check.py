"""Layers written from 3- and 4-layer models (memlens.estimator.depth) against the whole model simulated.

    python bench/depth_check.py            # every case below (~10 minutes on 2 cores)
    python bench/depth_check.py gpt2 vit   # cases whose name contains one of these

For each case the step is simulated twice in one process: as `estimate` does it (a stack of 10 or
more layers written from two shallow models where that is shown) and with the whole model
simulated (steps 2.. still written from step 1, as before). Then the same for the case one sample
larger: its family is checked by then, so it is written from its 4-layer simulation alone. The two event logs must be equal event
for event, module names included, and so must the parameter counts and the peaks. Each path is
timed after a warm-up simulation of the same model (CPU seconds of the simulation itself, no
imports). Writes bench/results/depth_check.{json,md}; exits 1 if anything differs.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.report import write_results  # noqa: E402

CASES = [
    ("gpt2-fp32-b8-L512", dict(model="gpt2", batch_size=8, seq_len=512)),
    ("gpt2-ampfp16-b4-L256", dict(model="gpt2", batch_size=4, seq_len=256, precision="amp-fp16")),
    ("gpt2-ampbf16-ckpt-b4-L256", dict(model="gpt2", batch_size=4, seq_len=256, precision="amp-bf16", grad_checkpointing=True)),
    ("gpt2-bf16-accum3-b2-L256", dict(model="gpt2", batch_size=2, seq_len=256, precision="bf16", grad_accum=3)),
    ("gpt2-eager-clip-b2-L256", dict(model="gpt2", batch_size=2, seq_len=256, attn="eager", max_grad_norm=1.0)),
    ("gpt2-trainer-b2-L256", dict(model="gpt2", batch_size=2, seq_len=256, hf_trainer=True)),
    ("gpt2-lora8-b2-L256", dict(model="gpt2", batch_size=2, seq_len=256, lora_rank=8)),
    ("gpt2-sgdm-b2-L256", dict(model="gpt2", batch_size=2, seq_len=256, optimizer="sgd-momentum")),
    ("gpt2-adafactor-b2-L256", dict(model="gpt2", batch_size=2, seq_len=256, optimizer="adafactor")),
    ("gpt2-adamw8bit-b2-L256", dict(model="gpt2", batch_size=2, seq_len=256, optimizer="adamw-8bit")),
    ("llama1b-bf16-b4-L2048", dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, precision="bf16")),
    ("llama1b-ampfp16-eager-accum2-b2-L512", dict(model="llama-3.2-1b", batch_size=2, seq_len=512, precision="amp-fp16",
                                                  attn="eager", grad_accum=2)),
    ("llama1b-qlora16-ckpt-b2-L512", dict(model="llama-3.2-1b", batch_size=2, seq_len=512, precision="bf16", qlora=True,
                                          lora_rank=16, grad_checkpointing=True)),
    ("llama8b-lora16-bf16-b4-L1024", dict(model="llama-3.1-8b", batch_size=4, seq_len=1024, precision="bf16", lora_rank=16)),
    ("llama70b-lora16-bf16-ckpt-b1-L2048", dict(model="llama-3.1-70b", batch_size=1, seq_len=2048, precision="bf16",
                                                lora_rank=16, grad_checkpointing=True)),
    ("qwen0.5b-bf16-b4-L512", dict(model="qwen2.5-0.5b", batch_size=4, seq_len=512, precision="bf16")),
    ("mistral7b-lora16-bf16-b1-L512", dict(model="mistral-7b", batch_size=1, seq_len=512, precision="bf16", lora_rank=16)),
    ("gemma2b-bf16-b2-L256", dict(model="gemma-2b", batch_size=2, seq_len=256, precision="bf16")),
    ("phi1.5-ampbf16-b2-L256", dict(model="phi-1.5", batch_size=2, seq_len=256, precision="amp-bf16")),
    ("olmoe-bf16-b1-L128", dict(model="olmoe-1b-7b", batch_size=1, seq_len=128, precision="bf16")),
    ("vit-ampfp16-b32", dict(model="vit-base-patch16-224", batch_size=32, precision="amp-fp16")),
    ("bert-ampfp16-b8-L512", dict(model="bert-base-uncased", batch_size=8, seq_len=512, precision="amp-fp16")),
    ("gpt2-medium-b2-L256", dict(model="gpt2-medium", batch_size=2, seq_len=256)),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="substrings of case names (default: all)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    a = ap.parse_args()
    import torch
    import transformers

    from memlens.core.events import canonical
    from memlens.core.ledger import analyze
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import depth
    from memlens.estimator.simulate import _simulate, simulate
    from memlens.models.source import resolve

    def compare(spec, src):
        t0 = time.process_time()
        fast = simulate(spec, src)
        t_fast = time.process_time() - t0
        t0 = time.process_time()
        full = _simulate(spec, src, 2, True)
        t_full = time.process_time() - t0
        pa, pb = analyze(fast.log), analyze(full.log)
        same = (canonical(fast.log) == canonical(full.log) and fast.param_count == full.param_count
                and fast.trainable_count == full.trainable_count
                and (pa.peak_allocated_bytes, pa.peak_reserved_bytes) == (pb.peak_allocated_bytes, pb.peak_reserved_bytes))
        if not same:
            ca, cb = canonical(fast.log), canonical(full.log)
            i = next((i for i, (x, y) in enumerate(zip(ca, cb)) if x != y), min(len(ca), len(cb)))
            print(f"    first difference at event {i} of {len(ca)} / {len(cb)}:\n    {ca[i] if i < len(ca) else None}\n"
                  f"    {cb[i] if i < len(cb) else None}", flush=True)
        return {"spec": spec.to_dict(), "later_layers": fast.later_layers, "equal": same, "events": len(full.log.events),
                "peak_allocated": pb.peak_allocated_bytes, "peak_reserved": pb.peak_reserved_bytes,
                "cpu_s_written": round(t_fast, 2), "cpu_s_whole": round(t_full, 2)}

    rows, bad = [], 0
    for name, kw in CASES:
        if a.cases and not any(c in name for c in a.cases):
            continue
        spec = TrainingSpec(**kw)
        src = resolve(spec.model)
        _simulate(spec, depth.shallow_source(src, 2) if depth.depth_of(src) else src, 2, True)   # warm-up
        # the spec, then the same step one sample larger (its family checked: written from 4 layers alone)
        for i, s in enumerate((spec, TrainingSpec(**{**kw, "batch_size": kw.get("batch_size", 1) + 1}))):
            row = {"name": name + ("" if i == 0 else " (batch + 1)"), "layers": depth.depth_of(src), **compare(s, src)}
            bad += not row["equal"]
            rows.append(row)
            print(f"{row['name']:50s} {'equal' if row['equal'] else 'DIFFERENT'}  {row['cpu_s_written']:5.2f} s / "
                  f"{row['cpu_s_whole']:5.2f} s  {row['later_layers']}", flush=True)
    if not a.no_write and not a.cases:
        meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "python": platform.python_version(),
                "torch": torch.__version__, "transformers": transformers.__version__,
                "date": time.strftime("%Y-%m-%d")}
        write_results("depth_check", {"meta": meta, "rows": rows},
                      "Layers written from 3- and 4-layer models against the whole model simulated",
                      f"`python bench/depth_check.py`, {meta['machine']}, torch {meta['torch']}, transformers "
                      f"{meta['transformers']}, {meta['date']}. CPU seconds of one simulation after a warm-up, in one process.",
                      ["case", "layers", "logs equal", "CPU s written / whole", "how"],
                      [[r["name"], r["layers"], "yes" if r["equal"] else "NO", f"{r['cpu_s_written']} / {r['cpu_s_whole']}",
                        r["later_layers"]] for r in rows])
    print("all equal" if not bad else f"{bad} case(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
