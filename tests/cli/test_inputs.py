"""Inputs that cannot be right are refused in one line `ERROR: ... HINT: ...`, exit 2 (issue "What a new user meets")."""
import pytest

from memlens.cli.main import main
from tests.cli.cli_support import one_line



NEW = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.69 GiB of which {free} is "
       "free. Of the allocated memory {alloc} is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated.")
OLD = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.69 GiB total capacity; {alloc} already allocated; "
       "1.89 GiB free; {reserved} reserved in total by PyTorch)")


@pytest.mark.parametrize("text,words", [
    (NEW.format(free="30.00 GiB", alloc="10.00 GiB"), "30.00 GiB is free on a GPU of 23.69 GiB: free memory cannot exceed"),
    (NEW.format(free="1.00 GiB", alloc="40.00 GiB"), "40.00 GiB is allocated by PyTorch on a GPU of 23.69 GiB"),
    (OLD.format(alloc="20.45 GiB", reserved="41.50 GiB"), "41.50 GiB is reserved by PyTorch on a GPU of 23.69 GiB"),
])
def test_oom_message_numbers_above_the_total_are_refused(capsys, text, words):
    err = one_line(capsys, "doctor", "oom", text)
    assert words in err and "HINT: paste the message exactly as PyTorch printed it" in err


def test_oom_message_at_the_total_is_still_read(capsys):
    assert main(["doctor", "oom", NEW.format(free="20.00 MiB", alloc="22.60 GiB")]) == 0


def test_log_readings_above_the_capacity_are_refused(capsys, tmp_path):
    log = tmp_path / "train.log"
    log.write_text("".join(f"Step {i}: Memory={16 + i}.0GB\n" for i in range(5)))
    err = one_line(capsys, "doctor", "log", str(log), "--capacity", "1MiB")
    assert "the log's readings are 14.90 GiB to 18.63 GiB, all above the stated capacity 1.00 MiB" in err
    assert "HINT: give --capacity the GPU's whole memory" in err


def test_lora_rank_above_the_layer_width_is_refused(capsys):
    err = one_line(capsys, "estimate", "--model", "gpt2", "--lora-rank", "100000")
    assert err == ("ERROR: --lora-rank 100000 is above the width of every adapted layer (at most 768: min(in, out) "
                   "features of c_attn): a LoRA update has rank at most min(in, out), a larger adapter only adds memory  "
                   "HINT: use --lora-rank 768 or less (8-64 is usual)")


def test_target_len_is_bounded_like_seq_len(capsys):
    err = one_line(capsys, "estimate", "--model", "t5-base", "--target-len", "2000000")
    assert err == "ERROR: target_len 2000000 is impossibly long  HINT: use at most 1048576 decoder tokens"


def test_relative_position_model_past_its_trained_length_says_so():
    from memlens import estimate
    from memlens.core.spec import TrainingSpec

    r = estimate(TrainingSpec(model="t5-base", batch_size=1, seq_len=64, target_len=1024))
    assert any("t5-base has relative positions (no length limit), but target_len 1024 is beyond the 512 tokens" in n
               for n in r.notes), r.notes


@pytest.mark.parametrize("gpu,precision,noted", [("t4", "bf16", True), ("t4", "amp-bf16", True), ("v100", "bf16", True),
                                                 ("t4", "amp-fp16", False), ("a100-80gb", "bf16", False)])
def test_bf16_on_a_gpu_without_bf16_tensor_cores_is_noted(gpu, precision, noted):
    from memlens import estimate
    from memlens.core.spec import TrainingSpec

    r = estimate(TrainingSpec(model="gpt2", gpu=gpu, precision=precision), method="formula")
    assert any("has no bf16 tensor cores: bf16 runs emulated, much slower" in n for n in r.notes) == noted, r.notes


def _gpt2_config(tmp_path, **changes):
    import json
    from pathlib import Path

    import memlens.models

    cfg = json.loads((Path(memlens.models.__file__).parent / "configs" / "gpt2.json").read_text())["config"]
    cfg.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_config_size_written_as_a_string_names_the_field(capsys, tmp_path):
    path = _gpt2_config(tmp_path, n_embd="768")
    err = one_line(capsys, "estimate", "--model", path)
    assert err == (f"ERROR: {path}: config field 'n_embd' is \"768\" (a JSON string): a model size must be a whole number "
                   "above 0  HINT: write it as a number, without quotes: \"n_embd\": 768")


def test_config_field_of_another_wrong_type_names_the_field(capsys, tmp_path):
    err = one_line(capsys, "estimate", "--model", _gpt2_config(tmp_path, layer_norm_epsilon="x"))
    assert "Field 'layer_norm_epsilon' expected float, got str" in err and "HINT: fix that field in config.json" in err


