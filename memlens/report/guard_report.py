"""The page memlens.guard() writes at an OOM (oom_report.html): the diagnosis with its evidence,
the account of the GPU, what held the memory (by category, module, allocating phase, largest
blocks) and the levers, all from the guard's Result (one self-contained file, no matplotlib).

>>> from memlens.core.result import Result
>>> d = GuardPayload(device="cuda:0", step=3, diagnosis="capacity", requested_bytes=2**30, allocated_bytes=3 * 2**30,
...                  reserved_bytes=3 * 2**30, categories_sum_bytes=3 * 2**30, categories_error=0.0,
...                  reasons=["too big"], advice=["halve"])
>>> html = guard_html(Result(verb="guard", by_category={"activations": 3 * 2**30}, data=d))
>>> "capacity" in html and "3.00 GiB" in html
True
"""
from __future__ import annotations

from ..core.payloads import GuardPayload
from ..core.result import Result
from ..core.units import fmt_bytes
from ..doctor.account import Account
from .profile_report import _CSS, _e, _table


def guard_html(result: Result) -> str:
    d: GuardPayload = result.data
    f = fmt_bytes
    title = "memlens guard: out of memory"
    p = [f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{_CSS}</style></head><body>",
         f"<h1>{title} on {_e(d.device or 'cuda')}</h1>",
         f"<div class='sub'>step {_e(d.step)} · {_e(f(d.requested_bytes))} requested · "
         f"{_e(f(d.allocated_bytes))} allocated, {_e(f(d.reserved_bytes))} reserved at the failure</div>"]
    sure = "" if d.certain is not False else " <span class='bad'>(uncertain)</span>"
    p.append(f"<h2>Diagnosis: {_e(d.diagnosis)}{sure}</h2>")
    p += [f"<p>{_e(r)}</p>" for r in d.reasons or []]
    if d.evidence:
        p.append(_table(["evidence", "bytes"], [[k, f(v)] for k, v in d.evidence.items()]))
    if d.account:
        rows = [[label, f(n), what] for label, n, what in Account(**d.account).lines() if n is not None]
        p.append("<h2>The GPU at the failure</h2>" + _table(["", "bytes", "what"], rows))
    total = d.allocated_bytes or sum(result.by_category.values()) or 1
    if result.by_category:
        p.append("<h2>What held the memory (live blocks, by category)</h2>")
        p.append(_table(["category", "bytes", "share of allocated"],
                        [[k, f(v), f"{100 * v / total:.1f}%"] for k, v in result.by_category.items()]))
        err = d.categories_error
        p.append(f"<div class='note'>categories sum to {_e(f(d.categories_sum_bytes))}, memory_allocated() was "
                 f"{_e(f(d.allocated_bytes))}" + (f" ({100 * err:+.3f}%)" if err is not None else "") + "</div>")
    if result.by_module:
        p.append("<h2>By module (top 25)</h2>")
        p.append(_table(["module", "bytes", "by category"],
                        [[m["module"], f(m["bytes"]), ", ".join(f"{c} {f(v)}" for c, v in m["by_category"].items())]
                         for m in result.by_module[:25]]))
    if d.by_allocation_phase:
        p.append("<h2>Allocated in</h2>" + _table(["phase", "bytes live at the failure"],
                                                  [[k, f(v)] for k, v in d.by_allocation_phase.items()]))
        if d.earlier_steps_bytes:
            p.append(f"<div class='note'>{_e(f(d.earlier_steps_bytes))} was allocated by earlier steps and is still live: "
                     f"tensors kept across steps (a leak?)</div>")
    if d.top_blocks:
        p.append("<h2>Largest live blocks</h2>")
        p.append(_table(["size", "category", "module", "allocated in", "site"],
                        [[f(b["size"]), b["category"], b["module"], b["allocated_in"], b.get("site") or ""] for b in d.top_blocks]))
    levers = d.levers or []
    if levers:
        p.append("<h2>Levers</h2>")
        if d.levers_estimated:
            p.append(_table(["change", "estimated peak allocated", "fits"],
                            [[o["name"], f(o["peak_allocated_bytes"]), "yes" if o["fits"] else "no"] for o in levers]))
        else:
            p.append(_table(["lever", "kind", "shrinks", "live now", "cost"],
                            [[o["title"], o["kind"], ", ".join(o["shrinks"]), f(o["shrinks_bytes"]), o["cost"]] for o in levers]))
    if d.advice:
        p.append("<h2>What to do</h2><ol>" + "".join(f"<li>{_e(a)}</li>" for a in d.advice) + "</ol>")
    for n in result.notes:
        p.append(f"<div class='note'>note: {_e(n)}</div>")
    if d.message:
        p.append(f"<h2>PyTorch's message</h2><pre style='white-space:pre-wrap'>{_e(d.message)}</pre>")
    p.append("<div class='note'>oom_snapshot.pickle beside this page opens at https://pytorch.org/memory_viz "
             "(or torch.cuda._memory_viz trace_plot / segment_plot).</div></body></html>")
    return "\n".join(p)
