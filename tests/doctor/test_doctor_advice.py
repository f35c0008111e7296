"""Doctor's advice names techniques and their costs from the one technique table (memlens.core.techniques)."""
from memlens.core import techniques as tech
from memlens.core.spec import TrainingSpec
from memlens.doctor.advice import measured_levers, oom_advice
from memlens.doctor.message import OomMessage
from memlens.explore.compare import compare
from memlens.explore.core import CachedEstimator, Point

MSG = OomMessage(form="torch>=2.1", message="", requested_bytes=2**20, free_bytes=0, total_capacity_bytes=80 * 2**30,
                 allocated_by_pytorch_bytes=79 * 2**30, reserved_unallocated_bytes=0)


def test_advice_and_compare_show_the_same_checkpointing_cost():
    est = CachedEstimator(fn=lambda s: Point(2**30, 2**30))
    rows = compare(TrainingSpec(model="m", batch_size=8), ["fp32", "checkpointing"], estimator=est).data["rows"]
    cost = next(r["cost"] for r in rows if r["technique"] == "checkpointing")
    assert cost == tech.cost("checkpointing") == "recomputes the forward in backward (~+33% compute)"
    advice = oom_advice(MSG, "capacity")
    ckpt = next(a for a in advice if a.startswith("Enable gradient checkpointing"))
    assert ckpt.endswith(f"it {cost}.") and "20-30%" not in " ".join(advice)
    assert next(lv for lv in measured_levers({}) if lv["name"] == "checkpointing")["cost"] == cost


def test_every_technique_the_advice_names_comes_with_its_table_cost():
    text = " ".join(oom_advice(MSG, "capacity"))
    for name in ("halve-batch", "amp-bf16", "amp-fp16", "adamw-8bit", "adafactor", "lora", "fsdp", "offload"):
        assert tech.cost(name) in text, name
    for name in ("amp-bf16", "adamw-8bit", "adafactor", "lora", "offload"):
        assert f"{tech.title(name)} ({tech.cost(name)})" in text, name
    assert "FSDP (ZeRO-3) over several GPUs (" in text
