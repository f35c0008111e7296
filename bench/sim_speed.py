"""CPU seconds of one simulation, for the specs the test suite simulates most (issue 34, item 7).

    python bench/sim_speed.py                                # this tree: time every case, print a table
    python bench/sim_speed.py --tree /tmp/base --label before --out /tmp/before.json   # another checkout
    python bench/sim_speed.py --render before.json after.json   # write results/sim_speed.{json,md}
    python bench/sim_speed.py --digest out.json              # every result of the equivalence set, to compare two trees

Each case is a whole ``estimate`` (resolve, plan, simulation, allocator replay, Result), timed as CPU seconds
(``time.process_time``: the machine is shared, wall time says little) after one warm-up estimate of the same spec
in the same process, as a test worker runs it. Between runs the layer check of :mod:`memlens.estimator.depth`
is forgotten, so a deep model does the same work every time. The median of ``--runs`` runs is reported.
``--tree`` measures another checkout's ``memlens`` (its path goes first on ``sys.path``).

``--digest`` estimates a larger set of specs (every mechanism the suite's tiny models exercise: checkpointing,
LoRA, QLoRA, DP-SGD, FSDP/DDP/TP/PP ranks, TRL trainers, --compile, EMA, offload, accumulation, vision) and writes
each Result (minus its creation time and the simulation's own wall seconds) and the sha256 of the simulated event
log: two trees whose digests are equal give every byte and every second alike. Run both with the same
``PYTHONHASHSEED`` (e.g. 0): the order of equal-sized rows of a breakdown follows string hashing.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIX = os.path.join(ROOT, "tests", "fixtures")
TINY_LLAMA = os.path.join(FIX, "tiny-llama")
TINY_GPT2 = os.path.join(FIX, "models", "tiny-gpt2")

# name -> TrainingSpec fields: the tiny models most tests build, and one mid-size model (written from 3 and 4 layers)
CASES = {
    "tiny-llama b2 L64": dict(model=TINY_LLAMA, batch_size=2, seq_len=64),
    "tiny-llama b2 L64 checkpointing": dict(model=TINY_LLAMA, batch_size=2, seq_len=64, grad_checkpointing=True),
    "tiny-llama b2 L64 LoRA r8": dict(model=TINY_LLAMA, batch_size=2, seq_len=64, lora_rank=8),
    "tiny-llama b2 L64 FSDP over 2 ranks": dict(model=TINY_LLAMA, batch_size=2, seq_len=64, world_size=2, sharding="fsdp"),
    "tiny-gpt2 b2 L64 amp-bf16": dict(model=TINY_GPT2, batch_size=2, seq_len=64, precision="amp-bf16"),
    "tiny-gpt2 b2 L64 DP-SGD LoRA r8": dict(model=TINY_GPT2, batch_size=2, seq_len=64, dp=True, lora_rank=8),
    "tests.tiny_models:linear": dict(model="tests.tiny_models:linear"),
    "gpt2 b2 L128": dict(model="gpt2", batch_size=2, seq_len=128),
}

_G = dict(model=TINY_GPT2, seq_len=32)
_L = dict(model=TINY_LLAMA, batch_size=2, seq_len=32)
# the equivalence set (--digest): CASES and one spec per mechanism
EQUIV = {
    **CASES,
    "gpt2 tiny bf16": {**_G, "precision": "bf16"}, "gpt2 tiny eager": {**_G, "attn": "eager"},
    "gpt2 tiny sgd": {**_G, "optimizer": "sgd"}, "gpt2 tiny freeze": {**_G, "freeze": ("wte",)},
    "gpt2 tiny accum2": {**_G, "grad_accum": 2}, "gpt2 tiny a100": {**_G, "gpu": "a100-80gb"},
    "gpt2 tiny hf_trainer": {**_G, "hf_trainer": True, "precision": "amp-fp16"}, "gpt2 tiny compile": {**_G, "compile": True},
    "gpt2 tiny criterion": {**_G, "loss": "criterion-fp32"}, "gpt2 tiny keep_outputs": {**_G, "keep_outputs": True},
    "gpt2 tiny pad": {**_G, "pad_fraction": 0.25}, "gpt2 tiny ckpt 1 layer": {**_G, "grad_checkpointing": True, "checkpoint_layers": 1},
    "gpt2 tiny selective": {**_G, "grad_checkpointing": True, "checkpoint_policy": "selective"},
    "gpt2 tiny offload": {**_G, "offload_layers": 1}, "gpt2 tiny ema": {**_G, "ema": True},
    "gpt2 tiny sft": {**_G, "trainer": "sft"}, "gpt2 tiny sft bfd": {**_G, "trainer": "sft", "packing": "bfd"},
    "gpt2 tiny dpo": {**_G, "trainer": "dpo"},
    "gpt2 tiny grpo": {**_G, "trainer": "grpo", "batch_size": 8, "max_completion_length": 8, "beta": 0.04},
    "gpt2 tiny qlora": {**_G, "lora_rank": 8, "qlora": True}, "gpt2 tiny lora dropout": {**_G, "lora_rank": 8, "lora_dropout": 0.05},
    "gpt2 tiny dp ghost": {**_G, "dp": True, "lora_rank": 8, "grad_sample_mode": "ghost", "batch_size": 4, "physical_batch_size": 2},
    "gpt2 tiny ddp": {**_G, "world_size": 2, "sharding": "ddp"},
    "gpt2 tiny fsdp no reshard": {**_G, "world_size": 2, "sharding": "fsdp", "reshard_after_forward": False},
    "gpt2 tiny hsdp": {**_G, "world_size": 8, "sharding": "hsdp", "shard_size": 4},
    "gpt2 tiny zero1": {**_G, "world_size": 2, "sharding": "zero1"},
    "llama tiny tp2 fsdp": {**_L, "world_size": 4, "sharding": "fsdp", "tp": 2},
    "llama tiny pp2 fsdp": {**_L, "world_size": 4, "sharding": "fsdp", "pp": 2, "pp_schedule": "gpipe"},
    "llama tiny amp-fp16 ckpt": {**_L, "precision": "amp-fp16", "grad_checkpointing": True},
    "llama tiny lora dp hooks": {**_L, "lora_rank": 4, "dp": True},
    "vit tiny": dict(model=os.path.join(FIX, "models", "tiny-vit"), batch_size=4),
    "gpt2 b1 L64 ckpt": dict(model="gpt2", batch_size=1, seq_len=64, grad_checkpointing=True),
    "gpt2 b2 L64 fsdp 2": dict(model="gpt2", batch_size=2, seq_len=64, world_size=2, sharding="fsdp"),
}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def time_cases(names: list[str], runs: int) -> list[dict]:
    from memlens.core.spec import TrainingSpec   # the measured tree's memlens: imported once --tree is on sys.path
    from memlens.estimator import depth, estimate

    rows = []
    for name in names:
        spec = TrainingSpec(**CASES[name])
        estimate(spec)                  # warm: imports, the model's code, torch's fake-tensor dispatch cache
        cpu = []
        load = [_load()]
        for _ in range(runs):
            depth.CHECKED.clear()
            t = time.process_time()
            estimate(spec)
            cpu.append(time.process_time() - t)
        load.append(_load())
        rows.append({"case": name, "cpu_s": round(statistics.median(cpu), 4), "runs_cpu_s": [round(c, 4) for c in cpu],
                     "load_avg": max(load)})
        print(f"{name:40s} {statistics.median(cpu):7.3f} CPU-s  (runs {', '.join(f'{c:.3f}' for c in cpu)}; load {max(load)})",
              flush=True)
    return rows


def digest(names: list[str]) -> dict:
    """Each spec's Result (less its creation time and simulation wall seconds) and its event log's sha256."""
    from memlens.core.errors import MemlensError   # the measured tree's memlens (see time_cases)
    from memlens.core.events import canonical
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import depth, estimate
    from memlens.estimator.simulate import simulate

    out = {}
    for name in names:
        depth.CHECKED.clear()
        try:
            spec = TrainingSpec(**EQUIV[name])
            d = estimate(spec).to_dict()
        except MemlensError as e:
            out[name] = {"error": e.message}
            print(f"{name:40s} error: {e.message}", flush=True)
            continue
        d.pop("created_at", None)
        _drop_seconds(d)
        log = None
        if spec.world_size == 1:
            depth.CHECKED.clear()
            log = hashlib.sha256(repr(canonical(simulate(spec).log)).encode()).hexdigest()
        out[name] = {"result": d, "log_sha256": log}
        print(f"{name:40s} peak {d.get('peak_allocated_bytes')}  log {log and log[:12]}", flush=True)
    return out


def _drop_seconds(d) -> None:
    """The simulation's own wall time (``simulate_seconds``) differs run to run: dropped."""
    if isinstance(d, dict):
        for k in [k for k in d if k in ("simulate_seconds", "estimate_seconds")]:
            d.pop(k)
        for v in d.values():
            _drop_seconds(v)
    elif isinstance(d, list):
        for v in d:
            _drop_seconds(v)


