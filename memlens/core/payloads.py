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


def given(value: Any) -> Any:
    """A field's value, None where it was never set (for a renderer that writes null for an absent field).

    >>> given(UNSET), given(0)
    (None, 0)
    """
    return None if value is UNSET else value


@dataclass
class Payload(MutableMapping):
    """Base of every verb's payload: declared fields (UNSET = absent) plus ``extra``."""

    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    plots_skipped: str | None = UNSET             # any verb: why its PNGs were not drawn (report.plots.skip_plots)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The verb's own declared fields, in the JSON's order (the base's, which any verb may carry, apart)."""
        return cls.declared()[:-len(_BASE) + 1]     # declared() less the base fields (extra is in neither)

    @classmethod
    def declared(cls) -> tuple[str, ...]:
        """Every declared field: the verb's own, then the base's (``plots_skipped``); read once per class."""
        got = _DECLARED.get(cls)
        if got is None:
            got = _DECLARED[cls] = (tuple(f.name for f in fields(cls) if f.name not in _BASE)
                                    + tuple(n for n in _BASE if n != "extra"))
        return got

    # -- mapping protocol (fields left UNSET count as absent)
    def __getitem__(self, key: str) -> Any:
        if key in self.declared():
            v = getattr(self, key)
            if v is UNSET:
                raise KeyError(key)
            return v
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self.declared():
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self.declared():
            if getattr(self, key) is UNSET:
                raise KeyError(key)
            setattr(self, key, UNSET)
        else:
            del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        for n in self.declared():
            if getattr(self, n) is not UNSET:
                yield n
        yield from self.extra

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def to_dict(self) -> dict[str, Any]:
        return {k: self[k] for k in self}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Payload":
        known = set(cls.declared())
        p = cls(**{k: v for k, v in d.items() if k in known})
        p.extra.update({k: v for k, v in d.items() if k not in known})
        return p


_BASE = tuple(f.name for f in fields(Payload))    # extra, plots_skipped
_DECLARED: dict[type, tuple[str, ...]] = {}


@dataclass
class EstimatePayload(Payload):
    method: str | None = UNSET                    # simulate | formula
    peak_phase: str | None = UNSET                # the phase the peak falls in
    peak_step: int | None = UNSET
    peak_requested_bytes: int | None = UNSET      # requested bytes live at the peak (before 512-B rounding)
    cuda_context_bytes: int | None = UNSET        # what nvidia-smi shows beyond reserved (the GPU facts)
    nvidia_smi_estimate_bytes: int | None = UNSET
    fit_verdict: str | None = UNSET               # the fit rule against the whole --gpu (default h100), in words:
                                                  # "fits the h100 (...)" / "does not fit the rtx-4090 (...): ..., N over"
    fit: dict | None = UNSET                      # the same: fits, need/usable/headroom, budget/context/margin bytes, gpu
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
    worst_case: dict | None = UNSET               # DDP: the peak with the stale buckets held (rank, peaks, cause);
                                                  # the headline peak is the expected one, without them
    later_steps: str | None = UNSET               # steps 2..: "written from step 1" or "simulated (why)"
    later_micro_batches: str | None = UNSET       # accumulation: "2..k written from micro-batch 1", "3..k written from micro-batch 2" or "simulated"
    later_layers: str | None = UNSET              # a deep stack: "written from 3 and 4 layers" or "simulated (why)"
    scaling: dict | None = UNSET                  # answers over many sizes: "simulated" (why) or "replayed" (estimator.scaling)
    activation_plan: dict | None = UNSET          # checkpointing / offload: which blocks, what one micro-batch recomputes
                                                  # (ops, FLOPs, bytes, seconds) and moves to host memory (bytes, seconds)
    liger: dict | None = UNSET                    # --liger: the fused loss's chunk (memlens.models.liger.liger_facts)
    step_seconds: float | None = UNSET            # predicted seconds of one optimizer step (memlens.estimator.timing)
    step_time: dict | None = UNSET                # its parts (forward, backward, recompute, optimizer, collectives, host,
                                                  # offload), tokens/s, samples/s, MFU, the timing table used, host_range
                                                  # (the step at the table's fast and slow host: host_ms, seconds)
    outside_allocator_bytes: int | None = UNSET   # TRL GRPO with vLLM colocated: its share of the GPU (not in the peaks;
                                                  # the fit rule adds it to the need)
    compile_model: str | None = UNSET             # --compile: how the compiled step is modelled (estimator.compiled.MODEL)
    lengths: dict | None = UNSET                  # --lengths: the sample lengths the peak was taken over (estimator.lengths)
    # several GPUs (estimator.ranks): the job, its wrapper and every rank; the headline figures are the peak rank's
    world_size: int | None = UNSET
    sharding: str | None = UNSET
    strategy: str | None = UNSET                  # what the wrapper does, in words
    wrapper: dict | None = UNSET                  # the wrapper's facts (buckets, shards, groups)
    peak_rank: int | None = UNSET
    rank_imbalance_bytes: int | None = UNSET      # peak allocated of the rank that peaks minus the lowest
    job: dict | None = UNSET                      # every rank's peaks summed (gpus, peak_*_bytes_sum, nvidia_smi_bytes_sum)
    nccl: dict | None = UNSET                     # NCCL's own buffers per rank (bytes_per_rank, source)


