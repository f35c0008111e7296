"""Build a model, its synthetic batch and its optimizer from a TrainingSpec.

The same functions serve the estimator (inside a fake-tensor mode: no memory, no weights) and the
profiler (on a real device with random weights), so both run exactly the same training step.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import sys
from typing import Any

from ..core import usercode
from ..core.errors import ModelSourceError, SpecError, sentences
from ..core.quiet import silenced
from ..core.spec import TRL_TRAINERS, TrainingSpec
from .adapt import (  # noqa: F401 - re-exported
    Built,
    adaptable_modules,
    apply_freeze,
    apply_lora,
    default_lora_targets,
    expert_lora_note,
    mark_known,
    torch_dtype,
)
from .checkpoint import checkpoint_blocks, checkpoint_kwargs, offload_blocks
from .diffusion import build_diffusion
from .liger import apply_liger
from .source import ModelSource
from . import vlm
from .trl_batch import trl_batch
from .vision import build_vision_module

DEFAULT_SEQ_LEN = 512
DEFAULT_IMAGE_SIZE = 224   # ImageNet crops, for configs that do not name an image size (ResNet, RegNet)


def build(spec: TrainingSpec, source: ModelSource, device: Any = None, fake: bool = False) -> Built:
    """Model (with precision, freezing, LoRA/QLoRA, checkpointing applied) and one micro-batch.

    Tensors are created in the ambient mode/device context, or on ``device`` if given. ``fake``: the model will
    run on fake tensors (kernels that only a GPU runs, liger's, are simulated: models/liger.py).
    """
    if spec.pad_fraction and (source.kind in ("factory", "module", "timm", "torchvision") or source.task not in PADDED_TASKS):
        what = f"{source.task} ({source.name})" if source.task else f"{source.name}, a {source.kind}"
        raise SpecError(f"--pad-fraction pads token ids of text models ({', '.join(PADDED_TASKS)}), not {what}",
                        hint="drop --pad-fraction (a factory's batch carries its own attention_mask)")
    if source.kind == "factory":
        return _build_factory(spec, source, device)
    if source.kind == "module":
        return _build_module(spec, source)
    if source.kind in ("timm", "torchvision"):
        return build_vision_module(spec, source, device)
    if source.kind == "diffusers":
        return build_diffusion(spec, source, device)
    if spec.target_len is not None and source.task not in SEQ2SEQ_TASKS:
        raise SpecError(f"--target-len is for encoder-decoder models; {source.name} trains {source.task}",
                        hint="drop --target-len (or use --seq-len)")
    model, notes = _build_hf(spec, source, device, fake)
    batch, seq_len, image_size = make_batch(spec, source, device)
    if source.task == "vlm" and vlm.note(spec, source.config, DEFAULT_SEQ_LEN):
        notes += (vlm.note(spec, source.config, DEFAULT_SEQ_LEN),)
    target = int(batch["labels"].shape[1]) if source.task in SEQ2SEQ_TASKS else None
    return Built(model, batch, None, seq_len, image_size, target_len=target, notes=notes)


SEQ2SEQ_TASKS = ("seq2seq", "speech-seq2seq")
# tasks whose batch is token ids a tokenizer pads (--pad-fraction): an attention_mask over input_ids
PADDED_TASKS = ("causal-lm", "masked-lm", "seq-classification", "seq2seq")


# ---------------------------------------------------------------- Hugging Face models
def _auto_class(task: str):
    import transformers as tf  # heavy: transformers, loaded on first use

    return {
        "causal-lm": tf.AutoModelForCausalLM,
        "masked-lm": tf.AutoModelForMaskedLM,
        "seq-classification": tf.AutoModelForSequenceClassification,
        "seq2seq": tf.AutoModelForSeq2SeqLM,
        "speech-seq2seq": tf.AutoModelForSpeechSeq2Seq,
        "image-classification": tf.AutoModelForImageClassification,
        "clip": tf.AutoModel,
        "vlm": tf.AutoModelForImageTextToText,
    }[task]


def _release_build_cache(device: Any) -> None:
    """Return to the driver the segments that building left free on a CUDA device.

    ``from_config`` on the device makes a tied model's output weight, then ties it to the input
    embedding: an embedding-sized transient (measured on an H100: Llama-3.2-1B's model load peaks
    520 MB above its parameters and leaves a free 502 MiB segment in the cache). A user's
    ``from_pretrained`` ties before it materializes and leaves no such segment, and the estimate has
    none; kept, the step's first allocations (the cuBLAS workspace, activations) land in it and the
    reserved peak of a DP-SGD step with several physical batches moved by -5% / +8%."""
    import torch  # heavy: torch, loaded on first use

    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _build_hf(spec: TrainingSpec, source: ModelSource, device: Any, fake: bool = False):
    import torch  # heavy: torch, loaded on first use

    config = copy.deepcopy(source.config)
    length_notes = _check_lengths(spec, source)
    if spec.image_size and source.task == "image-classification" and hasattr(config, "image_size"):
        config.image_size = spec.image_size   # position embeddings for that many patches (as a fine-tune at that size)
    dtype = torch_dtype(spec.param_dtype)
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    notes: tuple[str, ...] = ()
    cls = _auto_class(source.task)
    try:
        attn = {"attn_implementation": spec.attn}
        if not has_attention(cls, config):
            attn = {}  # CNNs (ConvNeXt, ResNet): transformers refuses an attention implementation
            notes = (f"{source.name} has no attention layers: --attn does not apply",)
        elif spec.attn == "sdpa" and not supports_sdpa(cls, config):
            # what transformers does when no implementation is asked for: eager for a model without SDPA
            attn = {"attn_implementation": "eager"}
            notes = (f"{source.name} has no SDPA attention in transformers: it runs eager attention, as transformers "
                     "does when no implementation is asked for",)
        with ctx:
            model = cls.from_config(config, dtype=dtype, **attn)
        _release_build_cache(device)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        msg = sentences(e) or type(e).__name__
        raise ModelSourceError(f"transformers cannot build {source.name!r}: {msg}",
                               hint="check the config (or use pkg.module:factory for custom code)") from None
    notes += length_notes
    model.train()
    if spec.liger:       # liger-kernel's instance patch, before LoRA wraps the model (models/liger.py)
        apply_liger(model, spec, fake=fake)
    if spec.hf_trainer and hasattr(model.config, "use_cache"):
        model.config.use_cache = False   # the Trainer sets config.use_cache = args.use_cache (default False)
    elif spec.use_cache is not None and hasattr(model.config, "use_cache"):
        # with the cache, each layer's K and V are cat'd into a DynamicCache (new tensors the attention kernel keeps);
        # without it the kernel keeps V as a view of its projection: a fused qkv output (GPT-NeoX, GPT-2) stays alive
        model.config.use_cache = spec.use_cache
    apply_freeze(model, spec.freeze)
    compute = torch.float16 if spec.precision in ("fp16", "amp-fp16") else torch.bfloat16
    # a model that runs (not fake, not the formula's meta model): bitsandbytes' own 4-bit layers, as
    # from_pretrained(load_in_4bit) leaves them; else the memory-faithful stand-ins after LoRA (below)
    runs = not fake and next(model.parameters()).device.type != "meta"
    if spec.qlora and runs:
        from .quant import quantize_with_bitsandbytes  # heavy: imports torch; bitsandbytes on first use

        quantize_with_bitsandbytes(model, compute)
    if spec.kbit_prep:
        prepare_for_kbit(model, source.name)
    if spec.grad_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise SpecError(f"{source.name} does not support gradient checkpointing in transformers", hint="drop --grad-checkpointing")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(spec.checkpoint_policy))
        if spec.checkpoint_layers is not None:   # some layers: the others' own switch off (models/checkpoint.py)
            checkpoint_blocks(model, spec.checkpoint_layers, spec.checkpoint_policy)
    if spec.offload_layers is not None:          # save_on_cpu around the chosen blocks (models/checkpoint.py)
        offload_blocks(model, spec.offload_layers)
    if spec.lora_rank:
        targets = None if spec.lora_targets else default_lora_targets(model)
        if targets:
            notes += (f"LoRA targets {','.join(targets)}: peft has no default for model_type {model.config.model_type!r}, so "
                      "the attention projections, as peft's default for Llama-like attention (--lora-targets names others)",)
        model = apply_lora(model, spec, targets)
        fused = expert_lora_note(model)
        notes += (fused,) if fused else ()
    if spec.qlora:
        from .quant import quantize_frozen_linears, unquantized_note  # heavy: imports torch

        if not runs:   # the stand-ins go in after LoRA (its base layers among them): memory-faithful, no bitsandbytes
            quantize_frozen_linears(model, compute_dtype=compute, bias_dtype=torch.float32 if spec.kbit_prep else None)
        left = unquantized_note(model)
        if left:
            notes += (left,)
    return model, notes


def prepare_for_kbit(model, name: str) -> None:
    """peft's ``prepare_model_for_kbit_training(model)`` with its defaults, as QLoRA recipes call it on
    the 4-bit model before ``get_peft_model``: every parameter frozen, the fp16/bf16 parameters that are
    not 4-bit (norms, embeddings, lm_head, biases) cast to fp32, input gradients, and gradient
    checkpointing with ``gradient_checkpointing_kwargs={}`` (torch's checkpoint then defaults to
    use_reentrant=True). peft recognizes a quantized model by ``is_loaded_in_4bit`` (peft/utils/other.py
    ``prepare_model_for_kbit_training``): set here, since memlens puts its 4-bit stand-ins in after LoRA
    (:func:`memlens.models.quant.quantize_frozen_linears`); the linear weights peft casts to fp32 here
    are the ones those stand-ins replace, so what stays in fp32 is what stays outside 4-bit on a GPU."""
    from peft import prepare_model_for_kbit_training  # heavy: loaded for --kbit-prep only

    if not getattr(model, "supports_gradient_checkpointing", False):
        raise SpecError(f"--kbit-prep enables gradient checkpointing, which {name} does not support in transformers",
                        hint="drop --kbit-prep")
    model.is_loaded_in_4bit = True
    prepare_model_for_kbit_training(model)


def has_attention(cls, config) -> bool:
    """Whether the transformers class that ``cls`` (an Auto class) builds for ``config`` has
    attention layers, i.e. takes an attention implementation. Classes that support SDPA or
    attention backends do; convolutional ones (ConvNeXt, ResNet, RegNet...) declare neither."""
    try:
        model_cls = cls._model_mapping[type(config)]
    except (KeyError, AttributeError):
        return True
    return bool(getattr(model_cls, "_supports_sdpa", False) or getattr(model_cls, "_supports_attention_backend", False)
                or getattr(model_cls, "_supports_flash_attn", False) or getattr(model_cls, "_supports_flex_attn", False)
                or any("attention" in n.lower() for n in _module_class_names(model_cls)))


def supports_sdpa(cls, config) -> bool:
    """Whether the class ``cls`` builds for ``config`` takes attn_implementation="sdpa" (True when unknown)."""
    try:
        model_cls = cls._model_mapping[type(config)]
    except (KeyError, AttributeError):
        return True
    return bool(getattr(model_cls, "_supports_sdpa", True))


def _module_class_names(model_cls) -> list[str]:
    """Names of the classes defined in the modeling module of ``model_cls`` (a cheap look for
    attention modules in models that support no SDPA yet)."""
    import torch  # heavy: torch, loaded on first use

    mod = sys.modules.get(model_cls.__module__)
    return [n for n, v in vars(mod).items() if isinstance(v, type) and issubclass(v, torch.nn.Module)
            and v.__module__ == mod.__name__] if mod else []


# T5-style relative position buckets have no absolute position limit
_RELATIVE_POSITIONS = ("t5", "mt5", "umt5", "longt5", "switch_transformers")


def _check_lengths(spec: TrainingSpec, source: ModelSource) -> tuple[str, ...]:
    """Refuse lengths beyond a model's position embeddings; for relative-position models (no
    limit to refuse at) a note when a length passes the one their config trained at (n_positions)."""
    cfg = source.config
    if source.task == "speech-seq2seq":
        src = getattr(cfg, "max_source_positions", None)
        if spec.seq_len is not None:
            raise SpecError(f"{source.name}'s encoder takes a fixed {2 * src if src else 'length of'} mel frames, not --seq-len",
                            hint="drop --seq-len; --target-len sets the decoder tokens")
        tgt = getattr(cfg, "max_target_positions", None)
        if spec.target_len and tgt and spec.target_len > tgt:
            raise SpecError(f"target_len {spec.target_len} exceeds {source.name}'s {tgt} decoder positions", hint=f"use --target-len {tgt} or less")
        return ()
    if spec.image_size and source.task == "image-classification":
        _check_image_size(spec.image_size, source)
    text_cfg = getattr(cfg, "text_config", None) or cfg
    max_pos = getattr(text_cfg, "max_position_embeddings", None) or getattr(text_cfg, "n_positions", None)
    notes: tuple[str, ...] = ()
    if cfg.model_type in _RELATIVE_POSITIONS:
        trained = getattr(cfg, "n_positions", None)
        longer = [f"{what} {n}" for what, n in (("seq_len", spec.seq_len), ("target_len", spec.target_len))
                  if trained and n and n > trained]
        if longer:
            notes = (f"{source.name} has relative positions (no length limit), but {' and '.join(longer)} "
                     f"{'is' if len(longer) == 1 else 'are'} beyond the {trained} tokens it was trained on (n_positions): "
                     "memory is estimated as asked, attention grows with the square of the length",)
        max_pos = None
    if spec.seq_len and max_pos and spec.seq_len > max_pos and source.task != "vlm":
        raise SpecError(f"seq_len {spec.seq_len} exceeds {source.name}'s {max_pos} positions", hint=f"use --seq-len {max_pos} or less")
    if spec.target_len and max_pos and spec.target_len > max_pos:
        raise SpecError(f"target_len {spec.target_len} exceeds {source.name}'s {max_pos} decoder positions", hint=f"use --target-len {max_pos} or less")
    return notes


def _check_image_size(size: int, source: ModelSource) -> None:
    """Refuse an image smaller than one patch, or than a hierarchical model's (Swin, ConvNeXt: a
    ``depths`` list) last stage, whose feature map is the patch grid halved at each later stage."""
    cfg = source.config
    patch = getattr(cfg, "patch_size", None)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    if not isinstance(patch, int) or patch <= 0:
        return
    stages = len(getattr(cfg, "depths", None) or [1])
    smallest = patch * 2 ** (stages - 1)
    if size < smallest:
        why = (f"its {patch}-pixel patches" if stages == 1
               else f"its {patch}-pixel patches halved {stages - 1} times (its {stages} stages)")
        raise SpecError(f"image_size {size} is smaller than {source.name} can take: {why} need at least {smallest} pixels",
                        hint=f"use --image-size {smallest} or more (it was trained at {_trained_size(cfg)})")


def _trained_size(cfg) -> str:
    s = getattr(cfg, "image_size", None)
    return str(s[0] if isinstance(s, (list, tuple)) else s) if s else "its config's size"


# ---------------------------------------------------------------- batches
def default_seq_len(spec: TrainingSpec, source: ModelSource) -> int:
    cfg = source.config
    if source.task == "clip":
        return min(spec.seq_len or 77, cfg.text_config.max_position_embeddings)
    if source.task == "vlm":   # the language model's sequence (models/vlm.py: text and image tokens)
        return vlm.lm_length(spec, cfg, DEFAULT_SEQ_LEN)
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or DEFAULT_SEQ_LEN
    return spec.seq_len or min(DEFAULT_SEQ_LEN, max_pos)


def image_tokens(source: ModelSource) -> int:
    """Image tokens per image in the language model's sequence (models/vlm.py)."""
    return vlm.image_tokens(source.config)


