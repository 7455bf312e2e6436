"""The local executor's driver: a private Ray cluster on this machine, then the job.

    start_local_ray  ->  controller.driver.run_job  ->  stop_local_ray
    (the model directory, meanwhile)

It sits above the controller it starts (as the Slurm entry points beside it
do): `relax_core.launch.local` calls `run_driver` in the `relax submit`
process. Each node group of the recipe becomes a share of this machine's
cores (`local_cpu_sets`).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from relax_core.config.modes import mode_spec
from relax_core.config.schema import Recipe, rollout_group_name
from relax_core.controller.driver import run_job, setup_logging
from relax_core.controller.setup import prepare_model_dir
from relax_core.launch.rundir import RunDir

log = logging.getLogger(__name__)


def run_driver(recipe: Recipe, run: RunDir, console=None) -> str:
    """The local executor's driver: a private Ray cluster on this machine, then the job.

    Returns:
        "completed", or "stopped" when USR1 or TERM ended the run early (checkpointed).
    """
    from relax_core.cluster.local_ray import LOCAL_NODE, remove_ray_dir, start_local_ray, stop_local_ray
    from relax_core.controller.preemption import stop_on_signals

    setup_logging(run)
    # + 2: TransferQueue's controller and storage unit each hold a Ray CPU (the asynchronous modes);
    # the project's own actors take none (their cores are the node groups').
    cpus = max(os.cpu_count() or 1, recipe.train_ranks + recipe.rollout.num_engines) + 2
    bus = mode_spec(recipe.mode).bus  # TransferQueue
    with ThreadPoolExecutor(1, thread_name_prefix="model-dir") as pool:
        # The model directory (and the import of torch and transformers it takes) while Ray starts,
        # which mostly waits for its processes; the job then finds it ready.
        model_dir = pool.submit(prepare_model_dir, recipe, run)
        if bus:  # TransferQueue's import too (4-6 CPU-s), which the job needs first
            from relax_core.data.bus import import_tq

            bus_import = pool.submit(import_tq)
        log.info("starting a local Ray cluster")
        ray_dir = start_local_ray(run, num_cpus=cpus, resources=local_slots(recipe), bus=bus)
        log.info("Ray cluster up (its sockets and logs in %s)", ray_dir)
        stop = threading.Event()
        stop_on_signals(stop)  # after Ray's start-up, which installs a TERM handler of its own
        try:
            model_dir.result()
            if bus:
                bus_import.result()
            return run_job(recipe, run, console, stop=stop, cpu_sets=local_cpu_sets(recipe))
        finally:
            log.info("job closed; stopping Ray")
            stop_local_ray()
            kept = remove_ray_dir(ray_dir, run.logs / "ray" / LOCAL_NODE)
            log.info("Ray stopped; its logs in %s", kept or "(none written)")


def local_slots(recipe: Recipe) -> dict[str, float]:
    """The custom resources of the one local Ray node: every group's slots (as `cluster.node` gives a node)."""
    from relax_core.cluster.node import JUDGE_RESOURCE, REFERENCE_RESOURCE, ROLLOUT_RESOURCE, TRAIN_RESOURCE
    from relax_core.launch.plan import local_engine_capacity

    # GPU engines: the engines' group's GPUs, as a node of it declares them (their placement groups take
    # them all, controller/gpu_slots.py); CPU engines: one slot each, for as many as a scale-out may add
    engine_gpus = recipe.rollout.gpus_per_engine and getattr(recipe.cluster, rollout_group_name(recipe)).gpus_per_node
    slots = {TRAIN_RESOURCE: recipe.train_ranks, ROLLOUT_RESOURCE: engine_gpus or local_engine_capacity(recipe)}
    if recipe.reward.judge_engines:  # the judge's engines (reward.genrm), beside the rollout engines
        slots[JUDGE_RESOURCE] = recipe.reward.judge_engines
    if recipe.cluster.reference.nodes:  # one reference worker: the group's one node (LocalExecutor.problems)
        slots[REFERENCE_RESOURCE] = 1
    return slots


def local_cpu_sets(recipe: Recipe) -> dict[str, list[int]]:
    """On one machine, each node group gets its own cores (`cpus_per_node` each, in het-group order) when
    they fit, so rollout and training of the asynchronous modes do not slow each other down.

    Train and rollout are pinned both or neither (else none are pinned); a reference group gets its own
    cores after theirs only when those fit too, and otherwise shares the machine unpinned.
    """
    cluster, available = recipe.cluster, sorted(os.sched_getaffinity(0))
    wanted = cluster.train.cpus_per_node + (cluster.rollout.cpus_per_node if cluster.rollout.nodes else 0)
    if not cluster.rollout.nodes or wanted > len(available):
        return {}
    train = available[:cluster.train.cpus_per_node]
    sets = {"train": train, "rollout": available[len(train):wanted]}
    reference = available[wanted:wanted + cluster.reference.cpus_per_node]
    if cluster.reference.nodes and len(reference) == cluster.reference.cpus_per_node:
        sets["reference"] = reference
    return sets
