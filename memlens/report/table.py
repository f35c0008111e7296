"""Terminal renderings of a memory Result (rich tables). Data in, text out: nothing is computed here."""
from __future__ import annotations

from typing import Any

from ..core.spec import TrainingSpec
from ..core.units import fmt_bytes


def _pct(part: int, whole: int | None) -> str:
    return f"{100.0 * part / whole:5.1f}%" if whole else "-"


def memory_tables(result: Any, top_modules: int = 12):
    """The rich renderables for an estimate/profile Result: headline, categories, phases, modules."""
    from rich.table import Table  # rich: tables only, not for --json
    from rich.text import Text  # rich: tables only, not for --json

    d = result.to_dict() if hasattr(result, "to_dict") else result
    peak = d.get("peak_allocated_bytes")
    spec = d.get("spec") or {}
    out = []
    head = Text()
    head.append(f"{d.get('verb', '')}: ", style="bold")
    head.append(_describe(spec))
    head.append("\n")
    head.append("peak allocated ", style="bold")
    head.append(f"{fmt_bytes(peak)}", style="bold green")
    head.append("  (torch.cuda.max_memory_allocated)\n")
    if d.get("peak_reserved_bytes") is not None:
        head.append("peak reserved  ", style="bold")
        head.append(f"{fmt_bytes(d['peak_reserved_bytes'])}  (max_memory_reserved: caching allocator segments)\n")
    if d.get("cuda_context_bytes"):
        head.append("nvidia-smi     ", style="bold")
        nccl = (d.get("nccl") or {}) if d.get("ranks") else {}
        extra = "" if not d.get("ranks") else (f" + {fmt_bytes(nccl['bytes_per_rank'])} NCCL" if nccl.get("bytes_per_rank")
                                                else "; NCCL's own buffers not included: not measured for this GPU")
        head.append(f"~{fmt_bytes(d.get('nvidia_smi_estimate_bytes'))}  (reserved + ~{fmt_bytes(d['cuda_context_bytes'])} CUDA context{extra})\n")
    if d.get("fit_verdict"):
        ok = (d.get("fit") or {}).get("fits")
        head.append("GPU            ", style="bold")
        head.append(d["fit_verdict"] + "\n", style="green" if ok else "bold red")
    if d.get("peak_phase"):
        head.append(f"peak reached in the {d['peak_phase']} phase" + (f" of step {d['peak_step']}" if d.get("peak_step") else ""))
        if d.get("attention_backends"):
            head.append(f"; attention kernel: {', '.join(d['attention_backends'])}")
    lig = d.get("liger") or {}
    if lig.get("fused_loss"):     # --liger: the fused linear cross entropy's chunk (memlens.models.liger.liger_facts)
        head.append(f"\nliger-kernel {lig['version']}: fused linear cross entropy in {lig['chunks']} chunk(s) of "
                    f"{lig['chunk_size']} tokens ({lig['chunk_size']} x {lig['vocab_size']} logits at a time)")
    if (d.get("activation_plan") or {}).get("summary"):   # checkpointing / offload: what it recomputes and moves
        head.append("\n" + d["activation_plan"]["summary"].removesuffix(" (activation_plan)."))
    out.append(head)

    if d.get("ranks"):
        out.append(_ranks_table(d))

    cats = Table(title="at the peak, by category" + (f" (rank {d['peak_rank']})" if d.get("ranks") else ""), title_justify="left")
    cats.add_column("category")
    cats.add_column("bytes", justify="right")
    cats.add_column("share", justify="right")
    for k, v in sorted((d.get("by_category") or {}).items(), key=lambda kv: -kv[1]):
        if v:
            cats.add_row(k.replace("_", " "), fmt_bytes(v), _pct(v, peak))
    out.append(cats)

    if d.get("by_phase"):
        ph = Table(title="peak of each phase", title_justify="left")
        ph.add_column("phase")
        ph.add_column("peak allocated", justify="right")
        # clip: DP-SGD (Opacus); generation, reference: TRL's GRPO and DPO steps
        for k in ("setup", "generation", "forward", "reference", "backward", "clip", "optimizer"):
            if k in d["by_phase"]:
                ph.add_row(k, fmt_bytes(d["by_phase"][k]["peak_allocated_bytes"]))
        out.append(ph)

    if d.get("by_component"):
        ct = Table(title="at the peak, by component (module-name patterns)", title_justify="left")
        ct.add_column("component")
        ct.add_column("bytes", justify="right")
        ct.add_column("share", justify="right")
        for c in d["by_component"]:
            ct.add_row(c["component"], fmt_bytes(c["bytes"]), _pct(c["bytes"], peak))
        out.append(ct)

    if d.get("terms"):
        tt = Table(title="closed-form terms at the peak", title_justify="left")
        tt.add_column("term")
        tt.add_column("bytes", justify="right")
        tt.add_column("how it is counted")
        for t in d["terms"]:
            tt.add_row(t["name"].replace("_", " "), fmt_bytes(t["bytes"]), t["why"])
        out.append(tt)

    mods = d.get("by_module_group") or d.get("by_module") or []
    if mods:
        mt = Table(title=f"at the peak, top {min(top_modules, len(mods))} modules (blocks grouped; JSON by_module has every module)", title_justify="left")
        mt.add_column("module")
        mt.add_column("bytes", justify="right")
        mt.add_column("mostly", justify="left")
        for row in mods[:top_modules]:
            cat = max(row["by_category"].items(), key=lambda kv: kv[1])[0] if row.get("by_category") else ""
            mt.add_row(row["module"], fmt_bytes(row["bytes"]), cat.replace("_", " "))
        out.append(mt)
    return out


def _ranks_table(d: dict):
    """One row per simulated (or measured) rank: its peaks and what nvidia-smi would show."""
    from rich.table import Table  # rich: tables only, not for --json

    t = Table(title=f"per rank ({d.get('sharding')} over {d.get('world_size')} GPUs: {d.get('strategy', '')})", title_justify="left")
    for col in ("ranks", "peak allocated", "peak reserved", "nvidia-smi", "peak phase", "largest terms at the peak"):
        t.add_column(col, justify="left" if col in ("ranks", "peak phase", "largest terms at the peak") else "right")
    for e in d["ranks"]:
        ranks = e.get("ranks") or [e.get("rank")]
        label = ",".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
        if not e.get("simulated", True):
            lo, hi = e["peak_allocated_bytes_between"]
            t.add_row(label, f"{fmt_bytes(lo)}..{fmt_bytes(hi)}", "", "", "between the simulated ranks", "")
            continue
        terms = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in list((e.get("terms") or {}).items())[:2])
        mark = " *" if e.get("rank") == d.get("peak_rank") else ""
        t.add_row(label + mark, fmt_bytes(e["peak_allocated_bytes"]), fmt_bytes(e.get("peak_reserved_bytes")),
                  fmt_bytes(e.get("nvidia_smi_estimate_bytes")) if e.get("nvidia_smi_estimate_bytes") else "-",
                  f"{e.get('peak_phase')} (step {e.get('peak_step')})", terms)
    job = d.get("job") or {}
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
    except Exception:  # a spec from another version: show its model only
        return str(spec.get("model", ""))


def print_memory(result: Any, top_modules: int = 12) -> None:
    from rich.console import Console  # rich: tables only, not for --json

    console = Console()
    for r in memory_tables(result, top_modules):
        console.print(r)
