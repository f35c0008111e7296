"""Pipeline parallel x FSDP2 (--pp N): torchtitan's split of a Llama into stages, FSDP2 per stage over the data-parallel
ranks, and the schedule's forwards and backwards run op by op on fake tensors under the fake process group (issue 37)."""
from __future__ import annotations

import json

import pytest

from memlens.core.errors import SpecError
from memlens.core.events import ALLOC, FREE, PHASE, TAG
from memlens.core.ledger import analyze
from memlens.core.spec import TrainingSpec
from memlens.estimator.ranks import estimate_ranks, peak_terms, simulate_rank
from memlens.step.parallel.pp import in_flight, schedule_order, split_layers

LLAMA = "tests/fixtures/tiny-llama"     # H 64, MLP 128, 4 heads of 16, 2 kv heads, vocab 256, untied, fp32


def blocks(n: int) -> int:
    return -(-n // 512) * 512


# One decoder layer's fp32 parameters, each FSDP2-sharded over 2 ranks (ceil(dim0 / 2) rows): q (64 x 64), k, v (32 x
# 64), o (64 x 64), gate, up (128 x 64), down (64 x 128), two norms (64); the embedding and lm_head (256 x 64), the norm
LAYER = [64 * 64, 32 * 64, 32 * 64, 64 * 64, 128 * 64, 128 * 64, 64 * 128, 64, 64]
EMBED, NORM = [256 * 64], [64]


def _held(sizes: list[int], shards: int) -> tuple[int, int]:
    """(the sharded parameters in allocator blocks, the gathered ones) of fp32 tensors of ``sizes`` values, dim 0 halved."""
    return sum(blocks(n * 4 // shards) for n in sizes), sum(blocks(n * 4) for n in sizes)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama4")
    cfg = json.loads(open(f"{LLAMA}/config.json").read())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4}))
    return str(d)


def _spec(model, **kw):
    return TrainingSpec(**{"model": model, "batch_size": 1, "seq_len": 16, "world_size": 4, "sharding": "fsdp", "pp": 2,
                           "pp_schedule": "gpipe", **kw})


def _terms(sim):
    return peak_terms(sim.log, analyze(sim.log).peak_event, sim.wrapper)[1]


def _marks(log, name: str) -> list[int]:
    return [i for i, ev in enumerate(log.events) if ev[0] == PHASE and ev.name == name]


def _most_in_schedule(sim, category: str) -> int:
    """The most bytes (allocator blocks) of the storages last tagged ``category`` live at once from the schedule's first
    forward on (step 1's second "forward" mark: the first opens the stages' first-step initialization)."""
    final = {ev.key: ev.category for ev in sim.log.events if ev[0] in (ALLOC, TAG)}
    start = _marks(sim.log, "forward")[1]
    live, now, most = {}, 0, 0
    for i, ev in enumerate(sim.log.events):
        if ev[0] == ALLOC and final[ev.key] == category:
            live[ev.key] = blocks(ev.nbytes)
            now += live[ev.key]
        elif ev[0] == FREE and ev.key in live:
            now -= live.pop(ev.key)
        if i >= start:
            most = max(most, now)
    return most


@pytest.fixture(scope="module")
def one_mb(llama4):
    """pp 2 x dp 2, one micro-batch of one sequence (GPipe): pipeline ranks 0 (rank 0) and 1 (rank 2)."""
    return {r: simulate_rank(_spec(llama4), r, steps=1) for r in (0, 2)}


def test_the_layers_are_split_as_torchtitan_splits_them():
    # the embedding and the norm + output weigh one layer each: 4 + 2 over 2 stages is 3 each, over 4 stages 2, 2, 1, 1
    assert split_layers(2, 4) == [[0, 1], [2, 3]]
    assert split_layers(4, 4) == [[0], [1, 2], [3], []]
    assert [len(s) for s in split_layers(4, 32)] == [8, 9, 8, 7]      # Llama-3.1-8B over 4 stages
    with pytest.raises(SpecError, match=r"^--pp: 8 stages are more than the model's 4 layers \+ embedding \+ output"):
        split_layers(8, 4)


