"""The optimizer a TrainingSpec names, built as torch (or transformers, or bitsandbytes) builds it.

Each name is an implementation, and each has its own memory (:mod:`memlens.core.optimizers`):

=================  ==========================================  ==========================================
name               state per parameter tensor                  transient in ``step()``
=================  ==========================================  ==========================================
adamw, adam        exp_avg, exp_avg_sq (param dtype);          ``_foreach_sqrt(exp_avg_sqs)``: one
(foreach)          ``step`` on the CPU                         parameter-sized list per param group
                                                               (torch/optim/adam.py ``_multi_tensor_adam``);
                                                               Adam with weight decay: one more (grads+wd*p)
adamw-fused,       exp_avg, exp_avg_sq; ``step`` a float32     none: one in-place kernel per (device, dtype)
adam-fused         tensor on the GPU (512 B block each)        (``_fused_adam``: ``torch._fused_adamw_``)
sgd                none                                        none (``_foreach_add_(params, grads)``)
sgd-momentum       momentum_buffer (first step: grad clone)    none
adafactor          row/col factors (torch.optim.Adafactor)     per tensor (single-tensor path, torch's
                                                               default): the variance estimate, turned
                                                               in place into the update: one
                                                               parameter-sized temporary
adafactor-hf       transformers' Adafactor, per parameter      grad**2 and update (fp32, parameter-sized)
adamw-8bit         2 x uint8 + fp32 absmax / 256 elements       none (bitsandbytes' in-place kernel)
paged-adamw-8bit   as adamw-8bit; tensors of >= 1e5 elements   none
                   in CUDA managed memory (not in the
                   caching allocator)
=================  ==========================================  ==========================================

On fake tensors (``simulate=True``) the CPU stands for CUDA: ``adamw`` asks for ``foreach=True``
(what torch picks on CUDA, torch/optim/optimizer.py ``_default_to_fused_or_foreach``), the fused
optimizers run torch's CPU fused kernel (same state, no temporaries, ``step`` on the device: see
:func:`memlens.core.tracker.tag_optimizer_state`), and bitsandbytes gets memory-faithful stand-ins
(:mod:`memlens.models.quant`). The CPU-side constant foreach AdamW adds to its CPU step counters
(``torch.tensor(1.0, device="cpu")``) is host memory on CUDA too: the simulation does not count it.

With ``spec.hf_trainer`` the parameters are split as ``Trainer.create_optimizer`` splits them: a
decay group and a no-decay group (biases and norm weights), each group's foreach step running
on its own (so the transient is the larger group's, not the sum); bitsandbytes 8-bit optimizers
then keep 32-bit states for ``nn.Embedding`` weights (the Trainer's GlobalOptimManager override).
"""
from __future__ import annotations

from ..core.errors import SpecError
from ..core.optimizers import optimizer_facts
from ..core.spec import TrainingSpec

LR = 1e-4


