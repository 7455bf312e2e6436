"""Every process a run starts dies with the process that started it, however that one dies.

A driver killed with SIGKILL runs no clean-up code, so both mechanisms here are
set up in advance:

- `die_with_parent`, the `preexec_fn` of every child we start ourselves (the
  router, each engine server): the kernel sends the child SIGKILL when its
  parent dies (PR_SET_PDEATHSIG). The parent is the thread that forked, so the
  caller must start children from a thread that lives as long as they should
  (the driver's and the actor's main threads do).
- `Reaper`, for a local Ray cluster: `ray.init` ties the GCS and the raylet to
  the driver the same way, but the raylet's children (the dashboard agent and
  the runtime-env agent) outlive a killed raylet by up to a minute: they try to
  report its death to the dead GCS, with a 60 s timeout (Ray 2.60,
  `ray._private.utils.publish_error_to_driver`). The reaper, a small process of
  its own, watches the driver; when the driver ends without saying goodbye it
  kills, by PID, every process of the cluster: the driver's descendants as it
  last saw them (it looks every `SNAPSHOT_S`; after the driver's death they
  belong to init), and every process whose environment carries the cluster's
  mark (`MARK_ENV`, inherited from the driver; Ray's agents overwrite theirs
  with their process title, hence the snapshots).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

MARK_ENV = "RELAX_LOCAL_CLUSTER"
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child of a threaded parent must not load it
_GOODBYE = b"done\n"
SNAPSHOT_S = 1.0


def die_with_parent(parent_pid: int) -> None:
    """In a freshly forked child (before exec): get SIGKILL when the parent dies.

    The parent may have died between fork and prctl, when the child was
    already adopted by another process: then it ends at once.
    """
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def child_of_this_process():
    """A `preexec_fn` that ties the child to the calling process."""
    parent = os.getpid()
    return lambda: die_with_parent(parent)


class Reaper:
    """A watcher process that kills what carries `mark` once this process ends without `close()`."""

    def __init__(self, mark: str):
        os.environ[MARK_ENV] = mark  # before anything is started: every child inherits it
        env = {k: v for k, v in os.environ.items() if k != MARK_ENV}  # the reaper must not reap itself
        self.proc = subprocess.Popen([sys.executable, "-m", "relax_core.cluster.lifetime", mark, str(os.getpid())],
                                     stdin=subprocess.PIPE, env=env, start_new_session=True)

    def close(self) -> None:
        """Everything was stopped cleanly: the reaper leaves without killing anything."""
        try:
            self.proc.stdin.write(_GOODBYE)
            self.proc.stdin.close()
        except OSError:  # it is already gone
            pass
        self.proc.wait(timeout=10)


def marked(mark: str) -> dict[int, str]:
    """This user's processes whose (initial) environment has `MARK_ENV=mark`, with their start times."""
    needle = f"{MARK_ENV}={mark}".encode()
    return {pid: started for pid, (_, started) in _processes().items()
            if needle in _read(f"/proc/{pid}/environ").split(b"\0")}


def descendants(root: int) -> dict[int, str]:
    """The processes below `root`, with their start times."""
    table = _processes()
    found, todo = {}, [root]
    while todo:
        parent = todo.pop()
        children = [pid for pid, (ppid, _) in table.items() if ppid == parent and pid not in found]
        found |= {pid: table[pid][1] for pid in children}
        todo += children
    return found


def reap(processes: dict[int, str], rounds: int = 3) -> None:
    """SIGKILL each of `processes` that is still the same process, a few rounds apart."""
    for _ in range(rounds):
        now = _processes()
        for pid, started in processes.items():
            if pid != os.getpid() and now.get(pid, (0, None))[1] == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.2)


def watch(mark: str, driver_pid: int) -> None:
    """The reaper's body: until the driver says goodbye or ends, note its descendants; then reap."""
    stdin, seen = sys.stdin.buffer, {}
    try:
        driver = os.pidfd_open(driver_pid)
    except ProcessLookupError:  # it died before we looked
        return reap(marked(mark))
    while True:
        ready, _, _ = select.select([stdin, driver], [], [], SNAPSHOT_S)
        if stdin in ready and stdin.readline() == _GOODBYE:
            return
        if ready:  # the driver ended, or closed the pipe without a goodbye (it is ending)
            return reap(seen | descendants(driver_pid) | marked(mark))
        seen |= descendants(driver_pid)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process now."""
    table = {}
    for entry in Path("/proc").iterdir():
        stat = _read(f"/proc/{entry.name}/stat").decode(errors="replace") if entry.name.isdigit() else ""
        if stat:
            fields = stat.rsplit(")", 1)[1].split()
            table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # ended meanwhile, or another user's
        return b""


if __name__ == "__main__":
    watch(sys.argv[1], int(sys.argv[2]))
