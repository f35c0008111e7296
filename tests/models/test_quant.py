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
