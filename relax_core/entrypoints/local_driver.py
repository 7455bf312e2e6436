"""The local executor's driver: a private Ray cluster on this machine, then the job.

    start_local_ray  ->  controller.driver.run_job  ->  stop_local_ray
    (the model directory, meanwhile)

It sits above the controller it starts (as the Slurm entry points beside it
do): `relax_core.launch.local` calls `run_driver` in the `relax submit`
process. Each node group of the recipe becomes a share of this machine's
cores (`cluster/placement.py`: `local_cpu_sets`).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from relax_core.cluster.node import transfer_queue_cpus
from relax_core.cluster.placement import local_cpu_sets, local_slots
from relax_core.config.modes import mode_spec
from relax_core.config.schema import Recipe
from relax_core.controller.driver import run_job, setup_logging
from relax_core.controller.scale_out import LocalScaleOut
from relax_core.models.model_dir import prepare_model_dir
from relax_core.rundir import RunDir

log = logging.getLogger(__name__)


def run_driver(recipe: Recipe, run: RunDir, console=None) -> str:
    """The local executor's driver: a private Ray cluster on this machine, then the job.

    Returns:
        "completed", or "stopped" when USR1 or TERM ended the run early (checkpointed).
    """
    from relax_core.cluster.local_ray import LOCAL_NODE, remove_ray_dir, start_local_ray, stop_local_ray
    from relax_core.controller.preemption import stop_on_signals

    setup_logging(run)
    # The project's own actors take no Ray CPU (their cores are the node groups'); TransferQueue's
    # controller and storage unit take one each (the asynchronous modes): the one node is the head and a
    # training node.
    cpus = max(os.cpu_count() or 1, recipe.train_ranks + recipe.rollout.num_engines)
    cpus += transfer_queue_cpus(recipe, "train", head=True)
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
            return run_job(recipe, run, console, stop=stop, cpu_sets=local_cpu_sets(recipe),
                           scale_out=LocalScaleOut.for_run(recipe, run))
        finally:
            log.info("job closed; stopping Ray")
            stop_local_ray()
            kept = remove_ray_dir(ray_dir, run.logs / "ray" / LOCAL_NODE)
            log.info("Ray stopped; its logs in %s", kept or "(none written)")