@dataclass
class ProfilePayload(Payload):
    mode: str | None = UNSET                      # phases | full | ledger
    device: str | None = UNSET
    measured_by: str | None = UNSET
    peak_phase: str | None = UNSET
    peak_step: int | None = UNSET
    snapshots: list | None = UNSET                # every labelled reading
    step_time: dict | None = UNSET                # the profiled steps' seconds and parts (CUDA events per phase, measure/phase_time.py)
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
    profiled_steps_peak_allocated_bytes: int | None = UNSET   # the profiled steps alone (setup readings excluded)
    categories_sum_bytes: int | None = UNSET      # full/ledger mode: the categories summed (= the measured peak)
    categories_error: float | None = UNSET        # (categories_sum - peak) / peak
    lora_bytes_at_peak: int | None = UNSET
    by_operation: dict | None = UNSET             # allocated at the end of each phase (start, forward, backward, ...)
    param_count: int | None = UNSET
    trainable_param_count: int | None = UNSET
    theoretical_param_bytes: int | None = UNSET   # parameters' numel x element size
    buffer_bytes: int | None = UNSET
    total_memory_bytes: int | None = UNSET        # the device's total memory (CUDA)
    memory_snapshot: dict | None = UNSET          # --snapshot: its totals and top sites
    untracked_at_start_bytes: int | None = UNSET  # device memory no tracked tensor owns when profiling starts
    integration: str | None = UNSET               # the callback that profiled (transformers.Trainer, lightning.Trainer)
    # several GPUs (measure.gather): this rank, or the job with every rank in ``ranks``
    rank: int | None = UNSET
    world_size: int | None = UNSET
    peak_rank: int | None = UNSET
    rank_imbalance_bytes: int | None = UNSET
    job: dict | None = UNSET
    launcher: dict | None = UNSET                 # the torchrun command that ran the ranks
    node: int | None = UNSET                      # several machines: this rank's node (0..nnodes-1)
    hostname: str | None = UNSET                  # ... and the machine's name
    nodes: list | None = UNSET                    # the job's nodes: each one's ranks, host and peaks
    multinode: dict | None = UNSET                # nnodes, ranks per node, rendezvous, which node holds the whole job
    max_memory_allocated_bytes: int | None = UNSET   # a rank's process counters at its end
    max_memory_reserved_bytes: int | None = UNSET


