"""The driver: runs a job's training loop on a Ray cluster that is already up.

    Job (model dir, engines, trainers)  ->  train_<mode>(job)  ->  stop everything it started

`run_driver` (the local executor) brings up a private Ray cluster on this
machine first, and USR1 or TERM to it stop the run; on Slurm the batch step
(`relax_core.cluster.slurm_job`) brings up the cluster across the allocation
and then calls `run_job`. A stop aborts generation at once and checkpoints the
last completed step (`preemption.py`).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading

from relax_core.config.schema import Recipe
from relax_core.launch.rundir import RunDir

LOOPS = {
    "colocate": "relax_core.controller.colocate:train_colocate",
    "fully_async": "relax_core.controller.streaming:train_fully_async",
    "hybrid": "relax_core.controller.streaming:train_hybrid",
}


def setup_logging(run: RunDir) -> None:
    handler = logging.FileHandler(run.logs / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("relax_core")
    root.setLevel(logging.INFO)
    root.addHandler(handler)


def run_job(recipe: Recipe, run: RunDir, console=None, stop: threading.Event | None = None,
            cpu_sets: dict[str, list[int]] | None = None) -> str:
    """Run the training loop to the end, or until `stop` is set (then checkpoint).

    Returns:
        "completed", or "stopped" when `stop` ended the run early.
    """
    from relax_core.controller.job import Job
    from relax_core.controller.preemption import abort_generation_on_stop

    module, _, name = LOOPS[recipe.mode].partition(":")
    train_loop = getattr(importlib.import_module(module), name)
    job = Job(recipe, run, console, stop=stop, cpu_sets=cpu_sets)
    try:
        with abort_generation_on_stop(job):
            return train_loop(job)
    finally:
        job.close()


def run_driver(recipe: Recipe, run: RunDir, console=None) -> str:
    """The local executor's driver: a private Ray cluster on this machine, then the job.

    Returns:
        "completed", or "stopped" when USR1 or TERM ended the run early (checkpointed).
    """
    from relax_core.cluster.local_ray import start_local_ray, stop_local_ray
    from relax_core.cluster.node import ROLLOUT_RESOURCE, TRAIN_RESOURCE
    from relax_core.controller.preemption import stop_on_signals

    setup_logging(run)
    # + 2: TransferQueue's controller and storage unit each hold a Ray CPU (the asynchronous modes);
    # the project's own actors take none (their cores are the node groups').
    cpus = max(os.cpu_count() or 1, recipe.train_ranks + recipe.rollout.num_engines) + 2
    slots = {TRAIN_RESOURCE: recipe.train_ranks,
             ROLLOUT_RESOURCE: recipe.rollout.num_engines * max(recipe.rollout.gpus_per_engine, 1)}
    start_local_ray(run, num_cpus=cpus, resources=slots)
    stop = threading.Event()
    stop_on_signals(stop)  # after Ray's start-up, which installs a TERM handler of its own
    try:
        return run_job(recipe, run, console, stop=stop, cpu_sets=local_cpu_sets(recipe))
    finally:
        stop_local_ray()


def local_cpu_sets(recipe: Recipe) -> dict[str, list[int]]:
    """On one machine, each node group gets its own cores (`cpus_per_node` each, in order) when they fit,
    so rollout and training of the asynchronous modes do not slow each other down; else none are pinned."""
    cluster, available = recipe.cluster, sorted(os.sched_getaffinity(0))
    wanted = cluster.train.cpus_per_node + (cluster.rollout.cpus_per_node if cluster.rollout.nodes else 0)
    if not cluster.rollout.nodes or wanted > len(available):
        return {}
    train = available[:cluster.train.cpus_per_node]
    return {"train": train, "rollout": available[len(train):wanted]}
