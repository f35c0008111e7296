"""Measure the formula's activation constants with the simulator (no GPU needed).

For each family: simulate the same model with 2 and 4 layers (batch 2 x 512 tokens, bf16) and
take the growth of activation bytes at the peak per added layer, per token, per hidden unit,
per byte of activation element. Prints the constants that memlens/estimator/formula.py uses.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def activation_bytes(model: str, layers: int, **kw) -> tuple[int, int, int]:
    import copy

    from memlens.estimator.simulate import simulate
    from memlens.models.source import resolve
    from memlens.core.spec import TrainingSpec

    src = copy.deepcopy(resolve(model))
    cfg = getattr(src.config, "text_config", None) or src.config
    key = "n_layer" if hasattr(cfg, "n_layer") else "num_hidden_layers"
    setattr(cfg, key, layers)
    spec = TrainingSpec(model=model, batch_size=2, precision="bf16", **kw)
    from memlens.core.ledger import PHASE, breakdown_at

    log = simulate(spec, source=src).log
    # all activations are live when the last forward ends (where backward begins)
    idx = [i for i, ev in enumerate(log.events) if ev[0] == PHASE and ev[1] == "backward"][-1]
    by_cat, _, _ = breakdown_at(log, idx)
    H = getattr(cfg, "hidden_size", None) or cfg.n_embd
    return by_cat["activations"] + by_cat["temporaries"], H, 0


def main() -> None:
    for fam, model, kw in (("gpt2", "gpt2", {"seq_len": 512}), ("llama", "llama-3.2-1b", {"seq_len": 512}),
                           ("bert", "bert-base-uncased", {"seq_len": 512}), ("vit", "vit-base-patch16-224", {})):
        a2, H, _ = activation_bytes(model, 2, **kw)
        a4, _, _ = activation_bytes(model, 4, **kw)
        tokens = 2 * (kw.get("seq_len") or 197)
        print(f"{fam:6s} {(a4 - a2) / 2 / tokens / H / 2:6.2f}")


if __name__ == "__main__":
    main()
