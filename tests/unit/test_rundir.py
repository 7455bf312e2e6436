"""The run directory: run.json under concurrent writers, private secrets, and the rules that keep a run safe:
a resume stays the same run, one driver at a time, checkpoints tied to their run, each step logged once."""

import errno
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relax_core.checkpoint.layout import CheckpointError
from relax_core.checkpoint.owner import check_owner, claim
from relax_core.config import dump_recipe, load_recipe
from relax_core.config.same_run import check_same_run, fingerprint, stored_recipe
from relax_core.errors import RecipeError, UserError
from relax_core.metrics.tracker import MetricsTracker
from relax_core.rundir import DriverLock, RunDir, file_system, lock_holder


def _writer(path, prefix, count):
    run = RunDir(path)
    for i in range(count):
        run.update_state(**{f"{prefix}{i}": i})


def test_concurrent_updates_lose_nothing_and_stay_valid_json(tmp_path):
    run = RunDir(tmp_path / "run").create()
    procs = [mp.get_context("spawn").Process(target=_writer, args=(run.path, p, 40)) for p in "ab"]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    state = json.loads((run.path / "run.json").read_text())
    assert {f"{p}{i}" for p in "ab" for i in range(40)} <= set(state)


def test_secrets_are_private(tmp_path):
    run = RunDir(tmp_path / "run").create()
    path = run.write_secret("token")
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(run.secrets.stat().st_mode & 0o777) == "0o700"
    assert len(run.secret("token")) >= 32


# ---------------------------------------------------------------- resuming: the same run or a different one
QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


def resolved(*overrides: str) -> dict:
    return load_recipe(QUICKSTART, list(overrides)).model_dump(mode="json")


def test_resume_accepts_the_safe_changes_and_reports_them():
    found = check_same_run(resolved(), resolved("train.steps=300", "checkpoint.interval=10", "checkpoint.keep_last=4",
                                                "logging.backends=[]", "cluster.slurm.time=01:00:00"), "r")
    assert {field: (old, new) for field, old, new in found} == {
        "train.steps": (150, 300), "checkpoint.interval": (50, 10), "checkpoint.keep_last": (2, 4),
        "logging.backends": (["tensorboard"], []), "cluster.slurm.time": ("04:00:00", "01:00:00")}


@pytest.mark.parametrize("override", [
    "model.seed=1", "model.hidden_size=32", "data.task=reverse", "data.seed=1", "train.seed=1", "train.lr=0.01",
    "rollout.prompts_per_step=8", "rollout.n_samples_per_prompt=4", "train.micro_batch_size=32",
    "rollout.max_new_tokens=3", "rollout.temperature=0.5", "mode=fully_async", "reward.name=exact_match",
    "checkpoint.dir=/elsewhere", "checkpoint.resume=false",
])
def test_resume_refuses_a_change_that_makes_a_different_run(override):
    field, _, value = override.partition("=")
    with pytest.raises(RecipeError) as err:
        check_same_run(resolved(), resolved(override), "runs/r")
    assert f"{field}: " in str(err.value) and value in str(err.value) and "runs/r" in str(err.value)


def test_the_refusal_names_every_changed_field_with_old_and_new_values():
    with pytest.raises(RecipeError) as err:
        check_same_run(resolved(), resolved("train.seed=7", "rollout.n_samples_per_prompt=4", "train.steps=9",
                                            "algorithm.name=rloo"), "r")
    message = str(err.value)
    assert "train.seed: 0 -> 7" in message and "rollout.n_samples_per_prompt: 8 -> 4" in message
    assert 'algorithm.name: "grpo" -> "rloo"' in message
    assert "train.steps: 150" not in message  # a safe change is not blamed


def test_a_field_an_older_recipe_yaml_lacks_counts_as_its_default():
    old = yaml.safe_load(dump_recipe(load_recipe(QUICKSTART)))
    del old["rollout"]["top_k"], old["checkpoint"]["resume"]  # written before these fields existed
    assert check_same_run(stored_recipe(yaml.safe_dump(old)), resolved(), "r") == []


def test_the_fingerprint_ignores_safe_fields_only():
    assert fingerprint(resolved()) == fingerprint(resolved("train.steps=7", "logging.backends=[]"))
    assert fingerprint(resolved()) != fingerprint(resolved("train.seed=1"))


