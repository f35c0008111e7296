"""`memlens profile` in the terminal: the measured peaks, every rank, phases, categories, components, modules,
the model load, the allocator, the estimate beside the measurement and torch.profiler's top operators."""
from __future__ import annotations

from ..core.payloads import UNSET, ProfilePayload, given
from ..core.result import Result
from ..core.units import fmt_bytes
from .text import console


def render_profile(result: Result) -> None:
    """The terminal summary of a profile Result."""
    c = console()
    d: ProfilePayload = result.data
    _headline(c, result, d)
    if d.ranks:
        c.print(_ranks_table(d))
        c.print(f"  imbalance between ranks: {fmt_bytes(given(d.rank_imbalance_bytes))} (peak allocated)")
    for t in _memory_tables(result, d):
        c.print(t)
    _setup_lines(c, d)
    st = d.step_time
    if st:
        c.print(f"  step {st['seconds']:.4g} s measured (median of {st['steps']}: "
                + ", ".join(f"{k} {v:.4g}" for k, v in st["parts"].items()) + f"; {st['measured_by']})")
    ce = d.compare_estimate
    if ce and not ce.get("available"):
        c.print(f"  [yellow]estimate unavailable: {ce.get('reason')}[/yellow]")
    elif ce:
        c.print(_estimate_vs_measured(ce))
        for r in ce.get("step_time") or []:   # seconds: the per-op time model vs CUDA events per phase
            rng = r.get("predicted_range")
            c.print(f"  {r['name']} seconds: predicted {r['predicted_seconds']:.4g}"
                    + (f" ({rng[0]:.4g}-{rng[1]:.4g} over the host spread)" if rng else "")
                    + f", measured {r['measured_seconds']:.4g}" + ("" if r["error"] is None else f" ({100 * r['error']:+.1f}%)")
                    + ("" if not rng else ", inside the range" if r["inside_range"] else ", outside the range"))
    if d.torch_profiler:
        c.print(_top_operators(d.torch_profiler))
    if d.multinode:
        c.print(_nodes_line(d))


def _nodes_line(d: ProfilePayload) -> str:
    """A job over several machines: the nodes, the rendezvous, and which node holds the whole job's result."""
    mn = d.multinode
    nodes = ", ".join(f"node {n['node']} ({n['hostname']}): ranks {', '.join(map(str, n['ranks']))}" for n in d.nodes or [])
    return (f"  {mn['nnodes']} nodes x {mn['nproc_per_node']} ranks ({mn['rendezvous']} rendezvous at {mn['rdzv_endpoint']}): "
            f"{mn['note']}" + (f"; {nodes}" if nodes else ""))


def _headline(c, result: Result, d: ProfilePayload) -> None:
    spec = result.spec or {}
    steps = d.profiled_steps if d.profiled_steps is not UNSET else len(d.steps or [])
    c.print(f"[bold]memlens profile[/bold] {spec.get('model', '')} on {given(d.device)} ({given(d.mode)} mode, "
            f"{steps} steps after {d.warmup_steps or 0} warmup)")
    what = "max_memory_allocated()" if str(d.device or "").startswith("cuda") else "live tensor storages (CPU ledger)"
    c.print(f"  peak allocated [bold]{fmt_bytes(result.peak_allocated_bytes)}[/bold] ({what}) in {given(d.peak_phase)} "
            f"of step {given(d.peak_step)}; peak reserved {fmt_bytes(result.peak_reserved_bytes)}")
    nv = d.nvml or {}
    if nv.get("available"):
        c.print(f"  nvidia-smi for this process {fmt_bytes(nv['process_used_bytes'])} (NVML: reserved + CUDA context + libraries)")


def _ranks_table(d: ProfilePayload):
    from rich.table import Table  # rich: tables only, not for --json

    t = Table(title=f"per rank ({len(d.ranks)} ranks; * the rank that peaks)", box=None)
    for col in ("rank", "peak allocated", "peak reserved", "nvidia-smi (NVML)", "peak phase"):
        t.add_column(col, justify="left" if col in ("rank", "peak phase") else "right")
    for r in d.ranks:
        nvr = (r.get("nvml") or {})
        t.add_row(f"{r['rank']}{' *' if r['rank'] == d.peak_rank else ''}", fmt_bytes(r["peak_allocated_bytes"]),
                  fmt_bytes(r["peak_reserved_bytes"]), fmt_bytes(nvr["process_used_bytes"]) if nvr.get("available") else "-",
                  f"{r.get('peak_phase')} (step {r.get('peak_step')})")
    return t


