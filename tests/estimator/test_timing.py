"""The per-op step-time model (memlens.estimator.timing): pricing by hand on a tiny Linear step, the table file's
round trip, and what an uncalibrated or borrowed table says."""
import json

import pytest

from memlens.core.errors import SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator.timing import step as step_mod
from memlens.estimator.timing import tables
from memlens.estimator.timing.record import price
from memlens.estimator.timing.tables import TimingTable, datasheet_table, read_table, table_for

import os

TINY_LLAMA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "tiny-llama")
LINEAR = "tests.tiny_models:linear"   # one bias-free 1024 x 1024 fp32 linear, batch 16 x 1024, loss = sum


def flat_table(tflops: float = 10.0, gbps: float = 100.0) -> TimingTable:
    """Every matmul at ``tflops``, every byte at ``gbps``, no kernel floor, no host cost: each op's price by hand."""
    grid = {"m": [1, 2**20], "n": [1, 2**20], "k": [1, 2**20], "tflops": [[[tflops] * 2] * 2] * 2}
    t = TimingTable(gpu="h100", calibrated=True, source="test", matmul={"float32": grid, "bfloat16": grid},
                    attention={"bfloat16": {"seq": [1, 2**20], "fwd_tflops": [tflops] * 2, "bwd_tflops": [tflops] * 2}},
                    bandwidth={"bytes": [1, 2**40], "gbps": [gbps, gbps]}, min_kernel_us=0.0,
                    host_us={"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "view": 0.0},
                    pcie_gbps={"h2d": 20.0, "d2h": 20.0})
    tables._add_logs(t)
    return t


@pytest.fixture(scope="module")
def linear_sim():
    from memlens.estimator.simulate import simulate

    return simulate(TrainingSpec(model=LINEAR, optimizer="sgd"))


def test_a_linear_step_is_priced_op_by_op(linear_sim, monkeypatch):
    tab = flat_table()
    rows = price(linear_sim.timing, tab)
    mm = [r for r in rows if r[5] == "matmul"]
    # forward x @ W.T and backward grad_W = grad_out.T @ x (x needs no gradient): 2 x 16 x 1024 x 1024 FLOPs each
    assert [(r[0], r[4]) for r in mm] == [("forward", 33_554_432), ("backward", 33_554_432)]
    # each reads a 16 x 1024 fp32 operand (64 KiB) and the 4 MiB weight (or writes the 4 MiB gradient) and the
    # other 64 KiB operand: 4,325,376 bytes at 100 GB/s = 43.25 us, more than 33.5 MFLOP at 10 TFLOP/s (3.36 us)
    assert [r[2] for r in mm] == pytest.approx([4_325_376 / 100e9] * 2)
    monkeypatch.setattr(step_mod, "table_for", lambda gpu: tab)
    st = step_mod.step_time(linear_sim)
    fwd = sum(r[2] for r in rows if r[0] == "forward")
    assert st["parts"]["forward"] == pytest.approx(fwd) and fwd >= 4_325_376 / 100e9
    assert st["parts"]["host"] == 0.0 and st["parts"]["collectives"] == 0.0
    # SGD without momentum, foreach add_(p, g): the parameter read and written, the gradient read: 3 x 4 MiB at 100 GB/s
    assert st["parts"]["optimizer"] == pytest.approx(3 * 4 * 2**20 / 100e9)
    assert st["seconds"] == pytest.approx(sum(st["parts"].values()))
    assert st["model_flops"] == 2 * 33_554_432


def test_the_launch_queue_counts_host_bound_ops():
    # three ops of 1 us on the GPU each dispatched in 10 us: the GPU waits 9 us before each but the first's 10
    rows = [("forward", 0, 1e-6, 10e-6, 0, "memory")] * 3
    busy, wait, host = step_mod.queue(rows, [1.0] * 3)
    assert busy["forward"] == pytest.approx(3e-6) and wait["forward"] == pytest.approx(28e-6) and host == pytest.approx(30e-6)
    # the same op 3 times as one row of multiplicity 3 (a layer of a shallow model standing for 3): the same end
    busy3, wait3, _ = step_mod.queue(rows[:1], [3.0])
    assert busy3["forward"] + wait3["forward"] == pytest.approx(busy["forward"] + wait["forward"])


def test_a_later_micro_batch_starts_behind_the_one_before():
    # GPU-bound (1 s of kernel, 0.5 s of host each): the first micro-batch's forward waits 0.5 s for its dispatch; the
    # next one's forward is dispatched while the GPU still runs the backward before it: no wait (a step of 4
    # micro-batches pays 0.5 s of host, not 2)
    rows = [("forward", 0, 1.0, 0.5, 0, "memory"), ("backward", 0, 1.0, 0.5, 0, "memory")]
    _, first, _ = step_mod.queue(rows, [1.0, 1.0])
    assert first == {"forward": pytest.approx(0.5), "backward": 0.0}
    assert step_mod.later_waits(rows, [1.0, 1.0], first) == {"forward": 0.0, "backward": 0.0}
    # host-bound (0.2 s of kernel, 0.5 of host): each op waits for its dispatch, the later forward 0.3 s (its queue is
    # empty 0.3 s before its dispatch ends), not the first's 0.5
    rows = [("forward", 0, 0.2, 0.5, 0, "memory"), ("backward", 0, 0.2, 0.5, 0, "memory")]
    _, first, _ = step_mod.queue(rows, [1.0, 1.0])
    assert first == {"forward": pytest.approx(0.5), "backward": pytest.approx(0.3)}
    assert step_mod.later_waits(rows, [1.0, 1.0], first) == {"forward": pytest.approx(0.3), "backward": pytest.approx(0.3)}


def test_the_table_file_round_trips(tmp_path):
    t = datasheet_table("h100")
    path = t.write(tmp_path / "h100_timing.json")
    back = read_table(path)
    assert back.to_dict() == t.to_dict()
    assert json.loads(path.read_text())["calibrated"] is False
    for args in (("bfloat16", 4096, 4096, 4096), ("float32", 100, 3000, 700), ("tf32", 10**6, 10, 10)):
        assert back.matmul_tflops(*args) == t.matmul_tflops(*args)
    # a grid point reads back its own value (log-space interpolation is exact on the grid)
    g = t.matmul["bfloat16"]
    assert t.matmul_tflops("bfloat16", g["m"][2], g["n"][1], g["k"][3]) == pytest.approx(g["tflops"][2][1][3])


def test_a_gpu_without_a_table_says_uncalibrated():
    t = table_for("a100-80gb")
    assert t.calibrated is False and t.note.startswith("uncalibrated: a100-80gb data-sheet rates")


def test_a_table_of_another_gpu_is_used_only_when_named_and_says_so(tmp_path, monkeypatch):
    src = flat_table()
    src.device_name = "NVIDIA H100 80GB HBM3"
    path = src.write(tmp_path / "mine.json")
    monkeypatch.setenv(tables.ENV_TABLE, str(path))
    t = table_for("h200")
    # a flat table measured no op's own rate: it says so for each of calibrate's 43 and the 6 ops measured by row width
    assert t.note == ("calibrated table mine.json (NVIDIA H100 80GB HBM3), measured on a h100 and used for the h200 "
                      "as asked (--timing-table); 49 op rates not measured there; mid-size GEMMs timed at the host's "
                      "pace there")


def test_a_bad_table_file_is_one_line(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text("{")
    with pytest.raises(SpecError, match=r"^timing table '.*t\.json' is not JSON"):
        read_table(bad)
    with pytest.raises(SpecError, match="does not exist"):
        read_table(tmp_path / "none.json")


def test_an_estimate_carries_its_step_time(linear_sim):
    from memlens.core.ledger import analyze
    from memlens.estimator.result import simulation_result

    r = simulation_result(linear_sim, analyze(linear_sim.log))
    st = r.data["step_time"]
    assert r.data["step_seconds"] == st["seconds"] > 0
    assert set(st["parts"]) >= {"forward", "backward", "recompute", "optimizer", "collectives", "host"}
    assert st["micro_batches"] == 1 and st["micro_batch_size"] == 1
    # h100's shipped table is the one `memlens calibrate` measured on an H100 (bench/results/step_time_h100.md), the
    # op rates calibrate measures since and its mid-size GEMMs taken from the H200's (bench/borrow_rates.py): it says so
    assert st["calibrated"] is True and st["table"] == ("calibrated on a NVIDIA H100 80GB HBM3; 26 op rates and GEMMs "
                                                        "under 2e+11 FLOPs from the NVIDIA H200's table")
    assert st["table_unmeasured_ops"] == [] and st["table_matmul_loop_timed"] is False
    assert st["table_borrowed"]["ops"][:6] == ["_grouped_mm", "_log_softmax/w*", "_log_softmax_backward_data/w*",
                                               "_softmax/w*", "_softmax_backward_data/w*", "_to_copy/up"]
    assert len(st["table_borrowed"]["ops"]) == 26 and "convolution/depthwise/nhwc" in st["table_borrowed"]["ops"]
    assert 0 < st["mfu"] < 1


def test_a_matmul_whose_leading_dim_is_off_16_bytes_takes_the_unaligned_rate():
    import torch

    from memlens.estimator.timing.ops import op_facts

    tab = flat_table(tflops=100.0, gbps=1e9)
    slow = {"m": [1, 2**20], "n": [1, 2**20], "k": [1, 2**20], "tflops": [[[25.0] * 2] * 2] * 2}
    tab.matmul_unaligned = {"bfloat16": slow}
    tab.matmul_unaligned_out = {"bfloat16": {**slow, "tflops": [[[12.5] * 2] * 2] * 2}}
    tables._add_logs(tab)
    mm = torch.ops.aten.mm.default
    x = torch.empty(64, 768, dtype=torch.bfloat16)
    for w, aligned in ((torch.empty(768, 50257, dtype=torch.bfloat16), False),    # GPT-2's head: 50,257 x 2 bytes
                       (torch.empty(768, 50264, dtype=torch.bfloat16), True),     # padded to a multiple of 8
                       (torch.empty(50257, 768, dtype=torch.bfloat16).t(), False),  # nn.Linear's W.T: the output's rows
                       (torch.empty(2304, 768, dtype=torch.bfloat16).t(), True)):   # GPT-2's qkv: every row 16-byte
        f = op_facts(mm, (x, w), {}, mm(x, w))
        assert f.aligned is aligned
        rate = tab.matmul_tflops("bfloat16", *f.mnk, f.aligned, f.out_unaligned)
        assert rate == pytest.approx(100.0 if aligned else 12.5)      # these three: the output's rows are off
    # the gradient of the head's input reads the [tokens, 50257] gradient: unaligned too
    g = torch.empty(64, 50257, dtype=torch.bfloat16)
    f = op_facts(mm, (g, torch.empty(50257, 768, dtype=torch.bfloat16)), {}, torch.empty(64, 768))
    assert (f.aligned, f.out_unaligned) == (False, False)
    assert tab.matmul_tflops("bfloat16", *f.mnk, f.aligned, f.out_unaligned) == pytest.approx(25.0)
    # fp32: the unaligned grids are 16-bit only, so an unaligned fp32 GEMM takes fp32's own (aligned) rate, not 16-bit's
    tab.matmul["float32"] = {**slow, "tflops": [[[50.0] * 2] * 2] * 2}
    tables._add_logs(tab)
    head = op_facts(mm, (x.float(), torch.empty(50257, 768).t()), {}, torch.empty(64, 50257))
    assert head.out_unaligned and tab.matmul_tflops("float32", *head.mnk, head.aligned, head.out_unaligned) == pytest.approx(50.0)


def test_attention_takes_the_variant_of_its_head_dim_and_mask():
    tab = flat_table()
    row = tab.attention["bfloat16"]
    row["variants"] = {"64": {"fwd_tflops": [200.0] * 2, "bwd_tflops": [150.0] * 2},
                       "64c": {"fwd_tflops": [100.0] * 2, "bwd_tflops": [80.0] * 2}}
    tables._add_logs(tab)
    assert tab.attention_tflops("bfloat16", 1024, False, 128, False) == pytest.approx(10.0)   # the table's own row
    assert tab.attention_tflops("bfloat16", 1024, False, 64, False) == pytest.approx(200.0)
    assert tab.attention_tflops("bfloat16", 1024, True, 64, True) == pytest.approx(80.0)
    assert tab.attention_tflops("bfloat16", 1024, True, 128, True) == pytest.approx(10.0)    # no 128c: the 128 row


def test_a_memory_bound_op_runs_at_its_measured_ratio_to_a_copy():
    tab = flat_table(gbps=100.0)
    tab.op_ratio = {"_log_softmax": 0.5, "nll_loss_forward": 20.0}
    assert tab.op_seconds("add", 1e9) == pytest.approx(0.01)
    assert tab.op_seconds("_log_softmax", 1e9) == pytest.approx(0.02)     # reads its input three times
    assert tab.op_seconds("nll_loss_forward", 1e9) == pytest.approx(0.0005)   # gathers one element a row


def test_host_costs_inside_a_model_blend_with_the_checkpointed_share():
    from memlens.estimator.timing.record import SAC_HOST_SECONDS_PER_OP, host_costs

    tab = flat_table()
    tab.host_us = {"forward": 15.0, "backward": 20.0, "view": 2.0}
    # bare per-op costs: a recomputed op costs the backward's, plus the selective policy's dispatch modes
    assert host_costs(tab, 1.0, "full") == pytest.approx((2e-6, 15e-6, 20e-6, 20e-6))
    assert host_costs(tab, 1.0, "selective") == pytest.approx((2e-6, 15e-6 + SAC_HOST_SECONDS_PER_OP, 20e-6, 20e-6 + SAC_HOST_SECONDS_PER_OP))
    tab.host_us.update(model_forward=24.0, model_backward=28.0, model_forward_ckpt=58.0, model_recompute_ckpt=55.0,
                       model_forward_sac=40.0, model_recompute_sac=70.0)
    assert host_costs(tab, 0.0, "full") == pytest.approx((2e-6, 24e-6, 28e-6, 55e-6))
    assert host_costs(tab, 0.5, "full") == pytest.approx((2e-6, 41e-6, 28e-6, 55e-6))      # half the layers hooked
    assert host_costs(tab, 1.0, "selective") == pytest.approx((2e-6, 40e-6, 28e-6, 70e-6))


def test_metadata_queries_of_fake_tensors_get_no_row():
    import torch

    from memlens.estimator.timing.ops import META, kind_of

    assert kind_of(torch.ops.prim.device.default) == META       # eager PyTorch answers .device without dispatching
    assert kind_of(torch.ops.aten.mm.default) == "matmul"


def test_a_calibrated_table_with_every_section_round_trips(tmp_path):
    t = flat_table()
    t.matmul_unaligned = {"bfloat16": {"m": [1, 4], "n": [1, 4], "k": [1, 4], "tflops": [[[5.0, 6.0]] * 2] * 2}}
    t.attention["bfloat16"]["variants"] = {"64c": {"fwd_tflops": [3.0, 4.0], "bwd_tflops": [2.0, 3.0]}}
    t.op_ratio = {"sum": 0.47}
    t.optimizer_ratio = {"adamw": 1.15}
    t.host_us["model_forward"] = 23.6
    tables._add_logs(t)
    back = read_table(t.write(tmp_path / "t.json"))
    assert back.to_dict() == t.to_dict()
    assert back.matmul_tflops("bfloat16", 4, 4, 4, aligned=False) == pytest.approx(6.0)
    assert back.attention_tflops("bfloat16", 2**20, True, 64, True) == pytest.approx(3.0)


def test_fp32_attention_runs_at_the_16_bit_rate_scaled_as_the_tables_gemms():
    tab = flat_table(tflops=10.0)
    g = tab.matmul["bfloat16"]
    tab.matmul = {"bfloat16": g, "float32": {**g, "tflops": [[[2.5] * 2] * 2] * 2}}   # fp32 GEMMs 4x slower
    tables._add_logs(tab)
    assert tab.attention_tflops("float32", 1024, False, 64, True) == pytest.approx(10.0 / 4)


def test_a_functional_collective_is_priced_by_the_ring_law_over_its_group():
    import torch
    import torch.distributed._functional_collectives  # noqa: F401 - registers _c10d_functional

    from memlens.estimator.timing.ops import COMM, op_facts
    from memlens.estimator.timing.record import OpTrace

    ag = torch.ops._c10d_functional.all_gather_into_tensor.default
    shard = torch.empty(1024, 512, dtype=torch.bfloat16)                 # 1 MiB a rank, 4 MiB gathered
    f = op_facts(ag, (shard, 4, "tp-group"), {}, torch.empty(4096, 512, dtype=torch.bfloat16))
    assert (f.kind, f.op, f.seq, f.nbytes) == (COMM, "all_gather", 4, 4 * 2**20)
    tab = flat_table()
    row = {"bytes": [1, 2**40], "busbw_gbps": [100.0, 100.0], "latency_us": 0.0}
    tab.nccl = {"4": {"all_reduce": dict(row), "all_gather": dict(row)}}
    tables._add_logs(tab)
    (priced,) = price(OpTrace(rows=[("forward", 0, f)]), tab)
    # all-gather moves (n - 1) / n of the 4 MiB buffer through each rank at 100 GB/s of bus bandwidth
    assert priced[2] == pytest.approx(4 * 2**20 * 3 / 4 / 100e9) and priced[5] == COMM


def test_a_memory_bound_op_is_priced_by_its_layout_where_measured_else_by_its_name():
    import torch

    from memlens.estimator.timing.ops import op_facts

    mul = torch.ops.aten.mul.Tensor
    x, y, w = torch.empty(64, 32), torch.empty(64, 32), torch.empty(32)
    assert op_facts(mul, (x, y), {}, x * y).op == "mul"
    assert op_facts(mul, (x, w), {}, x * w).op == "mul/bcast"            # a norm's weight, re-read per row
    r = torch.empty(64, 1)
    assert op_facts(mul, (x, r), {}, x * r).op == "mul/rows"             # RMSNorm's x * rsqrt(var): one value a row
    assert op_facts(mul, (x.t(), y.t()), {}, x.t() * y.t()).op == "mul/strided"
    cat = torch.ops.aten.cat.default
    halves = [x[:, 16:], x[:, :16]]                                       # RoPE's rotate_half
    assert op_facts(cat, (halves, -1), {}, torch.cat(halves, -1)).op == "cat/heads"   # short runs: priced as strided where not measured
    tab = flat_table(gbps=100.0)
    tab.op_ratio = {"mul": 1.0, "mul/bcast": 0.5}
    assert tab.op_seconds("mul/bcast", 1e9) == pytest.approx(0.02)
    assert tab.op_seconds("mul/strided", 1e9) == pytest.approx(0.01)    # not measured: the op's own rate
    assert tab.op_seconds("cat/strided", 1e9) == pytest.approx(0.01)    # neither: a copy's
    assert tab.op_seconds("mul/rows", 1e9) == pytest.approx(0.02)       # per-row not measured: as any broadcast
    tab.op_ratio["mul/rows"] = 0.8
    assert tab.op_seconds("mul/rows", 1e9) == pytest.approx(1e9 / 80e9)


def test_each_rank_prices_its_own_share_of_the_optimizer_step():
    from memlens.estimator.ranks import simulate_rank

    base = dict(model="tests/fixtures/tiny-llama", batch_size=2, seq_len=32, world_size=4, precision="bf16")
    opt = {name: step_mod.step_time(simulate_rank(TrainingSpec(**base, **kw), 0, steps=1))["parts"]["optimizer"]
           for name, kw in (("fsdp4", dict(sharding="fsdp")), ("tp2xfsdp2", dict(sharding="fsdp", tp=2)))}
    # FSDP2 over 4 ranks and FSDP2 over 2 x TP over 2 both leave a quarter of every tensor on a rank
    assert opt["tp2xfsdp2"] == pytest.approx(opt["fsdp4"])


def test_fsdp2_forward_all_gather_waits_in_the_queue_only_where_the_host_is_behind():
    # host-bound: the gather (5 us) is issued at t=10 us with the copy-out behind it; the copy-out (host 10 us, so
    # issued at 20 us) finds the gather done at 15 us: nothing exposed. GPU-bound: a 50 us kernel ahead, the gather
    # issued at 1 us runs under it: nothing exposed either. A 30 us gather with hosts of 1 us: 31 - 2 = 29 us exposed.
    gather = ("forward", 0, 5e-6, 0.0, 0, "gather")
    _, wait, _ = step_mod.queue([("forward", 0, 1e-6, 10e-6, 0, "memory"), gather, ("forward", 0, 1e-6, 10e-6, 0, "memory")], [1.0] * 3)
    assert wait.get("gather", 0.0) == 0.0
    _, wait, _ = step_mod.queue([("forward", 0, 50e-6, 1e-6, 0, "matmul"), gather, ("forward", 0, 1e-6, 1e-6, 0, "memory")], [1.0] * 3)
    assert wait.get("gather", 0.0) == 0.0
    slow = ("forward", 0, 30e-6, 0.0, 0, "gather")
    busy, wait, _ = step_mod.queue([("forward", 0, 1e-6, 1e-6, 0, "memory"), slow, ("forward", 0, 1e-6, 1e-6, 0, "memory")], [1.0] * 3)
    assert wait["gather"] == pytest.approx(31e-6 - 2e-6) and busy["forward"] == pytest.approx(2e-6)


def test_an_fsdp2_copy_in_prices_its_groups_hooks_and_all_gather():
    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 - registers fsdp::all_gather_copy_in

    from memlens.estimator.timing.ops import op_facts
    from memlens.estimator.timing.record import FSDP_FORWARD_HOOK_OPS, OpTrace

    shards = [torch.empty(1000, dtype=torch.bfloat16, device="meta"), torch.empty(24, dtype=torch.bfloat16, device="meta")]
    buf = torch.empty(2 * 1024, dtype=torch.bfloat16, device="meta")      # 2 ranks x 1,024 elements
    func = torch.ops.fsdp.all_gather_copy_in.default
    f = op_facts(func, (shards, buf, [1000, 24], 1024, 0), {}, (buf[:1024], buf))
    assert (f.kind, f.op, f.gathered, f.seq) == ("memory", "all_gather_copy_in", 4096, 2)
    tab = flat_table()
    tab.host_us["model_forward"], tab.host_us["model_recompute_ckpt"] = 20.0, 40.0
    tab.nccl = {"2": {"all_gather": {"bytes": [1, 2**40], "busbw_gbps": [100.0, 100.0], "latency_us": 15.0}}}
    tables._add_logs(tab)
    rows = price(OpTrace(rows=[("forward", 0, f), ("backward", 0, f)]), tab)
    assert [r[5] for r in rows] == ["memory", "gather", "memory"]       # backward's gathers are prefetched: no row
    # the copy-in's host: one forward op (20 us) + the hooks' 30 forward-op equivalents; backward: its op's cost only
    assert rows[0][3] == pytest.approx((1 + FSDP_FORWARD_HOOK_OPS) * 20e-6) and rows[2][3] == 0.0
    # the all-gather by the ring law: 4,096 bytes x (2-1)/2 at 100 GB/s bus bandwidth + 15 us latency
    assert rows[1][2] == pytest.approx(2048 / 100e9 + 15e-6)


def test_an_fp32_convolution_is_priced_at_the_tf32_rate_as_cudnn_runs_it():
    import torch

    from memlens.estimator.timing.ops import op_facts
    from memlens.estimator.timing.record import OpTrace

    x, w = torch.empty(8, 16, 32, 32), torch.empty(32, 16, 3, 3)
    out = torch.empty(8, 32, 32, 32)
    f = op_facts(torch.ops.aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}, out)
    tab = flat_table(tflops=10.0, gbps=1e6)        # bytes nearly free: the compute time decides
    tf32 = {"m": [1, 2**20], "n": [1, 2**20], "k": [1, 2**20], "tflops": [[[40.0] * 2] * 2] * 2}
    tab.matmul["tf32"] = tf32
    tables._add_logs(tab)
    # 2 x (8 x 32 x 32) x 32 x (16 x 9) FLOPs = 75,497,472 at tf32's 40 TFLOP/s, not fp32's 10
    assert f.flops == 75_497_472
    (row,) = price(OpTrace(rows=[("forward", 0, f)]), tab)
    assert row[2] == pytest.approx(75_497_472 / 40e12, rel=1e-3)


def test_attention_with_dropout_takes_its_measured_variant_where_the_table_has_one():
    import torch

    from memlens.estimator.timing.ops import attention_facts
    from memlens.estimator.timing.record import OpTrace

    tab = flat_table(gbps=1e6)
    tab.attention["bfloat16"]["variants"] = {"64c": {"fwd_tflops": [100.0] * 2, "bwd_tflops": [80.0] * 2},
                                             "64cd": {"fwd_tflops": [40.0] * 2, "bwd_tflops": [60.0] * 2}}
    tables._add_logs(tab)
    q = torch.empty(2, 4, 256, 64, dtype=torch.bfloat16)
    fwd = attention_facts(q, q, q, True, backward=False, dropout=True)
    plain = attention_facts(q, q, q, True, backward=False)
    # 4 B H L S D / 2 (causal) = 4 x 2 x 4 x 256 x 256 x 64 / 2 = 67,108,864 FLOPs: at 40 TFLOP/s with dropout, 100 without
    assert fwd.flops == plain.flops == 67_108_864 and fwd.dropout and not plain.dropout
    rows = price(OpTrace(rows=[("forward", 0, fwd), ("forward", 0, plain)]), tab)
    assert [r[2] for r in rows] == pytest.approx([67_108_864 / 40e12, 67_108_864 / 100e12], rel=1e-3)
    # a table without the dropout variant (calibrated before it was measured) prices it as the variant without
    del tab.attention["bfloat16"]["variants"]["64cd"]
    assert tab.attention_tflops("bfloat16", 256, True, 64, True, dropout=True) == pytest.approx(80.0)


def test_each_module_call_in_forward_is_a_host_row_at_the_calibrated_split(linear_sim):
    from memlens.estimator.timing.record import CALIBRATION_OPS_PER_MODULE

    mods = [r for r in linear_sim.timing.rows if r[2].kind == "module"]
    assert [r[0] for r in mods] == ["forward"] * 2       # Sequential's forward and its Linear's, once each; none in backward
    tab = flat_table()
    tab.host_us.update(forward=5.0, model_forward=8.0, model_recompute_ckpt=50.0)
    rows = price(linear_sim.timing, tab)
    # model_forward (8 us an op in the calibration Llama) = the bare dispatch (5) + its module calls' share: each call
    # costs (8 - 5) x 666 / 214 us, each forward kernel op the bare 5 us
    assert [r[3] for r in rows if r[5] == "module"] == pytest.approx([3e-6 * CALIBRATION_OPS_PER_MODULE] * 2)
    assert [r[3] for r in rows if r[0] == "forward" and r[5] == "matmul"] == pytest.approx([5e-6])


def test_heads_transposed_out_of_a_projection_are_their_own_layout_falling_back_to_strided():
    import torch

    from memlens.estimator.timing.ops import op_facts

    qkv = torch.empty(2, 16, 3 * 256, dtype=torch.bfloat16)
    k = qkv[..., 256:512].view(2, 16, 4, 64).transpose(1, 2)         # runs of 64 elements, 768 apart
    cat = torch.ops.aten.cat.default
    assert op_facts(cat, ([k[..., 32:], k[..., :32]], -1), {}, torch.empty(2, 4, 16, 64)).op == "cat/heads"
    wide = torch.empty(16, 1024, dtype=torch.bfloat16)
    assert op_facts(cat, ([wide[:, 512:], wide[:, :512]], -1), {}, torch.empty(16, 1024)).op == "cat/strided"
    cos = torch.empty(2, 1, 16, 64, dtype=torch.bfloat16)                 # RoPE: the keys times a broadcast cos
    assert op_facts(torch.ops.aten.mul.Tensor, (k, cos), {}, k * cos).op == "mul/heads"
    tab = flat_table(gbps=100.0)
    tab.op_ratio = {"cat/strided": 0.5, "cat": 1.0}
    assert tab.op_seconds("cat/heads", 1e6) == pytest.approx(1e6 / 50e9)      # no heads figure: the strided one
    tab.op_ratio["cat/heads"] = 0.1
    assert tab.op_seconds("cat/heads", 1e6) == pytest.approx(1e6 / 10e9)


def test_a_cast_to_fp32_is_an_upcast_priced_at_its_own_rate_where_measured():
    import torch

    from memlens.estimator.timing.ops import op_facts

    a = torch.ops.aten
    x16, x32 = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(64, 32)
    up = op_facts(a._to_copy.default, (x16,), {"dtype": torch.float32}, x32)
    assert (up.op, up.nbytes) == ("_to_copy/up", 64 * 32 * (2 + 4))                   # reads 2 bytes, writes 4
    assert op_facts(a._to_copy.default, (x32,), {"dtype": torch.bfloat16}, x16).op == "_to_copy"   # narrowing
    assert op_facts(a.copy_.default, (x32, x16), {}, x32).op == "copy_/up"               # into an fp32 buffer
    assert op_facts(a.copy_.default, (x16, x32), {}, x16).op == "copy_"
    half = torch.empty(64, 32, dtype=torch.float16)
    assert op_facts(a._to_copy.default, (half,), {"dtype": torch.float32}, x32).op == "_to_copy/up"
    assert op_facts(a._to_copy.default, (x32,), {"dtype": torch.float64}, x32.double()).op == "_to_copy"
    tab = flat_table(gbps=100.0)
    tab.op_ratio = {"_to_copy": 1.0}
    assert tab.op_seconds("_to_copy/up", 1e9) == pytest.approx(0.01)      # a table that did not measure it: a cast's
    tab.op_ratio["_to_copy/up"] = 0.5
    assert tab.op_seconds("_to_copy/up", 1e9) == pytest.approx(0.02)      # half the rate: twice the time
    tab = table_for("h200")
    assert tab.op_ratio["_to_copy/up"] < 0.6 < tab.op_ratio["_to_copy"]     # measured on an H200


def test_batch_norm_is_priced_at_the_spatial_size_measured_nearest_its_input():
    import torch

    from memlens.estimator.timing.ops import op_facts

    bn = torch.ops.aten.native_batch_norm.default
    w, b, rm, rv = torch.ones(8), torch.zeros(8), torch.zeros(8), torch.ones(8)

    def name(*shape):
        x = torch.empty(*shape, dtype=torch.bfloat16)
        return op_facts(bn, (x, w, b, rm, rv, True, 0.1, 1e-5), {}, bn(x.float(), w, b, rm, rv, True, 0.1, 1e-5)).op

    # ResNet-50's stages: 112^2 ... 7^2; between two sizes, the nearer on a log scale (sqrt(784 * 196) = 392)
    assert [name(2, 8, s, s) for s in (112, 56, 28, 14, 7)] == [f"native_batch_norm/hw{s * s}" for s in (112, 56, 28, 14, 7)]
    assert (name(2, 8, 20, 20), name(2, 8, 19, 20), name(2, 8, 1, 1)) == \
        ("native_batch_norm/hw784", "native_batch_norm/hw196", "native_batch_norm/hw49")
    assert name(4, 8) == "native_batch_norm"                                 # BatchNorm1d's (N, C): the op's own name
    tab = flat_table(gbps=100.0)
    tab.op_ratio = {"native_batch_norm": 0.5, "native_batch_norm/hw49": 0.25}
    assert tab.op_seconds("native_batch_norm/hw49", 1e9) == pytest.approx(0.04)
    assert tab.op_seconds("native_batch_norm/hw3136", 1e9) == pytest.approx(0.02)   # a table without that size


def test_opacus_clip_rows_of_a_shallow_trace_repeat_for_the_tensors_of_the_layers_it_writes():
    from types import SimpleNamespace

    from memlens.estimator.timing.record import OpTrace
    from memlens.estimator.timing.step import trainable_tensors

    tr = OpTrace()
    tr.trainable_tensors, tr.layer_tensors = 12, 4          # a 3-layer LoRA model: 4 adapter tensors a layer
    assert trainable_tensors(tr) == (12, 1.0)               # the whole model simulated: each row is itself
    tr.stack, tr.layers = SimpleNamespace(depth=3), 16      # written to 16 layers: 13 more of 4 tensors
    assert trainable_tensors(tr) == (12 + 13 * 4, pytest.approx(64 / 12))


def test_embedding_backward_is_a_fill_of_the_whole_gradient_then_work_per_row():
    # Llama-3.2-1B at 1 x 512 tokens: the [128256, 2048] bf16 gradient zero-filled (one kernel at the fill's rate), then
    # the 512 looked-up rows summed (their bytes at the rows' measured ratio): the vocabulary no longer scales the rows
    import torch

    from memlens.estimator.timing.ops import EMBEDDING_ROWS, op_facts
    from memlens.estimator.timing.record import OpTrace

    grad = torch.empty(1, 512, 2048, dtype=torch.bfloat16, device="meta")
    idx = torch.empty(1, 512, dtype=torch.int64, device="meta")
    out = torch.empty(128256, 2048, dtype=torch.bfloat16, device="meta")
    f = op_facts(torch.ops.aten.embedding_dense_backward.default, (grad, idx, 128256, -1, False), {}, out)
    assert (f.op, f.nbytes, f.fill) == (EMBEDDING_ROWS, 512 * 2048 * 2 + 512 * 8, 128256 * 2048 * 2)
    tab = flat_table(gbps=100.0)
    tab.op_ratio = {EMBEDDING_ROWS: 0.025, "fill_": 1.25}
    [row] = price(OpTrace(rows=[("backward", -1, f)]), tab)
    assert row[2] == pytest.approx(f.nbytes / (100e9 * 0.025) + f.fill / (100e9 * 1.25))


def test_a_table_measured_before_the_split_prices_the_rows_from_its_whole_ratio():
    # the whole op at EMBEDDING_CAL took (all its bytes) / (copy rate x 0.1); less the fill at its own rate, the rest
    # over the rows' bytes is their ratio: the calibration case priced the same either way
    from memlens.estimator.timing.ops import EMBEDDING_CAL, EMBEDDING_ROWS

    d = flat_table(gbps=100.0).to_dict()
    d["op_ratio"] = {"embedding_dense_backward": 0.1, "fill_": 2.0}
    t = TimingTable.from_dict(d)
    n, h, v = EMBEDDING_CAL
    rows, fill = n * h * 2 + n * 8, v * h * 2
    whole = (rows + fill) / (100e9 * 0.1)
    assert t.op_ratio[EMBEDDING_ROWS] == pytest.approx(rows / (100e9 * (whole - fill / 200e9)), rel=1e-3)
    assert t.op_seconds(EMBEDDING_ROWS, rows) + t.op_seconds("fill_", fill) == pytest.approx(whole, rel=1e-3)
    d["op_ratio"][EMBEDDING_ROWS] = 0.03          # a table that measured the rows keeps its own
    assert TimingTable.from_dict(d).op_ratio[EMBEDDING_ROWS] == 0.03


def test_checkpointings_host_work_is_per_checkpointed_call_from_calibrates_two_models():
    # bare: 10 ms forward, 20 ms backward; every one of 4 layers checkpointed: 14 ms and 40 ms, the forward with 2 views
    # more, backward re-running 100 kernel ops and 40 views (a forward op costs 50 us in the model, a view 1 us)
    from memlens.measure.calibrate import ckpt_layer_costs

    plain = (0.010, 0.020, {"kernel": 300, "view": 200}, {"kernel": 500, "view": 400})
    ckpt = (0.014, 0.040, {"kernel": 300, "view": 202}, {"kernel": 600, "view": 440})
    out = ckpt_layer_costs(plain, ckpt, 4, 50e-6, 1e-6)
    assert out == {"ckpt_layer_forward": pytest.approx((4e-3 - 2e-6) / 4 * 1e6),
                   "ckpt_layer_recompute": pytest.approx((20e-3 - 100 * 50e-6 - 40e-6) / 4 * 1e6)}


def test_a_checkpointed_step_pays_each_checkpointed_layers_call_on_the_host():
    # tiny-llama's 2 layers, each checkpointed: one host-only row per call in forward and per recomputation in backward,
    # at the table's per-call costs; a recomputed op costs what a forward op costs in a model
    from memlens.estimator.simulate import simulate

    tab = flat_table()
    tab.host_us = {"forward": 5.0, "backward": 6.0, "optimizer": 0.0, "view": 1.0, "model_forward": 8.0,
                   "model_backward": 7.0, "ckpt_layer_forward": 300.0, "ckpt_layer_recompute": 500.0}
    rows = price(simulate(TrainingSpec(model=TINY_LLAMA, batch_size=1, seq_len=16, grad_checkpointing=True)).timing, tab)
    calls = [(r[0], r[3]) for r in rows if r[5] == "ckpt"]
    assert calls == [("forward", 300e-6)] * 2 + [("recompute", 500e-6)] * 2
    recomputed = [r[3] for r in rows if r[0] == "recompute" and r[5] == "matmul"]   # 8 GEMMs a layer, both layers
    assert recomputed == pytest.approx([8e-6] * 16)
    # one layer checkpointed: one call each way; under the selective policy the calls are in its per-op costs
    one = price(simulate(TrainingSpec(model=TINY_LLAMA, batch_size=1, seq_len=16, grad_checkpointing=True,
                                      checkpoint_layers=1)).timing, tab)
    assert [(r[0], r[3]) for r in one if r[5] == "ckpt"] == [("forward", 300e-6), ("recompute", 500e-6)]
    sac = price(simulate(TrainingSpec(model=TINY_LLAMA, batch_size=1, seq_len=16, grad_checkpointing=True,
                                      checkpoint_policy="selective")).timing, tab)
    assert {r[3] for r in sac if r[5] == "ckpt"} <= {0.0}


def test_opacus_hooked_modules_pay_their_hooks_per_call_both_ways():
    # tiny-llama's 2 layers, LoRA r8 on q_proj and v_proj: 8 adapter linears, each hooked by Opacus' GradSampleModule: a
    # row per hooked call in forward and per backward hook, at the table's per-call costs; without DP-SGD no such row
    from memlens.estimator.simulate import simulate

    tab = flat_table()
    tab.host_us = {"forward": 5.0, "backward": 6.0, "optimizer": 0.0, "view": 1.0, "model_forward": 8.0,
                   "model_backward": 7.0, "hooked_module_forward": 150.0, "hooked_module_backward": 200.0}
    dp = price(simulate(TrainingSpec(model=TINY_LLAMA, batch_size=2, seq_len=16, dp=True, lora_rank=8)).timing, tab)
    hooked = sorted((r[0], round(r[3] * 1e6, 6)) for r in dp if r[5] == "module" and r[3] > 100e-6)
    assert hooked == [("backward", 200.0)] * 8 + [("forward", 150.0)] * 8
    plain = price(simulate(TrainingSpec(model=TINY_LLAMA, batch_size=2, seq_len=16, lora_rank=8)).timing, tab)
    assert not [r for r in plain if r[5] == "module" and r[3] > 100e-6]
    # a user's own full backward hook is not Opacus' per-sample work: no hooked-module row
    user = price(simulate(TrainingSpec(model="tests.tiny_models:hooked_linear", optimizer="sgd")).timing, tab)
    assert [r for r in user if r[5] == "module"] and not [r for r in user if r[5] == "module" and r[3] > 100e-6]


def test_calibrate_prices_a_wrappers_calls_by_what_it_adds_beyond_its_ops():
    from memlens.measure.calibrate import extra_per_call

    plain = (0.010, 0.020, {"kernel": 300, "view": 200}, {"kernel": 500, "view": 400})
    hooked = (0.016, 0.030, {"kernel": 300, "view": 300}, {"kernel": 600, "view": 800})
    # 10 hooked calls; forward: 6 ms less 100 views at 1 us; backward: 10 ms less 100 ops at 20 us and 400 views
    assert extra_per_call(plain, hooked, 10, 50e-6, 20e-6, 1e-6) == (pytest.approx(590.0), pytest.approx(760.0))


def _ddp_spec(**kw):
    return TrainingSpec(model="gpt2", precision="bf16", world_size=2, sharding="ddp", **kw)


def test_ddps_reducer_copies_and_the_overlap_cost_are_priced_by_hand():
    tab = flat_table(gbps=100.0)
    row = {"bytes": [1, 2**40], "busbw_gbps": [50.0, 50.0], "latency_us": 0.0}
    tab.nccl = {"2": {"all_reduce": dict(row), "all_gather": dict(row)}}
    tables._add_logs(tab)
    grad = 100 * 2**20                                  # 50 Mi bf16 gradients: 4 buckets of 25 MiB
    comm = grad / 50e9                                  # all-reduce moves 2(n-1)/n = 1x the buffer at 50 GB/s
    copies = 2 * (2 * grad) / 100e9                     # mul_out into the buckets, then back into .grad: read + write
    assert step_mod.collective_seconds(_ddp_spec(), grad // 2, grad // 2, 1, 1.0, 0.5, 1, tab) == pytest.approx(
        comm / 4 + copies)                              # a long backward hides all but the last bucket
    assert step_mod.collective_seconds(_ddp_spec(gradient_as_bucket_view=True), grad // 2, grad // 2, 1, 1.0, 0.5, 1,
                                       tab) == pytest.approx(comm / 4 + copies / 2)   # the grads are the buckets' views
    # measured over 2 GPUs: the collective runs 3x slower beside compute, and the compute loses 0.1 s a second of it
    tab.nccl_overlap = {"2": {"matmul": 0.1, "comm_beside_matmul": 3.0}}
    short = 0.5 * comm                                  # a backward shorter than the (slowed) all-reduce
    assert step_mod.collective_seconds(_ddp_spec(), grad // 2, grad // 2, 1, short, 0.5, 1, tab) == pytest.approx(
        (3 * comm - short) + 0.1 * short + copies)


def test_the_overlap_cost_is_the_nearest_world_measured_and_none_without_one():
    tab = flat_table()
    assert tab.overlap_cost(2) == 0.0 and datasheet_table("h100").overlap_cost(8) == 0.0
    tab.nccl_overlap = {"2": {"matmul": 0.02, "memory": 0.1}, "8": {"matmul": 0.05}}
    assert (tab.overlap_cost(1), tab.overlap_cost(2, "memory"), tab.overlap_cost(4), tab.overlap_cost(16)) == (0.0, 0.1, 0.02, 0.05)


def test_reduce_scatter_takes_its_own_measured_row_else_all_gathers(tmp_path):
    tab = flat_table()
    row = lambda bw: {"bytes": [1, 2**40], "busbw_gbps": [bw, bw], "latency_us": 0.0}   # noqa: E731
    tab.nccl = {"2": {"all_reduce": row(100.0), "all_gather": row(80.0)}}
    tables._add_logs(tab)
    assert tab.collective_seconds("reduce_scatter", 1e9, 2) == pytest.approx(0.5e9 / 80e9)
    tab.nccl["2"]["reduce_scatter"] = row(40.0)
    tab.nccl_overlap = {"2": {"matmul": 0.013}}
    back = read_table(tab.write(tmp_path / "t.json"))
    assert back.collective_seconds("reduce_scatter", 1e9, 2) == pytest.approx(0.5e9 / 40e9)
    assert back.nccl_overlap == {"2": {"matmul": 0.013}}


def test_fsdp2s_optimizer_pays_dtensors_dispatch_per_tensor_of_each_foreach_op():
    tab = flat_table()
    tab.host_us.update(optimizer=10.0, fsdp_optimizer_tensor_op=2.0)
    spec = TrainingSpec(model="gpt2", precision="bf16", world_size=2, sharding="fsdp")
    _, plain = step_mod.optimizer_seconds(spec, 1000, 100, tab)
    _, dt = step_mod.optimizer_seconds(spec, 1000, 100, tab, dtensor=True)
    assert plain == pytest.approx(10 * 10e-6 + 100 * step_mod.PER_TENSOR_HOST_US * 1e-6)   # AdamW's 10 foreach ops
    assert dt - plain == pytest.approx(10 * 100 * 2e-6)
    tab.host_us["fsdp_optimizer_tensor_op_ranks"] = 3.0     # measured over several ranks: that one
    assert step_mod.optimizer_seconds(spec, 1000, 100, tab, dtensor=True)[1] - plain == pytest.approx(10 * 100 * 3e-6)


def test_an_fsdp2_unshard_over_several_ranks_pays_the_hooks_measured_over_ranks():
    from memlens.estimator.timing.ops import OpFacts
    from memlens.estimator.timing.record import OpTrace

    tab = flat_table()
    tab.host_us.update(model_forward=20.0, fsdp_forward_group=500.0, fsdp_backward_group=700.0)
    tab.nccl = {"2": {"all_gather": {"bytes": [1, 2**40], "busbw_gbps": [100.0, 100.0], "latency_us": 0.0}}}
    tables._add_logs(tab)
    one = OpFacts("memory", nbytes=8, op="all_gather_copy_in", gathered=4096, seq=1)
    two = one._replace(seq=2)
    host = lambda f: [r[3] for r in price(OpTrace(rows=[("forward", 0, f), ("backward", 0, f)]), tab) if r[5] == "memory"]  # noqa: E731
    assert host(two) == pytest.approx([20e-6 + 500e-6, 700e-6])          # no measurement over ranks: the one-rank one
    tab.host_us.update(fsdp_forward_group_ranks=1500.0, fsdp_backward_group_ranks=1600.0)
    assert host(two) == pytest.approx([20e-6 + 1500e-6, 1600e-6])
    assert host(one) == pytest.approx([20e-6 + 500e-6, 700e-6])          # one rank copies: its own figure


def test_each_4bit_layer_call_pays_bitsandbytes_host_work_both_ways():
    from memlens.estimator.simulate import simulate
    from memlens.estimator.timing.ops import OpFacts

    sim = simulate(TrainingSpec(model=TINY_LLAMA, batch_size=1, seq_len=16, precision="bf16", lora_rank=4, qlora=True))
    calls = [(b, f.op) for b, _, f in sim.timing.rows if f.kind == "module" and f.op]
    # 2 layers x 7 projections, each a 4-bit stand-in: 14 calls forward; backward reaches 11 (layer 0's q, k and v
    # take the frozen embedding's output, which needs no gradient: autograd never runs their backward)
    assert calls.count(("forward", "qlora_layer")) == 14 and calls.count(("backward", "qlora_layer/backward")) == 11
    tab = flat_table()
    rows = [OpFacts("module", op="qlora_layer"), OpFacts("module", op="qlora_layer/backward")]
    from memlens.estimator.timing.record import OpTrace

    trace = OpTrace(rows=[("forward", 0, rows[0]), ("recompute", 0, rows[0]), ("backward", 0, rows[1])])
    assert [r[3] for r in price(trace, tab)] == [0.0, 0.0, 0.0]          # a table without the costs: none
    tab.host_us.update(qlora_layer_forward=60.0, qlora_layer_backward=170.0)
    assert [r[3] for r in price(trace, tab)] == pytest.approx([60e-6, 60e-6, 170e-6])


def test_matmul_flops_read_directly_are_torchs_formulas():
    import torch
    from torch.utils.flop_counter import flop_registry

    from memlens.estimator.timing.ops import _flops

    aten = torch.ops.aten
    e = torch.empty
    cases = [(aten.mm.default, (e(4, 6), e(6, 5)), 240), (aten.addmm.default, (e(5), e(4, 6), e(6, 5)), 240),
             (aten.bmm.default, (e(3, 4, 6), e(3, 6, 5)), 720),
             (aten.baddbmm.default, (e(3, 4, 5), e(3, 4, 6), e(3, 6, 5)), 720),
             (aten.mm.default, (e(4, 6), e(7, 5)), 0)]       # operands that do not multiply: no FLOPs, as torch's says
    for func, args, flops in cases:
        try:
            torchs = int(flop_registry[func._overloadpacket](*args, out_val=None))
        except AssertionError:
            torchs = 0
        assert _flops(func, args, {}, None) == torchs == flops


def test_a_shipped_table_names_the_hosts_spread_and_a_calibrated_or_datasheet_one_does_not():
    """The shipped tables price the host at the reference speed and name the quartiles of the host speeds measured
    beside steps on their GPU's machines (bench/results/host_range.md): the factors are those over the reference."""
    h100 = table_for("h100")
    assert h100.env["host_reference_ms"] == 20.77 and h100.env["host_range_ms"] == [14.22, 22.78]
    assert h100.host_range() == pytest.approx((14.22 / 20.77, 22.78 / 20.77))
    assert datasheet_table("rtx-4090").host_range() is None          # a data sheet: no host measured
    assert flat_table().host_range() is None                          # as calibrate writes one: its own host, no spread
    t = flat_table()
    t.env = {"host_reference_ms": 20.0, "host_range_ms": [25.0, 10.0]}
    assert t.host_range() is None                                     # a range the wrong way round is not a range


def test_a_steps_seconds_at_the_hosts_spread_move_only_its_host_part(linear_sim, monkeypatch):
    """``host_range``: the step priced again with every host cost times each end of the spread over the reference;
    the kernels stay. A spread of one speed gives the step's own seconds; the linear step's ops at 1 ms of host each
    (0.5 and 2 ms at the ends of a 10-40 ms spread over a 20 ms reference) by hand: 1.5 ms an op between the ends."""
    t = flat_table()
    t.host_us = {"forward": 1000.0, "backward": 1000.0, "optimizer": 0.0, "view": 0.0}
    t.env = {"host_reference_ms": 20.0, "host_range_ms": [20.0, 20.0]}
    monkeypatch.setattr(step_mod, "table_for", lambda gpu: t)
    st = step_mod.step_time(linear_sim)
    assert st["host_range"]["host_ms"] == [20.0, 20.0]
    assert st["host_range"]["seconds"] == pytest.approx([st["seconds"]] * 2)
    linear_sim._step_time = None
    t.env = {"host_reference_ms": 20.0, "host_range_ms": [10.0, 40.0]}
    st2 = step_mod.step_time(linear_sim)
    assert st2["seconds"] == pytest.approx(st["seconds"])
    lo, hi = st2["host_range"]["seconds"]
    kernels = st["seconds"] - st["parts"]["host"]
    rows = price(linear_sim.timing, t)
    ops = sum(1 for r in rows if r[0] in ("forward", "backward") and r[3] > 0)
    # every op's host (0.5 / 2 ms) is longer than every kernel (<= 43 us): the queue waits on the host for all of it
    # but the kernels that run after the last launch
    assert lo == pytest.approx(kernels + step_mod.host_at(rows, [1.0] * len(rows), 1, 0.5, (0.0, 0.0)))
    assert hi - lo == pytest.approx(ops * (2e-3 - 0.5e-3), rel=0.05)
    assert "host-bound: " in step_mod.describe({**st2, "table": "t"})


def test_a_written_layers_backward_copies_its_recompute_and_backward_together():
    """A deep model priced from a shallow one's trace (memlens.estimator.depth copies layer 1, the template): in
    backward a checkpointed layer's rows run backward, recompute, backward; each copy is that whole span, so the full
    model's recomputes interleave with its backwards layer by layer as autograd runs them. A stray row another module
    owns inside the span (here the next layer's) is copied with it; the forward's span is the forward's alone."""
    from types import SimpleNamespace

    from memlens.estimator.timing.record import expanded

    modules = ["layers.0", "layers.1", "layers.2", "head"]
    stack = SimpleNamespace(depth=3, layer_of=lambda n: int(n.split(".")[1]) if n.startswith("layers.") else None)
    trace = SimpleNamespace(stack=stack, layers=5, modules=modules)     # 2 copies of layer 1 beyond the trace's 3

    def r(bucket, mod, tag):
        return (bucket, mod, 0.0, 0.0, 0, tag)

    rows = [r("forward", 0, "f0"), r("forward", 1, "f1"), r("forward", 2, "f2"), r("forward", 3, "head"),
            r("backward", 3, "dhead"), r("backward", 2, "b2"),
            r("backward", 1, "b1a"), r("recompute", 1, "r1a"), r("recompute", 2, "stray"), r("recompute", 1, "r1b"),
            r("backward", 1, "b1b"), r("backward", 0, "b0")]
    got = [x[5] for x in expanded(rows, trace)]
    span = ["b1a", "r1a", "stray", "r1b", "b1b"]
    assert got == ["f0", "f1", "f1", "f1", "f2", "head", "dhead", "b2", *span * 3, "b0"]


def test_a_table_says_when_its_gemms_were_timed_from_a_python_loop(tmp_path, monkeypatch):
    from memlens.measure.calibrate import matmul_timer

    # the H200's grids were measured again graph-timed (bench/gpu_matmul_grid.py): nothing to say
    h200 = table_for("h200")
    assert h200.env[tables.MATMUL_TIMER] == matmul_timer() == "CUDA graph under 2e+11 FLOPs"
    # and it has every op rate calibrate measures now (the softmax ops by row width among them)
    assert not h200.matmul_loop_timed() and h200.note == "calibrated on a NVIDIA H200" and not h200.unmeasured_ops()
    src = flat_table()
    src.env[tables.MATMUL_TIMER] = matmul_timer()
    monkeypatch.setenv(tables.ENV_TABLE, str(src.write(tmp_path / "graphed.json")))
    assert "GEMMs" not in table_for("h100").note
    src.calibrated = False                              # a data-sheet table timed nothing: nothing to say either
    src.env.pop(tables.MATMUL_TIMER)
    monkeypatch.setenv(tables.ENV_TABLE, str(src.write(tmp_path / "sheet.json")))
    assert not table_for("h100").matmul_loop_timed()


def test_two_dtypes_in_one_elementwise_op_and_a_cat_of_one_tensor_are_their_own_rates():
    import torch

    from memlens.estimator.timing.ops import op_facts

    a = torch.ops.aten
    x32, x16 = torch.empty(64, 32), torch.empty(64, 32, dtype=torch.bfloat16)
    mixed = op_facts(a.add.Tensor, (x32, x16), {}, x32 + x16)  # autocast's residual: fp32 stream + bf16 output
    assert (mixed.op, mixed.nbytes) == ("add/mixed", 64 * 32 * (4 + 2 + 4))
    assert op_facts(a.add.Tensor, (x16, x16), {}, x16).op == "add"
    w32 = torch.empty(32)                                      # a broadcast fp32 weight: the broadcast's rate
    assert op_facts(a.mul.Tensor, (x16, w32), {}, x16 * w32).op == "mul/bcast"
    assert op_facts(a.mul.Tensor, (x16, torch.tensor(2.0)), {}, x16).op == "mul"   # a 0-dim operand: not two dtypes
    drop = op_facts(a.native_dropout.default, (x32, 0.1, True), {}, (torch.empty(64, 32), torch.empty(64, 32, dtype=torch.bool)))
    assert (drop.op, drop.nbytes) == ("native_dropout", 64 * 32 * (4 + 4 + 1))      # reads x, writes out and the mask
    kv = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16)       # DynamicCache.update in training: cat onto an empty cache
    one = op_facts(a.cat.default, ([torch.empty(0, dtype=torch.bfloat16), kv], -2), {}, kv.clone())
    assert (one.op, one.nbytes) == ("cat/one", 2 * kv.numel() * 2)
    tab = flat_table(gbps=100.0)
    tab.op_ratio = {"cat/heads": 0.25, "add": 1.0}
    assert tab.op_seconds("cat/one", 1e6) == pytest.approx(1e6 / 25e9)        # not measured: as a cat of heads
    assert tab.op_seconds("add/mixed", 1e6) == pytest.approx(1e6 / 100e9)     # not measured: as the op
    h200 = table_for("h200")
    assert h200.op_ratio["add/mixed"] < 0.7 < 1.0 < h200.op_ratio["add"] and h200.op_ratio["cat/one"] < 0.2
    # the backward of RoPE's half-head slice: zeros of the whole head, then the half copied in (read and written)
    g = torch.empty(2, 4, 16, 32, dtype=torch.bfloat16)
    sb = op_facts(a.slice_backward.default, (g, [2, 4, 16, 64], -1, 0, 32, 1), {}, torch.empty(2, 4, 16, 64, dtype=torch.bfloat16))
    assert (sb.op, sb.nbytes, sb.fill) == ("slice_backward", 2 * g.numel() * 2, 2 * 4 * 16 * 64 * 2)
    tab.op_ratio.update({"fill_": 2.0, "slice_backward": 0.5})
    assert tab.op_seconds("slice_backward", 1e6) + tab.op_seconds("fill_", 2e6) == pytest.approx(1e6 / 50e9 + 2e6 / 200e9)


