"""`memlens profile --dp` on a GPU: its peak is the process' max_memory_allocated() of the same run,
and its snapshots include the seed's setup phases (privacy engine setup) and each physical batch.

Needs a CUDA GPU and opacus (on the GPU machine: PYTHONPATH=/tmp/site after installing the carried
wheels, see bench/gpu_opacus.py). Each run is a fresh process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUN = textwrap.dedent("""
    import json, sys, torch
    from memlens import TrainingSpec
    from memlens.measure.runner import profile_spec
    spec = TrainingSpec(model="llama-3.2-1b", precision="bf16", lora_rank=8, batch_size=8, physical_batch_size=4, seq_len=256,
                        dp=True, optimizer="sgd", grad_sample_mode=sys.argv[2])
    r, _ = profile_spec(spec, steps=2, warmup=1, device="cuda", mode=sys.argv[1])
    torch.cuda.synchronize()
    print(json.dumps({"peak": r.peak_allocated_bytes, "max_allocated": torch.cuda.max_memory_allocated(),
                      "labels": [s["label"] for s in r.data["snapshots"]]}))
""")


@pytest.mark.gpu
@pytest.mark.parametrize("mode,gsm", [("phases", "hooks"), ("full", "hooks"), ("full", "ghost")])
def test_profile_dp_peak_is_max_memory_allocated(mode, gsm):
    pytest.importorskip("opacus")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    p = subprocess.run([sys.executable, "-c", RUN, mode, gsm], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["peak"] == r["max_allocated"]
    assert r["labels"][:5] == ["model load", "data preparation", "optimizer setup", "privacy engine setup", "warmup (1 step)"]
    assert "step 1 physical 1/2 clip" in r["labels"] and "step 2 physical 2/2 optimizer" in r["labels"]