# ---------------------------------------------------------------- one driver per run directory
HOLD = """
import sys, time
from pathlib import Path
from relax_core.rundir import DriverLock, RunDir
lock = DriverLock(RunDir(Path(sys.argv[1]))).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_driver_is_refused_naming_the_holders_host_and_pid(tmp_path):
    run = RunDir(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run.path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError) as err:
            DriverLock(run).acquire()
        assert f"host {socket.gethostname()}, PID {holder.pid}" in str(err.value)
        assert lock_holder(run)["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()
    assert lock_holder(run) is None  # the kernel dropped the dead holder's lock: nothing stale remains
    with DriverLock(run):
        assert json.loads(run.lock_file.read_text())["pid"] == os.getpid()
    assert lock_holder(run) is None


def test_probing_the_lock_writes_nothing(tmp_path):
    run = RunDir(tmp_path / "run").create()
    assert lock_holder(run) is None and not run.lock_file.exists()



# A file system mounted without flock (Lustre `noflock`): flock fails as it does there. This machine has no
# Lustre, so the real CLI runs with fcntl.flock replaced by one that raises what Lustre's client returns.
NO_FLOCK = """
import errno, fcntl, sys
def flock(fd, operation):
    raise OSError(errno.ENOLCK, "No locks available")
fcntl.flock = flock
from relax_cli.main import app
sys.argv = ["relax", *sys.argv[1:]]
app()
"""


def test_submit_on_a_file_system_without_flock_warns_once_and_goes_on(tmp_path):
    quickstart = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    env = os.environ | {"NO_COLOR": "1", "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-c", NO_FLOCK, "submit", str(quickstart), "--dry-run", "--executor",
                           "local", "--run-dir", "r"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "r" / "run.json").read_text())["state"] == "dry-run"  # run.json updated twice
    warnings = [line for line in proc.stderr.splitlines() if "file locks (flock) fail" in line]
    assert len(warnings) == 1, proc.stderr
    assert f"fail on {file_system(tmp_path)} (" in warnings[0] and "a second driver" in warnings[0]


def test_a_driver_lock_without_flock_is_taken_with_a_warning(tmp_path, monkeypatch, caplog):
    import fcntl

    def flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr("relax_core.rundir._WARNED_NO_LOCKS", set())
    run = RunDir(tmp_path / "run")
    with DriverLock(run):
        run.update_state(state="running")
    assert json.loads(run.lock_file.read_text())["pid"] == os.getpid()
    assert len([m for m in caplog.messages if "file locks (flock) fail on" in m]) == 1  # once, for both locks


# ---------------------------------------------------------------- checkpoint directories belong to one run
def fake_checkpoint(root: Path, iteration: int) -> None:
    (root / f"iter_{iteration:07d}").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def test_a_checkpoint_dir_serves_only_the_run_that_claimed_it(tmp_path):
    shared, first, second = tmp_path / "shared", tmp_path / "first", tmp_path / "second"
    claim(shared, "id-first", first, "f0")
    fake_checkpoint(shared, 4)
    check_owner(shared, "id-first", first)  # the same run resumes
    claim(shared, "id-first", first, "f0")
    with pytest.raises(CheckpointError) as err:
        check_owner(shared, None, second)  # a fresh run
    assert str(shared) in str(err.value) and str(first) in str(err.value)
    with pytest.raises(CheckpointError):
        claim(shared, "id-second", second, "f1")
    assert json.loads((shared / "relax_run.json").read_text())["run_id"] == "id-first"


def test_unclaimed_checkpoints_are_a_runs_own_only_inside_its_directory(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run / "checkpoints", 2)  # a run made before identity files
    check_owner(run / "checkpoints", None, run)
    fake_checkpoint(tmp_path / "loose", 2)
    with pytest.raises(CheckpointError) as err:
        check_owner(tmp_path / "loose", None, run)
    assert "relax_run.json" in str(err.value)


# ---------------------------------------------------------------- metrics after a resume
def test_resume_from_keeps_each_step_once_in_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    metrics, board = tmp_path / "metrics.jsonl", tmp_path / "tb"
    first = MetricsTracker(metrics, board, 4)
    for step in (1, 2, 3, 4):
        first.log(step, {"reward_mean": float(step)})
    first.close()
    with metrics.open("a") as handle:
        handle.write('{"step": 5, "rew')  # the attempt died mid-line
    second = MetricsTracker(metrics, board, 4)
    second.resume_from(2)  # the checkpoint the run resumes from
    for step in (3, 4):
        second.log(step, {"reward_mean": 10.0 * step})
    second.close()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r["reward_mean"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    newest = sorted(board.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)[-1]
    starts = [e.step for e in EventFileLoader(str(newest)).Load() if e.HasField("session_log")]
    assert starts == [3]  # purge_step: TensorBoard hides the first attempt's events from step 3 on
    board_view = EventAccumulator(str(board))
    board_view.Reload()
    assert [(s.step, s.value) for s in board_view.Scalars("reward_mean")] == [(1, 1.0), (2, 2.0), (3, 30.0),
                                                                               (4, 40.0)]
