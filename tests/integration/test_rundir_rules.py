"""A run directory is safe from the user's own mistakes, with `relax submit` run as a user runs it.

- a dry run never writes into an existing run; a refused submit leaves every file as it was;
- resuming accepts only changes that keep the run the same run, naming each one that does not;
- two drivers never own one run directory (the second is told the first's host and PID), on either executor;
- a checkpoint directory belongs to one run: a fresh run never resumes, or overwrites, another run's;
- after an interrupted run resumes, metrics.jsonl and TensorBoard hold each step once.

One real run serves most tests: it is interrupted with SIGINT (as `relax cancel` does), a second
driver is tried while it runs, and then it resumes to the end (fixture `interrupted_run`).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from relax_runs import cli_env, wait_for
from relax_runs import relax as relax_cli

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
INTERVAL = 5
SMALL = ["rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", f"checkpoint.interval={INTERVAL}",
         "checkpoint.keep_last=50"]
relax = partial(relax_cli, timeout=300)  # whole runs: longer than a command's 120 s


def tree_hash(*roots: Path) -> dict[str, str]:
    """Every file under `roots` with its content hash (and mode): equal before and after = nothing touched."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() + oct(p.stat().st_mode)
            for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


def steps_logged(run: Path) -> list[int]:
    if not (run / "metrics.jsonl").exists():
        return []
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line)["step"])
        except ValueError:  # being written
            pass
    return rows


