"""The GPU registry (memlens.core.gpus): every hardware fact in one place, for every GPU."""
import dataclasses

import pytest

from memlens.core import gpus
from memlens.core.errors import SpecError
from memlens.core.gpus import GPUS, HOST_CPU_ADAM_PARAMS_PER_S, gpu_facts, nccl_bytes
from memlens.core.spec import TrainingSpec
from memlens.estimator.compiled import _compute_bound
from memlens.explore.core import Point, predict_step_time

DATASHEET = ("peak_tflops_half", "peak_tflops_fp32", "dram_gbps", "pcie_gbps")


@pytest.mark.parametrize("name", sorted(GPUS))
def test_every_gpu_has_every_fact(name):
    f = gpu_facts(name)
    for field in dataclasses.fields(f):
        assert getattr(f, field.name) is not None, f"{name} lacks {field.name}"
    for field in DATASHEET + ("matmul_tflops_half", "matmul_tflops_fp32", "pcie_bytes_per_s"):
        assert getattr(f, field) > 0, f"{name}: {field} is {getattr(f, field)}"


def test_datasheet_figures():
    # NVIDIA data sheets (cited beside each entry in memlens/core/gpus.py)
    assert [(gpu_facts(g).peak_tflops_half, gpu_facts(g).dram_gbps, gpu_facts(g).pcie_gbps)
            for g in ("h100", "a100-40gb", "rtx-4090", "t4", "v100")] == [
        (989.5, 3350, 64), (312.5, 1555, 32), (165, 1008, 32), (65, 320, 16), (125, 900, 16)]


def test_effective_rates_scale_from_the_h100():
    assert (gpu_facts("h100").matmul_tflops_half, gpu_facts("h100").matmul_tflops_fp32) == (120.0, 40.0)
    assert (gpu_facts("a100-80gb").matmul_tflops_half, gpu_facts("l4").matmul_tflops_fp32) == (37.9, 4.8)
    assert [gpu_facts(g).pcie_bytes_per_s for g in ("h100", "a100-80gb", "t4")] == [20e9, 10e9, 5e9]


def test_compute_bound_uses_each_gpus_own_balance():
    # M = K = N = 360: intensity 120; half the machine balance: H100 147.7, T4 101.6 (no H100 stand-in for the T4)
    assert not _compute_bound(360, 360, 360, "h100")
    assert _compute_bound(360, 360, 360, "t4")
    assert _compute_bound(360, 360, 360, "rtx-3090") and not _compute_bound(360, 360, 360, None)


def test_offload_time_uses_the_gpus_pcie_and_the_host_adam_rate():
    p = Point(0, 0, param_count=100_000_000, trainable_param_count=100_000_000)
    s = TrainingSpec(model="m", batch_size=8, seq_len=1024, offload_optimizer=True)
    adam = 1e8 / HOST_CPU_ADAM_PARAMS_PER_S
    # fp32 gradients out + parameters back: 8e8 bytes over 20 GB/s (H100) or 5 GB/s (T4, PCIe Gen3)
    assert predict_step_time(s, p).parts["offload"] == pytest.approx(8e8 / 20e9 + adam)
    assert predict_step_time(s.replace(gpu="t4"), p).parts["offload"] == pytest.approx(8e8 / 5e9 + adam)


def test_nccl_bytes_measured_nearest_or_unknown():
    assert nccl_bytes("h200", 2) == gpus.NCCL_MEASURED[("h200", 2)]
    b, src = nccl_bytes("h200", 8)
    assert b == 964689920 and "measured at world size 4, not 8" in src
    # a rank of a 2D mesh holds a communicator per mesh dimension (measured: 1,886 MiB under HSDP 2 x 2 on 4 H200s)
    b2, src2 = nccl_bytes("h200", 4, communicators=2)
    assert b2 == 2 * 964689920 and "x 2 communicators" in src2
    assert nccl_bytes("h100", 2)[0] == 966787072 and "2 x NVIDIA H100" in nccl_bytes("h100", 2)[1]
    assert nccl_bytes("a100-80gb", 2)[0] is None and "not measured for a100-80gb" in nccl_bytes("a100-80gb", 2)[1]


def test_unknown_gpu_is_one_error():
    with pytest.raises(SpecError, match="unknown GPU 'h10'") as e:
        gpu_facts("h10")
    assert "did you mean 'h100'" in e.value.hint


@pytest.mark.parametrize("fields, n", [
    (dict(world_size=1, sharding="none"), 0),
    (dict(world_size=4, sharding="ddp"), 1), (dict(world_size=4, sharding="fsdp"), 1),
    (dict(world_size=4, sharding="hsdp", shard_size=2), 2), (dict(world_size=4, sharding="hsdp", shard_size=4), 1),
    (dict(world_size=4, sharding="fsdp", tp=2), 2), (dict(world_size=2, sharding="fsdp", tp=2), 1),
    (dict(world_size=8, sharding="hsdp", shard_size=2, tp=2), 3),
    (dict(world_size=4, sharding="fsdp", cp=2), 2), (dict(world_size=4, sharding="fsdp", pp=2), 2),
])
def test_a_rank_uses_one_communicator_per_mesh_dimension(fields, n):
    from types import SimpleNamespace

    from memlens.core.parallel import communicators

    spec = SimpleNamespace(**{"shard_size": None, "tp": 1, "cp": 1, "pp": 1, **fields})
    assert communicators(spec) == n
