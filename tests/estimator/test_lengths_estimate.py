"""estimate with --lengths: the worst step estimated, which step and sample peak, what would fit a budget."""
from pathlib import Path

import pytest

from memlens.cli.main import main
from memlens.core.fits import Budget
from memlens.core.spec import TrainingSpec
from memlens.estimator import estimate
from memlens.estimator.lengths import estimate_lengths

LLAMA = str(Path(__file__).parents[1] / "fixtures" / "tiny-llama")
LENS = [100, 300, 120, 90, 700, 50, 60, 40]      # batch 2, max_length 512: steps (2,300) (2,120) (2,512) (2,60)


def spec(**kw):
    return TrainingSpec(model=LLAMA, **{"batch_size": 2, "seq_len": 512, **kw})


def test_worst_step_is_estimated_at_its_shape_and_named(tmp_path):
    f = tmp_path / "lens.txt"
    f.write_text("\n".join(map(str, LENS)))
    r = estimate(spec(lengths=str(f)))
    plain = estimate(spec())                     # (2, 512): the shape of step 3 (sample 5 has 700 tokens, truncated)
    assert r.peak_allocated_bytes == plain.peak_allocated_bytes
    info = r.data["lengths"]
    w = info["worst_step"]
    assert (w["step"], w["rows"], w["tokens"], w["longest_sample"], w["longest_sample_number"]) == (3, 2, 512, 700, 5)
    assert w["samples"] == [5, 6] and info["steps"] == 4 and info["truncated_samples"] == 1
    assert w["peak_allocated_bytes"] == plain.peak_allocated_bytes
    assert r.spec["lengths"] == str(f) and r.spec["batch_size"] == 2
    assert "in file order step 3 of 4 peaks (2 x 512 tokens, its longest sample 700 tokens (sample 5)" in info["note"]


def test_any_order_bound_is_above_the_file_order_peak():
    # file order: (2,300) (2,120) (2,90): the 300 sample is first; any order: still (2, 300); shuffled never more
    r = estimate_lengths(spec(), [300, 10, 120, 10, 90, 20])
    info = r.data["lengths"]
    assert (info["worst_step"]["step"], info["worst_step"]["tokens"]) == (1, 300)
    assert (info["worst_any_order"]["rows"], info["worst_any_order"]["tokens"]) == (2, 300)
    assert r.peak_allocated_bytes == estimate(spec(seq_len=300)).peak_allocated_bytes
    # the longest in a short last batch: file order (1, 400), any order (2, 400)
    r = estimate_lengths(spec(), [10, 20, 400])
    info = r.data["lengths"]
    assert (info["worst_step"]["rows"], info["worst_any_order"]["rows"]) == (1, 2)
    assert r.peak_allocated_bytes == estimate(spec(seq_len=400)).peak_allocated_bytes
    assert info["worst_step"]["peak_allocated_bytes"] == estimate(spec(batch_size=1, seq_len=400)).peak_allocated_bytes


@pytest.mark.slow
def test_what_would_fit_a_budget_computed_by_hand():
    # the budget sits between the needs of (2, 256) and (2, 384): the largest max_length that fits is 256; and between
    # (1, 512) and (2, 512): batch 1 (accumulating 2)
    need = {L: estimate(spec(seq_len=L)).peak_reserved_bytes for L in (256, 384)}
    assert need[256] < need[384]
    b = Budget.make(need[256], context_bytes=0, margin=0)
    r = estimate_lengths(spec(), LENS, budget=b)
    fit = r.data["lengths"]["would_fit"]
    assert fit["max_length"]["max_length"] == 256 and fit["max_length"]["need_bytes"] == need[256]
    assert fit["max_length"]["truncated_samples"] == 2           # 300 and 700
    assert fit["batch_size"] == {"batch_size": 1, "grad_accum": 2, "shape": "1 x 512 tokens",
                                 "need_bytes": estimate(spec(batch_size=1)).peak_reserved_bytes}
    assert "max_length 256 would fit (2 x 256 tokens, 2 samples truncated)" in r.data["lengths"]["note"]
    assert not r.data["lengths"]["budget"]["fits"]


def test_cli_lengths_errors(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("12\n-3\n")
    assert main(["estimate", "--model", LLAMA, "--seq-len", "64", "--lengths", str(bad)]) == 2
    assert f"ERROR: {bad} line 2: -3 is negative" in capsys.readouterr().err
    ok = tmp_path / "ok.txt"
    ok.write_text("12\n")
    assert main(["estimate", "--model", LLAMA, "--lengths", str(ok)]) == 2
    assert "ERROR: --lengths needs --seq-len" in capsys.readouterr().err
    assert main(["estimate", "--model", LLAMA, "--seq-len", "64", "--budget", "8GiB"]) == 2
    assert "ERROR: --budget needs --lengths" in capsys.readouterr().err


def test_without_lengths_the_result_says_it_is_the_flags_worst_case(capsys):
    assert main(["estimate", "--model", LLAMA, "--batch-size", "2", "--seq-len", "64", "--json"]) == 0
    import json

    notes = json.loads(capsys.readouterr().out)["notes"]
    assert ("lengths: every sample at 64 tokens (2 x 64 tokens per step), the worst case of these flags; a collator that "
            "pads to each batch's longest sample gives smaller steps (--lengths FILE finds the step that peaks).") in notes


def test_other_verbs_refuse_lengths(tmp_path, capsys):
    f = tmp_path / "l.txt"
    f.write_text("10\n50\n")
    assert main(["fit", "--model", LLAMA, "--seq-len", "64", "--lengths", str(f), "--budget", "4GiB"]) == 2
    assert "ERROR: --lengths is read by `memlens estimate` only: one step has one shape" in capsys.readouterr().err
    from memlens.estimator.formula import formula_estimate

    with pytest.raises(Exception, match="read by `memlens estimate` \\(simulated\\) only"):
        formula_estimate(spec(lengths=str(f)))


def test_a_short_batch_of_longer_rows_is_weighed_against_the_fullest():
    # batch 4: (4, 100) has the most tokens, the short last batch (1, 150) the longest rows: the larger estimate wins
    r = estimate_lengths(spec(batch_size=4), [100, 100, 100, 100, 150])
    a = estimate(spec(batch_size=4, seq_len=100)).peak_allocated_bytes
    b = estimate(spec(batch_size=1, seq_len=150)).peak_allocated_bytes
    w = r.data["lengths"]["worst_step"]
    assert (w["step"], w["peak_allocated_bytes"]) == ((1, a) if a >= b else (2, b))