def param_groups(spec: TrainingSpec, model) -> list[dict]:
    """The optimizer's parameter groups: one group of the trainable parameters, or with
    ``spec.hf_trainer`` the Trainer's decay / no-decay split (transformers Trainer.create_optimizer;
    weight_decay 0.0, TrainingArguments' default, in both)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise SpecError("no trainable parameters", hint="check --freeze patterns (everything is frozen)")
    if not spec.hf_trainer:
        return [{"params": params}]
    decay = set(trainer_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def trainer_decay_parameter_names(model) -> list[str]:
    """``Trainer.get_decay_parameter_names`` of the installed transformers (it reads only the model)."""
    try:
        from transformers import Trainer  # heavy: transformers, loaded on first use

        return list(Trainer.get_decay_parameter_names(None, model))
    except Exception:  # noqa: BLE001 - older transformers: the rule it had (no bias, no LayerNorm)
        import torch  # heavy: torch, loaded on first use

        out = []
        for mname, mod in model.named_modules():
            for pname, _ in mod.named_parameters(recurse=False):
                if not isinstance(mod, torch.nn.LayerNorm) and "bias" not in pname:
                    out.append(f"{mname}.{pname}" if mname else pname)
        return out


def embedding_weights(model) -> set[int]:
    """ids of ``nn.Embedding`` weights (the Trainer optimizes them in 32 bits under bitsandbytes 8-bit)."""
    import torch  # heavy: torch, loaded on first use

    return {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}


def make_optimizer(spec: TrainingSpec, model, simulate: bool = False):
    """The optimizer the spec names, over the trainable parameters (see the module docstring).

    ``simulate``: fake CPU tensors stand for CUDA ones (foreach where torch picks it on CUDA;
    stand-ins for bitsandbytes).
    """
    import torch  # heavy: torch, loaded on first use

    groups = param_groups(spec, model)
    name = spec.optimizer
    entry = optimizer_facts(name)
    if entry.build is not None:          # a registered optimizer builds itself
        return entry.build(groups, spec, model, simulate)
    fe = {"foreach": True} if simulate else {}   # on CUDA torch picks foreach by itself
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=LR, **fe)
    if name == "adamw-fused":
        return torch.optim.AdamW(groups, lr=LR, fused=True)
    if name == "adam":
        return torch.optim.Adam(groups, lr=LR, **fe)
    if name == "adam-fused":
        return torch.optim.Adam(groups, lr=LR, fused=True)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=LR, **fe)
    if name == "sgd-momentum":
        return torch.optim.SGD(groups, lr=LR, momentum=0.9, **fe)
    if name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise SpecError("torch.optim.Adafactor needs torch >= 2.5", hint="upgrade torch or use --optimizer adafactor-hf")
        # foreach=None is the single-tensor path on CUDA too: Adafactor does not call
        # _default_to_fused_or_foreach (torch/optim/_adafactor.py; measured on an H100)
        return torch.optim.Adafactor(groups, lr=1e-2)
    if name == "adafactor-hf":
        from transformers.optimization import Adafactor  # heavy: transformers, loaded on first use

        # what the Trainer's optim="adafactor" builds (transformers/trainer_optimizer.py _get_adafactor)
        return Adafactor(groups, lr=LR, scale_parameter=False, relative_step=False)
    if name in ("adamw-8bit", "paged-adamw-8bit"):
        paged = name == "paged-adamw-8bit"
        fp32 = embedding_weights(model) if spec.hf_trainer else set()
        if not simulate:
            return _bnb_adamw8bit(groups, paged, fp32, model)
        from ..models.quant import AdamW8bitSim  # heavy: imports torch; memory-faithful stand-in (bitsandbytes needs a GPU)

        return AdamW8bitSim(groups, lr=LR, paged=paged, fp32_params=fp32)
    raise AssertionError(name)


def _bnb_adamw8bit(groups, paged: bool, fp32_params: set[int], model):
    try:
        import bitsandbytes as bnb  # optional: bitsandbytes (GPU)
    except ImportError:
        raise SpecError("--optimizer adamw-8bit needs bitsandbytes on a GPU", hint="pip install bitsandbytes") from None
    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    opt = cls(groups, lr=LR)
    if fp32_params:
        manager = bnb.optim.GlobalOptimManager.get_instance()
        import torch  # heavy: torch, loaded on first use

        for m in model.modules():
            if isinstance(m, torch.nn.Embedding):
                manager.register_module_override(m, "weight", {"optim_bits": 32})
    return opt


def clip_gradients(model, max_norm: float | None, scaler=None, optimizer=None) -> None:
    """``torch.nn.utils.clip_grad_norm_`` over the model's parameters, after unscaling the gradients
    when a GradScaler is in use, as accelerate's ``Accelerator.clip_grad_norm_`` does
    (unscale_gradients, then torch's clip: ``_foreach_norm`` per (device, dtype), one stacked total
    norm, ``_foreach_mul_`` by the clamped coefficient)."""
    import torch  # heavy: torch, loaded on first use

    if not max_norm:
        return
    if scaler is not None and optimizer is not None and hasattr(scaler, "unscale_"):
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)


__all__ = ["make_optimizer", "param_groups", "clip_gradients", "trainer_decay_parameter_names"]
