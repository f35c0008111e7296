"""--trainer-args with TRL 1.16's SFTConfig, DPOConfig and GRPOConfig (memlens.integrations.trl_args)."""
from __future__ import annotations

import json
import warnings

import pytest
import yaml

from memlens.cli.main import main
from memlens.core.errors import SpecError
from memlens.integrations import trl_args
from memlens.integrations.trainer_args import spec_fields, spec_fields_from_file

trl = pytest.importorskip("trl")


def config_json(tmp_path, cls, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = getattr(trl, cls)(output_dir=str(tmp_path / "o"), use_cpu=True, **kw).to_json_string()
    p = tmp_path / f"{cls}.json"
    p.write_text(text)
    return p


@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo"])
def test_fallback_defaults_and_fields_equal_installed_trl(trainer, monkeypatch):
    installed = (trl_args.trl_defaults(trainer), trl_args.own_fields(trainer))
    monkeypatch.setattr(trl_args, "_config_class", lambda t: None)
    assert (trl_args.trl_defaults(trainer), trl_args.own_fields(trainer)) == installed


def test_sft_config_round_trip(tmp_path):
    """An SFTConfig as to_json_string writes it: SFT's defaults (checkpointing, bf16 over fp32 weights, fused AdamW),
    max_length as the rows' length, packing with its strategy."""
    p = config_json(tmp_path, "SFTConfig", packing=True, per_device_train_batch_size=4, max_length=2048)
    f = spec_fields_from_file(p, "fp32")
    assert f == {"batch_size": 4, "grad_accum": 1, "precision": "amp-bf16", "grad_checkpointing": True, "optimizer": "adamw-fused",
                 "max_grad_norm": 1.0, "compile": False, "hf_trainer": True, "trainer": "sft", "seq_len": 2048, "packing": "bfd"}


def test_dpo_and_grpo_config_round_trips(tmp_path):
    d = spec_fields_from_file(config_json(tmp_path, "DPOConfig", per_device_train_batch_size=2, precompute_ref_log_probs=True), "bf16")
    assert (d["trainer"], d["seq_len"], d["precompute_ref_log_probs"], d["precision"]) == ("dpo", 1024, True, "bf16-amp")
    g = spec_fields_from_file(config_json(tmp_path, "GRPOConfig", per_device_train_batch_size=8, beta=0.04, use_vllm=True,
                                          gradient_accumulation_steps=2), "fp32")
    assert {k: g[k] for k in ("trainer", "num_generations", "max_completion_length", "beta", "steps_per_generation",
                              "vllm_gpu_memory_utilization", "grad_accum")} == {
        "trainer": "grpo", "num_generations": 8, "max_completion_length": 512, "beta": 0.04, "steps_per_generation": 2,
        "vllm_gpu_memory_utilization": 0.3, "grad_accum": 2}


def test_yaml_with_some_fields_takes_trl_defaults(tmp_path):
    p = tmp_path / "grpo.yaml"
    p.write_text(yaml.safe_dump({"per_device_train_batch_size": 16, "num_generations": 4, "generation_batch_size": 32}))
    f = spec_fields_from_file(p, "bf16")
    assert (f["trainer"], f["steps_per_generation"], f["max_completion_length"], f["beta"], f["grad_checkpointing"]) == (
        "grpo", 2, 512, 0.0, True)
    assert "vllm_gpu_memory_utilization" not in f


def test_which_config(tmp_path):
    assert spec_fields({"max_length": 512}, trainer="dpo")["trainer"] == "dpo"
    assert "trainer" not in spec_fields({"per_device_train_batch_size": 2})     # TrainingArguments only: the Trainer
    with pytest.raises(SpecError, match="could be a SFTConfig or a DPOConfig"):
        spec_fields({"max_length": 512})
    with pytest.raises(SpecError, match="--trainer sft, but the trainer args name 'num_generations'"):
        spec_fields({"num_generations": 4}, trainer="sft")
    with pytest.raises(SpecError, match="mix fields of several TRL configs"):
        spec_fields({"packing": True, "num_generations": 4})


@pytest.mark.parametrize("d, words", [
    ({"per_device_train_batch_size": "eight"}, "per_device_train_batch_size must be a whole number >= 1, got 'eight'"),
    ({"packing": True, "loss_type": "dft"}, "loss_type='dft'"),
    ({"packing": True, "activation_offloading": True}, "activation_offloading=True"),
    ({"packing": True, "pad_to_multiple_of": 64}, "pad_to_multiple_of=64"),
    ({"precompute_ref_log_probs": True, "use_weighting": True}, "use_weighting=True"),
    ({"precompute_ref_log_probs": True, "loss_type": ["simpo"]}, "DPO loss_type 'simpo' is not one of TRL 1.16's"),
    ({"num_generations": 4, "num_iterations": 2}, "num_iterations=2"),
    ({"num_generations": 4, "use_vllm": True, "vllm_mode": "server"}, "vllm_mode='server'"),
    ({"num_generations": 4, "cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32=True"),
    ({"num_generations": 4, "cache_implementation": "static"}, "cache_implementation='static'"),
    ({"num_generations": 4, "top_entropy_quantile": 0.2}, "top_entropy_quantile=0.2"),
    ({"num_generations": 4, "generation_batch_size": 9, "per_device_train_batch_size": 4}, "generation_batch_size 9 is not a multiple"),
    ({"packing": True, "max_lenght": 512}, "'max_lenght' is not a SFTConfig field (did you mean 'max_length'?)"),
])
def test_refusals_are_one_line(d, words):
    with pytest.raises(SpecError) as e:
        spec_fields(d, "fp32")
    assert words in e.value.message and e.value.hint and "\n" not in e.value.render()


def test_use_liger_kernel_maps_to_liger_or_is_refused():
    from dataclasses import fields

    from memlens.core.spec import TrainingSpec

    if "liger" in {f.name for f in fields(TrainingSpec)}:
        assert spec_fields({"packing": True, "use_liger_kernel": True})["liger"] is True
    else:
        with pytest.raises(SpecError, match="use_liger_kernel=True: this memlens has no liger-kernel model"):
            spec_fields({"packing": True, "use_liger_kernel": True})


def test_cli_trainer_args_eight_is_one_line(tmp_path, capsys):
    p = tmp_path / "args.json"
    p.write_text(json.dumps({"per_device_train_batch_size": "eight"}))
    assert main(["estimate", "--model", "gpt2", "--trainer-args", str(p)]) == 2
    err = capsys.readouterr().err
    assert "per_device_train_batch_size must be a whole number" in err and "Traceback" not in err


def test_cli_estimate_from_an_sft_config(tmp_path, capsys):
    from pathlib import Path

    llama = str(Path(__file__).parent.parent / "fixtures" / "models" / "tiny-llama" / "config.json")
    p = config_json(tmp_path, "SFTConfig", packing=True, per_device_train_batch_size=2, max_length=64)
    assert main(["estimate", "--model", llama, "--trainer-args", str(p), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["spec"]["trainer"], out["spec"]["packing"], out["spec"]["seq_len"], out["spec"]["precision"]) == ("sft", "bfd", 64, "amp-bf16")
