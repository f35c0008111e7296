"""The README and docs/*.md run: every `memlens ...` command in their ```console blocks (`$ memlens ...`) and ```bash blocks
(`memlens ...`) is run here, on a tiny stand-in where the README's model is large (same verb, same flags shape),
or parsed only where it needs a GPU, NVML or a token; where the README shows the output, the stand-in's output
is compared with it on its shape (the same labels and headers, numbers aside). The outputs of the full-size runs
(bench/readme_outputs.py) are checked line for line, and the ```python blocks run, in tests/test_readme_python.py.

A README command that is not in COMMANDS fails `test_every_readme_command_is_covered`: a new example must say
here how it runs.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from memlens.cli.main import build_parser, main
from tests import docs_pages

ROOT = Path(__file__).resolve().parents[1]
FIX = "tests/fixtures"
TINY_LLAMA = f"{FIX}/tiny-llama"
TINY_GPT2 = f"{FIX}/models/tiny-gpt2"

RUN, PARSE, SKIP, REFUSED = "run", "parse", "skip", "refused"
# README command (continuation lines joined, comments dropped) -> (RUN, stand-in argv) | (PARSE, reason) | (SKIP, reason)
# | (REFUSED, stand-in argv or None): a refusal, run as written (or on the stand-in), exit 2, each line it shows printed
# as it is (an ERROR line names no number that a stand-in would change)
COMMANDS = {
    # docs/speed.md: step time
    "estimate --model llama-3.2-1b --batch-size 4 --seq-len 1024 --precision bf16":
        (RUN, f"estimate --model {TINY_LLAMA} --batch-size 2 --seq-len 64 --precision bf16"),
    "calibrate --out h100_timing.json": (REFUSED, None),   # no GPU here: one line, exit 2
    "estimate --model llama-3.2-1b --batch-size 4 --seq-len 1024 --precision bf16 --timing-table h100_timing.json":
        (PARSE, "needs the table memlens calibrate writes on a GPU"),
    # the quickstart
    "estimate --model gpt2 --batch-size 8 --seq-len 1024 --precision amp-bf16":
        (RUN, f"estimate --model {TINY_GPT2} --batch-size 2 --seq-len 64 --precision amp-bf16"),
    "compare --model gpt2 --batch-size 8 --seq-len 1024 --techniques fp32,amp-bf16,checkpointing,amp-bf16+checkpointing":
        (RUN, f"compare --model {TINY_GPT2} --batch-size 2 --seq-len 64 --techniques fp32,amp-bf16,checkpointing,amp-bf16+checkpointing"),
    "profile --model gpt2 --device cpu --steps 1 --batch-size 1 --seq-len 64":
        (RUN, f"profile --model {TINY_GPT2} --device cpu --steps 1 --batch-size 1 --seq-len 16"),
    "doctor oom \"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 23.65 GiB "
    "of which 1.19 GiB is free. Including non-PyTorch memory, this process has 22.45 GiB memory in use. Of the allocated memory "
    "21.70 GiB is allocated by PyTorch, and 110.00 MiB is reserved by PyTorch but unallocated.\"": (RUN, None),   # as written
    # the sections below
    "estimate --model llama-3.2-1b --batch-size 4 --seq-len 2048 --precision bf16":
        (RUN, f"estimate --model {TINY_LLAMA} --batch-size 4 --seq-len 256 --precision bf16"),
    "estimate --model gpt2 --batch-size 8 --seq-len 1024 --precision amp-bf16 --compile":
        (RUN, f"estimate --model {TINY_GPT2} --batch-size 2 --seq-len 64 --precision amp-bf16 --compile"),
    "fit --model gpt2 --seq-len 512 --batch-size 32 --budget 16GiB":
        (RUN, f"fit --model {TINY_GPT2} --seq-len 512 --batch-size 32 --budget 600MiB --context 0"),
    "estimate --model gpt2 --batch-size 2 --seq-len 128 --precision amp-bf16 --grad-checkpointing --checkpoint-policy selective":
        (RUN, None),
    "estimate --model gpt2 --batch-size 2 --seq-len 128 --precision amp-bf16 --checkpoint-layers 6 --offload-activations 6,7":
        (RUN, None),
    "fit --model llama-3.1-8b --lora-rank 16 --precision bf16 --batch-size 2 --seq-len 2048 --budget 40GiB --least-recompute":
        (RUN, f"fit --model {TINY_LLAMA} --lora-rank 16 --precision bf16 --batch-size 2 --seq-len 512 --budget 73MiB "
             "--least-recompute --context 0 --margin 0"),
    "compare --model gpt2-medium --batch-size 1 --seq-len 128 --measure --out cmp/":
        (PARSE, "--measure runs real steps on a GPU"),
    "sweep --model gpt2-medium --batch-sizes 4,8,16 --seq-lens 512,1024 --techniques fp32,amp-bf16+checkpointing --measure --budget 10GiB --out sw/":
        (PARSE, "--measure runs real steps on a GPU"),
    "sweep ... --out sw/ --resume": (SKIP, "elided flags (the sweep above, resumed)"),
    "estimate --model llama-3.2-1b --precision bf16 --lora-rank 8 --dp --batch-size 16 --physical-batch-size 4 --seq-len 512":
        (RUN, f"estimate --model {TINY_LLAMA} --precision bf16 --lora-rank 8 --dp --batch-size 4 --physical-batch-size 2 --seq-len 32"),
    "estimate ... --dp --grad-sample-mode ghost": (SKIP, "elided flags (the estimate above in ghost mode)"),
    "compare --model llama-3.2-1b --precision bf16 --lora-rank 8 --dp --batch-size 16 --physical-batch-size 4 --seq-len 2048":
        (RUN, f"compare --model {TINY_LLAMA} --precision bf16 --lora-rank 8 --dp --batch-size 4 --physical-batch-size 2 --seq-len 32"),
    "fit --model llama-3.1-8b --precision bf16 --lora-rank 16 --dp --batch-size 64 --budget 80GiB":
        (PARSE, "a DP fit of an 8B model searches many simulated steps (minutes); the DP estimate and compare above run"),
    "profile --dp ... --mode full --out prof/": (SKIP, "elided flags; profile needs a GPU"),
    "sweep --dp --token $HF_TOKEN --seq_lengths 128 256 512 --batch_sizes 8 16 32 --max_physical_batch_sizes 1 2 4 --lora_ranks 8 16 "
    "--results_dir ./memory_results --num_steps 5 --measure": (PARSE, "--measure on a GPU, with a Hugging Face token"),
    "sweep --dp --token $HF_TOKEN --seq_lengths 128 256 --batch_sizes 8 16 --max_physical_batch_sizes 1 2 --results_dir ./detailed_results "
    "--num_steps 3 --detailed --measure": (PARSE, "--measure on a GPU, with a Hugging Face token"),
    "doctor log train.log --capacity 23.69GiB --out report/": (RUN, f"doctor log {FIX}/doctor/seed_exercise_9_8.log --capacity 23.69GiB --out {{tmp}}"),
    "doctor snapshot step5.pickle --diff step15.pickle --out report/":
        (RUN, f"doctor snapshot {FIX}/doctor/gpu_snapshot_step5.pickle --diff {FIX}/doctor/gpu_snapshot_step15.pickle --out {{tmp}}"),
    "doctor stats stats.json": (RUN, f"doctor stats {FIX}/doctor/gpu_memory_stats.json"),
    "watch": (PARSE, "needs an NVIDIA driver (NVML)"),
    "watch --once --json": (PARSE, "needs an NVIDIA driver (NVML)"),
    "watch --log mem.csv": (PARSE, "needs an NVIDIA driver (NVML)"),
    "profile --model gpt2 --batch-size 4 --seq-len 512 --precision amp-bf16": (PARSE, "profile measures on a GPU"),
    "profile --model llama-3.2-1b --precision bf16 --mode full --compare-estimate --out prof/": (PARSE, "profile measures on a GPU"),
    "profile --model gpt2 --torch-profiler --snapshot --out prof/": (PARSE, "profile measures on a GPU"),
    "profile --model mypkg.models:tiny --device cpu --steps 2": (RUN, "profile --model tests.tiny_models:mlp --device cpu --steps 2"),
    "profile --model gpt2 --load-on-cpu": (PARSE, "profile measures on a GPU"),
    "estimate --model llama-3.1-8b --precision amp-bf16 --grad-checkpointing --world-size 8 --sharding fsdp":
        (RUN, f"estimate --model {TINY_LLAMA} --precision amp-bf16 --grad-checkpointing --world-size 8 --sharding fsdp --seq-len 32"),
    "estimate --model gpt2 --batch-size 8 --world-size 2 --sharding ddp --gradient-as-bucket-view":
        (RUN, f"estimate --model {TINY_GPT2} --batch-size 8 --world-size 2 --sharding ddp --gradient-as-bucket-view --seq-len 32"),
    "profile --model llama-3.2-1b --precision amp-bf16 --world-size 2 --sharding fsdp --out prof/": (PARSE, "launches torchrun on 2 GPUs"),
    "profile --model llama-3.2-1b --precision amp-bf16 --sharding fsdp --nnodes 2 --nproc-per-node 8 --rdzv-endpoint node0:29400 "
    "--out prof/": (PARSE, "runs on two machines of 8 GPUs each (tests/distributed/test_multinode.py: two agents on one CPU host)"),
    "profile --model llama-3.2-1b --precision amp-bf16 --sharding fsdp --nnodes 2 --nproc-per-node 8 --rdzv-endpoint node0:29400 "
    "--node-rank 1 --out prof/": (PARSE, "runs on two machines of 8 GPUs each"),
    "profile --model gpt2 --nnodes 2 --nproc-per-node 8": (REFUSED, f"profile --model {TINY_GPT2} --nnodes 2 --nproc-per-node 8"),
    "estimate --model llama-3.1-8b --precision amp-bf16 --grad-checkpointing --world-size 64 --sharding hsdp --shard-size 8":
        (RUN, f"estimate --model {TINY_LLAMA} --precision amp-bf16 --grad-checkpointing --world-size 64 --sharding hsdp --shard-size 8 "
              "--seq-len 32"),
    "estimate --model llama-3.1-8b --precision amp-bf16 --grad-checkpointing --world-size 16 --sharding fsdp --tp 8":
        (RUN, f"estimate --model {TINY_LLAMA} --precision amp-bf16 --grad-checkpointing --world-size 4 --sharding fsdp --tp 2 "
              "--seq-len 32"),
    "estimate --model llama-3.1-8b --precision amp-bf16 --grad-checkpointing --seq-len 8192 --batch-size 8 --world-size 8 "
    "--sharding fsdp --pp 4 --pp-microbatches 8":
        (RUN, f"estimate --model {TINY_LLAMA} --precision amp-bf16 --grad-checkpointing --seq-len 64 --batch-size 4 --world-size 4 "
              "--sharding fsdp --pp 2 --pp-microbatches 4"),
    "estimate --model llama-3.1-8b --world-size 8 --sharding ddp --pp 4": (REFUSED, None),
    "estimate --model llama-3.1-8b --precision amp-bf16 --grad-checkpointing --seq-len 65536 --world-size 8 --sharding fsdp --cp 2":
        (RUN, f"estimate --model {TINY_LLAMA} --precision amp-bf16 --grad-checkpointing --seq-len 64 --world-size 4 --sharding fsdp "
              "--cp 2"),
    "fit --model llama-3.1-8b --precision bf16 --world-size 8 --sharding zero2 --budget 80GiB --target-batch 256":
        (PARSE, "a sharded fit of an 8B model simulates many ranks and sizes (minutes); the sharded estimates above run"),
    "sweep --model gpt2-medium --batch-sizes 4,8,16,32 --measure --gpus 0,1,2,3 --out sw/": (PARSE, "--measure on 4 GPUs"),
    "doctor oom \"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB "
    "of which 1.19 GiB is free. Process 48213 has 22.33 GiB memory in use. Of the allocated memory 17.10 GiB is allocated by "
    "PyTorch, and 4.71 GiB is reserved by PyTorch but unallocated.\"": (RUN, None),   # as written    # docs/budget.md: one budget rule (--gpu alone is that GPU's whole memory; sizes checked against the GPUs known)
    "fit --model gpt2 --seq-len 1024 --gpu rtx-4090 --no-plan":
        (RUN, f"fit --model {TINY_GPT2} --seq-len 1024 --gpu rtx-4090 --no-plan"),
    "fit --model gpt2 --seq-len 1024 --budget 80GiB --no-plan":
        (RUN, f"fit --model {TINY_GPT2} --seq-len 64 --budget 80GiB --no-plan"),
    "sweep --model gpt2-medium --batch-sizes 4,8,16 --seq-lens 512,1024 --techniques fp32,amp-bf16+checkpointing --budget 10GiB --out sw/":
        (RUN, f"sweep --model {TINY_GPT2} --batch-sizes 1,2 --seq-lens 32 --techniques fp32,amp-bf16+checkpointing "
             "--budget 10GiB --out {tmp}"),
    "compare --model gpt2-medium --batch-size 8 --seq-len 512 --techniques amp-bf16+checkpointing --budget 10GiB":
        (RUN, f"compare --model {TINY_GPT2} --batch-size 2 --seq-len 64 --techniques amp-bf16+checkpointing --budget 10GiB"),
    "fit --model gpt2-medium --seq-len 512 --precision amp-bf16 --grad-checkpointing --budget 10GiB --no-plan":
        (RUN, f"fit --model {TINY_GPT2} --seq-len 64 --precision amp-bf16 --grad-checkpointing --budget 1100MiB --no-plan"),
    "fit --model gpt2 --budget 80GiB --gpu t4": (REFUSED, f"fit --model {TINY_GPT2} --budget 80GiB --gpu t4"),
    "fit --model gpt2 --budget 1e30GiB": (REFUSED, f"fit --model {TINY_GPT2} --budget 1e30GiB"),
    "fit --model gpt2 --budget 80": (REFUSED, f"fit --model {TINY_GPT2} --budget 80"),
    "fit --model gpt2 --budget -1GiB": (REFUSED, f"fit --model {TINY_GPT2} --budget -1GiB"),
    "fit --model gpt2 --budget 16GiB --margin 1.5": (REFUSED, f"fit --model {TINY_GPT2} --budget 16GiB --margin 1.5"),
    "sweep --model gpt2 --batch-sizes 1 --margin 0.1 --out sw/":
        (REFUSED, f"sweep --model {TINY_GPT2} --batch-sizes 1 --margin 0.1 --out {{tmp}}"),
    "fit --model gpt2 --no-plan": (PARSE, "its refusal is what a machine without a CUDA GPU prints; where one is, it runs"),
    # docs/trl.md: TRL 1.16's steps on the tiny llama (the same trainer, flags and printed lines)
    "estimate --model qwen2.5-0.5b --trainer-args sft_config.json":
        (RUN, f"estimate --model {TINY_LLAMA} --trainer-args {FIX}/trl/sft_lora.yaml --seq-len 256"),
    "estimate --model qwen2.5-0.5b --trainer sft --batch-size 4 --seq-len 1024 --precision bf16-amp --grad-checkpointing --optimizer adamw-fused":
        (RUN, f"estimate --model {TINY_LLAMA} --trainer sft --batch-size 2 --seq-len 64 --precision bf16-amp --grad-checkpointing "
             "--optimizer adamw-fused"),
    "estimate --model qwen2.5-0.5b --trainer sft --packing bfd --batch-size 4 --seq-len 1024 --precision bf16-amp --grad-checkpointing --optimizer adamw-fused":
        (RUN, f"estimate --model {TINY_LLAMA} --trainer sft --packing bfd --batch-size 2 --seq-len 64 --precision bf16-amp "
             "--grad-checkpointing --optimizer adamw-fused"),
    "estimate --model qwen2.5-0.5b --trainer dpo --batch-size 2 --seq-len 1024 --prompt-len 512 --precision bf16-amp --grad-checkpointing --optimizer adamw-fused":
        (RUN, f"estimate --model {TINY_LLAMA} --trainer dpo --batch-size 2 --seq-len 64 --prompt-len 32 --precision bf16-amp "
             "--grad-checkpointing --optimizer adamw-fused"),
    "estimate --model qwen2.5-0.5b --trainer grpo --batch-size 8 --seq-len 256 --max-completion-length 1024 --precision bf16-amp --grad-checkpointing --optimizer adamw-fused":
        (RUN, f"estimate --model {TINY_LLAMA} --trainer grpo --batch-size 8 --seq-len 32 --max-completion-length 32 --precision bf16-amp "
             "--grad-checkpointing --optimizer adamw-fused"),
    "estimate --model qwen2.5-0.5b --trainer grpo --batch-size 16 --seq-len 256 --max-completion-length 1024 --beta 0.04 --precision bf16-amp --grad-checkpointing --optimizer adamw-fused":
        (RUN, f"estimate --model {TINY_LLAMA} --trainer grpo --batch-size 8 --seq-len 32 --max-completion-length 32 --beta 0.04 "
             "--precision bf16-amp --grad-checkpointing --optimizer adamw-fused"),
    # docs/liger.md
    "estimate --model qwen2.5-0.5b --batch-size 4 --seq-len 1024 --precision bf16":
        (RUN, f"estimate --model {TINY_LLAMA} --batch-size 2 --seq-len 64 --precision bf16"),
    "estimate --model qwen2.5-0.5b --batch-size 4 --seq-len 1024 --precision bf16 --liger":
        (RUN, f"estimate --model {TINY_LLAMA} --batch-size 2 --seq-len 64 --precision bf16 --liger"),
    "compare --model qwen2.5-0.5b --batch-size 4 --seq-len 1024 --precision bf16 --techniques bf16,liger,checkpointing+liger":
        (RUN, f"compare --model {TINY_LLAMA} --batch-size 2 --seq-len 64 --precision bf16 --techniques bf16,liger,checkpointing+liger"),
    # docs/vlm.md: the tiny configs of the same families
    "estimate --model qwen2.5-vl-3b --image-size 448 --precision bf16 --lora-rank 16":
        (RUN, f"estimate --model {FIX}/configs/qwen2.5-vl.json --image-size 56 --precision bf16 --lora-rank 16 --seq-len 32"),
    "estimate --model qwen2.5-vl-3b --image-size 448 --precision bf16 --freeze visual":
        (RUN, f"estimate --model {FIX}/configs/qwen2.5-vl.json --image-size 56 --precision bf16 --freeze visual --seq-len 32"),
    "estimate --model olmoe-1b-7b --lora-rank 16": (RUN, f"estimate --model {FIX}/configs/olmoe.json --lora-rank 16 --seq-len 32"),
    'estimate --model gpt2 --lora-rank 8 --lora-targets ""': (REFUSED, f'estimate --model {TINY_GPT2} --lora-rank 8 --lora-targets ""'),
    "estimate --model deberta-v3-base": (RUN, f"estimate --model {FIX}/configs/deberta-v2.json --seq-len 32"),
    # docs/lengths.md: the page's lengths file, on tiny GPT-2
    "estimate --model gpt2 --batch-size 8 --seq-len 1024 --precision amp-bf16 --lengths docs/examples/lengths.txt --budget 12GiB":
        (RUN, f"estimate --model {TINY_GPT2} --batch-size 8 --seq-len 64 --precision amp-bf16 --lengths docs/examples/lengths.txt "
             "--budget 12GiB"),
    # docs/configs.md: the axolotl example as written (about 15 s), and refusals of keys not modelled
    "estimate --config tests/fixtures/axolotl/lora-1b.yml --top 3": (RUN, None),
    "estimate --config ds.yml": (REFUSED, f"estimate --config {FIX}/axolotl/deepspeed.yml"),
    "estimate --config k.yml": (REFUSED, f"estimate --config {FIX}/axolotl/lora-kernel.yml"),
    # docs/doctor.md, what changed in the verdicts: an edited OOM message, a log of falling memory
    "doctor oom oom.txt": (REFUSED, f"doctor oom {FIX}/doctor/oom_edited.txt"),
    "doctor log train.log": (RUN, f"doctor log {FIX}/doctor/falling.log"),
    # docs/diffusion.md: as written (the shipped SD-1.5 config on fake tensors: about 12 s), so its module names show
    "estimate --model sd-1.5 --batch-size 8 --image-size 512 --precision amp-bf16 --grad-checkpointing": (RUN, None),
    "estimate --model sd-1.5 --batch-size 8 --image-size 512 --precision amp-bf16 --grad-checkpointing --ema": (RUN, None),
}


def readme_examples(text: str) -> list[tuple[str, list[str]]]:
    """(command after `memlens `, the output lines the README shows under it) for each example."""
    out: list[tuple[str, list[str]]] = []
    for lang, body in re.findall(r"^```(console|bash)\n(.*?)^```", text, re.S | re.M):
        lines = body.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            prompt = lang == "bash" or line.startswith("$ ")
            cmd = line[2:] if line.startswith("$ ") else line
            if not (prompt and cmd.startswith("memlens ")):
                i += 1
                continue
            while cmd.rstrip().endswith("\\") and i + 1 < len(lines):      # continuation lines
                i += 1
                cmd = cmd.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            i += 1
            shown = []
            while i < len(lines) and not lines[i].startswith("$ ") and not (lang == "bash" and lines[i].startswith("memlens ")):
                shown.append(lines[i])
                i += 1
            cmd = re.sub(r"\s+#\s.*$", "", cmd[len("memlens "):]).strip()   # a trailing comment
            out.append((re.sub(r"\s+", " ", cmd), [s for s in shown if s.strip() and not s.lstrip().startswith("#")]))
    return out


EXAMPLES = readme_examples(docs_pages.text())   # README.md and docs/*.md


def test_every_readme_command_is_covered():
    found = [c for c, _ in EXAMPLES]
    assert len(found) >= 25, found
    assert sorted(set(found) - set(COMMANDS)) == [], "README commands with no entry in COMMANDS"
    assert sorted(set(COMMANDS) - set(found)) == [], "COMMANDS entries the README no longer has"


_BOX = str.maketrans({c: " " for c in "│┃┏┓┗┛┡┩┢┪━─┳┻╇╈┼┯┷╋┠┨┌┐└┘├┤┬┴"})


def _words(s: str) -> str:
    return " ".join(s.translate(_BOX).split())


_NUMBER = re.compile(r"^[~+\-]?\d[\d.,]*(%|x|s|})?\)?$")   # 12, +3.5%, 2x, 8.9s, 10}) (a number closing a dict in code)


def skeleton(line: str, model: str | None = None) -> list[str]:
    """The words of a shown line before its first number (a row's label, a table's header), after a leading row
    number, and never the README's model name or a `b=4`-like setting: what the stand-in's output must show too."""
    words = _words(line).split()
    while words and words[0].isdigit():
        words = words[1:]
    out = []
    for w in words:
        if _NUMBER.match(w) or "=" in w or w in ("...", "…") or (model and model in w):
            break
        out.append(w)
    return out


def _by_command() -> list[tuple[str, list[list[str]]]]:
    """Each distinct command once, with what every page that shows it shows under it (the same command shown twice
    runs once: each place's lines are checked against that one output)."""
    shown: dict[str, list[list[str]]] = {}
    for cmd, lines in EXAMPLES:
        shown.setdefault(cmd, []).append(lines)
    return list(shown.items())


UNIQUE = _by_command()


@pytest.mark.parametrize("example", UNIQUE, ids=[c[:70] for c, _ in UNIQUE])
def test_readme_example(example, capsys, tmp_path, monkeypatch):
    cmd, places = example
    kind, what = COMMANDS[cmd]
    if kind == SKIP:
        pytest.skip(what)
    argv = shlex.split(cmd.replace("$HF_TOKEN", "hf_x"))
    if kind == PARSE:       # the flags exist and take these values: the README's command is one memlens accepts
        args = build_parser(argv[0]).parse_args(argv)
        assert args is not None
        return
    monkeypatch.setenv("MEMLENS_WORKERS", "1")
    monkeypatch.chdir(ROOT)
    run_argv = argv if what is None else shlex.split(what.replace("{tmp}", str(tmp_path)))
    assert run_argv[0] == argv[0], "a stand-in keeps the verb"
    assert {a for a in run_argv if a.startswith("--")} >= {a for a in argv if a.startswith("--")}, "a stand-in keeps the flags"
    code = main(run_argv)
    out, err = capsys.readouterr()
    if kind == REFUSED:
        assert code == 2, out + err
        printed = _words(err.replace(TINY_GPT2, "gpt2"))
        assert [s for shown in places for s in shown if _words(s) not in printed] == [], \
            f"the page shows a refusal this command no longer prints:\n{err}"
        return
    assert code == 0, err
    text = _words(out + err)   # what the terminal shows: a WARNING line is on stderr
    model = argv[argv.index("--model") + 1] if "--model" in argv else None
    missing = []
    for line in (line for shown in places for line in shown):
        sk = skeleton(line, model)
        if not sk:
            continue
        # a row or a line: its label as one phrase; a table header (4 words or more): each word, since rich wraps
        # header cells over lines
        ok = " ".join(sk) in text or (len(sk) >= 4 and all(w in text.split() for w in sk))
        if not ok:
            missing.append(" ".join(sk))
    assert missing == [], f"the README shows lines this command no longer prints: {missing}\n--- output ---\n{out}"
