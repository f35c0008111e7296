"""The README's example outputs that run on a CPU, regenerated at full size (the README quotes these files).

    python bench/readme_outputs.py [NAME ...]   # about 2 minutes on 2 cores (fit ~20 s, profile on the CPU ~40 s)

Writes bench/results/readme/<name>.txt: the command line, then its stdout as `memlens` prints it (COLUMNS=200, or
the case's width), then the wall time and the versions it ran with. tests/test_readme.py runs the same commands on
tiny stand-ins and compares their output with the README on its shape; tests/test_readme_python.py checks that the
README shows lines of these files, as they are.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 23.65 GiB of "
       "which 1.19 GiB is free. Including non-PyTorch memory, this process has 22.45 GiB memory in use. Of the allocated "
       "memory 21.70 GiB is allocated by PyTorch, and 110.00 MiB is reserved by PyTorch but unallocated.")
# name -> the command after `memlens` (shell syntax), or (command, terminal width) where 200 columns is too wide for
# the README. tests/test_readme_python.py checks that the README's output under each of these commands is lines of
# its file.
CASES = {
    "estimate_llama-3.2-1b": "estimate --model llama-3.2-1b --batch-size 4 --seq-len 2048 --precision bf16",
    "fit_gpt2": "fit --model gpt2 --seq-len 512 --batch-size 32 --budget 16GiB",
    # the quickstart
    "quick_estimate_gpt2": "estimate --model gpt2 --batch-size 8 --seq-len 1024 --precision amp-bf16",
    "quick_compare_gpt2": ("compare --model gpt2 --batch-size 8 --seq-len 1024 --techniques fp32,amp-bf16,checkpointing,amp-bf16+checkpointing", 110),
    "quick_profile_gpt2_cpu": ("profile --model gpt2 --device cpu --steps 1 --batch-size 1 --seq-len 64", 110),
    "quick_doctor_oom": (f"doctor oom {shlex.quote(OOM)}", 110),
}


def command(name: str) -> str:
    c = CASES[name]
    return c if isinstance(c, str) else c[0]


def main() -> None:
    only = sys.argv[1:]
    out_dir = os.path.join(HERE, "results", "readme")
    os.makedirs(out_dir, exist_ok=True)
    for name, case in CASES.items():
        if only and name not in only:
            continue
        cmd, columns = (case, 200) if isinstance(case, str) else case
        env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "memlens.cli.main", *shlex.split(cmd)], cwd=ROOT, env=env, capture_output=True, text=True)
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
