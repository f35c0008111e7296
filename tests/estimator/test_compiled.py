"""--compile: the step partitioned by inductor's min-cut partitioner, run on fake tensors."""
import json

from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate

TINY_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512, "architectures": ["LlamaForCausalLM"]}


def test_compiled_step_keeps_fewer_activations_and_says_it_is_a_bound(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(TINY_LLAMA))
    kw = dict(model=str(p), batch_size=4, seq_len=256, precision="bf16")
    eager, compiled = estimate(TrainingSpec(**kw)), estimate(TrainingSpec(compile=True, **kw))
    # model states are the same; the partitioner recomputes cheap ops (norms, activations, rotary) instead of keeping them
    assert compiled.by_phase["setup"] == eager.by_phase["setup"]
    assert compiled.by_phase["backward"]["peak_allocated_bytes"] < eager.by_phase["backward"]["peak_allocated_bytes"]
    assert compiled.by_phase["optimizer"]["peak_allocated_bytes"] == eager.by_phase["optimizer"]["peak_allocated_bytes"]
    assert "min-cut partitioner" in compiled.data["bound"] and any("--compile" in n for n in compiled.notes)
    assert "bound" not in eager.data


def test_inductor_fusion_rule():
    """A pointwise op read only by pointwise ops or reductions is fused away; one read by a matmul
    or returned by the graph is a buffer."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from memlens.estimator.compiled import materialized

    def f(x, w):
        a = x * 2            # read by b (pointwise): fused
        b = a.exp()          # read by mm: a buffer
        c = b @ w
        d = (c + 1).sum(1)   # c + 1 read by a reduction: fused; the sum is a buffer
        e = d.relu()         # a graph output: a buffer
        return e

    g = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4)).graph
    kept = {str(n.target).split(".")[1]: m for n, m in materialized(g).items() if "aten" in str(n.target)}
    assert kept == {"mul": False, "exp": True, "mm": True, "add": False, "sum": True, "relu": True}


def test_cross_entropy_never_stores_its_log_probs_or_one_hot():
    """inductor lowers gather to an indexing load and a scatter into a constant to a pointwise
    where (scatter_upon_const_tensor): cross-entropy keeps only the reductions as buffers."""
    import torch
    import torch.nn.functional as F
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from memlens.estimator.compiled import materialized

    def f(logits, target):
        return F.cross_entropy(logits.float(), target)

    g = make_fx(f, decomposition_table=select_decomp_table())(torch.randn(8, 50), torch.randint(0, 50, (8,))).graph
    big = [str(n.target) for n, m in materialized(g).items()
           if m and not n.target.is_view and tuple(n.meta["val"].shape) == (8, 50)]
    assert big == []   # no (8, 50) buffer: upcast, log-softmax and the gather fused

    def bwd(logits, target, grad):
        t = torch.full((8, 50), 0.0).scatter(1, target[:, None], -1.0)   # nll_loss_backward's one-hot
        return (t * grad).exp()

    g = make_fx(bwd)(torch.randn(8, 50), torch.randint(0, 50, (8,)), torch.randn(8, 50)).graph
    kept = {str(n.target).split(".")[1]: m for n, m in materialized(g).items() if "aten" in str(n.target)}
    assert kept["full"] is False and kept["scatter"] is False and kept["exp"] is True


def test_a_view_of_a_fused_value_takes_no_memory():
    """A value inductor fuses away is never stored, and neither is a view of it: the boxed runner
    accounts neither (a view's storage is new to the tracker when its base was not accounted)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from memlens.core.ledger import EventLog, analyze
    from memlens.core.tracker import StorageTracker
    from memlens.estimator.compiled import boxed_runner

    def f(x):
        return ((x * 2).view(-1).sum(),)   # mul fused into the sum through a view

    gm = make_fx(f)(torch.randn(256, 256))
    log = EventLog()
    with FakeTensorMode() as fake:
        x = torch.empty(256, 256)
    with fake, StorageTracker(log):
        out = boxed_runner(gm, fuse=True)([x])
    a = analyze(log)
    assert a.peak_allocated_bytes == 512   # only the 0-dim sum (one 512-byte block)
    del out


def test_compiled_graph_is_not_refused_as_a_python_loop(tmp_path):
    """The eager simulation refuses a module running over 1000 ops of its own (a Python loop); a
    compiled forward is one graph of thousands of ops by design and runs."""
    import pytest

    from memlens.core.errors import MemlensError

    kw = dict(model="tests.tiny_models:many_ops", batch_size=4)
    with pytest.raises(MemlensError, match="runs more than 1000 ops"):
        estimate(TrainingSpec(**kw))
    r = estimate(TrainingSpec(compile=True, **kw))
    assert r.peak_allocated_bytes > 0


def test_an_index_put_into_fresh_zeros_writes_in_place():
    """inductor reinplaces a functional index_put whose self nothing else reads (an embedding's
    weight gradient): one weight-sized buffer, not two."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from memlens.core.ledger import EventLog, analyze
    from memlens.core.tracker import StorageTracker
    from memlens.estimator.compiled import boxed_runner

    def f(idx, vals):
        return (torch.full((512, 64), 0.0).index_put((idx,), vals, accumulate=True),)

    gm = make_fx(f)(torch.randint(0, 512, (32,)), torch.randn(32, 64))
    log = EventLog()
    with FakeTensorMode() as fake:
        idx, vals = torch.randint(0, 512, (32,)), torch.empty(32, 64)
    with fake, StorageTracker(log):
        out = boxed_runner(gm, fuse=True)([idx, vals])
    assert analyze(log).peak_allocated_bytes == 512 * 64 * 4
    del out
