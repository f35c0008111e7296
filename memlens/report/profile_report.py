"""Renderings of a profile Result: timeline.csv, PNG plots and one self-contained report.html.

Every figure is read from the Result (never recomputed). matplotlib is imported only here, with
the Agg backend. The HTML inlines its CSS and its PNGs (base64): no CDN, opens offline.

>>> from memlens.core.result import Result
>>> r = Result(verb="profile", peak_allocated_bytes=1024, timeline=[{"label": "start", "step": 1, "phase": "start",
...            "t_s": 0.0, "allocated_bytes": 512, "reserved_bytes": 2048, "peak_allocated_bytes": 512}])
>>> timeline_csv(r).splitlines()[0]
'index,label,step,phase,t_s,allocated_bytes,reserved_bytes,peak_allocated_bytes'
"""
from __future__ import annotations

import base64
import csv
import html
import io
import pickle
from pathlib import Path

from ..core.payloads import ProfilePayload, given
from ..core.result import Result
from ..core.units import fmt_bytes
from . import plots as plots_mod  # a module: have_matplotlib is asked at call time
from .plots import bytes_unit, legend_outside, skip_plots
from .plots import pyplot as _pyplot

COLUMNS = ("index", "label", "step", "phase", "t_s", "allocated_bytes", "reserved_bytes", "peak_allocated_bytes")
CAT_COLORS = {
    "parameters": "#4c72b0", "buffers": "#8172b3", "gradients": "#dd8452", "optimizer_state": "#55a868",
    "activations": "#c44e52", "temporaries": "#937860", "inputs": "#da8bc3", "workspace": "#8c8c8c",
    "per_sample_gradients": "#ccb974", "unattributed": "#cccccc",
}


def timeline_csv(result: Result) -> str:
    """The timeline as CSV, one row per point: a profile's labelled snapshots, or an estimate's
    sampled allocation events (then ``event`` replaces ``label`` and ``t_s``)."""
    simulated = any("event" in p for p in result.timeline)
    cols = ("index", "event", "step", "phase", "allocated_bytes", "reserved_bytes") if simulated else COLUMNS
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for i, p in enumerate(result.timeline):
        w.writerow([i] + [p.get(c) for c in cols[1:]])
    return buf.getvalue()


