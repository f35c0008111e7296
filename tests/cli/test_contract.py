"""The CLI contract on user mistakes: one line `ERROR: ... HINT: ...`, exit 2, no traceback (issue 15's list)."""
import json
import sys
import textwrap

import pytest

from memlens.cli.main import main
from tests.cli.cli_support import one_line

USER_FACTORIES = '''
import torch

def boom(spec=None):
    raise ValueError("my factory is broken")

W = torch.randn(8, 8)

def captured(spec=None):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    return model, torch.randn(4, 8), lambda out, b: (out @ W).sum()

def bad_loss(spec=None):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    return model, torch.randn(4, 8), lambda out, b: out.reshape(3, -1).sum()

def bad_step(spec=None):
    def step(model, batch):
        raise KeyError("labels")
    return torch.nn.Sequential(torch.nn.Linear(8, 8)), {"x": torch.randn(4, 8)}, step
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's factory module `userfac` (fresh for each test) importable from the working directory."""
    (tmp_path / "userfac.py").write_text(textwrap.dedent(USER_FACTORIES))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("userfac", None)
    yield tmp_path
    sys.modules.pop("userfac", None)


def test_config_directory_and_binary(capsys, tmp_path):
    err = one_line(capsys, "estimate", "--config", str(tmp_path))
    assert err == f"ERROR: config {tmp_path} is a directory, not a YAML file  HINT: give --config the path of a spec.yaml"
    binary = tmp_path / "b.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    err = one_line(capsys, "estimate", "--config", str(binary))
    assert err == (f"ERROR: {binary} is not valid YAML (not UTF-8 text)  "
                   "HINT: give --config a YAML text file (key: value per line)")


def test_factory_that_raises_is_the_users_error_with_its_last_frame(capsys, user_module):
    err = one_line(capsys, "estimate", "--model", "userfac:boom")
    assert err.startswith("ERROR: your factory userfac:boom raised ValueError: my factory is broken (userfac.py:5 in boom)  HINT: ")


def test_loss_function_and_step_that_fail_are_the_users(capsys, user_module):
    err = one_line(capsys, "estimate", "--model", "userfac:bad_loss")
    assert err.startswith("ERROR: the loss function of your factory userfac:bad_loss raised RuntimeError: ")
    assert "(userfac.py:15 in <lambda>)" in err
    err = one_line(capsys, "estimate", "--model", "userfac:bad_step")
    assert err.startswith("ERROR: the step function of your factory userfac:bad_step raised KeyError: 'labels' "
                          "(userfac.py:19 in step)")


def test_loss_closure_with_a_real_tensor(capsys, user_module):
    err = one_line(capsys, "estimate", "--model", "userfac:captured")
    assert err == ("ERROR: the loss function of your factory userfac:captured uses a real tensor created outside the factory, "
                   "which estimate cannot trace (userfac.py:11 in <lambda>)  "
                   "HINT: create every tensor inside the factory (or register it on the model as a buffer)")


def test_module_that_fails_at_import(capsys, tmp_path, monkeypatch):
    (tmp_path / "brokenmod.py").write_text("x = 1\nraise RuntimeError('no import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = one_line(capsys, "estimate", "--model", "brokenmod:f")
    assert err.startswith("ERROR: importing your module 'brokenmod' for factory 'brokenmod:f' raised RuntimeError: "
                          "no import (brokenmod.py:2 in <module>)")


def test_debug_after_the_verb_shows_the_traceback_behind_the_line(capsys, user_module):
    rc = main(["estimate", "--model", "userfac:boom", "--debug"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback (most recent call last)" in err and 'raise ValueError("my factory is broken")' in err
    assert err.strip().splitlines()[-1].startswith("ERROR: your factory userfac:boom raised ValueError")


LORA_FACTORY = "tests.tiny_models:mlp"
LORA_LINE = ("ERROR: --lora-rank on a model without a transformers config needs --lora-targets "
             "(its Linear/Conv modules: 0, 2)  HINT: e.g. --lora-targets 0,2")


@pytest.mark.parametrize("verb,extra", [
    ("estimate", []), ("compare", ["--techniques", "fp32,amp-bf16"]), ("fit", ["--budget", "1GiB", "--gpus", "1"]),
    ("sweep", ["--batch-sizes", "1,2"]),
])
def test_lora_on_a_factory_without_targets_names_its_modules(capsys, tmp_path, verb, extra):
    out = ["--out", str(tmp_path / "o")] if verb == "sweep" else []
    rc = main([verb, "--model", LORA_FACTORY, "--lora-rank", "4", *extra, *out])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().splitlines()[-1] == LORA_LINE and "Traceback" not in err
    if verb == "sweep":   # nothing was estimated: no results.jsonl that would block the corrected rerun
        assert not (tmp_path / "o" / "results.jsonl").exists()


def test_lora_targets_from_the_message_work(capsys):
    assert main(["estimate", "--model", LORA_FACTORY, "--lora-rank", "4", "--lora-targets", "0,2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["spec"]["lora_targets"] == ["0", "2"]


@pytest.mark.parametrize("argv,line", [
    (["estimate", "--model", "gpt2", "--lora-rank", "8", "--lora-alpha", "-1"],
     "ERROR: lora-alpha must be a positive number, got -1.0  HINT: e.g. --lora-alpha 32 (default 2 x rank)"),
    (["estimate", "--model", "gpt2", "--lora-rank", "-8"], "ERROR: lora-rank must be >= 1, got -8  HINT: e.g. --lora-rank 8"),
    (["estimate", "--model", "gpt2", "--top", "-1"],
     "ERROR: argument --top: must be a whole number >= 0, got -1  HINT: see `memlens estimate --help`"),
    (["compare", "--model", "gpt2", "--steps", "0"],
     "ERROR: argument --steps: must be a whole number >= 1, got 0  HINT: see `memlens compare --help`"),
    (["fit", "--model", "gpt2", "--gpus", "-2"],
     "ERROR: argument --gpus: must be a whole number >= 1, got -2  HINT: see `memlens fit --help`"),
    (["sweep", "--model", "gpt2", "--batch-sizes", "-4"],
     "ERROR: argument --batch-sizes/--batch_sizes: '-4' is not a whole number >= 1  HINT: see `memlens sweep --help`"),
    (["sweep", "--model", "gpt2", "--timeout", "nan"],
     "ERROR: argument --timeout: must be a number > 0, got nan  HINT: see `memlens sweep --help`"),
    (["profile", "--model", "gpt2", "--warmup", "-1"],
     "ERROR: argument --warmup: must be a whole number >= 0, got -1  HINT: see `memlens profile --help`"),
    (["doctor", "snapshot", "x.pickle", "--top", "0"],
     "ERROR: argument --top: must be a whole number >= 1, got 0  HINT: see `memlens doctor snapshot --help`"),
    (["watch", "--window", "-5"], "ERROR: argument --window: must be a number > 0, got -5  HINT: see `memlens watch --help`"),
    (["estimate", "--model", "gpt2", "--bogus"], "ERROR: unrecognized arguments: --bogus  HINT: see `memlens estimate --help`"),
    (["estimate", "--model", "gpt2", "--world-size", "2", "--method", "formula"],
     "ERROR: --world-size 2 needs --sharding  HINT: add --sharding ddp (or zero1, zero2, zero3, fsdp)"),
    (["estimate", "--model", "whisper-small", "--target-len", "512"],
     "ERROR: target_len 512 exceeds whisper-small's 448 decoder positions  HINT: use --target-len 448 or less"),
    (["estimate", "--model", "gpt2", "--offload-optimizer"],
     "ERROR: --offload-optimizer is not simulated or run by this step yet  HINT: use --method formula, or drop --offload-optimizer"),
    (["profile", "--model", "tests.tiny_models:mlp"],
     "ERROR: profile measures real steps on a GPU and this machine has none  "
     "HINT: add --device cpu to run them on the CPU (ledger of tensor storages)"),
])
def test_nonsense_values_and_flags(capsys, argv, line):
    if argv[0] == "profile" and "--warmup" not in argv:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    assert one_line(capsys, *argv) == line


def test_debug_before_the_verb_still_works(capsys):
    assert main(["--debug", "estimate", "--model", "gpt2", "--top", "-1"]) == 2
    assert "must be a whole number >= 0" in capsys.readouterr().err


# ---------------------------------------------------------------- Hugging Face ids without a network
OFFLINE_HINT = ("HINT: use a built-in name (memlens estimate --list-models), a local directory with config.json, "
                "or set HF_HUB_OFFLINE/HF_HOME to a cache that has it")


def test_hub_id_without_network_is_one_quick_line(capsys, monkeypatch, tmp_path):
    import time

    from memlens.models import source

    monkeypatch.setenv("HF_HOME", str(tmp_path))   # an empty cache
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(source, "_hub_unreachable", lambda timeout=2.0: "cannot reach huggingface.co:443: Name or service not known")
    t = time.perf_counter()
    err = one_line(capsys, "estimate", "--model", "google/gemma-2-2b")
    assert time.perf_counter() - t < 3
    assert err == ("ERROR: cannot download the config of google/gemma-2-2b: no network (cannot reach huggingface.co:443: "
                   "Name or service not known) and no cached copy  " + OFFLINE_HINT)


def test_hub_offline_env(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = one_line(capsys, "estimate", "--model", "google/gemma-2-2b")
    assert err == "ERROR: cannot download the config of google/gemma-2-2b: no network (HF_HUB_OFFLINE is set) and no cached copy  " + OFFLINE_HINT


def test_unreachable_check_is_quick_on_a_closed_port(monkeypatch):
    import socket
    import time

    from memlens.models import source

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()   # nothing listens there: refused at once
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t = time.perf_counter()
    why = source._hub_unreachable()
    assert why.startswith(f"cannot reach 127.0.0.1:{port}: ") and time.perf_counter() - t < 2.5


def test_missing_id_with_network_says_check_the_id(capsys, monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.utils import RepositoryNotFoundError

    from memlens.models import source

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(source, "_hub_unreachable", lambda timeout=2.0: None)
    calls = []

    def not_found(repo_id, filename, **kw):
        calls.append((repo_id, filename, kw.get("local_files_only")))
        raise RepositoryNotFoundError("404 Client Error: Repository Not Found", response=_response(404))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", not_found)
    err = one_line(capsys, "estimate", "--model", "someorg/no-such-model")
    assert calls == [("someorg/no-such-model", "config.json", False)]
    assert err == ("ERROR: cannot download the config of someorg/no-such-model: not found on the Hub (RepositoryNotFoundError)  "
                   "HINT: check the id, or use a built-in name (`memlens estimate --list-models`)")


def _response(status: int):
    """A minimal HTTP response for huggingface_hub's error classes (httpx or requests, as installed)."""
    from unittest import mock

    r = mock.Mock()
    r.status_code = status
    r.headers = {}
    r.url = "https://huggingface.co/x"
    r.request = mock.Mock(url=r.url)
    return r


# ---------------------------------------------------------------- answers that must be right (exit 0)
def test_formula_shards_per_rank_and_says_so(capsys):
    def run(*extra):
        assert main(["estimate", "--model", "llama-3.1-8b", "--precision", "bf16", "--method", "formula", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    one, z3 = run(), run("--world-size", "8", "--sharding", "zero3")
    assert z3["by_category"]["optimizer_state"] * 8 == one["by_category"]["optimizer_state"]
    assert z3["by_category"]["gradients"] * 8 == one["by_category"]["gradients"]
    assert z3["peak_allocated_bytes"] < one["peak_allocated_bytes"] / 4
    assert any("per rank of 8 GPUs (zero3): parameters, gradients and optimizer states divided by 8" in n for n in z3["notes"])
    ddp = run("--world-size", "8", "--sharding", "ddp")   # whole states on every rank, plus the all-reduce buckets
    assert ddp["by_category"]["gradients"] == 2 * one["by_category"]["gradients"]


def test_whisper_small_is_the_whole_encoder_decoder():
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.models.build import build
    from memlens.models.source import resolve

    with torch.device("meta"):
        b = build(TrainingSpec(model="whisper-small"), resolve("whisper-small"))
    # openai/whisper-small: 241.7M parameters (the decoder alone would be 153.6M); proj_out is tied to the embeddings
    assert type(b.model).__name__ == "WhisperForConditionalGeneration"
    assert sum({id(p): p.numel() for p in b.model.parameters()}.values()) == 241_734_912


def test_cpu_measured_sweep_records_the_cpu_ledger(tmp_path):
    from memlens.core.spec import TrainingSpec
    from memlens.explore.sweep import Grid, sweep

    r = sweep(TrainingSpec(model="tests.tiny_models:linear"), Grid(batch_sizes=[16]), out=tmp_path, measure=True,
              device="cpu", steps=1, timeout=120)
    row = r.data["rows"][0]
    assert row["status"] == "ok" and row["memory_measured"] is True
    # 1024 x 1024 fp32 weights, their gradients and AdamW's two states are all alive in the step: 16 MiB at least
    assert 16 * 2**20 <= row["peak_allocated_bytes"] < 32 * 2**20


def test_the_command_exits_with_mains_code_and_skips_the_last_collections(monkeypatch):
    """`memlens` (cli) exits with main's code; the objects left are frozen, so the interpreter's
    final garbage collections do not walk them (about 0.8 s with torch and transformers imported)."""
    import gc

    from memlens.cli import main as cli_main

    monkeypatch.setattr(cli_main, "main", lambda: 2)
    try:
        with pytest.raises(SystemExit) as e:
            cli_main.cli()
        assert e.value.code == 2 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_command_writes_its_whole_answer_before_it_exits(tmp_path):
    import subprocess

    p = subprocess.run([sys.executable, "-m", "memlens.cli.main", "estimate", "--model", "gpt2", "--method", "formula",
                        "--batch-size", "2", "--seq-len", "64", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["verb"] == "estimate"
