"""The driver: runs a job's training loop on a Ray cluster that is already up.

    Job (model dir, engines, trainers)  ->  train_<mode>(job)  ->  stop everything it started

The entry points above it bring up the cluster first and then call `run_job`:
`relax_core.entrypoints.local_driver` (a private Ray cluster on this machine;
USR1 or TERM stop the run) and, on Slurm, the batch step
`relax_core.entrypoints.slurm_job` (Ray across the allocation). A stop aborts
generation at once and checkpoints the last completed step (`preemption.py`).
"""

from __future__ import annotations

import importlib
import logging
import threading

from relax_core.config.modes import mode_spec
from relax_core.config.schema import Recipe
from relax_core.rundir import RunDir


def setup_logging(run: RunDir) -> None:
    handler = logging.FileHandler(run.logs / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("relax_core")
    root.setLevel(logging.INFO)
    root.addHandler(handler)


def run_job(recipe: Recipe, run: RunDir, console=None, stop: threading.Event | None = None,
            cpu_sets: dict[str, list[int]] | None = None, scale_out=None) -> str:
    """Run the training loop to the end, or until `stop` is set (then checkpoint). A job that lost a trainer
    rank or a service starts again from its latest checkpoint, at most `recovery.max_restarts` times
    (controller/restarts.py). `cpu_sets` and `scale_out`: the executor's, as `Job` takes them.

    Returns:
        "completed", or "stopped" when `stop` ended the run early.
    """
    from relax_core.controller.restarts import JobRestarts
    from relax_core.metrics.notify import Notifier

    module, _, name = mode_spec(recipe.mode).loop.partition(":")
    train_loop = getattr(importlib.import_module(module), name)
    notifier = Notifier(recipe.logging.notify, recipe.name, recipe.logging.notify_every)
    notifier.started(str(run.path), run.read_state().get("job_id"), recipe.train.steps)
    restarts = JobRestarts(recipe.recovery.max_restarts)
    try:
        while True:
            outcome = _attempt(recipe, run, console, stop, {"cpu_sets": cpu_sets, "scale_out": scale_out},
                               notifier, train_loop, restarts)
            if outcome != "restart":
                return outcome
    except BaseException as exc:
        notifier.failed(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:500]}",
                        str(run.logs / "driver.log"))
        raise
    finally:
        notifier.close()


def _attempt(recipe, run, console, stop, placed: dict, notifier, train_loop, restarts) -> str:
    """One job from start to end: its outcome, or "restart" when it failed in a way a restart mends."""
    from relax_core.controller.job import Job
    from relax_core.controller.preemption import abort_generation_on_stop

    job = None
    try:
        job = Job(recipe, run, console, stop=stop, notifier=notifier, restarted=restarts.count > 0, **placed)
        with abort_generation_on_stop(job):
            outcome = train_loop(job)
        if outcome == "completed":
            notifier.finished(recipe.train.steps)
        else:
            notifier.stopped(job.progress.completed[0])
        return outcome
    except Exception as exc:
        cause = restarts.cause(exc, job)  # raises RestartLimit past recovery.max_restarts
        if cause is None:
            raise
        run.update_state(job_restarts=restarts.history)
        if console is not None:
            console.print(f"restart {restarts.count} of at most {restarts.limit}: {cause}; resuming from the "
                          f"checkpoint of step {job.progress.checkpointed}", style="yellow", highlight=False,
                          markup=False)
        notifier.restarted(restarts.count, restarts.limit, cause, job.progress.checkpointed)
        return "restart"
    finally:
        if job is not None:
            job.close()
