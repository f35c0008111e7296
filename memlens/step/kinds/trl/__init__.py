"""TRL 1.16's trainers as step kinds: ``sft``, ``dpo``, ``grpo`` (``--trainer``; each a Trainer subclass, so
``hf_trainer`` holds too: the Trainer's optimizer groups and ``use_cache=False``).

Each runs the step as the installed TRL runs it (see :mod:`.sft`, :mod:`.dpo`, :mod:`.grpo`), through TRL's fused
LM head (:mod:`.fused_head`: no ``[tokens, vocab]`` logits), on fake tensors (estimate) and on a device (profile)
alike. Their phases: "forward", "backward", "optimizer", and DPO's "reference", GRPO's "generation".
"""
from __future__ import annotations

from . import dpo, grpo, sft
from .common import add_reference, refuse_trl
from .grpo import batch_unit, search_base

TITLES = {"sft": "TRL SFTTrainer's step (fused LM head, packing)",
          "dpo": "TRL DPOTrainer's step (chosen + rejected rows, reference log-probs)",
          "grpo": "TRL GRPOTrainer's step (generation, then training on the completions)"}
RUNS = {"sft": sft.run, "dpo": dpo.run, "grpo": grpo.run}

__all__ = ["TITLES", "RUNS", "refuse_trl", "add_reference", "batch_unit", "search_base"]
