"""The batch step of a Relax Slurm job: a small supervisor on node 0 of het group 0.

    python -m relax_core.entrypoints.slurm_job RUN_DIR

It imports nothing heavy and needs only Slurm's commands, so it runs on the
host even when everything else runs in a container. It starts, each as an
`srun --overlap` step logging to `logs/`:

    ray-<node>.log   one Ray node per allocated node (head on node 0)
    driver.log       the driver (`relax_core.entrypoints.slurm_driver`) on node 0

then watches them: a node step that dies ends the job at once, naming the node
and its log; the driver's exit code says how the run ended. On USR1 (sent by
Slurm `signal_before_end_s` before the time limit) it tells the driver to stop:
the driver aborts the rollout in progress and checkpoints the last completed
step within seconds; then this step requeues the job, which resumes from that
checkpoint. SIGTERM that is not the user's `relax cancel` (which marks
run.json `cancel_requested` first) is the same: the time limit (the driver's
checkpoint outlasted `signal_before_end_s`: `scontrol requeue` still turns a
TIMEOUT job back into a pending one) or an administrator's scancel. A site's
preemption (PreemptMode CANCEL or REQUEUE with GraceTime) sends SIGTERM to
every step but not to this one (slurmctld's job_signal without KILL_FULL_JOB):
the steps end, Slurm's `scontrol show job` shows a PreemptTime, and this step
requeues the job at once, in either mode (with REQUEUE Slurm would only requeue
a job still running at the grace time's end). A run whose newest checkpoint is
no newer than the one it started from made no progress and is not requeued
after a signal, so a failing start-up cannot loop; a preempted one always is.
It holds the run directory's driver lock for its whole life, so no local
driver or second job drives the same run meanwhile. It also submits the
rollout-only jobs the driver asks for (`relax scale-rollout +N`,
entrypoints/scale_jobs.py: the driver may run in a container without Slurm's
commands) and cancels them when they are done with, and all of them when the
job ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from relax_core.cluster.ports import NodePorts, lease_ports
from relax_core.config.schema import Recipe
from relax_core.entrypoints.scale_jobs import ScaleJobs
from relax_core.entrypoints.slurm_steps import Allocation, JobSteps
from relax_core.entrypoints.slurm_steps import srun_command as srun_command  # tests/unit/test_container_steps.py
from relax_core.errors import UserError
from relax_core.rundir import DriverLock, RunDir

# Exit codes of the driver step.
DRIVER_COMPLETED, DRIVER_STOPPED, DRIVER_STARTUP_FAILED = 0, 3, 4


def head_address(recipe: Recipe, ports: NodePorts) -> str:
    from relax_core.cluster.node import node_address

    return f"{node_address(recipe)}:{ports.gcs}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def main(argv: list[str] | None = None) -> int:
    from relax_core.config import load_recipe
    from relax_core.models.hub_cache import hub_env

    run = RunDir(Path((argv or sys.argv[1:])[0]).resolve())
    try:  # the run's driver lock, held until this batch step ends (the submitting node cannot hold it)
        _lock = DriverLock(run).acquire()
    except UserError as exc:  # another driver owns the run: leave its run.json alone
        print(f"relax: {exc}", file=sys.stderr, flush=True)
        return 2
    if run.read_state().get("state") == "completed":
        # Slurm 24.11 requeues a job that was preempted once more when its next run ends (measured on 24.11.5,
        # tests/slurm_versions); an administrator's `scontrol requeue` does the same. The run is done: leave it.
        print(f"relax: run {run.path} already completed; this restart of job "
              f"{os.environ.get('SLURM_JOB_ID', '?')} does nothing", file=sys.stderr, flush=True)
        return 0
    recipe = load_recipe(run.recipe)
    # Every step (and scale-out job) inherits this: the hub offline, its cache the one `relax submit` filled.
    os.environ.update(hub_env(recipe, run.path))
    alloc = Allocation.from_environ(recipe.cluster.groups, recipe)
    if alloc.sharing() is not None:
        return _failed(run, alloc.sharing())
    start_step = run.read_state().get("checkpoint_step", 0)
    head_lease = lease_ports(alloc.job_id, 0)  # this step runs on the head's machine, and holds it until it ends
    head = head_address(recipe, head_lease.ports)
    run.update_state(state="running", job_id=str(alloc.job_id), restart_count=alloc.restart_count,
                     nodes=alloc.groups, ray_head=head, started=_now(), error=None, cancel_requested=None)
    steps = JobSteps(recipe, run, alloc)
    signalled = stop_on_signals(run, steps)
    scale_jobs = ScaleJobs(recipe, run)
    try:
        steps.start_nodes(head, head_lease.ports.block)
        steps.start_driver()
        code, node_failure = steps.supervise(scale_jobs=scale_jobs)
    finally:
        end_steps(steps, scale_jobs)
    return finish(run, alloc, code, node_failure, start_step, bool(signalled))


def stop_on_signals(run: RunDir, steps: JobSteps) -> list[str]:
    """On USR1 or SIGTERM the driver checkpoints and stops, and the job is requeued (the names of the signals
    received go into the list returned); SIGTERM after the user's `relax cancel` stops the steps and ends."""
    signalled: list[str] = []

    def on_signal(signum, _frame) -> None:
        if signum == signal.SIGTERM and run.read_state().get("cancel_requested"):
            sys.exit(143)  # the user's relax cancel: stop the steps on the way out, never requeue
        signalled.append(signal.Signals(signum).name)
        steps.signal_driver(signal.SIGUSR1)  # checkpoint the last completed step now

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return signalled


