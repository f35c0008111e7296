"""On a real GPU: each optimizer implementation's step takes what the estimate says (run on the device).

Each case runs in a fresh process: the profile's peak is the process' max_memory_allocated, so
blocks other tests left in the same process would count (measured: 1 to 5 MiB after the GPU suite).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = textwrap.dedent("""
    import json, sys
    from memlens import estimate
    from memlens.core.spec import TrainingSpec
    from memlens.measure.runner import profile_spec
    spec = TrainingSpec(model="tests.tiny_models:linear_norm", optimizer=sys.argv[1], max_grad_norm=1.0, hf_trainer=True)
    result, _ = profile_spec(spec, steps=2, warmup=0, device="cuda", mode="phases")
    est = estimate(spec)
    print(json.dumps({"measured": result.peak_allocated_bytes, "estimated": est.peak_allocated_bytes,
                      "measured_phases": result.by_phase, "estimated_phases": est.by_phase}))
""")

# Both Adafactors reduce the 4 MiB gradient over dim -2 (torch's: vector_norm for the column factor;
# transformers': (grad**2 + eps).mean(dim=-2)), and CUDA's reduction kernel then takes a global
# staging buffer (aten/src/ATen/native/cuda/Reduce.cuh, ctas_per_output > 1): 8 MiB for torch's,
# measured by bench/gpu_peak_probe.py adafactor on an H100 (transformers': 4 MiB more than the
# estimate); memlens does not model Reduce.cuh's launch configuration (docs/estimate.md, Limits worth knowing)
REDUCE_BUFFER = pytest.mark.xfail(strict=True, reason="CUDA reduction staging buffer not modelled (measured: 8 MiB)")
# transformers' Adafactor: 4 MiB over the estimate on an H100, within 64 KiB of it on an H200 (2026-11-28, the twelfth
# session's GPU run): whether its mean over dim -2 takes the staging buffer differs between the two machines, not modelled
REDUCE_BUFFER_SOME_GPUS = pytest.mark.xfail(strict=False, reason="CUDA reduction staging buffer not modelled (an H100: "
                                                                 "4 MiB; an H200: none)")


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-fused", "adam-fused", "sgd-momentum",
                                       pytest.param("adafactor", marks=REDUCE_BUFFER),
                                       pytest.param("adafactor-hf", marks=REDUCE_BUFFER_SOME_GPUS)])
def test_optimizer_memory_matches_real_steps(optimizer):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    p = subprocess.run([sys.executable, "-c", RUN, optimizer], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # a 4 MiB weight: the implementations differ by whole parameter-sized temporaries (foreach, Adafactor)
    # or 512-byte step counters (fused); the cuBLAS workspaces are the same on both sides
    assert abs(r["estimated"] - r["measured"]) <= 64 * 1024, r
