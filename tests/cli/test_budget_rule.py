"""One budget rule for every verb (issue 34, "What to build" 1): peak reserved + CUDA context <= budget - margin,
the same in estimate, compare, sweep and fit; `--gpu` alone gives the budget; a budget above the GPU is refused, or
(up to the GPU's nominal size) taken as its total memory with one warning; the rule table in the docs is the code's."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from memlens.cli.main import main
from memlens.core.fits import MARGIN_FRACTION, MARGIN_MIN_BYTES, Budget
from memlens.core.gpus import DEFAULT_GPU, GPUS, gpu_facts
from memlens.core.units import fmt_bytes
from tests.cli.cli_support import one_line

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests/fixtures/models/tiny-gpt2")
MiB, GiB = 2**20, 2**30
CTX = gpu_facts(DEFAULT_GPU).cuda_context_bytes



def run_json(capsys, *argv):
    rc = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out), err


@pytest.mark.slow
def test_sweep_compare_and_fit_give_one_verdict_at_the_byte(capsys, tmp_path):
    # the bullet: sweep --budget marked cells "ok" whose reserved was under the budget but over budget - context -
    # margin, which compare and fit refused. One cell, its reserved peak R: with R + context + 256 MiB (the margin's
    # floor) all three say it fits; one MiB less, all three say it does not (sweep's old cap said "ok" to both).
    spec = ["--model", TINY, "--seq-len", "64"]
    d, _ = run_json(capsys, "compare", *spec, "--batch-size", "4", "--techniques", "fp32")
    need = d["rows"][0]["estimated_peak_reserved_bytes"]
    for budget, fit_ok in ((need + CTX + MARGIN_MIN_BYTES, True), (need + CTX + MARGIN_MIN_BYTES - MiB, False)):
        c, _ = run_json(capsys, "compare", *spec, "--batch-size", "4", "--techniques", "fp32", "--budget", f"{budget}B")
        assert c["usable_bytes"] == budget - CTX - MARGIN_MIN_BYTES and c["rows"][0]["fits"] is fit_ok
        s, _ = run_json(capsys, "sweep", *spec, "--batch-sizes", "4", "--techniques", "fp32", "--budget", f"{budget}B",
                        "--out", str(tmp_path / f"sw{budget}"))
        assert s["usable_bytes"] == c["usable_bytes"] and s["context_bytes"] == CTX and s["margin_bytes"] == MARGIN_MIN_BYTES
        assert s["rows"][0]["estimated_peak_reserved_bytes"] == need
        assert s["rows"][0]["status"] == ("ok" if fit_ok else "oom-estimated")
        f, _ = run_json(capsys, "fit", *spec, "--batch-size", "4", "--budget", f"{budget}B", "--no-plan")
        assert f["usable_bytes"] == c["usable_bytes"] and (f["max_batch_size"] >= 4) is fit_ok


@pytest.mark.slow
def test_gpu_alone_gives_the_budget(capsys):
    # the bullet: `fit --gpu rtx-4090` without --budget refused ("no CUDA GPU to read free memory from")
    d, err = run_json(capsys, "fit", "--model", "gpt2", "--gpu", "rtx-4090", "--no-plan", "--method", "formula")
    g = gpu_facts("rtx-4090")
    assert d["budget_bytes"] == g.total_memory_bytes and d["budget_source"] == "total memory of the rtx-4090"
    assert d["usable_bytes"] == Budget.make("total", gpu="rtx-4090").usable_bytes and d["max_batch_size"] > 0
    assert err == ""
    # compare with --gpu alone says what fits that GPU
    c, _ = run_json(capsys, "compare", "--model", TINY, "--seq-len", "32", "--techniques", "fp32", "--gpu", "t4")
    assert c["budget_bytes"] == gpu_facts("t4").total_memory_bytes and c["rows"][0]["fits"] is True


def test_without_budget_or_gpu_and_no_cuda_fit_says_both_ways(capsys):
    assert one_line(capsys, "fit", "--model", "gpt2", "--no-plan") == (
        "ERROR: no --budget given and no CUDA GPU to read free memory from  "
        "HINT: give --budget 16GiB, or --gpu NAME for that GPU's whole memory")


def test_budget_above_the_gpu_is_refused(capsys):
    # the bullet: `fit --budget 80GiB --gpu t4` answered micro-batch 80 (74.6 GiB) for a 14.6 GiB card
    assert one_line(capsys, "fit", "--model", "gpt2", "--budget", "80GiB", "--gpu", "t4") == (
        "ERROR: budget 80GiB is more than the t4 has (14.58 GiB as PyTorch reports it, 16 GB nominal)  "
        "HINT: leave --budget out to use the whole t4, give a smaller one, or name your GPU with --gpu "
        "(`memlens estimate --list-gpus`)")
    for verb in (["compare", "--techniques", "fp32"], ["sweep", "--batch-sizes", "1"]):
        err = one_line(capsys, *verb, "--model", "gpt2", "--budget", "17GiB", "--gpu", "t4")
        assert err.startswith("ERROR: budget 17GiB is more than the t4 has (14.58 GiB")


def test_budget_at_an_h100s_nominal_size_is_its_total_with_one_warning(capsys):
    # the bullet: `--budget 80GiB` on an H100 (79.19 GiB real) passed silently. Decided: up to the GPU's nominal size
    # (80 GB sold, typed 80GiB) the budget is the whole GPU as PyTorch sees it, said in one line; above it, refused.
    d, err = run_json(capsys, "fit", "--model", "gpt2", "--budget", "80GiB", "--no-plan", "--method", "formula")
    h100 = gpu_facts("h100")
    assert err == ("WARNING: budget 80GiB is more than the h100's 79.19 GiB (its total memory as PyTorch reports it; "
                   "80 GB is its nominal size): using 79.19 GiB\n")
    assert d["budget_bytes"] == h100.total_memory_bytes and d["budget_source"] == "total memory of the h100; 80GiB given"
    assert d["budget_warning"] in err
    assert one_line(capsys, "fit", "--model", "gpt2", "--budget", "81GiB", "--no-plan").startswith(
        "ERROR: budget 81GiB is more than the h100 has (79.19 GiB as PyTorch reports it, 80 GB nominal)")


def test_margin_and_context_apply_in_every_verb_and_need_a_budget(capsys, tmp_path):
    c, _ = run_json(capsys, "compare", "--model", TINY, "--seq-len", "32", "--techniques", "fp32", "--budget", "2GiB",
                    "--margin", "0.1", "--context", "100MiB")
    assert (c["context_bytes"], c["margin_bytes"]) == (100 * MiB, int(0.1 * (2 * GiB - 100 * MiB)))
    err = one_line(capsys, "sweep", "--model", TINY, "--batch-sizes", "1", "--margin", "0.1", "--out", str(tmp_path / "s"))
    assert err == ("ERROR: --margin and --context are taken off a budget, and none is given  "
                   "HINT: add --budget 16GiB, or --gpu NAME for that GPU's whole memory")
    assert not (tmp_path / "s").exists()     # refused before any file


# ---------------------------------------------------------------- the docs state the rule the code applies

def rule_docs() -> list[Path]:
    """README.md and docs/*.md: wherever the rule table lives now."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def gpu_table() -> list[str]:
    """The table of every GPU's usable memory, as the code computes it (Budget.make("total", gpu=...))."""
    rows = ["| GPU (`--gpu`) | sold as | total memory (PyTorch) | CUDA context | margin | usable |", "|---|---|---|---|---|---|"]
    for g in GPUS.values():
        b = Budget.make("total", gpu=g.name)
        rows.append(f"| `{g.name}` | {g.nominal_gb:g} GB | {fmt_bytes(b.budget_bytes)} | {fmt_bytes(b.context_bytes)} | "
                    f"{fmt_bytes(b.margin_bytes)} | {fmt_bytes(b.usable_bytes)} |")
    return rows


def test_the_docs_gpu_table_is_the_codes():
    want = gpu_table()
    found = [(p, p.read_text().splitlines()) for p in rule_docs() if want[0] in p.read_text()]
    assert len(found) == 1, f"one page holds the GPU table (found in {[str(p) for p, _ in found]})"
    path, lines = found[0]
    i = lines.index(want[0])
    got = lines[i:i + len(want) + 1]
    assert got[:len(want)] == want and not got[len(want):][0].startswith("|"), (
        f"{path.name}'s GPU table is not the code's; paste:\n" + "\n".join(want))


def test_the_docs_rule_table_is_the_codes():
    # the rule table: | term | ... | rows; the margin's row says 5% and 256 MiB, the context's 740 MiB, as the code does
    pages = [p for p in rule_docs() if "| usable |" in p.read_text() and "| margin |" in p.read_text()]
    assert pages, "no page holds the rule table"
    for p in pages:
        rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (budget|CUDA context|margin|usable|need) \|(.*)$",
                                                             p.read_text(), re.M)}
        assert set(rows) == {"budget", "CUDA context", "margin", "usable", "need"}, (p, rows)
        assert f"{MARGIN_FRACTION:.0%}" in rows["margin"] and f"{MARGIN_MIN_BYTES // MiB} MiB" in rows["margin"]
        assert f"{CTX // MiB} MiB" in rows["CUDA context"]
        assert "budget - CUDA context - margin" in rows["usable"] and "peak reserved" in rows["need"]


def test_every_statement_of_the_margin_in_the_docs_is_the_codes():
    said = [(p.name, m.groups()) for p in rule_docs() for m in re.finditer(r"(\d+)% margin \(at least (\d+) MiB\)", p.read_text())]
    assert said and all(g == (f"{MARGIN_FRACTION * 100:.0f}", str(MARGIN_MIN_BYTES // MiB)) for _, g in said), said


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_a_gpus_nominal_size_is_above_what_pytorch_sees(gpu):
    # what makes "up to the nominal size: the total, with a warning" a tolerance, never a larger budget
    g = gpu_facts(gpu)
    assert g.total_memory_bytes < g.nominal_gb * GiB < 1.1 * g.total_memory_bytes
