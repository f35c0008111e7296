"""A failed torchrun job's one-line error names why it failed, not torchrun's summary rule."""
from memlens.measure.launch import why_torchrun_failed

# torchrun's own summary after a rank was killed (torch/distributed/elastic/multiprocessing/errors: ChildFailedError)
KILLED = """W1128 00:11:02.123000 4321 torch/distributed/elastic/multiprocessing/api.py:908] Sending process 4401 closing signal SIGTERM
E1128 00:11:02.456000 4321 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: -9) local_rank: 1 (pid: 4402) of binary: /usr/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
memlens.measure.worker FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_00:11:02
  host      : ci
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4402)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4402
============================================================
"""


def test_a_killed_rank_is_named_by_torchruns_root_cause_not_its_rule():
    assert why_torchrun_failed(KILLED) == "rank 1 (local_rank: 1): exitcode -9 (pid: 4402); Signal 9 (SIGKILL) received by PID 4402"


def test_a_ranks_own_exception_wins_over_the_summary():
    err = "Traceback (most recent call last):\n  File \"w.py\", line 3\nRuntimeError: Connection closed by peer\n" + KILLED
    assert why_torchrun_failed(err) == "RuntimeError: Connection closed by peer"


def test_without_a_summary_the_last_line_that_is_not_a_rule():
    assert why_torchrun_failed("starting\nsomething odd happened\n=========\n") == "something odd happened"
    assert why_torchrun_failed("") == ""
