"""What to do about a diagnosed OOM or memory pattern: ordered, concrete, with the numbers filled in.

The orders follow the seeds' emergency list (checkpointing, batch halving with accumulation, AMP,
optimizer state, offload) after the cause-specific step that fixes the actual cause first.

>>> from memlens.doctor.message import OomMessage
>>> m = OomMessage(form="torch>=2.1", message="", requested_bytes=2 * 1024**3, free_bytes=0,
...                total_capacity_bytes=80 * 1024**3, allocated_by_pytorch_bytes=60 * 1024**3,
...                reserved_unallocated_bytes=10 * 1024**3)
>>> oom_advice(m, "fragmentation")[0].startswith("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
True
"""
from __future__ import annotations

from ..core import techniques as tech
from ..core.enums import Category
from ..core.units import fmt_bytes as f
from .account import Account, account
from .message import OomMessage


def _named(name: str, gpus: str | None = None) -> str:
    """'Title (cost)' of a technique, both from the one technique table (memlens/core/techniques.py);
    ``gpus``: words for the GPU count of a sharded title (advice names no count)."""
    t = tech.lookup(name)
    return f"{t.title.format(gpus=gpus) if gpus else tech.title(name)} ({t.cost})"


# The general ways to shrink a step; each technique's name and cost come from the technique table, so
# doctor, compare and fit's plan say the same thing about it.
_REDUCE = [
    f"Halve the micro-batch and double gradient accumulation: {tech.cost('halve-batch')}.",
    "Enable gradient checkpointing (model.gradient_checkpointing_enable()): activation memory grows with "
    f"sqrt(layers) instead of layers; it {tech.cost('checkpointing')}.",
    f"Train under autocast: {_named('amp-bf16')}, or {_named('amp-fp16')}.",
    f"Shrink optimizer state (AdamW keeps 2 fp32 tensors per trained parameter): {_named('adamw-8bit')}, "
    f"{_named('adafactor')}, or {_named('lora')}.",
    f"Shard or offload the model states: {_named('fsdp', gpus='several')}, or {_named('offload')}.",
    "Run `memlens estimate` and `memlens fit` with your configuration to see which category dominates "
    "and the largest micro-batch that fits.",
]


def oom_advice(msg: "OomMessage", diagnosis: str, acc: "Account | None" = None) -> list[str]:
    """Ordered advice for one OOM message and its diagnosis (see ``oom.diagnose``); ``acc`` is the
    account the diagnosis rests on (default: the message's own)."""


    acc = acc or account(msg)
    req = msg.requested_bytes or 0
    total = msg.total_capacity_bytes or 0
    out: list[str] = []
    if diagnosis == "fragmentation":
        out += [
            f"Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts: "
            f"{f(msg.reserved_unallocated_bytes)} is reserved by PyTorch but unallocated, split into pieces "
            f"smaller than the {f(req)} requested; expandable segments let the allocator grow one segment instead.",
            "Pad or bucket variable shapes (sequence lengths, image sizes) to a few fixed sizes so cached blocks are reused.",
            "Call torch.cuda.empty_cache() between phases with different shapes (e.g. after evaluation) "
            "to return unsplit cached segments to the driver.",
            "On torch without expandable segments, PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 stops large cached "
            "blocks from being split.",
        ]
    elif diagnosis == "other_processes":
        pids = ", ".join(str(p["pid"]) for p in acc.other_processes[:5])
        out += [
            f"Free the GPU: other processes ({pids}) hold {f(acc.other_processes_bytes)}; stop them "
            f"(a leftover notebook kernel or DataLoader worker is the usual culprit) or use another GPU "
            f"(CUDA_VISIBLE_DEVICES).",
            "See who holds what with `memlens watch --once` (or nvidia-smi).",
            "If the GPU is shared on purpose, give each job a budget with torch.cuda.set_per_process_memory_fraction "
            "and size the micro-batch to it with `memlens fit`.",
        ]
    elif diagnosis == "non_pytorch_memory":
        out += [
            f"Find what in this process allocates outside PyTorch ({f(acc.non_pytorch_bytes)}): NCCL buffers "
            f"(NCCL_BUFFSIZE, fewer communicators), another framework or allocator in the same process (TensorFlow, JAX, "
            f"CuPy preallocate: XLA_PYTHON_CLIENT_PREALLOCATE=false, TF's allow_growth), CUDA graphs captured outside "
            f"PyTorch, or an extension that calls cudaMalloc.",
            "Compare `memlens watch --once` (what the driver says this process uses) with torch.cuda.memory_reserved() "
            "while the job runs: the difference is the non-PyTorch part.",
        ]
    elif diagnosis == "held_elsewhere":
        out += [
            f"Find who holds the {f(acc.held_elsewhere_bytes)} that is neither free nor PyTorch's: `memlens watch --once` "
            f"(or nvidia-smi, on the host when in a container) lists every process by PID; a leftover process, "
            f"another container on the same GPU, or another framework in this process are the usual holders.",
            "If the GPU is shared on purpose, size the job to what is left with `memlens fit --budget ...`.",
        ]
    elif diagnosis == "memory_fraction_limit":
        if msg.form == "mps":
            out.append("PyTorch's MPS high watermark capped this process: lower the batch, or raise "
                       "PYTORCH_MPS_HIGH_WATERMARK_RATIO (0.0 disables the cap and may freeze the system).")
        else:
            out.append(f"Raise the limit: this process may use only {f(msg.allowed_bytes)} of the GPU's {f(total)} "
                       f"(torch.cuda.set_per_process_memory_fraction or a framework setting); if the GPU is not "
                       f"shared, a fraction of 1.0 removes the cap.")
        out += _REDUCE[:3]
    else:
        if diagnosis == "unknown":
            out.append("This OOM came from CUDA itself (context creation, cuBLAS/cuDNN workspace, NCCL), not from "
                       "PyTorch's allocator: check with `memlens watch --once` whether the GPU was already full, and wrap "
                       "training in memlens.guard() to record what held the memory at the next failure.")
        if total and req >= 0.10 * total:
            out.append(f"A single request of {f(req)} ({100 * req / total:.0f}% of the GPU) is typical of the logits "
                       f"(batch x seq_len x vocab x 4 bytes) or an eager attention matrix (batch x heads x seq_len^2): "
                       f"use SDPA/flash attention, a chunked cross-entropy, or a shorter sequence.")
        out += _REDUCE
    if diagnosis != "non_pytorch_memory" and (acc.non_pytorch_bytes or 0) >= 2 * 1024**3:
        out.append(f"{f(acc.non_pytorch_bytes)} of this process' memory is outside PyTorch's allocator (CUDA context, "
                   f"cuBLAS/cuDNN workspaces, NCCL buffers, other libraries): check extensions that allocate on their own.")
    return out


