"""The driver: brings a run up, runs its training loop, and always tears it down.

    model dir, Ray, engines, trainers   (Job)
    train_<mode>(job)                   (the loop)
    stop engines and trainers, stop Ray
"""

from __future__ import annotations

import logging
import os

from relax_core.config.schema import Recipe
from relax_core.launch.rundir import RunDir

LOOPS = {"colocate": "relax_core.controller.colocate:train_colocate"}


def setup_logging(run: RunDir) -> None:
    handler = logging.FileHandler(run.logs / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("relax_core")
    root.setLevel(logging.INFO)
    root.addHandler(handler)


def run_driver(recipe: Recipe, run: RunDir, console=None) -> None:
    import importlib

    from relax_core.cluster.local_ray import start_local_ray, stop_local_ray
    from relax_core.controller.job import Job

    setup_logging(run)
    module, _, name = LOOPS[recipe.mode].partition(":")
    train_loop = getattr(importlib.import_module(module), name)
    cpus = max(os.cpu_count() or 1, recipe.train_ranks + recipe.rollout.num_engines)
    start_local_ray(run, num_cpus=cpus)
    job = None
    try:
        job = Job(recipe, run, console)
        train_loop(job)
    finally:
        if job is not None:
            job.close()
        stop_local_ray()
