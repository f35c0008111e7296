"""torchtitan's published per-GPU memory against memlens' per-rank estimate (issue 37), on the CPU only.

python bench/torchtitan_figures.py              # every figure (about 10 minutes on this 2-core CPU)
python bench/torchtitan_figures.py fsdp8        # only the cases whose name contains "fsdp8" (merged into the results)
python bench/torchtitan_figures.py --render     # the .md again from the .json (the cases' texts as they are now)
python bench/torchtitan_figures.py --tiny       # the same code path on a tiny Llama at 4 ranks (seconds; the tests)

Source: benchmarks/llama3_h100_202412_torchtitan.md (torchtitan, end of 2024: torch 1963fc8 of 2024-12-23,
torchtitan 9dec370 of 2024-12-26), H100 96 GB HBM2e (Grand Teton), ``max_reserved_gib`` read at step 90
(torchtitan's DeviceMemoryMonitor: torch.cuda.memory_stats()["reserved_bytes.all.peak"], its peak reset at each
log). Settings from torchtitan at 9dec370 (train_configs/llama3_8b.toml, llama3_70b.toml, train.py,
torchtitan/parallelisms/parallelize_llama.py, torchtitan/optimizer.py, config_manager.py, utils.py):

- seq_len 8192 (the tomls), the tables' local batch per data-parallel rank (a TP group shares one), bf16 params
  with fp32 reduction (``mixed_precision_param`` / ``_reduce`` defaults: FSDP2 MixedPrecisionPolicy(bf16, fp32) =
  memlens --precision amp-bf16), AdamW foreach (``optimizer.fused`` off by default), clip_grad_norm_(1.0);
- FSDP2 ``fully_shard`` per TransformerBlock + root, on ``dp_shard_cp`` (dp x cp) with CP, TP on the last dim;
- selective AC = ``selective_ac_option = 'op'``: torchtitan's ``_save_list`` with every second mm recomputed
  (memlens --checkpoint-policy torchtitan-op); full AC = checkpoint_wrapper per block (memlens --grad-checkpointing);
- TP: loss parallel on (``training.disable_loss_parallel`` off by default: memlens --loss-parallel);
- CP: ``context_parallel(cp_mesh, buffers=[input_ids, labels, freqs_cis])``, rotate method allgather,
  SDPA limited to flash / memory-efficient (the flash kernel: memlens' --gpu h100-96gb below);
- the H100 96 GB: memlens has no entry for it; this script registers ``h100-96gb`` = the H100 entry with
  96 GB and SDPA's flash kernel first (torch of Dec 2024: cuDNN attention was opt-in since pytorch#138522).

What memlens cannot reproduce, said per row: torch.compile of each block (its fused kernels hold fewer
temporaries), Float8 linears (torchao: fp8 weight / activation casts, amax), torchtitan's own Llama module (memlens
runs Hugging Face's LlamaForCausalLM of the same shapes: RoPE in bf16 where torchtitan rotates in fp32 complex,
K/V heads not repeated before SDPA), ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (run_llama_train.sh;
memlens models the default caching allocator's segments), the last block kept unsharded after forward.

Writes bench/results/torchtitan_figures.json and .md (--tiny: nothing, prints the rows). Each case runs as a fresh
process (the whole estimate, timed end to end: model build, simulation of every rank that can differ).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SOURCE = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md "
          "(settings: https://github.com/pytorch/torchtitan/tree/9dec370ad26b5f8e9a7333a0e36165018262644b)")
GPU = "h100-96gb"
OUT = os.path.join(ROOT, "bench", "results", "torchtitan_figures")

COMMON = dict(precision="amp-bf16", optimizer="adamw", max_grad_norm=1.0, gpu=GPU, sharding="fsdp")
SAC = dict(grad_checkpointing=True, checkpoint_policy="torchtitan-op")
FULL = dict(grad_checkpointing=True)
B8 = dict(COMMON, model="llama-3.1-8b", seq_len=8192)

NOT_COMPILE = "torch.compile of each block (fused kernels, fewer temporaries) is not modelled per rank: eager estimate"
NOT_FLOAT8 = "Float8 linears (torchao) are not modelled: bf16 estimate"
NOT_LOSS_PARALLEL = ("without --loss-parallel (torchtitan's default with TP: the loss on 1/8 of the vocabulary per rank) "
                     "memlens all-gathers the logits whole")


def cases() -> list[dict]:
    """Each published figure: the table, its row, the published GiB, memlens' spec fields, what is not reproduced."""
    rows = [
        dict(name="t1-fsdp8-8b", table="Table 1 (8 GPUs, local batch 2, selective AC)", row="FSDP", published=82.4,
             spec=dict(B8, batch_size=2, world_size=8, **SAC), missing=[]),
        dict(name="t1-fsdp8-8b-compile", table="Table 1", row="FSDP + torch.compile", published=77.0,
             spec=dict(B8, batch_size=2, world_size=8, **SAC), missing=[NOT_COMPILE], same_as="t1-fsdp8-8b"),
        dict(name="t1-fsdp8-8b-compile-float8", table="Table 1", row="FSDP + torch.compile + Float8", published=76.8,
             spec=dict(B8, batch_size=2, world_size=8, **SAC), missing=[NOT_COMPILE, NOT_FLOAT8], same_as="t1-fsdp8-8b"),
        dict(name="t1-fsdp8-8b-memlens-selective", table="Table 1 (memlens' own selective policy)",
             row="FSDP, --checkpoint-policy selective (every matmul kept)", published=82.4,
             spec=dict(B8, batch_size=2, world_size=8, grad_checkpointing=True, checkpoint_policy="selective"),
             missing=["memlens' selective policy keeps every matmul output, torchtitan's every other one"]),
        dict(name="t3-fsdp128-8b", table="Table 3 (128 GPUs, local batch 2, selective AC)", row="FSDP", published=67.0,
             spec=dict(B8, batch_size=2, world_size=128, **SAC), missing=[]),
    ]
    for cp, pub in ((1, 83.9), (2, 84.2), (4, 84.0), (8, 84.5)):
        longer = 32768 * cp > 131072    # torchtitan sets max_seq_len = seq_len; Llama-3.1's config says 131072 positions
        rows.append(dict(name=f"t2-fsdp{8 // cp}-cp{cp}-8b", table="Table 2 (8 GPUs, local batch 1, full AC, compile + Float8)",
                         row=f"FSDP {8 // cp}, CP {cp}, seq {32768 * cp}", published=pub,
                         spec=dict(B8, batch_size=1, seq_len=32768 * cp, world_size=8, **({"cp": cp} if cp > 1 else {}), **FULL),
                         positions=32768 * cp if longer else None,
                         missing=[NOT_COMPILE, NOT_FLOAT8] + ([f"max_position_embeddings raised to {32768 * cp} (torchtitan's "
                                                                "max_seq_len = seq_len; no memory depends on it)"] if longer else [])))
    rows.append(dict(name="t4-fsdp32-tp8-70b", table="Table 4 (256 GPUs, FSDP 32 x TP 8, local batch 16, full AC, compile "
                     "+ Float8)", row="2D", published=71.9,
                     spec=dict(COMMON, model="llama-3.1-70b", seq_len=8192, batch_size=16, world_size=256, tp=8,
                               loss_parallel=True, **FULL),
                     missing=[NOT_COMPILE, NOT_FLOAT8]))
    rows.append(dict(name="t4-fsdp32-tp8-70b-no-loss-parallel", table="Table 4 (memlens without loss parallel)",
                     row="2D, logits all-gathered", published=71.9,
                     spec=dict(COMMON, model="llama-3.1-70b", seq_len=8192, batch_size=16, world_size=256, tp=8, **FULL),
                     missing=[NOT_COMPILE, NOT_FLOAT8, NOT_LOSS_PARALLEL]))
    return rows


