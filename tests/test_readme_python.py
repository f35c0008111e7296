"""The Python of the README and docs/*.md runs, and the outputs they show are real ones.

Every ```python block is run here (on a tiny stand-in where the README's model is large: the same calls, the
replacements listed in BLOCKS) or, where it needs a GPU, compiled only, with the reason. A block that is not in
BLOCKS fails `test_every_python_block_is_covered`: a new snippet must say here how it runs.

The outputs the README shows under the commands of bench/readme_outputs.py (the quickstart, the llama estimate,
fit) and the GPU profile output are lines of the files that produced them, as they are: regenerate the files with
`python bench/readme_outputs.py` and copy the lines (tests/test_readme.py checks their shape on tiny stand-ins).
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from bench import readme_outputs
from memlens.cli.main import main
from tests import docs_pages

ROOT = Path(__file__).resolve().parents[1]
README = docs_pages.text()   # README.md and docs/*.md: the README's deep sections are pages there
TINY_GPT2 = ROOT / "tests/fixtures/models/tiny-gpt2"
TINY_LLAMA = ROOT / "tests/fixtures/tiny-llama"

RUN, COMPILE = "run", "compile"
# the block's first line -> (RUN, [(README text, stand-in text), ...], prelude name) | (COMPILE, why it cannot run here)
BLOCKS = {
    "# mypkg/models.py                      memlens estimate --model mypkg.models:classifier --batch-size 64":
        (RUN, [], "factory"),
    "from memlens import TrainingSpec, estimate":
        (RUN, [('model="llama-3.1-8b"', f'model="{TINY_LLAMA}"'), ("seq_len=1024", "seq_len=64")], None),
    "import memlens\ntrainer = Trainer(model=model, args=args, train_dataset=ds)": (RUN, [], "trainer"),
    "import memlens.measure.profiler as mp": (RUN, [], "loop"),
    "import memlens\n\nwith memlens.guard(model, optimizer, out_dir=\"oom/\"):":
        (COMPILE, "memlens.guard() needs a CUDA device (PyTorch's out-of-memory observer is CUDA's)"),
    "ab = memlens.adaptive_batch(optimizer, micro_batch=16)   # or spec=..., budget=...: start from memlens.fit":
        (COMPILE, "adaptive_batch reads CUDA memory between steps (Torch not compiled with CUDA here)"),
    "from memlens import Monitor": (COMPILE, "Monitor reads torch.cuda memory (needs CUDA)"),
    # docs/budget.md: the verbs take spec fields as keywords, the budget alike; the misspelt field is refused
    "import memlens\nmemlens.estimate(model=\"gpt2\", batch_size=8)":
        (RUN, [('model="gpt2"', f'model="{TINY_GPT2}"'), ("seq_len=1024", "seq_len=64"),
               ("spec, budget=", f'memlens.TrainingSpec(model="{TINY_GPT2}"), budget='),
               (f'memlens.estimate(model="{TINY_GPT2}", batch_sise=8)',
                f'import pytest\nwith pytest.raises(memlens.core.errors.SpecError, match="unknown spec field .batch_sise."):\n'
                f'    memlens.estimate(model="{TINY_GPT2}", batch_sise=8)')], None),
    # docs/lengths.md: the lengths of a tokenized dataset (a list of rows here), then the worst step's estimate
    "import memlens\nlengths = memlens.lengths_of(dataset":
        (RUN, [("lengths = memlens.lengths_of(", 'dataset = [{"input_ids": [1] * n} for n in (5, 60, 7)]\nlengths = memlens.lengths_of('),
               ('model="gpt2"', f'model="{TINY_GPT2}"'), ("seq_len=1024", "seq_len=64"),
               ('r.data["lengths"]["worst_step"]', 'assert r.data["lengths"]["worst_step"]["longest_sample"] == 60')], None),
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def _key(block: str) -> str:
    for k in BLOCKS:
        if block.startswith(k):
            return k
    return block.split("\n")[0]


BLOCK_LIST = python_blocks(README)


def test_every_python_block_is_covered():
    assert len(BLOCK_LIST) >= 7
    keys = [_key(b) for b in BLOCK_LIST]
    assert sorted(set(keys) - set(BLOCKS)) == [], "README python blocks with no entry in BLOCKS"
    assert sorted(set(BLOCKS) - set(keys)) == [], "BLOCKS entries the README no longer has"
    assert len(keys) == len(set(keys)), "two README blocks start alike: lengthen a key"


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config.from_pretrained(TINY_GPT2))


def _loop_names() -> dict:
    model = _tiny_gpt2()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters()),
            "loader": [{"input_ids": ids, "labels": ids}] * 2}


def _run_factory(block: str, tmp_path, monkeypatch, capsys):
    """The factory block as mypkg/models.py (with the imports and a tiny MyCNN it leaves out), then the command
    in its first line."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    prelude = '''import torch
