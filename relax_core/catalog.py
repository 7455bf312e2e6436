"""What a recipe can name: algorithms and rewards, with descriptions and parameters.

Read by `relax list`. Algorithms come from their specs
(relax_core/config/algorithm_specs.py: description, building blocks) and the config
class each spec names (parameters and defaults), so a registered algorithm is
listed exactly as a recipe accepts it; rewards from the reward registry.
Imports no torch.
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel

from relax_core.config import algorithm_specs as specs
from relax_core.config.algorithms import config_class


def algorithm_entries() -> list[dict[str, Any]]:
    """One entry per algorithm: name, description, what it is made of, parameters with defaults."""
    entries = []
    for name in specs.algorithm_names():
        spec = specs.get_spec(name)
        entries.append({"name": name, "description": spec.description,
                        "estimator": spec.advantage_estimator, "loss": spec.policy_loss,
                        "parameters": _defaults(config_class(spec), {"name": name})})
    return entries


def reward_entries(plugin_dirs: list[str] | tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One entry per reward the registry knows: built-ins and plug-ins (default folder and `plugin_dirs`)."""
    from relax_core.rewards.registry import get_spec, list_rewards

    entries = []
    for name in list_rewards(plugin_dirs):
        spec = get_spec(name, plugin_dirs)
        entries.append({"name": name, "description": _first_line(inspect.getdoc(spec.fn)), "source": str(spec.source)})
    return entries


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if doc and doc.strip() else ""


def _defaults(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """Dotted parameter -> default; `data` is what a default may depend on (the algorithm's name)."""
    params: dict[str, Any] = {}
    for key, info in model.model_fields.items():
        if key == "name":
            continue
        default = "required" if info.is_required() else info.get_default(call_default_factory=True,
                                                                         validated_data=data)
        params |= _flatten(key, default.model_dump() if isinstance(default, BaseModel) else default)
    return params


def _flatten(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {key: value}
    return {dotted: v for k, sub in value.items() for dotted, v in _flatten(f"{key}.{k}", sub).items()}
