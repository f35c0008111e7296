"""MoE experts and peft's LoRA shorthands: the grouped matmul in fp32 as CUDA runs it, ``all-linear``,
fused expert parameters as peft's ``target_parameters``, and the refusal of an empty target list."""
from pathlib import Path

import pytest

from memlens.cli.main import main
from memlens.core.errors import SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
OLMOE = str(CONFIGS / "olmoe.json")   # 2 layers, H 64, I 32, 4 experts, top-2


def _peft_at_least(version: str) -> bool:
    import peft

    return tuple(int(x) for x in peft.__version__.split(".")[:2]) >= tuple(int(x) for x in version.split("."))


def test_fp32_grouped_mm_gets_cuda_fallback_output_and_gradients():
    """torch._grouped_mm of fp32 operands: the meta kernel refuses (bf16 only); CUDA's fallback loop
    writes one (S, N) output, and backward gives the operands' shapes. a: 16 x 8, b: 4 x 8 x 12."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlens.estimator.cuda_rules import CudaEmulation, CudaRules

    with FakeTensorMode():
        a = torch.empty(16, 8, requires_grad=True)
        b = torch.empty(4, 8, 12, requires_grad=True)
        offs = torch.empty(4, dtype=torch.int32)
        with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
            torch._grouped_mm(a, b, offs=offs)
        with CudaEmulation(CudaRules()):
            out = torch.nn.functional.grouped_mm(a, b, offs=offs)
        assert out.shape == (16, 12) and out.dtype == torch.float32
        assert out.untyped_storage().nbytes() == 16 * 12 * 4
        ga, gb = torch.autograd.grad(out.sum(), [a, b])
        assert ga.shape == a.shape and gb.shape == b.shape


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_olmoe_lora_estimates_in_fp32_and_bf16(precision):
    """The built-in olmoe-1b-7b with LoRA stopped on "Expected inputs of BF16 type" in fp32 (issue 33)."""
    r = estimate(TrainingSpec(model=OLMOE, batch_size=1, seq_len=16, lora_rank=4, precision=precision))
    assert any(n.startswith("LoRA targets q_proj,v_proj: peft has no default for model_type 'olmoe'") for n in r.notes)
    # adapters on q and v only: 2 layers x 2 x (4 x 64 + 64 x 4) params, fp32 adapters' AdamW: 2 states of 4 bytes
    assert r.by_category["optimizer_state"] == 2 * 2 * 512 * 4 * 2


def _lora_model(model_path, targets, rank=4):
    from memlens.models.build import build
    from memlens.models.source import resolve

    return build(TrainingSpec(model=model_path, batch_size=1, seq_len=8, lora_rank=rank, lora_targets=targets), resolve(model_path)).model


def test_all_linear_adapts_every_linear_but_the_output_layer():
    """peft's all-linear on GPT-2: its Conv1D layers (c_attn, c_proj, c_fc, attn and mlp c_proj), never lm_head."""
    model = _lora_model("gpt2", ("all-linear",))
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
               if hasattr(m, "lora_A") and n.endswith(("c_attn", "c_proj", "c_fc", "lm_head"))}
    assert adapted == {"c_attn", "c_proj", "c_fc"}
    layers = sum(1 for n, m in model.named_modules() if hasattr(m, "lora_A") and "lora_A" not in n and "lora_B" not in n)
    assert layers == 12 * 4   # per block: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj


def test_expert_parameters_are_targets_of_peft_parameters():
    """experts.gate_up_proj (4 x 64 x 64) and experts.down_proj (4 x 64 x 32) as target_parameters: per layer and
    parameter peft's ParamWrapper makes lora_A (in -> r*experts) and lora_B (r*experts -> out): r = 4, 4 experts:
    16 x (64 + 64) + 16 x (64 + 32) = 3584 trainable values a layer, 7168 for 2 layers."""
    model = _lora_model(OLMOE, ("experts.gate_up_proj", "experts.down_proj"))
    assert {type(m).__name__ for m in model.modules()} >= {"ParamWrapper"}
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 7168
    assert not any("self_attn" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.skipif(not _peft_at_least("0.21"), reason="peft 0.21 rewrites MoE targets into target_parameters")
def test_all_linear_on_moe_adapts_the_experts_as_peft_does():
    """peft 0.21 resolves all-linear on a transformers-5 MoE model to its v4 names and rewrites the expert ones
    into target_parameters (gate_up_proj at twice the rank: gate and up were two layers), the router's gate.weight
    too; the note says what each forward copies."""
    r = estimate(TrainingSpec(model=OLMOE, batch_size=1, seq_len=16, lora_rank=4, lora_targets=("all-linear",)))
    note = next(n for n in r.notes if n.startswith("LoRA on fused parameters"))
    assert "down_proj 4x64x32 r=4, gate_up_proj 4x64x64 r=8, weight 4x64 r=4" in note
    # fp32 copies of the stacks per forward: 2 layers x (4*64*32 + 4*64*64 + 4*64) x 4 bytes = 198656 bytes
    assert "(torch.baddbmm under a parametrization, 0.2 MiB over all layers)" in note


def _one_line(capsys, *argv):
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_empty_lora_targets_are_refused_not_read_as_the_default(capsys):
    err = _one_line(capsys, "estimate", "--model", "gpt2", "--lora-rank", "8", "--lora-targets", "")
    assert err == "ERROR: --lora-targets is empty  HINT: give --lora-targets a value, or leave it out for its default"
    with pytest.raises(SpecError) as e:   # a spec file / Python: the spec's own check
        TrainingSpec.from_dict({"model": "gpt2", "lora_rank": 8, "lora_targets": ""})
    assert e.value.render() == "ERROR: --lora-targets is empty  HINT: name modules (e.g. q_proj,v_proj, or all-linear), or drop the flag"


def test_all_linear_stands_alone(capsys):
    err = _one_line(capsys, "estimate", "--model", "gpt2", "--lora-rank", "8", "--lora-targets", "all-linear,c_attn")
    assert err.startswith("ERROR: --lora-targets all-linear is peft's shorthand for every linear layer: it stands alone, not beside c_attn")
