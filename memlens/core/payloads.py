"""Typed payloads: what each verb adds to the common Result schema.

Every Result has the same top-level schema (``schema_version``, ``verb``, ``spec``,
``peak_allocated_bytes``, ``peak_reserved_bytes``, ``by_category``, ``by_phase``, ``by_module``,
``timeline``, ``notes``, ``environment``); a verb's own fields are its payload, a dataclass here,
flattened into the same JSON object. A payload also reads and writes like a dict (``r.data["rows"]``),
and keys it does not declare go to ``extra`` (written out too), so a renderer never loses a field.

>>> p = EstimatePayload(method="simulate", peak_phase="backward")
>>> p["peak_phase"], p.method, "seq_len" in p
('backward', 'simulate', False)
>>> p["note"] = "x"; sorted(p.to_dict())
['method', 'note', 'peak_phase']
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any, Iterator


class _Unset:
    """A declared field not set (absent from the JSON); None is a value like any other."""

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "UNSET"     # unpickled as this module's one UNSET (a Result made in a worker process)


UNSET: Any = _Unset()


@dataclass
class Payload(MutableMapping):
    """Base of every verb's payload: declared fields (UNSET = absent) plus ``extra``."""

    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "extra")

    # -- mapping protocol (fields left UNSET count as absent)
    def __getitem__(self, key: str) -> Any:
        if key in self.names():
            v = getattr(self, key)
            if v is UNSET:
                raise KeyError(key)
            return v
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self.names():
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self.names():
            if getattr(self, key) is UNSET:
                raise KeyError(key)
            setattr(self, key, UNSET)
        else:
            del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        for n in self.names():
            if getattr(self, n) is not UNSET:
                yield n
        yield from self.extra

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def to_dict(self) -> dict[str, Any]:
        return {k: self[k] for k in self}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Payload":
        known = set(cls.names())
        p = cls(**{k: v for k, v in d.items() if k in known})
        p.extra.update({k: v for k, v in d.items() if k not in known})
        return p


@dataclass
class EstimatePayload(Payload):
    method: str | None = UNSET                    # simulate | formula
    peak_phase: str | None = UNSET                # the phase the peak falls in
    peak_step: int | None = UNSET
    peak_requested_bytes: int | None = UNSET      # requested bytes live at the peak (before 512-B rounding)
    cuda_context_bytes: int | None = UNSET        # what nvidia-smi shows beyond reserved (the GPU facts)
    nvidia_smi_estimate_bytes: int | None = UNSET
    steps: list | None = UNSET                    # per simulated step: peak, end allocated / reserved
    attention_backends: list | None = UNSET       # the SDPA kernels CUDA would pick
    by_module_group: list | None = UNSET          # by_module summed per block
    by_component: list | None = UNSET             # by_module summed per component (attention, mlp, embedding, norm, lora ...)
    param_count: int | None = UNSET
    trainable_param_count: int | None = UNSET
    seq_len: int | None = UNSET
    image_size: int | None = UNSET
    model_source: dict | None = UNSET
    simulate_seconds: float | None = UNSET
    gpu: dict | None = UNSET                      # the GPU facts used (memlens.core.gpus)
    applied: list | None = UNSET                  # what the prepared step applied, in order
    terms: list | None = UNSET                    # formula: the terms of the peak phase
    forward_backward_terms: list | None = UNSET
    optimizer_terms: list | None = UNSET
    facts: dict | None = UNSET
    ranks: list | None = UNSET                    # several GPUs: each rank's peaks and breakdown
    later_steps: str | None = UNSET               # steps 2..: "written from step 1" or "simulated (why)"
    later_micro_batches: str | None = UNSET       # accumulation: "2..k written from micro-batch 1", "3..k written from micro-batch 2" or "simulated"
    later_layers: str | None = UNSET              # a deep stack: "written from 3 and 4 layers" or "simulated (why)"
    scaling: dict | None = UNSET                  # answers over many sizes: "simulated" (why) or "replayed" (estimator.scaling)