def end_steps(steps: JobSteps, scale_jobs: ScaleJobs) -> None:
    """Whatever the run started ends with it: the scale-out jobs first (scancel frees their nodes at once,
    while stopping the steps may take each its grace time), then this job's steps."""
    scale_jobs.cancel_all()
    steps.stop()


def finish(run: RunDir, alloc: Allocation, code: int | None, node_failure: str | None, start_step: int,
           signalled: bool) -> int:
    if code == DRIVER_COMPLETED and node_failure is None:
        run.update_state(state="completed", finished=_now())
        return 0
    by_slurm = preempted(alloc.job_id)
    if signalled or by_slurm:  # the steps may have ended of Slurm's SIGTERM: not a failure
        if not by_slurm and run.read_state().get("checkpoint_step", 0) <= start_step:
            return _failed(run, "signalled before making progress; not requeued")
        return _requeue(run, alloc)
    if node_failure is not None:
        return _failed(run, node_failure)
    recorded = run.read_state().get("error")
    return _failed(run, recorded or f"the driver exited with code {code}; see {run.logs / 'driver.log'}")


def preempted(job_id: int) -> bool:
    """Slurm is preempting the job: `scontrol show job` shows when (PreemptTime; None otherwise)."""
    try:
        proc = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    fields = dict(part.split("=", 1) for part in proc.stdout.split() if "=" in part)
    return proc.returncode == 0 and fields.get("PreemptTime", "None") not in ("None", "Unknown", "")


def _requeue(run: RunDir, alloc: Allocation) -> int:
    run.update_state(state="requeued", requeued=_now())
    proc = subprocess.run(["scontrol", "requeue", str(alloc.job_id)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return _failed(run, f"scontrol requeue {alloc.job_id} failed: {proc.stderr.strip()}")
    _notify_requeued(run, alloc.job_id)
    return 0


def _notify_requeued(run: RunDir, job_id) -> None:
    """Tell `logging.notify` (never at the requeue's expense)."""
    from relax_core.config import load_recipe
    from relax_core.metrics.notify import Notifier

    try:
        recipe = load_recipe(run.recipe)
        notifier = Notifier(recipe.logging.notify, recipe.name)
        notifier.requeued(str(job_id), run.read_state().get("checkpoint_step", 0))
        notifier.close()
    except Exception as exc:
        print(f"relax: the requeue notification failed: {exc}", file=sys.stderr, flush=True)


def _failed(run: RunDir, message: str) -> int:
    run.update_state(state="failed", finished=_now(), error=message)
    print(f"relax: {message}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
