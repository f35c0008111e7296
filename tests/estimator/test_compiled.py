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
