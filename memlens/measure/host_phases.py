"""The host's seconds in one training step's forward and backward, and the ops each dispatched: what ``memlens
calibrate`` measures the eager host's per-op cost with (calibrate.py) and FSDP2's hook cost against (calibrate_fsdp.py).

The host's speed drifts on a shared machine: on one H100 machine a fixed Python loop (:func:`host_speed`) took 13 to
30 ms within three minutes (bench/results/raw/host_probe/). One short snapshot can land in a slow stretch (a calibrate
measured 41 us a forward op in its small Llama where the same model's step ran at ~20-30 us minutes later), so the
models compared are timed in interleaved rounds and each figure is the median of its rounds' medians: a difference
between two of them (checkpointing's recompute, FSDP2's hooks) comes from the same stretches of the host's time.
"""
from __future__ import annotations

import statistics
import time

ROUNDS, RUNS = 5, 5          # interleaved rounds of every model, timed steps per model in each (after a warm-up)
# calibrate's host model: a 16-layer Llama of width 64 (transformers' LlamaConfig fields), so small that the GPU idles
CALIB_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=16, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)


def calib_llama(torch, dev):
    """Calibrate's host model (:data:`CALIB_LLAMA`) in bf16 on ``dev``, in training mode (random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy: transformers, loaded on first use

    return LlamaForCausalLM(LlamaConfig(**CALIB_LLAMA)).to(dev, torch.bfloat16).train()


def host_speed() -> float:
    """Seconds of a fixed pure-Python loop: the host's speed at this moment (lower is faster)."""
    t = time.perf_counter()
    acc = 0
    for i in range(200_000):
        acc += i * i % 7
    return time.perf_counter() - t


def host_per_phase(torch, model, ids) -> tuple[float, float, dict, dict]:
    """(forward s, backward s) of ``model``'s step and the ops of each, counted (:func:`host_rounds` of one model)."""
    return host_rounds(torch, {"model": model}, ids)["model"]


def host_rounds(torch, models: dict, ids, rounds: int = ROUNDS, runs: int = RUNS, speeds: list | None = None) -> dict:
    """name -> (forward s, backward s, forward ops, backward ops) for each of ``models`` (name -> model): each counted
    once (kernel ops and views/allocations, as the simulation's trace counts them), warmed up, then timed in
    ``rounds`` interleaved rounds of ``runs`` steps; a phase's seconds are the median over rounds of each round's
    median. ``speeds``: :func:`host_speed` appended once per round (the host's drift, for the table's record)."""
    counted = {name: _phases(torch, m, ids, True) for name, m in models.items()}
    for m in models.values():
        for _ in range(2):
            _phases(torch, m, ids, False)
    per_round: dict = {name: [] for name in models}
    for _ in range(rounds):
        for name, m in models.items():
            rs = [_phases(torch, m, ids, False) for _ in range(runs)]
            per_round[name].append((statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)))
        if speeds is not None:
            speeds.append(host_speed())
    return {name: (statistics.median(f for f, _ in per_round[name]), statistics.median(b for _, b in per_round[name]),
                   counted[name][2], counted[name][3]) for name in models}


def _phases(torch, model, ids, count: bool) -> tuple:
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)   # a CPU model: tests
    out = timed_step(torch, lambda: model(input_ids=ids, labels=ids).loss, sync, count)
    model.zero_grad(set_to_none=True)
    return out[:4]


def timed_step(torch, loss_fn, sync, count: bool) -> tuple:
    """(forward s, backward s, forward ops, backward ops, tensors autograd saved in forward) of ``loss_fn()`` and its
    backward, ``sync`` between them; with ``count`` the ops (kernel ops and views/allocations, as the simulation's trace
    counts them) and the saved tensors are counted (that run is slower: its seconds are not the host's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ..estimator.timing.ops import ALLOC, META, VIEW, kind_of

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = {"view": 0, "kernel": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kind = kind_of(func)
            if kind != META:      # a metadata query: not dispatched in eager mode (memlens.estimator.timing.ops_kinds)
                self.n["view" if kind in (VIEW, ALLOC) else "kernel"] += 1
            return func(*args, **(kwargs or {}))

    saved = [0]

    def pack(t):
        saved[0] += 1
        return t

    fwd, bwd = (Count(), Count()) if count else (None, None)
    sync()
    t = time.perf_counter()
    if fwd:
        with fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = loss_fn()
    else:
        loss = loss_fn()
    sync()
    t1 = time.perf_counter()
    if bwd:
        with bwd:
            loss.backward()
    else:
        loss.backward()
    sync()
    t2 = time.perf_counter()
    return t1 - t, t2 - t1, fwd.n if fwd else {}, bwd.n if bwd else {}, saved[0]
