"""Where a run's hub downloads live, and the environment that makes the job read them offline.

`relax submit` fetches every hub id of a recipe into this cache (launch/hub.py); the job's processes load
from it with the hub offline (`hub_env`, set by the Slurm batch step, entrypoints/slurm_job.py), and a
container binds it (cluster/container.py). Layout: `HF_HOME`, the snapshots under `hub/`.
"""

from __future__ import annotations

from pathlib import Path

HUB_CACHE_NAME = "hub-cache"
# The job's environment: the hub is never asked from a compute node.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def hub_cache_dir(recipe, run_dir: str | Path) -> Path:
    """The shared cache of a run: `cluster.hub_cache`, or `hub-cache` in the run directory's parent.
    `relax submit` creates it when the recipe names a hub id."""
    if recipe.cluster.hub_cache:
        return Path(recipe.cluster.hub_cache).expanduser().resolve()
    return Path(run_dir).expanduser().resolve().parent / HUB_CACHE_NAME


def hub_env(recipe, run_dir: str | Path) -> dict[str, str]:
    """The variables every process of a Slurm job gets: the hub offline, and `HF_HOME` / `HF_HUB_CACHE` in
    the shared cache (also inside a container, whose image may point `HF_HOME` at a folder of its own)."""
    cache = hub_cache_dir(recipe, run_dir)
    return {**OFFLINE_ENV, "HF_HOME": str(cache), "HF_HUB_CACHE": str(cache / "hub")}