def make_batch(spec: TrainingSpec, source: ModelSource, device: Any = None):
    """One synthetic micro-batch for the task. Returns (batch dict, seq_len, image_size)."""
    import torch  # heavy: torch, loaded on first use

    B = spec.batch_size
    cfg = source.config
    dev = {"device": device} if device is not None else {}
    pix_dtype = torch_dtype(spec.param_dtype)
    task = source.task
    if task in ("causal-lm", "masked-lm"):
        L = default_seq_len(spec, source)
        if spec.trainer in TRL_TRAINERS and task == "causal-lm":   # TRL's collators (models/trl_batch.py)
            return trl_batch(spec, cfg.vocab_size, L, dev), L, None
        ids = torch.randint(0, cfg.vocab_size, (B, L), **dev)
        if not spec.pad_fraction:
            return {"input_ids": ids, "labels": ids}, L, None
        mask, n = padding_mask(spec.pad_fraction, B, L, dev)
        labels = ids.clone()          # a collator's labels: a copy of the ids, -100 on padding
        labels[:, L - n:] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}, L, None
    if task == "seq-classification":
        L = default_seq_len(spec, source)
        n_labels = getattr(cfg, "num_labels", 2)
        labels = torch.randn(B, **dev) if n_labels == 1 else mark_known(torch.randint(0, n_labels, (B,), **dev))
        batch = {"input_ids": torch.randint(0, cfg.vocab_size, (B, L), **dev), "labels": labels}
        if spec.pad_fraction:
            batch["attention_mask"] = padding_mask(spec.pad_fraction, B, L, dev)[0]
        return batch, L, None
    if task == "seq2seq":  # the model makes decoder_input_ids from the labels (shift right)
        L = default_seq_len(spec, source)
        T = spec.target_len or L
        batch = {"input_ids": torch.randint(0, cfg.vocab_size, (B, L), **dev),
                 "labels": torch.randint(0, cfg.vocab_size, (B, T), **dev)}
        if spec.pad_fraction:         # the encoder's padding (the decoder's labels are the targets)
            batch["attention_mask"] = padding_mask(spec.pad_fraction, B, L, dev)[0]
        return batch, L, None
    if task == "speech-seq2seq":  # Whisper: 30 s of log-mel frames (2 x max_source_positions)
        frames = 2 * cfg.max_source_positions
        T = spec.target_len or min(cfg.max_source_positions, cfg.max_target_positions)
        return {"input_features": torch.randn(B, cfg.num_mel_bins, frames, dtype=pix_dtype, **dev),
                "labels": torch.randint(0, cfg.vocab_size, (B, T), **dev)}, frames, None
    if task == "image-classification":
        S = spec.image_size or getattr(cfg, "image_size", None) or DEFAULT_IMAGE_SIZE
        S = S[0] if isinstance(S, (list, tuple)) else S
        n_labels = max(getattr(cfg, "num_labels", 2), 2)
        return {"pixel_values": torch.randn(B, getattr(cfg, "num_channels", 3), S, S, dtype=pix_dtype, **dev),
                "labels": torch.randint(0, n_labels, (B,), **dev)}, None, S
    if task == "clip":
        S = spec.image_size or cfg.vision_config.image_size
        L = default_seq_len(spec, source)
        return {"input_ids": torch.randint(0, cfg.text_config.vocab_size, (B, L), **dev),
                "pixel_values": torch.randn(B, 3, S, S, dtype=pix_dtype, **dev), "return_loss": True}, L, S
    if task == "vlm":
        return vlm.make_batch(spec, source, DEFAULT_SEQ_LEN, dev, pix_dtype)
    raise AssertionError(task)