def test_a_softmax_is_priced_at_the_measured_row_width_nearest_its_own():
    import torch

    from memlens.estimator.timing.ops import op_facts

    a = torch.ops.aten
    logits = torch.empty(4, 50257)                          # GPT-2's vocabulary, fp32: a width measured as is
    assert op_facts(a._log_softmax.default, (logits, -1, False), {}, logits).op == "_log_softmax/w50257"
    scores = torch.empty(2, 4, 1500, 1500, dtype=torch.bfloat16)   # nearest 1,024 (log 0.38) before 2,048 (0.31)? 2,048
    assert op_facts(a._softmax.default, (scores, 3, False), {}, scores).op == "_softmax/w2048/16bit"
    grad, out, big = (torch.empty(2, 128256) for _ in range(3))   # Llama-3's 128,256: nearest 131,072
    bwd = op_facts(a._log_softmax_backward_data.default, (grad, out, 1, torch.float32), {}, big)
    assert (bwd.op, bwd.nbytes) == ("_log_softmax_backward_data/w131072", 3 * 2 * 128256 * 4)
    rows = torch.empty(64, 8)                               # over the first dimension: the op's own rate
    assert op_facts(a._softmax.default, (rows, 0, False), {}, rows).op == "_softmax"
    # priced: the width's ratio where the table has it, else the op's one ratio, else a copy's
    t = flat_table()
    t.op_ratio.update({"_log_softmax/w50257": 0.5, "_softmax": 0.8})
    copy = t.op_seconds("copy_", 1e8)
    assert t.op_seconds("_log_softmax/w50257", 1e8) == pytest.approx(copy / 0.5)
    assert t.op_seconds("_softmax/w2048/16bit", 1e8) == pytest.approx(copy / 0.8)
    assert t.op_seconds("_log_softmax/w1024", 1e8) == pytest.approx(copy)


