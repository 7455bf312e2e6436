"""Requests through the run directory: the files the CLI, the Slurm job's supervisor and the driver
exchange, because the login node, the batch host and the driver's container share the run directory
when they share nothing else.

    control/<id>.request.json  ->  <id>.answer.json   the CLI asks the driver's control API
                                                       (launch/control.py, controller/api.py)
    scale/<op>.submit.json     ->  <op>.job.json      the driver asks the supervisor for a scale-out job
    scale/<op>.cancel, <op>.ending                     ... for its end; the job says its time is up
                                                       (controller/scale_out.py,
                                                       entrypoints/scale_jobs.py, slurm_scale.py)

Each file is written whole (a 0600 temporary file renamed into place). Who may ask: the run's owner. The
control folder is the owner's, mode 0700, and the driver obeys a control request only if it is a plain
file owned by the driver's own user that no one else may write; anything else it removes unread. A
request older than `REQUEST_TTL_S` (its sender gave up waiting) is dropped.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from relax_core.rundir import RunDir

CONTROL_FOLDER = "control"
SCALE_FOLDER = "scale"
REQUEST_TTL_S = 120.0


def control_folder(run: RunDir) -> Path:
    """The run's request folder (mode 0700), made by the driver when its API starts."""
    path = run.path / CONTROL_FOLDER
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, data: dict[str, Any]) -> None:
    """`data` as JSON in `path`, whole and readable by its owner only (a 0600 file renamed into place)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(data))
    os.replace(tmp, path)


def read_trusted(path: Path) -> dict[str, Any] | None:
    """The request in `path` if this user may obey it: a plain file (not a link), owned by this process's
    user, writable by no one else, not older than `REQUEST_TTL_S`. Raises `PermissionError` naming why
    not; None when it is gone or not JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link
        raise PermissionError(f"{path}: not a plain file ({exc.strerror})") from None
    with os.fdopen(fd) as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PermissionError(f"{path}: not a plain file")
        if info.st_uid != os.getuid():
            raise PermissionError(f"{path}: owned by uid {info.st_uid}, not the run's owner (uid {os.getuid()})")
        if info.st_mode & 0o022:
            raise PermissionError(f"{path}: writable by others (mode {oct(info.st_mode & 0o777)})")
        if time.time() - info.st_mtime > REQUEST_TTL_S:
            raise PermissionError(f"{path}: older than {REQUEST_TTL_S:.0f}s (its sender stopped waiting)")
        try:
            return json.loads(handle.read())
        except ValueError:
            return None


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON in `path`; None when it is missing or not (yet) JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def scale_folder(run: RunDir) -> Path:
    path = run.path / SCALE_FOLDER
    path.mkdir(exist_ok=True)
    return path


class ScaleJobRequests:
    """The driver's side of the scale-out jobs: ask for one, read what became of it, ask for its end
    (the supervisor's side: entrypoints/scale_jobs.py)."""

    def __init__(self, run: RunDir):
        self.folder = scale_folder(run)

    def submit(self, op_id: str, nodes: int) -> None:
        write_private(self.folder / f"{op_id}.submit.json", {"op": op_id, "nodes": nodes})

    def result(self, op_id: str) -> dict[str, Any] | None:
        return read_json(self.folder / f"{op_id}.job.json")

    def cancel(self, op_id: str) -> None:
        path = self.folder / f"{op_id}.cancel"
        if not path.exists():
            path.write_text("")

    def ending(self, op_id: str) -> bool:
        return (self.folder / f"{op_id}.ending").exists()