@pytest.mark.parametrize("rank, sizes", [(0, EMBED + 2 * LAYER), (2, 2 * LAYER + NORM + EMBED)])
def test_pp2_each_stage_holds_its_layers_sharded_over_its_data_parallel_ranks(one_mb, rank, sizes):
    terms = _terms(one_mb[rank])
    sharded, gathered = _held(sizes, 2)
    assert terms["sharded parameters"] == sharded and terms["optimizer states (sharded)"] == 2 * sharded   # AdamW
    # no gradient sync until the stage's last backward (backward_maybe_with_nosync): the whole stage's gradients
    # accumulate unsharded beside its gathered parameters (reshard_after_forward=False, torchtitan's default with PP)
    assert terms["gathered parameters"] == terms["gathered gradients"] == gathered
    setup = sum(ev.nbytes for ev in one_mb[rank].log.events if ev[0] == ALLOC and ev.phase == "setup" and ev.category == "parameters")
    assert setup == sum(n * 4 for n in sizes) // 2
    assert one_mb[rank].wrapper.facts["mesh"] == {"pp": 2, "dp_shard": 2}


@pytest.mark.parametrize("pipe_rank, sizes", [(0, EMBED + LAYER), (1, 2 * LAYER), (2, LAYER), (3, NORM + EMBED)])
def test_pp4_stage_bytes_by_hand(llama4, pipe_rank, sizes):
    sim = simulate_rank(_spec(llama4, world_size=8, pp=4), 2 * pipe_rank, steps=1)
    terms = _terms(sim)
    sharded, gathered = _held(sizes, 2)
    assert terms["sharded parameters"] == sharded and terms["optimizer states (sharded)"] == 2 * sharded
    assert terms["gathered parameters"] == gathered