def tiny(spec: dict) -> dict:
    """The same mesh on the tiny Llama at 4 ranks (the code path, in seconds)."""
    world = 4
    cp, tp = spec.get("cp", 1), spec.get("tp", 1)
    if cp * tp > world:
        cp = 2 if cp > 1 else 1
        tp = 2 if tp > 1 else 1
    return dict(spec, model="tests/fixtures/tiny-llama", seq_len=64 * cp, batch_size=2, world_size=world,
                **({"cp": cp} if cp > 1 else {}), **({"tp": tp} if tp > 1 else {}))


def register_gpu() -> None:
    """``h100-96gb``: the H100 entry with 96 GB (nominal; not measured) and the flash kernel first."""
    import dataclasses

    from memlens.core.gpus import GPUS

    if GPU not in GPUS:
        h = GPUS["h100"]
        GPUS[GPU] = dataclasses.replace(h, name=GPU, label="NVIDIA H100 96GB HBM2e (Grand Teton)", cudnn_attention=False,
                                        total_memory_bytes=int(h.total_memory_bytes * 96 / 80))


def estimate_case(spec: dict) -> dict:
    """One case's per-rank estimate (in this process)."""
    from memlens.core.spec import TrainingSpec
    from memlens.estimator.ranks import estimate_ranks

    register_gpu()
    t = time.perf_counter()
    r = estimate_ranks(TrainingSpec(**spec))
    peak = max((e for e in r.data["ranks"] if e.get("simulated", True) and e["rank"] is not None),
               key=lambda e: e["peak_reserved_bytes"])
    return {"peak_rank": r.data["peak_rank"], "peak_allocated_bytes": r.peak_allocated_bytes,
            "peak_reserved_bytes": r.peak_reserved_bytes, "max_reserved_rank": peak["rank"],
            "max_reserved_bytes": peak["peak_reserved_bytes"], "simulated_ranks": [e["rank"] for e in r.data["ranks"] if e["rank"] is not None],
            "attention": r.data.get("attention_backends"), "later_layers": r.data.get("later_layers"),
            "strategy": r.data["strategy"], "estimate_seconds": round(time.perf_counter() - t, 1)}


