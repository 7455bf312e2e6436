"""Models and data sets from the hub, fetched on the login node (`relax submit`), read offline in the job.

Compute nodes of most clusters have no internet. `relax submit` therefore downloads every hub id the
recipe names into a shared cache (`cluster.hub_cache`, default `hub-cache` beside the run directory)
and the job runs with the hub offline, reading from there.

This module imports nothing heavy: the container code asks it for the cache path to bind.
"""

from __future__ import annotations

from pathlib import Path

HUB_CACHE_NAME = "hub-cache"


def hub_cache_dir(recipe, run_dir: str | Path) -> Path:
    """The shared cache of a run: `cluster.hub_cache`, or `hub-cache` in the run directory's parent."""
    if recipe.cluster.hub_cache:
        return Path(recipe.cluster.hub_cache).expanduser().resolve()
    return Path(run_dir).expanduser().resolve().parent / HUB_CACHE_NAME
