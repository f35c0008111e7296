"""Ctrl-C and kill end `memlens fit` and every worker process it forked, with one line on stderr."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc; workers are forks")]


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (the CLI and the workers it forked)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getsid(int(d)) == sid:
                    out.append(int(d))
            except OSError:
                pass
    return out


def _wait(pred, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.2)
    return pred()


@pytest.mark.parametrize("sig, to_group, code, line", [
    (signal.SIGINT, True, 130, "ERROR: interrupted (Ctrl-C)"),      # a terminal's Ctrl-C reaches every process of the group
    (signal.SIGTERM, False, 143, "ERROR: terminated (SIGTERM)"),    # `kill PID` reaches the CLI alone
])
def test_fit_ends_with_its_workers_in_one_line(sig, to_group, code, line):
    env = dict(os.environ, MEMLENS_WORKERS="2", PYTHONPATH=os.getcwd())
    p = subprocess.Popen([sys.executable, "-m", "memlens.cli.main", "fit", "--model", "gpt2", "--seq-len", "256",
                          "--budget", "16GiB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         start_new_session=True)
    try:
        assert _wait(lambda: len(_session(p.pid)) >= 3, 90), "the workers never started"
        time.sleep(1.0)                             # inside a simulation
        (os.killpg if to_group else os.kill)(p.pid, sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == code
    assert err.decode().splitlines() == [line]
    assert _wait(lambda: not _session(p.pid), 10), f"left running: {_session(p.pid)}"


def test_workers_end_themselves_when_fit_is_killed():
    env = dict(os.environ, MEMLENS_WORKERS="2", PYTHONPATH=os.getcwd())
    p = subprocess.Popen([sys.executable, "-m", "memlens.cli.main", "fit", "--model", "gpt2", "--seq-len", "256",
                          "--budget", "16GiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                         start_new_session=True)
    try:
        assert _wait(lambda: len(_session(p.pid)) >= 3, 90), "the workers never started"
        os.kill(p.pid, signal.SIGKILL)              # no handler runs: the workers see their parent gone
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert _wait(lambda: not _session(p.pid), 20), f"left running: {_session(p.pid)}"
