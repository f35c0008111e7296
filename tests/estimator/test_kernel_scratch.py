"""What CUDA kernels take from the allocator beside their outputs, found in H100 allocator histories
(bench/results/zero1_probe.md, ninth session): reductions' staging, autograd's in-place sums, embedding backward's
sort, fused attention's backward workspaces. Sizes by hand."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memlens.core.events import ALLOC, FREE
from memlens.core.spec import TrainingSpec
from memlens.estimator import cuda_rules as cr
from memlens.estimator.reduce_scratch import ReduceScratch, global_reduce_bytes
from memlens.estimator.simulate import simulate

H100 = dict(sm_count=132, max_threads_per_sm=2048)


def test_column_reduction_staging_by_hand():
    # a bias gradient: grad_output (1,024 tokens x N outputs, fp32) summed over the tokens. Reduce.cuh: not along the
    # fastest dim, so 4-wide output vectors; block 32 x 4 (128 threads); 1,024 / 4 = 256 values per thread; grid
    # N / 4 / 32 columns; CTAs per output min(ceil(132 SMs x 16 blocks / grid), ceil(256 / 16)) = 16
    for n in (1024, 3072, 4096):
        grid = n // 4 // 32
        ctas = min(-(-132 * (2048 // 128) // grid), 256 // 16)
        assert ctas == 16
        assert global_reduce_bytes((1024, n), (n, 1), (0,), 4, **H100) == (4 * n * ctas * 32 * 4, 4 * grid)
    # GPT-2 medium's four bias gradients per layer, as the H100 made them: 8, 8, 24, 32 MiB
    assert [global_reduce_bytes((1024, n), (n, 1), (0,), 4, **H100)[0] >> 20 for n in (1024, 1024, 3072, 4096)] == \
        [8, 8, 24, 32]
    # the same sum over a 3-D gradient (2 x 512 tokens): TensorIterator coalesces the two reduced dims
    assert global_reduce_bytes((2, 512, 4096), (512 * 4096, 4096, 1), (0, 1), 4, **H100) == \
        global_reduce_bytes((1024, 4096), (4096, 1), (0,), 4, **H100)


def test_no_staging_where_blocks_do_not_split_an_output():
    # along the fastest dim (a norm's mean over the hidden size): one block per row, no global memory
    assert global_reduce_bytes((1024, 1024), (1024, 1), (1,), 4, **H100) == (0, 0)
    # 1,000 inputs per output: 250 values per thread, under 256
    assert global_reduce_bytes((1000, 1024), (1024, 1), (0,), 4, **H100) == (0, 0)
    # 270,336 outputs: 2,112 block columns, the H100's whole target grid (132 SMs x 16): one block per column, no split
    assert global_reduce_bytes((1024, 270336), (270336, 1), (0,), 4, **H100) == (0, 0)
    # a 0-dim tensor summed over its one dim
    assert global_reduce_bytes((), (), (0,), 4, **H100) == (0, 0)


def test_staging_follows_the_gpu():
    # an L4 (58 SMs, 1,536 threads per SM): target grid 58 x 12 = 696 blocks; 4,096 outputs at 8,192 tokens: grid 32,
    # CTAs min(ceil(696 / 32) = 22, 2048 / 16 = 128) = 22 where the H100 takes min(66, 128) = 66
    l4 = global_reduce_bytes((8192, 4096), (4096, 1), (0,), 2, sm_count=58, max_threads_per_sm=1536)[0]
    h100 = global_reduce_bytes((8192, 4096), (4096, 1), (0,), 2, **H100)[0]
    assert (l4, h100) == (4 * 4096 * 22 * 128, 4 * 4096 * 66 * 128)


def _scratch(log):
    return [ev for ev in log.events if ev[0] == ALLOC and isinstance(ev[6], ReduceScratch)]


def test_a_bias_gradient_stages_its_sum_for_the_call():
    sim = simulate(TrainingSpec(model="tests.tiny_models:biased_tokens", optimizer="sgd"), steps=1, repeat=False)
    got = _scratch(sim.log)
    staging = [ev for ev in got if ev[6].part == 0 and ev[2]]
    # the loss' full sum of 2 x 512 x 1024 values stages one partial per block (512 B); the bias gradient, 4 x 1024
    # outputs x 16 CTAs x 128
    assert [(ev[2], ev[5]) for ev in staging] == [(512, "forward"), (8 * 2**20, "backward")]
    staging = staging[1:]
    # made and freed at once: semaphores (32 B) first
    i = sim.log.events.index(staging[0])
    assert sim.log.events[i + 1][0] == ALLOC and sim.log.events[i + 1][2] == 32
    assert [ev[0] for ev in sim.log.events[i + 2:i + 4]] == [FREE, FREE]
    # every float reduction logs its pair: two here, each a staging buffer and semaphores
    assert [ev[6].part for ev in got] == [0, 1, 0, 1]


def test_autograd_sums_a_tensors_two_gradients_in_place():
    # h (16 x 1024 fp32, 64 KiB) gets two gradients: 2 * g and g * (1 - tanh^2). On CUDA the engine adds the second
    # into the first, which it alone holds (input_buffer.cpp accumulate): no third h-sized tensor
    sim = simulate(TrainingSpec(model="tests.tiny_models:twice", optimizer="sgd"), steps=1, repeat=False)
    adds = [ev for ev in sim.log.events if ev[0] == ALLOC and ev[5] == "backward" and "aten.add.Tensor" in str(ev[6])]
    assert adds == []


def test_embedding_backward_sorts_only_above_3072_indices():
    from memlens.estimator.simulate import SimulationTracker
    from memlens.core.events import EventLog

    for n, expected in ((3072, []), (3073, [3073 * 64 * 4, 3073 * 454])):
        log = EventLog()
        tr = SimulationTracker(log)
        tr._embedding_backward_scratch(torch.empty(n, 64), torch.zeros(n, dtype=torch.long))
        assert [ev[2] for ev in log.events if ev[0] == ALLOC] == expected
    log = EventLog()
    SimulationTracker(log)._embedding_backward_scratch(torch.empty(8, 64), torch.zeros(8, dtype=torch.long), by_freq=True)
    assert [ev[2] for ev in log.events if ev[0] == ALLOC] == [8 * 64 * 4, 8 * 454]


def _backward_allocs(backend, q, k, v):
    from memlens.core.ledger import EventLog
    from memlens.core.tracker import StorageTracker

    log = EventLog()
    fake = FakeTensorMode()
    with fake:
        q, k, v = (torch.empty(*s, dtype=q[1]) for s in (q[0], k[0], v[0]))
        out = torch.empty(q.shape, dtype=q.dtype)
        stats = torch.empty(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float32)
    with fake, StorageTracker(log):
        grads = cr.attention_kernel_backward(backend, q, k, v, out, stats)
    return [(ev[0], ev[2]) for ev in log.events if ev[0] in (ALLOC, FREE) and (ev[0] == FREE or ev[2] > 2**20)], grads


def test_fp32_efficient_attention_backward_takes_a_dq_workspace():
    # GPT-2 medium, 2 x 512 tokens, 16 heads of 64: per batch and head, 8 query tiles x 1 head-dim tile of
    # (64 x 64 floats + 16 B) = 4,198,400 B, after dq, dk, dv (4 MiB each) and freed at once
    B, H, L, D = 2, 16, 512, 64
    allocs, _ = _backward_allocs("efficient", ((B, H, L, D), torch.float32), ((B, H, L, D), None), ((B, H, L, D), None))
    big = [n for kind, n in allocs if kind == ALLOC]
    assert B * H * 8 * (64 * 64 * 4 + 16) == 4_198_400
    assert big[-1] == 4_198_400 and big[:-1].count(4 * 2**20) == 4    # dq, the output-sized scratch, dk, dv


def test_cudnn_backward_takes_one_workspace_after_the_gradients():
    # GPT-2 XL bf16, 2 x 512 tokens, 25 heads of 64: dq, dk, dv (3,276,800 B each), then fp32 dQ (6,553,600 B), the
    # statistics' size (102,400 B) and 256 B in one block: 6,656,256 B, as the H100 allocated it
    B, H, L, D = 2, 25, 512, 64
    allocs, _ = _backward_allocs("cudnn", ((B, H, L, D), torch.bfloat16), ((B, H, L, D), None), ((B, H, L, D), None))
    assert [n for kind, n in allocs if kind == ALLOC] == [3_276_800] * 3 + [6_656_256]


def test_cudnn_grouped_query_backward_writes_kv_sized_grads_and_an_fp32_workspace():
    # Llama-3.2-3B, 2 x 1,024 tokens, 24 query heads, 8 kv heads of 128, bf16: dq 12 MiB, dk and dv 4 MiB each, then
    # fp32 dQ (24 MiB), dK and dV for every query head (2 x 12 MiB), the statistics' size (192 KiB) and 256 B:
    # 50,528,512 B
    B, H, Hk, L, D = 2, 24, 8, 1024, 128
    allocs, (dq, dk, dv, _) = _backward_allocs("cudnn", ((B, H, L, D), torch.bfloat16), ((B, Hk, L, D), None),
                                               ((B, Hk, L, D), None))
    assert [n for kind, n in allocs if kind == ALLOC] == [12 * 2**20, 4 * 2**20, 4 * 2**20, 50_528_512]
    assert dk.shape == dv.shape == (B, Hk, L, D)


def test_the_in_place_sum_is_priced_as_the_add_it_is(monkeypatch):
    # the engine's sum of h's two gradients runs in place on the GPU, reading both and writing one: 3 x 64 KiB
    from memlens.estimator import estimate
    from memlens.estimator.timing import record

    seen = []
    orig_op = record.Recorder.op

    def op(self, func, args, kwargs, out):
        if func is torch.ops.aten.add.Tensor and self.tracker.phase == "backward":
            seen.append(record.op_facts(func, args, kwargs, out).nbytes)
        return orig_op(self, func, args, kwargs, out)

    monkeypatch.setattr(record.Recorder, "op", op)
    estimate(TrainingSpec(model="tests.tiny_models:twice", optimizer="sgd"))
    assert 3 * 16 * 1024 * 4 in seen


def test_a_convolutions_bias_gradient_stages_its_sum():
    # the bias gradient sums grad_output over (N, H, W) as it came: transposed back from (B, patches, C), channels are
    # its fastest dim, so TensorIterator coalesces the reduced dims to 8,192 rows beside 64 channels - a column
    # reduction: 4-wide vectors, block 16 x 8, 1,024 values per thread, one block column; CTAs min(2,112, 1024 / 16) = 64;
    # 4 B x 64 outputs x 64 CTAs x (16 x 4) = 1 MiB, then 4 B of semaphores
    sim = simulate(TrainingSpec(model="tests.tiny_models:patch_embed", optimizer="sgd"), steps=1, repeat=False)
    staged = [(ev[2], ev[5]) for ev in _scratch(sim.log) if ev[2] and ev[6].part == 0]
    assert (4 * 64 * 64 * 16 * 4, "backward") in staged
