"""Hugging Face ``TrainingArguments`` -> TrainingSpec fields, as the Trainer would apply them.

A file is JSON as ``TrainingArguments.to_json_string()`` writes it, or YAML as
``HfArgumentParser.parse_yaml_file`` reads it (a flat mapping of argument: value). What it leaves
out takes the installed transformers' defaults (5.x: ``optim="adamw_torch_fused"``,
``max_grad_norm=1.0``, ``per_device_train_batch_size=8``).

=================================  ===============================================================
TrainingArguments                  TrainingSpec
=================================  ===============================================================
per_device_train_batch_size        batch_size
gradient_accumulation_steps        grad_accum
bf16 / fp16 over the weights'      fp32 weights: amp-bf16 / amp-fp16; bf16 weights: bf16-amp
dtype (``--precision``, else the   (bf16 autocast over bf16 weights); neither: the weights' dtype
config's ``dtype``, what
from_pretrained loads)
gradient_checkpointing /           grad_checkpointing (non-reentrant, transformers 5.x's default)
activation_checkpointing
optim (+ optim_args momentum)      optimizer (aliases in memlens.core.optimizers)
max_grad_norm                      max_grad_norm (0: no clipping)
torch_compile                      compile
use_liger_kernel                   liger (memlens.models.liger; liger_kernel_config: defaults only)
(always)                           hf_trainer (fp32 outputs under AMP, decay/no-decay groups)
=================================  ===============================================================

Settings that change memory in ways memlens does not model are refused in one line (deepspeed,
fsdp, label smoothing, reentrant checkpointing); settings that do not touch one step's memory
(learning rate, logging, saving...) are read and ignored. A name that is no TrainingArguments
field and looks like a misspelling of one memlens reads is refused; other unknown names
(fields of another transformers version) are ignored.

>>> spec_fields({"per_device_train_batch_size": 4, "bf16": True}, weights="fp32")["precision"]
'amp-bf16'
>>> f = spec_fields({}, weights="fp32"); f["optimizer"], f["max_grad_norm"], f["batch_size"]
('adamw-fused', 1.0, 8)
"""
from __future__ import annotations

import difflib
import json
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import SpecError
from ..core.optimizers import HF_OPTIM_ALIASES
from ..models.build import quiet
from ..models.source import resolve
from .trl_args import FALLBACK as _TRL_READ
from .trl_args import detect, number, trl_defaults, trl_fields, whole

# transformers 5.x TrainingArguments defaults (training_args.py), used when transformers cannot be imported
_FALLBACK_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "bf16": False, "fp16": False,
                      "gradient_checkpointing": False, "optim": "adamw_torch_fused", "max_grad_norm": 1.0,
                      "torch_compile": False, "optim_args": None}


def trainer_defaults() -> dict[str, Any]:
    """Defaults of the installed transformers' TrainingArguments (the fields memlens reads)."""
    try:
        from transformers import TrainingArguments  # heavy: transformers, loaded on first use
    except ImportError:
        return dict(_FALLBACK_DEFAULTS)
    out = {}
    for f in fields(TrainingArguments):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    out = {k: (getattr(v, "value", v)) for k, v in out.items()}   # OptimizerNames -> str
    for k, v in _FALLBACK_DEFAULTS.items():
        out.setdefault(k, v)
    return out


def load_file(path: str | Path) -> dict[str, Any]:
    """A TrainingArguments JSON or YAML file as a dict (one line on any problem)."""
    p = Path(path)
    if not p.exists():
        raise SpecError(f"trainer-args file {p} does not exist", hint="give the JSON TrainingArguments.to_json_string() wrote, or a YAML file")
    if p.is_dir():
        raise SpecError(f"trainer-args {p} is a directory, not a file", hint="give the JSON TrainingArguments.to_json_string() wrote, or a YAML file")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise SpecError(f"{p} is neither JSON nor valid YAML (not UTF-8 text)", hint="one `argument: value` per line, as HfArgumentParser reads") from None
    except OSError as e:
        raise SpecError(f"cannot read trainer-args {p}: {e.strerror or e}", hint="check the path given to --trainer-args") from None
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" or text.lstrip().startswith("{") else None
    except json.JSONDecodeError as e:
        raise SpecError(f"{p} is not valid JSON (line {e.lineno}: {e.msg})", hint="write it with TrainingArguments.to_json_string()") from None
    if data is None:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            raise SpecError(f"{p} is neither JSON nor valid YAML", hint="one `argument: value` per line, as HfArgumentParser reads") from None
    if not isinstance(data, dict):
        raise SpecError(f"{p} must hold a mapping of TrainingArguments fields", hint="e.g. per_device_train_batch_size: 8")
    return data


# the TrainingArguments memlens reads (a misspelling of one of these would silently take the default)
READ = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "gradient_checkpointing",
        "activation_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs", "optim", "optim_args",
        "max_grad_norm", "torch_compile", "deepspeed", "fsdp", "label_smoothing_factor", "use_cache", "use_liger_kernel",
        "liger_kernel_config")


