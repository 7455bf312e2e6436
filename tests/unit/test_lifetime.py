"""How a child process lives and ends (relax_core/cluster/lifetime.py: `Child`), with real processes.

The children are small Python programs: one that starts a grandchild (in its process group, as SGLang's
server starts its scheduler) and then ignores SIGTERM, waits, or ends at once with a given code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_core.cluster.lifetime import Child

PROGRAM = """
import signal, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(grandchild.pid, flush=True)
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[1].startswith("exit"):
    sys.exit(int(sys.argv[1][4:]))
time.sleep(600)
"""


def start(mode: str, log: Path, **kwargs) -> tuple[Child, int]:
    """A `Child` running PROGRAM in `mode`, and its grandchild's PID (once it has started)."""
    child = Child([sys.executable, "-c", PROGRAM, mode], log=log, **kwargs)
    deadline = time.monotonic() + 30
    while not log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    return child, int(log.read_text().split()[0])


def alive(pid: int) -> bool:
    """Running (a zombie is not: it waits to be reaped by whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_child_that_ignores_sigterm_is_killed_with_its_group_after_the_grace(tmp_path):
    child, grandchild = start("stubborn", tmp_path / "log")
    began = time.monotonic()
    assert child.stop(grace_s=1.0) == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - began < 10
    assert not alive(child.pid) and gone(grandchild)  # the grandchild, in its group, went too
    assert child.stop() == -signal.SIGKILL and child.returncode == -signal.SIGKILL  # idempotent


def test_a_child_that_ends_on_sigterm_is_not_waited_for_longer(tmp_path):
    child, grandchild = start("wait", tmp_path / "log")
    began = time.monotonic()
    assert child.stop(grace_s=30) == -signal.SIGTERM
    assert time.monotonic() - began < 10 and gone(grandchild)


def test_its_exit_status_is_reported_and_it_stays_ours_until_stopped(tmp_path):
    child, grandchild = start("exit3", tmp_path / "log")
    assert child.wait(timeout=30) == 3 and child.poll() == 3 and child.returncode == 3
    assert Path(f"/proc/{child.pid}/stat").exists()  # not reaped: its PID, the group's id, is not reused
    assert alive(grandchild)  # the grandchild outlived it, as SGLang's scheduler may outlive its server
    assert child.stop() == 3
    assert gone(grandchild) and not Path(f"/proc/{child.pid}/stat").exists()


def test_wait_times_out_as_popen_does(tmp_path):
    child, _ = start("wait", tmp_path / "log")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.2)
        assert child.poll() is None and child.returncode is None
    finally:
        child.stop(grace_s=0)
    assert child.returncode == -signal.SIGKILL  # grace 0: SIGKILL at once


def test_its_output_is_appended_to_its_log_and_each_start_reads_its_own(tmp_path):
    log = tmp_path / "log"
    log.write_text("an earlier start\n")
    child = Child([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"], log=log,
                  log_mode=0o600)
    child.wait(timeout=30)
    child.stop()
    assert log.read_text() == "an earlier start\nout\nerr\n"
    assert child.output() == "out\nerr\n"
    fresh = Child([sys.executable, "-c", "pass"], log=tmp_path / "private", log_mode=0o600)
    fresh.stop()
    assert (tmp_path / "private").stat().st_mode & 0o777 == 0o600  # a server that logs its API key


def test_it_runs_in_a_session_of_its_own_unless_told_to_stay_in_ours(tmp_path):
    own, _ = start("wait", tmp_path / "own")
    ours, grandchild = start("wait", tmp_path / "ours", own_session=False)
    try:
        assert os.getsid(own.pid) == own.pid and os.getpgid(own.pid) == own.pid
        assert os.getpgid(ours.pid) == os.getpgid(0)
    finally:
        own.stop()
        assert ours.stop() == -signal.SIGTERM
        assert alive(grandchild)  # signalled alone: our own group (the grandchild's) got nothing
        os.kill(grandchild, signal.SIGKILL)


PARENT = """
import os, sys
from relax_core.cluster.lifetime import Child
core = min(os.sched_getaffinity(0))
child = Child([sys.executable, "-c", "import time; time.sleep(600)"], die_with_parent=True, cpus=[core])
print(child.pid, core, flush=True)
sys.stdin.read()
"""


def test_a_child_that_dies_with_its_parent_dies_when_the_parent_is_killed():
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        pid, core = map(int, parent.stdout.readline().split())
        assert os.sched_getaffinity(pid) == {core}
        parent.kill()  # SIGKILL: no clean-up code runs
    finally:
        parent.wait()
    assert gone(pid), "the child outlived its killed parent"
