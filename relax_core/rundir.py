"""The run directory: everything one run writes, in one place.

    runs/quickstart-20261129-101500/
        recipe.yaml          resolved recipe (written before anything starts)
        job.sbatch           the Slurm job script (the slurm executor; written beside the recipe)
        run.json             executor, state, pid / job id, times
        metrics.jsonl        one JSON object per step
        tensorboard/         TensorBoard event files
        logs/                driver.log, engine-*.log, ...; ray/<node>/<session>/: Ray's own logs (a Slurm
                             node's, or `local`), kept as the cluster stops
        checkpoints/         Megatron layout (iter_0000010/, latest_checkpointed_iteration.txt),
                             relax_run.json: the run that owns it (relax_core/checkpoint/owner.py)
        secrets/             tokens (mode 0700 folder, 0600 files)
        driver.lock          flock held by the run's one driver; holds its host and PID

`relax status`, `relax logs` and a resumed run find everything from here.
Light imports only: the CLI uses this on the login node.

One driver owns a run directory at a time (`DriverLock`). The lock is an
flock(2): the kernel drops it when its holder dies, so a crash never leaves a
stale lock behind. On NFS, Linux emulates flock with NFS byte-range locks,
so it holds across hosts (v3 with lockd, v4); on a file system mounted without
locks (`nolock`, `local_lock=all`, Lustre's `localflock`) it holds on one host
only, and where flock fails outright (Lustre `noflock`) the run goes on with a
warning: the submit-time check of run.json's live job still applies.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_core.errors import UserError

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = "driver.lock"
JOB_SCRIPT_FILE = "job.sbatch"
# What flock fails with where a file system has no locks (Lustre mounted `noflock`, some FUSE and NFS mounts).
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
_WARNED_NO_LOCKS: set[str] = set()


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def recipe(self) -> Path:
        return self.path / RECIPE_FILE

    @property
    def job_script(self) -> Path:
        return self.path / JOB_SCRIPT_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def secrets(self) -> Path:
        return self.path / "secrets"

    @property
    def lock_file(self) -> Path:
        return self.path / LOCK_FILE

    def checkpoint_dir(self, recipe) -> Path:
        """Where the run's checkpoints live: `checkpoint.dir`, or checkpoints/ in the run directory."""
        return Path(recipe.checkpoint.dir).expanduser() if recipe.checkpoint.dir else self.checkpoints

    def run_id(self) -> str:
        """The run's identity (in run.json), created on first use; it survives moving the directory."""
        return self.read_state().get("run_id") or self.update_state(run_id=uuid.uuid4().hex)["run_id"]

    def create(self) -> RunDir:
        for folder in (self.path, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        self.secrets.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.secrets, 0o700)
        return self

    def write_secret(self, name: str, value: str | None = None) -> Path:
        """Write a token readable by its owner only (mode 0600); returns its path."""
        path = self.secrets / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(value or secrets.token_urlsafe(32))
        os.chmod(path, 0o600)
        return path

    def secret(self, name: str) -> str:
        return (self.secrets / name).read_text().strip()

    def read_state(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / RUN_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def update_state(self, **fields: Any) -> dict[str, Any]:
        """Merge `fields` into run.json: under a lock (the job's supervisor and driver both
        write it), through a temporary file of this process, renamed into place."""
        import fcntl

        with open(self.path / f".{RUN_FILE}.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError as exc:
                if exc.errno not in NO_LOCKS:
                    raise
                warn_no_locks(self.path, exc)
            state = self.read_state() | fields
            tmp = self.path / f".{RUN_FILE}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(state, indent=2))
            os.replace(tmp, self.path / RUN_FILE)
        return state

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        rows = []
        for line in self.metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line being written right now
                continue
        return rows


def new_run_dir(root: str | Path, name: str) -> RunDir:
    """A fresh, uniquely named run directory under `root` (not yet created)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(root).expanduser().resolve() / f"{name}-{stamp}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return RunDir(candidate)


def find_run(run: str | None, root: str | Path = "runs") -> RunDir:
    """The run a user means: a path, a run name under `root`, or the newest run."""
    if run:
        for candidate in (Path(run), Path(root) / run):
            if (candidate / RECIPE_FILE).exists():
                return RunDir(candidate.resolve())
        raise UserError(f"run '{run}': no run directory with a {RECIPE_FILE} there or under {root}/")
    runs = sorted(Path(root).glob(f"*/{RECIPE_FILE}"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise UserError(f"no runs under {Path(root).resolve()}; give the run directory as an argument")
    return RunDir(runs[-1].parent.resolve())


class DriverLock:
    """The run directory's driver lock: taken by whoever runs the driver, held for its lifetime.

    The local executor's driver process takes it; on Slurm the job's batch step does
    (the login node that submitted the job cannot hold it for the job's life).
    """

    def __init__(self, run: RunDir):
        self.run, self._fd = run, None

    def acquire(self) -> DriverLock:
        """Take the lock and write this host and PID into it; UserError names the holder when taken."""
        self.run.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        if not _flock(fd, exclusive=True):
            os.close(fd)
            raise UserError(in_use_message(self.run, lock_holder_record(self.run)))
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the flock
            self._fd = None

    def __enter__(self) -> DriverLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _flock(fd: int, exclusive: bool) -> bool:
    """Try to lock `fd` without waiting; False when another process holds it."""
    import fcntl

    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:  # a file system without flock: nothing to enforce it with here
        if exc.errno not in NO_LOCKS:
            raise
        warn_no_locks(Path(os.readlink(f"/proc/self/fd/{fd}")), exc)
        return True


def warn_no_locks(path: Path, exc: OSError) -> None:
    """Warn, once per file system, that flock fails there (Lustre mounted `noflock`) and what goes without it."""
    where = file_system(path)
    if where in _WARNED_NO_LOCKS:
        return
    _WARNED_NO_LOCKS.add(where)
    log.warning("file locks (flock) fail on %s (%s); going on without them: a second driver on one run directory "
                "is not refused, and the job's processes may overwrite each other's updates of run.json. "
                "Put runs on a file system with locks (Lustre: mounted with `flock`)", where, exc)


def file_system(path: Path) -> str:
    """`TYPE at MOUNT POINT` of the file system holding `path` (from /proc/self/mounts)."""
    path = path.resolve()
    best = ("?", "/")
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        mounts = []
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if path.is_relative_to(point) and len(point) >= len(best[1]):
            best = (fields[2], point)
    return f"{best[0]} at {best[1]}"


def lock_holder(run: RunDir) -> dict[str, Any] | None:
    """Who holds the run's driver lock ({host, pid, since}), or None when nobody does. Writes nothing."""
    try:
        fd = os.open(run.lock_file, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        # A shared probe: it conflicts with the driver's exclusive lock, and NFS lets a read-only file take it.
        return None if _flock(fd, exclusive=False) else lock_holder_record(run)
    finally:
        os.close(fd)


def lock_holder_record(run: RunDir) -> dict[str, Any]:
    try:
        return json.loads(run.lock_file.read_text())
    except (OSError, ValueError):  # the holder is between taking the lock and writing its name
        return {}


def in_use_message(run: RunDir, holder: dict[str, Any]) -> str:
    who = f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}"
    return (f"run directory {run.path} is in use: its driver runs on {who} (since {holder.get('since', '?')}); "
            f"wait for it to end or stop it with `relax cancel {run.path}`, or give another --run-dir")
