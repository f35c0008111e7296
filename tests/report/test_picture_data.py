"""The pictures plot what the tables and verdicts state (issue 34, item 5): read from matplotlib's Figures and
from the HTML, not from pixels."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from memlens.core.fits import Budget  # noqa: E402
from memlens.core.result import Result  # noqa: E402
from memlens.explore.core import Point  # noqa: E402
from memlens.report.compare_plots import compare_figure  # noqa: E402
from memlens.report.profile_report import plot_timeline, report_html  # noqa: E402
from memlens.report.sweep_plots import cell_timeline_figure, memory_vs_batch_figure  # noqa: E402

GIB = 2**30
PROFILE = Path(__file__).resolve().parents[1] / "fixtures" / "profile" / "cpu_tiny_gpt2_profile.json"


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def _by_gid(ax, gid):
    return [a for a in ax.get_children() if a.get_gid() == gid]


def _sweep(usable=None):
    rows = []
    # (batch, seq, status, allocated GiB, reserved GiB): the b=2,L=256 cell is over the budget by its reserved,
    # although its allocated figure (7.9) is under it: the cross goes where the verdict looked
    for b, L, st, a, r in [(1, 128, "ok", 6.6, 6.9), (2, 128, "ok", 7.0, 7.4), (1, 256, "ok", 6.9, 7.2),
                           (2, 256, "oom-estimated", 7.9, 8.4), (4, 256, "oom", None, None)]:
        rows.append({"key": f"b={b},L={L}", "batch_size": b, "seq_len": L, "status": st,
                     "estimated_peak_allocated_bytes": int(a * GIB) if a else None,
                     "estimated_peak_reserved_bytes": int(r * GIB) if r else None})
    data = {"rows": rows, "measured": False, "budget_bytes": 8 * GIB}
    if usable:
        data["usable_bytes"] = usable
    return Result(verb="sweep", spec={"model": "gpt2"}, data=data)


def test_memory_vs_batch_plots_reserved_with_labelled_crosses_above_the_budget():
    ax = memory_vs_batch_figure(_sweep()).axes[0]
    assert ax.get_ylabel() == "peak reserved (GiB, estimated)"
    fits = {ln.get_label(): list(ln.get_ydata()) for ln in _by_gid(ax, "fits")}
    assert fits == {"L=128: fits": [pytest.approx(6.9), pytest.approx(7.4)], "L=256: fits": [pytest.approx(7.2)]}
    (budget,) = _by_gid(ax, "budget")
    assert budget.get_ydata()[0] == pytest.approx(8.0) and budget.get_label() == "budget 8.00 GiB"
    (crosses,) = _by_gid(ax, "oom")          # one series has cells that do not fit
    assert crosses.get_label() == "L=256: does not fit (top edge: measured OOM)"
    ys = sorted(y for _, y in crosses.get_offsets())
    assert ys[0] == pytest.approx(8.4)        # its reserved estimate, above the budget
    assert ys[1] == pytest.approx(ax.get_ylim()[1])     # measured without a figure: on the top edge
    assert all(y > 8.0 for y in ys)


def test_memory_vs_batch_draws_the_usable_line_the_rule_compares_with():
    usable = Budget.make(8 * GIB, context_bytes=512 * 2**20, margin=0).usable_bytes
    ax = memory_vs_batch_figure(_sweep(usable)).axes[0]
    (line,) = _by_gid(ax, "usable")
    assert line.get_ydata()[0] == pytest.approx(7.5)
    assert line.get_label().startswith("usable 7.50 GiB: a cell fits when")


def test_a_sampled_timeline_keeps_its_peak_and_the_cell_picture_reaches_the_table():
    tl = [{"event": i, "phase": "forward", "step": 1, "allocated_bytes": 100 + i, "reserved_bytes": 2048} for i in range(1000)]
    tl[7]["allocated_bytes"] = 5000                       # between two sampled points (every 8th)
    tl[13]["reserved_bytes"] = 9000
    r = Result(verb="estimate", peak_allocated_bytes=5000, peak_reserved_bytes=9000, timeline=tl, data={})
    p = Point.from_result(r)
    assert max(pt["allocated_bytes"] for pt in p.timeline) == 5000
    assert max(pt["reserved_bytes"] for pt in p.timeline) == 9000
    row = {"key": "b=1,L=8", "timeline": list(p.timeline), "estimated_peak_allocated_bytes": 5000,
           "estimated_peak_reserved_bytes": 9000}
    ax = cell_timeline_figure(row).axes[0]
    (alloc,) = _by_gid(ax, "allocated")
    (peak,) = _by_gid(ax, "peak-allocated")
    assert max(alloc.get_ydata()) == pytest.approx(peak.get_ydata()[0])
    assert peak.get_label().startswith("peak allocated ")
    (res,) = _by_gid(ax, "reserved")
    assert max(res.get_ydata()) == pytest.approx(_by_gid(ax, "peak-reserved")[0].get_ydata()[0])


def _compare(budget=True):
    rows = [{"technique": t, "estimated_peak_allocated_bytes": int(a * GIB), "estimated_peak_reserved_bytes": int(r * GIB)}
            for t, a, r in [("fp32", 8.1, 8.7), ("bf16", 5.3, 6.0)]]
    data = {"rows": rows}
    if budget:
        data.update(Budget.make(12 * GIB, context_bytes=740 * 2**20, gpu="h100").to_dict())
    return Result(verb="compare", spec={"model": "gpt2", "gpu": "h100"}, data=data)


def test_compare_plots_reserved_and_the_lines_its_verdicts_use():
    r = _compare()
    ax = compare_figure(r).axes[0]
    heights = [b.get_height() for b in ax.patches if b.get_gid() == "estimated"] or \
        [b.get_height() for c in ax.containers for b in c]
    assert heights == [pytest.approx(8.7), pytest.approx(6.0)]
    assert ax.get_ylabel().startswith("peak reserved (GiB)")
    (budget,) = _by_gid(ax, "budget")
    (usable,) = _by_gid(ax, "usable")
    assert budget.get_ydata()[0] == pytest.approx(12.0)
    assert usable.get_ydata()[0] == pytest.approx(r.data["usable_bytes"] / GIB)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "--budget 12.00 GiB" in labels
    whole = Budget.make("total", gpu="h100").usable_bytes / GIB
    assert f"usable on the whole h100: {whole:.2f} GiB (off the scale)" in labels
    ax = compare_figure(_compare(budget=False)).axes[0]       # no --budget: the verdict is the GPU's
    (gpu,) = _by_gid(ax, "gpu-usable")
    assert gpu.get_ydata()[0] == pytest.approx(whole)


def test_profile_timeline_is_in_seconds_from_the_first_step_with_allocated_drawn_over_reserved():
    r = Result.load(PROFILE)
    assert min(p["t_s"] for p in r.timeline) < 0          # the fixture: setup is before the profiler started
    ax = plot_timeline(r).axes[0]
    (alloc,) = _by_gid(ax, "allocated")
    (reserved,) = _by_gid(ax, "reserved")
    xs = list(alloc.get_xdata())
    assert xs[0] == 0 and min(xs) == 0 and ax.get_xlim()[0] == 0
    steps = [p for p in r.timeline if p["step"] >= 1]
    assert xs[-1] == pytest.approx(steps[-1]["t_s"] - steps[0]["t_s"])
    assert [y * 2**20 for y in alloc.get_ydata()] == [pytest.approx(p["allocated_bytes"]) for p in steps]
    assert alloc.get_zorder() > reserved.get_zorder()
    assert ax.get_xlabel().startswith("seconds since the first measured step started")


def test_report_html_has_a_lora_column_only_with_lora():
    r = Result.load(PROFILE)
    assert not any(m.get("lora") for m in r.by_module)
    html = report_html(r, {})
    assert "<th>module</th>" in html and "<th>LoRA</th>" not in html
    lora = copy.deepcopy(r)
    lora.by_module[0]["lora"] = True
    assert "<th>LoRA</th>" in report_html(lora, {})
