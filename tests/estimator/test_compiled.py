"""--compile: the step partitioned by inductor's min-cut partitioner, run on fake tensors."""
import json

import pytest

from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate

TINY_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512, "architectures": ["LlamaForCausalLM"]}


@pytest.fixture(scope="module")
def llama_estimate(tmp_path_factory):
    """The tiny Llama's estimate (bf16, 4 x 256) with the given changes, each made once for the module's tests."""
    p = tmp_path_factory.mktemp("compiled") / "config.json"
    p.write_text(json.dumps(TINY_LLAMA))
    made = {}

    def get(**changes):
        key = tuple(sorted(changes.items()))
        if key not in made:
            made[key] = estimate(TrainingSpec(model=str(p), batch_size=4, seq_len=256, precision="bf16", **changes))
        return made[key]

    return get


def test_compiled_step_keeps_fewer_activations_and_says_what_is_modelled(llama_estimate):
    eager, compiled = llama_estimate(), llama_estimate(compile=True)
    # model states are the same; the partitioner recomputes cheap ops (norms, activations, rotary) instead of keeping them
    assert compiled.by_phase["setup"] == eager.by_phase["setup"]
    assert compiled.by_phase["backward"]["peak_allocated_bytes"] < eager.by_phase["backward"]["peak_allocated_bytes"]
    assert compiled.by_phase["optimizer"]["peak_allocated_bytes"] == eager.by_phase["optimizer"]["peak_allocated_bytes"]
    assert "min-cut partitioner" in compiled.data["compile_model"] and any("--compile" in n for n in compiled.notes)
    assert "compile_model" not in eager.data


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


