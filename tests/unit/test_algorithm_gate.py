"""Preflight's algorithm gate: what `relax list algorithms` offers is what a run accepts, and nothing else."""

from __future__ import annotations

import pytest

from relax_core.config.algorithms import ALGORITHM_MODELS
from relax_core.config.loader import load_recipe
from relax_core.launch import preflight
from relax_core.launch.preflight import WIRED_ALGORITHMS, _feature_problems


def test_every_listed_algorithm_is_wired():
    assert WIRED_ALGORITHMS == set(ALGORITHM_MODELS)


def test_an_algorithm_not_wired_is_refused_with_its_name(monkeypatch):
    recipe = load_recipe("recipes/quickstart.yaml", ["algorithm.name=rloo"])
    assert _feature_problems(recipe) == []
    monkeypatch.setattr(preflight, "WIRED_ALGORITHMS", WIRED_ALGORITHMS - {"rloo"})
    problems = _feature_problems(recipe)
    assert len(problems) == 1 and problems[0].startswith("algorithm.name: rloo is not available")


@pytest.mark.parametrize("name", ["ppo", "opd"])
def test_algorithms_needing_a_model_name_it_when_it_is_missing(name):
    with pytest.raises(Exception, match="critic" if name == "ppo" else "teacher"):
        load_recipe("recipes/quickstart.yaml", [f"algorithm.name={name}"])
