"""A two-process stand-in for torchrun (tests/bench/test_gpu_runner.py): runs the command once per RANK, each in a
session of its own as torchrun's elastic agent starts them."""
import os
import subprocess
import sys

n, cmd = int(sys.argv[1]), sys.argv[2:]
procs = [subprocess.Popen([sys.executable, *cmd], env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(n)),
                          start_new_session=True) for r in range(n)]
sys.exit(max(p.wait() for p in procs))
