"""`memlens profile --world-size 2` under torchrun on 2 GPUs: each rank's peak is that rank's own
torch.cuda.max_memory_allocated() (GPU only; needs 2 GPUs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _two_gpus() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.device_count() >= 2
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [
    ["--model", "gpt2", "--batch-size", "4", "--seq-len", "512", "--sharding", "ddp"],
    ["--model", "llama-3.2-1b", "--batch-size", "2", "--seq-len", "1024", "--precision", "amp-bf16", "--sharding", "fsdp"],
])
def test_each_rank_peak_is_its_max_memory_allocated(flags, tmp_path):
    if not _two_gpus():
        pytest.skip("needs 2 GPUs")
    p = subprocess.run([sys.executable, "-m", "memlens.cli.main", "profile", *flags, "--world-size", "2", "--steps", "2",
                        "--out", str(tmp_path), "--json"], capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout)
    assert [r["rank"] for r in d["ranks"]] == [0, 1]
    for r in d["ranks"]:
        assert r["peak_allocated_bytes"] == r["max_memory_allocated_bytes"], r
        assert r["peak_reserved_bytes"] == r["max_memory_reserved_bytes"], r
    assert d["peak_allocated_bytes"] == max(r["peak_allocated_bytes"] for r in d["ranks"])
    assert (tmp_path / "report.html").read_text().count("<polyline") == 2