def _check_known(d: dict[str, Any], trainer: str = "hf") -> None:
    """Refuse a name that is no TrainingArguments field of the installed transformers (nor of the TRL config
    ``trainer`` names) and looks like a misspelling of one memlens reads. Other unknown names (fields of another
    transformers version, in a file written there) do not change one step's memory and are ignored."""
    from .trl_args import own_fields

    try:
        from transformers import TrainingArguments  # heavy: transformers, loaded on first use

        known = {f.name for f in fields(TrainingArguments)}
    except ImportError:
        known = set(_FALLBACK_DEFAULTS)
    read = READ + (tuple(_TRL_READ[trainer]) if trainer != "hf" else ())
    if trainer != "hf":
        known |= own_fields(trainer)
    what = "TrainingArguments" if trainer == "hf" else f"{trainer.upper()}Config".replace("GRPOCONFIG", "GRPOConfig")
    for k in d:
        if k in known or k in read:
            continue
        close = difflib.get_close_matches(k, read, n=1, cutoff=0.8)
        if close:
            raise SpecError(f"{k!r} is not a {what} field (did you mean {close[0]!r}?)",
                            hint=f"write {close[0]}: ... (see {'transformers.TrainingArguments' if trainer == 'hf' else 'trl.' + what})")


def _truthy(v: Any) -> bool:
    return bool(v) and str(v).lower() not in ("false", "no", "0", "none", "")


def _optim_args(v: Any) -> dict[str, str]:
    """TrainingArguments.optim_args: 'momentum=0.9,nesterov=true' (the Trainer's format)."""
    if not v:
        return {}
    if isinstance(v, dict):
        return {str(k): str(x) for k, x in v.items()}
    return dict(kv.split("=", 1) for kv in str(v).replace(" ", "").split(",") if "=" in kv)


