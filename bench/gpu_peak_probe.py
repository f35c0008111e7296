"""What is alive at a real step's peak: the caching allocator's own history, replayed (GPU).

    python bench/gpu_peak_probe.py OUT.json adafactor        # torch.optim.Adafactor on one 1024 x 1024 weight
    python bench/gpu_peak_probe.py OUT.json compile-gpt2     # torch.compile'd GPT-2, amp-bf16, 8 x 1024
    python bench/gpu_peak_probe.py OUT.json compile-llama1b  # torch.compile'd Llama-3.2-1B shapes, bf16, 2 x 2048
    python bench/gpu_peak_probe.py OUT.json compile-qwen0.5b | compile-bert | compile-vit | compile-qwen0.5b-ckpt | compile-gpt2-lora   # held-out
    python bench/gpu_peak_probe.py OUT.json torchvision-resnet50 | whisper-small | phi-1.5   # generality cases off by > 1%

Records torch.cuda.memory._record_memory_history(stacks="python") from the model's build through 3
steps of memlens' reference step, replays the whole allocation trace, and writes the step's peak, the blocks alive at that
peak (size, the innermost Python frames) and max_memory_allocated.
Used to find what an estimate misses (issue 12): a mechanism, not a constant.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {
    "adafactor": dict(model="tests.tiny_models:linear_norm", optimizer="adafactor", max_grad_norm=1.0, hf_trainer=True),
    "compile-gpt2": dict(model="gpt2", batch_size=8, seq_len=1024, precision="amp-bf16", compile=True),
    "compile-llama1b": dict(model="llama-3.2-1b", batch_size=2, seq_len=2048, precision="bf16", compile=True),
    # compiled steps checked after the --compile mechanisms were modelled (none used to find them)
    "compile-qwen0.5b": dict(model="qwen2.5-0.5b", batch_size=4, seq_len=1024, precision="bf16", compile=True),
    "compile-bert": dict(model="bert-base-uncased", batch_size=16, seq_len=512, precision="amp-bf16", compile=True),
    "compile-vit": dict(model="vit-base-patch16-224", batch_size=64, precision="amp-bf16", compile=True),
    "compile-qwen0.5b-ckpt": dict(model="qwen2.5-0.5b", batch_size=4, seq_len=1024, precision="bf16", compile=True,
                                  grad_checkpointing=True),
    "compile-gpt2-lora": dict(model="gpt2", batch_size=8, seq_len=1024, precision="amp-bf16", compile=True, lora_rank=16),
    "compile-phi-1.5": dict(model="phi-1.5", batch_size=4, seq_len=1024, precision="bf16", compile=True),
    "compile-resnet50": dict(model="torchvision:resnet50", batch_size=64, precision="amp-bf16", compile=True),
    "torchvision-resnet50": dict(model="torchvision:resnet50", batch_size=64, precision="amp-fp16"),
    "whisper-small": dict(model="whisper-small", batch_size=16, precision="amp-bf16"),
    "phi-1.5": dict(model="phi-1.5", batch_size=4, seq_len=1024, precision="bf16", optimizer="adamw-fused"),
}


def _frames(frames: list[dict], n: int = 8) -> list[str]:
    keep = [f for f in frames if f.get("filename", "").endswith(".py")]
    return [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in keep[:n]]


def peak_blocks(trace: list[dict], start: int) -> dict:
    """Replay alloc/free events from ``start``: the peak and the blocks alive there."""
    live: dict[int, dict] = {}
    cur = peak = 0
    at_peak: dict[int, dict] = {}
    for i, ev in enumerate(trace):
        a = ev["action"]
        if a == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if i >= start and cur > peak:
                peak, at_peak = cur, dict(live)
        elif a == "free_requested" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    rows = sorted(at_peak.values(), key=lambda e: -e["size"])
    return {"peak_allocated": peak, "blocks": [{"size": e["size"], "frames": _frames(e.get("frames", []))} for e in rows],
            "n_blocks": len(rows)}


def inductor_code(out_path: str) -> None:
    """The generated wrapper code (files with ``def call(args)``) of a compiled case, beside OUT.json as a
    tar: the frames of its blocks name these files and lines."""
    import getpass
    import glob
    import tarfile
    import tempfile

    root = os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser())
    files = [f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
             if "def call(" in open(f, errors="replace").read()]
    with tarfile.open(out_path.replace(".json", "") + "_code.tar.gz", "w:gz") as t:
        for f in files:
            t.add(f, arcname=os.path.basename(f))


def main() -> None:
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.step.prepare import prepare

    out_path, case = sys.argv[1], sys.argv[2]
    spec = TrainingSpec(**CASES[case])
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    step = prepare(spec, device="cuda", seed=0)

    one = step.run
    one()   # compile, optimizer state
    one()
    torch.cuda.synchronize()
    mark = len(torch.cuda.memory._snapshot()["device_traces"][0])
    torch.cuda.reset_peak_memory_stats()
    one()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    res = {"case": case, "spec": spec.to_dict(), "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "max_allocated_last_step": torch.cuda.max_memory_allocated(), "trace_events": len(trace), **peak_blocks(trace, mark)}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "blocks"}))
    if spec.compile:
        inductor_code(out_path)
    for b in res["blocks"][:15]:
        print(f"{b['size'] / 2**20:10.2f} MiB  {' <- '.join(b['frames'][:4])}")


if __name__ == "__main__":
    main()