def test_borrowed_rates_fill_only_what_the_table_lacks_and_say_so(tmp_path, monkeypatch):
    mine, theirs = flat_table(), flat_table()
    mine.device_name, theirs.device_name = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    mine.op_ratio, theirs.op_ratio = {"mul": 0.9}, {"mul": 0.5, "_to_copy/up": 0.55}
    # their GEMMs all at 500 TFLOP/s; mine (the flat table: 10 TFLOP/s, 100 GB/s) over the grid [1, 2^20]^3
    theirs.matmul["bfloat16"] = {"m": [1, 2**20], "n": [1, 2**20], "k": [1, 2**20], "tflops": [[[500.0] * 2] * 2] * 2}
    ops = tables.borrow_rates(mine, theirs, 2e11, "same chip")
    assert ops == ["_to_copy/up"] and mine.op_ratio["mul"] == 0.9 and mine.op_ratio["_to_copy/up"] == 0.55
    got = mine.matmul["bfloat16"]["tflops"]
    assert got[1][1][1] == 10.0                               # 2^61 FLOPs: over 2e11, its own (long enough for a loop)
    assert got[0][0][0] == pytest.approx(2 / (6 / 100e9) / 1e12, rel=1e-3)   # 2 FLOPs, 6 bytes: mine's bytes' time
    # 2^20 x 1 x 1: 2^21 FLOPs, 4 MiB read and written: bound by mine's 100 GB/s, not their 500 TFLOP/s
    nbytes = (2**20 + 1 + 2**20) * 2
    assert got[1][0][0] == pytest.approx(2**21 / (nbytes / 100e9) / 1e12, rel=1e-3)
    assert mine.matmul_tflops("bfloat16", 2**20, 1, 1) == pytest.approx(got[1][0][0], rel=1e-3)
    monkeypatch.setenv(tables.ENV_TABLE, str(mine.write(tmp_path / "filled.json")))
    t = table_for("h100")
    assert "_to_copy/up" not in t.unmeasured_ops() and not t.matmul_loop_timed() and t.borrowed()["why"] == "same chip"
    # what it still lacks (the flat table's 43 + 6 by-width families, less mul and the upcast) and what it took
    assert t.note.endswith("; 47 op rates not measured there; 1 op rate and GEMMs under 2e+11 FLOPs from the NVIDIA "
                           "H200's table")


