"""Where a checkpointed call's host time goes, per model (issue 36).

bench/gpu_ckpt_probe.py measured what torch.utils.checkpoint (non-reentrant, as transformers calls it) adds to the
host's forward per checkpointed call on an H100: 473 us a GPT-2 block, 889 a Llama layer, 936 a ViT layer, where this
CPU gives 240-292 us for all three. The time model prices every call at calibrate's Llama figure. This probe splits the
cost into its mechanisms, on the GPU it runs on, for calibrate's width-64 GPT-2 / Llama / ViT stacks and a Llama with
LoRA adapters on every projection (peft), each run bare and:

- ``hooks``: bare, under ``saved_tensors_hooks`` that pass each tensor through (the C++ -> Python call per saved
  tensor that checkpoint's own pack hook pays);
- ``ckpt``: every block checkpointed as memlens does (memlens.models.checkpoint.checkpoint_blocks, "full");
- ``ckpt-norng``: the same without preserving RNG states (``preserve_rng_state=False``);
- ``ckpt-nodet``: the same without checkpoint's per-tensor metadata record (``determinism_check="none"``).

Each variant: forward and backward seconds (the median of interleaved rounds' medians, memlens.measure.host_phases),
the tensors saved in forward and the checkpointed calls; then a cProfile of ``PROFILE_RUNS`` forwards of ``bare`` and
``ckpt``: the Python functions (and C functions called from Python) whose own time grew most per checkpointed call.
One JSON line per record to $OUT/gpu_ckpt_parts.jsonl.

    python bench/gpu_ckpt_parts.py            # on the GPU machine (about a minute); on a CPU it runs too
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_ckpt_probe import _out, interleaved, stacks, summary  # noqa: E402
from memlens.measure.host_phases import CALIB_LLAMA  # noqa: E402  (no torch)

PROFILE_RUNS, TOP = 20, 25
VARIANTS = ("bare", "hooks", "ckpt", "ckpt-norng", "ckpt-nodet")
JSONL = "gpu_ckpt_parts.jsonl"


def models(torch, dev) -> dict:
    """name -> (build: () -> model in training mode, loss: model -> scalar): gpu_ckpt_probe's stacks and a Llama
    with LoRA on every projection."""
    def llama_lora():
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        return get_peft_model(LlamaForCausalLM(LlamaConfig(**CALIB_LLAMA)), LoraConfig(r=8, target_modules=targets))

    out = {name: (build, loss) for name, (build, loss, _) in stacks(torch, dev).items()}
    out["llama-lora"] = (llama_lora, out["llama"][1])
    return out


def variant(torch, dev, build, run, how: str):
    """(loss fn, checkpointed calls) of one model built for ``how``."""
    from torch.utils.checkpoint import checkpoint

    from memlens.models.checkpoint import checkpoint_blocks

    torch.manual_seed(0)
    m = build().to(dev, torch.bfloat16).train()
    calls = 0
    if how.startswith("ckpt"):
        names = checkpoint_blocks(m, "all", "full")
        calls = len(names)
        if how != "ckpt":
            kw = {"preserve_rng_state": False} if how == "ckpt-norng" else {"determinism_check": "none"}
            func = partial(checkpoint, use_reentrant=False, **kw)
            for mod in m.modules():
                if getattr(mod, "_gradient_checkpointing_func", None) is not None:
                    mod._gradient_checkpointing_func = func
    if how == "hooks":
        def fn(m=m):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                return run(m)
        return fn, calls
    return (lambda m=m: run(m)), calls


def profile_forward(torch, fn, sync) -> dict:
    """Own seconds per function over PROFILE_RUNS forwards (the graph dropped after each)."""
    pr = cProfile.Profile()
    for _ in range(3):
        fn()
    sync()
    pr.enable()
    for _ in range(PROFILE_RUNS):
        loss = fn()
        del loss
    sync()
    pr.disable()
    st = pstats.Stats(pr)
    out = {}
    for (file, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
        key = f"{os.path.basename(file)}:{line}:{name}" if file != "~" else name
        out[key] = (out.get(key, (0, 0.0))[0] + nc, out.get(key, (0, 0.0))[1] + tt)
    return out


def main() -> int:
    import torch

    from memlens.measure.host_phases import timed_step

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    env = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    for name, (build, run) in models(torch, dev).items():
        vs = {how: variant(torch, dev, build, run, how) for how in VARIANTS}
        counted = {how: timed_step(torch, fn, sync, True)[2:] for how, (fn, _) in vs.items()}
        per, speeds = interleaved(torch, {how: fn for how, (fn, _) in vs.items()}, sync)
        for how, (fn, calls) in vs.items():
            nf, nb, saved = counted[how]
            _out({"model": name, "variant": how, **summary(how, per, speeds), "forward_ops": nf, "backward_ops": nb,
                  "saved_in_forward": saved, "checkpointed_calls": calls, **env}, JSONL)
        bare, ck = profile_forward(torch, vs["bare"][0], sync), profile_forward(torch, vs["ckpt"][0], sync)
        calls = vs["ckpt"][1] * PROFILE_RUNS
        grew = sorted(((k, (ck[k][1] - bare.get(k, (0, 0.0))[1]) / calls * 1e6, (ck[k][0] - bare.get(k, (0, 0.0))[0]) / calls)
                       for k in ck), key=lambda r: -r[1])
        _out({"model": name, "profile": "ckpt - bare, own us and calls per checkpointed call (cProfile)",
              "total_us": sum(g for _, g, _ in grew), "top": [[k, round(g, 2), round(c, 2)] for k, g, c in grew[:TOP]], **env},
             JSONL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