def longer_config(model: str, positions: int, where: str) -> str:
    """A directory with ``model``'s built-in config, its max_position_embeddings set to ``positions``."""
    from memlens.models.source import resolve

    cfg = resolve(model).config.to_dict()
    cfg.update(max_position_embeddings=positions, architectures=["LlamaForCausalLM"])
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "config.json"), "w") as f:
        json.dump(cfg, f)
    return where


def run_case(case: dict, small: bool) -> dict:
    """The case's estimate in a fresh process, timed end to end (or an error line)."""
    spec = tiny(case["spec"]) if small else case["spec"]
    if case.get("positions") and not small:
        import tempfile

        spec = dict(spec, model=longer_config(spec["model"], case["positions"],
                                              os.path.join(tempfile.gettempdir(), f"{spec['model']}-{case['positions']}")))
    cmd = [sys.executable, os.path.abspath(__file__), "--spec", json.dumps(spec)]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    secs = round(time.perf_counter() - t, 1)
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1], "seconds": secs}
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "seconds": secs}


def row_text(c: dict) -> str:
    e = c["estimate"]
    if "error" in e:
        return f"| {c['table']} | {c['row']} | {c['published']:.1f} | error: {e['error']} | | | |"
    gib = e["max_reserved_bytes"] / 2**30
    diff = 100 * (gib - c["published"]) / c["published"]
    what = "; ".join(c["missing"]) or "none beyond the notes below"
    return (f"| {c['table']} | {c['row']} | {c['published']:.1f} | {gib:.1f} | {diff:+.1f}% | "
            f"{e['peak_allocated_bytes'] / 2**30:.1f} | {e['seconds']:.0f} | {what} |")


def markdown(results: list[dict]) -> str:
    lines = ["# torchtitan's published memory vs memlens' per-rank estimate", "",
             f"Source: {SOURCE}. Regenerate: `python bench/torchtitan_figures.py` (CPU only).", "",
             "Published: torchtitan's `max_reserved_gib` per GPU (the maximum over ranks). memlens: the per-rank estimate "
             "(`estimate_ranks`) of the rank with the largest reserved memory, same model shapes, world size, mesh, local batch, "
             "sequence length, AC, mixed precision and optimizer; allocated is `max_memory_allocated` of the rank that "
             "peaks; seconds: the whole estimate in a fresh process on this 2-core CPU.", "",
             "| table | row | published GiB | memlens reserved GiB | diff | memlens allocated GiB | seconds | not reproduced |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    lines += [row_text(c) for c in results]
    lines += ["", "Settings common to every row: " + ", ".join(f"{k}={v}" for k, v in COMMON.items()) +
              "; selective AC = --grad-checkpointing --checkpoint-policy torchtitan-op; full AC = --grad-checkpointing.", "",
              "Not modelled anywhere in this table (each row's last column adds its own): torchtitan's own Llama module "
              "(memlens runs Hugging Face's LlamaForCausalLM of the same shapes), `expandable_segments:True` (torchtitan's "
              "launch script; memlens models the default allocator's segments, so its reserved figure is that of a run "
              "without it), the last block kept unsharded after forward, the 96 GB card's own CUDA context (not in "
              "max_reserved either)."]
    return "\n".join(lines) + "\n"


def write(results: list[dict]) -> None:
    """Merge ``results`` into the committed JSON (by case name, in the cases' order) and render the .md."""
    old = {}
    if os.path.exists(OUT + ".json"):
        with open(OUT + ".json") as f:
            old = {c["name"]: c for c in json.load(f)["cases"]}
    old.update({c["name"]: c for c in results})
    merged = [dict(c, estimate=old[c["name"]]["estimate"]) for c in cases() if c["name"] in old]   # texts as they are now
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT + ".json", "w") as f:
        json.dump({"source": SOURCE, "gpu": GPU, "cases": merged}, f, indent=1)
    with open(OUT + ".md", "w") as f:
        f.write(markdown(merged))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--spec"]:
        print(json.dumps(estimate_case(json.loads(argv[1]))))
        return 0
    small = "--tiny" in argv
    names = [a for a in argv if not a.startswith("--")]
    done: dict[str, dict] = {}
    results = []
    for c in cases() if "--render" not in argv else []:
        if names and not any(n in c["name"] for n in names):
            continue
        same = c.get("same_as")
        c = dict(c, estimate=done[same] if same in done else run_case(c, small))
        done[c["name"]] = c["estimate"]
        results.append(c)
        print(row_text(c), flush=True)
    if not small:
        write(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