def test_negative_layer_count_says_what_is_wrong(capsys, tmp_path):
    err = one_line(capsys, "estimate", "--model", _gpt2_config(tmp_path, n_layer=-2))
    assert "config field 'n_layer' is -2: a model size must be a whole number above 0" in err
    assert "--method formula" not in err


def test_image_smaller_than_a_patch_says_what_is_wrong(capsys):
    err = one_line(capsys, "estimate", "--model", "vit-base-patch16-224", "--image-size", "7")
    assert err == ("ERROR: image_size 7 is smaller than vit-base-patch16-224 can take: its 16-pixel patches need at least "
                   "16 pixels  HINT: use --image-size 16 or more (it was trained at 224)")


def test_sweep_into_a_directory_that_cannot_be_made(capsys):
    err = one_line(capsys, "sweep", "--model", "gpt2", "--batch-sizes", "1", "--out", "/proc/nope")
    assert err == ("ERROR: cannot create output directory /proc/nope: No such file or directory  "
                   "HINT: choose a writable --out DIR")


CONFIGS = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "configs"


def test_moe_model_without_a_peft_default_gets_the_attention_projections():
    from memlens import estimate
    from memlens.core.spec import TrainingSpec

    r = estimate(TrainingSpec(model=str(CONFIGS / "olmoe.json"), batch_size=1, seq_len=16, lora_rank=4, precision="bf16"))
    assert any(n.startswith("LoRA targets q_proj,v_proj: peft has no default for model_type 'olmoe'") for n in r.notes), r.notes
    # q and v in each of 2 layers: r x (64 + 64) each
    assert r.data["trainable_param_count"] == 2 * 2 * 4 * (64 + 64)


GATED = ("401 Client Error. (Request ID: Root=1-abc)\n\nCannot access gated repo for url "
         "https://huggingface.co/meta-llama/Llama-3.1-8B/resolve/main/config.json.\nAccess to model meta-llama/Llama-3.1-8B is "
         "restricted. You must have access to it and be authenticated to access it. Please log in.")


def test_library_messages_keep_whole_sentences():
    from memlens.core.errors import sentences
    from memlens.core.usercode import first_line
    from memlens.models.source import _short

    for short in (_short(Exception(GATED)), first_line(Exception(GATED)), sentences(GATED)):
        assert short.endswith(".") and "\n" not in short, short
        assert GATED.replace("\n\n", " ").replace("\n", " ").startswith(short), short
    assert sentences(GATED, limit=len(" ".join(GATED.split())) - 1).endswith("You must have access to it and be authenticated to access it.")
    assert sentences("x" * 5000).endswith(" ...") or len(sentences("x" * 5000)) <= 604


def _transformers_before(version: str) -> bool:
    import transformers

    return tuple(int(x) for x in transformers.__version__.split(".")[:2]) < tuple(int(x) for x in version.split("."))


# transformers 5.15's DeBERTa-v2 scripts its relative-position helpers with TorchScript, which fake tensors cannot
# run: the simulation runs their Python originals (memlens/models/scripted.py); 5.24 runs them as Python itself
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_deberta_v2_sequence_classification_estimates_on_the_cpu(attn):
    from memlens import estimate
    from memlens.core.spec import TrainingSpec

    r = estimate(TrainingSpec(model=str(CONFIGS / "deberta-v2.json"), batch_size=2, seq_len=32, attn=attn))
    assert r.peak_allocated_bytes > 0
    fell_back = any("has no SDPA attention in transformers: it runs eager attention" in n for n in r.notes)
    assert fell_back == (attn == "sdpa"), r.notes


def test_known_labels_answer_deberta_nonzero_without_reading_data():
    """`(labels >= 0).nonzero()` on the synthetic labels: every index, as on CUDA; other values still refuse."""
    import torch
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

    from memlens.estimator.cuda_rules import _known_values
    from memlens.models.adapt import mark_known

    with FakeTensorMode():
        labels = mark_known(torch.randint(0, 3, (5,)))
        ge = _known_values(torch.Tensor.__ge__, "__ge__", (labels, 0), {})
        idx = _known_values(torch.Tensor.nonzero, "nonzero", (ge,), {})
        assert idx.shape == (5, 1) and idx.dtype == torch.long
        gt = _known_values(torch.Tensor.__ge__, "__ge__", (labels, 1), {})   # not known all true
        with pytest.raises(DynamicOutputShapeException):
            _known_values(torch.Tensor.nonzero, "nonzero", (gt,), {})
