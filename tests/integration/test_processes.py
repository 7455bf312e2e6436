"""Nothing a run started is left behind: not when its driver is killed, not when its set-up fails.

- `relax submit` on this machine with a router (two engines), killed with
  SIGKILL (the driver only, by its PID) once it trains: within a few seconds
  none of its processes runs any more: router, engine servers, Ray's workers,
  raylet, GCS, agents. The job's processes are found by an environment mark of
  the test's own, which each of them inherits, whatever its parent. That test
  is `test_a_killed_driver_leaves_no_process_behind` in test_listening_sockets.py,
  where it ends the job that module's tests inspect (one quick start for both).
- A set-up that fails after the engines started (a teacher model whose
  weights file is damaged, which only the trainer reads) raises an error
  naming the problem, and has stopped every engine server and freed every
  engine and trainer slot of the cluster, which lives on (the tests' shared one).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from proc_table import QUICKSTART, cmdline

from relax_core.config.loader import load_recipe
from relax_core.rundir import new_run_dir

GONE_WITHIN_S = 10


def test_a_failed_set_up_stops_what_it_started(local_ray, tmp_path, one_torch_thread):
    import ray

    from relax_core.controller.job import Job

    before = ray.available_resources()
    teacher = damaged_model(tmp_path / "teacher")
    recipe = load_recipe(QUICKSTART, ["rollout.num_engines=2", "algorithm.name=opd",
                                      f"algorithm.teacher.path={teacher}", "logging.backends=[]"])
    run = new_run_dir(tmp_path, "run").create()
    started = _engines_of(run)
    with pytest.raises(Exception) as failure:
        Job(recipe, run)
    assert "SafetensorError" in str(failure.value), failure.value  # the trainer's own error reaches the caller
    assert (run.logs / "engine-1.log").exists()  # the engines had been started
    left = _eventually(lambda: _engines_of(run) - started)
    assert not left, f"engine servers still running after the failed set-up: {left}"
    held = _eventually(lambda: _slots(ray.available_resources()) != _slots(before))
    assert not held, f"slots still held: {ray.available_resources()} (before: {before})"  # actors ended


def damaged_model(path: Path) -> Path:
    """A model directory whose config is fine and whose weights file is not."""
    from relax_core.models.tiny import materialize_tiny_model

    materialize_tiny_model(path, seed=1, alphabet="abcd", hidden_size=64, num_layers=2)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    return path


def _engines_of(run) -> set[int]:
    """Engine servers serving this run's model (their command line names it)."""
    model = str(run.path / "model")
    commands = {int(p): cmdline(int(p)) for p in os.listdir("/proc") if p.isdigit()}
    return {pid for pid, command in commands.items() if "relax_core.rollout.cpu_engine" in command and model in command}


def _eventually(problem, timeout: float = GONE_WITHIN_S):
    """Poll `problem()` until it is falsy or `timeout` passed; returns its last value."""
    deadline = time.monotonic() + timeout
    while (found := problem()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def _slots(resources: dict) -> dict:
    return {k: resources.get(k, 0) for k in ("relax_train", "relax_rollout")}
