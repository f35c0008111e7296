"""estimate says whether the step fits the GPU it is for (the fit rule of memlens.core.fits)."""
from pathlib import Path

from memlens.cli.main import main
from memlens.core.fits import Budget
from memlens.core.spec import TrainingSpec
from memlens.core.units import fmt_bytes
from memlens.estimator import estimate

TINY_GPT2 = str(Path(__file__).parent.parent / "fixtures" / "models" / "tiny-gpt2" / "config.json")


def test_a_70b_qlora_does_not_fit_a_named_4090():
    r = estimate(TrainingSpec(model="llama-3.1-70b", qlora=True, lora_rank=16, precision="bf16", gpu="rtx-4090"),
                 method="formula")
    b = Budget.make("total", gpu="rtx-4090")
    f = r.data.fit
    assert f["fits"] is False and f["usable_bytes"] == b.usable_bytes and f["gpu"] == "rtx-4090"
    assert f["need_bytes"] == r.peak_reserved_bytes
    over = r.peak_reserved_bytes - b.usable_bytes
    assert r.data.fit_verdict == (f"does not fit the rtx-4090 ({fmt_bytes(b.usable_bytes)} usable): needs "
                                  f"{fmt_bytes(r.peak_reserved_bytes)} reserved, {fmt_bytes(over)} over")


def test_the_default_gpu_is_judged_too_and_shown(capsys):
    r = estimate(TrainingSpec(model=TINY_GPT2, batch_size=2, seq_len=64))
    assert r.data.fit["fits"] is True and r.data.fit_verdict.startswith("fits the h100 (")
    assert main(["estimate", "--model", TINY_GPT2, "--batch-size", "2", "--seq-len", "64", "--gpu", "t4"]) == 0
    assert "fits the t4 (" in capsys.readouterr().out
