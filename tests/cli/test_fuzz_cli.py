"""Property: whatever flags, values and files a user gives any verb, memlens answers with exit code
0 or 2 and never a traceback or an "internal error" (issue 15, the CLI contract).

The CLI runs in this process (``main(argv)``), on tiny factory models and on the CPU, so each valid
case takes well under a second; the examples are derandomized so that CI is reproducible. The
max_examples of the tests below sum to 570 invocations.
"""
import contextlib
import io
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlens.cli.main import main

# test_the_fuzz_ran_valid_cases reads CODES, which the fuzz tests fill in this process: under pytest-xdist the module
# runs whole on one worker, in order (tests/conftest.py: pytest_xdist_make_scheduler)
pytestmark = pytest.mark.xdist_group("cli_fuzz")

FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
_counter = itertools.count()
CODES: dict[str, list] = {}   # verb -> exit codes seen (how many cases were valid: see test_the_fuzz_ran_valid_cases)

MODELS = ["tests.tiny_models:mlp", "tests.tiny_models:mlp", "tests.tiny_models:linear", "tests.tiny_models:labelled",
          "tests.tiny_models:own_step", "tests.tiny_models:seq_linear", "tests.tiny_models:nosuch", "nosuchpkg.mod:fn",
          "gtp2", "", ":", "a/b c", "tests.tiny_models:"]
NUM = ["0", "-1", "1", "2", "x", "1e3", "nan", "-0", "99999999999"]
SPEC_FLAGS = {
    "--batch-size": ["1", "2", "3"] + NUM, "--seq-len": ["8", "16"] + NUM, "--image-size": ["32"] + NUM,
    "--images-per-sample": ["1"] + NUM, "--precision": ["fp32", "bf16", "amp-bf16", "amp-fp16", "fp16", "bf16-amp", "fp8"],
    "--grad-checkpointing": None, "--attn": ["sdpa", "eager", "flash"],
    "--optimizer": ["adamw", "sgd", "adafactor", "adamw-fused", "adamw_torch_fused", "lion", "adamw-8bit"],
    "--max-grad-norm": ["1.0", "0", "-1", "nan", "inf"], "--lora-rank": ["4"] + NUM, "--lora-alpha": ["8", "-1", "0", "nan", "inf"],
    "--lora-targets": ["0", "0,2", "q_proj", ",", "fc"], "--qlora": None, "--freeze": ["0", "nomatch", "*", "fc"],
    "--grad-accum": ["1", "2"] + NUM, "--dp": None, "--physical-batch-size": ["1", "2"] + NUM,
    "--grad-sample-mode": ["hooks", "ghost", "x"], "--noise-multiplier": ["1", "-1", "nan"],
    "--world-size": ["1", "2", "0", "-2"], "--sharding": ["none", "ddp", "zero1", "zero2", "zero3", "fsdp", "bogus"],
    "--reshard-after-forward": ["true", "false", "2", "x", "-1"], "--gradient-as-bucket-view": None,
    "--bucket-cap-mb": ["25", "0", "-1", "nan"], "--offload-optimizer": None, "--gpu": ["h100", "a100", "nosuchgpu", ""],
    "--target-len": ["8"] + NUM, "--hf-trainer": None, "--deepspeed": ["ds.json"], "--bogus": None, "-x": None,
    "--config": "FILE", "--trainer-args": "FILE",
}
OUT_FLAGS = {"--json": None, "--out": "DIR"}

_yaml_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 64), st.floats(allow_nan=True, allow_infinity=True),
                         st.text(max_size=12), st.lists(st.integers(-2, 8), max_size=3))
_yaml_keys = st.sampled_from(["model", "batch_size", "seq_len", "precision", "lora_rank", "lora_alpha", "world_size",
                              "sharding", "optimizer", "spec", "per_device_train_batch_size", "bf16", "optim",
                              "gradient_accumulation_steps", "hidden_size", "model_type", "bogus"])
