"""Multi-GPU bad input: one line, exit 2 (issue 10)."""
from __future__ import annotations

import pytest

from memlens.cli.main import main
from memlens.core.errors import MemlensError, SpecError
from memlens.core.spec import TrainingSpec


@pytest.mark.parametrize("argv, needle", [
    (["estimate", "--model", "gpt2", "--sharding", "fsdp"], "needs --world-size"),
    (["estimate", "--model", "gpt2", "--world-size", "2"], "needs --sharding"),
    (["estimate", "--model", "gpt2", "--world-size", "2", "--sharding", "fsdp", "--precision", "amp-fp16"], "amp-fp16"),
    (["estimate", "--model", "gpt2", "--world-size", "2", "--sharding", "fsdp", "--offload-optimizer"], "offload"),
    (["estimate", "--model", "gpt2", "--world-size", "2", "--sharding", "zero1", "--dp"], "DP-SGD"),
    (["estimate", "--model", "gpt2", "--world-size", "2", "--sharding", "ddp", "--reshard-after-forward", "false"], "FSDP2 setting"),
    (["estimate", "--model", "gpt2", "--world-size", "2", "--sharding", "zero2", "--reshard-after-forward", "true"], "zero2"),
    (["estimate", "--model", "gpt2", "--world-size", "4", "--sharding", "fsdp", "--reshard-after-forward", "3"], "divisor"),
    (["estimate", "--model", "gpt2", "--world-size", "2", "--sharding", "fsdp", "--reshard-after-forward", "maybe"], "true, false"),
    (["estimate", "--model", "gpt2", "--world-size", "2", "--sharding", "fsdp", "--bucket-cap-mb", "25"], "DDP setting"),
    (["estimate", "--model", "gpt2", "--world-size", "2", "--sharding", "ddp", "--bucket-cap-mb", "-1"], "positive"),
    (["estimate", "--model", "gpt2", "--deepspeed", "ds.json"], "DeepSpeed"),
    (["fit", "--model", "gpt2", "--world-size", "4", "--sharding", "ddp", "--budget", "80GiB", "--target-batch", "30"],
     "does not split evenly"),
    (["profile", "--model", "gpt2", "--world-size", "2", "--sharding", "fsdp"], "GPUs"),
    (["profile", "--model", "gpt2", "--world-size", "2", "--sharding", "fsdp", "--device", "cpu"], "gloo"),
    (["sweep", "--model", "gpt2", "--batch-sizes", "1", "--gpus", "0,1"], "--measure"),
])
def test_one_line_exit_2(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ERROR: ") and "HINT: " in err and "\n" not in err and needle in err, err


def test_estimate_refuses_inside_a_running_process_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memlens.estimator import estimate

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(MemlensError, match="already has one"):
            estimate(TrainingSpec(model="tests.distributed.dist_models:blocks", world_size=2, sharding="ddp"))
    finally:
        dist.destroy_process_group()


def test_real_step_outside_torchrun_is_refused():
    from memlens.step import prepare

    with pytest.raises(SpecError, match="not one rank"):
        prepare(TrainingSpec(model="tests.distributed.dist_models:blocks", world_size=2, sharding="ddp"), device="cpu")
