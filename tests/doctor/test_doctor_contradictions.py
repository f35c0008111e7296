"""doctor refuses what cannot be one GPU's numbers, calls a message without numbers `unknown`, and names falling
memory (issue 34, item 4)."""
import pytest

from memlens.cli.main import main
from memlens.core.errors import MemlensError
from memlens.doctor.log import doctor_log
from memlens.doctor.oom import diagnose_oom

CONTRADICTORY = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which 1.00 "
                 "GiB is free. Including non-PyTorch memory, this process has 40.00 GiB memory in use. Of the allocated "
                 "memory 60.00 GiB is allocated by PyTorch, and 2.00 GiB is reserved by PyTorch but unallocated.")


def test_a_process_total_below_its_allocated_figure_is_refused(capsys, tmp_path):
    with pytest.raises(MemlensError) as e:
        diagnose_oom(CONTRADICTORY)
    assert e.value.message == ("the OOM message says this process has 40.00 GiB in use but PyTorch alone has allocated "
                               "60.00 GiB: a process holds at least what its allocator allocated and reserved")
    f = tmp_path / "oom.txt"
    f.write_text(CONTRADICTORY)
    assert main(["doctor", "oom", str(f)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ERROR: " + e.value.message + "  HINT: paste the message exactly as PyTorch printed it (its numbers look edited "
        "or taken from two messages)"]


def test_a_process_total_below_reserved_is_refused_and_rounding_is_not():
    reserved_above = CONTRADICTORY.replace("this process has 40.00 GiB", "this process has 61.00 GiB")
    with pytest.raises(MemlensError) as e:
        diagnose_oom(reserved_above)
    assert "this process has 61.00 GiB in use but PyTorch alone has reserved 62.00 GiB" in e.value.message
    # PyTorch rounds each figure to two decimals: a total equal to reserved within that is one message
    ok = CONTRADICTORY.replace("this process has 40.00 GiB", "this process has 61.99 GiB")
    assert diagnose_oom(ok).data.diagnosis != "unknown"


@pytest.mark.parametrize("text, reason", [
    ("torch.OutOfMemoryError: CUDA out of memory.",
     "the message has no numbers: nothing in it says what holds the GPU (PyTorch prints its figures after 'Tried to "
     "allocate ...': was the message cut?)"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
     "the message has no numbers beyond the 2.00 GiB requested: nothing in it says what holds the GPU (PyTorch prints "
     "its figures after 'Tried to allocate ...': was the message cut?)"),
    ("RuntimeError: CUDA error: out of memory",
     "CUDA itself ran out of memory outside PyTorch's allocator (the message has no numbers)"),
])
def test_a_message_without_numbers_is_unknown(text, reason):
    d = diagnose_oom(text).data
    assert d.diagnosis == "unknown" and d.certain is False
    assert d.reasons[0] == reason


def _log(values_gb):
    return "\n".join(f"Step {100 * (i + 1)}: Memory={v}GB" for i, v in enumerate(values_gb))


@pytest.mark.parametrize("values, pattern", [
    ([13.0, 12.1, 11.0, 10.2, 9.1, 8.3, 7.45], "falling"),     # still falling at the end
    ([13.0, 13.0, 13.0, 7.45, 7.45, 7.45, 7.45], "dropped"),   # fell once, then level
])
def test_falling_memory_is_named(values, pattern, capsys, tmp_path):
    d = doctor_log(_log(values)).data
    assert (d.verdict, d.pattern) == ("falling", pattern)
    assert d.first_bytes == 13 * 10**9 and d.last_bytes == int(7.45 * 10**9)
    assert d.causes[0].startswith("Not a leak: memory f")
    f = tmp_path / "train.log"
    f.write_text(_log(values))
    assert main(["doctor", "log", str(f)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"FALLING ({pattern}) over 7 readings of 'Memory' (lines)"


def test_flat_and_rising_memory_are_still_steady_and_leak():
    assert doctor_log(_log([7.45] * 7)).data.verdict == "steady"
    assert doctor_log(_log([7.45, 8.3, 9.1, 10.2, 11.0, 12.1, 13.0])).data.verdict == "leak"