import torch.nn.functional as F


class MyCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=4)
        self.fc = torch.nn.Linear(4, 1000)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))


'''
    (pkg / "models.py").write_text(prelude + block)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        monkeypatch.delitem(sys.modules, m)
    cmd = block.split("\n")[0].split("memlens ", 1)[1]
    assert main(shlex.split(cmd)) == 0, capsys.readouterr().err
    assert "estimate: mypkg.models:classifier b=64" in capsys.readouterr().out


def _trainer_names(tmp_path) -> dict:
    from transformers import Trainer, TrainingArguments

    from memlens.integrations.hf import MemlensCallback

    model = _tiny_gpt2()
    ids = torch.randint(0, model.config.vocab_size, (16,))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, report_to=[], use_cpu=True)
    return {"Trainer": Trainer, "MemlensCallback": MemlensCallback, "model": model, "args": args,
            "ds": [{"input_ids": ids, "labels": ids}] * 4}


@pytest.mark.parametrize("block", BLOCK_LIST, ids=[_key(b)[:50] for b in BLOCK_LIST])
def test_readme_python_block(block, tmp_path, monkeypatch, capsys):
    kind, *rest = BLOCKS[_key(block)]
    compile(block, "<README python block>", "exec")        # every block is valid Python
    if kind == COMPILE:
        pytest.skip(rest[0])
    subs, prelude = rest
    code = block
    for old, new in subs:
        assert old in code, f"the stand-in replaces {old!r}, which the block no longer has"
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMLENS_WORKERS", "1")
    if prelude == "factory":
        _run_factory(code, tmp_path, monkeypatch, capsys)
        return
    names: dict = {"__name__": "readme_block"}
    if prelude == "loop":
        names.update(_loop_names())
    elif prelude == "trainer":
        names.update(_trainer_names(tmp_path))
    exec(compile(code, "<README python block>", "exec"), names)


# ---------------------------------------------------------------- shown outputs are lines of real runs

def _shown_under(command: str) -> list[list[str]]:
    """The lines the README shows under `$ memlens COMMAND` (each occurrence), up to the block's end."""
    want = shlex.split(command)
    out = []
    for body in re.findall(r"^```console\n(.*?)^```", README, re.S | re.M):
        lines = body.splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("$ memlens ") or line.rstrip().endswith("\\"):    # continued: not one of these
                continue
            if shlex.split(re.sub(r"\s+#\s.*$", "", line[len("$ memlens "):])) == want:
                shown = []
                for s in lines[i + 1:]:
                    if s.startswith("$ "):
                        break
                    shown.append(s)
                out.append(shown)
    return out


@pytest.mark.parametrize("name", list(readme_outputs.CASES))
def test_readme_shows_lines_of_the_real_run(name):
    shown_blocks = _shown_under(readme_outputs.command(name))
    assert shown_blocks, f"the README no longer shows `memlens {readme_outputs.command(name)}`: drop it from bench/readme_outputs.py"
    real = {ln.rstrip() for ln in (ROOT / "bench/results/readme" / f"{name}.txt").read_text().splitlines()}
    for shown in shown_blocks:
        stale = [s for s in shown if s.strip() and not s.startswith("...") and s.rstrip() not in real]
        assert stale == [], f"README lines that bench/results/readme/{name}.txt does not have (rerun bench/readme_outputs.py): {stale}"


@pytest.mark.slow
def test_the_quickstart_file_is_what_the_code_prints_now(capsys, monkeypatch):
    """The README quotes bench/results/readme/quick_estimate_gpt2.txt, which bench/readme_outputs.py wrote from some
    version of the code: its headline lines are what this code prints (a file written from a working tree the
    commits did not hold had quoted 14.18 GiB reserved where the code said 14.21)."""
    monkeypatch.setenv("COLUMNS", "200")
    assert main(shlex.split(readme_outputs.command("quick_estimate_gpt2"))) == 0
    now = capsys.readouterr().out.splitlines()
    file = (ROOT / "bench/results/readme/quick_estimate_gpt2.txt").read_text().splitlines()
    heads = ("peak allocated", "peak reserved", "nvidia-smi", "GPU ", "predicted step")
    assert [ln.rstrip() for ln in now if ln.startswith(heads)] == [ln.rstrip() for ln in file if ln.startswith(heads)]


def test_gpu_profile_output_is_the_measured_one():
    """The profile output the README shows (an H100 run) is in the file it names (the README joins the lines the
    80-column run wrapped, so the words are compared)."""
    name = "bench/results/profile_gpt2_cli_output.txt"
    i = README.index(f"`{name}`")
    block = re.search(r"^```\n(.*?)^```", README[i:], re.S | re.M).group(1)
    real = " ".join((ROOT / name).read_text().split())
    stale = [s for s in block.splitlines() if s.strip() and " ".join(s.split()) not in real]
    assert stale == [], stale