def padding_mask(fraction: float, B: int, L: int, dev: dict):
    """A tokenizer's attention_mask for a right-padded batch: (B, L) int64, 1 on tokens and 0 on the
    last n = round(fraction * L) positions of each sample (at least 1, at most L - 1). Returns (mask, n).

    A mask with zeros makes transformers build its 4D attention mask (masking_utils: the causal
    mask is skipped only when every token is real), and SDPA with a mask cannot run flash
    attention (memlens.estimator.cuda_rules.sdpa_backend)."""
    import torch  # heavy: torch, loaded on first use

    n = min(max(1, round(fraction * L)), L - 1)
    mask = torch.ones(B, L, dtype=torch.long, **dev)
    if n:
        mask[:, L - n:] = 0
    return mask, n


# ---------------------------------------------------------------- factories
def _build_factory(spec: TrainingSpec, source: ModelSource, device: Any) -> Built:
    """A factory returns ``(model, batch)``, ``(model, batch, loss_fn)`` with
    ``loss_fn(output, batch) -> loss``, or ``(model, batch, step)`` with ``step(model, batch) -> loss``
    (a callable of two parameters whose first is named ``model``, or marked ``step.memlens_step = True``).
    A dict batch reaches ``forward`` only through the entries its signature takes (all of them
    when it takes ``**kwargs``); the rest (labels...) are for the loss function."""
    import torch  # heavy: torch, loaded on first use

    fn = source.factory
    try:
        takes_spec = len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):
        takes_spec = False
    ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    with ctx:
        out = fn(spec) if takes_spec else fn()
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        raise ModelSourceError(f"factory {source.name} must return (model, batch), (model, batch, loss_fn) or (model, batch, step)",
                               hint="e.g. `return model, {'input_ids': ids, 'labels': ids}`")
    model, batch = out[0], out[1]
    third = out[2] if len(out) == 3 else None
    if not isinstance(model, torch.nn.Module):
        raise ModelSourceError(f"factory {source.name} returned {type(model).__name__}, not an nn.Module", hint="return (model, batch)")
    if third is not None and not callable(third):
        raise ModelSourceError(f"factory {source.name}: the third item is {type(third).__name__}, not a function",
                               hint="return (model, batch, loss_fn) with loss_fn(output, batch), or a step(model, batch)")
    step = third if third is not None and is_step_callable(third) else None
    loss_fn = None if step is not None else third
    if third is not None:
        usercode.register(third, "step function" if step is not None else "loss function", source.name)
    forward_keys = None
    if step is None:
        forward_keys = forward_batch_keys(model, batch, source.name, has_loss_fn=loss_fn is not None)
    model.train()
    apply_freeze(model, spec.freeze)
    if spec.checkpoint_layers is not None:   # the factory checkpoints all blocks or none itself (spec.grad_checkpointing)
        checkpoint_blocks(model, spec.checkpoint_layers, spec.checkpoint_policy)
    elif spec.checkpoint_policy != "full":
        raise SpecError(f"--checkpoint-policy {spec.checkpoint_policy} with --grad-checkpointing: factory {source.name} "
                        "checkpoints its blocks itself, with its own policy", hint="name the blocks: --checkpoint-layers N (all N of them)")
    if spec.offload_layers is not None:
        offload_blocks(model, spec.offload_layers)
    if spec.lora_rank:
        model = apply_lora(model, spec)
    return Built(model, batch, loss_fn, forward_keys=forward_keys, step=step)


