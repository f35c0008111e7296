"""A Result as HTML for Jupyter (``Result._repr_html_``): the verb's summary, its main tables and
the timeline inline (an SVG drawn here). Importing this module registers the view with
:mod:`memlens.core.result` (``import memlens`` does it), so the Result itself stays data.

>>> from memlens.core.result import Result
>>> r = Result(verb="estimate", peak_allocated_bytes=3 * 1024**2, by_category={"parameters": 1024**2})
>>> "3.00 MiB" in result_html(r) and "parameters" in result_html(r)
True
"""
from __future__ import annotations

import html
from typing import Any

from ..core import result as _result
from ..core.result import Result
from ..core.payloads import UNSET, DoctorLogPayload, EstimatePayload, FitPayload, Payload, ProfilePayload
from ..core.units import bytes_unit, fmt_bytes

_CSS = ("font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;font-size:13px;max-width:980px")
_TABLE = "border-collapse:collapse;margin:4px 0 10px 0"
_CELL = "padding:2px 10px;border-bottom:1px solid #e5e5e5;text-align:right"


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th style='{_CELL};text-align:left' >{_e(h)}</th>" if i == 0 else f"<th style='{_CELL}'>{_e(h)}</th>"
                   for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f"<td style='{_CELL}{';text-align:left' if i == 0 else ''}'>{_e(c)}</td>" for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f"<table style='{_TABLE}'><tr>{head}</tr>{body}</table>"


def _fits(d: Payload) -> str | None:
    """The fit verdict, where the verb made one: an estimate against its GPU, fit's largest batch, a log's trend."""
    if isinstance(d, EstimatePayload) and d.fit_verdict:     # the fit rule against the GPU it is for
        return d.fit_verdict
    if isinstance(d, FitPayload) and d.max_batch_size is not UNSET and d.max_batch_size is not None:
        return f"largest batch that fits: {d.max_batch_size}" + (f" (budget {fmt_bytes(d.budget_bytes)})" if d.budget_bytes else "")
    if isinstance(d, DoctorLogPayload) and d.verdict:
        return f"verdict: {d.verdict}"
    return None


def timeline_svg(timeline: list[dict[str, Any]], width: int = 900, height: int = 220) -> str:
    """Allocated (blue) and reserved (grey) over the timeline points, y from 0 (no plotting library)."""
    top = max([p.get("reserved_bytes") or 0 for p in timeline] + [p.get("allocated_bytes") or 0 for p in timeline] + [1])
    div, unit = bytes_unit(top)
    left, bottom, pad = 60, 24, 8
    n = max(len(timeline) - 1, 1)

    def xy(i: int, v: float) -> str:
        x = left + (width - left - pad) * i / n
        y = pad + (height - bottom - pad) * (1 - (v or 0) / top)
        return f"{x:.1f},{y:.1f}"

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-family='sans-serif' font-size='11'>",
           f"<rect x='{left}' y='{pad}' width='{width - left - pad}' height='{height - bottom - pad}' fill='#fafafa' stroke='#ddd'/>"]
    for key, colour in (("reserved_bytes", "#95a5a6"), ("allocated_bytes", "#3498db")):
        pts = " ".join(xy(i, p.get(key)) for i, p in enumerate(timeline))
        out.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' points='{pts}'/>")
    out.append(f"<text x='4' y='{pad + 10}'>{top / div:.2f} {unit}</text><text x='4' y='{height - bottom}'>0</text>")
    out.append(f"<text x='{left}' y='{height - 6}' fill='#666'>timeline points in order; blue: allocated, grey: reserved; "
               f"y from 0 to {top / div:.2f} {unit}</text></svg>")
    return "".join(out)


def _timeline_html(result: Result) -> str:
    if not result.timeline:
        return ""
    return timeline_svg(result.timeline)   # inline SVG: no matplotlib, no image files, sharp at any zoom


def result_html(result: Result, top_modules: int = 10) -> str:
    """The HTML a notebook shows for a Result."""
    spec = result.spec or {}
    title = f"memlens {result.verb}" + (f": {spec.get('model')}" if spec.get("model") else "")
    parts = [f"<div style='{_CSS}'><h3 style='margin:4px 0'>{_e(title)}</h3>"]
    summary = []
    if result.peak_allocated_bytes is not None:
        summary.append(("peak allocated", fmt_bytes(result.peak_allocated_bytes)))
    if result.peak_reserved_bytes is not None:
        summary.append(("peak reserved", fmt_bytes(result.peak_reserved_bytes)))
    d = result.data
    if isinstance(d, (EstimatePayload, ProfilePayload)) and d.peak_phase:
        summary.append(("peak phase", f"{d.peak_phase} (step {d.peak_step if d.peak_step is not UNSET else None})"))
    fits = _fits(d)
    if fits:
        summary.append(("fit", fits))
    if summary:
        parts.append("".join(f"<div style='display:inline-block;margin:4px 22px 8px 0'><b style='font-size:17px'>{_e(v)}</b>"
                             f"<br><span style='color:#666'>{_e(k)}</span></div>" for k, v in summary))
    total = result.peak_allocated_bytes or 0
    cats = [(k, v) for k, v in (result.by_category or {}).items() if v]
    if cats:
        parts.append("<h4 style='margin:6px 0 0'>At the peak, by category</h4>")
        parts.append(_table(["category", "bytes", "share of peak"],
                            [[k, fmt_bytes(v), f"{100 * v / total:.1f}%" if total else "-"] for k, v in cats]))
    if result.by_phase:
        parts.append("<h4 style='margin:6px 0 0'>Peak of every phase</h4>")
        parts.append(_table(["phase", "peak allocated", "step"],
                            [[ph, fmt_bytes(v.get("peak_allocated_bytes")), v.get("peak_step")] for ph, v in result.by_phase.items()]))
    if result.by_module:
        rows = sorted(result.by_module, key=lambda r: -(r.get("bytes") or 0))[:top_modules]
        parts.append(f"<h4 style='margin:6px 0 0'>Top {len(rows)} modules (live at the peak)</h4>")
        parts.append(_table(["module", "live at the peak", "forward peak", "backward peak"],
                            [[r["module"], fmt_bytes(r.get("bytes")), fmt_bytes(r.get("forward_peak_bytes")),
                              fmt_bytes(r.get("backward_peak_bytes"))] for r in rows]))
    tl = _timeline_html(result)
    if tl:
        parts.append("<h4 style='margin:6px 0 0'>Timeline</h4>" + tl)
    if d.plots_skipped:
        parts.append(f"<div style='color:#666'>{_e(d.plots_skipped)}</div>")
    parts.append("</div>")
    return "".join(parts)


_result.register_html_view(result_html)
