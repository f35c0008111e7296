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

Each is an :class:`Optimizer` entry of one registry: its state and step-temporary bytes for the closed
form, whether its states are Adam's two moments, whether it is bitsandbytes' (which no sharding wraps), and
optionally its builder (a new optimizer is one :func:`register_optimizer` call; the built-in ones are built
by :mod:`memlens.step.optim`).

>>> canonical_optimizer("adamw_torch_fused"), canonical_optimizer("adamw_bnb_8bit"), canonical_optimizer("sgd")
('adamw-fused', 'adamw-8bit', 'sgd')
>>> optimizer_facts("adamw").state_bytes(1000, 4000), optimizer_facts("adamw").temporary_bytes(1000, 4000)
(8000, 4000)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .errors import SpecError


def _none(numel: int, nbytes: int) -> int:
    return 0


def _two_moments(numel: int, nbytes: int) -> int:
    return 2 * nbytes


def _one_buffer(numel: int, nbytes: int) -> int:
    return nbytes


def _factored(numel: int, nbytes: int) -> int:
    # row and column factors: a small fraction of the parameters (closed-form constant, bench/formula_constants.py)
    return int(0.02 * nbytes) + 4 * 1024


def _eight_bit(numel: int, nbytes: int) -> int:
    return 2 * numel      # two uint8 states per element (the fp32 absmax per 256 elements is under 2%)


@dataclass(frozen=True)
class Optimizer:
    """One optimizer implementation: what it holds per trainable parameter and how it is built.

    ``state_bytes(numel, nbytes)`` / ``temporary_bytes(numel, nbytes)``: bytes of state, and of the
    step's transient, for trainable parameters of ``numel`` elements taking ``nbytes``.
    ``build(groups, spec, model, simulate)``: the torch optimizer (None: a built-in of memlens.step.optim).
    """

    name: str
    state_bytes: Callable[[int, int], int]
    temporary_bytes: Callable[[int, int], int] = _none
    adam_like: bool = False          # Adam's two full-precision moments (what a switch of optimizer saves)
    bitsandbytes: bool = False       # bitsandbytes' 8-bit states (not on DTensor shards or under ZeRO-1)
    build: Callable[..., Any] | None = None


_REGISTRY: dict[str, Optimizer] = {o.name: o for o in (
    # foreach: one parameter-sized list in the step; fused and bitsandbytes: none; Adafactor (torch's
    # single-tensor path, transformers'): per tensor, not counted by the closed form
    Optimizer("adamw", _two_moments, _one_buffer, adam_like=True),
    Optimizer("adamw-fused", _two_moments, adam_like=True),
    Optimizer("adam", _two_moments, _one_buffer, adam_like=True),
    Optimizer("adam-fused", _two_moments, adam_like=True),
    Optimizer("sgd", _none),
    Optimizer("sgd-momentum", _one_buffer),
    Optimizer("adafactor", _factored),
    Optimizer("adafactor-hf", _factored),
    Optimizer("adamw-8bit", _eight_bit, bitsandbytes=True),
    Optimizer("paged-adamw-8bit", _none, bitsandbytes=True),   # paged states live in CUDA managed memory
)}
OPTIMIZERS: tuple[str, ...] = tuple(_REGISTRY)   # the built-in names (CLI help)


def register_optimizer(entry: Optimizer) -> Optimizer:
    """Add an optimizer (its name then validates in a TrainingSpec); it must bring its ``build``."""
    if entry.build is None:
        raise SpecError(f"optimizer {entry.name!r} has no build function", hint="give Optimizer(..., build=fn)")
    _REGISTRY[entry.name] = entry
    return entry


def optimizer_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def optimizer_facts(name: str) -> Optimizer:
    return _REGISTRY[name]

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
    if key in _REGISTRY:
        return key
    low = key.lower()
    if low.startswith("optimizernames."):  # str(OptimizerNames.ADAMW_TORCH) in some dumps
        low = low.split(".", 1)[1]
    return HF_OPTIM_ALIASES.get(low) or _UNDERSCORED.get(low) or (low if low in _REGISTRY else name)