def test_a_kernel_reads_its_fused_inputs_and_frees_graph_inputs_at_their_last_reader():
    """inductor frees a kernel's inputs after the kernel: a value read by a fused-away op stays alive
    until the kernel that stores the fused chain's result is allocated. A graph input is freed after
    its last reader, not when the graph returns (the boxed call clears its argument list)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from memlens.core.events import ALLOC, FREE
    from memlens.core.ledger import EventLog, analyze
    from memlens.core.tracker import StorageTracker
    from memlens.estimator.compiled import boxed_runner

    def f(x):
        return ((x * 2).sum(1) * 3,)   # mul fused into the sum's kernel; the sum a buffer; the output a buffer

    gm = make_fx(f)(torch.randn(256, 256))
    log = EventLog()
    with FakeTensorMode(), StorageTracker(log):
        args = [torch.empty(256, 256)]
        out = boxed_runner(gm, fuse=True)(args)
    assert args == []
    assert analyze(log).peak_allocated_bytes == 256 * 256 * 4 + 1024   # x alive while the sum's (256,) is allocated
    kinds = [(ev[0], ev[2] if ev[0] == ALLOC else None) for ev in log.events if ev[0] in (ALLOC, FREE)]
    assert kinds[:4] == [(ALLOC, 256 * 256 * 4), (ALLOC, 1024), (FREE, None), (ALLOC, 1024)]   # x freed before the output
    del out


def test_pad_matmuls_pads_unaligned_k_and_n_of_half_matmuls():
    """inductor's pad_mm: GPT-2's vocabulary (50257) is padded to 50264 where it is N (the logits)
    or K (their gradient times the weight), not where it is only M (the weight's gradient)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from memlens.estimator.compiled import pad_matmuls

    def f(h, w, g):
        logits = h @ w                   # (4096, 768) @ (768, 50257): N unaligned
        dh = g @ w.t()                   # (4096, 50257) @ (50257, 768): K unaligned
        dw = g.t() @ h                   # (50257, 4096) @ (4096, 768): only M unaligned
        aligned = h @ h.t()              # (4096, 768) @ (768, 4096)
        return logits, dh, dw, aligned

    bf = torch.bfloat16
    gm = make_fx(f, tracing_mode="fake")(torch.empty(4096, 768, dtype=bf), torch.empty(768, 50257, dtype=bf),
                                         torch.empty(4096, 50257, dtype=bf))
    assert pad_matmuls(gm, "h100") == 2
    pads = sorted(tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.target is torch.ops.aten.constant_pad_nd.default)
    assert pads == [(768, 50264), (4096, 50264), (50264, 768)]
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert sorted(tuple(n.meta["val"].shape) for n in mms) == [(4096, 768), (4096, 4096), (4096, 50264), (50257, 768)]
    outs = [n.meta["val"].shape for n in next(n for n in gm.graph.nodes if n.op == "output").args[0]]
    assert [tuple(s) for s in outs] == [(4096, 50257), (4096, 768), (50257, 768), (4096, 4096)]
    fp32 = make_fx(f, tracing_mode="fake")(torch.empty(4096, 768), torch.empty(768, 50257), torch.empty(4096, 50257))
    assert pad_matmuls(fp32, "h100") == 0   # modelled for half precision only


def test_held_tensors_and_the_compiling_flag():
    """A key/value cache in the outputs is no pytree: its tensors are returned from the graph too;
    while memlens traces, torch.compiler.is_compiling() is True as under dynamo."""
    import torch

    from memlens.estimator.compiled import compiling, held_tensors

    class Layer:
        def __init__(self):
            self.keys, self.values = torch.zeros(2), torch.ones(3)

    class Cache:
        def __init__(self):
            self.layers = [Layer(), Layer()]
            self.name = "cache"

    c = Cache()
    assert [t.numel() for t in held_tensors(c)] == [2, 3, 2, 3]
    assert held_tensors("text") == []
    assert not torch.compiler.is_compiling()
    with compiling():
        assert torch.compiler.is_compiling()
    assert not torch.compiler.is_compiling()


def test_the_loss_graph_break_is_dynamos():
    """Dynamo breaks GPT-2's graph at transformers' loss_function (its warning for an unknown
    loss_type is a logging call) and not Llama's: loss_graph_break says the same (tiny models,
    real dynamo on the CPU)."""
    import torch
    import transformers

    from memlens.estimator.compiled import loss_graph_break

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, vocab_size=64))
    ids = torch.randint(0, 64, (2, 16))
    for model, breaks in ((gpt2, True), (llama, False)):
        torch._dynamo.reset()
        ex = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
        assert (ex.graph_count, ex.graph_break_count) == ((2, 1) if breaks else (1, 0))
        assert (loss_graph_break(model) is not None) == breaks
        if breaks:
            assert loss_graph_break(model)[0] is model
    torch._dynamo.reset()


def test_a_reused_value_is_stored_once_its_inlined_expression_reads_too_many_buffers():
    """inductor inlines a pointwise value into every kernel that reads it, until the inlined
    expression of a value read more than once reads more than 4 buffers (mark_reuse): a residual
    stream is stored every few layers."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from memlens.estimator.compiled import materialized

    def f(a, b, c, d, e, g):
        s1 = a + b               # reads a, b
        s2 = s1 + c              # a, b, c
        s3 = s2 + d              # a, b, c, d
        s4 = s3 + e              # a..e: 5 buffers, 2 readers -> stored
        s5 = s4 + g              # s4, g
        return s1.sum() + s2.sum() + s3.sum() + s4.sum() + s5.sum()

    g = make_fx(f)(*[torch.randn(8) for _ in range(6)]).graph
    adds = [m for n, m in materialized(g).items() if n.target is torch.ops.aten.add.Tensor and n.meta["val"].shape == (8,)]
    assert adds == [False, False, False, True, False]


def test_a_stored_copy_is_written_by_the_kernel_of_its_source():
    """inductor fuses a stored pointwise node into the kernel of the pointwise producer it reads
    (a second output): a half-precision copy kept for backward is written beside its source, not
    where the partitioner put it, at the end of the graph."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from memlens.estimator.compiled import kernel_order, materialized

    def f(x, w):
        c = x * 2                # a buffer (the mm reads it)
        m = c @ w
        z = m.relu()
        return z, c.to(torch.bfloat16)   # the copy, traced last

    g = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4)).graph
    fused = {n for n, kept in materialized(g).items() if not kept}
    order = [n.name for n in kernel_order(list(g.nodes), fused) if n.op == "call_function"]
    assert order.index("_to_copy") == order.index("mul") + 1


