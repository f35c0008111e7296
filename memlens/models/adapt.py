"""What every model builder shares: the built model with its batch (:class:`Built`), the weight dtype,
``--freeze`` and LoRA (peft) applied to a built model."""
from __future__ import annotations

import collections
import fnmatch
from dataclasses import dataclass
from typing import Any, Callable

from ..core.errors import SpecError, sentences
from ..core.spec import TrainingSpec


@dataclass
class Built:
    """A model ready to train, its batch, and how to get a loss from its output.

    ``forward_keys``: for a dict batch, the entries the model's ``forward`` takes (None: all);
    the others reach only ``loss_fn``. ``step``: a factory's own ``step(model, batch) -> loss``.
    """

    model: Any
    batch: Any
    loss_fn: Callable | None = None
    seq_len: int | None = None
    image_size: int | None = None
    forward_keys: frozenset[str] | None = None
    step: Callable | None = None
    target_len: int | None = None
    notes: tuple[str, ...] = ()


# The synthetic batch's class labels are drawn from [0, num_labels): a model's check on them that
# reads data (DeBERTa's `(labels >= 0).nonzero()`) is answered from that (estimator/cuda_rules.py)
KNOWN = "_memlens_known"   # "nonnegative", or "all_true" (a comparison that holds for every element)


def mark_known(t, what: str = "nonnegative"):
    """``t``, marked as known without reading it: "nonnegative" (a synthetic batch's class labels) or "all_true"."""
    setattr(t, KNOWN, what)
    return t


def torch_dtype(name: str):
    import torch  # heavy: torch, loaded on first use

    return getattr(torch, name)


def apply_freeze(model, patterns) -> None:
    """Freeze parameters whose name contains a pattern (or matches it as a glob)."""
    for pat in patterns or ():
        hit = False
        for name, p in model.named_parameters():
            if pat in name or fnmatch.fnmatch(name, pat):
                p.requires_grad_(False)
                hit = True
        if not hit:
            tops = sorted({n.split(".")[0] for n, _ in model.named_parameters()})[:8]
            raise SpecError(f"--freeze {pat!r} matches no parameter", hint=f"top-level modules: {', '.join(tops)}")


# Attention projections LoRA adapts when peft has no default for a model type, as peft's own
# defaults do for Llama-like attention (q, v): the first pair whose names a model's Linear layers have
_ATTENTION_TARGETS = (("q_proj", "v_proj"), ("query_proj", "value_proj"), ("query", "value"), ("q", "v"),
                      ("qkv_proj",), ("Wqkv",), ("c_attn",), ("query_key_value",))


def default_lora_targets(model) -> list[str] | None:
    """LoRA targets for a transformers model whose model_type peft has no default for (OLMoE,
    other new MoE models): its attention projections; None where peft has a default (or no
    config, or a VLM, which :func:`apply_lora` handles)."""
    import torch  # torch and peft: heavy, loaded when a model is built with LoRA
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS  # heavy: peft, loaded on first use

    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) in PEFT_DEFAULTS or hasattr(cfg, "vision_config"):
        return None
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return next((list(pair) for pair in _ATTENTION_TARGETS if set(pair) <= linear), None)


def apply_lora(model, spec: TrainingSpec, targets: list[str] | None = None):
    """peft's LoRA on ``model``: ``spec.lora_targets``, else ``targets`` (:func:`default_lora_targets`), else peft's default."""
    from peft import LoraConfig, get_peft_model  # heavy: peft, loaded on first use

    params: list[str] | None = None
    if spec.lora_targets:
        targets, params = split_lora_targets(model, spec.lora_targets)
    mcfg = getattr(model, "config", None)      # None for a plain nn.Module from a factory
    if targets is None and hasattr(mcfg, "text_config") and hasattr(mcfg, "vision_config"):
        # VLMs: peft has no default; adapt the language model's attention like text LLMs (q, v)
        targets = r".*language_model.*\.(q_proj|v_proj)$"
    cfg = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha or 2 * spec.lora_rank, lora_dropout=spec.lora_dropout,
                     target_modules=targets, bias="none", **({"target_parameters": params} if params else {}))
    if targets is None and mcfg is None:   # a plain nn.Module: peft has no default targets for it
        names = adaptable_modules(model)
        raise SpecError("--lora-rank on a model without a transformers config needs --lora-targets "
                        + (f"(its Linear/Conv modules: {', '.join(names[:6])}{', ...' if len(names) > 6 else ''})" if names
                           else "(it has no Linear/Conv module LoRA can adapt)"),
                        hint=f"e.g. --lora-targets {','.join(names[:2])}" if names else "drop --lora-rank")
    try:
        model = get_peft_model(model, cfg)
    except (ValueError, TypeError, AttributeError) as e:
        msg = sentences(e) or type(e).__name__
        names = adaptable_modules(model)
        raise SpecError(f"LoRA cannot be applied: {msg}",
                        hint=(f"name the modules with --lora-targets (Linear/Conv modules: {', '.join(names[:6])})" if names
                              else "name the modules with --lora-targets q_proj,v_proj")) from None
    _check_rank(model, spec.lora_rank)
    if spec.grad_checkpointing:
        model.enable_input_require_grads()
    return model