def plot_snapshots(result: Result):
    """Bars of allocated / reserved / peak at every labelled snapshot (the seeds' plot_snapshots)."""
    plt = _pyplot()
    tl = result.timeline
    div, u = bytes_unit(max([p["reserved_bytes"] for p in tl] + [1]))
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(tl) + 3), 4.8))
    x = range(len(tl))
    w = 0.27
    ax.bar([i - w for i in x], [p["allocated_bytes"] / div for p in tl], w, label="allocated", color="#3498db")
    ax.bar(list(x), [p["reserved_bytes"] / div for p in tl], w, label="reserved", color="#95a5a6")
    ax.bar([i + w for i in x], [p["peak_allocated_bytes"] / div for p in tl], w, label="peak since previous", color="#e74c3c")
    ax.set_xticks(list(x))
    ax.set_xticklabels([p["label"] for p in tl], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(u)
    ax.set_title("memory at each snapshot")
    legend_outside(ax)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def step_timeline(result: Result) -> tuple[list[dict], list[float]]:
    """The points of the measured steps (from the profiler's "start" on; setup and warm-up are in snapshots.png)
    and their times in seconds since the first of them: never negative.

    >>> r = Result(verb="profile", timeline=[{"step": 0, "phase": "setup", "t_s": -2.9}, {"step": 1, "phase": "start",
    ...     "t_s": 0.25}, {"step": 1, "phase": "forward", "t_s": 0.5}])
    >>> step_timeline(r)[1]
    [0.0, 0.25]
    """
    tl = [p for p in result.timeline if (p.get("step") or 0) >= 1] or list(result.timeline)
    t0 = tl[0]["t_s"] if tl else 0.0
    return tl, [round(p["t_s"] - t0, 6) for p in tl]


def plot_timeline(result: Result):
    """Allocated and reserved over the measured steps (seconds since the first started), with each interval's
    peak and the overall peak. Reserved is drawn under allocated as a shaded area, so allocated shows even where
    they are equal (CPU mode: no caching allocator)."""
    plt = _pyplot()
    tl, t = step_timeline(result)
    div, u = bytes_unit(max([p["reserved_bytes"] for p in tl] + [result.peak_allocated_bytes or 1]))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    reserved = [p["reserved_bytes"] / div for p in tl]
    same = all(p["reserved_bytes"] == p["allocated_bytes"] for p in tl)
    ax.fill_between(t, reserved, step="post", color="#d5dbdb", zorder=1, gid="reserved",
                    label="reserved (shaded)" + (": equal to allocated here" if same else ""))
    ax.step(t, reserved, where="post", color="#95a5a6", lw=0.8, zorder=2)
    ax.step(t, [p["allocated_bytes"] / div for p in tl], where="post", label="allocated (at snapshot)", color="#2471a3",
            lw=1.8, zorder=3, gid="allocated")
    ax.plot(t, [p["peak_allocated_bytes"] / div for p in tl], "v", color="#e74c3c", ms=5, zorder=4,
            label="peak of the interval ending here")
    if result.peak_allocated_bytes:
        ax.axhline(result.peak_allocated_bytes / div, ls="--", color="#e74c3c", lw=0.8, zorder=4,
                   label=f"peak allocated {result.peak_allocated_bytes / div:.2f} {u}")
    for p, x in zip(tl, t):
        if p["phase"] == "forward":
            ax.axvline(x, color="#bbbbbb", lw=0.5)
    ax.set_xlabel("seconds since the first measured step started (vertical lines: forward starts; "
                  "setup and warm-up: snapshots)")
    ax.set_xlim(left=0)
    ax.set_ylabel(u)
    ax.set_ylim(bottom=0)
    ax.set_title("memory timeline of the measured steps")
    legend_outside(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_categories(result: Result):
    """One stacked bar: what was live at the peak, by category."""
    plt = _pyplot()
    cats = [(k, v) for k, v in result.by_category.items() if v > 0]
    div, u = bytes_unit(sum(v for _, v in cats) or 1)
    fig, ax = plt.subplots(figsize=(6, 5))
    bottom = 0.0
    for k, v in cats:
        ax.bar([0], [v / div], bottom=bottom, color=CAT_COLORS.get(k, "#999999"), label=f"{k} {fmt_bytes(v)}")
        bottom += v / div
    if result.peak_allocated_bytes:
        ax.axhline(result.peak_allocated_bytes / div, ls="--", color="k", lw=0.8, label=f"peak allocated {fmt_bytes(result.peak_allocated_bytes)}")
    ax.set_xticks([])
    ax.set_xlim(-0.8, 0.8)
    ax.set_ylabel(u)
    ax.set_title("at the peak, by category")
    legend_outside(ax)
    fig.tight_layout()
    return fig


def plot_modules(result: Result, top: int = 15):
    """Top modules: bytes live at the peak, and the forward / backward peak of their own allocations."""
    plt = _pyplot()
    rows = sorted(result.by_module, key=lambda r: -max(r["bytes"], r.get("forward_peak_bytes", 0), r.get("backward_peak_bytes", 0)))[:top]
    rows.reverse()
    div, u = bytes_unit(max([max(r["bytes"], r.get("forward_peak_bytes", 0), r.get("backward_peak_bytes", 0)) for r in rows] + [1]))
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(rows) + 1.8))
    y = range(len(rows))
    h = 0.27
    ax.barh([i + h for i in y], [r["bytes"] / div for r in rows], h, label="live at the peak", color="#4c72b0")
    ax.barh(list(y), [r.get("forward_peak_bytes", 0) / div for r in rows], h, label="forward peak (own allocations)", color="#c44e52")
    ax.barh([i - h for i in y], [r.get("backward_peak_bytes", 0) / div for r in rows], h, label="backward peak (own allocations)", color="#dd8452")
    ax.set_yticks(list(y))
    ax.set_yticklabels([(r["module"][-48:] + ("  [LoRA]" if r.get("lora") else "")) for r in rows], fontsize=8)
    ax.set_xlabel(u)
    ax.set_title(f"top {len(rows)} modules")
    legend_outside(ax, below=True, ncol=3)
    fig.tight_layout()
    return fig


