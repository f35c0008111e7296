"""Where the host's seconds per op come from (issue 36): calibrate's small Llama against the models it prices.

The fifth session's H100 run found the calibrate's in-model host cost (``model_forward`` 41 us a kernel op, a 16-layer
Llama of width 64 at 1 x 16 tokens) about twice what Llama-3.2-1B's own host-bound step showed on the same machine
(18 us a profiled top-level op at 1 x 512). This probe times, on one GPU, the forward and backward of:

- ``calib``: calibrate's own model and loop (memlens.measure.host_phases.host_per_phase), as calibrate runs it;
- ``l1b-hf-L16`` / ``l1b-hf-L512``: Llama-3.2-1B's architecture (memlens' shipped config, random bf16 weights) in the
  same loop, at 1 x 16 and 1 x 512 tokens;
- ``calib-step`` / ``l1b-step-L16`` / ``l1b-step-L512``: the same models through memlens' prepared step (what
  bench/gpu_step_time.py measures: memlens.step.prepare, CUDA events at the phase marks), 2 warm-ups, median of 7; PROBE_ROUNDS (4) interleaved rounds of all six, each row with
  ``cpu_ref_s``, a fixed pure-Python loop timed right after it (memlens.measure.host_phases.host_speed). Results:
  bench/results/host_probe.md.

Each row: forward and backward seconds and the ops host_per_phase counts (kernel ops, views/allocations).
One JSON line per variant to $OUT/gpu_host_probe.jsonl.

    python bench/gpu_host_probe.py            # on the GPU machine (about a minute)
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from memlens.measure.host_phases import CALIB_LLAMA, host_speed  # noqa: E402  (no torch: the probe's host-speed loop)

CALIB = CALIB_LLAMA


def _out(rec: dict) -> None:
    print(json.dumps(rec), flush=True)
    with open(os.path.join(os.environ.get("OUT", "out"), "gpu_host_probe.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def hf_loop(torch, dev, name: str, cfg, tokens: int) -> None:
    from transformers import LlamaForCausalLM

    from memlens.measure.host_phases import host_per_phase

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).train()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=dev)
    f, b, nf, nb = host_per_phase(torch, model, ids)
    _out({"variant": name, "loop": "host_per_phase", "tokens": tokens, "forward_s": f, "backward_s": b,
          "cpu_ref_s": host_speed(),
          "forward_ops": nf, "backward_ops": nb, "attn": model.config._attn_implementation,
          "use_cache": model.config.use_cache})
    del model
    torch.cuda.empty_cache()


def step_loop(torch, dev, name: str, model: str, tokens: int) -> None:
    from memlens.core.spec import TrainingSpec
    from memlens.measure.phase_time import PhaseTimer
    from memlens.step import prepare

    torch.manual_seed(0)
    step = prepare(TrainingSpec(model=model, batch_size=1, seq_len=tokens, precision="bf16"), device=dev)
    timer = PhaseTimer(torch, dev)
    walls, phases = [], []
    for i in range(2 + 7):
        torch.cuda.synchronize()
        t = time.perf_counter()
        timer.start()
        step.run(timer.on_phase)
        torch.cuda.synchronize()
        if i >= 2:
            walls.append(time.perf_counter() - t)
            phases.append(timer.finish())
    med = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
    _out({"variant": name, "loop": "memlens.step", "tokens": tokens, "forward_s": med.get("forward"),
          "backward_s": med.get("backward"), "optimizer_s": med.get("optimizer"), "step_s": statistics.median(walls),
          "cpu_ref_s": host_speed()})
    del step
    torch.cuda.empty_cache()


def main() -> int:
    import torch
    from transformers import LlamaConfig

    from memlens.models.source import resolve

    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    dev = torch.device("cuda", 0)
    calib = LlamaConfig(**CALIB)
    l1b = resolve("llama-3.2-1b").config
    calib_dir = tempfile.mkdtemp()
    calib.save_pretrained(calib_dir)
    rounds = int(os.environ.get("PROBE_ROUNDS", "4"))
    for rep in range(rounds):   # interleaved rounds: the host's speed drifts (cpu_ref_s says by how much)
        hf_loop(torch, dev, f"calib#{rep}", calib, 16)
        hf_loop(torch, dev, f"l1b-hf-L16#{rep}", l1b, 16)
        hf_loop(torch, dev, f"l1b-hf-L512#{rep}", l1b, 512)
        step_loop(torch, dev, f"calib-step#{rep}", calib_dir, 16)
        step_loop(torch, dev, f"l1b-step-L16#{rep}", "llama-3.2-1b", 16)
        step_loop(torch, dev, f"l1b-step-L512#{rep}", "llama-3.2-1b", 512)
    return 0


if __name__ == "__main__":
    sys.exit(main())
