"""What activation checkpointing costs the host, per checkpointed call and per op (issue 36).

The time model priced checkpointing's host work per kernel op, from calibrate's small Llama (``model_forward_ckpt`` and
``model_recompute_ckpt`` over ``model_forward``): ViT-L under full checkpointing ran its forward 25-28% over that price
on an H100 and an H200 (bench/results/step_time_h100.md), with 2.6x fewer kernel ops per layer than Llama. If the
cost is per checkpointed call (torch.utils.checkpoint's frame, RNG states, hooks) rather than per op, a model with
short layers pays more per op. This probe times, on one GPU, interleaved rounds (memlens.measure.host_phases: median
of the rounds' medians) of:

- ``chain-plain`` / ``chain-ckpt`` / ``chain-ckpt-norng``: 64 tiny calls (one sin each, which saves its input) in a chain, bare, each
  under torch.utils.checkpoint (non-reentrant, as transformers calls it), and without preserving RNG states;
- ``llama`` / ``llama-ckpt``: calibrate's 16-layer Llama of width 64 at 1 x 16 tokens, bare and under memlens' full
  checkpointing; ``vit`` / ``vit-ckpt``: a 24-layer ViT of width 64 (transformers ViTForImageClassification, 32 px
  images of 8 px patches, batch 1), the same two ways; ``gpt2`` / ``gpt2-ckpt``: GPT-2's 12 blocks at width 64 (1 x 16
  tokens), the same two ways.

Each row: forward and backward seconds, the kernel ops and views each dispatched (counted once as calibrate counts
them), the tensors autograd saved in forward (bare variants), the layers, and the host's speed over the rounds.
One JSON line per variant to $OUT/gpu_ckpt_probe.jsonl.

    python bench/gpu_ckpt_probe.py            # on the GPU machine (about a minute)
"""
from __future__ import annotations

import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from memlens.measure.host_phases import CALIB_LLAMA, host_speed  # noqa: E402  (no torch)

ROUNDS, RUNS, CHAIN = 5, 5, 64


def _out(rec: dict, name: str = "gpu_ckpt_probe.jsonl") -> None:
    """One record printed and appended to $OUT/``name``."""
    print(json.dumps(rec)[:400], flush=True)
    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "out"), name), "a") as f:
        f.write(json.dumps(rec) + "\n")


def stacks(torch, dev) -> dict:
    """The probes' tiny models at calibrate's width: name -> (build: () -> model, loss: model -> scalar, blocks)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, ViTConfig, ViTForImageClassification

    ids = torch.randint(0, 512, (1, 16), device=dev)
    px = torch.randn(1, 3, 32, 32, device=dev, dtype=torch.bfloat16)
    lab = torch.zeros(1, dtype=torch.long, device=dev)
    return {
        "gpt2": (lambda: GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=12, n_head=4, vocab_size=512, n_positions=64)),
                 lambda m: m(input_ids=ids, labels=ids).loss, 12),
        "llama": (lambda: LlamaForCausalLM(LlamaConfig(**CALIB_LLAMA)), lambda m: m(input_ids=ids, labels=ids).loss, 16),
        "vit": (lambda: ViTForImageClassification(ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                                                            num_attention_heads=4, image_size=32, patch_size=8, num_labels=10)),
                lambda m: m(pixel_values=px, labels=lab).loss, 24),
    }


def interleaved(torch, fns: dict, sync) -> tuple[dict, list[float]]:
    """Each of ``fns`` (name -> loss fn) timed in ROUNDS interleaved rounds of RUNS steps after 3 warm-up steps:
    (name -> [(forward s, backward s) median of each round], the host's speed after each round)."""
    from memlens.measure.host_phases import timed_step

    for fn in fns.values():
        for _ in range(3):
            timed_step(torch, fn, sync, False)
    per: dict = {n: [] for n in fns}
    speeds = []
    for _ in range(ROUNDS):
        for n, fn in fns.items():
            rs = [timed_step(torch, fn, sync, False)[:2] for _ in range(RUNS)]
            per[n].append((statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)))
        speeds.append(host_speed())
    return per, speeds


def summary(n: str, per: dict, speeds: list[float]) -> dict:
    """A variant's forward and backward seconds (the median of its rounds' medians), its rounds, the host's speed."""
    return {"forward_s": statistics.median(x for x, _ in per[n]), "backward_s": statistics.median(y for _, y in per[n]),
            "rounds": per[n], "host_speed_ms": [round(min(speeds) * 1e3, 2), round(statistics.median(speeds) * 1e3, 2),
                                                round(max(speeds) * 1e3, 2)]}


def variants(torch, dev) -> dict:
    """name -> (make loss: () -> scalar tensor, layers checkpointed)."""
    from torch.utils.checkpoint import checkpoint

    from memlens.models.checkpoint import checkpoint_blocks

    x0 = torch.randn(16, device=dev, requires_grad=True)

    def chain(mode):
        def run():
            x = x0
            for _ in range(CHAIN):
                if mode == "plain":
                    x = torch.sin(x)
                else:
                    x = checkpoint(torch.sin, x, use_reentrant=False, preserve_rng_state=mode == "ckpt")   # saves its input
            return x.sum()
        return run

    out = {"chain-plain": (chain("plain"), 0), "chain-ckpt": (chain("ckpt"), CHAIN), "chain-ckpt-norng": (chain("norng"), CHAIN)}
    models = stacks(torch, dev)
    for ck in (False, True):
        for name in ("gpt2", "llama", "vit"):
            build, loss, blocks = models[name]
            torch.manual_seed(0)
            m = build().to(dev, torch.bfloat16).train()
            if ck:
                checkpoint_blocks(m, "all", "full")
            out[name + ("-ckpt" if ck else "")] = ((lambda m=m, loss=loss: loss(m)), blocks if ck else 0)
    return out


def step(torch, loss_fn, count: bool = False):
    """(forward s, backward s, (forward ops, backward ops, saved tensors) when counted) of one step of ``loss_fn``."""
    from memlens.measure.host_phases import timed_step

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)   # the CPU: a smoke test
    f, b, nf, nb, saved = timed_step(torch, loss_fn, sync, count)
    return f, b, (nf, nb, saved) if count else None


def main() -> int:
    import torch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    vs = variants(torch, dev)
    counted = {n: step(torch, fn, True)[2] for n, (fn, _) in vs.items()}
    per, speeds = interleaved(torch, {n: fn for n, (fn, _) in vs.items()}, sync)
    for n, (fn, layers) in vs.items():
        f, b, s = counted[n]
        _out({"variant": n, **summary(n, per, speeds), "forward_ops": f, "backward_ops": b, "saved_in_forward": s,
              "checkpointed_calls": layers,
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
