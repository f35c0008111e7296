"""--liger: liger-kernel's kernels simulated on fake tensors (memlens.models.liger), bytes counted by hand.

Every tensor below is at most 1 MiB and a multiple of 512 bytes where it matters, so the caching allocator's model
adds nothing but 512-byte rounding (a 128-byte mask or an 8-byte scalar is one 512-byte block).
"""
import functools
import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memlens.core.errors import MemlensError, SpecError
from memlens.core.ledger import EventLog, analyze
from memlens.core.spec import TrainingSpec
from memlens.core.tracker import StorageTracker
from memlens.models import liger

LLAMA = str(Path(__file__).parent.parent / "fixtures" / "models" / "tiny-llama" / "config.json")   # H 64, V 1000, I 176
B512 = 512


def _blocks(n: int) -> int:
    return -(-n // B512) * B512


def _track(fn, tensors_fn):
    """Make the inputs on a fake mode, then run ``fn(*inputs)`` under a StorageTracker: (analysis, outputs)."""
    fake = FakeTensorMode()
    with fake:
        inputs = tensors_fn()
    log = EventLog()
    tracker = StorageTracker(log)
    tracker.on_host(inputs)      # the inputs exist before: not counted (views of them are not new storage)
    with fake, tracker:
        out = fn(*inputs)
    return analyze(log), out, inputs


def test_chunk_size_follows_liger_rule():
    # liger's own example (ops/fused_linear_cross_entropy.py): BT 16384, V 32000, H 4096 -> inc_factor 8, chunk 2048
    assert liger.chunk_size(16384, 4096, 32000) == 2048
    # Qwen2.5-0.5B: inc_factor cdiv(151936, 896) = 170; 4096 tokens: next_power_of_2(cdiv(4096, 170) = 25) = 32
    assert liger.chunk_size(4096, 896, 151936) == 32
    assert liger.chunk_size(5, 64, 10) == 5     # never more than BT
    assert liger.chunk_size(128, 64, 1000) == 8  # cdiv(1000, 64) = 16, cdiv(128, 16) = 8


def _flce_inputs(dtype, BT=128, H=64, V=1000):
    x = torch.empty(BT, H, dtype=dtype, requires_grad=True)
    w = torch.empty(V, H, dtype=dtype, requires_grad=True)
    t = torch.zeros(BT, dtype=torch.long)
    return x, w, t


def test_fused_linear_cross_entropy_bf16_holds_grads_and_one_chunk():
    f = liger._functions().FusedLinearCrossEntropy
    a, loss, _ = _track(lambda x, w, t: f.apply(x, w, t, None, (9, 0), -100), lambda: _flce_inputs(torch.bfloat16))
    BT, H, V, chunk = 128, 64, 1000, 8
    grad_input, grad_weight = BT * H * 2, V * H * 2         # zeros_like(x), zeros_like(weight): bf16
    loss_1d, mask, logits_chunk = BT * 4, _blocks(BT), _blocks(chunk * V * 2)   # fp32 losses, bool mask, (chunk, V) bf16
    assert a.peak_allocated_bytes == grad_input + grad_weight + loss_1d + mask + logits_chunk
    assert a.peak_allocated_bytes < BT * V * 2               # less than the logits tensor it never makes
    # after forward: the saved gradients and the 0-dim loss
    assert a.end_allocated_bytes == grad_input + grad_weight + B512
    assert loss.dim() == 0 and loss.dtype == torch.float32


def test_fused_linear_cross_entropy_fp32_adds_a_weight_sized_product_per_chunk():
    # fp32 gradients: liger's legacy branch, grad_weight += mm(grad_logits.t(), x_chunk).float() (a V x H fp32 temporary)
    f = liger._functions().FusedLinearCrossEntropy
    a, _, _ = _track(lambda x, w, t: f.apply(x, w, t, None, (9, 0), -100), lambda: _flce_inputs(torch.float32))
    BT, H, V, chunk = 128, 64, 1000, 8
    expected = BT * H * 4 + V * H * 4 + BT * 4 + _blocks(BT) + _blocks(chunk * V * 4) + V * H * 4
    assert a.peak_allocated_bytes == expected


def test_fused_linear_cross_entropy_frozen_weight_makes_no_weight_grad():
    f = liger._functions().FusedLinearCrossEntropy

    def inputs():
        x, w, t = _flce_inputs(torch.bfloat16)
        return x, w.detach(), t

    a, _, _ = _track(lambda x, w, t: f.apply(x, w, t, None, (9, 0), -100), inputs)
    assert a.end_allocated_bytes == 128 * 64 * 2 + B512      # grad_input and the loss only (LoRA: lm_head frozen)


def test_rms_norm_saves_input_and_fp32_rstd_backward_in_place():
    f = liger._functions().RMSNorm
    rows, H, sms = 256, 128, 132

    def inputs():
        return torch.empty(2, rows // 2, H, dtype=torch.bfloat16, requires_grad=True), torch.empty(H, dtype=torch.bfloat16,
                                                                                                    requires_grad=True)

    def run(x, w):
        y = f.apply(x, w, sms)
        saved = {t.untyped_storage().nbytes() for t in y.grad_fn.saved_tensors}
        return y, saved

    a, (y, saved), (x, w) = _track(run, inputs)
    assert a.end_allocated_bytes == rows * H * 2 + _blocks(rows * 4)   # Y and RSTD (fp32, one per row) only
    assert saved == {rows * H * 2, H * 2, rows * 4}                  # X (the input itself), W, RSTD
    fake = y.fake_mode if hasattr(y, "fake_mode") else None
    log = EventLog()
    with (fake or FakeTensorMode()), StorageTracker(log):
        dy = torch.empty_like(y)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    b = analyze(log)
    assert dx.untyped_storage() is dy.untyped_storage() or dx.untyped_storage()._cdata == dy.untyped_storage()._cdata  # dX in dY
    # dY, then the per-SM fp32 partial dW (132 x 128), its fp32 sum over SMs and the bf16 cast
    assert b.peak_allocated_bytes == rows * H * 2 + sms * H * 4 + B512 + B512


def test_swiglu_saves_gate_and_up_only():
    f = liger._functions().SiLUMul
    n, I = 256, 176

    def inputs():
        return (torch.empty(n, I, dtype=torch.bfloat16, requires_grad=True),
                torch.empty(n, I, dtype=torch.bfloat16, requires_grad=True))

    a, c, (x, y) = _track(lambda a_, b_: f.apply(a_ * 1, b_ * 1), inputs)
    ab = _blocks(n * I * 2)
    assert a.end_allocated_bytes == 3 * ab                    # a, b (saved) and c; HF's MLP also keeps silu(a)
    assert len({t.untyped_storage().nbytes() for t in c.grad_fn.saved_tensors}) == 1 and len(c.grad_fn.saved_tensors) == 2


def _forward_peak(spec):
    from memlens.estimator import estimate

    return estimate(spec).by_phase["forward"]["peak_allocated_bytes"]


def test_fused_loss_alone_saves_the_logits_chain_minus_its_chunk(monkeypatch):
    """The tiny Llama (H 64, V 1000) at 2 x 64 tokens in bf16, with only liger's fused linear cross entropy
    against transformers' loss: the forward peaks in the loss either way, with the same layers' activations."""
    from memlens.models import build

    monkeypatch.setattr(build, "apply_liger", functools.partial(liger.apply_liger, kernels=("fused_linear_cross_entropy",)))
    spec = TrainingSpec(model=LLAMA, batch_size=2, seq_len=64, precision="bf16")
    BT, H, V = 128, 64, 1000
    # transformers: bf16 logits, their fp32 copy (ForCausalLMLoss' .float()), the fp32 log-softmax, and nll_loss'
    # two 0-dim outputs (the loss, total_weight) made while all three are alive
    chain = BT * V * 2 + BT * V * 4 + BT * V * 4 + 2 * B512
    # liger: grad_input, grad_weight, loss_1d, the target mask, one 8 x 1000 bf16 logits chunk
    fused = BT * H * 2 + V * H * 2 + BT * 4 + B512 + _blocks(8 * V * 2)
    assert _forward_peak(spec) - _forward_peak(spec.replace(liger=True)) == chain - fused


def test_whole_liger_step_is_below_the_plain_one_and_says_its_chunk():
    from memlens.estimator import estimate

    spec = TrainingSpec(model=LLAMA, batch_size=2, seq_len=64, precision="bf16")
    plain, lig = estimate(spec), estimate(spec.replace(liger=True))
    assert lig.peak_allocated_bytes < plain.peak_allocated_bytes
    assert lig.data["liger"] == {"version": "0.8.5", "apply_fn": "apply_liger_kernel_to_llama", "tokens": 128, "hidden_size": 64,
                                 "vocab_size": 1000, "chunk_size": 8, "chunks": 16, "fused_loss": True}
    line = next(a for a in lig.data["applied"] if a.startswith("liger-kernel"))
    assert "16 chunk(s) of 8 of the 128 tokens" in line and "simulated kernels" in line


def test_refusals(tmp_path):
    with pytest.raises(SpecError, match="--liger with --dp is not modelled"):
        TrainingSpec(model="gpt2", liger=True, dp=True)
    with pytest.raises(SpecError, match="--liger with --compile"):
        TrainingSpec(model="gpt2", liger=True, compile=True)
    from memlens.estimator import estimate

    with pytest.raises(SpecError, match="liger-kernel 0.8.5 has no patch for model_type 'gpt2'"):
        estimate(TrainingSpec(model="gpt2", liger=True, seq_len=32))
    olmo2 = tmp_path / "config.json"
    olmo2.write_text(json.dumps({"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}))
    with pytest.raises(SpecError, match="patches model_type 'olmo2', but memlens does not model its kernels yet"):
        estimate(TrainingSpec(model=str(olmo2), liger=True, seq_len=32))
    with pytest.raises(SpecError, match="is a factory"):
        estimate(TrainingSpec(model="tests.tiny_models:mlp", liger=True))
    with pytest.raises(MemlensError, match="--method formula has no terms for --liger"):
        estimate(TrainingSpec(model=LLAMA, liger=True), method="formula")


def test_device_run_without_liger_kernel_is_refused(monkeypatch):
    import sys

    from memlens.models.source import resolve
    from memlens.step.plan import resolve as plan

    monkeypatch.setitem(sys.modules, "liger_kernel", None)    # import fails as when it is not installed
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
    spec = TrainingSpec(model=LLAMA, liger=True)
    with pytest.raises(SpecError, match="runs liger-kernel's own kernels") as e:
        plan(spec, fake=False, source=resolve(LLAMA))
    assert "pip install liger-kernel" in e.value.hint


def test_spec_round_trip_and_description():
    s = TrainingSpec(model="qwen2.5-0.5b", liger=True)
    assert TrainingSpec.from_dict(s.to_dict()) == s and "liger" in s.describe().split()
    assert "liger" not in TrainingSpec(model="qwen2.5-0.5b").to_dict()


def test_gemma_runs_liger_geglu(tmp_path):
    """Gemma 1 (apply_liger_kernel_to_gemma): LigerGEGLUMLP, whose GELU-mul kernel allocates as SwiGLU's."""
    from memlens.estimator import estimate

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_size": 64, "head_dim": 16,
                               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 1, "vocab_size": 1000, "hidden_activation": "gelu_pytorch_tanh"}))
    spec = TrainingSpec(model=str(cfg), batch_size=2, seq_len=64, precision="bf16")
    plain, lig = estimate(spec), estimate(spec.replace(liger=True))
    assert lig.peak_allocated_bytes < plain.peak_allocated_bytes
    assert any("apply_liger_kernel_to_gemma: RMSNorm, GEGLU MLP" in a for a in lig.data["applied"])


def test_trainer_args_use_liger_kernel():
    from memlens.integrations.trainer_args import spec_fields

    assert spec_fields({"use_liger_kernel": True}, weights="bf16")["liger"] is True
    assert "liger" not in spec_fields({}, weights="bf16")
    assert spec_fields({"use_liger_kernel": True, "liger_kernel_config": {"rope": True}}, weights="bf16")["liger"] is True
    with pytest.raises(SpecError, match="memlens models liger's default kernels only"):
        spec_fields({"use_liger_kernel": True, "liger_kernel_config": {"swiglu": False}}, weights="bf16")


def test_cli_flag_table_line_and_refusal(capsys):
    from memlens.cli.main import main

    code = main(["estimate", "--model", LLAMA, "--batch-size", "2", "--seq-len", "64", "--precision", "bf16", "--liger"])
    out, _ = capsys.readouterr()
    assert code == 0 and "liger-kernel 0.8.5: fused linear cross entropy in 16 chunk(s) of 8 tokens" in " ".join(out.split())
    code = main(["estimate", "--model", "gpt2", "--seq-len", "32", "--liger"])
    _, err = capsys.readouterr()
    assert code == 2 and "ERROR: --liger: liger-kernel 0.8.5 has no patch for model_type 'gpt2'" in err


def test_no_module_global_left_patched(monkeypatch):
    """liger rewrites transformers' modeling module; memlens' patch is the instance's: after a --liger estimate the
    module's RoPE and classes are transformers' own, so a plain model built next is plain."""
    from transformers.models.llama import modeling_llama

    from memlens.estimator import estimate

    rope, norm, mlp = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP
    calls = []
    simulated = liger._functions().Rope
    monkeypatch.setattr(liger._functions(), "Rope", type("Counted", (simulated,), {
        "apply": classmethod(lambda cls, *a: calls.append(1) or simulated.apply(*a))}))
    estimate(TrainingSpec(model=LLAMA, batch_size=1, seq_len=32, precision="bf16", liger=True))
    assert len(calls) == 2          # liger's RoPE in both layers' attention (step 2 is written from step 1's events)
    assert (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP) == (rope, norm, mlp)


def test_fused_linear_cross_entropy_under_amp_keeps_autocast_cached_weight_copy():
    """amp-bf16 (fp32 x and weight, bf16 autocast): chunk 1's ``grad_logits @ weight`` casts the leaf weight, which
    autocast caches until it exits; chunk 2's ``x_chunk @ weight.t()`` casts the transpose (a view: not cached) while
    that copy lives: two bf16 copies of the weight at the forward peak (measured on an H200, qwen2.5-0.5b)."""
    from memlens.estimator import cuda_rules as cr

    fake = FakeTensorMode()
    with fake:
        x, w, t = _flce_inputs(torch.float32)
    emu = cr.CudaEmulation(cr.CudaRules(autocast_dtype=torch.bfloat16))
    log = EventLog()
    tracker = StorageTracker(log)
    tracker.on_host((x, w, t))
    f = liger._functions().FusedLinearCrossEntropy
    with fake, tracker, emu:
        with cr.cuda_autocast(emu, torch.bfloat16):
            loss = f.apply(x, w, t, None, (9, 0), -100)
            assert len(emu._cache) == 1                  # the weight's bf16 copy, made with grad mode off
        assert emu._cache == {}
    a = analyze(log)
    BT, H, V, chunk = 128, 64, 1000, 8
    kept = BT * H * 4 + V * H * 4 + BT * 4 + _blocks(BT)   # grad_input, grad_weight (fp32 like x, w), loss_1d, mask
    w_bf16 = V * H * 2                                      # 128000 bytes, a multiple of 512
    # chunk 2's matmul: the cached copy, the transpose's copy, x_chunk's bf16 copy and the bf16 logits chunk
    assert a.peak_allocated_bytes == kept + w_bf16 + w_bf16 + chunk * H * 2 + _blocks(chunk * V * 2)
    assert a.end_allocated_bytes == BT * H * 4 + V * H * 4 + B512   # the cached copy dies with autocast
    assert loss.dtype == torch.float32


def test_amp_liger_forward_peak_holds_the_tied_weights_cached_copy(tmp_path, monkeypatch):
    """A tiny tied Llama (H 64, V 1000) at 2 x 64 tokens: with amp-bf16 the forward peak (in the fused loss, from its
    second chunk on) holds one bf16 copy of the tied embedding/lm_head weight more than its first chunk does; in
    pure bf16 (no autocast, no cache) every chunk allocates alike."""
    from memlens.estimator import estimate

    cfg = json.loads(Path(LLAMA).read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    V, H = 1000, 64

    def forward_peaks(precision):
        spec = TrainingSpec(model=str(path), batch_size=2, seq_len=64, precision=precision, liger=True)
        every = estimate(spec).by_phase["forward"]["peak_allocated_bytes"]
        with monkeypatch.context() as m:
            m.setattr(liger, "_chunk_starts", lambda tokens, chunk: [0])
            first = estimate(spec).by_phase["forward"]["peak_allocated_bytes"]
        return every, first

    every, first = forward_peaks("amp-bf16")
    assert every - first == V * H * 2
    every, first = forward_peaks("bf16")
    assert every == first
