"""The CLI's side of a run's control API (controller/api.py): where it is, and asking it.

run.json names the API (`api_url`) and its token's file (`api_token_file`, mode
0600, readable by the run's owner only); both exist while the run's driver runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_core.errors import UserError
from relax_core.launch.rundir import RunDir

TIMEOUT_S = 30.0


class ControlClient:
    """Requests to one run's control API; a run that is not running (no API) is the user's mistake."""

    def __init__(self, run: RunDir):
        from relax_core.launch.status import current_state

        state = run.read_state()
        status = current_state(state)
        self.url, token_file = state.get("api_url"), state.get("api_token_file")
        if status != "running" or not self.url or not token_file:
            raise UserError(f"{run.path}: the run is {status}, not running with its control API up; "
                            "scale a run while it trains (relax status shows its state)")
        try:
            self.token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise UserError(f"{token_file}: cannot read the run's API token ({exc.strerror}); it is readable "
                            "by the run's owner only") from None

    def call(self, method: str, path: str, **kwargs) -> tuple[int, dict[str, Any]]:
        import httpx

        try:
            response = httpx.request(method, f"{self.url}{path}", headers={"Authorization": f"Bearer {self.token}"},
                                     timeout=TIMEOUT_S, **kwargs)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"the run's control API at {self.url} did not answer: {exc}") from None
        try:
            body = response.json()
        except ValueError:
            body = {"error": response.text}
        return response.status_code, body