PLOTS = {"snapshots.png": plot_snapshots, "timeline.png": plot_timeline, "categories.png": plot_categories, "modules.png": plot_modules}


def _wanted(result: Result) -> list[str]:
    names = ["snapshots.png", "timeline.png"]
    if any(v > 0 for v in result.by_category.values()):
        names.append("categories.png")
    if result.by_module:
        names.append("modules.png")
    return names


def render_pngs(result: Result) -> dict[str, bytes]:
    """PNG bytes of every plot that has data, by file name ({} without matplotlib)."""
    if not plots_mod.have_matplotlib():
        return {}
    plt = _pyplot()
    out = {}
    for name in _wanted(result):
        fig = PLOTS[name](result)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        out[name] = buf.getvalue()
    return out


def write_report(result: Result, out_dir: str | Path, memory_snapshot: dict | None = None) -> list[Path]:
    """Write result.json, timeline.csv, the PNGs and report.html into ``out_dir``; return the paths."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    pngs = render_pngs(result)
    if not plots_mod.have_matplotlib():
        skip_plots(result, _wanted(result))
    paths = [result.save(d / "result.json")]
    (d / "timeline.csv").write_text(timeline_csv(result))
    paths.append(d / "timeline.csv")
    for name, data in pngs.items():
        (d / name).write_bytes(data)
        paths.append(d / name)
    if memory_snapshot is not None:
        with open(d / "memory_snapshot.pickle", "wb") as f:
            pickle.dump(memory_snapshot, f)
        paths.append(d / "memory_snapshot.pickle")
    (d / "report.html").write_text(report_html(result, pngs))
    paths.append(d / "report.html")
    return paths


# ---------------------------------------------------------------- HTML

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1100px;color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;font-size:13px} table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:right} th{background:#f5f5f5}
td:first-child,th:first-child{text-align:left} .kpi{display:inline-block;margin:8px 18px 8px 0}
.kpi b{display:block;font-size:20px} .kpi span{color:#666;font-size:12px} img{max-width:100%;border:1px solid #eee;margin:6px 0}
.note{color:#666;font-size:12px} .bad{color:#b00} .good{color:#070} code{background:#f4f4f4;padding:1px 4px}
"""


def _e(x) -> str:
    return html.escape(str(x))


def _table(headers: list[str], rows: list[list]) -> str:
    h = "".join(f"<th>{_e(c)}</th>" for c in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def _lanes_top(ranks: list[dict]) -> int:
    return max([p.get("peak_allocated_bytes") or p.get("allocated_bytes") or 0 for r in ranks for p in r.get("timeline") or []] + [1])


def rank_lanes_svg(ranks: list[dict], width: int = 1000, lane: int = 70, top: int | None = None) -> str:
    """One lane per rank: allocated memory at each snapshot (line), each interval's peak (dots), on
    one scale for every rank (``top``: a scale shared with other nodes' lanes), so ranks compare at a glance (inline
    SVG, no plotting library)."""
    top = top or _lanes_top(ranks)
    div, unit = bytes_unit(top)
    left, pad = 70, 8
    h = lane * len(ranks) + 24
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{h}' font-family='sans-serif' font-size='11'>"]
    for i, r in enumerate(ranks):
        tl = r.get("timeline") or []
        y0 = i * lane + pad
        y1 = y0 + lane - 2 * pad
        out.append(f"<rect x='{left}' y='{y0}' width='{width - left - 10}' height='{y1 - y0}' fill='#f7f7f7' stroke='#ddd'/>")
        out.append(f"<text x='4' y='{(y0 + y1) // 2}'>rank {_e(r.get('rank'))}</text>")
        out.append(f"<text x='4' y='{(y0 + y1) // 2 + 13}' fill='#666'>{_e(fmt_bytes(r.get('peak_allocated_bytes')))}</text>")
        if not tl:
            continue
        n = max(len(tl) - 1, 1)

        def xy(j, v):
            return left + (width - left - 10) * j / n, y1 - (y1 - y0) * (v or 0) / top

        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(j, p.get("allocated_bytes")) for j, p in enumerate(tl)))
        out.append(f"<polyline fill='none' stroke='#3498db' stroke-width='1.5' points='{pts}'/>")
        for j, p in enumerate(tl):
            if p.get("peak_allocated_bytes"):
                x, y = xy(j, p["peak_allocated_bytes"])
                out.append(f"<circle cx='{x:.1f}' cy='{y:.1f}' r='2' fill='#e74c3c'><title>{_e(p.get('label', ''))}: "
                           f"peak {_e(fmt_bytes(p['peak_allocated_bytes']))}</title></circle>")
            if p.get("phase") == "forward":
                x, _ = xy(j, 0)
                out.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{y0}' y2='{y1}' stroke='#ccc' stroke-width='0.5'/>")
    out.append(f"<text x='{left}' y='{h - 6}' fill='#666'>snapshots in order (grey: a step's forward starts); "
               f"scale 0 - {top / div:.2f} {unit} on every lane; blue: allocated at the snapshot, red: peak since the previous</text>")
    out.append("</svg>")
    return "".join(out)