ALL_LINEAR = "all-linear"   # peft's shorthand (peft/utils/constants.py INCLUDE_LINEAR_LAYERS_SHORTHAND)


def split_lora_targets(model, names) -> tuple[Any, list[str] | None]:
    """``--lora-targets`` as peft's LoraConfig takes it: (target_modules, target_parameters).

    ``all-linear`` (any case) stands alone and goes to peft as the string, which peft expands
    (tuners_utils ``_maybe_include_all_linear_layers``) to every nn.Linear / Conv1D except the output
    embedding (and, for a classifier, its head). A name that matches no module but ends the name of a
    parameter (peft's rule for target_parameters: ``key.endswith("." + name)``; the fused 3-D expert
    weights of transformers 5's MoE models, e.g. ``experts.gate_up_proj``, ``down_proj``) goes to
    ``target_parameters`` (peft's lora.ParamWrapper); every other name to ``target_modules``."""
    names = [n for n in names if n]
    if any(n.lower() == ALL_LINEAR for n in names):
        if len(names) > 1:
            raise SpecError(f"--lora-targets {ALL_LINEAR} is peft's shorthand for every linear layer: it stands alone, "
                            f"not beside {', '.join(n for n in names if n.lower() != ALL_LINEAR)}",
                            hint=f"use --lora-targets {ALL_LINEAR}, or list the modules")
        return ALL_LINEAR, None
    modules = [n for n, _ in model.named_modules() if n]
    param_keys = [f"{m}.{p}" for m, mod in model.named_modules() if m for p, _ in mod.named_parameters(recurse=False)]

    def ends(keys, name):
        return any(k == name or k.endswith("." + name) for k in keys)

    params = [n for n in names if not ends(modules, n) and ends(param_keys, n)]
    mods = [n for n in names if n not in params]
    return (mods if mods or not params else []), (params or None)


def expert_lora_note(model) -> str | None:
    """What LoRA on fused parameters costs, when peft wrapped any (lora.ParamWrapper: a name given for
    them, or peft 0.21's rewrite of v4 MoE names and ``all-linear`` into ``target_parameters`` for models
    transformers 5 fused, utils/transformers_weight_conversion.py ``_convert_peft_config_moe``)."""
    wrapped = {}
    for m in model.modules():
        if type(m).__name__ == "ParamWrapper":
            p = m.get_param()
            rank = next(iter(m.r.values()), 0)
            key = (m.parameter_name, tuple(p.shape), rank)
            wrapped[key] = wrapped.get(key, 0) + p.numel() * p.element_size()
    if not wrapped:
        return None
    what = ", ".join(f"{name} {'x'.join(map(str, shape))} r={r}" for name, shape, r in sorted(wrapped))
    total = sum(wrapped.values())
    return (f"LoRA on fused parameters through peft's target_parameters (lora.ParamWrapper): {what}; every forward folds "
            f"W + B@A into a full copy of each wrapped parameter (torch.baddbmm under a parametrization, {_mib(total)} MiB "
            "over all layers), which the experts' grouped matmul keeps for backward")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _check_rank(model, rank: int) -> None:
    """Refuse a rank above min(in, out) features of every adapted layer. The update B @ A of a
    layer has rank at most min(in, out), so a larger r adds parameters (r * (in + out), more than
    the layer's in * out) and nothing it could learn; peft itself does not check. A rank that
    exceeds some adapted layers only (a 2-class head among the targets) is peft's usual behaviour."""
    sizes = {}
    for name, m in model.named_modules():
        if hasattr(m, "lora_A") and isinstance(getattr(m, "in_features", None), int) \
                and isinstance(getattr(m, "out_features", None), int):
            sizes[name] = min(m.in_features, m.out_features)
    if sizes and rank > max(sizes.values()):
        name = max(sizes, key=sizes.get)
        widest = sizes[name]
        raise SpecError(f"--lora-rank {rank} is above the width of every adapted layer (at most {widest}: "
                        f"min(in, out) features of {name.rsplit('.', 1)[-1]}): a LoRA update has rank at most min(in, out), "
                        "a larger adapter only adds memory",
                        hint=f"use --lora-rank {widest} or less (8-64 is usual)")


def adaptable_modules(model) -> list[str]:
    """Names of the modules peft's LoRA can adapt (Linear, Embedding, Conv1d/2d/3d, transformers' Conv1D),
    as --lora-targets takes them (the last part of the name), most frequent first."""
    import torch  # heavy: torch, loaded on first use

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.modules.conv._ConvNd)
    count: collections.Counter = collections.Counter()
    for name, m in model.named_modules():
        if name and (isinstance(m, kinds) or type(m).__name__ == "Conv1D"):
            count[name.rsplit(".", 1)[-1]] += 1
    return [n for n, _ in count.most_common()]