def _memory_tables(result: Result, d: ProfilePayload) -> list:
    """Peak of every phase; at the peak by category, by component and the top modules."""
    from rich.table import Table  # rich: tables only, not for --json

    out = []
    t = Table(title="peak of every phase" + (f" (rank {given(d.peak_rank)})" if d.ranks else ""), box=None)
    t.add_column("phase")
    t.add_column("peak allocated", justify="right")
    t.add_column("step", justify="right")
    for ph, v in result.by_phase.items():
        t.add_row(ph, fmt_bytes(v["peak_allocated_bytes"]), str(v.get("peak_step")))
    out.append(t)
    if result.by_category:
        total = result.peak_allocated_bytes or 1
        t = Table(title="at the peak, by category", box=None)
        t.add_column("category")
        t.add_column("bytes", justify="right")
        t.add_column("share", justify="right")
        for k, v in result.by_category.items():
            if v:
                t.add_row(k, fmt_bytes(v), f"{100 * v / total:.1f}%")
        out.append(t)
    if d.by_component:
        t = Table(title="at the peak, by component", box=None)
        t.add_column("component")
        t.add_column("bytes", justify="right")
        for r in d.by_component:
            t.add_row(r["component"], fmt_bytes(r["bytes"]))
        out.append(t)
    if result.by_module:
        t = Table(title="top modules", box=None)
        for col in ("module", "live at peak", "forward peak", "backward peak"):
            t.add_column(col, justify="left" if col == "module" else "right")
        for r in result.by_module[:10]:
            t.add_row(r["module"] + (" [LoRA]" if r.get("lora") else ""), fmt_bytes(r["bytes"]),
                      fmt_bytes(r.get("forward_peak_bytes")), fmt_bytes(r.get("backward_peak_bytes")))
        out.append(t)
    return out


def _setup_lines(c, d: ProfilePayload) -> None:
    """What loading the model cost, and the caching allocator's counters."""
    ml = d.model_load or {}
    if "loaded_bytes" in ml:
        c.print(f"  model load: {fmt_bytes(ml['loaded_bytes'])} allocated vs {fmt_bytes(ml['theoretical_param_bytes'])} of parameters "
                f"(overhead {fmt_bytes(ml['overhead_bytes'])}: buffers, batch, rounding)")
    if "allocated_after_move_bytes" in ml:
        c.print(f"  loaded on the CPU in {ml['cpu_build_seconds']} s (device allocated {fmt_bytes(ml['allocated_after_cpu_load_bytes'])}), "
                f"moved to the device in {ml['move_seconds']} s: allocated {fmt_bytes(ml['allocated_after_move_bytes'])}, "
                f"reserved {fmt_bytes(ml['reserved_after_move_bytes'])}")
    al = d.allocator
    if al:
        c.print(f"  allocator: reserved-allocated {fmt_bytes(al['reserved_unallocated_bytes'])}, inactive split "
                f"{fmt_bytes(al['inactive_split_bytes'])} (fragmentation {100 * al['fragmentation']:.1f}%), "
                f"alloc retries {al['num_alloc_retries']}, OOMs {al['num_ooms']}")


def _estimate_vs_measured(ce: dict):
    from rich.table import Table  # rich: tables only, not for --json

    t = Table(title="estimate vs measured", box=None)
    for col in ("figure", "estimated", "measured", "error"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    for r in ce["rows"] + ce["by_phase"] + ce["by_category"]:
        t.add_row(r["name"], fmt_bytes(r["estimated_bytes"]), fmt_bytes(r["measured_bytes"]),
                  "-" if r["error"] is None else f"{100 * r['error']:+.2f}%")
    return t


def _top_operators(tp: dict):
    from rich.table import Table  # rich: tables only, not for --json

    t = Table(title="torch.profiler: top operators by time", box=None)
    t.add_column("operator")
    t.add_column("calls", justify="right")
    t.add_column(tp["time_key"], justify="right")
    for r in tp["by_time"][:8]:
        t.add_row(r["name"], str(r["calls"]), f"{r[tp['time_key']]:.0f}")
    return t
