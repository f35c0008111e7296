"""QLoRA's 4-bit weights are the model's parameters (as bitsandbytes' Params4bit), at their storage dtypes."""
from pathlib import Path

import pytest

from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate

TINY_LLAMA = str(Path(__file__).parent.parent / "fixtures" / "models" / "tiny-llama" / "config.json")


def test_qlora_weights_are_parameters_not_buffers():
    spec = TrainingSpec(model=TINY_LLAMA, batch_size=1, seq_len=16, qlora=True, lora_rank=4, precision="bf16")
    r = estimate(spec)
    lora = estimate(spec.replace(qlora=False))
    # the packed uint8 weights moved from buffers to parameters: buffers are what the plain LoRA model has (rotary freqs)
    assert r.by_category.get("buffers", 0) == lora.by_category.get("buffers", 0)
    assert 0 < r.by_category["parameters"] < lora.by_category["parameters"]
    note = next(a for a in r.data.applied if a.startswith("4-bit NF4 frozen weights under parameters: "))
    assert " uint8, " in note and " float32 (packed 2 a byte" in note
    # the parameter count is the model's, each packed weight counted as the in x out weights it holds (issue 36: an
    # 8B QLoRA reported 1.06B, the unquantized rest)
    assert r.data["param_count"] == lora.data["param_count"]
    assert r.data["trainable_param_count"] == lora.data["trainable_param_count"]


def test_qlora_says_what_bitsandbytes_leaves_unquantized():
    """OLMoE's experts are fused nn.Parameters (experts x 2I x H and experts x H x I), not nn.Linear:
    bitsandbytes leaves them in bf16, and the Result says so. Tiny config: 4 experts, H 64, I 32, 2 layers:
    2 x (4*64*64 + 4*64*32) x 2 bytes = 96 KiB of experts; the routers' (4 x 64) weights 2 x 512 bytes."""
    from pathlib import Path

    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    cfg = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "olmoe.json"
    r = estimate(TrainingSpec(model=str(cfg), batch_size=1, seq_len=16, lora_rank=4, qlora=True, precision="bf16"))
    note = next(n for n in r.notes if "quantizes nn.Linear layers only" in n)
    assert "OlmoeExperts 96.00 KiB" in note and "OlmoeTopKRouter 1.00 KiB" in note


def _fake_bitsandbytes(monkeypatch):
    """A stand-in ``bitsandbytes`` module with the two classes memlens builds on a device (no GPU, no bitsandbytes
    here): Params4bit records that it was quantized when moved, Linear4bit its construction arguments."""
    import sys
    import types

    import torch

    class Params4bit(torch.nn.Parameter):
        def __new__(cls, data=None, requires_grad=False, **kw):
            p = super().__new__(cls, data, requires_grad)
            p.kw = kw
            p.moved = False
            return p

        def to(self, *a, **kw):
            self.moved = True
            return self

    class Linear4bit(torch.nn.Linear):
        def __init__(self, i, o, bias=True, device=None, **kw):
            super().__init__(i, o, bias=bias, device=device)
            self.kw = kw

        def to(self, *a, **kw):
            self.weight.to(*a, **kw)
            return self

    bnb = types.ModuleType("bitsandbytes")
    bnb.nn = types.SimpleNamespace(Linear4bit=Linear4bit, Params4bit=Params4bit)
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)
    return bnb


def test_bitsandbytes_layers_replace_every_linear_but_the_head(monkeypatch):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memlens.core.errors import SpecError
    from memlens.models.quant import param_count, quantize_with_bitsandbytes, replace_linears_4bit

    bnb = _fake_bitsandbytes(monkeypatch)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(Path(TINY_LLAMA).parent)))
    with pytest.raises(SpecError) as e:         # a model on the CPU: bitsandbytes' layers are a GPU's
        quantize_with_bitsandbytes(model, torch.bfloat16)
    assert e.value.message == "--qlora builds bitsandbytes' 4-bit layers on a CUDA GPU; this model is built on cpu"
    before = sum(p.numel() for p in model.parameters())
    assert replace_linears_4bit(model, bnb, torch.bfloat16) == 7 * model.config.num_hidden_layers
    # bitsandbytes packs two 4-bit weights a byte (Params4bit holds in x out / 2 uint8): the count stays the weights'
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.weight.data = torch.empty(m.in_features * m.out_features // 2, 1, dtype=torch.uint8)
    assert param_count(model) == before
    four = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert [n for n, m in model.named_modules() if type(m) is torch.nn.Linear] == ["lm_head"] and len(four) == 14
    m = model.model.layers[0].self_attn.q_proj
    assert m.kw == {"compute_dtype": torch.bfloat16, "compress_statistics": True, "quant_type": "nf4",
                    "quant_storage": torch.uint8}
    assert m.weight.moved and not m.weight.requires_grad and m.weight.kw["quant_type"] == "nf4"
    assert m.weight.shape == (64 * 64 // 2, 1)


def test_a_device_build_quantizes_before_lora_and_never_puts_stand_ins(monkeypatch):
    import memlens.models.quant as quant
    from memlens.models.build import build
    from memlens.models.source import resolve

    seen = []
    monkeypatch.setattr(quant, "quantize_with_bitsandbytes", lambda model, dt: seen.append((type(model).__name__, dt)))
    monkeypatch.setattr(quant, "quantize_frozen_linears", lambda *a, **k: seen.append("stand-ins"))
    spec = TrainingSpec(model=TINY_LLAMA, batch_size=1, seq_len=16, qlora=True, lora_rank=4, precision="bf16")
    build(spec, resolve(spec.model), device="cpu", fake=False)
    import torch

    assert seen == [("LlamaForCausalLM", torch.bfloat16)]       # the bare model, before peft wraps it
    seen.clear()
    build(spec, resolve(spec.model), fake=True)
    assert seen == ["stand-ins"]


def test_a_device_build_without_bitsandbytes_is_refused_in_one_line(monkeypatch, capsys):
    import sys

    from memlens.cli.main import main

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)     # not importable
    code = main(["profile", "--model", TINY_LLAMA, "--batch-size", "1", "--seq-len", "16", "--qlora", "--lora-rank", "4",
                 "--precision", "bf16", "--device", "cpu", "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert err.startswith("ERROR: --qlora on a device needs bitsandbytes") and "HINT: pip install bitsandbytes" in err
    assert "`memlens estimate --qlora` simulates QLoRA without it" in err
