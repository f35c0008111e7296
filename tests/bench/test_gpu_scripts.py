"""Every bench/gpu_*.py script that runs cases runs them through bench/gpu_runner.py (issue 35: no copied runner);
the scripts left out are single-case probes or drive memlens' own measured verbs, each named here with why."""
from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
NOT_CASE_RUNNERS = {   # script: why it has no loop of cases for the runner
    "gpu_bert_eager_probe.py": "one case per command, in its own process",
    "gpu_fp16_steps.py": "one case per command, in its own process",
    "gpu_peak_probe.py": "one case per command, in its own process",
    "gpu_history_case.py": "one case per command, in its own process",
    "gpu_t5_sdpa_probe.py": "one case per command, in its own process",
    "gpu_tied_sum_probe.py": "one case per command, in its own process (an allocator trace of one step)",
    "gpu_sdpa_probe.py": "one process of microbenchmarks (kernel choice per dtype), no model step",
    "gpu_calibrate.py": "one process of microbenchmarks: the CUDA context and workspaces it reads need that one process",
    "gpu_compare.py": "memlens.compare(measure=True): the library's own trial runner (memlens.measure.trial)",
    "gpu_sweep.py": "memlens.sweep(measure=True): the library's own trial runner",
    "gpu_budget_rule.py": "memlens.sweep(measure=True): the library's own trial runner",
    "gpu_host_probe.py": "times the host's seconds of a few loops on one GPU in one process (no cases, no subprocesses)",
    "gpu_unaligned_probe.py": "re-measures calibrate's unaligned GEMM grids and the GPT-2 head's rates in one process",
    "gpu_opacus_sweep.py": "kills and resumes `memlens sweep --measure` itself (the test is the sweep's own resume)",
}


def test_every_gpu_script_with_cases_uses_the_one_runner():
    scripts = sorted(p.name for p in BENCH.glob("gpu_*.py") if p.name != "gpu_runner.py")
    assert set(NOT_CASE_RUNNERS) <= set(scripts), sorted(set(NOT_CASE_RUNNERS) - set(scripts))
    for name in scripts:
        text = (BENCH / name).read_text()
        uses = "from bench.gpu_runner import" in text
        copied = re.search(r"subprocess\.(run|Popen)\(\[sys\.executable, (os\.path\.abspath\()?__file__\)?, [^\]]*--child", text)
        if name in NOT_CASE_RUNNERS:
            assert not uses, f"{name} uses the runner now: take it out of NOT_CASE_RUNNERS"
        else:
            assert uses and not copied, f"{name}: run its cases through bench/gpu_runner.py"
