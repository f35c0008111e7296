"""`memlens estimate` in the terminal (rich tables): the headline, every rank, categories, phases, components,
closed-form terms and modules of an estimate Result. Data in, text out: nothing is computed here."""
from __future__ import annotations

from ..core.errors import MemlensError
from ..core.payloads import EstimatePayload, given
from ..core.result import Result
from ..core.spec import TrainingSpec
from ..estimator.timing.step import describe as describe_time
from ..core.units import fmt_bytes

# clip: DP-SGD (Opacus); generation, reference: TRL's GRPO and DPO steps
_PHASE_ORDER = ("setup", "generation", "forward", "reference", "backward", "clip", "optimizer")


def _pct(part: int, whole: int | None) -> str:
    return f"{100.0 * part / whole:5.1f}%" if whole else "-"


def memory_tables(result: Result, top_modules: int = 12) -> list:
    """The rich renderables of an estimate Result: headline, ranks, categories, phases, components, terms, modules."""
    d: EstimatePayload = result.data
    out = [_headline(result, d)]
    if d.ranks:
        out.append(_ranks_table(d))
    out.append(_category_table(result, d))
    if result.by_phase:
        out.append(_phase_table(result))
    if d.by_component:
        out.append(_component_table(result, d))
    if d.terms:
        out.append(_terms_table(d))
    mods = d.by_module_group or result.by_module or []
    if mods:
        out.append(_module_table(mods, top_modules))
    return out


def _headline(result: Result, d: EstimatePayload):
    """What was estimated; the peaks and what nvidia-smi would show; the GPU verdict; where the peak falls."""
    from rich.text import Text  # rich: tables only, not for --json

    head = Text()
    head.append(f"{result.verb}: ", style="bold")
    head.append(_describe(result.spec or {}))
    head.append("\n")
    head.append("peak allocated ", style="bold")
    head.append(f"{fmt_bytes(result.peak_allocated_bytes)}", style="bold green")
    head.append("  (torch.cuda.max_memory_allocated)\n")
    if result.peak_reserved_bytes is not None:
        head.append("peak reserved  ", style="bold")
        head.append(f"{fmt_bytes(result.peak_reserved_bytes)}  (max_memory_reserved: caching allocator segments)\n")
    if d.cuda_context_bytes:
        head.append("nvidia-smi     ", style="bold")
        head.append(f"~{fmt_bytes(given(d.nvidia_smi_estimate_bytes))}  (reserved + ~{fmt_bytes(d.cuda_context_bytes)} CUDA context"
                    f"{_nccl_words(d)})\n")
    if d.fit_verdict:
        head.append("GPU            ", style="bold")
        head.append(d.fit_verdict + "\n", style="green" if (d.fit or {}).get("fits") else "bold red")
    if d.peak_phase:
        head.append(f"peak reached in the {d.peak_phase} phase" + (f" of step {d.peak_step}" if d.peak_step else ""))
        if d.attention_backends:
            head.append(f"; attention kernel: {', '.join(d.attention_backends)}")
    lig = d.liger or {}
    if lig.get("fused_loss"):     # --liger: the fused linear cross entropy's chunk (memlens.models.liger.liger_facts)
        head.append(f"\nliger-kernel {lig['version']}: fused linear cross entropy in {lig['chunks']} chunk(s) of "
                    f"{lig['chunk_size']} tokens ({lig['chunk_size']} x {lig['vocab_size']} logits at a time)")
    if (d.activation_plan or {}).get("summary"):   # checkpointing / offload: what it recomputes and moves
        head.append("\n" + d.activation_plan["summary"].removesuffix(" (activation_plan)."))
    return head


def _nccl_words(d: EstimatePayload) -> str:
    """Several GPUs: NCCL's own buffers beside the CUDA context (measured per GPU model), or why they are not counted."""
    if not d.ranks:
        return ""
    nccl = d.nccl or {}
    if nccl.get("bytes_per_rank"):
        return f" + {fmt_bytes(nccl['bytes_per_rank'])} NCCL"
    return "; NCCL's own buffers not included: not measured for this GPU"


def _category_table(result: Result, d: EstimatePayload):
    from rich.table import Table  # rich: tables only, not for --json

    cats = Table(title="at the peak, by category" + (f" (rank {given(d.peak_rank)})" if d.ranks else ""), title_justify="left")
    cats.add_column("category")
    cats.add_column("bytes", justify="right")
    cats.add_column("share", justify="right")
    for k, v in sorted((result.by_category or {}).items(), key=lambda kv: -kv[1]):
        if v:
            cats.add_row(k.replace("_", " "), fmt_bytes(v), _pct(v, result.peak_allocated_bytes))
    return cats