def _build_module(spec: TrainingSpec, source: ModelSource) -> Built:
    """A model built elsewhere (a Trainer's, as a meta skeleton) with its batch: trained as it
    is (its own frozen parameters and adapters); gradient checkpointing is switched on as the
    Trainer does at ``train()`` (transformers 5.x: non-reentrant)."""
    model, batch = source.factory(spec)   # the batch at the spec's micro-batch
    model.train()
    if spec.grad_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False) and not hasattr(model, "gradient_checkpointing_enable"):
            raise SpecError(f"{source.name} does not support gradient checkpointing", hint="turn gradient_checkpointing off")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(spec.checkpoint_policy))
        if spec.checkpoint_layers is not None:
            checkpoint_blocks(model, spec.checkpoint_layers, spec.checkpoint_policy)
        if hasattr(model, "enable_input_require_grads") and any(not p.requires_grad for p in model.parameters()):
            model.enable_input_require_grads()   # what peft-wrapped Trainer runs do for checkpointing
    if spec.offload_layers is not None:
        offload_blocks(model, spec.offload_layers)
    return Built(model, batch)


def is_step_callable(f) -> bool:
    """A factory's third item is a step (``step(model, batch) -> loss``) rather than a loss
    function (``loss_fn(output, batch) -> loss``) when it says so (``memlens_step = True``) or its
    first parameter is named ``model``."""
    if getattr(f, "memlens_step", False):
        return True
    try:
        params = list(inspect.signature(f).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] == "model"


def forward_batch_keys(model, batch, name: str, has_loss_fn: bool) -> frozenset[str] | None:
    """The entries of a dict batch that ``model.forward`` takes (None: all of them, or not a dict).

    Entries forward does not name go only to the loss function; a batch with none that forward
    takes, or with extra entries and no loss function to read them, is refused in one line."""
    if not isinstance(batch, dict):
        return None
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    names = {n for n, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    taken = frozenset(k for k in batch if k in names)
    extra = sorted(k for k in batch if k not in names)
    if not taken:
        raise ModelSourceError(f"factory {name}: forward({', '.join(params)}) takes none of the batch entries "
                               f"{', '.join(map(str, batch))}",
                               hint="name the batch entries after forward's arguments, or return a step(model, batch) callable")
    if extra and not has_loss_fn:
        raise ModelSourceError(f"factory {name}: batch entries {', '.join(map(str, extra))} are not arguments of forward "
                               "and there is no loss function to use them",
                               hint="return (model, batch, loss_fn) with loss_fn(output, batch), or drop those entries")
    return taken if extra else None


def quiet():
    """Silence transformers' logging and Python warnings while a model is built or run."""
    return silenced("transformers", logging.ERROR)
