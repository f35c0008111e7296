"""The simulated step, checked byte by byte on models small enough to count by hand."""
import pytest
import torch

from memlens.estimator import estimate
from memlens.core.gpus import gpu_facts

CUBLAS_WORKSPACE_BYTES = gpu_facts("h100").cublas_workspace_bytes
from memlens.core.spec import TrainingSpec

MiB = 1024 * 1024
W = 1024 * 1024 * 4          # the 1024x1024 fp32 weight
X = 16 * 1024 * 4            # the 16x1024 fp32 input batch
LOSS = 512                   # the detached loss the step returns: one 512-byte block


def test_linear_sgd_exact_bytes():
    r = estimate(TrainingSpec(model="tests.tiny_models:linear", optimizer="sgd"))
    cat = r.by_category
    assert cat["parameters"] == W
    assert cat["inputs"] == X
    assert cat["workspace"] == 2 * CUBLAS_WORKSPACE_BYTES
    assert cat["optimizer_state"] == 0
    # the peak is reached in backward when the weight gradient appears
    assert cat["gradients"] == W
    assert r.peak_allocated_bytes == sum(cat.values())
    # at the end of each step only the model, the batch and the workspaces remain
    for s in r.data["steps"]:
        assert s["end_allocated_bytes"] == W + X + 2 * CUBLAS_WORKSPACE_BYTES + LOSS


def test_linear_adamw_state_and_foreach_temporary():
    r = estimate(TrainingSpec(model="tests.tiny_models:linear", optimizer="adamw"))
    steps = r.data["steps"]
    base = W + X + 2 * CUBLAS_WORKSPACE_BYTES
    # AdamW keeps exp_avg and exp_avg_sq (2 x W); `step` and the 1.0 constant foreach AdamW adds
    # to it live on the CPU (host memory on CUDA too): not counted.
    assert steps[0]["end_allocated_bytes"] == base + 2 * W + LOSS
    # the optimizer phase holds weight, grad, two states and foreach's sqrt list (one W)
    assert r.by_phase["optimizer"]["peak_allocated_bytes"] == base + 4 * W + LOSS
    assert r.peak_allocated_bytes == base + 4 * W + LOSS
    assert r.by_category["optimizer_state"] == 2 * W
    assert r.by_category["temporaries"] == W + LOSS


def _live_at_backward_peak(log) -> list:
    from memlens.core.events import ALLOC, FREE

    live: dict = {}
    peak = max((i for i, ev in enumerate(log.events) if ev[0] == ALLOC and ev[5] == "backward"),
               key=lambda i: analyze_upto(log, i))
    for ev in log.events[:peak + 1]:
        if ev[0] == ALLOC:
            live[ev[1]] = ev[2]
        elif ev[0] == FREE:
            live.pop(ev[1], None)
    return sorted(v for v in live.values() if v == W)


def test_tied_weight_gradients_are_summed_in_place_only_into_the_first(monkeypatch):
    """A tied weight gets two gradients (the head's, then the embedding's); autograd's InputBuffer sums them in place
    into the first (``old_var``) when the buffer holds its last reference (input_buffer.cpp accumulate), never into the
    second, else into a new tensor. Here the head's gradient is TBackward's transposed view (its base alive: not
    stealable), so the sum is a third block of W, as the GPU made for GPT-2 medium fp32 on one H200 and under DDP /
    ZeRO-1 (bench/results/zero1_probe.md); a gradient the buffer owns is summed into, as TRL's fused head's was."""
    import torch

    from memlens.core.events import ALLOC
    from memlens.estimator import simulate as sim_mod

    sim = sim_mod.simulate(TrainingSpec(model="tests.tiny_models:tied", optimizer="sgd"))
    assert _live_at_backward_peak(sim.log) == [W, W, W, W]      # the weight, both gradients and their sum
    adds = [ev for ev in sim.log.events if ev[0] == ALLOC and ev[2] == W and "aten.add.Tensor" in str(ev[6])]
    assert len(adds) == 2                                       # one sum a step (2 steps simulated)
    # the rule: into old_var when the buffer owns it (a fresh gradient), else a new tensor (None), never into var

    class Next:
        variable = torch.empty(8, 8)

    node = type("Node", (), {"name": lambda self: "EmbeddingBackward0", "_sequence_nr": lambda self: 0,
                             "next_functions": ((Next(), 0),)})()
    monkeypatch.setattr(torch._C, "_current_autograd_node", lambda: node)
    monkeypatch.setattr(torch, "is_grad_enabled", lambda: False)
    fresh, view, var = torch.empty(8, 8), torch.empty(8, 8).t(), torch.empty(8, 8)
    assert sim_mod._stealable(fresh) and not sim_mod._stealable(view) and sim_mod._stealable(var)
    tracker = sim_mod.SimulationTracker.__new__(sim_mod.SimulationTracker)
    tracker.key_of = id
    tracker._made_by = {id(var): ("EmbeddingBackward0", 0), id(fresh): ("MmBackward0", 3), id(view): ("TBackward0", 4)}
    assert tracker._buffer_sum_into((fresh, var), None) is fresh
    assert tracker._buffer_sum_into((view, var), None) is None


