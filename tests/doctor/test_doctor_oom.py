"""`doctor oom`: every message form parsed exactly, diagnosed, advised; the spec path; bad input; fuzzing.

The corpus follows PyTorch's format strings (c10/cuda/CUDACachingAllocator.cpp of 2.0 and 2.1+,
c10/xpu/XPUCachingAllocator.cpp, the MPS allocator) and holds messages seen in the wild: the seed
notebook's (verbatim, tests/fixtures/doctor/seed_000_oom.txt), the seed guide's exercise 9.2, and a
2.0 message quoted in a public repository. GPU-captured ones are in test_doctor_gpu_fixtures.py.
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
from memlens.doctor.oom import diagnose, diagnose_oom, find_oom_messages, parse_oom, what_fits
from memlens.core.errors import MemlensError
from memlens.report.result import Result
from memlens.core.spec import TrainingSpec

from doctor_support import FIXTURES, format_size

_UNIT = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def b(text: str) -> int:
    """'15.57 GiB' -> bytes, rounded half-even (independent of memlens' parser)."""
    num, unit = text.split()
    return round(Fraction(num) * _UNIT[unit])


SEED_000 = (FIXTURES / "seed_000_oom.txt").read_text()

CORPUS = [
    # id, text, expected fields (None: absent from the message), diagnosis
    ("seed_000_two_other_processes", SEED_000, dict(
        form="torch>=2.1", device_type="cuda", device_index=0, requested_bytes=16777216,
        total_capacity_bytes=16718160200, free_bytes=b("23.06 MiB"), allowed_bytes=None,
        allocated_by_pytorch_bytes=b("413.55 MiB"), reserved_unallocated_bytes=b("12.45 MiB"),
        this_process_bytes=b("510.00 MiB"), private_pools_bytes=None,
        other_processes=[(3859131, b("12.57 GiB")), (3880458, b("2.10 GiB"))]), "other_processes"),
    ("seed_003_exercise_9_2_wrapped", "RuntimeError: CUDA out of memory. Tried to allocate 2.50 GiB \n"
     "(GPU 0; 23.69 GiB total capacity; 21.45 GiB already allocated; \n1.89 GiB free; 21.50 GiB reserved in total by PyTorch)",
     dict(form="torch<=2.0", device_type="cuda", device_index=0, requested_bytes=2684354560,
          total_capacity_bytes=25436943811, free_bytes=b("1.89 GiB"), allowed_bytes=None,
          allocated_by_pytorch_bytes=b("21.45 GiB"), reserved_unallocated_bytes=b("21.50 GiB") - b("21.45 GiB"),
          this_process_bytes=None, other_processes=[]), "capacity"),
    ("torch_2_0_public", "RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; "
     "130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) If reserved memory is >> "
     "allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management "
     "and PYTORCH_CUDA_ALLOC_CONF",
     dict(form="torch<=2.0", requested_bytes=b("36.00 MiB"), total_capacity_bytes=b("7.93 GiB"), free_bytes=b("47.06 MiB"),
          allocated_by_pytorch_bytes=b("130.35 MiB"), reserved_unallocated_bytes=b("188.00 MiB") - b("130.35 MiB")),
     "fragmentation"),
    ("torch_2_0_allowed", "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB (GPU 1; 39.39 GiB "
     "total capacity; 17.50 GiB already allocated; 20.88 GiB free; 19.69 GiB allowed; 17.52 GiB reserved in total by PyTorch)",
     dict(form="torch<=2.0", device_index=1, requested_bytes=4 * 2**30, allowed_bytes=b("19.69 GiB"),
          reserved_unallocated_bytes=b("17.52 GiB") - b("17.50 GiB")), "memory_fraction_limit"),
    ("torch_2_1_0_capacty_typo", "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
     "total capacty of 7.79 GiB of which 1024 bytes is free. Process 2310 has 3.00 GiB memory in use. Including non-PyTorch "
     "memory, this process has 4.78 GiB memory in use. Of the allocated memory 4.51 GiB is allocated by PyTorch, and "
     "102.94 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
     "max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
     dict(form="torch>=2.1", requested_bytes=20 * 2**20, total_capacity_bytes=b("7.79 GiB"), free_bytes=1024,
          allocated_by_pytorch_bytes=b("4.51 GiB"), reserved_unallocated_bytes=b("102.94 MiB"),
          this_process_bytes=b("4.78 GiB"), other_processes=[(2310, 3 * 2**30)]), "other_processes"),
    ("torch_2_4_allowed_private_pools", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 10.00 GiB. GPU 0 has a "
     "total capacity of 79.10 GiB of which 45.20 GiB is free. Including non-PyTorch memory, this process has 33.89 GiB memory "
     "in use. 39.55 GiB allowed; Of the allocated memory 32.50 GiB is allocated by PyTorch, with 2.00 GiB allocated in "
     "private pools (e.g., CUDA Graphs), and 857.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
     "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
     "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
     dict(form="torch>=2.1", requested_bytes=10 * 2**30, allowed_bytes=b("39.55 GiB"), private_pools_bytes=2 * 2**30,
          allocated_by_pytorch_bytes=b("32.50 GiB"), reserved_unallocated_bytes=b("857.00 MiB"),
          this_process_bytes=b("33.89 GiB"), other_processes=[]), "memory_fraction_limit"),
    ("torch_2_1_fragmentation_kib", "CUDA out of memory. Tried to allocate 128.00 MiB. GPU 0 has a total capacity of 23.65 GiB "
     "of which 3.50 KiB is free. Including non-PyTorch memory, this process has 23.64 GiB memory in use. Of the allocated "
     "memory 11.20 GiB is allocated by PyTorch, and 11.90 GiB is reserved by PyTorch but unallocated.",
     dict(requested_bytes=128 * 2**20, free_bytes=3584, reserved_unallocated_bytes=b("11.90 GiB")), "fragmentation"),
    ("torch_2_1_zero_bytes", "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 3 has a total capacity of 14.75 GiB of "
     "which 0 bytes is free. Of the allocated memory 14.10 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch "
     "but unallocated.",
     dict(device_index=3, requested_bytes=2 * 2**20, free_bytes=0, reserved_unallocated_bytes=0, this_process_bytes=None),
     "capacity"),
    ("hip", "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of 63.98 GiB of "
     "which 1.21 GiB is free. Of the allocated memory 61.20 GiB is allocated by PyTorch, and 1.02 GiB is reserved by "
     "PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_HIP_ALLOC_CONF=expandable_segments:True",
     dict(device_type="hip", requested_bytes=b("1.95 GiB"), free_bytes=b("1.21 GiB")), "fragmentation"),
    ("xpu_old_no_free", "XPU out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 64.00 GiB. Of the "
     "allocated memory 62.50 GiB is allocated by PyTorch, and 512.00 MiB is reserved by PyTorch but unallocated. Please use "
     "`empty_cache` to release all unoccupied cached memory.",
     dict(form="torch>=2.1", device_type="xpu", requested_bytes=2**30, total_capacity_bytes=64 * 2**30, free_bytes=None,
          allocated_by_pytorch_bytes=b("62.50 GiB"), reserved_unallocated_bytes=512 * 2**20), "capacity"),
    ("xpu_new_allowed", "XPU out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 48.00 GiB of which "
     "30.00 GiB is free. 24.00 GiB allowed; Of the allocated memory 18.00 GiB is allocated by PyTorch, and 0 bytes is "
     "reserved by PyTorch but unallocated. Please use `empty_cache` to release all unoccupied cached memory.",
     dict(device_type="xpu", allowed_bytes=24 * 2**30, free_bytes=30 * 2**30), "memory_fraction_limit"),
    ("generic_out_of_memory", "torch.OutOfMemoryError: Out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity "
     "of 79.19 GiB of which 2.06 GiB is free. Including non-PyTorch memory, this process has 77.12 GiB memory in use. Of the "
     "allocated memory 74.00 GiB is allocated by PyTorch, and 2.50 GiB is reserved by PyTorch but unallocated.",
     dict(device_type=None, requested_bytes=4 * 2**30, reserved_unallocated_bytes=b("2.50 GiB")), "fragmentation"),
    ("mps_watermark", "RuntimeError: MPS backend out of memory (MPS allocated: 18.04 GB, other allocations: 7.27 MB, max "
     "allowed: 18.13 GB). Tried to allocate 256.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable "
     "upper limit for memory allocations (may cause system failure).",
     dict(form="mps", device_type="mps", requested_bytes=256 * 2**20, allocated_by_pytorch_bytes=b("18.04 GiB"),
          mps_other_allocations_bytes=b("7.27 MiB"), allowed_bytes=b("18.13 GiB")), "memory_fraction_limit"),
    ("cuda_error_no_numbers", "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported "
     "at some other API call, so the stacktrace below might be incorrect.",
     dict(form="cuda_error", requested_bytes=None, total_capacity_bytes=None), "capacity"),
]


@pytest.mark.parametrize("name,text,expected,diagnosis", CORPUS, ids=[c[0] for c in CORPUS])
def test_corpus_parsed_exactly_and_diagnosed(name, text, expected, diagnosis):
    msg = parse_oom(text)
    for key, want in expected.items():
        got = msg.other_processes if key == "other_processes" else getattr(msg, key)
        if key == "other_processes":
            got = [(p.pid, p.used_bytes) for p in got]
        assert got == want, f"{name}: {key}"
    assert diagnose(msg).diagnosis == diagnosis


def test_reserved_adds_up_in_both_forms():
    new = parse_oom(CORPUS[5][1])  # allocated 32.50 GiB (includes 2 GiB private pools) + 857 MiB unallocated
    assert new.reserved_by_pytorch_bytes == b("32.50 GiB") + b("857.00 MiB")
    assert new.non_pytorch_bytes == b("33.89 GiB") - new.reserved_by_pytorch_bytes
    old = parse_oom(CORPUS[1][1])
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
    log = ("[rank0]: " + CORPUS[6][1] + "\nretrying with a smaller batch\n[rank0]: " + CORPUS[7][1])
    msgs = find_oom_messages(log)
    assert [m.requested_bytes for m in msgs] == [128 * 2**20, 2 * 2**20]
    r = diagnose_oom(log)
    assert r.data["requested_bytes"] == 2 * 2**20 and r.data["messages_found"] == 2
    assert r.notes == ["2 OOM messages found; the last one is diagnosed"]


def test_message_text_is_cut_before_pytorch_advice():
    assert parse_oom(CORPUS[2][1]).message.endswith("188.00 MiB reserved in total by PyTorch)")


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
    advice = diagnose(parse_oom(CORPUS[1][1])).advice
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
    # baseline 2+2+4+16 = 24 GiB; checkpointing: 2+2+4+4 = 12 GiB (x 1.1 pressed) fits in 16 GiB less the 5% margin
    assert by["checkpointing"].peak_allocated_bytes == 12 * 2**30 and by["checkpointing"].fits
    assert by["halve micro-batch, double accumulation"].peak_allocated_bytes == 16 * 2**30
    assert not by["halve micro-batch, double accumulation"].fits  # 16 GiB > 15.2 GiB
    assert by["halve micro-batch, double accumulation"].changes == {"batch_size": 8, "grad_accum": 2}
    combined = [o for o in opts if " + " in o.name]
    assert combined and combined[-1].fits and combined[-1].name == "halve micro-batch, double accumulation + checkpointing"


def test_doctor_oom_with_spec_cli(monkeypatch, capsys):
    monkeypatch.setattr(oom_mod, "_run_estimate", _fake_estimate)
    rc = main(["doctor", "oom", CORPUS[1][1], "--model", "gpt2", "--batch-size", "16", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    est = d["estimate"]
    assert est["dominant_category"] == "activations" and est["dominant_category_bytes"] == 16 * 2**30
    assert est["estimated_peak_allocated_bytes"] == 24 * 2**30 and est["fits"] is False
    assert est["budget_bytes"] == b("23.69 GiB")
    assert any(o["fits"] for o in est["fit_options"])
    assert d["spec"]["batch_size"] == 16


def test_doctor_oom_with_spec_renders_table(monkeypatch, capsys):
    monkeypatch.setattr(oom_mod, "_run_estimate", _fake_estimate)
    assert main(["doctor", "oom", CORPUS[1][1], "--model", "gpt2", "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "activations (dominant)" in out and "what would fit" in out and "Diagnosis: capacity" in out


def test_budget_subtracts_other_processes_and_non_pytorch_memory():
    msg = parse_oom(SEED_000)
    expected = msg.total_capacity_bytes - msg.other_processes_bytes - msg.non_pytorch_bytes
    assert oom_mod.budget_bytes(msg) == expected
    assert oom_mod.budget_bytes(parse_oom(CORPUS[5][1])) == b("39.55 GiB") - parse_oom(CORPUS[5][1]).non_pytorch_bytes


def test_estimator_missing_is_one_clear_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "memlens.estimator", None)
    assert main(["doctor", "oom", CORPUS[1][1], "--model", "gpt2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ERROR: the estimator is not available") and "\n" not in err


# ---------------------------------------------------------------- CLI input paths

def test_cli_json_keys(capsys):
    assert main(["doctor", "oom", SEED_000, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verb"] == "doctor.oom" and d["schema_version"] == "1"
    for k in ("requested_bytes", "total_capacity_bytes", "free_bytes", "allocated_by_pytorch_bytes",
              "reserved_unallocated_bytes", "other_processes", "diagnosis", "advice"):
        assert k in d
    assert d["other_processes"] == [{"pid": 3859131, "used_bytes": b("12.57 GiB")}, {"pid": 3880458, "used_bytes": b("2.10 GiB")}]


def test_cli_reads_a_file_and_writes_out(tmp_path, capsys):
    f = tmp_path / "crash.log"
    f.write_text("Traceback (most recent call last):\n  File 'train.py', line 3\n" + CORPUS[2][1] + "\n")
    assert main(["doctor", "oom", str(f), "--out", str(tmp_path / "o")]) == 0
    assert "Diagnosis: fragmentation" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "result.json").read_text())["diagnosis"] == "fragmentation"


def test_cli_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(CORPUS[3][1]))
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

    r = subprocess.run([sys.executable, "-m", "memlens.cli.doctor", "oom", CORPUS[1][1], "--json"],
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


@settings(max_examples=300, deadline=None)
@given(req=SIZES, total=SIZES, alloc=SIZES, free=SIZES, reserved=SIZES, allowed=st.one_of(st.none(), SIZES))
def test_generated_old_form_round_trips(req, total, alloc, free, reserved, allowed):
    fs = format_size
    text = (f"CUDA out of memory. Tried to allocate {fs(req)} (GPU 0; {fs(total)} total capacity; {fs(alloc)} already "
            f"allocated; {fs(free)} free; " + (f"{fs(allowed)} allowed; " if allowed is not None else "")
            + f"{fs(reserved)} reserved in total by PyTorch)")
    m = parse_oom(text)
    assert m.form == "torch<=2.0"
    assert m.requested_bytes == oom_mod.parse_size(fs(req)) and m.total_capacity_bytes == oom_mod.parse_size(fs(total))
    assert m.reserved_unallocated_bytes == max(0, oom_mod.parse_size(fs(reserved)) - oom_mod.parse_size(fs(alloc)))
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
    text = CORPUS[idx][1][:cut]
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
