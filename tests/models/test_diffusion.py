"""Diffusion models (memlens/models/diffusion.py) and EMA weights (memlens/step/ema.py) on tiny diffusers configs."""
import importlib.util
import json

import pytest
import torch

from memlens.core.errors import ModelSourceError, SpecError
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.models.build import build
from memlens.models.source import resolve
from memlens.step.plan import resolve as resolve_plan

pytest.importorskip("diffusers")

CFG = "tests/fixtures/configs/diffusers/"
UNET, UNET_XL, DIT, FLUX, SD3 = (CFG + f"tiny-{n}.json" for n in ("unet", "unetxl", "dit", "flux", "sd3"))


def built(**kw):
    spec = TrainingSpec(**kw)
    with torch.device("meta"):
        return build(spec, resolve(spec.model))


def blocks(nbytes: int) -> int:
    """The caching allocator's 512-byte rounding of one tensor."""
    return -(-nbytes // 512) * 512


def param_blocks(model, trainable_only: bool = False) -> int:
    return sum(blocks(p.numel() * p.element_size()) for p in model.parameters() if p.requires_grad or not trainable_only)


# ---------------------------------------------------------------- shipped configs
@pytest.mark.parametrize("name, count", [
    ("sd-1.5", 859_520_964),          # the published SD-1.5 UNet
    ("sdxl", 2_567_463_684),          # the published SDXL base UNet
    ("dit-xl-2-256", 749_826_464),    # DiT-XL/2 is 675M in the paper; diffusers' DiT gives every block its own
                                      # timestep+class embedding (AdaLayerNormZero): 28 x 2.68M more (3.0 GB fp32 checkpoint)
    ("flux-dev", 11_901_408_320),     # FLUX.1-dev's transformer (11.9B; with the guidance embedder)
    ("flux-schnell", 11_891_178_560),  # FLUX.1-schnell: no guidance embedder
    ("sd3-medium", 2_028_328_000),    # SD3-medium's MMDiT (2B)
])
def test_shipped_configs_build_the_published_models(name, count):
    b = built(model=name)
    assert sum(p.numel() for p in b.model.parameters()) == count
    assert resolve(name).task == "diffusion" and resolve(name).kind == "diffusers"


def test_hub_ids_and_aliases_are_the_built_ins():
    assert resolve("stable-diffusion-v1-5/stable-diffusion-v1-5").name == "sd-1.5"
    assert resolve("runwayml/stable-diffusion-v1-5").name == "sd-1.5"
    assert resolve("black-forest-labs/FLUX.1-dev").name == "flux-dev"
    assert resolve("facebook/DiT-XL-2-256").name == "dit-xl-2-256"


# ---------------------------------------------------------------- batches
def test_sd15_batch_is_what_train_text_to_image_feeds_the_unet():
    b = built(model="sd-1.5", batch_size=3, precision="amp-bf16")
    x = b.batch
    assert tuple(x["sample"].shape) == (3, 4, 64, 64) and x["sample"].dtype == torch.bfloat16   # 512 px / 8, weight_dtype
    assert tuple(x["encoder_hidden_states"].shape) == (3, 77, 768) and x["encoder_hidden_states"].dtype == torch.bfloat16
    assert x["timestep"].dtype == torch.int64 and tuple(x["timestep"].shape) == (3,)
    assert tuple(x["target"].shape) == (3, 4, 64, 64)
    assert b.forward_keys == frozenset({"sample", "timestep", "encoder_hidden_states", "return_dict"})   # the noise is the loss's
    assert b.image_size == 512 and b.seq_len is None
    assert next(b.model.parameters()).dtype == torch.float32     # amp: fp32 weights under autocast


def test_sdxl_batch_adds_pooled_text_embeds_and_time_ids():
    b = built(model="sdxl", batch_size=2, image_size=1024, precision="bf16")
    x = b.batch
    assert tuple(x["sample"].shape) == (2, 4, 128, 128)
    assert tuple(x["encoder_hidden_states"].shape) == (2, 77, 2048)
    assert tuple(x["added_cond_kwargs"]["text_embeds"].shape) == (2, 1280)     # 2816 - 6 x 256
    assert tuple(x["added_cond_kwargs"]["time_ids"].shape) == (2, 6)


def test_flux_batch_packs_latents_and_carries_t5_states_ids_and_guidance():
    x = built(model="flux-dev", batch_size=2, image_size=512, precision="bf16").batch
    assert tuple(x["hidden_states"].shape) == (2, 32 * 32, 64)            # 16 channels in 2x2 patches of the 64x64 latents
    assert tuple(x["encoder_hidden_states"].shape) == (2, 512, 4096)      # T5, max_sequence_length 512
    assert tuple(x["pooled_projections"].shape) == (2, 768)
    assert tuple(x["img_ids"].shape) == (1024, 3) and tuple(x["txt_ids"].shape) == (512, 3)
    assert tuple(x["guidance"].shape) == (2,) and x["guidance"].untyped_storage().nbytes() == 4   # tensor([3.5]).expand(B)
    assert tuple(x["target"].shape) == (2, 16, 64, 64)
    assert "guidance" not in built(model="flux-schnell", image_size=512).batch
    assert tuple(built(model="flux-dev", image_size=512, seq_len=256).batch["encoder_hidden_states"].shape) == (1, 256, 4096)


def test_dit_batch_has_class_labels_and_the_image_size_sets_its_patches():
    b = built(model="dit-xl-2-256", batch_size=4)
    assert tuple(b.batch["hidden_states"].shape) == (4, 4, 32, 32) and tuple(b.batch["class_labels"].shape) == (4,)
    assert b.image_size == 256
    assert built(model="dit-xl-2-256", image_size=512).model.config.sample_size == 64


def test_loss_is_mse_on_the_fp32_prediction_against_the_noise():
    from memlens.models.diffusion import mse_loss

    target = torch.randn(2, 4, 8, 8)
    pred = torch.randn(2, 8, 8, 8)                   # DiT's learned sigma: the first 4 channels are epsilon
    assert torch.allclose(mse_loss((pred,), {"target": target}), ((pred[:, :4] - target) ** 2).mean())
    lat = torch.randn(2, 16, 8, 8)                   # Flux: packed 2x2, unpacked before the loss
    packed = lat.view(2, 16, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 16, 64)
    assert mse_loss((packed,), {"target": lat}).item() == 0.0


# ---------------------------------------------------------------- estimate: hand-checked bytes
@pytest.mark.slow
def test_unet_estimate_bytes_by_hand():
    spec = TrainingSpec(model=UNET, batch_size=2, image_size=64, precision="amp-bf16")
    r = estimate(spec)
    model = built(**{k: getattr(spec, k) for k in ("model", "batch_size", "image_size", "precision")}).model
    p = param_blocks(model)
    assert r.by_category["parameters"] == p
    assert r.by_category["gradients"] == p                     # every parameter trains
    assert r.by_category["optimizer_state"] == 2 * p           # AdamW's exp_avg and exp_avg_sq
    # the batch, bf16 under amp-bf16: latents 2x4x8x8, timesteps 2 x int64, text states 2x77x32, noise 2x4x8x8
    assert r.by_category["inputs"] == blocks(2 * 4 * 8 * 8 * 2) + blocks(2 * 8) + blocks(2 * 77 * 32 * 2) + blocks(2 * 4 * 8 * 8 * 2)
    assert any("the VAE and text encoders are frozen and not on the GPU" in n for n in r.notes)


@pytest.mark.slow
def test_ema_copy_is_the_trainable_parameters_bytes():
    spec = TrainingSpec(model=DIT, batch_size=2, image_size=64)
    plain, ema = estimate(spec), estimate(spec.replace(ema=True))
    p = param_blocks(built(model=DIT, image_size=64).model)
    shadow = next(m for m in ema.by_module if m["module"] == "(ema weights)")
    assert shadow["by_category"] == {"optimizer_state": p}
    assert ema.by_category["optimizer_state"] == 3 * p         # AdamW's two states and the shadow
    assert ema.peak_allocated_bytes - plain.peak_allocated_bytes == p   # resident from setup; its update runs after zero_grad
    assert any("EMAModel(foreach=False)" in a for a in ema.data["applied"])


@pytest.mark.slow
def test_ema_with_lora_shadows_only_the_adapters():
    r = estimate(TrainingSpec(model=UNET, batch_size=1, image_size=64, lora_rank=4, ema=True))
    model = built(model=UNET, image_size=64, lora_rank=4).model
    shadow = next(m for m in r.by_module if m["module"] == "(ema weights)")
    assert shadow["by_category"]["optimizer_state"] == param_blocks(model, trainable_only=True)


def test_ema_update_allocates_what_diffusers_step_allocates():
    """EMAModel.step: foreach=False subtracts per parameter (two temporaries of one parameter at a time),
    foreach=True makes a whole copy of the tracked parameters at once (torch._foreach_sub)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memlens.step import ema

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.out = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func._schema.name.endswith("_"):   # out-of-place: a new tensor (or list)
                outs = out if isinstance(out, (list, tuple)) else [out]
                self.out.append((func._schema.name, [t.numel() for t in outs if isinstance(t, torch.Tensor)]))
            return out

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for how, expect in ((True, [("aten::sub", [128]), ("aten::mul", [128])]), ("foreach", [("aten::_foreach_sub", [128, 16, 64, 4])])):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ema.attach(TrainingSpec(model="x", ema=how), model, opt, [])
        assert [(t.numel(), p.numel()) for t, p in ema.shadow(opt)] == [(128, 128), (16, 16), (64, 64), (4, 4)]
        with Sizes() as s:
            ema.update(opt)
        assert s.out[:len(expect)] == expect


# ---------------------------------------------------------------- other families, checkpointing, LoRA
@pytest.mark.slow
@pytest.mark.parametrize("path, kw", [(UNET_XL, {}), (FLUX, {"seq_len": 8}), (SD3, {})])
def test_other_families_estimate(path, kw):
    r = estimate(TrainingSpec(model=path, batch_size=2, image_size=64, precision="amp-bf16", **kw))
    p = param_blocks(built(model=path, image_size=64, **kw).model)
    assert r.by_category["parameters"] == p and r.by_category["optimizer_state"] == 2 * p
    assert r.data["attention_backends"] == ["cudnn"]   # diffusers' SDPA calls on an H100 in bf16: a fused kernel, no L x L matrix


def test_gradient_checkpointing_is_the_models_own_switch():
    m = built(model=UNET, image_size=64, grad_checkpointing=True).model
    assert m.is_gradient_checkpointing
    assert not built(model=UNET, image_size=64).model.is_gradient_checkpointing


def test_lora_adapts_the_attention_projections_as_diffusers_scripts_do():
    m = built(model=UNET, image_size=64, lora_rank=4).model
    adapted = [n for n, mod in m.named_modules() if hasattr(mod, "lora_A")]
    assert {"to_out.0" if n.endswith("to_out.0") else n.rsplit(".", 1)[-1] for n in adapted} == {"to_q", "to_k", "to_v", "to_out.0"}
    attn = sum(1 for _, mod in m.named_modules() if type(mod).__name__ == "Attention")
    assert len(adapted) == 4 * attn
    assert all("lora_" in n for n, p in m.named_parameters() if p.requires_grad)
    dit = built(model=DIT, image_size=64, lora_rank=4).model        # no add_adapter: peft's inject_adapter_in_model
    assert {n.rsplit(".", 1)[-1] for n, mod in dit.named_modules() if hasattr(mod, "lora_A")} >= {"to_q", "to_k", "to_v"}
    assert all("lora_" in n for n, p in dit.named_parameters() if p.requires_grad)


@pytest.mark.slow
def test_fit_finds_the_largest_micro_batch():
    from memlens.explore.fit import fit

    spec = TrainingSpec(model=DIT, batch_size=1, image_size=64, precision="amp-bf16")
    # 67 MiB and no margin: the reserved peak steps from 66 to 68 MiB between 16 and 32 images, a search of ~10
    # probes (400 MiB with the 256 MiB margin searched up to 1,861 images: 21 probes)
    r = fit(spec, "67MiB", plan=False, context_bytes=0, margin=0)
    n, usable = r.data["max_batch_size"], r.data["usable_bytes"]
    assert n > 1
    assert estimate(spec.replace(batch_size=n)).peak_reserved_bytes <= usable < estimate(spec.replace(batch_size=n + 1)).peak_reserved_bytes


@pytest.mark.slow
def test_compare_runs_the_techniques_on_a_unet():
    from memlens.explore.compare import compare

    r = compare(TrainingSpec(model=UNET, batch_size=2, image_size=64), ["bf16", "lora"])
    rows = {row["technique"]: row for row in r.data["rows"]}
    assert rows["bf16"]["estimated_peak_allocated_bytes"] > 0 and rows["lora"]["estimated_peak_allocated_bytes"] > 0


# ---------------------------------------------------------------- refusals
def test_without_diffusers_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "diffusers" else real(name, *a))
    with pytest.raises(ModelSourceError, match=r"--model sd-1.5 needs diffusers, which is not installed"):
        resolve("sd-1.5")


@pytest.mark.parametrize("kw, message", [
    ({"model": "sd-1.5", "seq_len": 128}, "--seq-len does not apply to sd-1.5: its conditioning is CLIP's 77 text tokens"),
    ({"model": "dit-xl-2-256", "seq_len": 8}, "--seq-len does not apply to dit-xl-2-256"),
    ({"model": "flux-dev", "seq_len": 1024}, "seq_len 1024 exceeds T5's 512 tokens"),
    ({"model": "sd-1.5", "image_size": 500}, "image_size 500 is not a multiple of 8"),
    ({"model": "flux-dev", "image_size": 520}, "image_size 520 is not a multiple of 16"),
    ({"model": "sd-1.5", "hf_trainer": True}, "--hf-trainer: sd-1.5 is trained by diffusers' scripts"),
    ({"model": "sd-1.5", "attn": "eager"}, "--attn eager: diffusers' attention processors run SDPA"),
    ({"model": "sd-1.5", "checkpoint_layers": 2}, "checkpoints through diffusers' enable_gradient_checkpointing"),
    ({"model": "sd-1.5", "lora_rank": 4, "qlora": True}, "--qlora is not modelled for sd-1.5"),
])
def test_refusals(kw, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        built(**kw)


def test_unknown_diffusers_class_is_refused(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"_class_name": "AutoencoderKL", "in_channels": 3}))
    with pytest.raises(ModelSourceError, match="diffusers class 'AutoencoderKL' is not one memlens builds"):
        resolve(str(tmp_path))


@pytest.mark.parametrize("kw, message", [
    ({"dp": True}, "--ema with --dp is not modelled"),
    ({"hf_trainer": True}, "transformers' Trainer keeps no EMA weights"),
    ({"world_size": 2, "sharding": "fsdp"}, "--ema with --sharding fsdp is not modelled"),
])
def test_ema_refusals(kw, message):
    from memlens.step import ema

    with pytest.raises(SpecError, match=message):
        ema.refuse(resolve_plan(TrainingSpec(model="gpt2", ema=True, **kw), refuse=False))


def test_ema_spec_field():
    assert TrainingSpec.from_dict({"model": "sd-1.5", "ema": "foreach"}).ema == "foreach"
    assert TrainingSpec.from_dict({"model": "sd-1.5", "ema": "yes"}).ema is True
    assert "ema" not in TrainingSpec(model="sd-1.5").to_dict()
    assert TrainingSpec(model="sd-1.5", ema=True).describe().endswith("ema")
    for bad in ("sometimes", 2):
        with pytest.raises(SpecError, match="ema must be true, false or foreach"):
            TrainingSpec.from_dict({"model": "sd-1.5", "ema": bad})


@pytest.mark.slow
@pytest.mark.parametrize("how", [True, "foreach"])
def test_ema_on_a_deep_language_model_writes_its_layers_from_shallow_ones(tmp_path, how):
    """--ema is the same mechanism for any model: on a 12-layer GPT-2 the log written from 3 and 4 layers
    (one shadow copy per layer) equals the whole model's simulation event for event."""
    from tests.estimator.test_depth import GPT2, assert_written_equals_whole, deep

    fast = assert_written_equals_whole(TrainingSpec(model=deep(tmp_path, GPT2), batch_size=2, seq_len=32, ema=how))
    assert fast.later_layers == "written from 3 and 4 layers"


@pytest.mark.parametrize("argv, ema", [([], False), (["--ema"], True), (["--ema", "foreach"], "foreach"),
                                       (["--ema", "--batch-size", "2"], True)])
def test_ema_flag(argv, ema):
    import argparse

    from memlens.cli.common import add_spec_args, spec_from_args

    p = argparse.ArgumentParser()
    add_spec_args(p)
    assert spec_from_args(p.parse_args(["--model", "sd-1.5", *argv])).ema == ema


@pytest.mark.slow
def test_ema_with_ddp_holds_the_whole_shadow_on_each_rank():
    spec = TrainingSpec(model=DIT, batch_size=2, image_size=64, world_size=2, sharding="ddp")
    p = param_blocks(built(model=DIT, image_size=64).model)
    assert estimate(spec.replace(ema=True)).peak_allocated_bytes - estimate(spec).peak_allocated_bytes == p