@dataclass
class ComparePayload(Payload):
    rows: list | None = UNSET                     # one per technique: estimated (and measured) peaks, saving, cost
    baseline: str | None = UNSET
    measured: bool | None = UNSET
    device: str | None = UNSET
    estimate_calls: int | None = UNSET
    estimator: dict | None = UNSET                # the estimator's work: simulations, replays (explore.core.CachedEstimator.stats)
    budget_bytes: int | None = UNSET              # with --budget: the fit rule's figures (core.fits.Budget.to_dict)
    context_bytes: int | None = UNSET
    margin_bytes: int | None = UNSET
    usable_bytes: int | None = UNSET
    budget_source: str | None = UNSET
    budget_warning: str | None = UNSET


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
    gpus: list | None = UNSET                     # --gpus: the GPUs the measured cells ran on
    estimator: dict | None = UNSET                # the estimator's work: simulations, replays
    context_bytes: int | None = UNSET             # with --budget: the fit rule's figures (core.fits.Budget.to_dict)
    margin_bytes: int | None = UNSET
    usable_bytes: int | None = UNSET
    budget_source: str | None = UNSET
    budget_warning: str | None = UNSET


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
    recompute_plan: dict | None = UNSET           # --least-recompute: N of L blocks checkpointed, rows none/N/all, code
    budget_warning: str | None = UNSET            # the budget taken as the GPU's total memory (core.fits.Budget)
    batch_size: int | None = UNSET                # --least-recompute: the micro-batch searched
    batch1_peak_bytes: int | None = UNSET         # nothing fits: what batch 1 needs
    accumulated_peak_bytes: int | None = UNSET    # the target batch's accumulation, simulated
    target_fits: bool | None = UNSET              # False: the accumulated step does not fit
    world_size: int | None = UNSET                # --gpus N: the per-GPU search
    per_gpu_target_batch: int | None = UNSET
    peak_rank: int | None = UNSET
    gpus: int | None = UNSET
    verify: dict | None = UNSET                   # --verify: the real trials on the GPU
    estimate_calls: int | None = UNSET
    estimate_seconds: float | None = UNSET        # summed over the threads that waited for estimates
    seconds: float | None = UNSET                 # wall time of the search and the plan
    estimator: dict | None = UNSET                # the estimator's work: simulations, replays, per rank


@dataclass
class DoctorOomPayload(Payload):
    """doctor oom: the diagnosis, the message's numbers (doctor.message.OomMessage), the account and,
    with a training configuration, its estimate. The diagnosis comes first in the JSON."""

    diagnosis: str | None = UNSET                 # one of doctor.oom.DIAGNOSES
    reasons: list[str] | None = UNSET
    advice: list[str] | None = UNSET              # ordered: the first to try first
    form: str | None = UNSET                      # torch>=2.1 | torch<=2.0 | mps | cuda_error | no_figures
    message: str | None = UNSET
    device_type: str | None = UNSET
    device_index: int | None = UNSET
    requested_bytes: int | None = UNSET
    total_capacity_bytes: int | None = UNSET
    free_bytes: int | None = UNSET
    allowed_bytes: int | None = UNSET             # a per-process limit (set_per_process_memory_fraction)
    allocated_by_pytorch_bytes: int | None = UNSET
    private_pools_bytes: int | None = UNSET
    reserved_unallocated_bytes: int | None = UNSET
    this_process_bytes: int | None = UNSET
    mps_other_allocations_bytes: int | None = UNSET
    other_processes: list[dict] | None = UNSET    # {pid, used_bytes} per other process listed
    reserved_by_pytorch_bytes: int | None = UNSET
    other_processes_bytes: int | None = UNSET
    non_pytorch_bytes: int | None = UNSET
    certain: bool | None = UNSET                  # False: what the message leaves open could change the verdict
    evidence: dict[str, int] | None = UNSET       # the figures the verdict rests on, in bytes
    alternatives: list[dict] | None = UNSET       # the verdict for each process that could be this one
    account: dict | None = UNSET                  # doctor.account.Account, as a dict
    messages_found: int | None = UNSET
    estimate: dict | None = UNSET                 # with a configuration: its estimate, budget and fit options


