"""A run's engines fail as nodes do, and the run goes on without losing or repeating a sample.

A local quick start (colocate, and fully_async): its engine's server is killed by PID mid-run, and the run replaces it
and finishes every step with every sample; then the replacement is stopped (SIGSTOP: alive, answering
nothing), and the health watch ends and replaces it within `recovery.health_timeout_s`. `relax status`
shows the restarts. An engine that keeps failing ends the run at `recovery.max_engine_restarts`, naming
the engine and its log, exit 1.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from test_elastic import QUICKSTART, relax, start_relax
from test_slurm_launch import wait_for

SAMPLES = 16 * 8  # the quick start's prompts_per_step x n_samples_per_prompt


def state(run: Path) -> dict:
    return json.loads((run / "run.json").read_text()) if (run / "run.json").exists() else {}


def steps(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def engine_pid(run: Path, restarts: int) -> int | None:
    """The engine's server PID once it has been replaced `restarts` times (and serves)."""
    engines = state(run).get("engines") or []
    if engines and engines[0]["restarts"] == restarts and engines[0]["state"] == "active":
        return engines[0]["pid"]
    return None


def kill_engine_after(run: Path, driver, step: int) -> int:
    """Once `step` is logged, kill the run's engine server by its PID (returned)."""
    wait_for(lambda: len(steps(run)) >= step or driver.poll() is not None, 300, f"step {step}", poll=0.1)
    assert driver.poll() is None, "the run ended early"
    pid = engine_pid(run, 0)
    os.kill(pid, signal.SIGKILL)
    return pid


def ends_with(driver, timeout: float) -> int:
    """The driver's exit code (killed if it has not ended within `timeout`)."""
    try:
        return driver.wait(timeout=timeout)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocate", "fully_async"])
def test_an_engine_killed_or_stopped_mid_run_is_replaced_and_no_sample_is_lost(tmp_path, mode):
    run, out = tmp_path / "run", tmp_path / "driver.out"
    driver = start_relax("submit", str(QUICKSTART), f"mode={mode}", "train.steps=150", "logging.backends=[]",
                         "recovery.health_timeout_s=2", "--executor", "local", "--run-dir", "run",
                         cwd=tmp_path, out=out)
    try:
        wait_for(lambda: driver.poll() is None and len(steps(run)) >= 3 or driver.poll() is not None, 300,
                 "step 3", poll=0.1)
        assert driver.poll() is None, out.read_text()[-3000:]
        first = engine_pid(run, 0)
        os.kill(first, signal.SIGKILL)
        killed_at = len(steps(run))
        second = wait_for(lambda: engine_pid(run, 1), 120, "the killed engine's replacement", poll=0.1)
        assert second != first and len(steps(run)) < 150, "the run must still be going"

        os.kill(second, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: engine_pid(run, 2), 120, "the stopped engine's replacement", poll=0.1)
        restarts = state(run)["engine_restarts"]
        # Noticed by the watch: within the health timeout, plus one check interval and the engine's load.
        assert time.monotonic() - stopped < 2 + 2 + 30
        assert gone(second), "the stopped engine must be ended, not left behind"
        assert driver.wait(timeout=300) == 0, out.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    rows = steps(run)
    assert [r["step"] for r in rows] == list(range(1, 151))
    # Every step trains all its samples (the driver also checks each is trained once: fully_async by id
    # against the rollout's record, colocate by distinct ids, and fails the run otherwise).
    assert all(r["samples"] == SAMPLES for r in rows)
    assert killed_at < 150
    assert [r["engine"] for r in restarts] == ["e0", "e0"]
    assert "health" in restarts[1]["reason"] and "health" not in restarts[0]["reason"]
    shown = relax("status", "run", "--json", cwd=tmp_path)
    report = json.loads(shown.stdout)
    assert report["engine_restarts"] == 2, shown.stdout


@pytest.mark.slow
def test_an_engine_that_keeps_failing_ends_the_run_naming_it_and_its_log(tmp_path):
    run, out = tmp_path / "run", tmp_path / "driver.out"
    driver = start_relax("submit", str(QUICKSTART), "train.steps=150", "logging.backends=[]",
                         "recovery.max_engine_restarts=0", "--executor", "local", "--run-dir", "run",
                         cwd=tmp_path, out=out)
    kill_engine_after(run, driver, 2)
    assert ends_with(driver, 120) == 1, out.read_text()[-3000:]
    printed = " ".join(out.read_text().split())
    assert "engine e0" in printed and "recovery.max_engine_restarts=0" in printed and "ray::" not in printed
    assert str(run / "logs" / "engine-0.log") in printed
    assert len(steps(run)) < 150
    assert state(run)["state"] == "failed" and "engine e0" in state(run)["error"]
