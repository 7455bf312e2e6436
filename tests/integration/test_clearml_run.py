"""A run's ClearML task as a user on a cluster without a network gets it (`logging.backends: [clearml]`): an
offline session under RUN/clearml whose metrics are the steps logged, one task continued by a resumed attempt,
no token of the driver's environment or the recipe in any file ClearML wrote, and no process left behind.

The files are read as ClearML wrote them (its offline session: task.json, metrics.jsonl with one JSON list of
events per flush, and the session's zip); `clearml-task --import-offline-session` uploads that zip."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import psutil
import pytest

from relax_core.metrics.clearml_run import ID_FILE, ClearMLRun, child_env
from relax_core.metrics.tracker import public_recipe

RECIPE = {"name": "copy", "cluster": {"train": {"env": {"RELAX_TEST_TOKEN": "hunter2"}}}, "train": {"steps": 4}}
SECRET = "hunter3-in-the-drivers-environment"


def offline_events(session: Path) -> list[dict]:
    """ClearML's scalar events of an offline session, in the order written."""
    events = []
    for line in (session / "metrics.jsonl").read_text().splitlines():
        events += [e for e in json.loads(line) if e["type"] == "training_stats_scalar"]
    return events


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A user whose clearml.conf records every environment variable with each task, and a token in the
    driver's environment."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "clearml.conf").write_text('sdk { development { log_os_environments: ["*"] } }\n')
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RELAX_TEST_SECRET", SECRET)
    monkeypatch.delenv("CLEARML_OFFLINE_MODE", raising=False)
    return home


def test_an_offline_task_holds_each_step_a_resume_continues_it_and_no_token_is_recorded(tmp_path, home):
    run = tmp_path / "run"
    run.mkdir()
    before = children()

    first = ClearMLRun(run, "relax-test", "run", public_recipe(RECIPE), run / "logs" / "clearml.log")
    for step in (1, 2, 3):
        first.log(step, {"reward_mean": 0.1 * step, "train_s": 0.5, "skipped": float("nan"), "flag": True})
    first.close()
    task_id = (run / ID_FILE).read_text().strip()
    session = run / "clearml" / "offline" / task_id
    assert task_id.startswith("offline-") and session.is_dir()
    assert [(e["iter"], e["metric"], e["value"]) for e in offline_events(session) if e["metric"] == "reward_mean"] \
        == [(1, "reward_mean", pytest.approx(0.1)), (2, "reward_mean", pytest.approx(0.2)),
            (3, "reward_mean", pytest.approx(0.3))]
    assert {e["metric"] for e in offline_events(session)} == {"reward_mean", "train_s"}  # numbers only
    task = json.loads((session / "task.json").read_text())
    assert (task["project_name"], task["name"]) == ("relax-test", "run")
    assert "RELAX_TEST_TOKEN" in task["configuration"]["recipe"]["value"]  # the recipe, its env's names
    assert "script" not in task  # no repository, script or requirements

    # A resumed attempt (it redoes step 3 from its checkpoint): the same task, iterations still Relax's steps.
    second = ClearMLRun(run, "relax-test", "run", public_recipe(RECIPE), run / "logs" / "clearml.log")
    for step in (3, 4):
        second.log(step, {"reward_mean": 0.1 * step + 0.05})
    second.close()
    assert (run / ID_FILE).read_text().strip() == task_id
    assert sorted(p.name for p in (run / "clearml" / "offline").iterdir()) == [task_id, f"{task_id}.zip"]
    rewards = [(e["iter"], round(e["value"], 3)) for e in offline_events(session) if e["metric"] == "reward_mean"]
    print(f"task {task_id}: reward_mean by iteration {rewards}")
    assert rewards == [(1, 0.1), (2, 0.2), (3, 0.3), (3, 0.35), (4, 0.45)]
    with zipfile.ZipFile(run / "clearml" / "offline" / f"{task_id}.zip") as archive:
        assert {"task.json", "metrics.jsonl"} <= set(archive.namelist())

    written = [p for p in (run / "clearml").rglob("*") if p.is_file()]
    for path in written:
        data = path.read_bytes()
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                data = b"".join(archive.read(name) for name in archive.namelist())
        assert b"hunter2" not in data and SECRET.encode() not in data, path
    assert children() <= before  # the ClearML process ended with its task


def test_a_task_that_cannot_start_fails_the_step_naming_its_log(tmp_path, home, monkeypatch):
    """Online (`CLEARML_OFFLINE_MODE=0`) with a server that does not answer: ClearML retries for minutes, so the
    step that logs first fails after the start's time limit (shortened here from 120 s), naming the log, and the
    ClearML process is ended."""
    import relax_core.metrics.clearml_run as clearml_run

    monkeypatch.setattr(clearml_run, "START_TIMEOUT_S", 5)
    before = children()
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "0")
    monkeypatch.setenv("CLEARML_API_HOST", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("CLEARML_API_ACCESS_KEY", "key")
    monkeypatch.setenv("CLEARML_API_SECRET_KEY", "secret")
    run = tmp_path / "run"
    run.mkdir()
    tracker = ClearMLRun(run, "relax-test", "run", public_recipe(RECIPE), run / "logs" / "clearml.log")
    with pytest.raises(RuntimeError, match="clearml.log"):
        tracker.log(1, {"reward_mean": 0.5})
    tracker.close()
    assert not (run / ID_FILE).exists() and children() <= before


def test_the_clearml_process_gets_none_of_the_drivers_variables_but_clearmls_own_and_pythons(tmp_path):
    env = child_env(tmp_path, {"PATH": "/usr/bin", "HOME": "/home/u", "HF_TOKEN": "hf_x", "WANDB_API_KEY": "w",
                               "CLEARML_API_HOST": "https://api.example", "CLEARML_API_SECRET_KEY": "s"})
    assert {k: env[k] for k in ("PATH", "HOME", "CLEARML_API_HOST", "CLEARML_API_SECRET_KEY")} == {
        "PATH": "/usr/bin", "HOME": "/home/u", "CLEARML_API_HOST": "https://api.example",
        "CLEARML_API_SECRET_KEY": "s"}
    assert "HF_TOKEN" not in env and "WANDB_API_KEY" not in env
    assert env["CLEARML_OFFLINE_MODE"] == "1" and env["CLEARML_CACHE_DIR"] == str(tmp_path / "clearml")
    assert child_env(tmp_path, {"CLEARML_OFFLINE_MODE": "0"})["CLEARML_OFFLINE_MODE"] == "0"  # online, if asked
