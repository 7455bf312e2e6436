"""The CLI's side of a run's control API (controller/api.py): requests through the run directory.

    relax scale-rollout (login node)                 driver (compute node, controller/api.py)
    control/<id>.request.json  {"method", "path", "json"}  ->  checked, then sent to its own API
                               <-  control/<id>.answer.json  {"status", "body"}

Login nodes often cannot reach the compute node the driver runs on, but they
share the run directory with it, so the CLI never calls the API's address
itself. Who may ask: the run's owner. The folder is the owner's, mode 0700;
each file is written whole (a 0600 temporary file renamed into place), and the
driver obeys a request only if it is a plain file owned by the driver's own
user that no one else may write; anything else it removes unread and logs. A
request older than `REQUEST_TTL_S` (its CLI gave up waiting) is dropped.

The API's HTTP address stays, for programs on the cluster's network (and is
what the driver relays to); run.json names it (`api_url`) while the driver runs.
"""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Any

from relax_core.errors import UserError
from relax_core.rundir import RunDir

FOLDER = "control"
TIMEOUT_S = 30.0  # how long the CLI waits for the driver's answer
REQUEST_TTL_S = 120.0
POLL_S = 0.1


def control_folder(run: RunDir) -> Path:
    """The run's request folder (mode 0700), made by the driver when its API starts."""
    path = run.path / FOLDER
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


class ControlClient:
    """Requests to one run's control API, through its run directory; a run that is not running (no API)
    is the user's mistake."""

    def __init__(self, run: RunDir):
        from relax_core.launch.status import current_state

        state = run.read_state()
        status = current_state(state)
        if status != "running" or not state.get("api_url"):
            raise UserError(f"{run.path}: the run is {status}, not running with its control API up; "
                            "scale a run while it trains (relax status shows its state)")
        self.folder = run.path / FOLDER

    def call(self, method: str, path: str, json: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of the request, as the driver's API answered it."""
        name = uuid.uuid4().hex
        request, answer = self.folder / f"{name}.request.json", self.folder / f"{name}.answer.json"
        try:
            write_private(request, {"method": method, "path": path, "json": json})
        except PermissionError:
            raise UserError(f"{self.folder}: cannot write a request there; only the run's owner can control "
                            "the run") from None
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                body = read_trusted(answer)
            except PermissionError as exc:
                raise RuntimeError(f"the answer is not the driver's: {exc}") from None
            if body is not None:
                answer.unlink(missing_ok=True)
                return int(body["status"]), body["body"]
            time.sleep(POLL_S)
        request.unlink(missing_ok=True)
        raise RuntimeError(f"the run's driver did not answer within {TIMEOUT_S:.0f}s (it reads requests from "
                           f"{self.folder}); is it still running? relax status shows it")
