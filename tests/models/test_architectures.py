"""Encoder-decoders, classification heads, CNNs and vision-library sources on tiny configs."""
import sys
import types

import pytest
import torch

from memlens.core.errors import ModelSourceError, SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.models.build import build
from memlens.models.source import resolve

CFG = "tests/fixtures/configs/"


def built(**kw):
    spec = TrainingSpec(**kw)
    with torch.device("meta"):
        return build(spec, resolve(spec.model))


def test_seq2seq_batch_and_target_len():
    b = built(model=CFG + "t5.json", batch_size=2, seq_len=64, target_len=16)
    assert type(b.model).__name__ == "T5ForConditionalGeneration"
    assert tuple(b.batch["input_ids"].shape) == (2, 64) and tuple(b.batch["labels"].shape) == (2, 16) and b.target_len == 16
    assert built(model=CFG + "bart.json", batch_size=2, seq_len=64).target_len == 64       # default: the encoder's
    with pytest.raises(SpecError, match="target_len 200 exceeds .* 128 decoder positions"):
        built(model=CFG + "bart.json", seq_len=64, target_len=200)
    with pytest.raises(SpecError, match="--target-len is for encoder-decoder models"):
        built(model="gpt2", seq_len=64, target_len=16)


def test_whisper_is_an_encoder_decoder_not_a_decoder_only_model():
    src = resolve(CFG + "whisper.json")
    assert src.task == "speech-seq2seq"
    b = built(model=CFG + "whisper.json", batch_size=2)
    assert type(b.model).__name__ == "WhisperForConditionalGeneration"
    # 30 s of log-mel frames (2 x max_source_positions) x num_mel_bins, decoder tokens capped at max_target_positions
    assert tuple(b.batch["input_features"].shape) == (2, 16, 100) and tuple(b.batch["labels"].shape) == (2, 32)
    with pytest.raises(SpecError, match="target_len 33 exceeds .* 32 decoder positions"):
        built(model=CFG + "whisper.json", target_len=33)
    with pytest.raises(SpecError, match="fixed 100 mel frames, not --seq-len"):
        built(model=CFG + "whisper.json", seq_len=64)


def test_seq2seq_estimate_charges_encoder_and_decoder():
    r = estimate(TrainingSpec(model=CFG + "t5.json", batch_size=2, seq_len=64, target_len=16))
    mods = {m["module"].split(".")[0] for m in r.by_module}
    assert {"encoder", "decoder"} <= mods
    assert r.data["seq_len"] == 64


def test_sequence_classification_labels_per_sample():
    b = built(model=CFG + "bertcls.json", batch_size=3, seq_len=32)
    assert type(b.model).__name__ == "BertForSequenceClassification"
    assert tuple(b.batch["labels"].shape) == (3,)


@pytest.mark.parametrize("name, cls", [("convnext", "ConvNextForImageClassification"), ("resnet", "ResNetForImageClassification"),
                                       ("swin", "SwinForImageClassification")])
def test_vision_models_with_and_without_attention(name, cls):
    b = built(model=CFG + f"{name}.json", batch_size=2)
    assert type(b.model).__name__ == cls
    size = 224 if name == "resnet" else 64             # ResNet's config names no image size: ImageNet's 224
    assert tuple(b.batch["pixel_values"].shape) == (2, 3, size, size)
    assert any("no attention" in n for n in b.notes) == (name != "swin")


def test_cnn_estimate_runs_and_counts_conv_activations():
    r = estimate(TrainingSpec(model=CFG + "convnext.json", batch_size=2))
    assert r.by_phase["backward"]["peak_allocated_bytes"] > r.by_phase["setup"]["peak_allocated_bytes"]
    assert any("no attention layers" in n for n in r.notes)


# ---------------------------------------------------------------- timm: / torchvision: sources
def test_missing_vision_library_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "timm" else real(name, *a))
    with pytest.raises(ModelSourceError, match="needs timm, which is not installed"):
        resolve("timm:resnet50")
    with pytest.raises(ModelSourceError, match="needs a model name"):
        resolve("torchvision:")


class _TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 10)
        self.pretrained_cfg = {"input_size": (3, 32, 32)}
        self.num_classes = 10

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))


@pytest.fixture
def fake_timm(monkeypatch):
    """A stand-in `timm` module: the library itself is not in the CPU test venv."""
    mod = types.ModuleType("timm")
    mod.list_models = lambda: ["tinynet", "resnet50"]
    mod.create_model = lambda name, pretrained=False: _TinyNet()
    monkeypatch.setitem(sys.modules, "timm", mod)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "timm" else real(name, *a))
    return mod


def test_vision_library_source_and_build(fake_timm):
    src = resolve("timm:tinynet")
    assert (src.kind, src.task) == ("timm", "vision-module")
    with pytest.raises(ModelSourceError, match="timm has no model 'resnet5'"):
        resolve("timm:resnet5")
    b = built(model="timm:tinynet", batch_size=4)
    assert tuple(b.batch["x"].shape) == (4, 3, 32, 32) and tuple(b.batch["labels"].shape) == (4,)
    assert b.forward_keys == frozenset({"x"})      # forward(x); the labels are for the loss
    r = estimate(TrainingSpec(model="timm:tinynet", batch_size=4))
    assert r.data["image_size"] == 32
    with pytest.raises(SpecError, match="--seq-len does not apply"):
        built(model="timm:tinynet", seq_len=8)
