import pytest

from memlens.core.errors import SpecError
from memlens.core.spec import TrainingSpec
from memlens.core.units import fmt_bytes, parse_bytes


def test_yaml_round_trip(tmp_path):
    s = TrainingSpec(model="llama-3.2-1b", batch_size=4, seq_len=2048, precision="bf16", grad_checkpointing=True,
                     lora_rank=16, lora_targets=("q_proj", "v_proj"), freeze=("vision",), grad_accum=4)
    p = tmp_path / "spec.yaml"
    p.write_text(s.to_yaml())
    assert TrainingSpec.from_yaml(p) == s
    assert s.effective_batch_size == 16


def test_yaml_coercions(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("model: gpt2\nbatch-size: '8'\ngrad_checkpointing: yes\nlora_rank: 8\nlora_targets: c_attn\n")
    s = TrainingSpec.from_yaml(p)
    assert (s.batch_size, s.grad_checkpointing, s.lora_targets) == (8, True, ("c_attn",))


@pytest.mark.parametrize("fields,needle", [
    ({"batch_size": 0}, "batch-size must be >= 1"),
    ({"batch_size": -3}, "batch-size must be >= 1"),
    ({"precision": "fp8"}, "precision 'fp8' is not one of"),
    ({"optimizer": "adamw8"}, "did you mean"),
    ({"qlora": True}, "--qlora needs --lora-rank"),
    ({"sharding": "zero3"}, "needs --world-size"),
    ({"seq_len": 10**7}, "impossibly long"),
    ({"target_len": 10**7}, "target_len 10000000 is impossibly long"),
    ({"qlora": True, "lora_rank": 8, "precision": "fp32"}, "--qlora with fp32 is not modelled"),
])
def test_invalid_specs(fields, needle):
    with pytest.raises(SpecError) as e:
        TrainingSpec(model="gpt2", **fields)
    assert needle in e.value.render()


def test_malformed_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: gpt2\nbatch_size: [1, 2\n")
    with pytest.raises(SpecError, match="not valid YAML at line"):
        TrainingSpec.from_yaml(p)


def test_unknown_yaml_field_suggests(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("model: gpt2\nbatchsize: 4\n")
    with pytest.raises(SpecError) as e:
        TrainingSpec.from_yaml(p)
    assert "batch_size" in e.value.hint


def test_units():
    assert parse_bytes("16GiB") == 16 * 1024**3
    assert parse_bytes("24 GB") == 24 * 10**9
    assert fmt_bytes(1536) == "1.50 KiB"
    with pytest.raises(Exception, match="cannot read size"):
        parse_bytes("lots")


def test_version_and_environment(capsys):
    import memlens
    from memlens.cli.main import main
    from memlens.core.result import Result

    assert memlens.__version__.count(".") >= 2
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.strip() == f"memlens {memlens.__version__}"
    r = Result(verb="estimate")
    assert r.environment["memlens"] == memlens.__version__ and r.environment["python"]
    import torch  # noqa: F401 - imported libraries are reported
    assert Result(verb="estimate").environment["torch"] == torch.__version__
    loaded = Result.from_dict({"verb": "estimate", "environment": {"torch": "2.4.0"}})
    assert loaded.environment == {"torch": "2.4.0"}          # as it was made


def test_qlora_without_precision_computes_in_bf16_as_fit_and_compare_do(tmp_path):
    from memlens.cli.main import build_parser
    from memlens.cli.common import spec_from_args

    assert TrainingSpec(model="gpt2", lora_rank=8, qlora=True).precision == "bf16"
    assert TrainingSpec(model="gpt2").precision == "fp32"
    assert TrainingSpec(model="gpt2", lora_rank=8, qlora=True, precision="amp-fp16").precision == "amp-fp16"
    p = tmp_path / "s.yaml"
    p.write_text("model: gpt2\nbatch_size: 2\n")
    args = build_parser("estimate").parse_args(["estimate", "--config", str(p), "--lora-rank", "8", "--qlora"])
    assert spec_from_args(args).precision == "bf16"
