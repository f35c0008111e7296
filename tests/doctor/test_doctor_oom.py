"""`doctor oom`: every message form parsed exactly, accounted byte by byte, diagnosed, advised; the
spec path; bad input; fuzzing. The corpus (containers, several processes, memory fractions, torch <=
2.0, HIP/XPU/MPS) and its sources are in oom_corpus.py; GPU-captured messages in
test_doctor_gpu_fixtures.py.
"""
from __future__ import annotations

import io
import json
import re
import sys
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlens.cli.main import main
from memlens.doctor import oom as oom_mod
from memlens.doctor.advice import oom_advice
from memlens.doctor.sizes import parse_size
from memlens.doctor.oom import diagnose, diagnose_oom, find_oom_messages, parse_oom, what_fits
from memlens.core.errors import MemlensError
from memlens.core.result import Result
from memlens.core.spec import TrainingSpec

from doctor_support import FIXTURES, format_size
from oom_corpus import CORPUS, SEED_000, b, text

_UNIT = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
EX_9_2 = text("seed_003_exercise_9_2_wrapped")
PRIVATE_POOLS = text("torch_2_4_allowed_private_pools")
FRAG_KIB = text("torch_2_1_fragmentation_kib")
ZERO_BYTES = text("torch_2_1_zero_bytes_no_nvml")
PUBLIC_2_0 = text("torch_2_0_public_held_elsewhere")
OLD_ALLOWED = text("torch_2_0_allowed")
FRAGMENTED_OLD = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.93 GiB total capacity; 3.00 GiB already "
                  "allocated; 1.00 GiB free; 5.90 GiB reserved in total by PyTorch)")


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_corpus_parsed_exactly_and_diagnosed(case):
    msg = parse_oom(case["text"])
    for key, want in case["fields"].items():
        got = getattr(msg, key)
        if key == "other_processes":
            got = [(p.pid, p.used_bytes) for p in got]
        assert got == want, f"{case['id']}: {key}"
    d = diagnose(msg)
    assert d.diagnosis == case["diagnosis"], d.reasons
    assert d.certain is case.get("certain", True), d.reasons
    acc = d.account
    if "self_source" in case:
        assert acc.this_process_source == case["self_source"] or (
            case["self_source"] == "ambiguous" and acc.this_process_source == "hypothesis")
    if "self_pid" in case:
        assert acc.this_process_pid == case["self_pid"]
    if "others" in case:
        assert acc.other_processes_bytes == case["others"]
    assert (d.evidence or d.diagnosis == "unknown") and all(isinstance(v, int) and v >= 0 for v in d.evidence.values())


@pytest.mark.parametrize("case", [c for c in CORPUS if c["fields"].get("form", "torch>=2.1") != "mps"
                                  and parse_oom(c["text"]).total_capacity_bytes is not None
                                  and parse_oom(c["text"]).free_bytes is not None],
                         ids=lambda c: c["id"])
def test_account_adds_up_to_the_gpu(case):
    """total = free + this process + others + unaccounted, to the byte, whatever the message gives;
    and this process = PyTorch reserved + non-PyTorch whenever both are known."""
    msg = parse_oom(case["text"])
    acc = diagnose(msg).account
    if acc.this_process_bytes is not None:
        assert acc.total_bytes == acc.free_bytes + acc.this_process_bytes + acc.other_processes_bytes + acc.unaccounted_bytes
        # the unaccounted rest is small when every process is listed (driver memory, print rounding)
        if case["diagnosis"] != "held_elsewhere" and acc.this_process_source in ("message", "matched"):
            assert abs(acc.unaccounted_bytes) < 0.08 * acc.total_bytes, case["id"]
        if acc.pytorch_reserved_bytes is not None:
            assert acc.this_process_bytes == acc.pytorch_reserved_bytes + acc.non_pytorch_bytes
    if acc.pytorch_reserved_bytes is not None:
        assert acc.held_elsewhere_bytes == acc.total_bytes - acc.free_bytes - acc.pytorch_reserved_bytes
        assert acc.pytorch_reachable_bytes == min(acc.pytorch_reserved_bytes + acc.free_bytes,
                                                  acc.allowed_bytes if acc.allowed_bytes is not None else 2**63)


