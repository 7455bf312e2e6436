"""The CLI's side of a run's control API (controller/api.py): requests through the run directory.

    relax scale-rollout (login node)                 driver (compute node, controller/api.py)
    control/<id>.request.json  {"method", "path", "json"}  ->  checked, then sent to its own API
                               <-  control/<id>.answer.json  {"status", "body"}

Login nodes often cannot reach the compute node the driver runs on, but they
share the run directory with it, so the CLI never calls the API's address
itself. Who may ask, and how the files are written and read: relax_core/run_requests.py.

The API's HTTP address stays, for programs on the cluster's network (and is
what the driver relays to); run.json names it (`api_url`) while the driver runs.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from relax_core.errors import UserError
from relax_core.run_requests import CONTROL_FOLDER, read_trusted, write_private
from relax_core.rundir import RunDir

TIMEOUT_S = 30.0  # how long the CLI waits for the driver's answer
POLL_S = 0.1


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
        self.folder = run.path / CONTROL_FOLDER

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
