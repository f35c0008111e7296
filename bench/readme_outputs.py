"""The README's example outputs that run on a CPU, regenerated at full size (the README quotes these files).

    python bench/readme_outputs.py            # a few minutes on 2 cores (fit simulates ~40 steps of GPT-2)

Writes bench/results/readme/<name>.txt: the command line, then its stdout as `memlens` prints it (COLUMNS=200),
then the wall time and the versions it ran with. tests/test_readme.py runs the same commands on tiny stand-ins and
compares their output with the README on its shape.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CASES = {
    "estimate_llama-3.2-1b": "estimate --model llama-3.2-1b --batch-size 4 --seq-len 2048 --precision bf16",
    "fit_gpt2": "fit --model gpt2 --seq-len 512 --batch-size 32 --budget 16GiB",
}


def main() -> None:
    only = sys.argv[1:]
    out_dir = os.path.join(HERE, "results", "readme")
    os.makedirs(out_dir, exist_ok=True)
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name, cmd in CASES.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "memlens.cli.main", *cmd.split()], cwd=ROOT, env=env, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            sys.exit(f"{name} failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
        v = subprocess.run([sys.executable, "-c", "import torch, transformers; print(torch.__version__, transformers.__version__)"],
                           capture_output=True, text=True).stdout.split()
        with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
            f.write(f"$ memlens {cmd}\n{r.stdout.rstrip()}\n# {dt:.0f} s whole command on {os.cpu_count()} cores (load average "
                    f"{os.getloadavg()[0]:.1f}); torch {v[0]}, transformers {v[1]}\n")
        print(f"{name}: {dt:.1f} s", flush=True)


if __name__ == "__main__":
    main()
