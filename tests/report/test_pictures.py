"""The pictures read at a glance: OOM cells drawn and explained, scales from 0, contrasting cell
text, relative time and adaptive units on the snapshot, and one stderr line when PNGs are skipped."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from memlens.cli.main import main  # noqa: E402
from memlens.core.result import Result  # noqa: E402
from memlens.report import sweep_plots as sweep_mod  # noqa: E402
from memlens.report import doctor_plots, plots  # noqa: E402
from memlens.report.plots import contrast_ratio, heatmap, luminance, text_colour  # noqa: E402

GIB = 1024**3
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"


def _capture(monkeypatch, module) -> list:
    """Keep the figures a module saves (its save_png closes them otherwise)."""
    figs: list = []

    def keep(fig, plt_, path, *a, **k):
        figs.append(fig)
        return Path(path)

    monkeypatch.setattr(module, "save_png", keep)
    return figs


def _cells():
    # a 5% spread (6.67-7.03 GiB) and two cells that do not fit
    return {(128, 1): ("ok", int(6.67 * GIB)), (128, 2): ("ok", int(7.03 * GIB)),
            (256, 1): ("ok", int(0.2 * GIB)), (256, 2): ("oom-estimated", int(9.5 * GIB))}


def test_heatmap_draws_and_explains_oom_cells_on_a_scale_from_zero():
    fig, ax = plt.subplots()
    cb = heatmap(fig, ax, _cells(), [1, 2], [128, 256], budget_bytes=8 * GIB)
    oom = [p for p in ax.patches if p.get_gid() == "cell-oom-estimated"]
    assert len(oom) == 1 and oom[0].get_hatch() and oom[0].get_xy() == (0.5, 0.5)   # (x=2, y=256) drawn, not blank
    assert any(t.get_text().startswith("OOM") for t in ax.texts)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("OOM" in t and "8.00 GiB" in t for t in legend)
    vmin, vmax = cb.mappable.get_clim()
    assert vmin == 0 and vmax == pytest.approx(9.5)          # 0 to the largest value (here an OOM's estimate)
    assert "0-9.50 GiB" in cb.ax.get_ylabel()
    plt.close(fig)


def test_heatmap_cell_text_contrasts_with_its_cell():
    fig, ax = plt.subplots()
    cb = heatmap(fig, ax, _cells(), [1, 2], [128, 256])
    im = cb.mappable
    ok_texts = [t for t in ax.texts if not t.get_text().startswith("OOM")]
    assert len(ok_texts) == 3
    colours = set()
    for t in ok_texts:
        value = float(t.get_text())
        cell = im.cmap(im.norm(value))
        fg = matplotlib.colors.to_rgb(t.get_color())
        other = (1, 1, 1) if fg == (0, 0, 0) else (0, 0, 0)
        assert contrast_ratio(fg, cell) >= contrast_ratio(other, cell)
        assert contrast_ratio(fg, cell) >= 4.5                # WCAG AA for text
        colours.add(t.get_color())
    assert colours == {"black", "white"}                      # dark purple gets white, yellow-green black
    plt.close(fig)


def test_luminance_and_text_colour():
    assert luminance((1, 1, 1)) == 1.0 and luminance((0, 0, 0)) == 0.0
    assert text_colour(matplotlib.colormaps["viridis"](0.0)) == "white"
    assert text_colour(matplotlib.colormaps["viridis"](1.0)) == "black"


def _sweep_result() -> Result:
    rows = []
    for b, L, st, v in [(1, 128, "ok", 6.67), (2, 128, "ok", 7.03), (1, 256, "ok", 6.9), (2, 256, "oom-estimated", 8.4)]:
        rows.append({"key": f"b={b},L={L}", "technique": None, "batch_size": b, "seq_len": L, "lora_rank": None,
                     "physical_batch_size": None, "status": st, "estimated_peak_allocated_bytes": int(v * GIB),
                     "estimated_peak_reserved_bytes": int((v + 0.3) * GIB)})
    return Result(verb="sweep", spec={"model": "gpt2"}, data={"rows": rows, "measured": False, "budget_bytes": 8 * GIB})


def test_sweep_pictures_start_at_zero_and_show_oom(monkeypatch, tmp_path):
    figs = _capture(monkeypatch, sweep_mod)
    written = sweep_mod.plot_sweep(_sweep_result(), tmp_path)
    assert [p.name for p in written] == ["heatmap_spec.png", "memory_vs_batch.png"]
    heat, lines = figs
    ax = heat.axes[0]
    assert any(p.get_gid() == "cell-oom-estimated" for p in ax.patches)
    assert ax.images[0].get_clim()[0] == 0
    assert lines.axes[0].get_ylim()[0] == 0
    leg = lines.axes[0].get_legend()
    assert any("does not fit" in t.get_text() for t in leg.get_texts())
    assert leg.get_bbox_to_anchor().x0 > lines.axes[0].get_window_extent().x1 - 1   # right of the data


def test_snapshot_axes_read_in_relative_time_and_adaptive_sizes(monkeypatch, tmp_path):
    figs = _capture(monkeypatch, doctor_plots)
    assert main(["doctor", "snapshot", str(FIXTURES / "gpu_snapshot_step15.pickle"), "--out", str(tmp_path)]) == 0
    (fig,) = figs
    ax1, ax2 = fig.axes
    assert re.fullmatch(r"time since the first trace event \((µs|ms|s)\)", ax1.get_xlabel())
    fig.canvas.draw()
    assert ax1.xaxis.get_major_formatter().get_offset() == ""          # no "1e6+1.79535412e15"
    assert ax1.get_xlim()[0] < 1 and ax1.get_ylim()[0] == 0
    assert ax1.get_ylabel() == "allocated (MiB)"                        # 70 MiB, not 0.07 GiB
    assert ax2.get_xlabel() == "MiB"                                    # 2 MiB segments, not 0.002 GiB
    legend = ax2.get_legend()
    assert legend.get_bbox_to_anchor().y1 < ax2.get_window_extent().y0 + 1   # below the bars


def test_skipped_pngs_are_said_on_stderr(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    assert main(["estimate", "--model", "tests.tiny_models:linear", "--out", str(tmp_path)]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if "skipped" in ln]
    assert err == ["memlens: skipped timeline.png (matplotlib is not installed); pip install 'memlens[viz]' to get it"]
    assert not (tmp_path / "timeline.png").exists()
    assert "matplotlib is not installed" in Result.load(tmp_path / "result.json").data["plots_skipped"]