def analyze_upto(log, index: int) -> int:
    """The allocated bytes (allocator blocks) live after event ``index``."""
    from memlens.core.events import ALLOC, FREE
    from memlens.core.ledger import round_size

    live, total = {}, 0
    for ev in log.events[:index + 1]:
        if ev[0] == ALLOC:
            live[ev[1]] = round_size(ev[2]) if ev[2] else 0
            total += live[ev[1]]
        elif ev[0] == FREE and ev[1] in live:
            total -= live.pop(ev[1])
    return total


def test_sgd_momentum_buffer():
    r = estimate(TrainingSpec(model="tests.tiny_models:linear", optimizer="sgd-momentum"))
    assert r.data["steps"][-1]["end_allocated_bytes"] == W + X + 2 * CUBLAS_WORKSPACE_BYTES + W + LOSS


def test_gpt2_tiny_result_shape():
    r = estimate(TrainingSpec(model="gpt2", batch_size=1, seq_len=32))
    d = r.to_dict()
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "by_category", "by_phase", "by_module", "timeline", "spec", "schema_version"):
        assert key in d
    assert d["peak_reserved_bytes"] >= d["peak_allocated_bytes"]
    assert set(d["by_phase"]) >= {"forward", "backward", "optimizer"}
    # 124,439,808 parameters in fp32 (tied embeddings counted once), counted in allocator blocks
    assert d["param_count"] == 124_439_808
    assert d["by_category"]["parameters"] >= 124_439_808 * 4
    assert d["by_category"]["parameters"] < 124_439_808 * 4 * 1.01  # block rounding, unsplit remainders
    assert d["attention_backends"] == ["efficient"]  # fp32 SDPA on Hopper
    mods = [m["module"] for m in d["by_module"]]
    assert any(m.startswith("transformer.h.") for m in mods)


def test_precision_and_checkpointing_change_the_peak():
    base = estimate(TrainingSpec(model="gpt2", batch_size=4, seq_len=256)).peak_allocated_bytes
    ckpt = estimate(TrainingSpec(model="gpt2", batch_size=4, seq_len=256, grad_checkpointing=True)).peak_allocated_bytes
    amp = estimate(TrainingSpec(model="gpt2", batch_size=4, seq_len=256, precision="amp-bf16"))
    assert ckpt < base
    assert amp.data["attention_backends"] == ["cudnn"]


def test_lora_trains_only_adapters():
    r = estimate(TrainingSpec(model="gpt2", batch_size=1, seq_len=32, lora_rank=8))
    # gpt2 c_attn is 768 -> 2304: A (8x768) + B (2304x8) per layer, 12 layers
    assert r.data["trainable_param_count"] == 12 * (8 * 768 + 2304 * 8)
    assert r.by_category["optimizer_state"] < 1 * MiB * 12