def latest_checkpoint(ckpt: Path) -> int:
    return int((ckpt / "latest_checkpointed_iteration.txt").read_text())


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
    """A run with a shared checkpoint.dir, SIGINT-ed a few steps past a checkpoint, then resumed to the end."""
    cwd = tmp_path_factory.mktemp("rules")
    shared = cwd / "shared-ckpt"
    args = [str(QUICKSTART), *SMALL, f"checkpoint.dir={shared}", "--executor", "local", "--run-dir", "run"]
    # Started as a shell starts `relax submit ... &` (SIGINT ignored): the SIGINT below must stop it all the same.
    first = subprocess.Popen([sys.executable, "-m", "relax_cli.main", "submit", *args, "train.steps=500"], cwd=cwd,
                             env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    run = cwd / "run"
    try:
        wait_for(lambda: steps_logged(run), 300, "the first step", poll=0.05, alive=first)
        recipe_before = (run / "recipe.yaml").read_bytes()
        second = relax("submit", *args, "train.steps=500", cwd=cwd)
        dry = relax("submit", *args, "train.steps=500", "--dry-run", cwd=cwd)
        state_during = json.loads((run / "run.json").read_text())
        unchanged = (run / "recipe.yaml").read_bytes() == recipe_before
        # Interrupt between two checkpoints, so the attempt leaves steps the resumed run redoes.
        wait_for(lambda: steps_logged(run)[-1] > INTERVAL and steps_logged(run)[-1] % INTERVAL in (1, 2), 300,
                 "a step just past a checkpoint", poll=0.05, alive=first)
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    before = (run / "metrics.jsonl").read_text().splitlines()
    checkpoint = latest_checkpoint(shared)
    total = steps_logged(run)[-1] + 2
    resumed = relax("submit", *args, f"train.steps={total}", cwd=cwd, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return {"cwd": cwd, "run": run, "shared": shared, "args": args, "first_pid": first.pid, "second": second,
            "dry": dry, "state_during": state_during, "recipe_unchanged": unchanged, "before": before,
            "checkpoint": checkpoint, "total": total, "resumed": resumed}


def test_a_second_driver_of_a_running_run_is_refused_naming_host_and_pid(interrupted_run):
    r = interrupted_run
    holder = f"host {socket.gethostname()}, PID {r['first_pid']}"
    for proc in (r["second"], r["dry"]):  # a real submit and a dry run alike
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert holder in proc.stderr and "relax cancel" in proc.stderr
    print(r["second"].stderr.strip())
    assert r["recipe_unchanged"] and r["state_during"]["pid"] == r["first_pid"]
    assert r["state_during"]["state"] == "running"


def test_metrics_hold_each_step_once_after_a_resume(interrupted_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = interrupted_run
    k, total = r["checkpoint"], r["total"]
    assert max(json.loads(line)["step"] for line in r["before"]) > k  # the attempt logged steps past its checkpoint
    lines = (r["run"] / "metrics.jsonl").read_text().splitlines()
    print(f"interrupted attempt logged steps {[json.loads(x)['step'] for x in r['before']]}, latest checkpoint {k}; "
          f"after the resume to {total}: {[json.loads(x)['step'] for x in lines]}")
    assert [json.loads(line)["step"] for line in lines] == list(range(1, total + 1))
    assert lines[:k] == r["before"][:k]  # the steps up to the checkpoint are the first attempt's own rows
    board = EventAccumulator(str(r["run"] / "tensorboard"))
    board.Reload()
    assert [s.step for s in board.Scalars("reward_mean")] == list(range(1, total + 1))
    assert f"step {k + 1}/{total}" in r["resumed"].stdout and f"step {k}/{total}" not in r["resumed"].stdout


def test_the_shared_checkpoint_dir_is_claimed_by_its_run(interrupted_run):
    r = interrupted_run
    owner = json.loads((r["shared"] / "relax_run.json").read_text())
    state = json.loads((r["run"] / "run.json").read_text())
    assert owner["run_id"] == state["run_id"] and owner["run_dir"] == str(r["run"])
    assert state["state"] == "completed" and latest_checkpoint(r["shared"]) == r["total"]


def test_a_fresh_run_refuses_another_runs_checkpoint_dir(interrupted_run):
    r = interrupted_run
    before = tree_hash(r["run"], r["shared"])
    args = [a if a != "run" else "fresh" for a in r["args"]]
    proc = relax("submit", *args, f"train.steps={r['total'] + 5}", cwd=r["cwd"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(r["shared"]) in proc.stderr and str(r["run"]) in proc.stderr and "checkpoint.dir" in proc.stderr
    assert not (r["cwd"] / "fresh").exists() and tree_hash(r["run"], r["shared"]) == before


def test_a_dry_run_of_an_existing_run_writes_nothing(interrupted_run):
    r = interrupted_run
    before = tree_hash(r["run"], r["shared"])
    proc = relax("submit", *r["args"], f"train.steps={r['total'] + 4}", "--dry-run", cwd=r["cwd"])
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout.strip())
    assert "existing run (completed)" in proc.stdout and "wrote nothing" in proc.stdout
    assert f"from step {r['total']} to step {r['total'] + 4}" in proc.stdout
    assert f"train.steps: {r['total']} -> {r['total'] + 4}" in proc.stdout
    assert tree_hash(r["run"], r["shared"]) == before  # recipe.yaml and run.json ("completed") included


@pytest.mark.parametrize(("overrides", "named"), [
    (["model.seed=1", "data.seed=3", "train.seed=2"],
     ["model.seed: 0 -> 1", "data.seed: 0 -> 3", "train.seed: 0 -> 2"]),
    (["rollout.n_samples_per_prompt=2", "train.micro_batch_size=32"],
     ["rollout.n_samples_per_prompt: 4 -> 2", "train.micro_batch_size: 64 -> 32"]),
    (["algorithm.name=rloo", "mode=fully_async", "reward.name=exact_match"],
     ['algorithm.name: "grpo" -> "rloo"', 'mode: "colocate" -> "fully_async"', 'reward.name: "copy" -> "exact_match"']),
    (["data.task=reverse", "model.hidden_size=32"], ['data.task: "copy" -> "reverse"', "model.hidden_size: 64 -> 32"]),
    (["train.steps=1"], ["train.steps=1", "latest checkpoint"]),
])
@pytest.mark.parametrize("dry_run", [False, True])
def test_resuming_refuses_a_different_run_and_changes_nothing(interrupted_run, overrides, named, dry_run):
    r = interrupted_run
    before = tree_hash(r["run"], r["shared"])
    proc = relax("submit", *r["args"], f"train.steps={r['total']}", *overrides, *(["--dry-run"] if dry_run else []),
                 cwd=r["cwd"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    print(proc.stderr.strip())
    for words in named:
        assert words in proc.stderr
    assert tree_hash(r["run"], r["shared"]) == before


def test_a_dry_run_of_a_new_run_records_it(tmp_path):
    proc = relax("submit", str(QUICKSTART), "--executor", "local", "--dry-run", "--run-dir", "new", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "new" / "run.json").read_text())["state"] == "dry-run"
    assert "checked and recorded" in proc.stdout and (tmp_path / "new" / "recipe.yaml").is_file()
    again = relax("submit", str(QUICKSTART), "train.seed=3", "--executor", "local", "--dry-run", "--run-dir", "new",
                  cwd=tmp_path)  # a dry run's record is not a run yet: it may be redone with other values
    assert again.returncode == 0, again.stderr
    assert "seed: 3" in (tmp_path / "new" / "recipe.yaml").read_text()


def test_a_folder_that_is_not_a_run_is_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    proc = relax("submit", str(QUICKSTART), "--executor", "local", "--run-dir", "mine", cwd=tmp_path)
    assert proc.returncode == 2 and "not a Relax run" in proc.stderr
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def recorded_run(tmp_path: Path, **state) -> Path:
    """A run directory as `relax submit` records it, with run.json fields set as a live job's would be."""
    proc = relax("submit", str(QUICKSTART), "--executor", "local", "--dry-run", "--run-dir", "r", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "r"
    (run / "run.json").write_text(json.dumps(json.loads((run / "run.json").read_text()) | state))
    return run


def test_submit_refuses_a_run_whose_recorded_driver_is_alive(tmp_path):
    """No lock (a driver of an older Relax, say), but run.json says running and its PID is alive."""
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        run = recorded_run(tmp_path, state="running", pid=sleeper.pid)
        before = tree_hash(run)
        proc = relax("submit", str(QUICKSTART), "--executor", "local", "--run-dir", "r", cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"PID {sleeper.pid}" in proc.stderr and "running" in proc.stderr
        assert tree_hash(run) == before
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_slurm_batch_step_refuses_a_run_another_driver_holds(tmp_path):
    from relax_core.rundir import DriverLock, RunDir

    run = recorded_run(tmp_path, executor="slurm", state="pending", job_id="77")
    before = tree_hash(run)
    with DriverLock(RunDir(run)):
        proc = subprocess.run([sys.executable, "-m", "relax_core.entrypoints.slurm_job", str(run)], cwd=tmp_path,
                              env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"host {socket.gethostname()}, PID {os.getpid()}" in proc.stderr
    assert json.loads((run / "driver.lock").read_text())["pid"] == os.getpid()  # the holder's record stands
    after = tree_hash(run)
    after.pop(str(run / "driver.lock"))  # taken by this test
    assert after == before  # run.json still says what it said


# One training node and one rollout node, as tests/integration/test_slurm_launch.py runs the quick start.
ON_TWO_NODES = ["cluster.rollout.nodes=1", "cluster.rollout.cpus_per_node=2", "cluster.network.interface=lo",
                "logging.backends=[]"]


def test_submit_refuses_a_run_whose_slurm_job_is_still_pending(slurm_cluster, tmp_path):
    args = [str(QUICKSTART), *ON_TWO_NODES, "--executor", "slurm", "--run-dir", "r"]
    first = relax("submit", *args, "cluster.slurm.extra_sbatch=[--hold]", cwd=tmp_path, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    job_id = json.loads((tmp_path / "r" / "run.json").read_text())["job_id"]
    try:
        before, queued = tree_hash(tmp_path / "r"), slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()
        again = relax("submit", *args, "cluster.slurm.extra_sbatch=[--hold]", cwd=tmp_path, timeout=120)
        assert again.returncode == 2, again.stdout + again.stderr
        assert f"Slurm job {job_id} is pending" in again.stderr
        assert tree_hash(tmp_path / "r") == before
        assert slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split() == queued  # nothing submitted
    finally:
        slurm_cluster.run(["scancel", str(job_id)])
