"""Lengths that vary, measured: does the step memlens names (estimate --lengths) peak, at the bytes it says?

Run on the GPU machine from the repo root (about 2-3 minutes on an H100):

    python bench/gpu_lengths.py                 # results under $OUT (default ./out)
    python bench/gpu_lengths.py --dry-run       # CPU: the estimates only, on a tiny model (checks the script)

Each case runs in its own subprocess (bench/gpu_runner.py; resumed, --fresh starts over). It builds the model with memlens' own builder (random weights) and its
prepared step (memlens.step.prepare, the code `estimate` simulates), then trains one optimizer step per
micro-batch in file order, each batch padded to its longest sample (truncated at max_length), as a sequential
sampler and a pad-to-longest collator hand them over. Per step: torch.cuda.max_memory_allocated (reset at each
step's start). memlens' side, computed in the same process before the model is built: the batch shapes
(memlens.core.lengths), the step it names as the peak and its estimate at that shape. One JSON line per case in
$OUT/gpu_lengths.jsonl; a markdown table last.
"""
from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_runner import gib, list_or_run, runner_args  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "tiny-llama")


def _lengths(n: int, seed: int, long_at: dict[int, int]) -> list[int]:
    rng = random.Random(seed)
    out = [max(8, int(rng.lognormvariate(5.5, 0.6))) for _ in range(n)]
    for i, v in long_at.items():
        out[i] = v
    return out


# name -> (spec fields, lengths); the long samples sit mid-file so the peak is not the first step
CASES = {
    "qwen2.5-0.5b-bf16-b4-L2048": ({"model": "qwen2.5-0.5b", "precision": "bf16", "batch_size": 4, "seq_len": 2048},
                                   _lengths(40, 1, {9: 1500, 22: 3000})),
    "llama-3.2-1b-bf16-ckpt-b2-L4096": ({"model": "llama-3.2-1b", "precision": "bf16", "batch_size": 2, "seq_len": 4096,
                                         "grad_checkpointing": True}, _lengths(24, 2, {5: 2500, 15: 3900})),
}
DRY = {"tiny-llama-b2-L256": ({"model": TINY, "batch_size": 2, "seq_len": 256}, _lengths(12, 3, {7: 400}))}


def predict(fields: dict, lengths: list[int]) -> dict:
    from memlens.core.lengths import batches, worst, worst_any_order
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    spec = TrainingSpec(**fields)
    bs = batches(lengths, spec.batch_size, spec.seq_len)
    w = worst(bs)
    a = worst_any_order(lengths, spec.batch_size, spec.seq_len)
    r = estimate(spec.replace(batch_size=w.rows, seq_len=w.tokens))
    ra = estimate(spec.replace(batch_size=a.rows, seq_len=a.tokens))
    return {"shapes": [[b.rows, b.tokens] for b in bs], "worst_step": w.step, "worst_shape": [w.rows, w.tokens],
            "estimate_worst_step": r.peak_allocated_bytes, "estimate_worst_step_reserved": r.peak_reserved_bytes,
            "any_order_shape": [a.rows, a.tokens], "estimate_any_order": ra.peak_allocated_bytes}


def measure(fields: dict, shapes: list[list[int]], device: str = "cuda") -> dict:
    """The real steps (on "cpu" with --dry-run: the same code, peaks 0, to check the script)."""
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    rows, tokens = max(shapes, key=lambda s: s[0] * s[1])
    spec = TrainingSpec(**{**fields, "batch_size": rows, "seq_len": tokens})
    cuda = device == "cuda"
    step = prepare(spec, device=torch.device(device))
    vocab = step.model.config.vocab_size
    template = step.batch
    peaks = []
    for n, (r, t) in enumerate(shapes, 1):
        ids = torch.randint(0, vocab, (r, t), device=device)
        step.batch = {k: ids for k in template} if isinstance(template, dict) else ids   # input_ids and labels: one tensor
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        step.run()
        if cuda:
            torch.cuda.synchronize()
        peaks.append({"step": n, "shape": [r, t], "peak_allocated": torch.cuda.max_memory_allocated() if cuda else 0,
                      "seconds": round(time.perf_counter() - t0, 4)})
        del ids
    return {"steps": peaks, "max_reserved": torch.cuda.memory_stats()["reserved_bytes.all.peak"] if cuda else 0}


def case(name: str, payload: list, dry: bool) -> dict:
    """One case in its own subprocess (bench/gpu_runner.py); --dry-run: the real steps on the CPU (peaks 0)."""
    fields, lengths = payload
    rec: dict = {"fields": fields, "lengths": lengths}
    rec.update(predict(fields, lengths))
    if dry:
        rec["cpu_steps_ran"] = len(measure(fields, rec["shapes"], device="cpu")["steps"])
        return rec
    rec.update(measure(fields, rec["shapes"]))
    real = max(rec["steps"], key=lambda s: s["peak_allocated"])
    rec["measured_worst_step"] = real["step"]
    # steps 1..: step 1 has no optimizer state yet, so only later steps are compared with the estimate
    rec["measured_at_predicted_step"] = rec["steps"][rec["worst_step"] - 1]["peak_allocated"]
    rec["error_pct"] = round(100 * (rec["estimate_worst_step"] / rec["measured_at_predicted_step"] - 1), 3)
    return rec


COLUMNS = [("predicted peak step (shape)", lambda r: f"{r['worst_step']} ({r['worst_shape'][0]} x {r['worst_shape'][1]})"),
           ("measured peak step", lambda r: r.get("measured_worst_step", "-")),
           ("estimate GiB", lambda r: gib(r["estimate_worst_step"])),
           ("measured at that step GiB", lambda r: gib(r.get("measured_at_predicted_step"))),
           ("error", lambda r: f"{r['error_pct']:+.2f}%" if "error_pct" in r else "-")]


def main(argv: list[str] | None = None) -> None:
    a = runner_args(__doc__.splitlines()[0], timeout=400).parse_args(argv)
    list_or_run(a, list((DRY if a.dry_run else CASES).items()), fn=case, jsonl="gpu_lengths.jsonl", columns=COLUMNS)


if __name__ == "__main__":
    main()
