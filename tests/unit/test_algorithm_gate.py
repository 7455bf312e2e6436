"""What `relax list algorithms` offers is what `relax submit` accepts, and a missing model is named."""

from __future__ import annotations

import pytest

from relax_core.config.algorithm_specs import algorithm_names
from relax_core.config.loader import load_recipe
from relax_core.errors import RecipeError
from relax_core.launch.executors import executor_named
from relax_core.launch.preflight import preflight

NEEDS = {"ppo": ["algorithm.critic.lr=1e-5"], "opd": ["algorithm.teacher.path=Org/teacher"]}


@pytest.mark.parametrize("name", algorithm_names())
def test_every_listed_algorithm_passes_the_submit_checks(name):
    recipe = load_recipe("recipes/quickstart.yaml", [f"algorithm.name={name}", *NEEDS.get(name, [])])
    preflight(recipe, "recipes/quickstart.yaml", executor_named("local"))  # raises RecipeError naming any problem


@pytest.mark.parametrize("name", ["ppo", "opd"])
def test_algorithms_needing_a_model_name_it_when_it_is_missing(name):
    with pytest.raises(RecipeError, match="algorithm.critic is missing" if name == "ppo" else "algorithm.teacher"):
        load_recipe("recipes/quickstart.yaml", [f"algorithm.name={name}"])