@dataclass
class ProfilePayload(Payload):
    mode: str | None = UNSET                      # phases | full | ledger
    device: str | None = UNSET
    measured_by: str | None = UNSET
    peak_phase: str | None = UNSET
    peak_step: int | None = UNSET
    snapshots: list | None = UNSET                # every labelled reading
    steps: list | None = UNSET
    labels: dict | None = UNSET                   # what each measured figure is, in PyTorch's words
    ledger: dict | None = UNSET
    history: dict | None = UNSET
    allocator: dict | None = UNSET
    nvml: dict | None = UNSET
    model_load: dict | None = UNSET
    warmup_steps: int | None = UNSET
    profiled_steps: int | None = UNSET
    seq_len: int | None = UNSET
    image_size: int | None = UNSET
    model_source: dict | None = UNSET
    applied: list | None = UNSET
    compare_estimate: dict | None = UNSET
    torch_profiler: dict | None = UNSET
    by_component: list | None = UNSET             # by_module summed per component (attention, mlp, embedding, norm, lora ...)
    dp: dict | None = UNSET                       # DP-SGD: Opacus' settings and the physical batches
    ranks: list | None = UNSET                    # several GPUs: each rank's profile


@dataclass
class ComparePayload(Payload):
    rows: list | None = UNSET                     # one per technique: estimated (and measured) peaks, saving, cost
    baseline: str | None = UNSET
    measured: bool | None = UNSET
    device: str | None = UNSET
    estimate_calls: int | None = UNSET


@dataclass
class SweepPayload(Payload):
    rows: list | None = UNSET                     # one per cell, in grid order
    grid: dict | None = UNSET
    measured: bool | None = UNSET
    device: str | None = UNSET
    results_path: str | None = UNSET
    status_counts: dict | None = UNSET
    budget_bytes: int | None = UNSET
    memory_fraction: float | None = UNSET
    detailed: bool | None = UNSET                 # cells carry ``detail`` (category, phase, component at the peak)
    steps: int | None = UNSET                     # optimizer steps per measured cell
    seed_files: list | None = UNSET               # the Opacus profiler's files written (seeds/004)


@dataclass
class FitPayload(Payload):
    max_batch_size: int | None = UNSET
    searched_field: str | None = UNSET            # batch_size, or physical_batch_size under DP-SGD
    budget_bytes: int | None = UNSET
    context_bytes: int | None = UNSET
    margin_bytes: int | None = UNSET
    usable_bytes: int | None = UNSET
    budget_source: str | None = UNSET
    target_batch: int | None = UNSET
    micro_batch_size: int | None = UNSET
    grad_accum: int | None = UNSET
    effective_batch_size: int | None = UNSET
    predicted_peak_bytes: int | None = UNSET
    predicted_peak_allocated_bytes: int | None = UNSET
    predicted_need_bytes: int | None = UNSET
    plan: list | None = UNSET
    estimates: list | None = UNSET
    method: str | None = UNSET


@dataclass
class DoctorPayload(Payload):
    """doctor oom / log / snapshot / stats: the diagnosis and its evidence (fields vary by input)."""

    diagnosis: str | None = UNSET
    reasons: list | None = UNSET
    advice: list | None = UNSET


@dataclass
class GuardPayload(Payload):
    """memlens.guard(): live memory at an OOM, the account, the diagnosis and the levers."""

    device: str | None = UNSET
    requested_bytes: int | None = UNSET
    allocated_bytes: int | None = UNSET           # memory_allocated() at the failure
    reserved_bytes: int | None = UNSET
    categories_sum_bytes: int | None = UNSET      # the classified live blocks (= allocated)
    diagnosis: str | None = UNSET
    account: dict | None = UNSET
    levers: list | None = UNSET


@dataclass
class WatchPayload(Payload):
    time_s: float | None = UNSET
    gpus: list | None = UNSET


PAYLOADS: dict[str, type[Payload]] = {
    "estimate": EstimatePayload, "profile": ProfilePayload, "compare": ComparePayload, "sweep": SweepPayload,
    "fit": FitPayload, "watch": WatchPayload, "doctor.oom": DoctorPayload, "doctor.log": DoctorPayload,
    "doctor.snapshot": DoctorPayload, "doctor.stats": DoctorPayload, "guard": GuardPayload,
}


def payload_for(verb: str, data: dict[str, Any] | Payload | None) -> Payload:
    """``data`` as the verb's payload class (a dict is converted; unknown verbs get the base)."""
    if isinstance(data, Payload):
        return data
    return PAYLOADS.get(verb, Payload).from_dict(dict(data or {}))