def render(before: dict, after: dict) -> None:
    rows = []
    for b in before["rows"]:
        a = next((r for r in after["rows"] if r["case"] == b["case"]), None)
        if a is not None:
            rows.append({"case": b["case"], "before_cpu_s": b["cpu_s"], "after_cpu_s": a["cpu_s"],
                         "change": round(a["cpu_s"] / b["cpu_s"] - 1, 3), "load_before": b["load_avg"], "load_after": a["load_avg"]})
    tb, ta = sum(r["before_cpu_s"] for r in rows), sum(r["after_cpu_s"] for r in rows)
    out = {"before": before["meta"], "after": after["meta"], "rows": rows,
           "total_before_cpu_s": round(tb, 3), "total_after_cpu_s": round(ta, 3), "total_change": round(ta / tb - 1, 3)}
    with open(os.path.join(HERE, "results", "sim_speed.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = ["# CPU seconds of one simulation (`bench/sim_speed.py`)", "",
             f"Before: {before['meta']['label']}; after: {after['meta']['label']}. Median of {before['meta']['runs']} runs "
             "each, CPU seconds (`time.process_time`) of a whole `estimate` after a warm-up one in the same process; "
             f"{before['meta']['machine']}, shared (load averages below).", "",
             "| case | before | after | change | load before / after |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['before_cpu_s']:.3f} | {r['after_cpu_s']:.3f} | {100 * r['change']:+.1f}% "
                     f"| {r['load_before']} / {r['load_after']} |")
    lines.append(f"| **all** | **{tb:.3f}** | **{ta:.3f}** | **{100 * (ta / tb - 1):+.1f}%** | |")
    with open(os.path.join(HERE, "results", "sim_speed.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=ROOT, help="the checkout whose memlens is measured (default: this one)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", action="append", default=[], help="cases whose name contains this (repeatable)")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--digest", metavar="JSON", help="write every result of the equivalence set here instead of timing")
    ap.add_argument("--render", nargs=2, metavar=("BEFORE", "AFTER"), help="write results/sim_speed.{json,md}")
    a = ap.parse_args()
    if a.render:
        render(*(json.load(open(p)) for p in a.render))
        return
    sys.path.insert(0, os.path.abspath(a.tree))
    os.chdir(a.tree)                                   # factories given by module name (tests.tiny_models:linear)
    os.environ.setdefault("MEMLENS_WORKERS", "1")
    if a.digest:
        names = [n for n in EQUIV if not a.only or any(o in n for o in a.only)]
        with open(a.digest, "w") as f:
            json.dump(digest(names), f, indent=1, sort_keys=True, default=str)
        return
    names = [n for n in CASES if not a.only or any(o in n for o in a.only)]
    rows = time_cases(names, a.runs)
    meta = {"label": a.label, "tree": a.tree, "runs": a.runs, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