def node_lanes_html(nodes: list[dict], ranks: list[dict]) -> list[str]:
    """A job over several machines: a table of the nodes, then each node's lanes under its name, on one scale."""
    by_rank = {r["rank"]: r for r in ranks}
    top = _lanes_top(ranks)
    parts = [_table(["node", "host", "ranks", "peak allocated (rank)", "peak reserved"],
                    [[str(n["node"]), n.get("hostname") or "", ", ".join(map(str, n["ranks"])),
                      f"{fmt_bytes(n.get('peak_allocated_bytes'))} (rank {n.get('peak_rank')})", fmt_bytes(n.get("peak_reserved_bytes"))]
                     for n in nodes])]
    for n in nodes:
        parts.append(f"<h3>node {_e(n['node'])} ({_e(n.get('hostname') or '')}): ranks {_e(', '.join(map(str, n['ranks'])))}</h3>")
        parts.append(rank_lanes_svg([by_rank[r] for r in n["ranks"] if r in by_rank], top=top))
    return parts


def ranks_html(result: Result) -> str:
    """The per-rank section of a report: a table and a lane per rank."""
    d: ProfilePayload = result.data
    ranks = d.ranks
    rows = []
    for r in ranks:
        nv = r.get("nvml") or {}
        rows.append([f"{r['rank']}{' *' if r['rank'] == d.peak_rank else ''}", fmt_bytes(r.get("peak_allocated_bytes")),
                     fmt_bytes(r.get("peak_reserved_bytes")), fmt_bytes(nv.get("process_used_bytes")) if nv.get("available") else "-",
                     f"{r.get('peak_phase')} (step {r.get('peak_step')})", r.get("device_name") or r.get("device") or ""])
    job = d.job or {}
    nodes = d.nodes or []
    head = ["rank", "peak allocated", "peak reserved", "nvidia-smi (NVML, this process)", "peak phase", "device"]
    if nodes:
        head.append("node")
        for row, r in zip(rows, ranks):
            row.append(f"{r.get('node')} ({r.get('hostname')})")
    parts = [f"<h2>Ranks ({len(ranks)}; * the rank that peaks)</h2>",
             _table(head, rows),
             f"<div class='note'>imbalance: {_e(fmt_bytes(given(d.rank_imbalance_bytes)))} between the highest and the lowest "
             f"rank's peak allocated; whole job: allocated {_e(fmt_bytes(job.get('peak_allocated_bytes_sum')))}, reserved "
             f"{_e(fmt_bytes(job.get('peak_reserved_bytes_sum')))}"
             + (f", NVML {_e(fmt_bytes(job['nvml_process_used_bytes_sum']))}" if job.get("nvml_process_used_bytes_sum") else "")
             + " (each rank's peak summed).</div>"]
    parts += node_lanes_html(nodes, ranks) if nodes else [rank_lanes_svg(ranks)]
    phases = sorted({ph for r in ranks for ph in (r.get("by_phase") or {})}, key=lambda p: (p not in ("forward", "backward", "optimizer"), p))
    if phases:
        parts.append(_table(["phase"] + [f"rank {r['rank']}" for r in ranks],
                            [[ph] + [fmt_bytes(((r.get("by_phase") or {}).get(ph) or {}).get("peak_allocated_bytes")) for r in ranks]
                             for ph in phases]))
    return "\n".join(parts)


