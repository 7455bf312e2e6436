"""What `relax status` and `relax logs` report about a run, from its run directory.

Local runs record their driver's PID in run.json; a run marked running whose
process is gone is reported as `died`. Slurm runs add the scheduler's view.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relax_core.rundir import RunDir

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


def current_state(state: dict[str, Any]) -> str:
    """The run's state: what its executor (the one run.json names) sees, else what the run recorded."""
    from relax_core.launch.executors import executor_named

    executor = executor_named(state.get("executor"))
    return executor.current_state(state) if executor else state.get("state", "unknown")


def run_status(run: RunDir) -> dict[str, Any]:
    state = run.read_state()
    status = current_state(state)
    metrics = run.read_metrics()
    last = metrics[-1] if metrics else {}
    return {
        "run_dir": str(run.path),
        "name": state.get("name", run.path.name),
        "executor": state.get("executor"),
        "job_id": state.get("job_id"),
        "state": status,
        "step": last.get("step", 0),
        "total_steps": state.get("total_steps"),
        "reward_mean": last.get("reward_mean"),
        "policy_version": last.get("policy_version"),
        "latest_checkpoint": _latest_checkpoint(run, state),
        "started": state.get("started"),
        "finished": state.get("finished"),
        "error": state.get("error"),
        # the driver records these as they change (controller/elastic.py); each engine's answer, weight
        # version and load are asked now (as GET /v1/engines of the control API does)
        "engines": _with_health(run, state.get("engines")) if status in ("running", "requeued") else None,
        "scale": state.get("scale"),
        "engine_restarts": len(state.get("engine_restarts") or []),
        # the job's restarts from its checkpoint after a trainer rank or service died (controller/restarts.py)
        "job_restarts": len(state.get("job_restarts") or []),
        "last_restart": ((state.get("job_restarts") or [{}])[-1]).get("cause"),
        "trainers": state.get("trainers") if status in ("running", "requeued") else None,
    } | progress(metrics, state.get("total_steps"))


TREND_STEPS = 10  # the reward trend: the mean of the last this many steps against the this many before


def progress(rows: list[dict[str, Any]], total: int | None) -> dict[str, Any]:
    """Rate, ETA, reward trend and staleness from metrics.jsonl's rows (steps logged with their time)."""
    timed = [r for r in rows[-(2 * TREND_STEPS + 1):] if isinstance(r.get("time"), (int, float))]
    rate = None
    if len(timed) >= 2 and timed[-1]["time"] > timed[0]["time"]:
        rate = (timed[-1]["step"] - timed[0]["step"]) / (timed[-1]["time"] - timed[0]["time"])
    step = rows[-1]["step"] if rows else 0
    rewards = [r["reward_mean"] for r in rows if isinstance(r.get("reward_mean"), (int, float))]
    recent, before = rewards[-TREND_STEPS:], rewards[-2 * TREND_STEPS:-TREND_STEPS]
    last = rows[-1] if rows else {}
    return {
        "steps_per_min": round(rate * 60, 2) if rate else None,
        "eta_s": round((total - step) / rate) if rate and total and total > step else None,
        "reward_recent_mean": round(sum(recent) / len(recent), 4) if recent else None,
        "reward_trend": round(sum(recent) / len(recent) - sum(before) / len(before), 4) if before else None,
        "staleness_max": last.get("staleness_max"),
        "tokens_per_s": last.get("tokens_per_s"),
    }


def engine_views(run: RunDir, engines: list[dict[str, Any]], timeout_s: float = 2.0) -> dict[str, dict[str, Any]]:
    """Each engine's own view now (url -> answering, weight version, load: rollout/client.py's `engine_view`),
    asked with the run's engine key. It never asks for /health, which SGLang answers with a generation,
    also while colocate's engines have released their memory for the trainer."""
    import asyncio

    from relax_core.rollout.client import engine_view

    try:
        key = run.secret("engine_api_key")
    except OSError:
        return {}
    urls = [engine["url"] for engine in engines if engine.get("url")]

    async def ask() -> list[dict[str, Any]]:
        return await asyncio.gather(*(engine_view(url, key, timeout_s) for url in urls))

    return dict(zip(urls, asyncio.run(ask()))) if urls else {}


def _with_health(run: RunDir, engines: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not engines:
        return engines
    views = engine_views(run, engines)
    return [e | _shown(views.get(e.get("url"))) for e in engines]


def _shown(view: dict[str, Any] | None) -> dict[str, Any]:
    """An engine's live fields in the report (None where it was not asked)."""
    if view is None:
        return {"healthy": None, "weight_version": None, "load": None}
    return {"healthy": view["answering"], "weight_version": view["weight_version"], "load": view["load"]}


def _latest_checkpoint(run: RunDir, state: dict[str, Any]) -> int | None:
    """The newest checkpoint's step, in the folder the submit recorded (`checkpoint.dir`, often on scratch
    outside the run directory), else the run's checkpoints/."""
    folder = Path(state["checkpoint_dir"]) if state.get("checkpoint_dir") else run.checkpoints
    tracker = folder / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        return None


def follow(path: Path, run: RunDir, poll_s: float = 0.5, max_status_interval_s: float = 30.0) -> Iterator[str]:
    """Yield what is written to `path` until the run ends.

    The file is read every `poll_s`; the run's state (for Slurm runs a
    `squeue` call) is asked with a back-off from 2 s up to
    `max_status_interval_s`, so following a log does not hammer the scheduler.
    """
    position, interval, next_check = 0, 2.0, 0.0
    while True:
        if path.exists():
            with path.open() as handle:
                handle.seek(position)
                chunk = handle.read()
                position = handle.tell()
            if chunk:
                yield chunk
        if time.monotonic() >= next_check:
            if current_state(run.read_state()) not in ("running", "pending", "requeued", "unknown"):
                if not path.exists() or path.stat().st_size <= position:
                    return
            interval = min(interval * 1.5, max_status_interval_s)
            next_check = time.monotonic() + interval
        time.sleep(poll_s)


def cancel_run(run: RunDir) -> str:
    """Stop the run's job or driver; returns what was done."""
    from relax_core.errors import UserError
    from relax_core.launch.executors import executor_named

    state = run.read_state()
    status = current_state(state)
    if status in FINAL_STATES or status == "dry-run":
        raise UserError(f"{run.path}: the run is {status}; nothing to cancel")
    executor = executor_named(state.get("executor"))
    if executor is None:
        raise UserError(f"{run.path}: the run has no live job or driver to cancel (state: {status})")
    return executor.cancel(run, state)