@dataclass
class DoctorLogPayload(Payload):
    """doctor log: the memory series of a training log, its trend and the projected OOM."""

    source: str | None = UNSET                    # the file read (None: text given directly)
    source_format: str | None = UNSET             # lines | jsonl | json | trainer_state | csv
    memory_key: str | None = UNSET
    x_axis: str | None = UNSET                    # step | time_s
    readings: int | None = UNSET
    first_bytes: int | None = UNSET
    last_bytes: int | None = UNSET
    verdict: str | None = UNSET                   # leak | falling | steady
    pattern: str | None = UNSET                   # accelerating | linear | stepwise | decelerating | falling | dropped | steady
    growth_bytes_per_step: int | None = UNSET
    current_growth_bytes_per_step: int | None = UNSET
    accelerating: bool | None = UNSET
    acceleration_bytes_per_step2: float | None = UNSET
    trend_model: str | None = UNSET               # linear | quadratic
    trend_coefficients: list[float] | None = UNSET  # bytes = c0 + c1*x (+ c2*x^2)
    capacity_bytes: int | None = UNSET
    projected_oom_step: int | None = UNSET
    steps_to_oom: int | None = UNSET
    oom_observed_at: float | None = UNSET
    warmup_readings_skipped: int | None = UNSET
    interval_growth: list[dict] | None = UNSET    # {from, to, bytes_per_step} between readings
    causes: list[str] | None = UNSET
    notes_on_axis: str | None = UNSET             # only when x is seconds


@dataclass
class DoctorSnapshotPayload(Payload):
    """doctor snapshot: totals, top allocations, sites and fragmented segments of a memory snapshot;
    with a later snapshot, what grew."""

    snapshot: str | None = UNSET
    allocated_bytes: int | None = UNSET
    active_bytes: int | None = UNSET
    requested_bytes: int | None = UNSET
    reserved_bytes: int | None = UNSET
    reserved_unallocated_bytes: int | None = UNSET
    inactive_split_bytes: int | None = UNSET      # free pieces of segments still in use
    live_blocks: int | None = UNSET
    segments_count: int | None = UNSET
    top_allocations: list[dict] | None = UNSET    # doctor.snapshot.Allocation, largest first
    allocation_sites: list[dict] | None = UNSET   # {site, bytes, blocks}, largest first
    segments: list[dict] | None = UNSET           # the most fragmented segments (SegmentUse + fragmentation)
    trace_entries: int | None = UNSET
    timeline_axis: str | None = UNSET             # time_us | trace event
    oom_events: int | None = UNSET
    snapshot_after: str | None = UNSET            # the diff's fields, only with a later snapshot
    after_allocated_bytes: int | None = UNSET
    after_reserved_bytes: int | None = UNSET
    allocated_growth_bytes: int | None = UNSET
    grown_sites: list[dict] | None = UNSET        # doctor.snapshot.SiteGrowth + growth_bytes, largest first