def test_a_convolution_is_its_implicit_gemm_and_a_depthwise_one_a_memory_bound_op():
    import torch

    from memlens.estimator.timing.ops import op_facts

    a = torch.ops.aten
    # a ResNet 1 x 1 convolution: M = 8 x 14 x 14 positions, N = 256 out channels, K = 64 in channels
    x, w = torch.empty(8, 64, 14, 14), torch.empty(256, 64, 1, 1)
    conv = (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    y = a.convolution.default(*conv)
    f = op_facts(a.convolution.default, conv, {}, y)
    assert (f.kind, f.mnk, f.flops) == ("conv", (8 * 196, 256, 64), 2 * 8 * 196 * 256 * 64)
    # backward, both gradients: two convolutions of the forward's size; the first layer's (no input gradient): one
    bwd = (y, x, w, [256], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])
    assert op_facts(a.convolution_backward.default, bwd, {}, a.convolution_backward.default(*bwd)).flops == 2 * f.flops
    first = (*bwd[:10], [False, True, True])
    assert op_facts(a.convolution_backward.default, first, {}, a.convolution_backward.default(*first)).flops == f.flops
    # a grouped 3 x 3 (32 groups of 8 channels): per group N = 8, K = 8 x 9; FLOPs over every group
    wg = torch.empty(256, 8, 3, 3)
    xg = torch.empty(8, 256, 14, 14)
    g = (xg, wg, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 32)
    fg = op_facts(a.convolution.default, g, {}, a.convolution.default(*g))
    assert (fg.mnk, fg.flops) == ((8 * 196, 8, 72), 2 * 8 * 196 * 8 * 72 * 32)
    # depthwise (one input channel a group): priced by bytes at the rate of its input's layout
    wd = torch.empty(64, 1, 7, 7, dtype=torch.bfloat16)
    for xd, key in ((torch.empty(2, 64, 8, 8, dtype=torch.bfloat16), "convolution/depthwise"),
                    (torch.empty(2, 64, 8, 8, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last),
                     "convolution/depthwise/nhwc")):
        d = (xd, wd, None, [1, 1], [3, 3], [1, 1], False, [0, 0], 64)
        fd = op_facts(a.convolution.default, d, {}, a.convolution.default(*d))
        assert (fd.kind, fd.op, fd.nbytes) == ("memory", key, 2 * (2 * 64 * 64 * 2) + 64 * 49 * 2)
        yd = a.convolution.default(*d)
        db = (yd, xd, wd, [64], [1, 1], [3, 3], [1, 1], False, [0, 0], 64, [True, True, False])
        assert op_facts(a.convolution_backward.default, db, {}, a.convolution_backward.default(*db)).op == \
            key.replace("convolution", "convolution_backward")


