"""Every number a user types is checked for sense (issue 34, "What to build" 2): each bullet of "Accepted but
meaningless" re-run as written, answered with one line (exit 2) or the right answer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memlens.cli.main import main
from memlens.core.errors import MemlensError
from memlens.core.fits import parse_margin
from memlens.core.spec import TrainingSpec
from memlens.core.techniques import apply
from memlens.core.units import parse_bytes
from memlens.explore.compare import row_label, row_specs
from tests.cli.cli_support import one_line

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests/fixtures/models/tiny-gpt2")



@pytest.mark.parametrize("verb", [["fit"], ["compare", "--techniques", "fp32"], ["sweep", "--batch-sizes", "1"]])
def test_a_budget_above_every_gpu_is_refused(capsys, verb):
    # the bullet: `--budget 1e30GiB` answered micro-batch 65536 and a 27-digit TiB figure
    assert one_line(capsys, *verb, "--model", "gpt2", "--budget", "1e30GiB") == (
        "ERROR: budget 1e30GiB is more than any GPU memlens knows has (the largest: the h200, 139.80 GiB)  "
        "HINT: give the memory of one GPU, e.g. 24GiB or 80GiB (`memlens estimate --list-gpus`)")


def test_a_log_capacity_above_every_gpu_is_refused(capsys, tmp_path):
    log = tmp_path / "train.log"
    log.write_text("step 1 mem 1GB\nstep 2 mem 2GB\nstep 3 mem 3GB\n")
    assert one_line(capsys, "doctor", "log", str(log), "--capacity", "1e30GiB") == (
        "ERROR: --capacity 1e30GiB is more than any GPU memlens knows has (the largest: the h200, 139.80 GiB)  "
        "HINT: give the memory of one GPU, e.g. 24GiB or 80GiB (`memlens estimate --list-gpus`)")
    assert one_line(capsys, "doctor", "log", str(log), "--capacity", "24") == (
        "ERROR: --capacity 24 has no unit  HINT: did you mean 24GiB? (sizes take a unit: GiB, MiB, GB, ...; bytes: 24B)")
    assert one_line(capsys, "doctor", "log", str(log), "--capacity", "") == (
        "ERROR: --capacity is empty  HINT: write it like 16GiB, 24GB or 512MiB")


def test_a_margin_of_1_5_is_refused(capsys):
    # the bullet: `--margin 1.5` was read as 1 byte
    assert one_line(capsys, "fit", "--model", "gpt2", "--budget", "16GiB", "--margin", "1.5") == (
        "ERROR: --margin 1.5 is neither a fraction below 1 nor a size  "
        "HINT: a fraction of the memory below 1 (--margin 0.05 = 5%) or a size with a unit (--margin 512MiB)")
    assert one_line(capsys, "fit", "--model", "gpt2", "--budget", "16GiB", "--margin", "-0.1").startswith(
        "ERROR: --margin -0.1 is negative")
    assert one_line(capsys, "fit", "--model", "gpt2", "--budget", "16GiB", "--margin", "512").startswith(
        "ERROR: --margin 512 is neither a fraction below 1 nor a size")
    assert parse_margin("0") == 0.0 and parse_margin("0.05") == 0.05 and parse_margin("512MiB") == 512 * 2**20


def test_a_size_without_a_unit_is_refused(capsys):
    # the bullet: `--budget 80` was read as 80 bytes, no "did you mean 80GiB"
    assert one_line(capsys, "fit", "--model", "gpt2", "--budget", "80") == (
        "ERROR: budget 80 has no unit  HINT: did you mean 80GiB? (sizes take a unit: GiB, MiB, GB, ...; bytes: 80B)")
    assert one_line(capsys, "fit", "--model", "gpt2", "--budget", "16GiB", "--context", "740").startswith(
        "ERROR: --context 740 has no unit  HINT: did you mean 740GiB?")
    assert parse_bytes("0") == 0 and parse_bytes("80B") == 80 and parse_bytes(80) == 80   # bytes when said so


def test_a_negative_budget_is_refused_in_words(capsys):
    # the bullet: `--budget -1GiB` answered argparse's "expected one argument"
    assert one_line(capsys, "fit", "--model", "gpt2", "--budget", "-1GiB") == (
        "ERROR: budget -1GiB is negative  HINT: give a size such as 16GiB")
    # a negative number is still a value everywhere (argparse's own rule kept): --batch-size -3 refused as before
    assert one_line(capsys, "estimate", "--model", "gpt2", "--batch-size", "-3") == (
        "ERROR: batch-size must be >= 1, got -3  HINT: e.g. --batch-size 8")


def test_checkpointing_all_and_some_blocks_at_once_is_refused(capsys):
    # the bullet: `--grad-checkpointing --checkpoint-layers 3` silently used 3
    assert one_line(capsys, "estimate", "--model", "gpt2", "--grad-checkpointing", "--checkpoint-layers", "3") == (
        "ERROR: --grad-checkpointing checkpoints every block and --checkpoint-layers 3 only some  "
        "HINT: give one of them: --checkpoint-layers 3 alone checkpoints those blocks")
    # "all" is what --grad-checkpointing says: no contradiction
    assert main(["estimate", "--model", TINY, "--seq-len", "16", "--grad-checkpointing", "--checkpoint-layers", "all",
                 "--json"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("pair", [["--use-cache", "--no-cache"], ["--keep-outputs", "--drop-outputs"]])
def test_yes_and_no_of_one_setting_is_refused(capsys, pair):
    err = one_line(capsys, "estimate", "--model", "gpt2", *pair)
    assert err.startswith(f"ERROR: argument {pair[1]}: not allowed with argument {pair[0]}")


@pytest.mark.parametrize("flag", ["--gpu", "--lora-targets", "--model", "--optimizer", "--config", "--freeze"])
def test_an_empty_flag_is_refused_not_read_as_its_default(capsys, flag):
    # the bullet: `--gpu ""` and `--lora-targets ""` silently meant the defaults
    extra = ["--lora-rank", "8"] if flag == "--lora-targets" else []
    argv = ["estimate", "--model", "gpt2", *extra, flag, ""] if flag != "--model" else ["estimate", "--model", ""]
    err = one_line(capsys, *argv)
    assert err.startswith(f"ERROR: {flag} is empty") or (flag == "--model" and err.startswith("ERROR: no model given")), err


def test_an_empty_gpu_or_lora_targets_is_refused_in_python_too():
    with pytest.raises(MemlensError, match="--gpu is empty"):
        TrainingSpec(model="gpt2", gpu="")
    with pytest.raises(MemlensError, match="--lora-targets is empty"):
        TrainingSpec(model="gpt2", lora_rank=8, lora_targets=[])
    with pytest.raises(MemlensError, match="--lora-targets is empty"):
        TrainingSpec.from_dict({"model": "gpt2", "lora_rank": 8, "lora_targets": ""})


# ---------------------------------------------------------------- compare's rows keep what the user gave

@pytest.mark.slow
def test_compare_lora_rank_given_is_kept_and_labelled(capsys):
    # the bullet: `compare --techniques fp32,lora --lora-rank 8` labelled a LoRA r8 row "fp32" and ran "lora" at r16
    rc = main(["compare", "--model", TINY, "--seq-len", "32", "--techniques", "fp32,lora,amp-bf16", "--lora-rank", "8", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = {r["technique"]: r for r in json.loads(out)["rows"]}
    assert rows["fp32"]["label"] == "fp32 + LoRA r=8" and rows["fp32"]["spec"]["lora_rank"] == 8
    assert rows["amp-bf16"]["label"] == "amp-bf16 + LoRA r=8" and rows["amp-bf16"]["spec"]["lora_rank"] == 8
    assert rows["lora"]["status"] == "invalid" and "spec" not in rows["lora"]
    assert rows["lora"]["error"].startswith("changes nothing: the baseline (fp32: ")
    assert not any(r.get("spec", {}).get("lora_rank") == 16 for r in rows.values())


def test_compare_lora_rank_default_without_one_given():
    base, specs = row_specs(TrainingSpec(model="gpt2"), ["fp32", "lora", "qlora"])
    assert [s.lora_rank for s in specs] == [None, 16, 16]
    assert row_label("qlora", base, specs[2]) == "qlora (bf16)"      # QLoRA's compute dtype, said in its label
    assert row_label("lora", base, specs[1]) == "lora"


@pytest.mark.slow
def test_compare_qlora_under_a_given_fp32_is_refused_as_estimate_refuses_it(capsys):
    # the bullet: `compare --precision fp32 --techniques fp32,qlora` ran QLoRA in bf16 where estimate refuses it
    estimate_says = one_line(capsys, "estimate", "--model", TINY, "--precision", "fp32", "--lora-rank", "16", "--qlora")
    rc = main(["compare", "--model", TINY, "--seq-len", "32", "--precision", "fp32", "--techniques", "fp32,qlora", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = {r["technique"]: r for r in json.loads(out)["rows"]}
    assert rows["qlora"]["status"] == "invalid" and estimate_says == f"ERROR: {rows['qlora']['error']}  HINT: " + (
        "drop --precision (QLoRA defaults to bf16), or use bf16, amp-bf16 or fp16")
    assert rows["fp32"]["spec"]["precision"] == "fp32"
    # without --precision the row is QLoRA as it runs (bf16), and says so
    assert apply(TrainingSpec(model="gpt2"), "qlora").precision == "bf16"
