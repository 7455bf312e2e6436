"""What `relax status` and `relax logs` report about a run, from its run directory.

Local runs record their driver's PID in run.json; a run marked running whose
process is gone is reported as `died`. Slurm runs add the scheduler's view.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

from relax_core.launch.rundir import RunDir

FINAL_STATES = ("completed", "failed", "cancelled", "died", "preempted")


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


def run_status(run: RunDir) -> dict[str, Any]:
    state = run.read_state()
    status = state.get("state", "unknown")
    if state.get("executor") == "local" and status == "running" and not pid_alive(state.get("pid")):
        status = "died"
    metrics = run.read_metrics()
    last = metrics[-1] if metrics else {}
    return {
        "run_dir": str(run.path),
        "name": state.get("name", run.path.name),
        "executor": state.get("executor"),
        "state": status,
        "step": last.get("step", 0),
        "total_steps": state.get("total_steps"),
        "reward_mean": last.get("reward_mean"),
        "policy_version": last.get("policy_version"),
        "latest_checkpoint": _latest_checkpoint(run),
        "started": state.get("started"),
        "finished": state.get("finished"),
        "error": state.get("error"),
    }


def _latest_checkpoint(run: RunDir) -> int | None:
    tracker = run.checkpoints / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        return None


def follow(path: Path, run: RunDir, poll_s: float = 0.5) -> Iterator[str]:
    """Yield the lines of `path` as they are written, until the run ends."""
    position = 0
    while True:
        if path.exists():
            with path.open() as handle:
                handle.seek(position)
                chunk = handle.read()
                position = handle.tell()
            if chunk:
                yield chunk
        if run_status(run)["state"] not in ("running", "pending", "unknown"):
            if not path.exists() or path.stat().st_size <= position:
                return
        time.sleep(poll_s)