def test_a_grouped_gemm_is_priced_as_one_gemm_over_its_rows_with_each_groups_last_tile_half_empty():
    import torch

    from memlens.estimator.timing.ops import GROUP_TILE_M, op_facts

    a = torch.ops.aten
    x = torch.empty(4096, 512, dtype=torch.bfloat16, device="meta")          # 4,096 routed rows, K = 512
    w = torch.empty(16, 1024, 512, dtype=torch.bfloat16, device="meta").transpose(-2, -1)   # 16 experts, N = 1,024
    offs = torch.empty(16, dtype=torch.int32, device="meta")
    out = torch.empty(4096, 1024, dtype=torch.bfloat16, device="meta")
    f = op_facts(a._grouped_mm.default, (x, w, offs), {}, out)
    assert (f.kind, f.op, f.mnk, f.flops) == ("matmul", "_grouped_mm", (4096, 1024, 512), 2 * 4096 * 1024 * 512)
    assert f.pad == pytest.approx((4096 + 16 * GROUP_TILE_M / 2) / 4096)
    # the weights' gradient: [K, T] x [T, N] split along T into 16 groups -> [16, K, N], each reducing T / 16 rows
    gw = op_facts(a._grouped_mm.default, (x.t(), out, offs), {}, torch.empty(16, 512, 1024, device="meta"))
    assert (gw.mnk, gw.flops, gw.pad) == ((16 * 512, 1024, 256), 2 * 16 * 512 * 1024 * 256, 1.0)
    # priced: the dense grid's rate (the flat table's 10 TFLOP/s) times the table's grouped ratio, over the padded FLOPs
    from memlens.estimator.timing.record import OpTrace
    t = flat_table()
    t.op_ratio["_grouped_mm"] = 0.5
    (bucket, _, gpu, _, flops, kind), = price(OpTrace(rows=[("forward", 0, f)]), t)
    assert (bucket, kind, flops) == ("forward", "matmul", f.flops)           # MFU counts the FLOPs asked
    assert gpu == pytest.approx(2 * 4096 * 1024 * 512 * f.pad / 5e12)


