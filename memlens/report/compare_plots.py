"""compare.png: the peak *reserved* memory of each technique (the figure the fit verdicts use,
memlens.core.fits), estimated and measured side by side, with the lines the verdicts compare it with:
the --budget, what a step may reserve under it (budget - CUDA context - margin), and the same for the
whole GPU of the spec. :func:`compare_figure` returns the Figure (tests read its bars and lines)."""
from __future__ import annotations


from ..core.errors import MemlensError
from ..core.fits import Budget
from ..core.payloads import ComparePayload
from ..core.result import Result
from .plots import bytes_unit, legend_outside, pyplot


def _gpu_usable(result: Result) -> tuple[str, int] | None:
    """(name, usable bytes) of the spec's GPU used whole: its total less its CUDA context and the rule's margin."""
    gpu = (result.spec or {}).get("gpu")
    try:
        b = Budget.make("total", gpu=gpu)
    except MemlensError:
        return None
    return b.source.removeprefix("total memory of the "), b.usable_bytes


def compare_figure(result: Result):
    """Bars of peak reserved per technique; budget, usable and the GPU's usable memory as labelled lines."""
    plt = pyplot()
    d: ComparePayload = result.data
    rows = [r for r in d.rows if r.get("estimated_peak_reserved_bytes") or r.get("measured_peak_reserved_bytes")]
    est = [r.get("estimated_peak_reserved_bytes") or 0 for r in rows]
    meas = [r.get("measured_peak_reserved_bytes") or 0 for r in rows]
    has_meas = any(meas)
    budget, usable = d.budget_bytes or None, d.usable_bytes or None
    gpu = _gpu_usable(result)
    # the whole GPU's line is drawn where it is on the scale of the bars and the budget, else named in the legend
    near = max(est + meas + [budget or 0])
    gpu_drawn = bool(gpu) and (not budget or gpu[1] <= 2 * near)
    lines = [v for v in (budget, usable, gpu[1] if gpu_drawn else None) if v]
    div, unit = bytes_unit(max(est + meas + lines + [1]))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 4.8))
    x = list(range(len(rows)))
    w = 0.4 if has_meas else 0.7
    ax.bar([i - (w / 2 if has_meas else 0) for i in x], [v / div for v in est], w, label="estimated peak reserved",
           color="#3498db", gid="estimated")
    if has_meas:
        ax.bar([i + w / 2 for i in x], [v / div for v in meas], w, label="measured peak reserved", color="#e67e22",
               gid="measured")
    base = (meas[0] or est[0]) if rows else 0
    for i in x:
        top = max(est[i], meas[i])
        saving = f"\n{(top / base - 1) * 100:+.0f}%" if i and base and top else ""
        ax.text(i, top / div, f"{top / div:.2f}{saving}", ha="center", va="bottom", fontsize=8)
    if budget:
        ax.axhline(budget / div, color="#c0392b", ls="--", lw=1, label=f"--budget {budget / div:.2f} {unit}", gid="budget")
    if usable and usable != budget:
        ax.axhline(usable / div, color="#8e44ad", ls=":", lw=1.3, gid="usable",
                   label=f"usable under the budget {usable / div:.2f} {unit}\n(budget - CUDA context - margin): "
                         "a row fits at or below it")
    if gpu and not gpu_drawn:
        ax.plot([], [], " ", label=f"usable on the whole {gpu[0]}: {gpu[1] / div:.2f} {unit} (off the scale)")
    if gpu_drawn:
        ax.axhline(gpu[1] / div, color="#2c3e50", ls="-.", lw=1, gid="gpu-usable",
                   label=f"usable on the whole {gpu[0]} {gpu[1] / div:.2f} {unit}\n(total - CUDA context - margin)")
    ax.set_xticks(x)
    ax.set_xticklabels([r.get("label") or r["technique"] for r in rows], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(f"peak reserved ({unit}); % vs the first row")
    ax.set_title(f"{result.spec['model']}: peak reserved per technique" + (" (measured vs estimated)" if has_meas else " (estimated)"))
    legend_outside(ax)
    ax.set_ylim(0, max(est + meas + lines + [0]) / div * 1.18 or 1)   # room for the labels above the bars
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_compare(result: Result, path) -> None:
    """Write :func:`compare_figure` as a PNG."""
    plt = pyplot()
    fig = compare_figure(result)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
