"""Build a model, its synthetic batch and its optimizer from a TrainingSpec.

The same functions serve the estimator (inside a fake-tensor mode: no memory, no weights) and the
profiler (on a real device with random weights), so both run exactly the same training step.
"""
from __future__ import annotations

import contextlib
import fnmatch
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from ..core.errors import ModelSourceError, SpecError
from ..core.spec import TrainingSpec
from .source import ModelSource

DEFAULT_SEQ_LEN = 512


@dataclass
class Built:
    """A model ready to train, its batch, and how to get a loss from its output."""

    model: Any
    batch: Any
    loss_fn: Callable | None = None
    seq_len: int | None = None
    image_size: int | None = None


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def build(spec: TrainingSpec, source: ModelSource, device: Any = None) -> Built:
    """Model (with precision, freezing, LoRA/QLoRA, checkpointing applied) and one micro-batch.

    Tensors are created in the ambient mode/device context, or on ``device`` if given.
    """
    if source.kind == "factory":
        return _build_factory(spec, source, device)
    model = _build_hf(spec, source, device)
    batch, seq_len, image_size = make_batch(spec, source, device)
    return Built(model, batch, None, seq_len, image_size)


# ---------------------------------------------------------------- Hugging Face models
def _auto_class(task: str):
    import transformers as tf

    return {
        "causal-lm": tf.AutoModelForCausalLM,
        "masked-lm": tf.AutoModelForMaskedLM,
        "image-classification": tf.AutoModelForImageClassification,
        "clip": tf.AutoModel,
        "vlm": tf.AutoModelForImageTextToText,
    }[task]


def _build_hf(spec: TrainingSpec, source: ModelSource, device: Any):
    import contextlib
    import copy

    import torch

    config = copy.deepcopy(source.config)
    _check_lengths(spec, source)
    dtype = torch_dtype(spec.param_dtype)
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    try:
        with ctx:
            model = _auto_class(source.task).from_config(config, attn_implementation=spec.attn, dtype=dtype)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise ModelSourceError(f"transformers cannot build {source.name!r}: {msg}",
                               hint="check the config (or use pkg.module:factory for custom code)") from None
    model.train()
    apply_freeze(model, spec.freeze)
    if spec.grad_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise SpecError(f"{source.name} does not support gradient checkpointing in transformers", hint="drop --grad-checkpointing")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.lora_rank:
        model = apply_lora(model, spec)
    if spec.qlora:
        from .quant import quantize_frozen_linears

        quantize_frozen_linears(model, compute_dtype=torch.bfloat16 if spec.precision != "fp16" and spec.precision != "amp-fp16" else torch.float16)
    return model


def _check_lengths(spec: TrainingSpec, source: ModelSource) -> None:
    cfg = source.config
    text_cfg = getattr(cfg, "text_config", None) or cfg
    max_pos = getattr(text_cfg, "max_position_embeddings", None) or getattr(text_cfg, "n_positions", None)
    if spec.seq_len and max_pos and spec.seq_len > max_pos and source.task != "vlm":
        raise SpecError(f"seq_len {spec.seq_len} exceeds {source.name}'s {max_pos} positions", hint=f"use --seq-len {max_pos} or less")


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


def apply_lora(model, spec: TrainingSpec):
    from peft import LoraConfig, get_peft_model

    targets: Any = list(spec.lora_targets) if spec.lora_targets else None
    mcfg = getattr(model, "config", None)      # None for a plain nn.Module from a factory
    if targets is None and hasattr(mcfg, "text_config") and hasattr(mcfg, "vision_config"):
        # VLMs: peft has no default; adapt the language model's attention like text LLMs (q, v)
        targets = r".*language_model.*\.(q_proj|v_proj)$"
    cfg = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha or 2 * spec.lora_rank, lora_dropout=0.0,
                     target_modules=targets, bias="none")
    try:
        model = get_peft_model(model, cfg)
    except ValueError as e:
        msg = str(e).splitlines()[0][:160]
        raise SpecError(f"LoRA cannot be applied: {msg}", hint="name the modules with --lora-targets q_proj,v_proj") from None
    if spec.grad_checkpointing:
        model.enable_input_require_grads()
    return model


