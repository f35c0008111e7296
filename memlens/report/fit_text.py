"""`memlens fit` in the terminal: the largest micro-batch and the ranked plan; `fit --least-recompute`: the fewest
checkpointed blocks that fit."""
from __future__ import annotations

from ..core.payloads import UNSET, FitPayload
from ..core.result import Result
from ..core.units import fmt_bytes
from .text import console


def render_fit(result: Result) -> None:
    """The answer and the plan as rich tables."""
    c = console(wide=True)
    d: FitPayload = result.data
    dp = d.searched_field == "physical_batch_size"
    what = "physical batch (DP-SGD, Opacus' BatchMemoryManager)" if dp else "micro-batch"
    c.print(f"[bold]{result.spec['model']}[/bold]: largest {what} [bold]{d.max_batch_size}[/bold] "
            f"(predicted peak reserved {fmt_bytes(d.predicted_peak_bytes)}, allocated {fmt_bytes(d.predicted_peak_allocated_bytes)})")
    c.print(_budget_and_effort(d))
    if dp and d.micro_batch_size:
        k = -(-d.target_batch // d.micro_batch_size)
        c.print(f"logical batch {d.target_batch}: --physical-batch-size {d.micro_batch_size} ({k} physical batch(es) per optimizer step)")
    else:
        c.print(f"target batch {d.target_batch}: micro-batch {d.micro_batch_size} x accumulation {d.grad_accum}")
    v = d.verify
    if v:
        c.print(f"verified on the GPU: largest batch {v['max_batch_size']} in {len(v['trials'])} trials "
                f"({', '.join(str(t['batch']) + ('✓' if t['fits'] else '✗') for t in v['trials'])})")
    if d.plan:
        c.print(_plan_table(d))
        if any(e["gpus"] > 1 and not e.get("not_searched") for e in d.plan):
            c.print("[dim]multi-GPU entries: each rank simulated under a fake process group; peaks are the rank that peaks[/dim]")


def _budget_and_effort(d: FitPayload) -> str:
    """budget - context - margin = usable; how many estimates (simulated, replayed) in how long."""
    e = d.estimator or {}
    how = ""
    if "simulations" in e:
        how = (f" ({e['simulations']} simulated, {e['replays']} replayed"
               + (f", {e['per_rank']} simulated per rank" if e.get("per_rank") else "") + ")")
    seconds = d.seconds if d.seconds is not UNSET else d.estimate_seconds
    return (f"budget {fmt_bytes(d.budget_bytes)} ({d.budget_source}) - CUDA context {fmt_bytes(d.context_bytes)} "
            f"- margin {fmt_bytes(d.margin_bytes)} = {fmt_bytes(d.usable_bytes)} usable; {d.estimate_calls} estimates"
            + how + f", {seconds} s")


def _plan_table(d: FitPayload):
    """The ranked plan for the target batch: one row per setting, best first."""
    from rich.table import Table  # rich: tables only, not for --json

    t = Table(title=f"plan for batch {d.target_batch} (step times predicted)", title_justify="left")
    for col, j in (("#", "right"), ("setting", "left"), ("fits", "center"), ("micro x accum", "right"), ("peak reserved", "right"),
                   ("step (pred.)", "right"), ("GPU-s vs as-is", "right"), ("kind", "left"), ("flags", "left")):
        t.add_column(col, justify=j, no_wrap=col in ("setting", "micro x accum", "flags"))
    for e in d.plan:
        if e.get("error"):
            t.add_row(str(e["rank"]), e["name"], "?", "-", "-", "-", "-", e["kind"], f"[dim]{e['error'][:60]}[/dim]")
            continue
        if e.get("not_searched"):
            f = e.get("best_step_time_factor")
            t.add_row(str(e["rank"]), e["name"], "[dim]-[/dim]", "-", "-", f">= {e['best_gpu_seconds'] / e['gpus']:.3f} s",
                      f">= {f:.2f}x" if f else "-", e["kind"], f"[dim]not searched: {e['not_searched_for']} fits and is faster[/dim]")
            continue
        mxa = f"{e['micro_batch']} x {e['grad_accum']}" + (f" x {e['gpus']} GPUs" if e["gpus"] > 1 else "") if e["fits"] else "-"
        t.add_row(str(e["rank"]), e["name"], "yes" if e["fits"] else "[red]no[/red]", mxa,
                  fmt_bytes(e["predicted_peak_bytes"]), f"{e['predicted_step_seconds']:.3f} s",
                  f"{e['step_time_factor']:.2f}x" if e.get("step_time_factor") else "-", e["kind"], e["flags"])
    return t


def render_recompute(result: Result) -> None:
    """The least recompute: the answer, none / N / all side by side, and the line that applies it."""
    c = console(wide=True)
    d: FitPayload = result.data
    rp = d.recompute_plan
    n = rp["checkpoint_layers"]
    c.print(_recompute_answer(result, d))
    c.print(f"budget {fmt_bytes(d.budget_bytes)} ({d.budget_source}) - CUDA context {fmt_bytes(d.context_bytes)} "
            f"- margin {fmt_bytes(d.margin_bytes)} = {fmt_bytes(d.usable_bytes)} usable; {d.estimate_calls} simulations, "
            f"{d.seconds} s")
    c.print(_recompute_table(rp))
    if rp.get("apply") and (rp["apply"].get("checkpoint_layers") or rp["apply"].get("offload_layers")):
        c.print(f"apply it: {rp['code']}")
    elif n is None:
        c.print("[dim]a smaller --batch-size (memlens fit without --least-recompute finds the largest) or a larger GPU[/dim]")
    if not rp.get("offload_weighed"):
        c.print("[dim]activation offload not weighed: it costs more per byte freed than recomputing on this GPU[/dim]")


def _recompute_answer(result: Result, d: FitPayload) -> str:
    """The first line: does not fit / fits as it is / checkpoint the first N blocks (and offload M) at this cost."""
    rp = d.recompute_plan
    L, n = rp["layers"], rp["checkpoint_layers"]
    head = f"[bold]{result.spec['model']}[/bold] micro-batch {d.batch_size}: "
    if n is None:
        return head + f"[red]does not fit even with all {L} blocks checkpointed[/red]"
    if not rp["apply"].get("checkpoint_layers") and not rp["apply"].get("offload_layers") if rp.get("apply") else True:
        return head + "fits without checkpointing"
    what = [f"checkpoint the first [bold]{n}[/bold] of {L} blocks" + ("" if rp["checkpoint_policy"] == "full" else
                                                                     f" ({rp['checkpoint_policy']})")] if n else []
    if rp.get("offload_layers"):
        what.append(f"offload [bold]{rp['offload_layers']}[/bold] more to host memory")
    full = rp.get("full_checkpointing_added_seconds") or 0
    share = f", {rp['added_step_seconds'] / full:.0%} of checkpointing all {L}" if full else ""
    return head + " and ".join(what) + f" (+{rp['added_step_seconds'] * 1e3:.1f} ms per micro-batch predicted{share})"


def _recompute_table(rp: dict):
    from rich.table import Table  # rich: tables only, not for --json

    t = Table(title_justify="left")
    for col in ("plan", "fits", "need", "peak reserved", "peak allocated", "added (pred.)", "flags"):
        t.add_column(col, justify="left" if col in ("plan", "flags") else "right", no_wrap=True)
    for r in rp["rows"]:
        t.add_row(r["name"], "yes" if r["fits"] else "[red]no[/red]", fmt_bytes(r["need_bytes"]), fmt_bytes(r["predicted_peak_bytes"]),
                  fmt_bytes(r["predicted_peak_allocated_bytes"]), f"+{r['added_seconds'] * 1e3:.1f} ms", r["flags"] or "-")
    return t
