"""A run's engines fail as nodes do, and the run goes on without losing or repeating a sample.

A local quick start (colocate, and fully_async): its engine's server is killed by PID mid-run, and the run replaces it
and finishes every step with every sample; then the replacement is stopped (SIGSTOP: alive, answering
nothing), and the health watch ends and replaces it within `recovery.health_timeout_s`. `relax status`
shows the restarts. An engine that fails past `recovery.max_engine_restarts` is left out while another
serves; with none left the run ends naming the engine and its log, exit 1.

A trainer rank killed by PID restarts the job from its latest checkpoint in the same driver, and the
run ends with the weights of a run resumed from that checkpoint; a rank that stops answering is ended
by the trainer watch, and past `recovery.max_restarts` the run ends naming the rank.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from relax_runs import relax, start_relax, wait_for
from test_elastic import QUICKSTART
from test_local_run import final_weights
from test_notify import told_about_a_run
from webhook import closed_port

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


@pytest.mark.parametrize("mode", ["colocate", pytest.param("fully_async", marks=pytest.mark.full(
    covered_by="tests/integration/test_recovery.py::test_an_engine_killed_or_stopped_mid_run_is_replaced_and_no_sample_is_lost[colocate]"))])
def test_an_engine_killed_or_stopped_mid_run_is_replaced_and_no_sample_is_lost(tmp_path, mode, webhook):
    run, out = tmp_path / "run", tmp_path / "driver.out"
    # The colocate run also tells a webhook (test_notify.py), and a second one nobody answers.
    notify = ([f'logging.notify=["{webhook.url}", "json://127.0.0.1:{closed_port()}/nobody"]',
               "logging.notify_every=40", "checkpoint.interval=60"] if mode == "colocate" else [])
    driver = start_relax("submit", str(QUICKSTART), f"mode={mode}", "train.steps=150", "logging.backends=[]",
                         "recovery.health_timeout_s=2", *notify, "--executor", "local", "--run-dir", "run",
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
        third = wait_for(lambda: engine_pid(run, 2), 120, "the stopped engine's replacement", poll=0.1)
        restarts = state(run)["engine_restarts"]
        live = json.loads(relax("status", "run", "--json", cwd=tmp_path).stdout)  # while it runs
        shown = relax("status", "run", cwd=tmp_path).stdout
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
    # A stopped engine is found by the watch (requests in flight hang) or by a request it cannot take.
    assert all(r["reason"] for r in restarts)
    assert live["state"] == "running" and live["engine_restarts"] == 2
    assert [(e["id"], e["restarts"], e["healthy"], e["pid"]) for e in live["engines"]] == [("e0", 2, True, third)]
    assert live["steps_per_min"] > 0 and live["eta_s"] is not None and live["reward_recent_mean"] is not None
    assert "healthy" in shown and "restarts 2" in shown and "eta_s" in shown
    assert json.loads(relax("status", "run", "--json", cwd=tmp_path).stdout)["engine_restarts"] == 2
    if mode == "colocate":
        told_about_a_run(webhook, run)


@pytest.mark.full(covered_by="tests/integration/test_recovery.py::"
                              "test_an_engine_killed_or_stopped_mid_run_is_replaced_and_no_sample_is_lost[colocate]")
def test_the_watch_ends_a_stopped_engine_within_the_health_timeout(tiny_model_dir, tmp_path):
    """`recovery.health_timeout_s` is how long a stopped engine gets: a real engine server is stopped
    (SIGSTOP), and the watch gives up on it within the timeout and ends it, while a healthy one is kept."""
    import asyncio
    from types import SimpleNamespace

    from engine_fixtures import EngineServer

    from relax_core.controller.recovery import EngineRecovery

    class Engines:  # the job's engine set, as the watch uses it
        def __init__(self, servers):
            self.servers = {s.base_url: s for s in servers}
            self.spec, self.ended = SimpleNamespace(api_key="k"), []

        @property
        def urls(self):
            return list(self.servers)

        def kill(self, url):
            self.ended.append(url)
            return True

    with EngineServer(tiny_model_dir, tmp_path / "a.log", "k") as healthy, \
            EngineServer(tiny_model_dir, tmp_path / "b.log", "k") as stopped:
        engines = Engines([healthy, stopped])
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            for timeout_s in (1.0, 3.0):
                recovery = EngineRecovery(SimpleNamespace(engines=engines, elastic=None), timeout_s, 3)
                engines.ended.clear()
                start = time.monotonic()
                asyncio.run(recovery.check())
                took = time.monotonic() - start
                assert engines.ended == [stopped.base_url]
                assert timeout_s - 0.1 < took < timeout_s + 1.0, took  # it waited the timeout, no more
        finally:
            stopped.proc.kill()


@pytest.mark.full(covered_by="tests/integration/test_recovery.py::test_an_engine_killed_or_stopped_mid_run_is_replaced_and_no_sample_is_lost[colocate]")
def test_an_engine_past_its_restarts_is_left_out_and_with_none_left_the_run_ends_naming_it(tmp_path, webhook):
    """Two engines, `recovery.max_engine_restarts=0`: the first killed is left out and the run goes on with
    the other; when that one is killed too, the run ends naming it and its log."""
    run, out = tmp_path / "run", tmp_path / "driver.out"
    driver = start_relax("submit", str(QUICKSTART), "train.steps=300", "rollout.num_engines=2", "logging.backends=[]",
                         "recovery.max_engine_restarts=0", f'logging.notify=["{webhook.url}"]',
                         "--executor", "local", "--run-dir", "run", cwd=tmp_path, out=out)
    try:
        wait_for(lambda: len(steps(run)) >= 2 or driver.poll() is not None, 300, "step 2", poll=0.1)
        first, second = [(e["id"], e["pid"]) for e in state(run)["engines"]]
        os.kill(first[1], signal.SIGKILL)
        wait_for(lambda: state(run).get("engine_restarts") or driver.poll() is not None, 120, "e0 left out")
        left_at = len(steps(run))
        wait_for(lambda: len(steps(run)) >= left_at + 3 or driver.poll() is not None, 120, "3 steps more")
        assert driver.poll() is None, out.read_text()[-3000:]  # it went on with one engine
        assert [e["id"] for e in state(run)["engines"]] == [second[0]]
        assert all(r["samples"] == SAMPLES for r in steps(run))
        os.kill(second[1], signal.SIGKILL)
        assert ends_with(driver, 120) == 1, out.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    left_out = state(run)["engine_restarts"]
    assert [(r["engine"], r["left_out"], r["serving"]) for r in left_out] == [(first[0], True, 1)]
    printed = " ".join(out.read_text().split())
    assert f"engine {second[0]}" in printed and "recovery.max_engine_restarts=0" in printed and "ray::" not in printed
    assert "No other engine serves" in printed and str(run / "logs" / "engine-1.log") in printed
    assert len(steps(run)) < 300
    assert state(run)["state"] == "failed" and f"engine {second[0]}" in state(run)["error"]
    assert "engine left out" in webhook.titles()
    failed = webhook.posts[-1]  # the notifiers hear it with the cause and the log to read
    assert failed["title"].endswith("failed") and failed["type"] == "failure"
    assert f"engine {second[0]}" in failed["message"] and str(run / "logs" / "driver.log") in failed["message"]


TWO_RANKS = ["train.steps=10", "checkpoint.interval=4", "checkpoint.keep_last=5", "rollout.prompts_per_step=4",
             "rollout.n_samples_per_prompt=4", "train.cpu_ranks_per_node=2", "logging.backends=[]"]


def trainer_pid_after_checkpoint(run: Path, driver, step: int, rank: int) -> int:
    """Trainer rank `rank`'s PID, once the checkpoint of `step` is written (run.json lists the ranks)."""
    wait_for(lambda: state(run).get("checkpoint_step", 0) >= step or driver.poll() is not None, 300,
             f"the checkpoint of step {step}", poll=0.02)
    assert driver.poll() is None, "the run ended early"
    return state(run)["trainers"][rank]["pid"]


