"""cuDNN convolution workspaces: a measured ratio per class, a transient after each convolution's outputs."""
from memlens.core.spec import TrainingSpec
from memlens.estimator import conv_workspaces, estimate

CFG = "tests/fixtures/configs/resnet.json"


def test_kinds():
    assert conv_workspaces.kind((64, 64, 1, 1), 1, 64) == "1x1"
    assert conv_workspaces.kind((64, 64, 3, 3), 1, 64) == "kxk"
    assert conv_workspaces.kind((96, 1, 7, 7), 96, 96) == "depthwise"
    assert conv_workspaces.kind((64, 16, 3, 3), 4, 64) == "grouped"


def test_uncalibrated_gpu_says_so_and_counts_nothing(monkeypatch):
    monkeypatch.setattr(conv_workspaces, "table", lambda: {})
    r = estimate(TrainingSpec(model=CFG, batch_size=2))
    assert any("not calibrated for h100" in n for n in r.notes)


def test_measured_ratio_adds_a_transient_workspace(monkeypatch):
    monkeypatch.setattr(conv_workspaces, "table", lambda: {})
    plain = estimate(TrainingSpec(model=CFG, batch_size=2))
    rules = {f"{p}|float32|{k}": {"ratio": 4.0} for p in ("forward", "backward") for k in ("1x1", "kxk")}
    monkeypatch.setattr(conv_workspaces, "table", lambda: {"h100": {"source": "test", "rules": rules}})
    with_ws = estimate(TrainingSpec(model=CFG, batch_size=2))
    assert not any("not calibrated" in n for n in with_ws.notes)
    # the workspaces are transient: the end-of-step memory is the same, the peak is higher
    assert with_ws.data["steps"][-1]["end_allocated_bytes"] == plain.data["steps"][-1]["end_allocated_bytes"]
    assert with_ws.peak_allocated_bytes > plain.peak_allocated_bytes
    assert with_ws.by_category["workspace"] > plain.by_category["workspace"]
