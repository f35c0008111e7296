"""memlens.guard() and adaptive_batch() on a real CUDA device (skipped without one): a planted OOM
under a memory fraction writes a report whose categories sum to memory_allocated() at the failure
(read by an independent OOM observer) and whose snapshot opens with torch.cuda._memory_viz; a loop
started with a micro-batch that does not fit ends like one started at the right size. Each in a
fresh process (its own allocator and memory fraction)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GUARD = textwrap.dedent("""
    import json, pickle, sys, torch
    from torch.cuda import _memory_viz
    import memlens
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda d, a, t, f: seen.append(torch.cuda.memory_allocated(d)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                                      torch.nn.Linear(4096, 1024)) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out = sys.argv[1]
    try:
        with memlens.guard(model, opt, out_dir=out):
            for b in (64, 64, 4096):
                if b == 4096:
                    total = torch.cuda.get_device_properties(0).total_memory
                    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 2**28) / total)
                model(torch.randn(b, 1024, device="cuda")).pow(2).mean().backward()
                opt.step(); opt.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError as e:
        notes = getattr(e, "__notes__", [])
    d = json.load(open(out + "/oom_report.json"))
    snap = pickle.load(open(out + "/oom_snapshot.pickle", "rb"))
    viz = [len(getattr(_memory_viz, f)(snap)) for f in ("segsum", "trace", "trace_plot", "segment_plot")]
    params = sum(-(-p.numel() * 4 // 512) * 512 for p in model.parameters())
    print(json.dumps({"allocated": seen[-1], "sum": d["categories_sum_bytes"], "by_category": d["by_category"],
                      "diagnosis": d["diagnosis"], "viz": viz, "notes": notes, "params": params,
                      "modules": [m["module"] for m in d["by_module"]]}))
""")

ADAPTIVE = textwrap.dedent("""
    import json, sys, torch
    import memlens
    def run(micro, frac, adaptive):
        torch.cuda.set_per_process_memory_fraction(frac) if frac else None
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 512)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ab = memlens.adaptive_batch(opt, micro_batch=micro, trend=False)
        g = torch.Generator(device="cuda").manual_seed(1)
        losses = []
        for _ in range(3):
            x = torch.randn(65536, 512, device="cuda", generator=g)
            losses.append(ab.step(x, lambda mb: model(mb).pow(2).mean()).item())
        return losses, [(c.micro_batch_from, c.micro_batch_to) for c in ab.changes], torch.cuda.max_memory_allocated()
    mode = sys.argv[1]
    if mode == "calib":
        print(json.dumps([run(m, None, False)[2] for m in (int(sys.argv[2]),)]))
    else:
        print(json.dumps(run(int(sys.argv[2]), float(sys.argv[3]), True)))
""")


def _py(code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_guard_report_at_a_planted_oom(tmp_path):
    d = _py(GUARD, str(tmp_path / "oom"))
    assert abs(d["sum"] - d["allocated"]) <= 0.01 * d["allocated"]
    assert d["by_category"]["parameters"] == d["params"]
    assert d["by_category"]["optimizer_state"] >= 2 * d["params"]
    assert d["diagnosis"] == "memory_fraction_limit"
    assert all(n > 0 for n in d["viz"]) and "oom_report.html" in d["notes"][0]
    assert any(m.startswith("0") for m in d["modules"])


@pytest.mark.gpu
def test_adaptive_started_twice_too_large_matches_the_right_size():
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    (peak_m,) = _py(ADAPTIVE, "calib", "16384")       # hidden activations of 16384 x 8192 fp32: 512 MiB each
    (peak_2m,) = _py(ADAPTIVE, "calib", "32768")
    frac = ((peak_m * 1.1 + 2**29) + peak_2m) / 2 / total
    assert peak_m * 1.1 + 2**29 < peak_2m, "the test's sizes no longer separate the two micro-batches"
    ref_losses, ref_changes, _ = _py(ADAPTIVE, "run", "16384", str(frac))
    losses, changes, _ = _py(ADAPTIVE, "run", "32768", str(frac))
    assert ref_changes == [] and changes == [[32768, 16384]]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