# ---------------------------------------------------------------- batches
def default_seq_len(spec: TrainingSpec, source: ModelSource) -> int:
    cfg = source.config
    if source.task == "clip":
        return min(spec.seq_len or 77, cfg.text_config.max_position_embeddings)
    if source.task == "vlm":
        n_img = image_tokens(source) * spec.images_per_sample
        return spec.seq_len or n_img + DEFAULT_SEQ_LEN
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or DEFAULT_SEQ_LEN
    return spec.seq_len or min(DEFAULT_SEQ_LEN, max_pos)


def image_tokens(source: ModelSource) -> int:
    """Image placeholder tokens per image for LLaVA-style VLMs (patches, minus CLS for 'default')."""
    cfg = source.config
    n = getattr(cfg, "image_seq_length", None)
    if n:
        return int(n)
    v = cfg.vision_config
    return (v.image_size // v.patch_size) ** 2


def make_batch(spec: TrainingSpec, source: ModelSource, device: Any = None):
    """One synthetic micro-batch for the task. Returns (batch dict, seq_len, image_size)."""
    import torch

    B = spec.batch_size
    cfg = source.config
    dev = {"device": device} if device is not None else {}
    pix_dtype = torch_dtype(spec.param_dtype)
    task = source.task
    if task in ("causal-lm", "masked-lm"):
        L = default_seq_len(spec, source)
        ids = torch.randint(0, cfg.vocab_size, (B, L), **dev)
        return {"input_ids": ids, "labels": ids}, L, None
    if task == "image-classification":
        S = spec.image_size or cfg.image_size
        n_labels = max(getattr(cfg, "num_labels", 2), 2)
        return {"pixel_values": torch.randn(B, 3, S, S, dtype=pix_dtype, **dev),
                "labels": torch.randint(0, n_labels, (B,), **dev)}, None, S
    if task == "clip":
        S = spec.image_size or cfg.vision_config.image_size
        L = default_seq_len(spec, source)
        return {"input_ids": torch.randint(0, cfg.text_config.vocab_size, (B, L), **dev),
                "pixel_values": torch.randn(B, 3, S, S, dtype=pix_dtype, **dev), "return_loss": True}, L, S
    if task == "vlm":
        S = spec.image_size or cfg.vision_config.image_size
        if S != cfg.vision_config.image_size:
            raise SpecError(f"{source.name} takes {cfg.vision_config.image_size}px images", hint="drop --image-size (multi-resolution VLMs: use a factory)")
        n_img = image_tokens(source) * spec.images_per_sample
        L = default_seq_len(spec, source)
        if L < n_img + 1:
            raise SpecError(f"seq_len {L} leaves no room for {n_img} image tokens", hint=f"use --seq-len {n_img + 256} or more")
        vocab = cfg.text_config.vocab_size
        image_token = cfg.image_token_id if hasattr(cfg, "image_token_id") else cfg.image_token_index
        text = torch.randint(0, min(vocab, image_token), (B, L - n_img), **dev)
        img = torch.full((B, n_img), image_token, dtype=torch.long, **dev)
        ids = torch.cat([img, text], dim=1)
        return {"input_ids": ids, "labels": ids,
                "pixel_values": torch.randn(B * spec.images_per_sample, 3, S, S, dtype=pix_dtype, **dev)}, L, S
    raise AssertionError(task)


# ---------------------------------------------------------------- factories
def _build_factory(spec: TrainingSpec, source: ModelSource, device: Any) -> Built:
    import contextlib

    import torch

    fn = source.factory
    try:
        takes_spec = len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):
        takes_spec = False
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    with ctx:
        out = fn(spec) if takes_spec else fn()
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        raise ModelSourceError(f"factory {source.name} must return (model, batch) or (model, batch, loss_fn)",
                               hint="e.g. `return model, {'input_ids': ids, 'labels': ids}`")
    model, batch = out[0], out[1]
    loss_fn = out[2] if len(out) == 3 else None
    if not isinstance(model, torch.nn.Module):
        raise ModelSourceError(f"factory {source.name} returned {type(model).__name__}, not an nn.Module", hint="return (model, batch)")
    model.train()
    apply_freeze(model, spec.freeze)
    if spec.lora_rank:
        model = apply_lora(model, spec)
    return Built(model, batch, loss_fn)


@contextlib.contextmanager
def quiet():
    """Silence transformers' logging and Python warnings while a model is built or run."""
    import logging
    import warnings

    tlog = logging.getLogger("transformers")
    old = tlog.level
    tlog.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            tlog.setLevel(old)
