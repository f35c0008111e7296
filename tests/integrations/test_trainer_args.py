"""TrainingArguments -> spec, --trainer-args, and memlens.estimate_trainer on a Trainer built on the CPU."""
import json

import pytest
import torch

from memlens.core.errors import SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.integrations.trainer_args import spec_fields, spec_fields_from_file

TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 128,
             "architectures": ["GPT2LMHeadModel"]}


def test_defaults_are_the_trainers():
    f = spec_fields({}, weights="fp32")
    assert f == {"batch_size": 8, "grad_accum": 1, "precision": "fp32", "grad_checkpointing": False,
                 "optimizer": "adamw-fused", "max_grad_norm": 1.0, "compile": False, "hf_trainer": True}


@pytest.mark.parametrize("flags, weights, precision", [
    ({"bf16": True}, "fp32", "amp-bf16"), ({"fp16": True}, "fp32", "amp-fp16"), ({"bf16": True}, "bf16", "bf16-amp"),
    ({}, "bf16", "bf16"), ({}, None, "fp32"),
])
def test_precision_flags_over_the_weights(flags, weights, precision):
    assert spec_fields(flags, weights=weights)["precision"] == precision


def test_mapping_of_the_rest():
    f = spec_fields({"per_device_train_batch_size": 3, "gradient_accumulation_steps": 4, "gradient_checkpointing": True,
                     "optim": "sgd", "optim_args": "momentum=0.9", "max_grad_norm": 0.0, "torch_compile": True}, "fp32")
    assert (f["batch_size"], f["grad_accum"], f["grad_checkpointing"], f["optimizer"], f["max_grad_norm"], f["compile"]) == \
        (3, 4, True, "sgd-momentum", None, True)
    assert spec_fields({"activation_checkpointing": True}, "fp32")["grad_checkpointing"] is True   # transformers 5.2x's name
    assert spec_fields({"optim": "adafactor"}, "fp32")["optimizer"] == "adafactor-hf"
    assert spec_fields({"optim": "adamw_bnb_8bit"}, "fp32")["optimizer"] == "adamw-8bit"


@pytest.mark.parametrize("args, weights, message", [
    ({"fp16": True}, "bf16", "fp16=True over bf16 weights"),
    ({"bf16": True, "fp16": True}, "fp32", "both bf16 and fp16"),
    ({"optim": "lion_8bit"}, "fp32", "not a Trainer optimizer memlens models"),
    ({"deepspeed": "ds.json"}, "fp32", "DeepSpeed"),
    ({"fsdp": "full_shard"}, "fp32", "FSDP"),
    ({"label_smoothing_factor": 0.1}, "fp32", "label_smoothing_factor"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}, "fp32", "reentrant"),
    ({"per_device_train_batch_sizes": 4}, "fp32", "did you mean 'per_device_train_batch_size'"),
])
def test_refused_in_one_line(args, weights, message):
    with pytest.raises(SpecError, match=message):
        spec_fields(args, weights)


def test_json_from_training_arguments_and_yaml(tmp_path):
    from transformers import TrainingArguments

    ta = TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                           report_to="none", use_cpu=True)
    (tmp_path / "args.json").write_text(ta.to_json_string())
    (tmp_path / "args.yaml").write_text("per_device_train_batch_size: 2\ngradient_accumulation_steps: 2\n")
    a, b = spec_fields_from_file(tmp_path / "args.json"), spec_fields_from_file(tmp_path / "args.yaml")
    assert a == b and a["batch_size"] == 2 and a["grad_accum"] == 2 and a["optimizer"] == "adamw-fused"
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(SpecError, match="not valid JSON"):
        spec_fields_from_file(tmp_path / "bad.json")
    with pytest.raises(SpecError, match="does not exist"):
        spec_fields_from_file(tmp_path / "missing.yaml")


def test_cli_trainer_args_precision_names_the_weights(tmp_path):
    import argparse

    from memlens.cli.common import add_spec_args, spec_from_args

    (tmp_path / "a.yaml").write_text("bf16: true\nper_device_train_batch_size: 2\n")
    p = argparse.ArgumentParser()
    add_spec_args(p)
    s = spec_from_args(p.parse_args(["--model", "gpt2", "--trainer-args", str(tmp_path / "a.yaml"), "--precision", "bf16",
                                     "--batch-size", "4"]))
    assert (s.precision, s.batch_size, s.optimizer, s.max_grad_norm, s.hf_trainer) == ("bf16-amp", 4, "adamw-fused", 1.0, True)