def test_norms_over_fp32_inputs_have_their_own_rates_and_fall_back_to_the_16_bit_ones():
    import torch

    from memlens.estimator.timing.ops import op_facts

    a = torch.ops.aten
    x32, x16 = torch.empty(64, 128), torch.empty(64, 128, dtype=torch.bfloat16)
    w = torch.empty(128)
    ln32 = op_facts(a.native_layer_norm.default, (x32, [128], w, w, 1e-5), {}, a.native_layer_norm.default(x32, [128], w, w, 1e-5))
    assert ln32.op == "native_layer_norm/w96/fp32"        # 128 wide: nearest 96 of the measured widths (log scale)
    assert op_facts(a.native_layer_norm.default, (x16, [128], w, w, 1e-5), {}, x16).op == "native_layer_norm/w96"
    wide = torch.empty(4, 1536)
    assert op_facts(a.native_layer_norm.default, (wide, [1536], torch.empty(1536), None, 1e-5), {},
                    wide).op == "native_layer_norm/w1600/fp32"
    img = torch.empty(2, 8, 28, 28)
    bn = op_facts(a.native_batch_norm.default, (img, torch.empty(8), torch.empty(8), None, None, True, 0.1, 1e-5), {},
                  a.native_batch_norm.default(img, torch.empty(8), torch.empty(8), None, None, True, 0.1, 1e-5))
    assert bn.op == "native_batch_norm/hw784/fp32"
    t = flat_table()
    t.op_ratio.update({"native_batch_norm/hw784": 0.25, "native_layer_norm": 0.5})
    copy = t.op_seconds("copy_", 1e8)
    assert t.op_seconds("native_batch_norm/hw784/fp32", 1e8) == pytest.approx(copy / 0.25)   # its 16-bit layout's rate
    assert t.op_seconds("native_layer_norm/w96/fp32", 1e8) == pytest.approx(copy / 0.5)      # the op's own
    t.op_ratio["native_batch_norm/hw784/fp32"] = 0.5
    assert t.op_seconds("native_batch_norm/hw784/fp32", 1e8) == pytest.approx(copy / 0.5)