def test_container_message_names_this_process_and_stops_blaming_it():
    """Issue 14: in a PID namespace the job is printed as "Process 48213"; memlens used to call it an
    other process and advise killing it. 22.33 GiB = 17.10 + 4.71 reserved + a 0.52 GiB context."""
    d = diagnose(parse_oom(text("container_alone_fragmented")))
    acc = d.account
    assert acc.this_process_pid == 48213 and acc.other_processes == []
    assert acc.non_pytorch_bytes == b("22.33 GiB") - b("17.10 GiB") - b("4.71 GiB")
    assert d.diagnosis == "fragmentation"
    assert d.evidence["reserved_unallocated"] == b("4.71 GiB") and d.evidence["requested"] == 2 * 2**30
    assert not any("48213" in a for a in d.advice)
    assert d.advice[0].startswith("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def test_shared_container_blames_only_the_others():
    d = diagnose(parse_oom(text("container_shared_public_ocrflux")))
    assert d.diagnosis == "other_processes" and d.account.this_process_pid == 30427
    assert d.advice[0].startswith("Free the GPU: other processes (25454, 104554) hold 8.15 GiB")
    assert "30427" in d.reasons[0] and "recognized by its numbers" in d.reasons[0]


def test_when_the_message_cannot_tell_it_says_so_and_what_would():
    d = diagnose(parse_oom(text("container_one_listed_cannot_tell")))
    assert d.certain is False
    assert d.alternatives == [{"this_process_pid": 77, "diagnosis": "non_pytorch_memory"},
                              {"this_process_pid": None, "diagnosis": "other_processes"}]
    assert "memlens watch --once" in d.reasons[-1] and "cannot" not in d.reasons[0]
    same = diagnose(parse_oom(text("container_two_candidates_same_verdict")))
    assert same.certain and {a["this_process_pid"] for a in same.alternatives} == {111, 222}
    assert "the verdict is the same whichever it is" in same.reasons[-1]


def test_torch_2_0_memory_held_elsewhere_is_not_fragmentation():
    """Issue 14: total - free - reserved is memory PyTorch does not hold; 8.11 GiB of a 10.76 GiB GPU."""
    d = diagnose(parse_oom(text("torch_2_0_issue14_held_elsewhere")))
    assert d.diagnosis == "held_elsewhere"
    assert d.account.held_elsewhere_bytes == b("10.76 GiB") - b("301.69 MiB") - b("2.36 GiB")
    from memlens.doctor.account import context_allowance
    assert d.evidence["held_elsewhere"] == d.account.held_elsewhere_bytes - context_allowance()
    assert "memlens watch --once" in d.reasons[-1]
    # a fragmented 2.0 message with little held elsewhere stays fragmentation
    assert diagnose(parse_oom(FRAGMENTED_OLD)).diagnosis == "fragmentation"


def test_reserved_adds_up_in_both_forms():
    new = parse_oom(PRIVATE_POOLS)  # allocated 32.50 GiB (includes 2 GiB private pools) + 857 MiB unallocated
    assert new.reserved_by_pytorch_bytes == b("32.50 GiB") + b("857.00 MiB")
    assert new.non_pytorch_bytes == b("33.89 GiB") - new.reserved_by_pytorch_bytes
    old = parse_oom(EX_9_2)
    assert old.reserved_by_pytorch_bytes == b("21.50 GiB")
    assert old.other_processes_bytes == 0


def test_seed_000_message_in_whole_notebook_is_found_among_code_mentions():
    notebook = "print('x')\nif \"out of memory\" in str(e):\n    pass\n" + SEED_000 + "\nif 'out of memory' in msg: pass\n"
    r = diagnose_oom(notebook)
    assert r.data["messages_found"] == 1
    assert r.data["requested_bytes"] == 16 * 2**20
    assert r.data["diagnosis"] == "other_processes"
    assert r.data["other_processes_bytes"] == b("12.57 GiB") + b("2.10 GiB")


def test_several_messages_in_a_log_last_one_wins():
    log = ("[rank0]: " + FRAG_KIB + "\nretrying with a smaller batch\n[rank0]: " + ZERO_BYTES)
    msgs = find_oom_messages(log)
    assert [m.requested_bytes for m in msgs] == [128 * 2**20, 2 * 2**20]
    r = diagnose_oom(log)
    assert r.data["requested_bytes"] == 2 * 2**20 and r.data["messages_found"] == 2
    assert r.notes == ["2 OOM messages found; the last one is diagnosed"]


def test_message_text_is_cut_before_pytorch_advice():
    assert parse_oom(PUBLIC_2_0).message.endswith("188.00 MiB reserved in total by PyTorch)")


@pytest.mark.parametrize("diagnosis,first_words", [
    ("fragmentation", "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
    ("other_processes", "Free the GPU: other processes (3859131, 3880458) hold 14.67 GiB"),
    ("memory_fraction_limit", "Raise the limit: this process may use only"),
    ("capacity", "Halve the micro-batch"),
])
def test_advice_is_ordered_and_specific(diagnosis, first_words):
    msg = parse_oom(SEED_000)
    advice = oom_advice(msg, diagnosis)
    assert advice[0].startswith(first_words)
    assert len(advice) >= 3


def test_large_single_request_mentions_logits_first():
    advice = diagnose(parse_oom(EX_9_2)).advice
    assert advice[0].startswith("A single request of 2.50 GiB (11% of the GPU)")
    assert advice[1].startswith("Halve the micro-batch")


# ---------------------------------------------------------------- with a spec

def _fake_estimate(spec: TrainingSpec) -> Result:
    """Activations scale with batch, halve with checkpointing/AMP; AdamW state 2x params, 8-bit 0.5x."""
    params = 2 * 2**30
    act = spec.batch_size * 2**30 // (4 if spec.grad_checkpointing else 1) // (2 if spec.precision != "fp32" else 1)
    opt = params // 4 if spec.optimizer == "adamw-8bit" else 2 * params
    if spec.lora_rank:
        opt //= 100
    cats = {"parameters": params, "gradients": params if not spec.lora_rank else params // 100,
            "optimizer_state": opt, "activations": act}
    return Result(verb="estimate", peak_allocated_bytes=sum(cats.values()), by_category=cats)


def test_what_fits_tries_each_lever_then_combines():
    spec = TrainingSpec(model="gpt2", batch_size=16)
    opts = what_fits(spec, 16 * 2**30, _fake_estimate)
    names = [o.name for o in opts]
    assert names[:5] == ["halve micro-batch, double accumulation", "checkpointing", "AMP bf16", "8-bit AdamW",
                         "LoRA r=16"]
    by = {o.name: o for o in opts}
    # baseline 2+2+4+16 = 24 GiB; checkpointing: 2+2+4+4 = 12 GiB (no reserved figure: allocated) fits in 16 GiB less the 5% margin
    assert by["checkpointing"].peak_allocated_bytes == 12 * 2**30 and by["checkpointing"].fits
    assert by["halve micro-batch, double accumulation"].peak_allocated_bytes == 16 * 2**30
    assert not by["halve micro-batch, double accumulation"].fits  # 16 GiB > 15.2 GiB
    assert by["halve micro-batch, double accumulation"].changes == {"batch_size": 8, "grad_accum": 2}
    combined = [o for o in opts if " + " in o.name]
    assert combined and combined[-1].fits and combined[-1].name == "halve micro-batch, double accumulation + checkpointing"


def test_doctor_oom_with_spec_cli(monkeypatch, capsys):
    monkeypatch.setattr(oom_mod, "_run_estimate", _fake_estimate)
    rc = main(["doctor", "oom", EX_9_2, "--model", "gpt2", "--batch-size", "16", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    est = d["estimate"]
    assert est["dominant_category"] == "activations" and est["dominant_category_bytes"] == 16 * 2**30
    assert est["estimated_peak_allocated_bytes"] == 24 * 2**30 and est["fits"] is False
    assert est["budget_bytes"] == b("21.50 GiB") + b("1.89 GiB")   # what PyTorch could hold: reserved + free
    assert any(o["fits"] for o in est["fit_options"])
    assert d["spec"]["batch_size"] == 16


def test_doctor_oom_with_spec_renders_table(monkeypatch, capsys):
    monkeypatch.setattr(oom_mod, "_run_estimate", _fake_estimate)
    assert main(["doctor", "oom", EX_9_2, "--model", "gpt2", "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "activations (dominant)" in out and "what would fit" in out and "Diagnosis: capacity" in out


FRAGMENTED = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.65 GiB total capacity; 15.00 GiB already allocated; "
              "1.00 GiB free; 21.90 GiB reserved in total by PyTorch)")


def test_doctor_with_an_estimate_that_does_not_fit_says_capacity(monkeypatch):
    # the message alone reads as fragmentation (6.9 GiB reserved but unallocated); the step's estimate
    # (gpt2 batch 16 in the fake: 24 GiB) does not fit the 22.9 GiB PyTorch could hold: capacity, technique advice
    assert diagnose_oom(FRAGMENTED).data.diagnosis == "fragmentation"
    r = diagnose_oom(FRAGMENTED, TrainingSpec(model="gpt2", batch_size=16), _fake_estimate)
    d = r.data
    assert d.diagnosis == "capacity" and d.estimate["fits"] is False
    assert d.estimate["verdict"].startswith("does not fit what PyTorch could hold on this GPU (")
    assert d.reasons[0].startswith("the estimate of this configuration does not fit")
    assert any(x.startswith("the message alone reads as fragmentation") for x in d.reasons)
    assert not any("expandable_segments" in a for a in d.advice)
    assert d.advice[0] == "halve micro-batch, double accumulation (gpt2 b=8 fp32 adamw accum=2): estimated to fit"
    # an estimate that fits leaves the message's verdict alone
    small = diagnose_oom(FRAGMENTED, TrainingSpec(model="gpt2", batch_size=1), _fake_estimate).data
    assert small.diagnosis == "fragmentation" and small.estimate["fits"] is True


def test_budget_is_what_pytorch_could_hold():
    """reserved + free (capped by the allowed limit): other processes, this process' context and
    whatever the message does not list are outside it, measured rather than summed from NVML."""
    msg = parse_oom(SEED_000)
    assert oom_mod.budget_bytes(msg) == b("413.55 MiB") + b("12.45 MiB") + b("23.06 MiB")
    assert oom_mod.budget_bytes(parse_oom(PRIVATE_POOLS)) == b("39.55 GiB")      # the allowed limit is lower
    container = parse_oom(text("container_shared_public_ocrflux"))
    assert oom_mod.budget_bytes(container) == b("30.21 GiB") + b("217.48 MiB") + b("9.25 MiB")
    # without PyTorch's figures: the capacity less the other processes and the non-PyTorch part
    truncated = parse_oom(text("public_truncated_other_process"))
    assert oom_mod.budget_bytes(truncated) == b("44.39 GiB") - b("8.06 GiB")


def test_estimator_missing_is_one_clear_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "memlens.estimator", None)
    assert main(["doctor", "oom", EX_9_2, "--model", "gpt2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ERROR: the estimator is not available") and "\n" not in err


# ---------------------------------------------------------------- CLI input paths

def test_cli_json_keys(capsys):
    assert main(["doctor", "oom", SEED_000, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verb"] == "doctor.oom" and d["schema_version"] == "1"
    for k in ("requested_bytes", "total_capacity_bytes", "free_bytes", "allocated_by_pytorch_bytes",
              "reserved_unallocated_bytes", "other_processes", "diagnosis", "advice", "account", "evidence", "certain"):
        assert k in d
    assert d["other_processes"] == [{"pid": 3859131, "used_bytes": b("12.57 GiB")}, {"pid": 3880458, "used_bytes": b("2.10 GiB")}]


def test_cli_reads_a_file_and_writes_out(tmp_path, capsys):
    f = tmp_path / "crash.log"
    f.write_text("Traceback (most recent call last):\n  File 'train.py', line 3\n" + PUBLIC_2_0 + "\n")
    assert main(["doctor", "oom", str(f), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "Diagnosis: held_elsewhere" in out and "held outside PyTorch" in out
    d = json.loads((tmp_path / "o" / "result.json").read_text())
    assert d["diagnosis"] == "held_elsewhere" and d["certain"] is True
    assert d["account"]["held_elsewhere_bytes"] == b("7.93 GiB") - b("47.06 MiB") - b("188.00 MiB")


def test_cli_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(OLD_ALLOWED))
    assert main(["doctor", "oom", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["diagnosis"] == "memory_fraction_limit"


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("argv,stdin,message", [
    (["doctor", "oom", "hello world"], None, "ERROR: not an OOM message"),
    (["doctor", "oom", ""], None, "ERROR: not an OOM message"),
    (["doctor", "oom", "crash.log"], None, "ERROR: OOM message crash.log does not exist"),
    (["doctor", "oom"], _Tty(""), "ERROR: no OOM message given"),
    (["doctor", "oom", "-"], io.StringIO("\x00\x01 binary junk"), "ERROR: not an OOM message"),
    (["doctor"], None, "ERROR: doctor needs what to read"),
    (["doctor", "oom", SEED_000, "--batch-size", "8"], None, "ERROR: no model given"),
    (["doctor", "xray"], None, "ERROR: argument WHAT: invalid choice"),
])
def test_bad_input_is_one_line_exit_2(monkeypatch, capsys, argv, stdin, message):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", stdin)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "HINT:" in err and err.count("\n") == 1 and "Traceback" not in err


def test_module_runs_alone(tmp_path):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "memlens.cli.doctor", "oom", EX_9_2, "--json"],
                       capture_output=True, text=True, cwd=FIXTURES.parent.parent.parent)
    assert r.returncode == 0 and json.loads(r.stdout)["diagnosis"] == "capacity"


# ---------------------------------------------------------------- fuzzing

SIZES = st.integers(min_value=0, max_value=200 * 2**30)


@settings(max_examples=300, deadline=None)
@given(req=SIZES, total=SIZES, free=SIZES, alloc=SIZES, unalloc=SIZES, this=SIZES, allowed=st.one_of(st.none(), SIZES),
       private=st.one_of(st.none(), SIZES), procs=st.lists(st.tuples(st.integers(1, 2**22), SIZES), max_size=4),
       typo=st.booleans(), gpu=st.integers(0, 15))
def test_generated_new_form_round_trips(req, total, free, alloc, unalloc, this, allowed, private, procs, typo, gpu):
    """Messages built from the 2.1+ format string parse back to PyTorch's printed numbers exactly."""
    fs = format_size
    text = (f"CUDA out of memory. Tried to allocate {fs(req)}. GPU {gpu} has a total {'capacty' if typo else 'capacity'} of "
            f"{fs(total)} of which {fs(free)} is free. "
            + "".join(f"Process {pid} has {fs(u)} memory in use. " for pid, u in procs)
            + f"Including non-PyTorch memory, this process has {fs(this)} memory in use. "
            + (f"{fs(allowed)} allowed; " if allowed is not None else "")
            + f"Of the allocated memory {fs(alloc)} is allocated by PyTorch, "
            + (f"with {fs(private)} allocated in private pools (e.g., CUDA Graphs), " if private is not None else "")
            + f"and {fs(unalloc)} is reserved by PyTorch but unallocated. If reserved but unallocated memory is large")
    m = parse_oom(text)

    def printed(n):
        num, unit = fs(n).split()
        return round(Fraction(num) * _UNIT[unit])

    assert (m.requested_bytes, m.total_capacity_bytes, m.free_bytes) == (printed(req), printed(total), printed(free))
    assert (m.allocated_by_pytorch_bytes, m.reserved_unallocated_bytes, m.this_process_bytes) == (printed(alloc), printed(unalloc), printed(this))
    assert m.allowed_bytes == (printed(allowed) if allowed is not None else None)
    assert m.private_pools_bytes == (printed(private) if private is not None else None)
    assert [(p.pid, p.used_bytes) for p in m.other_processes] == [(pid, printed(u)) for pid, u in procs]
    assert m.device_index == gpu
    assert diagnose(m).diagnosis in oom_mod.DIAGNOSES


GiB_ = 2**30


@settings(max_examples=400, deadline=None)
@given(total_gib=st.integers(8, 141), alloc=st.integers(0, 60 * GiB_), unalloc=st.integers(0, 8 * GiB_),
       ctx=st.integers(300 * 2**20, 1536 * 2**20), others=st.lists(st.integers(0, 40 * GiB_), max_size=3),
       driver=st.integers(0, 100 * 2**20), req=st.integers(2**20, 40 * GiB_), pids=st.permutations([101, 202, 303, 404]),
       order=st.integers(0, 3))
def test_container_form_gets_the_verdict_of_the_plain_form(total_gib, alloc, unalloc, ctx, others, driver, req, pids, order):
    """A world (this process = reserved + a context, other processes, free = the rest) printed twice:
    with the "this process" line, and as a PID namespace prints it (this process among the others under
    a PID that does not match). When no other process could pass for this one, the account must find
    it and the verdict must not change."""
    fs = format_size
    total = total_gib * GiB_
    mine = alloc + unalloc + ctx
    free = total - mine - sum(others) - driver
    if free < 0:
        return
    me, *other_pids = pids
    procs = list(zip(other_pids, others))
    tail = f"Of the allocated memory {fs(alloc)} is allocated by PyTorch, and {fs(unalloc)} is reserved by PyTorch but unallocated."
    head = f"CUDA out of memory. Tried to allocate {fs(req)}. GPU 0 has a total capacity of {fs(total)} of which {fs(free)} is free. "
    plain = head + "".join(f"Process {p} has {fs(u)} memory in use. " for p, u in procs) + \
        f"Including non-PyTorch memory, this process has {fs(mine)} memory in use. " + tail
    listed = procs[:]
    listed.insert(min(order, len(listed)), (me, mine))
    container = head + "".join(f"Process {p} has {fs(u)} memory in use. " for p, u in listed) + tail
    m_plain, m_box = parse_oom(plain), parse_oom(container)
    from memlens.doctor.account import SELF_MAX_NON_PYTORCH_BYTES
    reserved = m_box.reserved_by_pytorch_bytes
    lookalike = any(-64 * 2**20 <= parse_size(fs(u)) - reserved <= SELF_MAX_NON_PYTORCH_BYTES + 64 * 2**20
                    for _, u in procs)
    d_box = diagnose(m_box)
    assert d_box.diagnosis in oom_mod.DIAGNOSES
    if lookalike:
        return
    assert d_box.account.this_process_pid == me and d_box.account.this_process_source == "matched"
    assert d_box.account.other_processes_bytes == m_plain.other_processes_bytes
    assert d_box.diagnosis == diagnose(m_plain).diagnosis
    assert d_box.certain


@settings(max_examples=300, deadline=None)
@given(req=SIZES, total=SIZES, alloc=SIZES, free=SIZES, reserved=SIZES, allowed=st.one_of(st.none(), SIZES))
def test_generated_old_form_round_trips(req, total, alloc, free, reserved, allowed):
    fs = format_size
    text = (f"CUDA out of memory. Tried to allocate {fs(req)} (GPU 0; {fs(total)} total capacity; {fs(alloc)} already "
            f"allocated; {fs(free)} free; " + (f"{fs(allowed)} allowed; " if allowed is not None else "")
            + f"{fs(reserved)} reserved in total by PyTorch)")
    m = parse_oom(text)
    assert m.form == "torch<=2.0"
    assert m.requested_bytes == parse_size(fs(req)) and m.total_capacity_bytes == parse_size(fs(total))
    assert m.reserved_unallocated_bytes == max(0, parse_size(fs(reserved)) - parse_size(fs(alloc)))
    assert diagnose(m).diagnosis in oom_mod.DIAGNOSES


def _only_memlens_errors(text):
    try:
        r = diagnose_oom(text)
    except MemlensError as e:
        assert e.message and e.hint
        return
    assert r.data["diagnosis"] in oom_mod.DIAGNOSES
    json.dumps(r.to_dict())


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_fuzz_any_text(text):
    _only_memlens_errors(text)


@settings(max_examples=500, deadline=None)
@given(idx=st.integers(0, len(CORPUS) - 1), cut=st.integers(0, 2000), junk=st.text(max_size=30), pos=st.integers(0, 2000))
def test_fuzz_truncated_and_corrupted_real_messages(idx, cut, junk, pos):
    text = CORPUS[idx]["text"][:cut]
    text = text[:pos] + junk + text[pos:]
    _only_memlens_errors(text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([
    "CUDA", "out of memory.", "Tried to allocate", "1.00 GiB", "99999999999999999999.99 GiB", "(GPU", "0;", "GPU 0 has a total",
    "capacity of", "of which", "is free.", "Process", "-1", "has", "memory in use.", "allowed;", "Of the allocated memory",
    "is allocated by PyTorch,", "and", "is reserved by PyTorch but unallocated.", "reserved in total by PyTorch)", "MPS backend",
    "(MPS allocated:", "GB,", "other allocations:", "max allowed:", "GB).", "\n", "0 bytes", "1e400 GiB", "nan MiB",
]), max_size=40))
def test_fuzz_shuffled_message_pieces(pieces):
    _only_memlens_errors(" ".join(pieces))


def test_huge_numbers_do_not_overflow():
    r = diagnose_oom("CUDA out of memory. Tried to allocate 99999999999999999999.99 GiB (GPU 0; 1.00 GiB total capacity; "
                     "0 bytes already allocated; 1.00 GiB free; 0 bytes reserved in total by PyTorch)")
    assert r.data["requested_bytes"] == round(Fraction("99999999999999999999.99") * 2**30)
    assert r.data["diagnosis"] == "capacity"


def test_no_side_effects_at_import():
    import importlib

    mod = importlib.reload(oom_mod)
    assert "torch" not in re.findall(r"^import (\w+)", open(mod.__file__).read(), re.M)