def report_html(result: Result, pngs: dict[str, bytes] | None = None) -> str:
    """One self-contained HTML page (inline CSS, PNGs as data: URIs)."""
    pngs = render_pngs(result) if pngs is None else pngs
    d: ProfilePayload = result.data
    parts = _head_html(result, d)
    if d.ranks:
        parts.append(ranks_html(result))
    parts += _peak_html(result, d, pngs)
    parts += _setup_html(d)
    parts += _tools_html(d)
    parts.append("<h2>Snapshots</h2>")
    parts.append(_table(["label", "allocated", "reserved", "peak since previous"],
                        [[p["label"], fmt_bytes(p["allocated_bytes"]), fmt_bytes(p["reserved_bytes"]), fmt_bytes(p["peak_allocated_bytes"])]
                         for p in result.timeline]))
    parts.append("<h2>Notes</h2><ul>" + "".join(f"<li class='note'>{_e(n)}</li>" for n in result.notes) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _head_html(result: Result, d: ProfilePayload) -> list[str]:
    """Title, device and mode, the headline figures and the spec."""
    spec = result.spec or {}
    env = result.environment
    title = f"memlens profile: {spec.get('model', 'your loop')}"
    cuda = str(d.device or "").startswith("cuda")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{_e(title)}</h1>",
             f"<div class='sub'>device {_e(given(d.device))}{_e(' (' + env['device_name'] + ')' if env.get('device_name') else '')} · mode "
             f"{_e(given(d.mode))} · torch {_e(env.get('torch'))} · measured by {_e(given(d.measured_by))}</div>"]
    kpis = [("peak allocated", fmt_bytes(result.peak_allocated_bytes), "max_memory_allocated()" if cuda else "live storages"),
            ("peak reserved", fmt_bytes(result.peak_reserved_bytes), "max_memory_reserved()" if cuda else "CPU: same as allocated"),
            ("peak phase", f"{given(d.peak_phase)} (step {given(d.peak_step)})", "where the peak happened")]
    nv = d.nvml or {}
    if nv.get("available"):
        kpis.append(("nvidia-smi (this process)", fmt_bytes(nv.get("process_used_bytes")), "NVML: reserved + CUDA context"))
    parts.append("".join(f"<div class='kpi'><b>{_e(v)}</b><span>{_e(k)}: {_e(s)}</span></div>" for k, v, s in kpis))
    if spec:
        parts.append(f"<div class='note'>spec: {_e(', '.join(f'{k}={v}' for k, v in spec.items() if v not in (None, False, (), [])))}</div>")
    return parts


def _peak_html(result: Result, d: ProfilePayload, pngs: dict[str, bytes]) -> list[str]:
    """Every phase's peak; at the peak by category, by the phase that allocated it, the pictures and the modules."""
    parts = ["<h2>Peak of every phase" + (f" (rank {given(d.peak_rank)}, the rank that peaks)" if d.ranks else "") + "</h2>",
             _table(["phase", "peak allocated", "step", "peak reserved"],
                    [[ph, fmt_bytes(v["peak_allocated_bytes"]), v.get("peak_step"), fmt_bytes(v.get("peak_reserved_bytes"))]
                     for ph, v in result.by_phase.items()])]
    if result.by_category:
        total = result.peak_allocated_bytes or 1
        parts.append("<h2>At the peak, by category</h2>")
        parts.append(_table(["category", "bytes", "share of peak"],
                            [[k, fmt_bytes(v), f"{100 * v / total:.1f}%"] for k, v in result.by_category.items() if v]))
        parts.append(f"<div class='note'>categories sum to {fmt_bytes(given(d.categories_sum_bytes))} "
                     f"({_pct(given(d.categories_error))} of the peak before the unattributed row)</div>")
    if d.by_operation:
        parts.append("<h2>By operation (which phase allocated what was live at the peak)</h2>")
        parts.append(_table(["allocated in", "bytes live at the peak"], [[k, fmt_bytes(v)] for k, v in d.by_operation.items()]))
    for name, caption in (("snapshots.png", "Snapshots"), ("timeline.png", "Timeline"), ("categories.png", "Category stack at the peak"),
                          ("modules.png", "Top modules")):
        if name in pngs:
            b64 = base64.b64encode(pngs[name]).decode()
            parts.append(f"<h2>{caption}</h2><img alt='{name}' src='data:image/png;base64,{b64}'>")
    if result.by_module:
        parts.append("<h2>Modules (top 25)</h2>")
        lora = any(r.get("lora") for r in result.by_module)     # the LoRA column only on a run with LoRA
        parts.append(_table(["module", "live at the peak", "forward peak", "backward peak"] + (["LoRA"] if lora else []),
                            [[r["module"], fmt_bytes(r["bytes"]), fmt_bytes(r.get("forward_peak_bytes")),
                              fmt_bytes(r.get("backward_peak_bytes"))] + (["yes" if r.get("lora") else ""] if lora else [])
                             for r in result.by_module[:25]]))
    return parts


