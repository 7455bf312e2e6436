"""Every process a run starts dies with the process that started it, however that one dies.

Every child Relax starts is a `Child` (engine servers, the router, Slurm's
steps, agent programs, reward and tool workers, `ray start` on a node, the
reaper below): started in a session of its own, so that a Ctrl-C meant for
its parent does not reach it and its own children are in its process group
(`ray start` stays in its parent's, where Slurm's signals reach it);
stopped with SIGTERM to that group, a grace time, then SIGKILL to whatever of
the group is left; its exit seen without reaping it, so that its PID (the
group's id) cannot pass to another process before `stop` is done with it.

A driver killed with SIGKILL runs no clean-up code, so two mechanisms here are
set up in advance:

- `die_with_parent` (`Child(..., die_with_parent=True)`: the router, each
  engine server, `ray start`): the kernel sends the child SIGKILL when its
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
import threading
import time
from collections.abc import Sequence
from pathlib import Path

MARK_ENV = "RELAX_LOCAL_CLUSTER"
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child of a threaded parent must not load it
_GOODBYE = b"done\n"
SNAPSHOT_S = 1.0
STOP_GRACE_S = 20.0  # SIGTERM to SIGKILL (within the 30 s `end_actors` gives an actor's `stop`, Slurm's KillWait)


def die_with_parent(parent_pid: int) -> None:
    """In a freshly forked child (before exec): get SIGKILL when the parent dies.

    The parent may have died between fork and prctl, when the child was
    already adopted by another process: then it ends at once.
    """
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


class Child:
    """A process Relax started, from its start to its reaping; `stop` it at the end, also once it has ended.

    Until `stop` reaps it, its exit is only looked at (`poll`, `wait`): its PID, and so the id of its process
    group, stays its own, so that the signals of `stop` reach only what we started.

    Args:
        argv: its command line.
        log: where its stdout and stderr go, appended to (created with `log_mode`); `output` reads what this
            start wrote there.
        log_mode: the permissions a new log gets (0o600: a server that logs its API key).
        env, cwd, stdin, stdout, pass_fds, close_fds: as `subprocess.Popen`'s.
        own_session: start it in a session (and process group) of its own, which `stop` signals as a whole;
            False: it stays in ours and `stop` signals it alone.
        die_with_parent: it gets SIGKILL when this process (the calling thread: see the module) dies.
        cpus: the cores it runs on (None: ours).
    """

    def __init__(self, argv: list[str], *, log: str | os.PathLike | None = None, log_mode: int = 0o666,
                 env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None, stdin=None, stdout=None,
                 pass_fds: Sequence[int] = (), close_fds: bool = True, own_session: bool = True,
                 die_with_parent: bool = False, cpus: Sequence[int] | None = None):
        self.own_session, self.log, self.log_start = own_session, log, 0
        self.returncode: int | None = None
        preexec = _preexec(os.getpid() if die_with_parent else None, cpus)
        out = open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, log_mode), "ab") if log else None
        try:
            self.log_start = out.seek(0, os.SEEK_END) if out else 0
            self._popen = subprocess.Popen(argv, stdin=stdin, stdout=out or stdout,
                                           stderr=subprocess.STDOUT if out else None, env=env, cwd=cwd,
                                           pass_fds=pass_fds, close_fds=close_fds, start_new_session=own_session,
                                           preexec_fn=preexec)
        finally:
            if out:
                out.close()  # the child holds its own copy
        self.pid, self.stdin, self.stdout = self._popen.pid, self._popen.stdin, self._popen.stdout
        self._reaped = False
        self._stopping = threading.Lock()

    def poll(self) -> int | None:
        """Its exit code (minus the signal that ended it), or None while it runs."""
        return self._status(block=False)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code once it has ended; `subprocess.TimeoutExpired` past `timeout` seconds."""
        if timeout is None:
            return self._status(block=True)
        deadline, delay = time.monotonic() + timeout, 0.0005
        while self.poll() is None:  # Popen's own wait with a timeout polls the same way
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self._popen.args, timeout)
            delay = min(delay * 2, left, 0.05)
            time.sleep(delay)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """`signum` to it alone (not its group), while it is ours to signal."""
        if not self._reaped:
            os.kill(self.pid, signum)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM to its group (or to it alone, not `own_session`), up to `grace_s` for it to end, then SIGKILL
        to whatever is left of the group: its children may outlive it. `grace_s=0`: SIGKILL at once. Then reap
        it and close its pipes. Idempotent; returns its exit code."""
        with self._stopping:
            if not self._reaped:
                if grace_s > 0 and self.poll() is None:
                    self._signal(signal.SIGTERM)
                    try:
                        self.wait(grace_s)
                    except subprocess.TimeoutExpired:
                        pass
                self._signal(signal.SIGKILL)
                self.returncode = self._popen.wait()
                self._reaped = True
                for pipe in (self.stdin, self.stdout):
                    _close(pipe)
            return self.returncode

    def output(self) -> str:
        """What this start wrote to its log ("" without one)."""
        if not self.log:
            return ""
        try:
            with open(self.log, "rb") as log:
                log.seek(self.log_start)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def _status(self, block: bool) -> int | None:
        if self.returncode is None:
            flags = os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)
            try:
                ended = os.waitid(os.P_PID, self.pid, flags)
            except ChildProcessError:  # reaped by another hand (SIGCHLD ignored): Popen knows what to say
                self.returncode = self._popen.poll()
                return self.returncode
            if ended is not None:
                self.returncode = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
        return self.returncode

    def _signal(self, signum: int) -> None:
        try:
            if self.own_session:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)
        except (ProcessLookupError, PermissionError):  # nothing left; a member that changed its user is not ours
            pass


def _preexec(parent: int | None, cpus: Sequence[int] | None):
    """What runs in the child before exec: die with `parent`, run on `cpus` (None when neither is asked)."""
    if parent is None and not cpus:
        return None

    def before_exec() -> None:
        if parent is not None:
            die_with_parent(parent)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return before_exec


def _close(pipe) -> None:
    try:
        if pipe is not None:
            pipe.close()
    except OSError:  # the pipe broke with the process
        pass


class Reaper:
    """A watcher process that kills what carries `mark` once this process ends without `close()`."""

    def __init__(self, mark: str):
        os.environ[MARK_ENV] = mark  # before anything is started: every child inherits it
        env = {k: v for k, v in os.environ.items() if k != MARK_ENV}  # the reaper must not reap itself
        # not die_with_parent: it must outlive us
        self.proc = Child([sys.executable, "-m", "relax_core.cluster.lifetime", mark, str(os.getpid())],
                          stdin=subprocess.PIPE, env=env)

    def close(self) -> None:
        """Everything was stopped cleanly: the reaper leaves without killing anything."""
        try:
            self.proc.stdin.write(_GOODBYE)
            self.proc.stdin.close()
        except OSError:  # it is already gone
            pass
        self.proc.wait(timeout=10)
        self.proc.stop()


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
