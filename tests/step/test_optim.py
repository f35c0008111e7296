"""Each optimizer implementation's memory, in bytes, on a model small enough to count by hand.

The model is one bias-free 1024 x 1024 fp32 linear layer (W = 4 MiB) on a 16 x 1024 batch
(tests/tiny_models.py:linear). Before the optimizer step the GPU holds the weight, the batch, the
two cuBLAS workspaces (forward and the autograd thread), the detached loss (one 512-byte block)
and the weight's gradient (W).
"""
import pytest
import torch

from memlens.core.errors import SpecError
from memlens.core.gpus import gpu_facts
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate

W = 1024 * 1024 * 4
X = 16 * 1024 * 4
WS = 2 * gpu_facts("h100").cublas_workspace_bytes
LOSS = 512
BASE = W + X + WS + LOSS      # what every step ends with besides optimizer state
BLOCK = 512                   # a 0-dim tensor's allocator block


def run(optimizer, **kw):
    return estimate(TrainingSpec(model="tests.tiny_models:linear", optimizer=optimizer, **kw))


def test_adamw_foreach_one_parameter_sized_temporary():
    r = run("adamw")
    # exp_avg + exp_avg_sq; the step counter and foreach's 1.0 constant live on the CPU
    assert r.data["steps"][-1]["end_allocated_bytes"] == BASE + 2 * W
    # grad + 2 states + _foreach_sqrt(exp_avg_sqs) (torch/optim/adam.py _multi_tensor_adam)
    assert r.peak_allocated_bytes == BASE + W + 2 * W + W
    assert r.data["peak_phase"] == "optimizer"


@pytest.mark.parametrize("name", ["adamw-fused", "adam-fused"])
def test_fused_adam_step_counter_on_the_gpu_and_no_temporary(name):
    r = run(name)
    # the fused step keeps `step` as a float32 tensor on the device: one 512-byte block per parameter tensor
    assert r.data["steps"][-1]["end_allocated_bytes"] == BASE + 2 * W + BLOCK
    assert r.by_phase["optimizer"]["peak_allocated_bytes"] == BASE + W + 2 * W + BLOCK
    # the step's peak is in step 2's backward as the gradient appears: states, step counter and the
    # loss's seed gradient (one block) besides the gradient; the fused update adds nothing
    assert r.peak_allocated_bytes == BASE + 3 * W + 2 * BLOCK
    assert r.data["peak_phase"] == "backward"


def test_adam_foreach_like_adamw_without_weight_decay():
    assert run("adam").peak_allocated_bytes == BASE + 4 * W


def test_sgd_no_state_sgd_momentum_one_buffer():
    assert run("sgd").data["steps"][-1]["end_allocated_bytes"] == BASE
    r = run("sgd-momentum")
    assert r.data["steps"][-1]["end_allocated_bytes"] == BASE + W
    assert r.by_category["optimizer_state"] == W


def test_torch_adafactor_factored_state():
    r = run("adafactor")
    # a row and a column factor of 1024 fp32 each (4 KiB), step on the CPU
    assert r.data["steps"][-1]["end_allocated_bytes"] == BASE + 2 * 4096
    # grad + the single-tensor path's one parameter-sized transient, var_estimate (row x col outer
    # product, updated in place into the update; torch/optim/_adafactor.py: foreach=None is not
    # foreach, on CUDA either), + row/column-sized scratch
    assert BASE + 2 * W <= r.peak_allocated_bytes < BASE + 2 * W + 64 * 1024


def test_transformers_adafactor_fp32_update_temporaries():
    r = run("adafactor-hf")
    # exp_avg_sq_row, exp_avg_sq_col (4 KiB each) and the RMS scalar (one block)
    assert r.data["steps"][-1]["end_allocated_bytes"] == BASE + 2 * 4096 + BLOCK
    # grad + `grad**2 + eps` and the update (two parameter-sized fp32 tensors: optimization.py Adafactor.step); but
    # first `update.mean(dim=-2)`, a column reduction of 1024 x 1024 fp32 with 1024 outputs, which CUDA splits over 16
    # blocks per output column and stages in global memory (Reduce.cuh): 4 B x 1024 outputs x 16 x (32 lanes x 4-wide
    # vectors) = 8 MiB beside grad and `grad**2 + eps`: the peak
    staging = 4 * 1024 * 16 * 32 * 4
    assert staging == 8 * 2**20 > W
    assert BASE + 2 * W + staging <= r.peak_allocated_bytes < BASE + 2 * W + staging + 64 * 1024