def test_a_trainer_rank_killed_mid_run_restarts_the_job_from_its_checkpoint_as_a_resume_would(tmp_path, webhook):
    run, out = tmp_path / "run", tmp_path / "driver.out"
    driver = start_relax("submit", str(QUICKSTART), *TWO_RANKS, f'logging.notify=["{webhook.url}"]',
                         "--executor", "local", "--run-dir", "run", cwd=tmp_path, out=out)
    try:
        pid = trainer_pid_after_checkpoint(run, driver, 4, 1)
        os.kill(pid, signal.SIGKILL)  # while steps 5 to 8 run
        assert driver.wait(timeout=300) == 0, out.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    restarts = state(run)["job_restarts"]
    assert len(restarts) == 1 and restarts[0]["from_step"] == 4, restarts
    assert f"trainer rank 1 (pid {pid} on " in restarts[0]["cause"] and "is gone" in restarts[0]["cause"]
    assert pid not in [t["pid"] for t in state(run)["trainers"]] and gone(pid)
    assert "restart 1 of at most 3: trainer rank 1" in out.read_text()
    assert [r["step"] for r in steps(run)] == list(range(1, 11))  # steps 5.. ran again, and are logged once
    assert json.loads(relax("status", "run", "--json", cwd=tmp_path).stdout)["job_restarts"] == 1
    told = {p["title"].rsplit(" ", 1)[-1]: p["message"] for p in webhook.posts}
    assert "trainer rank 1" in told["restarted"] and "checkpoint of step 4" in told["restarted"]
    assert webhook.titles()[-1] == "finished"

    # The same recipe, never interrupted: the restart from step 4's checkpoint lands on the same weights and
    # draws the same samples (resuming is exact: it restores the weights, the optimizer, the prompt cursor and
    # the sampling seeds).
    straight = relax("submit", str(QUICKSTART), *TWO_RANKS, "--executor", "local", "--run-dir", "straight",
                     cwd=tmp_path, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    ours, theirs = final_weights(run, tmp_path, 10), final_weights(tmp_path / "straight", tmp_path, 10)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert [r["reward_mean"] for r in steps(run)] == [r["reward_mean"] for r in steps(tmp_path / "straight")]


@pytest.mark.full(covered_by="tests/integration/test_recovery.py::test_a_trainer_rank_killed_mid_run_restarts_the_job_from_its_checkpoint_as_a_resume_would")
def test_a_trainer_rank_that_stops_answering_is_ended_and_past_the_restart_limit_the_run_fails(tmp_path, webhook):
    run, out = tmp_path / "run", tmp_path / "driver.out"
    driver = start_relax("submit", str(QUICKSTART), *TWO_RANKS, "train.steps=200", "recovery.health_timeout_s=3",
                         "recovery.max_restarts=0", f'logging.notify=["{webhook.url}"]', "--executor", "local",
                         "--run-dir", "run", cwd=tmp_path, out=out)
    pid = trainer_pid_after_checkpoint(run, driver, 4, 1)
    os.kill(pid, signal.SIGSTOP)  # alive, answering nothing: the other rank waits for it in a collective
    stopped = time.monotonic()
    assert ends_with(driver, 120) == 1, out.read_text()[-3000:]
    assert time.monotonic() - stopped < 3 + 1 + 30  # the timeout, one check interval, the shutdown
    assert gone(pid), "the stopped rank must be ended, not left behind"
    printed = " ".join(out.read_text().split())
    assert f"trainer rank 1 (pid {pid} on " in printed and "recovery.health_timeout_s=3s" in printed
    assert "recovery.max_restarts=0" in printed and str(run / "logs" / "driver.log") in printed
    assert "job_restarts" not in state(run) and state(run)["state"] == "failed"
    assert len(steps(run)) < 200
    failed = webhook.posts[-1]
    assert failed["type"] == "failure" and "trainer rank 1" in failed["message"]
