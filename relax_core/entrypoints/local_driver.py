"""The local executor's driver: a private Ray cluster on this machine, then the job.

    start_local_ray  ->  controller.driver.run_job  ->  stop_local_ray

It sits above the controller it starts (as the Slurm entry points beside it
do): `relax_core.launch.local` calls `run_driver` in the `relax submit`
process. Each node group of the recipe becomes a share of this machine's
cores (`local_cpu_sets`).
"""

from __future__ import annotations

import os
import threading

from relax_core.config.schema import Recipe
from relax_core.controller.driver import run_job, setup_logging
from relax_core.launch.rundir import RunDir


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