def _setup_html(d: ProfilePayload) -> list[str]:
    """What loading the model cost; the caching allocator's counters and NVML."""
    parts = []
    ml = d.model_load
    if ml:
        parts.append("<h2>Model load</h2>")
        rows = [["parameters (theoretical)", fmt_bytes(ml.get("theoretical_param_bytes"))], ["buffers", fmt_bytes(ml.get("buffer_bytes"))],
                ["batch", fmt_bytes(ml.get("batch_bytes"))]]
        if "loaded_bytes" in ml:
            rows += [["allocated by loading", fmt_bytes(ml["loaded_bytes"])],
                     ["overhead vs parameters", f"{fmt_bytes(ml['overhead_bytes'])} ({_pct(ml.get('overhead_fraction'))})"]]
        if "allocated_after_move_bytes" in ml:
            rows += [["device allocated after loading on the CPU", fmt_bytes(ml["allocated_after_cpu_load_bytes"])],
                     ["device allocated after .to(device)", fmt_bytes(ml["allocated_after_move_bytes"])],
                     ["device reserved after .to(device)", fmt_bytes(ml["reserved_after_move_bytes"])]]
        parts.append(_table(["", "bytes"], rows))
    al = d.allocator
    if al:
        nv = d.nvml or {}
        parts.append("<h2>Allocator (memory_stats) and NVML</h2>")
        lab = al.get("labels", {})
        rows = [[k, fmt_bytes(al[k]) if k.endswith("bytes") else al[k], lab.get(k, "")]
                for k in ("reserved_unallocated_bytes", "inactive_split_bytes", "fragmentation", "num_alloc_retries", "num_ooms")]
        if nv:
            rows.append(["nvml process used", fmt_bytes(nv.get("process_used_bytes")) if nv.get("available") else f"n/a ({nv.get('reason')})",
                         nv.get("label", "")])
        parts.append(_table(["figure", "value", "what it is"], rows))
    return parts


def _tools_html(d: ProfilePayload) -> list[str]:
    """The estimate beside the measurement (--compare-estimate) and torch.profiler's top operators."""
    parts = []
    ce = d.compare_estimate
    if ce and ce.get("available"):
        parts.append("<h2>Estimate vs measured</h2>")
        rows = [[r["name"], fmt_bytes(r["estimated_bytes"]), fmt_bytes(r["measured_bytes"]), _pct(r["error"])]
                for r in ce["rows"] + ce["by_phase"] + ce["by_category"]]
        parts.append(_table(["figure", "estimated", "measured", "error"], rows))
        parts.append(f"<div class='note'>{_e(ce.get('note'))}</div>")
    tp = d.torch_profiler
    if tp:
        parts.append("<h2>torch.profiler: top operators</h2>")
        tk, mk = tp["time_key"], tp["memory_key"]
        parts.append(_table(["operator (by time)", "calls", tk], [[r["name"], r["calls"], f"{r[tk]:.0f}"] for r in tp["by_time"][:12]]))
        parts.append(_table(["operator (by memory)", "calls", mk], [[r["name"], r["calls"], fmt_bytes(r[mk])] for r in tp["by_memory"][:12]]))
        if tp.get("chrome_trace"):
            parts.append(f"<div class='note'>Chrome trace: <code>{_e(tp['chrome_trace'])}</code> (open in chrome://tracing or ui.perfetto.dev)</div>")
    return parts
