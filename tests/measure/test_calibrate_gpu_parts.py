"""calibrate over several GPUs (memlens.measure.calibrate_nccl), run where a machine has two or more (the device):
every collective's row measured at every size, the overlap's cost in range, FSDP2's hooks over the ranks."""
import pytest

from memlens.estimator.timing.tables import GRID_NCCL


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
def test_calibrate_over_every_gpu_measures_the_collectives_the_overlap_and_fsdp2s_hooks():
    import torch

    if _gpus() < 2:
        pytest.skip("needs 2 or more GPUs")
    from memlens.measure.calibrate_nccl import measure_ranks

    logs = []
    out = measure_ranks(torch, _gpus(), GRID_NCCL[::3], {"view": 2.0, "model_forward": 30.0, "model_backward": 30.0}, logs.append)
    rows = out["nccl"][str(_gpus())]
    assert set(rows) == {"all_reduce", "all_gather", "reduce_scatter"}
    for r in rows.values():
        assert r["bytes"] == list(GRID_NCCL[::3]) and all(v > 0 for v in r["busbw_gbps"])
        assert r["busbw_gbps"][-1] > r["busbw_gbps"][0]          # a large message amortizes the launch
    ov = out["overlap"][str(_gpus())]
    assert 0 <= ov["matmul"] < 1 and 0 <= ov["memory"] < 1 and ov["comm_beside_matmul"] >= 0.9
    assert out["host_us"]["fsdp_forward_group_ranks"] > 0 and out["host_us"]["fsdp_optimizer_tensor_op_ranks"] >= 0
    assert logs[0].startswith(f"NCCL over {_gpus()} GPUs")


@pytest.mark.gpu
def test_calibrate_measures_bitsandbytes_4bit_layers_per_call_where_it_is_installed():
    import torch

    pytest.importorskip("bitsandbytes")
    from memlens.measure.calibrate import measure_qlora_host

    logs = []
    out = measure_qlora_host(torch, torch.device("cuda"), {"view": 2.0, "model_forward": 30.0, "model_backward": 30.0}, logs.append)
    assert set(out) == {"qlora_layer_forward", "qlora_layer_backward"} and all(v >= 0 for v in out.values())
    assert logs[-1].startswith("bitsandbytes' 4-bit layers per call (112 layers")
    assert measure_qlora_host(torch, torch.device("cpu"), {}, logs.append) == {}
