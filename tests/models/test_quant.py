"""QLoRA's 4-bit weights are the model's parameters (as bitsandbytes' Params4bit), at their storage dtypes."""
from pathlib import Path

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
