"""Vision-language models as their processors feed them (models/vlm.py): Qwen2.5-VL's dynamic resolution,
Gemma-3's fixed 896 px image, Llama-3.2-Vision's tiles; tiny configs, token counts and bytes by hand."""
from pathlib import Path

import pytest

from memlens.cli.main import main
from memlens.core.errors import SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.models import registry, vlm

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
QWEN = str(CONFIGS / "qwen2.5-vl.json")          # vision: 2 blocks, 14 px patches, merge 2; LM 2 layers, H 64
QWEN_HUB = str(CONFIGS / "qwen2.5-vl-hub.json")  # the same in the layout of the Hub's config.json
GEMMA = str(CONFIGS / "gemma3-vl.json")          # SigLIP 224 px, 14 px patches, 16 tokens an image
MLLAMA = str(CONFIGS / "mllama.json")            # 56 px tiles, 4 tiles, one cross-attention layer


def _round(n: int) -> int:
    return -(-n // 512) * 512


@pytest.mark.parametrize("size, resized, patches, tokens", [(448, 448, 1024, 256), (500, 504, 1296, 324), (30, 56, 16, 4)])
def test_qwen_grid_follows_the_processors_resize(size, resized, patches, tokens):
    """smart_resize to multiples of 28 within [56*56, 28*28*16384] pixels; (side/14)^2 patches merged 2x2."""
    from memlens.models.source import resolve

    cfg = resolve(QWEN).config
    assert vlm.smart_resize(size, size, 28, 56 * 56, 28 * 28 * 16384) == (resized, resized)
    assert vlm.qwen_grid(cfg, size) == (patches, tokens, resized // 14)


def test_qwen25_vl_batch_is_what_the_processor_emits():
    """448 px -> 1024 patches of 3*2*14*14 = 1176 values (fp32: 4816896 bytes), image_grid_thw (1, 32, 32);
    256 image tokens + 64 text tokens = 320 ids (2560 bytes), as many labels and mm_token_type_ids (the
    processor's, 1 on image tokens: get_rope_index places the image by them); the grid 24 bytes -> 512."""
    r = estimate(TrainingSpec(model=QWEN, batch_size=1, seq_len=64, image_size=448))
    assert r.by_category["inputs"] == 1024 * 1176 * 4 + 3 * 320 * 8 + 512
    assert ("1 image(s) of 448x448 px a sample, resized to 448px by the Qwen-VL processor: 1024 patches each, merged 2x2 "
            "into 256 image tokens; the language model's sequence is 64 text tokens (--seq-len) + 256 image tokens = 320") in r.notes


def test_several_images_a_sample_add_their_tokens():
    r = estimate(TrainingSpec(model=QWEN, batch_size=1, seq_len=64, image_size=500, images_per_sample=2))
    assert any(n.endswith("+ 648 image tokens = 712") and "1296 patches each" in n for n in r.notes), r.notes
    # pixel values 2 x 1296 x 1176 x 4 = 12192768 bytes: a 12 MiB segment of its own whose 390144-byte remainder
    # (under 1 MiB) the caching allocator does not split off; ids and labels 712 x 8 bytes each
    assert r.by_category["inputs"] == 12 * 2**20 + 3 * _round(712 * 8) + _round(2 * 3 * 8)


def test_a_frozen_vision_tower_has_no_optimizer_state():
    """--freeze visual: AdamW's two fp32 states of every vision parameter are gone (each rounded to 512 bytes)."""
    import torch

    from memlens.models.build import build
    from memlens.models.source import resolve

    with torch.device("meta"):
        model = build(TrainingSpec(model=QWEN, batch_size=1, seq_len=64, freeze=("visual",)), resolve(QWEN)).model
    vision = [p for n, p in model.named_parameters() if n.startswith("model.visual.")]
    assert vision and not any(p.requires_grad for p in vision)
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("model.visual."))
    full = estimate(TrainingSpec(model=QWEN, batch_size=1, seq_len=64, image_size=448))
    frozen = estimate(TrainingSpec(model=QWEN, batch_size=1, seq_len=64, image_size=448, freeze=("visual",)))
    states = 2 * sum(_round(p.numel() * 4) for p in vision)
    assert full.by_category["optimizer_state"] - frozen.by_category["optimizer_state"] == states


def test_qwen3_vl_estimates_with_its_32px_merge():
    """Qwen3-VL: 16 px patches merged 2x2, so 448 px -> 784 patches -> 196 image tokens."""
    r = estimate(TrainingSpec(model=str(CONFIGS / "qwen3-vl.json"), batch_size=1, seq_len=64, image_size=448))
    assert any("784 patches each, merged 2x2 into 196 image tokens" in n and n.endswith("= 260") for n in r.notes), r.notes


def test_the_hub_config_with_an_image_size_estimates(capsys):
    """It stopped on "internal error: AttributeError: 'Qwen2_5_VLVisionConfig' object has no attribute 'image_size'"."""
    assert main(["estimate", "--model", QWEN_HUB, "--image-size", "448"]) == 0
    assert "peak allocated" in capsys.readouterr().out
    r = estimate(TrainingSpec(model=QWEN_HUB, batch_size=1, image_size=448))
    assert any(n.endswith("512 text tokens (--seq-len) + 256 image tokens = 768") for n in r.notes), r.notes


def test_gemma3_has_a_fixed_image_and_its_token_types():
    """224 px (the tiny SigLIP's size), 16 tokens between <start_of_image> and <end_of_image>; token_type_ids
    beside the ids: pixel values 3*224*224*4 bytes, ids/labels/token types 80 x 8 bytes each."""
    r = estimate(TrainingSpec(model=GEMMA, batch_size=1, seq_len=64))
    assert r.by_category["inputs"] == 3 * 224 * 224 * 4 + 3 * _round(80 * 8)
    assert any(n.endswith("64 text tokens (--seq-len) + 16 image tokens = 80") for n in r.notes), r.notes
    with pytest.raises(SpecError, match="gemma3 takes 224px images"):
        estimate(TrainingSpec(model=GEMMA, batch_size=1, seq_len=64, image_size=448))


def test_mllama_pads_every_image_to_its_tiles():
    """4 tiles of 3 x 56 x 56 fp32 (150528 bytes) whatever the size; one <|image|> token in 64 text tokens;
    aspect_ratio_ids (1), aspect_ratio_mask (4) and cross_attention_mask (64 x 1 x 4) int64."""
    r = estimate(TrainingSpec(model=MLLAMA, batch_size=1, seq_len=64))
    assert r.by_category["inputs"] == 4 * 3 * 56 * 56 * 4 + 2 * _round(64 * 8) + _round(8) + _round(4 * 8) + _round(64 * 4 * 8)
    assert any("1 of 4 tiles used" in n for n in r.notes)
    bigger = estimate(TrainingSpec(model=MLLAMA, batch_size=1, seq_len=64, image_size=112))
    assert any("4 of 4 tiles used" in n for n in bigger.notes)
    assert bigger.by_category["inputs"] == r.by_category["inputs"]


@pytest.mark.parametrize("name, params", [("qwen2.5-vl-3b", 3.755e9), ("qwen2.5-vl-7b", 8.29e9), ("gemma-3-4b", 4.30e9),
                                          ("llama-3.2-11b-vision", 10.67e9)])
def test_builtin_vlms_have_their_published_sizes(name, params):
    import torch
    from transformers import AutoModelForImageTextToText

    from memlens.models.source import resolve

    assert name in registry.names()
    src = resolve(name)
    assert src.task == "vlm"
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(src.config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.01)


@pytest.mark.slow
def test_a_large_micro_batch_estimates_as_fit_probes_it():
    """get_rope_index loops over the batch's rows in Python: the simulation's per-module op guard allows for it (fit
    probes micro-batches of 64 and more; at 16 the guard stopped it before)."""
    small, large = (estimate(TrainingSpec(model=QWEN, image_size=224, seq_len=64, lora_rank=8, batch_size=b)) for b in (4, 16))
    assert large.peak_allocated_bytes > small.peak_allocated_bytes
    assert large.data["seq_len"] == small.data["seq_len"]