def test_the_backward_is_traced_under_the_forwards_autocast():
    """AOTAutograd traces the backward under the forward's autocast (backward_pass_autocast
    "same_as_forward"): an fp32 region's backward matmul is cast to bf16 in the compile trace, and
    stays fp32 in the eager simulation."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from memlens.estimator import cuda_rules

    def f(a, b):
        with torch._C._DisableAutocast():      # an fp32 region (SDPA's math path)
            out = a @ b
        return torch.autograd.grad(out.sum(), (a,))

    def mm_dtypes(traced: bool):
        rules = cuda_rules.CudaRules(autocast_dtype=torch.bfloat16)
        rules.compile_trace = traced
        emulation = cuda_rules.CudaEmulation(rules)
        a, b = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8)
        with emulation, torch.autocast("cpu", dtype=torch.bfloat16):
            g = make_fx(f)(a, b).graph
        return [n.meta["val"].dtype for n in g.nodes if n.target is torch.ops.aten.mm.default]

    assert mm_dtypes(True) == [torch.float32, torch.bfloat16]
    assert mm_dtypes(False) == [torch.float32, torch.float32]


def test_checkpointed_regions_are_recomputed_in_the_compiled_backward(llama_estimate):
    """Under torch.compile a checkpointed layer is dynamo's tag_activation_checkpoint: its ops are
    tagged "prefer recompute" and the partitioner keeps only the layer inputs (measured on an H100:
    Qwen2.5-0.5B with checkpointing -0.03%; traced as a plain graph it was +59%)."""
    fwd = lambda **k: llama_estimate(**k).by_phase["forward"]["peak_allocated_bytes"]  # noqa: E731
    saved_eager = fwd() - fwd(grad_checkpointing=True)
    saved_compiled = fwd(compile=True) - fwd(compile=True, grad_checkpointing=True)
    assert saved_eager > 0 and saved_compiled > 0.5 * saved_eager   # traced as a plain graph it saved nothing


def test_a_wrapped_model_breaks_in_the_transformers_model_it_wraps():
    import peft
    import transformers

    from memlens.estimator.compiled import loss_graph_break

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    wrapped = peft.get_peft_model(gpt2, peft.LoraConfig(r=4, target_modules=["c_attn"]))
    owner, fn = loss_graph_break(wrapped)
    assert owner is gpt2 and callable(fn)


def test_a_cnn_with_max_pooling_compiles():
    """inductor's max-pool decomposition consults its lowering module, which compile_fx always has
    loaded: the trace loads it too (torchvision's ResNet-50 compiled: -0.07% on an H100)."""
    r = estimate(TrainingSpec(model="tests.tiny_models:pooled_cnn", batch_size=8, precision="amp-bf16", compile=True))
    # fp32 weights, each block rounded up to 512 bytes by the allocator: conv 1728 -> 2048, its bias 64 -> 512,
    # the classifier 163840, its bias 40 -> 512
    assert r.by_category["parameters"] == 2048 + 512 + 16 * 16 * 16 * 10 * 4 + 512
    assert r.peak_allocated_bytes > 2 * r.by_category["parameters"] and "compile_model" in r.data


def test_an_output_returned_twice_keeps_the_output_structure():
    """The compiled module rebuilds the model's output from the graph's outputs in order: a tensor
    the model returns under two keys is two outputs, not one (the third key keeps its own tensor)."""
    r = estimate(TrainingSpec(model="tests.tiny_models:twice_out", batch_size=8, compile=True))
    assert r.by_category["parameters"] == 64 * 64 * 4 + 512   # the weight, and the bias' 256 bytes in a 512-byte block
    assert r.peak_allocated_bytes > r.by_category["parameters"]