@dataclass
class DoctorStatsPayload(Payload):
    """doctor stats: the figures of a torch.cuda.memory_stats() dump and what they say."""

    stats_file: str | None = UNSET
    allocated_bytes: int | None = UNSET
    allocated_peak_bytes: int | None = UNSET
    reserved_bytes: int | None = UNSET
    reserved_peak_bytes: int | None = UNSET
    active_bytes: int | None = UNSET
    requested_bytes: int | None = UNSET
    reserved_unallocated_bytes: int | None = UNSET
    inactive_split_bytes: int | None = UNSET
    segments: int | None = UNSET
    num_alloc_retries: int | None = UNSET
    num_ooms: int | None = UNSET
    num_device_alloc: int | None = UNSET
    num_device_free: int | None = UNSET
    fragmentation: float | None = UNSET           # inactive_split / reserved
    cache_unused_fraction: float | None = UNSET   # 1 - allocated / reserved
    findings: list[dict] | None = UNSET           # {kind, text, advice}


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
    levers: list[dict] | None = UNSET
    free_bytes: int | None = UNSET
    total_bytes: int | None = UNSET
    allowed_bytes: int | None = UNSET
    categories_error: float | None = UNSET        # (categories_sum - allocated) / allocated
    live_blocks: int | None = UNSET
    by_allocation_phase: dict[str, int] | None = UNSET
    earlier_steps_bytes: int | None = UNSET       # live blocks allocated by an earlier step
    top_blocks: list[dict] | None = UNSET
    step: int | None = UNSET
    history: bool | None = UNSET                  # allocator history was recorded
    module_depth: int | None = UNSET
    stats: dict[str, int] | None = UNSET          # memory_stats() at the failure (the kept counters)
    processes: list | None = UNSET                # (pid, used bytes) on the GPU, from NVML
    pid: int | None = UNSET
    certain: bool | None = UNSET
    reasons: list[str] | None = UNSET
    evidence: dict[str, int] | None = UNSET
    alternatives: list[dict] | None = UNSET
    advice: list[str] | None = UNSET
    levers_estimated: bool | None = UNSET         # levers are estimated configurations (else measured levers)
    message: str | None = UNSET


@dataclass
class AdaptivePayload(Payload):
    """Adaptive micro-batching (memlens.adaptive_batch, and the Hugging Face / Lightning callbacks):
    the micro-batch now, the recoveries and every change. Each runner writes its own batch fields."""

    micro_batch: int | None = UNSET
    effective_batch: int | None = UNSET           # adaptive_batch: rows of one optimizer step's batch
    per_device_batch: int | None = UNSET          # transformers.Trainer: rows of one dataloader batch
    batch_size: int | None = UNSET                # lightning.Trainer: rows of one dataloader batch
    accumulation: int | None = UNSET              # adaptive_batch: micro-batches per optimizer step
    accumulation_per_batch: int | None = UNSET    # transformers.Trainer: micro-batches per dataloader batch
    gradient_accumulation_steps: int | None = UNSET
    accumulate_grad_batches: int | None = UNSET
    steps: int | None = UNSET                     # adaptive_batch: optimizer steps run
    ooms_recovered: int | None = UNSET
    windows_redone: int | None = UNSET            # accumulation windows redone after an OOM in a backward
    changes: list[dict] | None = UNSET            # explore.adaptive.BatchChange, in order
    start_fit: dict | None = UNSET                # what memlens.fit said when it set the start
    trend: dict | None = UNSET                    # adaptive_batch: the last memory reading of the trend guard
    integration: str | None = UNSET
    guard_report: list[str] | None = UNSET        # the guard's files, when one ran


@dataclass
class WatchPayload(Payload):
    time_s: float | None = UNSET
    gpus: list | None = UNSET


PAYLOADS: dict[str, type[Payload]] = {
    "estimate": EstimatePayload, "profile": ProfilePayload, "compare": ComparePayload, "sweep": SweepPayload,
    "fit": FitPayload, "watch": WatchPayload, "doctor.oom": DoctorOomPayload, "doctor.log": DoctorLogPayload,
    "doctor.snapshot": DoctorSnapshotPayload, "doctor.stats": DoctorStatsPayload, "guard": GuardPayload,
    "adaptive": AdaptivePayload,
}


def payload_for(verb: str, data: dict[str, Any] | Payload | None) -> Payload:
    """``data`` as the verb's payload class (a dict is converted; unknown verbs get the base). A payload
    of another verb's class is refused: the JSON schema of a verb is its class.

    >>> payload_for("fit", EstimatePayload())
    Traceback (most recent call last):
    ...
    TypeError: a 'fit' Result takes a FitPayload, not EstimatePayload
    """
    cls = PAYLOADS.get(verb, Payload)
    if isinstance(data, Payload):
        if type(data) is not cls:
            raise TypeError(f"a {verb!r} Result takes a {cls.__name__}, not {type(data).__name__}")
        return data
    return cls.from_dict(dict(data or {}))
