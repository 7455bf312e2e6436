"""Checks of what a recipe refers to: the model and data paths, the reward plug-in folders, the judge model.

The schema checks a recipe's shape; these check that the things it names
exist, so that a typo fails on the login node with exit 2 instead of on the
cluster after the job has waited in the queue. Light imports only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from relax_core.config.data import FileData
from relax_core.config.model import HFModel
from relax_core.config.schema import Recipe

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def reference_problems(recipe: Recipe) -> list[str]:
    """Every path or name in the recipe that does not exist on this machine."""
    return _model_problems(recipe) + _data_problems(recipe) + _plugin_dir_problems(recipe) + _judge_problems(recipe)


def looks_like_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and not Path(value).exists()


def _model_problems(recipe: Recipe) -> list[str]:
    model = recipe.model
    if not isinstance(model, HFModel) or looks_like_hub_id(model.path):
        return []
    path = Path(model.path).expanduser()
    if not path.is_dir():
        return [f"model.path: '{model.path}' is neither a local model directory nor a hub id like Org/Name"]
    if not (path / "config.json").is_file():
        return [f"model.path: '{model.path}' has no config.json; point it at a Hugging Face model directory"]
    return []


def _data_problems(recipe: Recipe) -> list[str]:
    data = recipe.data
    if isinstance(data, FileData) and data.source == "file" and not Path(data.path).expanduser().exists():
        return [f"data.path: file '{data.path}' does not exist (use source: hub for a hub data set)"]
    return []


def _plugin_dir_problems(recipe: Recipe) -> list[str]:
    return [
        f"reward.plugin_dirs: folder '{folder}' does not exist"
        for folder in recipe.reward.plugin_dirs
        if not Path(folder).expanduser().is_dir()
    ]


def _judge_problems(recipe: Recipe) -> list[str]:
    """`reward.genrm.model`: a model directory (or hub id) that loads without running its own code, unless trusted."""
    genrm = recipe.reward.genrm
    if genrm is None or looks_like_hub_id(genrm.model):
        return []
    config = Path(genrm.model).expanduser() / "config.json"
    if not config.is_file():
        return [f"reward.genrm.model: '{genrm.model}' is neither a local model directory with a config.json "
                "nor a hub id like Org/Name"]
    if "auto_map" in json.loads(config.read_text()) and not genrm.trust_remote_code:
        return [f"reward.genrm.model: '{genrm.model}' ships its own code (auto_map in config.json); set "
                "reward.genrm.trust_remote_code=true if you trust it"]
    return []
