"""What the asynchronous modes decide before anything runs: off-policy correction, cores, refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relax_core.cluster.placement import local_cpu_sets
from relax_core.config.loader import load_recipe
from relax_core.errors import RecipeError
from relax_core.launch.executors import executor_named
from relax_core.launch.preflight import preflight

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


@pytest.mark.parametrize("mode, overrides, cap", [
    ("colocate", [], None),                         # on-policy: no correction unless asked for
    ("fully_async", [], 2.0),                       # docs/algorithms.md: C = 2 by default where samples lag
    ("hybrid", [], 2.0),
    ("fully_async", ["algorithm.tis_cap=0"], None),  # 0 turns it off
    ("colocate", ["algorithm.tis_cap=3.5"], 3.5),
])
def test_truncated_importance_sampling_is_on_by_default_in_the_async_modes(mode, overrides, cap):
    from relax_core.train.settings import trainer_config

    recipe = load_recipe(QUICKSTART, [f"mode={mode}", *overrides])
    assert trainer_config(recipe).tis_cap == cap


def test_each_node_group_gets_its_own_cores_on_one_machine():
    cores = sorted(os.sched_getaffinity(0))
    recipe = load_recipe(QUICKSTART)  # train 1 core, rollout 1 core
    if len(cores) >= 2:
        assert local_cpu_sets(recipe) == {"train": cores[:1], "rollout": cores[1:2]}
    too_many = load_recipe(QUICKSTART, [f"cluster.rollout.cpus_per_node={len(cores)}"])
    assert local_cpu_sets(too_many) == {}  # they would overlap: share all cores instead
    no_group = load_recipe(QUICKSTART, ["cluster.rollout.nodes=0"])
    assert local_cpu_sets(no_group) == {}


def test_async_mode_without_a_rollout_group_is_refused():
    with pytest.raises(RecipeError, match="cluster.rollout.nodes"):
        load_recipe(QUICKSTART, ["mode=fully_async", "cluster.rollout.nodes=0"])


def test_local_executor_refuses_more_than_one_node_per_group():
    recipe = load_recipe(QUICKSTART, ["mode=fully_async", "cluster.rollout.nodes=2"])
    with pytest.raises(RecipeError, match="cluster.rollout.nodes"):
        preflight(recipe, QUICKSTART, executor_named("local"))


def test_quickstart_runs_in_every_mode_by_override():
    for mode in ("colocate", "fully_async", "hybrid"):
        preflight(load_recipe(QUICKSTART, [f"mode={mode}"]), QUICKSTART, executor_named("local"))  # raises if refused


def test_router_is_used_from_two_engines_unless_set():
    assert not load_recipe(QUICKSTART).rollout.uses_router
    assert load_recipe(QUICKSTART, ["rollout.num_engines=2"]).rollout.uses_router
    assert not load_recipe(QUICKSTART, ["rollout.num_engines=2", "rollout.router=false"]).rollout.uses_router
