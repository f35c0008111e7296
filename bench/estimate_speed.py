"""Speed and memory of `memlens estimate` on this CPU (issue 2's figures).

python bench/estimate_speed.py  -> bench/results/estimate_speed.json and .md
- in process, after `import torch, transformers, memlens`: the first estimate (cold: includes
  transformers' lazy import of the model's code); in another fresh process, the estimate after
  importing the model's modules too; and a repeated one (warm);
- the whole command from the shell (`memlens estimate ... --json`), wall time and max RSS;
- the floor: a bare fake-tensor step of the same model with no tracking.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [
    ("llama-3.2-1b bf16 b4 L2048", ["--model", "llama-3.2-1b", "--batch-size", "4", "--seq-len", "2048", "--precision", "bf16"]),
    ("llama-3.1-8b LoRA r16 bf16 b4 L1024", ["--model", "llama-3.1-8b", "--lora-rank", "16", "--batch-size", "4", "--seq-len", "1024", "--precision", "bf16"]),
    ("llama-3.1-70b LoRA r16 bf16 ckpt b1 L2048", ["--model", "llama-3.1-70b", "--lora-rank", "16", "--batch-size", "1", "--seq-len", "2048", "--precision", "bf16", "--grad-checkpointing"]),
]

AFTER_IMPORTS = r"""
import json, sys, time, importlib
import torch, transformers, memlens, peft
from memlens.cli.common import spec_from_args
from memlens.cli.main import build_parser
from memlens.models.source import resolve
import memlens.estimator.simulate, memlens.models.build
args = build_parser().parse_args(["estimate", *sys.argv[1:]])
spec = spec_from_args(args)
mt = resolve(spec.model).config.model_type
importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")  # what transformers imports lazily
import transformers.masking_utils, transformers.loss.loss_utils
from memlens.estimator import estimate
t = time.perf_counter(); estimate(spec); print(time.perf_counter() - t)
"""

CHILD = r"""
import json, sys, time, resource
t0 = time.perf_counter()
import torch, transformers, memlens
from memlens.cli.common import spec_from_args
from memlens.cli.main import build_parser
t_imp = time.perf_counter() - t0
args = build_parser().parse_args(["estimate", *sys.argv[1:]])
spec = spec_from_args(args)
from memlens.estimator import estimate
import importlib
t = time.perf_counter(); estimate(spec); cold = time.perf_counter() - t
# a second fresh process could import the model's own modules first (transformers imports them
# lazily on the first use): measure that split in the child below
t = time.perf_counter(); estimate(spec); warm = time.perf_counter() - t
# floor: the bare fake step, no tracking, no CUDA mapping
from memlens.estimator.simulate import _synthetic_batch_shortcuts
from memlens.step import prepare
p = prepare(spec, fake=True)
with p.fake_mode, _synthetic_batch_shortcuts():
    p.run()
    t = time.perf_counter(); p.run(); bare = time.perf_counter() - t
print(json.dumps({"imports_s": t_imp, "cold_s": cold, "after_imports_s": AFTER, "warm_s": warm, "bare_fake_step_s": bare,
                  "child_max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    rows = []
    exe = os.path.join(os.path.dirname(sys.executable), "memlens")
    for name, argv in CASES:
        after = float(subprocess.run([sys.executable, "-c", AFTER_IMPORTS, *argv], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        inproc = json.loads(subprocess.run([sys.executable, "-c", CHILD.replace("AFTER", repr(after)), *argv], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        t = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        subprocess.run([exe, "estimate", *argv, "--json"], capture_output=True, check=True)
        shell = time.perf_counter() - t
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        rows.append({"case": name, **inproc, "command_s": shell, "command_max_rss_mib": rss if rss > before / 1024 else None})
        print(rows[-1], flush=True)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    out = os.path.join(HERE, "results")
    with open(os.path.join(out, "estimate_speed.json"), "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "estimate_speed.md"), "w") as f:
        f.write(f"# estimate speed on {machine} (no GPU)\n\n")
        f.write("| case | imports | first estimate in a fresh process | estimate after all imports (model modules too) | estimate, repeated | bare fake step (floor, 1 step) | whole command | max RSS |\n|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['case']} | {r['imports_s']:.1f} s | {r['cold_s']:.1f} s | {r['after_imports_s']:.1f} s | {r['warm_s']:.1f} s | {r['bare_fake_step_s']:.1f} s | "
                    f"{r['command_s']:.1f} s | {r['child_max_rss_mib']:.0f} MiB |\n")


if __name__ == "__main__":
    main()