@pytest.mark.parametrize("rank, sched, k", [(0, "1f1b", 2), (0, "gpipe", 4), (2, "1f1b", 1), (2, "gpipe", 4)])
def test_1f1b_holds_pp_minus_stage_micro_batches_gpipe_all_of_them(llama4, one_mb, rank, sched, k):
    # 4 micro-batches of one sequence: the first stage runs 2 (pp - 0) forwards before its first backward under 1F1B,
    # all 4 under GPipe; the last stage 1 and 4. Each forward's saved activations are one micro-batch's (one_mb), counted
    # from the schedule's first forward on (torch >= 2.13's first-step inference saves its own input besides: below)
    assert in_flight(schedule_order(sched, 2, rank // 2, 4)) == k
    sim = simulate_rank(_spec(llama4, batch_size=4, pp_schedule=sched), rank, steps=1)
    assert _most_in_schedule(sim, "activations") == k * _most_in_schedule(one_mb[rank], "activations")
    assert sim.wrapper.facts["microbatches_in_flight"] == k


def _live_most(log, module: str, nbytes: int) -> tuple[int, int]:
    """(how many storages of ``nbytes`` allocated in ``module`` during forward, the most alive at once)."""
    mid = log.modules.index(module)
    live, most, made = set(), 0, 0
    for ev in log.events:
        if ev[0] == ALLOC and ev.module == mid and ev.nbytes == nbytes and ev.phase == "forward":
            live.add(ev.key)
            made += 1
            most = max(most, len(live))
        elif ev[0] == FREE:
            live.discard(ev.key)
    return made, most


@pytest.mark.parametrize("sched, most", [("1f1b", 2), ("gpipe", 4)])
def test_the_last_stage_holds_each_micro_batchs_logits_until_its_backward(llama4, sched, most):
    sim = simulate_rank(_spec(llama4, batch_size=4, pp_schedule=sched), 2, steps=1)
    logits = 1 * 16 * 256 * 4         # one sequence of 16 tokens over the 256-word vocabulary, fp32
    # one more than the micro-batches: the first step's inference forward (micro-batch 0's shape), its logits freed
    # before the schedule's first forward. 1F1B on the last stage alternates F and B, yet 2 are alive at once: the
    # schedule's `output` local still holds micro-batch i's logits (past its backward) when micro-batch i + 1's are made
    assert _live_most(sim.log, "stage1.lm_head", logits) == (4 + 1, most)
    # and the last micro-batch's until the step returns: after the gradients' reduce-scatter, freed with nothing
    # allocated after it before the optimizer step
    mid, opt = sim.log.modules.index("stage1.lm_head"), _marks(sim.log, "optimizer")[0]
    last = [ev.key for ev in sim.log.events if ev[0] == ALLOC and ev.module == mid and ev.nbytes == logits][-1]
    freed = next(i for i, ev in enumerate(sim.log.events) if ev[0] == FREE and ev.key == last)
    assert not any(ev[0] == ALLOC for ev in sim.log.events[freed:opt])
    assert max(i for i, ev in enumerate(sim.log.events[:opt]) if ev[0] == ALLOC and ev.category == "communication") < freed
    # a receive buffer per micro-batch for its input activations (the hidden states), none for gradients (last stage)
    assert sim.wrapper.facts["recv_buffers"] == 4 and sim.wrapper.facts["recv_buffer_shape"] == [1, 16, 64]
    comm = sum(ev.nbytes for ev in sim.log.events if ev[0] == ALLOC and sim.log.modules[ev.module] == "(pipeline P2P receive buffers)")
    assert comm == 4 * 16 * 64 * 4


def test_interleaved_runs_torchs_own_order_over_the_ranks_virtual_stages(llama4):
    spec = _spec(llama4, batch_size=4, pp_schedule="interleaved-1f1b", virtual_stages=2)
    sim = simulate_rank(spec, 0, steps=1)
    # 4 stages of a 4-layer model: pipeline rank 0 holds stage 0 (embedding + layer 0) and stage 2 (layer 3)
    assert sim.wrapper.facts["stages"] == {"0": "embedding + layer 0", "2": "layer 3"}
    order = schedule_order("interleaved-1f1b", 2, 0, 4, 2)
    assert order[:5] == [(0, "F", 0), (0, "F", 1), (2, "F", 0), (2, "F", 1), (0, "F", 2)]
    # torch's warm-up on rank 0: (V - 1) x 2 micro-batches a round + 2 x (pp - 1 - rank) = 4 forwards, and its 1F1B
    # phase starts with a forward before the first backward: 5 micro-batch stages in flight (the plain 1F1B's 2, x 2.5)
    assert sim.wrapper.facts["microbatches_in_flight"] == in_flight(order) == 5
    assert _terms(sim)["sharded parameters"] == _held(EMBED + 2 * LAYER, 2)[0]


def test_every_pipeline_rank_is_reported_and_the_headline_reserves_most(llama4):
    r = estimate_ranks(_spec(llama4, batch_size=2, pp_schedule="1f1b"), steps=1)
    ranks = r.data["ranks"]
    assert [(e["rank"], e["ranks"]) for e in ranks] == [(0, [0, 1]), (2, [2, 3])]
    top = max(ranks, key=lambda e: (e["peak_reserved_bytes"], e["peak_allocated_bytes"]))   # a tie: the larger allocated
    assert r.data["peak_rank"] == top["rank"] and r.peak_reserved_bytes == top["peak_reserved_bytes"]
    assert f"the headline is the simulated rank with the largest reserved peak: rank {top['rank']}, pipeline rank" in " ".join(r.notes)


def test_pp_stage_picks_the_pipeline_rank_reported(llama4):
    r = estimate_ranks(_spec(llama4, pp_stage=1), steps=1)
    assert [(e["rank"], e["ranks"]) for e in r.data["ranks"]] == [(2, [2, 3])]
    assert r.data["ranks"][0]["why"].startswith("pipeline rank 1 (stage 1: layers 2-3 + norm + lm_head + loss)")
    assert r.data["strategy"] == ("PP x FSDP2: 2 pipeline ranks (gpipe, 1 micro-batches), FSDP2 over 2; "
                                  "pipeline rank p is ranks 2p-2p+1")
    assert _spec(llama4, world_size=8).effective_batch_size == 4     # 8 GPUs / 2 stages = 4 data-parallel pipelines


@pytest.mark.parametrize("fields, message", [
    ({"sharding": "ddp"}, "--pp 2 composes with FSDP2 over each stage's data-parallel GPUs (torchtitan's PP x FSDP), "
     "not with --sharding ddp"),
    ({"pp_schedule": "zbv"}, "--pp-schedule zbv: zero-bubble schedules split each backward into an input and a weight "
     "pass, which memlens does not model"),
    ({"pp_schedule": "1f1b", "batch_size": 1}, "--pp 2 1f1b with 1 micro-batches: torch's Schedule1F1B needs at least "
     "one per stage"),
    ({"batch_size": 3, "pp_microbatches": 2}, "--pp-microbatches 2 must divide the local batch of 3 (--batch-size: each "
     "data-parallel rank's batch, split into micro-batches)"),
    ({"world_size": 3}, "--pp 2 must divide --world-size 3 (pipeline stages x data-parallel GPUs) with an FSDP2 sharding"),
    ({"virtual_stages": 2}, "--pp-schedule gpipe with --virtual-stages 2: the interleaved schedule runs 2 or more stages "
     "per rank, the others one"),
    ({"pp_stage": 2}, "--pp-stage 2 must be a pipeline rank between 0 and 1"),
    ({"world_size": 8, "tp": 2}, "--pp 2 with --tp: pipeline stages are modelled with FSDP2 alone"),
    ({"grad_accum": 2}, "--pp 2 with --grad-accum: the schedule's micro-batches are the accumulation (use "
     "--pp-microbatches) is not modelled"),
])
def test_what_is_not_modelled_is_refused_in_one_line(fields, message):
    with pytest.raises(SpecError) as e:
        _spec(LLAMA, **fields)
    assert e.value.message == message


def test_a_model_without_llamas_modules_and_too_many_stages_are_refused():
    with pytest.raises(SpecError, match=r"^--pp splits a Llama-style causal LM .* and GPT2LMHeadModel has no model.embed_tokens"):
        simulate_rank(_spec("tests/fixtures/models/tiny-gpt2"), 0, steps=1)
    with pytest.raises(SpecError, match=r"^--pp: 8 stages are more than the model's 2 layers"):   # 2 layers + 2 over 8
        simulate_rank(_spec(LLAMA, world_size=8, pp=8), 0, steps=1)
    with pytest.raises(SpecError, match=r"^--pp-schedule is pipeline parallel's"):
        TrainingSpec(model=LLAMA, pp_schedule="gpipe")


# ---------------------------------------------------------------- the schedule's first step: the stages' initialization
INFER, RECV = "(pipeline first-step inference)", "(pipeline P2P receive buffers)"
HIDDEN = 1 * 16 * 64 * 4      # one micro-batch of hidden states: 1 sequence x 16 tokens x H 64, fp32


def _init_window(log) -> tuple[int, int, list, list]:
    """Step 1's stage initialization (its first "forward" mark to the schedule's first forward): (start, end, what it
    allocated, what of that is still live at its end)."""
    a, b = _marks(log, "forward")[:2]
    made = [ev for ev in log.events[a:b] if ev[0] == ALLOC]
    freed = {ev.key for ev in log.events[a:b] if ev[0] == FREE}
    return a, b, made, [ev for ev in made if ev.key not in freed]


def _at(log, module: str) -> list[int]:
    mid = log.modules.index(module)
    return [i for i, ev in enumerate(log.events) if ev[0] == ALLOC and ev.module == mid]


def _gathers(log, a: int, b: int) -> list[tuple[str, int]]:
    """FSDP2's all-gather buffers and gathered parameters between events a and b, charged to their groups' modules (as
    communication, or parameters once a gathered parameter's storage is allocated again)."""
    return [(log.modules[ev.module], ev.nbytes) for ev in log.events[a:b] if ev[0] == ALLOC
            and ev.category in ("communication", "parameters") and log.modules[ev.module] != RECV]


@pytest.mark.parametrize("rank", [0, 2])
def test_torch_2_13_infers_with_a_forward_and_an_input_backward_then_reshards(one_mb, rank):
    from torch.distributed.pipelining import PipelineStage

    if not hasattr(PipelineStage, "_forward_metadata_inference"):
        pytest.skip("the installed torch infers shapes as 2.11 does (the test below)")
    sim = one_mb[rank]
    log = sim.log
    a, b, made, live = _init_window(log)
    # stage 0's input is micro-batch 0's token ids detached (no copy), and its backward inference's output gradient
    # _ones_from_metadata's (aten.ones); stage 1 (last) gets TensorMeta.to_tensor's empty input and a loss instead
    mine = [(ev.nbytes, str(ev.op)) for ev in made if log.modules[ev.module] == INFER]
    assert mine == [(HIDDEN, "aten.ones.default")] if rank == 0 else [(HIDDEN, "aten.empty.memory_format")]
    # a forward under enable_grad: its graph saves activations (the last stage's input among them)
    saved = {ev.key for ev in log.events[a:b] if ev[0] == TAG and ev.category == "activations"}
    assert saved and all(ev.key not in saved for ev in live)
    # all it made is freed before the schedule runs (the graph by autograd.grad or dropped, the logits, the gathered
    # parameters resharded by FSDP2's post-backward or the cleanup) but the micro-batch's receive buffer: stage 0's
    # for the output gradient, stage 1's for its input (and the cuBLAS workspace its first GEMM made, kept as on a GPU)
    assert [(log.modules[ev.module], ev.nbytes) for ev in live if ev.category != "workspace"] == [(RECV, HIDDEN)]
    # so the schedule's first forward gathers the stage's parameters again, as the inference did
    bwd = _marks(log, "backward")[0]
    assert _gathers(log, a, b) == _gathers(log, b, bwd) != []
    # in torch's order: the receive buffer after the inference forward (stage 1: after its logits, before its loss)
    # and, for the gradient buffer, after the backward inference (stage 0: after its ones gradient is freed)
    buf = _at(log, RECV)[0]
    if rank == 2:
        assert next(i for i in _at(log, "stage1.lm_head") if i > a) < buf < next(i for i in range(a, b) if log.events[i][0] == ALLOC
                                                          and "log_softmax" in str(log.events[i].op))
    else:
        ones = next(ev.key for ev in made if log.modules[ev.module] == INFER)
        assert next(i for i in range(a, b) if log.events[i][0] == FREE and log.events[i].key == ones) < buf
    assert sim.wrapper.facts["first_step_inference"] == "forward + input backward of micro-batch 0, then resharded"


def test_torch_2_11_infers_shapes_with_a_no_grad_forward_its_parameters_kept_gathered(llama4, monkeypatch):
    from torch.distributed.pipelining import PipelineStage

    # PPWrapper picks torch's mechanism by the method torch >= 2.13 has: without it, 2.11's _shape_inference
    monkeypatch.delattr(PipelineStage, "_forward_metadata_inference", raising=False)
    sim = simulate_rank(_spec(llama4), 2, steps=1)
    log = sim.log
    a, b, made, live = _init_window(log)
    # the input torch.zeros_like(meta, device=...) of the received metadata; a no_grad forward saves nothing
    assert [(ev.nbytes, str(ev.op)) for ev in made if log.modules[ev.module] == INFER] == [(HIDDEN, "aten.zeros.default")]
    assert not any(ev[0] == TAG and ev.category == "activations" for ev in log.events[a:b])
    # the logits made and freed, then the input, then the receive buffer (_prepare_forward_infra after _shape_inference)
    logits = next(i for i in _at(log, "stage1.lm_head") if i > a)
    frees = {ev.key: i for i, ev in enumerate(log.events[:b]) if ev[0] == FREE}
    zeros = next(ev.key for ev in made if log.modules[ev.module] == INFER)
    assert logits < frees[log.events[logits].key] < frees[zeros] < _at(log, RECV)[0] < b
    # live after it: the receive buffer and the stage's gathered parameters (reshard_after_forward=False keeps them),
    # which the schedule's first forward does not gather again
    # (and the cuBLAS workspace)
    live = [ev for ev in live if ev.category != "workspace"]
    assert [ev.nbytes for ev in live if log.modules[ev.module] == RECV] == [HIDDEN]
    assert sum(ev.nbytes for ev in live if log.modules[ev.module] != RECV) == sum(n * 4 for n in 2 * LAYER + NORM + EMBED)
    assert _gathers(log, b, _marks(log, "backward")[0]) == []
    assert sim.wrapper.facts["first_step_inference"] == "no_grad forward of micro-batch 0"