FILE_CONTENT = st.one_of(
    st.binary(max_size=200),
    st.dictionaries(_yaml_keys, _yaml_values, max_size=6).map(lambda d: json.dumps(d).encode()),
    st.dictionaries(_yaml_keys, _yaml_values, max_size=6).map(lambda d: {"model": "tests.tiny_models:mlp", **d})
    .map(lambda d: json.dumps(d).encode()),
    st.text(max_size=200).map(str.encode),
    st.just(b"__DIR__"), st.just(b"__MISSING__"),
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _path(workdir, kind: str, content: bytes | None) -> str:
    p = workdir / f"{kind}{next(_counter)}"
    if kind == "DIR" or content == b"__DIR__":
        p.mkdir()
    elif content != b"__MISSING__":
        p.write_bytes(content or b"")
    return str(p)


@st.composite
def _argv(draw, verb_words, flags, workdir, model=True, fixed=()):
    argv = list(verb_words)
    if model and draw(st.integers(0, 9)) > 0:
        argv += ["--model", draw(st.sampled_from(MODELS))]
    for flag in draw(st.lists(st.sampled_from(sorted(flags)), max_size=5, unique=True)):
        values = flags[flag]
        if values is None:
            argv.append(flag)
        elif values in ("FILE", "DIR"):
            argv += [flag, _path(workdir, values, draw(FILE_CONTENT) if values == "FILE" else None)]
        else:
            argv += [flag, draw(st.sampled_from(values))]
    return argv + list(fixed)


def check(argv: list[str]) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:   # --help, --version
            code = e.code or 0
    text = err.getvalue()
    CODES.setdefault(argv[0] if argv else "", []).append(code)
    assert code in (0, 2), f"exit {code} for {argv}:\n{text[-2000:]}"
    assert "Traceback" not in text and "internal error" not in text, f"{argv}:\n{text[-2000:]}"
    if code == 2:
        last = text.strip().splitlines()[-1]
        assert last.startswith("ERROR: ") and "  HINT: " in last, f"{argv}: {last}"


def test_estimate(workdir):
    flags = {**SPEC_FLAGS, **OUT_FLAGS, "--method": ["simulate", "formula", "exact"], "--top": NUM, "--list-gpus": None}

    @settings(FUZZ, max_examples=160)
    @given(_argv(["estimate"], flags, workdir))
    def run(argv):
        check(argv)

    run()


def test_profile(workdir):
    flags = {**SPEC_FLAGS, **OUT_FLAGS, "--steps": ["1", "2"] + NUM, "--warmup": ["0", "1"] + NUM,
             "--mode": ["phases", "ledger", "full", "x"], "--load-on-cpu": None, "--compare-estimate": None,
             "--device": ["cpu", "cpu", "cuda:99", "tpu", ""]}

    @settings(FUZZ, max_examples=70)
    @given(_argv(["profile"], flags, workdir, fixed=("--device", "cpu", "--steps", "1", "--warmup", "0")))
    def run(argv):
        check(argv)

    run()


def test_compare(workdir):
    flags = {**SPEC_FLAGS, **OUT_FLAGS, "--budget": ["1GiB", "0", "-1GiB", "lots", "10MB"],
             "--steps": NUM, "--timeout": NUM, "--measure": None}
    techniques = st.lists(st.sampled_from(["fp32", "amp-bf16", "checkpointing", "lora", "accumulation", "sgd", "turbo",
                                           "fp32+checkpointing", ""]), min_size=1, max_size=2).map(",".join)

    @settings(FUZZ, max_examples=70)
    @given(_argv(["compare"], flags, workdir), techniques)
    def run(argv, tech):
        check(argv + ["--techniques", tech])

    run()


def test_sweep(workdir):
    flags = {**SPEC_FLAGS, "--json": None, "--seq-lens": ["8,16", "0", "-4", "x"], "--lora-ranks": ["4", "0", "a"],
             "--physical-batch-sizes": ["1,2", "0"], "--techniques": ["fp32,amp-bf16", "turbo", "fp32"],
             "--budget": ["1GiB", "x"], "--resume": None, "--detailed": None, "--gpus": ["0", "x", "-1"],
             "--steps": NUM, "--timeout": NUM, "--measure": None, "--model_name": ["tests.tiny_models:mlp", "x"]}

    @settings(FUZZ, max_examples=50)
    @given(_argv(["sweep"], flags, workdir), st.sampled_from(["1", "1,2", "0", "-1", "x,2", ""]))
    def run(argv, batches):
        check(argv + ["--batch-sizes", batches, "--out", _path(workdir, "DIR", None)])

    run()


def test_fit(workdir):
    flags = {**SPEC_FLAGS, **OUT_FLAGS, "--target-batch": NUM, "--margin": ["0.05", "512MiB", "-1", "2", "x"],
             "--context": ["0", "740MiB", "-1", "x"], "--method": ["simulate", "formula"], "--verify": None,
             "--timeout": NUM, "--steps": NUM, "--gpus": NUM}

    @settings(FUZZ, max_examples=60)
    @given(_argv(["fit"], flags, workdir), st.sampled_from(["4GiB", "16GiB", "80GB", "80GB", "1GiB", "64MiB", "0", "-1", "x", "1e3"]))
    def run(argv, budget):
        check(argv + ["--budget", budget, "--no-plan"])

    run()


FIXTURES = Path(__file__).parent.parent / "fixtures" / "doctor"
REAL = {"oom": "gpu_oom_fragmentation.txt", "log": "gpu_watch_log.csv", "snapshot": "gpu_snapshot_step5.pickle",
        "stats": "gpu_memory_stats.json"}


def test_doctor(workdir):
    words = st.sampled_from([["doctor"], ["doctor", "oom"], ["doctor", "log"], ["doctor", "snapshot"], ["doctor", "stats"],
                             ["doctor", "nosuch"]])
    flags = {**OUT_FLAGS, "--capacity": ["24GiB", "x", "-1"], "--unit": ["MiB", "x"], "--gpu": NUM, "--top": NUM,
             "--diff": "FILE", "--bogus": None}
    texts = st.one_of(st.just("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"),
                      st.text(max_size=80))

    @settings(FUZZ, max_examples=120)
    @given(words, _argv([], flags, workdir, model=False), FILE_CONTENT, texts, st.integers(0, 2))
    def run(verb, argv, content, text, how):
        if verb in (["doctor"], ["doctor", "nosuch"]):
            target = []
        elif how == 0:   # a real input of that kind (a GPU's OOM message, log, snapshot, memory_stats)
            target = [str(FIXTURES / REAL[verb[1]])]
        else:
            target = [_path(workdir, "FILE", content) if how == 1 or verb[1] != "oom" else text]
        check(verb + target + argv)

    run()


def test_watch_and_top_level(workdir):
    flags = {"--interval": ["0.01", "0", "-1", "nan"], "--count": ["1", "0", "-1"], "--gpu": NUM, "--json": None,
             "--window": NUM, "--warn-fraction": ["0.9", "0", "2", "nan"], "--warn-minutes": NUM, "--log": "FILE",
             "--bogus": None}
    words = st.sampled_from([["watch"], ["watch", "--once"], [], ["--version"], ["--help"], ["nosuchverb"], ["--debug"],
                             ["estimate", "--help"], ["estimate", "--list-models"]])

    @settings(FUZZ, max_examples=40)
    @given(words, _argv([], flags, workdir, model=False))
    def run(verb, argv):
        # one reading at most, so that a machine with NVML answers at once as well
        check(verb + argv + (["--count", "1", "--interval", "0.01"] if verb == ["watch"] else []))

    run()


def test_the_fuzz_ran_valid_cases():
    """Not only refusals: a good share of the random invocations ran to the end (exit 0)."""
    if len(CODES) < 4:
        pytest.skip("run with the fuzz tests above")
    ran = {verb: sum(c == 0 for c in codes) for verb, codes in CODES.items()}
    total = sum(len(codes) for codes in CODES.values())
    print(ran, total)
    assert total >= 500
    for verb in ("estimate", "profile", "compare", "sweep", "fit", "doctor"):
        assert ran.get(verb, 0) >= 5, (verb, ran)