def test_bitsandbytes_8bit_states_and_paged_states_outside_the_allocator():
    blocks = 1024 * 1024 // 256
    r = run("adamw-8bit")
    # state1/state2 uint8 (1 byte per element), absmax1/absmax2 fp32 per 256-element block, two 256-entry qmaps
    state = 2 * (W // 4) + 2 * blocks * 4 + 2 * 1024
    assert r.by_category["optimizer_state"] == state
    assert r.data["steps"][-1]["end_allocated_bytes"] == BASE + state
    p = run("paged-adamw-8bit")
    # 1M elements >= 1e5: the uint8 states are in CUDA managed memory (bitsandbytes get_paged)
    assert p.by_category["optimizer_state"] == 2 * blocks * 4 + 2 * 1024
    assert any("managed memory" in n for n in p.notes)


def test_clip_grad_norm_adds_only_small_blocks():
    plain, clipped = run("adamw-fused"), run("adamw-fused", max_grad_norm=1.0)
    # clip_grad_norm_: the foreach_norm partial sums (16 chunks x 4 B) and 0-dim norms, coefficients: 512-byte blocks
    extra = clipped.by_phase["optimizer"]["peak_allocated_bytes"] - plain.by_phase["optimizer"]["peak_allocated_bytes"]
    assert 0 < extra <= 4 * BLOCK
    assert clipped.data["steps"][-1]["end_allocated_bytes"] == plain.data["steps"][-1]["end_allocated_bytes"]


def test_trainer_groups_run_one_foreach_step_per_group():
    from memlens.step.optim import param_groups
    from tests.tiny_models import linear_norm

    model = linear_norm()[0]
    g = param_groups(TrainingSpec(model="x", hf_trainer=True), model)
    assert [len(x["params"]) for x in g] == [1, 3]          # weight | bias, norm weight, norm bias
    assert g[0]["params"][0] is model[0].weight
    one = estimate(TrainingSpec(model="tests.tiny_models:linear_norm"))
    two = estimate(TrainingSpec(model="tests.tiny_models:linear_norm", hf_trainer=True))
    # one group: the sqrt list holds W + bias + 2 norm vectors at once; two groups: at most W
    assert one.peak_allocated_bytes - two.peak_allocated_bytes == 3 * 4096


def test_foreach_norm_scratch_as_cuda_allocates_it():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlens.core.events import EventLog
    from memlens.core.tracker import StorageTracker
    from memlens.estimator.cuda_rules import CudaEmulation, CudaRules

    fm, log = FakeTensorMode(), EventLog()
    with fm:
        ts = [torch.empty(3 * 65536) for _ in range(100)]     # 3 chunks of 65536 each
    with fm, CudaEmulation(CudaRules()), StorageTracker(log):
        norms = torch._foreach_norm(ts, 2)
    sizes = [e.nbytes for e in log.events if getattr(e, "nbytes", None)]
    assert sizes[0] == 100 * 3 * 4        # zeroed partial sums: ntensors x max_chunks fp32, first
    assert len(norms) == 100


def test_trainer_optim_names_are_aliases():
    assert TrainingSpec(model="gpt2", optimizer="adamw_torch_fused").optimizer == "adamw-fused"
    assert TrainingSpec(model="gpt2", optimizer="adamw_torch").optimizer == "adamw"
    assert TrainingSpec(model="gpt2", optimizer="paged_adamw_8bit").optimizer == "paged-adamw-8bit"
    assert TrainingSpec(model="gpt2", optimizer="adafactor").optimizer == "adafactor"   # memlens' own name first
    with pytest.raises(SpecError, match="lion_8bit.*not one memlens models"):
        TrainingSpec(model="gpt2", optimizer="lion_8bit")
    with pytest.raises(SpecError, match="max-grad-norm"):
        TrainingSpec(model="gpt2", max_grad_norm=-1)
    assert TrainingSpec(model="gpt2", max_grad_norm=0).max_grad_norm is None