def test_freeze_pattern_must_match():
    from memlens.core.errors import SpecError

    with pytest.raises(SpecError, match="matches no parameter"):
        estimate(TrainingSpec(model="gpt2", batch_size=1, seq_len=16, freeze=("vision_tower",)))


def test_formula_model_states_match_simulation():
    spec = TrainingSpec(model="gpt2", batch_size=2, seq_len=128, optimizer="adamw")
    f = estimate(spec, method="formula")
    terms = {t["name"]: t["bytes"] for t in f.data["terms"]}
    assert f.data["facts"]["trainable_param_count"] == 124_439_808
    assert terms["gradients"] == 124_439_808 * 4
    assert terms["optimizer_state"] == 2 * 124_439_808 * 4
    sim = estimate(spec)
    assert abs(f.peak_allocated_bytes - sim.peak_allocated_bytes) / sim.peak_allocated_bytes < 0.3


def test_adafactor_keeps_factored_state():
    r = estimate(TrainingSpec(model="tests.tiny_models:linear", optimizer="adafactor"))
    # one row and one column second-moment vector for the 1024x1024 weight: 2 x 1024 fp32, in 512 B blocks
    state = r.data["steps"][-1]["end_allocated_bytes"] - (W + X + 2 * CUBLAS_WORKSPACE_BYTES + LOSS)
    assert 0 < state <= 2 * 1024 * 4 + 4 * 512


class Looping(torch.nn.Module):
    """A forward that runs a Python loop of small ops (like transformers' token-by-token Mamba fallback)."""

    def __init__(self, steps: int):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.steps = steps

    def forward(self, x):
        h = self.fc(x)
        for _ in range(self.steps):
            h = h * 0.5
        return h


def looping_1200(spec=None):
    return torch.nn.Sequential(Looping(1200)), torch.randn(4, 8), lambda out, batch: out.sum()


def looping_200(spec=None):
    return torch.nn.Sequential(Looping(200)), torch.randn(4, 8), lambda out, batch: out.sum()


