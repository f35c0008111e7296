"""memlens calibrate's arithmetic on a CPU (the timings stubbed): what each new table section is made of."""
import itertools
import math

import pytest
import torch

import memlens.measure.calibrate as cal


def test_op_ratios_are_the_ops_bytes_rate_over_the_copys(monkeypatch):
    # every op "takes" 1 ms: its ratio is (its bytes as the time model counts them / 1 ms) / the copy's 100 GB/s
    seen = {}
    monkeypatch.setattr(cal, "BN_BATCH", 2)     # the five batch-norm shapes at batch 2: their names, not their sizes

    def one_ms(torch_, fn, **kw):
        fn()
        return 1e-3

    bw = {"bytes": [1, 2**40], "gbps": [100.0, 100.0]}
    old = cal._gpu_seconds
    cal._gpu_seconds = one_ms
    try:
        # on the meta device: the ops' shapes, not their work (a real CPU ran them at calibrate's sizes: seconds)
        ratios = cal.measure_op_ratios(torch, torch.device("meta"), bw, lambda s: seen.setdefault("log", s))
    finally:
        cal._gpu_seconds = old
    N, H = 8192, 2048
    # mul of two bf16 [N, H]: 2 read + 1 written = 3 N H 2 bytes in 1 ms = 100.7 GB/s -> 1.007 of a copy
    assert ratios["mul"] == pytest.approx(3 * N * H * 2 / 1e-3 / 1e9 / 100.0, abs=1e-3)
    # the loss reads its [N/2, 32768] fp32 input as the model counts it: a gather is far under that: clamped at 50
    assert ratios["nll_loss_forward"] == pytest.approx(min(50.0, (N // 2 * 32768 * 4 + N // 2 * 8 + 8) / 1e-3 / 1e9 / 100.0), rel=1e-3)
    assert set(ratios) >= {"_log_softmax/w131072", "sum", "native_batch_norm_backward",
                           "native_batch_norm/hw49", "native_batch_norm_backward/hw12544", "_to_copy/up", "copy_/up",
                           "native_layer_norm_backward/w768/fp32", "native_layer_norm/w96",
                           "_softmax/w1024", "_softmax_backward_data/w2048/16bit", "mul/heads", "add/heads", "mul/rows"}
    # each softmax op at each width in fp32 and bf16 (10 x 2 x 4), 64 MiB of input or 256 rows: softmax's backward
    # reads the gradient and the probabilities, writes the input's gradient: 3 x [16384, 1024] fp32 in 1 ms
    assert sum("softmax" in k for k in ratios) == 80 and sum("layer_norm" in k for k in ratios) == 9 * 2 * 2
    # a 96-wide fp32 layer norm: 64 MiB of rows read and written, the fp32 weight and bias read, mean and rstd written
    rows = 2**26 // (96 * 4)
    assert ratios["native_layer_norm/w96/fp32"] == pytest.approx((2 * rows * 96 + 2 * 96 + 2 * rows) * 4 / 1e-3 / 1e9 / 100.0,
                                                                 rel=1e-3)
    assert ratios["_softmax_backward_data/w1024"] == pytest.approx(3 * 2**26 / 1e-3 / 1e9 / 100.0, abs=1e-3)
    # 262,144 bf16 values a row (512 KiB): 128 rows would make 64 MiB; 256 rows, read and written once
    assert ratios["_log_softmax/w262144/16bit"] == pytest.approx(2 * 256 * 262144 * 2 / 1e-3 / 1e9 / 100.0, abs=1e-3)
    # the upcast reads the bf16 [N, H] and writes it in fp32: 6 N H bytes in 1 ms
    assert ratios["_to_copy/up"] == pytest.approx(6 * N * H / 1e-3 / 1e9 / 100.0, abs=1e-3)
    assert seen["log"].startswith("memory-bound ops against a copy:")
    # the time model's list of what calibrate measures (a table without some says so) is this list
    from memlens.estimator.timing.tables import CALIBRATED_OPS
    assert {k for k in ratios if "/hw" not in k and "/w" not in k} == CALIBRATED_OPS - {"_grouped_mm"}
    # the depthwise convolution's bytes: the bf16 [64, 96, 56, 56] input and output and the [96, 1, 7, 7] weight
    assert ratios["convolution/depthwise/nhwc"] == pytest.approx((2 * 64 * 96 * 56 * 56 + 96 * 49) * 2 / 1e-3 / 1e9 / 100.0,
                                                                 abs=1e-3)
    # embedding_dense_backward's 1 ms less its [V, H] zero-fill priced at the fill's ratio (measured in the same pass),
    # over the rows' bytes: the bf16 gradient [N, H] and the int64 indices
    fill, rows = 32768 * H * 2, N * H * 2 + N * 8
    fill_s = fill / (100e9 * ratios["fill_"])
    assert ratios["embedding_dense_backward/rows"] == pytest.approx(rows / (1e-3 - fill_s) / 1e9 / 100.0, rel=1e-3)
    # RoPE's half-head slice backward: the [4, 32, 1024, 64] bf16 zero-fill priced off, the half read and written
    half, whole = 4 * 32 * 1024 * 32 * 2, 4 * 32 * 1024 * 64 * 2
    assert ratios["slice_backward"] == pytest.approx(2 * half / (1e-3 - whole / (100e9 * ratios["fill_"])) / 1e9 / 100.0, rel=1e-3)
    # autocast's residual add: fp32 and bf16 [N, H] read, fp32 written; the KV cache's cat: the heads read and written
    assert ratios["add/mixed"] == pytest.approx((4 + 2 + 4) * N * H / 1e-3 / 1e9 / 100.0, abs=1e-3)
    assert ratios["cat/one"] == pytest.approx(2 * whole / 1e-3 / 1e9 / 100.0, abs=1e-3)


def test_a_gemm_shorter_than_a_python_loops_launch_is_timed_from_a_cuda_graph(monkeypatch):
    # which timer each grid point of measure_matmul used: a graph up to 2e11 FLOPs (4096 x 2048 x 512 among them, timed
    # at the host's pace before), the plain loop above
    used = []
    monkeypatch.setattr(cal, "_graphed_seconds", lambda torch_, fn, n=20: used.append(("graph", n)) or 1e-3)
    monkeypatch.setattr(cal, "_gpu_seconds", lambda torch_, fn, **kw: used.append(("loop",)) or 1e-3)
    monkeypatch.setattr(cal, "_DTYPES", {"bfloat16": "bfloat16"})
    grid = cal.measure_matmul(torch, torch.device("meta"), (4096, 65536), (512, 2048), lambda s: None)
    # (m, n, k) in grid order: m over (4096, 65536), n and k over (512, 2048)
    flops = [2 * m * n * k for m in (4096, 65536) for n in (512, 2048) for k in (512, 2048)]
    assert used == [("graph", 5) if f < 2e11 else ("loop",) for f in flops]
    assert used.count(("loop",)) == 1 and 2 * 4096 * 2048 * 512 < 2e11     # only 65536 x 2048 x 2048 in the loop
    assert grid["bfloat16"]["tflops"][0][0][0] == pytest.approx(2 * 4096 * 512 * 512 / 1e-3 / 1e12, abs=1e-3)


def test_the_unaligned_grids_are_an_inputs_two_layouts_and_the_outputs(monkeypatch):
    # per dtype: A's rows, A transposed (the input grid), then the output's at N = 64 and 128 (its own N axis)
    times = itertools.cycle([1e-3, 2e-3, 4e-3, 5e-3])
    monkeypatch.setattr(cal, "_gemm_seconds", lambda torch_, fn, flops: (fn(), next(times))[1])
    ins, outs = cal.measure_matmul_unaligned(torch, torch.device("cpu"), lambda s: None, ms=(64,), nks=(64,), out_ns=(64, 128))
    a_rows, a_t = 2 * 64 * 63 * 64 / 1e-3 / 1e12, 2 * 63 * 64 * 64 / 2e-3 / 1e12
    assert ins["bfloat16"]["tflops"] == [[[pytest.approx(math.sqrt(a_rows * a_t), abs=1e-3)]]]
    assert (ins["bfloat16"]["n"], outs["bfloat16"]["n"], outs["bfloat16"]["k"]) == ([64], [64, 128], [64])
    assert outs["bfloat16"]["tflops"] == [[[pytest.approx(2 * 64 * 64 * 63 / 4e-3 / 1e12, abs=1e-3)],
                                           [pytest.approx(2 * 64 * 127 * 64 / 5e-3 / 1e12, abs=1e-3)]]]


def test_fsdp2_hook_cost_is_the_extra_host_time_per_group_less_its_aten_ops(monkeypatch):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from memlens.measure.calibrate_fsdp import measure_fsdp_host, one_rank_group

    def timed1(model):   # (fwd s, bwd s, ops counted): 3 ms / 4 ms more and 10 / 20 more ops when sharded
        sharded = isinstance(model, FSDPModule) and all(isinstance(m, FSDPModule) for m in model.model.layers)
        return (0.013, 0.024, {"view": 40, "kernel": 10}, {"view": 30, "kernel": 20}) if sharded else \
            (0.010, 0.020, {"view": 30, "kernel": 0}, {"view": 30, "kernel": 0})

    def timed(torch_, models, ids, **kw):
        return {name: timed1(m) for name, m in models.items()}

    import memlens.measure.calibrate_fsdp as cal_fsdp

    def steps(torch_, models, ids):   # one foreach AdamW step: 2 ms bare, 3.5 ms on DTensors
        return {name: 0.0035 if isinstance(m, FSDPModule) else 0.002 for name, m in models.items()}

    monkeypatch.setattr(cal_fsdp, "host_rounds", timed)
    monkeypatch.setattr(cal_fsdp, "optimizer_rounds", steps)
    logs = []
    out = measure_fsdp_host(torch, torch.device("cpu"), {"view": 2.0, "model_forward": 20.0, "model_backward": 50.0},
                            logs.append, layers=2)
    # 3 groups (2 layers + the root): forward (3000 - 10 views x 2 - 10 ops x 20) / 3 us, backward (4000 - 20 x 50) / 3;
    # the optimizer: 1.5 ms more over 21 tensors (9 a layer, the embedding, the final norm, the head) x AdamW's 10 ops
    assert out == {"fsdp_forward_group": pytest.approx(2780 / 3, abs=0.01), "fsdp_backward_group": 1000.0,
                   "fsdp_optimizer_tensor_op": pytest.approx(1500 / 210, abs=1e-3)}
    assert logs[-1].startswith("FSDP2 hooks per parameter group") and not dist.is_initialized()
    with one_rank_group(torch, torch.device("cpu")):      # a process already in a group: not measured, said so
        assert measure_fsdp_host(torch, torch.device("cpu"), {}, logs.append, layers=1) == {}
    assert logs[-1].startswith("FSDP2 hook cost not measured") and not dist.is_initialized()


def test_host_rounds_interleave_the_models_and_take_the_median_of_round_medians(monkeypatch):
    import memlens.measure.host_phases as hp

    calls = []
    slow = {2}     # the third round runs in a slow stretch of the host: both models' figures double there

    def phases(torch_, model, ids, count):
        calls.append((model, count))
        timed = [c for c in calls if not c[1]]
        warm = 2 * 2                                  # two warm-up steps of each model come first
        rnd = (len(timed) - 1 - warm) // (2 * 3) if len(timed) > warm else -1
        f = {"a": 0.010, "b": 0.020}[model] * (2 if rnd in slow else 1) * (1 + 0.01 * (len(timed) % 3))
        return f, 2 * f, {"kernel": 1} if count else {}, {"kernel": 2} if count else {}

    monkeypatch.setattr(hp, "_phases", phases)
    speeds = []
    out = hp.host_rounds(None, {"a": "a", "b": "b"}, None, rounds=5, runs=3, speeds=speeds)
    # counted once each, then 2 warm-ups each, then rounds of a a a b b b (interleaved per round)
    assert [m for m, c in calls[:2]] == ["a", "b"] and all(c for _, c in calls[:2])
    assert [m for m, _ in calls[6:18]] == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert len(speeds) == 5 and len(calls) == 2 + 4 + 5 * 6
    # each round's median is the base figure x 1.01 (its three runs: x1.00, x1.01, x1.02); the slow round is outvoted
    assert out["a"][0] == pytest.approx(0.0101) and out["b"][1] == pytest.approx(0.0404)
    assert out["a"][2] == {"kernel": 1} and out["b"][3] == {"kernel": 2}


def test_a_host_whose_speed_drifts_past_30_percent_is_said_so():
    from memlens.measure.calibrate import host_drift_note

    assert host_drift_note([0.020, 0.021, 0.025]) is None                # 1.25x: quiet enough
    note = host_drift_note([0.0133, 0.0204, 0.0219, 0.0204, 0.0210])      # the sixth session's H100 calibrate: 1.6x
    assert note.startswith("note: this host's speed varied 1.6x") and "median" in note


def test_a_wrappers_cost_per_call_is_its_extra_time_less_its_extra_ops(monkeypatch):
    import torch

    import memlens.measure.calibrate as cal

    def rounds(torch_, models, ids, speeds=None):   # the wrapped model: 10 ms / 30 ms more, 100 more kernel ops forward
        assert list(models) == ["bare", "wrapped"] and ids.shape == (1, 16)
        return {"bare": (0.020, 0.040, {"kernel": 500, "view": 50}, {"kernel": 600, "view": 80}),
                "wrapped": (0.030, 0.070, {"kernel": 600, "view": 50}, {"kernel": 600, "view": 90})}

    monkeypatch.setattr(cal, "host_rounds", rounds)
    out = cal.per_call_costs(torch, torch.device("cpu"), {"bare": None, "wrapped": None}, 50,
                             {"model_forward": 30.0, "model_backward": 40.0, "view": 2.0}, ("x_forward", "x_backward"))
    # forward: (10 ms - 100 ops x 30 us) / 50 calls = 140 us; backward: (30 ms - 10 views x 2 us) / 50 = 599.6 us
    assert out == {"x_forward": 140.0, "x_backward": 599.6}


def test_a_failed_measurement_over_the_gpus_keeps_the_table_with_data_sheet_nccl(monkeypatch):
    import memlens.measure.calibrate as cal
    from memlens.estimator.timing.tables import TimingTable

    def fails(*a, **k):
        raise RuntimeError("process 1 terminated with signal SIGABRT\nNCCL error: unhandled system error")

    monkeypatch.setattr(cal, "measure_ranks", fails)
    t, logs = TimingTable(gpu="h100", host_us={"forward": 10.0}), []
    cal.ranks_section(t, None, 2, True, False, logs.append)
    assert set(t.nccl) == {"2", "4", "8"} and t.nccl_overlap == {} and t.env["nccl"] == "data sheet (not measured here)"
    assert logs == ["NCCL over 2 GPUs not measured (RuntimeError: NCCL error: unhandled system error); its rows are "
                    "data-sheet rates (--no-nccl skips it)"]
    monkeypatch.setattr(cal, "measure_ranks", lambda *a, **k: {"nccl": {"2": {}}, "overlap": {"2": {"matmul": 0.1}},
                                                               "host_us": {"fsdp_forward_group_ranks": 900.0}})
    cal.ranks_section(t, None, 2, True, False, logs.append)
    assert t.nccl == {"2": {}} and t.host_us == {"forward": 10.0, "fsdp_forward_group_ranks": 900.0}
    assert t.env["fsdp_ranks"] == 2 and t.env["nccl"].startswith("measured over 2 GPUs")
    cal.ranks_section(t, None, 1, True, False, logs.append)       # one GPU: data sheet, said so
    assert t.env["nccl"] == "data sheet (one GPU here)"


def test_the_grouped_gemms_ratio_is_the_dense_grids_time_over_the_measured_one(monkeypatch):
    from memlens.estimator.timing.ops import GROUP_TILE_M
    from memlens.estimator.timing.tables import TimingTable, _add_logs

    monkeypatch.setattr(cal, "_gpu_seconds", lambda torch_, fn, **kw: (fn(), 1e-3)[1])
    grid = {"m": [1, 2**20], "n": [1, 2**20], "k": [1, 2**20], "tflops": [[[400.0] * 2] * 2] * 2}
    t = TimingTable(gpu="h200", matmul={"bfloat16": grid}, bandwidth={"bytes": [1, 2**40], "gbps": [1e3, 1e3]})
    _add_logs(t)
    got = cal.measure_grouped_mm(torch, torch.device("meta"), t, lambda s: None)
    rows, groups, k, n = cal.GROUPED_MM_CASE
    padded = 2 * (rows + groups * GROUP_TILE_M / 2) * n * k
    assert got == {"_grouped_mm": pytest.approx(padded / 400e12 / 1e-3, abs=1e-4)}
