"""`logging.backends` and `logging.wandb` as a user writes them: what is refused, and how it is named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from relax_core.config.loader import load_recipe
from relax_core.errors import RecipeError
from relax_core.launch.preflight import unavailable_features

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


def test_clearml_is_refused_as_not_available_yet():
    (problem,) = unavailable_features(load_recipe(QUICKSTART, ["logging.backends=[clearml]"]))
    assert problem.startswith("logging.backends: clearml is not available in this version of Relax")


def test_wandb_without_its_package_is_refused_naming_the_extra(monkeypatch):
    recipe = load_recipe(QUICKSTART, ["logging.backends=[wandb]"])
    assert unavailable_features(recipe) == []  # installed here (dev extra)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not
    (problem,) = unavailable_features(recipe)
    assert "relax-rl[wandb]" in problem and "logging.backends" in problem


@pytest.mark.parametrize(("overrides", "words"), [
    (["logging.wandb.project=p"], "does not list wandb"),  # a setting nothing would read
    (["logging.backends=[wandb,wandb]"], "more than once"),
    (["logging.backends=[mlflow]"], "logging.backends"),
    (["logging.tensorboard=false"], "unknown key"),  # the old switch: logging.backends replaced it
])
def test_a_wrong_logging_section_is_a_recipe_error(overrides, words):
    with pytest.raises(RecipeError) as refused:
        load_recipe(QUICKSTART, overrides)
    assert words in str(refused.value)
