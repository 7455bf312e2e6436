"""`logging.backends`, `logging.wandb` and `logging.clearml` as a user writes them: what is refused, and how."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from relax_core.config.loader import load_recipe
from relax_core.errors import RecipeError
from relax_core.launch.preflight import unavailable_features

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


@pytest.mark.parametrize("backend", ["wandb", "clearml"])
def test_a_tracker_without_its_package_is_refused_naming_the_extra(monkeypatch, backend):
    recipe = load_recipe(QUICKSTART, [f"logging.backends=[{backend}]"])
    assert unavailable_features(recipe) == []  # installed here (dev extra)
    monkeypatch.setitem(sys.modules, backend, None)  # as if it were not
    (problem,) = unavailable_features(recipe)
    assert f"relax-rl[{backend}]" in problem and "logging.backends" in problem


@pytest.mark.parametrize(("overrides", "words"), [
    (["logging.wandb.project=p"], "does not list wandb"),  # a setting nothing would read
    (["logging.clearml.project=p"], "does not list clearml"),
    (["logging.backends=[wandb,wandb]"], "more than once"),
    (["logging.backends=[mlflow]"], "logging.backends"),
    (["logging.tensorboard=false"], "unknown key"),  # the old switch: logging.backends replaced it
])
def test_a_wrong_logging_section_is_a_recipe_error(overrides, words):
    with pytest.raises(RecipeError) as refused:
        load_recipe(QUICKSTART, overrides)
    assert words in str(refused.value)
