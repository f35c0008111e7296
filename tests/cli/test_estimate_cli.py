"""`memlens estimate` from the command line: output, files, and every bad-input path."""
import json

import pytest

from memlens.cli.main import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_keys(capsys):
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--batch-size", "1", "--seq-len", "32", "--json")
    assert code == 0
    d = json.loads(out)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "by_category", "by_phase", "by_module", "timeline", "spec", "schema_version"):
        assert key in d
    assert d["spec"]["model"] == "gpt2" and d["spec"]["seq_len"] == 32


def test_table_and_out_dir(capsys, tmp_path):
    code, out, _ = run(capsys, "estimate", "--model", "tests.tiny_models:mlp", "--out", str(tmp_path))
    assert code == 0
    assert "peak allocated" in out and "by category" in out
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["verb"] == "estimate"
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_config_yaml_with_flag_override(capsys, tmp_path):
    cfg = tmp_path / "spec.yaml"
    cfg.write_text("model: gpt2\nbatch_size: 2\nseq_len: 64\nprecision: bf16\n")
    code, out, _ = run(capsys, "estimate", "--config", str(cfg), "--batch-size", "1", "--json")
    d = json.loads(out)
    assert code == 0 and d["spec"]["batch_size"] == 1 and d["spec"]["precision"] == "bf16"


def test_formula_method(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "llama-3.1-70b", "--precision", "bf16", "--method", "formula", "--json")
    d = json.loads(out)
    assert code == 0 and d["method"] == "formula"
    assert d["facts"]["layers"] == 80
    assert any(t["name"] == "activations" for t in d["forward_backward_terms"])
    # a full fine-tune of 70B peaks in the optimizer step: bf16 weights, grads, two states, one temporary
    assert d["peak_phase"] == "optimizer"


def test_list_models(capsys):
    code, out, _ = run(capsys, "estimate", "--list-models")
    assert code == 0
    for name in ("gpt2", "llama-3.1-8b", "llava-1.5-7b", "vit-base-patch16-224", "clip-vit-large-patch14-336"):
        assert name in out


@pytest.mark.parametrize("argv,needle", [
    (["--model", "gtp2"], "unknown model 'gtp2'"),
    (["--model", "gpt2", "--batch-size", "0"], "batch-size must be >= 1"),
    (["--model", "gpt2", "--seq-len", "4096"], "exceeds gpt2's 1024 positions"),
    (["--model", "gpt2", "--qlora"], "--qlora needs --lora-rank"),
    (["--model", "gpt2", "--precision", "fp8"], "invalid choice"),
    (["--batch-size", "4"], "no model given"),
    (["--model", "nosuchpkg.mod:fn"], "cannot import 'nosuchpkg.mod'"),
    (["--model", "gpt2", "--batch-size", "x"], "invalid int value"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, "estimate", *argv)
    assert code == 2
    assert needle in err
    assert err.count("\n") == 1 and err.startswith("ERROR:") and "HINT:" in err
    assert "Traceback" not in err


def test_unknown_model_suggests_close_names(capsys):
    _, _, err = run(capsys, "estimate", "--model", "llama-3.2-1")
    assert "did you mean" in err and "llama-3.2-1b" in err


def test_malformed_yaml(capsys, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: gpt2\n  batch_size: : 3\n")
    code, _, err = run(capsys, "estimate", "--config", str(cfg))
    assert code == 2 and "not valid YAML" in err


def test_config_json_transformers_cannot_build(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-model", "hidden_size": 8}))
    code, _, err = run(capsys, "estimate", "--model", str(tmp_path))
    assert code == 2 and "cannot build model_type 'not-a-model'" in err


def test_local_config_dir_of_a_known_architecture(capsys, tmp_path):
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
           "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run(capsys, "estimate", "--model", str(tmp_path), "--seq-len", "64", "--json")
    assert code == 0 and json.loads(out)["model_source"]["kind"] == "local"


def test_hub_id_offline_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run(capsys, "estimate", "--model", "someorg/some-model-xyz")
    assert code == 2 and "cannot download the config of someorg/some-model-xyz: no network (HF_HUB_OFFLINE is set)" in err


def test_trainer_args_file_and_its_bad_inputs(capsys, tmp_path):
    ta = tmp_path / "args.json"
    ta.write_text(json.dumps({"per_device_train_batch_size": 2, "bf16": True, "optim": "adamw_torch"}))
    code, out, _ = run(capsys, "estimate", "--model", "tests.tiny_models:linear_norm", "--trainer-args", str(ta), "--json")
    d = json.loads(out)
    assert code == 0
    assert (d["spec"]["precision"], d["spec"]["optimizer"], d["spec"]["max_grad_norm"], d["spec"]["hf_trainer"]) == \
        ("amp-bf16", "adamw", 1.0, True)
    ta.write_text(json.dumps({"optim": "galore_adamw"}))
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--trainer-args", str(ta))
    assert code == 2 and "ERROR: optim 'galore_adamw' is not a Trainer optimizer memlens models" in err and "Traceback" not in err
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--trainer-args", str(tmp_path / "none.yaml"))
    assert code == 2 and "does not exist" in err


def test_new_flags_refused_in_one_line(capsys):
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--target-len", "16")
    assert code == 2 and "--target-len is for encoder-decoder models" in err
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--max-grad-norm", "-1")
    assert code == 2 and "max-grad-norm must be a number >= 0" in err
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--compile", "--method", "formula")
    assert code == 2 and "--method formula has no terms for --compile" in err
