"""The CPU -> CUDA mapping rules, on fake tensors."""
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from memlens.estimator import cuda_rules as cr


def test_backend_choice_matches_hopper_measurements():
    fake = FakeTensorMode()
    with fake:
        qh = torch.empty(2, 12, 1024, 64, dtype=torch.bfloat16)
        kg = torch.empty(2, 4, 1024, 64, dtype=torch.float32)
        q32 = torch.empty(2, 12, 1024, 64)
    assert cr.sdpa_backend(qh, qh, None, 0.0, False) == "cudnn"
    assert cr.sdpa_backend(qh, qh, torch.empty(0), 0.1, False) == "cudnn"
    assert cr.sdpa_backend(q32, q32, None, 0.1, False) == "efficient"
    assert cr.sdpa_backend(q32, kg, None, 0.0, True) == "math"


def test_cudnn_attention_keeps_output_and_stats_only():
    from memlens.core.tracker import StorageTracker
    from memlens.core.ledger import EventLog, analyze

    fake = FakeTensorMode()
    log = EventLog()
    tr = StorageTracker(log)
    rules = cr.CudaRules()
    with fake:
        q = torch.empty(2, 1024, 12, 64, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    with fake, cr.CudaEmulation(rules), tr:
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1)
    a = analyze(log)
    out_bytes = 2 * 1024 * 12 * 64 * 2
    stats = 2 * 12 * 1024 * 4
    # measured on an H100: output + stats (B,H,L) fp32 + two 512-byte RNG blocks
    assert a.end_allocated_bytes == out_bytes + stats + 2 * 512
    assert rules.attention_calls[0].backend == "cudnn"
    del out


def test_autocast_policy_and_weight_cache():
    fake = FakeTensorMode()
    rules = cr.CudaRules(autocast_dtype=torch.float16)
    emu = cr.CudaEmulation(rules)
    with fake:
        lin = torch.nn.Linear(8, 8)
        x = torch.empty(4, 8)
    with fake, emu, cr.cuda_autocast(emu, torch.float16):
        y = lin(x)
        y2 = lin(x)
        assert y.dtype == torch.float16
        assert len(emu._cache) == 2  # weight and bias cast once, reused
        s = torch.softmax(y, dim=-1)
        assert s.dtype == torch.float32  # fp32_set_opt_dtype
        ln = F.layer_norm(y2, (8,))
        assert ln.dtype == torch.float32  # fp32 policy
    assert emu._cache == {}  # cleared when autocast exits


def test_dropout_keeps_a_bool_mask():
    fake = FakeTensorMode()
    with fake:
        x = torch.empty(1000, requires_grad=True)
    with fake, cr.CudaEmulation(cr.CudaRules()):
        y = F.dropout(x, 0.1, training=True)
    assert y.grad_fn.name() == "NativeDropoutBackward0"