class ReadsIds(torch.nn.Module):
    """A forward that reads a long index tensor back to Python (Qwen2.5-VL's get_rope_index: ``input_ids.tolist()``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, ids):
        offset = sum(ids.tolist()[:2])       # one copy to the host on CUDA; one item() per element on a fake tensor
        return self.fc(x) * (offset + 1)


def reads_ids(spec=None):
    from memlens.models.vlm import known_tensor

    ids = known_tensor(list(range(3000)), {"device": "meta"})      # values the simulation keeps (as a VLM batch's ids)
    return ReadsIds(), (torch.randn(4, 8), ids), lambda out, batch: out.sum()


def test_a_tensor_read_back_to_python_is_not_a_loop_of_ops_and_one_host_sync():
    # 3,000 item() calls on the fake tensor: not counted against the 1,000-op guard, and priced as one sync
    r = estimate(TrainingSpec(model="tests.estimator.test_simulate:reads_ids", optimizer="sgd"))
    assert r.peak_allocated_bytes > 0
    from memlens.estimator.simulate import simulate
    from memlens.estimator.timing.ops_kinds import SYNC
    sim = simulate(TrainingSpec(model="tests.estimator.test_simulate:reads_ids", optimizer="sgd"))
    assert [f.kind for _, _, f in sim.timing.rows].count(SYNC) == 1


def test_a_python_loop_of_ops_in_one_module_is_refused_in_one_line():
    from memlens.core.errors import MemlensError

    with pytest.raises(MemlensError) as e:
        estimate(TrainingSpec(model="tests.estimator.test_simulate:looping_1200", optimizer="sgd"))
    assert e.value.message.startswith("0 (Looping) runs more than 1000 ops of its own in one forward pass: a Python loop")
    assert e.value.hint == "use --method formula, or simulate a short --seq-len (the cost grows with it)"
    # 200 ops is a long module, not a loop over tokens: simulated (its 200 outputs die one by one)
    r = estimate(TrainingSpec(model="tests.estimator.test_simulate:looping_200", optimizer="sgd"))
    assert r.peak_allocated_bytes > 0


@pytest.mark.parametrize("changes", [{"optimizer": "adamw"}, {"optimizer": "sgd-momentum", "precision": "amp-fp16", "max_grad_norm": 1.0},
                                     {"optimizer": "adamw", "lora_rank": 4, "grad_accum": 2}],
                         ids=["adamw", "sgd-momentum-amp-fp16-clip", "adamw-lora-accum2"])
def test_in_place_foreach_ops_answered_without_running_them(monkeypatch, changes):
    """An optimizer's in-place foreach ops (exp_avg.lerp_, addcdiv_ into the parameters...) are
    answered without running them on fake tensors: the log is the one running them gives."""
    from pathlib import Path

    import memlens.estimator.simulate as sim_mod
    from tests.estimator.test_periodic import canonical

    spec = TrainingSpec(model=str(Path(__file__).parent.parent / "fixtures" / "models" / "tiny-gpt2" / "config.json"),
                        batch_size=2, seq_len=32, **changes)
    answered = []
    real = sim_mod._inplace_foreach
    monkeypatch.setattr(sim_mod, "_inplace_foreach", lambda f: real(f) and not answered.append(f))
    fast = sim_mod.simulate(spec)
    assert answered                                # the path was taken
    monkeypatch.setattr(sim_mod, "_inplace_foreach", lambda f: False)
    assert canonical(fast.log) == canonical(sim_mod.simulate(spec).log)


def test_in_place_foreach_ops_that_need_checking_are_run():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlens.estimator.simulate import _inplace_foreach, _same_shapes

    a = torch.ops.aten
    assert _inplace_foreach(a._foreach_addcdiv_.Scalar) and _inplace_foreach(a._foreach_mul_.Tensor)
    assert not _inplace_foreach(a._foreach_sqrt.default)     # allocates its outputs
    assert not _inplace_foreach(a.add_.Tensor)
    with FakeTensorMode():
        x, y, s = [torch.empty(4, 3)], [torch.empty(4, 3)], torch.empty(())
        assert _same_shapes((x, y, 0.5), {})
        assert _same_shapes((x, s), {})                          # a scalar tensor
        assert not _same_shapes((x, [torch.empty(3)]), {})       # a broadcast
        assert not _same_shapes((x, torch.empty(3)), {})         # a non-scalar single tensor
        assert not _same_shapes((x, y + y), {"alpha": 2})        # a keyword argument
        assert not _same_shapes((x, [torch.empty(4, 3)] * 2), {})  # lists of different lengths
    assert not _same_shapes(([torch.empty(4, 3)], [torch.empty(4, 3)]), {})   # not fake tensors


def test_device_reads_on_the_short_path_give_what_the_full_handler_does(monkeypatch):
    """``prim::device`` (the autograd engine reads the device of every gradient: half the ops the tracker sees)
    takes a short path in the tracker's handler: the log, the recompute counts and the priced ops are the ones the
    full handler gives."""
    from pathlib import Path

    import memlens.estimator.simulate as sim_mod
    from tests.estimator.test_periodic import canonical

    spec = TrainingSpec(model=str(Path(__file__).parent.parent / "fixtures" / "models" / "tiny-gpt2" / "config.json"),
                        batch_size=2, seq_len=32, grad_checkpointing=True, lora_rank=4, precision="amp-bf16")
    seen = []
    real = sim_mod.SimulationTracker._device_read
    monkeypatch.setattr(sim_mod.SimulationTracker, "_device_read", lambda self, *a: seen.append(1) or real(self, *a))
    short = sim_mod.simulate(spec)
    assert len(seen) > 100                         # the path was taken
    monkeypatch.setattr(sim_mod, "_DEVICE", object())   # no op matches: every op takes the full handler
    full = sim_mod.simulate(spec)
    assert canonical(short.log) == canonical(full.log)
    assert short.costs == full.costs
    assert short.costs["recompute_ops"] > 0        # device reads of a recomputation count as its ops
    assert short.timing.rows == full.timing.rows
