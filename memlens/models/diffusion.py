"""Diffusion models as a built-in family: diffusers' UNets and transformers built from their configs.

Sources: the built-in names of ``configs/diffusers/*.json`` (``sd-1.5``, ``sdxl``, ``dit-xl-2-256``,
``flux-dev``, ``flux-schnell``, ``sd3-medium``; also their Hugging Face ids), or a diffusers
``config.json`` (a file, or a directory holding one) whose ``_class_name`` is one of :data:`CLASSES`.
The model is the diffusers class built by ``from_config`` in the ambient device context (the meta
device for estimates: no weights), so it is exactly the library's (diffusers is an optional extra:
``pip install memlens[diffusion]``).

The batch is what diffusers' training scripts feed the denoiser, with the VAE and the text
encoders frozen and run before it: their outputs are the inputs here, in the scripts'
``weight_dtype`` (the mixed-precision dtype, else the weights'), and the VAE / text encoders
themselves are not on the GPU in this estimate (precomputed latents and text states):

- UNet2DConditionModel (examples/text_to_image/train_text_to_image.py): ``noisy_latents``
  [B, 4, S/8, S/8] for ``--image-size S``, ``timesteps`` int64 [B], ``encoder_hidden_states``
  [B, 77, cross_attention_dim] (CLIP's 77 tokens); SDXL (train_text_to_image_sdxl.py) adds
  ``added_cond_kwargs`` ``text_embeds`` [B, 1280] and ``time_ids`` [B, 6];
- DiTTransformer2DModel: latents, timesteps and ``class_labels`` int64 [B];
- FluxTransformer2DModel (examples/dreambooth/train_dreambooth_flux.py): 16-channel latents packed
  2x2 into [B, (S/16)^2, 64] (``FluxPipeline._pack_latents``), T5 states [B, 512, 4096]
  (``--seq-len`` sets T5's max_sequence_length), pooled CLIP [B, 768], ``img_ids`` [(S/16)^2, 3],
  ``txt_ids`` [512, 3], ``timestep`` fp32 [B], ``guidance`` (dev) a one-element tensor expanded to [B];
- SD3Transformer2DModel (train_dreambooth_sd3.py): 16-channel latents [B, 16, S/8, S/8], T5+CLIP
  states [B, 77 + 256, 4096], pooled [B, 2048], ``timestep`` fp32 [B].

The loss is the scripts' ``F.mse_loss(model_pred.float(), target.float(), reduction="mean")``
against the noise (Flux: the prediction unpacked first, ``FluxPipeline._unpack_latents``; DiT
with learned sigma: its first ``in_channels`` output channels, the epsilon half). Gradient
checkpointing is the model's own ``enable_gradient_checkpointing()``; LoRA is peft's on the
attention projections ``to_q, to_k, to_v, to_out.0`` through ``model.add_adapter`` as diffusers'
LoRA scripts do (train_dreambooth_lora_sdxl.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..core.errors import ModelSourceError, SpecError, sentences
from ..core.quiet import silenced
from ..core.spec import TrainingSpec
from .adapt import Built, apply_freeze, torch_dtype

TASK = "diffusion"
KIND = "diffusers"
CLASSES = ("UNet2DConditionModel", "DiTTransformer2DModel", "FluxTransformer2DModel", "SD3Transformer2DModel")
LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")   # train_dreambooth_lora_sdxl.py: unet_target_modules
VAE_SCALE = 8            # 2 ** (len(vae.config.block_out_channels) - 1): the SD, SDXL, SD3 and Flux VAEs
CLIP_TOKENS = 77         # CLIP tokenizers' model_max_length
T5_TOKENS = {"FluxTransformer2DModel": 512, "SD3Transformer2DModel": 256}   # the scripts' max_sequence_length defaults


# ---------------------------------------------------------------- sources
@lru_cache(maxsize=None)
def _index() -> dict[str, dict]:
    out = {}
    for entry in resources.files("memlens.models").joinpath("configs", "diffusers").iterdir():
        if entry.name.endswith(".json"):
            doc = json.loads(entry.read_text())
            out[doc["name"]] = doc
    return out


def names() -> list[str]:
    """The built-in diffusion models.

    >>> "sd-1.5" in names() and "flux-dev" in names()
    True
    """
    return sorted(_index())


def _builtin(model: str) -> dict | None:
    key = model.strip().lower()
    for doc in _index().values():
        ids = [doc["name"], doc["hf_id"], doc["hf_id"].split("/")[-1], *doc.get("aliases", ())]
        if key in (i.lower() for i in ids):
            return doc
    return None


def _local_config(model: str) -> dict | None:
    """A diffusers config.json (the file, or a directory holding it) naming one of :data:`CLASSES`."""
    path = Path(model).expanduser()
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return None     # not ours to judge: models/source.py reads it and says what is wrong
    return cfg if isinstance(cfg, dict) and cfg.get("_class_name") else None


def diffusion_config(model: str) -> tuple[str, dict] | None:
    """(name, diffusers config) of a built-in diffusion name or a diffusers config file, else None (not one);
    models/source.py makes its ModelSource (kind ``KIND``, task ``TASK``)."""
    doc = _builtin(model)
    cfg = doc["config"] if doc is not None else _local_config(model) if os.path.exists(model.strip()) else None
    if cfg is None:
        return None
    cls = cfg.get("_class_name")
    name = doc["name"] if doc is not None else model.strip()
    if cls not in CLASSES:
        raise ModelSourceError(f"{name}: diffusers class {cls!r} is not one memlens builds ({', '.join(CLASSES)})",
                               hint="use pkg.module:factory returning (model, batch, loss_fn) for other diffusers models")
    _require_diffusers(name)
    return name, dict(cfg)


def _require_diffusers(name: str) -> None:
    import importlib.util

    if importlib.util.find_spec("diffusers") is None:
        raise ModelSourceError(f"--model {name} needs diffusers, which is not installed",
                               hint="pip install memlens[diffusion] (or pip install diffusers)")


# ---------------------------------------------------------------- building
def construct(config: dict, dtype=None):
    """The diffusers model of ``config`` (random init) in the ambient device context, in ``dtype``.

    Its parameters are made in ``dtype`` (torch's default dtype while it is built, as transformers'
    ``from_config(dtype=...)`` does), then the rest is cast: on a GPU, a bf16 Flux never holds its
    47.6 GB of fp32 weights."""
    import diffusers  # optional: diffusers (memlens[diffusion])
    import torch  # heavy: torch, loaded on first use

    cfg = dict(config)
    cls = getattr(diffusers, cfg.pop("_class_name"))
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    default = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        model = cls.from_config(cfg)
    except Exception as e:  # noqa: BLE001 - any constructor failure is one line
        raise ModelSourceError(f"diffusers cannot build {cls.__name__} from this config: {type(e).__name__}: {sentences(e)}",
                               hint="check the config (the published config.json of the model's subfolder)") from None
    finally:
        torch.set_default_dtype(default)
    if dtype is not None:
        with silenced("diffusers", logging.ERROR):   # its note on casting with to(): no module keeps fp32 here
            model.to(dtype)
    return model


def batch_dtype(spec: TrainingSpec):
    """The scripts' ``weight_dtype``: the mixed-precision dtype, else the weights' (latents and text states)."""
    return torch_dtype(spec.autocast_dtype or spec.param_dtype)


def _image_size(spec: TrainingSpec, cfg: dict, name: str) -> int:
    cls = cfg["_class_name"]
    step = VAE_SCALE * (2 if cls == "FluxTransformer2DModel" else cfg.get("patch_size") or 1)
    default = (cfg.get("sample_size") or 128) * VAE_SCALE if cls != "FluxTransformer2DModel" else 1024
    S = spec.image_size or default
    if S % step:
        raise SpecError(f"image_size {S} is not a multiple of {step}: {name}'s latents are the image / {VAE_SCALE}"
                        + (f", cut in {step // VAE_SCALE}x{step // VAE_SCALE} patches" if step > VAE_SCALE else ""),
                        hint=f"use --image-size {max(step, S // step * step)}")
    return S


def _text_tokens(spec: TrainingSpec, cls: str, name: str) -> int:
    if cls in T5_TOKENS:
        if spec.seq_len is not None and spec.seq_len > 512:
            raise SpecError(f"seq_len {spec.seq_len} exceeds T5's 512 tokens ({name}'s max_sequence_length)", hint="use --seq-len 512 or less")
        t5 = spec.seq_len or T5_TOKENS[cls]
        return t5 if cls == "FluxTransformer2DModel" else CLIP_TOKENS + t5   # SD3: CLIP's 77 and T5's, concatenated
    if spec.seq_len is not None:
        what = "CLIP's 77 text tokens" if cls == "UNet2DConditionModel" else "no text (class labels)"
        raise SpecError(f"--seq-len does not apply to {name}: its conditioning is {what}",
                        hint="drop --seq-len; --image-size sets the latents")
    return CLIP_TOKENS


def make_diffusion_batch(spec: TrainingSpec, cfg: dict, name: str) -> tuple[dict, int, int]:
    """(batch, text tokens, image size): the denoiser's inputs and the ``target`` noise (see the module docstring)."""
    import torch  # heavy: torch, loaded on first use

    B, cls = spec.batch_size, cfg["_class_name"]
    S = _image_size(spec, cfg, name)
    T = _text_tokens(spec, cls, name)
    wd = batch_dtype(spec)
    h = S // VAE_SCALE
    C = cfg.get("in_channels", 4)
    if cls == "UNet2DConditionModel":
        batch = {"sample": torch.randn(B, C, h, h, dtype=wd), "timestep": torch.randint(0, 1000, (B,)),
                 "encoder_hidden_states": torch.randn(B, T, cfg["cross_attention_dim"], dtype=wd)}
        if cfg.get("addition_embed_type") == "text_time":   # SDXL: pooled text embeds and the 6 size/crop ids
            pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
            batch["added_cond_kwargs"] = {"text_embeds": torch.randn(B, pooled, dtype=wd), "time_ids": torch.randn(B, 6, dtype=wd)}
        elif cfg.get("addition_embed_type"):
            raise SpecError(f"{name}: addition_embed_type {cfg['addition_embed_type']!r} is not modelled (SDXL's text_time is)",
                            hint="use pkg.module:factory with the batch your script feeds it")
        target = torch.randn(B, cfg.get("out_channels") or C, h, h, dtype=wd)
    elif cls == "DiTTransformer2DModel":
        batch = {"hidden_states": torch.randn(B, C, h, h, dtype=wd), "timestep": torch.randint(0, 1000, (B,)),
                 "class_labels": torch.randint(0, cfg.get("num_embeds_ada_norm") or 1000, (B,))}
        target = torch.randn(B, C, h, h, dtype=wd)
    elif cls == "FluxTransformer2DModel":
        n = (h // 2) ** 2                   # FluxPipeline._pack_latents: 2x2 patches of the 16-channel latents
        batch = {"hidden_states": torch.randn(B, n, C, dtype=wd),
                 "encoder_hidden_states": torch.randn(B, T, cfg["joint_attention_dim"], dtype=wd),
                 "pooled_projections": torch.randn(B, cfg["pooled_projection_dim"], dtype=wd),
                 "timestep": torch.rand(B), "img_ids": torch.randn(n, 3, dtype=wd), "txt_ids": torch.zeros(T, 3, dtype=wd)}
        if cfg.get("guidance_embeds"):
            batch["guidance"] = torch.tensor([3.5]).expand(B)   # torch.tensor([args.guidance_scale]).expand(bsz)
        target = torch.randn(B, C // 4, h, h, dtype=wd)
    else:   # SD3Transformer2DModel
        batch = {"hidden_states": torch.randn(B, C, h, h, dtype=wd),
                 "encoder_hidden_states": torch.randn(B, T, cfg["joint_attention_dim"], dtype=wd),
                 "pooled_projections": torch.randn(B, cfg["pooled_projection_dim"], dtype=wd), "timestep": torch.rand(B) * 1000}
        target = torch.randn(B, cfg.get("out_channels") or C, h, h, dtype=wd)
    batch["return_dict"] = False
    batch["target"] = target
    return batch, T, S


def mse_loss(out, batch):
    """``F.mse_loss(model_pred.float(), target.float(), reduction="mean")`` (train_text_to_image.py).

    Flux's packed prediction is unpacked first (``FluxPipeline._unpack_latents``: view, permute,
    reshape: a copy); a prediction with more channels than the target (DiT's learned sigma) is
    compared on its first channels (the epsilon half)."""
    import torch.nn.functional as F  # heavy: torch, loaded on first use

    pred = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
    target = batch["target"]
    if pred.dim() == 3:    # Flux: [B, (h/2)(w/2), C*4] -> [B, C, h, w]
        B, _, ch = pred.shape
        h, w = target.shape[-2:]
        pred = pred.view(B, h // 2, w // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, ch // 4, h, w)
    elif pred.shape[1] != target.shape[1]:
        pred = pred[:, :target.shape[1]]
    return F.mse_loss(pred.float(), target.float(), reduction="mean")


def build_diffusion(spec: TrainingSpec, source, device: Any = None) -> Built:
    """Model (dtype, freezing, checkpointing, LoRA applied) and its batch (see the module docstring)."""
    import torch  # heavy: torch, loaded on first use

    _refuse(spec, source)
    cfg = dict(source.config)
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    notes: tuple[str, ...] = (f"{source.name}: the denoiser alone; the VAE and text encoders are frozen and not on the GPU "
                              "here (precomputed latents and text states, in the scripts' weight_dtype)",)
    with ctx:
        batch, T, S = make_diffusion_batch(spec, cfg, source.name)
        if cfg["_class_name"] == "DiTTransformer2DModel":
            cfg["sample_size"] = S // VAE_SCALE   # its position embedding for that many patches (a fine-tune at that size)
        model = construct(cfg, torch_dtype(spec.param_dtype))
    model.train()
    apply_freeze(model, spec.freeze)
    if spec.grad_checkpointing:
        model.enable_gradient_checkpointing()   # diffusers' ModelMixin: torch.utils.checkpoint, use_reentrant=False
    if spec.lora_rank:
        model = _add_lora(model, spec)
    keys = frozenset(k for k in batch if k != "target")
    seq = T if cfg["_class_name"] in T5_TOKENS else None
    return Built(model, batch, mse_loss, seq, S, forward_keys=keys, notes=notes)


def _add_lora(model, spec: TrainingSpec):
    """peft's LoRA as diffusers' LoRA scripts add it: ``LoraConfig(r, lora_alpha, init_lora_weights="gaussian",
    target_modules=["to_k", "to_q", "to_v", "to_out.0"])`` then ``model.add_adapter(config)`` (every other
    parameter frozen first, ``unet.requires_grad_(False)``)."""
    from peft import LoraConfig  # heavy: peft, loaded on first use

    model.requires_grad_(False)
    targets = list(spec.lora_targets) if spec.lora_targets else list(LORA_TARGETS)
    cfg = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha or 2 * spec.lora_rank, lora_dropout=spec.lora_dropout,
                     init_lora_weights="gaussian", target_modules=targets)
    try:
        if hasattr(model, "add_adapter"):
            model.add_adapter(cfg)
        else:     # DiTTransformer2DModel has no PeftAdapterMixin: what add_adapter runs (diffusers/loaders/peft.py)
            from peft import inject_adapter_in_model  # heavy: peft, loaded on first use

            inject_adapter_in_model(cfg, model)
    except (ValueError, TypeError, AttributeError) as e:
        raise SpecError(f"LoRA cannot be applied: {sentences(e) or type(e).__name__}",
                        hint="name the modules with --lora-targets (diffusers' attention: to_q,to_k,to_v,to_out.0)") from None
    return model


def _refuse(spec: TrainingSpec, source) -> None:
    """Settings a diffusers denoiser does not take, in one line each."""
    if spec.hf_trainer:
        raise SpecError(f"--hf-trainer: {source.name} is trained by diffusers' scripts (accelerate), not transformers' Trainer",
                        hint="drop --hf-trainer")
    if spec.qlora:
        raise SpecError(f"--qlora is not modelled for {source.name} (bitsandbytes' 4-bit layers in a diffusers model)",
                        hint="use --lora-rank alone")
    if spec.attn != "sdpa":
        raise SpecError(f"--attn {spec.attn}: diffusers' attention processors run SDPA (AttnProcessor2_0)", hint="drop --attn")
    if spec.checkpoint_layers is not None or spec.checkpoint_policy != "full" or spec.offload_layers is not None:
        raise SpecError(f"{source.name} checkpoints through diffusers' enable_gradient_checkpointing (every block, full "
                        "recomputation)", hint="use --grad-checkpointing alone")
    if spec.use_cache is not None or spec.loss != "model":
        raise SpecError(f"--use-cache/--no-cache and --loss are for transformers' language models, not {source.name}",
                        hint="drop them (the loss is the scripts' MSE against the noise)")


__all__ = ["diffusion_config", "KIND", "TASK", "build_diffusion", "make_diffusion_batch", "mse_loss", "names", "CLASSES", "LORA_TARGETS"]