def _phase_table(result: Result):
    from rich.table import Table  # rich: tables only, not for --json

    ph = Table(title="peak of each phase", title_justify="left")
    ph.add_column("phase")
    ph.add_column("peak allocated", justify="right")
    for k in _PHASE_ORDER:
        if k in result.by_phase:
            ph.add_row(k, fmt_bytes(result.by_phase[k]["peak_allocated_bytes"]))
    return ph


def _component_table(result: Result, d: EstimatePayload):
    from rich.table import Table  # rich: tables only, not for --json

    ct = Table(title="at the peak, by component (module-name patterns)", title_justify="left")
    ct.add_column("component")
    ct.add_column("bytes", justify="right")
    ct.add_column("share", justify="right")
    for c in d.by_component:
        ct.add_row(c["component"], fmt_bytes(c["bytes"]), _pct(c["bytes"], result.peak_allocated_bytes))
    return ct


def _terms_table(d: EstimatePayload):
    from rich.table import Table  # rich: tables only, not for --json

    tt = Table(title="closed-form terms at the peak", title_justify="left")
    tt.add_column("term")
    tt.add_column("bytes", justify="right")
    tt.add_column("how it is counted")
    for t in d.terms:
        tt.add_row(t["name"].replace("_", " "), fmt_bytes(t["bytes"]), t["why"])
    return tt


def _module_table(mods: list[dict], top_modules: int):
    from rich.table import Table  # rich: tables only, not for --json

    mt = Table(title=f"at the peak, top {min(top_modules, len(mods))} modules (blocks grouped; JSON by_module has every module)",
               title_justify="left")
    mt.add_column("module")
    mt.add_column("bytes", justify="right")
    mt.add_column("mostly", justify="left")
    for row in mods[:top_modules]:
        cat = max(row["by_category"].items(), key=lambda kv: kv[1])[0] if row.get("by_category") else ""
        mt.add_row(row["module"], fmt_bytes(row["bytes"]), cat.replace("_", " "))
    return mt
def _ranks_table(d: EstimatePayload):
    """One row per simulated (or measured) rank: its peaks and what nvidia-smi would show."""
    from rich.table import Table  # rich: tables only, not for --json

    t = Table(title=f"per rank ({given(d.sharding)} over {given(d.world_size)} GPUs: {d.strategy or ''})", title_justify="left")
    for col in ("ranks", "peak allocated", "peak reserved", "nvidia-smi", "peak phase", "largest terms at the peak"):
        t.add_column(col, justify="left" if col in ("ranks", "peak phase", "largest terms at the peak") else "right")
    for e in d.ranks:
        ranks = e.get("ranks") or [e.get("rank")]
        label = ",".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
        if not e.get("simulated", True):
            lo, hi = e["peak_allocated_bytes_between"]
            t.add_row(label, f"{fmt_bytes(lo)}..{fmt_bytes(hi)}", "", "", "between the simulated ranks", "")
            continue
        terms = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in list((e.get("terms") or {}).items())[:2])
        mark = " *" if e.get("rank") == d.peak_rank else ""
        t.add_row(label + mark, fmt_bytes(e["peak_allocated_bytes"]), fmt_bytes(e.get("peak_reserved_bytes")),
                  fmt_bytes(e.get("nvidia_smi_estimate_bytes")) if e.get("nvidia_smi_estimate_bytes") else "-",
                  f"{e.get('peak_phase')} (step {e.get('peak_step')})", terms)
    job = d.job or {}
    if job:
        smi = job.get("nvidia_smi_bytes_sum")
        t.caption = (f"* the rank that peaks. Whole job ({job['gpus']} GPUs): allocated {fmt_bytes(job['peak_allocated_bytes_sum'])}, "
                     f"reserved {fmt_bytes(job['peak_reserved_bytes_sum'])}"
                     + (f", nvidia-smi {fmt_bytes(smi)}" if smi else ", nvidia-smi unknown (NCCL not measured)"))
    return t


def _describe(spec: dict) -> str:
    if not spec:
        return ""
    try:
        return TrainingSpec.from_dict(spec).describe()
    except MemlensError:  # a spec from another version: show its model only
        return str(spec.get("model", ""))


def render_estimate(result: Result, top_modules: int = 12) -> None:
    from rich.console import Console  # rich: tables only, not for --json

    console = Console()
    for r in memory_tables(result, top_modules):
        console.print(r)
    if result.data.step_time:
        print("predicted " + describe_time(result.data.step_time))
