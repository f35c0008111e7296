"""Per-rank estimates of DP-SGD ghost clipping under FSDP2 (Opacus' ``ghost_fsdp``) on this CPU.

The source profiler's scenario: Llama-3.1-8B (untied embeddings), LoRA r16 on q_proj,v_proj, bf16
weights, Opacus ghost clipping, ``--sharding fsdp``, logical batch 4 per rank; a grid over world
size (2, 4, 8), sequence (128, 256, 512) and physical batch (1-4). Each estimate is one
``memlens.estimate`` of every rank group, timed on this CPU; the table gives the peak of the
rank that peaks and the per-rank terms live at that peak (data.ranks[i].terms), and the two
backward passes' FSDP collectives.

    PYTHONPATH=. python bench/dp_fsdp_ranks.py          # writes bench/results/dp_fsdp_ranks.{json,md}
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import write_results  # noqa: E402
from memlens.core.spec import TrainingSpec  # noqa: E402

GiB = 2**30
MiB = 2**20
LOGICAL = 4
GRID = [  # (world size, sequence, physical batch): 8 points
    (2, 128, 1), (4, 128, 1), (8, 128, 1),          # world size at the smallest step
    (2, 512, 1),                                    # sequence
    (2, 128, 4),                                    # physical batch = logical batch (one physical batch)
    (2, 256, 2), (4, 256, 2),                       # the middle of the grid
    (8, 512, 4),                                    # the largest activations, sharded 8 ways
]
TERMS = [  # (column, term names summed)
    ("params", ("sharded parameters", "gathered parameters")),
    ("grads", ("sharded gradients", "gathered gradients")),
    ("optim", ("optimizer states (sharded)",)),
    ("activations", ("activations",)),
    ("per-sample/norm", ("per_sample_gradients", "gram_matrices")),
    ("comm", ("communication",)),
]


def spec(world: int, seq: int, physical: int) -> TrainingSpec:
    return TrainingSpec(model="llama-3.1-8b", dp=True, batch_size=LOGICAL, physical_batch_size=physical, seq_len=seq,
                        world_size=world, sharding="fsdp", grad_sample_mode="ghost", lora_rank=16,
                        lora_targets=("q_proj", "v_proj"), precision="bf16")


def one(world: int, seq: int, physical: int) -> dict:
    from memlens.estimator.ranks import estimate_ranks

    t0 = time.perf_counter()
    r = estimate_ranks(spec(world, seq, physical))
    seconds = time.perf_counter() - t0
    peak = next(e for e in r.data["ranks"] if e.get("rank") == r.data["peak_rank"])
    first = {p["pass"]: p for p in peak.get("passes", []) if p["physical_batch"] == 1}
    return {"world_size": world, "seq_len": seq, "physical_batch": physical, "logical_batch": LOGICAL,
            "seconds": round(seconds, 1), "peak_rank": r.data["peak_rank"],
            "rank_groups": [e["ranks"] for e in r.data["ranks"]],
            "peak_allocated_bytes": r.peak_allocated_bytes, "peak_reserved_bytes": r.peak_reserved_bytes,
            "peak_phase": peak["peak_phase"], "terms": peak["terms"], "term_maxima": peak["term_maxima"],
            "passes": {k: {kk: v[kk] for kk in ("start_allocated_bytes", "peak_allocated_bytes", "terms_at_start",
                                                "all_gathers", "reduce_scatters") if kk in v} for k, v in first.items()},
            "fsdp_groups": r.data["wrapper"].get("fsdp_groups"),
            "simulate_seconds_per_rank": [e.get("simulate_seconds") for e in r.data["ranks"] if e.get("simulated")]}


def main() -> None:
    runs = []
    for world, seq, physical in GRID:
        row = one(world, seq, physical)
        runs.append(row)
        print(f"N={world} T={seq} b={physical}: {row['peak_allocated_bytes'] / GiB:.2f} GiB in {row['seconds']} s", flush=True)
    header = ["N", "seq", "phys", "wall s", "peak GiB", "phase"] + [c + " MiB" for c, _ in TERMS] + \
             ["bwd1 AG/RS", "bwd2 AG/RS"]
    rows = []
    for r in runs:
        t = r["terms"]
        cells = [f"{sum(t.get(n, 0) for n in names) / MiB:.0f}" for _, names in TERMS]
        ag = lambda p: (f"{r['passes'][p].get('all_gathers', '-')}/{r['passes'][p].get('reduce_scatters', '-')}"  # noqa: E731
                        if p in r["passes"] else "-")
        rows.append([r["world_size"], r["seq_len"], r["physical_batch"], r["seconds"],
                     f"{r['peak_allocated_bytes'] / GiB:.2f}", r["peak_phase"], *cells, ag("backward 1"), ag("backward 2")])
    intro = ("`memlens estimate` per rank (fake tensors, fake process group) of Llama-3.1-8B, LoRA r16 on q_proj,v_proj, "
             f"bf16 weights, Opacus ghost clipping under FSDP2 (ghost_fsdp: Opacus' FSDP2Wrapper shards every layer), "
             f"logical batch {LOGICAL} per rank, on this CPU (2 shared cores). peak: max_memory_allocated of the rank that "
             "peaks; the term columns are what is live at that peak (params: sharded + gathered; comm: FSDP all-gather / "
             "reduce-scatter buffers; per-sample/norm: Opacus' norms and ghost clipping's Gram matrices). bwdK AG/RS: "
             "FSDP all-gathers / reduce-scatters in backward pass K of the first physical batch. wall s: the whole "
             "estimate, every simulated rank.")
    write_results("dp_fsdp_ranks", {"runs": runs, "grid": GRID, "logical_batch": LOGICAL}, "DP-SGD ghost clipping under "
                  "FSDP2, per rank (Llama-3.1-8B LoRA)", intro, header, rows)


if __name__ == "__main__":
    main()
