"""The optimizer names a TrainingSpec takes, and the Hugging Face ``TrainingArguments.optim`` aliases.

memlens names an *implementation* (what memory it takes), not just an algorithm:

- ``adamw`` / ``adam``: torch's AdamW / Adam as torch picks them on CUDA (foreach: one
  parameter-sized temporary list in the step; ``step`` counters on the CPU);
- ``adamw-fused`` / ``adam-fused``: ``fused=True`` (one kernel, no temporaries; ``step`` counters
  are float32 tensors on the GPU, one 512-byte block per parameter tensor);
- ``sgd`` / ``sgd-momentum``: torch's SGD (foreach), momentum 0.9 keeps one buffer per parameter;
- ``adafactor``: ``torch.optim.Adafactor`` (its default single-tensor path, also on CUDA); ``adafactor-hf``: transformers' own
  Adafactor (what the Trainer's ``optim="adafactor"`` builds: scale_parameter=False,
  relative_step=False);
- ``adamw-8bit`` / ``paged-adamw-8bit``: bitsandbytes' AdamW with 8-bit block-wise states (the
  paged one keeps states of >= 1e5 elements in CUDA managed memory, outside PyTorch's allocator).

>>> canonical_optimizer("adamw_torch_fused"), canonical_optimizer("adamw_bnb_8bit"), canonical_optimizer("sgd")
('adamw-fused', 'adamw-8bit', 'sgd')
"""
from __future__ import annotations

OPTIMIZERS = ("adamw", "adamw-fused", "adam", "adam-fused", "sgd", "sgd-momentum", "adafactor", "adafactor-hf",
              "adamw-8bit", "paged-adamw-8bit")

# transformers TrainingArguments.optim (transformers/training_args.py OptimizerNames) -> what the Trainer
# builds (transformers/trainer_optimizer.py): adamw_torch = torch AdamW with torch's defaults (foreach on
# CUDA), adamw_torch_fused = fused=True, adafactor = transformers.optimization.Adafactor, sgd = torch SGD,
# adamw_bnb_8bit / adamw_8bit = bitsandbytes AdamW(optim_bits=8), paged_adamw_8bit = the same, is_paged.
HF_OPTIM_ALIASES = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw-fused",
    "adafactor": "adafactor-hf",
    "sgd": "sgd",
    "adamw_bnb_8bit": "adamw-8bit",
    "adamw_8bit": "adamw-8bit",
    "paged_adamw_8bit": "paged-adamw-8bit",
}
# Own spellings with underscores (adamw_fused) are accepted too.
_UNDERSCORED = {n.replace("-", "_"): n for n in OPTIMIZERS}


def canonical_optimizer(name):
    """memlens' name for ``name`` (its own, or a Trainer ``optim`` alias); anything else is returned
    as given (the spec's validation then refuses it with the known names)."""
    if not isinstance(name, str):
        return name
    key = name.strip()
    if key in OPTIMIZERS:
        return key
    low = key.lower()
    if low.startswith("optimizernames."):  # str(OptimizerNames.ADAMW_TORCH) in some dumps
        low = low.split(".", 1)[1]
    return HF_OPTIM_ALIASES.get(low) or _UNDERSCORED.get(low) or (low if low in OPTIMIZERS else name)