def test_softmax_with_dtype_none_upcasts_like_cuda_autocast():
    """F.softmax passes dtype=None down; CUDA's fp32_set_opt_dtype policy treats that as unset, so
    an fp16 softmax under autocast returns fp32 (BERT's eager attention probabilities)."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlens.estimator.cuda_rules import CudaEmulation, CudaRules, cuda_autocast

    emu = CudaEmulation(CudaRules(autocast_dtype=torch.float16))
    with FakeTensorMode():
        x = torch.empty(2, 4, 8, 8, dtype=torch.float16)
        with emu, cuda_autocast(emu, torch.float16):
            assert F.softmax(x, dim=-1).dtype == torch.float32
            assert F.softmax(x, dim=-1, dtype=torch.float16).dtype == torch.float16
            assert torch.softmax(x, -1).dtype == torch.float32


def test_multihead_attention_reaches_the_fused_kernels():
    """nn.MultiheadAttention calls SDPA inside F.multi_head_attention_forward: CUDA's fused kernel
    is chosen there too (the CPU would build the L x L matrix)."""
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    r = estimate(TrainingSpec(model="tests.tiny_models:mha", optimizer="sgd"))
    assert r.data["attention_backends"] == ["efficient"]


def test_fused_kernels_refuse_a_mask_whose_last_dim_is_not_contiguous_and_cudnn_a_grad_mask():
    """sdp_utils check_last_dim_stride_equals_1_dense (GPUs check the mask too): T5's relative
    position bias, a permuted embedding output, sends T5 to the math path (measured on an H100);
    cuDNN refuses a mask that requires grad, the memory-efficient kernel takes it (measured)."""
    fake = FakeTensorMode()
    with fake:
        q = torch.empty(2, 12, 64, 64, dtype=torch.bfloat16)
        bias = torch.empty(64, 64, 12, requires_grad=True).permute(2, 0, 1).unsqueeze(0)   # strides (12, 1, 768, 12)
        assert cr.sdpa_backend(q, q, bias.to(torch.bfloat16), 0.1, False, v=q) == "math"
        assert cr.sdpa_backend(q, q, bias.contiguous(), 0.1, False, v=q) == "efficient"
        assert cr.sdpa_backend(q, q, bias.detach().contiguous(), 0.1, False, v=q) == "cudnn"
        assert cr.sdpa_backend(q, q, None, 0.0, False, v=q.transpose(-1, -2)) == "math"


def test_math_attention_runs_in_fp32_for_half_inputs():
    """attention.cpp _scaled_dot_product_attention_math upcasts half q, k, v: the L x S scores,
    softmax and dropout are fp32 (dropout keeps a bool mask, CUDA's fused kernel)."""
    from memlens.core.ledger import EventLog, analyze
    from memlens.core.tracker import StorageTracker

    B, H, L, D = 2, 4, 128, 64
    fake = FakeTensorMode()
    log = EventLog()
    with fake:
        q = torch.empty(B, H, L, D, dtype=torch.bfloat16, requires_grad=True)
        bias = torch.empty(L, L, H).permute(2, 0, 1).unsqueeze(0).to(torch.bfloat16)
    with fake, cr.CudaEmulation(cr.CudaRules()), StorageTracker(log):
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=bias, dropout_p=0.1)
    assert out.dtype == torch.bfloat16
    a = analyze(log)
    scores = B * H * L * L
    # kept for backward: q, k, v upcast and scaled (3 x fp32 (B,H,L,D)), the softmax output (fp32),
    # the dropout mask (bool) and the dropped weights (fp32); the bf16 output
    kept = 3 * B * H * L * D * 4 + scores * 4 + scores * 1 + scores * 4 + B * H * L * D * 2
    assert a.end_allocated_bytes == kept
    del out


def test_a_host_draw_branch_runs_as_on_cuda():
    """`if torch.rand([]) < p` (LayerDrop) reads a host draw's value: the draw is real, the layer
    runs (p = 0), and the step's memory is that of the same model without the branch."""
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    with_draw = estimate(TrainingSpec(model="tests.tiny_models:layerdrop"))
    plain = estimate(TrainingSpec(model="tests.tiny_models:no_layerdrop"))
    assert with_draw.peak_allocated_bytes == plain.peak_allocated_bytes
    assert with_draw.by_category["activations"] == plain.by_category["activations"]


def test_cudnn_output_follows_the_query_layout():
    """cuDNN attention allocates its output in the query's stride order (MHA.cpp
    alloc_with_matching_layout): a contiguous (B, H, L, D) query (Phi's partial-rotary cat) gives a
    (B, H, L, D) output, and the model's transpose(1, 2).contiguous() copies it; a query viewed from
    (B, L, H, D) (Llama's projections) gives a (B, L, H, D) output and no copy (measured, Phi-1.5)."""
    from memlens.core.ledger import EventLog, analyze
    from memlens.core.tracker import StorageTracker

    B, H, L, D = 2, 4, 128, 64
    out_bytes = B * H * L * D * 2
    kept = {}
    for layout in ("bhld", "blhd"):
        fake = FakeTensorMode()
        log = EventLog()
        with fake:
            if layout == "bhld":
                q = torch.empty(B, H, L, D, dtype=torch.bfloat16, requires_grad=True)
            else:
                q = torch.empty(B, L, H, D, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        with fake, cr.CudaEmulation(cr.CudaRules()), StorageTracker(log):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            merged = out.transpose(1, 2).contiguous()
        kept[layout] = analyze(log).end_allocated_bytes
        del out, merged
    assert kept["bhld"] - kept["blhd"] == out_bytes
