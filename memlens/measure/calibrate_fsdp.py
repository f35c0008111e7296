"""FSDP2's hooks on the host, per parameter group (``host_us["fsdp_forward_group"]`` / ``["fsdp_backward_group"]``):
what memlens.estimator.timing.record prices on each group's unshard beyond the aten ops the hooks dispatch.

FSDP2's ``pre_forward`` (unshard, wait_for_unshard, ``_register_post_backward_hook`` over the args), ``post_forward``
(reshard, setattr swaps of every parameter) and backward's ``pre_backward`` / ``post_backward`` are Python on the host
(torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py). Measured on calibrate's model (memlens.measure.calibrate:
a 16-layer Llama of width 64, so small the GPU idles) with every layer and the root under ``fully_shard`` over a
one-rank process group, against the same model bare, the two timed in interleaved rounds (memlens.measure.host_phases):
the extra host seconds per group, less the extra aten ops at the table's in-model costs (those are priced as rows of
their own). With one rank FSDP2 copies instead of all-gathering, so the collectives' own host cost is not in it: on
a machine with several GPUs calibrate measures the same pair over all of them as well (memlens.measure.calibrate_nccl:
``fsdp_forward_group_ranks`` / ``fsdp_backward_group_ranks``, what a step over several ranks is priced at).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time

from ..core.errors import MemlensError
from .host_phases import CALIB_LLAMA, host_rounds


@contextlib.contextmanager
def one_rank_group(torch, dev):
    """A default process group of one rank (NCCL on a GPU, gloo on a CPU), destroyed on exit; refused (MemlensError)
    when this process already has one (a torchrun job measures its own collectives)."""
    import torch.distributed as dist  # heavy: torch.distributed

    if not dist.is_available() or dist.is_initialized():
        raise MemlensError("FSDP2's hook cost is measured over a process group of its own, and this process has one")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method="file://" + os.path.join(d, "pg"),
                                rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def sharded_pair(torch, dev, layers: int = 16) -> tuple:
    """(plain, sharded): :func:`memlens.measure.host_phases.host_rounds`' figures of calibrate's host model bare and
    under ``fully_shard`` per layer and at the root, over the process group this process is in (one rank: FSDP2
    copies; several: it all-gathers and reduce-scatters over NCCL, every rank running this at once)."""
    from torch.distributed.fsdp import fully_shard  # heavy: torch.distributed
    from transformers import LlamaConfig, LlamaForCausalLM  # optional: the caller checked it imports

    cfg = LlamaConfig(**{**CALIB_LLAMA, "num_hidden_layers": layers})
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (1, 16), device=dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = LlamaForCausalLM(cfg).to(dev, dtype).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    plain = LlamaForCausalLM(cfg).to(dev, dtype).train()
    timed = host_rounds(torch, {"plain": plain, "sharded": model}, ids)
    steps = optimizer_rounds(torch, {"plain": plain, "sharded": model}, ids)
    tensors = sum(1 for p in plain.parameters() if p.requires_grad)
    return (*timed["plain"], steps["plain"], tensors), (*timed["sharded"], steps["sharded"], tensors)


def optimizer_rounds(torch, models: dict, ids, rounds: int = 5, runs: int = 5) -> dict:
    """name -> seconds of one foreach AdamW step over each model's gradients (the median over interleaved rounds of
    each round's median; the GPU idles on these models, so it is the host's time). Under FSDP2 every parameter is a
    DTensor: each foreach op goes through DTensor's dispatch (its Python, per tensor of the list)."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    opts = {}
    for name, m in models.items():
        m(input_ids=ids, labels=ids).loss.backward()
        opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-6, foreach=True)
        for _ in range(2):
            opts[name].step()
    per_round: dict = {name: [] for name in models}
    for _ in range(rounds):
        for name, opt in opts.items():
            ts = []
            for _ in range(runs):
                sync()
                t = time.perf_counter()
                opt.step()
                sync()
                ts.append(time.perf_counter() - t)
            per_round[name].append(statistics.median(ts))
    for m in models.values():
        m.zero_grad(set_to_none=True)
    return {name: statistics.median(v) for name, v in per_round.items()}


def per_group(plain: tuple, sharded: tuple, host: dict, groups: int, suffix: str = "") -> dict:
    """The sharded model's extra host seconds per parameter group, forward and backward, less its extra aten ops at
    the table's in-model costs (``host``: microseconds per view, per forward and backward op), in microseconds; with
    the optimizer's step times and tensors (the pair's 5th and 6th figures), also the extra per tensor of each
    foreach op (``fsdp_optimizer_tensor_op``: DTensor's dispatch)."""
    from ..estimator.timing.step import OPTIMIZER_TRAFFIC

    out = {}
    if len(plain) > 5 and plain[5]:
        ops = OPTIMIZER_TRAFFIC["adamw"][3]
        out["fsdp_optimizer_tensor_op" + suffix] = round(max(0.0, sharded[4] - plain[4]) / (plain[5] * ops) * 1e6, 3)
    for i, (name, per_op) in enumerate((("fsdp_forward_group", "model_forward"), ("fsdp_backward_group", "model_backward"))):
        ops = {k: sharded[2 + i].get(k, 0) - plain[2 + i].get(k, 0) for k in ("view", "kernel")}
        extra = sharded[i] - plain[i] - ops["view"] * host.get("view", 0.0) * 1e-6 - ops["kernel"] * host.get(per_op, 0.0) * 1e-6
        out[name + suffix] = round(max(0.0, extra) / groups * 1e6, 2)
    return out


def measure_fsdp_host(torch, dev, host: dict, log, layers: int = 16) -> dict:
    """(module docstring) {} where it cannot run (no transformers, no torch.distributed, a process group already up)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401  heavy: torch.distributed
        from transformers import LlamaConfig  # noqa: F401  optional: the model-level host cost needs it
    except ImportError:
        return {}
    try:
        with one_rank_group(torch, dev):
            plain, sharded = sharded_pair(torch, dev, layers)
    except (MemlensError, RuntimeError, ValueError) as e:
        log(f"FSDP2 hook cost not measured ({str(e).splitlines()[0][:120]})")
        return {}
    out = per_group(plain, sharded, host, layers + 1)
    log(f"FSDP2 hooks per parameter group beyond their aten ops (us): {out}")
    return out
