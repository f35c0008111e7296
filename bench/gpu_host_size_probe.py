"""Does the host's cost per op depend on the step's size? (issue 36: forward host-bound where the model says not)

The step-time model prices the host per op from calibrate's 16-layer Llama of width 64 at 1 x 16 tokens, where the
GPU idles. Qwen2.5-0.5B bf16 at 8 x 1,024 on an H100 ran its forward in 50.9 ms for 37.0 ms of kernels (the GPU
waited on the host) where the model priced 32.8 ms of host. This probe times the host alone (the wall clock of the
forward call, no synchronization: the host's own dispatch) and the phase's wall clock (synchronized), for real models
at sizes from 1 x 16 tokens (the GPU idles) to the bench's, the ops of each counted as calibrate counts them.

    python bench/gpu_host_size_probe.py            # on the GPU machine; writes $OUT/host_size_probe.jsonl

Each model is built once (memlens.step.prepare, random weights); each size: counted once, 2 warm-ups, then ROUNDS
interleaved rounds (every size once a round) of RUNS steps; the figures are the median over rounds of each round's
median, with memlens.measure.host_phases.host_speed beside each round.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ROUNDS, RUNS = 4, 3
MODELS = {   # name -> (spec fields, sizes (batch, tokens))
    "calib-llama": (None, [(1, 16), (8, 1024)]),
    "qwen2.5-0.5b": (dict(model="qwen2.5-0.5b", precision="bf16"), [(1, 16), (1, 256), (2, 512), (4, 1024), (8, 1024)]),
    "llama-3.2-1b": (dict(model="llama-3.2-1b", precision="bf16"), [(1, 16), (1, 256), (1, 512), (4, 1024)]),
    "gpt2": (dict(model="gpt2", precision="bf16"), [(1, 16), (8, 1024)]),
}


def one(torch, model, ids, count=False):
    from memlens.measure.host_phases import timed_step

    if count:
        return timed_step(torch, lambda: model(input_ids=ids, labels=ids).loss, torch.cuda.synchronize, True)
    sync = torch.cuda.synchronize
    sync()
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    sync()
    t4 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t0, t3 - t2, t4 - t2


def main() -> int:
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.measure.host_phases import CALIB_LLAMA, calib_llama, host_speed
    from memlens.step import prepare

    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "host_size_probe.jsonl")
    dev = torch.device("cuda", 0)
    for name, (fields, sizes) in MODELS.items():
        t0 = time.perf_counter()
        if fields is None:
            model = calib_llama(torch, dev)
            vocab = CALIB_LLAMA["vocab_size"]
        else:
            step = prepare(TrainingSpec(batch_size=1, seq_len=16, **fields), device=dev)
            model = step.model
            vocab = model.config.vocab_size
        torch.manual_seed(0)
        inputs = {s: torch.randint(0, vocab, s, device=dev) for s in sizes}
        counts = {s: one(torch, model, inputs[s], count=True) for s in sizes}
        for s in sizes:
            for _ in range(2):
                one(torch, model, inputs[s])
        per: dict = {s: [] for s in sizes}
        speeds = []
        for _ in range(ROUNDS):
            for s in sizes:
                rs = [one(torch, model, inputs[s]) for _ in range(RUNS)]
                per[s].append([statistics.median(r[i] for r in rs) for i in range(4)])
            speeds.append(host_speed() * 1e3)
        for s in sizes:
            med = [statistics.median(r[i] for r in per[s]) for i in range(4)]
            rec = {"model": name, "batch": s[0], "tokens": s[1], "host_forward_s": med[0], "forward_s": med[1],
                   "host_backward_s": med[2], "backward_s": med[3], "forward_ops": counts[s][2], "backward_ops": counts[s][3],
                   "host_speed_ms": [round(x, 2) for x in speeds], "device": torch.cuda.get_device_name(dev),
                   "torch": torch.__version__}
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            fk = max(1, counts[s][2]["kernel"])
            print(f"{name} {s}: host fwd {med[0] * 1e3:.1f} ms ({med[0] / fk * 1e6:.1f} us/kernel op of {fk}), fwd "
                  f"{med[1] * 1e3:.1f} ms; host bwd {med[2] * 1e3:.1f}, bwd {med[3] * 1e3:.1f} ms; host "
                  f"{statistics.median(speeds):.1f} ms", flush=True)
        del model
        torch.cuda.empty_cache()
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
