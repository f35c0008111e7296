"""Where a real forward's GPU idles: the kernel timeline of one profiled training step, its gaps placed (issue 36).

The time model runs a step's ops through a launch queue (memlens.estimator.timing.step.queue: the host's priced cost
per op, each kernel starting when the host has launched it and the GPU is free). Repriced with the H200's re-measured
GEMM grids, a host-bound forward is priced short of the measured one (GPT-2 fp32, 4 x 512 tokens: 17.1 ms priced,
20.5 measured, its kernels summing to 15.6). A profiler slows the host 2-3x (GPT-2's forward: 39 ms of host under it,
~15 without), so this marks the step instead: a CUDA event and the host's clock at the model's call, after the
embeddings, after each block, after the head and the loss (forward hooks), at backward's and the optimizer's ends; the
GPU synchronized before the step as the bench's steps are. Where the GPU's time at a mark is close to the host's, the
GPU was waiting on the host there; where it is later, the queue held work. Each case also runs unmarked (events at the
phases' ends only), to show the marks cost little.

    python bench/gpu_forward_gaps.py --out $OUT/forward_gaps.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (name, transformers config class, config kwargs, batch, seq, dtype, autocast)
CASES = [
    ("gpt2-fp32", "GPT2Config", {}, 4, 512, "float32", None),
    ("gpt2-amp-bf16", "GPT2Config", {}, 16, 512, "float32", "bfloat16"),
    ("qwen0.5b-bf16", "Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                          num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                          tie_word_embeddings=True), 8, 1024, "bfloat16", None),
    ("llama1b-bf16", "LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                         max_position_embeddings=2048, tie_word_embeddings=True), 4, 1024, "bfloat16", None),
]


def lags(marks: list) -> list:
    """[(label, host ms, GPU ms, GPU - host ms)] of marks [(label, host ms, GPU ms)] from the step's start."""
    return [(lab, round(h, 3), round(g, 3), round(g - h, 3)) for lab, h, g in marks]


def main(argv=None) -> int:
    import torch
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "transformers": transformers.__version__, "cases": {}}
    for name, cfg_cls, kw, b, seq, dtype, autocast in CASES:
        cfg = getattr(transformers, cfg_cls)(**kw)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(dev, getattr(torch, dtype))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        ids = torch.randint(0, cfg.vocab_size, (b, seq), device=dev)
        marks: list = []
        on = [False]

        def mark(label):
            if on[0]:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append((label, time.perf_counter(), ev))

        blocks = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
        emb = model.get_input_embeddings()
        hooks = [model.register_forward_pre_hook(lambda *_: mark("call")), emb.register_forward_hook(lambda *_: mark("embed"))]
        hooks += [blk.register_forward_hook(lambda *_, i=i: mark(f"block{i}")) for i, blk in enumerate(blocks)]
        hooks.append(model.get_output_embeddings().register_forward_hook(lambda *_: mark("head")))

        def step(marked: bool):
            on[0] = marked
            marks.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
            ctx = torch.autocast("cuda", dtype=getattr(torch, autocast)) if autocast else torch.autocast("cuda", enabled=False)
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
            on[0] = True
            mark("loss")
            loss.backward()
            mark("backward")
            opt.step()
            opt.zero_grad(set_to_none=True)
            mark("optimizer")
            torch.cuda.synchronize()
            return [(lab, (t - t0) * 1e3, e0.elapsed_time(ev)) for lab, t, ev in marks]

        for _ in range(3):
            step(True)
        rec = {"batch": b, "seq": seq, "dtype": dtype, "autocast": autocast, "marked": [], "unmarked": []}
        for _ in range(a.steps):          # interleaved: the host drifts
            rec["marked"].append(lags(step(True)))
            rec["unmarked"].append(lags(step(False)))
        for h in hooks:
            h.remove()
        report["cases"][name] = rec
        m, u = rec["marked"][-1], rec["unmarked"][-1]
        print(name, "marked:", [(x[0], x[1], x[2]) for x in m if x[0] in ("call", "embed", "block0", "head", "loss",
                                                                          "backward", "optimizer")],
              "unmarked:", u, flush=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        del model, opt
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