def spec_fields(d: dict[str, Any], weights: str | None = None, trainer: str | None = None) -> dict[str, Any]:
    """TrainingSpec fields from a TrainingArguments mapping, or a TRL SFTConfig / DPOConfig / GRPOConfig one
    (memlens.integrations.trl_args; ``trainer``: the ``--trainer`` given, else told from the fields). ``weights``:
    the model's weight precision (fp32 | bf16 | fp16; the ``--precision`` given, or the model's dtype), default fp32."""
    t = detect(d, trainer)
    _check_known(d, t)
    a = {**trainer_defaults(), **(trl_defaults(t) if t != "hf" else {}), **d}
    if a.get("bf16") is None:      # TrlBaseConfig.__post_init__: bf16 = not fp16
        a["bf16"] = not _truthy(a.get("fp16"))
    for key, why in (("deepspeed", "DeepSpeed"), ("fsdp", "FSDP")):
        if a.get(key) not in (None, "", [], False, {}):
            raise SpecError(f"trainer args use {why} ({key}={a[key]!r}), which memlens does not model yet",
                            hint=f"drop {key} from the file to estimate one unsharded GPU")
    if _truthy(a.get("use_cache")):
        raise SpecError("use_cache=True keeps the model's key/value cache in its outputs, which memlens does not model for training",
                        hint="leave use_cache at the Trainer's default (False)")
    if (number(a, "label_smoothing_factor") if a.get("label_smoothing_factor") else 0) > 0:
        raise SpecError("label_smoothing_factor > 0: the Trainer computes that loss outside the model, which memlens does not model",
                        hint="set label_smoothing_factor to 0 for the estimate")
    if _truthy(a.get("bf16")) and _truthy(a.get("fp16")):
        raise SpecError("trainer args set both bf16 and fp16", hint="keep one of them")
    w = (weights or "fp32").replace("amp-", "")
    if w in ("bf16-amp",):
        w = "bf16"
    if w not in ("fp32", "bf16", "fp16"):
        raise SpecError(f"model weights precision {weights!r} is not fp32, bf16 or fp16", hint="give --precision fp32 or bf16")
    if _truthy(a.get("fp16")):
        if w != "fp32":
            raise SpecError(f"fp16=True over {w} weights: the Trainer's GradScaler needs fp32 weights", hint="load the model in fp32 for fp16 mixed precision")
        precision = "amp-fp16"
    elif _truthy(a.get("bf16")):
        precision = "amp-bf16" if w == "fp32" else ("bf16-amp" if w == "bf16" else None)
        if precision is None:
            raise SpecError("bf16=True over fp16 weights is not a Trainer setting memlens models", hint="load the model in fp32 or bf16")
    else:
        precision = w
    ckpt = _truthy(a.get("gradient_checkpointing")) or _truthy(a.get("activation_checkpointing"))
    ck_kwargs = a.get("gradient_checkpointing_kwargs") or a.get("activation_checkpointing_kwargs") or {}
    if ckpt and isinstance(ck_kwargs, dict) and _truthy(ck_kwargs.get("use_reentrant")):
        raise SpecError("reentrant gradient checkpointing (use_reentrant=True) is not modelled",
                        hint="memlens models transformers 5.x's default, use_reentrant=False")
    liger_cfg = a.get("liger_kernel_config") or {}
    if _truthy(a.get("use_liger_kernel")) and isinstance(liger_cfg, dict) and any(
            (k == "cross_entropy") == bool(v) for k, v in liger_cfg.items() if k != "model"):
        raise SpecError(f"liger_kernel_config={liger_cfg!r}: memlens models liger's default kernels only (RoPE, RMSNorm, "
                        "SwiGLU, fused linear cross entropy all on)", hint="drop liger_kernel_config for the estimate")
    optim = str(getattr(a.get("optim"), "value", a.get("optim")))

    if optim.lower() not in HF_OPTIM_ALIASES:
        raise SpecError(f"optim {optim!r} is not a Trainer optimizer memlens models", hint=f"use one of {', '.join(HF_OPTIM_ALIASES)}")
    optimizer = HF_OPTIM_ALIASES[optim.lower()]
    if optimizer == "sgd" and float(_optim_args(a.get("optim_args")).get("momentum", 0) or 0) > 0:
        optimizer = "sgd-momentum"
    out = {
        "batch_size": whole(a, "per_device_train_batch_size"),
        "grad_accum": whole(a, "gradient_accumulation_steps"),
        "precision": precision,
        "grad_checkpointing": ckpt,
        "optimizer": optimizer,
        "max_grad_norm": (number(a, "max_grad_norm") if a.get("max_grad_norm") else 0) or None,
        "compile": _truthy(a.get("torch_compile")),
        "hf_trainer": True,
        **({"liger": True} if _truthy(a.get("use_liger_kernel")) else {}),   # Trainer: _apply_liger_kernel_to_instance(model)
    }
    if t != "hf":
        out.update(trl_fields(a, t))
    return out


def weights_of_model(model: str) -> str:
    """The weights a Trainer user gets for ``model`` from ``from_pretrained`` (transformers 5:
    ``dtype="auto"``, the config's ``dtype``): fp32 | bf16 | fp16; fp32 when the config names none
    (memlens' built-in configs, factories)."""
    try:
        cfg = resolve(model).config
    except Exception:  # noqa: BLE001 - the spec's own validation reports a bad model later
        return "fp32"

    with quiet():   # transformers 5 warns that `torch_dtype` is deprecated (a stray line on stderr)
        dt = str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32").replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16"}.get(dt, "fp32")


def spec_fields_from_file(path: str | Path, weights: str | None = None, trainer: str | None = None) -> dict[str, Any]:
    """:func:`spec_fields` of a JSON/YAML TrainingArguments (or TRL config) file."""
    return spec_fields(load_file(path), weights, trainer)


__all__ = ["spec_fields", "spec_fields_from_file", "load_file", "trainer_defaults"]
