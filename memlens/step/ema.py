"""EMA weights (``--ema``): diffusers' ``EMAModel`` over the trainable parameters, on the GPU.

What diffusers' training scripts do (examples/text_to_image/train_text_to_image.py,
train_text_to_image_sdxl.py) and what it allocates (diffusers/training_utils.py ``EMAModel``):

- setup: ``EMAModel(parameters, foreach=args.foreach_ema)`` keeps ``shadow_params = [p.clone().detach()
  for p in parameters]``, each in its parameter's dtype, then ``ema_unet.to(accelerator.device)``: one
  copy of the tracked parameters' bytes, resident for the whole run. The scripts track a separate fp32
  UNet's parameters, which are the trained UNet's (fp32 weights under mixed precision); here the
  trainable parameters themselves (with LoRA: the adapters only);
- after ``optimizer.step()`` and ``optimizer.zero_grad()`` (gradients already freed):
  ``ema_unet.step(unet.parameters())``. With ``foreach=False`` (the default) a loop over the
  parameters, ``s_param.sub_(one_minus_decay * (s_param - param))``: two temporaries the size of one
  parameter at a time (the largest one's are the peak); with ``foreach=True`` (``--ema foreach``)
  ``torch._foreach_sub_(shadow, torch._foreach_sub(shadow, params), alpha=1 - decay)``: a temporary
  copy of every tracked parameter at once.

The real ``EMAModel`` runs (diffusers is needed: ``pip install memlens[diffusion]``). It is the same
mechanism for any model, so ``--ema`` is allowed for any model a plain loop trains, on one GPU or
with DDP / ZeRO-1 (each rank holds the whole shadow). Refused: DP-SGD (Opacus' step), the Trainer's
step (transformers' Trainer has no EMA), FSDP2 sharding (a shadow of sharded DTensors), and
``offload_ema`` (pinned host copies moved to the GPU for each update: not a flag here).
"""
from __future__ import annotations

from ..core.errors import SpecError
from ..core.spec import TrainingSpec

ATTR = "memlens_ema"       # on the optimizer: (EMAModel, the parameters it tracks)
LABEL = "(ema weights)"    # the module label its shadow is accounted under


def refuse(plan) -> None:
    """What ``--ema`` cannot be combined with, in one line each (``plan``: the step's
    :class:`memlens.step.plan.StepPlan`; :func:`memlens.step.plan.resolve` asks)."""
    if not plan.spec.ema:
        return
    if plan.dp:
        raise SpecError("--ema with --dp is not modelled (Opacus' DP-SGD step)", hint="drop --ema or --dp")
    if plan.hf_trainer:
        raise SpecError("--ema with --hf-trainer: transformers' Trainer keeps no EMA weights", hint="drop --ema (a callback's EMA is not modelled)")
    if plan.distributed and plan.sharding.family == "fsdp":
        raise SpecError(f"--ema with --sharding {plan.sharding.name} is not modelled (a shadow of FSDP2's sharded parameters)",
                        hint="use --sharding ddp or zero1, or drop --ema")


def attach(spec: TrainingSpec, model, optimizer, applied: list[str]):
    """Build diffusers' EMAModel over ``model``'s trainable parameters and keep it on ``optimizer``
    (:func:`update` runs it after each step). Returns the optimizer."""
    if not spec.ema:
        return optimizer
    try:
        from diffusers.training_utils import EMAModel  # optional: diffusers (memlens[diffusion])
    except ImportError:
        raise SpecError("--ema runs diffusers' EMAModel, and diffusers is not installed",
                        hint="pip install memlens[diffusion] (or drop --ema)") from None
    params = [p for p in model.parameters() if p.requires_grad]
    foreach = spec.ema == "foreach"
    setattr(optimizer, ATTR, (EMAModel(params, foreach=foreach), params))
    applied.append(f"EMA weights: diffusers' EMAModel(foreach={foreach}) over the trainable parameters, on the GPU, "
                   "updated after zero_grad")
    return optimizer


def update(optimizer) -> None:
    """``ema.step(parameters)`` when the optimizer carries an EMA (else nothing)."""
    held = getattr(optimizer, ATTR, None)
    if held is not None:
        ema, params = held
        ema.step(params)


def shadow(optimizer) -> list:
    """(shadow tensor, the parameter it copies) of the EMA (empty without ``--ema``)."""
    held = getattr(optimizer, ATTR, None)
    return list(zip(held[0].shadow_params, held[1])) if held is not None else []


__all__ = ["attach", "update", "shadow", "refuse", "LABEL"]
