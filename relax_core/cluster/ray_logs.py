"""A Ray node's own logs, kept in the run directory when the node ends.

Ray writes its logs (raylet, GCS, agents, each worker's output) under the
node's temp dir, on node-local disk that the cluster wipes after the job. The
node's entrypoint runs `ray start --block` as its child (signals it receives
are passed on), and when the child ends, normally or because Slurm stopped the
step with SIGTERM, copies `session_latest/logs` of that temp dir into
`<run>/logs/ray/<node>/<session>/` (a requeued job's or a scale-out's nodes
start sessions of their own).

The copy starts at most `STOP_GRACE_S` after a signal and is bounded, so it
ends within Slurm's KillWait (30 s by default) after the SIGTERM: each file
keeps at most its last `FILE_BYTES` (a first line says how much was left out),
and once `TOTAL_BYTES` are copied the files that remain are only named in
`SKIPPED.txt`. Smaller files go first.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from relax_core.cluster.lifetime import Child

FILE_BYTES = 10 * 1024**2
TOTAL_BYTES = 100 * 1024**2
STOP_GRACE_S = 2.0


def run_ray_node(command: list[str], env: dict[str, str], temp_dir: Path, logs: Path) -> int:
    """Run `command` (`ray start --block`) to its end, then keep its logs in `logs`; its exit status, shell-style.

    On a signal (passed on to Ray) the logs are copied once Ray has ended or `STOP_GRACE_S` later, whichever
    comes first: Slurm's SIGKILL follows its SIGTERM after KillWait, sooner than Ray may take to stop. The child
    inherits the inheritable file descriptors (the port lease), dies with this process and stays in its process
    group (Slurm's signals to the step reach it)."""
    child = Child(command, env=env, close_fds=False, own_session=False, die_with_parent=True)
    stopping: list[float] = []

    def pass_on(received: int, _frame) -> None:
        child.send_signal(received)
        stopping.append(time.monotonic())

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, pass_on)
    while child.poll() is None and not (stopping and time.monotonic() - stopping[0] > STOP_GRACE_S):
        time.sleep(0.2)
    save_ray_logs(temp_dir, logs)
    child.wait()
    code = child.stop()
    return code if code >= 0 else 128 - code


def save_ray_logs(temp_dir: Path, logs: Path) -> Path | None:
    """Copy the latest session's logs under `temp_dir` into `logs/<session>/`, bounded as the module says."""
    session = (temp_dir / "session_latest").resolve()
    source = session / "logs"
    if not source.is_dir():
        return None
    dest = logs / session.name
    dest.mkdir(parents=True, exist_ok=True)
    files = sorted((path.stat().st_size, path) for path in source.rglob("*")
                   if path.is_file() and not path.is_symlink())
    left, skipped = TOTAL_BYTES, []
    for size, path in files:
        if left <= 0:
            skipped.append(f"{path.relative_to(source)} ({size} bytes)")
            continue
        left -= _copy_tail(path, dest / path.relative_to(source), size, min(FILE_BYTES, left))
    if skipped:
        (dest / "SKIPPED.txt").write_text(f"left out: over {TOTAL_BYTES} bytes copied already\n" + "\n".join(skipped))
    return dest


def _copy_tail(source: Path, dest: Path, size: int, limit: int) -> int:
    """Copy `source`, or its last `limit` bytes after a line saying what was left out; the bytes copied."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(dest, "wb") as out:
        if size > limit:
            out.write(f"[relax: the first {size - limit} of {size} bytes of this file were left out]\n".encode())
            src.seek(size - limit)
        out.write(src.read(limit))  # a file still growing: no more than `limit`
        copied = out.tell()
    os.utime(dest, (source.stat().st_atime, source.stat().st_mtime))
    return copied