# What each of the technique table's DOCTOR levers shrinks (memlens/core/techniques.py): halving the
# micro-batch halves what grows with the batch (activations, temporaries, the batch); checkpointing keeps
# only block inputs of the activations; autocast stores activations in 2 bytes; 8-bit AdamW keeps 2 bytes
# of state per parameter instead of 8; LoRA trains adapters only (no full gradients, no full states).
LEVER_SHRINKS = {
    "halve-batch": (Category.ACTIVATIONS, Category.TEMPORARIES, Category.INPUTS),
    "checkpointing": (Category.ACTIVATIONS,),
    "amp-bf16": (Category.ACTIVATIONS,),
    "adamw-8bit": (Category.OPTIMIZER_STATE,),
    "lora": (Category.GRADIENTS, Category.OPTIMIZER_STATE),
}


def measured_levers(by_category: dict[str, int]) -> list[dict]:
    """The DOCTOR levers of the technique table, each with the measured bytes of what it shrinks
    (live at the failure). Whether one fits needs the configuration (``fits`` None): with a
    TrainingSpec, ``oom.what_fits`` estimates each against the budget.

    >>> [(l["name"], l["shrinks_bytes"]) for l in measured_levers({"activations": 10, "optimizer_state": 4})][:2]
    [('halve-batch', 10), ('checkpointing', 10)]
    """
    out = []
    for name in tech.DOCTOR:
        cats = LEVER_SHRINKS.get(name, ())
        out.append({"name": name, "title": tech.title(name), "kind": tech.kind(name), "cost": tech.cost(name),
                    "shrinks": list(cats), "shrinks_bytes": sum(int(by_category.get(c, 0)) for c in cats), "fits": None})
    return out


LOG_CAUSES = {
    "accelerating": [
        "Something kept per step grows itself: an autograd graph kept alive across steps "
        "(`total_loss += loss` instead of `loss.item()`), so each step holds a longer chain.",
        "A cache keyed by shape (dynamic image sizes, sequence lengths) that never evicts.",
        "Forward hooks that store activations and are never removed (keep the handle, call handle.remove()).",
        "Growing inputs: sequence length or number of images per sample increasing over the run.",
    ],
    "linear": [
        "A fixed-size tensor kept every step: `losses.append(loss)` or metrics appended as CUDA tensors "
        "(append `loss.item()` or `.detach().cpu()`).",
        "Outputs or logits kept for later evaluation on the GPU.",
        "Forward hooks that store activations and are never removed.",
    ],
    "stepwise": [
        "Reserved memory grows when a new, larger shape arrives (longest batch so far) and the allocator caches it; "
        "pad or bucket shapes, or sort by length.",
        "Periodic evaluation or checkpoint saving that leaves tensors behind: free them, wrap eval in torch.no_grad().",
    ],
    "falling": [
        "Not a leak: memory falls over the run, so its peak is early (the first steps decide an OOM). Something "
        "held at the start is released: a warm-up or first-batch cache, a longest-first or shrinking batch or "
        "sequence length, torch.cuda.empty_cache() returning cached segments (reserved falls, allocated does not).",
    ],
    "dropped": [
        "Not a leak: memory fell once and then held level, so its peak is before the drop. Typical: the first "
        "steps' larger batch or sequence, evaluation or checkpoint buffers freed, torch.cuda.empty_cache() after "
        "warm-up.",
    ],
    "steady": [
        "No leak: memory per step is flat. If it is close to the capacity, peaks (not the trend) decide OOMs: "
        "see `memlens estimate` for the peak by phase.",
    ],
}


def log_causes(pattern: str) -> list[str]:
    """Likely causes of a memory-per-step pattern ("accelerating", "linear", "stepwise", "falling", "dropped", "steady")."""
    return list(LOG_CAUSES.get(pattern, LOG_CAUSES["steady"]))