def _collate(samples):  # labels are the inputs: one tensor under both keys, as memlens' synthetic batch
    ids = torch.stack([s["input_ids"] for s in samples])
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("targs, precision", [({}, "fp32"), ({"gradient_accumulation_steps": 2, "max_grad_norm": 0.5}, "fp32")])
def test_estimate_trainer_equals_the_hand_typed_flags_and_trainer_args(tmp_path, targs, precision):
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    import memlens

    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(TINY_GPT2))
    cfg = {k: v for k, v in TINY_GPT2.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **cfg), attn_implementation="sdpa")
    data = [{"input_ids": torch.randint(0, 512, (32,))} for _ in range(2)]
    args = TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, report_to="none", use_cpu=True,
                             remove_unused_columns=False, **targs)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=_collate)
    by_trainer = memlens.estimate_trainer(trainer)
    hand = TrainingSpec(model=str(cfg_path), batch_size=2, seq_len=32, precision=precision, optimizer="adamw-fused",
                        max_grad_norm=targs.get("max_grad_norm", 1.0), grad_accum=targs.get("gradient_accumulation_steps", 1),
                        hf_trainer=True)
    (tmp_path / "ta.json").write_text(args.to_json_string())
    from_file = TrainingSpec(model=str(cfg_path), seq_len=32, **spec_fields_from_file(tmp_path / "ta.json", "fp32"))
    assert from_file == hand
    assert by_trainer.peak_allocated_bytes == estimate(hand).peak_allocated_bytes
    assert by_trainer.peak_reserved_bytes == estimate(hand).peak_reserved_bytes
    # the Trainer's model was not touched: real weights, still on the CPU
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())


def test_estimate_trainer_refuses_a_custom_loss(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    import memlens
    from memlens.core.errors import MemlensError

    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).logits.sum()

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **{k: v for k, v in TINY_GPT2.items() if k != "model_type"}))
    t = MyTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True),
                  train_dataset=[{"input_ids": torch.zeros(8, dtype=torch.long)}] * 8)
    with pytest.raises(MemlensError, match="computes its own loss"):
        memlens.estimate_trainer(t)


def test_callback_checks_the_fit_before_the_first_step(tmp_path):
    from torch.utils.data import DataLoader
    from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments

    from memlens.core.errors import MemlensError
    from memlens.integrations.hf import MemlensCallback

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **{k: v for k, v in TINY_GPT2.items() if k != "model_type"}))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to="none", use_cpu=True)
    loader = DataLoader([{"input_ids": torch.randint(0, 512, (32,))} for _ in range(4)], batch_size=2, collate_fn=_collate)
    ok = MemlensCallback(fit_budget="16GiB", profile=False)
    ok.on_train_begin(args, None, None, model=model, train_dataloader=loader)
    assert ok.fit_verdict.fits and ok.estimate.peak_allocated_bytes < 2**30
    # 1000 MiB - the 740 MiB CUDA context - the 256 MiB margin leaves 4 MiB: less than the step's cuBLAS workspaces
    tight = MemlensCallback(fit_budget="1000MiB", profile=False)
    with pytest.raises(MemlensError, match="this Trainer's step needs"):
        tight.on_train_begin(args, None, None, model=model, train_dataloader=loader)
    assert tight.fit_verdict.fits is False


def test_weights_default_to_the_configs_dtype(tmp_path, capsys):
    """Without --precision, the weights are what from_pretrained(dtype="auto") loads: the config's dtype."""
    import argparse

    from memlens.cli.common import add_spec_args, spec_from_args

    (tmp_path / "config.json").write_text(json.dumps({**TINY_GPT2, "dtype": "bfloat16"}))
    (tmp_path / "a.yaml").write_text("bf16: true\n")
    p = argparse.ArgumentParser()
    add_spec_args(p)
    s = spec_from_args(p.parse_args(["--model", str(tmp_path / "config.json"), "--trainer-args", str(tmp_path / "a.yaml")]))
    assert s.precision == "bf16-amp"
    s = spec_from_args(p.parse_args(["--model", str(tmp_path / "config.json"), "--trainer-args", str(tmp_path / "a.yaml"),
                                     "--precision", "fp32"]))
    assert s.precision == "amp-bf16"
